"""choose_qparams: each recipe's formula, layouts, dtypes, and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

W = np.asarray(jax.random.normal(jax.random.key(0), (6, 70)), np.float32)


def _blocks(x, block):
  """x's rows in blocks of ``block`` columns (the last ragged): a list per row of arrays."""
  return [[row[start:start + block] for start in range(0, len(row), block)] for row in x]


def test_absmax_per_tensor_axis_block():
  scale, zero_point = jq.choose_qparams(W, jnp.int8)
  np.testing.assert_array_equal(scale, np.float32(np.abs(W).max()) / np.float32(127))
  assert zero_point.shape == () and zero_point.dtype == jnp.int8 and zero_point == 0
  scale, _ = jq.choose_qparams(W, jnp.int8, axis=0)
  np.testing.assert_array_equal(scale, np.abs(W).max(axis=1) / np.float32(127))
  scale, zero_point = jq.choose_qparams(W, jnp.int4, axis=1, block_size=32)
  expected = [[np.abs(b).max() / np.float32(7) for b in row] for row in _blocks(W, 32)]
  np.testing.assert_array_equal(scale, np.asarray(expected, np.float32))
  assert scale.shape == zero_point.shape == (6, 3)


def test_qmax_plus_half_and_clip_ratio():
  scale, _ = jq.choose_qparams(W, jnp.int2, axis=0, method="qmax_plus_half")
  np.testing.assert_array_equal(scale, np.abs(W).max(axis=1) / np.float32(1.5))
  scale, _ = jq.choose_qparams(W, jnp.int4, axis=0, clip_ratio=0.5)
  np.testing.assert_array_equal(scale, np.abs(W).max(axis=1) * np.float32(0.5) / np.float32(7))


@pytest.mark.slow
def test_minmax_is_dynamic_quantization_s_parameters():
  for dtype in (jnp.uint8, jnp.int8, jnp.int4):
    scale, zero_point = jq.choose_qparams(W, dtype, axis=1, block_size=16, method="minmax")
    _, expected_scale, expected_zero_point = jq.dynamic_quantize_linear(
        W, dtype=dtype, axis=1, block_size=16)
    np.testing.assert_array_equal(scale, expected_scale)
    np.testing.assert_array_equal(zero_point, expected_zero_point)


def test_percentile_of_magnitudes_per_block():
  scale, _ = jq.choose_qparams(W, jnp.int8, axis=0, method="percentile", percentile=90.0)
  expected = np.percentile(np.abs(W), 90.0, axis=1) / 127
  np.testing.assert_allclose(scale, expected, rtol=1e-6)


@pytest.mark.parametrize("x, percentile, expected", [
    ([1.0, 2.0, 3.0, np.inf], 99.0, np.inf),       # interpolated towards an infinity
    ([1.0, np.inf, np.inf, np.inf], 50.0, np.inf),  # between two
    ([1.0, 2.0, 3.0, np.inf], 100.0, 1.0),          # exactly on one: inf * 0 reads as 0
])
def test_percentile_of_an_infinity(x, percentile, expected):
  # nan_to_num made an infinite percentile float32's max: scale 2.68e36, where
  # every finite x quantizes to 0 (absmax gives inf).
  scale, _ = jq.choose_qparams(np.array(x, np.float32), jnp.int8, method="percentile",
                               percentile=percentile)
  assert float(scale) == expected


def test_mse_picks_the_least_squared_error_ratio_per_block():
  x = W
  scale, _ = jq.choose_qparams(x, jnp.int4, axis=0, method="mse")
  magnitude = np.abs(x).max(axis=1)
  chosen = []
  for row in range(x.shape[0]):
    errors = []
    for ratio in jq._recipes.MSE_CLIP_RATIOS:
      candidate = np.float32(magnitude[row] * np.float32(ratio)) / np.float32(7)
      y = np.asarray(jq.fake_quantize(x[row], candidate, dtype=jnp.int4, axis=None))
      errors.append(((y - x[row]) ** 2).sum())
    best = int(np.argmin(errors))
    chosen.append(best)
    np.testing.assert_allclose(
        scale[row], magnitude[row] * np.float32(jq._recipes.MSE_CLIP_RATIOS[best]) / 7, rtol=1e-6)
  assert max(chosen) > 0  # some row clips: the search did something


@pytest.mark.slow
def test_mse_error_never_above_absmax():
  for dtype in (jnp.int2, jnp.int4, jnp.float8_e4m3fn, jnp.float4_e2m1fn):
    def error(method):
      scale, _ = jq.choose_qparams(W, dtype, axis=1, block_size=16, method=method)
      y = jq.fake_quantize(W, scale, dtype=dtype, axis=1, block_size=16)
      return float(np.sum((np.asarray(y) - W) ** 2))
    assert error("mse") <= error("absmax")


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn,
                                   jnp.float6_e2m3fn, jnp.float6_e3m2fn])
def test_float_dtypes_max_scale(dtype):
  scale, zero_point = jq.choose_qparams(W, dtype, axis=0)
  largest = float(ml_dtypes.finfo(dtype).max)
  np.testing.assert_array_equal(scale, np.abs(W).max(axis=1) / np.float32(largest))
  codes = "float6" in np.dtype(dtype).name
  assert (zero_point is None) == codes
  q = jq.quantize_linear(W, scale, zero_point, axis=0, output_dtype=dtype)
  # The largest magnitude of each row lands on the dtype's largest value.
  y = np.asarray(jq.dequantize_linear(
      q, scale, zero_point, axis=0, packed_dtype=dtype if codes else None))
  np.testing.assert_allclose(np.abs(y).max(axis=1), np.abs(W).max(axis=1), rtol=1e-6)


def test_nan_ignored_zero_and_empty_blocks_get_scale_one():
  x = np.array([[np.nan, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
  for method in ("absmax", "qmax_plus_half", "percentile", "mse", "minmax"):
    scale, _ = jq.choose_qparams(x, jnp.int8, axis=1, block_size=2, method=method)
    assert np.isfinite(scale).all() and (scale > 0).all(), method
    assert scale[0, 1] == scale[1, 0] == scale[1, 1] == 1, method
  scale, _ = jq.choose_qparams(np.zeros((0, 3), np.float32), jnp.int8, axis=1)
  np.testing.assert_array_equal(scale, np.ones(3, np.float32))


def test_jit_vmap_and_one_compilation_per_layout():
  f = jax.jit(lambda x: jq.choose_qparams(x, jnp.int4, axis=0, method="mse"))
  np.testing.assert_array_equal(f(W)[0], jq.choose_qparams(W, jnp.int4, axis=0, method="mse")[0])
  batched = jax.vmap(lambda x: jq.choose_qparams(x, jnp.int8)[0])(W)
  np.testing.assert_array_equal(batched, jq.choose_qparams(W, jnp.int8, axis=0)[0])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dtype=jnp.float8_e4m3fn, method="minmax"), ValueError, "method"),
    (dict(dtype=jnp.float4_e2m1fn, method="qmax_plus_half"), ValueError, "method"),
    (dict(method="max"), ValueError, "method"),
    (dict(clip_ratio=0.0), ValueError, "clip_ratio"),
    (dict(clip_ratio=1.5), ValueError, "clip_ratio"),
    (dict(method="minmax", clip_ratio=0.9), ValueError, "clip_ratio"),
    (dict(percentile=101.0), ValueError, "percentile"),
    (dict(dtype=jnp.int32), TypeError, "dtype"),
    (dict(dtype=jnp.float32), TypeError, "dtype"),
    (dict(axis=None, block_size=4), ValueError, "block_size"),
    (dict(axis=2), ValueError, "axis"),
    (dict(method=None), ValueError, "method"),
    (dict(metod="mse"), TypeError, "method"),
])
def test_errors_name_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    jq.choose_qparams(W, **kwargs)


def test_integer_input_refused():
  with pytest.raises(TypeError, match="x.dtype"):
    jq.choose_qparams(np.ones((2, 2), np.int32))
