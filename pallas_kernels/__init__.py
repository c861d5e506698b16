"""Fused Pallas kernels behind ``implementation="pallas"``.

Each kernel takes plain arrays, static options and the element-wise formula
from its caller, and sits beside a pure-XLA reference with the same
signature. The formula is jaxquant's own (``dequantize_formula``,
``quantize_formula``), so the ONNX rules are written once; kernels never
import ``jaxquant``, so the two packages cannot import each other in a circle.

On TPU the kernels compile with Mosaic, on CUDA and ROCm with Triton, and
elsewhere (CPU) they run in Pallas interpret mode; the choice is made when the
call is lowered, so one jitted function serves every platform.
"""

from pallas_kernels.dequantize import dequantize as dequantize
from pallas_kernels.dequantize import dequantize_reference as dequantize_reference
from pallas_kernels.dynamic_quantize import dynamic_quantize as dynamic_quantize
from pallas_kernels.dynamic_quantize import (
    dynamic_quantize_reference as dynamic_quantize_reference,
)
from pallas_kernels.matmul import dequantize_matmul as dequantize_matmul
from pallas_kernels.matmul import (
    dequantize_matmul_reference as dequantize_matmul_reference,
)
from pallas_kernels.quantize import quantize as quantize
from pallas_kernels.quantize import quantize_reference as quantize_reference
from pallas_kernels.quantized_add import quantized_add as quantized_add
from pallas_kernels.quantized_add import (
    quantized_add_reference as quantized_add_reference,
)

__all__ = [
    "dequantize",
    "dequantize_matmul",
    "dequantize_matmul_reference",
    "dequantize_reference",
    "dynamic_quantize",
    "dynamic_quantize_reference",
    "quantize",
    "quantize_reference",
    "quantized_add",
    "quantized_add_reference",
]
