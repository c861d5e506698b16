"""Quantized matrix products (docs/numerics.md, "Quantized matmul").

ONNX MatMulInteger and QLinearMatMul, onnxruntime's com.microsoft
MatMulNBits, and the general :func:`quantized_dot_general` they build on.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _bind
from jaxquant import _dispatch
from jaxquant import _dtypes
from jaxquant import _fake
from jaxquant import _linear
from jaxquant import _numerics
from jaxquant import _packing
from jaxquant import _parameters
from jaxquant import _sharding
from jaxquant import _validate
import pallas_kernels

DimensionNumbers = tuple[
    tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
]
_INT8 = np.dtype(np.int8)
_UINT8 = np.dtype(np.uint8)
_INT32 = np.dtype(np.int32)
_FLOAT32 = np.dtype(np.float32)


def _dimension_numbers(value: Any) -> DimensionNumbers:
  """``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` as nested tuples."""
  try:
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = value
    return (
        (tuple(map(int, lhs_contracting)), tuple(map(int, rhs_contracting))),
        (tuple(map(int, lhs_batch)), tuple(map(int, rhs_batch))),
    )
  except (TypeError, ValueError):
    _validate.fail(
        "dimension_numbers",
        "((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)) as in lax.dot_general",
        repr(value), error=TypeError,
    )


class _Side:
  """One operand's dimensions: contracting, batch and free, in dot_general's order."""

  def __init__(self, ndim: int, contracting: tuple[int, ...], batch: tuple[int, ...]):
    self.ndim = ndim
    self.contracting = contracting
    self.batch = batch
    self.free = tuple(d for d in range(ndim) if d not in contracting and d not in batch)

  def parameter(self, argument: str, value: jax.Array, shape) -> jax.Array:
    """Checks that ``value`` is per-tensor or constant along the contracting dims."""
    if value.size == 1:
      return value.reshape(())
    _validate.check(
        value.ndim == self.ndim
        and all(value.shape[d] == 1 for d in self.contracting)
        and all(value.shape[d] in (1, shape[d]) for d in range(self.ndim)),
        f"{argument}.shape",
        f"one element, or rank {self.ndim} with 1 on the contracting dims "
        f"{self.contracting} and 1 or the operand's size elsewhere (operand shape {shape})",
        value.shape,
    )
    return value

  def to_output(self, value: jax.Array, *, lhs: bool, other_free: int) -> jax.Array:
    """``value`` (operand rank, size 1 on contracting dims) broadcastable to the output.

    The output of ``dot_general`` is (batch, lhs free, rhs free).
    """
    if value.ndim == 0:
      return value
    value = jnp.transpose(value, self.batch + self.free + self.contracting)
    batch = value.shape[:len(self.batch)]
    free = value.shape[len(self.batch):len(self.batch) + len(self.free)]
    ones = (1,) * other_free
    return value.reshape(batch + free + ones if lhs else batch + ones + free)


def _signed(
    x: jax.Array, zero_point: jax.Array | None, info: _dtypes.QuantizedDType
) -> tuple[jax.Array, jax.Array | None]:
  """An int8 (or int32) operand and int32 zero point with the same differences ``x - zp``.

  uint8 ``x`` is ``int8(x ^ 0x80) + 128``, so ``x - zp = int8(x ^ 0x80) - (zp - 128)``:
  the bytes are reinterpreted and the zero point moves by 128, both exactly.
  """
  zero_point = None if zero_point is None else zero_point.astype(jnp.int32)
  if x.dtype == _UINT8:
    x = lax.bitcast_convert_type(x ^ np.uint8(0x80), jnp.int8)
    zero_point = jnp.int32(-128) if zero_point is None else zero_point - 128
  elif info.bits < 8:
    # On CUDA the widened copy is written before the dot: XLA:GPU fused the
    # int4 -> int8 -> bfloat16 conversion into its dot and then compiled no
    # candidate for it ("No candidates could be compiled", an H100).
    x = lax.platform_dependent(x.astype(jnp.int8), cuda=lax.optimization_barrier,
                               default=lambda x: x)
  elif info.bits > 8:
    x = x.astype(jnp.int32)
  return x, zero_point


# Integers of magnitude <= 2**24 are exact in float32: with int8 operands
# (|product| <= 2**14) every partial sum over at most 2**10 terms is too.
_EXACT_FLOAT_DEPTH = 1024
# XLA:CPU hands an int8 x int8 -> int32 dot of at least two rows to YNNPACK,
# which reads the int8 weight as it is; the bfloat16 dot first writes a
# bfloat16 copy of it. Measured at K = N = 1024: the int8 dot is clearly faster
# up to ~200 rows, the two are within noise near 256, and the bfloat16 dot is
# faster from ~512 (benchmarks/matmul.py; docs/numerics.md). The same holds
# per batch of a batched product (rows per batch against a per-batch weight).
# On a CPU with AMX int8 tiles (an Intel Xeon) the int8 dot was 2.8-3.3x
# faster than the bfloat16 one from 128 to 2048 rows: there it takes any
# number of rows (:func:`_int8_dot_takes_any_rows`).
_INT8_DOT_MAX_ROWS = 256
# YNNPACK's int8 dot slows down past a depth of about 2048 when K is rhs's
# major dim (a (K, N) weight); with K minor (an (N, K) weight) it does not.
# A (K, N) weight deeper than that is contracted in slices of at most 2048,
# each a batch of one dot: rhs reshaped to (K // size, size, N), a view, and
# the per-slice products summed in int32 (exact in any grouping, wrap
# included). Measured at N = 4096 (benchmarks/matmul.py, docs/numerics.md):
# K = 4096 went from 1.1-1.2x float32's time to 0.5-0.6x at 1-16 rows and
# K = 11008 from 1.6-2.7x to 0.6-0.7x. Slices taken one by one (lax.slice)
# are each written out first: the whole weight copied at every call.
_INT8_DOT_MAX_DEPTH = 2048
# With few rows (decoding) shallower slices are faster still: the int8 dot in
# 1024-deep ones took 0.76-0.88 of its time in 2048-deep ones at 1-16 rows,
# K = N = 2048, 4096 and 8192 (an Intel Xeon with AMX); at 64 rows neither
# won everywhere, and at 256 the 2048-deep slices were 1.2-1.4x faster.
_FEW_ROWS = 16
_FEW_ROWS_MAX_DEPTH = 1024
# Up to this many rows (per batch) times a weight stored (N, K) run as the weight
# times the rows: with the weight as its left operand YNNPACK's int8 dot made the
# dynamic int8 layer take 0.57-0.82 of its time at 1-4 rows (K = N = 1024 and
# 4096), 0.70-0.99 at 16, and 0.73-0.83 at 17-32 rows at K = N = 2048 and 4096
# (0.90-1.01 at 1024); at 64 rows 0.94-1.10, at 128 1.2-1.4 (an Intel Xeon).
_WEIGHT_AS_LHS_MAX_ROWS = 32
# Slices of a view need a divisor of K; without one from this up to the
# maximum depth (a prime K) the slices are copies: up to _MAX_SLICES of them
# 1024 deep, each its own dot (lax.slice), more padded to equal depth as a
# batch dim (one padded copy). Separate dots measured faster where there are few: K = 4099
# by 1.0-1.3x (int8, N = 4096; 2048-deep copies were slower still), K = 1029
# by 1.2x (the bfloat16 dot, 1024 rows).
_MIN_SLICE_DEPTH = 256
_COPIED_SLICE_DEPTH = 1024
_MAX_SLICES = 8


def _sliced(dot, lhs: jax.Array, rhs: jax.Array, dimension_numbers, size: int):
  """``dot`` as the sum of ``dot`` over slices of K at most ``size`` deep, each its own dot."""
  ((lhs_k,), (rhs_k,)), _ = dimension_numbers
  depth = lhs.shape[lhs_k]
  return functools.reduce(operator.add, [
      dot(lax.slice_in_dim(lhs, start, min(start + size, depth), axis=lhs_k),
          lax.slice_in_dim(rhs, start, min(start + size, depth), axis=rhs_k), dimension_numbers)
      for start in range(0, depth, size)])


def _even_depth(depth: int, limit: int) -> int:
  """The depth of ``depth`` split evenly into as few slices of at most ``limit`` as can be."""
  return -(-depth // -(-depth // limit))


def _depth_as_batch(dot, lhs: jax.Array, rhs: jax.Array, dimension_numbers, size: int):
  """``dot`` with K cut into ``size``-deep slices that are one more batch dim of both
  operands, the slices' int32 products summed.

  Where ``size`` divides K each operand is reshaped, a view; otherwise zeros
  pad the last slice (they add nothing to any sum), a copy of both.
  """
  ((lhs_k,), (rhs_k,)), (lhs_batch, rhs_batch) = dimension_numbers
  slices = -(-lhs.shape[lhs_k] // size)

  def cut(x, k):
    pad = slices * size - x.shape[k]
    if pad:
      x = jnp.pad(x, [(0, pad if d == k else 0) for d in range(x.ndim)])
    return x.reshape(x.shape[:k] + (slices, size) + x.shape[k + 1:])

  def shifted(dims, k):
    return tuple(d + (d > k) for d in dims)

  # The slices are the last batch dim: after the others in the product.
  numbers = (((lhs_k + 1,), (rhs_k + 1,)),
             ((*shifted(lhs_batch, lhs_k), lhs_k), (*shifted(rhs_batch, rhs_k), rhs_k)))
  product = dot(cut(lhs, lhs_k), cut(rhs, rhs_k), numbers)
  return jnp.sum(product, axis=len(lhs_batch), dtype=jnp.int32)


def _last_dims_dot(a: jax.Array, b: jax.Array, batch: int) -> jax.Array:
  """The int32 dot of ``a`` and ``b`` over their last dims, their first ``batch`` dims batched."""
  batch_dims = tuple(range(batch))
  return lax.dot_general(a, b, (((a.ndim - 1,), (b.ndim - 1,)), (batch_dims, batch_dims)),
                         preferred_element_type=jnp.int32)


@jax.custom_batching.custom_vmap
def _weight_as_lhs(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """The int32 dot of ``lhs`` ``(batch..., rows, K)`` with ``rhs`` ``(batch..., N..., K)``,
  taken as ``rhs`` times ``lhs`` and transposed back.

  Under ``vmap`` the dot keeps its first order: the examples are more rows
  (or more weights), and past a few rows that order is the faster one.
  """
  batch = lhs.ndim - 2
  # XLA's simplifier turns a transposed dot back into the other order; the barrier keeps this one.
  swapped = lax.optimization_barrier(_last_dims_dot(rhs, lhs, batch))
  return jnp.moveaxis(swapped, -1, batch)


@_weight_as_lhs.def_vmap
def _weight_as_lhs_vmap(axis_size, in_batched, lhs, rhs):
  del axis_size
  in_axes = tuple(0 if batched else None for batched in in_batched)
  rows_first = lambda lhs, rhs: _last_dims_dot(lhs, rhs, lhs.ndim - 2)
  return jax.vmap(rows_first, in_axes=in_axes)(lhs, rhs), True


def _int8_rows_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers) -> jax.Array:
  """The int8 x int8 -> int32 dot with ``lhs`` as ``(batch..., rows, K)``, rows >= 2.

  One row is a matrix-vector product, which XLA:CPU runs outside YNNPACK on
  an int32 copy of ``rhs`` (16x slower than the int8 dot with a batch dim): a
  zero row is appended, and dropped after. At most
  :data:`_WEIGHT_AS_LHS_MAX_ROWS` rows times an rhs with K minor (a weight
  stored ``(N, K)``) run as rhs times lhs (:func:`_weight_as_lhs`). K deeper than
  :data:`_INT8_DOT_MAX_DEPTH` (:data:`_FEW_ROWS_MAX_DEPTH` for at most
  :data:`_FEW_ROWS` rows) as rhs's major dim runs in slices: views of rhs as
  a batch dim (:func:`_depth_as_batch`) where K has a divisor from
  :data:`_MIN_SLICE_DEPTH` up to that, else copies (:func:`_sliced`, or padded).
  """
  ((lhs_k,), (rhs_k,)), (lhs_batch, rhs_batch) = dimension_numbers
  free = tuple(d for d in range(lhs.ndim) if d != lhs_k and d not in lhs_batch)
  batch_shape = tuple(lhs.shape[d] for d in lhs_batch)
  free_shape = tuple(lhs.shape[d] for d in free)
  rows = math.prod(free_shape)
  matrix = jnp.transpose(lhs, lhs_batch + free + (lhs_k,)).reshape(
      batch_shape + (rows, lhs.shape[lhs_k]))
  if rows == 1:
    matrix = jnp.concatenate([matrix, jnp.zeros_like(matrix)], axis=-2)
  batch = len(lhs_batch)
  numbers = (((batch + 1,), (rhs_k,)), (tuple(range(batch)), rhs_batch))
  dot = functools.partial(lax.dot_general, preferred_element_type=jnp.int32)
  depth = lhs.shape[lhs_k]
  # A symbolic row count (jax.export) is taken as many.
  few_rows = isinstance(rows, int) and rows <= _FEW_ROWS
  max_depth = _FEW_ROWS_MAX_DEPTH if few_rows else _INT8_DOT_MAX_DEPTH
  weight_as_lhs = (isinstance(rows, int) and rows <= _WEIGHT_AS_LHS_MAX_ROWS
                   and rhs_k == rhs.ndim - 1 and tuple(rhs_batch) == tuple(range(batch)))
  if weight_as_lhs:
    product = _weight_as_lhs(matrix, rhs)
  elif isinstance(depth, int) and depth > max_depth and rhs_k != rhs.ndim - 1:
    divisors = [d for d in range(_MIN_SLICE_DEPTH, max_depth + 1) if depth % d == 0]
    if divisors:
      product = _depth_as_batch(dot, matrix, rhs, numbers, max(divisors))
    elif -(-depth // _COPIED_SLICE_DEPTH) <= _MAX_SLICES:
      product = _sliced(dot, matrix, rhs, numbers, _COPIED_SLICE_DEPTH)
    else:
      product = _depth_as_batch(dot, matrix, rhs, numbers, _even_depth(depth, max_depth))
  else:
    product = dot(matrix, rhs, numbers)
  product = lax.slice_in_dim(product, 0, rows, axis=batch)
  return product.reshape(batch_shape + free_shape + product.shape[batch + 1:])


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
  """The host CPU's feature flags as Linux lists them (none where it cannot be read)."""
  try:
    with open(path, encoding="ascii", errors="replace") as cpuinfo:
      line = next((line for line in cpuinfo if line.startswith("flags")), "")
  except OSError:
    return frozenset()
  return frozenset(line.partition(":")[2].split())


def _int8_dot_takes_any_rows() -> bool:
  """Whether the int8 dot is the faster one at any row count: a CPU with AMX int8 tiles."""
  return "amx_int8" in cpu_flags()


def _int8_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers) -> jax.Array:
  """``dot_general`` of int8 (or int32) operands, accumulated exactly, wrapping in int32.

  Chosen per platform when the program is lowered:

  * XLA:CPU: a product of at most :data:`_INT8_DOT_MAX_ROWS` (static) rows
    of lhs per batch, or of any static number on a CPU with AMX int8 tiles,
    runs as the int8 dot (:func:`_int8_rows_dot`); a larger one as the
    bfloat16 dot of :func:`exact_bfloat16_dot`. The host's CPU decides when
    the program is traced; every choice gives the same bits.
  * XLA:GPU (CUDA): the bfloat16 dot, on the tensor cores. XLA:GPU's own
    int8 x int8 -> int32 dot returned twice the sum for small operands
    ((5, 7) x (7, 3): every element doubled; jax 0.11.2, H100).
  * Elsewhere: the int8 dot.
  """
  (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
  if lhs.dtype != _INT8 or rhs.dtype != _INT8:
    return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.int32)
  if len(lhs_contracting) != 1:
    # One contracting dim, so that every platform takes its exact dot (XLA:GPU's
    # int8 dot over two contracting dims was wrong on an H100): each operand's
    # contracting dims moved last, in pairing order, and merged, a copy of both.
    lhs, lhs_batch = _merged_contracting(lhs, lhs_contracting, lhs_batch)
    rhs, rhs_batch = _merged_contracting(rhs, rhs_contracting, rhs_batch)
    dimension_numbers = (((lhs.ndim - 1,), (rhs.ndim - 1,)), (lhs_batch, rhs_batch))
    (lhs_contracting, _), _ = dimension_numbers
  # Every platform's exact dot is chosen by the depth (the bfloat16 dot's slices),
  # and each platform's branch is traced for any export.
  depth = lhs.shape[lhs_contracting[0]]
  _validate.check(isinstance(depth, int), "the contracting dim",
                  "static (jax.export: a symbolic batch, not a symbolic depth)", depth)
  bfloat16 = functools.partial(exact_bfloat16_dot, dimension_numbers=dimension_numbers)

  def on_cpu(lhs, rhs):
    ((lhs_k,), _), (lhs_batch, _) = dimension_numbers
    free = [d for d in range(lhs.ndim) if d != lhs_k and d not in lhs_batch]
    if len(free) > 1 and _sharding.split_dims(lhs) & set(free):
      # An explicit mesh cannot type the merge of split free dims into rows.
      return int8(lhs, rhs)
    rows = math.prod(lhs.shape[d] for d in free)
    # A symbolic row count (jax.export) may be large: the bfloat16 dot.
    if isinstance(rows, int) and (rows <= _INT8_DOT_MAX_ROWS or _int8_dot_takes_any_rows()):
      return _int8_rows_dot(lhs, rhs, dimension_numbers)
    return bfloat16(lhs, rhs)

  def int8(lhs, rhs):
    return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.int32)

  return lax.platform_dependent(lhs, rhs, cpu=on_cpu, cuda=bfloat16, default=int8)


def _merged_contracting(x: jax.Array, contracting, batch) -> tuple[jax.Array, tuple[int, ...]]:
  """``x`` with its ``contracting`` dims as one last dim, and where its ``batch`` dims went."""
  kept = [d for d in range(x.ndim) if d not in contracting]
  merged = jnp.transpose(x, kept + list(contracting)).reshape(
      [x.shape[d] for d in kept] + [math.prod(x.shape[d] for d in contracting)])
  return merged, tuple(kept.index(d) for d in batch)


def exact_bfloat16_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers, *,
                       depth_limit: int = _EXACT_FLOAT_DEPTH) -> jax.Array:
  """The int8 dot as a bfloat16 x bfloat16 -> float32 dot, exactly.

  bfloat16 holds every int8, each product is exact in float32, and each
  partial sum of at most :data:`_EXACT_FLOAT_DEPTH` products is an integer of
  magnitude <= 2**24, which float32 holds, in whatever order the backend
  adds. Deeper contractions run in slices up to that depth, their sums
  added in int32: up to :data:`_MAX_SLICES` each its own dot, more of equal
  depth as one more batch dim of one dot (:func:`_depth_as_batch`; the zeros
  padding the last are written with the bfloat16 copy).
  Integers of up to 256 in magnitude (int8 differences) are exact in
  bfloat16 too, with ``depth_limit`` lowered so that a slice's sum stays
  within 2**24.
  """
  lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)

  def dot(lhs, rhs, dimension_numbers):
    return lax.dot_general(
        lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32).astype(jnp.int32)

  depth = lhs.shape[dimension_numbers[0][0][0]]
  if depth <= depth_limit:
    return dot(lhs, rhs, dimension_numbers)
  if -(-depth // depth_limit) <= _MAX_SLICES:
    return _sliced(dot, lhs, rhs, dimension_numbers, depth_limit)
  return _depth_as_batch(dot, lhs, rhs, dimension_numbers, _even_depth(depth, depth_limit))


def integer_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_zero_point: jax.Array | None,
    rhs_zero_point: jax.Array | None,
    dimension_numbers: DimensionNumbers,
    *,
    lhs_info,
    rhs_info,
) -> jax.Array:
  r"""``sum_k (lhs - lhs_zp) (rhs - rhs_zp)`` in int32, wrapping as ONNX's int32 does.

  With :math:`a' , b'` the int8 operands of :func:`_signed` and their zero
  points :math:`z_a, z_b`:

  .. math::

    \sum_k (a' - z_a)(b' - z_b) = a' \cdot b' - z_b \sum_k a' - z_a \sum_k b' + K z_a z_b

  an identity over the integers and so over int32's wrap-around ring: every
  term may wrap, the result is ONNX's int32 result.
  """
  (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
  lhs_side = _Side(lhs.ndim, lhs_contracting, lhs_batch)
  rhs_side = _Side(rhs.ndim, rhs_contracting, rhs_batch)
  lhs, lhs_zero_point = _signed(lhs, lhs_zero_point, lhs_info)
  rhs, rhs_zero_point = _signed(rhs, rhs_zero_point, rhs_info)
  to_lhs = functools.partial(lhs_side.to_output, lhs=True, other_free=len(rhs_side.free))
  to_rhs = functools.partial(rhs_side.to_output, lhs=False, other_free=len(lhs_side.free))
  # An explicit mesh's split of lhs is part of its type: a row appended along a split dim
  # would straddle the devices' shards (a sharding error), so only whole dims take it.
  whole = [d for d in lhs_side.free if d not in _sharding.split_dims(lhs)]
  if lhs_zero_point is not None and whole:
    # rhs's sums over K are one more row of the product: a row of ones appended
    # along lhs's longest free dim, sliced off after. A separate reduction of rhs
    # would read it again, and XLA:CPU reduces a weight's columns slowly. A
    # symbolic dim (jax.export's batch) cannot be compared with the others: the
    # first one counts as the longest.
    symbolic = [d for d in whole if not isinstance(lhs.shape[d], int)]
    row = symbolic[0] if symbolic else max(whole, key=lambda d: lhs.shape[d])
    rows = lhs.shape[row]
    ones = _sharding.ones_split_like(lhs, (row,))
    product = _int8_dot(jnp.concatenate([lhs, ones], row), rhs, dimension_numbers)
    axis = len(lhs_side.batch) + lhs_side.free.index(row)
    accumulator = lax.slice_in_dim(product, 0, rows, axis=axis)
    rhs_sums = lax.slice_in_dim(product, rows, rows + 1, axis=axis)
  elif lhs_zero_point is not None and lhs_side.free:
    # Every free dim of lhs split over devices (data parallel on an explicit mesh):
    # rhs's sums are their own product with one row of ones, split along K like lhs.
    accumulator = _int8_dot(lhs, rhs, dimension_numbers)
    rhs_sums = _int8_dot(_sharding.ones_split_like(lhs, lhs_side.free), rhs,
                        dimension_numbers)
  else:
    accumulator = _int8_dot(lhs, rhs, dimension_numbers)
    if lhs_zero_point is not None:
      rhs_sums = to_rhs(jnp.sum(rhs, rhs_contracting, dtype=jnp.int32, keepdims=True))
  if rhs_zero_point is not None:
    lhs_sums = jnp.sum(lhs, lhs_contracting, dtype=jnp.int32, keepdims=True)
    accumulator = accumulator - to_lhs(lhs_sums) * to_rhs(rhs_zero_point)
  if lhs_zero_point is not None:
    accumulator = accumulator - to_lhs(lhs_zero_point) * rhs_sums
  if lhs_zero_point is not None and rhs_zero_point is not None:
    # K * z_a * z_b with K reduced mod 2**32, like every other term.
    depth = np.array(math.prod(lhs.shape[d] for d in lhs_contracting) % 2**32, np.uint32)
    depth = depth.view(np.int32)
    accumulator = accumulator + depth * to_lhs(lhs_zero_point) * to_rhs(rhs_zero_point)
  return accumulator


def _operand(name, x, zero_point):
  x = jnp.asarray(x)
  info = _dtypes.quantized_dtype(f"{name}.dtype", x.dtype, integer=True)
  _validate.check(
      info.bits <= 16, f"{name}.dtype", "an integer dtype of at most 16 bits",
      info.name, error=TypeError,
  )
  return x, info, _parameters.zero_point_array(f"{name}_zero_point", zero_point, info.dtype)


def _check_dimensions(lhs_shape, rhs_shape, dimension_numbers):
  (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
  for name, dims, shape in [
      ("lhs_contracting", lhs_contracting, lhs_shape), ("rhs_contracting", rhs_contracting,
                                                        rhs_shape),
      ("lhs_batch", lhs_batch, lhs_shape), ("rhs_batch", rhs_batch, rhs_shape),
  ]:
    _validate.check(
        all(0 <= d < len(shape) for d in dims), f"dimension_numbers' {name}",
        f"dims in [0, {len(shape)}) (non-negative, as lax.dot_general takes them)", dims,
    )
  for name, contracting, batch in [("lhs", lhs_contracting, lhs_batch),
                                   ("rhs", rhs_contracting, rhs_batch)]:
    dims = (*contracting, *batch)
    _validate.check(
        len(set(dims)) == len(dims), "dimension_numbers",
        f"each of {name}'s dims once among its contracting and batch dims (as "
        "lax.dot_general takes them)", dimension_numbers,
    )
  _validate.check(
      len(lhs_contracting) == len(rhs_contracting) and len(lhs_batch) == len(rhs_batch),
      "dimension_numbers", "as many lhs as rhs contracting dims, and batch dims",
      dimension_numbers,
  )
  _validate.check(
      [lhs_shape[d] for d in lhs_batch] == [rhs_shape[d] for d in rhs_batch],
      "rhs.shape", f"equal to lhs.shape {lhs_shape} on the batch dims", rhs_shape,
  )
  _validate.check(
      [lhs_shape[d] for d in lhs_contracting] == [rhs_shape[d] for d in rhs_contracting],
      "rhs.shape", f"equal to lhs.shape {lhs_shape} on the contracting dims",
      rhs_shape,
  )


def _check_dot_zero_points(arguments: dict) -> None:
  for name in ("lhs", "rhs"):
    if arguments[f"{name}_zero_point"] is None:
      continue  # nothing to check, and jnp.issubdtype is not free
    dtype = getattr(arguments[name], "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
      dtype = _INT8  # a float operand is quantized to int8 unless its zero point says otherwise
    arguments[f"{name}_zero_point"] = _dtypes.host_zero_point(
        f"{name}_zero_point", arguments[f"{name}_zero_point"], dtype)


@_bind.op(preferred_element_type=_bind.dtype, out_sharding=_bind.sharding,
          check=_check_dot_zero_points)
def quantized_dot_general(
    lhs: ArrayLike,
    rhs: ArrayLike,
    dimension_numbers: Any,
    *,
    lhs_scale: ArrayLike | None = None,
    lhs_zero_point: ArrayLike | None = None,
    rhs_scale: ArrayLike | None = None,
    rhs_zero_point: ArrayLike | None = None,
    preferred_element_type: DTypeLike | None = None,
    out_sharding: Any = None,
) -> jax.Array:
  r"""A quantized ``lax.dot_general``: integer products, int32 accumulation, scales after.

  .. math::

    \mathrm{acc} = \sum_k (\mathrm{lhs} - z_l)(\mathrm{rhs} - z_r), \qquad
    y = \mathrm{float32}(\mathrm{acc}) \cdot (s_l \, s_r)

  ``acc`` is int32 and wraps around as ONNX's MatMulInteger does. Without
  scales the result is ``acc`` (MatMulInteger); with a scale (a missing one
  is 1) it is ``y``, each element rounded once from ``float32(acc)`` times
  the float32 product of the two scales, as onnxruntime's dynamically
  quantized MatMulInteger + Mul models compute it. uint8 operands are
  reinterpreted as int8 with their zero point moved by 128, so the product
  is an exact int8 x int8 one (XLA:CPU widens uint8 x int8 to int32
  arithmetic, several times slower; there it runs as an exact bfloat16 dot
  with float32 accumulation, elsewhere as int8 -> int32), plus zero-point
  corrections from the operands' sums along the contracted dims.

  Scales and zero points are per tensor (one element) or have the operand's
  rank with size 1 on its contracting dims (per row of lhs, per column of
  rhs, per batch).

  Float operands are quantization-aware training: each is quantized with
  its scale and zero point (to the zero point's dtype, int8 without one; as
  :func:`quantize_linear`), the product is the integer one above, and the
  derivatives are those of ``dot_general`` of :func:`fake_quantize`'d
  operands (straight-through, masked where an operand saturates; the
  scales receive fake_quantize's derivatives). Integer operands carry no
  gradient.

  Args:
    lhs: integer (int8, uint8, 4- or 16-bit) or, with ``lhs_scale``, float operand.
    rhs: the other operand, likewise.
    dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
      rhs_batch))``, as for ``lax.dot_general``.
    lhs_scale: float32, float16 or bfloat16 scale of ``lhs``, or ``None``.
    lhs_zero_point: zero point of ``lhs`` in its dtype, or ``None`` for 0.
    rhs_scale: scale of ``rhs``, or ``None``.
    rhs_zero_point: zero point of ``rhs``, or ``None`` for 0.
    preferred_element_type: int32 (the default) without scales; float32 (the
      default), float16 or bfloat16 with them, rounded once from float32.
    out_sharding: the result's sharding, as ``lax.dot_general``'s (required
      on an explicit mesh where a contracted dim is split).

  Returns:
    ``lax.dot_general``'s output shape: (batch, lhs free, rhs free) dims.

  Raises:
    TypeError: for unsupported dtypes, float operands without a scale, or
      malformed ``dimension_numbers``.
    ValueError: for parameters that vary along a contracting dim, or
      operands whose contracting dims differ.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> a = jnp.array([[0, 255], [128, 130]], jnp.uint8)
    >>> b = jnp.array([[1, -2], [3, 4]], jnp.int8)
    >>> dims = (((1,), (0,)), ((), ()))
    >>> jq.quantized_dot_general(a, b, dims, lhs_zero_point=jnp.uint8(128))
    Array([[253, 764],
           [  6,   8]], dtype=int32)
    >>> jq.quantized_dot_general(a, b, dims, lhs_scale=0.5, lhs_zero_point=jnp.uint8(128))
    Array([[126.5, 382. ],
           [  3. ,   4. ]], dtype=float32)
  """
  dimension_numbers = _dimension_numbers(dimension_numbers)
  # Only the dtypes are read here: jnp.asarray would return a jax.Array
  # itself, after checks costing more than the jit dispatch.
  lhs, rhs = (v if isinstance(v, jax.Array) else jnp.asarray(v) for v in (lhs, rhs))
  if jnp.issubdtype(lhs.dtype, jnp.floating) or jnp.issubdtype(rhs.dtype, jnp.floating):
    product = functools.partial(
        _fake_quantized_dot, dimension_numbers=dimension_numbers,
        preferred_element_type=preferred_element_type)
  else:
    product = functools.partial(
        _quantized_dot, dimension_numbers=dimension_numbers,
        preferred_element_type=preferred_element_type)
  return _sharding.placed(product, out_sharding, lhs, rhs, lhs_scale, lhs_zero_point,
                          rhs_scale, rhs_zero_point)


@functools.partial(jax.jit, static_argnames=("dimension_numbers", "preferred_element_type"))
def _quantized_dot(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point, *,
                   dimension_numbers, preferred_element_type):
  return _integer_product(
      lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point,
      dimension_numbers=dimension_numbers, preferred_element_type=preferred_element_type,
  )


def _scaled(accumulator, lhs_scale, rhs_scale, sides, preferred_element_type):
  """``float32(acc) * (lhs_scale * rhs_scale)`` rounded once to the output dtype."""
  if lhs_scale is None and rhs_scale is None:
    _validate.check(
        preferred_element_type in (None, _INT32), "preferred_element_type",
        "None or int32 without scales", preferred_element_type,
    )
    return accumulator
  output_dtype = _dtypes.float_dtype(
      "preferred_element_type",
      _FLOAT32 if preferred_element_type is None else preferred_element_type,
  )
  lhs_side, rhs_side = sides
  scale = jnp.ones((), jnp.float32)
  if lhs_scale is not None:
    scale = lhs_side.to_output(
        lhs_scale.astype(jnp.float32), lhs=True, other_free=len(rhs_side.free))
  if rhs_scale is not None:
    scale = scale * rhs_side.to_output(
        rhs_scale.astype(jnp.float32), lhs=False, other_free=len(lhs_side.free))
  return (accumulator.astype(jnp.float32) * scale).astype(output_dtype)


def _prepare(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point,
             dimension_numbers, names=("lhs", "rhs")):
  """Validated integer operands and parameters, with their sides."""
  lhs, lhs_info, lhs_zero_point = _operand(names[0], lhs, lhs_zero_point)
  rhs, rhs_info, rhs_zero_point = _operand(names[1], rhs, rhs_zero_point)
  _check_dimensions(lhs.shape, rhs.shape, dimension_numbers)
  (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
  sides = (_Side(lhs.ndim, lhs_contracting, lhs_batch),
           _Side(rhs.ndim, rhs_contracting, rhs_batch))
  parameters = []
  for side, name, x, scale, zero_point in [
      (sides[0], names[0], lhs, lhs_scale, lhs_zero_point),
      (sides[1], names[1], rhs, rhs_scale, rhs_zero_point),
  ]:
    if scale is not None:
      scale = side.parameter(
          f"{name}_scale", _dtypes.scale_array(f"{name}_scale", scale),
          x.shape)
    if zero_point is not None:
      zero_point = side.parameter(f"{name}_zero_point", zero_point, x.shape)
    parameters += [scale, zero_point]
  return lhs, rhs, (lhs_info, rhs_info), sides, parameters


def _integer_product(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point,
                     *, dimension_numbers, preferred_element_type, names=("lhs", "rhs")):
  lhs, rhs, (lhs_info, rhs_info), sides, parameters = _prepare(
      lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point,
      dimension_numbers, names)
  lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point = parameters
  accumulator = integer_dot(
      lhs, rhs, lhs_zero_point, rhs_zero_point, dimension_numbers,
      lhs_info=lhs_info, rhs_info=rhs_info,
  )
  return _scaled(accumulator, lhs_scale, rhs_scale, sides, preferred_element_type)


def _fake_quantized_dot(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point, *,
                        dimension_numbers, preferred_element_type):
  """Float operands: the integer product's values, fake quantization's derivatives."""
  operands = []
  for name, x, scale, zero_point in [("lhs", lhs, lhs_scale, lhs_zero_point),
                                     ("rhs", rhs, rhs_scale, rhs_zero_point)]:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      operands.append((x, scale, zero_point, None))
      continue
    _validate.check(
        scale is not None, f"{name}_scale",
        f"given for a float {name} (it is quantized with it)", None, error=TypeError,
    )
    # The zero point's dtype, int8 for none or a Python int, as quantize_linear reads it.
    info = _parameters.quantized_output_dtype(
        zero_point, None, argument=f"{name}_zero_point", default=_INT8, integer=True)
    operands.append((x, jnp.asarray(scale), zero_point, info.dtype))
  (lhs, lhs_scale, lhs_zero_point, lhs_dtype), (rhs, rhs_scale, rhs_zero_point, rhs_dtype) = (
      operands)
  return _fake_quantized_dot_jit(
      lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point,
      dimension_numbers=dimension_numbers, preferred_element_type=preferred_element_type,
      dtypes=(lhs_dtype, rhs_dtype),
  )


@functools.partial(
    jax.jit, static_argnames=("dimension_numbers", "preferred_element_type", "dtypes"))
def _fake_quantized_dot_jit(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point, *,
                            dimension_numbers, preferred_element_type, dtypes):
  # A same-rank scale with 1 on the contracting dims is a block-wise broadcast
  # scale to quantize_linear: one scale per (row, all of K) block. quantize_linear
  # takes the zero point in the scale's shape, where this op takes either per tensor.
  def alike(scale, zero_point):
    if zero_point is None or jnp.shape(zero_point) == jnp.shape(scale):
      return scale, zero_point
    return jnp.broadcast_arrays(scale, zero_point)

  def quantized(x, scale, zero_point, dtype):
    if dtype is None:
      return x
    return _linear.quantize_linear(x, *alike(scale, zero_point), axis=None, output_dtype=dtype)

  def fake(x, scale, zero_point, dtype):
    if dtype is None:  # an integer operand: its values
      x = x.astype(jnp.float32)
      x = x if zero_point is None else x - jnp.asarray(zero_point).astype(jnp.float32)
      return x if scale is None else x * jnp.asarray(scale).astype(jnp.float32)
    return _fake.fake_quantize(x, *alike(scale, zero_point), dtype=dtype, axis=None)

  def integer(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point):
    return _integer_product(
        quantized(lhs, lhs_scale, lhs_zero_point, dtypes[0]),
        quantized(rhs, rhs_scale, rhs_zero_point, dtypes[1]),
        lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point,
        dimension_numbers=dimension_numbers, preferred_element_type=preferred_element_type,
    )

  def reference(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point):
    output_dtype = _FLOAT32 if preferred_element_type is None else preferred_element_type
    return lax.dot_general(
        fake(lhs, lhs_scale, lhs_zero_point, dtypes[0]),
        fake(rhs, rhs_scale, rhs_zero_point, dtypes[1]),
        dimension_numbers, precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    ).astype(output_dtype)

  return _dispatch.with_xla_derivatives(integer, reference)(
      lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point)


def _matmul_operands(a, b):
  """ONNX MatMul's operands as rank >= 2 arrays, their dimension numbers and output shape."""
  a, b = jnp.asarray(a), jnp.asarray(b)
  _validate.check(a.ndim >= 1, "a.shape", "at least 1-D (ONNX MatMul)", a.shape)
  _validate.check(b.ndim >= 1, "b.shape", "at least 1-D (ONNX MatMul)", b.shape)
  a2 = a[None] if a.ndim == 1 else a
  b2 = b[:, None] if b.ndim == 1 else b
  _validate.check(
      a2.shape[-1] == b2.shape[-2], "b.shape",
      f"(..., {a2.shape[-1]}, N) to multiply a.shape {a.shape}", b.shape,
  )
  if b2.ndim == 2:
    # A weight matrix: one dot over a's leading dims, nothing broadcast.
    dimension_numbers = (((a2.ndim - 1,), (0,)), ((), ()))
  else:
    try:
      batch = jnp.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    except ValueError:
      _validate.fail("b.shape", f"batch-broadcastable with a.shape {a.shape}",
                     b.shape)
    a2 = jnp.broadcast_to(a2, batch + a2.shape[-2:])
    b2 = jnp.broadcast_to(b2, batch + b2.shape[-2:])
    n = len(batch)
    dimension_numbers = (((n + 1,), (n,)), (tuple(range(n)), tuple(range(n))))
  shape = a2.shape[:-1] + b2.shape[-1:]
  if a.ndim == 1:
    shape = shape[:-2] + shape[-1:]
  if b.ndim == 1:
    shape = shape[:-1]
  return a2, b2, dimension_numbers, shape


def _per_row(argument, value, operand_ndim, *, rows: bool):
  """An ONNX per-tensor, 1-D (per row of a / column of b) or N-D parameter in operand rank."""
  if value is None:
    return None
  value = jnp.asarray(value)
  if value.size == 1 and value.ndim <= 1:
    return value.reshape(())
  if value.ndim == 1:
    value = value[:, None] if rows else value[None, :]
  _validate.check(
      value.ndim <= operand_ndim, f"{argument}.shape",
      f"one element, 1-D, or of at most the operand's rank {operand_ndim}", value.shape,
  )
  return value.reshape((1,) * (operand_ndim - value.ndim) + value.shape)


def _onnx_zero_points(a, b, a_zero_point, b_zero_point):
  """Zero points as the operands' dtype (a Python int takes it), in operand rank."""
  a_zero_point = _parameters.zero_point_array("a_zero_point", a_zero_point, a.dtype)
  b_zero_point = _parameters.zero_point_array("b_zero_point", b_zero_point, b.dtype)
  return (_per_row("a_zero_point", a_zero_point, a.ndim, rows=True),
          _per_row("b_zero_point", b_zero_point, b.ndim, rows=False))


def _check_onnx_zero_points(arguments: dict) -> None:
  for name in ("a", "b"):
    arguments[f"{name}_zero_point"] = _dtypes.host_zero_point(
        f"{name}_zero_point", arguments[f"{name}_zero_point"],
        getattr(arguments[name], "dtype", None),
    )


@_bind.op(jit=True, out_sharding=_bind.sharding, check=_check_onnx_zero_points)
def matmul_integer(
    a: ArrayLike,
    b: ArrayLike,
    a_zero_point: ArrayLike | None = None,
    b_zero_point: ArrayLike | None = None,
    *,
    out_sharding: Any = None,
) -> jax.Array:
  r"""ONNX MatMulInteger: ``(a - a_zero_point) @ (b - b_zero_point)`` in int32.

  .. math::

    y_{mn} = \sum_k (a_{mk} - z_{a,m}) (b_{kn} - z_{b,n})

  accumulated in int32, wrapping around on overflow as ONNX's int32 does
  (:func:`quantized_dot_general`, which this calls). Shapes follow
  ``numpy.matmul``: 1-D operands are promoted and the promoted dim removed,
  batch dims broadcast. No gradient (integer output).

  Args:
    a: int8 or uint8 (or 4- or 16-bit integer) matrix, ``(..., M, K)`` or ``(K,)``.
    b: int8 or uint8 (or 4- or 16-bit integer) matrix, ``(..., K, N)`` or ``(K,)``.
    a_zero_point: a's dtype: one element (per tensor), ``(M,)`` (per row), or
      a's rank with K replaced by 1; ``None`` for 0. A Python int takes a's dtype.
    b_zero_point: b's dtype: one element, ``(N,)`` (per column), or b's rank
      with K replaced by 1; ``None`` for 0.
    out_sharding: the result's sharding, as ``jnp.matmul``'s (required on an
      explicit mesh where K is split).

  Returns:
    An int32 array of ``numpy.matmul``'s output shape.

  Raises:
    TypeError: for a float or unsupported operand or zero point dtype.
    ValueError: if the shapes do not multiply, or a zero point fits no layout.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> a = jnp.array([[11, 7, 3], [10, 6, 2]], jnp.uint8)
    >>> b = jnp.array([[1, 4], [2, 5], [3, 6]], jnp.uint8)
    >>> jq.matmul_integer(a, b, jnp.uint8(12), jnp.uint8([0, 1]))
    Array([[-38, -68],
           [-44, -80]], dtype=int32)
  """
  return _sharding.placed(_matmul_integer, out_sharding, a, b, a_zero_point, b_zero_point)


def _matmul_integer(a, b, a_zero_point, b_zero_point):
  a2, b2, dimension_numbers, shape = _matmul_operands(a, b)
  a_zero_point, b_zero_point = _onnx_zero_points(a2, b2, a_zero_point, b_zero_point)
  accumulator = _integer_product(
      a2, b2, None, a_zero_point, None, b_zero_point,
      dimension_numbers=dimension_numbers, preferred_element_type=None, names=("a", "b"),
  )
  return accumulator.reshape(shape)


def _check_qlinear_zero_points(arguments: dict) -> None:
  _check_onnx_zero_points(arguments)
  arguments["y_zero_point"] = _dtypes.host_zero_point(
      "y_zero_point", arguments["y_zero_point"],
      arguments["output_dtype"] or getattr(arguments["a"], "dtype", None),
  )


@_bind.op(jit=True, output_dtype=_bind.dtype, out_sharding=_bind.sharding,
          check=_check_qlinear_zero_points)
def qlinear_matmul(
    a: ArrayLike,
    a_scale: ArrayLike,
    a_zero_point: ArrayLike | None,
    b: ArrayLike,
    b_scale: ArrayLike,
    b_zero_point: ArrayLike | None,
    y_scale: ArrayLike,
    y_zero_point: ArrayLike | None = None,
    *,
    output_dtype: DTypeLike | None = None,
    out_sharding: Any = None,
) -> jax.Array:
  r"""ONNX QLinearMatMul: a quantized matmul requantized to a quantized output.

  .. math::

    y = \mathrm{saturate}\left(\mathrm{round\_half\_to\_even}\left(
        \mathrm{float32}(\mathrm{acc}) \cdot \frac{s_a s_b}{s_y}\right) + z_y\right)

  where ``acc`` is :func:`matmul_integer`'s int32 accumulator and the
  multiplier ``(s_a * s_b) / s_y`` is formed in float32 (each operation
  rounded once), as onnxruntime computes it. Rounding and saturation are
  :func:`quantize_linear`'s; the zero point is added after rounding, as the
  ONNX operator's formula ``saturate(round(x / y_scale) + y_zero_point)``
  says. ``onnx.reference`` adds it before rounding, in float64, so it
  differs by 1 at exact ties with an odd zero point (docs/numerics.md).
  Shapes follow ``numpy.matmul``. No gradient (integer output).

  Args:
    a: int8 or uint8 matrix ``(..., M, K)`` or ``(K,)``.
    a_scale: float32 (or float16, bfloat16) scale of ``a``: one element or ``(M,)``.
    a_zero_point: a's dtype, one element or ``(M,)``; ``None`` for 0.
    b: int8 or uint8 matrix ``(..., K, N)`` or ``(K,)``.
    b_scale: one element or ``(N,)`` (per column).
    b_zero_point: b's dtype, one element or ``(N,)``; ``None`` for 0.
    y_scale: the output's scale, one element.
    y_zero_point: the output's zero point, one element; its dtype is the
      output's; ``None`` for 0.
    output_dtype: the output dtype when ``y_zero_point`` is ``None`` or a
      Python int; default a's dtype.
    out_sharding: the result's sharding, as ``jnp.matmul``'s (required on an
      explicit mesh where K is split).

  Returns:
    ``numpy.matmul``'s output shape, of y_zero_point's dtype, else
    ``output_dtype``, else a's dtype.

  Raises:
    TypeError: for float or unsupported operand, scale or zero point dtypes.
    ValueError: if the shapes do not multiply or a parameter fits no layout.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> a = jnp.array([[208, 236, 0, 238], [3, 214, 255, 29]], jnp.uint8)
    >>> b = jnp.array([[152, 51], [244, 60], [26, 255], [0, 127]], jnp.uint8)
    >>> jq.qlinear_matmul(a, 0.0066, jnp.uint8(113), b, 0.00705, jnp.uint8(114),
    ...                   0.0107, jnp.uint8(118))
    Array([[185,   1],
           [144, 207]], dtype=uint8)
  """
  return _sharding.placed(
      functools.partial(_qlinear_matmul, output_dtype=output_dtype), out_sharding,
      a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point)


def _qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale,
                    y_zero_point, *, output_dtype):
  a2, b2, dimension_numbers, shape = _matmul_operands(a, b)
  a_info = _dtypes.quantized_dtype("a.dtype", a2.dtype, integer=True)
  out_info = _parameters.quantized_output_dtype(
      y_zero_point, output_dtype, argument="y_zero_point", default=a_info.dtype,
      integer=True,
  )
  a_zero_point, b_zero_point = _onnx_zero_points(a2, b2, a_zero_point, b_zero_point)
  a_scale = _per_row("a_scale", _dtypes.scale_array("a_scale", a_scale),
                     a2.ndim, rows=True)
  b_scale = _per_row("b_scale", _dtypes.scale_array("b_scale", b_scale),
                     b2.ndim, rows=False)
  y_scale, y_zero_point = _parameters.per_tensor("y", y_scale, y_zero_point, out_info)
  lhs, rhs, infos, sides, (a_scale, a_zero_point, b_scale, b_zero_point) = _prepare(
      a2, b2, a_scale, a_zero_point, b_scale, b_zero_point, dimension_numbers,
      ("a", "b"))
  accumulator = integer_dot(
      lhs, rhs, a_zero_point, b_zero_point, dimension_numbers,
      lhs_info=infos[0], rhs_info=infos[1],
  )
  lhs_side, rhs_side = sides
  # A true division: XLA would multiply a per-row or per-column product by
  # the reciprocal of the broadcast y_scale (docs/numerics.md, XLA traps).
  multiplier = _numerics.true_divide(
      lhs_side.to_output(a_scale.astype(jnp.float32), lhs=True, other_free=len(rhs_side.free))
      * rhs_side.to_output(b_scale.astype(jnp.float32), lhs=False, other_free=len(
          lhs_side.free)),
      y_scale.astype(jnp.float32).reshape(()))
  value = accumulator.astype(jnp.float32) * multiplier
  y = _numerics.round_and_saturate(
      value, None if y_zero_point is None else y_zero_point.reshape(()), out_info)
  return y.reshape(shape)


_NBITS_DTYPES = {2: np.dtype(jnp.uint2), 4: np.dtype(jnp.uint4), 8: _UINT8}


def _nbits_bits(argument: str, value: Any) -> int:
  value = _bind.integer(argument, value)
  _validate.check(value in _NBITS_DTYPES, argument, "2, 4 or 8", value)
  return value


def _nbits_block_size(argument: str, value: Any) -> int:
  value = _bind.integer(argument, value)
  _validate.check(
      value >= 16 and value & (value - 1) == 0, argument,
      "a power of two >= 16 (MatMulNBits)", value,
  )
  return value


def _positive(argument: str, value: Any) -> int:
  value = _bind.integer(argument, value)
  _validate.check(value > 0, argument, "a positive int", value)
  return value


def nbits_inputs(b, scales, zero_points, *, K, N, bits, block_size):
  """MatMulNBits' inputs checked and laid out per row of the weight.

  Returns:
    ``(packed, scales, zero_points)``: the packed codes ``(N, k_blocks *
    blob_size)`` uint8, the scales ``(N, k_blocks)``, and the zero points
    ``(N, k_blocks)``: uint8 codes (onnxruntime's default ``2**(bits - 1)``
    when absent), or float as given.
  """
  blocks = -(-K // block_size)
  blob_size = block_size * bits // 8
  b = jnp.asarray(b)
  _validate.check(b.dtype == _UINT8, "b.dtype", "uint8 (packed)", b.dtype.name,
                  error=TypeError)
  _validate.check(
      b.size == N * blocks * blob_size, "b.shape",
      f"(N, k_blocks, blob_size) = ({N}, {blocks}, {blob_size})", b.shape,
  )
  scales = _dtypes.scale_array("scales", scales)
  _validate.check(
      scales.size == N * blocks, "scales.shape", f"(N, k_blocks) = ({N}, {blocks})",
      scales.shape,
  )
  if zero_points is None:
    zero_points = jnp.full((N, blocks), 1 << (bits - 1), jnp.uint8)
  elif jnp.issubdtype(jnp.asarray(zero_points).dtype, jnp.floating):
    zero_points = jnp.asarray(zero_points)
    _validate.check(
        zero_points.size == N * blocks, "zero_points.shape",
        f"(N, k_blocks) = ({N}, {blocks}) for float zero points", zero_points.shape,
    )
    zero_points = zero_points.reshape(N, blocks)
  else:
    zero_points = jnp.asarray(zero_points)
    _validate.check(
        zero_points.dtype == _UINT8, "zero_points.dtype",
        "uint8 (packed) or a float dtype", zero_points.dtype.name, error=TypeError,
    )
    row_bytes = -(-blocks * bits // 8)
    _validate.check(
        zero_points.size == N * row_bytes, "zero_points.shape",
        f"(N, ceil(k_blocks * bits / 8)) = ({N}, {row_bytes})", zero_points.shape,
    )
    zero_points = pallas_kernels.matmul.unpack_codes(
        zero_points.reshape(N, row_bytes), bits)[:, :blocks]
  return b.reshape(N, blocks * blob_size), scales.reshape(N, blocks), zero_points


def nbits_weight(packed, scales, zero_points, *, K, bits, block_size):
  """The ``(N, K)`` float32 weight of :func:`nbits_inputs`' arrays, as ``dequantize_linear``."""
  n, blocks = scales.shape
  # Each row's blocks are whole 32-bit words (block_size * bits >= 32), so
  # each row unpacks on its own.
  codes = packed if bits == 8 else _packing.unpack_integers(packed, bits, signed=False)
  codes = codes[:, :K]
  if jnp.issubdtype(zero_points.dtype, jnp.floating):
    # Float zero points: (q - zp) * scale in float32, each operation rounded once.
    steps = jnp.repeat(jnp.arange(blocks), block_size)[:K]
    zero = zero_points.astype(jnp.float32)[:, steps]
    return (codes.astype(jnp.float32) - zero) * scales.astype(jnp.float32)[:, steps]
  dtype = _NBITS_DTYPES[bits]
  if K % block_size:
    return _linear.dequantize_linear(
        codes.astype(dtype), scales, zero_points.astype(dtype), axis=1, block_size=block_size,
        output_dtype=jnp.float32,
    )
  # Whole blocks: dequantize_linear's formula on an (N, blocks, block_size)
  # view, the same element-wise arithmetic in one fusion.
  info = _dtypes.quantized_dtype("bits", dtype)
  weight = _numerics.dequantize_formula(
      codes.reshape(n, blocks, block_size), scales[:, :, None], zero_points[:, :, None],
      info=info, output_dtype=jnp.float32,
  )
  return weight.reshape(n, K)


def _nbits_xla(a, packed, scales, zero_points, *, K, bits, block_size):
  weight = nbits_weight(packed, scales, zero_points, K=K, bits=bits, block_size=block_size)
  # Fused into the dot, the dequantization changes XLA:CPU's summation order
  # for some shapes (a matrix-vector product at K = 1024): the barrier keeps
  # the product that of the materialized weight, as a user's
  # ``x @ dequantize_linear(...).T`` and the Pallas kernel compute it.
  weight = lax.optimization_barrier(weight)
  return lax.dot_general(
      a.astype(jnp.float32), weight, (((a.ndim - 1,), (1,)), ((), ())),
      precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
  )


def _nbits_kernel(a, packed, scales, zero_points, *, K, bits, block_size):
  """The fused kernel on MatMulNBits' own layout: packed rows, per-block scales and codes."""
  formula = functools.partial(
      _numerics.dequantize_formula,
      info=_dtypes.quantized_dtype("bits", _NBITS_DTYPES[bits]),
      output_dtype=jnp.float32,
  )
  del K  # a's last dim
  # a as it is, not its rows merged: under jax.jit the kernel is partitioned
  # along each of a's leading dims as a is sharded. Behind a barrier, closed-over
  # operands are not folded: XLA's evaluator would sum interpret mode's dot in
  # another order than the compiled dot.
  a, packed, scales, zero_points = lax.optimization_barrier((a, packed, scales, zero_points))
  return pallas_kernels.dequantize_matmul(
      a.astype(jnp.float32), packed, scales, zero_points,
      formula=formula, block_size=block_size, bits=bits,
  )


@_bind.op(
    jit=True, K=_positive, N=_positive, bits=_nbits_bits, block_size=_nbits_block_size,
    implementation=_bind.IMPLEMENTATION,
)
def matmul_nbits(
    a: ArrayLike,
    b: ArrayLike,
    scales: ArrayLike,
    zero_points: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    *,
    K: int,  # pylint: disable=invalid-name
    N: int,  # pylint: disable=invalid-name
    bits: int = 4,
    block_size: int,
    implementation: str | None = None,
) -> jax.Array:
  r"""onnxruntime's com.microsoft MatMulNBits: ``a @ dequantize(b).T``, weight-only.

  .. math::

    W_{nk} = (q_{nk} - z_{n,\lfloor k/\mathrm{bs} \rfloor}) \, s_{n,\lfloor k/\mathrm{bs} \rfloor},
    \qquad y = a W^\top + \mathrm{bias}

  ``W`` is :func:`dequantize_linear` of the unsigned ``bits``-bit codes,
  blocked along K (a short last block allowed), in float32; the product is
  a float32 matmul at full precision (``Precision.HIGHEST``), the result
  rounded once to a's dtype. onnxruntime sums in another order, so the
  two agree to float32 summation error, not bit for bit. Gradients flow
  to ``a``, ``scales`` and ``bias`` (the codes are integers).

  onnxruntime's ``accuracy_level`` attribute has no counterpart: this is its
  float32 computation (levels 0 and 1). At level 4, with the weight a
  constant initializer, onnxruntime quantizes ``a`` to int8 and differs by
  that rounding. Its optional ``g_idx`` input (a permutation of K's blocks)
  is not taken: onnxruntime's fifth input is ``g_idx``, this op's fifth
  argument ``bias``, so pass inputs by name.

  Args:
    a: float32 (or float16, bfloat16) activations ``(..., K)``.
    b: packed uint8 codes ``(N, k_blocks, blob_size)`` (any shape of that
      size), ``k_blocks = ceil(K / block_size)``, ``blob_size = block_size *
      bits / 8``, each block's codes LSB first, as onnxruntime writes them.
    scales: ``(N, k_blocks)`` (or flat) float scales.
    zero_points: ``None`` for onnxruntime's default ``2**(bits - 1)``;
      packed uint8 ``(N, ceil(k_blocks * bits / 8))``, codes LSB first; or
      float ``(N, k_blocks)``.
    bias: ``(N,)`` or ``None``.
    K: the weight's input features (static).
    N: the weight's output features (static).
    bits: 2, 4 (the default) or 8.
    block_size: a power of two >= 16.
    implementation: ``None`` (the fastest path), ``"xla"`` or ``"pallas"``
      (a fused kernel that dequantizes packed codes next to the dot; it needs
      K a multiple of block_size, integer zero points, a static batch and
      more than one output, else XLA runs). Same bits.

  Returns:
    ``(..., N)`` in a's dtype.

  Raises:
    TypeError: for unsupported dtypes.
    ValueError: if a shape or attribute does not fit MatMulNBits.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> codes = jnp.arange(32, dtype=jnp.uint8) % 16    # one row, K = 32
    >>> b = jq.pack(codes.astype(jnp.uint4))            # 16 bytes, low nibble first
    >>> jq.matmul_nbits(jnp.ones((1, 32)), b, jnp.array([[0.5, 2.0]]), K=32, N=1,
    ...                 block_size=16)
    Array([[-20.]], dtype=float32)
  """
  a = jnp.asarray(a)
  _dtypes.float_input("a", a)
  _validate.check(a.ndim >= 1 and a.shape[-1] == K, "a.shape", f"(..., K = {K})",
                  a.shape)
  packed, scales, zero_points = nbits_inputs(
      b, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size)
  options = dict(K=K, bits=bits, block_size=block_size)
  xla = functools.partial(_nbits_xla, **options)
  # A symbolic batch (jax.export) has no static grid to tile: XLA runs it.
  static_batch = all(isinstance(d, int) for d in a.shape)
  # One output is one dot product of K terms, nothing for a kernel to fuse,
  # and XLA:CPU sums it in an order its fusion with the decoding picks:
  # interpret mode's decode gave another order (2 bits, K = 16; docs/numerics.md).
  outputs = a.size // K * N if static_batch else 0
  kernel = None
  if K % block_size == 0 and zero_points.dtype == _UINT8 and outputs > 1:
    kernel = functools.partial(_nbits_kernel, **options)
  y = _dispatch.evaluate(
      _dispatch.Route("matmul_nbits", f"uint{bits}", "blocked"), implementation, xla, kernel,
      a, packed, scales, zero_points)
  if bias is not None:
    bias = jnp.asarray(bias)
    _validate.check(bias.shape == (N,), "bias.shape", f"({N},)", bias.shape)
    # With K = 1 XLA makes the dot a product, which an FMA would absorb.
    y = _numerics.rounded_sum(y, bias.astype(jnp.float32))
  return y.astype(a.dtype)
