"""quantized_add: DirectML's quantized add, onnxruntime's QLinearAdd (docs/numerics.md).

The oracles: onnxruntime's own QLinearAdd test vectors, onnxruntime's
com.microsoft QLinearAdd kernel (which folds the output zero point in before
rounding and scales by ratios of the scales, so it may differ by one at and near
ties: A1 and A2 in docs/numerics.md, "Oracle deviations"), and the documented
formula written out below in float32 NumPy for everything onnxruntime does not
take (mixed and non-8-bit dtypes, non-finite scales). Each check runs on every implementation
(``quant_testing.IMPLEMENTATIONS``; Pallas, in interpret mode on CPU, on fewer
random shapes), except the compiled-HLO checks of XLA's fusion.
"""

import itertools
import json
from pathlib import Path
import re
import zlib

from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import onnx_oracle
from quant_testing import assert_bits_equal
from quant_testing import dtype_name
from quant_testing import entry_work
from quant_testing import given_per_implementation
from quant_testing import IMPLEMENTATIONS

CONFORMANCE = Path(__file__).resolve().parent / "data" / "qlinear_add_cases.json"
EIGHT_BIT = [jnp.int8, jnp.uint8]


def reference_add(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_scale,
                  out_zero_point, out_dtype):
  """The documented formula in float32 NumPy: round half to even, then add the output zero point."""
  info = jnp.iinfo(out_dtype)
  to_float = lambda q, scale, zero_point: (
      (np.asarray(q).astype(np.int64) - int(zero_point)).astype(np.float32)
      * np.asarray(scale).astype(np.float32))
  with np.errstate(all="ignore"):
    total = to_float(a, a_scale, a_zero_point) + to_float(b, b_scale, b_zero_point)
    rounded = np.rint(total / np.asarray(out_scale).astype(np.float32))
  y = np.clip(rounded.astype(np.float64) + int(out_zero_point), info.min, info.max)
  return np.where(np.isnan(rounded), info.min, y).astype(np.int64).astype(out_dtype)


def _random_operand(rng, dtype, shape):
  info = jnp.iinfo(dtype)
  return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def _random_zero_point(rng, dtype):
  return _random_operand(rng, dtype, ())


def _random_scale(rng):
  # Log-uniform over four decades: the ratios of scales, not their size, matter.
  return np.float32(10.0 ** rng.uniform(-3.5, 0.5))


def _broadcastable_shapes(rng, max_rank=4, max_dim=6):
  """Two random shapes that broadcast NumPy-style (size-1 dims and missing leading dims)."""
  rank = int(rng.integers(0, max_rank + 1))
  full = rng.integers(1, max_dim + 1, rank)
  shapes = []
  for _ in range(2):
    shape = [1 if rng.random() < 0.3 else int(n) for n in full]
    shapes.append(tuple(shape[int(rng.integers(0, rank + 1)):]))
  return shapes


# --- onnxruntime's QLinearAdd test vectors ---------------------------------------------------


def _conformance_cases():
  if not CONFORMANCE.exists():
    return [pytest.param(None, id="qlinear_add_cases.json-missing")]
  cases = json.loads(CONFORMANCE.read_text())["cases"]
  return [pytest.param(case, id=case["name"]) for case in cases]


def test_conformance_file_has_all_twelve_cases():
  assert CONFORMANCE.exists(), f"missing conformance vectors: {CONFORMANCE}"
  assert len(_conformance_cases()) == 12


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", _conformance_cases())
def test_onnxruntime_qlinear_add_vectors(case, implementation):
  if case is None:
    pytest.fail(f"missing conformance vectors: {CONFORMANCE}")
  dtype = np.dtype(case["dataType"])
  operand = lambda name: np.array(case[name]["values"], dtype).reshape(case[name]["shape"])
  zero_point = lambda name: np.array(case[name], dtype)
  y = jq.quantized_add(
      operand("A"), np.float32(case["A_scale"]), zero_point("A_zero_point"),
      operand("B"), np.float32(case["B_scale"]), zero_point("B_zero_point"),
      np.float32(case["C_scale"]), zero_point("C_zero_point"), implementation=implementation,
  )
  assert_bits_equal(y, operand("expected"))


# --- onnxruntime's com.microsoft QLinearAdd kernel ---------------------------------------------


def run_qlinear_add(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_scale,
                    out_zero_point):
  inputs = dict(A=a, A_scale=a_scale, A_zero_point=a_zero_point, B=b, B_scale=b_scale,
                B_zero_point=b_zero_point, C_scale=out_scale, C_zero_point=out_zero_point)
  inputs = {name: np.asarray(value) for name, value in inputs.items()}
  return onnx_oracle.run_onnxruntime("QLinearAdd", inputs, inputs["A"].dtype,
                                     domain="com.microsoft")


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_matches_onnxruntime_qlinear_add_within_one(implementation):
  """Random data, scales, zero points and broadcast shapes against onnxruntime.

  onnxruntime adds the output zero point before rounding, so it may differ by
  one where the quotient is an exact .5 tie (rare with random float scales), and
  its scale ratios move a few quotients within an ulp or two of a tie (A2).
  """
  rng = np.random.default_rng(2024)
  configurations = [_broadcastable_shapes(rng) for _ in range(40)]
  if implementation == "pallas":
    # Each new shape is a new interpret-mode kernel: a fifth of the small ones.
    configurations = configurations[:8]
  # A few large ones, so that the mismatch rate is measured on 10**6 elements.
  configurations += [[(256, 512), (256, 512)], [(64, 1, 128), (1, 32, 128)],
                     [(100_000,), ()], [(), (3, 50_000)], [(512, 1024), (1024,)]]
  mismatches = total = 0
  for i, (a_shape, b_shape) in enumerate(configurations):
    dtype = EIGHT_BIT[i % 2]
    args = (_random_operand(rng, dtype, a_shape), _random_scale(rng),
            _random_zero_point(rng, dtype), _random_operand(rng, dtype, b_shape),
            _random_scale(rng), _random_zero_point(rng, dtype), _random_scale(rng),
            _random_zero_point(rng, dtype))
    actual = np.asarray(jq.quantized_add(*args, implementation=implementation))
    expected = run_qlinear_add(*args)
    assert actual.shape == expected.shape == np.broadcast_shapes(a_shape, b_shape)
    assert actual.dtype == dtype
    difference = np.abs(actual.astype(np.int64) - expected)
    assert difference.max(initial=0) <= 1, (a_shape, b_shape, args[1::3])
    mismatches += int(np.count_nonzero(difference))
    total += difference.size
  assert total > 1_000_000
  # Measured with jax 0.10.2 and onnxruntime 1.31.1: 0 of 1,167,712 elements differ.
  assert mismatches * 10_000 < total, f"{mismatches} / {total} differ from onnxruntime"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_tie_rounds_before_adding_the_zero_point(implementation):
  a = np.array([1, 3, 5, -1, -3, -5, 7], np.int8)
  args = (a, np.float32(1), np.int8(0), np.int8(0), np.float32(1), np.int8(0),
          np.float32(2), np.int8(1))
  # (a / 2) rounds half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, ... then + 1.
  expected = np.array([1, 3, 3, 1, -1, -1, 5], np.int8)
  assert_bits_equal(jq.quantized_add(*args, implementation=implementation), expected)
  assert_bits_equal(reference_add(*args, np.int8), expected)
  # onnxruntime rounds a / 2 + 1 instead: one off at every tie with an odd zero point.
  assert_bits_equal(run_qlinear_add(*args), np.array([2, 2, 4, 0, 0, -2, 4], np.int8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_onnxruntime_ties_differ_by_exactly_one(implementation):
  # Power-of-two scales put a quarter of the sums on ties; with an odd output
  # zero point onnxruntime's order of operations moves each of them by one.
  rng = np.random.default_rng(5)
  for dtype in EIGHT_BIT:
    a, b = _random_operand(rng, dtype, 4096), _random_operand(rng, dtype, 4096)
    args = (a, np.float32(0.25), np.array(3, dtype), b, np.float32(0.5), np.array(5, dtype),
            np.float32(1.0), np.array(7, dtype))
    actual = np.asarray(jq.quantized_add(*args, implementation=implementation)).astype(np.int64)
    assert_bits_equal(actual.astype(dtype), reference_add(*args, dtype))
    difference = actual - run_qlinear_add(*args)
    assert set(np.unique(difference)) <= {-1, 0, 1}
    assert np.count_nonzero(difference) > 100


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [1, 64])  # its tail path, and its vector loop
def test_a2_onnxruntime_scales_by_ratios_near_ties(size, implementation):
  """A2: onnxruntime's x86 kernel multiplies by a_scale / out_scale and b_scale /
  out_scale instead of dividing the sum, and so rounds differently near a tie,
  with an output zero point of 0 too: the sum / out_scale is 106.499954 here
  (106), its ratios give 106.5 or more, and it returns 107."""
  a, b = np.full(size, 111, np.uint8), np.full(size, 144, np.uint8)
  args = (a, np.float32(0.16684815), np.uint8(252), b, np.float32(0.17479742), np.uint8(3),
          np.float32(0.010524378), np.uint8(0))
  expected = np.full(size, 106, np.uint8)
  assert_bits_equal(reference_add(*args, np.uint8), expected)
  assert_bits_equal(jq.quantized_add(*args, implementation=implementation), expected)
  assert_bits_equal(run_qlinear_add(*args), expected + 1)


# --- dtypes (a, b and the output may each be int8 or uint8, and more) -----------------------


# The 8-bit triples with an even number of uint8: any two of a, b and the output still
# meet in all four int8/uint8 pairs. All uint8 is onnxruntime's own case, bit for bit in
# test_onnxruntime_qlinear_add_vectors and on random data in
# test_matches_onnxruntime_qlinear_add_within_one.
EIGHT_BIT_PAIRWISE = [dtypes for dtypes in itertools.product(EIGHT_BIT, repeat=3)
                      if sum(dtype == jnp.uint8 for dtype in dtypes) % 2 == 0]


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("a_dtype, b_dtype, out_dtype",
                         EIGHT_BIT_PAIRWISE + [
                             (jnp.int4, jnp.int4, jnp.int4), (jnp.uint4, jnp.int4, jnp.uint8),
                             (jnp.int16, jnp.int16, jnp.int16), (jnp.int8, jnp.int16, jnp.int4),
                             (jnp.uint16, jnp.uint8, jnp.int16), (jnp.int4, jnp.uint16, jnp.uint4),
                         ], ids=lambda d: dtype_name(d))
def test_mixed_dtypes_match_spec_formula(a_dtype, b_dtype, out_dtype, implementation):
  # A seed of the dtype names: str hashes change from run to run.
  names = "".join(dtype_name(d) for d in (a_dtype, b_dtype, out_dtype))
  rng = np.random.default_rng(zlib.crc32(names.encode()))
  for _ in range(3):
    a_shape, b_shape = _broadcastable_shapes(rng)
    args = (_random_operand(rng, a_dtype, a_shape), _random_scale(rng),
            _random_zero_point(rng, a_dtype), _random_operand(rng, b_dtype, b_shape),
            _random_scale(rng), _random_zero_point(rng, b_dtype), _random_scale(rng),
            _random_zero_point(rng, out_dtype))
    assert_bits_equal(jq.quantized_add(*args, implementation=implementation),
                      reference_add(*args, out_dtype))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@given_per_implementation(
    40, 8,
    dtypes=st.tuples(*[st.sampled_from([jnp.int8, jnp.uint8, jnp.int4, jnp.int16])] * 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_shapes_and_dtypes_match_spec_formula(implementation, dtypes, seed):
  rng = np.random.default_rng(seed)
  a_dtype, b_dtype, out_dtype = dtypes
  a_shape, b_shape = _broadcastable_shapes(rng, max_rank=5, max_dim=4)
  args = (_random_operand(rng, a_dtype, a_shape), _random_scale(rng),
          _random_zero_point(rng, a_dtype), _random_operand(rng, b_dtype, b_shape),
          _random_scale(rng), _random_zero_point(rng, b_dtype), _random_scale(rng),
          _random_zero_point(rng, out_dtype))
  assert_bits_equal(jq.quantized_add(*args, implementation=implementation),
                    reference_add(*args, out_dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16], ids=dtype_name)
def test_half_precision_scales_are_used_in_float32(scale_dtype, implementation):
  rng = np.random.default_rng(9)
  a, b = _random_operand(rng, np.int8, 500), _random_operand(rng, np.int8, 500)
  scales = [np.asarray(s, scale_dtype) for s in (0.0123, 0.0456, 0.0789)]
  args = (a, scales[0], np.int8(3), b, scales[1], np.int8(-7), scales[2], np.int8(1))
  assert_bits_equal(jq.quantized_add(*args, implementation=implementation),
                    reference_add(*args, np.int8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_output_dtype_resolution(implementation):
  a, b = np.array([10, 20], np.int8), np.array([1, 2], np.uint8)
  add = lambda out_zero_point, **kwargs: jq.quantized_add(
      a, 1.0, None, b, 1.0, None, 1.0, out_zero_point, implementation=implementation, **kwargs)
  # out_zero_point's dtype, else output_dtype, else a's dtype.
  assert add(np.uint8(5)).dtype == jnp.uint8
  assert add(np.uint8(5), output_dtype=jnp.uint8).dtype == jnp.uint8
  assert add(None, output_dtype=jnp.int16).dtype == jnp.int16
  assert add(None).dtype == jnp.int8
  # A Python number has no dtype of its own.
  assert add(5).dtype == jnp.int8
  assert add(5, output_dtype=jnp.uint4).tolist() == [15, 15]
  assert add(np.uint8(5)).tolist() == [16, 27]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_none_zero_points_mean_zero(implementation):
  rng = np.random.default_rng(4)
  a, b = _random_operand(rng, np.int8, 300), _random_operand(rng, np.int8, 300)
  zero = np.int8(0)
  with_zeros = jq.quantized_add(a, 0.02, zero, b, 0.03, zero, 0.04, zero,
                                implementation=implementation)
  assert_bits_equal(jq.quantized_add(a, 0.02, None, b, 0.03, None, 0.04,
                                     implementation=implementation), with_zeros)
  assert_bits_equal(jq.quantized_add(a, 0.02, None, b, 0.03, zero, 0.04, None,
                                     implementation=implementation), with_zeros)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("a_shape, b_shape", [
    ((), ()), ((), (4,)), ((3, 1), ()), ((0,), ()), ((0, 3), (3,)), ((2, 0), (1,)),
    ((2, 1, 3), (4, 1)), ((1,), (5,)), ((5,), (1, 1, 1)),
], ids=str)
def test_broadcasting(a_shape, b_shape, implementation):
  rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape))
  args = (_random_operand(rng, np.uint8, a_shape), np.float32(0.05), np.uint8(128),
          _random_operand(rng, np.int8, b_shape), np.float32(0.07), np.int8(-3),
          np.float32(0.1), np.int8(2))
  y = jq.quantized_add(*args, implementation=implementation)
  assert y.shape == np.broadcast_shapes(a_shape, b_shape)
  assert_bits_equal(y, reference_add(*args, np.int8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_non_finite_values_follow_quantize_linear(implementation):
  a = np.array([5, 0, -5, 5, 0, 1], np.int8)
  b = np.array([0, 0, 0, -5, 0, 0], np.int8)
  zero = np.int8(0)
  qmin, qmax = -128, 127
  inf, nan = np.float32(np.inf), np.float32(np.nan)
  cases = [
      # a_scale inf: +inf -> max, 0 * inf = NaN -> min, -inf -> min.
      ((a, inf, zero, b, 1.0, zero, 1.0, np.int8(3)), [qmax, qmin, qmin, qmax, qmin, qmax]),
      # inf + inf = inf, -inf + -inf = -inf, inf - inf = NaN -> min.
      ((a, inf, zero, np.int8([1, 1, -1, -5, 1, -1]), inf, zero, 1.0, zero),
       [qmax, qmin, qmin, qmin, qmin, qmin]),
      # out_scale 0: sign picks the end, 0 / 0 -> min.
      ((a, 1.0, zero, b, 1.0, zero, 0.0, zero), [qmax, qmin, qmin, qmin, qmin, qmax]),
      # out_scale inf: finite sums quantize to the zero point.
      ((a, 1.0, zero, b, 1.0, zero, inf, np.int8(9)), [9] * 6),
      # NaN scales: everything is the minimum.
      ((a, nan, zero, b, 1.0, zero, 1.0, np.int8(9)), [qmin] * 6),
      ((a, 1.0, zero, b, 1.0, zero, nan, np.int8(9)), [qmin] * 6),
  ]
  for args, expected in cases:
    y = jq.quantized_add(*args, implementation=implementation)
    assert y.tolist() == expected, args
    assert_bits_equal(y, reference_add(*args, np.int8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unsigned_non_finite_minimum_is_zero(implementation):
  y = jq.quantized_add(np.uint8([3, 0]), np.float32(np.nan), None, np.uint8([1, 1]), 1.0,
                       None, 1.0, np.uint8(200), implementation=implementation)
  assert y.tolist() == [0, 0]


# --- one fused pass ---------------------------------------------------------------------------


def _assert_one_fusion(fn, *args):
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  work = entry_work(hlo)
  assert [op for op, _, _ in work] == ["fusion"], work
  (_, result, operands), = work
  # Its operands are the parameters themselves: no broadcast or convert ran
  # before it, and nothing of the output's size was materialised on the way.
  # (A scalar constant may be passed in: jax 0.11 removes the division
  # guard's scalar barrier only after fusion.)
  entry = hlo.split("ENTRY", 1)[1]
  parameters = re.findall(r"%?([\w.\-]+) = \S+ parameter\(", entry)
  scalars = re.findall(r"%?([\w.\-]+) = \w+\[\] constant\(", entry)
  assert {o.strip().lstrip("%") for o in operands.split(",")} <= {*parameters, *scalars}, operands
  return result


@pytest.mark.parametrize("a_shape, b_shape", [
    ((1024, 1024), (1024, 1024)), ((1024, 1), (1, 1024)), ((1024, 1024), ()),
    ((1024,), (1024, 1)),
], ids=str)
@pytest.mark.xla_cpu
def test_one_fused_elementwise_pass_under_jit(a_shape, b_shape):
  a, b = jnp.zeros(a_shape, jnp.int8), jnp.zeros(b_shape, jnp.int8)
  scale, zero_point = jnp.float32(0.1), jnp.int8(3)
  result = _assert_one_fusion(
      lambda a, b, s, z: jq.quantized_add(a, s, z, b, s, z, s, z), a, b, scale, zero_point)
  assert result.startswith("s8[1024,1024]")


@pytest.mark.xla_cpu
def test_one_fusion_check_counts_separate_passes():
  """The check above fails for a computation XLA cannot fuse into one loop."""
  a = jnp.zeros((1024, 1024), jnp.int8)
  with pytest.raises(AssertionError):
    _assert_one_fusion(lambda a: jnp.sort(a.astype(jnp.float32) * 2, axis=0), a)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_vmap_and_no_retrace(implementation):
  rng = np.random.default_rng(8)
  a, b = _random_operand(rng, np.int8, (4, 5, 6)), _random_operand(rng, np.uint8, (4, 6))
  scales = rng.uniform(0.01, 0.1, (4, 3)).astype(np.float32)
  zero_points = _random_operand(rng, np.int8, (4,))

  mapped = jax.vmap(lambda a, b, s, z: jq.quantized_add(a, s[0], z, b, s[1], None, s[2], z,
                                                        implementation=implementation))(
      a, b, scales, zero_points)
  for i in range(4):
    args = (a[i], scales[i, 0], zero_points[i], b[i], scales[i, 1], np.uint8(0), scales[i, 2],
            zero_points[i])
    assert_bits_equal(mapped[i], reference_add(*args, np.int8))

  traces = []

  @jax.jit
  def model(a, b, s, z):
    traces.append(None)
    return jq.quantized_add(a, s, z, b, s, None, s, z, implementation=implementation)

  for i in range(3):
    model(a[i], b[i], scales[i, 0], zero_points[i])
  assert len(traces) == 1
  before = jq.quantized_add._cache_size()
  for i in range(3):
    jq.quantized_add(a[i], scales[i, 0], zero_points[i], b[i], scales[i, 1], None, scales[i, 2],
                     implementation=implementation)
  assert jq.quantized_add._cache_size() <= before + 1


# --- errors ----------------------------------------------------------------------------------


A = np.zeros((2, 3), np.int8)
B = np.zeros((3,), np.int8)


def _add(**overrides):
  args = dict(a=A, a_scale=1.0, a_zero_point=np.int8(0), b=B, b_scale=1.0,
              b_zero_point=np.int8(0), out_scale=1.0, out_zero_point=np.int8(0))
  args.update(overrides)
  output_dtype = args.pop("output_dtype", None)
  return jq.quantized_add(**args, output_dtype=output_dtype)


def test_non_broadcastable_shapes():
  with pytest.raises(ValueError, match=r"quantized_add: b\.shape must be broadcastable.*\(4,\)"):
    _add(b=np.zeros(4, np.int8))


@pytest.mark.parametrize("name", ["a_scale", "b_scale", "out_scale"])
def test_non_scalar_scale(name):
  with pytest.raises(ValueError, match=rf"quantized_add: {name}\.shape must be .*\(2,\)"):
    _add(**{name: np.ones(2, np.float32)})


@pytest.mark.parametrize("name", ["a_zero_point", "b_zero_point", "out_zero_point"])
def test_non_scalar_zero_point(name):
  with pytest.raises(ValueError, match=rf"quantized_add: {name}\.shape must be .*\(3,\)"):
    _add(**{name: np.zeros(3, np.int8)})


@pytest.mark.parametrize("name", ["a", "b"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=dtype_name)
def test_float_operand(name, dtype):
  with pytest.raises(TypeError, match=rf"quantized_add: {name}\.dtype must be .*got float"):
    _add(**{name: np.zeros((2, 3), dtype)})


@pytest.mark.parametrize("name", ["a", "b"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=dtype_name)
def test_float8_operand(name, dtype):
  with pytest.raises(TypeError,
                     match=rf"quantized_add: {name}\.dtype must be an integer quantized dtype"):
    _add(**{name: np.zeros((2, 3), dtype)})


@pytest.mark.parametrize("name", ["a_zero_point", "b_zero_point"])
def test_zero_point_dtype_mismatch(name):
  # The message names the argument, here which of the zero points.
  with pytest.raises(TypeError, match=rf"quantized_add: {name}\.dtype must be int8.*got uint8"):
    _add(**{name: np.uint8(0)})


def test_out_zero_point_conflicts_with_output_dtype():
  with pytest.raises(ValueError, match=r"quantized_add: output_dtype must be None or .*got uint8"):
    _add(out_zero_point=np.int8(0), output_dtype=jnp.uint8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn], ids=dtype_name)
def test_non_integer_output_dtype(dtype):
  with pytest.raises(TypeError, match=r"quantized_add: output_dtype must be"):
    _add(out_zero_point=None, output_dtype=dtype)


def test_integer_scale():
  with pytest.raises(TypeError, match=r"quantized_add: a_scale\.dtype must be"):
    _add(a_scale=np.int32(1))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_empty_operands(implementation):
  # Found by tests/test_fuzz.py: the kernel engine took the output shape as the
  # largest of each dim, so (0,) against the scalar parameters' (1,) became (1,).
  a = jnp.zeros((0,), jnp.int4)
  y = jq.quantized_add(a, 0.5, jnp.int4(1), a, 0.5, jnp.int4(1), 0.5, jnp.int4(0),
                       implementation=implementation)
  assert y.shape == (0,) and y.dtype == jnp.int4
  y = jq.quantized_add(jnp.zeros((3, 0), jnp.int8), 1.0, None, jnp.zeros((1,), jnp.int8), 1.0,
                       None, 1.0, implementation=implementation)
  assert y.shape == (3, 0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_products_are_rounded_before_the_sum(implementation):
  # Found by tests/test_fuzz.py: XLA:CPU contracted b_value + a_value into
  # fma(b - zb, b_scale, a_value), rounding once: here -60.166668 instead of
  # -60.16667, whose quotient by 1/3 is no longer the tie -180.50002.
  a = np.full(4, 3, np.uint8).astype(jnp.uint4)
  b = np.full(4, -82, np.int8)
  third = np.float32(0.33333334)
  a_value = np.float32(3 * 2.5)
  b_value = np.float32(np.float32(-82 - 121) * third)
  expected = np.clip(np.rint((a_value + b_value) / third) + 127, -128, 127)
  y = jq.quantized_add(a, np.float32(2.5), np.zeros((), jnp.uint4), b, third, np.int8(121),
                       third, np.int8(127), implementation=implementation)
  np.testing.assert_array_equal(y, np.full(4, expected, np.int8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_products_are_rounded_before_the_sum_with_constant_scales(implementation):
  # J6: LLVM proved isnan(product) false for constant scales, dropped that
  # second use of the product and contracted it into the sum again.
  a = np.full(4, 3, np.uint8).astype(jnp.uint4)
  b = np.full(4, -82, np.int8)
  third = np.float32(0.33333334)
  expected = np.clip(np.rint((np.float32(7.5) + np.float32(np.float32(-203) * third)) / third)
                     + 127, -128, 127).astype(np.int8)
  y = jax.jit(lambda a, b: jq.quantized_add(a, np.float32(2.5), np.zeros((), jnp.uint4), b,
                                            third, np.int8(121), third, np.int8(127),
                                            implementation=implementation))(a, b)
  np.testing.assert_array_equal(y, np.full(4, expected, np.int8))
