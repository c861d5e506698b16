"""Sub-byte values packed into bytes, in the ONNX TensorProto raw layout.

A dtype of ``bits < 8`` bits (from the dtype table: int2 and uint2 take 2,
int4, uint4 and float4_e2m1fn 4) stores ``8 // bits`` elements per byte.
Element ``k`` of the flattened array sits in byte ``k // (8 // bits)`` at bit
``bits * (k % (8 // bits))``: the first element in the lowest bits. A last
byte that is not full holds zero bits above its elements. These are the bytes
``onnx.numpy_helper.from_array`` writes to ``raw_data`` (its ``_pack_2bitx4``
and ``_pack_4bitx2``); ``docs/numerics.md`` states the contract.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _dtypes
from jaxquant import _validate

# The dtype table's rows stored below a byte, in the table's order.
_SUB_BYTE = tuple(info for info in _dtypes._QUANTIZED_DTYPES.values() if info.bits < 8)
# The unsigned dtype of each width: bit patterns cross between it and uint8.
_UNSIGNED = {
    info.bits: info.dtype for info in _SUB_BYTE if info.is_integer and info.min == 0
}


def _either(names: Sequence[str]) -> str:
  return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def sub_byte_dtype(
    function: str, argument: str, dtype: DTypeLike, *, bits: int | None = None
) -> _dtypes.QuantizedDType:
  """Looks ``dtype`` up in the dtype table and checks that it packs below a byte.

  Args:
    function: the public function's name, for the message.
    argument: the argument's name, for the message.
    dtype: the dtype to check.
    bits: accept only this width (4 for :func:`pack_int4`); default any width below 8.

  Returns:
    The dtype's table entry.

  Raises:
    TypeError: if ``dtype`` is not a quantized dtype, or not one of ``bits`` bits.
  """
  info = _dtypes.quantized_dtype(function, argument, dtype)
  allowed = [q for q in _SUB_BYTE if bits is None or q.bits == bits]
  _validate.check(
      info in allowed, function, argument, _either([q.name for q in allowed]), info.name,
      error=TypeError,
  )
  return info


def elements_per_byte(dtype: DTypeLike) -> int:
  """How many elements of the sub-byte ``dtype`` one byte holds: ``8 // bits``."""
  return 8 // _dtypes.quantized_dtype("elements_per_byte", "dtype", dtype).bits


def _pack(x: jax.Array, bits: int) -> jax.Array:
  per_byte = 8 // bits
  codes = lax.bitcast_convert_type(x.reshape(-1), _UNSIGNED[bits]).astype(jnp.uint8)
  codes = jnp.pad(codes, (0, -x.size % per_byte)).reshape(-1, per_byte)
  packed = codes[:, 0]
  for j in range(1, per_byte):
    packed = packed | (codes[:, j] << (bits * j))
  return packed


@jax.jit
def pack(x: ArrayLike) -> jax.Array:
  r"""Packs a sub-byte array into bytes, as ONNX stores int2, int4 and float4.

  .. math::

    \mathrm{packed}[i] = \sum_{j=0}^{n-1} 2^{b j} \, \mathrm{bits}(x_{n i + j}),
    \qquad n = 8 / b

  over the flattened array, where :math:`b` is the dtype's width: four int2 or
  uint2 elements per byte (element ``4i`` in bits 0-1, ``4i + 1`` in bits 2-3,
  ...), two int4, uint4 or float4_e2m1fn elements per byte (element ``2i`` in
  the low nibble). A last byte that is not full gets zero bits above its
  elements. These are the bytes of ONNX's ``TensorProto.raw_data``
  (``docs/numerics.md``). Integer data carries no gradient.

  Args:
    x: an int2, uint2, int4, uint4 or float4_e2m1fn array of any shape.

  Returns:
    A 1-D uint8 array of ``ceil(x.size / n)`` bytes.

  Raises:
    TypeError: if ``x`` is not of a sub-byte dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.pack(jnp.array([1, -2, 0, -1, 1], jnp.int2))  # 0b11_00_10_01, 0b01
    Array([201,   1], dtype=uint8)
    >>> jq.pack(jnp.array([1, -1, 7], jnp.int4))
    Array([241,   7], dtype=uint8)
  """
  x = jnp.asarray(x)
  return _pack(x, sub_byte_dtype("pack", "x.dtype", x.dtype).bits)


def unpack(packed: ArrayLike, shape: Sequence[int], dtype: DTypeLike) -> jax.Array:
  r"""Unpacks bytes written by :func:`pack` (or by ONNX) into a sub-byte array.

  .. math::

    x_{n i + j} = \left\lfloor \mathrm{packed}[i] / 2^{b j} \right\rfloor \bmod 2^b,
    \qquad n = 8 / b, \; 0 \le j < n

  read as ``dtype``'s bit patterns of :math:`b` bits (int2 and int4 are two's
  complement); bits past ``prod(shape)`` elements are ignored.

  Args:
    packed: a 1-D uint8 array of ``ceil(prod(shape) / n)`` bytes.
    shape: the shape of the unpacked array (static).
    dtype: int2, uint2, int4, uint4 or float4_e2m1fn (static).

  Returns:
    An array of ``shape`` and ``dtype``.

  Raises:
    TypeError: if ``packed`` is not uint8, ``dtype`` is not a sub-byte dtype or
      ``shape`` is not a sequence of non-negative ints.
    ValueError: if ``packed`` does not hold ``ceil(prod(shape) / n)`` bytes.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.unpack(jnp.array([201, 1], jnp.uint8), (5,), jnp.int2)
    Array([1, -2, 0, -1, 1], dtype=int2)
  """
  function = "unpack"
  return _unpack(
      packed, _validate.static_shape(function, "shape", shape),
      sub_byte_dtype(function, "dtype", dtype).dtype, function,
  )


@jax.jit
def pack_int4(x: ArrayLike) -> jax.Array:
  r"""Packs a 4-bit array two elements per byte: :func:`pack` for 4-bit dtypes only.

  .. math::

    \mathrm{packed}[i] = \mathrm{bits}(x_{2i}) + 16 \cdot \mathrm{bits}(x_{2i+1})

  over the flattened array: element ``2i`` in the low nibble, ``2i + 1`` in the
  high nibble; an odd length gets a zero high nibble in its last byte. Kept for
  code written before :func:`pack`, which also packs int2 and uint2.

  Args:
    x: an int4, uint4 or float4_e2m1fn array of any shape.

  Returns:
    A 1-D uint8 array of ``ceil(x.size / 2)`` bytes.

  Raises:
    TypeError: if ``x`` is not a 4-bit dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.pack_int4(jnp.array([1, -1, 7], jnp.int4))
    Array([241,   7], dtype=uint8)
  """
  x = jnp.asarray(x)
  return _pack(x, sub_byte_dtype("pack_int4", "x.dtype", x.dtype, bits=4).bits)


def unpack_int4(packed: ArrayLike, shape: Sequence[int], dtype: DTypeLike) -> jax.Array:
  r"""Unpacks two 4-bit values per byte: :func:`unpack` for 4-bit dtypes only.

  .. math::

    x_{2i} = \mathrm{packed}[i] \bmod 16, \qquad
    x_{2i+1} = \lfloor \mathrm{packed}[i] / 16 \rfloor

  read as ``dtype``'s bit patterns (int4 is two's complement). Kept for code
  written before :func:`unpack`, which also unpacks int2 and uint2.

  Args:
    packed: a 1-D uint8 array of ``ceil(prod(shape) / 2)`` bytes.
    shape: the shape of the unpacked array (static).
    dtype: int4, uint4 or float4_e2m1fn (static).

  Returns:
    An array of ``shape`` and ``dtype``.

  Raises:
    TypeError: if ``packed`` is not uint8 or ``dtype`` is not a 4-bit dtype.
    ValueError: if ``packed`` does not hold ``ceil(prod(shape) / 2)`` bytes.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.unpack_int4(jnp.array([241, 7], jnp.uint8), (3,), jnp.int4)
    Array([1, -1, 7], dtype=int4)
  """
  function = "unpack_int4"
  return _unpack(
      packed, _validate.static_shape(function, "shape", shape),
      sub_byte_dtype(function, "dtype", dtype, bits=4).dtype, function,
  )


def packed_bytes(
    function: str, packed: ArrayLike, shape: tuple[int, ...], dtype: DTypeLike
) -> jax.Array:
  """Checks that ``packed`` is the uint8 bytes of ``shape`` packed by :func:`pack`.

  Raises:
    TypeError: if ``packed`` is not uint8.
    ValueError: if ``packed`` is not 1-D with ``ceil(prod(shape) / (8 // bits))`` bytes.
  """
  packed = jnp.asarray(packed)
  _validate.check(
      packed.dtype == jnp.uint8, function, "packed.dtype", "uint8", packed.dtype.name,
      error=TypeError,
  )
  size = -(-math.prod(shape) // elements_per_byte(dtype))
  _validate.check(
      packed.shape == (size,), function, "packed.shape",
      f"({size},) to unpack into shape {shape}", packed.shape,
  )
  return packed


def unpacked(packed: jax.Array, shape: tuple[int, ...], dtype: DTypeLike) -> jax.Array:
  """The sub-byte array of ``shape`` and ``dtype`` stored in ``packed`` (already checked)."""
  bits = 8 // elements_per_byte(dtype)
  mask = (1 << bits) - 1
  codes = jnp.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], axis=-1)
  codes = codes.reshape(-1)[:math.prod(shape)].astype(_UNSIGNED[bits])
  return lax.bitcast_convert_type(codes, dtype).reshape(shape)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "function"))
def _unpack(
    packed: ArrayLike, shape: tuple[int, ...], dtype: np.dtype, function: str
) -> jax.Array:
  return unpacked(packed_bytes(function, packed, shape, dtype), shape, dtype)
