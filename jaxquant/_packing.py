"""Two 4-bit values per byte in the ONNX TensorProto layout (SPEC §6)."""

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

_FOUR_BIT_DTYPES = tuple(np.dtype(d) for d in (jnp.int4, jnp.uint4, jnp.float4_e2m1fn))


def four_bit_dtype(function: str, argument: str, dtype: DTypeLike) -> np.dtype:
  info = _dtypes.quantized_dtype(function, argument, dtype)
  _validate.check(
      info.dtype in _FOUR_BIT_DTYPES, function, argument,
      "int4, uint4 or float4_e2m1fn", info.name, error=TypeError,
  )
  return info.dtype


@jax.jit
def pack_int4(x: ArrayLike) -> jax.Array:
  r"""Packs a 4-bit array two elements per byte, as ONNX stores int4/uint4/float4.

  .. math::

    \mathrm{packed}[i] = \mathrm{bits}(x_{2i}) + 16 \cdot \mathrm{bits}(x_{2i+1})

  over the flattened array: element ``2i`` in the low nibble, ``2i + 1`` in the
  high nibble; an odd length gets a zero high nibble in its last byte. Integer
  data carries no gradient.

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
  four_bit_dtype("pack_int4", "x.dtype", x.dtype)
  nibbles = lax.bitcast_convert_type(x.reshape(-1), jnp.uint4).astype(jnp.uint8)
  nibbles = jnp.pad(nibbles, (0, x.size % 2)).reshape(-1, 2)
  return nibbles[:, 0] | (nibbles[:, 1] << 4)


def unpack_int4(packed: ArrayLike, shape: Sequence[int], dtype: DTypeLike) -> jax.Array:
  r"""Unpacks bytes written by :func:`pack_int4` (or by ONNX) into a 4-bit array.

  .. math::

    x_{2i} = \mathrm{packed}[i] \bmod 16, \qquad
    x_{2i+1} = \lfloor \mathrm{packed}[i] / 16 \rfloor

  read as ``dtype``'s bit patterns (int4 is two's complement).

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
      four_bit_dtype(function, "dtype", dtype),
  )


def packed_bytes(function: str, packed: ArrayLike, shape: tuple[int, ...]) -> jax.Array:
  """Checks that ``packed`` is the uint8 bytes of ``shape`` packed by :func:`pack_int4`.

  Raises:
    TypeError: if ``packed`` is not uint8.
    ValueError: if ``packed`` is not 1-D with ``ceil(prod(shape) / 2)`` bytes.
  """
  packed = jnp.asarray(packed)
  _validate.check(
      packed.dtype == jnp.uint8, function, "packed.dtype", "uint8", packed.dtype.name,
      error=TypeError,
  )
  size = math.prod(shape)
  _validate.check(
      packed.shape == ((size + 1) // 2,), function, "packed.shape",
      f"({(size + 1) // 2},) to unpack into shape {shape}", packed.shape,
  )
  return packed


def unpacked(packed: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
  """The 4-bit array of ``shape`` and ``dtype`` stored in ``packed`` (already checked)."""
  nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)[:math.prod(shape)]
  return lax.bitcast_convert_type(nibbles.astype(jnp.uint4), dtype).reshape(shape)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _unpack(packed: ArrayLike, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
  return unpacked(packed_bytes("unpack_int4", packed, shape), shape, dtype)
