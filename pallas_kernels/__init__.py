"""Fused Pallas kernels behind ``implementation="pallas"``.

Each kernel takes plain arrays, static options and the element-wise formula
from its caller. The formula is jaxquant's own (``_numerics.dequantize_formula``,
``quantize_formula``), so the ONNX rules are written once, and jaxquant's XLA
evaluation of the same formula is the kernels' reference (the kernel tests
compare against it bit for bit); kernels never import ``jaxquant``, so the
two packages cannot import each other in a circle.

On TPU the kernels compile with Mosaic, on CUDA and ROCm with Triton, and
elsewhere (CPU) they run in Pallas interpret mode; the choice is made when the
call is lowered, so one jitted function serves every platform.
"""

from pallas_kernels.dequantize import dequantize as dequantize
from pallas_kernels.dynamic_quantize import dynamic_quantize as dynamic_quantize
from pallas_kernels.matmul import dequantize_matmul as dequantize_matmul
from pallas_kernels.quantize import quantize as quantize
from pallas_kernels.quantized_add import quantized_add as quantized_add

__all__ = [
    "dequantize",
    "dequantize_matmul",
    "dynamic_quantize",
    "quantize",
    "quantized_add",
]
