"""ONNX QuantizeLinear and DequantizeLinear (docs/numerics.md, "Formulas")."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp

from jaxquant import _bind
from jaxquant import _dispatch
from jaxquant import _dtypes
from jaxquant import _granularity
from jaxquant import _numerics
from jaxquant import _packing
from jaxquant import _parameters
from jaxquant import _validate
import pallas_kernels


def _check_dequantize(arguments: dict) -> None:
  dtype = arguments["packed_dtype"]
  if dtype is None:
    dtype = jnp.int4 if arguments["packed_shape"] is not None else getattr(
        arguments["x"], "dtype", None)
  arguments["zero_point"] = _dtypes.host_zero_point("zero_point", arguments["zero_point"], dtype)


@_bind.op(
    axis=_bind.optional_integer, block_size=_bind.integer, output_dtype=_bind.dtype,
    implementation=_bind.IMPLEMENTATION, packed_shape=_bind.optional_shape,
    packed_dtype=_bind.dtype, check=_check_dequantize,
)
def dequantize_linear(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike | None = None,
    *,
    axis: int | None = 1,
    block_size: int = 0,
    output_dtype: DTypeLike | None = None,
    implementation: str | None = None,
    packed_shape: tuple[int, ...] | None = None,
    packed_dtype: DTypeLike | None = None,
) -> jax.Array:
  r"""Dequantizes ``x``: ONNX DequantizeLinear.

  .. math::

    y = (x - \mathrm{zero\_point}) \cdot \mathrm{scale}

  The subtraction is exact integer arithmetic (in int32; 32-bit inputs wrap
  around in their own width; float8, float6 and float4 in float32, exactly),
  the product is formed in float32 and rounded once to the output dtype. The
  granularity follows from the shape of ``scale`` (docs/numerics.md,
  "Granularity"): per-tensor, per-axis along ``axis``, blocked along ``axis``
  with ``block_size`` (a short last block is allowed), or block-wise broadcast.

  Sub-byte data (int2, uint2, int4, uint4, float4_e2m1fn, float6_e2m3fn,
  float6_e3m2fn) may arrive in three forms:

  * as an array of its dtype (for float6, which XLA cannot hold, a NumPy
    ``ml_dtypes`` array, read as codes before the jit boundary);
  * packed, as ONNX stores it (:func:`pack`; ``TensorProto.raw_data``): the
    uint8 bytes as ``x`` with ``packed_shape`` and ``packed_dtype`` (int4 if
    not given). The Pallas kernel reads 2- and 4-bit bytes directly where no
    byte straddles a row or a block, XLA unpacks them in the same fusion;
    6-bit codes straddle bytes, so float6 is unpacked by XLA first;
  * as codes, one per uint8 byte, with ``packed_dtype`` alone: what
    :func:`quantize_linear` returns for float6, and how float6 crosses a
    ``jax.jit`` boundary.

  Gradients flow to ``scale`` (``dy/dscale = x - zero_point``, summed per scale
  element); ``x`` and ``zero_point`` are integers and carry none.

  Args:
    x: quantized values: int2, uint2, int4, uint4, int8, uint8, int16, uint16,
      int32, uint32, the four float8 types, float4_e2m1fn, or a NumPy
      float6_e2m3fn or float6_e3m2fn array; with ``packed_shape``, the uint8
      bytes from :func:`pack`; with ``packed_dtype`` alone, uint8 codes.
    scale: float32, float16, bfloat16 or float8_e8m0fnu scale.
    zero_point: same dtype and shape as ``scale`` elements; ``None`` means 0.
      A Python number takes x's dtype. For float6: a NumPy float6 array, a
      Python number, or uint8 codes.
    axis: the quantization axis for per-axis and blocked scales (``None``
      only with a per-tensor or block-wise broadcast scale).
    block_size: block length along ``axis`` for blocked scales, else 0.
    output_dtype: float32, float16 or bfloat16; default the scale's dtype
      (float32 for a float8_e8m0fnu scale).
    implementation: ``None`` (the fastest path), ``"xla"`` or ``"pallas"``; same bits.
    packed_shape: the shape of the sub-byte array packed in ``x`` (a sequence
      of ints: a tuple, a list, an ONNX ``TensorProto.dims``), or ``None``
      when ``x`` is not packed.
    packed_dtype: the sub-byte dtype of packed bytes (default int4) or of
      codes (static); ``None`` when ``x`` has its own dtype.

  Returns:
    An array shaped like ``x`` (or ``packed_shape``) of ``output_dtype``.

  Raises:
    TypeError: for an unsupported dtype of ``x``, ``scale``, ``zero_point`` or
      ``output_dtype``; a ``packed_dtype`` that is not a sub-byte dtype, or
      that differs from a NumPy float6 x's; bytes or codes that are not
      uint8; or a ``packed_shape`` that is not a sequence of non-negative
      ints, or given with a NumPy float6 x.
    ValueError: if the shapes fit no granularity, ``axis``/``block_size`` are
      out of range, or packed bytes do not fill ``packed_shape``.

  Example:
    >>> import jax.numpy as jnp
    >>> import ml_dtypes
    >>> import numpy as np
    >>> import jaxquant as jq
    >>> jq.dequantize_linear(jnp.array([0, 3, 255], jnp.uint8), 0.5, 128)
    Array([-64. , -62.5,  63.5], dtype=float32)
    >>> jq.dequantize_linear(np.array([1.5, -7.5], ml_dtypes.float6_e2m3fn), 2.0)
    Array([  3., -15.], dtype=float32)
    >>> codes = jnp.array([12, 63], jnp.uint8)  # the same values as float6 codes
    >>> jq.dequantize_linear(codes, 2.0, packed_dtype=jnp.float6_e2m3fn)
    Array([  3., -15.], dtype=float32)
  """
  x, x_dtype = _dtypes.host_codes("x", x)
  if x_dtype is not None:
    _validate.check(
        packed_shape is None, "packed_shape",
        f"None for a NumPy {x_dtype.name} x (it holds values, not packed bytes)",
        packed_shape, error=TypeError,
    )
    _validate.check(
        packed_dtype is None or _dtypes._as_dtype(packed_dtype) == x_dtype, "packed_dtype",
        f"None or x's dtype {x_dtype.name}", _dtypes._name(packed_dtype), error=TypeError,
    )
    packed_dtype = x_dtype
  zero_point, zero_point_dtype = _dtypes.host_codes("zero_point", zero_point)
  return _dequantize_linear(
      x, scale, zero_point, axis=axis, block_size=block_size, output_dtype=output_dtype,
      implementation=implementation, packed_shape=packed_shape, packed_dtype=packed_dtype,
      zero_point_dtype=zero_point_dtype,
  )


@functools.partial(
    jax.jit,
    static_argnames=(
        "axis", "block_size", "output_dtype", "implementation", "packed_shape",
        "packed_dtype", "zero_point_dtype",
    ),
)
def _dequantize_linear(
    x, scale, zero_point, *, axis, block_size, output_dtype, implementation, packed_shape,
    packed_dtype, zero_point_dtype,
):
  x, shape, info = _quantized_input(x, packed_shape, packed_dtype)
  parameters = _parameters.bind(
      shape, scale, zero_point, info, axis=axis, block_size=block_size,
      zero_point_dtype=zero_point_dtype,
  )
  output_dtype = _dtypes.float_dtype(
      "output_dtype",
      _dtypes.scale_float_dtype(parameters.scale.dtype) if output_dtype is None else output_dtype,
  )
  formula = functools.partial(_numerics.dequantize_formula, info=info, output_dtype=output_dtype)
  # The kernel reads whole bytes of whole elements. 6-bit codes straddle
  # bytes, as do 2- and 4-bit ones across a row or block edge: XLA unpacks
  # those first, to one element (float6: one code) per byte.
  packed = packed_shape is not None and 8 % info.bits == 0 and _granularity.packable(
      parameters.granularity, shape, 8 // info.bits)
  call = _dispatch.Route("dequantize_linear", info.name, parameters.granularity.kind, packed)
  # An empty x has nothing for a kernel to do, and its packed bytes are unpacked.
  use_kernel = _dispatch.runs_kernel(call, implementation) and math.prod(shape) > 0
  # Elements per byte of x: 8 // bits while x holds packed bytes, else 1.
  per_byte = 1
  if packed_shape is not None:
    per_byte = 8 // info.bits
    if not (use_kernel and packed):
      x, per_byte = _packing.unpacked_values(x, shape, info.dtype), 1

  def xla(x, parameters):
    if per_byte > 1:
      x = _packing.unpacked_values(x, shape, info.dtype)
    return parameters.apply(formula, x)

  def kernel(x, parameters):
    if per_byte > 1:
      x = x.reshape(shape[:-1] + (shape[-1] // per_byte,))
    return pallas_kernels.dequantize(
        x, *parameters.shaped, formula=formula, output_dtype=output_dtype,
        packed_dtype=info.dtype if per_byte > 1 else None, blocks=parameters.blocks,
    )

  return _dispatch.evaluate(
      call, implementation, xla, kernel if use_kernel else None, x, parameters)


def _quantized_input(x, packed_shape, packed_dtype):
  """x as an array of its quantized dtype (or packed bytes), its unpacked shape, and that dtype."""
  x = jnp.asarray(x)
  if packed_shape is not None:
    info = _packing.sub_byte_dtype(
        "packed_dtype", jnp.int4 if packed_dtype is None else packed_dtype
    )
    return _packing.packed_bytes(x, packed_shape, info.dtype), packed_shape, info
  if packed_dtype is not None:
    info = _packing.sub_byte_dtype("packed_dtype", packed_dtype)
    accepted = ["uint8"] + ([] if info.as_codes else [info.name])
    _validate.check(
        x.dtype.name in accepted, "x.dtype",
        f"{' or '.join(accepted)} (one code per byte) for packed_dtype={info.name} "
        "without packed_shape", x.dtype.name, error=TypeError,
    )
    return (_packing.from_codes(x, info) if x.dtype == jnp.uint8 else x), x.shape, info
  return x, x.shape, _dtypes.quantized_dtype("x.dtype", x.dtype)


def _lane_parameters(
    parameters: _parameters.Parameters, per_byte: int
) -> _parameters.Parameters | None:
  """The parameters of every lane ``x[..., k::per_byte]``, or ``None``.

  The lanes share a byte, so they lie in one block along the last dim
  when its blocks hold whole bytes, and share its parameters, indexed at
  the lane's own size rather than by striding through parameters expanded
  to x's. ``None`` when a block edge splits a byte, and for one parameter
  per element of the last dim: each lane would take a strided slice of
  them too, which XLA:CPU compiles to scalar code (2.2x the CPU time of
  quantizing contiguously and packing whole words, measured).
  """
  granularity = parameters.granularity
  blocks, block = granularity.param_shape[-1], granularity.block_shape[-1]
  if blocks == 1:
    lane_block = 1
  elif block % per_byte == 0:
    lane_block = block // per_byte
  else:
    return None
  lane_granularity = dataclasses.replace(
      granularity, block_shape=granularity.block_shape[:-1] + (lane_block,)
  )
  return dataclasses.replace(
      parameters, scale=jnp.reshape(parameters.scale, granularity.param_shape),
      zero_point=None if parameters.zero_point is None
      else jnp.reshape(parameters.zero_point, granularity.param_shape),
      granularity=lane_granularity,
  )


def _packed_quantize(formula, x, parameters: _parameters.Parameters):
  """``pack(formula(x, *parameters))`` from uint8 codes, never holding a sub-byte array.

  When whole bytes lie within the last dim, the elements sharing a byte are
  the last dim's interleaved lanes ``x[..., k::per_byte]``: each lane is
  quantized on its own strided slice of x and the lanes are or-ed into
  bytes in one fusion. Otherwise (bytes straddling rows or blocks, 6-bit
  codes straddling bytes, one scale per element of the last dim) the codes
  are computed and then packed.
  """
  bits = parameters.info.bits
  per_byte = 8 // bits if 8 % bits == 0 else 0
  lanes = None
  if per_byte and x.ndim and x.shape[-1] % per_byte == 0:
    lanes = _lane_parameters(parameters, per_byte)
  if lanes is None:
    return _packing.pack_codes(parameters.apply(formula, x), bits)
  packed = None
  for k in range(per_byte):
    codes = lanes.apply(formula, x[..., k::per_byte])
    packed = codes if packed is None else packed | (codes << (bits * k))
  return packed.reshape(-1)


def _check_quantize(arguments: dict) -> None:
  arguments["zero_point"] = _dtypes.host_zero_point(
      "zero_point", arguments["zero_point"], arguments["output_dtype"] or jnp.uint8
  )


@_bind.op(
    axis=_bind.optional_integer, block_size=_bind.integer, output_dtype=_bind.dtype,
    saturate=_bind.boolean, precision=_bind.dtype, implementation=_bind.IMPLEMENTATION,
    packed=_bind.boolean, check=_check_quantize,
)
def quantize_linear(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike | None = None,
    *,
    axis: int | None = 1,
    block_size: int = 0,
    output_dtype: DTypeLike | None = None,
    saturate: bool = True,
    precision: DTypeLike | None = None,
    implementation: str | None = None,
    packed: bool = False,
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
  +-inf); NaN stays NaN. float4_e2m1fn always saturates to +-6, float6_e2m3fn
  to +-7.5 and float6_e3m2fn to +-28; NaN gives +max in all three, which have
  no NaN. Granularity as in :func:`dequantize_linear`.

  XLA has no float6 type, so a JAX array cannot hold float6 values: for
  float6 outputs the result holds their codes, one per uint8 byte in
  ml_dtypes' bit layout (``np.asarray(y).view(ml_dtypes.float6_e2m3fn)``
  reads them); :func:`dequantize_linear` takes them with ``packed_dtype=``,
  :func:`pack` packs them with ``dtype=``.

  With ``packed=True`` a sub-byte output comes back as the bytes ONNX stores
  (``raw_data``), equal bit for bit to ``pack(quantize_linear(...))`` but
  computed with integer arithmetic on the codes, without an array of the
  sub-byte dtype ever existing (XLA:CPU converts to int4 an order of
  magnitude slower than to int8). :func:`dequantize_linear` reads them back
  with ``packed_shape=x.shape`` and ``packed_dtype=``.

  The output is integer or low-precision float and carries no gradient; train
  through ``fake_quantize`` instead.

  Args:
    x: float32, float16, bfloat16 or int32 input.
    scale: float32, float16, bfloat16 or float8_e8m0fnu scale.
    zero_point: the output's zero point, in the quantized dtype; ``None``
      means 0. A Python number takes the output dtype. A float6 zero point is
      a NumPy float6 array or a Python number (rounded to it as x is).
    axis: the quantization axis for per-axis and blocked scales (``None``
      only with a per-tensor or block-wise broadcast scale).
    block_size: block length along ``axis`` for blocked scales, else 0.
    output_dtype: the quantized dtype when ``zero_point`` is ``None`` or a
      Python number; default uint8.
    saturate: float8 outputs only: clip instead of overflowing to NaN/inf.
    precision: float32, float16 or bfloat16: the dtype of the division (ONNX
      opset 23); default the scale's dtype.
    implementation: ``None`` (the fastest path), ``"xla"`` or ``"pallas"``; same bits.
    packed: sub-byte outputs only: return the packed bytes (static).

  Returns:
    An array shaped like ``x`` of the zero point's dtype, else ``output_dtype``,
    else uint8; for float6, uint8 codes of it. With ``packed``, a 1-D uint8
    array of ``ceil(x.size * bits / 8)`` bytes.

  Raises:
    TypeError: for an unsupported dtype of ``x``, ``scale``, ``zero_point``,
      ``output_dtype`` or ``precision``.
    ValueError: if ``output_dtype`` conflicts with the zero point's dtype, the
      shapes fit no granularity, ``axis``/``block_size`` are out of range, or
      ``packed`` is asked of a dtype of 8 bits or more.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> jq.quantize_linear(jnp.array([1.0, -1.0, 7.0]), 1.0, output_dtype=jnp.int4,
    ...                    packed=True)  # codes 1, 15, 7: 0xF1, 0x07
    Array([241,   7], dtype=uint8)
    >>> jq.quantize_linear(jnp.array([-2.5, 0.5, 1.5, 1e9]), 1.0, jnp.int8(0))
    Array([ -2,   0,   2, 127], dtype=int8)
    >>> codes = jq.quantize_linear(jnp.array([0.3, -1.1, 1e9]), 0.5,
    ...                            output_dtype=jnp.float6_e2m3fn)
    >>> codes  # 0.625, -2.25 and 7.5 (saturated), as float6_e2m3fn codes
    Array([ 5, 49, 31], dtype=uint8)
  """
  zero_point, zero_point_dtype = _dtypes.host_codes("zero_point", zero_point)
  return _quantize_linear(
      x, scale, zero_point, axis=axis, block_size=block_size, output_dtype=output_dtype,
      saturate=saturate, precision=precision, implementation=implementation,
      zero_point_dtype=zero_point_dtype, packed=packed,
  )


@functools.partial(
    jax.jit,
    static_argnames=(
        "axis", "block_size", "output_dtype", "saturate", "precision", "implementation",
        "zero_point_dtype", "packed",
    ),
)
def _quantize_linear(
    x, scale, zero_point, *, axis, block_size, output_dtype, saturate, precision,
    implementation, zero_point_dtype, packed=False,
):
  x = jnp.asarray(x)
  if x.dtype != jnp.int32:
    x = _dtypes.float_input("x", x, also="int32")
  info = _parameters.quantized_output_dtype(
      zero_point, output_dtype, zero_point_dtype=zero_point_dtype
  )
  _validate.check(
      not packed or info.bits < 8, "packed",
      f"False for {info.name} (only sub-byte dtypes pack)", packed,
  )
  parameters = _parameters.bind(
      x.shape, scale, zero_point, info, axis=axis, block_size=block_size,
      zero_point_dtype=zero_point_dtype,
  )
  precision = (_numerics.division_precision(parameters.scale.dtype) if precision is None
               else _dtypes.float_dtype("precision", precision))
  formula = functools.partial(
      _numerics.quantize_formula, info=info, precision=precision, saturate=saturate)

  def xla(x, parameters):
    if packed:
      return _packed_quantize(functools.partial(formula, codes=True), x, parameters)
    return parameters.apply(formula, x)

  def kernel(x, parameters):
    y = pallas_kernels.quantize(
        x, *parameters.shaped, formula=formula, output_dtype=info.array_dtype,
        blocks=parameters.blocks,
    )
    return _packing.pack_codes(_packing.to_codes(y, info), info.bits) if packed else y

  return _dispatch.evaluate(
      _dispatch.Route("quantize_linear", info.name, parameters.granularity.kind),
      implementation, xla, kernel if x.size else None, x, parameters)
