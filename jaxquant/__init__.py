"""jaxquant: ONNX-exact linear quantization for JAX."""

from jaxquant._dynamic import dynamic_quantize_linear as dynamic_quantize_linear
from jaxquant._elementwise import quantized_add as quantized_add
from jaxquant._linear import dequantize_linear as dequantize_linear
from jaxquant._linear import quantize_linear as quantize_linear
from jaxquant._packing import pack_int4 as pack_int4
from jaxquant._packing import unpack_int4 as unpack_int4

__version__ = "0.1.0"

__all__ = (
    "dequantize_linear",
    "dynamic_quantize_linear",
    "pack_int4",
    "quantize_linear",
    "quantized_add",
    "unpack_int4",
)
