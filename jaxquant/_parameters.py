"""A call's quantization parameters, bound once: scale, zero point, their dtype and layout.

Inside an op's ``jax.jit``, :func:`bind` turns the arrays a call gave into a
frozen :class:`Parameters` (the quantized dtype's table entry, the scale,
the zero point in that dtype, the :class:`~jaxquant._granularity.Granularity`),
validating each once; the op then only evaluates its formula on them.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses

import jax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _dtypes
from jaxquant import _granularity
from jaxquant import _numerics
from jaxquant import _packing
from jaxquant import _validate


def zero_point_array(
    argument: str,
    zero_point: ArrayLike | None,
    dtype: np.dtype,
    *,
    host_dtype: np.dtype | None = None,
) -> jax.Array | None:
  """``zero_point`` as an array of ``dtype``; a Python number takes ``dtype``.

  For a dtype XLA lacks (float6) the array holds codes: a Python number is
  rounded to ``dtype`` as quantize rounds, and uint8 codes pass through.

  Args:
    argument: the argument's name, for the message.
    zero_point: the zero point, or ``None``.
    dtype: the quantized dtype.
    host_dtype: the dtype of a NumPy zero point already turned into codes by
      :func:`_dtypes.host_codes`, else ``None``.

  Raises:
    TypeError: if an array zero point has a dtype other than ``dtype`` (or,
      for float6, its uint8 codes), or a Python float is given for an integer
      ``dtype`` (it would be truncated).
  """
  if zero_point is None:
    return None
  info = _dtypes.quantized_dtype(argument, dtype)
  zero_point = jnp.asarray(zero_point)
  if host_dtype is None and zero_point.weak_type:
    _validate.check(
        not (info.is_integer and jnp.issubdtype(zero_point.dtype, jnp.floating)),
        argument, f"an integer for the integer dtype {info.name}",
        "a Python float", error=TypeError,
    )
    if info.as_codes:
      # XLA cannot cast to float6: round the number as quantize would.
      return _numerics.round_and_saturate(zero_point.astype(jnp.float32), None, info)
    return zero_point.astype(dtype)
  got = zero_point.dtype if host_dtype is None else host_dtype
  given_as_codes = info.as_codes and host_dtype is None and got == jnp.uint8
  _validate.check(
      got == info.dtype or given_as_codes, f"{argument}.dtype",
      f"{info.name} (the quantized dtype){' or its uint8 codes' if info.as_codes else ''}",
      got.name, error=TypeError,
  )
  return _packing.from_codes(zero_point, info) if info.as_codes else zero_point


def quantized_output_dtype(
    zero_point: ArrayLike | None,
    output_dtype: DTypeLike | None,
    *,
    argument: str = "zero_point",
    default: DTypeLike = jnp.uint8,
    integer: bool = False,
    zero_point_dtype: np.dtype | None = None,
) -> _dtypes.QuantizedDType:
  """The zero point's dtype, else ``output_dtype``, else ``default``; a conflict is an error.

  ``zero_point_dtype`` is the dtype of a NumPy zero point that
  :func:`_dtypes.host_codes` turned into codes (float6).
  """
  if zero_point_dtype is None and zero_point is not None:
    if not jnp.asarray(zero_point).weak_type:
      zero_point_dtype = jnp.asarray(zero_point).dtype
  if zero_point_dtype is not None:
    info = _dtypes.quantized_dtype(
        f"{argument}.dtype", zero_point_dtype, integer=integer
    )
    if output_dtype is not None:
      _dtypes.quantized_dtype("output_dtype", output_dtype, integer=integer)
      _validate.check(
          np.dtype(output_dtype) == info.dtype, "output_dtype",
          f"None or {argument}'s dtype {info.name}", np.dtype(output_dtype).name,
      )
    return info
  return _dtypes.quantized_dtype(
      "output_dtype", default if output_dtype is None else output_dtype,
      integer=integer,
  )


def learned_parameter(argument: str, value: ArrayLike) -> jax.Array:
  """A learned float parameter (a scale or zero point trained by LSQ); a Python number is float32."""
  value = jnp.asarray(value)
  if value.weak_type:
    value = value.astype(jnp.float32)
  _validate.check(
      value.dtype in _dtypes.OUTPUT_FLOAT_DTYPES, f"{argument}.dtype",
      "a float dtype (float32, float16 or bfloat16; it is learned)", value.dtype.name,
      error=TypeError,
  )
  return value


def per_tensor(
    prefix: str, scale: ArrayLike, zero_point: ArrayLike | None, info: _dtypes.QuantizedDType
) -> tuple[jax.Array, jax.Array | None]:
  """A per-tensor ``{prefix}_scale`` and ``{prefix}_zero_point`` (0-d or one element) as 0-d arrays."""
  scale = _dtypes.scale_array(f"{prefix}_scale", scale)
  zero_point = zero_point_array(f"{prefix}_zero_point", zero_point, info.dtype)
  for name, value in [("scale", scale), ("zero_point", zero_point)]:
    _validate.check(
        value is None or value.size == 1, f"{prefix}_{name}.shape",
        "() or one element (per-tensor)", None if value is None else value.shape,
    )
  return scale.reshape(()), None if zero_point is None else zero_point.reshape(())


@dataclasses.dataclass(frozen=True)
class Parameters:
  """A call's quantization parameters, validated and canonicalised once.

  Attributes:
    info: the quantized dtype's table entry.
    scale: the scale (its dtype is the division's default precision).
    zero_point: the zero point, in ``info``'s array dtype (a learned one in
      float), or ``None`` for 0.
    granularity: how scale and zero point lay out against x.
  """

  info: _dtypes.QuantizedDType
  scale: jax.Array
  zero_point: jax.Array | None
  granularity: _granularity.Granularity

  @property
  def arrays(self) -> list[jax.Array | None]:
    """``[scale, zero_point]``: the formula's parameters, in its order."""
    return [self.scale, self.zero_point]

  # The one blocked view, read by both evaluations: XLA expands each
  # parameter over its block inside the formula's fusion (x is never
  # reshaped); a kernel takes the parameters at their own size, shaped to
  # x's rank, and the block each covers along every dim.

  def apply(self, formula: Callable[..., jax.Array], x: jax.Array) -> jax.Array:
    """``formula(x, scale, zero_point)`` element-wise, each x element with its block's parameters (XLA)."""
    return _granularity.apply_blockwise(formula, x, self.arrays, self.granularity)

  @property
  def shaped(self) -> list[jax.Array | None]:
    """Scale and zero point in x's rank, one element per block (the kernels')."""
    return self.granularity.shaped(self.arrays)

  @property
  def blocks(self) -> tuple[int, ...]:
    """Per dim, the x elements one parameter covers where it is split, else 1 (the kernels')."""
    return self.granularity.kernel_blocks


# Scale and zero point are the leaves: a derivative flows to them, and the
# dtype and layout stay static.
jax.tree_util.register_dataclass(
    Parameters, data_fields=["scale", "zero_point"], meta_fields=["info", "granularity"])


def bind(
    shape: tuple[int, ...],
    scale: ArrayLike,
    zero_point: ArrayLike | None,
    info: _dtypes.QuantizedDType,
    *,
    axis: int | None,
    block_size: int,
    zero_point_dtype: np.dtype | None = None,
    learned: bool = False,
) -> Parameters:
  """Binds scale and zero point against an x of ``shape`` quantized to ``info``.

  Args:
    shape: x's shape (the unpacked shape of packed x).
    scale: the scale as given.
    zero_point: the zero point as given, or ``None``.
    info: the quantized dtype.
    axis: the quantization axis, as given.
    block_size: the block length, as given.
    zero_point_dtype: the dtype of a NumPy zero point already turned into
      codes (float6), else ``None``.
    learned: scale and zero point are learned floats (LSQ), not an ONNX
      scale and a zero point in the quantized dtype.

  Returns:
    The :class:`Parameters`.

  Raises:
    TypeError: for a dtype of ``scale`` or ``zero_point`` that is not accepted.
    ValueError: if the shapes fit no granularity, or ``axis``/``block_size``
      are out of range.
  """
  if learned:
    scale = learned_parameter("scale", scale)
    if zero_point is not None:
      zero_point = learned_parameter("zero_point", zero_point)
  else:
    scale = _dtypes.scale_array("scale", scale)
    zero_point = zero_point_array(
        "zero_point", zero_point, info.dtype, host_dtype=zero_point_dtype)
  granularity = _granularity.resolve(
      shape, scale.shape, None if zero_point is None else zero_point.shape,
      axis=axis, block_size=block_size,
  )
  return Parameters(info, scale, zero_point, granularity)
