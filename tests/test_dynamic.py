"""dynamic_quantize_linear: ONNX DynamicQuantizeLinear bit for bit, and its extensions.

uint8 per tensor is checked against onnxruntime and onnx.reference (neither
written here). Everything ONNX has no operator for (int8, which is DirectML's,
the other integer dtypes, per-axis, per-block and symmetric) is checked against
the documented formula (docs/numerics.md, "dynamic_quantize_linear") written out
below in float32 NumPy, one slice at a time. The oracle deviations D1-D4 are listed
there too. Each check runs on every implementation (``quant_testing.IMPLEMENTATIONS``;
the randomized ones draw fewer examples for Pallas, which runs in interpret mode on CPU).
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from onnx import helper
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
import onnxruntime
import pytest

import jaxquant as jq
from jaxquant import _dynamic
from quant_testing import assert_bits_equal
from quant_testing import assert_vmap_is_a_loop
from quant_testing import dtype_name
from quant_testing import expand_scale
from quant_testing import given_per_implementation
from quant_testing import IMPLEMENTATIONS
from quant_testing import INTEGER_DTYPES
from quant_testing import INTEGER_DTYPES_32_BITS
from quant_testing import INTEGER_DTYPES_TO_16_BITS
from quant_testing import SIGNED_INTEGER_DTYPES

# 32-bit codes are not exactly representable in float32, so a float32 round
# trip cannot be within scale / 2 there.
ROUND_TRIP_DTYPES = INTEGER_DTYPES_TO_16_BITS
TINY = np.finfo(np.float32).tiny


# --- the documented formula in float32 NumPy --------------------------------------------


def _reference_parameters(x, dtype, symmetric):
  """(scale, zero_point) of one slice: the documented formula, NaNs ignored."""
  info = jnp.iinfo(dtype)
  qmin, qmax = np.float32(info.min), np.float32(info.max)
  x = np.asarray(x, np.float32).ravel()
  x = x[~np.isnan(x)]
  with np.errstate(all="ignore"):
    if symmetric:
      magnitude = np.max(np.abs(x), initial=np.float32(0))
      return (np.float32(1) if magnitude == 0 else magnitude / qmax), 0
    # initial=0 is the "range always holds 0" rule and covers empty slices.
    lo, hi = np.min(x, initial=np.float32(0)), np.max(x, initial=np.float32(0))
    scale = np.float32(1) if hi == lo else (hi - lo) / (qmax - qmin)  # true division
    shifted = qmin - lo / scale
  zero_point = qmax if np.isnan(shifted) else np.rint(np.clip(shifted, qmin, qmax))
  # float32 qmax of a 32-bit type is 2**32 or 2**31: saturate as an integer.
  return np.float32(scale), int(np.clip(int(zero_point), info.min, info.max))


def _reference_quantize(x, scale, zero_point, dtype):
  """saturate(round_half_to_even(x / scale) + zero_point) as int64, NaN -> qmin."""
  info = jnp.iinfo(dtype)
  with np.errstate(all="ignore"):
    rounded = np.rint(np.asarray(x, np.float32) / np.float32(scale))
  # float64 holds every sum with a 32-bit zero point exactly.
  y = np.clip(rounded.astype(np.float64) + zero_point, info.min, info.max)
  return np.where(np.isnan(rounded), info.min, y).astype(np.int64)


def reference_dynamic(x, dtype=jnp.uint8, axis=None, block_size=0, symmetric=False):
  """(y, scale, zero_point) computed slice by slice, in the documented shapes."""
  x = np.asarray(x, np.float32)
  if axis is None:
    scale, zero_point = _reference_parameters(x, dtype, symmetric)
    y = _reference_quantize(x, scale, zero_point, dtype)
    return (y.astype(dtype), np.asarray(scale, np.float32),
            np.asarray(zero_point).astype(dtype))
  axis %= x.ndim
  moved = np.moveaxis(x, axis, -1)
  length = moved.shape[-1]
  y = np.zeros(moved.shape, np.int64)
  if block_size == 0:
    scales, zero_points = np.zeros(length, np.float32), np.zeros(length, np.int64)
    for i in range(length):
      scales[i], zero_points[i] = _reference_parameters(moved[..., i], dtype, symmetric)
      y[..., i] = _reference_quantize(moved[..., i], scales[i], zero_points[i], dtype)
    return np.moveaxis(y, -1, axis).astype(dtype), scales, zero_points.astype(dtype)
  blocks = -(-length // block_size)
  scales = np.zeros(moved.shape[:-1] + (blocks,), np.float32)
  zero_points = np.zeros(scales.shape, np.int64)
  for index in np.ndindex(moved.shape[:-1]):
    for j in range(blocks):
      block = index + (slice(j * block_size, (j + 1) * block_size),)
      scale, zero_point = _reference_parameters(moved[block], dtype, symmetric)
      scales[index + (j,)], zero_points[index + (j,)] = scale, zero_point
      y[block] = _reference_quantize(moved[block], scale, zero_point, dtype)
  return (np.moveaxis(y, -1, axis).astype(dtype), np.moveaxis(scales, -1, axis),
          np.moveaxis(zero_points, -1, axis).astype(dtype))


# --- the ONNX oracles, with DynamicQuantizeLinear's three outputs ------------------------


@functools.cache
def _dynamic_quantize_model():
  # No shape on x, so one model (and one onnxruntime session) serves every rank.
  node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero_point"])
  graph = helper.make_graph(
      [node], "dynamic_quantize_linear",
      [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
      [helper.make_tensor_value_info("y", TensorProto.UINT8, None),
       helper.make_tensor_value_info("scale", TensorProto.FLOAT, None),
       helper.make_tensor_value_info("zero_point", TensorProto.UINT8, None)],
  )
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
  model.ir_version = 11
  return model


@functools.cache
def _onnxruntime_session():
  options = onnxruntime.SessionOptions()
  options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
  return onnxruntime.InferenceSession(
      _dynamic_quantize_model().SerializeToString(), options,
      providers=["CPUExecutionProvider"],
  )


def run_onnxruntime(x):
  return tuple(np.asarray(v) for v in _onnxruntime_session().run(
      None, {"x": np.asarray(x, np.float32)}))


def run_reference(x):
  with np.errstate(all="ignore"):
    outputs = ReferenceEvaluator(_dynamic_quantize_model()).run(
        None, {"x": np.asarray(x, np.float32)})
  return tuple(np.asarray(v) for v in outputs)


def assert_outputs_equal(actual, expected):
  for name, a, e in zip(("y", "scale", "zero_point"), actual, expected):
    try:
      assert_bits_equal(a, e)
    except AssertionError as error:
      raise AssertionError(f"{name} differs: got {np.asarray(a)!r}, expected {e!r}") from error


# --- random inputs ------------------------------------------------------------------------


_MAX_DIM = {0: 1, 1: 16, 2: 8, 3: 5, 4: 4, 5: 3, 6: 3}
KINDS = ("normal", "positive", "negative", "ties", "zero-point-ties", "repeated", "extreme")


@st.composite
def shapes(draw, min_rank=0, max_rank=6):
  rank = draw(st.integers(min_rank, max_rank))
  shape = draw(st.lists(st.integers(1, _MAX_DIM[rank]), min_size=rank, max_size=rank))
  # An empty dimension now and then, not in most examples.
  if rank and draw(st.integers(0, 9)) == 0:
    shape[draw(st.integers(0, rank - 1))] = 0
  return tuple(shape)


def random_values(kind, shape, seed):
  """float32 values of one kind; no subnormal values or scales (see test_subnormal_range)."""
  rng = np.random.default_rng(seed)
  size = int(np.prod(shape))
  magnitude = 10.0 ** rng.integers(-20, 31)
  if kind in ("normal", "positive", "negative"):
    x = rng.standard_normal(size) * magnitude
    x = {"normal": x, "positive": np.abs(x), "negative": -np.abs(x)}[kind]
  elif kind == "ties":
    # scale = 2**e exactly, so x = k * 2**(e - 1) puts x / scale on .5 ties.
    step, m = 2.0 ** rng.integers(-20, 21), int(rng.integers(0, 256))
    x = rng.integers(-2 * m, 2 * (255 - m), size, endpoint=True) * step / 2
    x[:2] = [-m * step, (255 - m) * step][:size]
  elif kind == "zero-point-ties":
    # lo = -(m + 1/2) * scale: the zero point before rounding is a .5 tie.
    step, m = 2.0 ** rng.integers(-20, 21), int(rng.integers(0, 255))
    lo = -(m + 0.5) * step
    x = lo + rng.integers(0, 510, size, endpoint=True) * step / 2
    x[:2] = [lo, lo + 255 * step][:size]
  elif kind == "repeated":
    x = rng.choice(np.array([-1.5, 0.0, 2.25, 2.25]) * magnitude, size)
  else:
    # Huge values overflow hi - lo to inf (an infinite scale). Tiny ones stay
    # above 1e-27 so that even a 32-bit scale (range / 2**32) is a normal float.
    x = rng.choice([3.4e38, -3.4e38, 1e38, -2e37, 1e-27, -1e-27, 0.0, 1.0, -1.0], size)
  x = x.astype(np.float32).reshape(shape)
  # Subnormal values are flushed to zero on XLA's CPU backend: see test_subnormal_range.
  return np.where(np.abs(x) < TINY, np.float32(0), x)


# --- uint8 per tensor: ONNX DynamicQuantizeLinear -----------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_onnx_documentation_example(implementation):
  # The reciprocal trap (docs/numerics.md): a multiply by 1/scale gives 25 for -2.5 instead of 26.
  x = np.array([0, 2, -3, -2.5, 1.34, 0.5], np.float32)
  expected = (np.array([153, 255, 0, 26, 221, 179], np.uint8), np.float32(0.0196078438),
              np.uint8(153))
  assert_outputs_equal(jq.dynamic_quantize_linear(x, implementation=implementation), expected)
  assert_outputs_equal(run_onnxruntime(x), expected)
  assert_outputs_equal(run_reference(x), expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_zero_point_ties_round_half_to_even(implementation):
  # hi - lo = 255 makes the scale exactly 1, so qmin - lo / scale = m + 1/2 is a
  # tie: half to even (0, 2, 2, 128), not half up (1, 2, 3, 128).
  for m, zero_point in [(0, 0), (1, 2), (2, 2), (127, 128)]:
    x = np.array([-(m + 0.5), 254.5 - m, 3.0], np.float32)
    expected = run_onnxruntime(x)
    assert expected[2] == zero_point
    assert_outputs_equal(jq.dynamic_quantize_linear(x, implementation=implementation), expected)
    assert_outputs_equal(run_reference(x), expected)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@given_per_implementation(1.0, 0.1, shape=shapes(), kind=st.sampled_from(KINDS),
                          seed=st.integers(0, 2**32 - 1))
def test_uint8_matches_onnxruntime_and_onnx_reference(implementation, shape, kind, seed):
  x = random_values(kind, shape, seed)
  actual = jq.dynamic_quantize_linear(x, implementation=implementation)
  assert_outputs_equal(actual, run_onnxruntime(x))
  # onnx.reference cannot reduce an empty x and takes scale 1/255 for all
  # zeros (test_onnx_reference_deviations); everywhere else it must agree.
  if np.any(x != 0):
    assert_outputs_equal(actual, run_reference(x))
  assert_outputs_equal(actual, reference_dynamic(x))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_one_ulp_scales_match_onnxruntime(implementation):
  # Ranges where (hi - lo) * (1/255) and (hi - lo) / 255 differ in the last bit.
  rng = np.random.default_rng(7)
  ranges = rng.uniform(0.1, 100, 1000).astype(np.float32)
  ranges = ranges[ranges / np.float32(255) != ranges * (np.float32(1) / np.float32(255))]
  assert ranges.size > 100
  for value in ranges[:5]:
    x = np.array([0.0, value], np.float32)
    assert_outputs_equal(
        jq.dynamic_quantize_linear(x, implementation=implementation),
        run_onnxruntime(x))


# --- degenerate inputs ----------------------------------------------------------------------


# An empty x has nothing for a kernel to do: "pallas" runs XLA's evaluation
# (_dispatch.evaluate), so the empty shapes run once, as "xla".
@pytest.mark.parametrize("shape, implementation", [
    *(((5,), implementation) for implementation in IMPLEMENTATIONS),
    *(((), implementation) for implementation in IMPLEMENTATIONS),
    ((0,), "xla"), ((2, 0, 3), "xla"),
], ids=str)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_name)
def test_all_zeros_and_empty(dtype, shape, implementation):
  x = np.zeros(shape, np.float32)
  y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=dtype, implementation=implementation)
  qmin = jnp.iinfo(dtype).min
  assert_bits_equal(scale, np.float32(1.0))
  assert_bits_equal(zero_point, np.asarray(qmin).astype(dtype))
  assert_bits_equal(y, np.full(shape, qmin).astype(dtype))
  assert_bits_equal(
      jq.dequantize_linear(y, scale, zero_point, implementation=implementation),
      np.zeros(shape, np.float32))
  if dtype == jnp.uint8:
    assert_outputs_equal((y, scale, zero_point), run_onnxruntime(x))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("x", [
    [1.0, np.nan, -2.0], [np.nan, 0.5, 3.0, -1.0], [np.nan, np.nan, np.nan], [np.nan],
    [[np.nan, 4.0], [-1.0, np.nan]],
], ids=str)
def test_nan_is_ignored_by_min_max_and_quantizes_to_qmin(x, implementation):
  x = np.array(x, np.float32)
  y, scale, zero_point = jq.dynamic_quantize_linear(x, implementation=implementation)
  finite = x[~np.isnan(x)]
  expected = reference_dynamic(np.where(np.isnan(x), finite[0] if finite.size else 0, x))
  assert_bits_equal(scale, expected[1])
  assert_bits_equal(zero_point, expected[2])
  assert np.all(np.asarray(y)[np.isnan(x)] == 0)
  assert_outputs_equal((y, scale, zero_point), reference_dynamic(x))
  assert_outputs_equal((y, scale, zero_point), run_onnxruntime(x))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=dtype_name)
def test_nan_other_dtypes(dtype, implementation):
  x = np.array([np.nan, 2.0, -1.0, np.nan, 0.25], np.float32)
  actual = jq.dynamic_quantize_linear(x, dtype=dtype, implementation=implementation)
  assert np.asarray(actual[0])[0] == jnp.iinfo(dtype).min
  assert_outputs_equal(actual, reference_dynamic(x, dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("x", [
    [1.0, np.inf], [-np.inf, 1.0], [np.inf, -np.inf], [np.inf, np.nan, 2.0],
    [3.4e38, -3.4e38], [-3.4e38, 1e38],
], ids=str)
def test_infinities_give_an_infinite_scale(x, implementation):
  x = np.array(x, np.float32)
  actual = jq.dynamic_quantize_linear(x, implementation=implementation)
  assert np.isinf(actual[1])
  assert_outputs_equal(actual, run_onnxruntime(x))
  assert_outputs_equal(actual, reference_dynamic(x))
  if not np.any(np.isnan(x)):
    assert_outputs_equal(actual, run_reference(x))


# The kernel's reductions are the same for every dtype, which enters only the
# parameters and the formula, as in XLA's evaluation: every dtype on "xla", one
# per width on "pallas" (signed and unsigned in turn).
@pytest.mark.parametrize("dtype, implementation", [
    *((dtype, "xla") for dtype in INTEGER_DTYPES),
    *((np.dtype(dtype), "pallas") for dtype in (jnp.int2, jnp.uint4, jnp.int8, jnp.uint8,
                                                jnp.uint16, jnp.int32)),
], ids=str)
def test_infinities_other_dtypes(dtype, implementation):
  for x in ([1.0, np.inf, -2.0], [-np.inf, 1.0], [np.inf, -np.inf, 0.0]):
    x = np.array(x, np.float32)
    assert_outputs_equal(
        jq.dynamic_quantize_linear(x, dtype=dtype, implementation=implementation),
        reference_dynamic(x, dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_onnx_reference_deviations(implementation):
  """D1-D3: onnx.reference departs from the documented formula where onnxruntime does not.

  onnx/reference/ops/op_dynamic_quantize_linear.py: np.max / np.min propagate
  NaN and cannot reduce an empty array, and max == min leaves a range of 1
  (scale 1/255) where onnxruntime's kernel takes scale 1.
  """
  zeros = np.zeros(4, np.float32)
  assert run_reference(zeros)[1] == np.float32(1) / np.float32(255)
  assert run_onnxruntime(zeros)[1] == 1.0
  assert_outputs_equal(
      jq.dynamic_quantize_linear(zeros, implementation=implementation),
      run_onnxruntime(zeros))

  with pytest.raises(Exception, match="zero-size array"):
    run_reference(np.zeros(0, np.float32))

  with_nan = np.array([1.0, np.nan, -2.0], np.float32)
  assert np.isnan(run_reference(with_nan)[1])
  assert run_onnxruntime(with_nan)[1] == np.float32(3) / np.float32(255)
  assert_outputs_equal(
      jq.dynamic_quantize_linear(with_nan, implementation=implementation),
      run_onnxruntime(with_nan))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_onnxruntime_nan_deviation(implementation):
  """onnxruntime ignores a NaN in some positions and not in others.

  Its vectorised min/max (MLAS) drops a NaN at the front but keeps one at the
  end of these 8 elements (also of 1000), and the scale becomes NaN (D4). The
  documented formula ignores every NaN; jaxquant does, wherever it is.
  """
  x = np.array([0.5, -1.0, 2.0, 0.25, -0.75, 1.5, 1.0, np.nan], np.float32)
  assert np.isnan(run_onnxruntime(x)[1])
  assert_outputs_equal(
      jq.dynamic_quantize_linear(x, implementation=implementation),
      reference_dynamic(x))
  # The same values with the NaN first: onnxruntime ignores it too.
  assert_outputs_equal(
      jq.dynamic_quantize_linear(np.roll(x, 1), implementation=implementation),
      run_onnxruntime(np.roll(x, 1)))


@pytest.mark.xfail(jax.default_backend() == "cpu", strict=True, reason=(
    "XLA's CPU backend runs with denormals-are-zero / flush-to-zero: subnormal x "
    "reads as 0 in the min/max and a subnormal scale becomes 0"))
@pytest.mark.parametrize("x", [
    [0.0, 3e-39, 1e-39],
    # Normal values whose range / 255 (7.8e-39) is subnormal: scale 0 instead.
    [1e-36, -1e-36, 5e-37],
], ids=["subnormal x", "subnormal scale"])
def test_subnormal_range(x):
  x = np.array(x, np.float32)
  expected = run_onnxruntime(x)
  assert_outputs_equal(run_reference(x), expected)
  assert_outputs_equal(jq.dynamic_quantize_linear(x), expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("x_dtype", [jnp.float16, jnp.bfloat16], ids=dtype_name)
def test_half_precision_x_is_quantized_in_float32(x_dtype, implementation):
  rng = np.random.default_rng(12)
  x = rng.standard_normal((5, 9)).astype(x_dtype)
  actual = jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0, implementation=implementation)
  assert actual[1].dtype == jnp.float32
  assert_outputs_equal(actual, reference_dynamic(x.astype(np.float32), jnp.int8, axis=0))


# --- other integer dtypes: int8 is DirectML's; ONNX has no operator for them -----------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
# uint8 is test_uint8_matches_onnxruntime_and_onnx_reference's, against this
# formula too, over the same shapes and kinds.
@pytest.mark.parametrize("dtype", [d for d in INTEGER_DTYPES if d != np.uint8], ids=dtype_name)
@given_per_implementation(8, 2, shape=shapes(max_rank=4), kind=st.sampled_from(KINDS),
                          seed=st.integers(0, 2**32 - 1))
def test_integer_dtypes_match_spec_formula(dtype, implementation, shape, kind, seed):
  # No ONNX operator takes DynamicQuantizeLinear to int8 (DirectML's
  # DML_OPERATOR_DYNAMIC_QUANTIZE_LINEAR does), so the oracle is the documented formula.
  x = random_values(kind, shape, seed)
  assert_outputs_equal(jq.dynamic_quantize_linear(x, dtype=dtype, implementation=implementation),
                       reference_dynamic(x, dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_int8_directml_example(implementation):
  # The ONNX example with int8: qmin = -128, so every code moves down by 128.
  x = np.array([0, 2, -3, -2.5, 1.34, 0.5], np.float32)
  y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=jnp.int8,
                                                    implementation=implementation)
  assert y.tolist() == [25, 127, -128, -102, 93, 51]
  assert_bits_equal(scale, np.float32(0.0196078438))
  assert_bits_equal(zero_point, np.int8(25))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES_32_BITS, ids=dtype_name)
def test_32bit_zero_point_saturates(dtype, implementation):
  # All negative: qmin - lo / scale is qmax, which float32 rounds up past the
  # type's maximum; the zero point must saturate, not wrap.
  x = np.array([-3.0, -1.0, -2.5], np.float32)
  actual = jq.dynamic_quantize_linear(x, dtype=dtype, implementation=implementation)
  assert int(actual[2]) == jnp.iinfo(dtype).max
  assert_outputs_equal(actual, reference_dynamic(x, dtype))


# --- per axis, per block, symmetric ---------------------------------------------------------


@st.composite
def granularities(draw):
  """(x shape, axis, block_size, dtype, symmetric) over every documented layout."""
  shape = draw(shapes(min_rank=1, max_rank=4))
  rank = len(shape)
  kind = draw(st.sampled_from(["per-tensor", "per-axis", "blocked"]))
  axis = None if kind == "per-tensor" else draw(st.integers(-rank, rank - 1))
  block_size = draw(st.integers(1, 7)) if kind == "blocked" else 0
  symmetric = draw(st.booleans())
  dtype = draw(st.sampled_from(SIGNED_INTEGER_DTYPES if symmetric else INTEGER_DTYPES))
  return shape, axis, block_size, dtype, symmetric


def _expected_parameter_shape(shape, axis, block_size):
  if axis is None:
    return ()
  if block_size == 0:
    return (shape[axis],)
  return tuple(-(-n // block_size) if d == axis % len(shape) else n
               for d, n in enumerate(shape))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@given_per_implementation(40, 8, layout=granularities(), kind=st.sampled_from(KINDS[:-1]),
                          seed=st.integers(0, 2**32 - 1))
def test_granularity_matches_slice_by_slice_reference(implementation, layout, kind, seed):
  shape, axis, block_size, dtype, symmetric = layout
  x = random_values(kind, shape, seed)
  kwargs = dict(axis=axis, block_size=block_size, symmetric=symmetric)
  y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=dtype, implementation=implementation,
                                                    **kwargs)
  parameter_shape = _expected_parameter_shape(shape, axis, block_size)
  assert scale.shape == zero_point.shape == parameter_shape
  assert scale.dtype == jnp.float32 and zero_point.dtype == dtype and y.shape == shape
  assert_outputs_equal((y, scale, zero_point), reference_dynamic(x, dtype, **kwargs))
  if symmetric:
    assert not np.any(np.asarray(zero_point).astype(np.int64))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@given_per_implementation(40, 8, layout=granularities(), seed=st.integers(0, 2**32 - 1),
                          magnitude=st.integers(-20, 20))
def test_round_trip_within_half_a_step(implementation, layout, seed, magnitude):
  shape, axis, block_size, dtype, symmetric = layout
  hypothesis.assume(dtype in ROUND_TRIP_DTYPES)
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * 10.0**magnitude).astype(np.float32)
  kwargs = dict(axis=axis, block_size=block_size)
  y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=dtype, symmetric=symmetric,
                                                    implementation=implementation, **kwargs)
  # dequantize_linear's axis defaults to 1; per tensor the scale has no axis.
  back = jq.dequantize_linear(y, scale, zero_point, implementation=implementation,
                              **(kwargs if axis is not None else {}))
  full_scale = expand_scale(scale, shape, axis, block_size)
  info = jnp.iinfo(dtype)
  # Half a step, plus float32 rounding of x / scale, of the scale and of the product.
  slack = (info.max - info.min) * 2.0**-20
  error = np.abs(np.asarray(back, np.float64) - x)
  assert np.all(error <= full_scale * (0.5 + slack)), np.max(error / full_scale)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int4], ids=dtype_name)
def test_rank1_per_axis_round_trip(dtype, implementation):
  # For rank-1 x a 1-D scale is the same-rank (element-wise) layout (docs/numerics.md).
  x = np.array([0.3, -1.7, 2.9, 0.0, -0.0, 5.5, -2.25], np.float32)
  y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=dtype, axis=0,
                                                    implementation=implementation)
  assert scale.shape == zero_point.shape == (7,)
  assert_outputs_equal((y, scale, zero_point), reference_dynamic(x, dtype, axis=0))
  back = jq.dequantize_linear(y, scale, zero_point, axis=0, implementation=implementation)
  assert np.all(np.abs(np.asarray(back) - x) <= np.asarray(scale) / 2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_blocked_ragged_last_block(implementation):
  rng = np.random.default_rng(11)
  x = rng.standard_normal((3, 10)).astype(np.float32)
  x[:, 8:] *= 100  # the short last block (2 of 4) gets its own, larger scale
  y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=1, block_size=4,
                                                    implementation=implementation)
  assert scale.shape == zero_point.shape == (3, 3)
  assert_outputs_equal((y, scale, zero_point),
                       reference_dynamic(x, jnp.int8, axis=1, block_size=4))
  assert np.all(np.asarray(scale)[:, 2] > np.asarray(scale)[:, 1])
  back = jq.dequantize_linear(y, scale, zero_point, axis=1, block_size=4,
                              implementation=implementation)
  assert np.all(np.abs(np.asarray(back) - x) <= expand_scale(scale, x.shape, 1, 4) / 2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", SIGNED_INTEGER_DTYPES, ids=dtype_name)
def test_symmetric(dtype, implementation):
  x = np.array([[0.5, -3.0, 1.0], [np.nan, 0.0, 0.0], [2.0, 1.0, -np.inf]], np.float32)
  y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=dtype, axis=0, symmetric=True,
                                                    implementation=implementation)
  qmax = np.float32(jnp.iinfo(dtype).max)
  # Rows: max|x| = 3; all zero or NaN (scale 1); an infinity (scale inf).
  assert_bits_equal(scale, np.array([np.float32(3) / qmax, 1, np.inf], np.float32))
  assert_bits_equal(zero_point, np.zeros(3, dtype))
  assert_outputs_equal((y, scale, zero_point),
                       reference_dynamic(x, dtype, axis=0, symmetric=True))
  assert np.asarray(y).astype(int)[0, 1] == -qmax  # -max|x| maps to -qmax, not qmin


NAN_ANYWHERE_LAYOUTS = {
    "columns": ((64, 1024), 1, 0),       # down columns: XLA:CPU's float min/max (YNNPACK)
    "wide": ((16, 32768 + 3), 1, 0),     # wide rows: integer keys
    "blocks-down": ((64, 80), 0, 4),     # blocks down columns: reduce-window
    "blocks-along": ((64, 1024), 1, 32),  # blocks along rows
    "rows": ((64, 1024), 0, 0),          # along rows: integer keys
    "tensor": ((64, 1024), None, 0),
}
# The paths above are XLA's: every layout and statistic on "xla". The kernel
# reduces its blocks NaN-aware in every layout, so "pallas" runs each layout
# with one statistic, min/max and absmax in turn.
NAN_ANYWHERE_CASES = [
    *((layout, symmetric, "xla") for layout in NAN_ANYWHERE_LAYOUTS for symmetric in (False, True)),
    *((layout, i % 2 == 1, "pallas") for i, layout in enumerate(NAN_ANYWHERE_LAYOUTS)),
]


@pytest.mark.parametrize("layout, symmetric, implementation", NAN_ANYWHERE_CASES, ids=[
    f"{layout}-{'absmax' if symmetric else 'minmax'}-{implementation}"
    for layout, symmetric, implementation in NAN_ANYWHERE_CASES])
def test_nan_anywhere_is_ignored(layout, symmetric, implementation):
  """A NaN right after a column's (block's) extreme, as its last element, and columns
  (blocks) of NaN only. XLA:CPU's float max and min do not propagate a NaN: YNNPACK's
  returned the extreme of the values after the last NaN, a reduce-window of NaNs its
  initial value."""
  shape, axis, block_size = NAN_ANYWHERE_LAYOUTS[layout]
  rng = np.random.default_rng(11)
  x = rng.uniform(-1, 1, shape).astype(np.float32)
  x[0, :] = 5
  x[2, :] = -4
  x[1, :10] = np.nan
  x[-1, 10:20] = np.nan
  x[:, 20] = np.nan
  x[4:8, 21] = np.nan
  dtype = jnp.int8 if symmetric else jnp.uint8
  options = dict(axis=axis, block_size=block_size, symmetric=symmetric)
  got = jax.jit(functools.partial(jq.dynamic_quantize_linear, dtype=dtype,
                                  implementation=implementation, **options))(x)
  assert_outputs_equal(got, reference_dynamic(x, dtype, **options))
  if implementation == "xla":
    scale, zero_point = jax.jit(functools.partial(
        jq.choose_qparams, dtype=dtype, axis=axis, block_size=block_size,
        method="absmax" if symmetric else "minmax"))(x)
    assert_bits_equal(scale, got[1])
    if not symmetric:
      assert_bits_equal(zero_point, got[2])


def test_symmetric_statistics_down_columns():
  """One scale per index of the minor dim (a weight per output feature) reduces down
  columns, as the integer max of the magnitudes' bits: the reference's bits with NaN,
  infinities, -0, ties and extremes, and the derivative of max(-min x, max x, 0), as the
  other layouts have. A subnormal max|x| (column 5), which XLA:CPU's float max would
  flush to 0, is exact too where no NaN is; quantizing by its scale is J1
  (docs/numerics.md): that column is checked on the statistic alone."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((5, 48)).astype(np.float32)
  big, tiny = np.finfo(np.float32).max, np.float32(1e-45)
  x[:, :8] = np.array([
      [np.nan, -np.inf, -0.0, 3, big, tiny, 0, 1],
      [1, 1, -0.0, -3, -big, -tiny, 0, -1],
      [-1, 0, -0.0, 3, 0, 0, 0, 0.5],
      [0, 0, -0.0, -3, 0, 0, 0, -0.5],
      [2, 0, -0.0, 1, 0, 0, 0, 1],
  ], np.float32)
  x[:, -1] = np.nan
  without_nan = x[:, 1:-1]  # a NaN anywhere has every column redone NaN-aware, by a float max
  magnitude = jax.jit(lambda x: _dynamic._max_magnitude(x, (0,))[0])(without_nan)
  assert_bits_equal(magnitude, np.max(np.abs(without_nan), axis=0))
  x = np.delete(x, 5, axis=1)
  quantize = functools.partial(jq.dynamic_quantize_linear, dtype=jnp.int8, axis=1,
                               symmetric=True, implementation="xla")
  assert_outputs_equal(jax.jit(quantize)(x), reference_dynamic(
      x, dtype=jnp.int8, axis=1, symmetric=True))
  finite = np.all(np.isfinite(x), axis=0)

  def scale_sum(x):
    return jnp.sum(jnp.where(finite, quantize(x)[1], 0))

  def by_extremes(x):
    magnitude = jnp.maximum(jnp.maximum(-jnp.min(x, 0), jnp.max(x, 0)), 0)
    return jnp.sum(jnp.where(finite & (magnitude > 0), magnitude / np.float32(127), 0))

  x = np.where(np.isfinite(x), x, 0).astype(np.float32)
  assert_bits_equal(jax.grad(scale_sum)(x), jax.grad(by_extremes)(x))


# The statistics do not see the dtype, which enters only the parameters: int8
# (a negative qmin) on the float path, whose arrays are small.
@pytest.mark.parametrize("dtype, columns", [
    (jnp.uint8, 48), (jnp.uint8, 32768 + 3), (jnp.int8, 48),
], ids=["uint8-float", "uint8-wide keys", "int8-float"])
def test_asymmetric_statistics_down_columns(dtype, columns):
  """Min and max per index of the minor dim: a float min and max (which flush subnormals
  and may swap -0 and +0), or past 32K columns plain reductions of integer keys. The
  reference's outputs either way, with NaN, infinities, signed zeros, a subnormal beside
  normal values, ties and extremes."""
  rng = np.random.default_rng(8)
  x = rng.standard_normal((5, columns)).astype(np.float32)
  big, tiny = np.finfo(np.float32).max, np.float32(1e-45)
  x[:, :9] = np.array([
      [np.nan, -np.inf, -0.0, 0.0, 3, big, -tiny, 0, 1],
      [1, 1, 0.0, -0.0, -3, -big, 5, 0, -1],
      [-1, 0, -0.0, 0.0, 3, 0, 2, np.inf, 0.5],
      [0, 0, 0.0, -0.0, -3, 0, 1, 0, -0.5],
      [2, 0, -0.0, 0.0, 1, 0, tiny, 0, 1],
  ], np.float32)
  quantize = jax.jit(functools.partial(jq.dynamic_quantize_linear, dtype=dtype, axis=1,
                                       implementation="xla"))
  assert_outputs_equal(quantize(x), reference_dynamic(x, dtype=dtype, axis=1))
  x[0, 0] = 0.0  # no NaN: the plain reductions' result is kept
  assert_outputs_equal(quantize(x), reference_dynamic(x, dtype=dtype, axis=1))


# --- NaN-free inputs take the plain reductions, NaN ones the NaN-ignoring pass ----------------
#
# On CPU the statistics come from plain min/max reductions, and only an x
# holding a NaN is reduced again, ignoring NaNs (speed: benchmarks/). These
# check that the fallback is taken per call and is right for every layout.


@pytest.mark.parametrize("kwargs", [
    {}, dict(axis=0), dict(axis=1), dict(axis=1, block_size=6), dict(axis=1, block_size=5),
    dict(axis=0, dtype=jnp.int8, symmetric=True),
    dict(axis=1, block_size=5, dtype=jnp.int8, symmetric=True),
], ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_one_nan_changes_only_its_own_slice(kwargs, implementation):
  rng = np.random.default_rng(5)
  x = rng.standard_normal((6, 48)).astype(np.float32)
  quantize = jax.jit(functools.partial(jq.dynamic_quantize_linear, implementation=implementation,
                                       **kwargs))
  assert_outputs_equal(quantize(x), reference_dynamic(x, **kwargs))
  x[2, 7] = np.nan  # the same compiled program, now with a NaN
  assert_outputs_equal(quantize(x), reference_dynamic(x, **kwargs))
  x[:, :] = np.nan
  assert_outputs_equal(quantize(x), reference_dynamic(x, **kwargs))


# --- transformations --------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, dict(axis=1), dict(axis=1, block_size=4),
                                    dict(dtype=jnp.int8, symmetric=True)],
                         ids=["per-tensor", "per-axis", "blocked", "symmetric"])
@pytest.mark.xla_cpu
def test_vmap_redoes_the_statistics_only_for_examples_with_a_nan(kwargs):
  """On XLA:CPU the statistics are plain reductions, redone NaN-aware where a NaN came
  out. vmap keeps that choice a cond (before: a select running the NaN-aware reductions,
  several times slower, for every example) and each example's own bits: one with a NaN,
  one with infinities, one with neither, and their derivative."""
  rng = np.random.default_rng(5)
  examples = rng.standard_normal((3, 6, 8)).astype(np.float32)
  examples[0, 2, 3] = np.nan
  examples[1, 4, 1], examples[1, 0, 7] = np.inf, -np.inf
  quantize = functools.partial(jq.dynamic_quantize_linear, implementation="xla", **kwargs)
  fake = jax.grad(lambda x: jnp.sum(jnp.nan_to_num(jq.fake_quantize_dynamic(
      x, **{k: v for k, v in kwargs.items() if k != "symmetric"}) * x)))
  for function in (quantize, fake):
    assert_vmap_is_a_loop(function, [[example] for example in examples], [0])
  compiled = jax.jit(jax.vmap(quantize)).lower(examples).compile().as_text()
  assert " conditional(" in compiled
  nested = jax.jit(jax.vmap(jax.vmap(quantize))).lower(examples[None]).compile().as_text()
  assert " conditional(" in nested
  # Differentiated outside vmap: JAX guarded a batched cond's tangent operands with
  # stop_gradient, which has no transpose (grad of vmap raised NotImplementedError,
  # transposing while tracing, under jit too). Under jit, as a model differentiates:
  # eagerly each batched primitive compiles on its own, seconds per layout.
  scale = lambda x: quantize(x)[1].sum()
  assert_outputs_equal(jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(scale)(x))))(examples),
                       jax.jit(jax.vmap(jax.grad(scale)))(examples))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_vmap_and_no_retrace(implementation):
  rng = np.random.default_rng(3)
  batch = rng.standard_normal((4, 6, 10)).astype(np.float32)
  for kwargs in [{}, dict(axis=1), dict(axis=1, block_size=4),
                 dict(axis=0, dtype=jnp.int8, symmetric=True)]:
    quantize = functools.partial(jq.dynamic_quantize_linear, implementation=implementation,
                                 **kwargs)
    mapped = jax.vmap(quantize)(batch)
    jitted = jax.jit(quantize)
    for i in range(batch.shape[0]):
      expected = reference_dynamic(batch[i], **kwargs)
      assert_outputs_equal([m[i] for m in mapped], expected)
      assert_outputs_equal(jitted(batch[i]), expected)

  traces = []

  @jax.jit
  def model(x):
    traces.append(None)
    y, scale, zero_point = jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=1, block_size=4,
                                                      implementation=implementation)
    return jq.dequantize_linear(y, scale, zero_point, axis=1, block_size=4,
                                implementation=implementation)

  for i in range(3):
    model(batch[i])
  assert len(traces) == 1
  before = jq.dynamic_quantize_linear._cache_size()
  for i in range(3):
    jq.dynamic_quantize_linear(batch[i] * (i + 1), axis=0, implementation=implementation)
  assert jq.dynamic_quantize_linear._cache_size() <= before + 1


# --- errors --------------------------------------------------------------------------------


X = np.ones((4, 6), np.float32)


def test_symmetric_uint8_is_a_value_error():
  message = r"dtype must be a signed integer dtype when symmetric=True, got uint8"
  with pytest.raises(ValueError, match=message):
    jq.dynamic_quantize_linear(X, dtype=jnp.uint8, symmetric=True)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn],
                         ids=dtype_name)
def test_float8_dtype_is_a_type_error(dtype):
  with pytest.raises(TypeError, match=r"dtype must be an integer quantized dtype, got float[48]_"):
    jq.dynamic_quantize_linear(X, dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.int64], ids=dtype_name)
def test_non_quantized_dtype_is_a_type_error(dtype):
  with pytest.raises(TypeError, match=r"dtype must be one of the quantized dtypes"):
    jq.dynamic_quantize_linear(X, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.bool_], ids=dtype_name)
def test_integer_x_is_a_type_error(dtype):
  with pytest.raises(TypeError, match=r"x\.dtype must be a float dtype.*got (int|uint|bool)"):
    jq.dynamic_quantize_linear(X.astype(dtype))


@pytest.mark.parametrize("axis", [2, -3, 7])
def test_axis_out_of_range(axis):
  message = rf"dynamic_quantize_linear: axis must be an int .*got {axis}\."
  with pytest.raises(ValueError, match=message):
    jq.dynamic_quantize_linear(X, axis=axis)


def test_axis_for_a_scalar():
  with pytest.raises(ValueError, match=r"dynamic_quantize_linear: axis must be an int .*got 0\."):
    jq.dynamic_quantize_linear(np.float32(1.0), axis=0)


def test_block_size_without_axis():
  message = r"dynamic_quantize_linear: block_size must be 0 when axis is None.*got 2\."
  with pytest.raises(ValueError, match=message):
    jq.dynamic_quantize_linear(X, block_size=2)


def test_negative_block_size():
  with pytest.raises(ValueError, match=r"dynamic_quantize_linear: block_size must be .*got -2\."):
    jq.dynamic_quantize_linear(X, axis=1, block_size=-2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_closed_over_constant_keeps_true_division(implementation):
  # A quotient of exactly -127.5 became -127.49999 when x was closed over (XLA
  # folded the division's NaN guard and multiplied by the reciprocal); found by
  # benchmarks/kernels.py, and this is the data that showed it.
  rng = np.random.default_rng(0)
  for _ in range(3):  # the draws before x in benchmarks/kernels.py's first version
    rng.integers(-8, 128, (16, 4096))
  x = jnp.asarray(rng.normal(size=(16, 4096)), jnp.bfloat16)
  eager = jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0, implementation=implementation)
  folded = jax.jit(lambda: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0,
                                                      implementation=implementation))()
  np.testing.assert_array_equal(np.asarray(folded[0]), np.asarray(eager[0]))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("axis", [None, 1])
def test_empty_symmetric_gives_scale_one(axis, implementation):
  # max|x| of nothing is 0: found by the fake_quantize_dynamic property test.
  y, scale, zero_point = jq.dynamic_quantize_linear(
      jnp.zeros((0, 3)), dtype=jnp.int8, symmetric=True, axis=axis, implementation=implementation)
  assert y.shape == (0, 3)
  np.testing.assert_array_equal(scale, np.ones(() if axis is None else 3))
  np.testing.assert_array_equal(zero_point, np.zeros(() if axis is None else 3))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("options", [{}, {"axis": 0}, {"axis": 1, "block_size": 4},
                                     {"axis": 0, "dtype": jnp.int8, "symmetric": True}],
                         ids=["per-tensor", "per-axis", "blocked", "symmetric"])
def test_float64_outputs_feed_back_in_under_x64(options, implementation):
  # Under x64 a float64 x gave a float64 scale, which every other op refused.
  layout = {k: v for k, v in options.items() if k in ("axis", "block_size")}
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)) * 3)
    y, scale, zero_point = jq.dynamic_quantize_linear(
        x, implementation=implementation, **options)
    assert scale.dtype == jnp.float32
    np.testing.assert_array_equal(jq.quantize_linear(x, scale, zero_point, **layout), y)
    dequantized = jq.dequantize_linear(y, scale, zero_point, **layout)
    fake_options = {"dtype": jnp.uint8, **options}
    fake = jq.fake_quantize_dynamic(x, **fake_options)
    assert fake.dtype == jnp.float64
    np.testing.assert_array_equal(fake, dequantized.astype(jnp.float64))
