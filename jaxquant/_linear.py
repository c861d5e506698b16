"""ONNX QuantizeLinear and DequantizeLinear (docs/numerics.md, "Formulas")."""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _dispatch
from jaxquant import _dtypes
from jaxquant import _granularity
from jaxquant import _packing
from jaxquant import _validate
import pallas_kernels


def zero_point_array(
    function: str, argument: str, zero_point: ArrayLike | None, dtype: np.dtype
) -> jax.Array | None:
  """``zero_point`` as an array of ``dtype``; a Python number takes ``dtype``.

  Raises:
    TypeError: if an array zero point has a dtype other than ``dtype``, or a
      Python float is given for an integer ``dtype`` (it would be truncated).
  """
  if zero_point is None:
    return None
  zero_point = jnp.asarray(zero_point)
  if zero_point.weak_type:
    _validate.check(
        not (jnp.issubdtype(dtype, jnp.integer)
             and jnp.issubdtype(zero_point.dtype, jnp.floating)),
        function, argument, f"an integer for the integer dtype {np.dtype(dtype).name}",
        "a Python float", error=TypeError,
    )
    return zero_point.astype(dtype)
  _validate.check(
      zero_point.dtype == dtype, function, f"{argument}.dtype",
      f"{np.dtype(dtype).name} (the quantized dtype)", zero_point.dtype.name,
      error=TypeError,
  )
  return zero_point


def true_divide(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``x / scale`` rounded once, as IEEE division.

  XLA rewrites division by a broadcast operand into multiplication by its
  reciprocal, which moves 12-43% of float32 quotients by one ulp and flips
  rounding ties (docs/numerics.md, "XLA traps the library avoids"). A divisor
  that depends on x element-wise is no broadcast, so it stays a true
  division; swapping in x where x is NaN leaves every quotient unchanged (NaN
  either way) and costs one select in the fusion.

  When x is a compile-time constant (a weight closed over by ``jit``), XLA
  would fold ``isnan(x)`` and the select away, leaving the broadcast divisor
  it rewrites. The optimization barrier keeps the guard opaque to the
  simplifier; XLA drops the barrier after simplification, so the compiled
  program is the same single fusion as for a traced x.
  """
  return x / jnp.where(jnp.isnan(lax.optimization_barrier(x)), x, scale)


def dequantize_formula(x, scale, zero_point, *, info, output_dtype):
  if zero_point is not None:
    if info.is_integer:
      # int32 holds every difference of <= 16-bit types exactly; 32-bit types
      # wrap around in their own width, as onnxruntime does.
      wide = jnp.int32 if info.bits < 32 else info.dtype
      x = x.astype(wide) - zero_point.astype(wide)
    else:
      x = x.astype(jnp.float32) - zero_point.astype(jnp.float32)
  return (x.astype(jnp.float32) * scale.astype(jnp.float32)).astype(output_dtype)


def dequantize_linear(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: DTypeLike | None = None,
    implementation: str | None = None,
    packed_shape: tuple[int, ...] | None = None,
    packed_dtype: DTypeLike = jnp.int4,
) -> jax.Array:
  r"""Dequantizes ``x``: ONNX DequantizeLinear.

  .. math::

    y = (x - \mathrm{zero\_point}) \cdot \mathrm{scale}

  The subtraction is exact integer arithmetic (in int32; 32-bit inputs wrap
  around in their own width), the product is formed in float32 and rounded once
  to the output dtype. The granularity follows from the shape of ``scale``
  (docs/numerics.md, "Granularity"): per-tensor, per-axis along ``axis``, blocked along ``axis`` with
  ``block_size`` (a short last block is allowed), or block-wise broadcast.

  4-bit data may stay packed two per byte (:func:`pack_int4`, ONNX's raw
  layout): pass the bytes as ``x`` with ``packed_shape``; the Pallas kernel
  then reads the bytes directly, XLA unpacks them in the same fusion.

  Gradients flow to ``scale`` (``dy/dscale = x - zero_point``, summed per scale
  element); ``x`` and ``zero_point`` are integers and carry none.

  Args:
    x: quantized values: int2, uint2, int4, uint4, int8, uint8, int16, uint16,
      int32, uint32, the four float8 types or float4_e2m1fn; with
      ``packed_shape``, the uint8 bytes from :func:`pack_int4`.
    scale: float32, float16, bfloat16 or float8_e8m0fnu scale.
    zero_point: same dtype and shape as ``scale`` elements; ``None`` means 0.
      A Python number takes x's dtype.
    axis: the quantization axis for per-axis and blocked scales.
    block_size: block length along ``axis`` for blocked scales, else 0.
    output_dtype: float32, float16 or bfloat16; default the scale's dtype
      (float32 for a float8_e8m0fnu scale).
    implementation: ``None`` (the fastest path), ``"xla"`` or ``"pallas"``; same bits.
    packed_shape: the shape of the 4-bit array packed in ``x`` (a sequence of
      ints: a tuple, a list, an ONNX ``TensorProto.dims``), or ``None`` when
      ``x`` is not packed.
    packed_dtype: with ``packed_shape``: int4, uint4 or float4_e2m1fn.

  Returns:
    An array shaped like ``x`` (or ``packed_shape``) of ``output_dtype``.

  Raises:
    TypeError: for an unsupported dtype of ``x``, ``scale``, ``zero_point`` or
      ``output_dtype``, or a ``packed_shape`` that is not a sequence of
      non-negative ints.
    ValueError: if the shapes fit no granularity, or ``axis``/``block_size`` are
      out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.dequantize_linear(jnp.array([0, 3, 255], jnp.uint8), 0.5, 128)
    Array([-64. , -62.5,  63.5], dtype=float32)
  """
  if packed_shape is not None:
    # Shapes often arrive as lists or protobuf dims (ONNX's TensorProto.dims);
    # jit's static arguments must hash, so the tuple is made here.
    packed_shape = _validate.static_shape("dequantize_linear", "packed_shape", packed_shape)
  return _dequantize_linear(
      x, scale, zero_point, axis=axis, block_size=block_size, output_dtype=output_dtype,
      implementation=implementation, packed_shape=packed_shape, packed_dtype=packed_dtype,
  )


@functools.partial(
    jax.jit,
    static_argnames=(
        "axis", "block_size", "output_dtype", "implementation", "packed_shape",
        "packed_dtype",
    ),
)
def _dequantize_linear(
    x, scale, zero_point, *, axis, block_size, output_dtype, implementation, packed_shape,
    packed_dtype,
):
  function = "dequantize_linear"
  x = jnp.asarray(x)
  shape = x.shape
  if packed_shape is not None:
    shape = packed_shape
    dtype = _packing.sub_byte_dtype(function, "packed_dtype", packed_dtype).dtype
    x = _packing.packed_bytes(function, x, shape, dtype)
  else:
    dtype = x.dtype
  info = _dtypes.quantized_dtype(function, "x.dtype", dtype)
  scale = _dtypes.scale_array(function, "scale", scale)
  zero_point = zero_point_array(function, "zero_point", zero_point, info.dtype)
  if output_dtype is None:
    output_dtype = (
        scale.dtype if scale.dtype in _dtypes.OUTPUT_FLOAT_DTYPES else jnp.float32
    )
  output_dtype = _dtypes.float_dtype(function, "output_dtype", output_dtype)
  granularity = _granularity.resolve(
      function, shape, scale.shape, None if zero_point is None else zero_point.shape,
      axis=axis, block_size=block_size,
  )
  formula = functools.partial(dequantize_formula, info=info, output_dtype=output_dtype)
  # An empty x has nothing for a kernel to do, and its packed bytes are unpacked.
  use_kernel = _dispatch.select(function, implementation) == "pallas" and math.prod(shape) > 0
  # Elements per byte of x: 8 // bits while x holds packed bytes, else 1.
  per_byte = _packing.elements_per_byte(info.dtype) if packed_shape is not None else 1
  if per_byte > 1 and not (use_kernel and _granularity.packable(granularity, shape, per_byte)):
    x, per_byte = _packing.unpacked(x, shape, info.dtype), 1
  if use_kernel:
    view = _granularity.kernel_view(
        x, [scale, zero_point], granularity, shape=shape, elements_per_byte=per_byte
    )
    return view.restore(pallas_kernels.dequantize(
        view.x, *view.params, formula=formula, output_dtype=output_dtype,
        packed_dtype=info.dtype if per_byte > 1 else None,
    ))
  return _granularity.apply_blockwise(
      formula, x, [scale, zero_point], granularity, result_dtype=output_dtype
  )


def quotient_formula(x, scale, *, precision):
  """``x / scale`` as quantization divides: x, scale and quotient rounded to ``precision``.

  ``x`` is float, or int32 (requantized accumulators), rounded once to ``precision``.
  """
  # A narrower precision is emulated: operands and quotient rounded to it,
  # the division itself done wider. For float16 and bfloat16 that is exact:
  # float32 has more than 2p + 2 significant bits, so the double rounding of
  # a quotient is innocuous (Figueroa 1995).
  accumulate = _dtypes.compute_dtype(x.dtype, precision)
  if jnp.issubdtype(x.dtype, jnp.integer):
    x = _dtypes.int32_to_float(x, accumulate, precision)
  else:
    x = _dtypes.round_to(x.astype(accumulate), precision)
  scale = _dtypes.round_to(scale.astype(accumulate), precision)
  return _dtypes.round_to(true_divide(x, scale), precision)


def quantize_formula(x, scale, zero_point, *, info, precision, saturate):
  quotient = quotient_formula(x, scale, precision=precision)
  return _dtypes.round_and_saturate(quotient, zero_point, info, saturate=saturate)


def quantized_output_dtype(
    function: str,
    zero_point: ArrayLike | None,
    output_dtype: DTypeLike | None,
    *,
    argument: str = "zero_point",
    default: DTypeLike = jnp.uint8,
    integer: bool = False,
) -> _dtypes.QuantizedDType:
  """The zero point's dtype, else ``output_dtype``, else ``default``; a conflict is an error."""
  if zero_point is not None and not jnp.asarray(zero_point).weak_type:
    info = _dtypes.quantized_dtype(
        function, f"{argument}.dtype", jnp.asarray(zero_point).dtype, integer=integer
    )
    if output_dtype is not None:
      _dtypes.quantized_dtype(function, "output_dtype", output_dtype, integer=integer)
      _validate.check(
          np.dtype(output_dtype) == info.dtype, function, "output_dtype",
          f"None or {argument}'s dtype {info.name}", np.dtype(output_dtype).name,
      )
    return info
  return _dtypes.quantized_dtype(
      function, "output_dtype", default if output_dtype is None else output_dtype,
      integer=integer,
  )


@functools.partial(
    jax.jit,
    static_argnames=(
        "axis", "block_size", "output_dtype", "saturate", "precision", "implementation",
    ),
)
def quantize_linear(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: DTypeLike | None = None,
    saturate: bool = True,
    precision: DTypeLike | None = None,
    implementation: str | None = None,
) -> jax.Array:
  r"""Quantizes ``x``: ONNX QuantizeLinear.

  .. math::

    y = \mathrm{saturate}\left(\mathrm{round\_half\_to\_even}
        \left(\frac{x}{\mathrm{scale}}\right) + \mathrm{zero\_point}\right)

  The division is a true IEEE division (never a multiply by ``1/scale``) in
  the scale's dtype, as ONNX specifies, or in ``precision``: with a float16
  scale, x is rounded to float16, divided, and the quotient rounded to float16
  (float32 for a float8_e8m0fnu scale). int32 x (requantizing an integer
  accumulator) is rounded once to that dtype. Integer outputs saturate to the dtype's range:
  NaN gives the minimum, +inf the maximum, -inf the minimum. Float8 outputs
  round to nearest even and, with ``saturate``, clip to the finite range (also
  +-inf); NaN stays NaN. float4_e2m1fn always saturates to +-6. Granularity as
  in :func:`dequantize_linear`.

  The output is integer or low-precision float and carries no gradient; train
  through ``fake_quantize`` instead.

  Args:
    x: float32, float16, bfloat16 or int32 input.
    scale: float32, float16, bfloat16 or float8_e8m0fnu scale.
    zero_point: the output's zero point, in the quantized dtype; ``None``
      means 0. A Python number takes the output dtype.
    axis: the quantization axis for per-axis and blocked scales.
    block_size: block length along ``axis`` for blocked scales, else 0.
    output_dtype: the quantized dtype when ``zero_point`` is ``None`` or a
      Python number; default uint8.
    saturate: float8 outputs only: clip instead of overflowing to NaN/inf.
    precision: float32, float16 or bfloat16: the dtype of the division (ONNX
      opset 23); default the scale's dtype.
    implementation: ``None`` (the fastest path), ``"xla"`` or ``"pallas"``; same bits.

  Returns:
    An array shaped like ``x`` of the zero point's dtype, else ``output_dtype``,
    else uint8.

  Raises:
    TypeError: for an unsupported dtype of ``x``, ``scale``, ``zero_point``,
      ``output_dtype`` or ``precision``.
    ValueError: if ``output_dtype`` conflicts with the zero point's dtype, the
      shapes fit no granularity, or ``axis``/``block_size`` are out of range.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.quantize_linear(jnp.array([-2.5, 0.5, 1.5, 1e9]), 1.0, jnp.int8(0))
    Array([ -2,   0,   2, 127], dtype=int8)
  """
  function = "quantize_linear"
  x = jnp.asarray(x)
  if x.dtype != jnp.int32:
    x = _dtypes.float_input(function, "x", x, also="int32")
  scale = _dtypes.scale_array(function, "scale", scale)
  saturate = _validate.static_bool(function, "saturate", saturate)
  info = quantized_output_dtype(function, zero_point, output_dtype)
  zero_point = zero_point_array(function, "zero_point", zero_point, info.dtype)
  precision = (_dtypes.division_precision(scale.dtype) if precision is None
               else _dtypes.float_dtype(function, "precision", precision))
  granularity = _granularity.resolve(
      function, x.shape, scale.shape, None if zero_point is None else zero_point.shape,
      axis=axis, block_size=block_size,
  )
  formula = functools.partial(
      quantize_formula, info=info, precision=precision, saturate=saturate
  )
  if _dispatch.select(function, implementation) == "pallas" and x.size:
    view = _granularity.kernel_view(x, [scale, zero_point], granularity)
    return view.restore(pallas_kernels.quantize(
        view.x, *view.params, formula=formula, output_dtype=info.dtype
    ))
  return _granularity.apply_blockwise(
      formula, x, [scale, zero_point], granularity, result_dtype=info.dtype
  )
