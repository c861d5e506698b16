"""Integer rounding and saturation against NumPy's ``rint``, near every integer and tie.

``round_and_saturate`` rounds, clamps and converts quotients for <= 16-bit
integer outputs with selects and a magic-number addition instead of a clip, a
NaN select and XLA's saturating cast (docs/numerics.md, "Speed on XLA:CPU").
These seeded checks cover, for each output dtype and several zero points,
every float within a few ulps of each integer and each ``k + 1/2`` of the
clamped range and just beyond it, the special values, and random bit patterns.
``benchmarks/rounding_exhaustive.py`` runs the same comparison over all 2**32
float32 quotients (its result is recorded in docs/numerics.md).
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _dtypes
from jaxquant import _numerics
from quant_testing import assert_bits_equal

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from rounding_exhaustive import near_integers_and_ties, reference, specials  # pylint: disable=wrong-import-position

_ULPS = 4
_RANDOM = 1 << 18

CASES = [
    ("int8", 3), ("int8", -128), ("int8", 127), ("uint8", 0), ("uint8", 128), ("uint8", 255),
    ("int16", -32768), ("int16", 32767), ("uint16", 65535), ("int4", -8), ("uint4", 15),
    ("int2", 1), ("uint2", 0),
]


def _quotients(dtype_name, zero_point, float_dtype, seed):
  info = ml_dtypes.iinfo(np.dtype(dtype_name))
  low, high = info.min - zero_point - 2, info.max - zero_point + 2
  rng = np.random.default_rng(seed)
  uint = {np.float32: np.uint32, np.float64: np.uint64}[float_dtype]
  random_bits = rng.integers(0, np.iinfo(uint).max, _RANDOM, dtype=uint, endpoint=True)
  return np.concatenate([
      near_integers_and_ties(low, high, _ULPS, float_dtype), specials(float_dtype),
      random_bits.view(float_dtype), rng.uniform(low, high, _RANDOM).astype(float_dtype),
  ])


def _check(dtype_name, zero_point, float_dtype, seed):
  info = _dtypes.quantized_dtype("dtype", np.dtype(dtype_name))
  quotients = _quotients(dtype_name, zero_point, float_dtype, seed)
  want = reference(quotients, zero_point, np.dtype(dtype_name))
  zero_point_array = jnp.asarray(zero_point, info.dtype)
  got = jax.jit(lambda q, z: _numerics.round_and_saturate(q, z, info))(
      jnp.asarray(quotients), zero_point_array)
  assert got.dtype == info.dtype
  mismatch = np.flatnonzero(np.asarray(got).astype(np.int64) != want)
  assert mismatch.size == 0, (quotients[mismatch[:8]], np.asarray(got)[mismatch[:8]],
                              want[mismatch[:8]])
  if info.bits < 8:
    codes = jax.jit(lambda q, z: _numerics.round_and_saturate(q, z, info, codes=True))(
        jnp.asarray(quotients), zero_point_array)
    np.testing.assert_array_equal(np.asarray(codes), want & ((1 << info.bits) - 1))


@pytest.mark.parametrize("dtype_name,zero_point", CASES)
def test_float32_quotients(dtype_name, zero_point):
  _check(dtype_name, zero_point, np.float32, seed=0)


@pytest.mark.parametrize("dtype_name,zero_point", [("int8", 3), ("uint8", 255), ("int16", 32767)])
def test_float64_quotients_under_x64(dtype_name, zero_point):
  with jax.enable_x64(True):
    _check(dtype_name, zero_point, np.float64, seed=1)


def test_no_zero_point_is_zero():
  info = _dtypes.quantized_dtype("dtype", np.dtype(np.int8))
  quotients = near_integers_and_ties(-130, 130, _ULPS, np.float32)
  got = _numerics.round_and_saturate(jnp.asarray(quotients), None, info)
  np.testing.assert_array_equal(np.asarray(got), reference(quotients, 0, np.dtype(np.int8)))


# Each platform's formulation, evaluated here on the CPU: lax.platform_dependent
# picks one when the program is lowered (XLA:CPU's bit trick, a cast elsewhere;
# division in float64 on CUDA), and every one must give the same bits.


@pytest.mark.parametrize("dtype_name,zero_point", CASES)
def test_integer_conversion_by_cast_equals_the_bit_trick(dtype_name, zero_point):
  info = ml_dtypes.iinfo(np.dtype(dtype_name))
  clamped = np.arange(info.min - zero_point, info.max - zero_point + 1, dtype=np.float32)
  arguments = jnp.asarray(clamped), jnp.asarray(zero_point, jnp.int32)
  by_cast = jax.jit(_numerics.integer_by_cast)(*arguments)
  np.testing.assert_array_equal(by_cast, jax.jit(_numerics.integer_through_magic)(*arguments))
  np.testing.assert_array_equal(by_cast, np.arange(info.min, info.max + 1))


def _division_operands(seed):
  """float32 (x, divisor) pairs: random bits, quotients on and next to rounding ties, specials."""
  rng = np.random.default_rng(seed)
  count = 1 << 18
  divisor = rng.uniform(1e-3, 1e3, count).astype(np.float32)
  ties = (rng.integers(-40000, 40000, count) + 0.5).astype(np.float32)
  on_ties = (ties.astype(np.float64) * divisor).astype(np.float32)
  next_to = np.nextafter(on_ties, rng.choice([-np.inf, np.inf], count).astype(np.float32))
  random_bits = rng.integers(0, 2**32, (2, count), dtype=np.uint64).astype(np.uint32)
  specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, 1e-45, -1e-38], np.float32)
  x = np.concatenate([on_ties, next_to, random_bits[0].view(np.float32),
                      np.repeat(specials, specials.size)])
  d = np.concatenate([divisor, divisor, random_bits[1].view(np.float32),
                      np.tile(specials, specials.size)])
  return x, d


def test_division_in_float64_is_ieee_division():
  """CUDA's formulation: the correctly rounded float32 quotient. Its subnormal quotients are
  rounded in float64 (test_float32_rounding_without_casts_is_the_cast_under_x64); this CPU
  flushes them in the final conversion to float32 (J1), CUDA keeps them."""
  x, divisor = _division_operands(seed=2)
  with np.errstate(all="ignore"):
    want = x / divisor
  got = np.asarray(jax.jit(_numerics.divide_in_float64)(x, divisor))
  # This CPU reads subnormal operands as zero (J1); CUDA does not.
  tiny = np.finfo(np.float32).tiny
  normal = ~((x != 0) & (np.abs(x) < tiny)) & ~((divisor != 0) & (np.abs(divisor) < tiny))
  x, divisor, want, got = x[normal], divisor[normal], want[normal], got[normal]
  subnormal = (want != 0) & (np.abs(want) < tiny)
  want = np.where(subnormal, np.copysign(np.float32(0), want), want)
  assert_bits_equal(got, want)


def test_division_lowers_per_platform():
  """One program: float32 division in float64 where lowered for CUDA, float32 elsewhere."""
  x = jnp.ones((4, 8), jnp.float32)
  divide = jax.jit(lambda x, s: _numerics.true_divide(x, s))
  for platform, wide in (("cuda", True), ("cpu", False), ("tpu", False)):
    text = divide.trace(x, jnp.float32(3)).lower(lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.reduce_precision" in text) == wide, platform
    assert ("stablehlo.divide" in text and ("xf64>" in text) == wide), platform


def test_float16_rounding_without_casts_is_the_cast():
  """CUDA's float16 rounding (XLA:GPU drops the cast pair) against NumPy's float32 -> float16."""
  rng = np.random.default_rng(3)
  half = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
  half = np.unique(half[np.isfinite(half)].astype(np.float64))
  ties = ((half[1:] + half[:-1]) / 2).astype(np.float32)  # exact: 12 significant bits
  half = half.astype(np.float32)
  x = np.concatenate([
      rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
      half, np.nextafter(half, np.inf), np.nextafter(half, -np.inf),
      ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf),
      np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.996, 65520.0, 2.0**-14,
                  2.0**-24, 2.0**-25, -(2.0**-25), 3 * 2.0**-26, 2.0**-14 - 2.0**-25]),
  ])
  # This CPU reads float32 subnormals as zero (J1); they round to a float16 zero anyway.
  x = x[~((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny))]
  with np.errstate(over="ignore"):
    want = x.astype(np.float16).astype(np.float32)
  got = np.asarray(jax.jit(lambda x: _numerics.round_without_casts(x, jnp.float16))(x))
  assert_bits_equal(got, want)


def test_float32_rounding_without_casts_is_the_cast_under_x64():
  """The same for float64 -> float32 (CUDA's rounding to odd), subnormals included."""
  rng = np.random.default_rng(4)
  single = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32)
  single = single[np.isfinite(single)].astype(np.float64)
  tiny = np.float64(np.finfo(np.float32).smallest_subnormal)
  x = np.concatenate([
      rng.integers(0, 2**64, 1 << 18, dtype=np.uint64).view(np.float64), single,
      single * (1 + 2.0**-24), single * (1 - 2.0**-24), single * (1 + 2.0**-30),
      tiny * np.arange(-4, 5) / 2, tiny * (np.arange(-4, 5) / 2 + 2.0**-20),
      [np.inf, -np.inf, np.nan, 3.4028235677973366e38, 3.4028235677973362e38],
  ])
  with np.errstate(over="ignore", invalid="ignore"):
    want = x.astype(np.float32).astype(np.float64)
  with jax.enable_x64(True):
    got = np.asarray(jax.jit(lambda x: _numerics.round_without_casts(x, jnp.float32))(x))
  assert_bits_equal(got, want)


def test_float16_rounding_lowers_per_platform():
  """One program: float16 rounding by reduce_precision for CUDA, by the cast pair elsewhere."""
  round_ = jax.jit(lambda x: _numerics.round_to(x, np.float16))
  for platform, arithmetic in (("cuda", True), ("cpu", False), ("tpu", False)):
    text = round_.trace(jnp.ones(8)).lower(lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.reduce_precision" in text) == arithmetic, platform
    assert ("xf16>" in text) != arithmetic, platform
  with jax.enable_x64(True):  # float64 x: rounded to odd in float32 first, without casts too
    round_ = jax.jit(lambda x: _numerics.round_to(x, np.float16))
    for platform, arithmetic in (("cuda", True), ("cpu", False)):
      text = round_.trace(jnp.ones(8, jnp.float64)).lower(
          lowering_platforms=(platform,)).as_text()
      assert ("format = e8m23" in text) == arithmetic, platform
    # float64 x to float32's precision (a float32 scale's quotient under x64) likewise.
    round_ = jax.jit(lambda x: _numerics.round_to(x, np.float32))
    for platform, arithmetic in (("cuda", True), ("cpu", False)):
      text = round_.trace(jnp.ones(8, jnp.float64)).lower(
          lowering_platforms=(platform,)).as_text()
      assert ("format = e8m23" in text) == arithmetic, platform


def _round_once(x, dtype):
  """float64 x rounded once, to nearest even, to dtype (normal range): NumPy's own
  float64 -> float16 cast, and for bfloat16 its 7 mantissa bits kept from float64's 52."""
  if dtype == np.float16:
    return x.astype(np.float16)
  bits = x.view(np.uint64)
  dropped = np.uint64(52 - 7)
  half, lowest = np.uint64(1) << (dropped - np.uint64(1)), (bits >> dropped) & np.uint64(1)
  rounded = ((bits + half - np.uint64(1) + lowest) >> dropped) << dropped
  return rounded.view(np.float64).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_float64_x_rounds_once_to_a_half_precision_under_x64(dtype):
  # XLA converts float64 to float16 or bfloat16 through float32: x just past a
  # tie of the narrow type rounded to float32's copy of the tie, then to even.
  rng = np.random.default_rng(3)
  count = 1 << 16
  mantissa = int(jnp.finfo(dtype).nmant)
  exponent = rng.integers(-10, 15, count)
  ties = (rng.integers(1 << mantissa, 2 << mantissa, count) + 0.5) * 2.0 ** (
      exponent - mantissa)
  steps = rng.integers(1, 1 << 20, count) * rng.choice([-1, 1], count)
  near_ties = (ties.view(np.int64) + steps).view(np.float64)
  x = np.concatenate([near_ties, -near_ties, ties, rng.uniform(-6e4, 6e4, count)])
  want = _round_once(np.abs(x), dtype).astype(np.float64) * np.sign(x)
  with jax.enable_x64(True):
    got = jax.jit(lambda x: _numerics.round_to(x, np.dtype(dtype)))(jnp.asarray(x))
    assert got.dtype == np.float64
    mismatch = np.flatnonzero(np.asarray(got) != want)
    assert mismatch.size == 0, (x[mismatch[:4]], np.asarray(got)[mismatch[:4]], want[mismatch[:4]])
    # The public ops divide in the scale's precision: the helpers' audit cases.
    x = jnp.asarray([2049 + 2.0**-30, 257 + 2.0**-20])
    assert jq.quantize_linear(x, np.float16(1), jnp.int16(0)).tolist() == [2050, 257]
    assert jq.quantize_linear(x, ml_dtypes.bfloat16(1), jnp.int16(0)).tolist() == [2048, 258]
    assert jq.fake_quantize(x, np.float16(1), dtype=jnp.int16).tolist() == [2050, 257]


def test_32bit_outputs_match_the_reference():
  """int32 and uint32 go their own way (the sum formed from 16-bit halves): the same rules.

  Quotients near 0, near each 2**16 boundary that the halves carry across, near
  the range's ends less the zero point and beyond them, plus specials (NaN ->
  min) and random bits, for zero points at both ends and in between.
  """
  rng = np.random.default_rng(4)
  for dtype_name, zero_point in [("int32", 0), ("int32", -2**31), ("int32", 2**31 - 1),
                                 ("int32", 70000), ("uint32", 0), ("uint32", 2**32 - 1),
                                 ("uint32", 3_000_000_000)]:
    info = _dtypes.quantized_dtype("dtype", np.dtype(dtype_name))
    centers = {0, 2**16, -2**16, 2**17, info.min - zero_point, info.max - zero_point}
    quotients = np.concatenate([
        *(near_integers_and_ties(c - 3, c + 3, _ULPS, np.float32) for c in sorted(centers)),
        specials(np.float32),
        rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32),
        rng.uniform(-1e5, 1e5, 1 << 16).astype(np.float32),
        rng.uniform(-2.0**33, 2.0**33, 1 << 16).astype(np.float32),
    ])
    want = reference(quotients, zero_point, np.dtype(dtype_name))
    got = jax.jit(lambda q, z, info=info: _numerics.round_and_saturate(q, z, info))(
        jnp.asarray(quotients), jnp.asarray(np.array(zero_point, dtype_name)))
    assert got.dtype == info.dtype
    mismatch = np.flatnonzero(np.asarray(got).astype(np.int64) != want)
    assert mismatch.size == 0, (dtype_name, zero_point, quotients[mismatch[:8]],
                                np.asarray(got)[mismatch[:8]], want[mismatch[:8]])


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
                                   jnp.float8_e5m2fnuz, jnp.float4_e2m1fn], ids=str)
def test_float_values_by_table_are_the_cast(dtype):
  """CUDA reads float8/float4 by a table (XLA:GPU drops a quantize's cast pair): every code."""
  bits = jnp.finfo(dtype).bits
  x = jnp.asarray(np.arange(2**bits, dtype=np.uint8).view(dtype))
  got = np.asarray(jax.jit(_numerics.float_values_by_table)(x))
  want = np.asarray(x.astype(jnp.float32))
  assert_bits_equal(got, want)
  fake = jax.jit(lambda x: jq.fake_quantize(x, 0.5, dtype=dtype))
  for platform, table in (("cuda", True), ("cpu", False)):
    text = fake.trace(jnp.ones(8)).lower(lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.gather" in text) == table, platform
