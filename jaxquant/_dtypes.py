"""The one table of quantized dtypes, and the checks of dtypes against it.

Every op asks this module what a dtype's range is; no other module compares
dtypes against lists of its own. How a float becomes a quantized value is
:mod:`jaxquant._numerics`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import _validate


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


def host_codes(argument: str, value: Any) -> tuple[Any, np.dtype | None]:
  """A NumPy array of a dtype XLA cannot hold, as ``(uint8 codes, dtype)``.

  Anything else comes back as ``(value, None)``. The public ops call this
  before their jit boundary, where a float6 array would otherwise fail to
  become a JAX array; the view costs no copy. A JAX array (a tracer of the
  caller's ``jit``) of such a dtype is a ``TypeError`` naming ``argument``:
  XLA cannot compile float6, so it must travel as its uint8 codes.
  """
  if isinstance(value, (np.ndarray, np.generic)):
    info = _QUANTIZED_DTYPES.get(value.dtype)
    if info is not None and info.as_codes:
      return np.asarray(value).view(np.uint8), info.dtype
    return value, None
  info = _QUANTIZED_DTYPES.get(getattr(value, "dtype", None))
  if info is not None and info.as_codes:
    _validate.fail(
        argument, "a NumPy float6 array or uint8 codes (XLA has no float6 type, so float6 "
        "values cross a jit boundary as codes: docs/numerics.md, \"float6\")",
        f"a JAX array of {info.name}", error=TypeError,
    )
  return value, None


def host_zero_point(argument: str, value: Any, dtype: Any) -> Any:
  """Checks a zero point given on the host, and returns it as the jit boundary must see it.

  There a NumPy int64 would silently become int32 (and pick an int32 output),
  a Python int would wrap around into ``dtype`` (uint8 300 -> 44), and a
  Python int beyond int32 (a uint32 zero point) would overflow: such an int
  comes back as a NumPy scalar of ``dtype``. Anything else comes back as is.

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
      if value > np.iinfo(np.int32).max:
        return info.dtype.type(value)
  return value


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


def zero_point_array(argument: str, value: Any, dtype: Any) -> jax.Array:
  """A zero point that must be of ``dtype``: a Python int in its range, or an array of it.

  Raises:
    TypeError: for a float, or an array of another dtype.
    ValueError: for a Python int outside ``dtype``'s range.
  """
  zero_point = jnp.asarray(host_zero_point(argument, value, dtype))
  name = np.dtype(dtype).name
  if zero_point.weak_type:
    _validate.check(jnp.issubdtype(zero_point.dtype, jnp.integer), argument,
                    f"an integer ({name} zero point)", value, error=TypeError)
    zero_point = zero_point.astype(dtype)
  _validate.check(zero_point.dtype == np.dtype(dtype), f"{argument}.dtype", name,
                  zero_point.dtype.name, error=TypeError)
  return zero_point


def scale_array(argument: str, scale: Any) -> jax.Array:
  """``scale`` as an array; a Python float is float32 (not float64 under x64)."""
  _validate.check(scale is not None, argument, "a float array (a scale is required)", None,
                  error=TypeError)
  scale = jnp.asarray(scale)
  if scale.weak_type and jnp.issubdtype(scale.dtype, jnp.floating):
    scale = scale.astype(jnp.float32)
  # A Python int is a weak int32, not a float: refused, not converted silently.
  python_int = " (a Python int: write a float, 2.0 for 2)" if scale.weak_type else ""
  _validate.check(
      scale.dtype in SCALE_DTYPES, f"{argument}.dtype",
      f"one of {_names(SCALE_DTYPES)}", scale.dtype.name + python_int, error=TypeError,
  )
  return scale


def scale_float_dtype(scale_dtype: Any) -> np.dtype:
  """The float dtype a scale computes in: its own, float32 for float8_e8m0fnu."""
  scale_dtype = np.dtype(scale_dtype)
  return scale_dtype if scale_dtype in OUTPUT_FLOAT_DTYPES else np.dtype(np.float32)


def float_dtype(argument: str, dtype: Any) -> np.dtype:
  """Checks that ``dtype`` is a float dtype an op may return or compute in."""
  _validate.check(
      _as_dtype(dtype) in OUTPUT_FLOAT_DTYPES, argument,
      f"one of {_names(OUTPUT_FLOAT_DTYPES)}", _name(dtype), error=TypeError,
  )
  return _as_dtype(dtype)


