"""Calibration: functional observers of activation ranges, and static quantization from them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
import dataclasses
import functools
import typing
from typing import Any, Literal

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _bind
from jaxquant import _dot_general
from jaxquant import _dtypes
from jaxquant import _dynamic
from jaxquant import _numerics
from jaxquant import _recipes
from jaxquant import _sharding
from jaxquant import _validate

ObserverMethod = Literal["minmax", "absmax", "qmax_plus_half", "percentile", "mse"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["low", "high", "histogram", "histogram_range", "count"],
    meta_fields=["momentum"],
)
@dataclasses.dataclass(frozen=True)
class Observer:
  """The running statistics of a tensor: a pytree, updated by :func:`observe`.

  Attributes:
    low: the running minimum (moving average of batch minima with a momentum).
    high: the running maximum (likewise).
    histogram: counts of ``|x|`` in equal bins over ``[0, histogram_range]``.
    histogram_range: the largest ``|x|`` seen; the histogram's upper edge.
    count: batches observed.
    momentum: ``None`` for the running min/max, else the moving average's
      weight on the past (static).
  """

  low: jax.Array
  high: jax.Array
  histogram: jax.Array
  histogram_range: jax.Array
  count: jax.Array
  momentum: float | None


@_validate.reports_as("init_observer")
def init_observer(*, momentum: float | None = None, bins: int = 1024) -> Observer:
  """An empty :class:`Observer`.

  Args:
    momentum: ``None``: ``low``/``high`` are the running min and max; a
      float in [0, 1): they are moving averages,
      ``low = momentum * low + (1 - momentum) * min(x)`` (the first batch
      taken as is; a batch of NaNs changes nothing).
    bins: histogram bins, for the ``"percentile"`` and ``"mse"`` methods.

  Returns:
    The observer state.

  Raises:
    ValueError: for a momentum outside [0, 1) or fewer than 2 bins.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> state = jq.observe(jq.init_observer(), jnp.array([-1.0, 3.0]))
    >>> state = jq.observe(state, jnp.array([0.5, 4.0]))
    >>> state.low, state.high
    (Array(-1., dtype=float32), Array(4., dtype=float32))
  """
  bins = _validate.static_int("bins", bins)
  _validate.check(bins >= 2, "bins", "at least 2", bins)
  if momentum is not None:
    momentum = _bind.finite_float("momentum", momentum)
    _validate.check(0 <= momentum < 1, "momentum", "in [0, 1) or None", momentum)
  zero = jnp.zeros((), jnp.float32)
  return Observer(
      jnp.array(jnp.inf, jnp.float32), jnp.array(-jnp.inf, jnp.float32),
      jnp.zeros((bins,), jnp.float32), zero, jnp.zeros((), jnp.int32), momentum,
  )


def _rebinned(histogram, old_range, new_range):
  """The histogram over ``[0, old_range]`` moved onto ``[0, new_range]`` (new_range >= old).

  Each old bin's count is split between the (at most two) new bins it overlaps, in
  proportion to the overlap: moving whole bins (to the one holding their centre) shifted
  a percentile by up to a bin at every regrouping, which a range growing with every
  batch accumulated (with 8 bins and batches 0..299, the median 299 instead of 149.5).
  """
  bins = histogram.shape[0]
  # Old bin edges in units of new bins: each old bin is at most one new bin wide.
  scale = jnp.where(new_range > 0, old_range / jnp.where(new_range > 0, new_range, 1), 0)
  start = jnp.arange(bins, dtype=jnp.float32) * scale
  end = start + scale
  first = jnp.floor(start)
  in_first = jnp.where(end > first + 1, (first + 1 - start) / jnp.maximum(end - start, 1e-30), 1)
  first = jnp.clip(first, 0, bins - 1).astype(jnp.int32)
  second = jnp.clip(first + 1, 0, bins - 1)
  return (jax.ops.segment_sum(histogram * in_first, first, num_segments=bins)
          + jax.ops.segment_sum(histogram * (1 - in_first), second, num_segments=bins))


def _has_values(low: jax.Array, high: jax.Array) -> jax.Array:
  """Whether a range holds values: nothing seen, or only NaNs, leaves it +inf and -inf."""
  return low <= high


@_bind.op(jit=True)
def observe(state: Observer, x: ArrayLike) -> Observer:
  """``state`` updated with the values of ``x`` (NaNs ignored, infinities kept out of the
  histogram); jittable, pure.

  Call it inside a jitted forward pass and return the new state, as any
  other pytree (:func:`calibrate` does this for every layer of a model).

  Args:
    state: from :func:`init_observer` or a previous :func:`observe`.
    x: a float array of any shape (an empty one leaves the statistics as they are).

  Returns:
    The new state.

  Raises:
    TypeError: if ``x`` is not a float array.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> state = jq.init_observer(momentum=0.5)
    >>> for batch in ([0.0, 2.0], [0.0, 4.0]):
    ...   state = jq.observe(state, jnp.array(batch))
    >>> state.high  # 0.5 * 2 + 0.5 * 4
    Array(3., dtype=float32)
  """
  x = _dtypes.float_input("x", jnp.asarray(x)).astype(jnp.float32)
  if x.size == 0:
    return state
  # The histogram flattens x and scatters it into one histogram, which an explicit
  # mesh's split does not survive; the statistics are the whole batch's anyway.
  x = _sharding.whole(x)
  axes = tuple(range(x.ndim))
  low, high = _dynamic._min_max(x, axes)
  if state.momentum is None:
    new_low, new_high = jnp.minimum(state.low, low), jnp.maximum(state.high, high)
  else:
    # A batch of NaNs has no values (its min and max are +-inf): it would wipe out
    # the average. Count batches with values, not batches, for the first one.
    m = np.float32(state.momentum)
    values, first = _has_values(low, high), ~_has_values(state.low, state.high)

    def average(old, new):
      # Each product rounded, as the formula says: XLA:CPU fused one into an FMA
      # in some programs (vmap, scan) and not in others (disable_jit).
      moved = _numerics.rounded_sum(m * old, (1 - m) * new)
      return jnp.where(values, jnp.where(first, new, moved), old)

    new_low, new_high = average(state.low, low), average(state.high, high)
  magnitude = jnp.abs(x).reshape(-1)
  # The histogram bins finite values: one infinity would stretch its range for good.
  finite = jnp.isfinite(magnitude)
  new_range = jnp.maximum(state.histogram_range, jnp.max(jnp.where(finite, magnitude, 0)))
  bins = state.histogram.shape[0]
  histogram = _rebinned(state.histogram, state.histogram_range, new_range)
  index = jnp.where(new_range > 0, jnp.floor(magnitude / new_range * bins), 0)
  index = jnp.clip(jnp.where(finite, index, 0), 0, bins - 1).astype(jnp.int32)
  histogram = histogram + jax.ops.segment_sum(
      finite.astype(jnp.float32), index, num_segments=bins)
  return Observer(new_low, new_high, histogram, new_range, state.count + 1, state.momentum)


def _histogram_percentile(state: Observer, percentile: float) -> jax.Array:
  bins = state.histogram.shape[0]
  cumulative = jnp.cumsum(state.histogram)
  position = jnp.searchsorted(cumulative, cumulative[-1] * (percentile / 100), side="left")
  return (position + 1).astype(jnp.float32) * (state.histogram_range / bins)


def _histogram_mse(state: Observer, qmax: float) -> jax.Array:
  """The clip magnitude, among the MSE recipe's ratios, least in expected squared error.

  Bin centres above the clip cost their distance to it squared; those below
  cost the rounding error of a uniform value, ``step**2 / 12``.
  """
  bins = state.histogram.shape[0]
  centers = (jnp.arange(bins, dtype=jnp.float32) + 0.5) * (state.histogram_range / bins)
  clips = jnp.asarray(_recipes.MSE_CLIP_RATIOS, jnp.float32) * state.histogram_range

  def error(clip):
    step = clip / qmax
    cost = jnp.where(centers > clip, (centers - clip) ** 2, step**2 / 12)
    return jnp.sum(state.histogram * cost)

  return clips[jnp.argmin(jax.vmap(error)(clips))]


def _check_observer_qparams(arguments: dict) -> None:
  info = _dtypes.quantized_dtype("dtype", arguments["dtype"])
  _validate.check(
      info.is_integer or arguments["method"] not in ("minmax", "qmax_plus_half"), "method",
      f"'absmax', 'percentile' or 'mse' for the float dtype {info.name}",
      repr(arguments["method"]),
  )
  _validate.check(
      0 < arguments["percentile"] <= 100, "percentile", "in (0, 100]",
      arguments["percentile"],
  )


@_bind.op(
    jit=True, dtype=_bind.dtype,
    method=_bind.choice(*typing.get_args(ObserverMethod)),
    percentile=_bind.finite_float, check=_check_observer_qparams,
)
def observer_qparams(
    state: Observer,
    dtype: DTypeLike = jnp.int8,
    *,
    method: ObserverMethod = "minmax",
    percentile: float = 99.99,
) -> tuple[jax.Array, jax.Array | None]:
  r"""A per-tensor scale and zero point from an observer, for static quantization.

  * ``"minmax"``: asymmetric over ``[min(0, low), max(0, high)]``, as
    :func:`choose_qparams` (integers).
  * ``"absmax"``: :math:`m / q_{max}` with :math:`m = \max(|low|, |high|)`, zero point 0.
  * ``"qmax_plus_half"``: :math:`m / (q_{max} + 1/2)`, zero point 0 (integers).
  * ``"percentile"``: ``"absmax"`` with :math:`m` the histogram's
    ``percentile`` of ``|x|`` (an upper bin edge).
  * ``"mse"``: ``"absmax"`` with :math:`m` the clip, among
    :func:`choose_qparams`'s ratios of the largest ``|x|``, of least
    expected squared error over the histogram.

  A state that saw nothing (or only NaNs), or only zeros, gives scale 1.

  Args:
    state: an :class:`Observer`.
    dtype: the quantized dtype.
    method: the recipe, above.
    percentile: in (0, 100], for ``"percentile"``.

  Returns:
    ``(scale, zero_point)``: a float32 scalar and a scalar of ``dtype``
    (``None`` for float6, as :func:`choose_qparams`).

  Raises:
    TypeError: if ``dtype`` is not a quantized dtype.
    ValueError: for ``"minmax"`` or ``"qmax_plus_half"`` with a float dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> state = jq.observe(jq.init_observer(), jnp.array([-1.0, 3.0]))
    >>> jq.observer_qparams(state, jnp.uint8)  # (3 - -1) / 255, 0 at 64
    (Array(0.01568628, dtype=float32), Array(64, dtype=uint8))
    >>> jq.observer_qparams(state, jnp.int8, method="absmax")[0]  # 3 / 127
    Array(0.02362205, dtype=float32)
  """
  info = _dtypes.quantized_dtype("dtype", dtype)
  seen = _has_values(state.low, state.high)
  low = jnp.where(seen, state.low, 0)
  high = jnp.where(seen, state.high, 0)
  if method == "minmax":
    return _dynamic._asymmetric_parameters(low, high, info=info)
  if method == "percentile":
    magnitude = _histogram_percentile(state, percentile)
  elif method == "mse":
    magnitude = _histogram_mse(state, info.max)
  else:
    magnitude = jnp.maximum(jnp.abs(low), jnp.abs(high))
  qmax = info.max + 0.5 if method == "qmax_plus_half" else info.max
  scale = _recipes._magnitude_scale(jnp.where(jnp.isnan(magnitude), 0, magnitude), qmax)
  return scale, None if info.as_codes else jnp.zeros((), info.dtype)


_LAX = {"dot_general": lax.dot_general, "conv_general_dilated": lax.conv_general_dilated}

_STATIC = {
    "dot_general": _dot_general.dot_general_static_int8,
    "einsum_op": _dot_general.dot_general_static_int8,
    "conv_general_dilated": _dot_general.conv_general_dilated_static_int8,
}


def _recording(path, original, current):
  def op(lhs, *args, **kwargs):
    current[path] = observe(current[path], lhs)
    return original(lhs, *args, **kwargs)
  return op


@_validate.reports_as("calibrate")
def calibrate(
    model: Callable[[Any], Any],
    batches: Iterable[Any],
    *,
    method: ObserverMethod = "minmax",
    momentum: float | None = None,
    bins: int = 1024,
    percentile: float = 99.99,
) -> dict[str, dict[str, Callable[..., jax.Array]]]:
  """Observes a model's layer inputs over ``batches``; returns static int8 drop-ins.

  Every layer :func:`replace_ops` would reach gets an :class:`Observer` of
  its input (the ``lhs`` of its contraction). ``model(batch)`` runs under
  ``jax.jit`` with the observer states as its argument and result, the
  layers' own contractions unchanged; then each layer's int8 scale and zero
  point come from :func:`observer_qparams`. The model is left as it was.

  Args:
    model: a callable model object, e.g. a Flax NNX module in eval mode
      (its parameters are read, not changed).
    batches: an iterable of inputs, each passed as ``model(batch)``.
    method: :func:`observer_qparams`'s recipe.
    momentum: :func:`init_observer`'s.
    bins: :func:`init_observer`'s.
    percentile: :func:`observer_qparams`'s.

  Returns:
    ``{"dot_general": {path: op}, "conv_general_dilated": {path: op}}``, each
    op :func:`dot_general_static_int8` or
    :func:`conv_general_dilated_static_int8` with its layer's parameters
    bound: ``replace_ops(model, **calibrate(model, batches))`` makes the
    model static int8. Layers the batches never reached are left out.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> from jax import lax
    >>> class Dense:
    ...   def __init__(self):
    ...     self.kernel, self.dot_general = jnp.eye(2), lax.dot_general
    ...   def __call__(self, x):
    ...     return self.dot_general(x, self.kernel, (((1,), (0,)), ((), ())))
    >>> model = Dense()
    >>> ops = jq.calibrate(model, [jnp.array([[0.0, 2.55]])])
    >>> ops["dot_general"][""].keywords  # (2.55 - 0) / 255, zero point -128
    {'input_scale': Array(0.01, dtype=float32), 'input_zero_point': Array(-128, dtype=int8)}
  """
  found = _dot_general.layers(model)
  # Every option is checked before a layer is touched (or a batch run): an error
  # must leave the model as it was.
  states = {path: init_observer(momentum=momentum, bins=bins) for path in found}
  observer_qparams(init_observer(bins=bins), jnp.int8, method=method, percentile=percentile)
  originals = {path: getattr(layer, attribute) for path, (layer, attribute) in found.items()}
  current: dict[str, Observer] = {}
  for path, (layer, attribute) in found.items():
    if attribute == "einsum_op":
      # x is the einsum's lhs there (jnp.einsum's own may pass the kernel first).
      op = _dot_general._Einsum(_recording(path, lax.dot_general, current))
    else:
      op = _recording(path, originals[path] or _LAX[attribute], current)
    setattr(layer, attribute, op)

  @jax.jit
  def step(states, batch):
    current.clear()
    current.update(states)
    # A jitted function inside the model (jnp.einsum, which nnx.Einsum calls) traces
    # its own scope, which an observer state cannot leave: run it inline instead.
    with jax.disable_jit():
      model(batch)
    return dict(current)

  try:
    for batch in batches:
      states = step(states, batch)
  finally:
    current.clear()
    for path, (layer, attribute) in found.items():
      setattr(layer, attribute, originals[path])
  ops: dict[str, dict[str, Callable[..., jax.Array]]] = {
      "dot_general": {}, "conv_general_dilated": {},
  }
  for path, (layer, attribute) in found.items():
    if int(states[path].count) == 0:
      continue
    scale, zero_point = observer_qparams(
        states[path], jnp.int8, method=method, percentile=percentile
    )
    kind = "conv_general_dilated" if attribute == "conv_general_dilated" else "dot_general"
    ops[kind][path] = functools.partial(
        _STATIC[attribute], input_scale=scale, input_zero_point=zero_point
    )
  return ops
