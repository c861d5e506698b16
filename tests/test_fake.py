"""Fake quantization: values, straight-through and LSQ gradients, transformations.

Values are checked bit for bit against ``dequantize_linear(quantize_linear(x))``;
gradients against the formulas of docs/numerics.md ("Fake quantization and its
gradients") evaluated in NumPy, element by element, with each scale element's
sum taken by ``np.bincount``. PyTorch as an oracle is in ``test_fake_torch.py``.
"""

import functools

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxquant as jq
from jaxquant import _dtypes
from quant_testing import assert_bits_equal
from quant_testing import CASES
from quant_testing import dtype_name
from quant_testing import entry_work
from quant_testing import expand_scale
from quant_testing import FLOAT4
from quant_testing import FLOAT8_DTYPES
from quant_testing import FLOAT_DTYPES
from quant_testing import INTEGER_DTYPES_TO_16_BITS
from quant_testing import layouts

# fake_quantize's low-precision float dtypes (float6 has its own tests, test_float6.py).
FAKE_FLOAT_DTYPES = FLOAT8_DTYPES + (FLOAT4,)


def _info(dtype):
  return _dtypes.quantized_dtype("dtype", dtype)


def _inputs(rng, x_shape, scale_shape, axis, block_size, dtype, input_dtype):
  """x on rounding ties, their neighbours, range edges, NaN and +-inf; scale; zero point."""
  info = _info(dtype)
  scale = rng.uniform(0.05, 2, scale_shape).astype(np.float32)
  # Powers of two keep quotients exact in every input dtype, so ties stay ties.
  scale.reshape(-1)[::2] = 2.0 ** rng.integers(-3, 3, scale.size)[::2]
  if info.is_integer:
    low, high = max(info.min, -20), min(info.max, 20)
    zero_point = rng.integers(low, high, scale_shape, endpoint=True).astype(info.dtype)
    reach = info.max - info.min + 4
  else:
    zero_point = rng.choice([0.0, 1.0, -2.0], scale_shape).astype(info.dtype)
    reach = 1.2 * info.max
  full_scale = expand_scale(scale, x_shape, axis, block_size)
  steps = rng.uniform(-reach, reach, x_shape)
  steps = np.where(rng.random(x_shape) < 0.5, np.round(steps) + rng.choice(
      [0.0, 0.5, -0.5, 0.49999997, 0.5000001], x_shape), steps)
  with np.errstate(over="ignore"):  # float16 overflows to inf: fine, inf is an input too
    x = (steps * full_scale).astype(input_dtype)
  flat = x.reshape(-1)
  flat[::11] = np.nan
  flat[3::13] = np.inf
  flat[5::17] = -np.inf
  return x, scale, zero_point, full_scale


def _reference(x, scale, zero_point, dtype, narrow_range, kwargs):
  """The value fake_quantize promises: dequantize(quantize(x)), the range narrowed by one."""
  q = jq.quantize_linear(x, scale, zero_point, output_dtype=dtype, **kwargs)
  if narrow_range:
    q = jnp.maximum(q, jnp.asarray(_info(dtype).min + 1, q.dtype))
  return jq.dequantize_linear(q, scale, zero_point, output_dtype=x.dtype, **kwargs)


def _unclamped(x, full_scale, full_zero_point, dtype):
  """round(x / scale) + zero_point in float64 (NumPy divides float32 exactly once).

  Integers round before the zero point is added (ONNX's order: at a tie the
  zero point's parity would otherwise matter); floats add, then round.
  """
  quotient = (x.astype(np.float32) / full_scale).astype(np.float64)
  if _info(dtype).is_integer:
    quotient = np.rint(quotient)
  return quotient + full_zero_point.astype(np.float64)


def _in_range(x, full_scale, full_zero_point, dtype, narrow_range=False):
  """The documented mask, written from the definition rather than from jaxquant's code."""
  info = _info(dtype)
  value = _unclamped(x, full_scale, full_zero_point, dtype)
  if info.is_integer:
    return (value >= info.min + narrow_range) & (value <= info.max)
  # A float dtype's value is in range if it rounds (to nearest even, exponent
  # unbounded) to at most max: below max + ulp/2, or on that tie when max's
  # significand is even.
  finfo = ml_dtypes.finfo(info.dtype)
  largest = float(finfo.max)
  ulp = 2.0 ** (np.floor(np.log2(largest)) - finfo.nmant)
  max_is_even = (largest / ulp) % 2 == 0
  magnitude = np.abs(value)
  return (magnitude < largest + ulp / 2) | ((magnitude == largest + ulp / 2) & max_is_even)


fake_layouts = layouts()

# Every example compiles forward and backward programs for a fresh shape; a
# third of the profile's examples (20 in CI, 333 under "thorough") for the
# gradient properties keeps this file near half a minute on two cores.
few = hypothesis.settings(max_examples=hypothesis.settings.default.max_examples // 3)


@pytest.mark.slow
@hypothesis.given(
    layout=fake_layouts, dtype=st.sampled_from(INTEGER_DTYPES_TO_16_BITS + FAKE_FLOAT_DTYPES),
    input_dtype=st.sampled_from(FLOAT_DTYPES), narrow_range=st.booleans(),
    with_zero_point=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_value_is_dequantize_of_quantize(
    layout, dtype, input_dtype, narrow_range, with_zero_point, seed
):
  x_shape, scale_shape, axis, block_size = layout
  narrow_range = narrow_range and _info(dtype).is_integer
  rng = np.random.default_rng(seed)
  x, scale, zero_point, _ = _inputs(rng, x_shape, scale_shape, axis, block_size, dtype,
                                    input_dtype)
  kwargs = dict(axis=axis, block_size=block_size)
  if not with_zero_point:
    zero_point = None
  y = jq.fake_quantize(x, scale, zero_point, dtype=dtype, narrow_range=narrow_range,
                       **kwargs)
  expected = _reference(x, scale, zero_point, dtype, narrow_range, kwargs)
  assert_bits_equal(y, expected)


@pytest.mark.slow
@few
@hypothesis.given(
    layout=fake_layouts, dtype=st.sampled_from(INTEGER_DTYPES_TO_16_BITS + FAKE_FLOAT_DTYPES),
    input_dtype=st.sampled_from(FLOAT_DTYPES), narrow_range=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_masked_gradient_is_the_inclusive_range_mask(
    layout, dtype, input_dtype, narrow_range, seed
):
  x_shape, scale_shape, axis, block_size = layout
  narrow_range = narrow_range and _info(dtype).is_integer
  rng = np.random.default_rng(seed)
  x, scale, zero_point, full_scale = _inputs(rng, x_shape, scale_shape, axis, block_size,
                                             dtype, input_dtype)
  kwargs = dict(dtype=dtype, axis=axis, block_size=block_size, narrow_range=narrow_range)
  upstream = rng.normal(size=x_shape).astype(input_dtype)
  fake = functools.partial(jq.fake_quantize, **kwargs)
  grad_x, grad_scale = jax.grad(
      lambda x, scale: jnp.sum(upstream * fake(x, scale, zero_point)), argnums=(0, 1)
  )(x, scale)
  full_zero_point = expand_scale(zero_point, x_shape, axis, block_size)
  mask = _in_range(x, full_scale, full_zero_point, dtype, narrow_range)
  assert_bits_equal(grad_x, np.where(mask, upstream, 0).astype(input_dtype))
  assert_bits_equal(grad_scale, np.zeros_like(scale))

  identity = jax.grad(lambda x: jnp.sum(upstream * fake(x, scale, zero_point,
                                                        gradient="identity")))(x)
  assert_bits_equal(identity, upstream)


def test_naive_rounding_has_zero_gradient_and_fake_quantize_does_not():
  """round -> astype(int) -> astype(float) trains nothing, silently (an XLA trap)."""
  x = jnp.linspace(-2.0, 2.0, 41)
  scale = 0.05

  def naive(x):
    q = jnp.clip(jnp.round(x / scale), -128, 127).astype(jnp.int8)
    return jnp.sum(q.astype(jnp.float32) * scale)

  assert not np.any(jax.grad(naive)(x))
  grad = jax.grad(lambda x: jnp.sum(jq.fake_quantize(x, scale)))(x)
  assert np.all(grad[jnp.abs(x) <= 127 * scale] == 1)


def test_range_edges_pass_gradient_one_not_one_half():
  scale = 0.5
  edges = jnp.array([-128 * scale, 127 * scale])
  clipped = jax.grad(lambda x: jnp.sum(jnp.clip(x / scale, -128, 127) * scale))(edges)
  np.testing.assert_array_equal(clipped, [0.5, 0.5])  # why jnp.clip is not an STE
  fake = jax.grad(lambda x: jnp.sum(jq.fake_quantize(x, scale)))(edges)
  np.testing.assert_array_equal(fake, [1.0, 1.0])
  # Inside the mask up to the last value that rounds into the range.
  x = jnp.array([-128.5, -128.50002, 127.49999, 127.5]) * scale
  np.testing.assert_array_equal(
      jax.grad(lambda x: jnp.sum(jq.fake_quantize(x, scale)))(x), [1, 0, 1, 0])
  narrow = jax.grad(lambda x: jnp.sum(jq.fake_quantize(x, scale, narrow_range=True)))
  # -127.5 rounds (half to even) to -128: outside [-127, 127].
  np.testing.assert_array_equal(
      narrow(jnp.array([-127.0, -126.5, -127.5, -128.0]) * scale), [1, 1, 0, 0])


@pytest.mark.xla_cpu
@pytest.mark.parametrize("gradient", ["masked", "identity"])
def test_training_step_writes_no_quotient(gradient):
  # Of x's size, only the gradient is written: the forward value and the
  # mask each divide x for themselves. (When the mask shared the forward's
  # division, XLA wrote the float32 quotient out for both to read.)
  x = w = jnp.zeros((1024, 1024), jnp.float32)
  step = jax.value_and_grad(
      lambda x, w: jnp.sum(w * jq.fake_quantize(x, 0.02, gradient=gradient)))
  work = entry_work(jax.jit(step).lower(x, w).compile().as_text())
  assert [result for _, result, _ in work].count("f32[1024,1024]{1,0}") == 1, work


# --- LSQ: fake_quantize_learnable -----------------------------------------------------


def _lsq_reference(x, scale, zero_point, upstream, dtype, narrow_range, grad_factor,
                   axis, block_size):
  """The documented LSQ gradients, per element in float64, summed per scale element."""
  info = _info(dtype)
  low, high = info.min + narrow_range, info.max
  rounded_zero_point = np.clip(np.rint(zero_point.astype(np.float64)), low, high)
  full_scale = expand_scale(scale, x.shape, axis, block_size).astype(np.float64)
  full_zero_point = expand_scale(rounded_zero_point, x.shape, axis, block_size)
  index = expand_scale(np.arange(scale.size).reshape(scale.shape), x.shape, axis,
                       block_size)
  value = _unclamped(x, full_scale.astype(np.float32), full_zero_point, dtype)
  below, above = value < low, value > high
  inside = (value >= low) & (value <= high)
  y = (np.clip(value, low, high) - full_zero_point) * full_scale
  x64 = x.astype(np.float64)
  with np.errstate(invalid="ignore"):
    local_scale = np.where(inside, (y - x64) / full_scale, np.where(
        below, low - full_zero_point, np.where(above, high - full_zero_point, 0)))
  local_zero_point = np.where(below | above, -full_scale, 0)

  def per_scale(local):
    terms = (grad_factor * upstream.astype(np.float64) * local).reshape(-1)
    return np.bincount(index.reshape(-1), terms, minlength=scale.size).reshape(scale.shape)

  return np.where(inside, upstream, 0), per_scale(local_scale), per_scale(local_zero_point)


@pytest.mark.slow
@few
@hypothesis.given(
    layout=fake_layouts, dtype=st.sampled_from([jnp.int4, jnp.uint4, jnp.int8, jnp.uint8]),
    narrow_range=st.booleans(), grad_factor=st.sampled_from([1.0, 0.03]),
    seed=st.integers(0, 2**32 - 1),
)
def test_learnable_gradients_match_lsq(layout, dtype, narrow_range, grad_factor, seed):
  x_shape, scale_shape, axis, block_size = layout
  rng = np.random.default_rng(seed)
  x, scale, _, _ = _inputs(rng, x_shape, scale_shape, axis, block_size, dtype, np.float32)
  info = _info(dtype)
  # Learned zero points sit anywhere, also off the grid and outside the range.
  zero_point = rng.uniform(info.min - 3, info.max + 3, scale_shape).astype(np.float32)
  upstream = rng.normal(size=x_shape).astype(np.float32)
  kwargs = dict(dtype=dtype, axis=axis, block_size=block_size, narrow_range=narrow_range)

  def loss(x, scale, zero_point):
    y = jq.fake_quantize_learnable(x, scale, zero_point, grad_factor=grad_factor, **kwargs)
    return jnp.sum(upstream * y), y

  (grad_x, grad_scale, grad_zero_point), y = jax.grad(
      loss, argnums=(0, 1, 2), has_aux=True)(x, scale, zero_point)
  rounded = np.clip(np.rint(zero_point), info.min + narrow_range, info.max)
  assert_bits_equal(y, jq.fake_quantize(x, scale, rounded.astype(info.dtype), **kwargs))

  expected_x, expected_scale, expected_zero_point = _lsq_reference(
      x, scale, zero_point, upstream, dtype, narrow_range, grad_factor, axis, block_size)
  assert_bits_equal(grad_x, expected_x.astype(np.float32))
  # Sums of float32 terms: compare to the scale of the terms, not of the sum.
  index_size = max(1, x.size // max(1, scale.size))
  tolerance = 1e-5 * grad_factor * info.max * index_size * np.abs(upstream).max(initial=1)
  np.testing.assert_allclose(grad_scale, expected_scale, rtol=1e-5, atol=tolerance)
  np.testing.assert_allclose(grad_zero_point, expected_zero_point, rtol=1e-5,
                             atol=tolerance * scale.max(initial=1))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_name)
def test_learnable_parameter_gradients_of_half_precision_x_are_taken_in_float32(dtype):
  # LSQ's (y - x) / scale inside the range reads y in float32, the forward's
  # compute dtype, not y rounded to x's dtype (which would move each term by up
  # to ulp(y) / (2 scale), ~0.1 here): the parameters get the gradients of the
  # same values given in float32. One scale per element, so each gradient is one
  # term; XLA may contract y - x into an FMA in one program and not the other,
  # a difference of a few float32 ulps of y.
  rng = np.random.default_rng(6)
  x = (rng.standard_normal((4, 8)) * 0.6).astype(dtype)
  scale, zero_point = jnp.full(x.shape, 0.0123, jnp.float32), jnp.full(x.shape, -2.3)

  def grads(x):
    loss = lambda scale, zero_point: jnp.sum(
        jq.fake_quantize_learnable(x, scale, zero_point).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))(scale, zero_point)

  for got, want in zip(grads(x), grads(x.astype(jnp.float32))):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)


def test_learnable_without_zero_point_is_symmetric_lsq():
  x, scale, _, kwargs = _case("blocked-ragged")
  loss = lambda x, scale, zero_point: jnp.sum(jnp.sin(jq.fake_quantize_learnable(
      x, scale, zero_point, dtype=jnp.int4, **kwargs)))
  fixed = jax.grad(loss, argnums=(0, 1))(x, scale, None)
  zero = jax.grad(loss, argnums=(0, 1))(x, scale, jnp.zeros_like(scale))
  chex.assert_trees_all_equal(fixed, zero)


def test_learnable_nan_passes_no_gradient():
  x = jnp.array([jnp.nan, 1.0, -300.0])
  grads = jax.grad(lambda x, s, z: jnp.sum(jq.fake_quantize_learnable(x, s, z)),
                   argnums=(0, 1, 2))(x, jnp.float32(1.0), jnp.float32(0.0))
  np.testing.assert_array_equal(grads[0], [0, 1, 0])
  assert float(grads[1]) == -128  # only -300 (below): qmin - 0
  assert float(grads[2]) == -1


@pytest.mark.parametrize("zero_point_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("dtype, zero_point, clipped", [
    (jnp.int16, 40000.0, 32767), (jnp.int16, -40000.0, -32768), (jnp.uint16, 70000.0, 65535),
])
def test_learnable_half_precision_zero_point_is_clipped_to_the_range(
    zero_point_dtype, dtype, zero_point, clipped):
  # Clipped in the zero point's own dtype, int16's bound 32767 was 32768 and
  # float16 has no 65535 (inf): a zero point out of range stayed out.
  x = jnp.array([0.0, 1.0, -1.0, 100.0, -100.0])
  # 70000 is inf in float16 (converted by XLA: NumPy's cast warns).
  zero_point = jnp.float32(zero_point).astype(zero_point_dtype)
  want = jq.fake_quantize(x, 1.0, np.array(clipped, dtype), dtype=dtype)
  loss = lambda z: jnp.sum(jq.fake_quantize_learnable(x, 1.0, z, dtype=dtype))
  assert_bits_equal(jq.fake_quantize_learnable(x, 1.0, zero_point, dtype=dtype), want)
  float32_gradient = jax.grad(loss)(jnp.float32(zero_point))
  assert float(jax.grad(loss)(zero_point)) == float(float32_gradient)


def test_lsq_grad_factor():
  assert jq.lsq_grad_factor(100, dtype=jnp.int8) == pytest.approx(1 / np.sqrt(12700))
  assert jq.lsq_grad_factor(1, dtype=jnp.uint4) == pytest.approx(1 / np.sqrt(15))
  assert jq.lsq_grad_factor(2**62, dtype=jnp.int8) == pytest.approx(1 / np.sqrt(2.0**62 * 127))
  # math.sqrt's OverflowError before: the docstring promises ValueError.
  with pytest.raises(ValueError, match="elements_per_scale must be below 2\\*\\*63"):
    jq.lsq_grad_factor(10**400)


# --- dynamic fake quantization -------------------------------------------------------


@st.composite
def reduction_layouts(draw):
  """(x shape, axis, block_size) for dynamic quantization: per tensor, axis, block."""
  rank = draw(st.integers(0, 4))
  x_shape = tuple(draw(st.lists(st.integers(0, 6), min_size=rank, max_size=rank)))
  if rank == 0 or draw(st.booleans()):
    return x_shape, None, 0
  axis = draw(st.integers(-rank, rank - 1))
  block_size = draw(st.sampled_from([0, 0, 1, 2, 4]))
  return x_shape, axis, block_size


@pytest.mark.slow
@few
@hypothesis.given(
    layout=reduction_layouts(), dtype=st.sampled_from(INTEGER_DTYPES_TO_16_BITS),
    input_dtype=st.sampled_from(FLOAT_DTYPES), symmetric=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_dynamic_is_dequantize_of_dynamic_quantize(
    layout, dtype, input_dtype, symmetric, seed
):
  x_shape, axis, block_size = layout
  symmetric = symmetric and _info(dtype).min < 0
  rng = np.random.default_rng(seed)
  x = (rng.normal(0, 3, x_shape) + rng.choice([0.0, 5.0], x_shape)).astype(input_dtype)
  x.reshape(-1)[::7] = np.nan
  kwargs = dict(dtype=dtype, axis=axis, block_size=block_size, symmetric=symmetric)
  upstream = rng.normal(size=x_shape).astype(input_dtype)

  def loss(x):
    y = jq.fake_quantize_dynamic(x, **kwargs)
    return jnp.sum(upstream * y), y

  grad, fake = jax.jit(jax.grad(loss, has_aux=True))(x)
  q, scale, zero_point = jq.dynamic_quantize_linear(x, **kwargs)
  dequantize_axis = 1 if axis is None else axis
  expected = jq.dequantize_linear(q, scale, zero_point, axis=dequantize_axis,
                                  block_size=block_size, output_dtype=x.dtype)
  assert_bits_equal(fake, expected)
  # The range covers x: every number passes gradient 1, NaN passes none, and
  # nothing flows through the min and max (that would change finite entries).
  assert_bits_equal(grad, np.where(np.isnan(x), 0, upstream).astype(input_dtype))


# --- transformations -----------------------------------------------------------------


def _case(name, seed=0):
  """The shared CASES layouts, with small scales and learned (float) zero points."""
  x_shape, scale_shape, kwargs = CASES[name]
  rng = np.random.default_rng(seed)
  x = rng.normal(0, 3, x_shape).astype(np.float32)
  scale = rng.uniform(0.01, 0.04, scale_shape).astype(np.float32)
  zero_point = rng.uniform(-10, 10, scale_shape).astype(np.float32)
  return x, scale, zero_point, kwargs


def _learnable_loss(x, scale, zero_point, kwargs):
  y = jq.fake_quantize_learnable(x, scale, zero_point, grad_factor=0.1, **kwargs)
  return jnp.sum(jnp.sin(y))


class TransformationsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_jit_and_eager_agree(self):
    for name in ("per-axis", "blocked-ragged"):  # op by op is slow: two layouts
      x, scale, zero_point, kwargs = _case(name)
      grad = self.variant(jax.grad(functools.partial(_learnable_loss, kwargs=kwargs),
                                   argnums=(0, 1, 2)))
      with jax.disable_jit():
        eager = jax.grad(functools.partial(_learnable_loss, kwargs=kwargs),
                         argnums=(0, 1, 2))(x, scale, zero_point)
      # Eager and jitted code sum the scale's terms in different orders.
      chex.assert_trees_all_close(grad(x, scale, zero_point), eager, rtol=1e-5, atol=1e-5)

  def test_vmap_matches_a_loop(self):
    for name in CASES:
      batch = [_case(name, seed) for seed in range(3)]
      kwargs = batch[0][3]
      xs, scales, zero_points = (np.stack([b[i] for b in batch]) for i in range(3))
      grad = jax.grad(functools.partial(_learnable_loss, kwargs=kwargs), argnums=(0, 1, 2))
      mapped = jax.vmap(grad)(xs, scales, zero_points)
      for i, (x, scale, zero_point, _) in enumerate(batch):
        chex.assert_trees_all_close(jax.tree.map(lambda m: m[i], mapped),
                                    grad(x, scale, zero_point), rtol=1e-6)
      dynamic = jax.vmap(functools.partial(jq.fake_quantize_dynamic, axis=-1))(xs)
      for i, x in enumerate(xs):
        chex.assert_trees_all_equal(dynamic[i], jq.fake_quantize_dynamic(x, axis=-1))

  def test_checkpoint_gives_the_same_gradients(self):
    for name in CASES:
      x, scale, zero_point, kwargs = _case(name)
      loss = functools.partial(_learnable_loss, kwargs=kwargs)
      grad = jax.grad(loss, argnums=(0, 1, 2))(x, scale, zero_point)
      remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(x, scale, zero_point)
      chex.assert_trees_all_close(remat, grad, rtol=1e-6)

  def test_forward_mode_agrees_with_reverse_mode(self):
    # A custom_jvp rule serves jvp and jacfwd too, which a custom_vjp would refuse.
    x, scale, zero_point, kwargs = _case("per-axis")
    loss = functools.partial(_learnable_loss, kwargs=kwargs)
    forward = jax.jacfwd(loss, argnums=(0, 1, 2))(x, scale, zero_point)
    reverse = jax.jacrev(loss, argnums=(0, 1, 2))(x, scale, zero_point)
    chex.assert_trees_all_close(forward, reverse, rtol=1e-5, atol=1e-5)
    tangent = jnp.ones_like(x)
    _, jvp = jax.jvp(lambda x: jq.fake_quantize(x, 0.1), (x,), (tangent,))
    np.testing.assert_array_equal(jvp, (np.abs(x) <= 12.75).astype(np.float32))

  def test_retraces_only_for_new_static_options(self):
    x, scale, zero_point, kwargs = _case("per-axis")
    before = jq.fake_quantize_learnable._cache_size()
    for seed in range(3):
      jq.fake_quantize_learnable(*_case("per-axis", seed)[:3], **kwargs)
    assert jq.fake_quantize_learnable._cache_size() == before + 1
    jq.fake_quantize_learnable(x, scale, zero_point, grad_factor=0.5, **kwargs)
    assert jq.fake_quantize_learnable._cache_size() == before + 2


def test_optax_trains_weights_and_learnable_scales():
  """A jitted optax step moves weights, scales and zero points, and the loss falls."""
  rng = np.random.default_rng(0)
  inputs = rng.normal(size=(256, 16)).astype(np.float32)
  true_weights = rng.normal(size=(16, 4)).astype(np.float32)
  targets = inputs @ true_weights
  params = {
      "weights": jnp.asarray(rng.normal(size=(16, 4)) * 0.1, jnp.float32),
      "scale": jnp.full((2, 4), 0.05, jnp.float32),  # one scale per 8 inputs per output
      "zero_point": jnp.zeros((2, 4), jnp.float32),
  }
  grad_factor = jq.lsq_grad_factor(8, dtype=jnp.int4)

  def loss(params):
    weights = jq.fake_quantize_learnable(
        params["weights"], params["scale"], params["zero_point"], dtype=jnp.int4, axis=0,
        block_size=8, grad_factor=grad_factor)
    activations = jq.fake_quantize_dynamic(inputs, axis=0)
    return jnp.mean((activations @ weights - targets) ** 2)

  optimizer = optax.adam(0.05)

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  state = optimizer.init(params)
  start = params
  losses = []
  for _ in range(150):
    params, state, value = step(params, state)
    losses.append(float(value))
  assert losses[-1] < 0.1 * losses[0], losses[::10]
  for name in params:
    assert not np.allclose(params[name], start[name]), name
  # The learned int4 weights reproduce the trained model's fake-quant output.
  weights = jq.fake_quantize_learnable(
      params["weights"], params["scale"], params["zero_point"], dtype=jnp.int4, axis=0,
      block_size=8)
  q = jq.quantize_linear(params["weights"], params["scale"],
                         jnp.clip(jnp.round(params["zero_point"]), -8, 7).astype(jnp.int4),
                         axis=0, block_size=8)
  assert_bits_equal(weights, jq.dequantize_linear(
      q, params["scale"], jnp.clip(jnp.round(params["zero_point"]), -8, 7).astype(jnp.int4),
      axis=0, block_size=8))


def test_rank_eight_and_empty():
  x = jnp.arange(2.0**8).reshape((2,) * 8) / 7 - 18
  scale = jnp.full((2,) * 8, 0.25)
  zero_point = jnp.zeros((2,) * 8, jnp.int8)
  assert_bits_equal(jq.fake_quantize(x, scale, zero_point),
                    jq.dequantize_linear(jq.quantize_linear(x, scale, zero_point),
                                         scale, zero_point))
  grad = jax.grad(lambda x: jnp.sum(jq.fake_quantize(x, 0.1, dtype=jnp.int4)))(x)
  rounded = np.rint(np.asarray(x) / np.float32(0.1))
  np.testing.assert_array_equal(grad, (rounded >= -8) & (rounded <= 7))
  empty = jnp.zeros((0, 3))
  assert jq.fake_quantize(empty, jnp.ones(3), axis=1).shape == (0, 3)
  assert jax.grad(lambda s: jnp.sum(jq.fake_quantize_learnable(empty, s, 0.0)))(
      jnp.float32(1)) == 0


# --- second order: Hessians and Hessian-vector products -------------------------------------
#
# References written by hand with stop_gradient, the textbook way to spell a
# straight-through estimator: their second derivatives are what the custom JVP
# must reproduce (before the fix, round's zero derivative leaked into them).


def _round_ste(v):
  return v + jax.lax.stop_gradient(jnp.round(v) - v)


def _masked_ste(x, scale, zero_point, info):
  """clip(round(x / s) + z) dequantized; derivative 1 inside the range, 0 outside."""
  q = _round_ste(x / scale) + zero_point
  inside = (q >= info.min) & (q <= info.max)
  q = jnp.where(inside, q, jax.lax.stop_gradient(jnp.clip(q, info.min, info.max)))
  return (q - zero_point) * scale


def _second_order_cases():
  rng = np.random.default_rng(7)
  x = jnp.asarray(np.concatenate([rng.normal(0, 4, 20), [-30.0, 30.0, 0.0]]), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.05, 0.2, (x.size // 23 * 23,))[:1].reshape(()), jnp.float32)
  return x, scale


def _assert_second_order(loss, reference, x):
  np.testing.assert_allclose(jax.hessian(loss)(x), jax.hessian(reference)(x), rtol=1e-6)
  v = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), x.dtype)
  hvp = jax.jvp(jax.grad(loss), (x,), (v,))[1]
  reference_hvp = jax.jvp(jax.grad(reference), (x,), (v,))[1]
  np.testing.assert_allclose(hvp, reference_hvp, rtol=1e-6)
  assert np.any(np.asarray(hvp) != 0), "a zero HVP proves nothing"


# The masked derivative on int8 has its second order checked through fake_quantize_dynamic
# and fake_quantize_learnable (below); the identity one passes x's tangent whatever the dtype.
@pytest.mark.slow
@pytest.mark.parametrize("gradient, dtype", [("masked", jnp.uint4), ("identity", jnp.int8)],
                         ids=lambda value: value if isinstance(value, str) else dtype_name(value))
def test_fake_quantize_second_order_is_straight_through(dtype, gradient):
  x, scale = _second_order_cases()
  zero_point = jnp.asarray(3 if dtype == jnp.uint4 else -2, dtype)
  info = _info(dtype)
  weights = jnp.linspace(0.5, 2.0, x.size)

  def loss(x):
    return jnp.sum(weights * jq.fake_quantize(x, scale, zero_point, dtype=dtype,
                                              gradient=gradient) ** 2)

  def reference(x):
    if gradient == "identity":
      y = x + jax.lax.stop_gradient(jq.fake_quantize(x, scale, zero_point, dtype=dtype) - x)
    else:
      y = _masked_ste(x, scale, zero_point.astype(jnp.float32), info)
    return jnp.sum(weights * y ** 2)

  _assert_second_order(loss, reference, x)


@pytest.mark.slow
def test_fake_quantize_learnable_second_order_matches_lsq_by_hand():
  x, scale = _second_order_cases()
  zero_point = jnp.float32(1.0)
  info = _info(jnp.int8)
  weights = jnp.linspace(0.5, 2.0, x.size)

  def loss(x, scale, zero_point):
    return jnp.sum(weights * jq.fake_quantize_learnable(x, scale, zero_point) ** 2)

  def reference(x, scale, zero_point):
    return jnp.sum(weights * _masked_ste(x, scale, zero_point, info) ** 2)

  args = (x, scale, zero_point)
  got = jax.hessian(loss, argnums=(0, 1, 2))(*args)
  want = jax.hessian(reference, argnums=(0, 1, 2))(*args)
  # float32: (y - x) / scale cancels, so the two spellings differ in the last
  # bits; a missing straight-through term would differ by O(1).
  for got_row, want_row in zip(got, want):
    for g, w in zip(got_row, want_row):
      np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-5)
  _assert_second_order(lambda x: loss(x, scale, zero_point),
                       lambda x: reference(x, scale, zero_point), x)


@pytest.mark.slow
def test_fake_quantize_dynamic_second_order_is_straight_through():
  x, _ = _second_order_cases()
  info = _info(jnp.int8)

  def loss(x):
    return jnp.sum(jq.fake_quantize_dynamic(x, dtype=jnp.int8) ** 2)

  def reference(x):
    _, scale, zero_point = jq.dynamic_quantize_linear(jax.lax.stop_gradient(x), dtype=jnp.int8)
    return jnp.sum(_masked_ste(x, scale, zero_point.astype(jnp.float32), info) ** 2)

  _assert_second_order(loss, reference, x)


def test_fake_quantize_dynamic_clamps_an_extreme_the_zero_point_pushes_out():
  """The documented exception to dx = 1: lo / s is the tie -159.5, z rounds to 160, and the
  maximum's 95.50001 rounds to 96, so it quantizes to 256 and is clamped to 255."""
  x = np.array([-0.11696374, 0.46420285, -0.7752916], np.float32)
  _, _, zero_point = jq.dynamic_quantize_linear(x, dtype=jnp.uint8)
  assert int(zero_point) == 160
  gradient = jax.grad(lambda x: jnp.sum(jq.fake_quantize_dynamic(x, dtype=jnp.uint8)))(x)
  np.testing.assert_array_equal(gradient, [1, 0, 1])
