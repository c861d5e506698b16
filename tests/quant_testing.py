"""What the test suites share: dtypes, implementations, bit equality, layouts, the documented model.

Test modules import from here (``tests/`` is on ``sys.path``), never from one
another. ONNX graphs are built and run by ``onnx_oracle``.

The documented model (``spec_quantize``, ``spec_dequantize``) is
docs/numerics.md written out in NumPy, element by element on full-shape
operands; the oracle suites compare against it where an oracle deviates.
"""

from __future__ import annotations

from collections.abc import Iterator
import dataclasses
import functools
import inspect
import math
import operator
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import hypothesis
from hypothesis import strategies as st
import ml_dtypes
import numpy as np
from onnx import helper
import pytest

# --- dtypes: one table, named subsets of it ---------------------------------------------

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
# The float dtypes of x, scales and dequantized outputs.
FLOAT_DTYPES = (F32, F16, BF16)
INT32 = np.dtype(np.int32)
FLOAT4 = np.dtype(ml_dtypes.float4_e2m1fn)

QUANTIZED_DTYPES = tuple(np.dtype(d) for d in (
    ml_dtypes.int2, ml_dtypes.uint2, ml_dtypes.int4, ml_dtypes.uint4, np.int8, np.uint8,
    np.int16, np.uint16, np.int32, np.uint32,
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e5m2fnuz, ml_dtypes.float4_e2m1fn,
    ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn,
))


def dtype_name(dtype: Any) -> str:
  """``dtype``'s name: the id of a test parametrized over dtypes."""
  return np.dtype(dtype).name


def is_integer(dtype: Any) -> bool:
  return dtype_name(dtype).startswith(("int", "uint"))


def bit_width(dtype: Any) -> int:
  return (ml_dtypes.iinfo if is_integer(dtype) else ml_dtypes.finfo)(dtype).bits


def _select(predicate) -> tuple[np.dtype, ...]:
  return tuple(d for d in QUANTIZED_DTYPES if predicate(d))


INTEGER_DTYPES = _select(is_integer)
SIGNED_INTEGER_DTYPES = _select(lambda d: is_integer(d) and ml_dtypes.iinfo(d).min < 0)
INTEGER_DTYPES_TO_16_BITS = _select(lambda d: is_integer(d) and bit_width(d) <= 16)
INTEGER_DTYPES_32_BITS = _select(lambda d: is_integer(d) and bit_width(d) == 32)
SUB_BYTE_INTEGER_DTYPES = _select(lambda d: is_integer(d) and bit_width(d) < 8)
FOUR_BIT_INTEGER_DTYPES = _select(lambda d: is_integer(d) and bit_width(d) == 4)
FLOAT8_DTYPES = _select(lambda d: d.name.startswith("float8"))
# XLA has no float6 type: its values are NumPy arrays in tests and uint8 codes on
# the device (jaxquant reads the NumPy arrays as codes before its jit boundary).
FLOAT6_DTYPES = _select(lambda d: d.name.startswith("float6"))
# Float dtypes without NaN or inf: they always saturate, NaN giving +max.
SATURATING_FLOAT_DTYPES = (FLOAT4, *FLOAT6_DTYPES)
TWO_BIT_DTYPES = _select(lambda d: bit_width(d) == 2)
FOUR_BIT_DTYPES = _select(lambda d: bit_width(d) == 4)
# What pack/unpack take besides float6 (which packs as a 6-bit stream).
SUB_BYTE_DTYPES = TWO_BIT_DTYPES + FOUR_BIT_DTYPES

# The MSE search's clip ratios as docs/numerics.md states them, written out here rather
# than read from the library: 1, 0.98, ..., 0.2, the first (largest) of equal errors kept.
MSE_CLIP_RATIOS = tuple(np.float32(1 - 0.02 * i) for i in range(41))

# --- implementations ----------------------------------------------------------------------

# The engines behind an op's ``implementation=``; Pallas runs in interpret mode on CPU.
IMPLEMENTATIONS = ("xla", "pallas")


def examples(fraction: float, minimum: int = 5) -> int:
  """A share of the active profile's max_examples, so "thorough" scales too."""
  return max(minimum, int(hypothesis.settings.default.max_examples * fraction))


def given_per_implementation(xla: float | int, pallas: float | int, **strategies):
  """``hypothesis.given(**strategies)`` for a test parametrized over ``implementation``.

  ``xla`` and ``pallas`` are each a float, the share of the profile's examples
  (``examples(share, minimum=3)``), or an int, the count itself. Pallas gets
  fewer: on CPU it runs in interpret mode and compiles each new shape and
  dtype anew, several times slower than XLA.
  """
  def count(examples_for):
    if isinstance(examples_for, int):
      return examples_for
    return examples(examples_for, minimum=3)

  def decorate(test):
    signature = inspect.signature(test)

    @functools.wraps(test)
    def run(*args, **kwargs):
      bound = signature.bind_partial(*args, **kwargs).arguments
      implementation = bound["implementation"]

      @hypothesis.settings(max_examples=count(xla if implementation == "xla" else pallas))
      @hypothesis.given(**strategies)
      def with_examples(**drawn):
        test(**bound, **drawn)

      with_examples()

    run.__signature__ = signature.replace(parameters=[
        p for name, p in signature.parameters.items() if name not in strategies])
    del run.__wrapped__  # pytest reads the signature above, not test's
    return run
  return decorate


# --- bit equality -----------------------------------------------------------------------------


def bits(a: Any) -> np.ndarray:
  """Raw storage bits, so -0.0/+0.0 and NaN payloads compare unequal."""
  a = np.asarray(a)
  return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


def _is_float(dtype: np.dtype) -> bool:
  return dtype.name.startswith(("float", "bfloat"))


def assert_bits_equal(actual: Any, expected: Any, message: str = "") -> None:
  """Equal dtypes, shapes and bits, so -0.0 != 0.0; NaN equals any NaN.

  IEEE leaves a NaN's sign and payload to the hardware (x86 makes 0 * inf a
  negative NaN), and no rule of docs/numerics.md depends on them.
  """
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype, (message, actual.dtype, expected.dtype)
  assert actual.shape == expected.shape, (message, actual.shape, expected.shape)
  if not _is_float(actual.dtype):
    np.testing.assert_array_equal(actual, expected, err_msg=message)
    return
  with np.errstate(invalid="ignore"):  # a signaling NaN among the bits is still a NaN
    nan, expected_nan = np.isnan(actual), np.isnan(expected)
  np.testing.assert_array_equal(nan, expected_nan, err_msg=message)
  np.testing.assert_array_equal(bits(actual)[~nan], bits(expected)[~nan], err_msg=message)


def assert_tree_bits_equal(actual: Any, expected: Any, message: str = "") -> None:
  """:func:`assert_bits_equal` leaf by leaf of two pytrees of one structure."""
  import jax  # pylint: disable=import-outside-toplevel

  assert jax.tree.structure(actual) == jax.tree.structure(expected), message
  for actual_leaf, expected_leaf in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert_bits_equal(actual_leaf, expected_leaf, message)


def assert_matches_oracle(actual, expected, *, context, inputs, deviating=None, spec=None):
  """Bitwise equality with an oracle; where ``deviating``, with ``spec`` instead.

  ``spec`` is the documented model's value for the elements where the oracle
  deviates from docs/numerics.md. NaN against NaN compares NaN-ness only, as
  ``assert_bits_equal`` does. A failure lists the first differing elements with
  their ``inputs`` (full-shape arrays, or None).
  """
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype, context)
  assert actual.shape == expected.shape, (actual.shape, expected.shape, context)
  want = bits(expected)
  if deviating is not None and deviating.any():
    want = np.where(deviating, bits(spec), want)
  got = bits(actual)
  if not is_integer(actual.dtype) and actual.dtype != FLOAT4:
    want_value = want.view(actual.dtype).astype(np.float32)
    both_nan = np.isnan(actual.astype(np.float32)) & np.isnan(want_value)
    if np.any(both_nan & (got != want)):
      hypothesis.event(f"NaN bits differ ({actual.dtype.name})")
    got = np.where(both_nan, want, got)
  if not np.array_equal(got, want):
    rows = []
    for index in map(tuple, np.argwhere(got != want)[:5]):
      values = ", ".join(
          f"{name}={value[index]!r}" for name, value in inputs.items() if value is not None)
      source = "documented model" if deviating is not None and deviating[index] else "oracle"
      rows.append(f"  at {index}: {values}, jaxquant={actual[index]!r} (bits "
                  f"{got[index]:#x}), {source} bits {want[index]:#x}")
    pytest.fail(f"{context}: {np.count_nonzero(got != want)} of {got.size} differ\n"
                + "\n".join(rows))


def tensor_type(dtype: Any) -> int:
  """ONNX's TensorProto type of a NumPy dtype (an ``output_dtype`` or ``precision`` attribute)."""
  return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


# --- granularity (docs/numerics.md, "Granularity") -----------------------------------------

LAYOUT_KINDS = ("per-tensor", "per-axis", "blocked", "broadcast")


@dataclasses.dataclass(frozen=True)
class Layout:
  """One granularity (docs/numerics.md), as jaxquant takes it and as ONNX runs it.

  Attributes:
    kind: one of LAYOUT_KINDS.
    x_shape: the input's shape.
    scale_shape: the scale (and zero point) shape given to jaxquant.
    axis: jaxquant's axis (ONNX's too, except for "broadcast").
    block_size: jaxquant's block_size.
  """

  kind: str
  x_shape: tuple[int, ...]
  scale_shape: tuple[int, ...]
  axis: int = 1
  block_size: int = 0

  @classmethod
  def of(cls, x_shape, scale_shape, axis, block_size) -> Layout:
    """The granularity table's reading of a scale shape, axis and block_size."""
    x_shape, scale_shape = tuple(x_shape), tuple(scale_shape)
    if math.prod(scale_shape) == 1:
      return cls("per-tensor", x_shape, scale_shape)
    if block_size:
      return cls("blocked", x_shape, scale_shape, axis, block_size)
    if len(scale_shape) == 1 and len(x_shape) >= 2:
      return cls("per-axis", x_shape, scale_shape, axis)
    return cls("broadcast", x_shape, scale_shape)

  def full(self, param: np.ndarray) -> np.ndarray:
    """``param`` (scale-shaped) repeated out to x's shape, as the granularity table defines."""
    if self.kind == "per-tensor":
      return np.broadcast_to(param.reshape(()), self.x_shape)
    rank = len(self.x_shape)
    if self.kind == "per-axis":
      shape = [1] * rank
      shape[self.axis] = param.size
      return np.broadcast_to(param.reshape(shape), self.x_shape)
    if self.kind == "blocked":
      axis = self.axis % rank
      repeated = np.repeat(param, self.block_size, axis=axis)
      return np.take(repeated, np.arange(self.x_shape[axis]), axis=axis)
    param = param.reshape((1,) * (rank - param.ndim) + param.shape)
    for d, (p, n) in enumerate(zip(param.shape, self.x_shape)):
      param = np.repeat(param, n // p if p else 1, axis=d)
    return np.broadcast_to(param, self.x_shape)

  def onnx(self, param: np.ndarray | None) -> tuple[np.ndarray | None, dict[str, int]]:
    """The parameter and attributes for the ONNX node."""
    if self.kind == "per-tensor":
      return param, {}
    if math.prod(self.scale_shape) == 1:
      # O5: onnxruntime reads any one-element scale as per-tensor, then refuses
      # block_size, and takes only () or (1,) there: jaxquant calls it per-tensor too.
      return None if param is None else param.reshape(()), {}
    if self.kind == "per-axis":
      return param, {"axis": self.axis}
    if self.kind == "blocked":
      return param, {"axis": self.axis, "block_size": self.block_size}
    # No ONNX mode repeats along several dims: a full-shape scale blocked by 1.
    full = None if param is None else np.ascontiguousarray(self.full(param))
    return full, {"axis": 0, "block_size": 1}


def expand_scale(param, x_shape, axis, block_size) -> np.ndarray:
  """A scale or zero point repeated out to x's shape: the slow, obvious reading of the table."""
  param = np.asarray(param)
  return Layout.of(x_shape, param.shape, axis, block_size).full(param)


@st.composite
def shapes(draw, min_rank=0, max_rank=8, max_size=512):
  """Shapes of rank min_rank..max_rank with at most max_size elements, some empty."""
  rank = draw(st.integers(min_rank, max_rank))
  cap = 24 if rank <= 2 else 6
  shape = [draw(st.integers(1, cap)) for _ in range(rank)]
  while np.prod(shape, dtype=np.int64) > max_size:
    largest = int(np.argmax(shape))
    shape[largest] = max(1, shape[largest] // 2)
  if rank and draw(st.integers(0, 9)) == 0:
    shape[draw(st.integers(0, rank - 1))] = 0
  return tuple(shape)


@st.composite
def layouts_for(draw, x_shape):
  """A Layout of any kind for ``x_shape``, block sizes over ONNX's whole accepted range."""
  rank = len(x_shape)
  kind = "per-tensor" if rank == 0 else draw(st.sampled_from(LAYOUT_KINDS))
  if kind == "per-tensor":
    return Layout(kind, x_shape, draw(st.sampled_from([(), (1,)])))
  axis = draw(st.integers(-rank, rank - 1))
  length = x_shape[axis]
  if kind == "per-axis":
    return Layout(kind, x_shape, (length,), axis=axis)
  if kind == "blocked":
    # Every block_size is in ONNX's accepted range [ceil(D/S), ceil(D/(S-1)) - 1]
    # for S = ceil(D/block_size), and every valid (S, block_size) pair is
    # reachable; block sizes that do not divide D give a ragged last block.
    # An empty axis has 0 blocks of any size.
    block_size = draw(st.integers(1, length + 2))
    blocks = -(-length // block_size)
    scale_shape = list(x_shape)
    scale_shape[axis] = blocks
    return Layout(kind, x_shape, tuple(scale_shape), axis=axis, block_size=block_size)
  scale_rank = draw(st.sampled_from(sorted({rank, *range(2, rank)})))
  scale_shape = []
  for n in x_shape[rank - scale_rank:]:
    # Any scale dim divides an empty one (0 included): it repeats 0 times.
    divisors = [p for p in range(1, n + 1) if n % p == 0] if n else [0, 1, 2, 3]
    scale_shape.append(draw(st.sampled_from(divisors)))
  return Layout(kind, x_shape, tuple(scale_shape))


@st.composite
def layouts(draw):
  """(x shape, scale shape, axis, block_size) over every row of docs/numerics.md, "Granularity"."""
  rank = draw(st.integers(0, 5))
  x_shape = tuple(draw(st.lists(st.integers(0, 5), min_size=rank, max_size=rank)))
  kind = draw(st.sampled_from(LAYOUT_KINDS))
  if rank == 0 or kind == "per-tensor":
    return x_shape, draw(st.sampled_from([(), (1,)])), 1, 0
  axis = draw(st.integers(-rank, rank - 1))
  if kind == "per-axis" and rank >= 2:
    return x_shape, (x_shape[axis],), axis, 0
  if kind == "blocked":
    block_size = draw(st.integers(1, 6))
    scale_shape = list(x_shape)
    scale_shape[axis] = -(-x_shape[axis] // block_size)
    return x_shape, tuple(scale_shape), axis, block_size
  scale_shape = tuple(
      n if n == 0 else draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
      for n in x_shape
  )
  # Drop leading dims now and then: the NumPy rank rule of the last row.
  drop = draw(st.integers(0, max(0, rank - 2)))
  return x_shape, scale_shape[drop:], axis, 0


# Small fixed layouts for the transformation tests: (x shape, scale shape, options).
CASES = {
    "per-tensor": ((5, 7), (), {}),
    "per-axis": ((5, 7), (7,), dict(axis=1)),
    "blocked-ragged": ((5, 7), (5, 3), dict(axis=1, block_size=3)),
    "broadcast-2d-blocks": ((6, 8), (3, 2), {}),
}


# --- inputs near the rounding decisions --------------------------------------------------------


def pick(rng, choices, shape, weights=None):
  """Elementwise choice from ``choices`` (rows stacked on axis 0)."""
  index = rng.choice(len(choices), size=shape, p=weights)
  return np.choose(index, choices) if np.ndim(choices[0]) else np.asarray(choices)[index]


def without_float32_subnormals(a):
  """``a`` with float32-subnormal values replaced by zeros of the same sign (J1)."""
  value = a.astype(np.float32)
  subnormal = (value != 0) & (np.abs(value) < np.finfo(np.float32).tiny)
  return np.where(subnormal, np.copysign(0.0, value), a).astype(a.dtype)


def scales(rng, shape, dtype, special_rate):
  """Positive scales that make exact ties likely, plus tiny, huge and non-finite ones."""
  info = ml_dtypes.finfo(dtype)
  nice = rng.integers(1, 16, shape) * 2.0 ** rng.integers(-12, 5, shape)
  wild = np.exp(rng.uniform(np.log(2.0**-20), np.log(2.0**10), shape))
  # J1: float32 subnormals are flushed by XLA on CPU; float16's are float32 normals.
  tiny = [float(info.tiny), float(info.smallest_subnormal)] if dtype == F16 else [2.0**-100]
  specials = np.array([
      *tiny, float(info.max), float(info.max) / 4, 0.0, -0.0, -0.75, np.nan, np.inf, -np.inf,
      2.0**-30,
  ])
  scale = np.where(rng.random(shape) < 0.6, nice, wild)
  scale = np.where(rng.random(shape) < special_rate, pick(rng, specials, shape), scale)
  return without_float32_subnormals(scale.astype(dtype))


def float_grid(qdtype):
  """The finite values of a float quantized dtype, ascending."""
  values = np.arange(2 ** ml_dtypes.finfo(qdtype).bits, dtype=np.uint8).view(qdtype)
  values = values.astype(np.float64)
  return np.unique(values[np.isfinite(values)])


def quantize_inputs(rng, qdtype, x_dtype, scale_full, zero_point_full, special_rate):
  """x near quantize_linear's rounding decisions for its element's scale."""
  shape = scale_full.shape
  scale64 = scale_full.astype(np.float64)
  if is_integer(qdtype):
    info = ml_dtypes.iinfo(qdtype)
    zp = 0.0 if zero_point_full is None else zero_point_full
    low, high = info.min - zp - 3, info.max - zp + 3
    k = np.floor(low + rng.random(shape) * (high - low + 1))
    # Half of the draws sit next to the saturation boundaries.
    edge = np.where(rng.random(shape) < 0.5, low + rng.integers(0, 5, shape),
                    high - rng.integers(0, 5, shape))
    k = np.where(rng.random(shape) < 0.3, edge, k)
    exact, tie = k, k + 0.5
    spread = (info.min - zp - (high - low), info.max - zp + (high - low))
  else:
    grid = float_grid(qdtype)
    index = rng.integers(0, len(grid) - 1, shape)
    exact, tie = grid[index], (grid[index] + grid[index + 1]) / 2
    spread = (-2.0 * grid[-1], 2.0 * grid[-1])
  uniform = spread[0] + rng.random(shape) * (spread[1] - spread[0])
  with np.errstate(over="ignore", invalid="ignore"):
    tie_x = (tie * scale64).astype(x_dtype)
    infinity = np.array(np.inf, x_dtype)
    candidates = [
        tie_x,
        (exact * scale64).astype(x_dtype),
        np.nextafter(tie_x, infinity) if x_dtype != BF16 else tie_x,
        np.nextafter(tie_x, -infinity) if x_dtype != BF16 else tie_x,
        (uniform * scale64).astype(x_dtype),
    ]
  if x_dtype == BF16:
    # NumPy has no nextafter for bfloat16: step the bit pattern instead.
    pattern = tie_x.view(np.uint16).astype(np.int32)
    candidates[2] = np.where(np.isfinite(tie_x.astype(np.float32)),
                             pattern + 1, pattern).astype(np.uint16).view(BF16)
    candidates[3] = np.where(np.isfinite(tie_x.astype(np.float32)) & (pattern & 0x7FFF != 0),
                             pattern - 1, pattern).astype(np.uint16).view(BF16)
  x = pick(rng, [c.astype(x_dtype) for c in candidates], shape,
           weights=[0.35, 0.15, 0.15, 0.15, 0.2])
  info = ml_dtypes.finfo(x_dtype)
  specials = np.array([
      np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, float(info.max), -float(info.max),
      float(info.tiny), -float(info.smallest_subnormal), 3e9, -3e9, 2.0**31, 65504.0,
  ]).astype(x_dtype)
  with np.errstate(over="ignore"):
    x = np.where(rng.random(shape) < special_rate, pick(rng, specials, shape), x)
  return without_float32_subnormals(x.astype(x_dtype))


# --- docs/numerics.md in NumPy ------------------------------------------------------------------


def division_precision(scale_dtype, precision):
  """ONNX's rule: ``precision`` if given, else the scale's dtype."""
  return np.dtype(precision) if precision is not None else np.dtype(scale_dtype)


def ieee_quotient(x, scale, precision):
  """x / scale as IEEE division in ``precision``, as float64 (exact)."""
  return (x.astype(precision) / scale.astype(precision)).astype(np.float64)


def spec_quantize(quotient, zero_point, qdtype, saturate=True):
  """The documented quantize of an exact quotient; zero_point full-shape float64 or None."""
  if is_integer(qdtype):
    info = ml_dtypes.iinfo(qdtype)
    y = np.rint(quotient)
    if zero_point is not None:
      y = y + zero_point
    y = np.where(np.isnan(y), info.min, np.clip(y, info.min, info.max))
    return y.astype(qdtype)
  if zero_point is not None:
    # A zero point 0 is no zero point (-0.0 stays); others add in float32.
    shifted = quotient.astype(np.float32) + zero_point.astype(np.float32)
    quotient = np.where(zero_point == 0, quotient, shifted)
  if saturate or qdtype in SATURATING_FLOAT_DTYPES:
    limit = float(ml_dtypes.finfo(qdtype).max)
    quotient = np.clip(quotient, -limit, limit)
  if qdtype in SATURATING_FLOAT_DTYPES:
    # No NaN: ONNX's float4 Cast table sends it to +6 (ml_dtypes: +-0), and
    # jaxquant sends float6 NaN to +max alike (R6, R10).
    quotient = np.where(np.isnan(quotient), float(ml_dtypes.finfo(qdtype).max), quotient)
  # float64 -> float32 is exact here; ml_dtypes then rounds once, IEEE-style.
  return quotient.astype(np.float32).astype(qdtype)


def spec_symmetric_scale(x, reduced, dtype) -> np.ndarray:
  """The symmetric scale the drop-ins document, in NumPy: ``max|x| / qmax`` over the
  ``reduced`` dims (kept as size 1), NaN ignored, 1 where that maximum is 0."""
  magnitude = np.abs(np.asarray(x, np.float32))
  magnitude = np.max(np.where(np.isnan(magnitude), 0, magnitude), axis=reduced,
                     keepdims=True, initial=0)
  qmax = np.float32(ml_dtypes.iinfo(np.dtype(dtype)).max)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(magnitude == 0, np.float32(1), magnitude / qmax).astype(np.float32)


def spec_fake_quantize(x, scale, zero_point, qdtype, axis, block_size) -> np.ndarray:
  """x quantized at a float32 scale and dequantized by the documented formulas, in x's dtype."""
  x = np.asarray(x)
  full = lambda param: expand_scale(np.asarray(param), x.shape, axis, block_size)
  scale = full(scale).astype(np.float32)
  zero_point = None if zero_point is None else full(zero_point).astype(np.float64)
  q = spec_quantize(ieee_quotient(x, scale, np.float32), zero_point, qdtype)
  return spec_dequantize(q, scale, zero_point, x.dtype)


def wrap_int32(x) -> np.ndarray:
  """Integers (exact, as int64) reduced to int32 as two's complement wraps them (ONNX's int32)."""
  return ((np.asarray(x, np.int64) + 2**31) % 2**32 - 2**31).astype(np.int32)


def spec_dequantize(x, scale, zero_point, output_dtype):
  """The documented dequantize, elementwise on full-shape operands."""
  if is_integer(x.dtype):
    wide = x.astype(np.int64)
    if zero_point is not None:
      wide = wide - zero_point.astype(np.int64)
    # int32 inputs wrap around in their own width (docs/numerics.md).
    difference = wide.astype(np.int32).astype(np.float32)
  else:
    difference = x.astype(np.float32)
    if zero_point is not None:
      difference = difference - zero_point.astype(np.float32)
  return (difference * scale.astype(np.float32)).astype(output_dtype)


def _nbits_codes(packed, rows, bits):
  """Each row's unsigned ``bits``-bit codes, LSB first in each byte (onnxruntime's order)."""
  data = np.asarray(packed, np.uint8).reshape(rows, -1)
  codes = (data[:, :, None] >> np.arange(0, 8, bits, dtype=np.uint8)) & (2**bits - 1)
  return codes.reshape(rows, -1)


def spec_nbits_weight(b, scales, zero_points, *, k, n, bits, block_size):
  """MatMulNBits' ``(N, K)`` float32 weight ``(q - z) * s``, per block of K (docs/numerics.md);
  absent zero points are ``2**(bits - 1)``, packed ones codes like b's, float ones as given."""
  blocks = -(-k // block_size)
  if zero_points is None:
    zero = np.full((n, blocks), 2 ** (bits - 1), np.float32)
  elif np.issubdtype(np.asarray(zero_points).dtype, np.floating):
    zero = np.asarray(zero_points, np.float32).reshape(n, blocks)
  else:
    zero = _nbits_codes(zero_points, n, bits)[:, :blocks].astype(np.float32)
  block = np.arange(k) // block_size
  codes = _nbits_codes(b, n, bits)[:, :k].astype(np.float32)
  scale = np.asarray(scales, np.float32).reshape(n, blocks)
  return (codes - zero[:, block]) * scale[:, block]


def conv_epilogue(accumulator, lhs_scale, rhs_scale, out_spec, dtype) -> np.ndarray:
  """The int8 convolution drop-ins' ``float32(acc) * (s_lhs * s_rhs)`` in ``dtype``: the lhs
  scale per tensor or per example along the output's batch dim (``out_spec[0]``), the
  kernel's per tensor or per output feature along its feature dim (``out_spec[1]``), their
  product in float32 first."""
  batch, feature = out_spec[:2]
  accumulator = np.asarray(accumulator)
  along = lambda scale, d: np.asarray(scale, np.float32).reshape(
      [-1 if e == d else 1 for e in range(accumulator.ndim)])
  with np.errstate(over="ignore", invalid="ignore"):  # an inf scale: inf and NaN, as documented
    value = accumulator.astype(np.float32) * (along(lhs_scale, batch) * along(rhs_scale, feature))
  return value.astype(dtype)


def summation_error(magnitude, terms: int) -> np.ndarray:
  """How far two float32 sums of ``terms`` products, ``magnitude`` the sum of the products'
  magnitudes, summed in different orders may differ: each rounds the products and the
  partial sums, so 4 ``terms`` eps of the magnitude."""
  return 4 * terms * np.finfo(np.float32).eps * magnitude


def summation_bound(a, weight, bias=None) -> np.ndarray:
  """:func:`summation_error` of ``a @ weight.T + bias`` (weight ``(..., N, K)``, batch dims
  broadcast): K products, and the bias."""
  magnitude = np.abs(a) @ np.swapaxes(np.abs(weight), -1, -2)
  if bias is not None:
    magnitude = magnitude + np.abs(bias)
  return summation_error(magnitude, weight.shape[-1])


def xla_cpu():
  """The host's CPU as JAX's default device, as a context manager.

  What XLA:CPU computes or compiles, on any machine: a test of XLA:CPU's
  compiled program (the ``xla_cpu`` mark runs the whole test in it), or a
  reference that XLA:GPU cannot run (an integer convolution). On a CPU-only
  machine it changes nothing.
  """
  import jax  # pylint: disable=import-outside-toplevel
  return jax.default_device(jax.devices("cpu")[0])


def integer_conv(lhs, rhs, *args, **options) -> np.ndarray:
  """``lax.conv_general_dilated`` of integer operands in int64, on the host's CPU.

  The integer convolution references: no sum wraps, and XLA:GPU, which runs
  no integer convolution, is not asked to.
  """
  import jax  # pylint: disable=import-outside-toplevel
  with jax.enable_x64(True), xla_cpu():
    return np.asarray(jax.lax.conv_general_dilated(
        np.asarray(lhs, np.int64), np.asarray(rhs, np.int64), *args, **options))


def allowed_cpus() -> list[int]:
  """The CPUs this process may run on, which a subprocess inherits; empty off Linux."""
  return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def one_cpu_arguments() -> list[str]:
  """A benchmark script's ``--cpus 1`` where the process may use more than one CPU."""
  return ["--cpus", "1"] if len(allowed_cpus()) > 1 else []


def run_on_cpu_devices(program: str, count: int, *, timeout: float = 300) -> str:
  """Runs ``program`` in a fresh interpreter with ``count`` simulated CPU devices.

  The device count is fixed when jax starts, so a multi-device test needs its own
  process. Returns the program's stdout; fails the test with its stderr's tail.
  """
  environment = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
                     JAX_PLATFORMS="cpu",
                     PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
  result = subprocess.run([sys.executable, "-c", program], env=environment,
                          capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


# --- the kernels' reference: jaxquant's own XLA evaluation ---------------------------------


def xla_evaluation(formula, x, params, *, output_dtype, blocks=None):
  """What jaxquant's XLA path computes for a kernel's call, to compare the kernel against.

  ``params`` are in the kernels' layout (x's rank; each dim 1, x's size, or
  one element per block of ``blocks[d]``); the formula runs through
  ``Parameters.apply``'s view (``_granularity.apply_blockwise``), each
  parameter expanded over the x elements it covers.
  """
  from jaxquant import _granularity  # pylint: disable=import-outside-toplevel

  param_shape = next(p.shape for p in params if p is not None)
  blocks = blocks or (1,) * x.ndim
  block_shape = tuple(
      b if b > 1 else (n if p == 1 else 1)
      for n, p, b in zip(x.shape, param_shape, blocks))
  granularity = _granularity.Granularity("blocked", param_shape, block_shape)
  return _granularity.apply_blockwise(formula, x, params, granularity).astype(output_dtype)


def xla_dynamic_evaluation(x, keep, *, reduction, parameters, formula, output_dtype):
  """jaxquant's XLA dynamic quantization for a kernel's call: reduce over the dims not kept,
  then :func:`xla_evaluation`. Returns ``(y, scale, zero_point)``."""
  scale, zero_point = parameters(*reduction(x, tuple(d for d, k in enumerate(keep) if not k)))
  y = xla_evaluation(formula, x, [scale, zero_point], output_dtype=output_dtype)
  return y, scale, zero_point


# --- compiled HLO ----------------------------------------------------------------------------

_ENTRY_BOOKKEEPING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def entry_work(hlo: str) -> list[tuple[str, str, str]]:
  """(opcode, result type, operands) of each ENTRY instruction that does work.

  Parameters, constants, tuples and bitcasts are left out: what remains is
  each pass XLA runs (a fusion, a custom call, a control-flow op).
  """
  entry = re.search(r"^ENTRY [^\n]*\{\n(.*?)\n\}", hlo, re.M | re.S).group(1)
  return [(op, result, operands)
          for result, op, operands in re.findall(r"= (\([^)]*\)|\S+) ([\w\-]+)\(([^)]*)\)", entry)
          if op not in _ENTRY_BOOKKEEPING]


def equations(jaxpr) -> Iterator[Any]:
  """Every equation, also inside jit, cond branches (one per platform) and the like."""
  for equation in jaxpr.eqns:
    yield equation
    for value in equation.params.values():
      for inner in value if isinstance(value, (tuple, list)) else [value]:
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from equations(inner)


def uses_pallas(function, *args) -> bool:
  """Whether ``function(*args)`` runs a Pallas kernel (on some platform branch)."""
  import jax  # pylint: disable=import-outside-toplevel
  jaxpr = jax.make_jaxpr(function)(*args).jaxpr
  return any(e.primitive.name == "pallas_call" for e in equations(jaxpr))


# --- the matmul ops and lax drop-ins as models call them -----------------------------------


def model_calls(seed: int = 0) -> dict[str, tuple[Any, tuple[Any, ...]]]:
  """Each matmul op and ``lax`` drop-in as a layer calls it: name -> (function, arrays).

  The function takes the arrays positionally, activations first, so a test
  can trace them, close them over, or map over them (the seed draws another
  set of the same shapes and dtypes). Scales and zero points are per row or
  column, or blocked, where the op takes them so; a kernel stored by
  :func:`jaxquant.quantize_params` is a pytree of arrays like any other.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jaxquant as jq  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  uniform = lambda *shape: rng.uniform(0.01, 0.05, shape).astype(np.float32)
  integers = lambda dtype, *shape: rng.integers(
      np.iinfo(dtype).min, np.iinfo(dtype).max + 1, shape).astype(dtype)
  dense, sequence = (((1,), (0,)), ((), ())), (((2,), (0,)), ((), ()))
  conv = dict(window_strides=(1, 1), padding="SAME",
              dimension_numbers=("NHWC", "HWIO", "NHWC"))
  x, w = normal(6, 32), normal(32, 8) / 4
  image, kernel = normal(2, 5, 5, 8), normal(3, 3, 8, 16) / 8
  int8 = jq.QuantizationRule()
  int4 = jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=16)  # packed
  static = lambda scale, zero_point: dict(input_scale=scale, input_zero_point=zero_point)
  # ONNX MatMulNBits: (N, K / block_size, block_size / 2) codes, zero points 2 per byte.
  codes = integers(np.uint8, 8, 2, 8)
  return {
      "matmul_integer": (jq.matmul_integer, (
          integers(np.uint8, 6, 32), integers(np.int8, 32, 8), integers(np.uint8, 6),
          integers(np.int8, 8))),
      "qlinear_matmul": (jq.qlinear_matmul, (
          integers(np.uint8, 6, 32), uniform(), integers(np.uint8), integers(np.int8, 32, 8),
          uniform(8), integers(np.int8, 8), uniform() * 8, integers(np.uint8))),
      "matmul_nbits": (lambda a, b, scales, zero_points, bias: jq.matmul_nbits(
          a, b, scales, zero_points, bias, K=32, N=8, block_size=16), (
              x, codes, uniform(8, 2), integers(np.uint8, 8, 1), normal(8))),
      "quantized_dot_general integer": (
          lambda lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale: jq.quantized_dot_general(
              lhs, rhs, dense, lhs_scale=lhs_scale, lhs_zero_point=lhs_zero_point,
              rhs_scale=rhs_scale), (
                  integers(np.uint8, 6, 32), integers(np.int8, 32, 8), uniform(6, 1),
                  integers(np.uint8, 6, 1), uniform(1, 8))),
      "quantized_dot_general float": (
          lambda lhs, rhs, lhs_scale, rhs_scale: jq.quantized_dot_general(
              lhs, rhs, dense, lhs_scale=lhs_scale, rhs_scale=rhs_scale),
          (x, w, uniform() * 2, uniform(1, 8) / 4)),
      "dot_general_dynamic_int8": (
          lambda x, w: jq.dot_general_dynamic_int8(x, w, dense), (x, w)),
      "dot_general_dynamic_int8 stored": (
          lambda x, w: jq.dot_general_dynamic_int8(x, w, dense),
          (x, jq.quantize_params(w, int8))),
      "dot_general_static_int8": (
          lambda x, w, scale, zero_point: jq.dot_general_static_int8(
              x, w, sequence, **static(scale, zero_point)),
          (normal(2, 3, 32), w, uniform() * 2, integers(np.int8))),
      "dot_general_weight_only": (
          lambda x, w: jq.dot_general_weight_only(x, w, dense, dtype=jnp.int4, block_size=16),
          (x, w)),
      "dot_general_weight_only stored": (
          lambda x, w: jq.dot_general_weight_only(x, w, dense),
          (x, jq.quantize_params(w, int4))),
      "dot_general_fake_quant": (
          lambda x, w: jq.dot_general_fake_quant(x, w, dense), (x, w)),
      "conv_general_dilated_dynamic_int8": (
          lambda x, w: jq.conv_general_dilated_dynamic_int8(x, w, **conv),
          (image, jq.quantize_params(kernel, int8))),
      "conv_general_dilated_static_int8": (
          lambda x, w, scale, zero_point: jq.conv_general_dilated_static_int8(
              x, w, **conv, **static(scale, zero_point)),
          (image, kernel, uniform() * 2, integers(np.int8))),
      "conv_general_dilated_weight_only": (
          lambda x, w: jq.conv_general_dilated_weight_only(x, w, **conv), (image, kernel)),
      "conv_general_dilated_fake_quant": (
          lambda x, w: jq.conv_general_dilated_fake_quant(x, w, **conv), (image, kernel)),
  }


def assert_same_under_x64(function, args) -> None:
  """``jax.jit(function)(*args)`` with x64 enabled gives x32's dtypes and bits."""
  import jax  # pylint: disable=import-outside-toplevel

  want = jax.jit(function)(*args)
  with jax.enable_x64(True):
    got = jax.jit(function)(*args)
  assert_tree_bits_equal(got, want, "x64")


def assert_vmap_is_a_loop(function, examples, in_axes) -> None:
  """``jax.vmap(function, in_axes)`` over the examples' arguments (those of axis None the
  first example's) gives each example's own ``jax.jit(function)`` bits. Under jit: eagerly,
  vmap compiles each primitive on its own, seconds for a drop-in."""
  import jax  # pylint: disable=import-outside-toplevel

  examples = [[a if axis == 0 else examples[0][j] for j, (a, axis) in enumerate(zip(args, in_axes))]
              for args in examples]
  stacked = [jax.tree.map(lambda *a: np.stack(a), *column) if axis == 0 else column[0]
             for column, axis in zip(zip(*examples), in_axes)]
  mapped = jax.jit(jax.vmap(function, in_axes=tuple(in_axes)))(*stacked)
  for i, args in enumerate(examples):
    assert_tree_bits_equal(jax.tree.map(operator.itemgetter(i), mapped), jax.jit(function)(*args),
                           f"example {i}")


def elementwise_calls(seed: int = 0) -> dict[str, tuple[Any, tuple[Any, ...]]]:
  """The other public ops, called as :func:`model_calls`' are: name -> (function, arrays).

  Scales and zero points are per axis or blocked where the op takes them so,
  and options Python numbers (a float64 under x64 unless the op reads them
  as float32).
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jaxquant as jq  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((6, 64)) * 3).astype(np.float32)
  scale = rng.uniform(0.01, 0.05, 64).astype(np.float32)
  blocked_scale = rng.uniform(0.2, 0.5, (6, 4)).astype(np.float32)
  codes = rng.integers(-128, 128, (6, 64)).astype(np.int8)
  zero_point = rng.integers(-20, 20, 64).astype(np.int8)
  blocked = dict(axis=1, block_size=16)
  int4 = jq.QuantizationRule(dtype=jnp.int4, axis=1, block_size=16)
  observed = lambda x, momentum: jq.observe(jq.init_observer(momentum=momentum), x)

  def stored_and_dequantized(w):
    stored = jq.quantize_params({"w": w}, int4)
    return stored, jq.dequantize_params(stored)

  return {
      "quantize_linear per-axis": (lambda x, s, z: jq.quantize_linear(x, s, z, axis=1),
                                   (x, scale, zero_point)),
      "dequantize_linear per-axis": (lambda q, s, z: jq.dequantize_linear(q, s, z, axis=1),
                                     (codes, scale, zero_point)),
      "dequantize_linear packed int4 blocked": (
          lambda q, s: jq.dequantize_linear(
              jq.pack(q.astype(jnp.int4)), s, packed_shape=q.shape, **blocked),
          (codes // 16, blocked_scale)),
      "dynamic_quantize_linear blocked": (
          lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, **blocked), (x,)),
      "quantized_add": (lambda a, b: jq.quantized_add(a, 0.05, 3, b, 0.1, -2, 0.07, 1),
                        (codes, codes[::-1])),
      "fake_quantize per-axis": (lambda x, s: jq.fake_quantize(x, s, axis=1), (x, scale)),
      "fake_quantize_learnable blocked": (
          lambda x, s, z: jq.fake_quantize_learnable(x, s, z, grad_factor=0.5, **blocked),
          (x, blocked_scale, blocked_scale * 10)),
      "fake_quantize_dynamic per-row": (lambda x: jq.fake_quantize_dynamic(x, axis=0), (x,)),
      "unpack int4": (lambda q: jq.unpack(jq.pack_int4(q.astype(jnp.int4)), q.shape, jnp.int4),
                      (codes // 16,)),
      "pack int2 rows": (lambda q: jq.pack(q.astype(jnp.int2), layout="rows"), (codes // 64,)),
      "choose_qparams mse blocked": (
          lambda w: jq.choose_qparams(w, jnp.int4, method="mse", **blocked), (x,)),
      "choose_qparams percentile per-row": (
          lambda w: jq.choose_qparams(w, axis=0, method="percentile"), (x,)),
      "quantize_params and dequantize_params int4": (stored_and_dequantized, (x,)),
      "observe moving average": (lambda x: observed(x, 0.9), (x,)),
      "observer_qparams moving average": (
          lambda x: jq.observer_qparams(observed(x, 0.9), jnp.uint8), (x,)),
      "observer_qparams percentile": (
          lambda x: jq.observer_qparams(observed(x, None), method="percentile", percentile=99.0),
          (x,)),
  }
