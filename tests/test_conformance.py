"""Every WebNN conformance vector in tests/data runs through jaxquant.

The vectors are web-platform-tests data that no one in this project wrote
(provenance in tests/data/README.md): 64 ``dequantizeLinear``/``quantizeLinear``
cases plus two subgraph cases whose scale rank is lower than the input rank.
Each case is checked twice: within the case's own ULP tolerance, and bit-exact
unless it sits on the commented allow-list below with the reason it cannot be.
"""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import jaxquant as jq
from quant_testing import FLOAT_DTYPES
from quant_testing import QUANTIZED_DTYPES

# Vendored beside this file, so a plain clone of the repository runs them.
CASES_FILE = Path(__file__).resolve().parent / "data" / "webnn_cases.json"

# Missing data must fail the run, not skip it: a silently absent conformance
# suite would look exactly like a passing one.
if not CASES_FILE.is_file():
  raise FileNotFoundError(
      f"WebNN conformance vectors not found at {CASES_FILE}; they are part of the "
      "repository (tests/data/webnn_cases.json): restore the file from git."
  )

_DATA = json.loads(CASES_FILE.read_text())
CASES: list[dict[str, Any]] = [*_DATA["cases"], *_DATA["extra_cases_rank_differs"]]

# WebNN's dataType names are NumPy's.
DTYPES = {d.name: d for d in (*QUANTIZED_DTYPES, *FLOAT_DTYPES)}

# Cases whose expected value is not bit-identical to ours, each with the
# reason; every other case must match exactly. test_bit_exact also checks that
# each listed case really is inexact, so the list cannot go stale.
NOT_BIT_EXACT = {
    # WPT computes the expected value in JavaScript doubles: 7391418.92... is
    # first rounded to the float32 input 7391419.0, and 7391419.0 / 0.28006873
    # = 26391447.28 in double, which rounds to 26391447 (+ zero point -2445234
    # = 23946213). A float32 scale divides in float32 (docs/numerics.md,
    # "quantize_linear"; so does onnxruntime), where the quotient lies above
    # 2**24 with a spacing of 2 and becomes 26391448, so we return 23946214:
    # one step off, inside the case's +-1 tolerance. See
    # test_int32_zero_point_case_differs_only_by_float32_division.
    "quantizeLinear float32 tensor with int32 zeroPoint":
        "expected value computed in float64 by the WPT JS; jaxquant divides in float32",
}

# Cases where ONNX's arithmetic and WebNN's expected value differ by more than
# the case's tolerance; jaxquant follows ONNX. test_within_tolerance checks that
# each one really is outside its tolerance and that jaxquant gives the ONNX
# value (_onnx_quantize), so the list cannot go stale.
ONNX_NOT_WEBNN = {
    # float16 x and float16 scale: ONNX divides in the scale's dtype
    # (docs/numerics.md, "quantize_linear"), so -22400 / 1.1201171875 =
    # -19997.9 rounds to the float16 -20000 (spacing 16 there), and -20000 +
    # 32345 = 12345; onnxruntime 1.32.0 and onnx.reference 1.23.2 give the same
    # quotient. WPT expects the quotient of a wider division, -19998, and so
    # 12347: two steps off, outside the case's +-1 tolerance.
    "quantizeLinear float16 tensor with int32 zeroPoint":
        "ONNX divides float16 by float16 in float16; WPT's expected value does not",
}


def _unique_ids(cases: list[dict[str, Any]]) -> list[str]:
  """Case names as test ids, numbered where a name repeats."""
  counts = collections.Counter(case["name"] for case in cases)
  seen: collections.Counter[str] = collections.Counter()
  ids = []
  for case in cases:
    name = case["name"]
    seen[name] += 1
    ids.append(name if counts[name] == 1 else f"{name} #{seen[name]}")
  return ids


IDS = _unique_ids(CASES)
CASES_BY_ID = dict(zip(IDS, CASES))


def _array(operand: dict[str, Any]) -> np.ndarray:
  """An operand's flat row-major values as an array of its dtype and shape.

  float16 operands hold float32-precision literals; NumPy rounds the Python
  floats straight to float16, as the WPT harness's Float16Array does.
  """
  dtype = DTYPES[operand["dataType"]]
  return np.asarray(operand["values"], dtype=dtype).reshape(operand["shape"])


def _preprocess(x: np.ndarray, steps: list[dict[str, Any]]) -> np.ndarray:
  for step in steps:
    if step["op"] == "transpose":
      x = np.transpose(x, step["permutation"])
    elif step["op"] == "reshape":
      x = np.reshape(x, step["newShape"])
    else:
      raise NotImplementedError(f"unknown preprocess step {step['op']!r}")
  return x


def _qdq(x, scale, zero_point):
  """``dequantize(quantize(x))``: one Q->DQ pair of an ONNX/WebNN QDQ graph."""
  return jq.dequantize_linear(
      jq.quantize_linear(x, scale, zero_point), scale, zero_point
  )


def _run(case: dict[str, Any]) -> np.ndarray:
  """Evaluates one case's graph with jaxquant; block_size is 0 throughout.

  WebNN scales are block-wise broadcast (docs/numerics.md, "Granularity": the
  block-wise broadcast and rank-padded rows), so no case passes axis or
  block_size.
  """
  op = case["op"]
  if op == "dequantizeLinear":
    x = _preprocess(_array(case["input"]), case.get("preprocess", []))
    return jq.dequantize_linear(x, _array(case["scale"]), _array(case["zeroPoint"]))
  if op == "quantizeLinear":
    x = _preprocess(_array(case["input"]), case.get("preprocess", []))
    return jq.quantize_linear(x, _array(case["scale"]), _array(case["zeroPoint"]))
  if op == "quantizeLinear->dequantizeLinear":
    # The note: quantize with quantizeScale/quantizeZeroPoint, then dequantize
    # the int8 result with the case's own scale/zeroPoint.
    q = jq.quantize_linear(
        _array(case["input"]), _array(case["quantizeScale"]),
        _array(case["quantizeZeroPoint"]),
    )
    return jq.dequantize_linear(q, _array(case["scale"]), _array(case["zeroPoint"]))
  if op.startswith("q(A)->dq, dq(B), add, q->dq"):
    # A QDQ graph around a float add: A is float and goes through its own Q->DQ
    # pair, B is already int8 and is only dequantized, the float32 sum goes
    # through the output Q->DQ pair. The note's integer form (QLinearAdd) is
    # the same arithmetic.
    a = _qdq(_array(case["inputA"]), _array(case["inputAScale"]),
             _array(case["inputAZeroPoint"]))
    b = jq.dequantize_linear(
        _array(case["inputB"]), _array(case["inputBScale"]),
        _array(case["inputBZeroPoint"]),
    )
    return _qdq(a + b, _array(case["outputScale"]), _array(case["outputZeroPoint"]))
  raise NotImplementedError(f"unknown op {op!r} in case {case['name']!r}")


@functools.cache
def _actual_and_expected(case_id: str) -> tuple[np.ndarray, np.ndarray]:
  """jaxquant's result and the expected value, both of the expected dtype."""
  case = CASES_BY_ID[case_id]
  actual = np.asarray(_run(case))
  expected = _array(case["expected"])
  assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  return actual, expected


def _ulp_distance(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
  """Element-wise distance in steps of the dtype: ULPs for floats, units for ints.

  Floats are mapped onto the integers in order (sign-magnitude bits to two's
  complement), so neighbours differ by one and +0 and -0 coincide. Two NaNs
  are distance 0 apart; a NaN against a number is infinitely far.
  """
  if not np.issubdtype(actual.dtype, np.floating):
    return np.abs(actual.astype(np.int64) - expected.astype(np.int64))
  bits = {2: np.int16, 4: np.int32}[actual.dtype.itemsize]
  lowest = np.iinfo(bits).min

  def ordered(values: np.ndarray) -> np.ndarray:
    signed = values.view(bits).astype(np.int64)
    return np.where(signed < 0, lowest - signed, signed)

  distance = np.abs(ordered(actual) - ordered(expected)).astype(np.float64)
  both_nan = np.isnan(actual) & np.isnan(expected)
  one_nan = np.isnan(actual) ^ np.isnan(expected)
  return np.where(both_nan, 0.0, np.where(one_nan, np.inf, distance))


def _tolerance(case: dict[str, Any], dtype: np.dtype) -> int:
  """The case's tolerance in ULPs of ``dtype``.

  The two subgraph cases record no numeric tolerance (a name, or nothing);
  they get 1 step, the tolerance every other case of the file grants.
  """
  tolerance = case.get("tolerance")
  if isinstance(tolerance, dict):
    assert tolerance["metricType"] == "ULP", tolerance
    return tolerance["value"][np.dtype(dtype).name]
  return 1


def test_every_case_is_collected():
  # Guards against a data update silently shrinking the suite.
  assert _DATA["meta"]["count"] == len(_DATA["cases"]) == 64
  assert len(_DATA["extra_cases_rank_differs"]) == 2
  assert len(IDS) == len(set(IDS)) == 66
  assert set(NOT_BIT_EXACT) <= set(IDS)
  assert set(ONNX_NOT_WEBNN) <= set(IDS)
  assert not set(NOT_BIT_EXACT) & set(ONNX_NOT_WEBNN)


def _onnx_quantize(case: dict[str, Any]) -> np.ndarray:
  """ONNX QuantizeLinear of a quantizeLinear case to int32, in NumPy.

  The quotient is rounded to the scale's dtype (NumPy divides float16 by
  float16 in float16); block-wise broadcast scales are repeated out to x's
  shape.
  """
  assert case["op"] == "quantizeLinear", case["name"]
  x, scale = _array(case["input"]), _array(case["scale"])
  zero_point = _array(case["zeroPoint"]).astype(np.int64)
  for d, (n, p) in enumerate(zip(x.shape, scale.shape)):
    scale = np.repeat(scale, n // p, axis=d)
    zero_point = np.repeat(zero_point, n // p, axis=d)
  quotient = (x.astype(scale.dtype) / scale).astype(np.float64)
  info = np.iinfo(np.int32)
  return np.clip(np.rint(quotient).astype(np.int64) + zero_point, info.min, info.max)


@pytest.mark.parametrize("case_id", IDS)
def test_within_tolerance(case_id):
  actual, expected = _actual_and_expected(case_id)
  tolerance = _tolerance(CASES_BY_ID[case_id], expected.dtype)
  distance = _ulp_distance(actual, expected)
  if case_id in ONNX_NOT_WEBNN:
    assert distance.max() > tolerance, f"{case_id!r} is now within tolerance"
    np.testing.assert_array_equal(actual, _onnx_quantize(CASES_BY_ID[case_id]))
    return
  assert np.all(distance <= tolerance), (
      f"max distance {distance.max()} > {tolerance}: got {actual.ravel().tolist()}, "
      f"expected {expected.ravel().tolist()}"
  )


@pytest.mark.parametrize("case_id", IDS)
def test_bit_exact(case_id):
  actual, expected = _actual_and_expected(case_id)
  # Distance 0 is bit equality except for the sign of zero, which the data
  # cannot carry: JSON.stringify(-0) writes "0". The block_size = [3, 2] cases
  # expect (12 - 12) * -3.617 = "0" where IEEE (and docs/numerics.md) gives -0.0.
  exact = not np.any(_ulp_distance(actual, expected))
  if case_id in ONNX_NOT_WEBNN:
    assert not exact  # and equal to ONNX's value: test_within_tolerance
  elif case_id in NOT_BIT_EXACT:
    assert not exact, f"{case_id!r} is now exact: remove it from NOT_BIT_EXACT"
    assert _ulp_distance(actual, expected).max() == 1
  else:
    assert exact, (
        f"not bit-exact: got {actual.ravel().tolist()}, "
        f"expected {expected.ravel().tolist()}"
    )


def test_int32_zero_point_case_differs_only_by_float32_division():
  # Backs the allow-list entry: redo the allow-listed case by hand in float32
  # (jaxquant's arithmetic for a float32 scale) and in float64 (the WPT JS's).
  case = CASES_BY_ID["quantizeLinear float32 tensor with int32 zeroPoint"]
  x, scale = _array(case["input"]), _array(case["scale"])
  zero_point = _array(case["zeroPoint"]).astype(np.int64)
  in_float32 = np.round(x / scale).astype(np.int64) + zero_point
  in_float64 = (
      np.round(x.astype(np.float64) / scale.astype(np.float64)).astype(np.int64)
      + zero_point
  )
  actual, expected = _actual_and_expected(
      "quantizeLinear float32 tensor with int32 zeroPoint"
  )
  np.testing.assert_array_equal(actual, in_float32)
  np.testing.assert_array_equal(expected, in_float64)
