"""The one place argument errors are raised, so every op reports them alike.

Every message reads ``<function>: <argument> must be <expected>, got <actual>.``
and is raised at trace time, before any XLA computation is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from jax import export
import numpy as np


def fail(
    function: str,
    argument: str,
    expected: str,
    got: object,
    *,
    error: type[Exception] = ValueError,
) -> NoReturn:
  """Raises ``error`` with the library's single message format."""
  raise error(f"{function}: {argument} must be {expected}, got {got}.")


def check(
    condition: bool,
    function: str,
    argument: str,
    expected: str,
    got: object,
    *,
    error: type[Exception] = ValueError,
) -> None:
  """Calls :func:`fail` unless ``condition`` holds."""
  if not condition:
    fail(function, argument, expected, got, error=error)


def static_int(function: str, argument: str, value: object) -> int:
  """Checks that a static option is an integer (a bool is none here)."""
  check(
      isinstance(value, (int, np.integer)) and not isinstance(value, bool),
      function, argument, "an int", repr(value), error=TypeError,
  )
  return int(value)


def block_size(function: str, value: object) -> int:
  """Checks ``block_size``: a non-negative int, 0 meaning not blocked."""
  value = static_int(function, "block_size", value)
  check(value >= 0, function, "block_size", "a non-negative int", value)
  return value


def static_bool(function: str, argument: str, value: object) -> bool:
  """Checks a static flag, so that a string such as 'no' is not silently true."""
  check(
      isinstance(value, (bool, np.bool_)), function, argument, "a bool", repr(value),
      error=TypeError,
  )
  return bool(value)


def normalize_axis(function: str, axis: object, ndim: int) -> int:
  """Returns ``axis`` as a non-negative index into a rank-``ndim`` array."""
  axis = static_int(function, "axis", axis)
  check(
      -ndim <= axis < ndim, function, "axis",
      f"an int in [{-ndim}, {ndim}) for an input of rank {ndim}", axis,
  )
  return axis % ndim


def static_shape(function: str, argument: str, value: object) -> tuple[int, ...]:
  """A shape given as a sequence of non-negative Python ints, as a tuple.

  A symbolic dim (``jax.export``'s batch, from a traced x's shape) is kept.
  """
  check(
      isinstance(value, Sequence) and all(
          export.is_symbolic_dim(n) or (
              isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0)
          for n in value
      ),
      function, argument, "a sequence of non-negative ints", repr(value), error=TypeError,
  )
  return tuple(n if export.is_symbolic_dim(n) else int(n) for n in value)
