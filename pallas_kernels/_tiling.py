"""Block shapes per backend: the rules a tile must obey to compile, and the sizes we aim for.

Mosaic TPU: the last two dims of every block are divisible by (sublanes, 128)
or equal the array's dims. A vreg holds 8 sublanes of 32-bit values and packs
narrower ones along sublanes, so the native row tiling is 8 for 32-bit, 16 for
16-bit, 32 for 8-bit and 64 for 4-bit types; a block taller than one tile of the
narrowest dtype it touches stays a whole number of those tiles.

Triton: every dim of every block is a power of two, and the array itself may
be any size once padded to whole blocks. Loads of int4 lower, but read one
value per byte where XLA:GPU packs two: the kernels never see a sub-byte
array on CUDA (``_blockwise.triton_holds``).

Mosaic GPU (the default ``pallas_call`` backend on CUDA) is not targeted: it
wants 16-byte-aligned strides and 128-element copies, refuses int4 memrefs and
(rows, 1) scale blocks, and is built around Hopper's TMA pipelines for
matmuls. The kernels here ask for Triton explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from jax import export
import jax.numpy as jnp
import numpy as np

Target = Literal["tpu", "triton"]
TARGETS = ("tpu", "triton")

LANES = 128
# Default tile caps (rows, lanes) for the last two dims. TPU: 512 x 1024
# elements keep an int8 -> float32 step at 2.5 MiB, 5 MiB double-buffered,
# inside v5e's 16 MiB of scoped VMEM. Triton: 8192 elements per program (32
# per thread at 8 warps) is the usual sweet spot of a memory-bound element-wise
# kernel on A100/H100.
MAX_BLOCK: dict[str, tuple[int, int]] = {"tpu": (512, 1024), "triton": (8, 1024)}


def sublanes(dtype: np.dtype) -> int:
  """TPU rows per native tile of ``dtype``: 8 for 32-bit, 16, 32, 64 for 4-bit."""
  dtype = np.dtype(dtype)
  bits = (jnp.iinfo if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo)(dtype).bits
  return 8 * 32 // min(bits, 32)


def _next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def symbolic(length) -> bool:
  """Whether a dim is known only when the program runs (``jax.export``'s symbolic batch)."""
  return export.is_symbolic_dim(length)


def _tpu_tile(length: int, cap: int, multiple: int) -> int:
  """A full dim if it fits, else a divisor of ``length`` that is a multiple of ``multiple``.

  Without such a divisor, or when ``length`` is symbolic, the largest multiple
  under ``cap`` is returned and the caller pads.
  """
  top = max(cap // multiple * multiple, multiple)
  if symbolic(length):
    return top
  if length <= cap:
    return length
  for tile in range(top, multiple - 1, -multiple):
    if length % tile == 0 and tile * 4 >= top:
      return tile
  return top


def tile_shape(
    shape: Sequence[int],
    dtypes: Sequence[np.dtype],
    target: Target,
    max_block: tuple[int, int] | None = None,
) -> tuple[int, ...]:
  """The block shape for an array of ``shape`` (rank >= 2) on ``target``.

  Leading dims get blocks of 1 (they become grid axes); the last two get
  tiles obeying ``target``'s rules for every dtype in ``dtypes``. Dims that
  the tile does not divide are padded by the caller.

  Args:
    shape: the (collapsed, rank >= 2) shape of the output.
    dtypes: the dtypes of every operand and result that spans the last two dims.
    target: ``"tpu"`` or ``"triton"``.
    max_block: caps for (rows, lanes); default :data:`MAX_BLOCK` of the target.

  Returns:
    The tile, one entry per dim of ``shape``.
  """
  rows, lanes = shape[-2:]
  max_rows, max_lanes = max_block or MAX_BLOCK[target]
  if target == "tpu":
    row_multiple = max(sublanes(d) for d in dtypes)
    tile = (_tpu_tile(rows, max_rows, row_multiple), _tpu_tile(lanes, max_lanes, LANES))
  else:
    lane_cap = _next_power_of_two(max_lanes)
    lane_tile = lane_cap if symbolic(lanes) else min(_next_power_of_two(lanes), lane_cap)
    row_cap = max(1, _next_power_of_two(max_rows * max_lanes) // lane_tile)
    tile = (row_cap if symbolic(rows) else min(_next_power_of_two(rows), row_cap), lane_tile)
  return (1,) * (len(shape) - 2) + tile


def padded_shape(shape: Sequence[int], tile: Sequence[int]) -> tuple[int, ...]:
  """``shape`` rounded up to whole tiles."""
  return tuple(-(-n // t) * t for n, t in zip(shape, tile))


def flat_width(size: int, target: Target, max_block: tuple[int, int] | None = None) -> int:
  """Row width for laying a 1-D array of ``size`` elements out as 2-D rows.

  A multiple of 128 dividing ``size`` if there is one (no padding), else the
  whole array as one row when it fits one block, else the lane cap (padded,
  as is a symbolic size).
  """
  max_lanes = (max_block or MAX_BLOCK[target])[1]
  if symbolic(size):
    return max_lanes
  for width in range(max_lanes // LANES * LANES, LANES - 1, -LANES):
    if size % width == 0:
      return width
  if size <= max_lanes:
    return size
  return max_lanes

