"""Differential fuzzing: every op gives the same bits however a model calls it.

Each example draws an op's inputs (dtypes, a granularity, a shape of rank 0 to
6 with empty and ragged-block cases, values on rounding ties and their float
neighbours, NaN, +-inf, +-0 and dtype extremes) and calls the op four ways:
directly, under ``jax.jit`` with traced arguments, under ``jax.jit`` with the
arguments closed over as compile-time constants (which XLA folds), and under
``jax.vmap`` over two such inputs. All four must agree to the bit, for each
implementation. The ``ci`` hypothesis profile runs a few examples per op; run
``HYPOTHESIS_PROFILE=thorough pytest tests/test_fuzz.py`` for more.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from quant_testing import assert_bits_equal
from quant_testing import bit_width
from quant_testing import expand_scale
from quant_testing import FLOAT4
from quant_testing import FLOAT8_DTYPES
from quant_testing import FLOAT_DTYPES
from quant_testing import IMPLEMENTATIONS
from quant_testing import INT32
from quant_testing import INTEGER_DTYPES_TO_16_BITS

# Every example compiles its op four ways: the whole suite is slow.
pytestmark = pytest.mark.slow

INTEGER_OUTPUTS = INTEGER_DTYPES_TO_16_BITS + (INT32,)
FLOAT_OUTPUTS = FLOAT8_DTYPES + (FLOAT4,)
# quantized_add's operands and output here.
ADD_DTYPES = tuple(d for d in INTEGER_DTYPES_TO_16_BITS if 4 <= bit_width(d) <= 8)


def _examples() -> int:
  return max(4, hypothesis.settings.default.max_examples // 4)


@dataclasses.dataclass(frozen=True)
class Layout:
  scale_shape: tuple[int, ...]
  options: dict[str, int]


@st.composite
def _shapes(draw, min_rank=0):
  rank = draw(st.integers(min_rank, 6))
  shape = draw(st.lists(st.integers(0, 5), min_size=rank, max_size=rank))
  if math.prod(shape) > 256:
    shape = [min(n, 2) for n in shape]
  return tuple(shape)


@st.composite
def _layouts(draw, shape):
  kinds = ["per-tensor"] + (["per-axis", "blocked"] if len(shape) >= 2 else [])
  kind = draw(st.sampled_from(kinds))
  if kind == "per-tensor":
    return Layout(draw(st.sampled_from([(), (1,)])), {})
  axis = draw(st.integers(0, len(shape) - 1))
  if kind == "per-axis":
    return Layout((shape[axis],), {"axis": axis})
  block = draw(st.integers(1, 4))
  blocked = tuple(-(-n // block) if d == axis else n for d, n in enumerate(shape))
  return Layout(blocked, {"axis": axis, "block_size": block})


def _scales(rng, shape, dtype):
  scale = rng.choice(np.float32([0.1, 0.37, 0.91362804, 1.0, 2.5, 1 / 3]), shape)
  return scale.astype(dtype)


def _float_values(rng, shape, dtype, scale_full):
  """Ties k + 1/2 of the scale, their float neighbours, uniform values and specials."""
  k = rng.integers(-300, 300, shape)
  ties = ((k + 0.5) * scale_full.astype(np.float64)).astype(dtype)
  up = np.nextafter(ties.astype(np.float32), np.float32(np.inf)).astype(dtype)
  down = np.nextafter(ties.astype(np.float32), np.float32(-np.inf)).astype(dtype)
  uniform = (rng.normal(0, 50, shape) * scale_full).astype(dtype)
  info = np.finfo(dtype) if dtype != np.dtype(jnp.bfloat16) else jnp.finfo(dtype)
  with np.errstate(over="ignore"):  # 3e9 is inf in float16, which is the point
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, float(info.max),
                         -float(info.max), 3e9, -3e9]).astype(dtype)
  pick = rng.integers(0, 5, shape)
  x = np.choose(pick, [ties, up, down, uniform, uniform]) if shape else np.asarray(
      [ties, up, down, uniform, uniform][int(pick)])
  special = rng.random(shape) < 0.1
  return np.where(special, rng.choice(specials, shape), x).astype(dtype)


def _integer_values(rng, shape, dtype):
  info = jnp.iinfo(dtype)
  x = rng.integers(int(info.min), int(info.max), shape, endpoint=True)
  extremes = rng.choice(np.array([info.min, info.max, 0], np.int64), shape)
  return np.where(rng.random(shape) < 0.2, extremes, x).astype(dtype)


def _four_ways(op: Callable[..., Any], args: tuple[np.ndarray, ...], batch: tuple,
               *, same: Callable[..., None] | None = None) -> None:
  """op(*args) directly, jitted traced, jitted constant, and vmapped: the same bits."""
  same = same or _assert_same
  direct = op(*args)
  traced = jax.jit(op)(*args)
  constant = jax.jit(lambda: op(*[jnp.asarray(a) for a in args]))()
  same(direct, traced, "jit, traced arguments")
  same(direct, constant, "jit, closed-over constants")
  stacked = [np.stack([a, b]) for a, b in zip(args, batch)]
  mapped = jax.vmap(op)(*stacked)
  same(direct, jax.tree.map(lambda y: y[0], mapped), "vmap, first")
  same(op(*batch), jax.tree.map(lambda y: y[1], mapped), "vmap, second")


def _assert_same(expected, actual, how):
  for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    assert_bits_equal(got, want, how)


def _assert_close(expected, actual, how):
  """LSQ's scale and zero-point gradients: arithmetic that XLA fuses differently
  (an FMA, a reciprocal) when compiled whole than op by op, on (y - x) / scale,
  which cancels: close, not equal."""
  for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6,
                               err_msg=how)


def _draw_quantize_inputs(data, rng_seed, *, integer_only=False):
  shape = data.draw(_shapes(), label="shape")
  layout = data.draw(_layouts(shape), label="layout")
  x_dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="x dtype")
  scale_dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="scale dtype")
  outputs = INTEGER_DTYPES_TO_16_BITS if integer_only else INTEGER_OUTPUTS + FLOAT_OUTPUTS
  qdtype = data.draw(st.sampled_from(outputs), label="quantized dtype")
  rngs = [np.random.default_rng(rng_seed + i) for i in range(2)]
  scale = _scales(rngs[0], layout.scale_shape, scale_dtype)
  full = expand_scale(scale, shape, layout.options.get("axis", 1),
                      layout.options.get("block_size", 0))
  xs = [_float_values(rng, shape, x_dtype, full) for rng in rngs]
  return shape, layout, qdtype, scale, xs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_quantize_linear(implementation, data, seed):
  _, layout, qdtype, scale, xs = _draw_quantize_inputs(data, seed)
  op = functools.partial(jq.quantize_linear, output_dtype=qdtype,
                         implementation=implementation, **layout.options)
  _four_ways(lambda x: op(x, scale), (xs[0],), (xs[1],))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_dequantize_linear(implementation, data, seed):
  shape = data.draw(_shapes(), label="shape")
  layout = data.draw(_layouts(shape), label="layout")
  qdtype = data.draw(st.sampled_from(INTEGER_OUTPUTS), label="quantized dtype")
  output_dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="output dtype")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  scale = _scales(rngs[0], layout.scale_shape, np.float32)
  zero_point = _integer_values(rngs[0], layout.scale_shape, qdtype)
  qs = [_integer_values(rng, shape, qdtype) for rng in rngs]
  op = functools.partial(jq.dequantize_linear, output_dtype=output_dtype,
                         implementation=implementation, **layout.options)
  _four_ways(lambda q, s: op(q, s, zero_point), (qs[0], scale), (qs[1], scale * 2))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_dynamic_quantize_linear(implementation, data, seed):
  shape = data.draw(_shapes(min_rank=1), label="shape")
  axis = data.draw(st.sampled_from([None, *range(len(shape))]), label="axis")
  block_size = data.draw(st.sampled_from([0, 2, 3]), label="block size") if axis is not None else 0
  qdtype = data.draw(st.sampled_from(INTEGER_DTYPES_TO_16_BITS), label="dtype")
  symmetric = data.draw(st.booleans(), label="symmetric") and jnp.iinfo(qdtype).min < 0
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  xs = [_float_values(rng, shape, np.float32, np.float32(0.37)) for rng in rngs]
  op = functools.partial(jq.dynamic_quantize_linear, dtype=qdtype, axis=axis,
                         block_size=block_size, symmetric=symmetric,
                         implementation=implementation)
  _four_ways(op, (xs[0],), (xs[1],))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_quantized_add(implementation, data, seed):
  shape = data.draw(_shapes(), label="shape")
  a_dtype, b_dtype, out_dtype = (
      data.draw(st.sampled_from(ADD_DTYPES), label=name) for name in "abo")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  scales = _scales(rngs[0], (3,), np.float32)
  a_zero_point, b_zero_point = (_integer_values(rngs[0], (), d) for d in (a_dtype, b_dtype))
  out_zero_point = _integer_values(rngs[0], (), out_dtype)
  pairs = [(_integer_values(rng, shape, a_dtype), _integer_values(rng, shape, b_dtype))
           for rng in rngs]

  def op(a, b, scales):
    return jq.quantized_add(a, scales[0], a_zero_point, b, scales[1], b_zero_point, scales[2],
                            out_zero_point, implementation=implementation)

  _four_ways(op, (*pairs[0], scales), (*pairs[1], scales))


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_fake_quantize(data, seed):
  _, layout, qdtype, scale, xs = _draw_quantize_inputs(data, seed)
  qdtype = qdtype if qdtype.itemsize <= 2 else np.dtype(jnp.int16)
  op = functools.partial(jq.fake_quantize, dtype=qdtype, **layout.options)
  _four_ways(lambda x: op(x, scale), (xs[0],), (xs[1],))
  _four_ways(jax.grad(lambda x: jnp.sum(op(x, scale).astype(jnp.float32))), (xs[0],), (xs[1],))


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_fake_quantize_learnable(data, seed):
  _, layout, qdtype, scale, xs = _draw_quantize_inputs(data, seed, integer_only=True)
  scale = scale.astype(np.float32)
  zero_point = np.zeros(scale.shape, np.float32)
  op = functools.partial(jq.fake_quantize_learnable, dtype=qdtype, **layout.options)

  def grads(x):
    return jax.grad(lambda x, s, z: jnp.sum(op(x, s, z).astype(jnp.float32)),
                    argnums=(0, 1, 2))(x, scale, zero_point)

  _four_ways(lambda x: op(x, scale, zero_point), (xs[0],), (xs[1],))
  _four_ways(grads, (xs[0],), (xs[1],), same=_assert_close)


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_fake_quantize_dynamic(data, seed):
  shape = data.draw(_shapes(min_rank=1), label="shape")
  axis = data.draw(st.sampled_from([None, *range(len(shape))]), label="axis")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  xs = [_float_values(rng, shape, np.float32, np.float32(0.37)) for rng in rngs]
  op = functools.partial(jq.fake_quantize_dynamic, dtype=jnp.int8, axis=axis)
  _four_ways(op, (xs[0],), (xs[1],))
