"""The one place argument errors are raised, so every op reports them alike.

Every message reads ``<op>: <argument> must be <expected>, got <actual>.`` and
is raised at trace time, before any XLA computation is built. A helper raises
it without knowing which op called it (:func:`fail`); the public op it
propagates out of names itself (:func:`named`, called by :func:`reports_as`
and by every ``_bind.op``), so no op name is threaded through the helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import NoReturn, ParamSpec, TypeVar

from jax import export
import numpy as np

_P = ParamSpec("_P")
_T = TypeVar("_T")


# The attribute ``fail`` sets on the errors it raises: the name of the public
# op that reported the error, ``None`` until one has. The errors stay plain
# ``ValueError``/``TypeError`` instances, as the docstrings promise.
_OP = "_jaxquant_op"

ERRORS = (ValueError, TypeError)


def fail(
    argument: str,
    expected: str,
    got: object,
    *,
    error: type[Exception] = ValueError,
) -> NoReturn:
  """Raises ``error`` with the library's single message format (the op added by :func:`reports_as`)."""
  exception = error(f"{argument} must be {expected}, got {got}.")
  setattr(exception, _OP, None)
  raise exception


def named(error: Exception, op: str) -> None:
  """Puts ``op``'s name in front of a :func:`fail` error's message, unless an inner op already did."""
  if getattr(error, _OP, op) is None:
    setattr(error, _OP, op)
    error.args = (f"{op}: {error.args[0]}",) + error.args[1:]


def reports_as(op: str) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
  """Decorates a public function: argument errors leaving it carry ``op``'s name.

  The innermost public op names an error (an op calling another op reports
  the inner op's argument as the inner op's).
  """

  def decorate(function: Callable[_P, _T]) -> Callable[_P, _T]:
    @functools.wraps(function)
    def reporting(*args: _P.args, **kwargs: _P.kwargs) -> _T:
      try:
        return function(*args, **kwargs)
      except ERRORS as error:
        named(error, op)
        raise

    return reporting

  return decorate


def check(
    condition: bool,
    argument: str,
    expected: str,
    got: object,
    *,
    error: type[Exception] = ValueError,
) -> None:
  """Calls :func:`fail` unless ``condition`` holds."""
  if not condition:
    fail(argument, expected, got, error=error)


def static_int(argument: str, value: object) -> int:
  """Checks that a static option is an integer (a bool is none here)."""
  check(
      isinstance(value, (int, np.integer)) and not isinstance(value, bool),
      argument, "an int", repr(value), error=TypeError,
  )
  return int(value)


def block_size(value: object) -> int:
  """Checks ``block_size``: a non-negative int, 0 meaning not blocked."""
  value = static_int("block_size", value)
  check(value >= 0, "block_size", "a non-negative int", value)
  return value


def static_bool(argument: str, value: object) -> bool:
  """Checks a static flag, so that a string such as 'no' is not silently true."""
  check(
      isinstance(value, (bool, np.bool_)), argument, "a bool", repr(value),
      error=TypeError,
  )
  return bool(value)


def normalize_axis(axis: object, ndim: int) -> int:
  """Returns ``axis`` as a non-negative index into a rank-``ndim`` array."""
  axis = static_int("axis", axis)
  check(
      -ndim <= axis < ndim, "axis",
      f"an int in [{-ndim}, {ndim}) for an input of rank {ndim}", axis,
  )
  return axis % ndim


def static_shape(argument: str, value: object) -> tuple[int, ...]:
  """A shape given as a sequence of non-negative Python ints, as a tuple.

  A symbolic dim (``jax.export``'s batch, from a traced x's shape) is kept.
  """
  check(
      isinstance(value, Sequence) and all(
          export.is_symbolic_dim(n) or (
              isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0)
          for n in value
      ),
      argument, "a sequence of non-negative ints", repr(value), error=TypeError,
  )
  return tuple(n if export.is_symbolic_dim(n) else int(n) for n in value)
