"""Fused dequantize: quantized blocks in, float blocks out, scales read per block.

The formula comes from the caller (jaxquant's ``dequantize_formula``), so the
ONNX rules live in one place; this module contributes the layout: scales and
zero points enter the kernel at their own size and broadcast inside a tile,
and sub-byte data may arrive packed (ONNX order, the output of ``jaxquant.pack``:
two 4-bit or four 2-bit values per byte) and is decoded in the kernel, so HBM
holds half a byte per 4-bit weight.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
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
_UNSIGNED = {2: np.dtype(jnp.uint2), 4: np.dtype(jnp.uint4)}


def decode_codes(codes: jax.Array, dtype: np.dtype) -> jax.Array:
  r"""The values of ``bits``-bit codes (uint8 ``0 .. 2**bits - 1``) of ``dtype``.

  .. math::

    \mathrm{int}b(c) = (c \oplus 2^{b-1}) - 2^{b-1}, \qquad \mathrm{uint}b(c) = c

  Arithmetic instead of a bitcast to a sub-byte type, which neither Mosaic nor
  Triton can load from registers: int2 and int4 are two's complement,
  float4_e2m1fn is sign, 2 exponent bits (bias 1) and 1 mantissa bit,
  subnormal at exponent 0.

  Args:
    codes: an integer array of codes of ``dtype``'s width.
    dtype: one of :data:`PACKED_DTYPES` (static).

  Returns:
    int32 values for int2, uint2, int4 and uint4; float32 for float4_e2m1fn.

  Example:
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from pallas_kernels.dequantize import decode_codes
    >>> decode_codes(jnp.arange(4, dtype=jnp.uint8), np.dtype(jnp.int2))
    Array([ 0,  1, -2, -1], dtype=int32)
  """
  codes = codes.astype(jnp.int32)
  if dtype != np.dtype(jnp.float4_e2m1fn):
    if jnp.iinfo(dtype).min == 0:
      return codes
    sign = 1 << (PACKED_DTYPES[dtype] - 1)
    return (codes ^ sign) - sign
  exponent, mantissa = (codes >> 1) & 3, (codes & 1).astype(jnp.float32)
  magnitude = jnp.where(
      exponent == 0, mantissa * 0.5,
      (2 + mantissa) * (1 << exponent).astype(jnp.float32) * 0.25,
  )
  return jnp.where(codes >= 8, -magnitude, magnitude)


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
    scale: same rank as x (as unpacked); each dim x's size or 1.
    zero_point: like ``scale``, or ``None`` (passed to ``formula`` as ``None``).
    formula: the element-wise dequantization ``formula(x, scale, zero_point)``,
      written in ``jnp``; it sees blocks of the operands, broadcast NumPy-style.
    output_dtype: what ``formula`` returns.
    packed_dtype: int2, uint2, int4, uint4 or float4_e2m1fn when ``x`` is
      packed (static); ``formula`` then sees x's values decoded to int32
      (int2, uint2, int4, uint4) or float32 (float4_e2m1fn).
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
      decode=(lambda codes: decode_codes(codes, np.dtype(packed_dtype))) if packed else None,
      backend=backend, interpret=interpret, max_block=max_block, name="dequantize",
  )
  return y


def dequantize_reference(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    formula: Formula,
    output_dtype: np.dtype,
    packed_dtype: np.dtype | None = None,
) -> jax.Array:
  r"""The pure-XLA twin of :func:`dequantize`: the same result, without Pallas.

  .. math::

    y = \mathrm{formula}(x, \mathrm{scale}, \mathrm{zero\_point})

  with NumPy broadcasting, cast to ``output_dtype``; packed bytes are unpacked
  first by a bitcast to ``packed_dtype`` (lowest bits first), which is the
  dtype ``formula`` then sees. The kernel tests compare against it bit for bit.

  Args:
    x, scale, zero_point, formula, output_dtype, packed_dtype: as for
      :func:`dequantize`.

  Returns:
    The dequantized array of ``output_dtype``, shaped like the (unpacked) x.

  Raises:
    ValueError: from ``jnp`` inside ``formula`` for shapes that do not
      broadcast. Nothing is checked here: the caller validates.

  Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels
    >>> def formula(x, scale, zero_point):
    ...   return x.astype(jnp.float32) * scale
    >>> packed = jnp.array([[0x21, 0x43]], jnp.uint8)  # uint4 1, 2, 3, 4
    >>> args = (packed, jnp.full((1, 1), 0.5), None)
    >>> options = dict(formula=formula, output_dtype=jnp.float32,
    ...                packed_dtype=jnp.uint4)
    >>> y = pallas_kernels.dequantize_reference(*args, **options)
    >>> y
    Array([[0.5, 1. , 1.5, 2. ]], dtype=float32)
    >>> bool(jnp.array_equal(
    ...     y, pallas_kernels.dequantize(*args, **options, interpret=True)))
    True
    >>> packed = jnp.array([[0b11_10_01_00]], jnp.uint8)  # int2 0, 1, -2, -1
    >>> pallas_kernels.dequantize_reference(
    ...     packed, jnp.full((1, 1), 0.5), None, formula=formula,
    ...     output_dtype=jnp.float32, packed_dtype=jnp.int2)
    Array([[ 0. ,  0.5, -1. , -0.5]], dtype=float32)
  """
  if packed_dtype is not None:
    bits = PACKED_DTYPES[np.dtype(packed_dtype)]
    codes = lax.bitcast_convert_type(x, _UNSIGNED[bits])  # (..., n, 8 // bits): low bits first
    x = lax.bitcast_convert_type(
        codes.reshape(*x.shape[:-1], (8 // bits) * x.shape[-1]), packed_dtype
    )
  return formula(x, scale, zero_point).astype(output_dtype)
