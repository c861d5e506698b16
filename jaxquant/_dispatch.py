"""``implementation=``: which code path runs an op (all give the same bits)."""

from __future__ import annotations

import jax

from jaxquant import _validate

IMPLEMENTATIONS = (None, "xla", "pallas")

# Per backend, the ops whose Pallas kernel was measured faster than XLA there
# (benchmarks/kernels.py). Only these are picked by ``implementation=None``.
# Empty: no kernel has yet been timed on a GPU or TPU, and on CPU the kernels
# run in interpret mode, orders of magnitude slower than XLA.
PALLAS_FASTER: dict[str, frozenset[str]] = {}


def select(function: str, implementation: str | None) -> str:
  """Returns the implementation that runs ``function``: ``"xla"`` or ``"pallas"``.

  ``None`` picks the Pallas kernel only where :data:`PALLAS_FASTER` lists it
  for the default backend, else XLA.

  Raises:
    ValueError: for an unknown ``implementation``.
  """
  _validate.check(
      implementation in IMPLEMENTATIONS, function, "implementation",
      "None, 'xla' or 'pallas'", repr(implementation),
  )
  if implementation is None:
    faster = PALLAS_FASTER.get(jax.default_backend(), frozenset())
    return "pallas" if function in faster else "xla"
  return implementation
