"""DirectML's quantized add (DML_ELEMENT_WISE_QUANTIZED_LINEAR_ADD); docs/numerics.md."""

from __future__ import annotations

import functools

import jax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _bind
from jaxquant import _dispatch
from jaxquant import _dtypes
from jaxquant import _numerics
from jaxquant import _parameters
from jaxquant import _validate
import pallas_kernels


def _operand(name, values, scale, zero_point):
  """Validates one quantized operand; returns it with scalar scale and zero point."""
  values = jnp.asarray(values)
  info = _dtypes.quantized_dtype(f"{name}.dtype", values.dtype, integer=True)
  return (values, info, *_parameters.per_tensor(name, scale, zero_point, info))


def _add_formula(
    a, b, a_scale, a_zero_point, b_scale, b_zero_point, out_scale, out_zero_point,
    *, a_info, b_info, out_info,
):
  to_float = functools.partial(_numerics.dequantize_formula, output_dtype=jnp.float32)
  a_value = to_float(a, a_scale, a_zero_point, info=a_info)
  b_value = to_float(b, b_scale, b_zero_point, info=b_info)
  # The sign of a zero sum rounds to the same integer.
  total = _numerics.rounded_sum(a_value, b_value, signed_zero=False)
  return _numerics.quantize_formula(
      total, out_scale, out_zero_point,
      info=out_info, precision=np.dtype(np.float32), saturate=True,
  )


def _check_zero_points(arguments: dict) -> None:
  a_dtype = getattr(arguments["a"], "dtype", None)
  for name, dtype in [("a", a_dtype), ("b", getattr(arguments["b"], "dtype", None)),
                      ("out", arguments["output_dtype"] or a_dtype)]:
    arguments[f"{name}_zero_point"] = _dtypes.host_zero_point(
        f"{name}_zero_point", arguments[f"{name}_zero_point"], dtype
    )


@_bind.op(
    jit=True, output_dtype=_bind.dtype, implementation=_bind.IMPLEMENTATION,
    check=_check_zero_points,
)
def quantized_add(
    a: ArrayLike,
    a_scale: ArrayLike,
    a_zero_point: ArrayLike | None,
    b: ArrayLike,
    b_scale: ArrayLike,
    b_zero_point: ArrayLike | None,
    out_scale: ArrayLike,
    out_zero_point: ArrayLike | None = None,
    *,
    output_dtype: DTypeLike | None = None,
    implementation: str | None = None,
) -> jax.Array:
  r"""Adds two quantized tensors into a third quantization: DirectML's quantized add.

  .. math::

    y = \mathrm{saturate}\left(\mathrm{round\_half\_to\_even}\left(
        \frac{(a - z_a) s_a + (b - z_b) s_b}{s_{out}}\right) + z_{out}\right)

  in float32, one fused element-wise pass. The rounding happens before the
  output zero point is added (DirectML); onnxruntime's QLinearAdd folds the
  zero point in first and so differs by 1 at some ties. Non-finite values
  follow :func:`quantize_linear` (NaN gives the minimum). ``a`` and ``b``
  broadcast NumPy-style. Integer outputs carry no gradient.

  Args:
    a: integer quantized tensor (int2 to uint32; a, b and the output may mix
      them; a Python list or int is int32, as ``jnp.asarray`` makes it).
    a_scale: per-tensor scale of ``a`` (float32, float16 or bfloat16).
    a_zero_point: per-tensor zero point of ``a`` in a's dtype, or ``None`` for 0.
    b: the other operand, broadcastable against ``a``.
    b_scale: per-tensor scale of ``b``.
    b_zero_point: per-tensor zero point of ``b``, or ``None``.
    out_scale: per-tensor scale of the output.
    out_zero_point: per-tensor zero point of the output, or ``None`` for 0.
    output_dtype: output dtype when ``out_zero_point`` is ``None`` or a Python
      number; default a's dtype.
    implementation: ``None`` (the fastest path), ``"xla"`` or ``"pallas"``; same bits.

  Returns:
    ``broadcast_shapes(a.shape, b.shape)``-shaped array of out_zero_point's
    dtype, else ``output_dtype``, else a's dtype.

  Raises:
    TypeError: for float or unsupported operand, scale or zero point dtypes.
    ValueError: if a and b do not broadcast, a scale or zero point is not
      per-tensor, or ``output_dtype`` conflicts with ``out_zero_point``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> a = jnp.array([1, 3, 5, -1], jnp.int8)
    >>> jq.quantized_add(a, 1.0, None, jnp.int8(0), 1.0, None, 2.0, jnp.int8(1))
    Array([1, 3, 3, 1], dtype=int8)
  """
  a, a_info, a_scale, a_zero_point = _operand("a", a, a_scale, a_zero_point)
  b, b_info, b_scale, b_zero_point = _operand("b", b, b_scale, b_zero_point)
  try:
    shape = jnp.broadcast_shapes(a.shape, b.shape)
  except ValueError:
    _validate.fail("b.shape", f"broadcastable with a.shape {a.shape}", b.shape)
  out_info = _parameters.quantized_output_dtype(
      out_zero_point, output_dtype, argument="out_zero_point", default=a.dtype,
      integer=True,
  )
  out_scale, out_zero_point = _parameters.per_tensor("out", out_scale, out_zero_point, out_info)
  formula = functools.partial(_add_formula, a_info=a_info, b_info=b_info, out_info=out_info)
  parameters = [a_scale, a_zero_point, b_scale, b_zero_point, out_scale, out_zero_point]

  def xla(a, b, parameters):
    return jnp.broadcast_to(formula(a, b, *parameters), shape)

  def kernel(a, b, parameters):
    return pallas_kernels.quantized_add(
        a, b, parameters, formula=formula, output_dtype=out_info.dtype
    )

  return _dispatch.evaluate(
      _dispatch.Route("quantized_add", out_info.name, "per-tensor"),
      implementation, xla, kernel, a, b, parameters)
