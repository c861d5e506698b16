"""The one scale-layout resolver and the block-wise application of a formula.

:func:`resolve` turns the shape of ``scale`` (with ``axis`` and ``block_size``)
into a :class:`Granularity`: the scale reshaped to x's rank, and how many x
elements each scale element covers along every dimension. :func:`apply_blockwise`
then evaluates an element-wise formula with each parameter expanded over its
block inside the formula's fusion, so x is never reshaped (a sharded x keeps
its sharding) and no x-sized parameter is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import math
from typing import Literal

import jax
from jax import lax
from jax import export
import jax.numpy as jnp
import numpy as np

from jaxquant import _numerics
from jaxquant import _sharding
from jaxquant import _validate

Kind = Literal["per-tensor", "per-axis", "blocked", "block-wise broadcast"]


@dataclasses.dataclass(frozen=True)
class Granularity:
  """A resolved scale layout.

  Attributes:
    kind: which row of the granularity table (docs/numerics.md) the scale matched.
    param_shape: the shape scale and zero point take to broadcast against x
      block by block (x's rank).
    block_shape: x elements covered by one scale element along each dimension;
      the last block along a dimension may be short (ragged).
    axis: the quantization axis for per-axis and blocked layouts, else ``None``.
  """

  kind: Kind
  param_shape: tuple[int, ...]
  block_shape: tuple[int, ...]
  axis: int | None = None

  @property
  def split_dims(self) -> tuple[int, ...]:
    """Dimensions where a scale element covers a block of several x elements."""
    return tuple(
        d for d, (params, block) in enumerate(zip(self.param_shape, self.block_shape))
        if _several(block) and _several(params)
    )

  @property
  def kernel_blocks(self) -> tuple[int, ...]:
    """Per dim, the x elements one parameter covers where it is split, else 1 (the kernels')."""
    split = self.split_dims
    return tuple(b if d in split else 1 for d, b in enumerate(self.block_shape))

  def shaped(self, params: Sequence[jax.Array | None]) -> list[jax.Array | None]:
    """The parameters in :attr:`param_shape` (``None`` stays ``None``)."""
    return [None if p is None else jnp.reshape(p, self.param_shape) for p in params]


def _several(n) -> bool:
  """``n > 1`` for a dimension size; a symbolic one (``jax.export``) counts as several.

  A split dimension is mapped over with ``jax.vmap``, which is right for any
  number of blocks, so a batch size known only at run time needs no decision.
  """
  return export.is_symbolic_dim(n) or n > 1


def _per_axis(x_shape: tuple[int, ...], axis: int) -> Granularity:
  """One parameter per index of ``axis``."""
  rank = len(x_shape)
  param_shape = tuple(x_shape[axis] if d == axis else 1 for d in range(rank))
  block_shape = tuple(1 if d == axis else x_shape[d] for d in range(rank))
  return Granularity("per-axis", param_shape, block_shape, axis)


def _blocked(x_shape: tuple[int, ...], axis: int, block_size: int) -> Granularity:
  """One parameter per ``block_size`` elements along ``axis`` (the last block may be short)."""
  param_shape = tuple(-(-n // block_size) if d == axis else n for d, n in enumerate(x_shape))
  block_shape = tuple(block_size if d == axis else 1 for d in range(len(x_shape)))
  return Granularity("blocked", param_shape, block_shape, axis)


def _block_size_range(length: int, blocks: int) -> str:
  low = -(-length // blocks)
  high = "inf" if blocks == 1 else str(-(-length // (blocks - 1)) - 1)
  return f"in ONNX's range [ceil(D/S), ceil(D/(S-1)) - 1] = [{low}, {high}]"


def resolve(
    x_shape: Sequence[int],
    scale_shape: Sequence[int],
    zero_point_shape: Sequence[int] | None = None,
    *,
    axis: int,
    block_size: int,
) -> Granularity:
  """Resolves the layout of ``scale`` against ``x``, validating every shape.

  Args:
    x_shape: shape of the quantized or float input.
    scale_shape: shape of the scale.
    zero_point_shape: shape of the zero point, which must equal ``scale_shape``
      (any two one-element shapes count as equal: both are per-tensor).
    axis: the quantization axis (used by per-axis and blocked layouts only).
    block_size: ``> 0`` for blocked quantization along ``axis``, else 0.

  Returns:
    The :class:`Granularity`.

  Raises:
    ValueError: if the shapes fit no layout, or ``axis``/``block_size`` are out of range.
  """
  x_shape, scale_shape = tuple(x_shape), tuple(scale_shape)
  rank = len(x_shape)
  block_size = _validate.block_size(block_size)
  if zero_point_shape is not None:
    # A 0-d and a one-element parameter are both per-tensor, so ONNX models
    # pair them freely (a () scale with a (1,) zero point).
    _validate.check(
        tuple(zero_point_shape) == scale_shape
        or math.prod(zero_point_shape) == math.prod(scale_shape) == 1,
        "zero_point.shape", f"equal to scale.shape {scale_shape}",
        tuple(zero_point_shape),
    )

  if math.prod(scale_shape) == 1 and (block_size == 0 or len(scale_shape) != rank):
    # ONNX and onnxruntime refuse block_size with a per-tensor scale; a
    # one-element scale of x's rank is one block, checked below.
    _validate.check(
        block_size == 0, "block_size",
        f"0 for a per-tensor scale of shape {scale_shape} (blocked quantization takes a "
        f"scale of x's rank {rank})", block_size,
    )
    return Granularity("per-tensor", (1,) * rank, x_shape)

  if len(scale_shape) == 1 and rank >= 2:
    _validate.check(
        block_size == 0, "block_size",
        "0 for a 1-D per-axis scale (blocked quantization takes a scale of x's "
        f"rank {rank})", block_size,
    )
    axis = _validate.normalize_axis(axis, rank)
    _validate.check(
        scale_shape[0] == x_shape[axis], "scale.shape",
        f"({x_shape[axis]},) for per-axis quantization along axis {axis} of x.shape "
        f"{x_shape}", scale_shape,
    )
    return _per_axis(x_shape, axis)

  if block_size > 0:
    _validate.check(
        len(scale_shape) == rank, "scale.shape",
        f"of x's rank {rank} for blocked quantization (block_size={block_size})",
        scale_shape,
    )
    axis = _validate.normalize_axis(axis, rank)
    blocked = _blocked(x_shape, axis, block_size)
    expected = blocked.param_shape
    _validate.check(
        all(s == e for d, (s, e) in enumerate(zip(scale_shape, expected)) if d != axis),
        "scale.shape", f"equal to x.shape {x_shape} except along axis {axis}",
        scale_shape,
    )
    if scale_shape[axis] != expected[axis]:
      if x_shape[axis] == 0 or scale_shape[axis] == 0:
        # No block_size fits: an empty axis has no blocks, a non-empty one has some.
        _validate.fail(
            "scale.shape", f"{expected} for x.shape {x_shape} blocked by "
            f"{block_size} along axis {axis}", scale_shape,
        )
      _validate.fail(
          "block_size",
          f"{_block_size_range(x_shape[axis], scale_shape[axis])} for x.shape[{axis}]="
          f"{x_shape[axis]} and scale.shape[{axis}]={scale_shape[axis]}", block_size,
      )
    return blocked

  _validate.check(
      len(scale_shape) == rank or 2 <= len(scale_shape) < rank, "scale.shape",
      "(), one element, (x.shape[axis],), or of x's rank"
      + (f" (or 2..{rank - 1}, left-padded)" if rank > 2 else "")
      + f" for x.shape {x_shape}", scale_shape,
  )
  param_shape = (1,) * (rank - len(scale_shape)) + scale_shape
  _validate.check(
      all((p == 0 and n == 0) or (p > 0 and n % p == 0)
          for p, n in zip(param_shape, x_shape)),
      "scale.shape",
      f"block-wise broadcastable to x.shape {x_shape} (each dim of x a multiple of "
      "scale's, rank left-padded with 1s)", scale_shape,
  )
  block_shape = tuple(n // p if p else 1 for p, n in zip(param_shape, x_shape))
  return Granularity("block-wise broadcast", param_shape, block_shape)


def _slice_params(params, d: int, start: int, stop: int):
  return [None if p is None else lax.slice_in_dim(p, start, stop, axis=d) for p in params]


def expand_params(
    params: Sequence[jax.Array | None], granularity: Granularity, shape: Sequence[int]
) -> list[jax.Array | None]:
  """The parameters broadcastable against x of ``shape``: each block's value repeated over it.

  Along each split dim the parameter is broadcast over its block and the
  (blocks, block) pair merged, then cut to x's length (a short last block).
  XLA fuses this into the element-wise formula that consumes it, so nothing
  x-sized is written; along the other dims the parameter keeps size 1.
  """
  params = granularity.shaped(params)
  for d, length in enumerate(shape):
    if length == 0:
      # An empty dim of x is a multiple of any scale dim; its blocks are empty.
      params = _slice_params(params, d, 0, 0)
  for d in granularity.split_dims:
    blocks, block = granularity.param_shape[d], granularity.block_shape[d]

    def expand(p, d=d, blocks=blocks, block=block):
      p = jnp.expand_dims(p, d + 1)
      p = jnp.broadcast_to(p, p.shape[:d + 1] + (block,) + p.shape[d + 2:])
      p = p.reshape(p.shape[:d] + (blocks * block,) + p.shape[d + 2:])
      return lax.slice_in_dim(p, 0, shape[d], axis=d)

    params = [None if p is None else expand(p) for p in params]
  return params


def apply_blockwise(
    formula: Callable[..., jax.Array],
    x: jax.Array,
    params: Sequence[jax.Array | None],
    granularity: Granularity,
) -> jax.Array:
  """Evaluates ``formula(x, *params)`` element-wise, each x element with its block's parameters.

  The parameters are expanded along each split dimension (see
  :func:`expand_params`; XLA fuses the expansion into the formula, so it is
  not written out), and the formula runs on x as it is. x is never reshaped:
  a sharded x keeps its sharding through the op, even where a shard edge
  cuts through a block, with no communication (docs/sharding.md), and a
  short last block needs neither padding nor a split.

  Args:
    formula: an element-wise function of x and broadcastable parameters.
    x: the input.
    params: arrays of any shape with ``prod(granularity.param_shape)`` elements,
      or ``None`` (passed through to ``formula`` as ``None``).
    granularity: from :func:`resolve`.

  Returns:
    ``formula``'s result, shaped like x.
  """
  params = expand_params(params, granularity, x.shape)
  return formula(x, *[None if p is None else _sharding.split_like(p, x) for p in params])


def packable(granularity: Granularity, shape: Sequence[int], elements_per_byte: int) -> bool:
  """Whether packed x can enter a kernel as bytes: no byte straddles a row or a block.

  Bytes run along the last dim, ``elements_per_byte`` (``8 // bits``) elements
  each, so the last dim, and the block when the last dim is split into blocks,
  must be multiples of it.
  """
  last = len(shape) - 1
  return bool(shape) and shape[-1] % elements_per_byte == 0 and (
      last not in granularity.split_dims
      or granularity.block_shape[-1] % elements_per_byte == 0
  )


def for_reduction(
    x_shape: Sequence[int], *, axis: int | None, block_size: int
) -> Granularity:
  """The layout of parameters computed from x itself (dynamic quantization).

  ``axis=None`` gives one parameter for the tensor, ``axis=k`` one per index
  of dimension k, ``axis=k, block_size=B`` one per block of B along k.

  Raises:
    ValueError: if ``axis`` or ``block_size`` is out of range.
  """
  x_shape = tuple(x_shape)
  rank = len(x_shape)
  block_size = _validate.block_size(block_size)
  if axis is None:
    _validate.check(
        block_size == 0, "block_size",
        "0 when axis is None (one scale for the tensor)", block_size,
    )
    return Granularity("per-tensor", (1,) * rank, x_shape)
  axis = _validate.normalize_axis(axis, rank)
  if block_size == 0:
    return _per_axis(x_shape, axis)
  return _blocked(x_shape, axis, block_size)


def reduce_windows(
    x: jax.Array, combine: Callable[[jax.Array, jax.Array], jax.Array],
    windows: Sequence[int],
) -> jax.Array:
  """The min or max (``combine``: ``lax.min`` or ``lax.max``) of each window of x.

  Windows do not overlap (stride = window). These two are the reductions
  JAX differentiates (``reduce_window_min``/``max``, reached through their
  identity as init), so the statistics keep their derivative. A short last
  window is reduced apart from the whole ones rather than padded: given a
  padded ``reduce_window`` over a sharded dim, XLA's SPMD partitioner
  returned the padding alone for the last window (jax 0.10.2, 8 CPU devices).
  Only a symbolic dim (``jax.export``), where the short window's start is
  unknown, is padded.
  """
  windows = tuple(windows)
  # On an explicit mesh, windows that the shards do not hold whole are reduced by
  # automatic sharding, which exchanges their halos (docs/sharding.md, "Explicit meshes").
  cut = [d for d in _sharding.split_dims(x)
         if windows[d] > 1 and x.shape[d] % (windows[d] * _sharding.shards(x, d))]
  if cut:
    return _sharding.unsplit_along(lambda x: reduce_windows(x, combine, windows), x, cut)
  for d, (n, w) in enumerate(zip(x.shape, windows)):
    if export.is_symbolic_dim(n % w):
      # A length known only at run time (jax.export) has no last whole window to cut
      # at: the short one is padded with combine's identity instead.
      padding = [(0, -(-n // w) * w - n if e == d else 0, 0) for e in range(x.ndim)]
      return reduce_windows(lax.pad(x, _neutral(combine, x.dtype), padding), combine, windows)
    if n % w:
      whole = n - n % w
      tail = reduce_windows(
          lax.slice_in_dim(x, whole, n, axis=d), combine, _replaced(windows, d, n - whole))
      if not whole:
        return tail
      head = reduce_windows(lax.slice_in_dim(x, 0, whole, axis=d), combine, windows)
      return jnp.concatenate([head, tail], axis=d)
  return _reduce_whole_windows(x, combine, windows)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _reduce_whole_windows(x, combine, windows):
  """``reduce_window`` with an identity XLA cannot see, so a constant x is not folded.

  XLA's evaluator took about a second per million elements of a closed-over
  x to fold it while compiling; the windows take about a millisecond to run.
  The derivative is that of ``jnp.min``/``jnp.max`` over each window: an
  extreme that several elements of a window share passes each the same part
  (JAX's own ``reduce_window_min``/``max`` derivative gives it all to one of
  them), as the per-tensor and per-axis statistics do.
  """
  return _windows(x, combine, windows, identity=_numerics.unfolded)


@_reduce_whole_windows.defjvp
def _reduce_whole_windows_jvp(combine, windows, primals, tangents):
  (x,), (tangent,) = primals, tangents
  extremes = _reduce_whole_windows(x, combine, windows)
  split = tuple(d for d, size in enumerate(windows) if size > 1)
  shape = sum(((n // windows[d], windows[d]) if d in split else (n,)
               for d, n in enumerate(x.shape)), ())
  within = tuple(d + 1 + split.index(d) for d in split)
  # Each window's extreme broadcast over its elements, compared with x where it lies.
  expanded = jnp.broadcast_to(jnp.expand_dims(extremes, within), shape).reshape(x.shape)
  at = x == expanded

  def window_sum(values):
    if _sharding.split_dims(x):
      # An explicit mesh, whose shards hold whole windows here (reduce_windows): sums
      # over each window as a dim of its own, transposed to broadcasts, where
      # reduce_window's transpose pads the split dim, which the mesh refuses.
      return jnp.sum(values.reshape(shape), axis=within)
    # In place: where shards cut windows, automatic sharding exchanges halos.
    return lax.reduce_window(values, np.array(0, values.dtype), lax.add, windows, windows,
                             "VALID")

  count = window_sum(at.astype(tangent.dtype))
  return extremes, window_sum(jnp.where(at, tangent, 0)) / jnp.maximum(count, 1)


def _windows(x, combine, windows, *, identity=lambda value: value):
  """``combine`` over whole non-overlapping ``windows``, from ``identity`` of its neutral value."""
  return lax.reduce_window(
      x, identity(_neutral(combine, x.dtype)), combine, windows, windows, "VALID")


def _neutral(combine, dtype) -> np.ndarray:
  """``combine``'s neutral value: +inf for ``lax.min``, -inf for ``lax.max``."""
  return np.array(np.inf if combine is lax.min else -np.inf, dtype)


def _replaced(shape: tuple[int, ...], d: int, value: int) -> tuple[int, ...]:
  return shape[:d] + (value,) + shape[d + 1:]


def reduce_blockwise(
    reduction: Callable[..., tuple[jax.Array, ...]],
    x: jax.Array,
    granularity: Granularity,
) -> tuple[jax.Array, ...]:
  """Reduces x over each block, giving arrays of ``granularity.param_shape``.

  Whole dims are reduced with ``reduction(x, axes)``. Blocks along a split
  dim are windows of x, reduced in place (``reduction(x, (), windows=...)``,
  see :func:`reduce_windows`) rather than over a ``(blocks, block)`` reshape
  of x: a shard edge through a block then costs XLA a halo exchange of at
  most one block, where the reshape gathered x; a short last block is padded
  with the reduction's identity.

  Args:
    reduction: ``reduction(x, axes, windows=None)`` reduces ``x`` over ``axes``
      (no kept dims), or with ``windows`` over each window (window sizes per
      dim, stride equal to size), and returns a tuple of arrays.
    x: the input.
    granularity: the parameters' layout (from :func:`for_reduction` or :func:`resolve`).

  Returns:
    The reduction's outputs, each of ``granularity.param_shape``.
  """
  split = granularity.split_dims
  if not split:
    axes = tuple(d for d, p in enumerate(granularity.param_shape) if p == 1)
    return tuple(r.reshape(granularity.param_shape) for r in reduction(x, axes))
  # A reduced dim beside the split ones is one window of its whole length.
  windows = tuple(
      granularity.block_shape[d] if d in split
      else n if granularity.param_shape[d] == 1 else 1
      for d, n in enumerate(x.shape)
  )
  return tuple(
      r.reshape(granularity.param_shape) for r in reduction(x, (), windows=windows)
  )
