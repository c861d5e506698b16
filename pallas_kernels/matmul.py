"""Weight-only quantized matmul: packed weights dequantized in VMEM/SRAM next to the dot.

``y = x @ W.T`` where ``W`` (N, K) is stored as packed codes (two 4-bit or
four 2-bit per byte, LSB first, or one 8-bit) with one scale and zero point
per block of ``block_size`` along K. Each program loads an (N-tile, K) strip
of packed bytes and its (N-tile, K / block_size) scales, decodes and
dequantizes them on chip with the caller's formula (jaxquant's
``dequantize_formula``), and feeds the float tile to the MXU / tensor cores:
the float weight never exists in HBM, which holds half a byte per 4-bit
weight. K is whole in every program, so each output element is one dot
over all of K, the same sum as the XLA twin's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from pallas_kernels import _platforms

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


def _tiles(m: int, n: int, backend: str) -> tuple[int, int]:
  """(M, N) tiles: whole dims when small, else 256 rows and 256 / 128 columns dividing N."""
  if backend == "triton":
    # Triton blocks are powers of two, and tl.dot wants at least 16 per dim.
    tile_m = min(max(16, 1 << max(m - 1, 0).bit_length()), 64)
    tile_n = min(max(16, 1 << max(n - 1, 0).bit_length()), 64)
    return tile_m, tile_n
  tile_m = m if m <= 256 else 256
  tile_n = next((t for t in (256, 128) if n % t == 0), n)
  return tile_m, tile_n


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
) -> jax.Array:
  r"""``x @ formula(decode(packed), scales, zero_points).T`` in one Pallas kernel.

  .. math::

    y_{mn} = \sum_k x_{mk} \, f\left(q_{nk}, s_{n, \lfloor k / b \rfloor},
             z_{n, \lfloor k / b \rfloor}\right)

  with :math:`q` the ``bits``-bit codes unpacked from ``packed`` and
  :math:`f` the caller's dequantization formula, in float32 at full
  precision.

  Args:
    x: float32 activations (M, K).
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

  Returns:
    float32 (M, N).

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
  arrays = (x, packed, scales, zero_points)
  options = dict(formula=formula, block_size=block_size, bits=bits)
  if backend is not None:
    return _call(*arrays, backend=backend, interpret=interpret, **options)

  def on(backend, *, interpret):
    return lambda *arrays: [_call(*arrays, backend=backend, interpret=interpret, **options)]

  (y,) = _platforms.per_platform(
      arrays, tpu=on("tpu", interpret=interpret), cuda=on("triton", interpret=interpret),
      default=on("tpu", interpret=True),
  )
  return y


def _call(x, packed, scales, zero_points, *, formula, block_size, bits, backend, interpret):
  (m, k), n = x.shape, packed.shape[0]
  per_byte = 8 // bits
  tile_m, tile_n = _tiles(m, n, backend)
  padded_m, padded_n = -(-m // tile_m) * tile_m, -(-n // tile_n) * tile_n
  x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
  packed, scales, zero_points = (
      jnp.pad(a, ((0, padded_n - n), (0, 0))) for a in (packed, scales, zero_points))

  def kernel(x_ref, packed_ref, scales_ref, zero_points_ref, y_ref):
    codes = unpack_codes(packed_ref[...], bits)
    weight = formula(codes, _expand(scales_ref[...], block_size),
                     _expand(zero_points_ref[...], block_size))
    y_ref[...] = lax.dot_general(
        x_ref[...], weight, _TRANSPOSED_RHS, precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )

  blocks = k // block_size
  if interpret:
    compiler_params = None
  elif backend == "tpu":
    compiler_params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  else:
    compiler_params = pltriton.CompilerParams(num_warps=4, num_stages=1)
  y = pl.pallas_call(
      kernel,
      grid=(padded_m // tile_m, padded_n // tile_n),
      in_specs=[
          pl.BlockSpec((tile_m, k), lambda i, j: (i, 0)),
          pl.BlockSpec((tile_n, k // per_byte), lambda i, j: (j, 0)),
          pl.BlockSpec((tile_n, blocks), lambda i, j: (j, 0)),
          pl.BlockSpec((tile_n, blocks), lambda i, j: (j, 0)),
      ],
      out_specs=pl.BlockSpec((tile_m, tile_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((padded_m, padded_n), jnp.float32),
      compiler_params=compiler_params,
      interpret=interpret,
      name="dequantize_matmul",
  )(x, packed, scales, zero_points)
  return y[:m, :n]


def dequantize_matmul_reference(
    x: jax.Array,
    packed: jax.Array,
    scales: jax.Array,
    zero_points: jax.Array,
    *,
    formula: Formula,
    block_size: int,
    bits: int,
) -> jax.Array:
  r"""The pure-XLA twin of :func:`dequantize_matmul`: the weight dequantized in HBM, then a dot.

  .. math::

    y = x \, f(q, s, z)^\top

  Args:
    x, packed, scales, zero_points, formula, block_size, bits: as for
      :func:`dequantize_matmul`.

  Returns:
    float32 (M, N).

  Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels
    >>> def formula(codes, scales, zero_points):
    ...   return (codes.astype(jnp.int32) - zero_points).astype(jnp.float32) * scales
    >>> pallas_kernels.dequantize_matmul_reference(
    ...     jnp.ones((1, 16)), jnp.full((2, 8), 0x19, jnp.uint8), jnp.array([[1.0], [0.5]]),
    ...     jnp.full((2, 1), 8, jnp.uint8), formula=formula, block_size=16, bits=4)
    Array([[-48., -24.]], dtype=float32)
  """
  codes = unpack_codes(packed, bits)
  weight = formula(codes, _expand(scales, block_size), _expand(zero_points, block_size))
  return lax.dot_general(x, weight, _TRANSPOSED_RHS, precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
