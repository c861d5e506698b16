"""IEEE-exact division and rounding inside Triton kernels.

Pallas lowers ``x / y`` on float32 to Triton's ``arith.divf``, which Triton
emits as PTX ``div.full.f32``: an approximation with up to 2 ulp of error,
enough to move a quotient across a rounding tie. And Pallas has no Triton
lowering for ``lax.round`` at all. :func:`exact` re-evaluates a formula's jaxpr
with the two replaced: division by PTX ``div.rn.f32`` (IEEE round to nearest
even, what XLA emits) and round-half-to-even by ``floor`` and an exact
comparison of the fraction with 1/2. (The shorter ``(x + 2**23) - 2**23`` is
folded to ``x`` by XLA's simplifier, which interpret mode runs through.)
The formula itself is written once, in plain ``jnp``, and means the same on
every backend.

The same re-evaluation drops optimization barriers, which no kernel backend
lowers: jaxquant's division places one so that XLA cannot constant-fold its
guard, and inside a kernel the operands are loads, never constants. With the
PTX division the guard itself (a zero computed as ``clz(v) >> k``, which XLA's
simplifier cannot see through) is given as zeros: Triton never rewrites a
division, and its clz would be a binary search per element. It
resolves ``lax.platform_dependent`` to its default branch: a formula's
platform branches are XLA's (an XLA:CPU conversion, XLA:GPU's division in
float64), and a kernel's own needs are these replacements. Two more
primitives that Triton cannot lower get exact replacements: ``lax.clz`` (a
binary search over the bits; an H100 refused the kernels that held it) and
``lax.reduce_precision`` to bfloat16's precision (rounding the bits), which
Mosaic cannot lower either.
"""

from __future__ import annotations

from collections.abc import Callable
import functools

import jax
from jax import lax
from jax.extend import core as jax_core
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp
import numpy as np

def round_half_to_even(x: jax.Array) -> jax.Array:
  """``jnp.round`` for float32 or float64 from ``floor`` (which Triton and Mosaic both lower).

  ``x - floor(x)`` is exact, so ties are seen exactly; the sign is copied back
  so that -0.3 rounds to -0.0. Beyond 2**p (p mantissa bits) every float is
  an integer.
  """
  floor = jnp.floor(x)
  fraction = x - floor
  odd = floor - 2 * jnp.floor(floor * 0.5)
  rounded = floor + jnp.where(fraction > 0.5, 1.0, jnp.where(fraction < 0.5, 0.0, odd))
  integral = x.dtype.type(2.0 ** jnp.finfo(x.dtype).nmant)
  return jnp.where(jnp.abs(x) < integral, jnp.copysign(rounded, x), x)


def round_mantissa(x: jax.Array, mantissa_bits: int) -> jax.Array:
  """``lax.reduce_precision(x, 8, mantissa_bits)`` for float32, on its bits.

  With float32's own exponent range (bfloat16's) there is nothing to flush or
  clamp: rounding the bits to nearest even rounds the value, carrying into
  the exponent and up to infinity as it should; NaN is kept.
  """
  dropped = jnp.finfo(np.float32).nmant - mantissa_bits
  if dropped <= 0:
    return x
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  odd = (bits >> np.uint32(dropped)) & np.uint32(1)
  half = np.uint32((1 << (dropped - 1)) - 1)
  kept = (bits + half + odd) & np.uint32(~((1 << dropped) - 1) & 0xFFFFFFFF)
  return jnp.where(jnp.isnan(x), x, lax.bitcast_convert_type(kept, jnp.float32))


def _divide_rn(x: jax.Array, y: jax.Array) -> jax.Array:
  x, y = jnp.broadcast_arrays(x, y)
  (quotient,) = pltriton.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;",
      args=[x, y],
      constraints="=r,r,r",
      pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
  )
  return quotient


def count_leading_zeros(x: jax.Array) -> jax.Array:
  """``lax.clz`` of an unsigned or signed integer array, by a binary search over its bits."""
  width = 8 * x.dtype.itemsize
  unsigned = jnp.dtype(f"uint{width}")
  bits = lax.bitcast_convert_type(x, unsigned) if x.dtype != unsigned else x
  count = jnp.zeros(x.shape, unsigned)
  shift = width // 2
  while shift:
    # The top ``shift`` bits of what is left are zero: count them, look lower.
    top_clear = bits < unsigned.type(1 << (width - shift))
    count = jnp.where(top_clear, count + unsigned.type(shift), count)
    bits = jnp.where(top_clear, bits << unsigned.type(shift), bits)
    shift //= 2
  count = count + (bits == 0).astype(unsigned)
  return lax.bitcast_convert_type(count, x.dtype) if x.dtype != unsigned else count


def _replacement(equation, *, divide: bool, rounding: bool):
  """The function replacing ``equation``'s primitive, or ``None`` to keep it.

  The replacement returns the equation's outputs as a list.
  """
  if equation.primitive is lax.optimization_barrier_p:
    return lambda *values: list(values)
  if equation.primitive is lax.clz_p and rounding:
    return lambda x: [count_leading_zeros(x)]
  if rounding and equation.primitive is lax.neg_p and jnp.issubdtype(
      equation.invars[0].aval.dtype, jnp.floating):
    # Triton lowers negation as 0 - x, which is +0 for x = +0: a multiply flips the sign.
    return lambda x: [x * np.asarray(-1, x.dtype)]
  float32 = all(v.aval.dtype == np.float32 for v in equation.invars)
  float32_or_64 = all(v.aval.dtype in (np.float32, np.float64) for v in equation.invars)
  if rounding and equation.primitive is lax.round_p and float32_or_64 and (
      equation.params["rounding_method"] == lax.RoundingMethod.TO_NEAREST_EVEN
  ):
    return lambda x: [round_half_to_even(x)]
  if equation.primitive is lax.reduce_precision_p and float32 and (
      equation.params["exponent_bits"] == 8
  ):
    return lambda x: [round_mantissa(x, equation.params["mantissa_bits"])]
  if divide and equation.primitive is lax.div_p and float32:
    return lambda x, y: [_divide_rn(x, y)]
  return None


def _evaluate(jaxpr, consts, *args, divide: bool, rounding: bool):
  env = {}

  def read(v):
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  zeros, dead = _division_guard(jaxpr) if divide else (set(), set())
  for equation in jaxpr.eqns:
    if equation.outvars[0] in zeros:
      (out,) = equation.outvars
      env[out] = jnp.zeros(out.aval.shape, out.aval.dtype)
      continue
    if equation.outvars[0] in dead:
      continue
    inputs = [read(v) for v in equation.invars]
    replacement = _replacement(equation, divide=divide, rounding=rounding)
    # jnp functions that are jitted themselves (jnp.clip, jnp.round, ...), and
    # custom_vmap functions, which a kernel body never batches.
    inner = equation.params.get("jaxpr", equation.params.get("call"))
    if equation.params.get("branches_platforms"):
      # lax.platform_dependent: its default branch (the one for no named platform).
      default = equation.params["branches_platforms"].index(None)
      inner = equation.params["branches"][default]
      inputs = inputs[1:]
    if equation.primitive.name == "platform_index":
      outputs = [None]  # read only by the platform-dependent cond, resolved above
    elif replacement is not None:
      outputs = replacement(*inputs)
    elif isinstance(inner, jax_core.ClosedJaxpr):
      outputs = _evaluate(inner.jaxpr, inner.consts, *inputs, divide=divide,
                          rounding=rounding)
    else:
      outputs = equation.primitive.bind(*inputs, **equation.params)
      if not equation.primitive.multiple_results:
        outputs = [outputs]
    for var, value in zip(equation.outvars, outputs):
      env[var] = value
  return [read(v) for v in jaxpr.outvars]


def _is_guard_zero(equation, clz_outputs) -> bool:
  """Whether ``equation`` is ``clz(v) >> k`` with ``2**k`` above v's width: 0 for every v."""
  if equation.primitive is not lax.shift_right_logical_p:
    return False
  value, amount = equation.invars
  return (isinstance(value, jax_core.Var) and value in clz_outputs
          and isinstance(amount, jax_core.Literal)
          and bool(np.all(np.asarray(amount.val) >= (8 * value.aval.dtype.itemsize).bit_length())))


def _division_guard(jaxpr) -> tuple[set, set]:
  """The outputs of :func:`_is_guard_zero` equations, and what only they read.

  jaxquant guards a division with such a zero, which XLA cannot see. Triton
  never rewrites a division, so with PTX division the zero is given as zeros
  and what computed its operand (a clz, a binary search on Triton) is skipped.
  """
  clz_outputs = {e.outvars[0] for e in jaxpr.eqns if e.primitive is lax.clz_p}
  zeros = {e.outvars[0] for e in jaxpr.eqns if _is_guard_zero(e, clz_outputs)}
  live = {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
  for equation in reversed(jaxpr.eqns):
    if equation.outvars[0] not in zeros and live.intersection(equation.outvars):
      live.update(v for v in equation.invars if isinstance(v, jax_core.Var))
  dead = {e.outvars[0] for e in jaxpr.eqns if not live.intersection(e.outvars)}
  return zeros, dead - zeros


def exact(
    formula: Callable[..., object], *, divide: bool = True, rounding: bool = True
) -> Callable[..., object]:
  """``formula`` as a kernel body: exact for Triton, without optimization barriers.

  A float32 ``reduce_precision`` (bfloat16's precision, a float8's
  significand) is always rounded by :func:`round_mantissa`: neither Triton
  nor Mosaic lowers it.

  Args:
    formula: a function of arrays built from ``jnp``/``lax`` operations.
    divide: replace float32 division by PTX ``div.rn.f32`` (CUDA only; off
      in interpret mode and on ROCm, whose ``fdiv`` lowering is already IEEE).
    rounding: replace float32 and float64 round-half-to-even by
      :func:`round_half_to_even` and ``clz`` by :func:`count_leading_zeros`
      (Triton lowers neither; Mosaic does), and float negation by a
      multiplication by -1 (Triton's ``0 - x`` loses the sign of a zero).

  Returns:
    A function with ``formula``'s signature and results.
  """

  @functools.wraps(formula)
  def wrapped(*args):
    closed, out_tree = jax.make_jaxpr(formula, return_shape=True)(*args)
    flat_args = jax.tree.leaves(args)
    outputs = _evaluate(closed.jaxpr, closed.consts, *flat_args, divide=divide,
                        rounding=rounding)
    return jax.tree.unflatten(jax.tree.structure(out_tree), outputs)

  return wrapped
