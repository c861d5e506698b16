"""Sub-byte values packed into bytes, in the ONNX TensorProto raw layout.

A dtype of ``bits < 8`` bits (from the dtype table: int2 and uint2 take 2;
int4, uint4 and float4_e2m1fn 4; float6_e2m3fn and float6_e3m2fn 6) is stored
as one LSB-first bit stream: bit ``t`` of element ``k`` of the flattened
array is bit ``bits * k + t`` of the stream, and bit ``j`` of the stream is
bit ``j % 8`` of byte ``j // 8``. That is ``8 // bits`` elements per byte,
the first in the lowest bits, for 2 and 4 bits, and four 6-bit elements in
three bytes, straddling byte boundaries, for float6. The stream takes
``ceil(n * bits / 8)`` bytes; the bits after the last element are zero.
These are the bytes ``onnx.numpy_helper.from_array`` writes to ``raw_data``
(its ``_pack_2bitx4``, ``_pack_4bitx2`` and ``_pack_6bit``);
``docs/numerics.md`` states the contract.

One implementation serves every width: the stream repeats every
``lcm(bits, 8)`` bits, a group of ``lcm(bits, 8) / bits`` elements in
``lcm(bits, 8) / 8`` bytes, so elements are gathered a group at a time into
one integer and cut into bytes (and back).

XLA has no float6 type, so float6 elements are uint8 codes on both sides
(:attr:`_dtypes.QuantizedDType.as_codes`); :func:`pack` also takes the uint8
codes of any sub-byte dtype, one per byte, with ``dtype=``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _bind
from jaxquant import _dtypes
from jaxquant import _sharding
from jaxquant import _validate

# The dtype table's rows stored below a byte, narrowest first.
_SUB_BYTE = tuple(sorted(
    (info for info in _dtypes._QUANTIZED_DTYPES.values() if info.bits < 8),
    key=lambda info: info.bits,
))
# The unsigned dtype of each width that XLA has: bit patterns cross between it and uint8.
_UNSIGNED = {
    info.bits: info.dtype for info in _SUB_BYTE if info.is_integer and info.min == 0
}


def _either(names: Sequence[str]) -> str:
  return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def sub_byte_dtype(
    argument: str, dtype: DTypeLike, *, bits: int | None = None,
    also: str = "",
) -> _dtypes.QuantizedDType:
  """Looks ``dtype`` up in the dtype table and checks that it packs below a byte.

  Args:
    argument: the argument's name, for the message.
    dtype: the dtype to check.
    bits: accept only this width (4 for :func:`pack_int4`); default any width below 8.
    also: what else the caller accepts, appended to the message.

  Returns:
    The dtype's table entry.

  Raises:
    TypeError: if ``dtype`` is not a quantized dtype, or not one of ``bits`` bits.
  """
  info = _dtypes.quantized_dtype(argument, dtype)
  allowed = [q for q in _SUB_BYTE if bits is None or q.bits == bits]
  _validate.check(
      info in allowed, argument,
      _either([q.name for q in allowed]) + (f" ({also})" if also else ""), info.name,
      error=TypeError,
  )
  return info


def packed_size(size: int, bits: int) -> int:
  """Bytes of ``size`` packed elements of ``bits`` bits: ``ceil(size * bits / 8)``."""
  return -(-size * bits // 8)


def _group(bits: int) -> tuple[int, int, type]:
  """Elements and bytes per repeat of the stream, and an integer type holding one."""
  group_bits = math.lcm(bits, 8)
  return group_bits // bits, group_bits // 8, jnp.uint8 if group_bits == 8 else jnp.uint32


def to_codes(x: jax.Array, info: _dtypes.QuantizedDType) -> jax.Array:
  """The uint8 codes of ``x``: its bit patterns, or, for ``info.as_codes``, x masked to them."""
  mask = jnp.uint8((1 << info.bits) - 1)
  if info.as_codes or x.dtype == jnp.uint8:
    return x & mask
  if x.dtype == jnp.float4_e2m1fn:
    # From the float32 value's bits: XLA:CPU emits invalid LLVM IR for a
    # float4 -> uint4 bitcast inside a loop (pack in lax.scan crashed).
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent = (bits >> 23) & 0xFF  # 126 for 0.5, the one subnormal; 127-129 for 1-6
    magnitude = jnp.where(exponent >= 127, ((exponent - 126) << 1) | ((bits >> 22) & 1),
                          (exponent == 126).astype(jnp.uint32))
    return (((bits >> 31) << 3) | magnitude).astype(jnp.uint8)
  # The mask is a no-op by the types, but XLA:CPU, fusing this conversion with
  # the computation of x, can leave the sign extension of a negative int2 in
  # the upper bits (-2 became 254 under one jit).
  return lax.bitcast_convert_type(x, _UNSIGNED[info.bits]).astype(jnp.uint8) & mask


def from_codes(x: jax.Array, info: _dtypes.QuantizedDType) -> jax.Array:
  """uint8 codes (bits above ``info.bits`` ignored) as an array of ``info.array_dtype``."""
  x = x & jnp.uint8((1 << info.bits) - 1)
  if info.as_codes:
    return x
  return lax.bitcast_convert_type(x.astype(_UNSIGNED[info.bits]), info.dtype)


def _static(shape: tuple[Any, ...]) -> bool:
  return all(isinstance(d, int) for d in shape)


def pack_codes(x: jax.Array, bits: int, *, static: bool | None = None) -> jax.Array:
  """1-D bytes of the bit stream of uint8 codes ``x`` (any shape, flattened).

  ``static``: whether the array x is part of has a static shape (default: x's
  own); a row under :func:`along_rows`' vmap does not see the mapped dims.
  """
  size = x.size
  # XLA cannot bitcast an array of symbolic shape (jax.export): the lanes then.
  if static is None:
    static = _static(x.shape)
  if bits in (2, 4) and static and size and x.ndim and x.shape[-1] % 4 == 0:
    # Four codes read as one uint32 and packed with shifts, all in contiguous
    # words: XLA:CPU vectorizes that, where the strided lanes x[:, i] below
    # compile to scalar code (a per-column int4 quantize ran 2.6x slower).
    # The words stay within x's last dim, so a fused producer indexes its
    # parameters without dividing a flat index. A bitcast reads memory order,
    # little-endian on XLA's backends: code i is byte i of its word, and the
    # int4 pairs' uint16 splits into its bytes in stream order.
    words = lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (-1, 4)), jnp.uint32)
    mask = (1 << bits) - 1
    packed = functools.reduce(jnp.bitwise_or, [
        ((words >> (8 * i)) & mask) << (bits * i) for i in range(4)])
    if bits == 2:
      return packed.astype(jnp.uint8).reshape(-1)
    return lax.bitcast_convert_type(packed.astype(jnp.uint16), jnp.uint8).reshape(-1)
  per_group, group_bytes, word = _group(bits)
  # The padded length spelled as groups times per_group, which a symbolic
  # size (jax.export) can be reshaped by; -size % per_group cannot.
  groups_count = -(-size // per_group)
  x = jnp.pad(x.reshape(-1), (0, groups_count * per_group - size))
  x = x.reshape(groups_count, per_group).astype(word)
  groups = x[:, 0]
  for i in range(1, per_group):
    groups = groups | (x[:, i] << (bits * i))
  packed = jnp.stack(
      [((groups >> (8 * j)) & 0xFF).astype(jnp.uint8) for j in range(group_bytes)], axis=-1
  )
  # ONNX stops at the last byte holding an element's bits, inside the group.
  return packed.reshape(-1)[:packed_size(size, bits)]


def _unpack_codes(packed: jax.Array, size: int, bits: int) -> jax.Array:
  """The first ``size`` uint8 codes in the bit stream ``packed`` (1-D bytes)."""
  per_group, group_bytes, word = _group(bits)
  groups_count = -(-size // per_group)
  packed = jnp.pad(packed, (0, groups_count * group_bytes - packed.size))
  packed = packed.reshape(groups_count, group_bytes).astype(word)
  groups = packed[:, 0]
  for j in range(1, group_bytes):
    groups = groups | (packed[:, j] << (8 * j))
  mask = (1 << bits) - 1
  x = jnp.stack([(groups >> (bits * i)) & mask for i in range(per_group)], axis=-1)
  return x.reshape(-1)[:size].astype(jnp.uint8)


def along_rows(function: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """``function`` of a 1-D row applied to every row (last axis) of x.

  Mapped over the leading dims rather than flattening them, so every dim of a
  sharded x keeps its sharding.
  """
  for _ in range(x.ndim - 1):
    function = jax.vmap(function)
  return function(x)


@_bind.op(dtype=_bind.dtype, layout=_bind.choice("flat", "rows"))
def pack(
    x: ArrayLike, *, dtype: DTypeLike | None = None, layout: Literal["flat", "rows"] = "flat"
) -> jax.Array:
  r"""Packs a sub-byte array into bytes, as ONNX stores int2, int4, float4 and float6.

  .. math::

    \mathrm{packed}[i] = \left\lfloor 2^{-8 i} \sum_k 2^{b k} c_k
      \right\rfloor \bmod 2^8

  over the flattened array, where :math:`c_k` is the :math:`b`-bit code (bit
  pattern) of element :math:`k` and :math:`b` the dtype's width: one LSB-first
  bit stream. That is four int2 or uint2 elements per byte (element ``4i`` in
  bits 0-1, ``4i + 1`` in bits 2-3, ...), two int4, uint4 or float4_e2m1fn
  elements per byte (element ``2i`` in the low nibble), and four float6
  elements in three bytes (elements ``4i + 1`` and ``4i + 2`` straddle byte
  boundaries). The bits after the last element are zero. These are the
  bytes of ONNX's ``TensorProto.raw_data`` (``docs/numerics.md``). Integer
  data carries no gradient.

  XLA has no float6 type: pass a NumPy float6 array (``ml_dtypes``), or its
  uint8 codes with ``dtype=`` (what :func:`quantize_linear` returns for float6).
  The uint8 codes of the other sub-byte dtypes, one per byte, pack the same way.

  ``layout="rows"`` packs each row (the last axis) as its own stream, padded
  to whole bytes, and keeps x's other dims: ``x.shape[:-1] +
  (ceil(x.shape[-1] * b / 8),)``. Where rows fill whole bytes (an even last
  dim for 4 bits) its bytes are the flat layout's, reshaped. Rows keep a
  sharded x's sharding along every axis (docs/sharding.md); the flat layout
  runs across rows, so it cannot be split by column. :func:`unpack` and
  :func:`dequantize_linear` read either layout, told apart by its shape.

  Args:
    x: an int2, uint2, int4, uint4 or float4_e2m1fn array, or a NumPy
      float6_e2m3fn or float6_e3m2fn array, of any shape; or, with ``dtype``,
      uint8 codes of ``dtype`` (bits above its width are ignored).
    dtype: the sub-byte dtype of uint8 codes in ``x`` (static); ``None``
      takes x's dtype.
    layout: ``"flat"`` (ONNX's ``raw_data``) or ``"rows"`` (static).

  Returns:
    A 1-D uint8 array of ``ceil(x.size * b / 8)`` bytes; with ``layout="rows"``
    and x of rank 2 or more, ``x.shape[:-1] + (ceil(x.shape[-1] * b / 8),)``.

  Raises:
    TypeError: if ``x`` is not of a sub-byte dtype (and ``dtype`` is not
      given), or ``dtype`` is not a sub-byte dtype, or, with ``dtype``, ``x``
      is neither uint8 codes nor of ``dtype``.

  Example:
    >>> import jax.numpy as jnp
    >>> import ml_dtypes
    >>> import numpy as np
    >>> import jaxquant as jq
    >>> jq.pack(jnp.array([1, -2, 0, -1, 1], jnp.int2))  # 0b11_00_10_01, 0b01
    Array([201,   1], dtype=uint8)
    >>> jq.pack(jnp.array([1, -1, 7], jnp.int4))
    Array([241,   7], dtype=uint8)
    >>> jq.pack(np.array([1.0, -7.5, 0.5], ml_dtypes.float6_e2m3fn))  # codes 8, 63, 4
    Array([200,  79,   0], dtype=uint8)
    >>> jq.pack(jnp.array([8, 63, 4], jnp.uint8), dtype=jnp.float6_e2m3fn)
    Array([200,  79,   0], dtype=uint8)
    >>> jq.pack(jnp.array([[1, -1, 7], [2, 3, 4]], jnp.int4), layout="rows")
    Array([[241,   7],
           [ 50,   4]], dtype=uint8)
  """
  x, host_dtype = _dtypes.host_codes("x", x)
  if host_dtype is not None:
    _validate.check(
        dtype is None or _dtypes._as_dtype(dtype) == host_dtype, "dtype",
        f"None or x's dtype {host_dtype.name}", _dtypes._name(dtype), error=TypeError,
    )
    dtype = host_dtype
  return _pack(x, dtype=dtype, layout=layout)


@functools.partial(jax.jit, static_argnames=("dtype", "bits", "layout"))
def _pack(x, *, dtype, bits=None, layout="flat"):
  x = jnp.asarray(x)
  if dtype is None:
    info = sub_byte_dtype(
        "x.dtype", x.dtype, bits=bits,
        also="" if bits else "or uint8 codes with dtype=",
    )
  else:
    info = sub_byte_dtype("dtype", dtype, bits=bits)
    accepted = ["uint8"] + ([] if info.as_codes else [info.name])
    _validate.check(
        x.dtype.name in accepted, "x.dtype",
        f"{' or '.join(accepted)} for dtype={info.name}", x.dtype.name, error=TypeError,
    )
  codes = to_codes(x, info)
  # Under an explicit-sharding mesh, JAX refuses to flatten an array sharded
  # along a minor dim; name the layout that keeps that sharding instead.
  spec = jax.typeof(x).sharding.spec
  _validate.check(
      layout == "rows" or _sharding.split_dims(x) <= {0}, "x's sharding",
      "unsplit after the first dim for ONNX's flat layout, which runs across rows "
      "(pack(x, layout='rows') keeps the sharding)", spec,
  )
  if layout == "rows" and codes.ndim > 1:
    rows = functools.partial(
        along_rows, functools.partial(pack_codes, bits=info.bits, static=_static(codes.shape)))
    last = codes.ndim - 1
    if last not in _sharding.split_dims(codes):
      return rows(codes)
    # Split rows pack in words that a shard need not hold whole (6 int4 values
    # a shard: 12 words over 8 devices), and where a shard edge cuts a byte no
    # split of the bytes is even: automatic sharding packs them, the bytes
    # split like x where every shard holds whole bytes, else whole along rows.
    cut = codes.shape[last] // _sharding.shards(codes, last) * info.bits % 8
    return _sharding.unsplit_along(rows, codes, [last] if cut else [])
  return pack_codes(codes, info.bits)


def _sub_byte_option(bits: int | None = None) -> _bind.Normalizer:
  """A dtype option checked by :func:`sub_byte_dtype` once per spelling (``_bind`` remembers it)."""

  def normalize(argument: str, value: DTypeLike) -> np.dtype:
    dtype = _bind.dtype(argument, value)
    return sub_byte_dtype(argument, dtype, bits=bits).dtype

  return normalize


@_bind.op(shape=_bind.shape, dtype=_sub_byte_option())
def unpack(packed: ArrayLike, shape: Sequence[int], dtype: DTypeLike) -> jax.Array:
  r"""Unpacks bytes written by :func:`pack` (or by ONNX) into a sub-byte array.

  .. math::

    c_k = \left\lfloor 2^{-b k} \sum_i 2^{8 i} \, \mathrm{packed}[i]
      \right\rfloor \bmod 2^b

  read as ``dtype``'s bit patterns of :math:`b` bits (int2 and int4 are two's
  complement); bits past ``prod(shape)`` elements are ignored. XLA has no
  float6 type, so float6 comes back as its uint8 codes, one per byte
  (``np.asarray(codes).view(ml_dtypes.float6_e2m3fn)`` reads them;
  :func:`dequantize_linear` takes them with ``packed_dtype=``).

  Args:
    packed: a 1-D uint8 array of ``ceil(prod(shape) * b / 8)`` bytes, or
      ``pack(..., layout="rows")``'s ``shape[:-1] + (ceil(shape[-1] * b / 8),)``.
    shape: the shape of the unpacked array (static).
    dtype: int2, uint2, int4, uint4, float4_e2m1fn, float6_e2m3fn or
      float6_e3m2fn (static).

  Returns:
    An array of ``shape`` and ``dtype``; uint8 codes for float6.

  Raises:
    TypeError: if ``packed`` is not uint8, ``dtype`` is not a sub-byte dtype or
      ``shape`` is not a sequence of non-negative ints.
    ValueError: if ``packed`` is shaped as neither layout of ``shape``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.unpack(jnp.array([201, 1], jnp.uint8), (5,), jnp.int2)
    Array([1, -2, 0, -1, 1], dtype=int2)
    >>> jq.unpack(jnp.array([200, 79, 0], jnp.uint8), (3,), jnp.float6_e2m3fn)
    Array([ 8, 63,  4], dtype=uint8)
  """
  return _unpack(packed, shape, dtype)


@_validate.reports_as("pack_int4")
def pack_int4(x: ArrayLike) -> jax.Array:
  r"""Packs a 4-bit array two elements per byte: :func:`pack` for 4-bit dtypes only.

  .. math::

    \mathrm{packed}[i] = \mathrm{bits}(x_{2i}) + 16 \cdot \mathrm{bits}(x_{2i+1})

  over the flattened array: element ``2i`` in the low nibble, ``2i + 1`` in the
  high nibble; an odd length gets a zero high nibble in its last byte. Kept for
  code written before :func:`pack`, which also packs int2, uint2 and float6.

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
  return _pack(x, dtype=None, bits=4)


@_bind.op(shape=_bind.shape, dtype=_sub_byte_option(bits=4))
def unpack_int4(packed: ArrayLike, shape: Sequence[int], dtype: DTypeLike) -> jax.Array:
  r"""Unpacks two 4-bit values per byte: :func:`unpack` for 4-bit dtypes only.

  .. math::

    x_{2i} = \mathrm{packed}[i] \bmod 16, \qquad
    x_{2i+1} = \lfloor \mathrm{packed}[i] / 16 \rfloor

  read as ``dtype``'s bit patterns (int4 is two's complement). Kept for code
  written before :func:`unpack`, which also unpacks int2, uint2 and float6.

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
  return _unpack(packed, shape, dtype)


def unpack_integers(packed: jax.Array, bits: int, *, signed: bool) -> jax.Array:
  """Packed 2- or 4-bit integers as int8 (uint8), LSB first: ``(..., n)`` -> ``(..., 8n / bits)``.

  Each four bytes (``n % 4 == 0``) are read as one little-endian 32-bit word,
  and each of its fields is shifted to the top bits and back down,
  arithmetically when ``signed``. Every lane reads whole contiguous words,
  which XLA:CPU vectorizes; interleaving stacked halves (``unpack``,
  ``unpack_codes``) and converting from int4 compile to code that writes an
  element at a time: a packed 1024 x 1024 int4 weight dequantized to float32
  in 0.14 ms against 0.45 ms (benchmarks/matmul.py).
  """
  words = lax.bitcast_convert_type(
      packed.reshape(packed.shape[:-1] + (packed.shape[-1] // 4, 4)), jnp.int32)
  words = jnp.broadcast_to(words[..., None], words.shape + (32 // bits,))
  # Field j moves up by 32 - (j + 1) * bits, to the top. From an iota, not a
  # constant array, whose lanes XLA:CPU loads one by one (0.85 against 0.15 ms).
  up = (32 - bits) - bits * lax.broadcasted_iota(jnp.int32, words.shape, words.ndim - 1)
  down = lax.shift_right_arithmetic if signed else lax.shift_right_logical
  fields = down(lax.shift_left(words, up), np.int32(32 - bits))
  return fields.astype(jnp.int8 if signed else jnp.uint8).reshape(
      packed.shape[:-1] + (packed.shape[-1] * 8 // bits,))


def packed_bytes(
    packed: ArrayLike, shape: tuple[int, ...], dtype: DTypeLike
) -> jax.Array:
  """Checks that ``packed`` is the uint8 bytes of ``shape`` packed by :func:`pack`.

  Raises:
    TypeError: if ``packed`` is not uint8.
    ValueError: if ``packed`` is neither 1-D with ``ceil(prod(shape) * bits / 8)``
      bytes (flat) nor ``shape[:-1] + (ceil(shape[-1] * bits / 8),)`` (rows).
  """
  packed = jnp.asarray(packed)
  _validate.check(
      packed.dtype == jnp.uint8, "packed.dtype", "uint8", packed.dtype.name,
      error=TypeError,
  )
  layouts = packed_layouts(shape, dtype)
  expected = f"{layouts[0]} (flat) or {layouts[1]} (rows)" if len(layouts) > 1 else f"{layouts[0]}"
  _validate.check(
      packed.shape in layouts, "packed.shape",
      f"{expected} to unpack into shape {shape}", packed.shape,
  )
  return packed


def packed_layouts(shape: tuple[int, ...], dtype: DTypeLike) -> tuple[tuple[int, ...], ...]:
  """The shapes :func:`pack` gives ``shape``'s bytes: flat, and (a matrix or more) in rows."""
  bits = _dtypes.quantized_dtype("dtype", dtype).bits
  flat = (packed_size(math.prod(shape), bits),)
  if len(shape) > 1:
    return (flat, tuple(shape[:-1]) + (packed_size(shape[-1], bits),))
  return (flat,)


def unpacked(packed: jax.Array, shape: tuple[int, ...], dtype: DTypeLike) -> jax.Array:
  """The sub-byte array of ``shape`` stored in ``packed`` (already checked).

  Returns:
    An array of ``dtype``, or of uint8 codes for a dtype XLA lacks (float6).
  """
  info = _dtypes.quantized_dtype("dtype", dtype)
  if packed.ndim > 1:
    return from_codes(along_rows(
        functools.partial(_unpack_codes, size=shape[-1], bits=info.bits), packed), info)
  return from_codes(_unpack_codes(packed, math.prod(shape), info.bits), info).reshape(shape)


def unpacked_values(packed: jax.Array, shape: tuple[int, ...], dtype: DTypeLike) -> jax.Array:
  """:func:`unpacked`'s values, as int8 (uint8) for integer 2- and 4-bit ones in whole words.

  The same numbers, for arithmetic: :func:`unpack_integers` reads whole
  32-bit words, of the flat bit stream or of each row (``pack(layout="rows")``),
  several times faster on XLA:CPU than building an int4 array, which it
  also converts slowly. Other dtypes and layouts: :func:`unpacked`.
  """
  info = _dtypes.quantized_dtype("dtype", dtype)
  static = _static((*packed.shape, *shape))
  # Under explicit sharding a split last dim would not survive the words'
  # reshapes: the bytes are then unpacked one stream group at a time.
  split = packed.ndim - 1 in _sharding.split_dims(packed)
  if static and not split and info.is_integer and info.bits in (2, 4):
    per_row = math.prod(shape) if packed.ndim == 1 else shape[-1]
    if per_row * info.bits % 32 == 0:
      return unpack_integers(packed, info.bits, signed=info.min < 0).reshape(shape)
  return unpacked(packed, shape, dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _unpack(packed: ArrayLike, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
  return unpacked(packed_bytes(packed, shape, dtype), shape, dtype)
