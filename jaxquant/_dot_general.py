"""Drop-ins for ``lax.dot_general`` and ``lax.conv_general_dilated``, and a duck-typed swap.

Flax's layers take their contraction as an argument (``nnx.Linear(...,
dot_general=)``, ``nnx.Conv(..., conv_general_dilated=)``, ``nnx.Einsum(...,
einsum_op=)``, linen's ``Dense(dot_general=)``), so a model quantizes its
matmuls by being handed these functions: jaxquant never imports Flax.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import functools
import math
import string
import types
from typing import Any

import jax
from jax import lax
from jax.typing import ArrayLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _checked
from jaxquant import _dtypes
from jaxquant import _dynamic
from jaxquant import _fake
from jaxquant import _linear
from jaxquant import _matmul
from jaxquant import _packing
from jaxquant import _params
from jaxquant import _recipes
from jaxquant import _sharding
from jaxquant import _validate

_INT8 = _dtypes.quantized_dtype("dtype", jnp.int8)


def _symmetric_scale(x: jax.Array, reduced: Sequence[int], info=_INT8) -> jax.Array:
  """``max|x| / qmax`` over the ``reduced`` dims (kept as size 1), 1 where x is all zeros.

  Held constant for differentiation: the statistics read x without a tangent,
  so no derivative of their reduction is traced, and every drop-in's
  derivative is the straight-through one (through ``max|x|`` it would reach
  the largest-magnitude element of each row and no other, a gradient that
  trains nothing).
  """
  return _compiled_symmetric_scale(lax.stop_gradient(x), tuple(reduced), info)


# Compiled once per shape: called eagerly (a drop-in outside jit, a model run op by op), the
# statistics' cond and variadic reduce, closures made anew each call, compiled on every call.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _compiled_symmetric_scale(x: jax.Array, reduced: tuple[int, ...], info) -> jax.Array:
  # Not keepdims (a kernel's reduction, NaN-aware in one pass): XLA:CPU then
  # reduces integer keys, with no |x| written out and no constant x folded.
  (magnitude,) = _dynamic._max_magnitude(x, reduced)
  magnitude = jnp.expand_dims(magnitude, reduced)
  scale, _ = _dynamic._symmetric_parameters(magnitude, info=info)
  return scale


def _signed_integer(argument: str, dtype: Any):
  info = _dtypes.quantized_dtype(argument, dtype, integer=True)
  _validate.check(
      info.min < 0 and info.bits <= 8, argument,
      "a signed integer dtype of at most 8 bits (int8, int4, int2: symmetric, no zero point)",
      info.name, error=TypeError,
  )
  return info


def _quantize_symmetric(x: ArrayLike, reduced: Sequence[int], info=_INT8):
  """x as symmetric ``info.dtype``, one scale per index of the dims not ``reduced``."""
  x = _dtypes.float_input("lhs or rhs", jnp.asarray(x))
  scale = _symmetric_scale(x, reduced, info)
  with _checked.unchecked():
    return _linear.quantize_linear(x, scale, axis=None, output_dtype=info.dtype), scale


def _rhs_quantized(rhs: Any, reduced: Sequence[int], info=_INT8, *,
                   kept: str = "a dim that is not contracted", as_stored: bool = False):
  """rhs as symmetric ``info.dtype`` with a scale of its rank, 1 along the ``reduced`` dims.

  A float rhs is quantized here, one scale per index of the other dims; a
  :class:`QuantizedArray` (of ``info.dtype``, no zero point, scale per tensor
  or along a dim that is not reduced; packed values unpacked) is used as it is:
  in the tensor's dim order, or with ``as_stored`` in its values' (the last
  two swapped where it is ``transposed``). ``kept`` names the dims a scale may
  run along, for the error.
  """
  if not isinstance(rhs, _params.QuantizedArray):
    return _quantize_symmetric(rhs, reduced, info)
  _params.element(rhs, "rhs")
  # quantize_params stores a non-negative axis; one built by hand may count from the end
  # (dequantize() reads it so): normalized, a reduced dim so counted is not taken for a kept one.
  axis = None if rhs.axis is None else rhs.axis % max(len(rhs.shape), 1)
  _validate.check(
      rhs.dtype == info.dtype and rhs.zero_point is None and rhs.block_size == 0
      and (rhs.scale.size == 1 or (
          axis is not None and axis not in reduced and rhs.scale.size == rhs.shape[axis])),
      "rhs", f"a float array, or a QuantizedArray of {info.name} without zero point "
      f"scaled per tensor or per index of {kept}", repr(rhs),
      error=TypeError,
  )
  values = _packing.unpacked_values(rhs.values, rhs.shape, rhs.dtype) if rhs.packed else rhs.values
  if rhs.transposed and not as_stored:
    values = jnp.swapaxes(values, -1, -2)
  shape = [1] * len(rhs.shape)
  if rhs.scale.size > 1:
    shape[rhs.stored_dim(axis) if as_stored else axis] = rhs.shape[axis]
  return values, rhs.scale.reshape(shape)


def _rhs_for_dot(rhs: Any, dimension_numbers: Any, info=_INT8):
  """:func:`_rhs_quantized` for a dot: ``(values, scale, dimension_numbers)``.

  A :class:`QuantizedArray` stored ``transposed`` enters the dot as it is
  stored, the dimension numbers counting its dims: swapped back instead, a
  contracted dim it stores minor would be major again, which the int8 dot
  reads by slices (``_matmul._int8_rows_dot``). Unless both swapped dims are
  free: the result keeps rhs's free dims in their order, so that swap is
  undone first.
  """
  (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
  as_stored = False
  if isinstance(rhs, _params.QuantizedArray) and rhs.transposed:
    ndim = len(rhs.shape)
    as_stored = any(d % ndim >= ndim - 2 for d in (*rhs_contracting, *rhs_batch))
  values, scale = _rhs_quantized(rhs, rhs_contracting, info, as_stored=as_stored)
  if not as_stored:
    return values, scale, dimension_numbers

  def stored(dims):
    return tuple(rhs.stored_dim(d % ndim) for d in dims)

  return values, scale, (
      (lhs_contracting, stored(rhs_contracting)), (lhs_batch, stored(rhs_batch)))


def _result_dtype(lhs, rhs, preferred_element_type):
  if preferred_element_type is not None:
    return np.dtype(preferred_element_type)
  if isinstance(rhs, _params.QuantizedArray):
    rhs = jnp.zeros((), rhs.output_dtype)
  return np.dtype(jnp.result_type(lhs, rhs))


def _compute_dtype(result_dtype: np.dtype) -> np.dtype:
  """The float dtype a product is scaled and computed in: the result's, or float32."""
  return result_dtype if result_dtype in _dtypes.OUTPUT_FLOAT_DTYPES else np.dtype(np.float32)


def _integer_dot(lhs_values, rhs_values, dimension_numbers, result_dtype, out_sharding, *,
                 lhs_scale, rhs_scale, lhs_zero_point=None):
  """:func:`quantized_dot_general` of the integer operands, in the result dtype."""
  compute = _compute_dtype(result_dtype)

  def product(lhs_values, rhs_values, lhs_scale, rhs_scale, lhs_zero_point):
    # The scales are the activations' statistics (or were checked when they
    # quantized them) and the stored weight's.
    with _checked.unchecked():
      return _matmul.quantized_dot_general(
          lhs_values, rhs_values, dimension_numbers, lhs_scale=lhs_scale,
          lhs_zero_point=lhs_zero_point, rhs_scale=rhs_scale, preferred_element_type=compute,
      ).astype(result_dtype)

  return _sharding.placed(product, out_sharding, lhs_values, rhs_values, lhs_scale,
                          rhs_scale, lhs_zero_point)


def _float_dot(lhs, rhs, dimension_numbers, result_dtype, out_sharding):
  """The float product of fake-quantized operands: the integer dot's derivative."""
  compute = _compute_dtype(result_dtype)
  return lax.dot_general(
      lhs.astype(compute), rhs.astype(compute), dimension_numbers,
      preferred_element_type=compute, out_sharding=out_sharding).astype(result_dtype)


def _zero_point_shifted(values: jax.Array, zero_point: jax.Array | None) -> jax.Array:
  """``values - zero_point`` exactly, as int16 (int8's differences fit it), or int8 for none."""
  if zero_point is None:
    return values
  return values.astype(jnp.int16) - jnp.asarray(zero_point).astype(jnp.int16)


def _static_parameters(lhs, input_scale, input_zero_point):
  """lhs, ``input_scale`` and ``input_zero_point`` (0-d) as arrays, checked."""
  lhs = _dtypes.float_input("lhs", jnp.asarray(lhs))
  input_scale = _dtypes.scale_array("input_scale", input_scale)
  _validate.check(
      input_scale.size == 1, "input_scale.shape", "one element (per tensor)",
      input_scale.shape,
  )
  if input_zero_point is not None:
    # The activations quantize to int8, the zero point's dtype (a uint8 one would need
    # uint8 values: quantize_linear refused the pair with a ValueError).
    input_zero_point = _dtypes.zero_point_array("input_zero_point", input_zero_point, np.int8)
    _validate.check(
        input_zero_point.size == 1, "input_zero_point.shape", "one element (per tensor)",
        input_zero_point.shape,
    )
    input_zero_point = input_zero_point.reshape(())
  return lhs, input_scale.reshape(()), input_zero_point


def _static_lhs(lhs, input_scale, input_zero_point):
  """lhs as int8 at the checked per-tensor ``input_scale`` and ``input_zero_point``."""
  return _linear.quantize_linear(lhs, input_scale, input_zero_point, axis=None,
                                 output_dtype=jnp.int8)


def _matching(values, other):
  """Both integer operands in one dtype, as lax's integer contractions need."""
  if values.dtype == other.dtype:
    return values, other
  return values, other.astype(values.dtype)


def _straight_through(integer_product: Callable[..., jax.Array],
                      fake_quantized_product: Callable[..., jax.Array], *operands: Any):
  """``integer_product(*operands)``, differentiated as ``fake_quantized_product``.

  The integer evaluation's own derivative is round's, zero. Its operands are
  ``dequantize(quantize(.))`` of the given ones, so the product is, to
  float rounding, the float product of the fake-quantized operands (same
  scales), whose derivative is :func:`fake_quantize`'s straight-through one:
  the inference drop-ins train, as AQT's int8 ``dot_general`` does, and a
  frozen quantized layer passes its input's gradient on.
  """

  @jax.custom_jvp
  def product(*operands):
    return integer_product(*operands)

  @product.defjvp
  def _(primals, tangents):
    # The integer product first: its checks name a bad operand before the float one runs.
    result = product(*primals)
    _, tangent = jax.jvp(fake_quantized_product, primals, tangents)
    return result, tangent

  return product(*operands)


def _fake_quantized_symmetric(x: jax.Array, reduced: Sequence[int], info=_INT8) -> jax.Array:
  """x fake-quantized as :func:`_quantize_symmetric` quantizes it (the same scale)."""
  scale = _symmetric_scale(x, reduced, info)
  with _checked.unchecked():
    return _fake.fake_quantize(x, scale, axis=None, dtype=info.dtype)


def _fake_quantized_rhs(rhs: Any, reduced: Sequence[int], info=_INT8) -> jax.Array:
  """rhs as :func:`_rhs_quantized` has it, in float: a stored weight dequantized."""
  if isinstance(rhs, _params.QuantizedArray):
    return rhs.dequantize()
  return _fake_quantized_symmetric(rhs, reduced, info)


def _fake_quantized_static(lhs, input_scale, input_zero_point):
  """lhs fake-quantized as :func:`_static_lhs` quantizes it (masked where it saturates)."""
  with _checked.unchecked():
    return _fake.fake_quantize(lhs, input_scale, input_zero_point, axis=None, dtype=jnp.int8)


def _float_operand(name: str, x: Any) -> Any:
  """A float array as an array (checked), a stored weight as it is."""
  if _params._is_container(x):
    return x
  return _dtypes.float_input(name, jnp.asarray(x))


@_validate.reports_as("dot_general_dynamic_int8")
def dot_general_dynamic_int8(
    lhs: ArrayLike,
    rhs: ArrayLike,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    out_sharding: Any = None,
    lhs_dtype: Any = jnp.int8,
    rhs_dtype: Any = jnp.int8,
) -> jax.Array:
  r"""``lax.dot_general`` with both operands quantized to int8 at run time, int32 accumulation.

  .. math::

    y = s_{lhs} \, s_{rhs} \sum_k q_{lhs} q_{rhs}, \quad
    q = \mathrm{round}(x / s), \quad s = \max|x| / q_{max}

  with one symmetric scale per index of each operand's batch and free dims
  (per token for activations, per output feature for a kernel), taken over
  the contracting dims; the sum is exact in int32 and the scaling
  :func:`quantized_dot_general`'s (``float32(acc) * (s_lhs * s_rhs)``).
  Symmetric, so that no zero-point correction is needed. For ``nnx.Linear(dot_general=...)``,
  linen's ``Dense(dot_general=...)``, ``nnx.Einsum`` through
  :func:`replace_ops`, or direct calls. The derivative is straight-through:
  that of ``lax.dot_general`` of the fake-quantized operands
  (:func:`fake_quantize` at the same scales, held constant), so a model
  with these layers trains, and a frozen one passes its input's gradient
  on; a stored weight's scale gets :meth:`QuantizedArray.dequantize`'s.
  ``lhs_dtype`` and ``rhs_dtype`` choose narrower symmetric integers
  (``q_max`` 7 for int4, 1 for int2): int4 activations are
  ``functools.partial(dot_general_dynamic_int8, lhs_dtype=jnp.int4)``, the
  product still exact in int32.

  Args:
    lhs: float activations.
    rhs: float weights (or a second float operand), or weights stored as a
      :class:`QuantizedArray` of ``rhs_dtype`` (no zero point, scale per
      tensor or per output feature; packed or not), used as they are.
    dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
    precision: ignored (integer arithmetic is exact).
    preferred_element_type: the float dtype of the result; default the
      operands' promoted dtype.
    out_sharding: the result's sharding (a sharding constraint), or ``None``.
    lhs_dtype: the activations' dtype: int8, int4 or int2 (static).
    rhs_dtype: the weights' dtype: int8, int4 or int2 (static).

  Returns:
    The float result, shaped as ``lax.dot_general``'s.

  Raises:
    TypeError: if an operand is not a float array (or a fitting
      :class:`QuantizedArray`), or for a dtype that is not a signed integer.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([[1.0, -2.0, 0.5]])
    >>> w = jnp.array([[0.5], [0.25], [-1.0]])
    >>> jq.dot_general_dynamic_int8(x, w, (((1,), (0,)), ((), ())))  # float: -0.5
    Array([[-0.499969]], dtype=float32)
    >>> jq.dot_general_dynamic_int8(x, w, (((1,), (0,)), ((), ())), lhs_dtype=jnp.int4)
    Array([[-0.6434196]], dtype=float32)
  """
  (lhs_contracting, rhs_contracting), _ = dimension_numbers
  lhs_info = _signed_integer("lhs_dtype", lhs_dtype)
  rhs_info = _signed_integer("rhs_dtype", rhs_dtype)
  lhs, rhs = _float_operand("lhs", lhs), _float_operand("rhs", rhs)
  result_dtype = _result_dtype(lhs, rhs, preferred_element_type)

  def integer(lhs, rhs):
    lhs_values, lhs_scale = _quantize_symmetric(lhs, lhs_contracting, lhs_info)
    rhs_values, rhs_scale, numbers = _rhs_for_dot(rhs, dimension_numbers, rhs_info)
    return _integer_dot(lhs_values, rhs_values, numbers, result_dtype, out_sharding,
                        lhs_scale=lhs_scale, rhs_scale=rhs_scale)

  def fake_quantized(lhs, rhs):
    return _float_dot(
        _fake_quantized_symmetric(lhs, lhs_contracting, lhs_info),
        _fake_quantized_rhs(rhs, rhs_contracting, rhs_info),
        dimension_numbers, result_dtype, out_sharding)

  return _straight_through(integer, fake_quantized, lhs, rhs)


@_validate.reports_as("dot_general_static_int8")
def dot_general_static_int8(
    lhs: ArrayLike,
    rhs: ArrayLike,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    out_sharding: Any = None,
    input_scale: ArrayLike,
    input_zero_point: ArrayLike | None = None,
) -> jax.Array:
  r"""``lax.dot_general`` with int8 activations at a calibrated (static) scale.

  .. math::

    y = s_{in} \, s_{rhs} \sum_k (q_{lhs} - z_{in}) \, q_{rhs}, \quad
    q_{lhs} = \mathrm{saturate}(\mathrm{round}(x / s_{in}) + z_{in})

  ``lhs`` is quantized with the given per-tensor scale and zero point (from
  :func:`calibrate` or :func:`observer_qparams`); ``rhs`` symmetric int8 per
  output feature as in :func:`dot_general_dynamic_int8`. The product is
  :func:`quantized_dot_general`'s: int32 accumulation with the zero point's
  correction, exact, then ``float32(acc) * (s_in * s_rhs)``. The
  derivative is :func:`dot_general_dynamic_int8`'s straight-through one,
  ``lhs`` masked where it saturates (:func:`fake_quantize`'s rule; none for
  ``input_scale`` and ``input_zero_point``). Bind the
  parameters with ``functools.partial`` to get ``lax.dot_general``'s
  signature; :func:`calibrate` does.

  Args:
    lhs: float activations.
    rhs: float weights, or int8 weights as a :class:`QuantizedArray` (as in
      :func:`dot_general_dynamic_int8`).
    dimension_numbers: as ``lax.dot_general``'s.
    precision: ignored (integer arithmetic is exact).
    preferred_element_type: the float dtype of the result.
    out_sharding: the result's sharding (a sharding constraint), or ``None``.
    input_scale: the activations' float scale, one element.
    input_zero_point: int8 zero point, one element, or ``None`` (symmetric).

  Returns:
    The float result, shaped as ``lax.dot_general``'s.

  Raises:
    TypeError: if an operand is not a float array, or for a zero point that is not int8.
    ValueError: if ``input_scale`` has more than one element.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([[1.0, -2.0, 0.5]])
    >>> w = jnp.array([[0.5], [0.25], [-1.0]])
    >>> jq.dot_general_static_int8(x, w, (((1,), (0,)), ((), ())), input_scale=0.5)
    Array([[-0.5]], dtype=float32)
  """
  (_, rhs_contracting), _ = dimension_numbers
  lhs, input_scale, input_zero_point = _static_parameters(lhs, input_scale, input_zero_point)
  rhs = _float_operand("rhs", rhs)
  result_dtype = _result_dtype(lhs, rhs, preferred_element_type)

  def integer(lhs, rhs, scale, zero_point):
    lhs_values = _static_lhs(lhs, scale, zero_point)
    rhs_values, rhs_scale, numbers = _rhs_for_dot(rhs, dimension_numbers)
    return _integer_dot(
        lhs_values, rhs_values, numbers, result_dtype, out_sharding,
        lhs_scale=scale, rhs_scale=rhs_scale, lhs_zero_point=zero_point,
    )

  def fake_quantized(lhs, rhs, scale, zero_point):
    return _float_dot(
        _fake_quantized_static(lhs, scale, zero_point),
        _fake_quantized_rhs(rhs, rhs_contracting), dimension_numbers, result_dtype,
        out_sharding)

  return _straight_through(integer, fake_quantized, lhs, rhs, input_scale, input_zero_point)


def _trained(rhs: Any) -> Any:
  """A :class:`FakeQuantizedArray` ``rhs`` dequantized (its LSQ gradient), or the
  :class:`QuantizedArray` :func:`quantize_params` deploys it as (the same bits), else as given."""
  return _params.element(rhs, "rhs").dequantize() if _params._is_container(rhs) else rhs


def _weight_only(rhs, contracting, *, dtype, block_size, method):
  """rhs fake-quantized per output feature, or in blocks along its one contracting dim."""
  if isinstance(rhs, _params.QuantizedArray):
    return _params.element(rhs, "rhs").dequantize()
  rhs = _dtypes.float_input("rhs", jnp.asarray(rhs))
  contracting = [d % rhs.ndim for d in contracting]
  _validate.check(
      block_size == 0 or len(contracting) == 1, "block_size",
      "0 when rhs has several contracting dims", block_size,
  )
  free = [d for d in range(rhs.ndim) if d not in contracting]
  order = (*contracting, *free)
  # As a (contracted, free) matrix: blocks run along axis 0, output features along axis 1.
  matrix = jnp.transpose(rhs, order).reshape(
      math.prod(rhs.shape[d] for d in contracting), math.prod(rhs.shape[d] for d in free))
  quantized = _fake_quantized_weight(
      matrix, 0 if block_size else 1, dtype=dtype, block_size=block_size, method=method)
  return jnp.transpose(
      quantized.reshape([rhs.shape[d] for d in order]), np.argsort(order))


def _fake_quantized_weight(weight, axis, *, dtype, block_size, method):
  """``weight`` fake-quantized by a :func:`choose_qparams` recipe along ``axis``, as
  :func:`quantize_params` stores it (bit for bit its ``dequantize()``)."""
  scale, zero_point = _recipes.choose_qparams(
      weight, dtype, axis=axis, block_size=block_size, method=method)
  with _checked.unchecked():
    return _fake.fake_quantize(
        weight, scale, zero_point, dtype=dtype, axis=axis, block_size=block_size)


@_validate.reports_as("dot_general_weight_only")
def dot_general_weight_only(
    lhs: ArrayLike,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    out_sharding: Any = None,
    dtype: Any = jnp.int8,
    block_size: int = 0,
    method: str = "absmax",
) -> jax.Array:
  r"""``lax.dot_general`` with ``rhs`` quantized and dequantized: weight-only quantization.

  .. math::

    y = \mathrm{dot\_general}(x, \hat w), \qquad
    \hat w = \mathrm{fake\_quantize}(w, s, z), \quad
    (s, z) = \mathrm{choose\_qparams}(w, \mathrm{dtype}, \mathrm{method})

  with one scale per output feature of ``rhs`` (its dims that are not
  contracted), or, with ``block_size``, per ``block_size`` elements along its
  contracting dim (a short last block allowed). A stored
  :class:`QuantizedArray` ``rhs`` is dequantized instead. The gradient is
  :func:`fake_quantize`'s straight-through one for ``rhs`` (the scale held
  constant: qwix-style QAT) and the ordinary one for ``lhs``. Bind the
  options with ``functools.partial``; :func:`replace_ops` takes the result.
  For weights stored quantized in memory, use :func:`quantize_params` instead.

  Args:
    lhs: float activations.
    rhs: float weights, or a :class:`QuantizedArray`.
    dimension_numbers: as ``lax.dot_general``'s.
    precision: passed to ``lax.dot_general``.
    preferred_element_type: passed to ``lax.dot_general``.
    out_sharding: passed to ``lax.dot_general``.
    dtype: the weights' quantized dtype (integer, float8, float6, float4).
    block_size: block length along the contracting dim, 0 for per output feature.
    method: :func:`choose_qparams`'s recipe.

  Returns:
    ``lax.dot_general(lhs, w_hat, ...)``.

  Raises:
    TypeError: if ``rhs`` is not a float array or :class:`QuantizedArray`, or
      for an unsupported ``dtype``.
    ValueError: for ``block_size`` with several contracting dims, or a bad ``method``.

  Example:
    >>> import functools
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> int2 = functools.partial(jq.dot_general_weight_only, dtype=jnp.int2,
    ...                          method="qmax_plus_half")
    >>> w = jnp.array([[0.3, -1.5], [0.9, 0.2], [-0.6, 0.1]])
    >>> int2(jnp.eye(3), w, (((1,), (0,)), ((), ())))  # s = 0.9 / 1.5, 1.5 / 1.5
    Array([[ 0.59999996, -2.        ],
           [ 0.59999996,  0.        ],
           [-0.59999996,  0.        ]], dtype=float32)
  """
  (_, rhs_contracting), _ = dimension_numbers
  weight = _weight_only(rhs, rhs_contracting, dtype=dtype, block_size=block_size,
                        method=method)
  return lax.dot_general(lhs, weight, dimension_numbers, precision, preferred_element_type,
                         out_sharding=out_sharding)


@_validate.reports_as("dot_general_fake_quant")
def dot_general_fake_quant(
    lhs: ArrayLike,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    out_sharding: Any = None,
) -> jax.Array:
  r"""``lax.dot_general`` of ``lhs`` fake-quantized to int8 per row, for training.

  ``lhs`` goes through :func:`fake_quantize` with
  :func:`dot_general_dynamic_int8`'s symmetric per-row scale (held constant
  in the backward pass), so training sees inference's activation rounding;
  ``rhs`` is used as given: give the layer weights fake-quantized by a
  :class:`FakeQuantizedArray` (:func:`quantize_params` with
  ``learnable=True``), whose scale LSQ learns. Straight-through gradient for
  ``lhs``, the ordinary one for ``rhs``.

  Args:
    lhs: float activations.
    rhs: float (fake-quantized) weights, a :class:`FakeQuantizedArray`, or
      the :class:`QuantizedArray` that deploys one (either dequantized here).
    dimension_numbers: as ``lax.dot_general``'s.
    precision: passed to ``lax.dot_general``.
    preferred_element_type: passed to ``lax.dot_general``.
    out_sharding: passed to ``lax.dot_general``.

  Returns:
    ``lax.dot_general(fake_quantize(lhs), rhs, ...)``.

  Raises:
    TypeError: if ``lhs`` is not a float array.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([[1.0, -2.0, 0.3]])  # scale 2 / 127: 1.0 -> 64 steps, 0.3 -> 19
    >>> jq.dot_general_fake_quant(x, jnp.eye(3), (((1,), (0,)), ((), ())))
    Array([[ 1.007874 , -2.       ,  0.2992126]], dtype=float32)
  """
  (lhs_contracting, _), _ = dimension_numbers
  lhs = _dtypes.float_input("lhs", jnp.asarray(lhs))
  return lax.dot_general(
      _fake_quantized_symmetric(lhs, lhs_contracting), _trained(rhs), dimension_numbers, precision,
      preferred_element_type, out_sharding=out_sharding,
  )


def _shape(x: Any) -> tuple[int, ...]:
  return x.shape if _params._is_container(x) else jnp.shape(x)


def _conv_numbers(lhs, rhs, dimension_numbers):
  return lax.conv_dimension_numbers(jnp.shape(lhs), _shape(rhs), dimension_numbers)


def _conv_scales(numbers, lhs_scale, rhs_scale, out_ndim):
  """The operands' scales laid out against the convolution's output."""
  batch, feature = numbers.out_spec[0], numbers.out_spec[1]
  shape = [1] * out_ndim
  lhs_shape, rhs_shape = list(shape), list(shape)
  lhs_shape[batch] = lhs_scale.size
  rhs_shape[feature] = rhs_scale.size
  return lhs_scale.reshape(lhs_shape) * rhs_scale.reshape(rhs_shape)


def _integer_conv(lhs_values, lhs_scale, rhs_values, rhs_scale, numbers, arguments,
                  preferred_element_type, result_dtype, out_sharding):
  def on_xla(lhs_values, rhs_values):
    return lax.conv_general_dilated(
        lhs_values, rhs_values, dimension_numbers=numbers,
        preferred_element_type=jnp.int32, **arguments,
    )

  def by_taps(lhs_values, rhs_values):
    return integer_conv_by_taps(lhs_values, rhs_values, numbers, **arguments)

  def convolution(lhs_values, rhs_values):
    # XLA:GPU cannot lower an integer convolution ("Can't lower one or more
    # integer convolutions", jax 0.11.2, H100).
    return lax.platform_dependent(lhs_values, rhs_values, cuda=by_taps, default=on_xla)

  # lax.conv_general_dilated refuses an integer result of float operands; the
  # float32 epilogue cast to one would truncate.
  _validate.check(
      preferred_element_type is None or jnp.issubdtype(preferred_element_type, jnp.floating),
      "preferred_element_type", "a float dtype (the result's) or None",
      None if preferred_element_type is None else np.dtype(preferred_element_type).name,
      error=TypeError)
  accumulator = _sharding.placed(convolution, out_sharding, lhs_values, rhs_values)
  scale = _conv_scales(numbers, lhs_scale, rhs_scale, accumulator.ndim)
  return (accumulator.astype(jnp.float32) * scale).astype(result_dtype)


def _float_conv(lhs, rhs, numbers, arguments, result_dtype, out_sharding):
  """The float convolution of fake-quantized operands: the integer one's derivative."""
  compute = _compute_dtype(result_dtype)
  return lax.conv_general_dilated(
      lhs.astype(compute), rhs.astype(compute), dimension_numbers=numbers,
      preferred_element_type=compute, out_sharding=out_sharding, **arguments,
  ).astype(result_dtype)


def integer_conv_by_taps(
    lhs: jax.Array, rhs: jax.Array, numbers: lax.ConvDimensionNumbers, *,
    window_strides: Sequence[int], padding: Any, lhs_dilation: Sequence[int] | None,
    rhs_dilation: Sequence[int] | None, feature_group_count: int, batch_group_count: int,
) -> jax.Array:
  """``lax.conv_general_dilated`` of integer operands into int32, as one exact dot per tap.

  For each position of the kernel's window, the input elements it meets
  (a strided slice of the padded, dilated input) are contracted with that
  tap's weights by :func:`jaxquant._matmul.exact_bfloat16_dot`; the taps'
  int32 products are added. Each product is exact, so the sum is the
  integer convolution whatever the order. Operands are int8, or int16 holding
  differences of int8 values (``|v| <= 255``).
  """
  spatial = len(numbers.lhs_spec) - 2
  window_strides = tuple(window_strides)
  lhs_dilation = tuple(lhs_dilation or (1,) * spatial)
  rhs_dilation = tuple(rhs_dilation or (1,) * spatial)
  lhs = jnp.transpose(lhs, numbers.lhs_spec)  # (N, C, *S)
  rhs = jnp.transpose(rhs, numbers.rhs_spec)  # (O, I, *K)
  kernel = rhs.shape[2:]
  dilated_kernel = [(k - 1) * d + 1 for k, d in zip(kernel, rhs_dilation)]
  if isinstance(padding, str):
    padding = lax.padtype_to_pads(lhs.shape[2:], dilated_kernel, window_strides, padding)
  lhs = lax.pad(lhs, np.zeros((), lhs.dtype), [(0, 0, 0), (0, 0, 0)] + [
      (low, high, dilation - 1) for (low, high), dilation in zip(padding, lhs_dilation)])
  # max_dim and min_dim also order symbolic sizes (jax.export), which max and min cannot.
  out = [jax.core.max_dim((n - k) // s + 1, 0)
         for n, k, s in zip(lhs.shape[2:], dilated_kernel, window_strides)]
  depth_limit = 2**24 // (_value_bound(lhs) * _value_bound(rhs))
  batch, channels = lhs.shape[:2]
  outputs = rhs.shape[0]
  if batch_group_count > 1:
    # Batch group b meets output features [b * O / B, (b + 1) * O / B).
    groups, x_shape, x_batch = batch_group_count, (
        batch_group_count, batch // batch_group_count, channels), 0
  else:
    groups, x_shape, x_batch = feature_group_count, (
        batch, feature_group_count, channels // feature_group_count), 1
  total = None
  for tap in np.ndindex(*kernel):
    # A window larger than the input gives an empty output, and a tap may then lie past
    # the input's end: its empty slice starts at the end (lax.slice takes no start past it).
    start = [jax.core.min_dim(t * d, n) for t, d, n in zip(tap, rhs_dilation, lhs.shape[2:])]
    window = lax.slice(
        lhs, (0, 0, *start),
        (batch, channels, *[jax.core.max_dim(b, b + (o - 1) * s + 1)
                            for b, o, s in zip(start, out, window_strides)]),
        (1, 1, *window_strides))
    x = window.reshape(*x_shape, *out)
    w = rhs[(slice(None), slice(None)) + tap].reshape(groups, outputs // groups, x_shape[2])
    product = _matmul.exact_bfloat16_dot(  # (groups, rows, *out, outputs per group)
        x, w, (((2,), (2,)), ((x_batch,), (0,))), depth_limit=depth_limit)
    product = jnp.moveaxis(product, 0, -2).reshape(product.shape[1], *out, outputs)
    total = product if total is None else total + product
  result = jnp.moveaxis(total, -1, 1)  # (N, O, *out)
  return jnp.transpose(result, np.argsort(numbers.out_spec))


def _value_bound(x: jax.Array) -> int:
  """The largest magnitude an operand of :func:`integer_conv_by_taps` holds."""
  return 128 if x.dtype.itemsize == 1 else 256


def _kernel_reduced(rhs, numbers) -> list[int]:
  """The kernel's dims but its output feature dim: one scale per output feature."""
  return [d for d in range(len(_shape(rhs))) if d != numbers.rhs_spec[0]]


def _rhs_per_output_feature(rhs, numbers):
  """The kernel as symmetric int8 and its scale, per output feature (or per tensor)."""
  values, scale = _rhs_quantized(
      rhs, _kernel_reduced(rhs, numbers),
      kept=f"the kernel's output feature dim ({numbers.rhs_spec[0]})")
  return values, scale.reshape(-1)


def _fake_quantized_kernel(rhs, numbers):
  """The kernel as :func:`_rhs_per_output_feature` has it, in float."""
  return _fake_quantized_rhs(rhs, _kernel_reduced(rhs, numbers))


@_validate.reports_as("conv_general_dilated_weight_only")
def conv_general_dilated_weight_only(
    lhs: ArrayLike,
    rhs: Any,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    *,
    dtype: Any = jnp.int8,
    block_size: int = 0,
    method: str = "absmax",
) -> jax.Array:
  r"""``lax.conv_general_dilated`` with the kernel quantized and dequantized: weight-only.

  .. math::

    y = \mathrm{conv}(x, \hat w), \qquad
    \hat w = \mathrm{fake\_quantize}(w, s, z), \quad
    (s, z) = \mathrm{choose\_qparams}(w, \mathrm{dtype}, \mathrm{method})

  with one scale per output feature of the kernel, or, with ``block_size``,
  per ``block_size`` input features (a short last block allowed) at each
  spatial position and output feature: :func:`quantize_params`' layouts
  ``axis=-1`` and ``axis=-2, block_size=...`` of an ``HWIO`` kernel, bit for
  bit. A stored :class:`QuantizedArray` kernel is dequantized instead. The
  convolution is the float one of ``lhs`` and the dequantized kernel; the
  kernel's gradient is :func:`fake_quantize`'s straight-through one (scale
  held constant). The convolution twin of :func:`dot_general_weight_only`,
  for ``nnx.Conv(conv_general_dilated=functools.partial(...))`` or
  :func:`replace_ops`.

  Args:
    lhs: float input.
    rhs: float kernel, or a :class:`QuantizedArray`.
    window_strides: as ``lax.conv_general_dilated``'s.
    padding: as ``lax.conv_general_dilated``'s.
    lhs_dilation: as ``lax.conv_general_dilated``'s.
    rhs_dilation: as ``lax.conv_general_dilated``'s.
    dimension_numbers: as ``lax.conv_general_dilated``'s.
    feature_group_count: as ``lax.conv_general_dilated``'s.
    batch_group_count: as ``lax.conv_general_dilated``'s.
    precision: passed to ``lax.conv_general_dilated``.
    preferred_element_type: passed to ``lax.conv_general_dilated``.
    out_sharding: passed to ``lax.conv_general_dilated``.
    dtype: the kernel's quantized dtype (integer, float8, float6, float4).
    block_size: block length along the kernel's input features, 0 for per output feature.
    method: :func:`choose_qparams`'s recipe.

  Returns:
    ``lax.conv_general_dilated(lhs, w_hat, ...)``.

  Raises:
    TypeError: if ``rhs`` is not a float array or :class:`QuantizedArray`, or
      for an unsupported ``dtype``.
    ValueError: for a bad ``method`` or ``block_size``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([[[1.0, 2.0, -1.0, 0.5]]])  # NCW
    >>> w = jnp.array([[[0.9, -0.2]]])  # OIW; int4, s = 0.9 / 7: w_hat = 0.9, -2 s
    >>> jq.conv_general_dilated_weight_only(x, w, (1,), "VALID", dtype=jnp.int4)
    Array([[[ 0.3857143,  2.0571427, -1.0285714]]], dtype=float32)
  """
  numbers = _conv_numbers(lhs, rhs, dimension_numbers)
  if isinstance(rhs, _params.QuantizedArray):
    weight = _params.element(rhs, "rhs").dequantize()
  else:
    rhs = _dtypes.float_input("rhs", jnp.asarray(rhs))
    out_feature, in_feature = numbers.rhs_spec[:2]
    weight = _fake_quantized_weight(
        rhs, in_feature if block_size else out_feature, dtype=dtype, block_size=block_size,
        method=method)
  return lax.conv_general_dilated(
      lhs, weight, window_strides, padding, lhs_dilation, rhs_dilation, numbers,
      feature_group_count, batch_group_count, precision, preferred_element_type,
      out_sharding=out_sharding,
  )


@_validate.reports_as("conv_general_dilated_dynamic_int8")
def conv_general_dilated_dynamic_int8(
    lhs: ArrayLike,
    rhs: ArrayLike,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
  r"""``lax.conv_general_dilated`` with int8 operands quantized at run time, int32 accumulation.

  One symmetric scale per example of ``lhs`` (per tensor when
  ``batch_group_count > 1``) and one per output feature of ``rhs``,
  ``max|x| / 127``; the convolution runs on the integers (zero padding is
  exact: 0 quantizes to 0) and the int32 result ``acc`` is scaled back in
  float32 as ``float32(acc) * (s_lhs * s_rhs)``, the two scales multiplied
  first (as :func:`dot_general_dynamic_int8`). For
  ``nnx.Conv(conv_general_dilated=...)``. The derivative is
  straight-through, as :func:`dot_general_dynamic_int8`'s: that of the
  float convolution of the fake-quantized operands.

  Args:
    lhs: float input.
    rhs: float kernel, or a kernel stored as a :class:`QuantizedArray` of
      int8 (no zero point, not blocked, scale per tensor or per output
      feature: :func:`quantize_params` with ``axis=None`` or the kernel's
      ``O`` dim, ``axis=-1`` for ``HWIO``), used as it is. Per output feature
      with the default ``method="absmax"`` it holds this op's own codes and
      scales: the result is the float kernel's, bit for bit.
    window_strides: as ``lax.conv_general_dilated``'s.
    padding: as ``lax.conv_general_dilated``'s.
    lhs_dilation: as ``lax.conv_general_dilated``'s.
    rhs_dilation: as ``lax.conv_general_dilated``'s.
    dimension_numbers: as ``lax.conv_general_dilated``'s.
    feature_group_count: as ``lax.conv_general_dilated``'s.
    batch_group_count: as ``lax.conv_general_dilated``'s.
    precision: ignored (integer arithmetic is exact).
    preferred_element_type: the float dtype of the result.
    out_sharding: passed to the integer convolution.

  Returns:
    The float result, shaped as ``lax.conv_general_dilated``'s.

  Raises:
    TypeError: if an operand is not a float array (or a fitting
      :class:`QuantizedArray`: not int8, a zero point, blocks, or a scale
      along another dim of the kernel are refused).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([[[1.0, 2.0, -1.0, 0.5]]])  # NCW
    >>> w = jnp.array([[[1.0, -1.0]]])             # OIW
    >>> jq.conv_general_dilated_dynamic_int8(x, w, (1,), "VALID")  # float: -1, 3, -1.5
    Array([[[-0.992126,  3.007874, -1.511811]]], dtype=float32)
    >>> stored = jq.quantize_params(w, jq.QuantizationRule(axis=0))  # OIW: O is dim 0
    >>> jq.conv_general_dilated_dynamic_int8(x, stored, (1,), "VALID")
    Array([[[-0.992126,  3.007874, -1.511811]]], dtype=float32)
  """
  lhs, rhs = _float_operand("lhs", lhs), _float_operand("rhs", rhs)
  numbers = _conv_numbers(lhs, rhs, dimension_numbers)
  batch = numbers.lhs_spec[0]
  reduced = [d for d in range(lhs.ndim) if d != batch or batch_group_count > 1]
  arguments = dict(
      window_strides=window_strides, padding=padding, lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation, feature_group_count=feature_group_count,
      batch_group_count=batch_group_count,
  )
  result_dtype = _result_dtype(lhs, rhs, preferred_element_type)

  def integer(lhs, rhs):
    lhs_values, lhs_scale = _quantize_symmetric(lhs, reduced)
    rhs_values, rhs_scale = _rhs_per_output_feature(rhs, numbers)
    return _integer_conv(lhs_values, lhs_scale.reshape(-1), rhs_values, rhs_scale, numbers,
                         arguments, preferred_element_type, result_dtype, out_sharding)

  def fake_quantized(lhs, rhs):
    return _float_conv(_fake_quantized_symmetric(lhs, reduced),
                       _fake_quantized_kernel(rhs, numbers), numbers, arguments, result_dtype,
                       out_sharding)

  return _straight_through(integer, fake_quantized, lhs, rhs)


@_validate.reports_as("conv_general_dilated_static_int8")
def conv_general_dilated_static_int8(
    lhs: ArrayLike,
    rhs: ArrayLike,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    *,
    input_scale: ArrayLike,
    input_zero_point: ArrayLike | None = None,
) -> jax.Array:
  r"""``lax.conv_general_dilated`` with int8 activations at a calibrated (static) scale.

  ``lhs`` is quantized with the per-tensor ``input_scale`` and
  ``input_zero_point``; the zero point is subtracted (in int16) before the
  integer convolution, so zero padding still stands for 0.0 and the result
  is exact up to the final float32 scaling, ``float32(acc) * (s_in * s_rhs)``
  with ``acc`` the int32 convolution. ``rhs`` is symmetric int8 per
  output feature. The derivative is straight-through, as
  :func:`dot_general_static_int8`'s. Bind the parameters with
  ``functools.partial`` (:func:`calibrate` does).

  Args:
    lhs: float input.
    rhs: float kernel, or an int8 kernel stored as a :class:`QuantizedArray` (as in
      :func:`conv_general_dilated_dynamic_int8`).
    window_strides: as ``lax.conv_general_dilated``'s.
    padding: as ``lax.conv_general_dilated``'s.
    lhs_dilation: as ``lax.conv_general_dilated``'s.
    rhs_dilation: as ``lax.conv_general_dilated``'s.
    dimension_numbers: as ``lax.conv_general_dilated``'s.
    feature_group_count: as ``lax.conv_general_dilated``'s.
    batch_group_count: as ``lax.conv_general_dilated``'s.
    precision: ignored (integer arithmetic is exact).
    preferred_element_type: the float dtype of the result.
    out_sharding: passed to the integer convolution.
    input_scale: the activations' float scale, one element.
    input_zero_point: int8 zero point, one element, or ``None``.

  Returns:
    The float result, shaped as ``lax.conv_general_dilated``'s.

  Raises:
    TypeError: if an operand is not a float array (or a fitting
      :class:`QuantizedArray`), or for a zero point that is not int8.
    ValueError: if ``input_scale`` has more than one element.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([[[1.0, 2.0, -1.0, 0.5]]])
    >>> w = jnp.array([[[1.0, -1.0]]])
    >>> jq.conv_general_dilated_static_int8(x, w, (1,), "VALID", input_scale=0.5)
    Array([[[-1. ,  3. , -1.5]]], dtype=float32)
  """
  lhs, input_scale, input_zero_point = _static_parameters(lhs, input_scale, input_zero_point)
  rhs = _float_operand("rhs", rhs)
  numbers = _conv_numbers(lhs, rhs, dimension_numbers)
  arguments = dict(
      window_strides=window_strides, padding=padding, lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation, feature_group_count=feature_group_count,
      batch_group_count=batch_group_count,
  )
  result_dtype = _result_dtype(lhs, rhs, preferred_element_type)

  def integer(lhs, rhs, scale, zero_point):
    lhs_values = _static_lhs(lhs, scale, zero_point)
    rhs_values, rhs_scale = _rhs_per_output_feature(rhs, numbers)
    lhs_values, rhs_values = _matching(_zero_point_shifted(lhs_values, zero_point), rhs_values)
    return _integer_conv(lhs_values, scale, rhs_values, rhs_scale, numbers,
                         arguments, preferred_element_type, result_dtype, out_sharding)

  def fake_quantized(lhs, rhs, scale, zero_point):
    return _float_conv(_fake_quantized_static(lhs, scale, zero_point),
                       _fake_quantized_kernel(rhs, numbers), numbers, arguments, result_dtype,
                       out_sharding)

  return _straight_through(integer, fake_quantized, lhs, rhs, input_scale, input_zero_point)


@_validate.reports_as("conv_general_dilated_fake_quant")
def conv_general_dilated_fake_quant(
    lhs: ArrayLike,
    rhs: Any,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
  r"""``lax.conv_general_dilated`` of ``lhs`` fake-quantized to int8 per example, for training.

  The training twin of :func:`conv_general_dilated_dynamic_int8`: ``lhs``
  through :func:`fake_quantize` with its per-example symmetric scale (held
  constant in the backward pass), ``rhs`` as given (fake-quantize weights
  with :func:`quantize_params`, ``learnable=True``).

  Args:
    lhs: float input.
    rhs: float (fake-quantized) kernel, a :class:`FakeQuantizedArray`, or
      the :class:`QuantizedArray` that deploys one (either dequantized here).
    window_strides: as ``lax.conv_general_dilated``'s.
    padding: as ``lax.conv_general_dilated``'s.
    lhs_dilation: as ``lax.conv_general_dilated``'s.
    rhs_dilation: as ``lax.conv_general_dilated``'s.
    dimension_numbers: as ``lax.conv_general_dilated``'s.
    feature_group_count: as ``lax.conv_general_dilated``'s.
    batch_group_count: as ``lax.conv_general_dilated``'s.
    precision: passed to ``lax.conv_general_dilated``.
    preferred_element_type: passed to ``lax.conv_general_dilated``.
    out_sharding: passed to ``lax.conv_general_dilated``.

  Returns:
    ``lax.conv_general_dilated(fake_quantize(lhs), rhs, ...)``.

  Raises:
    TypeError: if ``lhs`` is not a float array.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> x = jnp.array([[[1.0, 2.0, -1.0, 0.3]]])  # scale 2 / 127
    >>> jq.conv_general_dilated_fake_quant(x, jnp.ones((1, 1, 1)), (1,), "VALID")
    Array([[[ 1.007874 ,  2.       , -1.007874 ,  0.2992126]]], dtype=float32)
  """
  rhs = _trained(rhs)
  numbers = _conv_numbers(lhs, rhs, dimension_numbers)
  lhs = _dtypes.float_input("lhs", jnp.asarray(lhs))
  batch = numbers.lhs_spec[0]
  reduced = [d for d in range(lhs.ndim) if d != batch or batch_group_count > 1]
  return lax.conv_general_dilated(
      _fake_quantized_symmetric(lhs, reduced), rhs, window_strides, padding, lhs_dilation,
      rhs_dilation, numbers, feature_group_count, batch_group_count, precision,
      preferred_element_type, out_sharding=out_sharding,
  )


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)

Op = Callable[..., jax.Array] | Mapping[str, Callable[..., jax.Array]]


def _chosen(op: Op | None, path: str):
  if isinstance(op, Mapping):
    return op.get(path)
  return op


@dataclasses.dataclass(frozen=True, slots=True)
class _Einsum:
  """``jnp.einsum`` with its contraction run by ``op``, the activations as ``op``'s lhs.

  A layer's einsum (``x``, then the kernel) is written as the one
  ``dot_general`` it is, ``op(x, kernel)``, its result transposed to the
  output's labels: two operands, an explicit output, each label once per
  term, none summed within one operand alone. ``jnp.einsum`` itself may pass
  the operands swapped (to spare a transpose), which a drop-in that treats
  its operands differently (weight-only, static, fake-quant) cannot take; and
  it reads operands as arrays, which a :class:`QuantizedArray` (or
  :class:`FakeQuantizedArray`) is not. Other float einsums go to
  ``jnp.einsum``; a stored operand requires the form above.
  """

  op: Callable[..., jax.Array]

  def __call__(self, subscripts: str, *operands: Any, out_sharding: Any = None,
               **kwargs: Any) -> jax.Array:
    stored = any(_params._is_container(x) for x in operands)
    plan = _one_dot_general(subscripts, operands)
    if isinstance(plan, str):
      _validate.check(not stored, "subscripts", plan + " (with a stored operand)",
                      repr(subscripts))
      return jnp.einsum(subscripts, *operands, out_sharding=out_sharding,
                        _dot_general=self.op, **kwargs)
    numbers, permutation = plan
    kwargs.pop("optimize", None)
    if permutation is None:
      return self.op(*operands, numbers, out_sharding=out_sharding, **kwargs)
    product = self.op(*operands, numbers, out_sharding=_permuted(out_sharding, permutation),
                      **kwargs)
    return jnp.transpose(product, permutation)


def _permuted(out_sharding: Any, permutation: Sequence[int]) -> Any:
  """The sharding of a product whose transpose by ``permutation`` is ``out_sharding``'s."""
  if out_sharding is None:
    return None
  spec = out_sharding.spec if isinstance(out_sharding, jax.sharding.NamedSharding) else (
      out_sharding)
  entries = (*spec, *[None] * (len(permutation) - len(spec)))
  inverse = jax.sharding.PartitionSpec(*[entries[permutation.index(d)]
                                         for d in range(len(permutation))])
  if isinstance(out_sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(out_sharding.mesh, inverse)
  return inverse


def _one_dot_general(subscripts: str, operands: Sequence[Any]) -> Any:
  """``(dimension_numbers, transpose or None)`` of a two-operand einsum as one
  ``dot_general`` of its operands in order, or what keeps it from being one."""
  spec = subscripts.replace(" ", "")
  inputs, arrow, output = spec.partition("->")
  labels = inputs.split(",")
  if not (len(operands) == 2 and len(labels) == 2 and arrow):
    return "two operands and an explicit output ('->')"
  labels, output = _ellipsis_labelled(labels, output, operands, spec)
  if not (all(len(set(x)) == len(x) for x in (*labels, output))
          and all(len(x) == len(_shape(y)) for x, y in zip(labels, operands))
          and set(output) <= set("".join(labels))):
    return "two operands' labels and the output's, each label once per term"
  lhs, rhs = labels
  if not all(label in output or label in other for x, other in ((lhs, rhs), (rhs, lhs))
             for label in x):
    return "no label summed within one operand alone"
  contracting = [label for label in lhs if label in rhs and label not in output]
  batch = [label for label in lhs if label in rhs and label in output]
  result = batch + [label for label in lhs if label not in rhs] + [
      label for label in rhs if label not in lhs]
  numbers = ((tuple(map(lhs.index, contracting)), tuple(map(rhs.index, contracting))),
             (tuple(map(lhs.index, batch)), tuple(map(rhs.index, batch))))
  in_order = "".join(result) == output
  return numbers, None if in_order else [result.index(x) for x in output]


def _ellipsis_labelled(labels: Sequence[str], output: str, operands: Sequence[Any],
                       spec: str) -> tuple[list[str], str]:
  """The einsum's terms with each ``...`` written as letters the spec does not use,
  aligned from the right as NumPy broadcasts them."""
  if "..." not in spec:
    return list(labels), output
  # How many dims each operand's ellipsis stands for.
  spans = {i: len(_shape(x)) - len(term.replace("...", ""))
           for i, (term, x) in enumerate(zip(labels, operands)) if "..." in term}
  free = [c for c in string.ascii_letters if c not in spec]
  _validate.check(min(spans.values()) >= 0 and max(spans.values()) <= len(free), "subscripts",
                  "an ellipsis standing for dims the operand has", repr(spec))
  fresh = "".join(free[:max(spans.values())])
  labels = [term.replace("...", fresh[len(fresh) - spans[i]:]) if i in spans else term
            for i, term in enumerate(labels)]
  return labels, output.replace("...", fresh)


@dataclasses.dataclass(frozen=True, slots=True)
class _PassingStored:
  """A layer's dtype promotion (Flax NNX's ``promote_dtype``) that lets a stored kernel through.

  A :class:`QuantizedArray` or :class:`FakeQuantizedArray` argument is stood
  in for by a float scalar of the dtype it dequantizes to, so ``promote``
  decides every dtype as for a float kernel; the stored kernel comes back
  whole, to dequantize to the dtype chosen for it. Without one, ``promote``
  runs as it is.
  """

  promote: Callable[..., Any]

  def __call__(self, args: Sequence[Any], /, **kwargs: Any) -> Any:
    stored = [_params._is_container(x) for x in args]
    if not any(stored):
      return self.promote(args, **kwargs)
    promoted = self.promote(
        tuple(jnp.zeros((), _stored_dtype(x)) if s else x for x, s in zip(args, stored)),
        **kwargs)
    return tuple(_as_dtype(x, y.dtype) if s else y for x, y, s in zip(args, promoted, stored))


def _stored_dtype(x: Any) -> np.dtype:
  if isinstance(x, _params.QuantizedArray) or x.output_dtype is not None:
    return x.output_dtype
  return x.value.dtype


def _as_dtype(x: Any, dtype: np.dtype) -> Any:
  """x dequantizing to ``dtype``, which it reaches as a float kernel would: dequantized
  in its own dtype first (float64 from float32, which no dequantize returns, in the dot)."""
  if _stored_dtype(x) == dtype or dtype not in _dtypes.OUTPUT_FLOAT_DTYPES:
    return x
  return dataclasses.replace(x, output_dtype=np.dtype(dtype))


def layers(module: Any) -> dict[str, tuple[Any, str]]:
  """Every object under ``module`` with a ``dot_general``, ``conv_general_dilated`` or ``einsum_op``.

  The attribute may be ``None`` (Flax's ``nnx.LinearGeneral`` then uses
  ``lax.dot_general``).

  Walks attributes (not starting with ``_``), lists, tuples and dicts, each
  object once; paths are ``/``-joined attribute names and indices, as
  :func:`quantize_params` names parameters (``"layers/0"``).

  Returns:
    ``{path: (layer, attribute)}``.
  """
  found, seen = {}, set()

  def visit(node, path):
    if id(node) in seen or isinstance(node, (str, bytes, int, float, jax.Array, np.ndarray)):
      return
    seen.add(id(node))
    if isinstance(node, (list, tuple)):
      children = [(str(i), child) for i, child in enumerate(node)]
    elif isinstance(node, Mapping):
      children = [(str(key), child) for key, child in node.items()]
    else:
      attributes = getattr(node, "__dict__", None)
      if attributes is None or isinstance(node, _FUNCTIONS):
        return
      for attribute in ("dot_general", "conv_general_dilated", "einsum_op"):
        # None is Flax's "the lax default" (nnx.LinearGeneral).
        if attribute in attributes and (
            attributes[attribute] is None or callable(attributes[attribute])):
          found["/".join(path)] = (node, attribute)
      children = [(key, child) for key, child in attributes.items()
                  if not key.startswith("_") and not isinstance(child, _FUNCTIONS)]
    for key, child in children:
      visit(child, path + (key,))

  visit(module, ())
  return found


@_validate.reports_as("replace_ops")
def replace_ops(
    module: Any,
    *,
    dot_general: Op | None = None,
    conv_general_dilated: Op | None = None,
) -> list[str]:
  """Swaps the contractions of every layer of an existing model, in place.

  Duck-typed: any object under ``module`` (see :func:`layers`) with a
  callable ``dot_general`` attribute (Flax ``nnx.Linear``,
  ``nnx.LinearGeneral``, linen modules built with one) gets ``dot_general``;
  one with ``einsum_op`` (``nnx.Einsum``) gets an einsum running on
  ``dot_general`` (x as its lhs); one with ``conv_general_dilated``
  (``nnx.Conv``) gets ``conv_general_dilated``. Either may be a mapping from
  layer path to function (layers it lacks keep theirs; a path naming no
  layer is an error), as :func:`calibrate` returns.

  A changed layer's ``promote_dtype`` (Flax NNX's dtype promotion, if it has
  one) is wrapped to pass a stored kernel through untouched: a model merged
  with :func:`quantize_params`' output (``nnx.merge(graphdef,
  jq.quantize_params(state, rule))``) runs on the stored integers, which the
  drop-ins take as they are, and holds them in memory. Float kernels promote
  exactly as before.

  Args:
    module: a model object (e.g. a Flax NNX module).
    dot_general: a ``lax.dot_general`` drop-in, a mapping of them, or ``None``.
    conv_general_dilated: a ``lax.conv_general_dilated`` drop-in, a mapping,
      or ``None``.

  Returns:
    The paths of the layers changed.

  Raises:
    ValueError: for a mapping with a path that names no layer.

  Example:
    >>> import jaxquant as jq
    >>> class Dense:
    ...   def __init__(self):
    ...     self.dot_general = None
    >>> class Model:
    ...   def __init__(self):
    ...     self.layers = [Dense(), Dense()]
    >>> model = Model()
    >>> model.layers[0].dot_general = model.layers[1].dot_general = print
    >>> jq.replace_ops(model, dot_general=jq.dot_general_dynamic_int8)
    ['layers/0', 'layers/1']
  """
  found = layers(module)
  for argument, ops in [("dot_general", dot_general),
                        ("conv_general_dilated", conv_general_dilated)]:
    if isinstance(ops, Mapping):
      # A path that names no layer (a typo, another model's) would change nothing.
      unknown = sorted(set(ops) - set(found))
      _validate.check(not unknown, argument, f"a mapping of layer paths among {sorted(found)}",
                      f"paths naming no layer: {unknown}")
  changed = []
  for path, (layer, attribute) in found.items():
    if attribute == "conv_general_dilated":
      op = _chosen(conv_general_dilated, path)
    else:
      op = _chosen(dot_general, path)
      if op is not None and attribute == "einsum_op":
        op = _Einsum(op)
    if op is not None:
      setattr(layer, attribute, op)
      if getattr(layer, "dot_general_cls", None) is not None:
        # Flax's LinearGeneral calls dot_general_cls() in preference to dot_general.
        layer.dot_general_cls = None
      promote = getattr(layer, "promote_dtype", None)
      if callable(promote) and not isinstance(promote, _PassingStored):
        layer.promote_dtype = _PassingStored(promote)
      changed.append(path)
  return changed
