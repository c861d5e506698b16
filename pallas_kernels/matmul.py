"""Weight-only quantized matmul: packed weights dequantized in VMEM/SRAM next to the dot.

``y = x @ W.T`` where ``W`` (N, K) is stored as packed codes (two 4-bit or
four 2-bit per byte, LSB first, or one 8-bit) with one scale and zero point
per block of ``block_size`` along K. Each program loads an (N-tile, K) strip
of packed bytes and its (N-tile, K / block_size) scales, decodes and
dequantizes them on chip with the caller's formula (jaxquant's
``dequantize_formula``), and feeds the float tile to the MXU / tensor cores:
the float weight never exists in HBM, which holds half a byte per 4-bit
weight. Mosaic's programs take K whole, so each output element is one dot
over all of K, the same sum as jaxquant's XLA path (``matmul_nbits``);
Triton's step through K (:class:`Tiling`), in one range of it or in several
programs' ranges whose partial sums are added after the kernel: the same
products, summed in another order.

Under ``jax.jit`` with sharded operands the call is partitioned
(:func:`_partitioned`): each device runs the kernel on its rows of x and its
N rows of the weight, K whole.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
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

from pallas_kernels import _blockwise
from pallas_kernels import _platforms
from pallas_kernels import _tiling

Formula = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# dot_general's dimension numbers for x (M, K) against W (N, K).
_TRANSPOSED_RHS = (((1,), (1,)), ((), ()))


def _expand(blocks: jax.Array, block_size: int) -> jax.Array:
  """(rows, K / block_size) per-block values as (rows, K): each repeated ``block_size`` times."""
  rows, count = blocks.shape
  return jnp.broadcast_to(blocks[:, :, None], (rows, count, block_size)).reshape(
      rows, count * block_size)


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
  """Packed bytes as uint8 codes, one per element, LSB first: (..., n) -> (..., 8 n / bits).

  The width halves until it is ``bits``; each step interleaves the two halves
  with a two-operand stack, the only one Triton lowers (and XLA:CPU fuses into
  its consumer, where a sub-byte array would be materialized).

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.matmul import unpack_codes
    >>> unpack_codes(jnp.array([0x21, 0xE4], jnp.uint8), 2)
    Array([1, 0, 2, 0, 0, 1, 2, 3], dtype=uint8)
  """
  codes, width = packed, 8
  while width > bits:
    width //= 2
    low, high = codes & ((1 << width) - 1), codes >> width
    codes = jnp.stack([low, high], axis=-1).reshape(codes.shape[:-1] + (2 * codes.shape[-1],))
  return codes


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How one program covers y: ``m`` rows of x, ``n`` rows of the weight, K ``k`` at a time.

  ``k=None``: all of K in one dot (Mosaic: the strip fits VMEM). Triton
  tiles are powers of two and ``k`` a multiple of the block size: the
  program loops over K, loading and dequantizing one (n, k) tile of the
  weight per step into registers, and sums the steps' products in float32.
  ``m`` below 16 (``tl.dot``'s least) multiplies and sums on the CUDA cores
  instead of padding x's rows to 16. ``split`` cuts K into that many equal
  ranges, each a program of its own (a third grid dim), whose partial sums
  are added after the kernel: at few rows of x, ``N / n`` programs would
  each walk all of K in sequence.
  """

  m: int
  n: int
  k: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  split: int = 1


def tiling(m: int, n: int, k: int, block_size: int, backend: str) -> Tiling:
  """The default tiling for x (m, K) against a weight (n, K) on ``backend``."""
  if backend == "triton":
    # Powers of two, at least 16 per dim for tl.dot; K in steps of 64 or
    # the block size, whichever is larger, or of the largest power of two that
    # divides K (a whole number of blocks: K is a multiple of the block size).
    # On an H100 (benchmarks/kernels.py --sweep, K = N = 4096) 32 weight rows
    # by 64 of K ran 10-15x faster than 64 by 256 for 1-128 rows of x: the
    # decoded tile stays small.
    pow2 = lambda d, cap: min(max(16, 1 << max(d - 1, 0).bit_length()), cap)
    return Tiling(m=pow2(m, 64), n=pow2(n, 32), k=min(max(64, block_size), k & -k))
  return Tiling(m=m if m <= 256 else 256, n=next((t for t in (256, 128) if n % t == 0), n))


def dequantize_matmul(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    zero_points: jax.Array,
    *,
    formula: Formula,
    block_size: int,
    bits: int,
    backend: str | None = None,
    interpret: bool = False,
    tiles: Tiling | None = None,
) -> jax.Array:
  r"""``x @ formula(decode(packed), scales, zero_points).T`` in one Pallas kernel.

  .. math::

    y_{mn} = \sum_k x_{mk} \, f\left(q_{nk}, s_{n, \lfloor k / b \rfloor},
             z_{n, \lfloor k / b \rfloor}\right)

  with :math:`q` the ``bits``-bit codes unpacked from ``packed`` and
  :math:`f` the caller's dequantization formula, in float32 at full
  precision.

  Under ``jax.jit`` each device computes its block of y from its rows of x
  and of the weight (x split along its leading dims, the weight along N);
  K is never split (:func:`_partitioned`).

  Args:
    x: float32 activations (..., K).
    packed: uint8 (N, K * bits / 8): each row's codes, LSB first.
    scales: (N, K / block_size).
    zero_points: uint8 codes (N, K / block_size).
    formula: ``formula(codes, scales, zero_points)`` -> float32 weights, on
      (N-tile, K) blocks.
    block_size: the weights' block length along K; divides K.
    bits: 2, 4 or 8.
    backend: ``"tpu"`` (Mosaic) or ``"triton"``; ``None`` picks per platform
      when the call is lowered (interpret mode on CPU).
    interpret: run in Pallas interpret mode on every platform.
    tiles: the programs' tiling; ``None``: :func:`tiling`'s default for the
      platform.

  Returns:
    float32 (..., N).

  Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels
    >>> def formula(codes, scales, zero_points):
    ...   return (codes.astype(jnp.int32) - zero_points).astype(jnp.float32) * scales
    >>> packed = jnp.full((2, 8), 0x19, jnp.uint8)        # codes 9, 1, 9, 1, ...
    >>> scales = jnp.array([[1.0], [0.5]])
    >>> pallas_kernels.dequantize_matmul(
    ...     jnp.ones((1, 16)), packed, scales, jnp.full((2, 1), 8, jnp.uint8),
    ...     formula=formula, block_size=16, bits=4, interpret=True)
    Array([[-48., -24.]], dtype=float32)
  """
  options = dict(formula=formula, block_size=block_size, bits=bits, tiles=tiles)

  def kernel(x, packed, scales, zero_points):
    """The kernel on these arrays: whole, or one device's shards of them."""
    rows = x.reshape(-1, x.shape[-1])
    if backend is not None:
      y = _call(rows, packed, scales, zero_points, backend=backend, interpret=interpret,
                **options)
    else:
      def on(backend, *, interpret):
        return lambda *arrays: [_call(*arrays, backend=backend, interpret=interpret, **options)]

      (y,) = _platforms.per_platform(
          (rows, packed, scales, zero_points), tpu=on("tpu", interpret=interpret),
          cuda=on("triton", interpret=interpret), default=on("tpu", interpret=True),
      )
    return y.reshape(x.shape[:-1] + (packed.shape[0],))

  return _partitioned(kernel, x, packed, scales, zero_points)


def _partitioned(kernel: Callable[..., jax.Array], x: jax.Array,
                 *weight: jax.Array) -> jax.Array:
  """``kernel(x, *weight)``, run on each device's shards under ``jax.jit``.

  XLA cannot see into a ``pallas_call`` and would gather its operands. The
  call is a ``custom_partitioning`` whose Shardy rule pairs x's leading dims
  and the weight's N (``packed``, ``scales`` and ``zero_points`` alike) with
  the result's; each device runs ``kernel`` on its rows of x and its rows of
  the weight and returns its block of the result. K, the contracted dim, is
  whole on every device: split, each device would sum a part of every output
  and the float partials, added across devices, would round differently from
  one device's dot, so an x split along K is gathered along K instead. A dim
  that does not split evenly is replicated (gathered) too. On one device,
  inside ``shard_map`` and for symbolic shapes the call is ``kernel`` itself.
  Under ``vmap`` a batched x is more rows; a batched weight runs the kernel's
  own batching rule, unpartitioned.

  Args:
    kernel: the kernel call, a function of x (..., K) and the weight's arrays
      (each (N, ...)) of any consistent shapes, returning (..., N).
    x: the activations.
    *weight: the packed weight, its scales and its zero points.

  Returns:
    ``kernel(x, *weight)``, split along x's leading dims as x is and along N
    as the weight is.
  """
  if any(_tiling.symbolic(n) for a in (x, *weight) for n in a.shape):
    return kernel(x, *weight)
  out_shape = (*x.shape[:-1], weight[0].shape[0])

  def decode(mesh, arg) -> tuple[tuple[str, ...], ...]:
    """Per dim of ``arg``, the mesh axes its sharding splits it over."""
    return _blockwise.mesh_axes(arg.sharding, mesh, arg.shape) or ((),) * len(arg.shape)

  def even(mesh, per_dim) -> list[tuple[str, ...]]:
    """Per dim of the result, its axes where it splits evenly over axes no earlier dim has."""
    kept: list[tuple[str, ...]] = []
    for length, names in zip(out_shape, per_dim):
      taken = {a for k in kept for a in k}
      fits = length % math.prod(mesh.shape[a] for a in names) == 0
      kept.append(names if fits and not set(names) & taken else ())
    return kept

  def spec(*per_dim) -> PartitionSpec:
    return PartitionSpec(*(names or None for names in per_dim))

  def infer(mesh, arg_shapes, result_shape):
    # x's leading dims as x is split, N as the packed weight is.
    del result_shape
    x_axes, weight_axes = decode(mesh, arg_shapes[0]), decode(mesh, arg_shapes[1])
    return NamedSharding(mesh, spec(*even(mesh, [*x_axes[:-1], weight_axes[0]])))

  def partition(mesh, arg_shapes, result_shape):
    # The result's sharding, as propagation chose it; the operands follow.
    del arg_shapes
    *rows, columns = even(mesh, decode(mesh, result_shape))
    return mesh, kernel, NamedSharding(mesh, spec(*rows, columns)), (
        NamedSharding(mesh, spec(*rows, ())),
        *(NamedSharding(mesh, spec(columns, ())) for _ in weight))

  partitioned = custom_partitioning(kernel)
  leading = " ".join(f"m{d}" for d in range(x.ndim - 1))
  partitioned.def_partition(
      partition, infer_sharding_from_operands=infer,
      sharding_rule=f"{leading} k, n j, n b, n b -> {leading} n",
      need_replication_factors=("k", "j", "b"), decode_shardings=False,
  )
  batchable = custom_vmap(partitioned)

  @batchable.def_vmap
  def _(axis_size, in_batched, x, *weight):
    if axis_size == 0:
      return _blockwise.empty_batch(kernel, (x, *weight), in_batched), True
    if any(in_batched[1:]):
      return jax.vmap(kernel, in_axes=[0 if b else None for b in in_batched])(x, *weight), True
    return _partitioned(kernel, x, *weight), True

  return batchable(x, *weight)


def _call(x, packed, scales, zero_points, *, formula, block_size, bits, backend, interpret,
          tiles):
  (m, k), n = x.shape, packed.shape[0]
  per_byte = 8 // bits
  tiles = tiles or tiling(m, n, k, block_size, backend)
  depth = k // tiles.split  # each program's range of K
  step = tiles.k or depth
  if depth * tiles.split != k or depth % step or step % block_size:
    raise ValueError(f"{tiles} does not cut K = {k} into whole blocks of {block_size}")
  padded_m, padded_n = -(-m // tiles.m) * tiles.m, -(-n // tiles.n) * tiles.n
  x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
  packed, scales, zero_points = (
      jnp.pad(a, ((0, padded_n - n), (0, 0))) for a in (packed, scales, zero_points))

  def product(x_ref, packed_ref, scales_ref, zero_points_ref, start):
    """x's columns [start, start + step) against the weight's, dequantized here."""
    codes = unpack_codes(packed_ref[:, pl.ds(start // per_byte, step // per_byte)], bits)
    blocks = pl.ds(start // block_size, step // block_size)
    weight = formula(codes, _expand(scales_ref[:, blocks], block_size),
                     _expand(zero_points_ref[:, blocks], block_size))
    rows = x_ref[:, pl.ds(start, step)]
    if tiles.m < 16 and backend == "triton":
      # Fewer rows than tl.dot takes: products and their sum on the CUDA cores.
      return jnp.sum(rows[:, None, :] * weight[None, :, :], axis=2)
    return lax.dot_general(
        rows, weight, _TRANSPOSED_RHS,
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )

  def kernel(*refs):
    *operands, y_ref = refs
    if step == depth:
      total = product(*operands, 0)
    else:
      # The steps' partial products, summed in order from the range's start.
      total = lax.fori_loop(
          0, depth // step, lambda i, total: total + product(*operands, i * step),
          jnp.zeros((tiles.m, tiles.n), jnp.float32),
      )
    y_ref[0] = total

  blocks = depth // block_size
  if interpret:
    compiler_params = None
  elif backend == "tpu":
    compiler_params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)
  else:
    compiler_params = pltriton.CompilerParams(num_warps=tiles.num_warps,
                                              num_stages=tiles.num_stages)
  # Grid (rows of x, rows of the weight, ranges of K); each program reads its range of K.
  partial_sums = pl.pallas_call(
      kernel,
      grid=(padded_m // tiles.m, padded_n // tiles.n, tiles.split),
      in_specs=[
          pl.BlockSpec((tiles.m, depth), lambda i, j, r: (i, r)),
          pl.BlockSpec((tiles.n, depth // per_byte), lambda i, j, r: (j, r)),
          pl.BlockSpec((tiles.n, blocks), lambda i, j, r: (j, r)),
          pl.BlockSpec((tiles.n, blocks), lambda i, j, r: (j, r)),
      ],
      out_specs=pl.BlockSpec((1, tiles.m, tiles.n), lambda i, j, r: (r, i, j)),
      out_shape=jax.ShapeDtypeStruct((tiles.split, padded_m, padded_n), jnp.float32),
      compiler_params=compiler_params,
      interpret=interpret,
      name="dequantize_matmul",
  )(x, packed, scales, zero_points)
  y = partial_sums[0]
  for partial in partial_sums[1:]:  # in K's order
    y = y + partial
  return y[:m, :n]
