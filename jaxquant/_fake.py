"""Fake quantization for quantization-aware training (docs/numerics.md).

Every op here is ``dequantize(quantize(x))`` from float to float, bit for bit
the composition of :func:`quantize_linear` and :func:`dequantize_linear`, with
a derivative of its own: rounding has derivative 0 almost everywhere, so
training needs a straight-through estimator.

The derivative is a ``jax.custom_jvp`` on the element-wise formula, not a
``custom_vjp`` on the op. The rule is linear in the tangents, so JAX
transposes it for reverse mode (``grad``, ``vjp``) and keeps forward mode
(``jvp``, ``jacfwd``, Hessian-vector products), which a ``custom_vjp`` loses.
Because the rule sees one block with its parameters broadcast (the formula
runs under :func:`_granularity.apply_blockwise`), the transpose of that
broadcast is what sums a learnable scale's gradient over its block: per
tensor, per axis and per block alike, without code of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _bind
from jaxquant import _dtypes
from jaxquant import _dynamic
from jaxquant import _numerics
from jaxquant import _parameters
from jaxquant import _validate

Gradient = Literal["masked", "identity", "lsq"]


@dataclasses.dataclass(frozen=True)
class _Quantizer:
  """The static options of one fake quantizer.

  Attributes:
    info: the quantized dtype, its range narrowed by ``narrow_range``.
    precision: the dtype the division rounds to: the scale's, as in
      ``quantize_linear`` (the dynamic scale's for ``fake_quantize_dynamic``).
    gradient: ``"masked"``: ``dy/dx`` is 1 where the unclamped quantized value
      lies in the range, else 0; ``"identity"``: 1 everywhere; ``"lsq"``:
      masked, plus LSQ's derivatives for a learned scale and float zero point.
    grad_factor: multiplies the scale and zero point derivatives (``"lsq"``).
  """

  info: _dtypes.QuantizedDType
  precision: np.dtype
  gradient: Gradient
  grad_factor: float = 1.0


def _rounded_zero_point(zero_point, info):
  """A learned float zero point as the integer the forward pass uses (PyTorch's rule)."""
  if zero_point is None:
    return None
  # In at least float32: float16 and bfloat16 round int16's bounds (32767 to
  # 32768) and uint16's (65535 to inf in float16), so the clip would miss.
  wide = zero_point.astype(jnp.promote_types(zero_point.dtype, jnp.float32))
  return jnp.clip(jnp.round(wide), info.min, info.max)


def _forward(x, scale, zero_point, quantizer):
  """The fake-quantized x in the compute dtype, and the unclamped quantized value.

  The unclamped value is ``round(x / scale) + zero_point`` for integer dtypes
  and ``x / scale + zero_point`` rounded to the dtype's significand (but not
  its range) for float ones: the value that saturation clamps.
  """
  info = quantizer.info
  quotient = _numerics.quotient_formula(x, scale, precision=quantizer.precision)
  quantized = _numerics.round_and_saturate(quotient, zero_point, info)
  y = _numerics.dequantize_formula(
      quantized, scale, zero_point, info=info, output_dtype=quotient.dtype
  )
  # The order of round_and_saturate: integers round, then add the zero point
  # (at a tie its parity would matter otherwise); floats add, then round.
  if info.is_integer:
    quotient = jnp.round(quotient)
  if zero_point is not None:
    quotient = quotient + _numerics.values(zero_point, info).astype(quotient.dtype)
  if not info.is_integer:
    quotient = lax.reduce_precision(
        quotient, exponent_bits=jnp.finfo(quotient.dtype).nexp,
        mantissa_bits=jnp.finfo(info.dtype).nmant,
    )
  return y, quotient


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _fake_quantize(x, scale, zero_point, quantizer):
  """``dequantize(quantize(x))`` in x's dtype; parameters broadcast against x."""
  if quantizer.gradient == "lsq":
    zero_point = _rounded_zero_point(zero_point, quantizer.info)
  return _forward(x, scale, zero_point, quantizer)[0].astype(x.dtype)


@_fake_quantize.defjvp
def _fake_quantize_jvp(quantizer, primals, tangents):
  x, scale, zero_point = primals
  x_dot, scale_dot, zero_point_dot = tangents
  info = quantizer.info
  learned = quantizer.gradient == "lsq"
  # The primal output goes through this rule again, so a second derivative
  # (a Hessian, an HVP) sees the straight-through one instead of round's 0. It
  # is taken in the wide dtype the forward computes in, which LSQ's scale
  # derivative reads (x's own dtype would round it).
  wide = _numerics.compute_dtype(x.dtype)
  y = _fake_quantize(x.astype(wide), scale, zero_point, quantizer)
  if learned:
    zero_point = _rounded_zero_point(zero_point, info)
  # The unclamped value only decides the mask, which is piecewise constant.
  mask_x = lax.stop_gradient(x)
  if not learned:
    # Its own division, which XLA cannot merge with the forward's: the mask's
    # fusion then reads x, instead of both reading a float quotient that XLA
    # writes out whole because a division is too costly to compute twice
    # (the masked step 20% faster at 16M elements; LSQ reads y and the
    # quotient together, and is slower so).
    mask_x = _numerics.unfolded(mask_x)
  _, unclamped = _forward(mask_x, *lax.stop_gradient((scale, zero_point)), quantizer)
  # NaN is neither in the range nor out of it: it passes no gradient anywhere.
  below, above = unclamped < info.min, unclamped > info.max
  inside = (unclamped >= info.min) & (unclamped <= info.max)
  if quantizer.gradient == "identity":
    y_dot = x_dot
  else:
    y_dot = jnp.where(inside, x_dot, jnp.zeros_like(x_dot))
  if learned:
    # LSQ (Esser et al. 2019) with PyTorch's cases: inside the range
    # d(y)/d(scale) = (y - x) / scale and d(y)/d(zero_point) = 0; clamped to
    # q (qmin or qmax), y = (q - zero_point) * scale.
    scale = scale.astype(wide)
    offset = 0
    if zero_point is not None:
      # The rounded zero point, with the straight-through derivative of the
      # learned one, so that d2y / (dscale dzero_point) = -1 outside the range.
      offset = zero_point.astype(wide)
      learned_zero_point = primals[2].astype(wide)
      offset = learned_zero_point + lax.stop_gradient(offset - learned_zero_point)
    d_scale = jnp.where(
        inside, (y - x.astype(wide)) / scale,
        jnp.where(below, info.min - offset, jnp.where(above, info.max - offset, 0)),
    )
    parameters_dot = d_scale * scale_dot.astype(wide)
    if zero_point is not None:
      parameters_dot += jnp.where(below | above, -scale, 0) * zero_point_dot.astype(wide)
    y_dot = y_dot + (quantizer.grad_factor * parameters_dot).astype(y_dot.dtype)
  return y.astype(x.dtype), y_dot


def _fake_quantized_dtype(
    dtype: DTypeLike, *, narrow_range: bool, integer: bool = False
) -> _dtypes.QuantizedDType:
  """The quantized dtype of a fake quantizer: at most 16 bits, narrowed if asked."""
  info = _dtypes.quantized_dtype("dtype", dtype, integer=integer)
  _validate.check(
      info.bits <= 16, "dtype",
      "a quantized dtype of at most 16 bits (float32 cannot hold every 32-bit "
      "integer)", info.name, error=TypeError,
  )
  if not narrow_range:
    return info
  _validate.check(
      info.is_integer, "narrow_range",
      f"False for the float dtype {info.name} (its range is symmetric)", narrow_range,
  )
  return dataclasses.replace(info, min=info.min + 1)


def _apply(x, parameters: _parameters.Parameters, quantizer: _Quantizer) -> jax.Array:
  return parameters.apply(
      lambda x, scale, zero_point: _fake_quantize(x, scale, zero_point, quantizer), x)


def _check_zero_point(arguments: dict) -> None:
  arguments["zero_point"] = _dtypes.host_zero_point(
      "zero_point", arguments["zero_point"], arguments["dtype"]
  )


@_bind.op(
    dtype=_bind.dtype, axis=_bind.optional_integer, block_size=_bind.integer,
    narrow_range=_bind.boolean,
    gradient=_bind.choice("masked", "identity"), check=_check_zero_point,
)
def fake_quantize(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike | None = None,
    *,
    dtype: DTypeLike = jnp.int8,
    axis: int | None = 1,
    block_size: int = 0,
    narrow_range: bool = False,
    gradient: Literal["masked", "identity"] = "masked",
) -> jax.Array:
  r"""Quantizes and dequantizes ``x``, with a straight-through gradient.

  .. math::

    y = (\mathrm{clip}(\mathrm{round}(x / s) + z, q_{min}, q_{max}) - z) \cdot s,
    \qquad
    \frac{\partial y}{\partial x} =
      \begin{cases}
        1 & q_{min} \le \mathrm{round}(x / s) + z \le q_{max} \\
        0 & \text{otherwise}
      \end{cases}

  The value is bit for bit ``dequantize_linear(quantize_linear(x, s, z), s,
  z)`` in x's dtype (true division, round half to even, NaN to ``q_min``).
  ``gradient="masked"`` is PyTorch's rule for ``fake_quantize_per_tensor_affine``:
  the mask is inclusive and tested on the integer before clamping, so values
  at ``q_min`` and ``q_max`` pass gradient 1 (``jnp.clip`` would give 0.5),
  values rounding outside pass 0, and NaN passes 0. ``gradient="identity"``
  passes ``dy/dx = 1`` everywhere. ``scale`` and ``zero_point`` get zero
  gradient; learn them with :func:`fake_quantize_learnable`. For float8,
  float6 and float4 dtypes the mask tests ``x / s + z`` rounded to the
  dtype's significand against its finite range.

  Args:
    x: float32, float16 or bfloat16 input.
    scale: float32, float16, bfloat16 or float8_e8m0fnu scale; its shape picks
      the granularity as in :func:`quantize_linear` (per tensor, per axis,
      blocked, block-wise broadcast).
    zero_point: in ``dtype``, shaped like ``scale``; ``None`` means 0. A
      Python number takes ``dtype``. For float6, which XLA cannot hold: a
      NumPy float6 array, a Python number, or uint8 codes.
    dtype: the quantized dtype: an integer type of at most 16 bits, a float8
      type, float6_e2m3fn, float6_e3m2fn or float4_e2m1fn.
    axis: the quantization axis for per-axis and blocked scales (``None``
      only with a per-tensor or block-wise broadcast scale).
    block_size: block length along ``axis`` for blocked scales, else 0.
    narrow_range: integer dtypes: use ``[q_min + 1, q_max]`` (int8 in
      [-127, 127]).
    gradient: ``"masked"`` or ``"identity"``.

  Returns:
    An array like ``x`` (same shape and dtype).

  Raises:
    TypeError: for an unsupported dtype of ``x``, ``scale``, ``zero_point`` or
      ``dtype``.
    ValueError: if the shapes fit no granularity, ``axis`` / ``block_size`` are
      out of range, ``gradient`` is unknown, or ``narrow_range`` is set for a
      float dtype.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([-130.0, -127.6, 0.5, 1.5, 127.0, 200.0])
    >>> jq.fake_quantize(x, 1.0)
    Array([-128., -128.,    0.,    2.,  127.,  127.], dtype=float32)
    >>> jax.grad(lambda x: jq.fake_quantize(x, 1.0).sum())(x)
    Array([0., 1., 1., 1., 1., 0.], dtype=float32)
    >>> jq.fake_quantize(jnp.array([0.3, -1.1, 3.9, 4.0]), 0.5, dtype=jnp.float6_e2m3fn)
    Array([ 0.3125, -1.125 ,  3.75  ,  3.75  ], dtype=float32)
  """
  zero_point, zero_point_dtype = _dtypes.host_codes("zero_point", zero_point)
  return _fake_quantize_op(
      x, scale, zero_point, dtype=dtype, axis=axis, block_size=block_size,
      narrow_range=narrow_range, gradient=gradient, zero_point_dtype=zero_point_dtype,
  )


@functools.partial(
    jax.jit,
    static_argnames=(
        "dtype", "axis", "block_size", "narrow_range", "gradient", "zero_point_dtype",
    ),
)
def _fake_quantize_op(
    x, scale, zero_point, *, dtype, axis, block_size, narrow_range, gradient,
    zero_point_dtype,
):
  x = _dtypes.float_input("x", jnp.asarray(x))
  info = _fake_quantized_dtype(dtype, narrow_range=narrow_range)
  parameters = _parameters.bind(
      x.shape, scale, zero_point, info, axis=axis, block_size=block_size,
      zero_point_dtype=zero_point_dtype,
  )
  quantizer = _Quantizer(info, _numerics.division_precision(parameters.scale.dtype), gradient)
  return _apply(x, parameters, quantizer)


@_bind.op(
    jit=True,
    dtype=_bind.dtype, axis=_bind.optional_integer, block_size=_bind.integer,
    narrow_range=_bind.boolean,
    grad_factor=_bind.finite_float,
)
def fake_quantize_learnable(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike | None = None,
    *,
    dtype: DTypeLike = jnp.int8,
    axis: int | None = 1,
    block_size: int = 0,
    narrow_range: bool = False,
    grad_factor: float = 1.0,
) -> jax.Array:
  r"""Fake quantization with a learned scale and zero point (LSQ, Esser et al. 2019).

  .. math::

    z' = \mathrm{clip}(\mathrm{round}(z), q_{min}, q_{max}), \quad
    q = \mathrm{round}(x / s) + z', \quad
    y = (\mathrm{clip}(q, q_{min}, q_{max}) - z') \cdot s

  with gradients, ``g`` the incoming gradient and ``f`` the ``grad_factor``:

  .. math::

    \frac{\partial y}{\partial x} = [q_{min} \le q \le q_{max}], \quad
    \frac{\partial y}{\partial s} =
      \begin{cases}
        (y - x) / s & q_{min} \le q \le q_{max} \\
        q_{min} - z' & q < q_{min} \\
        q_{max} - z' & q > q_{max}
      \end{cases} \cdot f, \quad
    \frac{\partial y}{\partial z} =
      \begin{cases}
        0 & q_{min} \le q \le q_{max} \\
        -s & \text{otherwise}
      \end{cases} \cdot f

  summed over the elements each scale covers: PyTorch's
  ``_fake_quantize_learnable_per_tensor_affine`` and ``_per_channel_affine``,
  extended to every granularity of :func:`fake_quantize`. The value equals
  :func:`fake_quantize` with the zero point ``z'``. NaN elements pass no
  gradient to anything. LSQ recommends ``grad_factor=``
  :func:`lsq_grad_factor` of the elements per scale (with Adam-like
  optimizers, which normalise gradients, it matters little). Nothing keeps
  a learned scale positive: a scale of 0 or below quantizes by the special-value
  rules, so clip it after each update if the learning rate is large.

  Args:
    x: float32, float16 or bfloat16 input.
    scale: float32, float16 or bfloat16 scale, learned; its shape picks the
      granularity as in :func:`fake_quantize`.
    zero_point: float zero point shaped like ``scale``, learned; rounded half
      to even and clipped to the range in the forward pass. ``None`` fixes it
      at 0 (symmetric quantization, LSQ as published).
    dtype: an integer quantized dtype of at most 16 bits.
    axis: the quantization axis for per-axis and blocked scales (``None``
      only with a per-tensor or block-wise broadcast scale).
    block_size: block length along ``axis`` for blocked scales, else 0.
    narrow_range: use ``[q_min + 1, q_max]``.
    grad_factor: multiplies the gradients of ``scale`` and ``zero_point``.

  Returns:
    An array like ``x`` (same shape and dtype).

  Raises:
    TypeError: for an unsupported dtype of ``x``, ``scale``, ``zero_point`` or
      ``dtype``, or a ``grad_factor`` that is not a number.
    ValueError: if the shapes fit no granularity or ``axis`` / ``block_size``
      are out of range.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([-4.0, 0.375, 2.5])  # x / scale: -16 (below), 1.5, 10 (above)
    >>> loss = lambda scale: jq.fake_quantize_learnable(x, scale, 0.0, dtype=jnp.int4).sum()
    >>> jax.grad(loss)(jnp.float32(0.25))  # -8 + (0.5 - 0.375) / 0.25 + 7
    Array(-0.5, dtype=float32)
  """
  x = _dtypes.float_input("x", jnp.asarray(x))
  info = _fake_quantized_dtype(dtype, narrow_range=narrow_range, integer=True)
  parameters = _parameters.bind(
      x.shape, scale, zero_point, info, axis=axis, block_size=block_size, learned=True)
  quantizer = _Quantizer(
      info, _numerics.division_precision(parameters.scale.dtype), "lsq", float(grad_factor)
  )
  return _apply(x, parameters, quantizer)


@_bind.op(
    jit=True, dtype=_bind.dtype, axis=_bind.optional_integer, block_size=_bind.integer,
    symmetric=_bind.boolean, gradient=_bind.choice("masked", "identity"),
)
def fake_quantize_dynamic(
    x: ArrayLike,
    *,
    dtype: DTypeLike = jnp.int8,
    axis: int | None = None,
    block_size: int = 0,
    symmetric: bool = False,
    gradient: Literal["masked", "identity"] = "masked",
) -> jax.Array:
  r"""Fake quantization with a scale and zero point taken from x itself (activations).

  .. math::

    (q, s, z) = \mathrm{dynamic\_quantize\_linear}(x), \qquad
    y = (q - z) \cdot s

  bit for bit ``dequantize_linear(*dynamic_quantize_linear(x, ...))`` in x's
  dtype: every batch is quantized with its own range, as at inference with
  dynamic activation quantization. The gradient is straight through:
  ``s`` and ``z`` are treated as constants (no gradient flows through the
  min and max), and ``dy/dx`` is :func:`fake_quantize`'s ``gradient`` rule,
  which is 1 for every finite element because the range covers all of x,
  except an extreme that the zero point's rounding puts one step outside it
  (clamped, so 0 under ``"masked"``, as is NaN).

  Args:
    x: float32, float16 or bfloat16 input.
    dtype: an integer quantized dtype of at most 16 bits.
    axis: ``None`` for one scale for the tensor; ``k`` for one per index of
      dimension k, or one per block with ``block_size``.
    block_size: with ``axis``: one scale per ``block_size`` elements along it.
    symmetric: zero point 0 and ``scale = max|x| / q_max`` (signed dtypes).
    gradient: ``"masked"`` or ``"identity"``.

  Returns:
    An array like ``x`` (same shape and dtype).

  Raises:
    TypeError: if ``x`` is not a float array or ``dtype`` not an integer
      quantized dtype of at most 16 bits.
    ValueError: for ``symmetric=True`` with an unsigned dtype, ``axis`` /
      ``block_size`` out of range, or an unknown ``gradient``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.fake_quantize_dynamic(jnp.array([0.0, 2.0, -2.5, -3.0]), dtype=jnp.uint8)
    Array([ 0.       ,  2.       , -2.4901962, -3.       ], dtype=float32)
  """
  x = _dtypes.float_input("x", jnp.asarray(x))
  dynamic = _dynamic.dynamic_range(
      x.shape, dtype=dtype, axis=axis, block_size=block_size,
      symmetric=symmetric,
  )
  _fake_quantized_dtype(dtype, narrow_range=False)  # at most 16 bits
  # Statistics of a stop_gradient'ed x: no derivative of the reduction is traced at all.
  scale, zero_point = dynamic.scale_and_zero_point(lax.stop_gradient(x))
  quantizer = _Quantizer(dynamic.info, np.dtype(np.float32), gradient)  # the float32 scale's
  return _apply(
      x, _parameters.Parameters(dynamic.info, scale, zero_point, dynamic.granularity), quantizer)


@_validate.reports_as("lsq_grad_factor")
def lsq_grad_factor(elements_per_scale: int, *, dtype: DTypeLike = jnp.int8) -> float:
  r"""LSQ's recommended ``grad_factor`` for :func:`fake_quantize_learnable`.

  .. math::

    f = \frac{1}{\sqrt{N \cdot q_{max}}}

  where ``N`` is the number of elements sharing one scale (a layer's weight
  count per tensor, ``x.size // scale.size`` per channel or block; the
  features per example for activations) and ``q_max`` the dtype's maximum.
  It keeps the scale's update in proportion to the weights' (Esser et al.
  2019, section 2.2).

  Args:
    elements_per_scale: ``N``, a positive int.
    dtype: the integer quantized dtype.

  Returns:
    The factor, a Python float.

  Raises:
    TypeError: if ``elements_per_scale`` is not an int, or ``dtype`` not an
      integer quantized dtype.
    ValueError: if ``elements_per_scale`` is not positive, or not below 2**63.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> round(jq.lsq_grad_factor(4 * 64, dtype=jnp.int4), 6)  # 1 / sqrt(256 * 7)
    0.023623
  """
  elements = _validate.static_int("elements_per_scale", elements_per_scale)
  _validate.check(elements > 0, "elements_per_scale", "a positive int", elements)
  # No array has more elements; beyond a float, math.sqrt would overflow.
  _validate.check(elements < 2**63, "elements_per_scale", "below 2**63", elements)
  info = _dtypes.quantized_dtype("dtype", dtype, integer=True)
  return 1.0 / math.sqrt(elements * info.max)
