"""Fake quantization and its gradients against PyTorch as an independent oracle.

Every case runs jaxquant (forward value and ``jax.vjp`` with a random
cotangent, inside one ``jax.jit``) and the PyTorch CPU op on the same float32
data, and compares:

=====================================  ============================================
PyTorch op                             jaxquant
=====================================  ============================================
fake_quantize_per_tensor_affine        fake_quantize, scalar scale: y, dx
fake_quantize_per_channel_affine       fake_quantize, 1-D scale, ranks 2-4, axes
                                       0, 1, 2 and negative: y, dx
_fake_quantize_learnable_per_tensor_   fake_quantize_learnable, scalar scale:
affine                                 y, dx, dscale, dzero_point
_fake_quantize_learnable_per_channel_  fake_quantize_learnable, 1-D scale: y, dx,
affine                                 dscale, dzero_point (per channel)
fake_quantize_per_tensor_affine with   fake_quantize_dynamic: y, dx
dynamic_quantize_linear's (s, z)
amax, amin (tied extremes)             dynamic_quantize_linear's scale: d scale / dx
fake_quantize_per_channel_affine of    dot_general_dynamic_int8 (straight-through):
both operands, then a matmul           dx, dw
=====================================  ============================================

on int4, uint4, int8, uint8 and int16 (``narrow_range`` as ``quant_min =
qmin + 1``), with power-of-two scales (every special input below is exact in
float32) and random scales. Inputs mix normals spread so about a quarter fall
outside the range with values exactly at ``(qmin - zp) * s`` and ``(qmax - zp)
* s``, half-steps on both sides of each bound (ties), one and one and a half
steps outside, ties inside the range and values 1000 ranges away.

Forward values and dx are compared bit for bit (dx's zeros up to sign, T6);
dscale and dzero_point to ``_SUM_RTOL`` (about 8 float32 ulps) times the sum of
the absolute values of their terms: both sum float32 terms, in different
orders, and PyTorch's in-range term multiplies by ``1 / s`` where jaxquant
divides (observed: at most 0.2 of that tolerance). Elements where the two
libraries' integer arithmetic differs (T1, T3 below) are not compared with
PyTorch: NumPy float32 predicts each library's integer (``_Predicted``), the
cotangent is 0 there, so they add nothing to any gradient, and every test
checks that each such element lies within ``_TIE_ULPS`` ulps of a rounding
tie and that they are a minority. jaxquant is then run again with the full
cotangent and checked on every element against a NumPy model of the
formulas in docs/numerics.md ("Fake quantization and its gradients").
Each difference is pinned by its own test.

PyTorch deviations (PyTorch 2.x CPU kernels; jaxquant keeps its documented
formula; also listed in docs/numerics.md, "Oracle deviations"):

T1. PyTorch computes ``x * (1 / s)``, jaxquant the float32 division ``x / s``
    (ONNX; docs/numerics.md). With random scales their roundings differ near ties: for
    ``x = float32(127.5 * s)``, s uniform in [0.01, 0.1), 18.6% of the
    quotients round to different integers, e.g. ``s = 0.048766974``, ``x =
    6.217789``: ``x / s`` is 127.5 in float32 (128 after rounding half to
    even, clamped to int8's 127, dx 0), ``x * (1 / s)`` is 127.49999 (127, dx
    1). Inside the range the forward values differ by one step.
T2. ``_fake_quantize_learnable_per_tensor_affine`` rounds the float zero point
    twice: the forward with ``nearbyint`` (half to even), the backward as
    ``int64(clamp(zp + 0.5, qmin, qmax))``, truncation toward zero. They differ
    for almost every zero point in (qmin - 0.5, -0.5) and for positive halves
    with an even integer part: -2.3 -> -2 forward, -1 backward; -1 -> -1 and
    0; qmin -> qmin and qmin + 1; 2.5 -> 2 and 3. PyTorch's backward is then
    the gradient at the other zero point (dx, dscale and dzero_point). In
    ``test_t2_...`` (int8, s = 0.5, 300 elements), zp = -2.3: PyTorch's
    dscale -1746.25 and dzero_point -2.419; jaxquant's -2161.02 and -0.793,
    and at zp = -1 -1746.25 and -2.419; dx differs in 2 elements. jaxquant
    rounds half to even and clips in both. The randomized per-tensor learnable
    cases draw zero points where both rules agree (whole numbers and fractions
    from 0 up, and values clamped to either bound). Per channel, PyTorch uses
    ``round().clamp()`` in both, as jaxquant does, and any zero point is drawn.
T3. Both learnable backward kernels (per tensor and per channel) classify and
    reconstruct ``x`` from ``nearbyint(zp + x * (1 / s))``, rounding after the
    zero point is added, while their forward rounds ``x * (1 / s)`` and then
    adds it (and so do the non-learnable ops, forward and mask, and jaxquant). At
    a tie with an odd zero point the two differ by one, so PyTorch's learnable
    gradients are not those of its own forward value. int8, s = 1, zp = 1:
    x = 0.5: y = 0, PyTorch's in-range dscale (1 - 0.5) / 1 = +0.5, jaxquant's
    ``(y - x) / s`` = -0.5; x = 125.5: y = 126, +0.5 against PyTorch's -0.5;
    x = 126.5: q = 126 + 1 = 127 is in range (y = 126) but PyTorch's learnable
    dx is 0 (its non-learnable dx 1, as jaxquant's); x = -129.5: q = -130 + 1
    is clamped, PyTorch's learnable dx 1 (jaxquant 0).
T4. NaN and +-inf inputs convert a float to int64 in PyTorch's kernels,
    undefined behaviour in C++; only jaxquant's side is asserted
    (``test_nan_and_infinity``). Observed on this x86 build: NaN -> (qmin - zp)
    * s with dx 0, as jaxquant; +inf -> (qmax - zp) * s per tensor but (qmin -
    zp) * s per channel (jaxquant: qmax); the learnable backward counts NaN and
    +inf as below the range (dscale += g * (qmin - zp), dzero_point += -g * s)
    where jaxquant gives NaN no gradient and +inf the above-range one.
T5. PyTorch refuses zero points outside [quant_min, quant_max] (the
    non-learnable ops) and learnable ranges without 0 (uint with
    narrow_range): those cases are not compared.
T6. PyTorch's dx is ``g * mask``, so a negative g outside the range gives
    -0.0; jaxquant selects +0.0. dx is compared with -0.0 == +0.0.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxquant as jq

_QUANTIZED = {
    "int4": (jnp.int4, -8, 7),
    "uint4": (jnp.uint4, 0, 15),
    "int8": (jnp.int8, -128, 127),
    "uint8": (jnp.uint8, 0, 255),
    "int16": (jnp.int16, -32768, 32767),
}
# Float32 sums of a few thousand terms in two orders, and in-range terms that
# differ by an ulp or two (T1's multiply against a division).
_SUM_RTOL = 1e-6
# An element left out for differing integer arithmetic must lie within this many
# float32 ulps (of |x / s| + |zp| + 1) from a rounding tie, or the exclusion
# would hide a real difference.
_TIE_ULPS = 4


def _range(name, narrow_range):
  _, qmin, qmax = _QUANTIZED[name]
  return qmin + int(narrow_range), qmax


# -- jaxquant, jitted once per shape and static configuration ----------------


@functools.partial(jax.jit, static_argnames=("dtype", "axis", "narrow_range"))
def _jaxquant_masked(x, scale, zero_point, cotangent, *, dtype, axis, narrow_range):
  def fake_quantize(x):
    return jq.fake_quantize(
        x, scale, zero_point, dtype=dtype, axis=axis, narrow_range=narrow_range
    )

  y, vjp = jax.vjp(fake_quantize, x)
  return y, vjp(cotangent)[0]


@functools.partial(
    jax.jit, static_argnames=("dtype", "axis", "narrow_range", "grad_factor")
)
def _jaxquant_learnable(
    x, scale, zero_point, cotangent, *, dtype, axis, narrow_range, grad_factor
):
  def fake_quantize(x, scale, zero_point):
    return jq.fake_quantize_learnable(
        x, scale, zero_point, dtype=dtype, axis=axis, narrow_range=narrow_range,
        grad_factor=grad_factor,
    )

  y, vjp = jax.vjp(fake_quantize, x, scale, zero_point)
  return (y, *vjp(cotangent))


def _numpy(*arrays):
  return tuple(np.asarray(a) for a in arrays)


# -- PyTorch -------------------------------------------------------------------


def _torch_masked(x, scale, zero_point, cotangent, *, axis, qmin, qmax):
  """PyTorch's fake quantize (per tensor for a 0-d scale) and its dx."""
  x_torch = torch.tensor(x, requires_grad=True)
  if np.ndim(scale) == 0:
    y = torch.fake_quantize_per_tensor_affine(
        x_torch, float(scale), int(zero_point), qmin, qmax
    )
  else:
    y = torch.fake_quantize_per_channel_affine(
        x_torch, torch.tensor(scale), torch.tensor(zero_point, dtype=torch.int32),
        axis % x.ndim, qmin, qmax,
    )
  y.backward(torch.tensor(cotangent))
  return y.detach().numpy(), x_torch.grad.numpy()


def _torch_learnable(x, scale, zero_point, cotangent, *, axis, qmin, qmax, grad_factor):
  """PyTorch's learnable fake quantize and its (dx, dscale, dzero_point)."""
  per_tensor = np.ndim(scale) == 0
  x_torch = torch.tensor(x, requires_grad=True)
  scale_torch = torch.tensor(np.reshape(scale, -1), requires_grad=True)
  zero_point_torch = torch.tensor(
      np.reshape(zero_point, -1).astype(np.float32), requires_grad=True
  )
  if per_tensor:
    y = torch._fake_quantize_learnable_per_tensor_affine(
        x_torch, scale_torch, zero_point_torch, qmin, qmax, grad_factor
    )
  else:
    y = torch._fake_quantize_learnable_per_channel_affine(
        x_torch, scale_torch, zero_point_torch, axis % x.ndim, qmin, qmax, grad_factor
    )
  y.backward(torch.tensor(cotangent))
  gradients = [scale_torch.grad.numpy(), zero_point_torch.grad.numpy()]
  if per_tensor:
    gradients = [g.reshape(()) for g in gradients]
  return (y.detach().numpy(), x_torch.grad.numpy(), *gradients)


# -- NumPy predictions of each library's integer -----------------------------


@dataclasses.dataclass(frozen=True)
class _Predicted:
  """Each library's pre-clamp integer per element, from NumPy float32 arithmetic.

  Attributes:
    spec: ``round(x / s) + zp``: the documented formula, jaxquant's forward value.
    torch: ``round(x * (1 / s)) + zp``: PyTorch's forward and cachemask (T1).
    torch_learnable: ``round(zp + x * (1 / s))``: PyTorch's learnable backward
      (T3), with the sum rounded to float32 or, should the compiler contract it
      to a fused multiply-add, not; the two must agree for the element to count.
    tie_distance_ok: the element lies within ``_TIE_ULPS`` ulps of a tie of
      ``x / s`` (the only place where the integers may differ).
  """

  spec: np.ndarray
  torch: np.ndarray
  torch_learnable: np.ndarray
  tie_distance_ok: np.ndarray

  @classmethod
  def of(cls, x, scale, zero_point):
    """``scale`` and ``zero_point`` (integer valued) broadcast against ``x``."""
    x = np.asarray(x, np.float32)
    scale = np.asarray(scale, np.float32)
    zero_point = np.asarray(zero_point, np.float32)
    inverse = np.float32(1) / scale
    quotient = x / scale
    product = x * inverse
    # The integers can reach 2**26 (far outside inputs): add them in float64.
    spec = np.rint(quotient).astype(np.float64) + zero_point
    torch_forward = np.rint(product).astype(np.float64) + zero_point
    learnable_rounded = np.rint(product + zero_point).astype(np.float64)
    fused = np.float32(x.astype(np.float64) * inverse.astype(np.float64) + zero_point)
    learnable_fused = np.rint(fused).astype(np.float64)
    torch_learnable = np.where(
        learnable_rounded == learnable_fused, learnable_rounded, np.nan
    )
    exact = x.astype(np.float64) / scale.astype(np.float64)
    tie_distance = np.abs(np.abs(exact - np.floor(exact)) - 0.5)
    ulp = 2.0**-23 * (np.abs(exact) + np.abs(zero_point) + 1)
    return cls(
        spec, torch_forward, torch_learnable,
        tie_distance <= _TIE_ULPS * ulp,
    )


def _inside(integer, qmin, qmax):
  return (integer >= qmin) & (integer <= qmax)


def _check_left_out(left_out, predicted, *, at_most):
  """The elements not compared are few and all at (near-)ties."""
  assert np.all(predicted.tie_distance_ok[left_out]), "a left-out element is no tie"
  assert left_out.mean() <= at_most, f"{left_out.mean():.1%} of elements left out"


# -- inputs --------------------------------------------------------------------


def _scales(rng, count, kind):
  """Positive float32 scales: powers of two, or random significands."""
  exponents = rng.integers(-9, 1, size=count)
  if kind == "pow2":
    return np.ldexp(np.float32(1), exponents).astype(np.float32)
  return np.ldexp(rng.uniform(1, 2, size=count), exponents).astype(np.float32)


def _inputs(rng, shape, scale, zero_point, qmin, qmax):
  """x in float32: normals past the range plus bounds, ties and far values.

  Args:
    rng: a NumPy generator.
    shape: x's shape.
    scale: float32, broadcast against x.
    zero_point: integer valued, broadcast against x.
    qmin: the range's minimum.
    qmax: the range's maximum.

  Returns:
    x, each special value ``t * scale`` with ``t`` a whole or half number of
    steps, exact in float32 for power-of-two scales.
  """
  low = np.broadcast_to(qmin - zero_point, shape).astype(np.float64)
  high = np.broadcast_to(qmax - zero_point, shape).astype(np.float64)
  center, half_width = (low + high) / 2, (high - low + 1) / 2
  # Mostly in range; about a quarter fall outside (|N(0, 1)| > 1 / 0.87).
  steps = center + rng.standard_normal(shape) * half_width * 0.87
  far = 1000 * (qmax - qmin + 1)
  interior_tie = np.floor(rng.uniform(low, high)) + 0.5
  special = np.stack([
      low, high,  # exactly at the bounds
      low - 0.5, high + 0.5, low + 0.5, high - 0.5,  # ties at the bounds
      low - 1, high + 1, low - 1.5, high + 1.5,  # just outside
      interior_tie, interior_tie,
      low - far, high + far,
  ])
  which = rng.integers(0, len(special), size=shape)
  special = np.take_along_axis(special, which[None], axis=0)[0]
  steps = np.where(rng.uniform(size=shape) < 0.45, special, steps)
  return (steps * scale).astype(np.float32)


def _broadcast(shape, axis, *parameters):
  """Per-channel parameters of ``axis`` shaped to broadcast against x (per tensor: as given)."""
  if axis is None:
    return parameters
  broadcast_shape = [1] * len(shape)
  broadcast_shape[axis] = -1
  return tuple(parameter.reshape(broadcast_shape) for parameter in parameters)


def _assert_bits_equal(actual, expected, where=None, *, zero_sign=True):
  """Equal bit for bit; ``zero_sign=False`` counts -0.0 as +0.0 (T6)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype == np.float32
  if where is not None:
    actual, expected = actual[where], expected[where]
  if not zero_sign:
    actual, expected = actual + np.float32(0), expected + np.float32(0)
  np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def _assert_sums_close(actual, expected, terms):
  """float32 sums equal up to ``_SUM_RTOL`` of the sum of |terms| (per entry)."""
  tolerance = _SUM_RTOL * terms + 1e-30
  error = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
  assert np.all(error <= tolerance), (actual, expected, error / tolerance)


# -- fake_quantize: PyTorch's cachemask ops -----------------------------------


_PER_CHANNEL_LAYOUTS = (
    ((7, 45), 0),
    ((45, 7), 1),
    ((6, 50), -1),
    ((3, 5, 24), 1),
    ((3, 24, 5), -1),
    ((4, 3, 5, 6), 0),
    ((2, 3, 6, 9), 2),
    ((2, 3, 9, 6), -2),
)


def _masked_case(rng, shape, axis, name, narrow_range, scale_kind):
  """Runs both libraries on one random case and checks y and dx."""
  dtype = _QUANTIZED[name][0]
  qmin, qmax = _range(name, narrow_range)
  per_tensor = axis is None
  channels = 1 if per_tensor else shape[axis]
  scale = _scales(rng, channels, scale_kind)
  zero_point = rng.integers(qmin, qmax + 1, size=channels)  # PyTorch needs it in range
  if per_tensor:
    scale, zero_point = scale[0], zero_point[0]
  scale_b, zero_point_b = _broadcast(shape, axis, scale, zero_point)
  x = _inputs(rng, shape, scale_b, zero_point_b, qmin, qmax)
  predicted = _Predicted.of(x, scale_b, zero_point_b)
  inside = _inside(predicted.spec, qmin, qmax)
  same_value = predicted.spec == predicted.torch
  same_mask = inside == _inside(predicted.torch, qmin, qmax)
  # Power-of-two scales make both quotients exact: nothing is left out.
  at_most = 0 if scale_kind == "pow2" else 0.3
  _check_left_out(~same_value, predicted, at_most=at_most)
  _check_left_out(~same_mask, predicted, at_most=at_most)
  cotangent = rng.standard_normal(shape).astype(np.float32)
  compared = np.where(same_mask, cotangent, 0).astype(np.float32)

  def jaxquant(cotangent):
    return _numpy(*_jaxquant_masked(
        jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zero_point, dtype),
        jnp.asarray(cotangent), dtype=dtype, axis=1 if per_tensor else axis,
        narrow_range=narrow_range,
    ))

  y, dx = jaxquant(compared)
  y_torch, dx_torch = _torch_masked(
      x, scale, zero_point, compared, axis=axis, qmin=qmin, qmax=qmax
  )
  _assert_bits_equal(y, y_torch, where=same_value)
  _assert_bits_equal(dx, dx_torch, zero_sign=False)
  # Everywhere, T1's elements included, jaxquant is the documented formula.
  expected_y = (np.clip(predicted.spec, qmin, qmax) - zero_point_b) * scale_b
  _assert_bits_equal(y, expected_y.astype(np.float32))
  _, dx = jaxquant(cotangent)
  _assert_bits_equal(dx, np.where(inside, cotangent, np.float32(0)))
  # The comparison covers both sides of the mask.
  assert 0.1 < inside[same_mask].mean() < 0.95


@pytest.mark.parametrize("scale_kind", ["pow2", "random"])
@pytest.mark.parametrize("narrow_range", [False, True])
@pytest.mark.parametrize("name", list(_QUANTIZED))
def test_fake_quantize_per_tensor_matches_torch(name, narrow_range, scale_kind):
  rng = np.random.default_rng([11, len(name), narrow_range, scale_kind == "pow2"])
  for _ in range(3):
    _masked_case(rng, (40, 50), None, name, narrow_range, scale_kind)


@pytest.mark.parametrize(
    ("layout", "name", "narrow_range"),
    [
        (layout, ("int8", "uint4", "int4", "uint8", "int16")[i % 5], i % 3 == 2)
        for i, layout in enumerate(_PER_CHANNEL_LAYOUTS)
    ],
    ids=str,
)
def test_fake_quantize_per_channel_matches_torch(layout, name, narrow_range):
  shape, axis = layout
  rng = np.random.default_rng([12, *shape, axis % len(shape)])
  for scale_kind in ("pow2", "random", "pow2", "random"):
    _masked_case(rng, shape, axis, name, narrow_range, scale_kind)


# -- fake_quantize_learnable: PyTorch's learnable ops ------------------------


def _agreeing_zero_points(rng, count, qmin, qmax):
  """Float zero points that PyTorch's per-tensor forward and backward round alike (T2).

  A mix of whole numbers from 0 up, fractions from 0 up (never .5) and values
  clamped to either bound.
  """
  whole = rng.integers(0, qmax + 1, size=count).astype(np.float64)
  fraction = rng.uniform(0, qmax, size=count)
  above = qmax + rng.uniform(0.6, 3, size=count)
  below = qmin - rng.uniform(0.6, 3, size=count)
  choice = rng.integers(0, 4, size=count)
  zero_point = np.choose(choice, [whole, fraction, above, below]).astype(np.float32)
  forward = np.clip(np.rint(zero_point), qmin, qmax)
  backward = np.trunc(np.clip(zero_point + np.float32(0.5), qmin, qmax))
  return zero_point[forward == backward]


def _learnable_case(rng, shape, axis, name, narrow_range, scale_kind, grad_factor):
  """Runs both libraries on one random case and checks y, dx, dscale and dzero_point."""
  dtype = _QUANTIZED[name][0]
  qmin, qmax = _range(name, narrow_range)
  per_tensor = axis is None
  channels = 1 if per_tensor else shape[axis]
  scale = _scales(rng, channels, scale_kind)
  if per_tensor:
    zero_point = _agreeing_zero_points(rng, 8, qmin, qmax)[:1]
  else:
    # Any float: halves (rounded to even), negatives and out-of-range ones.
    zero_point = np.where(
        rng.uniform(size=channels) < 0.3,
        np.floor(rng.uniform(qmin - 2, qmax + 2, size=channels)) + 0.5,
        rng.uniform(qmin - 2, qmax + 2, size=channels),
    ).astype(np.float32)
  rounded = np.clip(np.rint(zero_point), qmin, qmax)
  if per_tensor:
    scale, zero_point, rounded = scale[0], zero_point[0], rounded[0]
  scale_b, rounded_b = _broadcast(shape, axis, scale, rounded)
  x = _inputs(rng, shape, scale_b, rounded_b, qmin, qmax)
  predicted = _Predicted.of(x, scale_b, rounded_b)
  same_value = predicted.spec == predicted.torch
  same = same_value & (predicted.spec == predicted.torch_learnable)
  # Power-of-two scales: only T3's ties with an odd zero point are left out.
  _check_left_out(~same_value, predicted, at_most=0 if scale_kind == "pow2" else 0.3)
  _check_left_out(~same, predicted, at_most=0.4)
  cotangent = rng.standard_normal(shape).astype(np.float32)
  compared = np.where(same, cotangent, 0).astype(np.float32)

  def jaxquant(cotangent):
    return _numpy(*_jaxquant_learnable(
        jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zero_point),
        jnp.asarray(cotangent), dtype=dtype, axis=1 if per_tensor else axis,
        narrow_range=narrow_range, grad_factor=grad_factor,
    ))

  y, dx, dscale, dzero_point = jaxquant(compared)
  y_torch, dx_torch, dscale_torch, dzero_point_torch = _torch_learnable(
      x, scale, zero_point, compared, axis=axis, qmin=qmin, qmax=qmax,
      grad_factor=grad_factor,
  )
  _assert_bits_equal(y, y_torch, where=same_value)
  _assert_bits_equal(dx, dx_torch, zero_sign=False)
  assert dscale.shape == dzero_point.shape == dscale_torch.shape == np.shape(scale)

  # The documented LSQ terms in float64: a model for the elements PyTorch cannot check,
  # the tolerance's scale, and proof that the comparison sees every branch.
  q = predicted.spec
  inside, below, above = _inside(q, qmin, qmax), q < qmin, q > qmax
  expected_y = (np.clip(q, qmin, qmax) - rounded_b) * scale_b
  dscale_terms = np.where(
      below, qmin - rounded_b,
      np.where(above, qmax - rounded_b, (expected_y - x) / scale_b),
  )
  dzero_point_terms = np.where(inside, 0, -scale_b)
  reduce = tuple(d for d in range(len(shape)) if per_tensor or d != axis % len(shape))
  for actual, expected, terms in (
      (dscale, dscale_torch, dscale_terms),
      (dzero_point, dzero_point_torch, dzero_point_terms),
  ):
    _assert_sums_close(
        actual, expected, np.abs(grad_factor * compared * terms).sum(axis=reduce)
    )
  assert below[same].any() and above[same].any() and inside[same].any()

  # Every element, T1's and T3's included: jaxquant is the documented formula.
  y, dx, dscale, dzero_point = jaxquant(cotangent)
  _assert_bits_equal(y, expected_y.astype(np.float32))
  _assert_bits_equal(dx, np.where(inside, cotangent, np.float32(0)))
  for actual, terms in ((dscale, dscale_terms), (dzero_point, dzero_point_terms)):
    terms = grad_factor * cotangent.astype(np.float64) * terms
    _assert_sums_close(actual, terms.sum(axis=reduce), np.abs(terms).sum(axis=reduce))


def _learnable_grid():
  """(name, narrow_range): PyTorch needs 0 in a learnable range (T5)."""
  return [
      (name, narrow_range)
      for name in _QUANTIZED
      for narrow_range in (False, True)
      if not (narrow_range and name.startswith("u"))
  ]


@pytest.mark.parametrize("scale_kind", ["pow2", "random"])
@pytest.mark.parametrize(("name", "narrow_range"), _learnable_grid())
def test_fake_quantize_learnable_per_tensor_matches_torch(name, narrow_range, scale_kind):
  rng = np.random.default_rng([13, len(name), narrow_range, scale_kind == "pow2"])
  grad_factor = jq.lsq_grad_factor(40 * 50, dtype=_QUANTIZED[name][0])
  for _ in range(4):
    _learnable_case(rng, (40, 50), None, name, narrow_range, scale_kind, grad_factor)


@pytest.mark.parametrize(
    ("layout", "name", "narrow_range", "grad_factor"),
    [
        (layout, ("uint8", "int8", "uint4", "int4", "int16")[i % 5], i % 5 in (1, 3),
         (1.0, 0.375)[i % 2])
        for i, layout in enumerate(_PER_CHANNEL_LAYOUTS)
    ],
    ids=str,
)
def test_fake_quantize_learnable_per_channel_matches_torch(
    layout, name, narrow_range, grad_factor
):
  shape, axis = layout
  rng = np.random.default_rng([14, *shape, axis % len(shape)])
  for scale_kind in ("pow2", "random", "pow2", "random"):
    _learnable_case(rng, shape, axis, name, narrow_range, scale_kind, grad_factor)


@pytest.mark.slow
def test_fake_quantize_dynamic_matches_torch_with_its_scale():
  rng = np.random.default_rng(15)
  x = (rng.standard_normal((30, 40)) * 3 + 1).astype(np.float32)
  cotangent = rng.standard_normal(x.shape).astype(np.float32)
  for dtype, qmin, qmax in (_QUANTIZED["uint8"], _QUANTIZED["int8"]):
    y, vjp = jax.vjp(lambda x: jq.fake_quantize_dynamic(x, dtype=dtype), jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(cotangent))
    _, scale, zero_point = jq.dynamic_quantize_linear(jnp.asarray(x), dtype=dtype)
    scale, zero_point = np.float32(scale), int(zero_point)
    y_torch, dx_torch = _torch_masked(
        x, scale, zero_point, cotangent, axis=None, qmin=qmin, qmax=qmax
    )
    predicted = _Predicted.of(x, scale, zero_point)
    same_value = predicted.spec == predicted.torch
    _check_left_out(~same_value, predicted, at_most=0.01)
    _assert_bits_equal(y, y_torch, where=same_value)
    # The range covers x: both pass the whole cotangent.
    _assert_bits_equal(dx, dx_torch, zero_sign=False)
    _assert_bits_equal(dx, cotangent)


@pytest.mark.parametrize("axis", [None, 0], ids=["per-tensor", "per-row"])
def test_dynamic_scale_derivative_splits_ties_as_torch_amax_and_amin(axis):
  """``d scale / dx`` of ``dynamic_quantize_linear`` against PyTorch's ``amax`` and ``amin``,
  which pass tied extremes equal shares: three maxima and two minima per row, a random
  cotangent per scale. Both divide by 255 in float32; their float32 sums of the shares
  may round differently (rtol 1e-6)."""
  rng = np.random.default_rng(16)
  x = rng.standard_normal((6, 40)).astype(np.float32)
  x[:, [3, 10, 33]] = np.arange(20, 26).reshape(-1, 1)
  x[:, [5, 6]] = -np.arange(20, 26).reshape(-1, 1)
  cotangent = rng.standard_normal(() if axis is None else (6,)).astype(np.float32)
  _, vjp = jax.vjp(lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.uint8, axis=axis)[1],
                   jnp.asarray(x))
  (dx,) = vjp(jnp.asarray(cotangent))
  x_torch = torch.tensor(x, requires_grad=True)
  dims = dict() if axis is None else dict(dim=1)
  low = torch.clamp(torch.amin(x_torch, **dims), max=0)
  high = torch.clamp(torch.amax(x_torch, **dims), min=0)
  ((high - low) / 255).backward(torch.tensor(cotangent))
  want = x_torch.grad.numpy()
  assert np.count_nonzero(want) == (5 if axis is None else 5 * x.shape[0])
  np.testing.assert_allclose(np.asarray(dx), want, rtol=1e-6)


# -- the bounds: dx is 1 exactly at qmin and qmax, 0 a step beyond ----------


@pytest.mark.parametrize("narrow_range", [False, True])
@pytest.mark.parametrize("name", list(_QUANTIZED))
def test_gradient_at_the_bounds(name, narrow_range):
  dtype = _QUANTIZED[name][0]
  qmin, qmax = _range(name, narrow_range)
  scale = np.float32(0.125)
  steps = np.array([qmin - 1, qmin, qmin + 1, qmax - 1, qmax, qmax + 1], np.float64)
  x = (steps * scale).astype(np.float32)
  expected_y = (np.clip(steps, qmin, qmax) * scale).astype(np.float32)
  expected_dx = np.array([0, 1, 1, 1, 1, 0], np.float32)
  ones = np.ones_like(x)
  # Per channel: one channel per element of x.
  x_row, ones_row, scales = x[None], ones[None], np.full(x.size, scale)
  # A zero point of 0 must lie in the range: narrow uint ranges start at 1
  # (jaxquant's learnable op would clip it to 1, PyTorch refuses it, T5).
  zero_in_range = qmin <= 0

  y, dx = _numpy(*_jaxquant_masked(
      x, scale, jnp.zeros((), dtype), ones, dtype=dtype, axis=1,
      narrow_range=narrow_range,
  ))
  y_channel, dx_channel = _numpy(*_jaxquant_masked(
      x_row, scales, jnp.zeros(x.size, dtype), ones_row, dtype=dtype, axis=1,
      narrow_range=narrow_range,
  ))
  for y_jaxquant in (y, y_channel[0]):
    _assert_bits_equal(y_jaxquant, expected_y)
  for dx_jaxquant in (dx, dx_channel[0]):
    _assert_bits_equal(dx_jaxquant, expected_dx)
  if not zero_in_range:
    return
  y_learnable, dx_learnable, _, _ = _numpy(*_jaxquant_learnable(
      x, scale, np.float32(0), ones, dtype=dtype, axis=1, narrow_range=narrow_range,
      grad_factor=1.0,
  ))
  _assert_bits_equal(y_learnable, expected_y)
  _assert_bits_equal(dx_learnable, expected_dx)
  y_torch, dx_torch = _torch_masked(x, scale, 0, ones, axis=None, qmin=qmin, qmax=qmax)
  y_channel_torch, dx_channel_torch = _torch_masked(
      x_row, scales, np.zeros(x.size, np.int32), ones_row, axis=1, qmin=qmin, qmax=qmax
  )
  y_learnable_torch, dx_learnable_torch, _, _ = _torch_learnable(
      x, scale, np.float32(0), ones, axis=None, qmin=qmin, qmax=qmax, grad_factor=1.0
  )
  for y_torch_op in (y_torch, y_channel_torch[0], y_learnable_torch):
    _assert_bits_equal(y_torch_op, expected_y)
  for dx_torch_op in (dx_torch, dx_channel_torch[0], dx_learnable_torch):
    _assert_bits_equal(dx_torch_op, expected_dx)


def test_jnp_clip_would_halve_the_gradient_at_the_bounds():
  # Why the bounds test matters: the naive formulation gives 0.5 there.
  clip_grad = jax.grad(lambda x: jnp.clip(x, -128.0, 127.0))
  assert float(clip_grad(127.0)) == float(clip_grad(-128.0)) == 0.5
  fake_grad = jax.grad(lambda x: jq.fake_quantize(x, 1.0, dtype=jnp.int8))
  assert float(fake_grad(127.0)) == float(fake_grad(-128.0)) == 1.0


# -- pinned deviations --------------------------------------------------------


def test_t1_torch_multiplies_by_the_inverse_scale():
  rng = np.random.default_rng(16)
  scale = rng.uniform(0.01, 0.1, size=4000).astype(np.float32)
  inverse = np.float32(1) / scale
  # Near-ties at the bound (127.5 steps) and inside the range (63.5 steps).
  at_bound = (np.float32(127.5) * scale).astype(np.float32)
  inside = (np.float32(63.5) * scale).astype(np.float32)
  differ = np.rint(at_bound / scale) != np.rint(at_bound * inverse)
  assert 0.1 < differ.mean() < 0.3  # about 18%: T1 is common near ties
  # Elements where the true division rounds past qmax and the product does not,
  # and elements where the two round to neighbouring integers in range.
  past = np.flatnonzero(differ & (np.rint(at_bound / scale) == 128))[:5]
  neighbours = np.flatnonzero(np.rint(inside / scale) != np.rint(inside * inverse))[:5]
  assert len(past) == len(neighbours) == 5
  x = np.concatenate([at_bound[past], inside[neighbours]])
  scales = np.concatenate([scale[past], scale[neighbours]])
  ones = np.ones_like(x)
  # One scale per element: per channel on a (1, 10) x.
  y, dx = _numpy(*_jaxquant_masked(
      x[None], scales, jnp.zeros(x.size, jnp.int8), ones[None], dtype=jnp.int8,
      axis=1, narrow_range=False,
  ))
  y_torch, dx_torch = _torch_masked(
      x[None], scales, np.zeros(x.size, np.int32), ones[None], axis=1, qmin=-128,
      qmax=127,
  )
  by_division = np.clip(np.rint(x / scales), -128, 127)
  by_inverse = np.clip(np.rint(x * (np.float32(1) / scales)), -128, 127)
  assert np.all(by_division[:5] == 127) and np.all(by_inverse[:5] == 127)
  assert np.all(by_division[5:] != by_inverse[5:])
  _assert_bits_equal(y[0], (by_division * scales).astype(np.float32))
  _assert_bits_equal(y_torch[0], (by_inverse * scales).astype(np.float32))
  # At the bound both values clamp to 127 steps, but only PyTorch passes dx.
  _assert_bits_equal(dx[0], np.array([0] * 5 + [1] * 5, np.float32))
  _assert_bits_equal(dx_torch[0], np.ones(10, np.float32))
  # jaxquant's fake quantizer is its own quantize_linear (a true division).
  q = jq.quantize_linear(x[None], scales, jnp.zeros(x.size, jnp.int8))
  np.testing.assert_array_equal(np.asarray(q[0], np.float64), by_division)


@pytest.mark.parametrize(
    ("zero_point", "forward", "backward"),
    [(-2.3, -2, -1), (-1.0, -1, 0), (-128.0, -128, -127), (2.5, 2, 3)],
)
def test_t2_torch_per_tensor_learnable_rounds_zero_point_twice(zero_point, forward, backward):
  rng = np.random.default_rng(17)
  scale = np.float32(0.5)
  x = (rng.standard_normal(300) * 100).astype(np.float32)
  x[:2] = [-70.0, 70.0]  # sure to be out of range on both sides
  cotangent = rng.standard_normal(x.shape).astype(np.float32)

  def jaxquant(zp):
    return _numpy(*_jaxquant_learnable(
        x, scale, np.float32(zp), cotangent, dtype=jnp.int8, axis=1,
        narrow_range=False, grad_factor=1.0,
    ))

  y_torch, *gradients_torch = _torch_learnable(
      x, scale, np.float32(zero_point), cotangent, axis=None, qmin=-128, qmax=127,
      grad_factor=1.0,
  )
  y, *gradients = jaxquant(zero_point)
  y_forward, *_ = jaxquant(forward)
  _, *gradients_backward = jaxquant(backward)
  # The forward value is the zero point rounded half to even, as jaxquant's.
  _assert_bits_equal(y_torch, y)
  _assert_bits_equal(y_torch, y_forward)
  # PyTorch's gradient is jaxquant's at the truncated zero point ...
  dx_torch, dscale_torch, dzero_point_torch = gradients_torch
  _assert_bits_equal(dx_torch, gradients_backward[0], zero_sign=False)
  np.testing.assert_allclose(dscale_torch, gradients_backward[1], rtol=1e-5)
  np.testing.assert_allclose(dzero_point_torch, gradients_backward[2], rtol=1e-5)
  # ... and not jaxquant's own, which belongs to the forward's zero point.
  assert not np.isclose(dscale_torch, gradients[1], rtol=1e-3)


# int8, s = 1, zp = 1. jaxquant: q = round(x) + 1; PyTorch's learnable backward
# q' = nearbyint(x + 1). Per element: x, y, then (dx, dscale, dzero_point) of
# jaxquant and of PyTorch.
_T3_CASES = (
    # q = 0 + 1 = 1 in range; q' = 2: PyTorch's dscale (2 - 1 - 0.5) / 1.
    (0.5, 0.0, (1, -0.5, 0), (1, 0.5, 0)),
    # q = 126 + 1 = 127 in range; q' = 126.
    (125.5, 126.0, (1, 0.5, 0), (1, -0.5, 0)),
    # q = 126 + 1 = 127 in range; q' = 128 above: dscale qmax - zp.
    (126.5, 126.0, (1, -0.5, 0), (0, 126, -1)),
    # q = -130 + 1 = -129 below: dscale qmin - zp; q' = -128 in range.
    (-129.5, -129.0, (0, -129, -1), (1, 0.5, 0)),
    # No tie: both agree.
    (1.25, 1.0, (1, -0.25, 0), (1, -0.25, 0)),
)


@pytest.mark.parametrize("per_channel", [False, True])
def test_t3_torch_learnable_backward_adds_zero_point_before_rounding(per_channel):
  x = np.array([[case[0] for case in _T3_CASES]], np.float32)
  if per_channel:  # one channel per element, all alike
    scale, zero_point = np.ones(x.size, np.float32), np.ones(x.size, np.float32)
  else:
    scale, zero_point = np.float32(1), np.float32(1)
  for i, (_, expected_y, spec, torch_gradients) in enumerate(_T3_CASES):
    cotangent = np.zeros_like(x)
    cotangent[0, i] = 1
    y_torch, dx_torch, dscale_torch, dzero_point_torch = _torch_learnable(
        x, scale, zero_point, cotangent, axis=1, qmin=-128, qmax=127, grad_factor=1.0
    )
    y, dx, dscale, dzero_point = _numpy(*_jaxquant_learnable(
        x, scale, zero_point, cotangent, dtype=jnp.int8, axis=1,
        narrow_range=False, grad_factor=1.0,
    ))
    # The same forward value ...
    assert y_torch[0, i] == y[0, i] == expected_y
    # ... but PyTorch's gradients are not those of its own y.
    assert (dx[0, i], dscale.sum(), dzero_point.sum()) == spec
    assert (dx_torch[0, i], dscale_torch.sum(), dzero_point_torch.sum()) == torch_gradients


def test_mask_rounds_before_adding_the_zero_point():
  # int8, s = 1, zp = 1. jaxquant: q = round(x / s) + zp, dx = [-128 <= q <= 127]:
  # 126.5 -> 126 + 1 = 127 (in range, dx 1); -129.5 -> -130 + 1 = -129 (out, dx 0).
  # Adding first would flip both: round(127.5) = 128, round(-128.5) = -128.
  x = np.array([126.5, -129.5], np.float32)
  ones = np.ones_like(x)
  expected_y, expected_dx = np.array([126, -129], np.float32), np.array([1, 0], np.float32)
  y, dx = _numpy(*_jaxquant_masked(
      x, np.float32(1), jnp.int8(1), ones, dtype=jnp.int8, axis=1, narrow_range=False
  ))
  y_learnable, dx_learnable, _, _ = _numpy(*_jaxquant_learnable(
      x, np.float32(1), np.float32(1), ones, dtype=jnp.int8, axis=1,
      narrow_range=False, grad_factor=1.0,
  ))
  y_torch, dx_torch = _torch_masked(x, np.float32(1), 1, ones, axis=None, qmin=-128, qmax=127)
  for y_op in (y, y_learnable, y_torch):
    _assert_bits_equal(y_op, expected_y)
  for dx_op in (dx, dx_learnable, dx_torch):
    _assert_bits_equal(dx_op, expected_dx)
  # PyTorch's learnable backward adds first: T3.


# -- NaN and infinity ---------------------------------------------------------


def test_nan_and_infinity():
  # PyTorch converts NaN and inf to int64 here (undefined behaviour, T4), so
  # only jaxquant is asserted; PyTorch's values on x86 are in the docstring.
  x = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
  scale, zero_point = np.float32(0.5), 3
  cotangent = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
  y, dx = _numpy(*_jaxquant_masked(
      x, scale, jnp.int8(zero_point), cotangent, dtype=jnp.int8, axis=1,
      narrow_range=False,
  ))
  qmin_value, qmax_value = (-128 - zero_point) * 0.5, (127 - zero_point) * 0.5
  _assert_bits_equal(y, np.array([qmin_value, qmax_value, qmin_value, 1.0], np.float32))
  _assert_bits_equal(dx, np.array([0, 0, 0, 1], np.float32))

  y, dx, dscale, dzero_point = _numpy(*_jaxquant_learnable(
      x, scale, np.float32(zero_point), cotangent, dtype=jnp.int8, axis=1,
      narrow_range=False, grad_factor=1.0,
  ))
  _assert_bits_equal(y, np.array([qmin_value, qmax_value, qmin_value, 1.0], np.float32))
  _assert_bits_equal(dx, np.array([0, 0, 0, 1], np.float32))
  # NaN adds nothing; +inf is above (127 - 3), -inf below (-128 - 3); 1.0 is
  # exact (dscale 0).
  assert float(dscale) == (127 - 3) + (-128 - 3)
  assert float(dzero_point) == -2 * 0.5

  # NaN alone: no gradient to anything, and a finite value.
  nan = np.array([np.nan], np.float32)
  y, dx, dscale, dzero_point = _numpy(*_jaxquant_learnable(
      nan, scale, np.float32(zero_point), np.ones(1, np.float32), dtype=jnp.int8,
      axis=1, narrow_range=False, grad_factor=1.0,
  ))
  assert y[0] == qmin_value and dx[0] == 0 and dscale == 0 and dzero_point == 0


@pytest.mark.parametrize("rhs", ["float", "stored"])
def test_int8_drop_in_gradients_are_torchs_fake_quant_matmul(rhs):
  """dot_general_dynamic_int8's straight-through gradients against PyTorch's autograd
  through ``fake_quantize_per_channel_affine`` of x per row and of w per column (scales
  ``max|.| / 127``, held constant) and a matmul. Each row's and column's maximum is
  ``127 * 2**-k``, so every scale is a power of two and PyTorch's ``x * (1 / s)`` is
  jaxquant's ``x / s`` (T1). The two matmuls sum in their own orders: float32 tolerance.
  A stored kernel (its scales the same) gives the same gradient for x."""
  rng = np.random.default_rng(31)
  rows, depth, columns = 6, 40, 8
  x_scale = np.exp2(rng.integers(-8, 0, rows)).astype(np.float32)
  w_scale = np.exp2(rng.integers(-10, -4, columns)).astype(np.float32)
  x = (rng.uniform(-1, 1, (rows, depth)) * 127 * x_scale[:, None]).astype(np.float32)
  w = (rng.uniform(-1, 1, (depth, columns)) * 127 * w_scale).astype(np.float32)
  x[np.arange(rows), rng.integers(0, depth, rows)] = 127 * x_scale  # the rows' maxima
  w[rng.integers(0, depth, columns), np.arange(columns)] = -127 * w_scale
  cotangent = rng.standard_normal((rows, columns)).astype(np.float32)

  tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
  fake = lambda t, s, axis: torch.fake_quantize_per_channel_affine(
      t, torch.tensor(s), torch.zeros(s.size, dtype=torch.int32), axis, -128, 127)
  (fake(tx, x_scale, 0) @ fake(tw, w_scale, 1)).backward(torch.tensor(cotangent))

  kernel = w if rhs == "float" else jq.quantize_params(w, jq.QuantizationRule(dtype=jnp.int8))
  dense = (((1,), (0,)), ((), ()))
  _, pullback = jax.vjp(lambda x, w: jq.dot_general_dynamic_int8(x, w, dense), x, kernel)
  x_gradient, w_gradient = pullback(cotangent)
  tolerance = dict(rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(x_gradient, tx.grad.numpy(), **tolerance)
  if rhs == "float":
    np.testing.assert_allclose(w_gradient, tw.grad.numpy(), **tolerance)
