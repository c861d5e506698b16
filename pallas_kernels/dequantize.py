"""Fused dequantize: quantized blocks in, float blocks out, scales read per block.

The formula comes from the caller (jaxquant's ``dequantize_formula``), so the
ONNX rules live in one place; this module contributes the layout: scales and
zero points enter the kernel at their own size and broadcast inside a tile,
and 4-bit data may arrive packed two per byte (ONNX order, the output of
``jaxquant.pack_int4``) and is unpacked in the kernel, so HBM holds half a byte
per weight.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _blockwise

Formula = Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]
PACKED_DTYPES = tuple(np.dtype(d) for d in (jnp.int4, jnp.uint4, jnp.float4_e2m1fn))


def decode_nibbles(nibbles: jax.Array, dtype: np.dtype) -> jax.Array:
  """The values of 4-bit codes (uint8 0..15) of ``dtype``, as int32 or float32.

  Arithmetic instead of a bitcast to a 4-bit type, which neither Mosaic nor
  Triton can load from registers: int4 is two's complement, float4_e2m1fn is
  sign, 2 exponent bits (bias 1) and 1 mantissa bit, subnormal at exponent 0.
  """
  codes = nibbles.astype(jnp.int32)
  if dtype == np.dtype(jnp.uint4):
    return codes
  if dtype == np.dtype(jnp.int4):
    return (codes ^ 8) - 8
  exponent, mantissa = (codes >> 1) & 3, (codes & 1).astype(jnp.float32)
  magnitude = jnp.where(
      exponent == 0, mantissa * 0.5,
      (2 + mantissa) * (1 << exponent).astype(jnp.float32) * 0.25,
  )
  return jnp.where(codes >= 8, -magnitude, magnitude)


def dequantize(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    formula: Formula,
    output_dtype: np.dtype,
    packed_dtype: np.dtype | None = None,
    backend: _blockwise.Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
) -> jax.Array:
  """``formula(x, scale, zero_point)`` in one Pallas kernel.

  Args:
    x: quantized values; or, with ``packed_dtype``, uint8 bytes holding two
      4-bit values each along the last dim (which is half the output's).
    scale: same rank as x (as unpacked); each dim x's size or 1.
    zero_point: like ``scale``, or ``None``.
    formula: the element-wise dequantization.
    output_dtype: what ``formula`` returns.
    packed_dtype: int4, uint4 or float4_e2m1fn when ``x`` is packed.
    backend, interpret, max_block: see ``_blockwise.elementwise``.

  Returns:
    The dequantized array, shaped like the (unpacked) x.
  """
  packed = packed_dtype is not None
  (y,) = _blockwise.elementwise(
      lambda *args: (formula(*args),),
      [x, scale, zero_point],
      [output_dtype],
      packed=(packed, False, False),
      decode=(lambda n: decode_nibbles(n, np.dtype(packed_dtype))) if packed else None,
      backend=backend, interpret=interpret, max_block=max_block, name="dequantize",
  )
  return y


def dequantize_reference(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    formula: Formula,
    output_dtype: np.dtype,
    packed_dtype: np.dtype | None = None,
) -> jax.Array:
  """The pure-XLA twin of :func:`dequantize`."""
  if packed_dtype is not None:
    nibbles = lax.bitcast_convert_type(x, jnp.uint4)  # (..., n, 2): low nibble first
    x = lax.bitcast_convert_type(
        nibbles.reshape(*x.shape[:-1], 2 * x.shape[-1]), packed_dtype
    )
  return formula(x, scale, zero_point).astype(output_dtype)
