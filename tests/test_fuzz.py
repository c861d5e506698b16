"""Differential fuzzing: every op gives the same bits however a model calls it.

Each example draws an op's inputs (dtypes, a granularity, a shape of rank 0 to
6 with empty and ragged-block cases, values on rounding ties and their float
neighbours, NaN, +-inf, +-0 and dtype extremes) and calls the op four ways:
directly, under ``jax.jit`` with traced arguments, under ``jax.jit`` with the
arguments closed over as compile-time constants (which XLA folds), and under
``jax.vmap`` over two such inputs. All four must agree to the bit, for each
implementation, but where a float dot's or convolution's summation order is XLA's choice
per program (``matmul_nbits`` under vmap, the weight-only and fake-quant drop-ins): there,
to float32 summation error (docs/numerics.md). The matmuls and convolutions are also held
to an oracle: int64 NumPy or an int64 convolution for ``quantized_dot_general`` and the
dynamic and static int8 drop-ins, ONNX's formula for ``qlinear_matmul``, onnxruntime to
float32 summation error for ``matmul_nbits``, the dequantized weight's dot or convolution
for the weight-only drop-ins, and the float contraction of ``fake_quantize``'d activations,
with its masked straight-through vjp, for the fake-quant ones. The ``ci`` hypothesis
profile runs a few examples per op; run
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
from onnx_oracle import run_onnxruntime
from quant_testing import assert_bits_equal
from quant_testing import BF16
from quant_testing import bit_width
from quant_testing import conv_epilogue
from quant_testing import examples
from quant_testing import expand_scale
from quant_testing import F32
from quant_testing import FLOAT4
from quant_testing import FLOAT8_DTYPES
from quant_testing import FLOAT_DTYPES
from quant_testing import given_per_implementation
from quant_testing import IMPLEMENTATIONS
from quant_testing import INT32
from quant_testing import integer_conv
from quant_testing import INTEGER_DTYPES_TO_16_BITS
from quant_testing import spec_nbits_weight
from quant_testing import spec_quantize
from quant_testing import spec_symmetric_scale
from quant_testing import summation_bound
from quant_testing import summation_error
from quant_testing import wrap_int32

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
               *, same: Callable[..., None] | None = None,
               same_mapped: Callable[..., None] | None = None) -> None:
  """op(*args) directly, jitted traced, jitted constant, and vmapped (jitted): the same bits.

  ``same_mapped`` compares the vmapped results (default ``same``): a float dot
  gains a batch dim under vmap, which XLA may sum in another order.
  """
  same = same or _assert_same
  same_mapped = same_mapped or same
  direct = op(*args)
  traced = jax.jit(op)(*args)
  constant = jax.jit(lambda: op(*[jnp.asarray(a) for a in args]))()
  same(direct, traced, "jit, traced arguments")
  same(direct, constant, "jit, closed-over constants")
  stacked = [np.stack([a, b]) for a, b in zip(args, batch)]
  # Under jit, as a model maps it: eagerly every batched primitive compiles on its own.
  mapped = jax.jit(jax.vmap(op))(*stacked)
  same_mapped(direct, jax.tree.map(lambda y: y[0], mapped), "vmap, first")
  same_mapped(op(*batch), jax.tree.map(lambda y: y[1], mapped), "vmap, second")


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


def _within_summation_error(bounds):
  """A ``_four_ways`` comparison of float dots' results, whose summation order XLA picks per
  program: each leaf equal (inf and NaN included) or within its bound, ``bounds[0]``'s leaf
  for the first arguments, ``bounds[1]``'s for the second (``"vmap, second"``). A leaf
  narrower than float32 (a bfloat16 gradient: a float32 sum rounded once more) may differ
  by one more of its roundings."""
  def within(expected, actual, how):
    for bound, want, got in zip(jax.tree.leaves(bounds[1 if how == "vmap, second" else 0]),
                                jax.tree.leaves(expected), jax.tree.leaves(actual)):
      dtype = np.asarray(got).dtype
      rounding = 0 if dtype == F32 else float(jnp.finfo(dtype).eps)
      want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
      same = (got == want) | (np.isnan(got) & np.isnan(want))
      with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are `same`
        close = np.abs(got - want) <= bound + rounding * np.abs(want)
      assert np.all(same | close), how
  return within


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


@dataclasses.dataclass(frozen=True)
class DotLayout:
  """Two operands' shapes and ``lax.dot_general`` dimension numbers, dims in any order."""
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  dimension_numbers: tuple
  # An einsum spec of the same product, for the int64 oracle.
  spec: str


@st.composite
def _dot_layouts(draw):
  batch = draw(st.lists(st.integers(0, 3), max_size=2), label="batch sizes")
  contracting = draw(st.lists(st.integers(0, 5), max_size=2), label="contracting sizes")
  if len(contracting) == 1 and draw(st.booleans(), label="deep"):
    # XLA:CPU's int8 dot in slices of a view (2049 = 3 x 683, 4100 = 4 x 1025) or padded
    # (8209, a prime); with 300 rows, the bfloat16 dot in slices (1025 and up) where the CPU
    # has no AMX int8 tiles.
    contracting = [draw(st.sampled_from([1025, 2049, 4100, 8209]), label="depth")]
  # 300 rows: past _INT8_DOT_MAX_ROWS, XLA:CPU's bfloat16 dot (without AMX int8 tiles).
  lhs_free = draw(st.lists(st.sampled_from([0, 1, 2, 4, 300]), max_size=2), label="lhs free")
  rhs_free = draw(st.lists(st.integers(0, 4), max_size=2), label="rhs free")
  if math.prod(lhs_free) * math.prod(batch) > 300:
    lhs_free = [min(n, 4) for n in lhs_free]
  dims = {"b": batch, "c": contracting}

  def operand(free, letters):
    kinds = ([("b", i) for i in range(len(batch))] + [("c", i) for i in range(len(contracting))]
             + [("f", i) for i in range(len(free))])
    order = draw(st.permutations(kinds))
    sizes = [free[i] if kind == "f" else dims[kind][i] for kind, i in order]
    names = "".join({"b": "ab", "c": "kl", "f": letters}[kind][i] for kind, i in order)
    position = {item: d for d, item in enumerate(order)}
    return (tuple(sizes), names, tuple(position["c", i] for i in range(len(contracting))),
            tuple(position["b", i] for i in range(len(batch))))

  lhs_shape, lhs_names, lhs_contracting, lhs_batch = operand(lhs_free, "mn")
  rhs_shape, rhs_names, rhs_contracting, rhs_batch = operand(rhs_free, "pq")
  out = ("ab"[:len(batch)] + "".join(c for c in lhs_names if c in "mn")
         + "".join(c for c in rhs_names if c in "pq"))
  return DotLayout(lhs_shape, rhs_shape,
                   ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)),
                   f"{lhs_names},{rhs_names}->{out}")


def _draw_parameter_shape(data, shape, contracting, label):
  """None, per tensor, or the operand's rank with 1 on contracting dims (per row/column/batch)."""
  kind = data.draw(st.sampled_from(["none", "tensor", "operand"]), label=label)
  if kind == "none":
    return None
  if kind == "tensor":
    return data.draw(st.sampled_from([(), (1,)]), label=f"{label} shape")
  return tuple(1 if d in contracting or not data.draw(st.booleans(), label=f"{label} dim {d}")
               else n for d, n in enumerate(shape))


def _in_output_layout(parameter, contracting, batch, *, lhs, other_free):
  """A parameter in its operand's layout, as an array broadcasting against the output."""
  if parameter.size == 1 and parameter.ndim <= 1:
    return parameter.reshape(())
  free = [d for d in range(parameter.ndim) if d not in contracting and d not in batch]
  kept = np.transpose(parameter, list(batch) + free + list(contracting))
  kept = kept.reshape(kept.shape[:len(batch) + len(free)])
  batch_shape, free_shape = kept.shape[:len(batch)], kept.shape[len(batch):]
  ones = (1,) * other_free
  return kept.reshape(batch_shape + (free_shape + ones if lhs else ones + free_shape))


def _centred(x, zero_point):
  x = np.asarray(x, np.int64)
  if zero_point is None:
    return x
  zero_point = np.asarray(zero_point, np.int64)
  return x - (zero_point.reshape(()) if zero_point.size == 1 and zero_point.ndim <= 1
              else zero_point)


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_quantized_dot_general(data, seed):
  """Any dimension numbers, integer dtypes and parameter layouts: int64 arithmetic's bits."""
  layout = data.draw(_dot_layouts(), label="layout")
  (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = layout.dimension_numbers
  sides = {"lhs": (layout.lhs_shape, lhs_contracting, lhs_batch),
           "rhs": (layout.rhs_shape, rhs_contracting, rhs_batch)}
  dtypes = {side: data.draw(st.sampled_from(INTEGER_DTYPES_TO_16_BITS), label=f"{side} dtype")
            for side in sides}
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  parameters = {}
  for side, (shape, contracting, _) in sides.items():
    for name, values in (("zero_point", lambda s: _integer_values(rngs[0], s, dtypes[side])),
                         ("scale", lambda s: _scales(rngs[0], s, np.float32))):
      parameter_shape = _draw_parameter_shape(data, shape, contracting, f"{side} {name}")
      if parameter_shape is not None:
        parameters[f"{side}_{name}"] = values(parameter_shape)
  operands = [tuple(_integer_values(rng, sides[side][0], dtypes[side]) for side in sides)
              for rng in rngs]

  def op(lhs, rhs, *values):
    return jq.quantized_dot_general(lhs, rhs, layout.dimension_numbers,
                                    **dict(zip(parameters, values)))

  values = tuple(parameters.values())
  _four_ways(op, (*operands[0], *values), (*operands[1], *values))
  lhs, rhs = (_centred(x, parameters.get(f"{side}_zero_point"))
              for x, side in zip(operands[0], sides))
  expected = wrap_int32(np.einsum(layout.spec, lhs, rhs))
  if any(name.endswith("scale") for name in parameters):
    lhs_free, rhs_free = (len(shape) - len(contracting) - len(batch)
                          for shape, contracting, batch in sides.values())
    scale = [_in_output_layout(parameters.get(f"{side}_scale", np.float32(1)), contracting,
                               batch, lhs=side == "lhs",
                               other_free=rhs_free if side == "lhs" else lhs_free)
             for side, (_, contracting, batch) in sides.items()]
    expected = expected.astype(np.float32) * (scale[0] * scale[1])
  assert_bits_equal(op(*operands[0], *values), expected, "against int64 arithmetic")


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_qlinear_matmul(data, seed):
  """numpy.matmul shapes, per-tensor/row/column parameters, ties: ONNX's formula's bits."""
  m, n = (data.draw(st.integers(0, 4), label=name) for name in "mn")
  k = data.draw(st.sampled_from([0, 1, 3, 8, 4100]), label="k")
  batch = data.draw(st.lists(st.integers(1, 3), max_size=2), label="batch")
  a_shape = data.draw(st.sampled_from([(k,), (m, k), (*batch, m, k)]), label="a shape")
  b_shape = data.draw(st.sampled_from([(k,), (k, n), ((1,) * len(batch)) + (k, n)]),
                      label="b shape")
  a_dtype, b_dtype, y_dtype = (data.draw(st.sampled_from([np.int8, np.uint8]), label=name)
                               for name in ("a dtype", "b dtype", "y dtype"))
  per_row = len(a_shape) >= 2 and data.draw(st.booleans(), label="per row")
  per_column = len(b_shape) >= 2 and data.draw(st.booleans(), label="per column")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  rows, columns = (m,) if per_row else (), (n,) if per_column else ()
  # Powers of two: many accumulators times the multiplier land on ties.
  a_scale = rngs[0].choice(np.float32([0.25, 0.5, 0.37]), rows)
  b_scale = rngs[0].choice(np.float32([0.5, 1.0, 0.91362804]), columns)
  y_scale = np.float32(data.draw(st.sampled_from([0.5, 2.0, 4.0, 3.7, 64.0]), label="y scale"))
  a_zero_point = _integer_values(rngs[0], rows, a_dtype)
  b_zero_point = _integer_values(rngs[0], columns, b_dtype)
  y_zero_point = _integer_values(rngs[0], (), y_dtype)
  operands = [(_integer_values(rng, a_shape, a_dtype), _integer_values(rng, b_shape, b_dtype))
              for rng in rngs]

  def op(a, b):
    return jq.qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale,
                             y_zero_point)

  _four_ways(op, operands[0], operands[1])
  a, b = (np.asarray(x, np.int64) for x in operands[0])
  a = a - (np.asarray(a_zero_point, np.int64)[:, None] if per_row else a_zero_point)
  b = b - np.asarray(b_zero_point, np.int64)
  accumulator = wrap_int32(np.matmul(a, b))
  multiplier = (a_scale[:, None] if per_row else a_scale) * b_scale / y_scale
  if len(a_shape) == 1 or len(b_shape) == 1:  # matmul drops a vector's dim
    multiplier = multiplier.reshape(-1 if accumulator.ndim else ())
  value = accumulator.astype(np.float32) * multiplier
  expected = spec_quantize(value.astype(np.float64), np.float64(y_zero_point), y_dtype)
  assert_bits_equal(op(*operands[0]), expected, "against ONNX's formula")


def _nbits_activations(rng, shape):
  """Normals over many magnitudes, +-0 and large values whose products stay finite.

  No tiny ones: XLA:CPU flushes float32 subnormals (J1), onnxruntime need not, and
  the summation bound has no absolute term. No NaN or inf: matmul_nbits' docs give
  them no meaning beyond IEEE arithmetic in some order.
  """
  x = rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 9, shape)
  specials = np.array([0.0, -0.0, 1e30, -1e30, 2.0**60, 65504.0, -3e9])
  return np.where(rng.random(shape) < 0.15, rng.choice(specials, shape), x).astype(np.float32)


def _nbits_inputs(rng, a_shape, *, k, n, bits, block_size, zero_points, bias):
  """MatMulNBits' inputs: random bytes (a ragged last block's padding codes too), scales
  over 2^-10..2^4, zero points absent, packed or float (a little outside the codes)."""
  blocks = -(-k // block_size)
  inputs = {
      "a": _nbits_activations(rng, a_shape),
      "b": rng.integers(0, 256, (n, blocks, block_size * bits // 8)).astype(np.uint8),
      "scales": np.exp2(rng.uniform(-10, 4, (n, blocks))).astype(np.float32),
  }
  if zero_points == "packed":
    inputs["zero_points"] = rng.integers(0, 256, (n, -(-blocks * bits // 8))).astype(np.uint8)
  elif zero_points == "float":
    inputs["zero_points"] = rng.uniform(-1, 2**bits, (n, blocks)).astype(np.float32)
  if bias:
    inputs["bias"] = (rng.standard_normal(n) * 2.0 ** rng.integers(-4, 20, n)).astype(np.float32)
  return inputs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@given_per_implementation(0.25, 0.1, data=st.data(), seed=st.integers(0, 2**31))
def test_matmul_nbits(implementation, data, seed):
  """2/4/8 bits, ragged last blocks, batches (empty ones too), every zero-point kind:
  onnxruntime to float32 summation error, and the pallas kernel gives the XLA path's bits."""
  bits = data.draw(st.sampled_from([4, 2, 8]), label="bits")
  block_size = data.draw(st.sampled_from([16, 32, 64, 128, 256]), label="block size")
  k = data.draw(st.one_of(st.integers(1, 3), st.integers(1, 3).map(lambda j: j * block_size),
                          st.integers(1, 3 * block_size)), label="k")
  n = data.draw(st.integers(1, 24), label="n")
  # 0 last: hypothesis draws its simplest value most, and an empty batch computes nothing.
  batch = data.draw(st.lists(st.sampled_from([2, 1, 3, 0]), max_size=2), label="batch")
  zero_points = data.draw(st.sampled_from(["packed", None, "float"]), label="zero points")
  bias = data.draw(st.booleans(), label="bias")
  nbits = dict(k=k, n=n, bits=bits, block_size=block_size)
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  inputs = [_nbits_inputs(rng, (*batch, k), zero_points=zero_points, bias=bias, **nbits)
            for rng in rngs]
  names = tuple(inputs[0])

  def op(*values, implementation=implementation):
    return jq.matmul_nbits(**dict(zip(names, values)), K=k, N=n, bits=bits,
                           block_size=block_size, implementation=implementation)

  values = tuple(inputs[0].values())
  weights = [spec_nbits_weight(given["b"], given["scales"], given.get("zero_points"), **nbits)
             for given in inputs]
  bounds = [summation_bound(given["a"], weight, given.get("bias"))
            for given, weight in zip(inputs, weights)]

  # vmap batches the weight too: a batched dot, which XLA:CPU may sum in another
  # order than the matrix-vector or matrix product of one call (docs/numerics.md).
  _four_ways(op, values, tuple(inputs[1].values()), same_mapped=_within_summation_error(bounds))
  got = np.asarray(op(*values))
  if implementation == "pallas":
    assert_bits_equal(got, op(*values, implementation="xla"), "pallas against xla")
  if bits == 8 and zero_points == "float":
    return  # M3: onnxruntime refuses 8-bit weights with float zero points
  given, weight = inputs[0], weights[0]
  expected = run_onnxruntime(
      "MatMulNBits", {"A": given["a"], "B": given["b"], "scales": given["scales"],
                      "zero_points": given.get("zero_points"), "g_idx": None,
                      "bias": given.get("bias")},
      np.float32, domain="com.microsoft", K=k, N=n, bits=bits, block_size=block_size)
  assert got.shape == expected.shape
  bound = bounds[0]
  if zero_points == "float":
    # onnxruntime 1.32.0 dequantizes with float zero points as q * s - z * s, each product
    # rounded before they cancel, not as (q - z) * s: the two weights' difference, times
    # |a|, adds to the bound.
    zero = np.zeros_like(given["zero_points"])
    codes_times_scales = spec_nbits_weight(given["b"], given["scales"], zero, **nbits)
    steps = np.arange(k) // block_size
    deviating = codes_times_scales - (given["zero_points"] * given["scales"])[:, steps]
    bound = bound + np.abs(given["a"]) @ np.abs(weight - deviating).T
  excess = np.abs(got - expected) - bound
  assert np.all(excess <= 0), f"onnxruntime differs by up to {np.max(excess)} past the bound"


# dot_general drop-ins' layouts, each with its operands made from canonical (batch, m, k) and
# (batch, k, n) arrays and a product in the canonical (batch, m, n) layout, whatever the
# dimension numbers: (lhs has a batch dim, rhs has it, transposed, dimension numbers).
DROP_IN_LAYOUTS = {
    "dense": (False, False, False, (((1,), (0,)), ((), ()))),
    "einsum": (True, False, False, (((2,), (0,)), ((), ()))),
    "batched": (True, True, False, (((2,), (1,)), ((0,), (0,)))),
    "contracting first": (False, False, True, (((0,), (1,)), ((), ()))),
}
SYMMETRIC_DTYPES = tuple(np.dtype(d) for d in (jnp.int8, jnp.int4, jnp.int2))


def _dynamic_activations(rng, shape, dtype, qmax, special_rate=0.005):
  """Rows (along the last dim) scaled by powers of two, most holding +-qmax times it, so
  that the scale is the power of two and the other values land on ties, integers, their
  float neighbours, zeros; some rows all zero, some values (``special_rate``) NaN, inf
  and huge."""
  step = np.exp2(rng.integers(-20, 20, (*shape[:-1], 1))).astype(np.float32)
  j = rng.integers(-qmax, qmax, shape)
  ties = ((j + 0.5) * step).astype(np.float32)
  x = np.choose(rng.integers(0, 5, shape), [
      ties, j * step, np.nextafter(ties, np.float32(np.inf)), rng.normal(0, qmax, shape) * step,
      np.zeros(shape)]).astype(np.float32)
  if shape[-1]:
    planted = rng.integers(0, shape[-1], shape[:-1])[..., None] == np.arange(shape[-1])
    sign = rng.choice(np.float32([-1, 1]), (*shape[:-1], 1))
    x = np.where(planted & (rng.random((*shape[:-1], 1)) < 0.8), sign * qmax * step, x)
  x = np.where(rng.random((*shape[:-1], 1)) < 0.1, 0.0, x)
  specials = np.float32([np.nan, np.inf, -np.inf, 3e38, -1e30, -0.0])
  x = np.where(rng.random(shape) < special_rate, rng.choice(specials, shape), x)
  return x.astype(dtype)


def _symmetric_oracle(x, reduced_axis, dtype):
  """x's symmetric values and scale as documented: ``max|x| / qmax`` over the reduced dim
  (NaN ignored, 1 where all zero), then :func:`quantize_linear`."""
  scale = spec_symmetric_scale(x, reduced_axis, dtype)
  values = jq.quantize_linear(x, scale, axis=None, output_dtype=dtype)
  return np.asarray(values, np.int64), scale


def _draw_drop_in_operands(data, seed, lhs_batched, rhs_batched, *, integer=True):
  """A drop-in's dims, whether its weight is stored, two rngs and a float weight (k, n).

  K = 4100 = 4 x 1025 takes XLA:CPU's int8 dot in slices, 300 rows its bfloat16 dot
  (without AMX int8 tiles; test_quantized_dot_general), where the product is an ``integer`` one; a tenth of the
  weight is zero.
  """
  k = data.draw(st.sampled_from([1, 3, 70] + ([4100] if integer else [])), label="k")
  m = data.draw(st.sampled_from([1, 2, 5] + ([300] if integer else [])), label="m")
  n = data.draw(st.sampled_from([1, 3, 8]), label="n")
  batch = (data.draw(st.integers(1, 2), label="batch"),) if lhs_batched else ()
  rhs_batch = batch if rhs_batched else ()
  stored = data.draw(st.booleans(), label="stored weights")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  weight = rngs[0].normal(0, 0.1, (*rhs_batch, k, n)).astype(np.float32)
  weight = np.where(rngs[0].random(weight.shape) < 0.1, 0.0, weight).astype(np.float32)
  return k, m, n, batch, rhs_batch, stored, rngs, weight


def _laid_out(x, transposed):
  """A canonical (..., m, k) or (..., k, n) operand in a DROP_IN_LAYOUTS layout."""
  return np.swapaxes(x, -1, -2) if transposed else x


def _draw_symmetric_weight(data, weight, dtype, *, stored, transposed):
  """The int8/4/2 drop-ins' rhs made from a canonical (..., k, n) float weight, with its
  integers (int64, canonical) and scale (broadcasting against them) as the oracle reads them.

  A float weight is quantized as documented: symmetric, ``max|w| / qmax`` per output feature.
  A stored one is :func:`quantize_params`' of the laid-out weight, per tensor, per output
  feature or per batch, packed or not; its integers are read back through the public
  ``dequantize`` (``q * s / s`` rounds to q).
  """
  rhs = _laid_out(weight, transposed)
  if not stored:
    return (rhs, *_symmetric_oracle(weight, -2, dtype))
  axes = [rhs.ndim - 2 if transposed else rhs.ndim - 1] + list(range(rhs.ndim - 2))
  axis = data.draw(st.sampled_from([None, *axes]), label="weight axis")
  packed = data.draw(st.booleans(), label="packed") if bit_width(dtype) < 8 else False
  rhs = jq.quantize_params(rhs, jq.QuantizationRule(dtype=dtype, axis=axis, packed=packed))
  scale = np.asarray(rhs.scale)
  if rhs.axis is None:
    weight_scale = scale.reshape(())
  else:
    weight_scale = _laid_out(
        scale.reshape([n if d == rhs.axis else 1 for d, n in enumerate(rhs.shape)]), transposed)
  weight_values = np.rint(_laid_out(np.asarray(rhs.dequantize()), transposed) / weight_scale)
  return rhs, weight_values.astype(np.int64), weight_scale


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_dot_general_dynamic_int8(data, seed):
  """int8/4/2 activations and weights, float or stored (packed or not, per tensor or per
  output feature or batch), deep K, many rows: int64 arithmetic then the float32 epilogue."""
  name = data.draw(st.sampled_from(list(DROP_IN_LAYOUTS)), label="layout")
  lhs_batched, rhs_batched, transposed, numbers = DROP_IN_LAYOUTS[name]
  lhs_dtype, rhs_dtype = (data.draw(st.sampled_from(SYMMETRIC_DTYPES), label=f"{side} dtype")
                          for side in ("lhs", "rhs"))
  x_dtype = data.draw(st.sampled_from([np.float32, np.dtype(jnp.bfloat16)]), label="x dtype")
  k, m, n, batch, _, stored, rngs, weight = _draw_drop_in_operands(
      data, seed, lhs_batched, rhs_batched)
  lhs_qmax = int(jnp.iinfo(lhs_dtype).max)
  lhses = [_dynamic_activations(rng, (*batch, m, k), x_dtype, lhs_qmax) for rng in rngs]
  laid_out = functools.partial(_laid_out, transposed=transposed)
  rhs, weight_values, weight_scale = _draw_symmetric_weight(
      data, weight, rhs_dtype, stored=stored, transposed=transposed)
  op = functools.partial(jq.dot_general_dynamic_int8, rhs=rhs, dimension_numbers=numbers,
                         lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype)
  _four_ways(lambda x: op(laid_out(x)), (lhses[0],), (lhses[1],))

  lhs_values, lhs_scale = _symmetric_oracle(lhses[0], -1, lhs_dtype)
  accumulator = np.matmul(lhs_values, weight_values)
  with np.errstate(over="ignore", invalid="ignore"):  # an inf scale: inf and NaN, as documented
    expected = accumulator.astype(np.float32) * (lhs_scale * weight_scale)
  assert_bits_equal(op(laid_out(lhses[0])), expected, "against int64 arithmetic")


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_dot_general_static_int8(data, seed):
  """Activations on ties, their neighbours, past the range, NaN and inf at a drawn per-tensor
  scale (float32 or bfloat16, shaped () or (1,)) and int8 zero point or none; int8 weights
  float or stored; deep K, many rows: int64 arithmetic with the zero point subtracted, then
  ``float32(acc) * (s_in * s_rhs)``. The scale and zero point are traced arguments too."""
  name = data.draw(st.sampled_from(list(DROP_IN_LAYOUTS)), label="layout")
  lhs_batched, rhs_batched, transposed, numbers = DROP_IN_LAYOUTS[name]
  k, m, n, batch, _, stored, rngs, weight = _draw_drop_in_operands(
      data, seed, lhs_batched, rhs_batched)
  arguments = _draw_static_arguments(data, rngs, (*batch, m, k))
  laid_out = functools.partial(_laid_out, transposed=transposed)
  rhs, weight_values, weight_scale = _draw_symmetric_weight(
      data, weight, np.dtype(np.int8), stored=stored, transposed=transposed)

  def op(x, input_scale, input_zero_point=None):
    return jq.dot_general_static_int8(laid_out(x), rhs, numbers, input_scale=input_scale,
                                      input_zero_point=input_zero_point)

  _four_ways(op, arguments[0], arguments[1])

  centred, scale = _static_oracle(*arguments[0])
  accumulator = np.matmul(centred, weight_values)
  expected = accumulator.astype(np.float32) * (scale * weight_scale)
  assert_bits_equal(op(*arguments[0]), expected, "against int64 arithmetic")


def _draw_static_arguments(data, rngs, lhs_shape):
  """The static int8 drop-ins' ``(lhs, input_scale[, input_zero_point])`` for each rng: a
  per-tensor scale (float32 or bfloat16, shaped () or (1,)), an int8 zero point or none, and
  float32 or bfloat16 activations on that scale's ties, their neighbours, past the range, NaN
  and inf. Each draw's lhs sits on its own scale's ties: the vmapped call maps all three."""
  x_dtype = data.draw(st.sampled_from([F32, BF16]), label="x dtype")
  scale_dtype = data.draw(st.sampled_from([F32, BF16]), label="scale dtype")
  scale_shape = data.draw(st.sampled_from([(), (1,)]), label="scale shape")
  zero_point = data.draw(st.booleans(), label="zero point")
  arguments = []
  for rng in rngs:
    scale = _scales(rng, scale_shape, scale_dtype)
    lhs = _float_values(rng, lhs_shape, x_dtype, scale.astype(np.float32))
    zero_points = (_integer_values(rng, scale_shape, np.int8),) if zero_point else ()
    arguments.append((lhs, scale, *zero_points))
  return arguments


def _static_oracle(lhs, scale, *zero_points):
  """The static int8 drop-ins' activations as documented: ``quantize_linear`` to int8, less
  the zero point (int64), and the scale as the float32 epilogue multiplies it (a bfloat16
  scale converts exactly)."""
  values = jq.quantize_linear(lhs, scale, *zero_points, axis=None, output_dtype=np.int8)
  centred = np.asarray(values, np.int64)
  if zero_points:
    centred = centred - np.asarray(zero_points[0], np.int64).reshape(())
  return centred, scale.astype(np.float32).reshape(())


def _with_vjp(contract):
  """``(lhs, rhs, cotangent) -> (contract(lhs, rhs), d_lhs, d_rhs)``, for _four_ways."""
  def value_and_vjp(lhs, rhs, cotangent):
    y, vjp = jax.vjp(contract, lhs, rhs)
    return (y, *vjp(cotangent))
  return value_and_vjp


def _bilinear_bounds(contract, a, b, cotangent=None):
  """:func:`summation_error` of ``contract(a, b)`` for any bilinear ``contract`` (a dot, a
  convolution), and with a cotangent, of its vjp's two halves too (a tuple of three): each
  output's magnitude is the contraction of the magnitudes, its count of products that of
  ones (float64, exact)."""
  def magnitudes(fill):
    operands = [fill(x).astype(np.float64) for x in (a, b)]
    if cotangent is None:
      return [np.asarray(contract(*operands))]
    y, vjp = jax.vjp(contract, *operands)
    return [np.asarray(z) for z in (y, *vjp(fill(cotangent).astype(np.float64)))]

  with jax.enable_x64(True), np.errstate(invalid="ignore", over="ignore"):
    bounds = tuple(summation_error(magnitude, terms) for magnitude, terms in
                   zip(magnitudes(np.abs), magnitudes(np.ones_like)))
  return bounds if cotangent is not None else bounds[0]


def _with_nan(rng, x):
  """x with one element NaN, where fake_quantize's straight-through gradient is masked (its
  value is finite: NaN quantizes to qmin)."""
  x = x.copy()
  x.flat[rng.integers(x.size)] = np.nan
  return x


def _fake_quant_oracle(contract, x, reduced, w, cotangent):
  """``contract(fake_quantize(x), w)`` and its vjp as the fake-quant drop-ins document them,
  with each one's :func:`_bilinear_bounds`: x fake-quantized to int8 at ``max|x| / 127``
  over the ``reduced`` dims (NaN ignored), the scale held constant; x's gradient the
  contraction's, masked by fake_quantize's straight-through rule where ``round(x / s)``
  leaves int8's range (tested before clamping; NaN is in no range), w's the contraction's."""
  _, scale = _symmetric_oracle(x, reduced, np.int8)
  fake = jq.fake_quantize(x, scale, axis=None, dtype=np.int8)
  y, d_fake, d_w = (np.asarray(z) for z in _with_vjp(contract)(fake, w, cotangent))
  with np.errstate(invalid="ignore"):
    q = np.rint(x.astype(np.float32) / scale)
  d_x = np.where((q >= -128) & (q <= 127), d_fake, np.zeros_like(d_fake))
  return (y, d_x, d_w), _bilinear_bounds(contract, np.asarray(fake, np.float32), w, cotangent)


# Each example differentiates the op eagerly and vmapped, which compiles each primitive of
# fake_quantize's derivative on its own for the example's shapes: seconds each.
@hypothesis.settings(max_examples=examples(0.05, minimum=3))
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_dot_general_fake_quant(data, seed):
  """float32 or bfloat16 activations as test_dot_general_dynamic_int8 draws them (per-row
  ties, NaN and inf more often, a NaN in each), float32 weights, a random cotangent: the
  value and vjp of :func:`_fake_quant_oracle` with ``lax.dot_general``, per row. Bit for bit
  eagerly; jitted, closed over or vmapped (rhs and the cotangent mapped too), to float32
  summation error."""
  name = data.draw(st.sampled_from(list(DROP_IN_LAYOUTS)), label="layout")
  lhs_batched, rhs_batched, transposed, numbers = DROP_IN_LAYOUTS[name]
  x_dtype = data.draw(st.sampled_from([F32, BF16]), label="x dtype")
  # A float rhs only: the drop-in takes no stored weight. A float dot: no deep K.
  k, m, n, batch, _, _, rngs, weight = _draw_drop_in_operands(
      data, seed, lhs_batched, rhs_batched, integer=False)
  weights = [weight, rngs[1].normal(0, 0.1, weight.shape).astype(np.float32)]
  laid_out = functools.partial(_laid_out, transposed=transposed)
  # NaN and inf more often, and a NaN in every example: there the straight-through
  # gradient is masked.
  arguments = [(laid_out(_with_nan(rng, _dynamic_activations(rng, (*batch, m, k), x_dtype, 127,
                                                             special_rate=0.03))),
                laid_out(w), rng.standard_normal((*batch, m, n)).astype(np.float32))
               for rng, w in zip(rngs, weights)]
  op = _with_vjp(lambda lhs, rhs: jq.dot_general_fake_quant(lhs, rhs, numbers))
  contract = lambda a, b: jax.lax.dot_general(a, b, numbers)
  (expected, bounds), (_, other_bounds) = (
      _fake_quant_oracle(contract, lhs, numbers[0][0], rhs, cotangent)
      for lhs, rhs, cotangent in arguments)
  _four_ways(op, arguments[0], arguments[1],
             same=_within_summation_error([bounds, other_bounds]))
  _assert_same(expected, op(*arguments[0]), "as documented")


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_dot_general_weight_only(data, seed):
  """int8/4/2 and float8 weights per output feature or in ragged blocks along K, float or
  stored (packed or not): bit for bit the float dot of the weight :func:`quantize_params`
  stores, each on its own; jitted, closed over or vmapped, to float32 summation error."""
  name = data.draw(st.sampled_from(list(DROP_IN_LAYOUTS)), label="layout")
  lhs_batched, rhs_batched, transposed, numbers = DROP_IN_LAYOUTS[name]
  dtype = data.draw(st.sampled_from(SYMMETRIC_DTYPES + (np.dtype(jnp.float8_e4m3fn),)),
                    label="dtype")
  # minmax (a zero point) is for integer dtypes only.
  methods = ["absmax", "minmax"] if dtype in SYMMETRIC_DTYPES else ["absmax"]
  method = data.draw(st.sampled_from(methods), label="method")
  block_size = data.draw(st.sampled_from([0, 16, 32]), label="block size")
  k, m, n, batch, rhs_batch, stored, rngs, weight = _draw_drop_in_operands(
      data, seed, lhs_batched, rhs_batched)
  lhses = [_nbits_activations(rng, (*batch, m, k)) for rng in rngs]
  laid_out = functools.partial(_laid_out, transposed=transposed)
  rhs = laid_out(weight)
  contracting = numbers[0][1][0]
  free = rhs.ndim - 2 if transposed else rhs.ndim - 1
  rule = functools.partial(jq.QuantizationRule, dtype=dtype, method=method)
  if block_size:
    rule = rule(axis=contracting, block_size=block_size)
  elif not stored:
    # One scale per output feature: per index of all of rhs's dims that are not contracted.
    rule = rule(axis=1)
    order = [contracting] + [d for d in range(rhs.ndim) if d != contracting]
    matrix = jq.quantize_params(np.transpose(rhs, order).reshape(k, -1), rule).dequantize()
    dequantized = np.transpose(np.reshape(matrix, [rhs.shape[d] for d in order]),
                               np.argsort(order))
  else:
    rule = rule(axis=free)
  if stored:
    packed = data.draw(st.booleans(), label="packed") if bit_width(dtype) < 8 else False
    rhs = jq.quantize_params(rhs, dataclasses.replace(rule, packed=packed))
    dequantized = rhs.dequantize()
  elif block_size:
    dequantized = jq.quantize_params(rhs, rule).dequantize()
  op = functools.partial(jq.dot_general_weight_only, rhs=rhs, dimension_numbers=numbers,
                         dtype=dtype, block_size=block_size, method=method)

  # The drop-in is lax.dot_general of the dequantized weight, a float dot whose
  # summation order XLA:CPU picks per program: how the weight's producer is laid out
  # for it under jit, evaluated while compiling when every operand is a constant,
  # batched under vmap (docs/numerics.md).
  bounds = [summation_bound(x, np.swapaxes(laid_out(np.asarray(dequantized)), -1, -2))
            for x in lhses]
  # lhs laid out before the call: a transpose inside jit may fold into the float dot.
  lhs, other = (laid_out(x) for x in lhses)
  _four_ways(op, (lhs,), (other,), same=_within_summation_error(bounds))
  expected = jax.lax.dot_general(lhs, dequantized, numbers)
  assert_bits_equal(op(lhs), expected, "the dequantized weight's dot")


@dataclasses.dataclass(frozen=True)
class ConvLayout:
  """Two operands' shapes and the rest of ``lax.conv_general_dilated``'s arguments."""
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  # window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
  # feature_group_count, batch_group_count.
  options: dict[str, Any]

  @property
  def numbers(self) -> jax.lax.ConvDimensionNumbers:
    return jax.lax.conv_dimension_numbers(self.lhs_shape, self.rhs_shape,
                                          self.options["dimension_numbers"])

  @property
  def lhs_reduced(self) -> tuple[int, ...]:
    """The lhs dims one dynamic activation scale covers: all but the batch dim (one scale
    per example), all of them with batch groups (one per tensor)."""
    batch = self.numbers.lhs_spec[0]
    per_tensor = self.options["batch_group_count"] > 1
    return tuple(d for d in range(len(self.lhs_shape)) if d != batch or per_tensor)


@st.composite
def _conv_layouts(draw, *, float_conv=False):
  """1-D and 2-D convolutions in NWC/NCW (NHWC/NCHW) and WIO/OIW (HWIO/OIHW), each operand's
  and the output's layout drawn on its own; spatial sizes 1 to 5, kernels 1 to 3, strides and
  both dilations 1 or 2 (lhs dilation with explicit padding only, as lax takes it), padding
  "SAME", "SAME_LOWER", "VALID" or explicit (negative too, and windows larger than the input:
  empty outputs), feature or batch groups. For a ``float_conv``, no negative low padding
  with a positive high one: there XLA:CPU's float32 and bfloat16 convolutions (jax 0.10.2)
  read past the input, some outputs wrong or garbage, run to run (its integer and float64
  ones are right)."""
  spatial = draw(st.sampled_from(["W", "HW"]), label="spatial dims")
  lhs_spec, out_spec = (draw(st.sampled_from([f"N{spatial}C", f"NC{spatial}"]), label=name)
                        for name in ("lhs layout", "out layout"))
  rhs_spec = draw(st.sampled_from([f"{spatial}IO", f"OI{spatial}"]), label="rhs layout")
  groups = draw(st.sampled_from([1, 2, 3]), label="feature groups")
  batch_groups = draw(st.sampled_from([1, 2]), label="batch groups") if groups == 1 else 1
  in_features = draw(st.integers(1, 4), label="input features per group")
  out_features = draw(st.integers(1, 3), label="output features per group")
  # Two examples first: per-example scales then differ from a per-tensor one.
  sizes = {"N": batch_groups * draw(st.sampled_from([2, 1]), label="batch"),
           "C": groups * in_features, "I": in_features,
           "O": groups * batch_groups * out_features}
  spatial_sizes = [draw(st.integers(1, 5), label=f"{d} size") for d in spatial]
  kernel = [draw(st.integers(1, 3), label=f"{d} kernel") for d in spatial]
  strides, lhs_dilation, rhs_dilation = (
      tuple(draw(st.integers(1, 2), label=f"{name} {d}") for d in spatial)
      for name in ("stride", "lhs dilation", "rhs dilation"))
  padding = draw(st.sampled_from(["SAME", "VALID", "SAME_LOWER", "explicit"]), label="padding")
  if padding != "explicit":
    lhs_dilation = (1,) * len(spatial)  # lax takes no padding name with lhs dilation
  else:
    padding = []
    for n, dilation in zip(spatial_sizes, lhs_dilation):
      low, high = (draw(st.integers(-1, 2), label=side) for side in ("low", "high"))
      if float_conv and low < 0 < high:
        high = 0
      # No less than nothing left of the dilated input.
      padding.append((low, high) if (n - 1) * dilation + 1 + low + high >= 0 else (0, 0))
  shape = lambda spec, spatial_values: tuple(
      spatial_values[spatial.index(c)] if c in spatial else sizes[c] for c in spec)
  return ConvLayout(shape(lhs_spec, spatial_sizes), shape(rhs_spec, kernel), dict(
      window_strides=strides, padding=padding, lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation, dimension_numbers=(lhs_spec, rhs_spec, out_spec),
      feature_group_count=groups, batch_group_count=batch_groups))


def _conv_kernel(rng, shape, dtype=F32):
  """A float kernel as _draw_drop_in_operands' weight: normal, a tenth of it zero."""
  kernel = rng.normal(0, 0.1, shape)
  return np.where(rng.random(shape) < 0.1, 0, kernel).astype(dtype)


def _per_example_activations(rng, shape, dtype, **options):
  """_dynamic_activations with a row per example (the batch dim, first in every layout drawn,
  and all the others), half the rows times 0.91362804: a scale off the powers of two, whose
  product with the kernel's rounds (the values near ties, no longer on them)."""
  rows = (shape[0], math.prod(shape[1:]))
  x = _dynamic_activations(rng, rows, np.float32, 127, **options)
  x = x * rng.choice(np.float32([1, 0.91362804]), (rows[0], 1))
  return x.astype(dtype).reshape(shape)


def _integer_conv_oracle(lhs_values, lhs_scale, rhs_values, rhs_scale, layout, dtype):
  """The int64 convolution of the integer drop-ins, then ``float32(acc) * (s_lhs * s_rhs)`` in
  ``dtype``: the lhs scale per tensor or per example, the kernel's per output feature, laid
  out along the output's batch and feature dims, their product in float32."""
  accumulator = integer_conv(lhs_values, rhs_values, **layout.options)
  return conv_epilogue(accumulator, lhs_scale, rhs_scale, layout.numbers.out_spec, dtype)


# Each example runs the op eagerly and vmapped, which compiles each primitive of its two
# dynamic scales on its own for the example's shapes: seconds each.
@hypothesis.settings(max_examples=examples(0.05, minimum=3))
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_conv_general_dilated_dynamic_int8(data, seed):
  """Any _conv_layouts convolution of float32 or bfloat16 activations on or near ties of
  their per-example scale (NaN, inf), float32 or bfloat16 kernels, a preferred result dtype or
  none: the int64 convolution of the integers quantized as documented (``max|x| / 127`` per
  example, per tensor with batch groups; per output feature for the kernel), then
  ``float32(acc) * (s_lhs * s_rhs)`` in the result dtype. Bit for bit four ways, the kernel
  mapped too."""
  layout = data.draw(_conv_layouts(), label="layout")
  x_dtype = data.draw(st.sampled_from([F32, BF16]), label="x dtype")
  w_dtype = data.draw(st.sampled_from([F32, BF16]), label="kernel dtype")
  preferred = data.draw(st.sampled_from([None, F32, BF16]), label="preferred element type")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  operands = [(_per_example_activations(rng, layout.lhs_shape, x_dtype),
               _conv_kernel(rng, layout.rhs_shape, w_dtype)) for rng in rngs]
  op = functools.partial(jq.conv_general_dilated_dynamic_int8, preferred_element_type=preferred,
                         **layout.options)
  _four_ways(op, operands[0], operands[1])

  lhs, rhs = operands[0]
  out_feature = layout.numbers.rhs_spec[0]
  lhs_values, lhs_scale = _symmetric_oracle(lhs, layout.lhs_reduced, np.int8)
  rhs_values, rhs_scale = _symmetric_oracle(
      rhs, tuple(d for d in range(rhs.ndim) if d != out_feature), np.int8)
  expected = _integer_conv_oracle(lhs_values, lhs_scale, rhs_values, rhs_scale, layout,
                                  preferred or jnp.result_type(lhs.dtype, rhs.dtype))
  assert_bits_equal(op(lhs, rhs), expected, "against int64 arithmetic")


@hypothesis.settings(max_examples=_examples())
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_conv_general_dilated_weight_only(data, seed):
  """Any _conv_layouts convolution, int8/4/2 and float8 kernels per output feature or in
  ragged blocks along the input features, absmax or minmax, float or stored (packed or
  not): bit for bit the float convolution of the kernel :func:`quantize_params` stores, each
  on its own; jitted, closed over or vmapped, to float32 summation error."""
  layout = data.draw(_conv_layouts(float_conv=True), label="layout")
  dtype = data.draw(st.sampled_from(SYMMETRIC_DTYPES + (np.dtype(jnp.float8_e4m3fn),)),
                    label="dtype")
  # minmax (a zero point) is for integer dtypes only.
  methods = ["absmax", "minmax"] if dtype in SYMMETRIC_DTYPES else ["absmax"]
  method = data.draw(st.sampled_from(methods), label="method")
  # Blocks of 2 are ragged for 1 or 3 input features per group (1 would give each element
  # a scale of its own).
  block_size = data.draw(st.sampled_from([0, 2, 3]), label="block size")
  stored = data.draw(st.booleans(), label="stored kernel")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  kernel = _conv_kernel(rngs[0], layout.rhs_shape)
  lhses = [_nbits_activations(rng, layout.lhs_shape) for rng in rngs]
  # The documented layouts: quantize_params' axis along the kernel's output features, or
  # blocks along its input features.
  numbers = layout.numbers
  axis = numbers.rhs_spec[1] if block_size else numbers.rhs_spec[0]
  rule = jq.QuantizationRule(dtype=dtype, axis=axis, block_size=block_size, method=method)
  if stored:
    packed = data.draw(st.booleans(), label="packed") if bit_width(dtype) < 8 else False
    rule = dataclasses.replace(rule, packed=packed)
  quantized = jq.quantize_params(kernel, rule)
  dequantized = quantized.dequantize()
  op = functools.partial(jq.conv_general_dilated_weight_only,
                         rhs=quantized if stored else kernel, dtype=dtype,
                         block_size=block_size, method=method, **layout.options)
  # The drop-in is lax.conv_general_dilated of the dequantized kernel, a float
  # convolution whose summation order XLA:CPU picks per program (docs/numerics.md).
  contract = functools.partial(jax.lax.conv_general_dilated, **layout.options)
  bounds = [_bilinear_bounds(contract, lhs, np.asarray(dequantized)) for lhs in lhses]
  _four_ways(op, (lhses[0],), (lhses[1],), same=_within_summation_error(bounds))
  expected = contract(lhses[0], dequantized)
  assert_bits_equal(op(lhses[0]), expected, "the dequantized kernel's convolution")


# As test_conv_general_dilated_dynamic_int8, with one dynamic scale: half the time.
@hypothesis.settings(max_examples=examples(0.1, minimum=3))
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_conv_general_dilated_static_int8(data, seed):
  """Any _conv_layouts convolution of activations on ties of a drawn per-tensor scale
  (float32 or bfloat16, shaped () or (1,)), their neighbours, past the range, NaN and inf,
  with an int8 zero point or none, float32 kernels: the int64 convolution of the integers
  less the zero point (so padding is still 0.0) and the kernel's, quantized as documented
  (``max|w| / 127`` per output feature), then ``float32(acc) * (s_in * s_rhs)``. Bit for bit
  four ways, the scale and zero point traced too."""
  layout = data.draw(_conv_layouts(), label="layout")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  kernel = _conv_kernel(rngs[0], layout.rhs_shape)
  arguments = _draw_static_arguments(data, rngs, layout.lhs_shape)

  def op(x, input_scale, input_zero_point=None):
    return jq.conv_general_dilated_static_int8(
        x, kernel, input_scale=input_scale, input_zero_point=input_zero_point, **layout.options)

  _four_ways(op, arguments[0], arguments[1])

  values, scale = _static_oracle(*arguments[0])
  out_feature = layout.numbers.rhs_spec[0]
  rhs_values, rhs_scale = _symmetric_oracle(
      kernel, tuple(d for d in range(kernel.ndim) if d != out_feature), np.int8)
  expected = _integer_conv_oracle(values, scale, rhs_values, rhs_scale, layout,
                                  jnp.result_type(arguments[0][0].dtype, kernel.dtype))
  assert_bits_equal(op(*arguments[0]), expected, "against int64 arithmetic")


# As test_dot_general_fake_quant: seconds per example.
@hypothesis.settings(max_examples=examples(0.05, minimum=3))
@hypothesis.given(data=st.data(), seed=st.integers(0, 2**31))
def test_conv_general_dilated_fake_quant(data, seed):
  """Any _conv_layouts convolution of float32 or bfloat16 activations on or near ties of
  their per-example scale (NaN and inf more often, a NaN in each), kernels of their dtype
  (lax's convolution takes no other), a random cotangent: the value and vjp of
  :func:`_fake_quant_oracle` with ``lax.conv_general_dilated``, per example (per tensor with
  batch groups). Bit for bit eagerly; jitted, closed over or vmapped (the kernel and
  cotangent mapped too), to float32 summation error."""
  layout = data.draw(_conv_layouts(float_conv=True), label="layout")
  x_dtype = data.draw(st.sampled_from([F32, BF16]), label="x dtype")
  rngs = [np.random.default_rng(seed + i) for i in range(2)]
  contract = functools.partial(jax.lax.conv_general_dilated, **layout.options)
  out_shape = jax.eval_shape(contract, jax.ShapeDtypeStruct(layout.lhs_shape, x_dtype),
                             jax.ShapeDtypeStruct(layout.rhs_shape, x_dtype)).shape
  # As test_dot_general_fake_quant's, a NaN in every example.
  arguments = [(_with_nan(rng, _per_example_activations(rng, layout.lhs_shape, x_dtype,
                                                        special_rate=0.03)),
                _conv_kernel(rng, layout.rhs_shape, x_dtype),
                rng.standard_normal(out_shape).astype(x_dtype)) for rng in rngs]
  op = _with_vjp(functools.partial(jq.conv_general_dilated_fake_quant, **layout.options))
  (expected, bounds), (_, other_bounds) = (
      _fake_quant_oracle(contract, lhs, layout.lhs_reduced, rhs, cotangent)
      for lhs, rhs, cotangent in arguments)
  _four_ways(op, arguments[0], arguments[1],
             same=_within_summation_error([bounds, other_bounds]))
  _assert_same(expected, op(*arguments[0]), "as documented")
