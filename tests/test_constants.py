"""Closed-over constants: every op gives the bits it gives on traced arguments.

A weight closed over by ``jax.jit`` is a compile-time constant, and XLA folds
and rewrites constants: it once folded the NaN guard of jaxquant's division and
turned ``x / scale`` into ``x * (1 / scale)``, which moves quotients that are
exact ``.5`` ties by one ulp (x = 57.101753, scale = 0.91362804: 62.5 rounds to
62, the reciprocal multiply gave 63). Each case runs an op three ways: its
operands traced, x a constant with the scale traced, and everything constant;
the inputs sit on rounding ties for their scale, where a reciprocal multiply is
wrong for about one quotient in five.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from quant_testing import assert_bits_equal
from quant_testing import assert_tree_bits_equal
from quant_testing import elementwise_calls
from quant_testing import IMPLEMENTATIONS
from quant_testing import model_calls


def _ties(shape, scale, seed=0):
  """x whose quotient by ``scale`` (broadcast) is, in exact arithmetic, k + 1/2."""
  rng = np.random.default_rng(seed)
  k = rng.integers(-120, 120, shape) + 0.5
  return (k * np.asarray(scale, np.float64)).astype(np.float32)


def _scales(layout):
  rng = np.random.default_rng(1)
  if layout == "per-tensor":
    return np.float32(0.91362804), {}
  if layout == "per-axis":
    return rng.uniform(0.3, 1.7, 64).astype(np.float32), {"axis": 1}
  return rng.uniform(0.3, 1.7, (32, 4)).astype(np.float32), {"axis": 1, "block_size": 16}


def _broadcast(scale, layout):
  if layout == "blocked":
    return np.repeat(scale, 16, axis=1)
  return scale


def _three_ways(op, x, scale):
  """op(x, scale) with both traced, with x constant, and with both constant."""
  traced = jax.jit(op)(x, scale)
  x_constant = jax.jit(lambda scale: op(jnp.asarray(x), scale))(scale)
  constant = jax.jit(lambda: op(jnp.asarray(x), jnp.asarray(scale)))()
  return traced, x_constant, constant


def _assert_all_equal(results, expected):
  for result in results:
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_reported_tie():
  x = np.full(256, 57.101753, np.float32)
  scale = np.float32(0.91362804)
  results = _three_ways(lambda x, s: jq.quantize_linear(x, s, output_dtype=jnp.int8), x, scale)
  _assert_all_equal(results, np.full(256, 62, np.int8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["per-tensor", "per-axis", "blocked"])
def test_quantize_linear(layout, implementation):
  scale, options = _scales(layout)
  x = _ties((32, 64), _broadcast(scale, layout))
  expected = np.clip(np.rint(x / _broadcast(scale, layout)), -128, 127).astype(np.int8)
  assert np.mean(np.rint(x * (1 / _broadcast(scale, layout))) != expected) > 0.05, (
      "the data must tell a true division from a reciprocal multiply")

  def op(x, scale):
    return jq.quantize_linear(x, scale, output_dtype=jnp.int8, implementation=implementation,
                              **options)

  _assert_all_equal(_three_ways(op, x, scale), expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("packed", [False, True], ids=["int8", "packed int4"])
@pytest.mark.parametrize("layout", ["per-tensor", "per-axis", "blocked"])
def test_dequantize_linear(layout, packed, implementation):
  # A stored weight dequantized inside jit is the weight-only layer's first step.
  scale, options = _scales(layout)
  full = _broadcast(scale, layout)
  rng = np.random.default_rng(5)
  low, high = (-8, 8) if packed else (-128, 128)
  codes = rng.integers(low, high, (32, 64))
  zero_point = rng.integers(low, high, np.shape(scale))
  expected = ((codes - _broadcast(zero_point, layout)) * full).astype(np.float32)
  if packed:
    x = np.asarray(jq.pack(codes.astype(jnp.int4)))
    zero_point = zero_point.astype(jnp.int4)
    options = {**options, "packed_shape": codes.shape}
  else:
    x, zero_point = codes.astype(np.int8), zero_point.astype(np.int8)

  def op(x, scale):
    return jq.dequantize_linear(x, scale, zero_point, implementation=implementation, **options)

  _assert_all_equal(_three_ways(op, x, scale), expected)


@pytest.mark.parametrize("layout", ["per-tensor", "per-axis", "blocked"])
def test_fake_quantize(layout):
  scale, options = _scales(layout)
  full = _broadcast(scale, layout)
  x = _ties((32, 64), full)
  expected = (np.clip(np.rint(x / full), -128, 127) * full).astype(np.float32)
  _assert_all_equal(
      _three_ways(lambda x, s: jq.fake_quantize(x, s, **options), x, scale), expected)
  _assert_all_equal(
      _three_ways(lambda x, s: jq.fake_quantize_learnable(x, s, jnp.zeros_like(s), **options),
                  x, scale),
      expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_quantized_add(implementation):
  # b adds nothing and out_scale = 2 * a_scale: the odd a are (near) ties.
  rng = np.random.default_rng(2)
  a = rng.integers(-128, 128, 4096).astype(np.int8)
  b = np.zeros(4096, np.int8)
  out_scale = np.float32(0.91362804)
  a_scale, b_scale = out_scale / 2, np.float32(0.0219)
  total = a.astype(np.float32) * a_scale
  expected = np.clip(np.rint(total / out_scale), -128, 127)
  assert np.mean(np.rint(total * (1 / out_scale)) != expected) > 0.05, (
      "the data must tell a true division from a reciprocal multiply")

  def op(a, out_scale):
    return jq.quantized_add(a, a_scale, None, b, b_scale, None, out_scale,
                            implementation=implementation)

  _assert_all_equal(_three_ways(op, a, out_scale), expected.astype(np.int8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("options", [{}, {"axis": 0}, {"axis": 1, "block_size": 16}],
                         ids=["per-tensor", "per-row", "blocked"])
def test_dynamic_quantize(options, implementation):
  rng = np.random.default_rng(3)
  x = rng.normal(size=(16, 4096)).astype(np.float32)
  eager = jq.dynamic_quantize_linear(x, dtype=jnp.int8, implementation=implementation,
                                     **options)
  constant = jax.jit(lambda: jq.dynamic_quantize_linear(
      jnp.asarray(x), dtype=jnp.int8, implementation=implementation, **options))()
  _assert_all_equal([constant], eager)
  fake = jax.jit(lambda: jq.fake_quantize_dynamic(jnp.asarray(x), dtype=jnp.int8, **options))()
  _assert_all_equal([fake], jq.fake_quantize_dynamic(x, dtype=jnp.int8, **options))


def test_splat_and_vmapped_constants():
  # XLA turns a constant of equal elements into a broadcast, and vmap
  # broadcasts whatever is not batched: neither may expose a broadcast divisor.
  scale = np.float32(0.91362804)
  op = functools.partial(jq.quantize_linear, output_dtype=jnp.int8)
  expected = np.full((4, 256), 62, np.int8)  # 57.101753 / scale = 62.5 in float32
  splat = jnp.full((4, 256), 57.101753, jnp.float32)
  ties = _ties((4, 256), scale)
  results = [
      jax.jit(lambda s: op(splat, s))(scale),
      jax.jit(lambda s: op(jnp.full((4, 256), 57.101753, jnp.float32), s))(scale),
      jax.jit(jax.vmap(lambda s: op(splat[0], s)))(jnp.full(4, scale)),
      jax.jit(jax.vmap(lambda x: op(x, scale)))(splat),
      jax.jit(jax.vmap(op, in_axes=(0, None)))(splat, scale),
      jax.jit(lambda: jax.vmap(lambda x: op(x, scale))(splat))(),
      jax.jit(lambda s: jax.vmap(lambda x: op(x, s))(splat))(scale),
  ]
  _assert_all_equal(results, [expected] * len(results))
  ties_expected = np.clip(np.rint(ties / scale), -128, 127).astype(np.int8)
  _assert_all_equal([jax.jit(jax.vmap(lambda s: op(jnp.asarray(ties), s)))(
      jnp.full(3, scale))], [np.broadcast_to(ties_expected, (3, 4, 256))])


@pytest.mark.xla_cpu
def test_compiled_program_divides():
  # The check in XLA's own terms: a closed-over x still compiles to a divide.
  x = _ties((256,), np.float32(0.91362804))
  compiled = jax.jit(
      lambda s: jq.quantize_linear(jnp.asarray(x), s, output_dtype=jnp.int8)
  ).lower(np.float32(0.91362804)).compile().as_text()
  # An element-wise divide, not the scalar 1 / scale of a reciprocal multiply.
  assert re.search(r"f32\[256\]\{0\} divide\(", compiled), compiled


_STATISTICS = {
    "absmax per axis": lambda w: jq.choose_qparams(w, jnp.int8, axis=1),
    "minmax per tensor": lambda w: jq.choose_qparams(w, jnp.uint8, method="minmax"),
    "percentile": lambda w: jq.choose_qparams(w, jnp.int8, method="percentile"),
    "absmax in blocks": lambda w: jq.choose_qparams(w, jnp.int4, axis=1, block_size=32),
    "dynamic uint8": lambda w: jq.dynamic_quantize_linear(w),
    "dynamic symmetric per row": lambda w: jq.dynamic_quantize_linear(
        w, dtype=jnp.int8, axis=0, symmetric=True),
    "dynamic int8 dot": lambda w: jq.dot_general_dynamic_int8(
        jnp.ones((4, 64)), w, (((1,), (0,)), ((), ()))),
    # Rows of 32K+ columns take another reduction (integer keys): before, folded.
    "dynamic symmetric per column, wide rows": lambda w: jq.dynamic_quantize_linear(
        w, dtype=jnp.int8, axis=1, symmetric=True),
}


@pytest.mark.parametrize("statistic", _STATISTICS)
def test_statistics_of_a_closed_over_weight_are_not_folded(statistic):
  # XLA's evaluator folds a reduction of a constant while compiling, at about
  # a second per million elements (a sort: minutes), for statistics that take
  # a millisecond to compute: jaxquant keeps them in the program. Small here,
  # so that folding would be quick: the compiled program must still reduce.
  shape = (2, 32768 + 3) if "wide rows" in statistic else (64, 128)
  w = jnp.asarray(np.random.default_rng(4).standard_normal(shape), jnp.float32)
  compiled = jax.jit(lambda: _STATISTICS[statistic](w)).lower().compile().as_text()
  assert re.search(r"= \S+ (reduce|reduce-window|sort)\(", compiled), compiled
  _assert_all_equal([jax.jit(lambda: _STATISTICS[statistic](w))()],
                    jax.jit(_STATISTICS[statistic])(w))


@pytest.mark.parametrize("name", model_calls())
def test_matmul_ops_and_drop_ins(name):
  # The layer's weights, scales and zero points closed over (how a model calls
  # it), then the activations too: XLA may fold and rewrite all but x, or all.
  function, (x, *weights) = model_calls()[name]
  traced = jax.jit(function)(x, *weights)
  assert_bits_equal(jax.jit(lambda x: function(x, *weights))(x), traced, "weights constant")
  assert_bits_equal(jax.jit(lambda: function(x, *weights))(), traced, "all constant")


# The ops whose results no rounding tie above decides: packing, statistics, stored
# parameters and observers, as quant_testing.elementwise_calls calls them.
@pytest.mark.parametrize("name", [
    "unpack int4", "pack int2 rows", "choose_qparams mse blocked",
    "choose_qparams percentile per-row", "quantize_params and dequantize_params int4",
    "observer_qparams moving average", "observer_qparams percentile",
])
def test_other_ops_closed_over(name):
  function, args = elementwise_calls()[name]
  assert_tree_bits_equal(jax.jit(lambda: function(*args))(), jax.jit(function)(*args),
                         "all constant")
