"""quantize_linear / dequantize_linear: docs/numerics.md edge cases, transformations, tracing.

The edge cases run on every implementation (``quant_testing.IMPLEMENTATIONS``).
"""

import functools

import chex
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _granularity
from jaxquant import _linear
from quant_testing import assert_bits_equal
from quant_testing import CASES
from quant_testing import dtype_name
from quant_testing import expand_scale
from quant_testing import FLOAT8_DTYPES
from quant_testing import given_per_implementation
from quant_testing import IMPLEMENTATIONS
from quant_testing import INTEGER_DTYPES
from quant_testing import INTEGER_DTYPES_32_BITS
from quant_testing import INTEGER_DTYPES_TO_16_BITS
from quant_testing import layouts


# --- quantize_linear: special values (docs/numerics.md) --------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_name)
def test_integer_special_values(dtype, implementation):
  info = jnp.iinfo(dtype)
  x = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1e30, -1e30, 0.0], jnp.float32)
  y = jq.quantize_linear(x, 1.0, output_dtype=dtype, implementation=implementation)
  assert_bits_equal(y, np.array([info.min, info.max, info.min, info.max, info.min, 0],
                                dtype=y.dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_name)
def test_scale_zero_saturates_by_sign(dtype, implementation):
  info = jnp.iinfo(dtype)
  y = jq.quantize_linear(jnp.array([3.0, -3.0, 0.0, -0.0]), 0.0, output_dtype=dtype,
                         implementation=implementation)
  assert y.tolist() == [info.max, info.min, info.min, info.min]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_name)
def test_rounds_half_to_even_then_adds_zero_point(dtype, implementation):
  info = jnp.iinfo(dtype)
  zero_point = np.array(info.min + (info.max - info.min) // 2).astype(dtype)
  ties = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5], np.float32)
  expected = np.clip(np.rint(ties).astype(np.int64) + int(zero_point), info.min, info.max)
  y = jq.quantize_linear(ties, 1.0, zero_point, implementation=implementation)
  assert y.tolist() == expected.tolist()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES_32_BITS, ids=dtype_name)
def test_32bit_zero_point_is_added_exactly(dtype, implementation):
  info = jnp.iinfo(dtype)
  rng = np.random.default_rng(0)
  # Quotients above 2**24, where a float32 sum with the zero point would round.
  quotient = rng.uniform(-2.0**33, 2.0**33, 4096).astype(np.float32)
  zero_point = rng.integers(info.min, info.max, 4096, endpoint=True).astype(dtype)
  y = jq.quantize_linear(quotient, np.ones(4096, np.float32), zero_point, axis=0,
                         implementation=implementation)
  exact = np.clip(np.rint(quotient).astype(np.float64).astype(object) + zero_point.astype(object),
                  info.min, info.max)
  assert np.asarray(y).astype(object).tolist() == exact.tolist()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_float8_saturate(dtype, implementation):
  finfo = ml_dtypes.finfo(dtype)
  x = np.array([1e6, -1e6, np.inf, -np.inf, np.nan, 1.0, -0.0], np.float32)
  quantize = functools.partial(jq.quantize_linear, output_dtype=dtype,
                               implementation=implementation)
  saturated = quantize(x, 1.0)
  expected = np.clip(x, -float(finfo.max), float(finfo.max)).astype(dtype)
  assert_bits_equal(saturated, expected)
  # saturate=False is the plain IEEE cast, which is what ml_dtypes does.
  assert_bits_equal(quantize(x, 1.0, saturate=False), x.astype(dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_float8_zero_point_keeps_negative_zero(implementation):
  y = jq.quantize_linear(jnp.array([-0.0, 1.0]), 1.0, jnp.zeros((), jnp.float8_e4m3fn),
                         implementation=implementation)
  assert_bits_equal(y, np.array([-0.0, 1.0], ml_dtypes.float8_e4m3fn))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_float4_saturates_to_six(implementation):
  x = np.array([100.0, -100.0, np.inf, -np.inf, 2.5, 0.25], np.float32)
  y = jq.quantize_linear(x, 1.0, output_dtype=jnp.float4_e2m1fn, implementation=implementation)
  assert np.asarray(y).astype(np.float32).tolist() == [6, -6, 6, -6, 2, 0]


def _divides_differently_by_reciprocal(dtype, size=4096):
  """Random x and one scale where ``x * (1/scale)`` != ``x / scale`` for many x."""
  rng = np.random.default_rng(1)
  scale = np.array(0.0373, dtype)
  x = (rng.standard_normal(size) * 50).astype(dtype)
  exact = x / scale
  assert np.mean(x * (1 / scale) != exact) > 0.05
  return x, scale, exact


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["scalar", "per-axis", "blocked"])
def test_division_is_true_division_under_jit(layout, implementation):
  x, scale, exact = _divides_differently_by_reciprocal(np.float32)
  # Quotients land on exact .5 ties when x is built from them, so a one-ulp
  # error in the quotient flips the rounding.
  ties = (np.floor(exact) + 0.5).astype(np.float32)
  x = (ties * scale).astype(np.float32)
  exact = x / scale
  kwargs = {}
  scale_array = scale
  if layout == "per-axis":
    x, exact = x.reshape(64, 64), exact.reshape(64, 64)
    scale_array, kwargs = np.full(64, scale), dict(axis=0)
  elif layout == "blocked":
    x, exact = x.reshape(64, 64), exact.reshape(64, 64)
    scale_array, kwargs = np.full((64, 3), scale), dict(axis=1, block_size=24)
  expected = np.clip(np.rint(exact), -32768, 32767).astype(np.int16)
  y = jax.jit(functools.partial(jq.quantize_linear, output_dtype=jnp.int16,
                                implementation=implementation, **kwargs))(x, scale_array)
  assert_bits_equal(y, expected)


def test_onnx_example_divides_in_the_scale_dtype():
  # ONNX QuantizeLinear: "The type of y_scale determines the precision of the
  # division". onnxruntime 1.32.0 and onnx.reference 1.23.2 both give 22087
  # (the float32 quotient would give 22082).
  x = jnp.array([4640], jnp.float16)
  for implementation in IMPLEMENTATIONS:
    y = jq.quantize_linear(x, jnp.float16(0.1875), jnp.int16(-2665),
                           implementation=implementation)
    assert_bits_equal(y, np.array([22087], np.int16))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("narrow", [np.float16, ml_dtypes.bfloat16], ids=dtype_name)
def test_division_precision_follows_the_scale(narrow, implementation):
  # Pairs whose quotient rounds to a different integer in the narrow dtype
  # than in float32: the scale's dtype decides which one is right.
  rng = np.random.default_rng(2)
  x = rng.uniform(-200, 200, 20000).astype(np.float32)
  scale = np.array(0.1, narrow)
  in_float32 = np.rint(x / np.float32(scale))
  in_narrow = np.rint(
      (x.astype(narrow).astype(np.float32) / np.float32(scale)).astype(narrow).astype(np.float32)
  )
  assert np.any(in_float32 != in_narrow)
  as_int16 = lambda q: np.clip(q, -32768, 32767).astype(np.int16)
  quantize = functools.partial(jq.quantize_linear, output_dtype=jnp.int16,
                               implementation=implementation)
  # float32 x, narrow scale: x is rounded to the scale's dtype too.
  assert_bits_equal(quantize(x, scale), as_int16(in_narrow))
  # precision= overrides the scale's dtype, either way.
  assert_bits_equal(quantize(x, scale, precision=jnp.float32), as_int16(in_float32))
  assert_bits_equal(quantize(x, np.float32(scale), precision=narrow), as_int16(in_narrow))
  # fake_quantize divides as quantize_linear does.
  fake = jq.fake_quantize(x, scale, dtype=jnp.int16)
  assert_bits_equal(fake, (as_int16(in_narrow).astype(np.float32)
                           * np.float32(scale)).astype(np.float32))


def test_int32_input_requantizes_accumulators():
  # An int32 accumulator is rounded once to the division's dtype, then divided.
  x = np.array([300, 301, -5, 1_000_000_001, 2**31 - 1, -2**31, 7 * 2**24 + 3], np.int32)
  scale = np.float32(2.0)
  expected = np.clip(np.rint(x.astype(np.float64).astype(np.float32) / 2.0) + 10, 0, 255)
  for implementation in IMPLEMENTATIONS:
    y = jq.quantize_linear(x, scale, jnp.uint8(10), implementation=implementation)
    assert_bits_equal(y, expected.astype(np.uint8))
    y = jax.jit(lambda x: jq.quantize_linear(x, scale, output_dtype=jnp.int16,
                                             implementation=implementation))(x)
    assert_bits_equal(y, np.clip(np.rint(x.astype(np.float32) / 2.0), -32768, 32767)
                      .astype(np.int16))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_int32_input_rounds_once_to_bfloat16(implementation):
  # 2**25 + 2**17 + 1 is just above a bfloat16 tie; through float32 it lands
  # on the tie (2**25 + 2**17) and ties-to-even rounds it down to 2**25.
  x = np.array([2**25 + 2**17 + 1, -(2**25 + 2**17 + 1), 2**25 + 2**17], np.int32)
  y = jq.quantize_linear(x, jnp.bfloat16(2.0**18), output_dtype=jnp.int16,
                         implementation=implementation)
  assert_bits_equal(y, np.array([129, -129, 128], np.int16))


@pytest.mark.parametrize("scale_shape, zero_point_shape", [((), (1,)), ((1,), ()), ((1, 1), (1,))])
def test_per_tensor_scale_and_zero_point_may_differ_in_rank(scale_shape, zero_point_shape):
  # ONNX's own test models pair a 0-d scale with a (1,) zero point.
  x = jnp.array([[-1.0, 0.25], [2.5, 100.0]])
  scale = jnp.full(scale_shape, 0.5)
  zero_point = jnp.full(zero_point_shape, 3, jnp.int8)
  q = jq.quantize_linear(x, scale, zero_point)
  assert_bits_equal(q, np.array([[1, 3], [8, 127]], np.int8))  # 0.5 ties to 0
  assert_bits_equal(jq.quantize_linear(x, scale, zero_point, implementation="pallas"), q)
  y = jq.dequantize_linear(q, scale, zero_point)
  assert_bits_equal(y, np.array([[-1.0, 0.0], [2.5, 62.0]], np.float32))
  assert_bits_equal(jq.dequantize_linear(q, scale, zero_point, implementation="pallas"), y)
  assert_bits_equal(jq.fake_quantize(x, scale, zero_point), y)
  learnable = jq.fake_quantize_learnable(x, scale, zero_point.astype(jnp.float32))
  assert_bits_equal(learnable, y)
  grads = jax.grad(lambda s, z: jq.fake_quantize_learnable(x, s, z).sum(), argnums=(0, 1))(
      scale, zero_point.astype(jnp.float32))
  assert grads[0].shape == scale_shape and grads[1].shape == zero_point_shape
  added = jq.quantized_add(q, scale, zero_point, q, scale, zero_point, scale, zero_point)
  assert added.dtype == jnp.int8


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_output_dtype_resolution(implementation):
  x = jnp.array([1.0, 300.0])
  quantize = functools.partial(jq.quantize_linear, implementation=implementation)
  assert quantize(x, 1.0).dtype == jnp.uint8
  assert quantize(x, 1.0, output_dtype=jnp.int16).dtype == jnp.int16
  assert quantize(x, 1.0, jnp.int4(0)).dtype == jnp.int4
  assert quantize(x, 1.0, jnp.int4(0), output_dtype=jnp.int4).dtype == jnp.int4
  # A Python number as zero point has no dtype of its own.
  assert quantize(x, 1.0, 3, output_dtype=jnp.int8).tolist() == [4, 127]


# --- dequantize_linear ----------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES_TO_16_BITS, ids=dtype_name)
def test_dequantize_subtracts_exactly(dtype, implementation):
  info = jnp.iinfo(dtype)
  x = np.array([info.min, info.max, 0]).astype(dtype)
  zero_point = np.array([info.max, info.min, info.max]).astype(dtype)
  y = jq.dequantize_linear(x, np.ones(3, np.float32), zero_point, axis=0,
                           implementation=implementation)
  assert y.tolist() == [info.min - info.max, info.max - info.min, -info.max]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dequantize_int32_wraps_around_like_onnxruntime(implementation):
  x = jnp.array([2**31 - 1, -(2**31)], jnp.int32)
  y = jq.dequantize_linear(x, jnp.ones(2), jnp.array([-1, 1], jnp.int32), axis=0,
                           implementation=implementation)
  # 2**31 - 1 - (-1) wraps to -2**31; -2**31 - 1 wraps to 2**31 - 1, which is 2**31 in float32.
  assert y.tolist() == [-(2.0**31), 2.0**31]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dequantize_uint32_wraps_around_in_its_own_width(implementation):
  x = jnp.array([0, 4_000_000_000], jnp.uint32)
  y = jq.dequantize_linear(x, 1.0, jnp.array(1, jnp.uint32), implementation=implementation)
  assert y.tolist() == [float(np.float32(2**32 - 1)), float(np.float32(3_999_999_999))]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_python_int_uint32_zero_points_beyond_int32(implementation):
  # jit reads a Python int as int32: 3e9 overflowed there (JAX's OverflowError)
  # after the range check had accepted it.
  x = np.array([1.0, -1.0, 3e9], np.float32)
  want = jq.quantize_linear(x, 1.0, np.uint32(3_000_000_000), implementation=implementation)
  assert want.tolist() == [3_000_000_001, 2_999_999_999, 2**32 - 1]
  got = jq.quantize_linear(x, 1.0, 3_000_000_000, output_dtype=jnp.uint32,
                           implementation=implementation)
  assert_bits_equal(got, want)
  codes = np.array([5, 3_000_000_001], np.uint32)
  assert_bits_equal(
      jq.dequantize_linear(codes, 1.0, 3_000_000_000, implementation=implementation),
      jq.dequantize_linear(codes, 1.0, np.uint32(3_000_000_000), implementation=implementation))
  assert_bits_equal(
      jax.jit(lambda x: jq.quantize_linear(x, 1.0, 4_294_967_295, output_dtype=jnp.uint32,
                                           implementation=implementation))(x),
      np.array([2**32 - 1, 2**32 - 2, 2**32 - 1], np.uint32))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dequantize_special_scales(implementation):
  x = jnp.array([-3, 0, 3], jnp.int8)
  for scale, expected in [(0.0, [-0.0, 0.0, 0.0]), (np.inf, [-np.inf, np.nan, np.inf]),
                          (np.nan, [np.nan] * 3)]:
    assert_bits_equal(jq.dequantize_linear(x, np.float32(scale), implementation=implementation),
                      np.array(expected, np.float32) if scale != 0
                      else np.float32(0.0) * np.array([-3, 0, 3], np.float32))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16])
def test_dequantize_rounds_product_once(scale_dtype, implementation):
  rng = np.random.default_rng(3)
  x = rng.integers(-128, 128, 5000).astype(np.int8)
  scale = np.asarray(0.0123, scale_dtype)
  dequantize = functools.partial(jq.dequantize_linear, implementation=implementation)
  y = dequantize(x, scale, np.int8(3))
  expected = ((x.astype(np.float32) - 3) * scale.astype(np.float32)).astype(scale_dtype)
  assert_bits_equal(y, expected)
  assert dequantize(x, scale, output_dtype=jnp.float32).dtype == jnp.float32


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dequantize_float8_input_and_e8m0_scale(implementation):
  x = np.array([1.5, -448, 0.25], ml_dtypes.float8_e4m3fn)
  scale = np.array(2.0**-3, ml_dtypes.float8_e8m0fnu)
  y = jq.dequantize_linear(x, scale, implementation=implementation)
  assert y.dtype == jnp.float32
  assert y.tolist() == [1.5 / 8, -56.0, 0.25 / 8]


# --- granularity: every layout against an explicit np.repeat expansion ------------------


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@given_per_implementation(1.0, 0.25, layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_every_layout_matches_expanded_scale(implementation, layout, seed):
  x_shape, scale_shape, axis, block_size = layout
  rng = np.random.default_rng(seed)
  x = rng.normal(0, 4, x_shape).astype(np.float32)
  scale = rng.uniform(0.1, 2, scale_shape).astype(np.float32)
  zero_point = rng.integers(-20, 20, scale_shape).astype(np.int8)
  kwargs = dict(axis=axis, block_size=block_size, implementation=implementation)
  full_scale = expand_scale(scale, x_shape, axis, block_size)
  full_zero_point = expand_scale(zero_point, x_shape, axis, block_size)

  y = jq.quantize_linear(x, scale, zero_point, **kwargs)
  expected = np.clip(np.rint(x / full_scale) + full_zero_point, -128, 127).astype(np.int8)
  assert_bits_equal(y, expected)

  back = jq.dequantize_linear(y, scale, zero_point, **kwargs)
  expected_back = (expected.astype(np.int32) - full_zero_point).astype(np.float32) * full_scale
  assert_bits_equal(back, expected_back.astype(np.float32))


def test_granularity_kinds():
  resolve = _granularity.resolve
  assert resolve((4, 6), (), axis=1, block_size=0).kind == "per-tensor"
  assert resolve((4, 6), (1, 1), axis=1, block_size=0).kind == "per-tensor"
  assert resolve((4, 6), (6,), axis=1, block_size=0).kind == "per-axis"
  assert resolve((4, 6), (4,), axis=-2, block_size=0).kind == "per-axis"
  blocked = resolve((4, 6), (4, 2), axis=1, block_size=4)
  assert (blocked.kind, blocked.split_dims) == ("blocked", (1,))
  broadcast = resolve((4, 6), (2, 3), axis=1, block_size=0)
  assert (broadcast.kind, broadcast.block_shape, broadcast.split_dims) == (
      "block-wise broadcast", (2, 2), (0, 1))
  assert resolve((2, 4, 6), (2, 3), axis=1, block_size=0).param_shape == (1, 2, 3)
  assert resolve((6,), (3,), axis=0, block_size=0).block_shape == (2,)


# --- transformations -------------------------------------------------------------------


def _case(name, seed=0):
  x_shape, scale_shape, kwargs = CASES[name]
  rng = np.random.default_rng(seed)
  x = rng.normal(0, 3, x_shape).astype(np.float32)
  scale = rng.uniform(0.05, 1, scale_shape).astype(np.float32)
  zero_point = rng.integers(-10, 10, scale_shape).astype(np.int8)
  return x, scale, zero_point, kwargs


class TransformationsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_jit_and_eager_agree_bit_for_bit(self):
    for name in CASES:
      x, scale, zero_point, kwargs = _case(name)
      quantize = self.variant(functools.partial(jq.quantize_linear, **kwargs))
      dequantize = self.variant(functools.partial(jq.dequantize_linear, **kwargs))
      with jax.disable_jit():
        eager_q = jq.quantize_linear(x, scale, zero_point, **kwargs)
        eager_dq = jq.dequantize_linear(eager_q, scale, zero_point, **kwargs)
      chex.assert_trees_all_equal(quantize(x, scale, zero_point), eager_q)
      chex.assert_trees_all_equal(dequantize(eager_q, scale, zero_point), eager_dq)

  def test_vmap_over_a_batch_matches_a_loop(self):
    for name in CASES:
      batch = [_case(name, seed) for seed in range(3)]
      kwargs = batch[0][3]
      xs, scales, zero_points = (np.stack([b[i] for b in batch]) for i in range(3))
      quantize = functools.partial(jq.quantize_linear, **kwargs)
      mapped = jax.vmap(quantize)(xs, scales, zero_points)
      for i, (x, scale, zero_point, _) in enumerate(batch):
        chex.assert_trees_all_equal(mapped[i], quantize(x, scale, zero_point))
      dequantize = functools.partial(jq.dequantize_linear, **kwargs)
      back = jax.vmap(dequantize)(mapped, scales, zero_points)
      for i, (_, scale, zero_point, _) in enumerate(batch):
        chex.assert_trees_all_equal(back[i], dequantize(mapped[i], scale, zero_point))

  def test_grad_of_dequantize_wrt_scale(self):
    for name in CASES:
      x, scale, zero_point, kwargs = _case(name)
      q = jq.quantize_linear(x, scale, zero_point, **kwargs)
      weights = np.random.default_rng(5).normal(size=x.shape).astype(np.float32)
      loss = lambda s: jnp.sum(weights * jq.dequantize_linear(q, s, zero_point, **kwargs))
      grad = jax.grad(loss)(scale)
      # d loss / d scale_k = sum over scale element k's block of w * (q - zp).
      x_shape = x.shape
      ones = np.ones_like(scale)
      axis, block_size = kwargs.get("axis", 1), kwargs.get("block_size", 0)
      contribution = weights * (np.asarray(q, np.float32)
                                - expand_scale(zero_point, x_shape, axis, block_size))
      expected = np.zeros_like(scale)
      for k in np.ndindex(scale.shape):
        mask = np.zeros_like(ones)
        mask[k] = 1
        expected[k] = np.sum(contribution * expand_scale(mask, x_shape, axis, block_size))
      np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)

  def test_new_values_same_shapes_do_not_retrace(self):
    traces = []

    @jax.jit
    def model(x, scale, zero_point):
      traces.append(None)
      q = jq.quantize_linear(x, scale, zero_point, axis=1, block_size=3)
      return jq.dequantize_linear(q, scale, zero_point, axis=1, block_size=3)

    for seed in range(3):
      model(*_case("blocked-ragged", seed)[:3])
    assert len(traces) == 1
    # quantize_linear reads NumPy float6 zero points before its jit boundary;
    # the jitted function behind it is what caches.
    before = _linear._quantize_linear._cache_size()
    for seed in range(3):
      jq.quantize_linear(*_case("per-axis", seed)[:3], axis=1)
    assert _linear._quantize_linear._cache_size() <= before + 1


def test_numpy_bools_are_static_flags():
  """A flag read from a NumPy array or config (np.bool_) is a bool, as Python's."""
  x = jnp.array([1e9, -1.0])
  assert_bits_equal(
      jq.quantize_linear(x, 1.0, output_dtype=jnp.float8_e4m3fn, saturate=np.bool_(False)),
      jq.quantize_linear(x, 1.0, output_dtype=jnp.float8_e4m3fn, saturate=False))
