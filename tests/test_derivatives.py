"""Every documented derivative works on every implementation, and agrees.

A Pallas kernel has no derivative of its own; each op's Pallas path takes the
derivative of its XLA evaluation (``_dispatch.with_xla_derivatives``), so the
two implementations must agree to the bit, first and second order, forward and
reverse mode, and under ``vmap``.
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from quant_testing import assert_bits_equal
from quant_testing import assert_tree_bits_equal
from quant_testing import dtype_name
from quant_testing import IMPLEMENTATIONS
from quant_testing import model_calls
from quant_testing import spec_symmetric_scale
from quant_testing import spec_nbits_weight


def _assert_same(results):
  xla, pallas = results["xla"], results["pallas"]
  for a, b in zip(jax.tree.leaves(xla), jax.tree.leaves(pallas)):
    assert_bits_equal(b, a)


def _per_implementation(function):
  return {implementation: function(implementation) for implementation in IMPLEMENTATIONS}


Q = jnp.asarray(np.random.default_rng(0).integers(-128, 128, (6, 64)), jnp.int8)
X = jnp.asarray(np.random.default_rng(1).normal(0, 3, (6, 64)), jnp.float32)
DEQUANTIZE_LAYOUTS = {
    "per-tensor": (jnp.float32(0.3), {}),
    "per-axis": (jnp.linspace(0.1, 1.0, 6), {"axis": 0}),
    "blocked": (jnp.linspace(0.1, 1.0, 12).reshape(6, 2), {"axis": 1, "block_size": 32}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", DEQUANTIZE_LAYOUTS)
def test_dequantize_scale_derivatives(layout):
  scale, options = DEQUANTIZE_LAYOUTS[layout]
  weights = jnp.linspace(-1, 1, Q.size).reshape(Q.shape)

  def derivatives(implementation):
    def loss(scale):
      zero_point = jnp.full(scale.shape, 3, jnp.int8)
      y = jq.dequantize_linear(Q, scale, zero_point, implementation=implementation, **options)
      return jnp.sum(weights * y ** 2)

    tangent = jax.jvp(lambda s: jq.dequantize_linear(
        Q, s, implementation=implementation, **options), (scale,), (jnp.ones_like(scale),))
    batched = jax.vmap(jax.grad(loss))(jnp.stack([scale, 2 * scale]))
    return jax.grad(loss)(scale), jax.hessian(loss)(scale), tangent, batched

  results = _per_implementation(derivatives)
  assert np.any(np.asarray(results["xla"][0]) != 0)
  _assert_same(results)


def test_packed_dequantize_scale_derivative():
  packed = jq.pack(Q.astype(jnp.int4).reshape(-1))

  def derivatives(implementation):
    return jax.grad(lambda s: jnp.sum(jq.dequantize_linear(
        packed, s, packed_shape=Q.shape, packed_dtype=jnp.int4,
        implementation=implementation)))(jnp.float32(0.5))

  _assert_same(_per_implementation(derivatives))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8], ids=dtype_name)
def test_quantize_derivatives(dtype):
  # Float8 outputs carry XLA's derivative of the cast; integer outputs none (float0).
  def derivatives(implementation):
    def quantize(x, scale):
      return jq.quantize_linear(x, scale, output_dtype=dtype, implementation=implementation)

    return jax.jvp(quantize, (X, jnp.float32(0.5)), (jnp.ones_like(X), jnp.float32(1.0)))

  _assert_same(_per_implementation(derivatives))


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"axis": 0}, {"axis": 1, "block_size": 16}],
                         ids=["per-tensor", "per-row", "blocked"])
def test_dynamic_quantize_scale_derivative(options):
  def derivatives(implementation):
    def scale_sum(x):
      return jnp.sum(jq.dynamic_quantize_linear(
          x, dtype=jnp.int8, implementation=implementation, **options)[1])

    return jax.grad(scale_sum)(X), jax.jvp(scale_sum, (X,), (jnp.ones_like(X),))

  results = _per_implementation(derivatives)
  assert np.any(np.asarray(results["xla"][0]) != 0)
  _assert_same(results)


@pytest.mark.parametrize("axis", [None, 0], ids=["per-tensor", "per-row"])
def test_dynamic_quantize_scale_derivative_splits_ties_evenly(axis):
  """``d scale / dx`` is that of the range from ``jnp.min`` and ``jnp.max``: an
  extreme that several elements share passes each the same part (JAX's
  derivative of jaxquant's one-pass variadic reduce would weight them by their
  places in a tree of pairs)."""
  x = np.asarray(X).copy()
  x[:, [3, 10, 40]] = np.arange(20, 26).reshape(-1, 1)  # three maxima per row ...
  x[:, [5, 6]] = -np.arange(20, 26).reshape(-1, 1)  # ... and two minima
  axes = None if axis is None else 1

  def reference(x):
    low = jnp.minimum(jnp.min(x, axis=axes), 0)
    high = jnp.maximum(jnp.max(x, axis=axes), 0)
    return jnp.sum((high - low) / 255)

  want = jax.grad(reference)(jnp.asarray(x))
  assert np.count_nonzero(np.asarray(want)) == (5 if axis is None else 5 * x.shape[0])
  for implementation in IMPLEMENTATIONS:
    got = jax.grad(lambda x: jnp.sum(jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=axis, implementation=implementation)[1]))(jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=implementation)


# Blocks of 12 over 64 columns are five whole windows and a short last one reduced apart
# (_granularity.reduce_windows): blocks of 8, whole windows only, would add no path.
@pytest.mark.parametrize("block_size", [12, 64], ids=["ragged", "one-block"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["minmax", "symmetric"])
def test_dynamic_quantize_blocked_scale_derivative_splits_ties_evenly(block_size, symmetric):
  """Per block too, an extreme that several elements of a block share passes each the
  same part of ``d scale / dx`` (JAX's ``reduce_window_max`` derivative gave it all to
  the first of them)."""
  x = np.asarray(X).copy()
  x[:, [1, 3, 5]] = np.arange(20, 26).reshape(-1, 1)  # three maxima in the first block ...
  x[:, [9, 10]] = -np.arange(20, 26).reshape(-1, 1)  # ... two minima (five of max|x|) ...
  x[:, [60, 63]] = np.arange(30, 36).reshape(-1, 1)  # ... two maxima in the (short) last one

  def reference(x):
    total = 0.0
    for start in range(0, x.shape[1], block_size):
      block = x[:, start:start + block_size]
      if symmetric:
        total += jnp.sum(jnp.max(jnp.abs(block), axis=1) / 127)
      else:
        low = jnp.minimum(jnp.min(block, axis=1), 0)
        high = jnp.maximum(jnp.max(block, axis=1), 0)
        total += jnp.sum((high - low) / 255)
    return total

  want = jax.grad(reference)(jnp.asarray(x))
  for implementation in IMPLEMENTATIONS:
    got = jax.grad(lambda x: jnp.sum(jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=1, block_size=block_size, symmetric=symmetric,
        implementation=implementation)[1]))(jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=implementation)


def _symmetric_scale(x, kept, dtype=jnp.int8):
  """The drop-ins' scale of x, one per index of the ``kept`` dims."""
  return spec_symmetric_scale(x, tuple(d for d in range(np.ndim(x)) if d not in kept), dtype)


def _fake_quantized(x, scale, zero_point=None, dtype=jnp.int8):
  return jq.fake_quantize(x, scale, zero_point, dtype=dtype)


def _straight_through_cases():
  """name -> (drop-in, its arrays, the float product of its fake-quantized operands)."""
  calls = model_calls()
  dense, sequence = (((1,), (0,)), ((), ())), (((2,), (0,)), ((), ()))
  conv = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  cases = {}
  for name in ("dot_general_dynamic_int8", "dot_general_dynamic_int8 stored"):
    function, (x, w) = calls[name]
    weight = (lambda w: w.dequantize()) if "stored" in name else (
        lambda w, s=_symmetric_scale(w, (1,)): _fake_quantized(w, s))
    cases[name] = function, (x, w), lambda x, w, s=_symmetric_scale(x, (0,)), weight=weight: (
        lax.dot_general(_fake_quantized(x, s), weight(w), dense))
  x, w = calls["dot_general_dynamic_int8"][1]
  cases["dot_general_dynamic_int8 int4 x int2"] = (
      lambda x, w: jq.dot_general_dynamic_int8(x, w, dense, lhs_dtype=jnp.int4,
                                               rhs_dtype=jnp.int2), (x, w),
      lambda x, w, s=_symmetric_scale(x, (0,), jnp.int4), t=_symmetric_scale(w, (1,), jnp.int2): (
          lax.dot_general(_fake_quantized(x, s, dtype=jnp.int4),
                          _fake_quantized(w, t, dtype=jnp.int2), dense)))
  function, (x, w, scale, zero_point) = calls["dot_general_static_int8"]
  x = x * 8  # a part of x saturates at the calibrated scale
  cases["dot_general_static_int8"] = function, (x, w, scale, zero_point), (
      lambda x, w, scale, zero_point, s=_symmetric_scale(w, (1,)): lax.dot_general(
          _fake_quantized(x, scale, zero_point), _fake_quantized(w, s), sequence))
  function, (image, stored) = calls["conv_general_dilated_dynamic_int8"]
  float_kernel = calls["conv_general_dilated_static_int8"][1][1]
  # Per-example image scales with a stored kernel here, a float kernel with batch groups
  # (and in the static drop-in) below: each operand is quantized on its own, so a float
  # kernel with per-example image scales would add no path.
  cases["conv_general_dilated_dynamic_int8 stored"] = function, (image, stored), (
      lambda x, w, s=_symmetric_scale(image, (0,)): lax.conv_general_dilated(
          _fake_quantized(x, s), w.dequantize(), **conv))
  # Batch groups: one scale for the whole input (per example would mix the groups' scales).
  grouped = dict(conv, batch_group_count=2)
  cases["conv_general_dilated_dynamic_int8 batch groups"] = (
      lambda x, w: jq.conv_general_dilated_dynamic_int8(x, w, **grouped), (image, float_kernel),
      lambda x, w, s=_symmetric_scale(image, ()), t=_symmetric_scale(float_kernel, (3,)): (
          lax.conv_general_dilated(_fake_quantized(x, s), _fake_quantized(w, t), **grouped)))
  function, (image, kernel, scale, zero_point) = calls["conv_general_dilated_static_int8"]
  image = image * 8
  cases["conv_general_dilated_static_int8"] = function, (image, kernel, scale, zero_point), (
      lambda x, w, scale, zero_point, s=_symmetric_scale(kernel, (3,)): (
          lax.conv_general_dilated(_fake_quantized(x, scale, zero_point),
                                   _fake_quantized(w, s), **conv)))
  return cases


STRAIGHT_THROUGH = _straight_through_cases()


@pytest.mark.parametrize("name", STRAIGHT_THROUGH)
def test_inference_drop_ins_have_the_straight_through_derivative(name):
  """The int8 drop-ins differentiate as the float product of their fake-quantized operands
  (the scales held constant): for x and a float kernel, round's derivative taken as 1 inside
  the range, 0 where a calibrated scale saturates; a stored kernel's scale as ``dequantize()``'s.
  The same bits, for a loss linear in the result (its value differs from the float product's
  by rounding); second order to rounding."""
  function, arrays, reference = STRAIGHT_THROUGH[name]
  cotangent = np.random.default_rng(3).standard_normal(
      jax.eval_shape(function, *arrays).shape).astype(np.float32)

  def gradients(product):
    linear = lambda *a: jnp.sum(cotangent * product(*a))
    return jax.grad(linear, argnums=(0, 1), allow_int=True)(*arrays)

  got, want = gradients(function), gradients(reference)
  assert_tree_bits_equal(got, want)
  x_gradient = np.asarray(got[0])
  assert np.any(x_gradient != 0)
  if "static" in name:
    assert np.any(x_gradient == 0)  # saturated elements
  curved = lambda product: jax.grad(lambda x: jnp.sum(jnp.sin(product(x, *arrays[1:]))))
  tangent = np.ones_like(arrays[0])
  (_, got), (_, want) = (jax.jvp(curved(f), (arrays[0],), (tangent,)) for f in (function, reference))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.max(np.abs(want)))


@pytest.mark.parametrize("name", STRAIGHT_THROUGH)
def test_differentiated_drop_ins_return_the_integer_product(name):
  """Under ``jax.jvp`` and ``jax.vjp`` (so ``jax.value_and_grad``'s loss) the int8 drop-ins'
  value is their own integer product, bit for bit, not the float product of the fake-quantized
  operands whose derivative they take: a training loop reports the loss the served model has."""
  function, arrays, _ = STRAIGHT_THROUGH[name]
  want = function(*arrays)
  x, rest = arrays[0], arrays[1:]
  got, _ = jax.jvp(lambda x: function(x, *rest), (x,), (jnp.ones_like(x),))
  assert_bits_equal(got, want)
  got, _ = jax.vjp(lambda x: function(x, *rest), x)
  assert_bits_equal(got, want)


def test_quantized_add_derivatives():
  def derivatives(implementation):
    def add(a_scale):
      return jq.quantized_add(Q, a_scale, None, Q, 0.25, None, 0.3,
                              implementation=implementation)

    return jax.jvp(add, (jnp.float32(0.1),), (jnp.float32(1.0),))

  _assert_same(_per_implementation(derivatives))


def test_matmul_nbits_derivatives():
  """The docstring's gradients, for ``a``, ``scales`` and ``bias``: those of ``a @ W.T + bias``
  with ``W = (q - z) * s`` (to float32 summation error), the same bits on both implementations."""
  function, (a, b, scales, zero_points, bias) = model_calls()["matmul_nbits"]
  cotangent = np.random.default_rng(2).standard_normal((a.shape[0], bias.size)).astype(np.float32)
  k, n, block_size = a.shape[1], bias.size, 16
  difference = spec_nbits_weight(b, np.ones_like(scales), zero_points, k=k, n=n, bits=4,
                                 block_size=block_size)
  weight = difference * np.repeat(scales, block_size, axis=1)
  weight_gradient = cotangent.T @ a
  want = (cotangent @ weight,
          (weight_gradient * difference).reshape(n, -1, block_size).sum(-1),
          cotangent.sum(0))

  def derivatives(implementation):
    def loss(a, scales, bias):
      y = jq.matmul_nbits(a, b, scales, zero_points, bias, K=k, N=n, block_size=block_size,
                          implementation=implementation)
      return jnp.sum(cotangent * y)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a, scales, bias)

  results = _per_implementation(derivatives)
  _assert_same(results)
  for got, expected, of in zip(results["xla"], want, ("a", "scales", "bias")):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=of)


def test_quantized_dot_general_float_second_order():
  """Float operands' derivatives are those of ``dot_general`` of fake-quantized operands, to
  second order: a Hessian-vector product equals that of the product written so."""
  _, (x, w, x_scale, w_scale) = model_calls()["quantized_dot_general float"]
  dims = (((1,), (0,)), ((), ()))
  rng = np.random.default_rng(3)
  tangents = (rng.standard_normal(x.shape).astype(np.float32),
              rng.standard_normal(w.shape).astype(np.float32))

  def quantized(x, w):
    return jq.quantized_dot_general(x, w, dims, lhs_scale=x_scale, rhs_scale=w_scale)

  def reference(x, w):
    return jax.lax.dot_general(
        jq.fake_quantize(x, x_scale, axis=None), jq.fake_quantize(w, w_scale, axis=None), dims,
        precision=jax.lax.Precision.HIGHEST)

  def hessian_vector_product(function):
    gradient = jax.grad(lambda x, w: jnp.sum(jnp.sin(function(x, w))), argnums=(0, 1))
    return jax.jit(lambda x, w: jax.jvp(gradient, (x, w), tangents)[1])(x, w)

  got, want = hessian_vector_product(quantized), hessian_vector_product(reference)
  assert np.any(np.asarray(want[0]) != 0)
  for g, e, of in zip(got, want, ("x", "w")):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4, err_msg=of)


@pytest.mark.parametrize("name", ["dot_general_dynamic_int8", "dot_general_static_int8"])
def test_drop_in_gradients_under_vmap_and_export(name):
  """The straight-through gradient mapped over a batch is each example's, and exported with a
  symbolic batch (jax.export) it runs as the jitted one."""
  function, (x, *rest) = model_calls()[name]
  gradient = jax.grad(lambda x: jnp.sum(jnp.sin(function(x, *rest))))
  batch = jnp.stack([x, 2 * x, -x])
  assert_bits_equal(jax.vmap(gradient)(batch), jnp.stack([gradient(b) for b in batch]))
  (size,) = jax.export.symbolic_shape("b")
  exported = jax.export.export(jax.jit(gradient))(
      jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype))
  assert_bits_equal(exported.call(x), jax.jit(gradient)(x))
