"""The one table of quantized dtypes and the saturating conversion into them.

Every op asks this module what a dtype's range is and how a float becomes it;
no other module compares dtypes against lists of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxquant import _validate
from pallas_kernels.dequantize import decode_codes


@dataclasses.dataclass(frozen=True)
class QuantizedDType:
  """What the ops need to know about one quantized dtype.

  Attributes:
    dtype: the NumPy dtype (``ml_dtypes`` for the sub-byte and float8 types).
    bits: storage bits per element in the ONNX layout.
    is_integer: integer (``True``) or low-precision float (``False``).
    min: the smallest finite value (``qmin`` for integers, ``-finfo.max`` else).
    max: the largest finite value.
    has_nan: whether the dtype encodes NaN (float4_e2m1fn and float6 do not).
    as_codes: XLA has no such type (float6_e2m3fn, float6_e3m2fn: jaxlib
      0.10.2 raises "Invalid XLA PrimitiveType"), so a JAX array can never
      hold it: its values travel as their codes, one per uint8 byte, in
      ml_dtypes' bit layout (``codes.view(dtype)`` in NumPy reads them).
  """

  dtype: np.dtype
  bits: int
  is_integer: bool
  min: int | float
  max: int | float
  has_nan: bool = False
  as_codes: bool = False

  @property
  def name(self) -> str:
    return self.dtype.name

  @property
  def array_dtype(self) -> np.dtype:
    """The dtype of a JAX array holding this dtype: uint8 codes, or the dtype itself."""
    return np.dtype(np.uint8) if self.as_codes else self.dtype


def _integer(dtype: Any) -> QuantizedDType:
  info = jnp.iinfo(dtype)
  return QuantizedDType(np.dtype(dtype), info.bits, True, int(info.min), int(info.max))


def _float(dtype: Any, *, as_codes: bool = False) -> QuantizedDType:
  info = jnp.finfo(dtype)
  has_nan = bool(np.isnan(np.array(np.nan, dtype).astype(np.float32)))
  return QuantizedDType(
      np.dtype(dtype), info.bits, False, float(info.min), float(info.max), has_nan,
      as_codes,
  )


_QUANTIZED_DTYPES: dict[np.dtype, QuantizedDType] = {
    q.dtype: q
    for q in [
        *map(
            _integer,
            [jnp.int2, jnp.uint2, jnp.int4, jnp.uint4, jnp.int8, jnp.uint8,
             jnp.int16, jnp.uint16, jnp.int32, jnp.uint32],
        ),
        *map(
            _float,
            [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2,
             jnp.float8_e5m2fnuz],
        ),
        _float(jnp.float6_e2m3fn, as_codes=True),
        _float(jnp.float6_e3m2fn, as_codes=True),
        _float(jnp.float4_e2m1fn),
    ]
}

QUANTIZED_DTYPE_NAMES = ", ".join(d.name for d in _QUANTIZED_DTYPES)

SCALE_DTYPES = tuple(
    np.dtype(d)
    for d in (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e8m0fnu)
)
OUTPUT_FLOAT_DTYPES = tuple(
    np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16)
)


INPUT_FLOAT_DTYPES = OUTPUT_FLOAT_DTYPES + (np.dtype(np.float64),)


def _names(dtypes: tuple[np.dtype, ...]) -> str:
  return ", ".join(d.name for d in dtypes)


def _as_dtype(dtype: Any) -> np.dtype | None:
  try:
    return np.dtype(dtype)
  except TypeError:
    return None


def _name(dtype: Any) -> str:
  """A dtype's name for messages (``jnp.float32`` prints as a class otherwise)."""
  as_dtype = _as_dtype(dtype)
  return repr(dtype) if as_dtype is None else as_dtype.name


def quantized_dtype(
    argument: str, dtype: Any, *, integer: bool = False
) -> QuantizedDType:
  """Looks ``dtype`` up in the table; a ``TypeError`` naming ``argument`` if absent.

  With ``integer=True`` the float8 and float4 entries are refused too.
  """
  info = _QUANTIZED_DTYPES.get(_as_dtype(dtype))
  if info is None:
    _validate.fail(
        argument, f"one of the quantized dtypes ({QUANTIZED_DTYPE_NAMES})",
        _name(dtype), error=TypeError,
    )
  _validate.check(
      info.is_integer or not integer, argument, "an integer quantized dtype",
      info.name, error=TypeError,
  )
  return info


def host_codes(value: Any) -> tuple[Any, np.dtype | None]:
  """A NumPy array of a dtype XLA cannot hold, as ``(uint8 codes, dtype)``.

  Anything else comes back as ``(value, None)``. The public ops call this
  before their jit boundary, where a float6 array would otherwise fail to
  become a JAX array; the view costs no copy.
  """
  if isinstance(value, (np.ndarray, np.generic)):
    info = _QUANTIZED_DTYPES.get(value.dtype)
    if info is not None and info.as_codes:
      return np.asarray(value).view(np.uint8), info.dtype
  return value, None


def check_host_zero_point(argument: str, value: Any, dtype: Any) -> None:
  """Checks a zero point given on the host, before the jit boundary rewrites it.

  There a NumPy int64 would silently become int32 (and pick an int32 output)
  and a Python int would wrap around into ``dtype`` (uint8 300 -> 44).

  Args:
    argument: the argument's name, for the message.
    value: the zero point as the caller gave it.
    dtype: the quantized dtype a Python int zero point takes.

  Raises:
    TypeError: for a NumPy zero point whose dtype is not a quantized dtype.
    ValueError: for a Python int outside ``dtype``'s range.
  """
  if isinstance(value, (np.ndarray, np.generic)):
    _validate.check(
        value.dtype in _QUANTIZED_DTYPES, f"{argument}.dtype",
        f"one of the quantized dtypes ({QUANTIZED_DTYPE_NAMES})", value.dtype.name,
        error=TypeError,
    )
  elif isinstance(value, int) and not isinstance(value, bool):
    info = _QUANTIZED_DTYPES.get(_as_dtype(dtype))
    if info is not None and info.is_integer:
      _validate.check(
          info.min <= value <= info.max, argument,
          f"in [{info.min}, {info.max}] for {info.name}", value,
      )


def values(x: jax.Array, info: QuantizedDType) -> jax.Array:
  """``x`` as numbers: float32 values for codes (``info.as_codes``), else ``x`` itself."""
  return decode_codes(x, info.dtype) if info.as_codes else x


def float_input(argument: str, x: jax.Array, *, also: str = "") -> jax.Array:
  """Checks that the array ``x`` holds floats to quantize (float64 too, under x64).

  ``also`` names the other dtypes the caller accepts, for the message.
  """
  _validate.check(
      x.dtype in INPUT_FLOAT_DTYPES, f"{argument}.dtype",
      f"a float dtype (float32, float16 or bfloat16){' or ' + also if also else ''}",
      x.dtype.name, error=TypeError,
  )
  return x


def scale_array(argument: str, scale: Any) -> jax.Array:
  """``scale`` as an array; a Python float is float32 (not float64 under x64)."""
  scale = jnp.asarray(scale)
  if scale.weak_type and jnp.issubdtype(scale.dtype, jnp.floating):
    scale = scale.astype(jnp.float32)
  _validate.check(
      scale.dtype in SCALE_DTYPES, f"{argument}.dtype",
      f"one of {_names(SCALE_DTYPES)}", scale.dtype.name, error=TypeError,
  )
  return scale


def float_dtype(argument: str, dtype: Any) -> np.dtype:
  """Checks that ``dtype`` is a float dtype an op may return or compute in."""
  _validate.check(
      _as_dtype(dtype) in OUTPUT_FLOAT_DTYPES, argument,
      f"one of {_names(OUTPUT_FLOAT_DTYPES)}", _name(dtype), error=TypeError,
  )
  return _as_dtype(dtype)


def round_to(x: jax.Array, dtype: np.dtype) -> jax.Array:
  """Rounds float ``x`` to ``dtype``'s precision and range, keeping x's dtype."""
  info, wide = jnp.finfo(dtype), jnp.finfo(x.dtype)
  if info.nmant >= wide.nmant:
    return x
  if info.nexp == wide.nexp:
    # bfloat16 from float32: XLA may drop a cast down and back up (it allows
    # excess precision by default) but keeps reduce_precision, which agrees
    # with the cast here because the exponent ranges, subnormals included, match.
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  # reduce_precision flushes the narrower type's subnormals; the cast keeps them.
  return x.astype(dtype).astype(x.dtype)


def division_precision(scale_dtype: Any) -> np.dtype:
  """The dtype ONNX divides in by default: the scale's (float32 for float8_e8m0fnu).

  A float8_e8m0fnu scale is a power of two, so float32 divides by it exactly.
  """
  scale_dtype = np.dtype(scale_dtype)
  return scale_dtype if scale_dtype in OUTPUT_FLOAT_DTYPES else np.dtype(np.float32)


def int32_to_float(x: jax.Array, dtype: np.dtype, precision: np.dtype) -> jax.Array:
  """int32 ``x`` as float ``dtype``, rounded once (to nearest even) to ``precision``.

  XLA converts int32 to a narrow float through float32, rounding twice, which
  can land on a tie of the narrow type and break it the wrong way. Rounding to
  float32 *to odd* first keeps the second rounding exact, as float32 has more
  than ``p + 2`` significant bits for float16 and bfloat16 (Boldo and
  Melquiond 2008).
  """
  wide = jnp.finfo(dtype)
  if jnp.finfo(precision).nmant >= wide.nmant or wide.nmant >= 31:
    # One rounding (float32 precision), or none (float64 holds every int32).
    return round_to(x.astype(dtype), precision)
  magnitude = lax.bitcast_convert_type(jnp.abs(x), jnp.uint32)  # |int32 min| fits uint32
  bit_length = 32 - lax.clz(magnitude).astype(jnp.int32)
  dropped = jnp.maximum(bit_length - (wide.nmant + 1), 0).astype(jnp.uint32)
  kept = magnitude >> dropped
  sticky = (magnitude & ((jnp.uint32(1) << dropped) - 1)) != 0
  odd = kept | sticky.astype(jnp.uint32)
  # 2**dropped built from its exponent bits: exact, unlike a library exp2.
  power = lax.bitcast_convert_type((dropped + 127) << 23, jnp.float32)
  value = odd.astype(jnp.float32) * power
  return round_to(jnp.where(x < 0, -value, value), precision)


def compute_dtype(*dtypes: Any) -> np.dtype:
  """The float dtype in which quantization arithmetic runs: float32, or float64 under x64."""
  return np.dtype(jnp.result_type(jnp.float32, *(
      d for d in dtypes if jnp.issubdtype(d, jnp.floating) and np.dtype(d).itemsize > 4
  )))


def _add_zero_point_32bit(
    rounded: jax.Array, zero_point: jax.Array, info: QuantizedDType
) -> jax.Array:
  """``saturate(rounded + zero_point)`` for 32-bit outputs, without rounding the sum.

  Neither float32 nor int32 holds the 33-bit sum, so it is formed from 16-bit
  halves: ``rounded = hi * 2**16 + lo`` with ``0 <= lo < 2**16``.
  """
  half = 2.0**16
  # Beyond +-2**32 every zero point of the type leaves the sum out of range.
  rounded = jnp.clip(rounded, -(2.0**32), 2.0**32)
  rounded_hi = jnp.floor(rounded / half)
  rounded_lo = (rounded - rounded_hi * half).astype(jnp.int32)
  zero_point = zero_point.astype(info.dtype)
  zero_point_hi = jnp.right_shift(zero_point, 16)  # arithmetic for int32, logical for uint32
  zero_point_lo = (zero_point & info.dtype.type(0xFFFF)).astype(jnp.int32)
  sum_lo = rounded_lo + zero_point_lo
  sum_hi = (
      rounded_hi.astype(jnp.int32) + zero_point_hi.astype(jnp.int32)
      + lax.shift_right_logical(sum_lo, jnp.int32(16))
  )
  sum_lo = (sum_lo & 0xFFFF).astype(info.dtype)
  value = lax.shift_left(sum_hi.astype(info.dtype), info.dtype.type(16)) | sum_lo
  return jnp.where(
      sum_hi > (info.max >> 16), info.dtype.type(info.max),
      jnp.where(sum_hi < (info.min >> 16), info.dtype.type(info.min), value),
  )


def _encode(value: jax.Array, info: QuantizedDType) -> jax.Array:
  """The code of ``value`` rounded to nearest even on ``info``'s grid, saturated.

  NaN gives +max (as float4's Cast table), +-inf and overflow +-max, -0.0 the
  -0.0 code. Within the binade ``[2**e, 2**(e+1))`` the grid steps by
  ``q = 2**(e - p)`` (below the smallest normal, by the subnormal step), so
  ``round(|v| / q)`` counts steps, and the code is that count plus
  ``2**p`` per binade below: a count that rounds up to the next binade lands
  on its first code, so no carry needs handling. Dividing by ``q`` is a
  multiplication by a power of two, exact in float32 and float64 alike.
  """
  finfo = jnp.finfo(info.dtype)
  mantissa_bits, low = finfo.nmant, finfo.minexp  # the smallest normal is 2**low
  value = jnp.where(jnp.isnan(value), info.max, value)
  magnitude = jnp.minimum(jnp.abs(value), info.max)
  steps = magnitude * 2.0 ** (mantissa_bits - low)
  offset = jnp.zeros(value.shape, jnp.int32)
  for exponent in range(low + 1, finfo.maxexp):
    above = magnitude >= 2.0**exponent
    steps = jnp.where(above, magnitude * 2.0 ** (mantissa_bits - exponent), steps)
    offset = jnp.where(above, (exponent - low) << mantissa_bits, offset)
  code = jnp.round(steps).astype(jnp.int32) + offset
  sign = jnp.signbit(value).astype(jnp.int32) << (info.bits - 1)
  return (code | sign).astype(jnp.uint8)


def round_and_saturate(
    quotient: jax.Array,
    zero_point: jax.Array | None,
    info: QuantizedDType,
    *,
    saturate: bool = True,
    codes: bool = False,
) -> jax.Array:
  """``saturate(round_half_to_even(quotient) + zero_point)`` as ``info.dtype``.

  The rules are docs/numerics.md's "Special values".
  Integers: NaN -> ``min``, +-inf and overflow clamp to the range, the clamp is
  done in float before the cast because XLA's cast maps NaN to 0. Floats: the
  dtype's own round-to-nearest-even cast; ``saturate`` clips to +-max first
  (XLA's float8 cast does not), NaN stays NaN, or becomes +max in a dtype
  without NaN (ONNX's float4 cast table; XLA's cast would give -0). float6,
  which XLA cannot cast to, is rounded and saturated by arithmetic (the same
  rules as float4) and returned as uint8 codes.

  Args:
    quotient: ``x / scale`` in float32 (or float64), broadcast against ``zero_point``.
    zero_point: in ``info.array_dtype`` (codes for float6), or ``None`` for 0.
    info: the target dtype's table entry.
    saturate: float8 only: clip to the finite range instead of overflowing.
    codes: sub-byte dtypes only: return the uint8 codes (bit patterns) of the
      result instead of an array of ``info.dtype``, never converting to a
      sub-byte type: XLA:CPU converts to int4 about 40 times slower than to
      int8 (benchmarks/run.py), and the codes are what packing needs.

  Returns:
    An array of ``info.array_dtype`` (``info.dtype``, or uint8 codes for
    float6), or uint8 codes with ``codes``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxquant import _dtypes
    >>> info = _dtypes.quantized_dtype("dtype", jnp.float6_e2m3fn)
    >>> _dtypes.round_and_saturate(jnp.array([1.0625, 1.1875, -0.0, 9.0, jnp.nan]),
    ...                            None, info)  # 1.0, 1.25, -0.0, 7.5, 7.5
    Array([ 8, 10, 32, 31, 31], dtype=uint8)
  """
  if not info.is_integer:
    if zero_point is not None:
      # Adding a zero point of +0 would turn a -0 quotient into +0.
      zero_point = values(zero_point, info).astype(quotient.dtype)
      quotient = jnp.where(zero_point == 0, quotient, quotient + zero_point)
    if info.as_codes or codes:
      return _encode(quotient, info)
    if saturate:
      quotient = jnp.clip(quotient, info.min, info.max)
    if not info.has_nan:
      quotient = jnp.where(jnp.isnan(quotient), info.max, quotient)
    return quotient.astype(info.dtype)

  rounded = jnp.round(quotient)
  # int8 holds every sub-byte integer; its two's complement low bits are the codes.
  storage = np.dtype(np.int8) if codes else info.dtype
  if info.bits == 32:
    if zero_point is None:
      zero_point = jnp.zeros((), info.dtype)
    result = _add_zero_point_32bit(rounded, zero_point, info)
  else:
    if zero_point is not None:
      rounded = rounded + zero_point.astype(rounded.dtype)
    result = jnp.clip(rounded, info.min, info.max).astype(storage)
  result = jnp.where(jnp.isnan(rounded), storage.type(info.min), result)
  if codes:
    return result.astype(jnp.uint8) & jnp.uint8((1 << info.bits) - 1)
  return result
