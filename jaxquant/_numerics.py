"""The numerics of quantization, in one place: division, rounding, saturation, the formulas.

docs/numerics.md states each rule; :mod:`jaxquant._dtypes` is the table of
dtypes they consult. Every op and every Pallas kernel evaluates these
formulas (a kernel is handed the formula; it never imports jaxquant).
"""

from __future__ import annotations

from typing import Any

import jax
from jax import custom_batching
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxquant import _dtypes
from jaxquant._dtypes import QuantizedDType
from pallas_kernels.dequantize import decode_codes


def values(x: jax.Array, info: QuantizedDType) -> jax.Array:
  """``x`` as numbers: float32 for a float dtype (codes, ``info.as_codes``, too), else ``x``.

  XLA:GPU drops a float32 -> float8 -> float32 conversion pair inside one
  program (excess precision): a float8 or float4 quantize dequantized in the
  same ``jit`` lost its rounding (every element of a float8 ``fake_quantize``
  differed, on an H100). On CUDA the values are read by their bits from a
  table of the dtype's codes, which no simplification pairs with the cast.
  """
  if info.as_codes:
    return decode_codes(x, info.dtype)
  if info.is_integer or x.dtype != info.dtype:  # integers, or codes decoded already
    return x
  return lax.platform_dependent(x, cuda=float_values_by_table,
                                default=lambda x: x.astype(jnp.float32))


def float_values_by_table(x: jax.Array) -> jax.Array:
  """float8 or float4 ``x`` as float32, looked up by its bits (:func:`values`)."""
  bits = jnp.finfo(x.dtype).bits
  unsigned = jnp.dtype(f"uint{bits}")
  # Built from an iota, not a constant: a kernel body (which takes the default
  # branch) may capture no constants, and XLA folds it.
  codes = lax.iota(jnp.uint8, 2**bits).astype(unsigned)
  table = lax.bitcast_convert_type(codes, x.dtype).astype(jnp.float32)
  return table[lax.bitcast_convert_type(x, unsigned).astype(jnp.int32)]


def round_to(x: jax.Array, dtype: np.dtype) -> jax.Array:
  """Rounds float ``x`` to ``dtype``'s precision and range, keeping x's dtype."""
  info, wide = jnp.finfo(dtype), jnp.finfo(x.dtype)
  if info.nmant >= wide.nmant:
    return x
  if x.dtype == np.float64 and dtype != np.float32:
    # XLA converts float64 to a narrower float through float32, rounding twice;
    # float32 rounded to odd keeps the second rounding the only one (as in
    # int32_to_float).
    return round_to(_float32_to_odd(x), dtype).astype(x.dtype)
  if info.nexp == wide.nexp:
    # bfloat16 from float32: XLA may drop a cast down and back up (it allows
    # excess precision by default) but keeps reduce_precision, which agrees
    # with the cast here because the exponent ranges, subnormals included, match.
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  # reduce_precision flushes the narrower type's subnormals; the cast keeps them.
  return _cast_down_and_up(x, dtype)


def _cast_down_and_up(x: jax.Array, dtype: np.dtype) -> jax.Array:
  """``x.astype(dtype).astype(x.dtype)``, which XLA:GPU keeps.

  XLA:GPU drops such a cast pair (excess precision; measured on an H100 for
  float32 -> float16 -> float32 and float64 -> float32 -> float64): on CUDA
  float16 and float32, which round and overflow as ``reduce_precision``
  does, are rounded without casts (:func:`round_without_casts`).
  """
  cast = lambda x: x.astype(dtype).astype(x.dtype)
  if np.dtype(dtype) not in (np.float16, np.float32):
    return cast(x)
  return lax.platform_dependent(
      x, cuda=lambda x: round_without_casts(x, dtype), default=cast)


def round_without_casts(x: jax.Array, dtype: np.dtype) -> jax.Array:
  """``x`` rounded to the narrower float ``dtype`` (nearest even, subnormals kept), by arithmetic.

  For XLA:GPU, which drops a cast down and back up. ``reduce_precision``
  rounds the normal range and overflows as the cast does; below ``dtype``'s
  smallest normal the value is rounded on the subnormal grid, an integer
  multiple of the smallest subnormal, scaled exactly by powers of two.
  """
  info = jnp.finfo(dtype)
  quantum = np.asarray(info.smallest_subnormal, x.dtype)
  normal = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  subnormal = jnp.round(x * (1 / quantum)) * quantum
  return jnp.where(jnp.abs(x) < np.asarray(info.smallest_normal, x.dtype), subnormal, normal)


def _float32_to_odd(x: jax.Array) -> jax.Array:
  """float64 ``x`` rounded to float32 *to odd*: truncated, the last bit set if inexact.

  The nearest float32 is one of the two that bracket x; where it is even and
  not x, the odd one is its neighbour on x's side.
  """
  nearest = x.astype(jnp.float32)
  back = _cast_down_and_up(x, jnp.float32)
  bits = lax.bitcast_convert_type(nearest, jnp.uint32)
  inexact = (back != x) & ~jnp.isnan(x) & (bits & 1 == 0)
  # Magnitudes order like their bits: one step of the bits is one ulp of |x|.
  step = jnp.where(jnp.abs(back) > jnp.abs(x), -1, 1).astype(jnp.int32)
  odd = lax.bitcast_convert_type(
      lax.bitcast_convert_type(bits, jnp.int32) + step, jnp.float32)
  return jnp.where(inexact, odd, nearest)


def division_precision(scale_dtype: Any) -> np.dtype:
  """The dtype ONNX divides in by default: the scale's (float32 for float8_e8m0fnu).

  A float8_e8m0fnu scale is a power of two, so float32 divides by it exactly.
  """
  return _dtypes.scale_float_dtype(scale_dtype)


def int32_to_float(x: jax.Array, dtype: np.dtype, precision: np.dtype) -> jax.Array:
  """int32 ``x`` as float ``dtype``, rounded once (to nearest even) to ``precision``.

  XLA converts int32 to a narrow float through float32, rounding twice, which
  can land on a tie of the narrow type and break it the wrong way. Rounding to
  float32 *to odd* first keeps the second rounding exact, as float32 has more
  than ``p + 2`` significant bits for float16 and bfloat16 (Boldo and
  Melquiond 2008).
  """
  wide = jnp.finfo(dtype)
  if jnp.finfo(precision).nmant >= wide.nmant or wide.nmant >= 31:
    # One rounding (float32 precision), or none (float64 holds every int32).
    return round_to(x.astype(dtype), precision)
  magnitude = lax.bitcast_convert_type(jnp.abs(x), jnp.uint32)  # |int32 min| fits uint32
  bit_length = 32 - lax.clz(magnitude).astype(jnp.int32)
  dropped = jnp.maximum(bit_length - (wide.nmant + 1), 0).astype(jnp.uint32)
  kept = magnitude >> dropped
  sticky = (magnitude & ((jnp.uint32(1) << dropped) - 1)) != 0
  odd = kept | sticky.astype(jnp.uint32)
  # 2**dropped built from its exponent bits: exact, unlike a library exp2.
  power = lax.bitcast_convert_type((dropped + 127) << 23, jnp.float32)
  value = odd.astype(jnp.float32) * power
  return round_to(jnp.where(x < 0, -value, value), precision)


def compute_dtype(*dtypes: Any) -> np.dtype:
  """The float dtype in which quantization arithmetic runs: float32, or float64 under x64."""
  return np.dtype(jnp.result_type(jnp.float32, *(
      d for d in dtypes if jnp.issubdtype(d, jnp.floating) and np.dtype(d).itemsize > 4
  )))


def _add_zero_point_32bit(
    rounded: jax.Array, zero_point: jax.Array, info: QuantizedDType
) -> jax.Array:
  """``saturate(rounded + zero_point)`` for 32-bit outputs, without rounding the sum.

  Neither float32 nor int32 holds the 33-bit sum, so it is formed from 16-bit
  halves: ``rounded = hi * 2**16 + lo`` with ``0 <= lo < 2**16``.
  """
  half = 2.0**16
  # Beyond +-2**32 every zero point of the type leaves the sum out of range.
  rounded = jnp.clip(rounded, -(2.0**32), 2.0**32)
  rounded_hi = jnp.floor(rounded / half)
  rounded_lo = (rounded - rounded_hi * half).astype(jnp.int32)
  zero_point = zero_point.astype(info.dtype)
  zero_point_hi = jnp.right_shift(zero_point, 16)  # arithmetic for int32, logical for uint32
  zero_point_lo = (zero_point & info.dtype.type(0xFFFF)).astype(jnp.int32)
  sum_lo = rounded_lo + zero_point_lo
  sum_hi = (
      rounded_hi.astype(jnp.int32) + zero_point_hi.astype(jnp.int32)
      + lax.shift_right_logical(sum_lo, jnp.int32(16))
  )
  sum_lo = (sum_lo & 0xFFFF).astype(info.dtype)
  value = lax.shift_left(sum_hi.astype(info.dtype), info.dtype.type(16)) | sum_lo
  return jnp.where(
      sum_hi > (info.max >> 16), info.dtype.type(info.max),
      jnp.where(sum_hi < (info.min >> 16), info.dtype.type(info.min), value),
  )


def _round_and_saturate_narrow(
    quotient: jax.Array, zero_point: jax.Array | None, info: QuantizedDType
) -> jax.Array:
  """``saturate(round_half_to_even(quotient) + zero_point)`` for integer types of <= 16 bits.

  The same value, computed in the order that compiles to the fewest
  instructions on XLA:CPU (docs/numerics.md, "Speed on XLA:CPU"):

  1. Round (``roundps``). The quotient's only use: XLA keeps an expensive
     producer (the division) out of a fusion that reads it twice.
  2. Clamp to ``[min - zero_point, max - zero_point]``: integers, so clamping
     after rounding and before adding the zero point saturates the sum.
     ``where(r > low, r, low)`` is one ``maxps`` that also sends NaN to
     ``low``, hence to ``min``; ``jnp.clip`` propagates NaN (a select more).
  3. Convert by adding ``magic = 1.5 * 2**p`` (``p`` mantissa bits): the sum
     is exact and lies in ``[2**p, 2**(p + 1))``, where the float grid is the
     integers, so its bits are ``bits(magic) + r``. Adding ``zero_point -
     bits(magic)`` to them, in the integer type of the float's width, gives
     the result, already within the output's range: the final conversion is a
     truncation. (XLA's float -> int conversion saturates and maps NaN to 0,
     several instructions per vector.) That is XLA:CPU's conversion; other
     platforms convert the clamped value with ``astype``: XLA:GPU compiles
     the bit trick fused with the output's conversion to -1 for every
     element (jax 0.11.2, H100).

  Step 1 keeps a product that produced ``quotient`` (qlinear_matmul's
  requantization) from being contracted with the addition into one FMA.

  Returns:
    The result in the signed integer type of the quotient's width (int32, or
    int64 for float64), to be converted to the output type.
  """
  quotient = quotient.astype(jnp.promote_types(quotient.dtype, jnp.float32))
  int_type = {4: np.int32, 8: np.int64}[quotient.dtype.itemsize]
  zero_point = jnp.asarray(0 if zero_point is None else zero_point, int_type)
  low = (info.min - zero_point).astype(quotient.dtype)
  high = (info.max - zero_point).astype(quotient.dtype)
  rounded = jnp.round(quotient)
  clamped = jnp.where(rounded > low, rounded, low)
  clamped = jnp.where(clamped < high, clamped, high)
  return lax.platform_dependent(
      clamped, zero_point, cpu=integer_through_magic, default=integer_by_cast)


def integer_through_magic(clamped: jax.Array, zero_point: jax.Array) -> jax.Array:
  """``clamped + zero_point`` in the signed integer type of clamped's width, by its bits.

  ``clamped`` holds integers within the output's range less the zero point
  (step 3 of :func:`_round_and_saturate_narrow`).
  """
  magic = clamped.dtype.type(1.5 * 2.0 ** jnp.finfo(clamped.dtype).nmant)
  int_type = zero_point.dtype.type
  bits = lax.bitcast_convert_type(clamped + magic, int_type)
  return bits + (zero_point - np.asarray(magic).view(int_type))


def integer_by_cast(clamped: jax.Array, zero_point: jax.Array) -> jax.Array:
  """:func:`integer_through_magic` by a cast."""
  return clamped.astype(zero_point.dtype) + zero_point


def _encode(value: jax.Array, info: QuantizedDType) -> jax.Array:
  """The code of ``value`` rounded to nearest even on ``info``'s grid, saturated.

  NaN gives +max (as float4's Cast table), +-inf and overflow +-max, -0.0 the
  -0.0 code. Within the binade ``[2**e, 2**(e+1))`` the grid steps by
  ``q = 2**(e - p)`` (below the smallest normal, by the subnormal step), so
  ``round(|v| / q)`` counts steps, and the code is that count plus
  ``2**p`` per binade below: a count that rounds up to the next binade lands
  on its first code, so no carry needs handling. Dividing by ``q`` is a
  multiplication by a power of two, exact in float32 and float64 alike.
  """
  finfo = jnp.finfo(info.dtype)
  mantissa_bits, low = finfo.nmant, finfo.minexp  # the smallest normal is 2**low
  value = jnp.where(jnp.isnan(value), info.max, value)
  magnitude = jnp.minimum(jnp.abs(value), info.max)
  steps = magnitude * 2.0 ** (mantissa_bits - low)
  offset = jnp.zeros(value.shape, jnp.int32)
  for exponent in range(low + 1, finfo.maxexp):
    above = magnitude >= 2.0**exponent
    steps = jnp.where(above, magnitude * 2.0 ** (mantissa_bits - exponent), steps)
    offset = jnp.where(above, (exponent - low) << mantissa_bits, offset)
  code = jnp.round(steps).astype(jnp.int32) + offset
  sign = jnp.signbit(value).astype(jnp.int32) << (info.bits - 1)
  return (code | sign).astype(jnp.uint8)


def round_and_saturate(
    quotient: jax.Array,
    zero_point: jax.Array | None,
    info: QuantizedDType,
    *,
    saturate: bool = True,
    codes: bool = False,
) -> jax.Array:
  """``saturate(round_half_to_even(quotient) + zero_point)`` as ``info.dtype``.

  The rules are docs/numerics.md's "Special values".
  Integers: NaN -> ``min``, +-inf and overflow clamp to the range; the clamp is
  done in float, as XLA's cast maps NaN to 0 (up to 16 bits by
  :func:`_round_and_saturate_narrow`, which never casts a float). Floats: the
  dtype's own round-to-nearest-even cast; ``saturate`` clips to +-max first
  (XLA's float8 cast does not), NaN stays NaN, or becomes +max in a dtype
  without NaN (ONNX's float4 cast table; XLA's cast would give -0). float6,
  which XLA cannot cast to, is rounded and saturated by arithmetic (the same
  rules as float4) and returned as uint8 codes.

  Args:
    quotient: ``x / scale`` in float32 (or float64), broadcast against ``zero_point``.
    zero_point: in ``info.array_dtype`` (codes for float6), or ``None`` for 0.
    info: the target dtype's table entry.
    saturate: float8 only: clip to the finite range instead of overflowing.
    codes: sub-byte dtypes only: return the uint8 codes (bit patterns) of the
      result instead of an array of ``info.dtype``, never converting to a
      sub-byte type: XLA:CPU converts to int4 about 40 times slower than to
      int8 (benchmarks/run.py), and the codes are what packing needs.

  Returns:
    An array of ``info.array_dtype`` (``info.dtype``, or uint8 codes for
    float6), or uint8 codes with ``codes``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxquant import _dtypes
    >>> info = _dtypes.quantized_dtype("dtype", jnp.float6_e2m3fn)
    >>> round_and_saturate(jnp.array([1.0625, 1.1875, -0.0, 9.0, jnp.nan]),
    ...                            None, info)  # 1.0, 1.25, -0.0, 7.5, 7.5
    Array([ 8, 10, 32, 31, 31], dtype=uint8)
  """
  if not info.is_integer:
    if zero_point is not None:
      # Adding a zero point of +0 would turn a -0 quotient into +0.
      zero_point = values(zero_point, info).astype(quotient.dtype)
      quotient = jnp.where(zero_point == 0, quotient, quotient + zero_point)
    if info.as_codes or codes:
      return _encode(quotient, info)
    if saturate:
      quotient = jnp.clip(quotient, info.min, info.max)
    if not info.has_nan:
      quotient = jnp.where(jnp.isnan(quotient), info.max, quotient)
    return quotient.astype(info.dtype)

  # int8 holds every sub-byte integer; its two's complement low bits are the codes.
  storage = np.dtype(np.int8) if codes else info.dtype
  if info.bits == 32:
    rounded = jnp.round(quotient)
    if zero_point is None:
      zero_point = jnp.zeros((), info.dtype)
    result = _add_zero_point_32bit(rounded, zero_point, info)
    result = jnp.where(jnp.isnan(rounded), storage.type(info.min), result)
  else:
    result = _round_and_saturate_narrow(quotient, zero_point, info).astype(storage)
  if codes:
    return result.astype(jnp.uint8) & jnp.uint8((1 << info.bits) - 1)
  return result


def true_divide(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``x / scale`` rounded once, as IEEE division, on every platform.

  Two compilers stand in the way, and each is handled where it runs (the
  choice is made when the program is lowered, so one exported program
  divides correctly on each platform):

  * XLA rewrites division by a broadcast operand into multiplication by its
    reciprocal, which moves 12-43% of float32 quotients by one ulp and flips
    rounding ties (docs/numerics.md, "XLA traps the library avoids"). The
    divisor is the scale with a zero OR-ed into its bits: ``clz(v) >> 6``
    (``>> 7`` for float64) is 0 for every v, as a count of leading zeros
    never exceeds the width. XLA's simplifier does not know that, so the
    divisor varies element-wise, is no broadcast and the division stays.
    LLVM does know it (the range of ``ctlz``) and drops the term: the
    compiled loop divides by the scale held in a register, with nothing
    added. v is x's bits XOR-ed with element positions times a zero behind
    an optimization barrier: neither a constant x (a weight closed over by
    ``jit``) nor one of equal elements (which XLA makes a broadcast) lets
    XLA fold v or see it as a broadcast, and the positions span ``vmap``'s
    batch dims (:func:`_positions`). The barrier holds one scalar, so it
    cuts no fusion (jax 0.11 keeps barriers until after fusion).
  * XLA:GPU emits float32 division as PTX ``div.full.f32``, within 2 ulp, not
    rounded correctly (openxla/xla#37181). On CUDA a float32 quotient is
    divided in float64 (``div.rn.f64``) and rounded to float32: 53 >= 2 * 24
    + 2 significant bits make the double rounding innocuous (Figueroa 1995),
    so the result is the correctly rounded float32 quotient, subnormal ones
    included (:func:`round_without_casts`), as onnxruntime computes them
    where XLA:CPU flushes them (docs/numerics.md, J1). The float64 divisor
    carries the same zero.

  Kernels evaluate the default branch: their operands are loads, never
  constants, and ``pallas_kernels._exact`` gives Triton its IEEE division.
  """
  shape = jnp.broadcast_shapes(jnp.shape(x), jnp.shape(scale))
  x = jnp.broadcast_to(x, shape)
  divisor = jnp.broadcast_to(jnp.asarray(scale, x.dtype), shape)
  return lax.platform_dependent(x, divisor, cuda=divide_in_float64, default=guarded_divide)


def guarded_divide(x: jax.Array, divisor: jax.Array) -> jax.Array:
  """``x / divisor`` (same shape and dtype) that XLA keeps a division (:func:`true_divide`)."""
  uint = _unsigned_like(x.dtype)
  width = 8 * x.dtype.itemsize
  positions = _positions(lax.stop_gradient(x)).astype(uint)
  varied = lax.bitcast_convert_type(x, uint) ^ (positions * opaque_zero(uint))
  zero = lax.clz(varied) >> width.bit_length()
  return x / lax.bitcast_convert_type(lax.bitcast_convert_type(divisor, uint) | zero, x.dtype)


def _unsigned_like(dtype: Any) -> np.dtype:
  """The unsigned integer dtype of ``dtype``'s width, for its bits."""
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def rounded_sum(a: jax.Array, b: jax.Array, *, signed_zero: bool = True) -> jax.Array:
  """``a + b`` with each addend rounded as it is: no product among them fused into an FMA.

  XLA:CPU's code generator contracts a product feeding an add into one fused
  multiply-add, which rounds once where the formula rounds the product first
  (J6 in docs/numerics.md). LLVM fuses only an addend that is a product, so
  the sum is taken as the larger plus the smaller of the two, each a select:
  the same float (addition commutes; a NaN in either stays in the sum). The
  selects' conditions differ (``>`` and ``>=``, equal where ``a == b``), or
  LLVM folds the mirrored pair back into ``a + b``; so at ``a == b`` both
  addends are ``b``, which is ``a + b`` but for ``a = +0, b = -0``: the sum
  is -0. With ``signed_zero`` a zero sum takes IEEE's sign (-0 only from two
  -0s); without, it is left, for a caller that rounds it to an integer.
  """
  larger = jnp.where(a > b, a, b)
  smaller = jnp.where(a >= b, b, a)
  total = larger + smaller
  if signed_zero:
    zero = jnp.where(jnp.signbit(a) & jnp.signbit(b), -0.0, 0.0).astype(total.dtype)
    total = jnp.where(total == 0, zero, total)
  return total


def opaque_zero(dtype: Any) -> jax.Array:
  """A scalar zero that XLA's simplifier and constant folding cannot see.

  It sits behind an optimization barrier, which XLA removes only after
  simplification (jax 0.10) or after fusion (jax 0.11), so what depends on
  it is neither folded nor rewritten; a scalar, so it cuts no fusion.
  """
  return lax.optimization_barrier(jnp.zeros((), dtype))


@jax.custom_jvp
def unfolded(x: jax.Array) -> jax.Array:
  """x, which XLA cannot constant-fold: its bits XOR-ed with :func:`opaque_zero`.

  For statistics of a closed-over x, which XLA would otherwise evaluate while
  compiling (a sort took minutes for a million elements). The XOR fuses into
  an element-wise consumer or a plain reduction, where LLVM drops it once the
  barrier is gone; a consumer that fuses no producer (a windowed reduction)
  would get x written out first, and takes an opaque identity instead. The
  derivative is the identity's.
  """
  uint = _unsigned_like(x.dtype)
  bits = lax.bitcast_convert_type(x, uint) ^ opaque_zero(uint)
  return lax.bitcast_convert_type(bits, x.dtype)


unfolded.defjvp(lambda primals, tangents: (unfolded(*primals), *tangents))


@custom_batching.custom_vmap
def _positions(x: jax.Array) -> jax.Array:
  """uint32 integers of x's shape that vary along each of its dims.

  x's values are not read. Under ``vmap`` the positions span the batch dims
  too: an ``iota`` alone is not batched, and the broadcast along them that
  ``vmap`` adds would let XLA treat a divisor as a broadcast after all. (The
  type is fixed: the batching rule may run outside ``jax.enable_x64``.)
  """
  positions = jnp.zeros(x.shape, jnp.uint32)
  for dim in range(x.ndim):
    positions = positions + lax.broadcasted_iota(jnp.uint32, x.shape, dim)
  return positions


@_positions.def_vmap
def _positions_vmap(axis_size, in_batched, x):
  del axis_size
  return _positions(x), in_batched[0]


def divide_in_float64(x: jax.Array, divisor: jax.Array) -> jax.Array:
  """:func:`guarded_divide`, with a float32 quotient divided in float64 (:func:`true_divide`)."""
  if x.dtype != np.float32:
    return guarded_divide(x, divisor)
  with jax.enable_x64(True):
    wide = guarded_divide(x.astype(jnp.float64), divisor.astype(jnp.float64))
    # Rounded by arithmetic, not by the cast alone: LLVM rewrites
    # fptrunc(fdiv(fpext a, fpext b)) into a float32 fdiv (exact in IEEE
    # arithmetic), which NVPTX then emits as div.full.f32 again.
    return round_without_casts(wide, np.float32).astype(jnp.float32)


def dequantize_formula(x, scale, zero_point, *, info, output_dtype):
  x = values(x, info)
  if zero_point is not None:
    zero_point = values(zero_point, info)
    if info.is_integer:
      # int32 holds every difference of <= 16-bit types exactly; 32-bit types
      # wrap around in their own width, as onnxruntime does.
      wide = jnp.int32 if info.bits < 32 else info.dtype
      x = x.astype(wide) - zero_point.astype(wide)
    else:
      x = x.astype(jnp.float32) - zero_point.astype(jnp.float32)
  return (x.astype(jnp.float32) * scale.astype(jnp.float32)).astype(output_dtype)


def quotient_formula(x, scale, *, precision):
  """``x / scale`` as quantization divides: x, scale and quotient rounded to ``precision``.

  ``x`` is float, or int32 (requantized accumulators), rounded once to ``precision``.
  """
  # A narrower precision is emulated: operands and quotient rounded to it,
  # the division itself done wider. For float16 and bfloat16 that is exact:
  # float32 has more than 2p + 2 significant bits, so the double rounding of
  # a quotient is innocuous (Figueroa 1995).
  accumulate = compute_dtype(x.dtype, precision)
  if jnp.issubdtype(x.dtype, jnp.integer):
    x = int32_to_float(x, accumulate, precision)
  else:
    x = round_to(x.astype(accumulate), precision)
  scale = round_to(scale.astype(accumulate), precision)
  return round_to(true_divide(x, scale), precision)


def quantize_formula(x, scale, zero_point, *, info, precision, saturate, codes=False):
  quotient = quotient_formula(x, scale, precision=precision)
  return round_and_saturate(quotient, zero_point, info, saturate=saturate, codes=codes)
