"""jq.checked: bad scale, zero point and code values reported, at no cost when off.

Each bad-value class is run eagerly, inside a ``jax.jit`` given to
``checked``, under ``vmap`` and ``grad``, and inside an outer ``jax.jit``
that ``checkify`` functionalises. Good values (NaN and infinities in x
included) pass and give the unchecked result. Off, the lowered programs are
the same text as in a process that never used the mode.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq


@dataclasses.dataclass(frozen=True)
class BadCase:
  """``function(*args)`` runs silently unchecked and raises ``message`` checked."""

  name: str
  function: Callable[..., Any]
  args: tuple[Any, ...]
  message: str


def _ones(*shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


NBITS_CODES = np.full((1, 2, 8), 0x98, np.uint8)  # MatMulNBits' (N, blocks, bytes), 4 bits

BAD_CASES = [
    BadCase(
        "negative scale, per axis",
        lambda x, scale: jq.quantize_linear(x, scale, output_dtype=jnp.int8, axis=1),
        (_ones(2, 3), jnp.array([0.5, -0.5, 1.0])),
        "quantize_linear: scale must be finite and > 0, got -0.5 at index (1,).",
    ),
    BadCase(
        "zero scale, per tensor",
        lambda x, scale: jq.quantize_linear(x, scale),
        (_ones(4), jnp.float32(0.0)),
        "quantize_linear: scale must be finite and > 0, got 0.0.",
    ),
    BadCase(
        "NaN scale, blocked, the first of two",
        lambda x, scale: jq.dequantize_linear(x, scale, axis=1, block_size=2),
        (_ones(2, 4, dtype=jnp.int8), jnp.array([[1.0, 1.0], [jnp.nan, -1.0]])),
        "dequantize_linear: scale must be finite and > 0, got nan at index (1, 0).",
    ),
    BadCase(
        "infinite float16 scale",
        lambda x, scale: jq.fake_quantize(x, scale, axis=0),
        (_ones(3, 2), jnp.array([1.0, 2.0, jnp.inf], jnp.float16)),
        "fake_quantize: scale must be finite and > 0, got inf at index (2,).",
    ),
    BadCase(
        "NaN float8_e8m0fnu scale",
        lambda x, scale: jq.quantize_linear(x, scale),
        (_ones(4), jnp.array(np.nan, jnp.float8_e8m0fnu)),
        "quantize_linear: scale must be finite and > 0, got nan.",
    ),
    BadCase(
        "negative b_scale of quantized_add",
        lambda a, b_scale: jq.quantized_add(a, 1.0, None, a, b_scale, None, 1.0),
        (_ones(4, dtype=jnp.uint8), jnp.float32(-2.0)),
        "quantized_add: b_scale must be finite and > 0, got -2.0.",
    ),
    BadCase(
        "negative out_scale of quantized_add",
        lambda a, out_scale: jq.quantized_add(a, 1.0, None, a, 1.0, None, out_scale),
        (_ones(4, dtype=jnp.uint8), jnp.float32(-1.0)),
        "quantized_add: out_scale must be finite and > 0, got -1.0.",
    ),
    BadCase(
        "NaN float8_e4m3fn zero point",
        lambda x, zero_point: jq.dequantize_linear(x, 1.0, zero_point),
        (_ones(3, dtype=jnp.float8_e4m3fn), jnp.array(np.nan, jnp.float8_e4m3fn)),
        "dequantize_linear: zero_point must be finite, got nan.",
    ),
    BadCase(
        "infinite float8_e5m2 zero point, per axis",
        lambda x, zero_point: jq.quantize_linear(x, jnp.ones(2, jnp.float32), zero_point,
                                                 axis=0),
        (_ones(2, 3), jnp.array([0.0, -np.inf], jnp.float8_e5m2)),
        "quantize_linear: zero_point must be finite, got -inf at index (1,).",
    ),
    BadCase(
        "LSQ zero point outside int8 once rounded",
        lambda x, zero_point: jq.fake_quantize_learnable(x, 1.0, zero_point),
        (_ones(3), jnp.float32(127.75)),
        "fake_quantize_learnable: zero_point must be finite and within [-128, 127] for "
        "int8 once rounded, got 127.75.",
    ),
    BadCase(
        "NaN LSQ zero point",
        lambda x, zero_point: jq.fake_quantize_learnable(x, 1.0, zero_point, dtype=jnp.int4),
        (_ones(3), jnp.float32(np.nan)),
        "fake_quantize_learnable: zero_point must be finite and within [-8, 7] for "
        "int4 once rounded, got nan.",
    ),
    BadCase(
        "float6 zero point codes above 63",
        lambda x, zero_point: jq.fake_quantize(x, 1.0, zero_point, dtype=jnp.float6_e2m3fn),
        (_ones(3), jnp.array(64, jnp.uint8)),
        "fake_quantize: zero_point must be below 64 (float6_e2m3fn codes have 6 bits), "
        "got 64.",
    ),
    BadCase(
        "float6 codes above 63 to dequantize",
        lambda codes: jq.dequantize_linear(codes, 2.0, packed_dtype=jnp.float6_e3m2fn),
        (jnp.array([[1, 2], [3, 200]], jnp.uint8),),
        "dequantize_linear: x must be below 64 (float6_e3m2fn codes have 6 bits), "
        "got 200 at index (1, 1).",
    ),
    # Plural names: matmul_nbits' scales and zero points were not checked at all.
    BadCase(
        "negative block scale of matmul_nbits",
        lambda a, scales: jq.matmul_nbits(a, NBITS_CODES, scales, K=32, N=1, block_size=16),
        (_ones(1, 32), jnp.array([[0.5, -2.0]], jnp.float32)),
        "matmul_nbits: scales must be finite and > 0, got -2.0 at index (0, 1).",
    ),
    BadCase(
        "NaN float zero point of matmul_nbits",
        lambda a, zero_points: jq.matmul_nbits(a, NBITS_CODES, _ones(1, 2), zero_points,
                                               K=32, N=1, block_size=16),
        (_ones(1, 32), jnp.array([[8.0, np.nan]], jnp.float32)),
        "matmul_nbits: zero_points must be finite, got nan at index (0, 1).",
    ),
    BadCase(
        "int4 codes above 15 to pack",
        lambda codes: jq.pack(codes, dtype=jnp.int4),
        (jnp.array([1, 16, 17], jnp.uint8),),
        "pack: x must be below 16 (int4 codes have 4 bits), got 16 at index (1,).",
    ),
]


def _raises(case: BadCase):
  return pytest.raises(checkify.JaxRuntimeError, match="^" + re.escape(case.message))


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.name)
def test_bad_values_pass_silently_unchecked_and_are_reported_checked(case):
  case.function(*case.args)  # no error: what the checked mode is for
  with _raises(case):
    jq.checked(case.function)(*case.args)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.name)
def test_bad_values_are_reported_from_a_jitted_function_traced_before(case):
  jitted = jax.jit(case.function)
  jitted(*case.args)  # traced and cached unchecked: checked must trace it again
  with _raises(case):
    jq.checked(jitted)(*case.args)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.name)
def test_bad_values_are_reported_the_same_under_x64(case):
  """The same arrays (the cases' constants spell float32) under x64: the same report."""
  with jax.enable_x64(True), _raises(case):
    jq.checked(case.function)(*case.args)


@pytest.mark.parametrize("case", BAD_CASES[:3], ids=lambda case: case.name)
def test_an_outer_jit_functionalised_by_checkify_carries_the_error(case):
  error, _ = checkify.checkify(jax.jit(jq.checked(case.function)))(*case.args)
  assert error.get().startswith(case.message)


def test_bad_values_under_vmap_and_grad():
  quantize = jax.vmap(lambda x, scale: jq.quantize_linear(x, scale))
  with pytest.raises(checkify.JaxRuntimeError, match="scale must be finite and > 0, got -1.0"):
    jq.checked(quantize)(_ones(2, 3), jnp.array([1.0, -1.0]))
  loss = jax.grad(lambda scale, x: jq.fake_quantize_learnable(x, scale).sum())
  with pytest.raises(checkify.JaxRuntimeError,
                     match=re.escape("fake_quantize_learnable: scale must be finite and > 0, "
                                     "got -0.25 at index (1,).")):
    jq.checked(loss)(jnp.array([0.5, -0.25]), _ones(3, 2))


GOOD_CASES = [
    (lambda x: jq.quantize_linear(x, jnp.array([0.5, 2.0], jnp.float32),
                                  jnp.array([0, -3], jnp.int8), axis=1),
     (jnp.array([[np.nan, np.inf], [-np.inf, 1e9]]),)),
    (lambda x: jq.quantize_linear(x, jnp.array(2.0 ** -20, jnp.float8_e8m0fnu),
                                  output_dtype=jnp.float8_e4m3fn),
     (jnp.array([1.0, np.nan, -np.inf]),)),
    (lambda x: jq.dequantize_linear(x, 0.5, jnp.array(-448.0, jnp.float8_e4m3fn)),
     (jnp.array([np.nan, 448.0], jnp.float8_e4m3fn),)),
    # A NumPy float6 array cannot be an argument of a traced function (XLA
    # has no float6 type), but the ops read closed-over ones as codes.
    (lambda: jq.dequantize_linear(np.array([7.5, -7.5], ml_dtypes.float6_e2m3fn), 1.0,
                                  np.array(-7.5, ml_dtypes.float6_e2m3fn)), ()),
    (lambda codes: jq.dequantize_linear(codes, 1.0, jnp.array(63, jnp.uint8),
                                        packed_dtype=jnp.float6_e2m3fn),
     (jnp.array([0, 63], jnp.uint8),)),
    (lambda packed: jq.dequantize_linear(packed, 1.0, packed_shape=(3,)),
     (jnp.array([255, 255], jnp.uint8),)),
    (lambda codes: jq.pack(codes, dtype=jnp.uint4), (jnp.array([0, 15, 7], jnp.uint8),)),
    # Packed bytes hold two codes each: a byte above 15 is no code of its own.
    (lambda packed: jq.dequantize_linear(packed, 1.0, packed_shape=(3,), packed_dtype=jnp.uint4),
     (jnp.array([255, 255], jnp.uint8),)),
    # -128.4 rounds to -128, int8's minimum: within.
    (lambda x: jq.fake_quantize_learnable(x, jnp.float32(0.1), jnp.float32(-128.4)),
     (jnp.array([np.nan, 3.0]),)),
    (lambda x: jq.fake_quantize_learnable(x, jnp.float32(0.1), jnp.float32(127.4)),
     (jnp.array([np.nan, 3.0]),)),
    (lambda x: jq.fake_quantize_dynamic(x), (jnp.array([np.nan, 0.0, 1.0]),)),
    (lambda x: jq.dynamic_quantize_linear(x), (jnp.array([np.inf, 0.0, 1.0]),)),
    (lambda a: jq.quantized_add(a, 0.5, 3, a, 0.25, 4, 1.0, 5), (_ones(3, dtype=jnp.uint8),)),
    (lambda x: jq.quantize_linear(x, jnp.ones((0,), jnp.float32), axis=0), (_ones(0),)),
    # Scales the library computes from x, whose infinities are legal: its own
    # inner calls were checked and blamed (fake_quantize: scale ... got inf).
    (lambda x: jq.choose_qparams(x, jnp.int8, method="mse"), (jnp.array([1.0, np.inf, -2.0]),)),
    (lambda x: jq.dot_general_dynamic_int8(x, _ones(3, 2), (((1,), (0,)), ((), ()))),
     (jnp.array([[1.0, np.inf, -2.0]]),)),
    (lambda x: jq.dot_general_fake_quant(x, _ones(3, 2), (((1,), (0,)), ((), ()))),
     (jnp.array([[1.0, np.inf, -2.0]]),)),
    (lambda w: jq.quantize_params({"w": w}, jq.QuantizationRule(pattern="w")),
     (jnp.array([[1.0, np.inf], [-2.0, 3.0]]),)),
    # A per-example NumPy scale under vmap (checkify's rule indexed the NumPy
    # payload with a tracer).
    (jax.vmap(lambda x, s: jq.quantize_linear(x, s, output_dtype=jnp.int8)),
     (np.ones((3, 4), np.float32), np.full(3, 0.5, np.float32))),
]


@pytest.mark.parametrize("function, args", GOOD_CASES)
def test_good_values_pass_and_give_the_unchecked_result(function, args):
  expected = function(*args)
  for got in (jq.checked(function)(*args), jq.checked(jax.jit(function))(*args)):
    jax.tree.map(_assert_same_bits, got, expected)


@pytest.mark.parametrize("function, args", GOOD_CASES)
def test_good_values_under_x64_give_x32_bits(function, args):
  expected = jq.checked(function)(*args)
  with jax.enable_x64(True):
    got = jq.checked(function)(*args)
  jax.tree.map(_assert_same_bits, got, expected)


def _assert_same_bits(got, expected):
  got, expected = np.asarray(got), np.asarray(expected)
  assert got.dtype == expected.dtype
  bits = f"u{got.dtype.itemsize}"
  np.testing.assert_array_equal(got.view(bits), expected.view(bits))


_LOWERED = textwrap.dedent("""
    import jax, jax.numpy as jnp, jaxquant as jq
    from jax.experimental import checkify

    def lowered():
      x, scale = jnp.ones((4, 8)), jnp.full((4, 2), 0.5)
      learnable = jax.grad(lambda s: jq.fake_quantize_learnable(x, s, axis=1, block_size=4).sum())
      ops = [
          (lambda x, s: jq.quantize_linear(x, s, axis=1, block_size=4), (x, scale)),
          (lambda x, s: jq.dequantize_linear(x, s, jnp.full((4, 2), 3, jnp.int8), axis=1,
                                         block_size=4),
           (x.astype(jnp.int8), scale)),
          (learnable, (scale,)),
          (lambda a: jq.quantized_add(a, 0.5, 1, a, 0.25, 2, 1.0, 3), (x.astype(jnp.uint8),)),
      ]
      return [jax.jit(op).lower(*args).as_text() for op, args in ops]

    before = lowered()
    try:
      jq.checked(lambda: jq.quantize_linear(jnp.ones(2), -1.0))()
    except checkify.JaxRuntimeError:
      pass
    jq.checked(lambda: jq.quantize_linear(jnp.ones(2), 1.0))()
    after = lowered()
    checked_text = jax.jit(checkify.checkify(jq.checked(
        lambda s: jq.quantize_linear(jnp.ones((4, 8)), s, axis=1, block_size=4)))).lower(
            jnp.full((4, 2), 0.5)).as_text()
    print(before == after, len(before), checked_text.count("compare"),
          before[0].count("compare"))
""")


def test_off_the_lowered_programs_are_those_of_a_process_that_never_used_it():
  result = subprocess.run([sys.executable, "-c", _LOWERED], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  same, count, checked_compares, plain_compares = result.stdout.split()
  assert (same, count) == ("True", "4")
  # The test can fail: the checked program is a different one.
  assert int(checked_compares) > int(plain_compares)
