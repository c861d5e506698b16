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

from jaxquant import _dtypes
from jaxquant import _numerics

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
