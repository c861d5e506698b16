"""The one place argument errors are raised, so every op reports them alike.

Every message reads ``<function>: <argument> must be <expected>, got <actual>.``
and is raised at trace time, before any XLA computation is built.
"""

from __future__ import annotations

from typing import NoReturn


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


def normalize_axis(function: str, axis: int, ndim: int) -> int:
  """Returns ``axis`` as a non-negative index into a rank-``ndim`` array."""
  check(
      isinstance(axis, int) and -ndim <= axis < ndim,
      function,
      "axis",
      f"an int in [{-ndim}, {ndim}) for an input of rank {ndim}",
      axis,
  )
  return axis % ndim
