"""The dot_general / conv_general_dilated drop-ins, replace_ops, and the ONNX export."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _dot_general
from quant_testing import assert_bits_equal
from quant_testing import assert_same_under_x64
from quant_testing import assert_tree_bits_equal
from quant_testing import assert_vmap_is_a_loop
from quant_testing import integer_conv
from quant_testing import model_calls
from quant_testing import spec_symmetric_scale

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

X = np.asarray(jax.random.normal(jax.random.key(0), (5, 70)), np.float32)
W = np.asarray(jax.random.normal(jax.random.key(1), (70, 8)), np.float32)
DENSE = (((1,), (0,)), ((), ()))


def _symmetric(x, reduced, dtype=jnp.int8):
  """NumPy's values and scale: one scale per index of the dims not reduced."""
  scale = spec_symmetric_scale(x, tuple(reduced), dtype)
  return np.asarray(jq.quantize_linear(x, scale, axis=None, output_dtype=dtype)), scale


# dot_general layouts: (lhs shape, rhs shape, dimension numbers).
LAYOUTS = [
    ((5, 70), (70, 8), DENSE),
    ((2, 3, 16), (16, 4, 5), (((2,), (0,)), ((), ()))),             # Einsum "btd,dhk"
    ((2, 16, 3), (2, 4, 16), (((1,), (2,)), ((0,), (0,)))),         # batch dim, contracting first
]


@pytest.mark.slow
@pytest.mark.parametrize("lhs_shape, rhs_shape, numbers", LAYOUTS)
def test_dynamic_int8_is_int32_accumulation_then_scales(lhs_shape, rhs_shape, numbers):
  lhs = np.asarray(jax.random.normal(jax.random.key(2), lhs_shape), np.float32)
  rhs = np.asarray(jax.random.normal(jax.random.key(3), rhs_shape), np.float32)
  (lhs_contracting, rhs_contracting), _ = numbers
  lhs_q, lhs_scale = _symmetric(lhs, lhs_contracting)
  rhs_q, rhs_scale = _symmetric(rhs, rhs_contracting)
  expected = jq.quantized_dot_general(lhs_q, rhs_q, numbers, lhs_scale=lhs_scale,
                                      rhs_scale=rhs_scale)
  y = jq.dot_general_dynamic_int8(lhs, rhs, numbers)
  np.testing.assert_array_equal(y, expected)
  np.testing.assert_array_equal(jax.jit(jq.dot_general_dynamic_int8, static_argnums=2)(
      lhs, rhs, numbers), expected)
  exact = lax.dot_general(lhs, rhs, numbers)
  assert np.abs(y - exact).max() <= 0.03 * np.abs(exact).max()


def test_dynamic_int8_takes_stored_int8_weights():
  stored = jq.quantize_params(W, jq.QuantizationRule())
  np.testing.assert_array_equal(jq.dot_general_dynamic_int8(X, stored, DENSE),
                                jq.dot_general_dynamic_int8(X, W, DENSE))
  for wrong in (jq.QuantizationRule(dtype=jnp.int4), jq.QuantizationRule(axis=0),
                jq.QuantizationRule(method="minmax")):
    with pytest.raises(TypeError, match="rhs"):
      jq.dot_general_dynamic_int8(X, jq.quantize_params(W, wrong), DENSE)


INT8_DROP_INS = {
    "dynamic": jq.dot_general_dynamic_int8,
    "static": functools.partial(jq.dot_general_static_int8, input_scale=0.02,
                                input_zero_point=-3),
}


# (lhs shape, rhs shape, dimension numbers): LAYOUTS, and experts' weights (a batch dim).
TRANSPOSED_LAYOUTS = [*LAYOUTS, ((3, 2, 16), (3, 16, 4), (((2,), (1,)), ((0,), (0,))))]
# Each drop-in on each layout, and each layout with its weight scaled per feature and per
# tensor, the other drop-in taking the other scale: every pair, not the product (both
# drop-ins read a stored weight by _dot_general._rhs_for_dot, and the dynamic one compiles slowly).
TRANSPOSED_CASES = [
    pytest.param(drop_in, *layout, per_tensor,
                 id=f"{drop_in}-layout{i}-{'per-tensor' if per_tensor else 'per-feature'}")
    for i, layout in enumerate(TRANSPOSED_LAYOUTS)
    for drop_in, per_tensor in (("dynamic", i == 0), ("static", i != 0))
]


@pytest.mark.parametrize("drop_in, lhs_shape, rhs_shape, numbers, per_tensor", TRANSPOSED_CASES)
def test_int8_drop_ins_give_a_weight_stored_transposed_the_same_bits(
    drop_in, lhs_shape, rhs_shape, numbers, per_tensor):
  """Eager, under jit, closed over, under vmap and grad: the bits of the weight stored as it
  is, whether the swapped dims are contracted, batched or (an einsum kernel's) both free."""
  op = INT8_DROP_INS[drop_in]
  lhs = np.asarray(jax.random.normal(jax.random.key(5), lhs_shape), np.float32)
  rhs = np.asarray(jax.random.normal(jax.random.key(6), rhs_shape), np.float32)
  (_, rhs_contracting), (_, rhs_batch) = numbers
  free = [d for d in range(len(rhs_shape)) if d not in (*rhs_contracting, *rhs_batch)]
  rule = jq.QuantizationRule(axis=None if per_tensor else max(free))
  stored = jq.quantize_params(rhs, rule)
  transposed = jq.quantize_params(rhs, dataclasses.replace(rule, transposed=True))

  def product(x, w):
    return op(x, w, numbers)

  def loss(x, w):
    return jnp.sum(jnp.sin(product(x, w)))

  want = product(lhs, stored)
  assert_bits_equal(product(lhs, transposed), want)
  assert_bits_equal(jax.jit(product)(lhs, transposed), want)
  assert_bits_equal(jax.jit(lambda x: product(x, transposed))(lhs), want)
  rows = jax.vmap(product, in_axes=(0, None))
  assert_bits_equal(rows(lhs[None], transposed), rows(lhs[None], stored))
  assert_bits_equal(jax.grad(loss)(lhs, transposed), jax.grad(loss)(lhs, stored))
  # The scale's gradient sums over the weight in the order it is stored: for one scale
  # of the whole weight, a float sum of terms of both signs in another order.
  scale_gradient = jax.grad(lambda scale, w: loss(lhs, dataclasses.replace(w, scale=scale)))
  np.testing.assert_allclose(scale_gradient(transposed.scale, transposed),
                             scale_gradient(stored.scale, stored), rtol=1e-5)


@pytest.mark.xla_cpu
def test_a_weight_stored_transposed_is_read_as_stored_by_one_int8_dot():
  """K = 4096: a (K, N) weight is contracted in slices (a batch dim of 2048-deep views),
  the weight stored (N, K) by one dot that contracts its minor dim, the values not copied."""
  w = np.asarray(jax.random.normal(jax.random.key(4), (4096, 8)), np.float32)
  transposed = jq.quantize_params(w, jq.QuantizationRule(transposed=True))
  hlo = jax.jit(lambda x, w: jq.dot_general_dynamic_int8(x, w, DENSE)).lower(
      np.ones((3, 4096), np.float32), transposed).compile().as_text()
  dots = [line for line in hlo.splitlines() if " dot(" in line]
  assert len(dots) == 1 and "batch_dims" not in dots[0], dots
  assert "rhs_contracting_dims={1}" in dots[0], dots
  weight_sized = {shape for shape in re.findall(r"s8\[([\d,]+)\]", hlo)
                  if math.prod(int(d) for d in shape.split(",")) == w.size}
  assert weight_sized == {"8,4096"}, weight_sized


def test_dynamic_int8_dtypes_and_zero_rows():
  x = X.copy()
  x[1] = 0
  y = jq.dot_general_dynamic_int8(x, W, DENSE)
  np.testing.assert_array_equal(y[1], 0)
  assert jq.dot_general_dynamic_int8(X.astype(jnp.bfloat16), W.astype(jnp.bfloat16),
                                     DENSE).dtype == jnp.bfloat16
  assert jq.dot_general_dynamic_int8(X, W, DENSE,
                                     preferred_element_type=jnp.float16).dtype == jnp.float16
  with pytest.raises(TypeError, match="dtype"):
    jq.dot_general_dynamic_int8(X.astype(np.int32), W, DENSE)


@pytest.mark.parametrize("lhs_dtype, rhs_dtype", [
    (jnp.int4, jnp.int8), (jnp.int4, jnp.int4), (jnp.int8, jnp.int4), (jnp.int2, jnp.int8)])
def test_dynamic_narrow_activations_and_weights_accumulate_exactly(lhs_dtype, rhs_dtype):
  x_q, x_scale = _symmetric(X, (1,), lhs_dtype)
  w_q, w_scale = _symmetric(W, (0,), rhs_dtype)
  accumulator = np.asarray(x_q, np.int64) @ np.asarray(w_q, np.int64)
  expected = accumulator.astype(np.float32) * (x_scale * w_scale)
  y = jq.dot_general_dynamic_int8(X, W, DENSE, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype)
  np.testing.assert_array_equal(y, expected)
  assert np.abs(x_q).max() == jnp.iinfo(lhs_dtype).max   # the row maxima land on q_max
  stored = jq.quantize_params(W, jq.QuantizationRule(dtype=rhs_dtype))  # packed for int4
  np.testing.assert_array_equal(
      jq.dot_general_dynamic_int8(X, stored, DENSE, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype),
      expected)


@pytest.mark.parametrize("dtype", [jnp.uint4, jnp.int16, jnp.float8_e4m3fn])
def test_dynamic_dtypes_must_be_narrow_signed_integers(dtype):
  with pytest.raises(TypeError, match="lhs_dtype"):
    jq.dot_general_dynamic_int8(X, W, DENSE, lhs_dtype=dtype)


@pytest.mark.parametrize("zero_point", [None, -7])
def test_static_int8(zero_point):
  scale = np.float32(0.02)
  q = jq.quantize_linear(X, scale, None if zero_point is None else np.int8(zero_point),
                         axis=None, output_dtype=jnp.int8)
  w_q, w_scale = _symmetric(W, (0,))
  expected = jq.quantized_dot_general(
      q, w_q, DENSE, lhs_scale=scale,
      lhs_zero_point=None if zero_point is None else np.int8(zero_point), rhs_scale=w_scale)
  y = jq.dot_general_static_int8(X, W, DENSE, input_scale=scale, input_zero_point=zero_point)
  np.testing.assert_array_equal(y, expected)


def test_static_int8_errors():
  with pytest.raises(ValueError, match="input_scale.shape"):
    jq.dot_general_static_int8(X, W, DENSE, input_scale=jnp.ones(2))
  with pytest.raises(TypeError, match="input_zero_point.dtype"):
    jq.dot_general_static_int8(X, W, DENSE, input_scale=1.0, input_zero_point=jnp.int16(1))
  with pytest.raises(TypeError, match="input_zero_point.dtype must be int8"):
    jq.dot_general_static_int8(X, W, DENSE, input_scale=1.0, input_zero_point=jnp.uint8(1))
  # Before: wrapped (200 as -56) or truncated (3.7 as 3) into int8 silently.
  with pytest.raises(ValueError, match=r"input_zero_point must be in \[-128, 127\]"):
    jq.dot_general_static_int8(X, W, DENSE, input_scale=1.0, input_zero_point=200)
  with pytest.raises(TypeError, match="input_zero_point must be an integer"):
    jq.dot_general_static_int8(X, W, DENSE, input_scale=1.0, input_zero_point=3.7)
  with pytest.raises(ValueError, match="input_zero_point.shape"):
    jq.dot_general_static_int8(X, W, DENSE, input_scale=1.0,
                               input_zero_point=np.ones(2, np.int8))


def test_fake_quant_value_and_straight_through_gradient():
  lhs_q, lhs_scale = _symmetric(X, (1,))
  expected = lax.dot_general(
      np.asarray(jq.dequantize_linear(lhs_q, lhs_scale, axis=None)), W, DENSE)
  np.testing.assert_array_equal(jq.dot_general_fake_quant(X, W, DENSE), expected)
  g_x, g_w = jax.grad(lambda x, w: jnp.sum(jq.dot_general_fake_quant(x, w, DENSE)),
                      argnums=(0, 1))(X, W)
  # Straight through: d/dx of sum(x @ W) is W's row sums (summed in XLA's order).
  np.testing.assert_allclose(g_x, np.broadcast_to(W.sum(axis=1), X.shape), rtol=1e-5)
  np.testing.assert_allclose(g_w, np.broadcast_to(
      np.asarray(jq.dequantize_linear(lhs_q, lhs_scale, axis=None)).sum(0)[:, None], W.shape),
      rtol=1e-6)


@pytest.mark.parametrize("layer", ["dot", "conv"])
def test_fake_quant_takes_a_learnable_weight(layer):
  """A FakeQuantizedArray rhs is its dequantize(): the same value, and jax.grad reaches the
  float weight and the learned scale (LSQ) through it."""
  call, x, w = {
      "dot": (lambda x, w: jq.dot_general_fake_quant(x, w, DENSE), X, W),
      "conv": (lambda x, w: jq.conv_general_dilated_fake_quant(x, w, **CONV), CONV_X, CONV_W),
  }[layer]
  call = jax.jit(call)  # eagerly, every primitive of the op compiles on its own
  trained = jq.quantize_params(w, jq.QuantizationRule(dtype=jnp.int4), learnable=True)
  np.testing.assert_array_equal(call(x, trained), call(x, trained.dequantize()))
  loss = lambda w: jnp.sum(call(x, w) ** 2)
  assert_tree_bits_equal(jax.grad(loss)(trained),
                         jax.grad(lambda w: loss(w.dequantize()))(trained), "gradient")


@pytest.mark.parametrize("rule, options", [
    (jq.QuantizationRule(), {}),
    (jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=32, method="mse"),
     dict(dtype=jnp.int4, block_size=32, method="mse")),                  # ragged: 70 = 2 * 32 + 6
    (jq.QuantizationRule(dtype=jnp.float8_e4m3fn), dict(dtype=jnp.float8_e4m3fn)),
])
def test_weight_only_is_the_dequantized_weight_s_dot(rule, options):
  expected = lax.dot_general(X, jq.quantize_params(W, rule).dequantize(), DENSE)
  np.testing.assert_array_equal(jq.dot_general_weight_only(X, W, DENSE, **options), expected)
  stored = jq.quantize_params(W, rule)
  np.testing.assert_array_equal(jq.dot_general_weight_only(X, stored, DENSE), expected)


def test_weight_only_general_layout_and_gradient():
  lhs = np.asarray(jax.random.normal(jax.random.key(6), (2, 3, 16)), np.float32)
  rhs = np.asarray(jax.random.normal(jax.random.key(7), (16, 4, 5)), np.float32)
  numbers = (((2,), (0,)), ((), ()))
  matrix = jq.quantize_params(rhs.reshape(16, 20), jq.QuantizationRule(dtype=jnp.int4))
  expected = lax.dot_general(lhs, matrix.dequantize().reshape(16, 4, 5), numbers)
  np.testing.assert_array_equal(
      jq.dot_general_weight_only(lhs, rhs, numbers, dtype=jnp.int4), expected)
  # Straight through for rhs (absmax: nothing saturates), ordinary for lhs.
  g_rhs = jax.grad(lambda w: jnp.sum(jq.dot_general_weight_only(lhs, w, numbers)))(rhs)
  np.testing.assert_allclose(g_rhs, np.broadcast_to(lhs.sum((0, 1))[:, None, None], rhs.shape),
                             rtol=1e-5)
  with pytest.raises(ValueError, match="block_size"):
    jq.dot_general_weight_only(lhs, rhs, (((1, 2), (1, 0)), ((), ())), block_size=4)


CONV_X = np.asarray(jax.random.normal(jax.random.key(4), (3, 6, 6, 4)), np.float32)
CONV_W = np.asarray(jax.random.normal(jax.random.key(5), (3, 3, 4, 8)), np.float32)
CONV = dict(window_strides=(2, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_conv_dynamic_int8():
  x_q, x_scale = _symmetric(CONV_X, (1, 2, 3))
  w_q, w_scale = _symmetric(CONV_W, (0, 1, 2))
  accumulator = integer_conv(x_q, w_q, **CONV)
  expected = accumulator.astype(np.float32) * (x_scale.reshape(3, 1, 1, 1)
                                              * w_scale.reshape(1, 1, 1, 8))
  y = jq.conv_general_dilated_dynamic_int8(CONV_X, CONV_W, **CONV)
  np.testing.assert_array_equal(y, expected)


def test_conv_static_int8_zero_point_with_padding_is_exact():
  scale, zero_point = np.float32(0.03), np.int8(20)
  x_q = np.asarray(jq.quantize_linear(CONV_X, scale, zero_point, axis=None)).astype(np.int64)
  w_q, w_scale = _symmetric(CONV_W, (0, 1, 2))
  # Zero padding of the shifted values stands for x = 0, as the float convolution pads.
  accumulator = integer_conv(x_q - zero_point, w_q, **CONV)
  expected = accumulator.astype(np.float32) * (scale * w_scale.reshape(1, 1, 1, 8))
  y = jq.conv_general_dilated_static_int8(CONV_X, CONV_W, **CONV, input_scale=scale,
                                          input_zero_point=zero_point)
  np.testing.assert_array_equal(y, expected)


def test_conv_fake_quant_and_grouped_dynamic():
  x_q, x_scale = _symmetric(CONV_X, (1, 2, 3))
  fake = np.asarray(jq.dequantize_linear(x_q, x_scale, axis=None))
  np.testing.assert_array_equal(
      jq.conv_general_dilated_fake_quant(CONV_X, CONV_W, **CONV),
      lax.conv_general_dilated(fake, CONV_W, **CONV))
  grouped = dict(CONV, feature_group_count=2)
  w = CONV_W[:, :, :2, :]
  y = jq.conv_general_dilated_dynamic_int8(CONV_X, w, **grouped)
  exact = lax.conv_general_dilated(CONV_X, w, **grouped)
  assert np.abs(y - exact).max() <= 0.03 * np.abs(exact).max()


CONV_STATIC = dict(input_scale=np.float32(0.03), input_zero_point=np.int8(20))
CONV_INT8 = {"dynamic": jq.conv_general_dilated_dynamic_int8,
             "static": functools.partial(jq.conv_general_dilated_static_int8, **CONV_STATIC)}


@pytest.mark.parametrize("drop_in", CONV_INT8)
def test_conv_int8_take_stored_int8_kernels(drop_in):
  """An int8 kernel quantize_params stores per output feature (absmax, no zero point) holds the
  drop-ins' own codes and scales: bit for bit the float kernel's call, HWIO or OIHW, its axis
  counted from the end too. Per tensor: its codes convolved, its one scale."""
  # Jitted: one compilation (eagerly, each of the op's primitives compiles on its own).
  op = lambda x, kernel, **options: jax.jit(functools.partial(CONV_INT8[drop_in], **options))(
      x, kernel)
  want = op(CONV_X, CONV_W, **CONV)
  stored = jq.quantize_params(CONV_W, jq.QuantizationRule(dtype=jnp.int8))  # axis -1: HWIO's O
  assert stored.axis == 3 and stored.scale.shape == (8,)
  assert_bits_equal(op(CONV_X, stored, **CONV), want)
  assert_bits_equal(op(CONV_X, dataclasses.replace(stored, axis=-1), **CONV), want)
  oihw = jq.quantize_params(np.transpose(CONV_W, (3, 2, 0, 1)), jq.QuantizationRule(axis=0))
  assert_bits_equal(
      op(CONV_X, oihw, **dict(CONV, dimension_numbers=("NHWC", "OIHW", "NHWC"))), want)

  per_tensor = jq.quantize_params(CONV_W, jq.QuantizationRule(axis=None))
  if drop_in == "dynamic":
    x_q, x_scale = _symmetric(CONV_X, (1, 2, 3))
    x_scale = x_scale.reshape(3, 1, 1, 1)
  else:
    x_q = np.asarray(jq.quantize_linear(CONV_X, *CONV_STATIC.values(), axis=None)).astype(
        np.int64) - CONV_STATIC["input_zero_point"]
    x_scale = CONV_STATIC["input_scale"]
  accumulator = integer_conv(x_q, per_tensor.values, **CONV)
  assert_bits_equal(op(CONV_X, per_tensor, **CONV),
                    accumulator.astype(np.float32) * (x_scale * np.asarray(per_tensor.scale)))
  # A depthwise kernel has one input feature: a scale along it is one scale, per tensor.
  depthwise, grouped = CONV_W[:, :, :1, :4], dict(CONV, feature_group_count=4)
  along_inputs = jq.quantize_params(depthwise, jq.QuantizationRule(axis=-2))
  assert along_inputs.scale.size == 1
  assert_bits_equal(
      op(CONV_X, along_inputs, **grouped),
      op(CONV_X, jq.quantize_params(depthwise, jq.QuantizationRule(axis=None)), **grouped))


@pytest.mark.parametrize("drop_in", CONV_INT8)
def test_conv_int8_refuse_other_stored_kernels(drop_in):
  """Another dtype, a zero point, blocks, or a scale along a dim that is not the output
  features: a TypeError naming rhs, before any convolution (none is silently rescaled)."""
  op = CONV_INT8[drop_in]
  rules = [jq.QuantizationRule(axis=-2), jq.QuantizationRule(axis=0),
           jq.QuantizationRule(axis=-2, block_size=2), jq.QuantizationRule(dtype=jnp.int4),
           jq.QuantizationRule(dtype=jnp.int4, packed=False),
           jq.QuantizationRule(method="minmax"),
           jq.QuantizationRule(dtype=jnp.uint8, method="minmax"),
           jq.QuantizationRule(dtype=jnp.float8_e4m3fn)]
  wrong = [jq.quantize_params(CONV_W, rule) for rule in rules]
  # Along the input features, counted from the end by hand: as many as the output features,
  # a scale the convolution would have spread over its output features unnoticed.
  square = jq.quantize_params(np.concatenate([CONV_W, CONV_W], axis=2),
                              jq.QuantizationRule(axis=2))
  wrong.append(dataclasses.replace(square, axis=-2))
  message = ("rhs must be a float array, or a QuantizedArray of int8 without zero point "
             r"scaled per tensor or per index of the kernel's output feature dim \(3\)")
  for kernel in wrong:
    x = CONV_X if kernel.shape[2] == 4 else np.concatenate([CONV_X, CONV_X], axis=3)
    with pytest.raises(TypeError, match=message):
      op(x, kernel, **CONV)
    with pytest.raises(TypeError, match=message):  # and differentiated
      jax.grad(lambda x, kernel=kernel: jnp.sum(op(x, kernel, **CONV)))(x)


@pytest.mark.parametrize("rule, options", [
    (jq.QuantizationRule(), {}),                                          # per output feature
    (jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=3, method="mse"),
     dict(dtype=jnp.int4, block_size=3, method="mse")),                   # ragged: 4 = 3 + 1
    (jq.QuantizationRule(dtype=jnp.float8_e4m3fn), dict(dtype=jnp.float8_e4m3fn)),
])
def test_conv_weight_only_is_the_dequantized_kernel_s_conv(rule, options):
  stored = jq.quantize_params(CONV_W, rule)
  expected = lax.conv_general_dilated(CONV_X, stored.dequantize(), **CONV)
  np.testing.assert_array_equal(
      jq.conv_general_dilated_weight_only(CONV_X, CONV_W, **CONV, **options), expected)
  np.testing.assert_array_equal(
      jq.conv_general_dilated_weight_only(CONV_X, stored, **CONV), expected)


def test_conv_weight_only_other_layout_and_gradient():
  # OIHW: output features lead, input features second.
  kernel = np.transpose(CONV_W, (3, 2, 0, 1))
  numbers = dict(CONV, dimension_numbers=("NHWC", "OIHW", "NHWC"))
  np.testing.assert_array_equal(
      jq.conv_general_dilated_weight_only(CONV_X, kernel, **numbers, dtype=jnp.int4,
                                          block_size=2),
      jq.conv_general_dilated_weight_only(CONV_X, CONV_W, **CONV, dtype=jnp.int4, block_size=2))
  # Straight through for the kernel (absmax: nothing saturates).
  grad = jax.grad(lambda w: jnp.sum(jq.conv_general_dilated_weight_only(CONV_X, w, **CONV)))
  np.testing.assert_allclose(
      grad(CONV_W), jax.grad(lambda w: jnp.sum(lax.conv_general_dilated(CONV_X, w, **CONV)))(
          CONV_W), rtol=1e-6)
  with pytest.raises(TypeError, match="rhs"):
    jq.conv_general_dilated_weight_only(CONV_X, CONV_W.astype(np.int32), **CONV)



# The matmul ops and the eight drop-ins as a layer calls them (quant_testing.model_calls):
# scales and zero points per row, per column or blocked; float and stored kernels.
LAYER_CALLS = list(model_calls())
# vmap of a float convolution over kernels too is a grouped convolution, which XLA:CPU sums
# in another order than one convolution per example (lax's own does, measured): those map x.
FLOAT_CONVOLUTIONS = ("conv_general_dilated_weight_only", "conv_general_dilated_fake_quant")


@pytest.mark.parametrize("name", LAYER_CALLS)
def test_x64_gives_x32_dtypes_and_bits(name):
  assert_same_under_x64(*model_calls()[name])


@pytest.mark.parametrize("name", LAYER_CALLS)
def test_vmap_over_every_argument_is_a_loop(name):
  """Scales, zero points, kernels (stored ones too) mapped, as for a stack of layers."""
  function, args = model_calls(0)[name]
  in_axes = [0] + [None if name in FLOAT_CONVOLUTIONS else 0] * (len(args) - 1)
  assert_vmap_is_a_loop(function, [args, model_calls(1)[name][1]], in_axes)


def test_replace_ops_duck_typed_and_by_path():
  class Layer:
    def __init__(self, attribute):
      setattr(self, attribute, None)

  class Model:
    def __init__(self):
      self.encoder = {"dense": Layer("dot_general"), "conv": Layer("conv_general_dilated")}
      self.heads = (Layer("einsum_op"), Layer("dot_general"))
      self.again = self.heads  # visited once

  model = Model()
  changed = jq.replace_ops(model, dot_general={"heads/1": jq.dot_general_fake_quant},
                           conv_general_dilated=jq.conv_general_dilated_dynamic_int8)
  assert changed == ["encoder/conv", "heads/1"]
  assert model.heads[1].dot_general is jq.dot_general_fake_quant
  assert model.encoder["dense"].dot_general is None
  # A path naming no layer (here "/" for "."): it changed nothing, silently.
  with pytest.raises(ValueError, match=r"^replace_ops: dot_general must be a mapping of layer "
                     r"paths among \['encoder/conv', .*\], got paths naming no layer: "
                     r"\['heads\.0'\]\.$"):
    jq.replace_ops(model, dot_general={"heads.0": jq.dot_general_fake_quant})
  jq.replace_ops(model, dot_general=jq.dot_general_dynamic_int8)
  einsum = model.heads[0].einsum_op
  np.testing.assert_array_equal(einsum("bi,io->bo", X, W),
                                jq.dot_general_dynamic_int8(X, W, DENSE))


def test_flax_linen_dense_takes_the_drop_in():
  linen = pytest.importorskip("flax.linen")
  dense = linen.Dense(8, dot_general=jq.dot_general_dynamic_int8)
  variables = dense.init(jax.random.key(0), X)
  kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
  np.testing.assert_array_equal(dense.apply(variables, X),
                                jq.dot_general_dynamic_int8(X, kernel, DENSE) + bias)


def _run_onnxruntime(model, x, *, outputs=(), optimize=False):
  """y and the named intermediate float32 tensors, as onnxruntime computes them."""
  model = onnx.ModelProto.FromString(model.SerializeToString())
  for name in outputs:
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
  options = onnxruntime.SessionOptions()
  options.graph_optimization_level = (
      onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
      else onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL)
  session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                         providers=["CPUExecutionProvider"])
  return session.run(None, {"x": x})


def _assert_within_summation_error(y, x, w):
  """|y - x @ w| within two float32 dot products' worst-case rounding, any summation order."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  unit = np.finfo(np.float32).eps / 2
  bound = 2 * x.shape[1] * unit * (np.abs(x) @ np.abs(w))
  assert np.all(np.abs(np.asarray(y, np.float64) - x @ w) <= bound)


BIAS = np.linspace(-1, 1, 8).astype(np.float32)
# Rows that exercise the dynamic scale: all zeros, one NaN, tiny, large.
EDGE_X = np.concatenate([X, np.zeros((1, 70), np.float32), np.where(np.arange(70) == 5, np.nan, X[:1]),
                         X[1:2] * np.float32(1e-30), X[2:3] * np.float32(1e30)]).astype(np.float32)


@pytest.mark.parametrize("rule", [
    jq.QuantizationRule(),
    jq.QuantizationRule(dtype=jnp.uint8, method="minmax", axis=None),
    jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=32),            # ragged, packed
    jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=32, packed=False),
    jq.QuantizationRule(dtype=jnp.int2, axis=0, block_size=16, method="mse"),
    jq.QuantizationRule(dtype=jnp.float8_e4m3fn),
], ids=lambda r: f"{np.dtype(r.dtype).name}-{r.block_size}-{r.packed}")
def test_export_qdq_dequantizes_bit_for_bit_in_onnxruntime(rule):
  weight = jq.quantize_params(W, rule)
  model = jq.export_onnx(weight, BIAS)
  onnx.checker.check_model(model)
  y, w, xw = _run_onnxruntime(model, X, outputs=("w", "xw"))
  np.testing.assert_array_equal(w, weight.dequantize())
  # The float MatMul sums in onnxruntime's order (docs/models.md has the ulps); the Add is exact.
  _assert_within_summation_error(xw, X, w)
  np.testing.assert_array_equal(y, xw + BIAS)


@pytest.mark.parametrize("shape, rule", [
    ((16, 1), jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=32)),   # a 1-output head
    ((16, 1), jq.QuantizationRule(dtype=jnp.uint2, method="minmax", axis=0, block_size=16)),
    ((1, 3), jq.QuantizationRule(dtype=jnp.int8, axis=-1, block_size=4)),
], ids=["int4-head", "uint2-head", "int8-row"])
def test_export_keeps_the_axis_of_a_single_block(shape, rule):
  """One block, one scale: still a blocked DequantizeLinear, along the weight's axis."""
  weight = jq.quantize_params(W[:shape[0], :shape[1]], rule)
  assert weight.scale.size == 1
  model = jq.export_onnx(weight)
  onnx.checker.check_model(model)
  _, w = _run_onnxruntime(model, X[:, :shape[0]], outputs=("w",))
  np.testing.assert_array_equal(w, weight.dequantize())


@pytest.mark.parametrize("rule, minimum", [
    (jq.QuantizationRule(dtype=jnp.float4_e2m1fn, axis=-2, block_size=32), 23),
    (jq.QuantizationRule(dtype=jnp.int2, axis=0, block_size=16), 25),
], ids=["float4", "int2"])
def test_export_needs_the_opset_that_reads_the_dtype(rule, minimum):
  """float4_e2m1fn came in opset 23, int2 in 25: below, an error (onnx's checker refuses
  the graph); from there, onnx.reference dequantizes the stored weight bit for bit
  (onnxruntime has no float4 DequantizeLinear kernel)."""
  weight = jq.quantize_params(W, rule)
  with pytest.raises(ValueError, match=f"opset must be at least {minimum}"):
    jq.export_onnx(weight, opset=minimum - 2)
  model = jq.export_onnx(weight, opset=minimum)
  onnx.checker.check_model(model, full_check=True)
  model.graph.output.append(onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, None))
  from onnx.reference import ReferenceEvaluator  # pylint: disable=import-outside-toplevel
  _, w = ReferenceEvaluator(model).run(None, {"x": X})
  np.testing.assert_array_equal(w, weight.dequantize())


@pytest.mark.parametrize("opset", [21, 23, 25])
def test_export_writes_the_opsets_ir_version(opset):
  """The IR version that goes with the opset, as onnx's helper tables it (int2 initializers
  need IR 13, which opset 25 brings; 11 was written for every opset)."""
  model = jq.export_onnx(jq.quantize_params(W, jq.QuantizationRule()), opset=opset)
  assert model.ir_version == onnx.helper.find_min_ir_version_for(model.opset_import)
  onnx.checker.check_model(model, full_check=True)


def test_export_reads_the_row_layout_of_a_sharded_weight():
  flat = jq.quantize_params(W[:, :7], jq.QuantizationRule(dtype=jnp.int4))  # odd rows: padded
  codes = jq.unpack(flat.values, flat.shape, flat.dtype)
  rows = dataclasses.replace(flat, values=jq.pack(codes, layout="rows"))
  assert rows.values.shape == (70, 4)
  _, w = _run_onnxruntime(jq.export_onnx(rows), X, outputs=("w",))
  np.testing.assert_array_equal(w, flat.dequantize())


@pytest.mark.parametrize("transposed", [False, True], ids=["stored", "stored-transposed"])
@pytest.mark.parametrize("optimize", [False, True], ids=["unoptimized", "optimized"])
@pytest.mark.parametrize("axis", [None, -1])
def test_export_dynamic_int8_bit_for_bit_in_onnxruntime(axis, optimize, transposed):
  weight = jq.quantize_params(W, jq.QuantizationRule(axis=axis, transposed=transposed))
  model = jq.export_onnx(weight, BIAS, activations="dynamic_int8")
  onnx.checker.check_model(model)
  (y,) = _run_onnxruntime(model, EDGE_X, optimize=optimize)
  np.testing.assert_array_equal(y, jq.dot_general_dynamic_int8(EDGE_X, weight, DENSE) + BIAS)


# The reference casts a NaN quotient to int32 (R1), then the graph's Where drops it.
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("axis", [None, -1])
def test_export_dynamic_int8_bit_for_bit_in_onnx_reference(axis):
  """The ONNX reference too: its ReduceMax propagates NaN (onnxruntime's skips it), so the
  graph's own Where keeps a NaN out of its row's scale."""
  from onnx.reference import ReferenceEvaluator  # pylint: disable=import-outside-toplevel
  weight = jq.quantize_params(W, jq.QuantizationRule(axis=axis))
  model = jq.export_onnx(weight, BIAS, activations="dynamic_int8")
  (y,) = ReferenceEvaluator(model).run(None, {"x": EDGE_X})
  np.testing.assert_array_equal(y, jq.dot_general_dynamic_int8(EDGE_X, weight, DENSE) + BIAS)


@pytest.mark.parametrize("optimize", [False, True], ids=["unoptimized", "optimized"])
def test_export_fake_quant_quantizes_bit_for_bit_in_onnxruntime(optimize):
  weight = jq.quantize_params(W, jq.QuantizationRule(dtype=jnp.int4))
  model = jq.export_onnx(weight, BIAS, activations="fake_quant")
  onnx.checker.check_model(model)
  x = EDGE_X[:-3]  # no NaN: the float MatMul's bound needs finite rows
  y, x_dq, w, xw = _run_onnxruntime(model, x, outputs=("x_dq", "w", "xw"), optimize=optimize)
  # dot_general_fake_quant's operands, bit for bit: the row-quantized input and the weight.
  fake_x = jq.dot_general_fake_quant(x, np.eye(70, dtype=np.float32), DENSE,
                                     precision=lax.Precision.HIGHEST)
  np.testing.assert_array_equal(x_dq, fake_x)
  np.testing.assert_array_equal(w, weight.dequantize())
  _assert_within_summation_error(xw, x_dq, w)
  np.testing.assert_array_equal(y, xw + BIAS)


@pytest.mark.parametrize("optimize", [False, True], ids=["unoptimized", "optimized"])
@pytest.mark.parametrize("zero_point", [None, -11])
@pytest.mark.parametrize("axis", [None, -1])
def test_export_static_int8_bit_for_bit_in_onnxruntime(zero_point, axis, optimize):
  weight = jq.quantize_params(W, jq.QuantizationRule(axis=axis))
  x = np.concatenate([X, np.full((1, 70), 1e3, np.float32), np.zeros((1, 70), np.float32)])
  model = jq.export_onnx(weight, BIAS, input_scale=0.02, input_zero_point=zero_point)
  onnx.checker.check_model(model)
  assert [node.op_type for node in model.graph.node] == [
      "QuantizeLinear", "MatMulInteger", "Cast", "Mul", "Add"]
  (y,) = _run_onnxruntime(model, x, optimize=optimize)
  expected = jq.dot_general_static_int8(x, weight, DENSE, input_scale=np.float32(0.02),
                                        input_zero_point=zero_point) + BIAS
  np.testing.assert_array_equal(y, expected)


def test_export_errors():
  with pytest.raises(TypeError, match="weight"):
    jq.export_onnx(W)
  with pytest.raises(ValueError, match="weight.shape"):
    jq.export_onnx(jq.quantize_params(CONV_W, jq.QuantizationRule()))
  with pytest.raises(ValueError, match="int8 without zero point"):
    jq.export_onnx(jq.quantize_params(W, jq.QuantizationRule(dtype=jnp.int4)), input_scale=1.0)
  with pytest.raises(ValueError, match="packed"):
    jq.export_onnx(jq.quantize_params(W, jq.QuantizationRule(dtype=jnp.float6_e2m3fn,
                                                             packed=False)))
  int8 = jq.quantize_params(W, jq.QuantizationRule())
  with pytest.raises(ValueError, match="activations"):
    jq.export_onnx(int8, activations="int4")
  with pytest.raises(ValueError, match="activations"):
    jq.export_onnx(int8, activations="dynamic_int8", input_scale=1.0)
  with pytest.raises(ValueError, match="dynamic int8"):
    jq.export_onnx(jq.quantize_params(W, jq.QuantizationRule(dtype=jnp.int4)),
                   activations="dynamic_int8")
  # One scale per input row (axis 0): the integer graphs scale output columns only.
  with pytest.raises(ValueError, match="per output column"):
    jq.export_onnx(jq.quantize_params(W, jq.QuantizationRule(axis=0)),
                   activations="dynamic_int8")
  with pytest.raises(ValueError, match="per output column"):
    jq.export_onnx(jq.quantize_params(W, jq.QuantizationRule(axis=0)), input_scale=1.0)
  # Before: written wrapped into the graph (uint8 200 as -56), or dropped silently.
  with pytest.raises(TypeError, match="input_zero_point.dtype must be int8"):
    jq.export_onnx(int8, input_scale=1.0, input_zero_point=np.uint8(200))
  with pytest.raises(ValueError, match="input_zero_point must be None without input_scale"):
    jq.export_onnx(int8, input_zero_point=-5)
  # An opset the installed onnx does not know has no IR version to write.
  with pytest.raises(ValueError, match=f"opset must be at most {onnx.defs.onnx_opset_version()}"):
    jq.export_onnx(int8, opset=onnx.defs.onnx_opset_version() + 1)
  with pytest.raises(ValueError, match="bias.shape"):
    jq.export_onnx(int8, np.ones(W.shape[1] + 1, np.float32))
  with pytest.raises(ValueError, match="opset must be at least 21"):
    jq.export_onnx(int8, activations="dynamic_int8", opset=13)


def test_export_without_onnx_names_the_extra(monkeypatch):
  import builtins  # pylint: disable=import-outside-toplevel
  real_import = builtins.__import__

  def no_onnx(name, *args, **kwargs):
    if name == "onnx":
      raise ImportError("No module named 'onnx'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_onnx)
  with pytest.raises(ImportError, match=r"jaxquant\[test\]"):
    jq.export_onnx(jq.quantize_params(W, jq.QuantizationRule()))


@pytest.mark.parametrize("case", [
    dict(shape=(2, 5, 9), kernel=(4, 5, 3), strides=(2,), padding="SAME", numbers=None),
    dict(shape=(2, 9, 8, 3), kernel=(3, 3, 3, 4), strides=(1, 2), padding="VALID",
         numbers=("NHWC", "HWIO", "NHWC"), rhs_dilation=(2, 1)),
    dict(shape=(1, 6, 7, 7), kernel=(4, 3, 2, 3), strides=(1, 1), padding=((2, -1), (0, 3)),
         numbers=None, lhs_dilation=(2, 1), feature_group_count=2),
    dict(shape=(4, 3, 10), kernel=(6, 3, 3), strides=(1,), padding="SAME", numbers=None,
         batch_group_count=2),
    dict(shape=(1, 1500, 4), kernel=(2, 1500, 3), strides=(1,), padding="VALID",
         numbers=None, lhs_dtype=np.int16),
    dict(shape=(1, 3000, 2), kernel=(2, 3000, 1), strides=(1,), padding="VALID",
         numbers=None, lhs_dtype=np.int16, largest=True),
    # A dilated window larger than the input: an empty output, a tap past the input's end.
    dict(shape=(1, 2, 1), kernel=(2, 1, 2), strides=(1,), padding="VALID", numbers=None,
         rhs_dilation=(2,), feature_group_count=2),
], ids=lambda case: f"{case['shape']}x{case['kernel']}")
def test_integer_conv_on_cuda_is_the_integer_conv(case):
  """CUDA's integer convolution (XLA:GPU lowers none), evaluated here: exact, one dot per tap."""
  case = dict(case)
  rng = np.random.default_rng(sum(case["shape"]))
  lhs_dtype = case.pop("lhs_dtype", np.int8)
  high = 256 if lhs_dtype == np.int16 else 128
  lhs = rng.integers(-high + 1, high, case.pop("shape")).astype(lhs_dtype)
  rhs = rng.integers(-128, 128, case.pop("kernel")).astype(np.int8)
  if case.pop("largest", False):
    # Sums past 2**24, where a float32 accumulation of too deep a slice rounds.
    lhs, rhs = (high - 1 - np.abs(lhs) % 3).astype(lhs_dtype), (127 - np.abs(rhs) % 3).astype(
        np.int8)
  numbers = lax.conv_dimension_numbers(lhs.shape, rhs.shape, case.pop("numbers"))
  options = dict(window_strides=case.pop("strides"), padding=case.pop("padding"),
                 lhs_dilation=case.pop("lhs_dilation", None),
                 rhs_dilation=case.pop("rhs_dilation", None),
                 feature_group_count=case.pop("feature_group_count", 1),
                 batch_group_count=case.pop("batch_group_count", 1))
  want = integer_conv(lhs, rhs, dimension_numbers=numbers, **options)
  got = jax.jit(lambda l, r: _dot_general.integer_conv_by_taps(l, r, numbers, **options))(
      lhs, rhs)
  np.testing.assert_array_equal(got, want)


def test_integer_conv_lowered_for_cuda_holds_no_integer_convolution():
  x, w = jnp.ones((2, 8, 8, 16)), jnp.ones((3, 3, 16, 4))
  conv = lambda x: jq.conv_general_dilated_dynamic_int8(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  cuda = jax.jit(conv).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  cpu = jax.jit(conv).trace(x).lower(lowering_platforms=("cpu",)).as_text()
  assert "stablehlo.convolution" not in cuda and "stablehlo.convolution" in cpu
  np.testing.assert_allclose(conv(x), jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), rtol=0.02)


@pytest.mark.parametrize("block_size", [0, 2])
def test_weight_only_contracting_an_empty_dim_gives_zeros(block_size):
  # As lax.dot_general and the other drop-ins: it raised ZeroDivisionError
  # reshaping the (0, 4) weight with a -1.
  lhs, rhs = np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32)
  got = jq.dot_general_weight_only(lhs, rhs, DENSE, block_size=block_size)
  assert_bits_equal(got, lax.dot_general(lhs, rhs, DENSE))


@pytest.mark.parametrize("op", [jq.conv_general_dilated_dynamic_int8,
                                functools.partial(jq.conv_general_dilated_static_int8,
                                                  input_scale=0.5)])
def test_integer_convolutions_refuse_an_integer_result(op):
  # As lax.conv_general_dilated refuses it: the float epilogue cast to int32
  # truncated every output.
  x, w = np.ones((1, 5, 2), np.float32), np.ones((3, 2, 4), np.float32)
  with pytest.raises(TypeError, match="preferred_element_type must be a float dtype"):
    op(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
       preferred_element_type=jnp.int32)
