"""Fused dequantize: quantized blocks in, float blocks out, scales read per block.

The formula comes from the caller (jaxquant's ``dequantize_formula``), so the
ONNX rules live in one place; this module contributes the layout: scales and
zero points enter the kernel at their own size and broadcast inside a tile,
and sub-byte data may arrive packed (ONNX order, the output of ``jaxquant.pack``:
two 4-bit or four 2-bit values per byte) and is decoded in the kernel, so HBM
holds half a byte per 4-bit weight. float6, which XLA cannot hold, arrives as
uint8 codes, one per byte (its packed codes straddle bytes, so jaxquant unpacks
them first), and the formula decodes them with :func:`decode_codes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _blockwise

Formula = Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]
# The dtypes that may arrive packed, and their bits per element (the kernels
# never import jaxquant, so this is not its dtype table).
PACKED_DTYPES = {
    np.dtype(jnp.int2): 2, np.dtype(jnp.uint2): 2,
    np.dtype(jnp.int4): 4, np.dtype(jnp.uint4): 4, np.dtype(jnp.float4_e2m1fn): 4,
}
# The unsigned dtype of each width, for the XLA twin's bitcasts.


def decode_codes(codes: jax.Array, dtype: np.dtype) -> jax.Array:
  r"""The values of ``bits``-bit codes (uint8 ``0 .. 2**bits - 1``) of ``dtype``.

  .. math::

    \mathrm{int}b(c) = (c \oplus 2^{b-1}) - 2^{b-1}, \qquad \mathrm{uint}b(c) = c,

    \mathrm{float}(c) = (-1)^s \cdot
      \begin{cases}
        m \cdot 2^{1 - \beta - p} & e = 0 \\
        (2^p + m) \cdot 2^{e - \beta - p} & e > 0
      \end{cases}

  where a float code holds the sign :math:`s`, then the exponent field
  :math:`e`, then :math:`p` mantissa bits :math:`m`, and :math:`\beta` is the
  exponent bias. Arithmetic instead of a bitcast to a sub-byte type, which
  neither Mosaic nor Triton can load from registers (and XLA has no float6
  type at all): int2 and int4 are two's complement; the floats have no inf
  or NaN, so every code is a number: float4_e2m1fn (:math:`p = 1`, bias 1),
  float6_e2m3fn (:math:`p = 3`, bias 1), float6_e3m2fn (:math:`p = 2`, bias 3),
  all with subnormals at :math:`e = 0` and a -0.0 code. Every product is of
  small integers and powers of two, so the float32 result is exact.

  Args:
    codes: an integer array of codes of ``dtype``'s width (bits above it must
      be 0).
    dtype: one of :data:`PACKED_DTYPES`, float6_e2m3fn or float6_e3m2fn (static).

  Returns:
    int32 values for int2, uint2, int4 and uint4; float32 for the float types.

  Example:
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from pallas_kernels.dequantize import decode_codes
    >>> decode_codes(jnp.arange(4, dtype=jnp.uint8), np.dtype(jnp.int2))
    Array([ 0,  1, -2, -1], dtype=int32)
    >>> decode_codes(jnp.array([1, 9, 31, 32], jnp.uint8), np.dtype(jnp.float6_e2m3fn))
    Array([ 0.125,  1.125,  7.5  , -0.   ], dtype=float32)
  """
  codes = codes.astype(jnp.int32)
  if jnp.issubdtype(dtype, jnp.integer):
    if jnp.iinfo(dtype).min == 0:
      return codes
    sign = 1 << (PACKED_DTYPES[dtype] - 1)
    return (codes ^ sign) - sign
  info = jnp.finfo(dtype)
  mantissa_bits, bias = info.nmant, 1 - info.minexp
  exponent = (codes >> mantissa_bits) & ((1 << info.nexp) - 1)
  mantissa = (codes & ((1 << mantissa_bits) - 1)).astype(jnp.float32)
  # In units of the subnormal step 2**(1 - bias - p): m for subnormals,
  # (2**p + m) * 2**(e - 1) for normal numbers.
  units = jnp.where(
      exponent == 0, mantissa,
      (2**mantissa_bits + mantissa)
      * (1 << jnp.maximum(exponent - 1, 0)).astype(jnp.float32),
  )
  magnitude = units * np.float32(2.0 ** (1 - bias - mantissa_bits))
  return jnp.where(codes >= 1 << (info.bits - 1), -magnitude, magnitude)


def decode_nibbles(nibbles: jax.Array, dtype: np.dtype) -> jax.Array:
  """The values of 4-bit codes (uint8 0..15) of ``dtype``: :func:`decode_codes`, 4-bit only.

  Args:
    nibbles: an integer array of 4-bit codes.
    dtype: int4, uint4 or float4_e2m1fn (static).

  Returns:
    int32 values for int4 and uint4; float32 for float4_e2m1fn.
  """
  return decode_codes(nibbles, np.dtype(dtype))


def dequantize(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    formula: Formula,
    output_dtype: np.dtype,
    packed_dtype: np.dtype | None = None,
    blocks: Sequence[int] | None = None,
    backend: _blockwise.Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
) -> jax.Array:
  r"""Dequantizes ``x`` with the caller's ``formula``, in one fused Pallas kernel.

  .. math::

    y_i = \mathrm{formula}\left(x_i, \mathrm{scale}_{\pi(i)},
        \mathrm{zero\_point}_{\pi(i)}\right)

  element-wise, where :math:`\pi(i)_d = i_d` along the dims where ``scale``
  (and ``zero_point``) have x's size and 0 where they have size 1: the block
  index maps read a size-1 dim through block index 0, so a per-channel or
  per-block scale is loaded once per tile and never expanded in HBM.
  jaxquant passes its ``dequantize_formula`` (:func:`jaxquant.dequantize_linear`
  with ``implementation="pallas"``). With ``packed_dtype`` of :math:`b` bits,
  each byte of ``x`` holds :math:`n = 8 / b` values along the last dim, the
  first in the lowest bits (ONNX order, :func:`jaxquant.pack`); the kernel
  reads the bytes as they are and decodes them with :func:`decode_codes`.

  Args:
    x: quantized values; or, with ``packed_dtype``, uint8 bytes holding
      ``8 // bits`` values each along the last dim (which is the output's
      divided by ``8 // bits``).
    scale: same rank as x (as unpacked); each dim x's size ``n``, 1, or
      ``ceil(n / blocks[k])`` (one scale per block of ``blocks[k]`` elements,
      the last possibly short; a block of packed x holds whole bytes).
    zero_point: like ``scale``, or ``None`` (passed to ``formula`` as ``None``).
    formula: the element-wise dequantization ``formula(x, scale, zero_point)``,
      written in ``jnp``; it sees blocks of the operands, broadcast NumPy-style.
    output_dtype: what ``formula`` returns.
    packed_dtype: int2, uint2, int4, uint4 or float4_e2m1fn when ``x`` is
      packed (static); ``formula`` then sees x's values decoded to int32
      (int2, uint2, int4, uint4) or float32 (float4_e2m1fn).
    blocks: per dim of x, the elements one parameter value covers (default 1).
    backend: ``"tpu"`` (Mosaic) or ``"triton"``; ``None`` picks per platform
      when the call is lowered (interpret mode on CPU).
    interpret: run in Pallas interpret mode on every platform.
    max_block: caps on the tile's (rows, lanes); default per backend.

  Returns:
    The dequantized array of ``output_dtype``, shaped like the (unpacked) x.

  Raises:
    TypeError: from JAX (typically a reshape) for operands outside the
      contract above. The kernel checks nothing itself: its caller,
      :func:`jaxquant.dequantize_linear`, validates dtypes and shapes.

  Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels
    >>> def formula(x, scale, zero_point):
    ...   return (x.astype(jnp.float32) - zero_point.astype(jnp.float32)) * scale
    >>> x = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int8)
    >>> scale = jnp.array([[0.5], [2.0]])  # one scale per row
    >>> zero_point = jnp.array([[1], [4]], jnp.int8)
    >>> pallas_kernels.dequantize(x, scale, zero_point, formula=formula,
    ...                           output_dtype=jnp.float32, interpret=True)
    Array([[-0.5,  0. ,  0.5,  1. ],
           [ 0. ,  2. ,  4. ,  6. ]], dtype=float32)
  """
  packed = packed_dtype is not None
  per_byte = 8 // PACKED_DTYPES[np.dtype(packed_dtype)] if packed else 1
  (y,) = _blockwise.elementwise(
      lambda *args: (formula(*args),),
      [x, scale, zero_point],
      [output_dtype],
      per_byte=(per_byte, 1, 1),
      blocks=blocks,
      decode=(lambda codes: decode_codes(codes, np.dtype(packed_dtype))) if packed else None,
      backend=backend, interpret=interpret, max_block=max_block, name="dequantize",
  )
  return y
