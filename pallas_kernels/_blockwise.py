"""The one kernel shape every op here shares: a formula over broadcast operands, tile by tile.

An op hands :func:`elementwise` (or :func:`reduce`) arrays of one rank whose
dims are each either the full broadcast size or 1, or, for a blocked
parameter, the number of blocks. Broadcasting is done by the index maps: a
size-1 dim gets block 1 and block index 0, so a per-channel scale is read once
per tile and never expanded in HBM. The wrapper

1. views each blocked dim as ``(pieces, piece)`` with the parameter ``(pieces,
   1)`` (:func:`_block_view`), on the shard each device holds;
2. collapses the dims (drops size-1 output dims, merges neighbours that every
   operand treats alike), so any rank becomes two or three dims;
3. picks the tile per backend (:mod:`._tiling`) and pads every dim to whole
   tiles, slicing the result after;
4. runs one ``pallas_call`` whose body is the formula on the loaded blocks.

The backend is picked per platform when the call is lowered
(:func:`._platforms.per_platform`): Mosaic on TPU, Triton on CUDA/ROCm,
interpret mode elsewhere (CPU). Under ``jax.jit`` with sharded operands the
call is partitioned (:func:`_sharded`): each device runs the kernel on its own
shards, and a reduction's per-shard partial results are combined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import itertools
import math

import jax
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from pallas_kernels import _exact
from pallas_kernels import _platforms
from pallas_kernels import _tiling

Backend = _tiling.Target


def _dispatch(
    call: Callable[..., tuple[jax.Array, ...]],
    arrays: Sequence[jax.Array],
    *,
    backend: Backend | None,
    interpret: bool,
    xla: Callable[[Sequence[jax.Array]], tuple[jax.Array, ...]],
    result_dtypes: Sequence[np.dtype],
) -> tuple[jax.Array, ...]:
  """``call(arrays, backend=..., interpret=..., divide_asm=...)`` for the platform lowered to.

  ``xla(arrays)`` computes the same results without a kernel, which CUDA and
  ROCm run where Triton cannot: a symbolic dim (``jax.export``; Triton has no
  grid whose size is known only at run time), or an operand or result of a
  dtype a Triton kernel cannot hold (:func:`triton_holds`).
  """
  triton_cannot = not triton_holds([a.dtype for a in arrays], result_dtypes)
  if backend is not None:
    if backend == "triton" and not interpret and triton_cannot:
      return xla(arrays)
    return call(arrays, backend=backend, interpret=interpret,
                divide_asm=backend == "triton" and not interpret)

  def on(backend, *, interpret, divide_asm=False):
    return lambda *arrays: call(
        arrays, backend=backend, interpret=interpret, divide_asm=divide_asm
    )

  symbolic = any(_tiling.symbolic(n) for a in arrays for n in a.shape)
  triton = (lambda *arrays: xla(arrays)) if (symbolic or triton_cannot) and not interpret else None
  return tuple(_platforms.per_platform(
      arrays,
      tpu=on("tpu", interpret=interpret),
      cuda=triton or on("triton", interpret=interpret, divide_asm=not interpret),
      rocm=triton or on("triton", interpret=interpret),
      default=on("tpu", interpret=True),
  ))


# What a Triton kernel reads and writes exactly as XLA lays it out and
# converts as XLA does. XLA:GPU packs sub-byte arrays two or four to a byte,
# which a Triton kernel would read and write as one per byte (out of bounds:
# CUDA_ERROR_ILLEGAL_ADDRESS on an H100); Triton cannot convert to
# float8_e8m0fnu or the fnuz float8s, and its conversions to float8 saturate
# (PTX ``cvt .satfinite``) where XLA's give NaN.
_TRITON_READS = frozenset(np.dtype(d) for d in (
    jnp.bool_, jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32, jnp.uint32, jnp.int64,
    jnp.uint64, jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.float8_e4m3fn,
    jnp.float8_e5m2))
_TRITON_WRITES = _TRITON_READS - {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}


def triton_holds(operand_dtypes: Sequence[np.dtype], result_dtypes: Sequence[np.dtype]) -> bool:
  """Whether a Triton kernel can read these operands and write these results exactly.

  Where it cannot, the kernels run their XLA twin on CUDA and ROCm.
  """
  return ({np.dtype(d) for d in operand_dtypes} <= _TRITON_READS
          and {np.dtype(d) for d in result_dtypes} <= _TRITON_WRITES)


@dataclasses.dataclass(frozen=True)
class _Cut:
  """How the shards of one blocked dim lie against its blocks.

  ``shards`` shards of ``length`` elements each over blocks of ``block``.
  Where ``length`` is a multiple of ``block`` every shard holds whole blocks
  (``slots`` is None); otherwise shard ``s`` touches blocks ``first(s)`` to
  ``last(s)``, at most ``slots`` of them.
  """

  shards: int
  length: int
  block: int

  def first(self, s: int) -> int:
    return s * self.length // self.block

  def last(self, s: int) -> int:
    return ((s + 1) * self.length - 1) // self.block

  @property
  def slots(self) -> int | None:
    if self.length % self.block == 0:
      return None
    return max(self.last(s) - self.first(s) + 1 for s in range(self.shards))


@dataclasses.dataclass(frozen=True)
class _Part:
  """The part of a call's output that one kernel call computes.

  Attributes:
    shape: the output's shape there (a shard's, when partitioned).
    blocks, reduced: per dim, as for :func:`_sharded`.
    origins: per dim split over devices with ``blocks > 1``, the shard's first
      index along it (traced) and the :class:`_Cut`; else ``None``.
  """

  shape: tuple[int, ...]
  blocks: tuple[int, ...]
  reduced: tuple[bool, ...]
  origins: tuple[tuple[jax.Array, _Cut] | None, ...]


def _sharded(
    run: Callable[..., tuple[jax.Array, ...]],
    arrays: Sequence[jax.Array],
    logical: Sequence[tuple[int, ...]],
    out_shape: tuple[int, ...],
    *,
    result_count: int,
    per_byte: Sequence[int],
    blocks: Sequence[int] | None = None,
    reduced: Sequence[bool] | None = None,
    combine: Callable[[list[jax.Array], int], tuple[jax.Array, ...]] | None = None,
    fill: float = 0,
) -> tuple[jax.Array, ...]:
  """``run(*arrays, part=...)``, run on each device's shards under ``jax.jit``.

  XLA cannot see into a ``pallas_call``: left to itself it gathers the
  operands and replicates the result. Here the call is a
  ``custom_partitioning`` whose rule (a Shardy einsum) pairs each dim of the
  output with the same dim of every operand that has it, so each dim is split
  the way the data operand is, an operand's broadcast (size-1) and blocked
  dims are replicated (a parameter's size), and every device runs ``run`` on
  its own shards: the kernel built for the local shapes. A dim that does not
  split evenly (or, for a packed operand, into whole bytes) is replicated
  instead: the same bits, at the cost of gathering that dim. On an explicit
  mesh the call is partitioned so too, under ``jax.sharding.auto_axes``, its
  results typed as split here. On one device, inside ``shard_map`` and for
  symbolic shapes the call is ``run`` itself.
  Under ``vmap`` the batch is one more leading dim of every operand (size 1
  where unbatched), partitioned alike.

  A blocked dim ``k`` (``blocks[k] > 1``) may be split anywhere, block edges
  or not: ``run`` is told where its shard starts (``part.origins[k]``) and
  finds each element's block from it. A reduction's
  per-block partial results of a shard whose edges cut blocks come in
  ``cut.slots`` slots, the shard's ``s``-th from block ``cut.first(s)``: the
  slots of every shard (a parameter's size) are gathered and each block's
  combined.

  Args:
    run: the kernel call, a function of arrays of any consistent shapes (of any
      rank) and, by keyword, of the :class:`_Part` it computes.
    arrays: its operands.
    logical: each operand's shape, a packed operand's counted in elements.
    out_shape: the shape the operands broadcast to; every result has it,
      but for the ``reduced`` dims, which are 1 in the results, and, with
      ``combine``, the blocked dims, which count blocks.
    result_count: how many results ``run`` returns.
    per_byte: each operand's elements per byte (1 where not packed).
    blocks: per dim of ``out_shape``, the elements one element of a blocked
      operand covers (an operand of ``ceil(n / blocks[k])`` there); default 1.
    reduced: per dim of ``out_shape``, whether ``run`` reduces it (default none).
    combine: for a reduction, ``combine(partials, axis)`` reduces each result's
      partials (several per parameter: one per shard, or per shard touching a
      block) over ``axis`` and drops it.
    fill: what an empty slot of partials holds (a value ``combine`` ignores).

  Returns:
    ``run(*arrays)``, each result split like the operand it follows.
  """
  rank = len(out_shape)
  reduced = tuple(reduced or (False,) * rank)
  blocks = tuple(blocks or (1,) * rank)
  whole = _Part(tuple(out_shape), blocks, reduced, (None,) * rank)
  if rank == 0 or any(_tiling.symbolic(n) for n in out_shape):
    return run(*arrays, part=whole)
  packing = max(per_byte)
  last = rank - 1
  # Results count blocks along a blocked dim of a reduction.
  counted = tuple(combine is not None and b > 1 for b in blocks)

  def factor(k: int, packed: bool) -> str:
    # A packed last dim counts bytes (d), an unpacked one elements (d p).
    return f"(d{k} p)" if packing > 1 and k == last and not packed else f"d{k}"

  follows = [tuple(shape[k] == n for k, n in enumerate(out_shape)) for shape in logical]
  operands = [
      " ".join(factor(k, count > 1) if follows[i][k] else f"b{i}_{k}" for k in range(rank))
      for i, count in enumerate(per_byte)
  ]
  results = [
      " ".join(f"r{j}_{k}" if reduced[k] or counted[k] else factor(k, False)
               for k in range(rank))
      for j in range(result_count)
  ]
  rule = dict(p=packing, need_replication_factors=("p",)) if packing > 1 else {}

  def split_axes(mesh, arg_shapes) -> list[tuple[str, ...]]:
    """Per dim, the mesh axes it is split over: the first operand's that has it."""
    specs = [mesh_axes(arg.sharding, mesh, arg.shape) for arg in arg_shapes]
    chosen: list[tuple[str, ...]] = []
    for k, n in enumerate(out_shape):
      names: tuple[str, ...] = ()
      for follow, spec in zip(follows, specs):
        if follow[k] and n != 1 and spec is not None:
          names = spec[k]
          break
      shards = math.prod(mesh.shape[a] for a in names)
      whole = packing if k == last else 1
      if n % (shards * whole) or set(names) & {a for c in chosen for a in c}:
        names = ()
      chosen.append(names)
    return chosen

  def cuts(mesh, axes) -> list[_Cut | None]:
    """Per dim, how its shards lie against its blocks (``None``: not blocked, or whole)."""
    return [
        _Cut(math.prod(mesh.shape[a] for a in names), n // math.prod(
            mesh.shape[a] for a in names), b) if b > 1 and names else None
        for n, b, names in zip(out_shape, blocks, axes)
    ]

  def spec(axes, keep) -> PartitionSpec:
    return PartitionSpec(*(
        (a if len(a) > 1 else a[0]) if a and k else None for a, k in zip(axes, keep)))

  def result_shardings(mesh, axes):
    # A reduction's blocks are split with x where shards hold whole blocks.
    keep = [not r and (not c or cut is None or cut.slots is None)
            for r, c, cut in zip(reduced, counted, cuts(mesh, axes))]
    return tuple(NamedSharding(mesh, spec(axes, keep)) for _ in range(result_count))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    axes = split_axes(mesh, arg_shapes)
    split = tuple(a for k, names in enumerate(axes) if reduced[k] for a in names)
    dim_cuts = cuts(mesh, axes)

    shape = tuple(n // math.prod(mesh.shape[a] for a in names)
                  for n, names in zip(out_shape, axes))

    def lower(*local):
      origins = tuple(
          None if cut is None else (_shard_index(mesh, names) * cut.length, cut)
          for cut, names in zip(dim_cuts, axes))
      outputs = run(*local, part=_Part(shape, blocks, reduced, origins))
      if split:
        outputs = combine([lax.all_gather(o, split) for o in outputs], 0)
      for k, cut in enumerate(dim_cuts):
        if counted[k] and cut is not None and cut.slots is not None:
          outputs = _combine_slots(outputs, k, cut, axes[k], out_shape[k], combine, fill)
      return outputs

    return mesh, lower, result_shardings(mesh, axes), tuple(
        NamedSharding(mesh, spec(axes, follow)) for follow in follows)

  partitioned = custom_partitioning(lambda *arrays: run(*arrays, part=whole))
  partitioned.def_partition(
      partition,
      infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: result_shardings(
          mesh, split_axes(mesh, arg_shapes)),
      sharding_rule=f"{', '.join(operands)} -> {', '.join(results)}",
      decode_shardings=False, **rule,
  )
  # custom_partitioning has no batching rule: the batch becomes a leading dim.
  batchable = custom_vmap(lambda *arrays: partitioned(*arrays))

  @batchable.def_vmap
  def _(axis_size, in_batched, *arrays):
    if axis_size == 0:
      return empty_batch(partitioned, arrays, in_batched), (True,) * result_count
    arrays = [a if b else a[None] for a, b in zip(arrays, in_batched)]
    outputs = _sharded(
        run, arrays, [(a.shape[0], *shape) for a, shape in zip(arrays, logical)],
        (axis_size, *out_shape), result_count=result_count, per_byte=per_byte,
        blocks=(1, *blocks), reduced=(False, *reduced), combine=combine, fill=fill)
    return outputs, tuple(True for _ in outputs)

  explicit = [mesh for mesh in (jax.typeof(a).sharding.mesh for a in arrays)
              if mesh.explicit_axes]
  if not explicit:
    return tuple(batchable(*arrays))
  # An explicit mesh types every array the call traces, and the block view's
  # reshapes need not split evenly (12 blocks over 8 devices): the call runs
  # under automatic sharding, partitioned by the rule above, and its results
  # come back typed as that rule splits them.
  mesh = explicit[0]
  out_sharding = result_shardings(mesh, split_axes(mesh, [jax.typeof(a) for a in arrays]))
  with jax.sharding.use_abstract_mesh(mesh):
    return tuple(jax.sharding.auto_axes(batchable, out_sharding=out_sharding)(*arrays))


def empty_batch(function, arrays, in_batched):
  """``vmap(function)``'s results over a batch of none: empty arrays of their shapes.

  A kernel's grid over no rows would have tiles of none, so nothing is run.
  """
  example = [jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
             for a, b in zip(arrays, in_batched)]
  return jax.tree.map(lambda r: jnp.zeros((0, *r.shape), r.dtype),
                      jax.eval_shape(function, *example))


def _shard_index(mesh, names: tuple[str, ...]) -> jax.Array:
  """This device's index among the shards of a dim split over mesh axes ``names``."""
  index = jnp.int32(0)
  for name in names:
    index = index * mesh.shape[name] + lax.axis_index(name)
  return index


def _combine_slots(outputs, k: int, cut: _Cut, names, length: int, combine, fill):
  """Each block's partials from the slots of every shard that touches it, combined.

  Every shard's ``cut.slots`` slots along dim ``k`` are gathered (a
  parameter's size, never x's); block ``b`` reads the slots that cover it
  (at most a few shards), an empty one reading ``fill``.
  """
  count = -(-length // cut.block)
  sources: list[list[int]] = [[] for _ in range(count)]
  slots = cut.slots
  for s in range(cut.shards):
    for j in range(cut.last(s) - cut.first(s) + 1):
      sources[cut.first(s) + j].append(s * slots + j)
  width = max(len(c) for c in sources)
  empty = cut.shards * slots
  table = np.array([c + [empty] * (width - len(c)) for c in sources], np.int32)
  gathered = []
  for output in outputs:
    every = jnp.moveaxis(lax.all_gather(output, names), 0, k)
    every = every.reshape(every.shape[:k] + (empty,) + every.shape[k + 2:])
    pad = [(0, 1 if d == k else 0) for d in range(every.ndim)]
    every = jnp.pad(every, pad, constant_values=np.array(fill, every.dtype))
    gathered.append(jnp.take(every, table, axis=k))
  return combine(gathered, k + 1)


def mesh_axes(sharding: jax.sharding.Sharding, mesh,
              shape: tuple[int, ...]) -> tuple[tuple[str, ...], ...] | None:
  """Per dim of an array of ``shape``, the mesh axes ``sharding`` splits it over, major first.

  A partition callback gets each operand's sharding as XLA's partitioner
  holds it (an ``HloSharding`` wrapped as a ``jax.sharding.Sharding``, no
  mesh axes named). It is matched by public API: each dim's shard count is
  read off the devices' slices, and of the ways to split the dims over
  distinct mesh axes with those counts, the one ``is_equivalent_to`` it is
  taken. ``None`` where none is: Shardy may split a reshaped operand by part
  of an axis (a block-view of x whose shard edges cut blocks), which no
  ``PartitionSpec`` of the mesh names; such an operand is then replicated
  (gathered), which gives the same bits.

  Args:
    sharding: an operand's or a result's sharding, as a partition callback gets it.
    mesh: the mesh the callback gets.
    shape: the array's shape.

  Returns:
    Per dim, the names of the mesh axes it is split over (``()``: whole), or
    ``None`` where no ``PartitionSpec`` of ``mesh`` is equivalent to ``sharding``.
  """
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    return tuple(() if e is None else tuple(e) if isinstance(e, tuple) else (e,) for e in spec)
  # Shard counts are read off a stand-in shape that every count divides: XLA
  # may split a dim unevenly (3 columns over 2 devices), and the devices'
  # slices of the real shape are then undefined. Callers keep even splits only.
  stand_in = (mesh.size,) * len(shape)
  slices = sharding.devices_indices_map(stand_in).values()
  counts = [len({index[k].indices(n)[0] for index in slices}) for k, n in enumerate(stand_in)]
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  splits = [[names for r in range(len(axes) + 1) for names in itertools.permutations(axes, r)
             if math.prod(mesh.shape[a] for a in names) == count] for count in counts]
  for names in itertools.product(*splits):
    used = [a for dim in names for a in dim]
    if len(used) == len(set(used)) and NamedSharding(
        mesh, PartitionSpec(*(dim or None for dim in names))).is_equivalent_to(
            sharding, len(shape)):
      return names
  return None


def _codes(packed: jax.Array, per_byte: int) -> jax.Array:
  """Packed bytes as one code per element: element ``n * i + k`` from bits ``k * 8 // n`` up."""
  bits = 8 // per_byte
  codes = [(packed >> (k * bits)) & ((1 << bits) - 1) for k in range(per_byte)]
  return jnp.stack(codes, axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def _compiler_params(backend: Backend, grid: tuple[int, ...], tile: tuple[int, ...]):
  if backend == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid))
  return pltriton.CompilerParams(
      num_warps=min(8, max(1, math.prod(tile) // 1024)), num_stages=1
  )


def _collapse(
    shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
  """Drops size-1 dims of ``out_shape`` and merges neighbours with equal broadcast patterns.

  Returns:
    The collapsed output shape (at least 1-D) and each operand's shape in it.
  """
  groups: list[tuple[tuple[bool, ...], int]] = []
  for d, length in enumerate(out_shape):
    if length == 1:
      continue
    pattern = tuple(shape[d] != 1 for shape in shapes)
    if groups and groups[-1][0] == pattern:
      groups[-1] = (pattern, groups[-1][1] * length)
    else:
      groups.append((pattern, length))
  if not groups:
    groups = [((False,) * len(shapes), 1)]
  collapsed = tuple(length for _, length in groups)
  return collapsed, [
      tuple(length if pattern[i] else 1 for pattern, length in groups)
      for i in range(len(shapes))
  ]


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Operands collapsed, widened to 2-D and padded to whole tiles.

  Attributes:
    arrays: the laid-out arrays (``None`` for a grouping-only shape).
    shapes: each operand's logical shape in the layout (a packed operand's
      array holds ``1 / per_byte`` of the last dim).
    collapsed: the collapsed output shape, before folding 1-D into rows.
    rows: the output shape the kernel sees before tile padding.
    padded: ``rows`` rounded up to whole tiles.
    tile: the block shape.
  """

  arrays: list[jax.Array | None]
  shapes: list[tuple[int, ...]]
  collapsed: tuple[int, ...]
  rows: tuple[int, ...]
  padded: tuple[int, ...]
  tile: tuple[int, ...]

  @property
  def grid(self) -> tuple[int, ...]:
    return tuple(p // t for p, t in zip(self.padded, self.tile))

  def trim(self, result: jax.Array) -> jax.Array:
    """A result on the padded layout cut back to the collapsed shape (size-1 dims stay 1).

    Tile padding is cut first: a 1-D output folded into rows may have padded
    lanes in every row, not only at the end.
    """
    result = result[tuple(slice(0, n) for n in self.rows)]
    if len(self.collapsed) == 1:
      return result.reshape(-1)[:self.collapsed[0]]
    return result


def _lay_out(
    arrays: Sequence[jax.Array | None],
    logical_shapes: Sequence[tuple[int, ...]],
    out_shape: tuple[int, ...],
    *,
    per_byte: Sequence[int],
    backend: Backend,
    dtypes: Sequence[np.dtype],
    max_block: tuple[int, int] | None,
    pad_value: float,
) -> _Layout:
  """Collapses, widens to 2-D and pads every operand to whole tiles.

  An entry of ``arrays`` may be ``None``: its logical shape then only takes
  part in grouping dims (a reduction's result shape, which tells kept dims
  from reduced ones).
  """
  collapsed, shapes = _collapse(logical_shapes, out_shape)
  rows = collapsed
  # Lanes come in whole bytes of every packed operand.
  lane_multiple = max(per_byte, default=1)
  if len(collapsed) == 1:
    # One dim: fold it into rows of a lane-dense width (padding if need be).
    width = _round_up(_tiling.flat_width(collapsed[0], backend, max_block), lane_multiple)
    rows = (-(-collapsed[0] // width), width)
    shapes = [rows if shape[0] != 1 else (1, 1) for shape in shapes]
    arrays = [
        jnp.pad(a.reshape(-1), (0, (math.prod(rows) - collapsed[0]) // n),
                constant_values=pad_value) if a is not None and shape != (1, 1) else a
        for a, shape, n in zip(arrays, shapes, per_byte)
    ]
  tile = _tiling.tile_shape(rows, dtypes, backend, max_block)
  tile = tile[:-1] + (_round_up(tile[-1], lane_multiple),)
  if backend == "tpu" and lane_multiple > 1 and tile[-1] != rows[-1]:
    # The packed block holds 1 / per_byte of the lanes: keep it a multiple of 128.
    tile = tile[:-1] + (_round_up(tile[-1], lane_multiple * _tiling.LANES),)
  padded = _tiling.padded_shape(rows, tile)
  laid_out = []
  for array, shape, count in zip(arrays, shapes, per_byte):
    if array is not None:
      storage = shape[:-1] + (shape[-1] // count,)
      array = array.reshape(storage)
      target = tuple(p if n != 1 else 1 for p, n in zip(padded, shape))
      target = target[:-1] + (target[-1] // count,)
      if target != storage:
        array = jnp.pad(
            array, [(0, t - n) for t, n in zip(target, storage)], constant_values=pad_value
        )
    laid_out.append(array)
  return _Layout(laid_out, shapes, collapsed, rows, padded, tile)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _block_spec(shape: tuple[int, ...], tile: tuple[int, ...], *, per_byte: int = 1):
  full = tuple(n != 1 for n in shape)
  block = tuple(t if f else 1 for t, f in zip(tile, full))
  block = block[:-1] + (block[-1] // per_byte,)
  return pl.BlockSpec(block, lambda *grid: tuple(g if f else 0 for g, f in zip(grid, full)))


def _split_dim(array: jax.Array, k: int, inner: int) -> jax.Array:
  """Dim ``k`` of ``array`` (a multiple of ``inner`` long) as ``(n // inner, inner)``."""
  n = array.shape[k]
  return array.reshape(array.shape[:k] + (n // inner, inner) + array.shape[k + 1:])


def _unsplit(n, origin) -> bool:
  """A whole dim of at most one element has no blocks to view (a symbolic one may
  have); a shard of one element (``origin`` set) reads its block's value."""
  return origin is None and not _tiling.symbolic(n) and n <= 1


def _pad_dim(array: jax.Array, k: int, extra: int, value: float) -> jax.Array:
  """``array`` with ``extra`` elements of ``value`` after the end of dim ``k``."""
  if not _tiling.symbolic(extra) and extra == 0:
    return array
  return jnp.pad(array, [(0, extra if d == k else 0) for d in range(array.ndim)],
                 constant_values=value)


def _block_view(
    arrays: Sequence[jax.Array],
    logical: Sequence[tuple[int, ...]],
    part: _Part,
    per_byte: Sequence[int],
) -> tuple[list[jax.Array], Callable[[jax.Array], jax.Array]]:
  """Operands where every dim of every operand is the output's or 1, and the way back.

  Each blocked dim ``k`` of ``part.shape``, ``n`` long, becomes ``(n / g, g)``:
  a blocked operand (``ceil(N / block)`` long there, ``N`` the whole dim) is then ``(n / g, 1)``, one
  value per piece of ``g`` elements, which the kernel's index maps broadcast
  without expanding it. A whole dim (``origins[k]`` None) is padded to whole
  blocks and ``g`` is the block, so the blocked operand is as it came. A
  shard of a dim starting at ``part.origins[k][0]`` takes ``g = gcd(block, n)``:
  its pieces never straddle a block edge, so each reads its block's value,
  gathered from the whole (replicated) parameter: its slice where the shard
  holds whole blocks, each value repeated ``block / g`` times where it does
  not, which is x's size only when ``g`` is 1.

  Returns:
    The operands in the view, and a function taking a result on the view
    back to ``part.shape``.
  """
  arrays, logical = list(arrays), [list(s) for s in logical]
  padded = list(part.shape)
  for k in reversed(range(len(part.shape))):
    n, block = part.shape[k], part.blocks[k]
    if block == 1 or _unsplit(n, part.origins[k]):
      continue
    if part.origins[k] is None:
      piece, index = block, None
      padded[k] = -(-n // block) * block
    else:
      start, _ = part.origins[k]
      piece = math.gcd(block, n)
      index = (start + jnp.arange(n // piece, dtype=jnp.int32) * piece) // block
    for i, (array, shape) in enumerate(zip(arrays, logical)):
      if shape[k] == n:
        bytes_here = per_byte[i] if k == len(shape) - 1 else 1
        array = _pad_dim(array, k, (padded[k] - n) // bytes_here, 0)
        arrays[i] = _split_dim(array, k, piece // bytes_here)
        shape[k:k + 1] = [padded[k] // piece, piece]
      else:
        if shape[k] != 1 and index is not None:
          array = jnp.take(array, index, axis=k)
          shape[k] = n // piece
        arrays[i] = array.reshape(array.shape[:k + 1] + (1,) + array.shape[k + 1:])
        shape.insert(k + 1, 1)

  def restore(result: jax.Array) -> jax.Array:
    result = result.reshape(padded)
    return result[tuple(slice(0, n) for n in part.shape)]

  return arrays, restore


def elementwise(
    formula: Callable[..., Sequence[jax.Array]],
    operands: Sequence[jax.Array | None],
    result_dtypes: Sequence[np.dtype],
    *,
    per_byte: Sequence[int] | None = None,
    blocks: Sequence[int] | None = None,
    decode: Callable[[jax.Array], jax.Array] | None = None,
    backend: Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
    name: str = "elementwise",
) -> tuple[jax.Array, ...]:
  """``formula(*operands)`` in one fused Pallas kernel.

  Args:
    formula: maps the operands' blocks (``None`` stays ``None``) to a sequence
      of arrays of ``result_dtypes``; element-wise, broadcasting size-1 dims.
    operands: arrays of one rank; each dim is the output's size, 1, or (a
      blocked operand) the output's size ``n`` in blocks, ``ceil(n / blocks[k])``,
      one value for each block of ``blocks[k]`` elements, the last block
      possibly short (a blocked dim's ``n`` is the first operand's). A packed
      operand holds ``n`` values of ``8 // n`` bits per byte along its last dim
      (ONNX order: element ``n * i + k`` in bits ``k * 8 // n`` upwards), so its
      last dim is the output's divided by ``n``.
    result_dtypes: the dtypes ``formula`` returns.
    per_byte: each operand's ``n``: 1 where it is not packed (the default), 2
      for 4-bit and 4 for 2-bit values.
    blocks: per dim of the output, the elements one value of a blocked operand
      covers there (default 1: no operand is blocked). The operands are viewed
      so that each block is a broadcast (:func:`_block_view`): x is not
      reshaped before the call, so under ``jax.jit`` a shard edge may cut a
      block and each device still computes its own shard alone.
    decode: maps a block of codes (uint8 values ``0 .. 2**(8 // n) - 1``) to
      the values the formula expects; required with a packed operand.
    backend: ``"tpu"`` or ``"triton"``; ``None`` picks per platform when lowered.
    interpret: run in Pallas interpret mode.
    max_block: caps on the tile's (rows, lanes); default per backend.
    name: the kernel's name in profiles.

  Returns:
    The results, each shaped like the broadcast of the (unpacked) operands.
  """
  per_byte = tuple(per_byte or (1,) * len(operands))
  present = [i for i, a in enumerate(operands) if a is not None]
  arrays = [operands[i] for i in present]
  present_per_byte = [per_byte[i] for i in present]

  def logical_shapes(arrays):
    return [a.shape[:-1] + (n * a.shape[-1],) if n > 1 else a.shape
            for a, n in zip(arrays, present_per_byte)]

  logical = logical_shapes(arrays)
  rank = len(logical[0]) if logical else 0
  blocks = tuple(blocks or (1,) * rank)
  out_shape = tuple(
      logical[0][k] if blocks[k] > 1 else jnp.broadcast_shapes(*[(s[k],) for s in logical])[0]
      for k in range(rank))
  if math.prod(out_shape) == 0:
    return tuple(jnp.zeros(out_shape, d) for d in result_dtypes)

  def run(*arrays, part):
    """The kernel on these arrays, whole or (under :func:`_sharded`) one shard of each."""
    arrays, restore = _block_view(arrays, logical_shapes(arrays), part, present_per_byte)
    logical = logical_shapes(arrays)
    out_shape = tuple(jnp.broadcast_shapes(*logical))

    def call(arrays, *, backend, interpret, divide_asm):
      layout = _lay_out(
          arrays, logical, out_shape, per_byte=present_per_byte,
          backend=backend, dtypes=[*(a.dtype for a in arrays), *result_dtypes],
          max_block=max_block, pad_value=0,
      )
      tile, shapes = layout.tile, layout.shapes
      kernel_formula = formula
      if backend == "triton":
        kernel_formula = _exact.exact(formula, divide=divide_asm)
      elif not interpret:
        kernel_formula = _exact.exact(formula, divide=False, rounding=False)
      lanes_per_byte = max(present_per_byte)

      def kernel(*refs):
        in_refs, out_refs = refs[:len(present)], refs[len(present):]
        if lanes_per_byte == 1:
          args = [None] * len(operands)
          for i, ref in zip(present, in_refs):
            args[i] = ref[...]
          for out_ref, result in zip(out_refs, kernel_formula(*args)):
            out_ref[...] = result
          return
        # Element n * j + k sits in bits k * bits.. of byte j: evaluate the k-th
        # elements of every byte together and store them with a lane stride of n.
        bits = 8 // lanes_per_byte
        for k in range(lanes_per_byte):
          lanes = (slice(None),) * (len(tile) - 1) + (
              pl.ds(k, tile[-1] // lanes_per_byte, stride=lanes_per_byte),)
          args = [None] * len(operands)
          for i, ref, shape, n in zip(present, in_refs, shapes, present_per_byte):
            if n > 1:
              args[i] = decode((ref[...] >> (k * bits)) & ((1 << bits) - 1))
            elif shape[-1] != 1:
              args[i] = ref[lanes]
            else:
              args[i] = ref[...]
          for out_ref, result in zip(out_refs, kernel_formula(*args)):
            out_ref[lanes] = result

      results = pl.pallas_call(
          kernel,
          out_shape=[jax.ShapeDtypeStruct(layout.padded, d) for d in result_dtypes],
          grid=layout.grid,
          in_specs=[_block_spec(s, tile, per_byte=n) for s, n in zip(shapes, present_per_byte)],
          out_specs=[_block_spec(layout.padded, tile) for _ in result_dtypes],
          compiler_params=None if interpret else _compiler_params(backend, layout.grid, tile),
          interpret=interpret,
          name=name,
      )(*layout.arrays)
      return tuple(layout.trim(r).reshape(out_shape) for r in results)

    def xla(arrays):
      args = [None] * len(operands)
      for i, array in zip(present, arrays):
        args[i] = decode(_codes(array, per_byte[i])) if per_byte[i] > 1 else array
      return tuple(jnp.broadcast_to(r, out_shape) for r in formula(*args))

    results = _dispatch(call, arrays, backend=backend, interpret=interpret, xla=xla,
                        result_dtypes=result_dtypes)
    return tuple(restore(r) for r in results)

  return _sharded(run, arrays, logical, out_shape, result_count=len(result_dtypes),
                  per_byte=present_per_byte, blocks=blocks)


def reduce(
    reduction: Callable[[jax.Array, tuple[int, ...]], Sequence[jax.Array]],
    x: jax.Array,
    keep: Sequence[bool],
    *,
    blocks: Sequence[int] | None = None,
    pad_value: float,
    backend: Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
    name: str = "reduce",
) -> tuple[jax.Array, ...]:
  """Reduces ``x`` over the dims where ``keep`` is False: one kernel pass over x.

  Each tile is reduced in the kernel to a partial result; the partials (one
  per tile, a small fraction of x) are combined by ``reduction`` again in XLA.
  Tiles never accumulate into a shared output, so there is no cross-program
  race on Triton and no ``arbitrary`` grid axis on TPU.

  Args:
    reduction: ``reduction(block, axes)`` reduces over ``axes`` keeping them as
      size-1 dims; it must be associative (min, max, sum) and ignore ``pad_value``.
    x: the array to reduce.
    keep: per dim of x, whether it is kept (a parameter dim) or reduced.
    blocks: per kept dim of x, how many elements are reduced to one value
      there (windows of that size, the last one possibly short); default 1.
      x is not reshaped before the call, so under ``jax.jit`` a shard edge may
      cut a block: each device reduces its part of the block, and the
      partials of every block (parameter-sized) are gathered and combined.
    pad_value: what padding reads as (for min/max: NaN, when NaN is ignored).
    backend, interpret, max_block, name: as for :func:`elementwise`.

  Returns:
    The reductions, each shaped like x with the reduced dims set to 1 and a
    blocked dim of ``n`` counting blocks, ``ceil(n / blocks[k])``.
  """
  blocks = tuple(blocks or (1,) * x.ndim)
  result_shape = tuple(-(-n // b) if k else 1 for n, k, b in zip(x.shape, keep, blocks))
  result_dtypes = [
      r.dtype for r in jax.eval_shape(lambda x: reduction(x, tuple(range(x.ndim))), x)
  ]
  if x.size == 0:
    # Nothing but padding: what the reduction makes of one padding element.
    padding = jnp.full((1,) * x.ndim, pad_value, x.dtype)
    return tuple(jnp.broadcast_to(r, result_shape)
                 for r in reduction(padding, tuple(range(x.ndim))))

  def run(x, *, part):
    """The kernel on x, whole or (under :func:`_sharded`) one shard of it."""
    x, keep, inner = _reduction_view(x, part, pad_value)
    result_shape = tuple(n if k else 1 for n, k in zip(x.shape, keep))
    # The result without each block's own (reduced) dim.
    blocked_shape = tuple(n for n, i in zip(result_shape, inner) if not i)

    def call(arrays, *, backend, interpret, divide_asm):
      del divide_asm
      # The result's shape marks reduced dims as broadcast, so the collapse
      # merges kept dims with kept dims and reduced with reduced only.
      layout = _lay_out(
          [*arrays, None], [x.shape, result_shape], x.shape, per_byte=[1, 1],
          backend=backend, dtypes=[x.dtype, *result_dtypes], max_block=max_block,
          pad_value=pad_value,
      )
      tile, grid = layout.tile, layout.grid
      kept = [n != 1 for n in layout.shapes[1]]
      rank = len(tile)
      axes = tuple(d for d in range(rank) if not kept[d])
      partial_tile = tuple(t if k else 1 for t, k in zip(tile, kept))

      def kernel(x_ref, *out_refs):
        for out_ref, result in zip(out_refs, reduction(x_ref[...], axes)):
          out_ref[...] = result

      partials = pl.pallas_call(
          kernel,
          out_shape=[jax.ShapeDtypeStruct(grid + partial_tile, d) for d in result_dtypes],
          grid=grid,
          in_specs=[pl.BlockSpec(tile, lambda *g: g)],
          out_specs=[
              pl.BlockSpec((pl.squeezed,) * rank + partial_tile, lambda *g: g + (0,) * rank)
              for _ in result_dtypes
          ],
          compiler_params=None if interpret else _compiler_params(backend, grid, tile),
          interpret=interpret,
          name=name,
      )(layout.arrays[0])
      # Combine the partials over the grid axes of reduced dims: the k-th result
      # is the k-th reduction of the k-th partials (min of the minima, max of the
      # maxima). Then put each kept dim's (tile index, offset in tile) back together.
      order = [a for d in range(rank) for a in (d, rank + d)]
      return tuple(
          layout.trim(reduction(partial, axes)[k].transpose(order).reshape(
              tuple(p if keep else 1 for p, keep in zip(layout.padded, kept)))
          ).reshape(result_shape)
          for k, partial in enumerate(partials)
      )

    def xla(arrays):
      (x,) = arrays
      return tuple(reduction(x, tuple(d for d, k in enumerate(keep) if not k)))

    results = _dispatch(call, [x], backend=backend, interpret=interpret, xla=xla,
                        result_dtypes=result_dtypes)
    return tuple(r.reshape(blocked_shape) for r in results)

  def combine(partials, axis):
    # The k-th result is the k-th reduction of the k-th partials (min of the
    # minima, max of the maxima), as across tiles.
    return tuple(jnp.squeeze(reduction(partial, (axis,))[k], axis)
                 for k, partial in enumerate(partials))

  return _sharded(run, [x], [x.shape], x.shape, result_count=len(result_dtypes), per_byte=[1],
                  blocks=blocks, reduced=tuple(not k for k in keep), combine=combine,
                  fill=pad_value)


def _reduction_view(
    x: jax.Array, part: _Part, pad_value: float
) -> tuple[jax.Array, list[bool], list[bool]]:
  """x with each blocked dim as ``(blocks, block)``, the block's dim reduced.

  A whole dim is padded to whole blocks with ``pad_value``. A shard whose
  edges cut blocks is written into ``cut.slots`` blocks of ``pad_value`` at
  its offset in its first block, so its ``j``-th block holds its part of
  block ``cut.first(s) + j`` (:func:`_combine_slots` puts them together).

  Returns:
    The view, per dim of it whether it is kept, and whether it is a block's own dim.
  """
  keep = [not r for r in part.reduced]
  inner = [False] * x.ndim
  for k in reversed(range(x.ndim)):
    n, block = part.shape[k], part.blocks[k]
    if block == 1 or _unsplit(n, part.origins[k]):
      continue
    if part.origins[k] is None:
      x = _pad_dim(x, k, -(-n // block) * block - n, pad_value)
    elif part.origins[k][1].slots is not None:
      start, cut = part.origins[k]
      buffer = jnp.full(x.shape[:k] + (cut.slots * block,) + x.shape[k + 1:], pad_value,
                        x.dtype)
      x = lax.dynamic_update_slice_in_dim(buffer, x, start % block, axis=k)
    x = _split_dim(x, k, block)
    keep.insert(k + 1, False)
    inner.insert(k + 1, True)
  return x, keep, inner

