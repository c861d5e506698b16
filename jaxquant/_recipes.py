"""Scale recipes: where a static scale and zero point come from."""

from __future__ import annotations

import functools
import typing
from typing import Literal

import jax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _bind
from jaxquant import _checked
from jaxquant import _dtypes
from jaxquant import _dynamic
from jaxquant import _fake
from jaxquant import _granularity
from jaxquant import _numerics
from jaxquant import _sharding
from jaxquant import _validate

Method = Literal["absmax", "qmax_plus_half", "minmax", "percentile", "mse"]
METHOD = _bind.choice(*typing.get_args(Method))

# Clip ratios the MSE search tries: 1 down to 0.2 in steps of 0.02.
MSE_CLIP_RATIOS = tuple(1.0 - 0.02 * i for i in range(41))


def public_shape(granularity: _granularity.Granularity, x_shape: tuple[int, ...]):
  """The shape the ops take parameters in: (), (D,) or x's rank."""
  if granularity.kind == "per-tensor":
    return ()
  if granularity.kind == "per-axis":
    return (x_shape[granularity.axis],)
  return granularity.param_shape


def _magnitude_scale(magnitude, denominator):
  """``magnitude / denominator``, 1 where the magnitude is 0 (an all-zero block)."""
  return jnp.where(
      magnitude == 0, np.float32(1), _numerics.true_divide(magnitude, np.float32(denominator))
  )


def _blocks(x: jax.Array, granularity: _granularity.Granularity) -> jax.Array:
  """x's elements grouped per parameter: shape ``param_shape + (elements,)``.

  A short last block is padded with NaN, which the statistics here ignore.
  """
  x = x.astype(jnp.float32)
  if granularity.kind == "per-tensor":
    return x.reshape(granularity.param_shape + (-1,))
  axis = granularity.axis
  if granularity.kind == "per-axis":
    return jnp.moveaxis(x, axis, 0).reshape(granularity.param_shape + (-1,))
  block, blocks = granularity.block_shape[axis], granularity.param_shape[axis]
  padding = [(0, blocks * block - n if d == axis else 0) for d, n in enumerate(x.shape)]
  x = jnp.pad(x, padding, constant_values=np.nan)
  x = x.reshape(x.shape[:axis] + (blocks, block) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis + 1, -1)


def _per_block(statistic, x, granularity):
  """``statistic(x)``, shaped ``granularity.param_shape``, of each block of :func:`_blocks`.

  That view merges dims that an explicit mesh may split, which its sharding
  types refuse: there the statistic runs by automatic sharding, its result
  split like x along the dims it keeps.
  """
  if not _sharding.split_dims(x):
    return statistic(x)
  reduced = [d for d, (p, n) in enumerate(zip(granularity.param_shape, x.shape)) if p != n]
  return _sharding.unsplit_along(statistic, x, reduced)


def _percentile(x, granularity, q):
  def percentile(x):
    # The sort writes its input out anyway; a closed-over x would be sorted at
    # compile time (28 s for 256K elements, measured).
    magnitude = _numerics.unfolded(jnp.abs(_blocks(x, granularity)))
    if magnitude.shape[-1] == 0:
      # An empty block has no percentile; its scale is 1, as for an all-zero one.
      return jnp.zeros(granularity.param_shape, jnp.float32)
    # A float32 q: a Python float is float64 under x64, where q / 100 rounded
    # from float64 moved the interpolation (scales up to 8 ulps off x32's).
    # NaN (a block of NaNs, or jnp's interpolation landing exactly on an
    # infinity: inf * 0) reads as 0; an infinity interpolated towards stays
    # infinite, as absmax's (nan_to_num's default made it float32's max).
    return jnp.nan_to_num(jnp.nanpercentile(magnitude, np.float32(q), axis=-1),
                          posinf=np.inf)

  return _per_block(percentile, x, granularity)


def _squared_error(error, granularity):
  def squared(error):
    error = _blocks(error, granularity)
    return jnp.sum(jnp.where(jnp.isnan(error), 0, error) ** 2, axis=-1)

  return _per_block(squared, error, granularity)


def _check(arguments: dict) -> None:
  method = arguments["method"]
  info = _dtypes.quantized_dtype("dtype", arguments["dtype"])
  _validate.check(
      info.bits <= 16, "dtype", "a quantized dtype of at most 16 bits",
      info.name, error=TypeError,
  )
  _validate.check(
      info.is_integer or method not in ("qmax_plus_half", "minmax"), "method",
      f"'absmax', 'percentile' or 'mse' for the float dtype {info.name}", repr(method),
  )
  _validate.check(
      method != "minmax" or arguments["clip_ratio"] == 1.0, "clip_ratio",
      "1.0 with method='minmax'", arguments["clip_ratio"],
  )
  _validate.check(
      0 < arguments["clip_ratio"] <= 1, "clip_ratio", "in (0, 1]",
      arguments["clip_ratio"],
  )
  _validate.check(
      0 < arguments["percentile"] <= 100, "percentile", "in (0, 100]",
      arguments["percentile"],
  )


@_bind.op(
    jit=True, dtype=_bind.dtype, axis=_bind.optional_integer, block_size=_bind.integer,
    method=METHOD,
    clip_ratio=_bind.finite_float, percentile=_bind.finite_float, check=_check,
)
def choose_qparams(
    x: ArrayLike,
    dtype: DTypeLike = jnp.int8,
    *,
    axis: int | None = None,
    block_size: int = 0,
    method: Method = "absmax",
    clip_ratio: float = 1.0,
    percentile: float = 99.99,
) -> tuple[jax.Array, jax.Array | None]:
  r"""A scale and zero point for quantizing ``x`` to ``dtype``, by a recipe.

  With :math:`m` the largest magnitude of each block (per tensor, per index
  of ``axis``, or per ``block_size`` elements along it), :math:`q_{max}` the
  dtype's largest value (an integer's, or a float8/float6/float4's largest
  finite value) and :math:`r` the ``clip_ratio``:

  * ``"absmax"``: :math:`s = r \cdot m / q_{max}`, zero point 0. For float
    dtypes this is the max-scale recipe: ``m`` lands on the largest finite value.
  * ``"qmax_plus_half"``: :math:`s = r \cdot m / (q_{max} + 1/2)`, zero point 0
    (integers): the largest magnitudes round to the edge of the range instead
    of onto it, so each of the few levels of a low bit width covers more
    weights. At int2 this recipe is what makes weight-only PTQ usable.
  * ``"minmax"``: asymmetric, :math:`lo = \min(0, \min x)`,
    :math:`hi = \max(0, \max x)`, :math:`s = (hi - lo) / (q_{max} - q_{min})`,
    zero point :math:`\mathrm{round}(q_{min} - lo / s)`
    (integers; :func:`dynamic_quantize_linear`'s parameters).
  * ``"percentile"``: ``"absmax"`` with :math:`m` the ``percentile`` of
    :math:`|x|` in each block (NaNs ignored; a percentile interpolated towards an
    infinity is infinite, as absmax's, but one landing exactly on an infinity,
    ``percentile=100`` of a block holding one, is ``inf * 0``, NaN, in the
    interpolation and read as 0: scale 1).
  * ``"mse"``: ``"absmax"`` with, per block, the clip ratio among
    ``1, 0.98, ..., 0.2`` (times ``clip_ratio``) that minimises the squared
    error of :func:`fake_quantize` over the block.

  NaNs are ignored; a block with :math:`m = 0` (or empty) gets scale 1. The
  scale is float32, a true division. No gradient is defined: parameters are
  chosen, not trained (train them with :func:`fake_quantize_learnable`).

  Args:
    x: float32, float16 or bfloat16 values (weights, or calibration activations).
    dtype: the quantized dtype: an integer of at most 16 bits, a float8,
      float6 or float4 dtype.
    axis: ``None`` for one scale for the tensor; ``k`` for one per index of
      dimension k, or one per block with ``block_size``.
    block_size: with ``axis``: one scale per ``block_size`` elements along it
      (the last block may be short).
    method: the recipe, above.
    clip_ratio: in (0, 1]; multiplies the magnitude (``"minmax"``: 1 only).
    percentile: in (0, 100], for ``"percentile"``.

  Returns:
    ``(scale, zero_point)``: float32 scale shaped ``()``, ``(x.shape[axis],)``
    or, blocked, x's rank with ``ceil(D / block_size)`` along ``axis``, as
    :func:`quantize_linear` takes it; the zero point of the same shape in
    ``dtype``, 0 unless ``method="minmax"`` (``None`` for float6, which no
    JAX array holds: pass ``output_dtype=`` to :func:`quantize_linear`).

  Raises:
    TypeError: if ``x`` is not a float array or ``dtype`` not a quantized
      dtype of at most 16 bits.
    ValueError: for an unknown ``method``, ``"qmax_plus_half"`` or
      ``"minmax"`` with a float dtype, ``clip_ratio`` or ``percentile`` out
      of range, or ``axis`` / ``block_size`` out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> w = jnp.array([[0.3, -1.5, 0.6], [0.1, 0.2, -0.05]])
    >>> jq.choose_qparams(w, jnp.int2, axis=0)[0]  # one scale per row: m / 1
    Array([1.5, 0.2], dtype=float32)
    >>> jq.choose_qparams(w, jnp.int2, axis=0, method="qmax_plus_half")[0]  # m / 1.5
    Array([1.        , 0.13333334], dtype=float32)
    >>> jq.choose_qparams(w, jnp.float8_e4m3fn)[0]  # 1.5 / 448
    Array(0.00334821, dtype=float32)
  """
  x = _dtypes.float_input("x", jnp.asarray(x))
  info = _dtypes.quantized_dtype("dtype", dtype)
  granularity = _granularity.for_reduction(x.shape, axis=axis, block_size=block_size)
  shape = public_shape(granularity, x.shape)
  reduce = functools.partial(_granularity.reduce_blockwise, x=x, granularity=granularity)

  if method == "minmax":
    scale, zero_point = _dynamic._asymmetric_parameters(
        *reduce(_dynamic._min_max), info=info
    )
    return scale.reshape(shape), zero_point.reshape(shape)

  if method == "percentile":
    magnitude = _percentile(x, granularity, percentile)
  else:
    (magnitude,) = reduce(_dynamic._max_magnitude)
  qmax = info.max + 0.5 if method == "qmax_plus_half" else info.max
  scale = _magnitude_scale(magnitude * np.float32(clip_ratio), qmax)
  if method == "mse":
    scale = _mse_scale(x, magnitude * np.float32(clip_ratio), info, granularity, shape)
  scale = scale.reshape(shape)
  # XLA has no float6 type, and uint8 codes would read as a uint8 zero point. Zeros
  # like the scale are split as it is (on a mesh, the pair shards alike).
  return scale, None if info.as_codes else jnp.zeros_like(scale, info.dtype)


def _mse_scale(x, magnitude, info, granularity, shape):
  """Per block, the absmax scale over the clip ratio with the least squared error."""
  ratios = jnp.asarray(MSE_CLIP_RATIOS, jnp.float32)
  axis = granularity.axis
  block_size = granularity.block_shape[axis] if granularity.kind == "blocked" else 0
  x = x.astype(jnp.float32)

  def error(ratio):
    scale = _magnitude_scale(magnitude * ratio, info.max)
    with _checked.unchecked():
      y = _fake.fake_quantize(
          x, scale.reshape(shape), dtype=info.dtype, axis=axis, block_size=block_size
      )
    return scale, _squared_error(y - x, granularity)

  scales, errors = jax.lax.map(error, ratios)
  # The first (largest) ratio wins ties, so an exact absmax stays absmax.
  return jnp.take_along_axis(scales, jnp.argmin(errors, axis=0)[None], axis=0)[0]
