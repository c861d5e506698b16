"""A call's quantization parameters, bound once: scale, zero point, their dtype and layout.

Inside an op's ``jax.jit``, :func:`bind` turns the arrays a call gave into a
frozen :class:`Parameters` (the quantized dtype's table entry, the scale,
the zero point in that dtype, the :class:`~jaxquant._granularity.Granularity`),
validating each once; the op then only evaluates its formula on them.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _dtypes
from jaxquant import _granularity
from jaxquant import _numerics
from jaxquant import _packing
from jaxquant import _validate


def zero_point_array(
    argument: str,
    zero_point: ArrayLike | None,
    dtype: np.dtype,
    *,
    host_dtype: np.dtype | None = None,
) -> jax.Array | None:
  """``zero_point`` as an array of ``dtype``; a Python number takes ``dtype``.

  For a dtype XLA lacks (float6) the array holds codes: a Python number is
  rounded to ``dtype`` as quantize rounds, and uint8 codes pass through.

  Args:
    argument: the argument's name, for the message.
    zero_point: the zero point, or ``None``.
    dtype: the quantized dtype.
    host_dtype: the dtype of a NumPy zero point already turned into codes by
      :func:`_dtypes.host_codes`, else ``None``.

  Raises:
    TypeError: if an array zero point has a dtype other than ``dtype`` (or,
      for float6, its uint8 codes), or a Python float is given for an integer
      ``dtype`` (it would be truncated).
  """
  if zero_point is None:
    return None
  info = _dtypes.quantized_dtype(argument, dtype)
  zero_point = jnp.asarray(zero_point)
  if host_dtype is None and zero_point.weak_type:
    _validate.check(
        not (info.is_integer and jnp.issubdtype(zero_point.dtype, jnp.floating)),
        argument, f"an integer for the integer dtype {info.name}",
        "a Python float", error=TypeError,
    )
    if info.as_codes:
      # XLA cannot cast to float6: round the number as quantize would.
      return _numerics.round_and_saturate(zero_point.astype(jnp.float32), None, info)
    return zero_point.astype(dtype)
  got = zero_point.dtype if host_dtype is None else host_dtype
  given_as_codes = info.as_codes and host_dtype is None and got == jnp.uint8
  _validate.check(
      got == info.dtype or given_as_codes, f"{argument}.dtype",
      f"{info.name} (the quantized dtype){' or its uint8 codes' if info.as_codes else ''}",
      got.name, error=TypeError,
  )
  return _packing.from_codes(zero_point, info) if info.as_codes else zero_point


def quantized_output_dtype(
    zero_point: ArrayLike | None,
    output_dtype: DTypeLike | None,
    *,
    argument: str = "zero_point",
    default: DTypeLike = jnp.uint8,
    integer: bool = False,
    zero_point_dtype: np.dtype | None = None,
) -> _dtypes.QuantizedDType:
  """The zero point's dtype, else ``output_dtype``, else ``default``; a conflict is an error.

  ``zero_point_dtype`` is the dtype of a NumPy zero point that
  :func:`_dtypes.host_codes` turned into codes (float6).
  """
  if zero_point_dtype is None and zero_point is not None:
    if not jnp.asarray(zero_point).weak_type:
      zero_point_dtype = jnp.asarray(zero_point).dtype
  if zero_point_dtype is not None:
    info = _dtypes.quantized_dtype(
        f"{argument}.dtype", zero_point_dtype, integer=integer
    )
    if output_dtype is not None:
      _dtypes.quantized_dtype("output_dtype", output_dtype, integer=integer)
      _validate.check(
          np.dtype(output_dtype) == info.dtype, "output_dtype",
          f"None or {argument}'s dtype {info.name}", np.dtype(output_dtype).name,
      )
    return info
  return _dtypes.quantized_dtype(
      "output_dtype", default if output_dtype is None else output_dtype,
      integer=integer,
  )
