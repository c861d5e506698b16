"""The int8 convolution drop-ins against onnxruntime's ConvInteger: an oracle no one here wrote.

``conv_general_dilated_dynamic_int8`` and ``conv_general_dilated_static_int8``
quantize their operands to int8, convolve the integers into int32 (``acc``)
and scale back as ``float32(acc) * (s_lhs * s_rhs)``. Here the int8 codes and
scales come from public ops (:func:`jaxquant.dynamic_quantize_linear`,
symmetric, per example and per output feature; :func:`jaxquant.quantize_linear`
with the static scale and zero point; :func:`jaxquant.quantize_params` for a
stored kernel), onnxruntime's ConvInteger (opset 10: ``conv(x - x_zero_point,
w - w_zero_point)`` in int32, NCHW and OIHW) computes ``acc`` from them, and
NumPy the documented epilogue: the drop-in's result must be its bits.

onnxruntime 1.32.0's CPU ConvInteger takes int8 or uint8 for each of x and w
(all four pairs; each case runs the int8 codes and the same codes shifted to
uint8, zero point + 128, and both must agree) with a per-tensor
``w_zero_point`` only (per output channel: "Non per-tensor quantization is not
supported now"). It refuses ``auto_pad`` SAME_UPPER or SAME_LOWER with a
dilation ("Dilation not supported"): such a case passes lax's padding as
explicit pads. It refuses an empty output ("Invalid input shape"; lax gives
one) and negative pads (as ONNX does), and has no lhs dilation or batch
groups: no case here draws them (tests/test_fuzz.py holds the drop-ins to an
int64 convolution there).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from onnx_oracle import run_onnxruntime
from quant_testing import assert_bits_equal
from quant_testing import BF16
from quant_testing import conv_epilogue
from quant_testing import F32
from quant_testing import integer_conv


@dataclasses.dataclass(frozen=True)
class Case:
  """One convolution: shapes in the lax layouts named, the rest of lax's arguments."""
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  dimension_numbers: tuple[str, str, str]
  window_strides: tuple[int, ...]
  padding: Any
  rhs_dilation: tuple[int, ...] | None = None
  feature_group_count: int = 1
  dtype: np.dtype = F32
  # The static drop-in's int8 zero point (None: symmetric).
  zero_point: int | None = None

  @property
  def options(self) -> dict[str, Any]:
    return dict(window_strides=self.window_strides, padding=self.padding,
                rhs_dilation=self.rhs_dilation, dimension_numbers=self.dimension_numbers,
                feature_group_count=self.feature_group_count)

  @property
  def numbers(self) -> lax.ConvDimensionNumbers:
    return lax.conv_dimension_numbers(self.lhs_shape, self.rhs_shape, self.dimension_numbers)


CASES = {
    "1d-ncw-asymmetric-pads": Case((2, 3, 9), (4, 3, 3), ("NCW", "OIW", "NCW"), (2,), [(2, 1)],
                                   zero_point=-128),
    "1d-nwc-dilated-same": Case((2, 10, 4), (3, 4, 5), ("NWC", "WIO", "NWC"), (1,), "SAME",
                                rhs_dilation=(2,), zero_point=127),
    "2d-nhwc-strided-asymmetric": Case((2, 7, 6, 4), (3, 2, 4, 6), ("NHWC", "HWIO", "NHWC"),
                                       (2, 1), [(0, 2), (1, 0)], rhs_dilation=(1, 2),
                                       zero_point=5),
    "2d-nchw-same-lower": Case((1, 4, 6, 5), (5, 4, 3, 3), ("NCHW", "OIHW", "NCHW"), (2, 2),
                               "SAME_LOWER"),
    "2d-nhwc-groups-same": Case((3, 5, 5, 6), (2, 2, 2, 9), ("NHWC", "HWIO", "NCHW"), (2, 3),
                                "SAME", feature_group_count=3, zero_point=-3),
    "2d-depthwise-dilated-valid": Case((2, 4, 6, 5), (8, 1, 3, 3), ("NCHW", "OIHW", "NHWC"),
                                       (1, 1), "VALID", rhs_dilation=(2, 1),
                                       feature_group_count=4, zero_point=-60),
    "2d-nhwc-bfloat16": Case((2, 6, 5, 3), (3, 3, 3, 4), ("NHWC", "HWIO", "NHWC"), (1, 2),
                             [(1, 1), (2, 0)], dtype=BF16, zero_point=17),
}


def _onnx_attributes(case: Case, spatial_shape) -> dict[str, Any]:
  """ConvInteger's attributes for lax's arguments (spatial dims in lax's order)."""
  rank = len(case.window_strides)
  dilations = tuple(case.rhs_dilation or (1,) * rank)
  attributes = dict(strides=tuple(case.window_strides), dilations=dilations,
                    group=case.feature_group_count)
  padding = case.padding
  if isinstance(padding, str):
    if padding == "VALID" or set(dilations) == {1}:
      return dict(attributes, auto_pad={"SAME": "SAME_UPPER"}.get(padding, padding))
    # onnxruntime takes no SAME_* with a dilation: lax's own pads for the dilated kernel.
    kernel = np.asarray(case.rhs_shape)[list(case.numbers.rhs_spec[2:])]
    dilated = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    padding = lax.padtype_to_pads(spatial_shape, dilated, case.window_strides, padding)
  pads = tuple(low for low, _ in padding) + tuple(high for _, high in padding)
  return dict(attributes, pads=pads)


def _conv_integer(case: Case, x_codes, w_codes, x_zero_point=None) -> np.ndarray:
  """onnxruntime's int32 ConvInteger of int8 codes in the case's lax layouts, transposed to
  lax's output layout; the same with x shifted to uint8 (zero point + 128) must agree."""
  numbers = case.numbers
  x = np.transpose(np.asarray(x_codes), numbers.lhs_spec)  # (N, C, *spatial)
  w = np.transpose(np.asarray(w_codes), numbers.rhs_spec)  # (M, C / group, *kernel)
  attributes = _onnx_attributes(case, x.shape[2:])
  zero_point = np.asarray(0 if x_zero_point is None else x_zero_point, np.int8)
  acc = run_onnxruntime("ConvInteger", {"x": x, "w": w, "x_zero_point": zero_point}, np.int32,
                        **attributes)
  shifted = {"x": (x.astype(np.int16) + 128).astype(np.uint8), "w": w,
             "x_zero_point": np.asarray(zero_point.astype(np.int16) + 128, np.uint8)}
  np.testing.assert_array_equal(
      run_onnxruntime("ConvInteger", shifted, np.int32, **attributes), acc,
      err_msg="ConvInteger of the uint8-shifted codes")
  return np.transpose(acc, np.argsort(numbers.out_spec))


def _epilogue(case: Case, acc, lhs_scale, rhs_scale) -> np.ndarray:
  """The documented epilogue of ``acc`` in the case's result dtype."""
  return conv_epilogue(acc, lhs_scale, rhs_scale, case.numbers.out_spec, case.dtype)


def _operands(case: Case, seed: int):
  """Normal lhs and kernel, the largest magnitude of each example and output feature
  alternately negative and positive, so both -127 and 127 codes occur."""
  rng = np.random.default_rng(seed)
  numbers = case.numbers

  def signed(x, dim):
    x = np.moveaxis(x, dim, 0).copy()
    for i, row in enumerate(x):
      flat = row.reshape(-1)
      at = np.argmax(np.abs(flat))
      flat[at] = (-1) ** i * abs(flat[at])
      x[i] = flat.reshape(row.shape)
    return np.moveaxis(x, 0, dim)

  lhs = signed(rng.standard_normal(case.lhs_shape), numbers.lhs_spec[0])
  rhs = signed(rng.normal(0, 0.1, case.rhs_shape), numbers.rhs_spec[0])
  return lhs.astype(case.dtype), rhs.astype(case.dtype)


def _symmetric_codes(x, axis):
  """The drop-ins' symmetric int8 codes and scales, ``max|x| / 127`` per index of ``axis``,
  through the public op (the same formula, ``quantize_linear`` of the float32 quotient)."""
  codes, scale, _ = jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=axis, symmetric=True)
  return np.asarray(codes), np.asarray(scale)


@pytest.mark.parametrize("name", CASES)
def test_dynamic_int8_is_conv_integer_then_the_epilogue(name):
  case = CASES[name]
  lhs, rhs = _operands(case, seed=len(name))
  numbers = case.numbers
  x_codes, x_scale = _symmetric_codes(lhs, numbers.lhs_spec[0])
  w_codes, w_scale = _symmetric_codes(rhs, numbers.rhs_spec[0])
  assert {-127, 127} <= set(np.unique(w_codes)) and 127 in np.abs(x_codes)
  expected = _epilogue(case, _conv_integer(case, x_codes, w_codes), x_scale, w_scale)
  y = jax.jit(functools.partial(jq.conv_general_dilated_dynamic_int8, **case.options))(lhs, rhs)
  assert_bits_equal(y, expected, f"{name}: against ConvInteger")


@pytest.mark.parametrize("name", CASES)
def test_static_int8_is_conv_integer_then_the_epilogue(name):
  """The activations' codes saturate at both ends (-128 and 127, x - z_in up to 255 in
  magnitude); ConvInteger subtracts the zero point, padding with it (so padding is 0.0)."""
  case = CASES[name]
  lhs, rhs = _operands(case, seed=len(name) + 1)
  numbers = case.numbers
  zero_point = None if case.zero_point is None else np.int8(case.zero_point)
  z = 0 if zero_point is None else int(zero_point)
  x = lhs.astype(np.float32)
  # Small enough that the largest and the most negative values saturate.
  limits = [x.max() / (127 - z) if z < 127 else np.inf,
            -x.min() / (128 + z) if z > -128 else np.inf]
  input_scale = np.float32(0.9 * min(limits))
  x_codes = np.asarray(jq.quantize_linear(lhs, input_scale, zero_point, axis=None,
                                          output_dtype=jnp.int8))
  assert {-128, 127} <= set(np.unique(x_codes))
  w_codes, w_scale = _symmetric_codes(rhs, numbers.rhs_spec[0])
  acc = _conv_integer(case, x_codes, w_codes, zero_point)
  expected = _epilogue(case, acc, input_scale, w_scale)
  op = functools.partial(jq.conv_general_dilated_static_int8, **case.options)
  y = jax.jit(op)(lhs, rhs, input_scale=input_scale, input_zero_point=zero_point)
  assert_bits_equal(y, expected, f"{name}: against ConvInteger")


@pytest.mark.parametrize("name", ["1d-ncw-asymmetric-pads", "2d-nhwc-groups-same"])
@pytest.mark.parametrize("axis", ["per-tensor", "per-output-feature"])
def test_stored_int8_kernels_are_conv_integer_then_the_epilogue(name, axis):
  """A kernel stored by quantize_params (int8, absmax: no zero point), per tensor or per
  output feature, in both drop-ins: its codes and scale as they are."""
  case = CASES[name]
  lhs, rhs = _operands(case, seed=len(name) + 2)
  numbers = case.numbers
  rule = jq.QuantizationRule(dtype=jnp.int8,
                             axis=None if axis == "per-tensor" else numbers.rhs_spec[0])
  stored = jq.quantize_params(rhs, rule)
  w_codes, w_scale = np.asarray(stored.values), np.asarray(stored.scale)
  x_codes, x_scale = _symmetric_codes(lhs, numbers.lhs_spec[0])
  expected = _epilogue(case, _conv_integer(case, x_codes, w_codes), x_scale, w_scale)
  dynamic = functools.partial(jq.conv_general_dilated_dynamic_int8, **case.options)
  assert_bits_equal(jax.jit(dynamic)(lhs, stored), expected,
                    f"{name}: dynamic, against ConvInteger")
  static = functools.partial(jq.conv_general_dilated_static_int8, **case.options,
                             input_scale=np.float32(0.01), input_zero_point=np.int8(9))
  x_codes = jq.quantize_linear(lhs, np.float32(0.01), np.int8(9), axis=None)
  expected = _epilogue(case, _conv_integer(case, x_codes, w_codes, np.int8(9)),
                       np.float32(0.01), w_scale)
  assert_bits_equal(jax.jit(static)(lhs, stored), expected,
                    f"{name}: static, against ConvInteger")


def test_conv_integer_takes_all_four_8_bit_pairs():
  """onnxruntime 1.32.0 registers ConvInteger for int8 and uint8 x and w alike (ONNX's T1 and
  T2): each pair with its zero points is the int64 convolution of the differences."""
  rng = np.random.default_rng(3)
  for x_dtype, w_dtype in [(np.uint8, np.uint8), (np.uint8, np.int8), (np.int8, np.uint8),
                           (np.int8, np.int8)]:
    x_info, w_info = np.iinfo(x_dtype), np.iinfo(w_dtype)
    x = rng.integers(x_info.min, x_info.max + 1, (2, 4, 5, 6)).astype(x_dtype)
    w = rng.integers(w_info.min, w_info.max + 1, (6, 2, 3, 2)).astype(w_dtype)
    x_zero_point, w_zero_point = x_dtype(x_info.max), w_dtype(w_info.min)
    inputs = {"x": x, "w": w, "x_zero_point": np.asarray(x_zero_point),
              "w_zero_point": np.asarray(w_zero_point)}
    attributes = dict(strides=(1, 2), pads=(1, 0, 0, 2), dilations=(1, 2), group=2)
    got = run_onnxruntime("ConvInteger", inputs, np.int32, **attributes)
    want = integer_conv(
        x.astype(np.int64) - int(x_zero_point), w.astype(np.int64) - int(w_zero_point),
        (1, 2), [(1, 0), (0, 2)], rhs_dilation=(1, 2), feature_group_count=2)
    np.testing.assert_array_equal(got, want, err_msg=f"{x_dtype} x {w_dtype}")
