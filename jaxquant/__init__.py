"""jaxquant: ONNX-exact linear quantization for JAX."""

from jaxquant._checked import checked as checked
from jaxquant._dynamic import dynamic_quantize_linear as dynamic_quantize_linear
from jaxquant._elementwise import quantized_add as quantized_add
from jaxquant._fake import fake_quantize as fake_quantize
from jaxquant._fake import fake_quantize_dynamic as fake_quantize_dynamic
from jaxquant._fake import fake_quantize_learnable as fake_quantize_learnable
from jaxquant._fake import lsq_grad_factor as lsq_grad_factor
from jaxquant._linear import dequantize_linear as dequantize_linear
from jaxquant._linear import quantize_linear as quantize_linear
from jaxquant._packing import pack as pack
from jaxquant._packing import pack_int4 as pack_int4
from jaxquant._packing import unpack as unpack
from jaxquant._packing import unpack_int4 as unpack_int4
from jaxquant._params import FakeQuantizedArray as FakeQuantizedArray
from jaxquant._params import QuantizationRule as QuantizationRule
from jaxquant._params import QuantizedArray as QuantizedArray
from jaxquant._params import dequantize_params as dequantize_params
from jaxquant._params import quantize_params as quantize_params
from jaxquant._recipes import choose_qparams as choose_qparams

__version__ = "0.1.0"

__all__ = (
    "checked",
    "FakeQuantizedArray",
    "QuantizationRule",
    "QuantizedArray",
    "choose_qparams",
    "dequantize_linear",
    "dequantize_params",
    "dynamic_quantize_linear",
    "fake_quantize",
    "fake_quantize_dynamic",
    "fake_quantize_learnable",
    "lsq_grad_factor",
    "pack",
    "pack_int4",
    "quantize_linear",
    "quantize_params",
    "quantized_add",
    "unpack",
    "unpack_int4",
)
