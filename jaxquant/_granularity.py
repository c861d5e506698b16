"""The one scale-layout resolver (SPEC §2) and the block-wise application of a formula.

:func:`resolve` turns the shape of ``scale`` (with ``axis`` and ``block_size``)
into a :class:`Granularity`: the scale reshaped to x's rank, and how many x
elements each scale element covers along every dimension. :func:`apply_blockwise`
then evaluates an element-wise formula block by block with ``jax.vmap``, so a
blocked scale is never repeated out to x's size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from jaxquant import _validate

Kind = Literal["per-tensor", "per-axis", "blocked", "block-wise broadcast"]


@dataclasses.dataclass(frozen=True)
class Granularity:
  """A resolved scale layout.

  Attributes:
    kind: which row of SPEC §2 the scale matched.
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
        if params > 1 and block > 1
    )


def _block_size_range(length: int, blocks: int) -> str:
  low = -(-length // blocks)
  high = "inf" if blocks == 1 else str(-(-length // (blocks - 1)) - 1)
  return f"in ONNX's range [ceil(D/S), ceil(D/(S-1)) - 1] = [{low}, {high}]"


def resolve(
    function: str,
    x_shape: Sequence[int],
    scale_shape: Sequence[int],
    zero_point_shape: Sequence[int] | None = None,
    *,
    axis: int,
    block_size: int,
) -> Granularity:
  """Resolves the layout of ``scale`` against ``x`` (SPEC §2), validating every shape.

  Args:
    function: the public op's name, for error messages.
    x_shape: shape of the quantized or float input.
    scale_shape: shape of the scale.
    zero_point_shape: shape of the zero point, which must equal ``scale_shape``.
    axis: the quantization axis (used by per-axis and blocked layouts only).
    block_size: ``> 0`` for blocked quantization along ``axis``, else 0.

  Returns:
    The :class:`Granularity`.

  Raises:
    ValueError: if the shapes fit no layout, or ``axis``/``block_size`` are out of range.
  """
  x_shape, scale_shape = tuple(x_shape), tuple(scale_shape)
  rank = len(x_shape)
  block_size = _validate.block_size(function, block_size)
  if zero_point_shape is not None:
    _validate.check(
        tuple(zero_point_shape) == scale_shape, function, "zero_point.shape",
        f"equal to scale.shape {scale_shape}", tuple(zero_point_shape),
    )

  if math.prod(scale_shape) == 1:
    return Granularity("per-tensor", (1,) * rank, x_shape)

  if len(scale_shape) == 1 and rank >= 2:
    _validate.check(
        block_size == 0, function, "block_size",
        "0 for a 1-D per-axis scale (blocked quantization takes a scale of x's "
        f"rank {rank})", block_size,
    )
    axis = _validate.normalize_axis(function, axis, rank)
    _validate.check(
        scale_shape[0] == x_shape[axis], function, "scale.shape",
        f"({x_shape[axis]},) for per-axis quantization along axis {axis} of x.shape "
        f"{x_shape}", scale_shape,
    )
    param_shape = tuple(x_shape[axis] if d == axis else 1 for d in range(rank))
    block_shape = tuple(1 if d == axis else x_shape[d] for d in range(rank))
    return Granularity("per-axis", param_shape, block_shape, axis)

  if block_size > 0:
    _validate.check(
        len(scale_shape) == rank, function, "scale.shape",
        f"of x's rank {rank} for blocked quantization (block_size={block_size})",
        scale_shape,
    )
    axis = _validate.normalize_axis(function, axis, rank)
    expected = tuple(-(-x_shape[d] // block_size) if d == axis else x_shape[d]
                     for d in range(rank))
    _validate.check(
        all(s == e for d, (s, e) in enumerate(zip(scale_shape, expected)) if d != axis),
        function, "scale.shape", f"equal to x.shape {x_shape} except along axis {axis}",
        scale_shape,
    )
    if scale_shape[axis] != expected[axis] and (x_shape[axis] == 0 or scale_shape[axis] == 0):
      # No block_size fits: an empty axis has no blocks, a non-empty one has some.
      _validate.fail(
          function, "scale.shape", f"{expected} for x.shape {x_shape} blocked by "
          f"{block_size} along axis {axis}", scale_shape,
      )
    if scale_shape[axis] != expected[axis]:
      _validate.fail(
          function, "block_size",
          f"{_block_size_range(x_shape[axis], scale_shape[axis])} for x.shape[{axis}]="
          f"{x_shape[axis]} and scale.shape[{axis}]={scale_shape[axis]}", block_size,
      )
    block_shape = tuple(block_size if d == axis else 1 for d in range(rank))
    return Granularity("blocked", scale_shape, block_shape, axis)

  _validate.check(
      len(scale_shape) == rank or 2 <= len(scale_shape) < rank, function, "scale.shape",
      "(), one element, (x.shape[axis],), or of x's rank"
      + (f" (or 2..{rank - 1}, left-padded)" if rank > 2 else "")
      + f" for x.shape {x_shape}", scale_shape,
  )
  param_shape = (1,) * (rank - len(scale_shape)) + scale_shape
  _validate.check(
      all((p == 0 and n == 0) or (p > 0 and n % p == 0)
          for p, n in zip(param_shape, x_shape)),
      function, "scale.shape",
      f"block-wise broadcastable to x.shape {x_shape} (each dim of x a multiple of "
      "scale's, rank left-padded with 1s)", scale_shape,
  )
  block_shape = tuple(n // p if p else 1 for p, n in zip(param_shape, x_shape))
  return Granularity("block-wise broadcast", param_shape, block_shape)


def apply_blockwise(
    formula: Callable[..., jax.Array],
    x: jax.Array,
    params: Sequence[jax.Array | None],
    granularity: Granularity,
) -> jax.Array:
  """Evaluates ``formula(x_block, *params_block)`` over every block of x.

  Each split dimension ``d`` (see :attr:`Granularity.split_dims`) is padded to
  a whole number of blocks, reshaped to ``(blocks, block)``, and mapped over
  with ``jax.vmap``; inside, a block sees its own parameters as size-1 dims
  and ``formula`` broadcasts them. The padding is sliced off the result.

  Args:
    formula: an element-wise function of x and broadcastable parameters.
    x: the input.
    params: arrays of any shape with ``prod(granularity.param_shape)`` elements,
      or ``None`` (passed through to ``formula`` as ``None``).
    granularity: from :func:`resolve`.

  Returns:
    ``formula``'s result, shaped like x.
  """
  params = [None if p is None else jnp.reshape(p, granularity.param_shape) for p in params]
  for d, length in enumerate(x.shape):
    if length == 0:
      # An empty dim of x is a multiple of any scale dim; its blocks are empty.
      params = [None if p is None else p[(slice(None),) * d + (slice(0, 0),)] for p in params]
  split = granularity.split_dims
  if not split:
    return formula(x, *params)
  unpadded_shape = x.shape
  x, padded_shape = _blocked_view(x, granularity, padding_value=0)

  def per_block(x_block, *block_params):
    return formula(x_block, *(
        None if p is None else jnp.expand_dims(p, split) for p in block_params
    ))

  mapped = per_block
  # The i-th split dim's block index sits at position split[i] in x (earlier
  # block indices are mapped away, earlier block extents remain) and at
  # split[i] - i in the parameters (which have no block extents).
  for i in reversed(range(len(split))):
    mapped = jax.vmap(
        mapped,
        in_axes=(split[i], *(None if p is None else split[i] - i for p in params)),
        out_axes=split[i],
    )
  y = mapped(x, *params).reshape(padded_shape)
  return y[tuple(slice(0, n) for n in unpadded_shape)]


def _blocked_view(x: jax.Array, granularity: Granularity, *, padding_value) -> tuple[jax.Array, list[int]]:
  """x padded to whole blocks along each split dim, each split into ``(blocks, block)``."""
  padded_shape, blocked_shape = list(x.shape), []
  for d, length in enumerate(x.shape):
    if d in granularity.split_dims:
      blocks, block = granularity.param_shape[d], granularity.block_shape[d]
      padded_shape[d] = blocks * block
      blocked_shape += [blocks, block]
    else:
      blocked_shape.append(length)
  padding = [(0, p - n) for p, n in zip(padded_shape, x.shape)]
  if any(high for _, high in padding):
    x = jnp.pad(x, padding, constant_values=padding_value)
  return x.reshape(blocked_shape), padded_shape


def for_reduction(
    function: str, x_shape: Sequence[int], *, axis: int | None, block_size: int
) -> Granularity:
  """The layout of parameters computed from x itself (dynamic quantization).

  ``axis=None`` gives one parameter for the tensor, ``axis=k`` one per index
  of dimension k, ``axis=k, block_size=B`` one per block of B along k.

  Raises:
    ValueError: if ``axis`` or ``block_size`` is out of range.
  """
  x_shape = tuple(x_shape)
  rank = len(x_shape)
  block_size = _validate.block_size(function, block_size)
  if axis is None:
    _validate.check(
        block_size == 0, function, "block_size",
        "0 when axis is None (one scale for the tensor)", block_size,
    )
    return Granularity("per-tensor", (1,) * rank, x_shape)
  axis = _validate.normalize_axis(function, axis, rank)
  if block_size == 0:
    param_shape = tuple(x_shape[axis] if d == axis else 1 for d in range(rank))
    block_shape = tuple(1 if d == axis else x_shape[d] for d in range(rank))
    return Granularity("per-axis", param_shape, block_shape, axis)
  param_shape = tuple(-(-n // block_size) if d == axis else n for d, n in enumerate(x_shape))
  block_shape = tuple(block_size if d == axis else 1 for d in range(rank))
  return Granularity("blocked", param_shape, block_shape, axis)


def reduce_blockwise(
    reduction: Callable[[jax.Array, tuple[int, ...]], tuple[jax.Array, ...]],
    x: jax.Array,
    granularity: Granularity,
    *,
    padding_value,
) -> tuple[jax.Array, ...]:
  """Reduces x over each block, giving arrays of ``granularity.param_shape``.

  Args:
    reduction: ``reduction(x_view, axes)`` reduces ``x_view`` over ``axes``
      (no kept dims) and returns a tuple of arrays.
    x: the input.
    granularity: the parameters' layout (from :func:`for_reduction` or :func:`resolve`).
    padding_value: fills short last blocks; it must not change the reduction.

  Returns:
    The reduction's outputs, each of ``granularity.param_shape``.
  """
  view, _ = _blocked_view(x, granularity, padding_value=padding_value)
  axes, position = [], 0
  for d in range(x.ndim):
    if d in granularity.split_dims:
      axes.append(position + 1)
      position += 2
    else:
      if granularity.param_shape[d] == 1:
        axes.append(position)
      position += 1
  return tuple(r.reshape(granularity.param_shape) for r in reduction(view, tuple(axes)))
