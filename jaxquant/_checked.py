"""Checked mode: every op checks the values of its scales, zero points and codes.

Bad values are legal arrays that give wrong results without an error: a
negative scale flips signs, a zero or NaN scale saturates every output, a NaN
float8 zero point makes every output NaN, a uint8 code above a sub-byte
dtype's range loses its high bits. Their values are only known when the
program runs, so the checks are ``jax.experimental.checkify`` checks, emitted
by :func:`jaxquant._bind.op` while :func:`checked` traces a function, and
raised after it has run.

Outside :func:`checked` no op emits anything: the programs traced and
compiled are the same as if this module did not exist. The mode is a
``jax.make_user_context``, part of ``jax.jit``'s cache key, so a function
jitted and traced before is traced again, with checks, inside :func:`checked`.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any, ParamSpec, TypeVar

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jaxquant import _dtypes

_P = ParamSpec("_P")
_T = TypeVar("_T")

_CHECKING = jax.make_user_context(default_value=False)


def checked(function: Callable[_P, _T]) -> Callable[_P, _T]:
  """Runs ``function`` with every jaxquant op checking its argument values.

  Inside, each op checks, as the program runs:

  * ``scale``, ``scales`` and every ``*_scale``: finite and > 0 (a negative
    scale flips the sign of every output, a zero or NaN one saturates them;
    on CPU one below float32's smallest normal, such as float8_e8m0fnu's
    2**-127, reads as 0, docs/numerics.md J1, and fails too);
  * float zero points (``zero_point``, ``zero_points``, ``*_zero_point``):
    finite (a NaN float8 zero point makes every output NaN); for an integer
    dtype (LSQ's learned zero point) also within the
    dtype's range once rounded, where it would be clipped silently;
  * uint8 codes of a sub-byte dtype (``x`` of :func:`dequantize_linear` with
    ``packed_dtype`` alone and of :func:`pack` with ``dtype``, float6 zero
    points given as codes): below ``2**bits``, where the high bits would be
    dropped silently.

  NaN and infinities in ``x`` are legal ONNX inputs and pass. The first
  failed check is raised as ``jax.experimental.checkify.JaxRuntimeError`` (a
  ``ValueError``) naming the op, the argument, the first bad value and its
  index. ``function`` may be jitted,
  vmapped or differentiated inside; put ``jax.jit`` inside ``checked``, not
  around it (a check cannot raise from a compiled program). Outside
  ``checked`` the ops trace exactly as without it: checking costs nothing
  when off.

  Args:
    function: any function calling jaxquant ops.

  Returns:
    A function with ``function``'s arguments and results that runs it
    checked: ``checkify.checkify(function)``, then raises the first error.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> quantize = jax.jit(
    ...     lambda x, scale: jq.quantize_linear(x, scale, output_dtype=jnp.int8, axis=0))
    >>> quantize(jnp.ones(2), jnp.array([0.5, -0.5]))  # no error, a flipped sign
    Array([ 2, -2], dtype=int8)
    >>> from jax.experimental import checkify
    >>> try:
    ...   jq.checked(quantize)(jnp.ones(2), jnp.array([0.5, -0.5]))
    ... except checkify.JaxRuntimeError as error:
    ...   print(error)
    quantize_linear: scale must be finite and > 0, got -0.5 at index (1,). (`check` failed)
  """

  @functools.wraps(function)
  def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
    # NumPy float arrays (scales) as JAX arrays: checkify's vmap rule indexes a
    # NumPy check payload with a tracer, which fails (jax 0.10.2). Integer ones
    # stay NumPy for the ops' host checks (an int64 zero point is refused), and
    # so do ml_dtypes' (kind "V"), float6 codes among them.
    args, kwargs = jax.tree.map(
        lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a,
        (args, kwargs))
    with _CHECKING(True):
      error, out = checkify.checkify(function)(*args, **kwargs)
    checkify.check_error(error)
    return out

  return run


def enabled() -> bool:
  """Whether the ops are being traced inside :func:`checked`."""
  return _CHECKING.value


def unchecked() -> Any:
  """A context in which ops check nothing: for parameters the library computed itself
  (from statistics of x, whose infinities are legal), which the caller never passed."""
  return _CHECKING(False)


def _quantized(dtype: Any) -> _dtypes.QuantizedDType | None:
  if dtype is None:
    return None
  return _dtypes._QUANTIZED_DTYPES.get(_dtypes._as_dtype(dtype))  # pylint: disable=protected-access


def _require(function: str, argument: str, expected: str, value: jax.Array,
             bad: jax.Array) -> None:
  """A check that no element of ``bad`` is set, reporting the first one's value and index."""
  if not bad.size:
    return
  prefix = f"{function}: {argument} must be {expected}, got {{}}"
  if not bad.ndim:
    checkify.check(~bad, prefix + ".", value)
    return
  first = jnp.argmax(bad.reshape(-1))
  index = jnp.unravel_index(first, bad.shape)
  coordinates = ", ".join(["{}"] * bad.ndim) + ("," if bad.ndim == 1 else "")
  checkify.check(
      ~jnp.any(bad), f"{prefix} at index ({coordinates}).", value.reshape(-1)[first], *index
  )


def _op_dtype(arguments: dict[str, Any]) -> _dtypes.QuantizedDType | None:
  """The quantized dtype an op works in, where one of its options or x names it."""
  x = arguments.get("x")
  for candidate in (arguments.get("packed_dtype"), arguments.get("dtype"),
                    arguments.get("output_dtype"), _dtypes.host_codes("x", x)[1]):
    info = _quantized(candidate)
    if info is not None:
      return info
  return None


def _check_codes(function: str, argument: str, codes: jax.Array,
                 info: _dtypes.QuantizedDType) -> None:
  limit = 1 << info.bits
  _require(
      function, argument, f"below {limit} ({info.name} codes have {info.bits} bits)", codes,
      codes >= limit,
  )


def check(function: str, arguments: dict[str, Any]) -> None:
  """Emits the checks of :func:`checked` for one op's bound ``arguments``."""
  info = _op_dtype(arguments)
  for argument, value in arguments.items():
    if value is None:
      continue
    if argument in ("scale", "scales") or argument.endswith("_scale"):
      scale = jnp.asarray(value)
      wide = scale.astype(jnp.float32)
      _require(function, argument, "finite and > 0", scale,
               ~(jnp.isfinite(wide) & (wide > 0)))
    elif argument in ("zero_point", "zero_points") or argument.endswith("_zero_point"):
      if _dtypes.host_codes(argument, value)[1] is not None:
        continue  # NumPy float6 values: every code is a finite number.
      zero_point = jnp.asarray(value)
      if jnp.issubdtype(zero_point.dtype, jnp.floating):
        wide = zero_point.astype(jnp.float32)
        if info is not None and info.is_integer:
          rounded = jnp.round(wide)
          _require(
              function, argument, f"finite and within [{info.min}, {info.max}] for "
              f"{info.name} once rounded", zero_point,
              ~(jnp.isfinite(wide) & (rounded >= info.min) & (rounded <= info.max)),
          )
        else:
          _require(function, argument, "finite", zero_point, ~jnp.isfinite(wide))
      elif zero_point.dtype == jnp.uint8 and info is not None and info.as_codes:
        _check_codes(function, argument, zero_point, info)
    elif (argument == "x" and info is not None and info.bits < 8
          and arguments.get("packed_shape") is None
          and np.dtype(getattr(value, "dtype", None)) == np.uint8):
      _check_codes(function, argument, jnp.asarray(value), info)
