"""choose_qparams: each recipe's formula, layouts, dtypes, and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from quant_testing import MSE_CLIP_RATIOS
from quant_testing import spec_fake_quantize

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


def _param_blocks(x, axis, block_size):
  """x's elements per scale, in the scales' layout: a dict index -> 1-D block, and the shape."""
  if not block_size:
    return {(i,): np.take(x, i, axis).ravel() for i in range(x.shape[axis])}, (x.shape[axis],)
  moved = np.moveaxis(x, axis, -1)
  shape = moved.shape[:-1] + (-(-moved.shape[-1] // block_size),)
  blocks = {}
  for index in np.ndindex(shape):
    start = index[-1] * block_size
    blocks[index] = moved[index[:-1]][start:start + block_size]
  return blocks, shape


def _reference_scales(x, dtype, axis, block_size, method, clip_ratio=1.0, percentile=99.99):
  """choose_qparams' scale as its docstring states it, block by block in NumPy (NaNs ignored)."""
  qmax = np.float32(ml_dtypes.iinfo(dtype).max)
  blocks, shape = _param_blocks(x, axis, block_size)
  scales = np.empty(shape, np.float32)
  for index, block in blocks.items():
    values = block[~np.isnan(block)]
    if method == "percentile":
      magnitude = np.float32(np.percentile(np.abs(values), percentile)) if values.size else 0
      scales[index] = magnitude / qmax if magnitude else 1
      continue
    magnitude = np.abs(values).max(initial=0) * np.float32(clip_ratio)
    errors, candidates = [], []
    for ratio in MSE_CLIP_RATIOS:
      clip = np.float32(magnitude * ratio)
      scale = clip / qmax if clip else np.float32(1)
      y = spec_fake_quantize(values, scale, None, np.dtype(dtype), None, 0)
      errors.append(np.sum((y - values) ** 2))
      candidates.append(scale)
    scales[index] = candidates[int(np.argmin(errors))]  # the first of equal errors
  return scales if not block_size else np.moveaxis(scales, -1, axis)


# A NaN, an outlier (the search clips it), a ragged last block along both axes.
X_EDGES = W.copy()
X_EDGES[1, 5] = np.nan
X_EDGES[2, 40] *= 8


@pytest.mark.parametrize("dtype, axis, block_size, method, options", [
    (jnp.int4, 1, 32, "mse", {}),
    (jnp.int4, 1, 32, "mse", dict(clip_ratio=0.9)),
    (jnp.int2, 0, 4, "mse", {}),
    (jnp.int4, 1, 0, "mse", {}),
    (jnp.int8, 1, 32, "percentile", dict(percentile=90.0)),
    (jnp.int8, 0, 4, "percentile", dict(percentile=50.0)),
    (jnp.int8, 1, 0, "percentile", dict(percentile=90.0)),
], ids=lambda v: str(v) if not isinstance(v, type) else np.dtype(v).name)
def test_mse_and_percentile_match_the_documented_recipe_per_block(
    dtype, axis, block_size, method, options):
  """Per index of either axis and in blocks (the last ragged), NaNs ignored, clip_ratio
  applied: ragged blocks, per-column layouts and NaNs each reached only the MSE search
  or the percentile of an existing test's per-row layout before."""
  scale, _ = jq.choose_qparams(X_EDGES, dtype, axis=axis, block_size=block_size,
                               method=method, **options)
  expected = _reference_scales(X_EDGES, dtype, axis, block_size, method, **options)
  assert scale.shape == expected.shape
  np.testing.assert_allclose(scale, expected, rtol=1e-6)


def test_mse_searches_down_to_a_fifth_and_keeps_the_first_of_equal_errors():
  # A hundred values at a fifth of the largest: clipping it to them is best, at the last ratio.
  x = np.array([1.0] + [0.2] * 100, np.float32)
  assert float(jq.choose_qparams(x, jnp.int2, method="mse")[0]) == np.float32(0.2)
  # int2 reaches -2: -1 is exact at ratio 1 (scale 1) and at 0.5 (scale 0.5, code -2).
  # The first wins, so an exact absmax stays absmax.
  x = np.array([-1.0, 0.0], np.float32)
  assert float(jq.choose_qparams(x, jnp.int2, method="mse")[0]) == 1.0


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.uint16])
def test_sixteen_bit_integers_are_the_widest_accepted(dtype):
  scale, zero_point = jq.choose_qparams(W, dtype, axis=0)
  np.testing.assert_array_equal(
      scale, np.abs(W).max(axis=1) / np.float32(ml_dtypes.iinfo(dtype).max))
  assert zero_point.dtype == dtype
  scale, zero_point = jq.choose_qparams(W, dtype, method="minmax")
  _, expected_scale, expected_zero_point = jq.dynamic_quantize_linear(W, dtype=dtype)
  assert scale == expected_scale and zero_point == expected_zero_point


def test_empty_blocks_get_scale_one_by_every_method():
  for method in ("absmax", "qmax_plus_half", "percentile", "mse", "minmax"):
    scale, _ = jq.choose_qparams(np.zeros((0, 3), np.float32), jnp.int8, axis=1, method=method)
    np.testing.assert_array_equal(scale, np.ones(3, np.float32), err_msg=method)


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
    (dict(percentile=0.0), ValueError, "percentile"),
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
