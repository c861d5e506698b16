"""``implementation=``: which code path runs an op (all give the same bits)."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec

from pallas_kernels import _platforms


IMPLEMENTATIONS = (None, "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Route:
  """What chooses an op's evaluation: the op, its quantized dtype and its layout.

  In a :data:`PALLAS_FASTER` entry, ``None`` for the dtype or the layout
  matches any.

  Attributes:
    op: the public op's name.
    dtype: the quantized dtype's name (``"int8"``, ``"int4"``, ...).
    layout: the parameters' granularity kind (``"per-tensor"``, ``"blocked"``, ...).
    packed: whether the kernel would read sub-byte values packed in bytes
      (``dequantize_linear``'s calls say; in an entry, ``None`` matches either).
  """

  op: str
  dtype: str | None = None
  layout: str | None = None
  packed: bool | None = None

  def covers(self, call: Route) -> bool:
    """Whether this entry applies to ``call``."""
    return (self.op == call.op and self.dtype in (None, call.dtype)
            and self.layout in (None, call.layout) and self.packed in (None, call.packed))


# Per platform (as lowered: "cpu", "cuda", "rocm", "tpu"), the routes whose
# Pallas kernel was measured faster than XLA there (benchmarks/kernels.py).
# Only these are picked by ``implementation=None``, and only on that platform:
# the choice is made when the program is lowered, so one exported program runs
# the kernel where it was measured faster and XLA elsewhere.
# CUDA (an H100, three runs at 16M and 64M elements; docs/numerics.md): the
# quantized add and the per-row dynamic quantize kernels were faster in every
# run; the others were slower in at least one (blocked int4 dequantization,
# listed from an earlier run, 0.68x at 64M: XLA's own got faster).
# On CPU the kernels run in interpret mode, orders of magnitude slower than
# XLA; TPU is not yet timed.
PALLAS_FASTER: dict[str, frozenset[Route]] = {
    "cuda": frozenset({
        Route("quantized_add", "int8", "per-tensor"),
        Route("dynamic_quantize_linear", "int8", "per-axis"),
    }),
}


def kernel_platforms(call: Route, implementation: str | None) -> frozenset[str] | None:
  """Where ``call`` runs its kernel: ``None`` on every platform, else these.

  ``"pallas"`` runs the kernel everywhere; ``None``, on the platforms where
  an entry of :data:`PALLAS_FASTER` covers ``call`` (possibly none);
  ``"xla"``, nowhere. ``implementation`` was checked when the op's call was
  bound (``_bind.IMPLEMENTATION``).
  """
  if implementation == "pallas":
    return None
  if implementation == "xla":
    return frozenset()
  return frozenset(
      platform for platform, routes in PALLAS_FASTER.items()
      if any(route.covers(call) for route in routes))


def runs_kernel(call: Route, implementation: str | None) -> bool:
  """Whether ``call``'s program holds its kernel (for at least one platform)."""
  return kernel_platforms(call, implementation) != frozenset()


def evaluate(
    call: Route,
    implementation: str | None,
    xla: Callable[..., Any],
    kernel: Callable[..., Any] | None,
    *args: Any,
) -> Any:
  """An op's evaluation: ``xla(*args)``, or ``kernel(*args)`` where it is chosen.

  The kernel runs on the platforms :func:`kernel_platforms` gives, decided
  when the program is lowered, with ``xla``'s derivatives
  (:func:`with_xla_derivatives`); ``xla`` everywhere else. ``kernel=None``
  says the call has no kernel evaluation (an empty x), so XLA's runs.
  """
  platforms = kernel_platforms(call, implementation)
  if kernel is None or platforms == frozenset():
    return xla(*args)
  return with_xla_derivatives(kernel, xla, platforms=platforms)(*args)


def with_xla_derivatives(
    kernel: Callable[..., Any], xla: Callable[..., Any], *,
    platforms: frozenset[str] | None = None,
) -> Callable[..., Any]:
  """``kernel``'s values with ``xla``'s derivatives, to every order.

  A ``pallas_call`` cannot be differentiated (JAX would linearize the kernel
  body, loads and all), so a Pallas op takes the derivative of its XLA
  evaluation, which computes the same values: the same derivatives on every
  implementation by construction. The JVP rule calls the op itself again for
  its primal output, so second derivatives come through the same rule.

  Inside ``jax.shard_map`` the kernel runs on each shard (see :func:`per_shard`).
  With ``platforms``, the kernel runs on those platforms and ``xla`` on the
  others, chosen when the program is lowered for its platform
  (``pallas_kernels._platforms.per_platform``).

  Args:
    kernel: the Pallas evaluation of an op, a function of arrays (or ``None``).
    xla: the XLA evaluation of the same op, with the same signature.
    platforms: where ``kernel`` runs (:func:`kernel_platforms`); ``None``:
      everywhere.

  Returns:
    A function with their signature: ``kernel``'s values, ``xla``'s JVP.
  """

  @jax.custom_jvp
  def evaluate(*args):
    if platforms is None:
      return per_shard(kernel)(*args)
    leaves, tree = jax.tree.flatten(args)
    results = jax.eval_shape(xla, *args)

    def flat(f):
      return lambda *leaves: jax.tree.leaves(f(*jax.tree.unflatten(tree, leaves)))

    chosen = _platforms.per_platform(
        leaves, default=flat(xla), **dict.fromkeys(platforms, flat(per_shard(kernel))))
    return jax.tree.unflatten(jax.tree.structure(results), chosen)

  @evaluate.defjvp
  def evaluate_jvp(primals, tangents):
    _, tangents_out = jax.jvp(xla, primals, tangents)
    return evaluate(*primals), tangents_out

  return evaluate


def per_shard(kernel: Callable[..., Any]) -> Callable[..., Any]:
  """``kernel``, callable inside ``jax.shard_map`` with its default ``check_vma=True``.

  Inside a ``shard_map`` every array is one shard and the kernel runs on it
  as on a whole array. What JAX's check refuses there is a ``pallas_call``
  whose outputs do not declare which mesh axes they vary over. The kernel is
  called through a ``shard_map`` over no further axes with the check off for
  its body alone, and its outputs are then declared varying over every axis
  any input varies over (``lax.pcast``), which is true of a function of its
  inputs; the enclosing ``shard_map`` checks everything else as before.
  Outside ``shard_map`` (no manual mesh axes) ``kernel`` is returned as is.
  """
  if not jax.sharding.get_abstract_mesh().manual_axes:
    return kernel

  def kernel_of_unmarked(*args):
    # Interpret mode (CPU) runs the kernel as a while_loop carrying its
    # operands, which must keep their types: an operand still marked varying
    # came out of the loop body unmarked (JAX 0.10.2 drops the mark in a
    # reshape when unchecked, keeps it in a copy). A reshape unmarks them all.
    unmark = lambda a: lax.reshape(a, (1, *a.shape))[0] if isinstance(a, jax.Array) else a
    return kernel(*jax.tree.map(unmark, args))

  unchecked = jax.shard_map(
      kernel_of_unmarked, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
      axis_names=frozenset(), check_vma=False,
  )

  def run(*args):
    varying = frozenset().union(*(
        jax.typeof(a).manual_axis_type.varying for a in jax.tree.leaves(args)))

    def declare(y):
      axes = tuple(sorted(varying - jax.typeof(y).manual_axis_type.varying))
      return jax.lax.pcast(y, axes, to="varying") if axes else y

    return jax.tree.map(declare, unchecked(*args))

  return run
