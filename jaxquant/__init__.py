"""jaxquant: ONNX-exact linear quantization for JAX."""

from jaxquant._calibration import Observer as Observer
from jaxquant._calibration import calibrate as calibrate
from jaxquant._calibration import init_observer as init_observer
from jaxquant._calibration import observe as observe
from jaxquant._calibration import observer_qparams as observer_qparams
from jaxquant._checked import checked as checked
from jaxquant._dot_general import conv_general_dilated_dynamic_int8 as conv_general_dilated_dynamic_int8
from jaxquant._dot_general import conv_general_dilated_fake_quant as conv_general_dilated_fake_quant
from jaxquant._dot_general import conv_general_dilated_static_int8 as conv_general_dilated_static_int8
from jaxquant._dot_general import conv_general_dilated_weight_only as conv_general_dilated_weight_only
from jaxquant._dot_general import dot_general_dynamic_int8 as dot_general_dynamic_int8
from jaxquant._dot_general import dot_general_fake_quant as dot_general_fake_quant
from jaxquant._dot_general import dot_general_static_int8 as dot_general_static_int8
from jaxquant._dot_general import dot_general_weight_only as dot_general_weight_only
from jaxquant._dot_general import replace_ops as replace_ops
from jaxquant._dynamic import dynamic_quantize_linear as dynamic_quantize_linear
from jaxquant._elementwise import quantized_add as quantized_add
from jaxquant._fake import fake_quantize as fake_quantize
from jaxquant._fake import fake_quantize_dynamic as fake_quantize_dynamic
from jaxquant._fake import fake_quantize_learnable as fake_quantize_learnable
from jaxquant._fake import lsq_grad_factor as lsq_grad_factor
from jaxquant._linear import dequantize_linear as dequantize_linear
from jaxquant._linear import quantize_linear as quantize_linear
from jaxquant._matmul import matmul_integer as matmul_integer
from jaxquant._matmul import matmul_nbits as matmul_nbits
from jaxquant._matmul import qlinear_matmul as qlinear_matmul
from jaxquant._matmul import quantized_dot_general as quantized_dot_general
from jaxquant._onnx_export import export_onnx as export_onnx
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
from jaxquant._runtime import tune_cpu as tune_cpu

__version__ = "0.1.0"

__all__ = (
    "FakeQuantizedArray",
    "Observer",
    "QuantizationRule",
    "QuantizedArray",
    "calibrate",
    "checked",
    "choose_qparams",
    "conv_general_dilated_dynamic_int8",
    "conv_general_dilated_fake_quant",
    "conv_general_dilated_static_int8",
    "conv_general_dilated_weight_only",
    "dequantize_linear",
    "dequantize_params",
    "dot_general_dynamic_int8",
    "dot_general_fake_quant",
    "dot_general_static_int8",
    "dot_general_weight_only",
    "dynamic_quantize_linear",
    "export_onnx",
    "fake_quantize",
    "fake_quantize_dynamic",
    "fake_quantize_learnable",
    "init_observer",
    "lsq_grad_factor",
    "matmul_integer",
    "matmul_nbits",
    "observe",
    "observer_qparams",
    "pack",
    "pack_int4",
    "qlinear_matmul",
    "quantize_linear",
    "quantize_params",
    "quantized_add",
    "quantized_dot_general",
    "replace_ops",
    "tune_cpu",
    "unpack",
    "unpack_int4",
)
