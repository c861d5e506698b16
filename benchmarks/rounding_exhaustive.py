"""Every float32 quotient through jaxquant's integer rounding, against NumPy's ``rint``.

``_numerics.round_and_saturate`` computes ``saturate(round_half_to_even(q) +
zero_point)`` for integer outputs of up to 16 bits by rounding, clamping to
bounds shifted by the zero point with selects (NaN to the minimum) and
converting through a magic-number addition (docs/numerics.md, "Speed on
XLA:CPU").
This script checks it, jitted on XLA:CPU, against :func:`reference`:

* float32: all 2**32 bit patterns (every finite value, both zeros, both
  infinities, every NaN payload and every subnormal), for each output dtype and
  zero point of ``CASES``;
* float64 (under x64): every float within ``ULPS`` ulps of each integer and of
  each ``k + 1/2`` in and just beyond the clamped range, ``RANDOM`` random bit
  patterns and ``RANDOM`` values uniform over the range.

  python benchmarks/rounding_exhaustive.py [--float32-chunks N] [--random N]

``--float32-chunks`` checks only the first N chunks of 2**24 patterns (256 is
all). Prints each case's count of mismatches; exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import sys
import time

import ml_dtypes
import numpy as np

# (dtype, zero points): the ends of each range and values between.
CASES = (
    ("int8", (0, 3, -128, 127)),
    ("uint8", (0, 128, 255)),
    ("int16", (0, 1234, -32768, 32767)),
    ("uint16", (0, 65535)),
    ("int4", (0, -8, 7)),
    ("uint4", (0, 15)),
    ("int2", (-2, 1)),
    ("uint2", (0, 3)),
)
ULPS = 8
RANDOM = 10**8
_CHUNK_BITS = 24


def reference(quotient: np.ndarray, zero_point: int, dtype: np.dtype) -> np.ndarray:
  """``saturate(rint(quotient) + zero_point)``, NaN -> min, in float64 then ``dtype``.

  ``np.rint`` rounds half to even; float64 holds ``rint(q) + zero_point``
  exactly wherever it is not far beyond the range, and beyond it only its
  side matters.
  """
  info = ml_dtypes.iinfo(dtype)
  with np.errstate(invalid="ignore"):  # rint(NaN)
    total = np.rint(quotient).astype(np.float64) + zero_point
  clipped = np.clip(total, info.min, info.max)
  return np.where(np.isnan(total), info.min, clipped).astype(np.int64)


def near_integers_and_ties(low: int, high: int, ulps: int, dtype) -> np.ndarray:
  """Every float of ``dtype`` within ``ulps`` ulps of k and of k + 1/2 for k in [low, high]."""
  centers = np.arange(low, high + 1, dtype=np.float64)
  centers = np.concatenate([centers, centers + 0.5]).astype(dtype)
  # Steps on the float grid, not the bit pattern: k = 0 has neighbours of both signs.
  values = [centers]
  for direction in (np.inf, -np.inf):
    current = centers
    for _ in range(ulps):
      current = np.nextafter(current, np.asarray(direction, dtype))
      values.append(current)
  return np.unique(np.concatenate(values))


def specials(dtype) -> np.ndarray:
  """Zeros, infinities, NaNs of both signs and several payloads, subnormals, extremes."""
  finfo = np.finfo(dtype)
  uint = {4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
  nans = np.array([np.nan, -np.nan], dtype)
  payloads = nans.view(uint) | uint(1)
  return np.concatenate([
      np.array([0.0, -0.0, np.inf, -np.inf, finfo.max, -finfo.max, finfo.tiny, -finfo.tiny,
                finfo.smallest_subnormal, -finfo.smallest_subnormal,
                finfo.tiny - finfo.smallest_subnormal], dtype),
      nans, payloads.view(dtype),
  ])


def _checker(dtype_name: str, zero_point: int, float_dtype):
  """A function from quotients to (got, want) for one case, jaxquant jitted."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from jaxquant import _dtypes  # pylint: disable=import-outside-toplevel
  from jaxquant import _numerics  # pylint: disable=import-outside-toplevel

  info = _dtypes.quantized_dtype("dtype", np.dtype(dtype_name))
  zero_point_array = jnp.asarray(zero_point, info.dtype)
  codes = info.bits < 8

  @jax.jit
  def round_and_saturate(quotient, zero_point):
    return _numerics.round_and_saturate(quotient, zero_point, info, codes=codes)

  def check(quotient: np.ndarray) -> int:
    got = np.asarray(round_and_saturate(jnp.asarray(quotient, float_dtype), zero_point_array))
    want = reference(quotient, zero_point, np.dtype(dtype_name))
    if codes:  # two's complement low bits
      want = want.astype(np.int64) & ((1 << info.bits) - 1)
    return int(np.count_nonzero(got.astype(np.int64) != want))

  return check


def check_float32(chunks: int) -> int:
  """Mismatches over the first ``chunks`` chunks of 2**24 float32 bit patterns, per case."""
  failures = 0
  for dtype_name, zero_points in CASES:
    for zero_point in zero_points:
      check = _checker(dtype_name, zero_point, np.float32)
      start, mismatches = time.perf_counter(), 0
      for chunk in range(chunks):
        bits = np.arange(chunk << _CHUNK_BITS, (chunk + 1) << _CHUNK_BITS, dtype=np.uint64)
        mismatches += check(bits.astype(np.uint32).view(np.float32))
      print(f"float32 {dtype_name:6} zero point {zero_point:6}: {chunks << _CHUNK_BITS} "
            f"quotients, {mismatches} mismatches ({time.perf_counter() - start:.0f} s)",
            flush=True)
      failures += mismatches
  return failures


def check_float64(random: int) -> int:
  """Mismatches over near-integer and near-tie float64 quotients and random ones, per case."""
  import jax  # pylint: disable=import-outside-toplevel

  failures = 0
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    for dtype_name, zero_points in CASES:
      info = ml_dtypes.iinfo(np.dtype(dtype_name))
      for zero_point in zero_points:
        check = _checker(dtype_name, zero_point, np.float64)
        low, high = info.min - zero_point - 2, info.max - zero_point + 2
        mismatches = check(near_integers_and_ties(low, high, ULPS, np.float64))
        mismatches += check(specials(np.float64))
        tested = 0
        for _ in range(0, random, 1 << 22):
          bits = rng.integers(0, 2**64, 1 << 22, dtype=np.uint64, endpoint=False)
          mismatches += check(bits.view(np.float64))
          mismatches += check(rng.uniform(low, high, 1 << 22))
          tested += 2 << 22
        print(f"float64 {dtype_name:6} zero point {zero_point:6}: near ties, specials and "
              f"{tested} random quotients, {mismatches} mismatches", flush=True)
        failures += mismatches
  return failures


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--float32-chunks", type=int, default=1 << (32 - _CHUNK_BITS))
  parser.add_argument("--random", type=int, default=RANDOM)
  arguments = parser.parse_args()
  import jax  # pylint: disable=import-outside-toplevel
  print(f"jax {jax.__version__} ({jax.default_backend()})", flush=True)
  failures = check_float32(arguments.float32_chunks) + check_float64(arguments.random)
  print("all equal" if not failures else f"{failures} mismatches")
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  main()
