"""Bad arguments raise a ValueError or TypeError at trace time (docs/numerics.md, "Errors").

Every error names the argument and what was expected, in the one format
``<function>: <argument> must be <expected>, got <actual>.``, and is raised
while tracing: eagerly, under an outer ``jax.jit``, and from ``.trace()``
alone, which never reaches XLA. The end of the file pins checks that were
once missing (wrongly named arguments, silently truncated zero points).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

QUANTIZED_DTYPES = re.escape("one of the quantized dtypes (") + r"int2, .*float4_e2m1fn\)"
SCALE_DTYPES = re.escape("one of float32, float16, bfloat16, float8_e8m0fnu")
BLOCK_RANGE = re.escape("in ONNX's range [ceil(D/S), ceil(D/(S-1)) - 1] = ")
MESSAGE_FORMAT = re.compile(r"^\w+: .+ must be .+, got .+\.$")


def _int8(*shape):
  return jnp.zeros(shape, jnp.int8)


def _float32(*shape):
  return jnp.ones(shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ErrorCase:
  """One bad call: ``function(*args, **static)`` must raise ``error``.

  ``args`` are arrays (or Python scalars, or None) and become tracers under
  an outer jit; ``static`` are the keyword-only attributes, closed over.
  ``match`` is searched in the message after ``"<function name>: "``.
  """

  id: str
  function: Callable[..., Any]
  args: tuple[Any, ...]
  static: dict[str, Any]
  error: type[Exception]
  match: str

  @property
  def name(self) -> str:
    """The public name that opens every message (jax.jit keeps ``__name__``)."""
    return self.function.__name__

  def __str__(self) -> str:
    return self.id


def _case(case_id, function, args, error, match, **static):
  return ErrorCase(case_id, function, tuple(args), static, error, match)


dq, q = jq.dequantize_linear, jq.quantize_linear
qa, dyn = jq.quantized_add, jq.dynamic_quantize_linear
fq, fql, fqd = jq.fake_quantize, jq.fake_quantize_learnable, jq.fake_quantize_dynamic

ERROR_CASES = [
    # --- unsupported dtypes -------------------------------------------------
    _case("dq-x-float32", dq, (_float32(4), 1.0), TypeError,
          rf"x\.dtype must be {QUANTIZED_DTYPES}, got float32\."),
    _case("dq-x-float16", dq, (jnp.ones(4, jnp.float16), 1.0), TypeError,
          rf"x\.dtype must be {QUANTIZED_DTYPES}, got float16\."),
    _case("dq-x-bool", dq, (jnp.zeros(4, bool), 1.0), TypeError,
          rf"x\.dtype must be {QUANTIZED_DTYPES}, got bool\."),
    # int32 x is accepted (ONNX opset 28 requantizes int32 accumulators); int8
    # and bool are outside ONNX's list.
    _case("q-x-int8", q, (_int8(4), 1.0), TypeError,
          r"x\.dtype must be a float dtype \(float32, float16 or bfloat16\) or int32, "
          r"got int8\."),
    _case("q-x-bool", q, (jnp.zeros(4, bool), 1.0), TypeError,
          r"x\.dtype must be a float dtype .*, got bool\."),
    _case("q-x-complex64", q, (jnp.zeros(4, jnp.complex64), 1.0), TypeError,
          r"x\.dtype must be a float dtype .*, got complex64\."),
    _case("dq-scale-int32", dq, (_int8(4), jnp.int32(1)), TypeError,
          rf"scale\.dtype must be {SCALE_DTYPES}, got int32\."),
    _case("q-scale-int32", q, (_float32(4), jnp.int32(1)), TypeError,
          rf"scale\.dtype must be {SCALE_DTYPES}, got int32\."),
    # A Python int scale is a weak int32, not a float: no silent conversion.
    _case("dq-scale-python-int", dq, (_int8(4), 2), TypeError,
          rf"scale\.dtype must be {SCALE_DTYPES}, got int32 \(a Python int: write a float, "
          r"2\.0 for 2\)\."),
    _case("dq-scale-bool", dq, (_int8(4), jnp.bool_(True)), TypeError,
          rf"scale\.dtype must be {SCALE_DTYPES}, got bool\."),
    _case("dq-output-int8", dq, (_int8(4), 1.0), TypeError,
          r"output_dtype must be one of float32, float16, bfloat16, got int8\.",
          output_dtype=jnp.int8),
    _case("dq-output-float64", dq, (_int8(4), 1.0), TypeError,
          r"output_dtype must be one of float32, float16, bfloat16, got float64\.",
          output_dtype=np.float64),
    _case("dq-output-not-a-dtype", dq, (_int8(4), 1.0), TypeError,
          r"output_dtype must be one of float32, float16, bfloat16, got 'bogus'\.",
          output_dtype="bogus"),
    _case("q-output-float32", q, (_float32(4), 1.0), TypeError,
          rf"output_dtype must be {QUANTIZED_DTYPES}, got float32\.",
          output_dtype=jnp.float32),
    _case("q-output-bool", q, (_float32(4), 1.0), TypeError,
          rf"output_dtype must be {QUANTIZED_DTYPES}, got bool\.",
          output_dtype=np.bool_),
    _case("q-precision-int8", q, (_float32(4), 1.0), TypeError,
          r"precision must be one of float32, float16, bfloat16, got int8\.",
          precision=jnp.int8),
    _case("q-precision-float8", q, (_float32(4), 1.0), TypeError,
          r"precision must be one of float32, float16, bfloat16, got float8_e4m3fn\.",
          precision=jnp.float8_e4m3fn),
    _case("q-precision-not-a-dtype", q, (_float32(4), 1.0), TypeError,
          r"precision must be one of float32, float16, bfloat16, got 'bogus'\.",
          precision="bogus"),
    # --- zero point ---------------------------------------------------------
    _case("dq-zero-point-shape", dq, (_int8(2, 3), _float32(3), _int8(2)), ValueError,
          r"zero_point\.shape must be equal to scale\.shape \(3,\), got \(2,\)\.",
          axis=1),
    _case("q-zero-point-shape", q, (_float32(2, 3), _float32(3), _int8(2)), ValueError,
          r"zero_point\.shape must be equal to scale\.shape \(3,\), got \(2,\)\.",
          axis=1),
    # A one-element zero point with a per-axis scale is no per-tensor pair.
    _case("dq-zero-point-shape-per-tensor", dq, (_int8(2, 3), _float32(3), _int8(1)),
          ValueError, r"zero_point\.shape must be equal to scale\.shape \(3,\), got \(1,\)\."),
    _case("q-zero-point-shape-blocked", q, (_float32(2, 4), _float32(2, 2), _int8(2, 1)),
          ValueError,
          r"zero_point\.shape must be equal to scale\.shape \(2, 2\), got \(2, 1\)\.",
          block_size=2),
    _case("dq-zero-point-dtype-uint8", dq, (_int8(4), 1.0, jnp.uint8(0)), TypeError,
          r"zero_point\.dtype must be int8 \(the quantized dtype\), got uint8\."),
    _case("dq-zero-point-dtype-float32", dq, (_int8(4), 1.0, jnp.float32(0)), TypeError,
          r"zero_point\.dtype must be int8 \(the quantized dtype\), got float32\."),
    _case("dq-zero-point-dtype-int4", dq,
          (jnp.zeros(4, jnp.uint4), 1.0, jnp.zeros((), jnp.int4)), TypeError,
          r"zero_point\.dtype must be uint4 \(the quantized dtype\), got int4\."),
    _case("q-zero-point-conflicts-output-dtype", q, (_float32(4), 1.0, jnp.int8(0)),
          ValueError,
          r"output_dtype must be None or zero_point's dtype int8, got uint8\.",
          output_dtype=jnp.uint8),
    # --- axis ---------------------------------------------------------------
    _case("dq-axis-per-axis-high", dq, (_int8(2, 3), _float32(3)), ValueError,
          r"axis must be an int in \[-2, 2\) for an input of rank 2, got 2\.", axis=2),
    _case("dq-axis-per-axis-low", dq, (_int8(2, 3), _float32(2)), ValueError,
          r"axis must be an int in \[-2, 2\) for an input of rank 2, got -3\.", axis=-3),
    _case("q-axis-per-axis-high", q, (_float32(2, 3), _float32(3)), ValueError,
          r"axis must be an int in \[-2, 2\) for an input of rank 2, got 5\.", axis=5),
    _case("dq-axis-blocked-high", dq, (_int8(2, 4), _float32(2, 2)), ValueError,
          r"axis must be an int in \[-2, 2\) for an input of rank 2, got 2\.",
          axis=2, block_size=2),
    _case("q-axis-blocked-low", q, (_float32(2, 4), _float32(2, 2)), ValueError,
          r"axis must be an int in \[-2, 2\) for an input of rank 2, got -3\.",
          axis=-3, block_size=2),
    # Blocked along axis 1 of a rank-1 x: ONNX's default axis is out of range.
    _case("dq-axis-blocked-rank1-default", dq, (_int8(6), _float32(2)), ValueError,
          r"axis must be an int in \[-1, 1\) for an input of rank 1, got 1\.",
          block_size=3),
    _case("dq-axis-float", dq, (_int8(2, 3), _float32(3)), TypeError,
          r"axis must be an int, got 1\.0\.", axis=1.0),
    _case("dq-axis-bool", dq, (_int8(2, 3), _float32(3)), TypeError,
          r"axis must be an int, got True\.", axis=True),
    # --- block_size ---------------------------------------------------------
    # D=10, S=3: ceil(10/3) = 4 and ceil(10/2) - 1 = 4, so only 4 is accepted.
    _case("dq-block-size-below-range", dq, (_int8(2, 10), _float32(2, 3)), ValueError,
          rf"block_size must be {BLOCK_RANGE}\[4, 4\] for x\.shape\[1\]=10 and "
          r"scale\.shape\[1\]=3, got 3\.", block_size=3),
    _case("dq-block-size-above-range", dq, (_int8(2, 10), _float32(2, 3)), ValueError,
          rf"block_size must be {BLOCK_RANGE}\[4, 4\] .*, got 5\.", block_size=5),
    # D=10, S=2: [5, 9].
    _case("q-block-size-above-range", q, (_float32(2, 10), _float32(2, 2)), ValueError,
          rf"block_size must be {BLOCK_RANGE}\[5, 9\] .*, got 10\.", block_size=10),
    _case("q-block-size-below-range", q, (_float32(2, 10), _float32(2, 2)), ValueError,
          rf"block_size must be {BLOCK_RANGE}\[5, 9\] .*, got 4\.", block_size=4),
    # S=1 (but more than one element overall): [D, inf).
    _case("dq-block-size-single-block", dq, (_int8(2, 10), _float32(2, 1)), ValueError,
          rf"block_size must be {BLOCK_RANGE}\[10, inf\] .*, got 5\.", block_size=5),
    _case("dq-block-size-negative", dq, (_int8(2, 4), _float32(2, 2)), ValueError,
          r"block_size must be a non-negative int, got -1\.", block_size=-1),
    _case("q-block-size-negative", q, (_float32(2, 4), _float32(2, 2)), ValueError,
          r"block_size must be a non-negative int, got -1\.", block_size=-1),
    # Even for a per-tensor scale, where block_size is otherwise unused.
    _case("dq-block-size-negative-per-tensor", dq, (_int8(2, 4), 1.0), ValueError,
          r"block_size must be a non-negative int, got -1\.", block_size=-1),
    _case("dq-block-size-float", dq, (_int8(2, 4), _float32(2, 2)), TypeError,
          r"block_size must be an int, got 2\.0\.", block_size=2.0),
    _case("q-block-size-float", q, (_float32(2, 4), _float32(2, 2)), TypeError,
          r"block_size must be an int, got 2\.0\.", block_size=2.0),
    _case("q-saturate-string", q, (_float32(4), 1.0), TypeError,
          r"saturate must be a bool, got 'no'\.", output_dtype=jnp.float8_e4m3fn,
          saturate="no"),
    # --- scale shape ----------------------------------------------------------
    _case("dq-1d-scale-with-block-size", dq, (_int8(2, 4), _float32(2)), ValueError,
          r"block_size must be 0 for a 1-D per-axis scale \(blocked quantization "
          r"takes a scale of x's rank 2\), got 2\.", axis=1, block_size=2),
    _case("q-1d-scale-with-block-size", q, (_float32(2, 4), _float32(2)), ValueError,
          r"block_size must be 0 for a 1-D per-axis scale .*, got 2\.",
          axis=1, block_size=2),
    _case("dq-per-axis-wrong-length", dq, (_int8(2, 4), _float32(3)), ValueError,
          r"scale\.shape must be \(4,\) for per-axis quantization along axis 1 of "
          r"x\.shape \(2, 4\), got \(3,\)\.", axis=1),
    _case("q-per-axis-wrong-length", q, (_float32(2, 4), _float32(3)), ValueError,
          r"scale\.shape must be \(2,\) for per-axis quantization along axis 0 of "
          r"x\.shape \(2, 4\), got \(3,\)\.", axis=0),
    _case("dq-blocked-other-dims-differ", dq, (_int8(2, 4), _float32(3, 2)), ValueError,
          r"scale\.shape must be equal to x\.shape \(2, 4\) except along axis 1, "
          r"got \(3, 2\)\.", axis=1, block_size=2),
    _case("q-blocked-other-dims-differ", q, (_float32(4, 2), _float32(2, 3)), ValueError,
          r"scale\.shape must be equal to x\.shape \(4, 2\) except along axis 0, "
          r"got \(2, 3\)\.", axis=0, block_size=2),
    _case("dq-blocked-rank-differs", dq, (_int8(2, 4, 2), _float32(2, 2)), ValueError,
          r"scale\.shape must be of x's rank 3 for blocked quantization "
          r"\(block_size=2\), got \(2, 2\)\.", axis=1, block_size=2),
    _case("dq-broadcast-not-dividing", dq, (_int8(2, 4), _float32(2, 3)), ValueError,
          r"scale\.shape must be block-wise broadcastable to x\.shape \(2, 4\) .*, "
          r"got \(2, 3\)\."),
    _case("q-broadcast-not-dividing", q, (_float32(2, 4), _float32(2, 3)), ValueError,
          r"scale\.shape must be block-wise broadcastable to x\.shape \(2, 4\) .*, "
          r"got \(2, 3\)\."),
    _case("dq-broadcast-scale-larger", dq, (_int8(2, 4), _float32(2, 8)), ValueError,
          r"scale\.shape must be block-wise broadcastable to x\.shape \(2, 4\) .*, "
          r"got \(2, 8\)\."),
    # Rank-padded (docs/numerics.md, "Granularity"): (3, 2) left-padded to (1, 3, 2)
    # vs x (2, 4, 4).
    _case("dq-broadcast-rank-padded-not-dividing", dq, (_int8(2, 4, 4), _float32(3, 2)),
          ValueError,
          r"scale\.shape must be block-wise broadcastable to x\.shape \(2, 4, 4\) .*, "
          r"got \(3, 2\)\."),
    _case("dq-rank1-x-1d-scale-not-dividing", dq, (_int8(4), _float32(3)), ValueError,
          r"scale\.shape must be block-wise broadcastable to x\.shape \(4,\) .*, "
          r"got \(3,\)\."),
    _case("dq-scale-rank-above-x", dq, (_int8(2, 4), _float32(1, 2, 4)), ValueError,
          r"scale\.shape must be \(\), one element, \(x\.shape\[axis\],\), or of x's rank "
          r"for x\.shape \(2, 4\), got \(1, 2, 4\)\."),
    _case("dq-scale-rank-above-x-rank3", dq, (_int8(4, 3, 2), _float32(5, 2, 2, 2)),
          ValueError,
          r"scale\.shape must be \(\), one element, \(x\.shape\[axis\],\), or of x's rank "
          r"\(or 2\.\.2, left-padded\) for x\.shape \(4, 3, 2\), got \(5, 2, 2, 2\)\."),
    _case("dq-blocked-empty-axis", dq, (_int8(2, 0), _float32(2, 1)), ValueError,
          r"scale\.shape must be \(2, 0\) for x\.shape \(2, 0\) blocked by 2 along axis 1, "
          r"got \(2, 1\)\.", axis=1, block_size=2),
    _case("q-scale-rank-above-x", q, (_float32(4), _float32(2, 2)), ValueError,
          r"scale\.shape must be \(\), one element, .* for x\.shape \(4,\), "
          r"got \(2, 2\)\."),
    # --- implementation -----------------------------------------------------
    _case("dq-implementation-bogus", dq, (_int8(4), 1.0), ValueError,
          r"implementation must be None, 'xla' or 'pallas', got 'bogus'\.",
          implementation="bogus"),
    _case("q-implementation-bogus", q, (_float32(4), 1.0), ValueError,
          r"implementation must be None, 'xla' or 'pallas', got 'bogus'\.",
          implementation="bogus"),
    # --- quantized_add --------------------------------------------------------
    _case("add-not-broadcastable", qa, (_int8(3), 1.0, None, _int8(4), 1.0, None, 1.0),
          ValueError, r"b\.shape must be broadcastable with a\.shape \(3,\), got \(4,\)\."),
    _case("add-not-broadcastable-2d", qa,
          (_int8(2, 3), 1.0, None, _int8(3, 2), 1.0, None, 1.0), ValueError,
          r"b\.shape must be broadcastable with a\.shape \(2, 3\), got \(3, 2\)\."),
    _case("add-a-float32", qa, (_float32(3), 1.0, None, _int8(3), 1.0, None, 1.0),
          TypeError, rf"a\.dtype must be {QUANTIZED_DTYPES}, got float32\."),
    _case("add-b-float8", qa,
          (_int8(3), 1.0, None, jnp.zeros(3, jnp.float8_e4m3fn), 1.0, None, 1.0),
          TypeError, r"b\.dtype must be an integer quantized dtype, got float8_e4m3fn\."),
    _case("add-a-scale-int32", qa, (_int8(3), 1, None, _int8(3), 1.0, None, 1.0),
          TypeError, rf"a_scale\.dtype must be {SCALE_DTYPES}, got int32 \(a Python int.*\."),
    _case("add-out-scale-int32", qa, (_int8(3), 1.0, None, _int8(3), 1.0, None, 2),
          TypeError, rf"out_scale\.dtype must be {SCALE_DTYPES}, got int32 \(a Python int.*\."),
    _case("add-a-scale-per-axis", qa,
          (_int8(3), _float32(3), None, _int8(3), 1.0, None, 1.0), ValueError,
          r"a_scale\.shape must be \(\) or one element \(per-tensor\), got \(3,\)\."),
    _case("add-b-zero-point-per-axis", qa,
          (_int8(3), 1.0, None, _int8(3), 1.0, _int8(3), 1.0), ValueError,
          r"b_zero_point\.shape must be \(\) or one element \(per-tensor\), "
          r"got \(3,\)\."),
    _case("add-out-scale-per-axis", qa,
          (_int8(3), 1.0, None, _int8(3), 1.0, None, _float32(2)), ValueError,
          r"out_scale\.shape must be \(\) or one element \(per-tensor\), got \(2,\)\."),
    _case("add-out-zero-point-per-axis", qa,
          (_int8(3), 1.0, None, _int8(3), 1.0, None, 1.0, _int8(2)), ValueError,
          r"out_zero_point\.shape must be \(\) or one element \(per-tensor\), "
          r"got \(2,\)\."),
    _case("add-b-zero-point-dtype", qa,
          (_int8(3), 1.0, None, _int8(3), 1.0, jnp.uint8(0), 1.0), TypeError,
          r"b_zero_point\.dtype must be int8 \(the quantized dtype\), got uint8\."),
    _case("add-output-dtype-conflict", qa,
          (_int8(3), 1.0, None, _int8(3), 1.0, None, 1.0, jnp.int8(0)), ValueError,
          r"output_dtype must be None or out_zero_point's dtype int8, got uint8\.",
          output_dtype=jnp.uint8),
    _case("add-output-float8", qa, (_int8(3), 1.0, None, _int8(3), 1.0, None, 1.0),
          TypeError, r"output_dtype must be an integer quantized dtype, got float8_e4m3fn\.",
          output_dtype=jnp.float8_e4m3fn),
    _case("add-implementation-bogus", qa,
          (_int8(3), 1.0, None, _int8(3), 1.0, None, 1.0), ValueError,
          r"implementation must be None, 'xla' or 'pallas', got 'bogus'\.",
          implementation="bogus"),
    # --- dynamic_quantize_linear ----------------------------------------------
    _case("dynamic-uint8-symmetric", dyn, (_float32(4),), ValueError,
          r"dtype must be a signed integer dtype when symmetric=True, got uint8\.",
          symmetric=True),
    _case("dynamic-uint4-symmetric", dyn, (_float32(4),), ValueError,
          r"dtype must be a signed integer dtype when symmetric=True, got uint4\.",
          dtype=jnp.uint4, symmetric=True),
    _case("dynamic-x-int8", dyn, (_int8(4),), TypeError,
          r"x\.dtype must be a float dtype .*, got int8\."),
    _case("dynamic-dtype-float8", dyn, (_float32(4),), TypeError,
          r"dtype must be an integer quantized dtype, got float8_e4m3fn\.",
          dtype=jnp.float8_e4m3fn),
    _case("dynamic-dtype-float32", dyn, (_float32(4),), TypeError,
          rf"dtype must be {QUANTIZED_DTYPES}, got .*float32.*\.", dtype=jnp.float32),
    _case("dynamic-axis-out-of-range", dyn, (_float32(2, 3),), ValueError,
          r"axis must be an int in \[-2, 2\) for an input of rank 2, got 2\.", axis=2),
    _case("dynamic-axis-rank0", dyn, (jnp.float32(1),), ValueError,
          r"axis must be an int in \[0, 0\) for an input of rank 0, got 0\.", axis=0),
    _case("dynamic-block-size-without-axis", dyn, (_float32(2, 4),), ValueError,
          r"block_size must be 0 when axis is None \(one scale for the tensor\), got 2\.",
          block_size=2),
    _case("dynamic-block-size-negative", dyn, (_float32(2, 4),), ValueError,
          r"block_size must be a non-negative int, got -1\.", axis=1, block_size=-1),
    _case("dynamic-implementation-bogus", dyn, (_float32(4),), ValueError,
          r"implementation must be None, 'xla' or 'pallas', got 'bogus'\.",
          implementation="bogus"),
    # --- packed 4-bit storage -----------------------------------------------
    _case("pack-int8", jq.pack_int4, (_int8(4),), TypeError,
          r"x\.dtype must be int4, uint4 or float4_e2m1fn, got int8\."),
    _case("pack-uint8", jq.pack_int4, (jnp.zeros(4, jnp.uint8),), TypeError,
          r"x\.dtype must be int4, uint4 or float4_e2m1fn, got uint8\."),
    _case("pack-float32", jq.pack_int4, (_float32(4),), TypeError,
          rf"x\.dtype must be {QUANTIZED_DTYPES}, got float32\."),
    _case("unpack-packed-too-short", jq.unpack_int4, (jnp.zeros(1, jnp.uint8),),
          ValueError,
          r"packed\.shape must be \(2,\) to unpack into shape \(4,\), got \(1,\)\.",
          shape=(4,), dtype=jnp.int4),
    _case("unpack-packed-too-long", jq.unpack_int4, (jnp.zeros(3, jnp.uint8),),
          ValueError,
          r"packed\.shape must be \(2,\) \(flat\) or \(2, 1\) \(rows\) to unpack into shape "
          r"\(2, 2\), got \(3,\)\.",
          shape=(2, 2), dtype=jnp.uint4),
    # Odd sizes round up: 5 elements take 3 bytes.
    _case("unpack-packed-odd-size", jq.unpack_int4, (jnp.zeros(2, jnp.uint8),),
          ValueError,
          r"packed\.shape must be \(3,\) to unpack into shape \(5,\), got \(2,\)\.",
          shape=(5,), dtype=jnp.int4),
    _case("unpack-packed-2d", jq.unpack_int4, (jnp.zeros((1, 2), jnp.uint8),),
          ValueError,
          r"packed\.shape must be \(2,\) to unpack into shape \(4,\), got \(1, 2\)\.",
          shape=(4,), dtype=jnp.int4),
    _case("unpack-packed-int8", jq.unpack_int4, (_int8(2),), TypeError,
          r"packed\.dtype must be uint8, got int8\.", shape=(4,), dtype=jnp.int4),
    _case("unpack-packed-uint4", jq.unpack_int4, (jnp.zeros(4, jnp.uint4),), TypeError,
          r"packed\.dtype must be uint8, got uint4\.", shape=(4,), dtype=jnp.uint4),
    _case("unpack-dtype-int8", jq.unpack_int4, (jnp.zeros(2, jnp.uint8),), TypeError,
          r"dtype must be int4, uint4 or float4_e2m1fn, got int8\.",
          shape=(4,), dtype=jnp.int8),
    _case("unpack-dtype-int2", jq.unpack_int4, (jnp.zeros(2, jnp.uint8),), TypeError,
          r"dtype must be int4, uint4 or float4_e2m1fn, got int2\.",
          shape=(4,), dtype=jnp.int2),
    _case("unpack-dtype-float32", jq.unpack_int4, (jnp.zeros(2, jnp.uint8),), TypeError,
          rf"dtype must be {QUANTIZED_DTYPES}, got .*float32.*\.",
          shape=(4,), dtype=jnp.float32),
    # dequantize_linear of packed 4-bit bytes checks them as unpack_int4 does.
    _case("dq-packed-too-short", dq, (jnp.zeros(3, jnp.uint8), 1.0), ValueError,
          r"packed\.shape must be \(4,\) \(flat\) or \(2, 2\) \(rows\) to unpack into shape "
          r"\(2, 4\), got \(3,\)\.",
          packed_shape=(2, 4)),
    _case("dq-packed-int8-bytes", dq, (_int8(4), 1.0), TypeError,
          r"packed\.dtype must be uint8, got int8\.", packed_shape=(2, 4)),
    _case("dq-packed-dtype-int8", dq, (jnp.zeros(4, jnp.uint8), 1.0), TypeError,
          r"packed_dtype must be int2, uint2, int4, uint4.* float4_e2m1fn.*, got int8\.",
          packed_shape=(2, 4), packed_dtype=jnp.int8),
    _case("dq-packed-shape-negative", dq, (jnp.zeros(4, jnp.uint8), 1.0), TypeError,
          r"packed_shape must be a sequence of non-negative ints, got \(2, -4\)\.",
          packed_shape=(2, -4)),
    _case("dq-packed-zero-point-dtype", dq,
          (jnp.zeros(4, jnp.uint8), 1.0, jnp.int4(0)), TypeError,
          r"zero_point\.dtype must be uint4 \(the quantized dtype\), got int4\.",
          packed_shape=(2, 4), packed_dtype=jnp.uint4),
    # --- fake quantization --------------------------------------------------
    _case("fq-x-int8", fq, (_int8(4), 1.0), TypeError,
          r"x\.dtype must be a float dtype .*, got int8\."),
    _case("fq-dtype-float32", fq, (_float32(4), 1.0), TypeError,
          rf"dtype must be {QUANTIZED_DTYPES}, got float32\.", dtype=jnp.float32),
    _case("fq-dtype-int32", fq, (_float32(4), 1.0), TypeError,
          r"dtype must be a quantized dtype of at most 16 bits \(float32 cannot hold "
          r"every 32-bit integer\), got int32\.", dtype=jnp.int32),
    _case("fq-zero-point-dtype", fq, (_float32(4), 1.0, jnp.uint8(0)), TypeError,
          r"zero_point\.dtype must be int8 \(the quantized dtype\), got uint8\."),
    _case("fq-gradient", fq, (_float32(4), 1.0), ValueError,
          r"gradient must be 'masked' or 'identity', got 'lsq'\.", gradient="lsq"),
    _case("fq-narrow-range-float8", fq, (_float32(4), 1.0), ValueError,
          r"narrow_range must be False for the float dtype float8_e4m3fn \(its range is "
          r"symmetric\), got True\.", dtype=jnp.float8_e4m3fn, narrow_range=True),
    _case("fq-narrow-range-string", fq, (_float32(4), 1.0), TypeError,
          r"narrow_range must be a bool, got 'yes'\.", narrow_range="yes"),
    _case("fq-scale-shape", fq, (_float32(2, 3), _float32(4)), ValueError,
          r"scale\.shape must be \(3,\) for per-axis quantization along axis 1 .*"),
    _case("fql-dtype-float8", fql, (_float32(4), 1.0, 0.0), TypeError,
          r"dtype must be an integer quantized dtype, got float8_e4m3fn\.",
          dtype=jnp.float8_e4m3fn),
    _case("fql-zero-point-int8", fql, (_float32(4), 1.0, jnp.int8(0)), TypeError,
          r"zero_point\.dtype must be a float dtype \(float32, float16 or bfloat16; it "
          r"is learned\), got int8\."),
    _case("fql-scale-e8m0", fql, (_float32(4), jnp.ones((), jnp.float8_e8m0fnu), 0.0),
          TypeError, r"scale\.dtype must be a float dtype .*, got float8_e8m0fnu\."),
    _case("fql-zero-point-shape", fql, (_float32(2, 3), _float32(3), _float32(2)),
          ValueError, r"zero_point\.shape must be equal to scale\.shape \(3,\), got \(2,\)\."),
    _case("fql-grad-factor-string", fql, (_float32(4), 1.0, 0.0), TypeError,
          r"grad_factor must be a Python float, got 'lsq'\.", grad_factor="lsq"),
    _case("fqd-dtype-float8", fqd, (_float32(4),), TypeError,
          r"dtype must be an integer quantized dtype, got float8_e4m3fn\.",
          dtype=jnp.float8_e4m3fn),
    _case("fqd-dtype-int32", fqd, (_float32(4),), TypeError,
          r"dtype must be a quantized dtype of at most 16 bits .*, got int32\.",
          dtype=jnp.int32),
    _case("fqd-symmetric-uint8", fqd, (_float32(4),), ValueError,
          r"dtype must be a signed integer dtype when symmetric=True, got uint8\.",
          dtype=jnp.uint8, symmetric=True),
    _case("fqd-gradient", fqd, (_float32(4),), ValueError,
          r"gradient must be 'masked' or 'identity', got None\.", gradient=None),
    # --- host values the jit boundary would rewrite silently (issue 13) -------
    # Zero points are given by keyword here, so under an outer jit they are
    # closed over as the caller's Python values (a traced int has no value).
    _case("q-zero-point-python-int-above-uint8", q, (_float32(4), 1.0), ValueError,
          r"zero_point must be in \[0, 255\] for uint8, got 300\.", zero_point=300),
    _case("q-zero-point-python-int-below-uint8", q, (_float32(4), 1.0), ValueError,
          r"zero_point must be in \[0, 255\] for uint8, got -1\.", zero_point=-1),
    _case("q-zero-point-python-int-int4", q, (_float32(4), 1.0), ValueError,
          r"zero_point must be in \[-8, 7\] for int4, got 8\.", zero_point=8,
          output_dtype=jnp.int4),
    _case("dq-zero-point-python-int-int8", dq, (_int8(4), 1.0), ValueError,
          r"zero_point must be in \[-128, 127\] for int8, got 1000\.", zero_point=1000),
    _case("dq-zero-point-python-int-packed", dq, (jnp.zeros(2, jnp.uint8), 1.0), ValueError,
          r"zero_point must be in \[-8, 7\] for int4, got 9\.", zero_point=9,
          packed_shape=(4,)),
    _case("fq-zero-point-python-int", fq, (_float32(4), 1.0), ValueError,
          r"zero_point must be in \[-128, 127\] for int8, got 128\.", zero_point=128),
    _case("qa-out-zero-point-python-int", qa,
          (_int8(4), 1.0, None, _int8(4), 1.0, None, 1.0), ValueError,
          r"out_zero_point must be in \[-128, 127\] for int8, got 300\.", out_zero_point=300),
    _case("qa-a-zero-point-python-int", qa,
          (jnp.zeros(4, jnp.uint8), 1.0), ValueError,
          r"a_zero_point must be in \[0, 255\] for uint8, got -3\.", a_zero_point=-3,
          b=_int8(4), b_scale=1.0, b_zero_point=None, out_scale=1.0),
    _case("q-zero-point-numpy-int64", q, (_float32(4), 1.0), TypeError,
          rf"zero_point\.dtype must be {QUANTIZED_DTYPES}, got int64\.",
          zero_point=np.int64(3)),
    _case("dq-zero-point-numpy-float64", dq, (_int8(4), 1.0), TypeError,
          rf"zero_point\.dtype must be {QUANTIZED_DTYPES}, got float64\.",
          zero_point=np.zeros((), np.float64)),
    _case("q-block-size-with-per-tensor-scale", q, (_float32(2, 8), _float32()), ValueError,
          r"block_size must be 0 for a per-tensor scale of shape \(\) \(blocked quantization "
          r"takes a scale of x's rank 2\), got 4\.", block_size=4),
    _case("dq-block-size-with-one-element-scale", dq, (_int8(8), _float32(1, 1)), ValueError,
          r"block_size must be 0 for a per-tensor scale of shape \(1, 1\) \(blocked "
          r"quantization takes a scale of x's rank 1\), got 8\.", block_size=8),
    _case("fql-grad-factor-nan", fql, (_float32(4), 1.0, 0.0), ValueError,
          r"grad_factor must be finite, got nan\.", grad_factor=float("nan")),
    _case("fql-grad-factor-inf", fql, (_float32(4), 1.0, 0.0), ValueError,
          r"grad_factor must be finite, got inf\.", grad_factor=float("inf")),
    # Unhashable or None static options: a message naming the option, not
    # JAX's "Non-hashable static arguments".
    _case("q-axis-none", q, (_float32(2, 4), _float32(4)), TypeError,
          r"axis must be an int, got None\.", axis=None),
    _case("dq-block-size-list", dq, (_int8(4), 1.0), TypeError,
          r"block_size must be an int, got \[1\]\.", block_size=[1]),
    _case("q-output-dtype-list", q, (_float32(4), 1.0), TypeError,
          r"output_dtype must be a dtype, got \['int8'\]\.", output_dtype=["int8"]),
    _case("dyn-dtype-dict", dyn, (_float32(4),), TypeError,
          r"dtype must be a dtype, got \{\}\.", dtype={}),
    _case("dyn-axis-list", dyn, (_float32(4),), TypeError,
          r"axis must be an int, got \[0\]\.", axis=[0]),
    _case("dyn-implementation-list", dyn, (_float32(4),), ValueError,
          r"implementation must be None, 'xla' or 'pallas', got \['xla'\]\.",
          implementation=["xla"]),
    _case("qa-output-dtype-list", qa, (_int8(4), 1.0, None, _int8(4), 1.0, None, 1.0),
          TypeError, r"output_dtype must be a dtype, got \[\]\.", output_dtype=[]),
    _case("fq-gradient-list", fq, (_float32(4), 1.0), ValueError,
          r"gradient must be 'masked' or 'identity', got \['masked'\]\.",
          gradient=["masked"]),
    _case("fq-narrow-range-none", fq, (_float32(4), 1.0), TypeError,
          r"narrow_range must be a bool, got None\.", narrow_range=None),
    _case("fql-block-size-none", fql, (_float32(4), 1.0, 0.0), TypeError,
          r"block_size must be an int, got None\.", block_size=None),
    _case("fqd-symmetric-list", fqd, (_float32(4),), TypeError,
          r"symmetric must be a bool, got \[\]\.", symmetric=[]),
    _case("dq-packed-shape-dict", dq, (jnp.zeros(2, jnp.uint8), 1.0), TypeError,
          r"packed_shape must be a sequence of non-negative ints, got \{\}\.",
          packed_shape={}),
    _case("unpack-shape-none", jq.unpack, (jnp.zeros(2, jnp.uint8),), TypeError,
          r"shape must be a sequence of non-negative ints, got None\.", shape=None,
          dtype=jnp.int4),
]

assert len({case.id for case in ERROR_CASES}) == len(ERROR_CASES), "duplicate ids"


def _call(case: ErrorCase, mode: str) -> Any:
  if mode == "eager":
    return case.function(*case.args, **case.static)
  traced = jax.jit(lambda *args: case.function(*args, **case.static))
  if mode == "outer_jit":
    return traced(*case.args)
  if mode == "trace_only":
    # Tracing builds a jaxpr and nothing else: raising here proves the error
    # comes before lowering, so it can never be an XLA crash.
    return traced.trace(*case.args)
  raise ValueError(mode)


@pytest.mark.parametrize("mode", ["eager", "outer_jit", "trace_only"])
@pytest.mark.parametrize("case", ERROR_CASES, ids=str)
def test_bad_argument_raises(case, mode):
  # (?m): under jit, pytest's match also sees JAX's traceback-filtering note,
  # which follows the message on later lines.
  with pytest.raises(case.error, match=rf"(?m)\A{case.name}: {case.match}$"):
    _call(case, mode)


@pytest.mark.parametrize("case", ERROR_CASES, ids=str)
def test_message_format(case):
  with pytest.raises((ValueError, TypeError)) as info:
    _call(case, "eager")
  assert type(info.value) is case.error
  # str() is the message alone; JAX's traceback note lives in __notes__.
  message = str(info.value)
  assert MESSAGE_FORMAT.fullmatch(message), message
  assert message.startswith(f"{case.name}: "), message


# --- arguments that look odd but are valid, and must not raise ---------------


@pytest.mark.parametrize("mode", ["eager", "outer_jit"])
@pytest.mark.parametrize(
    "function, x, scale, zero_point, static, expected",
    [
        # Per-tensor ignores axis (docs/numerics.md, "Granularity"): the default
        # axis=1 on a rank-0 x is out of range and must not matter.
        (dq, jnp.int8(3), jnp.float32(2), jnp.int8(1), {}, np.float32(4)),
        (q, jnp.float32(5), jnp.float32(2), jnp.int8(1), {}, np.int8(3)),
        (dq, jnp.int8(3), 2.0, None, {"axis": -7}, np.float32(6)),
        (q, jnp.float32(5), 2.0, None, {"axis": 99}, np.uint8(2)),
        # A one-element scale of any rank <= x's is per-tensor: axis unused.
        (dq, jnp.full((2, 3), 3, jnp.int8), jnp.full((1, 1), 2.0), None,
         {"axis": 99}, np.full((2, 3), 6, np.float32)),
        (dq, jnp.full((2, 3), 3, jnp.int8), jnp.full((1,), 2.0), None,
         {"axis": -9}, np.full((2, 3), 6, np.float32)),
        # Rank-1 x with a 1-D scale is the same-rank case: axis unused too.
        (dq, jnp.full((4,), 3, jnp.int8), jnp.full((2,), 2.0), None,
         {"axis": 5}, np.full((4,), 6, np.float32)),
    ],
    ids=[
        "dq-rank0-default-axis", "q-rank0-default-axis", "dq-rank0-axis-negative",
        "q-rank0-axis-99", "dq-one-element-2d-scale-axis-99",
        "dq-one-element-1d-scale-axis-negative", "dq-rank1-1d-scale-axis-5",
    ],
)
def test_per_tensor_does_not_validate_axis(
    function, x, scale, zero_point, static, expected, mode
):
  call = lambda x, scale, zero_point: function(x, scale, zero_point, **static)
  if mode == "outer_jit":
    call = jax.jit(call)
  y = call(x, scale, zero_point)
  assert y.dtype == expected.dtype
  np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize(
    "length, blocks, block_size",
    # Both ends of ONNX's range [ceil(D/S), ceil(D/(S-1)) - 1].
    [(10, 3, 4), (10, 2, 5), (10, 2, 9), (10, 1, 10), (10, 1, 1000), (8, 4, 2)],
)
def test_block_size_at_range_edges_is_accepted(length, blocks, block_size):
  x = jnp.arange(2 * length, dtype=jnp.int8).reshape(2, length)
  scale = jnp.arange(1, 2 * blocks + 1, dtype=jnp.float32).reshape(2, blocks)
  y = dq(x, scale, axis=1, block_size=block_size)
  block = np.arange(length) // block_size
  expected = np.asarray(x, np.float32) * np.asarray(scale)[:, block]
  np.testing.assert_array_equal(y, expected)


# --- float64 under x64: the documented scale dtypes exclude it --------------


@pytest.mark.parametrize(
    "function, x",
    [(dq, np.zeros(4, np.int8)), (q, np.zeros(4, np.float32))],
    ids=["dq", "q"],
)
def test_float64_scale_rejected_under_x64(function, x):
  # Without x64, float64 inputs are canonicalised to float32 before jaxquant
  # sees them, so the check only has something to reject under x64.
  with jax.enable_x64(True):
    with pytest.raises(
        TypeError, match=rf"(?m)\A{function.__name__}: scale\.dtype must be "
        rf"{SCALE_DTYPES}, got float64\.$"
    ):
      function(x, np.float64(0.5))


def test_int64_x_rejected_under_x64():
  with jax.enable_x64(True):
    with pytest.raises(
        TypeError,
        match=rf"(?m)\Adequantize_linear: x\.dtype must be {QUANTIZED_DTYPES}, got int64\.$",
    ):
      dq(np.zeros(4, np.int64), np.float32(0.5))


# --- checks that were once missing ------------------------------------------


@pytest.mark.parametrize(
    "zero_point", [jnp.float32(0), jnp.bool_(False)], ids=["float32", "bool"]
)
def test_quantize_float_zero_point_names_zero_point(zero_point):
  with pytest.raises(TypeError, match=r"\Aquantize_linear: zero_point\.dtype must be"):
    q(_float32(4), 1.0, zero_point)


@pytest.mark.parametrize(
    "args, argument",
    [
        ((_int8(3), 1.0, jnp.uint8(0), _int8(3), 1.0, None, 1.0), "a_zero_point"),
        ((_int8(3), 1.0, None, _int8(3), 1.0, jnp.uint8(0), 1.0), "b_zero_point"),
        ((_int8(3), 1.0, None, _int8(3), 1.0, None, 1.0, jnp.float32(0)),
         "out_zero_point"),
    ],
    ids=["a", "b", "out-float"],
)
def test_quantized_add_names_its_zero_point(args, argument):
  with pytest.raises(TypeError, match=rf"\Aquantized_add: {argument}\.dtype must be"):
    qa(*args)


@pytest.mark.parametrize(
    "call",
    [
        lambda: dq(_int8(2), 1.0, 3.7),
        lambda: q(_float32(2), 1.0, 3.7, output_dtype=jnp.int8),
        lambda: qa(_int8(2), 1.0, 3.7, _int8(2), 1.0, None, 1.0),
    ],
    ids=["dq", "q", "add"],
)
def test_python_float_zero_point_rejected(call):
  with pytest.raises(TypeError, match=r"zero_point"):
    call()


def test_python_float_scale_accepted_under_x64():
  with jax.enable_x64(True):
    y = dq(jnp.array([0, 3, 255], jnp.uint8), 0.5, 128)
  np.testing.assert_array_equal(y, np.array([-64.0, -62.5, 63.5], np.float32))


@pytest.mark.parametrize(
    "call",
    [
        lambda: q(_float32(4), 1.0, output_dtype=jnp.float32),
        lambda: jq.unpack_int4(jnp.zeros(2, jnp.uint8), (4,), jnp.float32),
    ],
    ids=["q-output_dtype", "unpack-dtype"],
)
def test_dtype_arguments_printed_by_name(call):
  with pytest.raises(TypeError) as info:
    call()
  assert "<class" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "shape", [(-1, -4), (4.0,), (-4,)], ids=["negative-dims", "float-dim", "negative"]
)
def test_unpack_bad_shape_named(shape):
  with pytest.raises((ValueError, TypeError)) as info:
    jq.unpack_int4(jnp.zeros(2, jnp.uint8), shape, jnp.int4)
  assert re.fullmatch(r"unpack_int4: shape must be .+, got .+\.", str(info.value))


@pytest.mark.parametrize("function", [q, dq, fq])
def test_axis_none_is_per_tensor(function):
  # axis=None says "no axis", as in dynamic_quantize_linear: fine for a
  # per-tensor scale, and an error naming axis for a per-axis one.
  x = _int8(2, 4) if function is dq else _float32(2, 4)
  np.testing.assert_array_equal(function(x, 0.5, axis=None), function(x, 0.5))
  with pytest.raises(TypeError, match=r"axis must be an int, got None\."):
    function(x, _float32(4), axis=None)
