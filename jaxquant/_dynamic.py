"""ONNX DynamicQuantizeLinear, per tensor, per axis and per block (docs/numerics.md)."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _bind
from jaxquant import _dispatch
from jaxquant import _dtypes
from jaxquant import _granularity
from jaxquant import _numerics
from jaxquant import _sharding
from jaxquant import _validate
import pallas_kernels


def _ignoring_nan(plain, nan_aware, nan_aware_in_one_pass, x, prepare):
  """A NaN-ignoring reduction of ``prepare(x)``, the fastest way per backend.

  XLA:CPU vectorizes a plain min or max, but not a reduction with a select
  inside, variadic or not (an order of magnitude slower, measured): there
  ``plain`` runs, and ``nan_aware`` only when NaN propagated into its result.
  Other backends are not measured yet and keep ``nan_aware_in_one_pass``.
  ``prepare`` (a conversion, an ``abs``) runs inside each branch, fused into
  its reduction: the operand of the NaN ``cond`` is x itself, as an operand
  is written out whole. The NaN-aware reductions read x :func:`unfolded`: a
  closed-over x is a constant inside the ``cond``'s branch, which XLA would
  reduce while compiling (1.4 s for a million elements, measured), whether
  or not the branch ever runs. (``plain`` keeps its own reductions unfolded.)

  Under ``vmap`` the predicate is whether any example has a NaN
  (:func:`_any_example`), not batched: the ``cond`` stays one, taking the
  NaN-aware branch only when some example needs it, and keeps ``plain``'s
  statistics for the examples without one (the same bits as example by
  example). Derivatives are JAX's own for the ``cond``, in any order with
  ``vmap``. (A batched predicate would make JAX turn the ``cond`` into a
  select that runs both branches for every example, and, differentiated
  first, guard its tangent operands with ``stop_gradient``, which has no
  transpose: ``grad`` of ``vmap`` raised.)
  """

  def redone(x):
    return nan_aware(prepare(_numerics.unfolded(x)))

  def where_nan(x, result, redo):
    """``result``, with ``redo(x)``'s in its place where (per example) a NaN came out."""
    nan = functools.reduce(jnp.logical_or, [jnp.any(jnp.isnan(r)) for r in jax.tree.leaves(result)])

    def chosen(x, result, nan):
      def replaced(x):
        return jax.tree.map(lambda new, old: jnp.where(nan, new, old), redo(x), result)

      return lax.cond(_any_example(nan), replaced, lambda _: result, x)

    if not _sharding.split_dims(x):
      return chosen(x, result, nan)
    # The per-example where, and a cond whose predicate an outer vmap batches (a
    # select of x), broadcast their predicate unsplit, which an explicit mesh
    # refuses against split cases (jax 0.10.2): the choice runs by automatic
    # sharding, its results typed as plain's.
    return _sharding.placed(
        chosen, jax.tree.map(lambda r: jax.typeof(r).sharding, result), x, result, nan)

  return lax.platform_dependent(
      x, cpu=lambda x: where_nan(x, plain(prepare(x)), redone),
      default=lambda x: nan_aware_in_one_pass(prepare(_numerics.unfolded(x))))


@jax.custom_batching.custom_vmap
def _any_example(flag: jax.Array) -> jax.Array:
  """``flag``, a scalar bool; under ``vmap``, whether any example's is set, not batched."""
  return flag


@_any_example.def_vmap
def _(axis_size, in_batched, flag):
  del axis_size, in_batched  # flag, the one operand, batched along its leading dim
  # Again through _any_example: an outer vmap batches this reduction's result too.
  return _any_example(jnp.any(flag, axis=0)), False


def _reduce(values, initial, combine, axes, *, keepdims=False, windows=None):
  """``values`` reduced by ``combine`` over ``axes``, or over each window of ``windows``.

  ``windows`` (from :func:`_granularity.reduce_blockwise`) reduces blocks of x
  in place, so a shard edge through a block costs a halo, not x gathered. A
  window is never empty, so ``initial`` has nothing to add there.
  """
  if windows is not None:
    return _granularity.reduce_windows(values, combine, windows)
  reduce = {lax.min: jnp.min, lax.max: jnp.max}[combine]
  return reduce(values, axes, keepdims=keepdims, initial=initial)


def _across_threads(reduce, values, axes):
  """``reduce(values, axes)``; to a scalar, first over all but the leading dim, then over it.

  XLA:CPU runs a reduction to a scalar on one thread and splits one to a
  vector across its threads (docs/numerics.md, "Speed on XLA:CPU"). Only
  order-free reductions (min, max) may be split: the result is the same.
  """
  shape = jax.tree.leaves(values)[0].shape
  if len(shape) < 2 or len(axes) != len(shape) or not isinstance(shape[0], int) or shape[0] < 2:
    return reduce(values, axes)
  return reduce(reduce(values, axes[1:]), (0,))


def _order_key(x, *, inverse: bool = False):
  """float32 ``x`` as int32 keys ordered as the floats, or keys back to floats with ``inverse``.

  The bits of a negative float, with the magnitude bits flipped, order below
  every positive one and among themselves by value: -0 just below +0, the
  infinities beyond the finite values and NaNs beyond the infinities (on the
  side of their sign bit). Flipping them again restores the float.
  """
  bits = jnp.asarray(x) if inverse else lax.bitcast_convert_type(jnp.asarray(x), jnp.int32)
  key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
  return lax.bitcast_convert_type(key, jnp.float32) if inverse else key


def _split_among_ties(axes: tuple[int, ...]):
  """``reduce(view) -> (min, max)`` over ``axes`` with the derivative of ``jnp.min``, ``jnp.max``.

  The tangent of an extreme is the mean of the tangents where ``view`` equals
  it (0 where nothing does: an empty view). JAX's own derivative of a variadic
  reduce would split ties by their places in a tree of pairs, and builds that
  tree from static shapes (no ``jax.export`` with a symbolic dim).
  """

  def decorate(reduce):
    reduce = jax.custom_jvp(reduce)

    @reduce.defjvp
    def jvp(primals, tangents):
      (view,), (tangent,) = primals, tangents
      extremes = reduce(view)

      def chosen(extreme):
        at = view == jnp.expand_dims(extreme, axes)
        count = jnp.sum(at, axes, dtype=tangent.dtype)
        return jnp.sum(jnp.where(at, tangent, 0), axes) / jnp.maximum(count, 1)

      return extremes, tuple(chosen(extreme) for extreme in extremes)

    return reduce

  return decorate


def _min_max(
    view: jax.Array, axes: tuple[int, ...], *, keepdims: bool = False,
    windows: tuple[int, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """min and max ignoring NaNs, in float32 (also for float64 x under x64).

  The scale is float32 (ONNX's DynamicQuantizeLinear; every op takes it back),
  so the statistics are too: float64 x is rounded to float32 first, which is
  also how quantizing it by a float32 scale sees it.
  """
  inf = np.float32(np.inf)
  low_high = functools.partial(_reduce, axes=axes, keepdims=keepdims, windows=windows)

  def without_nan(view):
    nan = jnp.isnan(view)
    return jnp.where(nan, jnp.inf, view), jnp.where(nan, -jnp.inf, view)

  def nan_aware(view):
    low, high = without_nan(view)
    return low_high(low, inf, lax.min), low_high(high, -inf, lax.max)

  def one_pass(view):
    if windows is not None:
      # JAX differentiates a windowed min or max, not a variadic pair of them.
      return nan_aware(view)

    @_split_among_ties(axes)
    def variadic_without_nan(view):
      return lax.reduce(
          without_nan(view), (inf, -inf),
          lambda a, b: (lax.min(a[0], b[0]), lax.max(a[1], b[1])), axes,
      )

    return variadic_without_nan(view)

  to_float32 = lambda view: view.astype(jnp.float32)
  if keepdims:
    # A kernel block is already on chip: two plain reductions, which Mosaic
    # and Triton lower.
    return nan_aware(to_float32(view))

  @_split_among_ties(axes)
  def on_keys(view):
    # One variadic reduce reads x once (measured faster than two plain
    # reductions at 1M), on int32 keys in the floats' order, where min and max
    # are one instruction each; a float min or max costs four (NaN
    # propagation and -0 < +0, which the keys keep: the results are the same
    # floats).
    # Unfolded: XLA would evaluate the keys and this variadic reduce of a
    # constant x (a closed-over weight) while compiling, about two seconds
    # per million elements, for a reduce that takes 0.1 ms to run.
    key = _order_key(_numerics.unfolded(view))
    if _down_columns(view, axes):
      # Wide rows (see plain): two plain reductions of the keys.
      low = lax.reduce(key, _order_key(inf), lax.min, axes)
      high = lax.reduce(key, _order_key(-inf), lax.max, axes)
    else:
      low, high = _across_threads(
          lambda values, axes: lax.reduce(
              values, (_order_key(inf), _order_key(-inf)),
              lambda a, b: (lax.min(a[0], b[0]), lax.max(a[1], b[1])), axes),
          (key, key), axes)
    return _order_key(low, inverse=True), _order_key(high, inverse=True)

  @_split_among_ties(axes)
  def float_min_max(view):
    # Behind a barrier, not unfolded: XLA:CPU hands a plain float min or max to
    # YNNPACK only without the XOR in its fusion (see _column_magnitude).
    view = lax.optimization_barrier(view)
    return _nan_where_lost(
        view, axes, (jnp.min(view, axes, initial=inf), jnp.max(view, axes, initial=-inf)))

  def plain(view):
    if windows is not None:
      return _nan_where_lost(
          view, None, (low_high(view, inf, lax.min), low_high(view, -inf, lax.max)))
    # Down columns (the minor dim kept) XLA:CPU reduces the keys' variadic pair in
    # scalar code: a float min and max, which it hands to YNNPACK, were 3-13x
    # faster, and past _WIDE_COLUMNS two plain reductions of the keys (the float
    # loop thrashes the cache; benchmarks/reductions.py). The float ones flush
    # subnormal operands to zero and may give either zero for -0 and +0: every
    # use adds, compares or divides the extremes in XLA:CPU's float arithmetic,
    # which reads a subnormal as a zero and -0 as equal to +0, so the scales and
    # zero points come out the same (tests/test_dynamic.py).
    if _down_columns(view, axes) and not _wide(view):
      return float_min_max(view)
    return on_keys(view)

  return _ignoring_nan(plain, nan_aware, one_pass, view, to_float32)


_WIDE_COLUMNS = 32768


def _down_columns(view: jax.Array, axes: tuple[int, ...]) -> bool:
  """Whether a reduction over ``axes`` keeps the minor dim (one result per column)."""
  return bool(view.ndim) and view.ndim - 1 not in axes


def _wide(view: jax.Array) -> bool:
  """Rows of at least :data:`_WIDE_COLUMNS` (a symbolic length is not known to be)."""
  columns = view.shape[-1]
  return isinstance(columns, int) and columns >= _WIDE_COLUMNS


def _by_extremes(view: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """max(-min x, max x, 0), NaNs ignored: how the other layouts' max|x| is
  differentiated, and so the column reductions' derivative."""
  nan = jnp.isnan(view)
  low = jnp.min(jnp.where(nan, np.float32(np.inf), view), axes, initial=np.float32(np.inf))
  high = jnp.max(jnp.where(nan, np.float32(-np.inf), view), axes, initial=np.float32(-np.inf))
  return jnp.maximum(jnp.maximum(-low, high), np.float32(0))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _column_magnitude(view: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """max|x| over ``axes``, which keep the minor dim, as a float max; NaN to have it redone.

  XLA:CPU flushes a float max's subnormal operands to zero, so a result
  below the least normal float32 (a column of zeros and subnormals) is
  marked NaN, as a NaN in x makes it: :func:`_column_magnitude_ignoring_nan`
  then redoes it exactly. x passes an optimization barrier, not
  :func:`_numerics.unfolded`, against folding a closed-over x: XLA:CPU hands
  ``max(abs(x))`` to YNNPACK, 4-5x faster down a large weight's columns than
  its own loop, which it falls back to with the XOR in the fusion.
  """
  view = lax.optimization_barrier(view)
  magnitude = jnp.max(jnp.abs(view), axes, initial=np.float32(0))
  magnitude = jnp.where(magnitude < np.finfo(np.float32).tiny, np.float32(np.nan), magnitude)
  return _nan_where_lost(view, axes, (magnitude,))[0]


def _nan_where_lost(view: jax.Array, axes: tuple[int, ...] | None,
                    extremes: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """Float ``extremes`` of ``view`` over ``axes`` (``None``: windows, tested over all of
  view), NaN wherever view may hold a NaN, which they may have lost: then
  :func:`_ignoring_nan` redoes them.

  XLA:CPU's float max and min (YNNPACK's, and its own reduce-window) do not
  propagate a NaN: a column's result is the extreme of the values after its
  last NaN, an all-NaN window's the initial value. A float sum cannot lose one
  (it is NaN for +inf beside -inf too, which costs only a redo).
  """
  nan = jnp.isnan(jnp.sum(view, tuple(range(view.ndim)) if axes is None else axes))
  return tuple(jnp.where(nan, np.float32(np.nan), extreme) for extreme in extremes)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _column_magnitude_ignoring_nan(view: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """max|x| over ``axes`` ignoring NaNs, exactly: the integer max of the magnitudes'
  bits, which order as the magnitudes (a NaN's, above infinity's, dropped)."""
  bits = lax.bitcast_convert_type(view, jnp.int32) & np.int32(0x7FFFFFFF)
  bits = jnp.where(bits > np.int32(0x7F800000), np.int32(0), bits)
  return lax.bitcast_convert_type(jnp.max(bits, axes, initial=np.int32(0)), jnp.float32)


def _extremes_jvp(axes, primals, tangents):
  return jax.jvp(functools.partial(_by_extremes, axes=axes), primals, tangents)


_column_magnitude.defjvp(_extremes_jvp)
_column_magnitude_ignoring_nan.defjvp(_extremes_jvp)


def _max_magnitude(
    view: jax.Array, axes: tuple[int, ...], *, keepdims: bool = False,
    windows: tuple[int, ...] | None = None,
) -> tuple[jax.Array]:
  # initial=0: an empty x (or block) has max|x| = 0, hence scale 1.
  maximum = functools.partial(
      _reduce, initial=np.float32(0), combine=lax.max, axes=axes, keepdims=keepdims,
      windows=windows,
  )

  def nan_aware(magnitude):
    return maximum(jnp.where(jnp.isnan(magnitude), 0, magnitude))

  magnitude = lambda view: jnp.abs(view.astype(jnp.float32))
  if keepdims:
    return (nan_aware(magnitude(view)),)
  if windows is not None:
    plain = lambda magnitude: _nan_where_lost(magnitude, None, (maximum(magnitude),))[0]
    return (_ignoring_nan(plain, nan_aware, nan_aware, view, magnitude),)
  if _down_columns(view, axes):
    # The minor dim kept (a (K, N) weight per output feature, a kernel per output
    # channel): XLA:CPU reduces the variadic min and max below down each column in
    # scalar code, several times slower than a float max (benchmarks/reductions.py).
    # Past ~16K columns the float max's loop thrashes the cache; the exact one does not.
    exact = functools.partial(_column_magnitude_ignoring_nan, axes=axes)
    plain = functools.partial(_column_magnitude, axes=axes)
    if _wide(view):
      # Unfolded as _ignoring_nan's plain reductions are: XLA would reduce a closed-over
      # x while compiling (seconds for a few million elements).
      plain = lambda view: exact(_numerics.unfolded(view))
    return (_ignoring_nan(plain, exact, exact, view, lambda view: view.astype(jnp.float32)),)
  # max|x| = max(-min x, max x, 0), the same float. XLA:CPU reduces the min
  # and max keys in vectorized code across threads; a float max it hands to
  # YNNPACK, with |x| (or x converted) written out first.
  low, high = _min_max(view, axes)
  return (jnp.maximum(jnp.maximum(-low, high), np.float32(0)),)


def _asymmetric_parameters(low, high, *, info):
  """The scale and zero point from the range [min(0, lo), max(0, hi)]."""
  qmin, qmax = low.dtype.type(info.min), low.dtype.type(info.max)
  low, high = jnp.minimum(low, 0), jnp.maximum(high, 0)
  scale = jnp.where(
      high == low, low.dtype.type(1), _numerics.true_divide(high - low, qmax - qmin)
  )
  # A NaN here (lo = -inf gives -inf / inf) clips to qmax, as std::min/std::max
  # do in onnxruntime and min/max in the ONNX reference.
  shifted = qmin - _numerics.true_divide(low, scale)
  zero_point = jnp.round(jnp.where(jnp.isnan(shifted), qmax, jnp.clip(shifted, qmin, qmax)))
  return scale, zero_point.astype(info.dtype)


def _symmetric_parameters(magnitude, *, info):
  """Zero point 0, ``scale = max|x| / qmax`` (1 where x is all zeros)."""
  qmax = magnitude.dtype.type(info.max)
  scale = jnp.where(
      magnitude == 0, magnitude.dtype.type(1), _numerics.true_divide(magnitude, qmax)
  )
  return scale, jnp.zeros_like(scale, info.dtype)


@dataclasses.dataclass(frozen=True)
class DynamicRange:
  """How scale and zero point follow from x: the validated static options.

  Attributes:
    info: the integer quantized dtype.
    granularity: one parameter per tensor, per index of ``axis`` or per block.
    reduction: ``reduction(view, axes)``: the statistics of x, NaNs ignored.
    parameters: ``parameters(*statistics)``: ``(scale, zero_point)``.
  """

  info: _dtypes.QuantizedDType
  granularity: _granularity.Granularity
  reduction: Callable[..., tuple[jax.Array, ...]]
  parameters: Callable[..., tuple[jax.Array, jax.Array]]

  def scale_and_zero_point(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The parameters of x, shaped ``granularity.param_shape``."""
    return self.parameters(
        *_granularity.reduce_blockwise(self.reduction, x, self.granularity)
    )

  def public_shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the parameters are returned in: (), (D,) or x's rank."""
    if self.granularity.kind == "per-tensor":
      return ()
    if self.granularity.kind == "per-axis":
      return (x_shape[self.granularity.axis],)
    return self.granularity.param_shape


def dynamic_range(
    x_shape: tuple[int, ...],
    *,
    dtype: DTypeLike,
    axis: int | None,
    block_size: int,
    symmetric: bool,
) -> DynamicRange:
  """Validates dynamic quantization's options (shared by every dynamic op).

  Raises:
    TypeError: if ``dtype`` is not an integer quantized dtype.
    ValueError: for ``symmetric=True`` with an unsigned dtype, or ``axis`` /
      ``block_size`` out of range.
  """
  info = _dtypes.quantized_dtype("dtype", dtype, integer=True)
  _validate.check(
      not symmetric or info.min < 0, "dtype",
      "a signed integer dtype when symmetric=True", info.name,
  )
  granularity = _granularity.for_reduction(
      x_shape, axis=axis, block_size=block_size
  )
  reduction, parameters = (
      (_max_magnitude, _symmetric_parameters) if symmetric
      else (_min_max, _asymmetric_parameters)
  )
  return DynamicRange(
      info, granularity, reduction, functools.partial(parameters, info=info)
  )


@_bind.op(
    jit=True, dtype=_bind.dtype, axis=_bind.optional_integer, block_size=_bind.integer,
    symmetric=_bind.boolean, implementation=_bind.IMPLEMENTATION,
)
def dynamic_quantize_linear(
    x: ArrayLike,
    *,
    dtype: DTypeLike = jnp.uint8,
    axis: int | None = None,
    block_size: int = 0,
    symmetric: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""Quantizes ``x`` with a scale and zero point computed from ``x``: ONNX DynamicQuantizeLinear.

  .. math::

    lo = \min(0, \min x), \quad hi = \max(0, \max x), \quad
    \mathrm{scale} = \frac{hi - lo}{q_{max} - q_{min}}, \\
    \mathrm{zero\_point} = \mathrm{round\_half\_to\_even}\left(
        \mathrm{clip}\left(q_{min} - \frac{lo}{\mathrm{scale}}, q_{min}, q_{max}\right)\right),
    \quad y = \mathrm{quantize\_linear}(x, \mathrm{scale}, \mathrm{zero\_point})

  in float32, NaNs ignored by the min and max (they quantize to ``q_min``).
  The range always holds 0, so 0 is exactly representable. ``hi == lo`` (all
  zeros, all NaN, or empty) gives scale 1 and zero point ``q_min``. With
  ``symmetric=True``: zero point 0 and ``scale = max|x| / q_max`` (signed
  dtypes only; 1 where ``max|x| == 0``). For uint8 and per-tensor this is ONNX
  DynamicQuantizeLinear bit for bit; int8 is DirectML's.

  The min and max come from one variadic reduction (one pass over ``x``).
  ``y`` and ``zero_point`` are integers and carry no gradient (for training
  use ``fake_quantize_dynamic``); ``scale``'s derivative is the formula's with
  ``jnp.min`` and ``jnp.max``: an extreme shared by several elements passes
  each the same share.

  Args:
    x: float32, float16 or bfloat16 input.
    dtype: any integer quantized dtype (static).
    axis: ``None`` for one scale for the tensor; ``k`` for one per index of
      dimension k (1-D scale and zero point), or one per block with ``block_size``.
    block_size: with ``axis``: one scale per ``block_size`` elements along it
      (the scale then has x's rank, ``ceil(D / block_size)`` along ``axis``).
    symmetric: zero point 0, scale from ``max|x|``.
    implementation: ``None`` (the fastest path), ``"xla"`` or ``"pallas"``; same bits.

  Returns:
    ``(y, scale, zero_point)``: ``y`` like x in ``dtype``; ``scale`` float32 and
    ``zero_point`` in ``dtype``, shaped so that
    ``dequantize_linear(y, scale, zero_point, axis=axis, block_size=block_size)``
    reconstructs x within ``scale / 2`` per element, up to float32 rounding.

  Raises:
    TypeError: if ``x`` is not a float array or ``dtype`` not an integer quantized dtype.
    ValueError: for ``symmetric=True`` with an unsigned dtype, or ``axis`` /
      ``block_size`` out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> y, scale, zero_point = jq.dynamic_quantize_linear(jnp.array([0.0, 2.0, -2.5, -3.0]))
    >>> y, scale, zero_point
    (Array([153, 255,  26,   0], dtype=uint8), Array(0.01960784, dtype=float32), Array(153, dtype=uint8))
  """
  x = _dtypes.float_input("x", jnp.asarray(x))
  dynamic = dynamic_range(
      x.shape, dtype=dtype, axis=axis, block_size=block_size,
      symmetric=symmetric,
  )
  info, granularity = dynamic.info, dynamic.granularity
  formula = functools.partial(
      _numerics.quantize_formula, info=info, precision=np.dtype(np.float32), saturate=True,
  )
  shape = dynamic.public_shape(x.shape)

  def xla(x):
    scale, zero_point = dynamic.scale_and_zero_point(x)
    y = _granularity.apply_blockwise(formula, x, [scale, zero_point], granularity)
    return y, scale.reshape(shape), zero_point.reshape(shape)

  def kernel(x):
    y, scale, zero_point = pallas_kernels.dynamic_quantize(
        x, [p != 1 or n == 1 for p, n in zip(granularity.param_shape, x.shape)],
        reduction=functools.partial(dynamic.reduction, keepdims=True),
        parameters=dynamic.parameters, formula=formula, output_dtype=info.dtype,
        blocks=granularity.kernel_blocks,
    )
    return y, scale.reshape(shape), zero_point.reshape(shape)

  return _dispatch.evaluate(
      _dispatch.Route("dynamic_quantize_linear", info.name, granularity.kind),
      implementation, xla, kernel if x.size else None, x)
