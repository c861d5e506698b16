"""An array's split over an explicit mesh, as the ops read and keep it.

On an explicit mesh (``jax.sharding.AxisType.Explicit``, ``jax.make_mesh``'s
default) the split is part of an array's type, and JAX checks each
operation's shardings while tracing: a concatenation, a select or a reshape
across a split raises where automatic sharding would let XLA move data. Under
automatic sharding every type reads as unsplit, and these helpers change
nothing (docs/sharding.md, "Explicit meshes").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any

import jax
from jax import lax

_P = jax.sharding.PartitionSpec


def split_dims(x: jax.Array) -> frozenset[int]:
  """The dims of ``x`` split over an explicit mesh's axes."""
  return frozenset(d for d, axes in enumerate(jax.typeof(x).sharding.spec)
                   if axes is not None and axes is not _P.UNCONSTRAINED)


def shards(x: jax.Array, dim: int) -> int:
  """How many pieces an explicit mesh splits ``x``'s ``dim`` into (1 where it is whole)."""
  if dim not in split_dims(x):
    return 1
  sharding = jax.typeof(x).sharding
  axes = sharding.spec[dim]
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(sharding.mesh.shape[axis] for axis in axes)


def _unsplit(x: jax.Array, dims: Sequence[int]) -> jax.sharding.NamedSharding:
  """x's sharding, with its ``dims`` whole."""
  sharding = jax.typeof(x).sharding
  return sharding.update(spec=_P(*[None if d in dims else axes
                                   for d, axes in enumerate(sharding.spec)]))


def whole(x: jax.Array) -> jax.Array:
  """``x`` gathered whole on every device, where it is split."""
  if not split_dims(x):
    return x
  return jax.sharding.reshard(x, _unsplit(x, range(x.ndim)))


def split_like(param: jax.Array, x: jax.Array) -> jax.Array:
  """``param`` (x's rank) split as x is along the dims it spans whole: a local slice.

  A select takes only operands split alike, and a parameter expanded over
  blocks (a reshape) comes out unsplit.
  """
  if param.ndim != x.ndim or not split_dims(x):
    return param
  sharding = jax.typeof(x).sharding
  spec = tuple(axes if n == length else None
               for axes, n, length in zip(sharding.spec, param.shape, x.shape))
  if tuple(jax.typeof(param).sharding.spec) == spec:
    return param
  return jax.sharding.reshard(param, sharding.update(spec=_P(*spec)))


def ones_split_like(x: jax.Array, dims: Sequence[int]) -> jax.Array:
  """Ones shaped like ``x`` with its ``dims`` of size 1, split like ``x`` elsewhere."""
  shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape))
  return lax.full(shape, 1, x.dtype, sharding=_unsplit(x, dims))


def unsplit_along(function: Callable[[jax.Array], jax.Array], x: jax.Array,
                  dims: Sequence[int]) -> jax.Array:
  """``function(x)`` (x's rank) by automatic sharding, split like x but along ``dims``.

  For what an explicit mesh cannot type along a split dim: a reduction of
  windows there has a halo to exchange and an output that need not divide
  evenly (12 blocks over 8 devices), rows packed there have bytes that a
  shard edge may cut. Automatic sharding moves what that takes, and the
  result comes back split like x, whole along ``dims``.
  """
  out_sharding = _unsplit(x, dims)
  with jax.sharding.use_abstract_mesh(out_sharding.mesh):
    return jax.sharding.auto_axes(function, out_sharding=out_sharding)(x)


def placed(contraction: Callable[..., Any], out_sharding: Any, *operands: Any) -> Any:
  """``contraction(*operands)``, its result placed by ``out_sharding`` as lax's own take it.

  On an explicit mesh ``lax.dot_general`` needs ``out_sharding`` where
  contracted dims are split, and an integer contraction is several dots (one
  per platform, slices of a deep K, taps of a convolution) and sums: automatic
  sharding places those (their int32 partials add exactly) and
  ``out_sharding`` the result. Elsewhere it constrains the result. Any
  function whose intermediates an explicit mesh cannot type is run so too,
  ``out_sharding`` a pytree like its result.
  """
  if out_sharding is None:
    return contraction(*operands)
  meshes = [jax.sharding.get_abstract_mesh()] + [
      jax.typeof(x).sharding.mesh for x in jax.tree.leaves(operands)]
  explicit = [mesh for mesh in meshes if mesh.explicit_axes]
  if not explicit:
    return lax.with_sharding_constraint(contraction(*operands), out_sharding)
  with jax.sharding.use_abstract_mesh(explicit[0]):
    return jax.sharding.auto_axes(contraction, out_sharding=out_sharding)(*operands)
