"""One call, a different function per platform, each lowered for its own platform only.

``lax.platform_dependent`` lowers every branch for every platform of the
module: exporting for ``("cpu", "tpu")`` lowers the Mosaic ``pallas_call`` for
CPU too, which Pallas refuses ("Only interpret mode is supported on CPU
backend"), and ``("cuda", "tpu")`` hands Triton's compiler parameters to the
Mosaic lowering. :func:`per_platform` binds one primitive whose lowering rule
is registered per platform, so JAX's multi-platform lowering gives each rule a
context holding just its platforms (``mlir.lower_per_platform``), and a
kernel is only ever lowered for the platform it was written for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import jax
from jax.extend import core as jex_core
from jax.interpreters import batching
from jax.interpreters import mlir

PLATFORMS = ("cpu", "tpu", "cuda", "rocm")

_per_platform_p = jex_core.Primitive("per_platform")
_per_platform_p.multiple_results = True


def per_platform(
    arrays: Sequence[jax.Array], *, default: Callable[..., Sequence[jax.Array]],
    **branches: Callable[..., Sequence[jax.Array]],
) -> list[jax.Array]:
  """``branches[platform](*arrays)`` on the platform the program runs on.

  Args:
    arrays: the operands, passed positionally to the branch.
    default: the branch for a platform not named in ``branches``.
    **branches: per platform of :data:`PLATFORMS`, a function of ``arrays``
      returning a sequence of arrays; every branch returns the same shapes
      and dtypes.

  Returns:
    The branch's results, as a list.
  """
  unknown = set(branches) - set(PLATFORMS)
  if unknown:
    raise ValueError(f"per_platform: unknown platforms {sorted(unknown)}; known: {PLATFORMS}")
  functions = [default, *dict.fromkeys(f for f in branches.values() if f is not default)]
  # Their types, sharding included: an explicit mesh's split is part of the
  # type, and the results' types are the default branch's.
  avals = [jax.typeof(a) for a in arrays]
  jaxprs = tuple(jax.make_jaxpr(lambda *a, f=f: list(f(*a)))(*avals) for f in functions)
  index = tuple((p, functions.index(branches.get(p, default))) for p in PLATFORMS)
  return _per_platform_p.bind(*arrays, branches=jaxprs, index=index)


def _branch(branches, index, platform: str) -> Callable[..., list[jax.Array]]:
  """The branch lowered for ``platform`` (the first is the default)."""
  return jex_core.jaxpr_as_fun(branches[dict(index).get(platform, 0)])


def _impl(*arrays, branches, index):
  # Compiled even under jax.disable_jit(), where the jitted bind would call
  # this again, forever: the branch is chosen when the program is lowered.
  with jax.disable_jit(False):
    return jax.jit(lambda *a: _per_platform_p.bind(*a, branches=branches, index=index))(*arrays)


def _abstract_eval(*avals, branches, index):
  del avals, index
  return branches[0].out_avals


def _lowering(platform: str):
  def lower(ctx, *arrays, branches, index):
    return mlir.lower_fun(_branch(branches, index, platform), multiple_results=True)(
        ctx, *arrays)

  return lower


def _batch(arrays, dims, *, branches, index):
  """vmap maps each branch: a kernel's own batching rule adds a grid axis."""
  # batching.not_mapped is None, vmap's own marker of an unmapped argument.
  avals = [jax.typeof(a) for a in arrays]
  batched = tuple(
      jax.make_jaxpr(jax.vmap(jex_core.jaxpr_as_fun(b), in_axes=tuple(dims)))(*avals)
      for b in branches
  )
  results = _per_platform_p.bind(*arrays, branches=batched, index=index)
  return results, [0] * len(results)


_per_platform_p.def_impl(_impl)
_per_platform_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[_per_platform_p] = _batch
mlir.register_lowering(_per_platform_p, _lowering("default"))
for _platform in PLATFORMS:
  mlir.register_lowering(_per_platform_p, _lowering(_platform), platform=_platform)
