"""``implementation=``: which code path runs an op (SPEC §1)."""

from __future__ import annotations

from jaxquant import _validate

IMPLEMENTATIONS = (None, "xla", "pallas")


def select(function: str, implementation: str | None) -> str:
  """Returns the implementation that runs ``function``: ``"xla"`` or ``"pallas"``.

  ``None`` picks the fastest correct path for the backend; until a Pallas
  kernel is measured faster somewhere, that is XLA everywhere.

  Raises:
    ValueError: for an unknown ``implementation``.
    NotImplementedError: for ``"pallas"`` on an op that has no kernel yet.
  """
  _validate.check(
      implementation in IMPLEMENTATIONS, function, "implementation",
      "None, 'xla' or 'pallas'", repr(implementation),
  )
  if implementation == "pallas":
    raise NotImplementedError(
        f"{function}: implementation='pallas' has no fused kernel yet; "
        "use implementation=None or 'xla'."
    )
  return "xla"
