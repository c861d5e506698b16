"""pack / unpack (and pack_int4 / unpack_int4) against ONNX's own packing, and packed dequantize.

The layout is ONNX's TensorProto ``raw_data``: four int2/uint2 values per byte
(element 4i in bits 0-1, 4i+1 in bits 2-3, ...), two int4/uint4/float4_e2m1fn
values per byte (element 2i in the low nibble), zero bits after the last
element. float6 (four codes in three bytes) is tested in test_float6.py. ``onnx.numpy_helper.from_array`` writes those bytes (its
``_pack_2bitx4`` and ``_pack_4bitx2``) and ``to_array`` reads them (its
``_unpack_2bit`` and ``_unpack_4bit``); both sides are checked.

onnxruntime and int2: onnxruntime 1.32.0 runs int2 and uint2 DequantizeLinear
on its CPU provider at opset 25, the opset that added the types, and refuses
a model that declares opset 21-24 at load ("Type 'tensor(int2)' of input
parameter (x) of operator (DequantizeLinear) ... is invalid"). It reads int2
and uint2 initializers from ``raw_data`` in the layout above, so it runs on the
bytes of :func:`jaxquant.pack` as they are; per-tensor, per-axis and blocked
(ragged included) scales, with zero points packed the same way, agree bit for
bit with jaxquant and with ``onnx.reference`` (1.23.2).
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
from onnx import helper
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
import onnxruntime
import pytest

import jaxquant as jq
from quant_testing import assert_bits_equal
from quant_testing import bit_width
from quant_testing import dtype_name
from quant_testing import FOUR_BIT_DTYPES
from quant_testing import IMPLEMENTATIONS
from quant_testing import SUB_BYTE_DTYPES
from quant_testing import SUB_BYTE_INTEGER_DTYPES
from quant_testing import TWO_BIT_DTYPES
# Ranks 0-4, empty, and sizes that leave the last byte part full.
EDGE_SHAPES = [(), (0,), (1,), (2,), (3,), (7,), (2, 3), (3, 0, 2), (4, 5), (1, 1, 9)]


def _random(dtype, shape, rng):
  """Every code of the dtype equally likely (float4's NaN-free codes are all values)."""
  bits = bit_width(dtype)
  codes = rng.integers(0, 2**bits, shape).astype(np.uint8)
  unsigned = ml_dtypes.uint2 if bits == 2 else ml_dtypes.uint4
  return codes.astype(unsigned).view(dtype)


def _codes(x):
  return np.asarray(x).view(np.uint8)


def _check_against_onnx(x, dtype):
  packed = jq.pack(x)
  assert packed.dtype == jnp.uint8
  assert packed.shape == (-(-x.size // (8 // bit_width(dtype))),)
  tensor = numpy_helper.from_array(x)
  np.testing.assert_array_equal(packed, np.frombuffer(tensor.raw_data, np.uint8))
  unpacked = jq.unpack(packed, x.shape, dtype)
  assert unpacked.dtype == dtype and unpacked.shape == x.shape
  np.testing.assert_array_equal(_codes(unpacked), _codes(x))
  # ONNX reads the bytes written here as the same values.
  ours = helper.make_tensor("x", tensor.data_type, x.shape, np.asarray(packed).tobytes(),
                            raw=True)
  np.testing.assert_array_equal(_codes(numpy_helper.to_array(ours)), _codes(x))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES, ids=dtype_name)
@hypothesis.given(shape=st.lists(st.integers(0, 6), max_size=4), seed=st.integers(0, 2**32 - 1))
@hypothesis.settings(max_examples=25)
def test_pack_matches_onnx_layout_and_round_trips(dtype, shape, seed):
  _check_against_onnx(_random(dtype, tuple(shape), np.random.default_rng(seed)), dtype)


@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES, ids=dtype_name)
def test_pack_edge_shapes_match_onnx(dtype, shape):
  _check_against_onnx(_random(dtype, shape, np.random.default_rng(len(shape))), dtype)


@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES, ids=dtype_name)
def test_pack_and_unpack_under_jit_and_vmap(dtype):
  x = _random(dtype, (3, 8), np.random.default_rng(3))
  packed = jax.jit(jq.pack)(x)
  unpack = jax.jit(jq.unpack, static_argnums=(1, 2))
  np.testing.assert_array_equal(_codes(unpack(packed, (3, 8), dtype)), _codes(x))
  rows = jax.vmap(jq.pack)(x)  # 8 elements of b bits fill b whole bytes per row
  assert rows.shape == (3, bit_width(dtype))
  np.testing.assert_array_equal(rows.reshape(-1), packed)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES, ids=dtype_name)
def test_codes_one_per_byte_stand_for_any_sub_byte_dtype(dtype, implementation):
  # uint8 bit patterns, one per byte, with the dtype given apart: the form
  # float6 takes in JAX, accepted for every sub-byte dtype alike.
  rng = np.random.default_rng(5)
  x = _random(dtype, (3, 8), rng)
  codes = jnp.asarray(_codes(x) & ((1 << bit_width(dtype)) - 1))
  np.testing.assert_array_equal(jq.pack(codes, dtype=dtype), jq.pack(x))
  np.testing.assert_array_equal(jq.pack(jnp.asarray(x), dtype=dtype), jq.pack(x))
  scale = jnp.asarray(rng.uniform(0.01, 2.0, (3,)).astype(np.float32))
  zero_point = jnp.asarray(_random(dtype, (3,), rng))
  expected = jq.dequantize_linear(x, scale, zero_point, axis=0, implementation="xla")
  assert_bits_equal(
      jq.dequantize_linear(codes, scale, zero_point, axis=0, packed_dtype=dtype,
                           implementation=implementation), expected)
  assert_bits_equal(
      jax.jit(functools.partial(jq.dequantize_linear, axis=0, packed_dtype=dtype,
                                implementation=implementation))(codes, scale, zero_point),
      expected)


def test_last_byte_holds_zero_bits_after_the_last_element():
  # The bytes onnx.helper.make_tensor writes for the same values.
  np.testing.assert_array_equal(jq.pack(jnp.array([1, -2, 0, -1, 1], jnp.int2)), [201, 1])
  np.testing.assert_array_equal(jq.pack(jnp.array([1, 2, 3], jnp.uint2)), [0b111001])
  np.testing.assert_array_equal(jq.pack(jnp.array([1, -1, 7], jnp.int4)), [0xF1, 0x07])
  np.testing.assert_array_equal(jq.pack_int4(jnp.array([1, -1, 7], jnp.int4)), [0xF1, 0x07])


def test_unpack_ignores_the_bits_after_the_last_element():
  # As ONNX's _unpack_2bit and _unpack_4bit do.
  np.testing.assert_array_equal(jq.unpack(jnp.array([0xFF], jnp.uint8), (1,), jnp.int2), [-1])
  np.testing.assert_array_equal(
      jq.unpack(jnp.array([0xFF], jnp.uint8), (3,), jnp.uint2), [3, 3, 3])
  np.testing.assert_array_equal(jq.unpack(jnp.array([0xF1], jnp.uint8), (1,), jnp.int4), [1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FOUR_BIT_DTYPES, ids=dtype_name)
@hypothesis.given(shape=st.lists(st.integers(0, 5), max_size=3), seed=st.integers(0, 2**32 - 1))
@hypothesis.settings(max_examples=10)
def test_pack_int4_is_pack_for_4_bit_dtypes(dtype, shape, seed):
  x = _random(dtype, tuple(shape), np.random.default_rng(seed))
  packed = jq.pack_int4(x)
  np.testing.assert_array_equal(packed, jq.pack(x))
  np.testing.assert_array_equal(_codes(jq.unpack_int4(packed, x.shape, dtype)), _codes(x))


def test_unpack_onnx_bytes_and_dequantize():
  weight = np.array([[-8, 7, 0], [3, -1, 5]], ml_dtypes.int4)
  raw = np.frombuffer(numpy_helper.from_array(weight).raw_data, np.uint8)
  unpacked = jax.jit(jq.unpack_int4, static_argnums=(1, 2))(raw, (2, 3), jnp.int4)
  y = jq.dequantize_linear(unpacked, jnp.array([0.5, 2.0]), axis=0)
  np.testing.assert_array_equal(y, [[-4, 3.5, 0], [6, -2, 10]])


def test_packed_shape_may_be_any_sequence_of_ints():
  # ONNX hands shapes over as TensorProto.dims, a protobuf repeated field:
  # neither a tuple nor hashable, which jit's static arguments require.
  tensor = numpy_helper.from_array(np.array([[-8, 7, 0], [3, -1, 5]], ml_dtypes.int4))
  raw = np.frombuffer(tensor.raw_data, np.uint8)
  expected = jq.dequantize_linear(raw, 0.5, axis=0, packed_shape=(2, 3))
  for shape in (tensor.dims, list(tensor.dims)):
    np.testing.assert_array_equal(
        jq.dequantize_linear(raw, 0.5, axis=0, packed_shape=shape), expected
    )
  np.testing.assert_array_equal(expected, [[-4, 3.5, 0], [1.5, -0.5, 2.5]])


# --- errors, in the library's one format ------------------------------------------

SUB_BYTE_NAMES = "int2, uint2, int4, uint4, float4_e2m1fn, float6_e2m3fn or float6_e3m2fn"


@pytest.mark.parametrize("call, error, message", [
    (lambda: jq.pack(jnp.zeros(4, jnp.int8)), TypeError,
     f"pack: x.dtype must be {SUB_BYTE_NAMES} (or uint8 codes with dtype=), got int8."),
    (lambda: jq.pack(jnp.zeros(4, jnp.float8_e4m3fn)), TypeError,
     f"pack: x.dtype must be {SUB_BYTE_NAMES} (or uint8 codes with dtype=), got "
     "float8_e4m3fn."),
    (lambda: jq.pack_int4(jnp.zeros(4, jnp.int2)), TypeError,
     "pack_int4: x.dtype must be int4, uint4 or float4_e2m1fn, got int2."),
    (lambda: jq.unpack(jnp.zeros(2, jnp.uint8), (4,), jnp.int2), ValueError,
     "unpack: packed.shape must be (1,) to unpack into shape (4,), got (2,)."),
    (lambda: jq.unpack(jnp.zeros(1, jnp.uint8), (5,), jnp.uint2), ValueError,
     "unpack: packed.shape must be (2,) to unpack into shape (5,), got (1,)."),
    (lambda: jq.unpack(jnp.zeros((1, 1), jnp.uint8), (2, 2), jnp.int2), ValueError,
     "unpack: packed.shape must be (1,) (flat) or (2, 1) (rows) to unpack into shape (2, 2), "
     "got (1, 1)."),
    (lambda: jq.unpack(jnp.zeros(1, jnp.int8), (4,), jnp.int2), TypeError,
     "unpack: packed.dtype must be uint8, got int8."),
    (lambda: jq.unpack(jnp.zeros(1, jnp.uint8), (4,), jnp.int8), TypeError,
     f"unpack: dtype must be {SUB_BYTE_NAMES}, got int8."),
    (lambda: jq.unpack(jnp.zeros(1, jnp.uint8), (-4,), jnp.int2), TypeError,
     "unpack: shape must be a sequence of non-negative ints, got (-4,)."),
    (lambda: jq.unpack_int4(jnp.zeros(1, jnp.uint8), (4,), jnp.uint2), TypeError,
     "unpack_int4: dtype must be int4, uint4 or float4_e2m1fn, got uint2."),
    (lambda: jq.dequantize_linear(jnp.zeros(3, jnp.uint8), 1.0, packed_shape=(2, 4),
                                  packed_dtype=jnp.int2), ValueError,
     "dequantize_linear: packed.shape must be (2,) (flat) or (2, 1) (rows) to unpack into "
     "shape (2, 4), got (3,)."),
    (lambda: jq.dequantize_linear(jnp.zeros(2, jnp.int8), 1.0, packed_shape=(2, 4),
                                  packed_dtype=jnp.int2), TypeError,
     "dequantize_linear: packed.dtype must be uint8, got int8."),
    (lambda: jq.dequantize_linear(jnp.zeros(2, jnp.uint8), 1.0, packed_shape=(2, 4),
                                  packed_dtype=jnp.int8), TypeError,
     f"dequantize_linear: packed_dtype must be {SUB_BYTE_NAMES}, got int8."),
], ids=[
    "pack-int8", "pack-float8", "pack_int4-int2", "unpack-int2-too-long",
    "unpack-uint2-too-short", "unpack-2d", "unpack-int8-bytes", "unpack-dtype-int8",
    "unpack-negative-shape", "unpack_int4-uint2", "dq-int2-too-long", "dq-int2-int8-bytes",
    "dq-packed-dtype-int8",
])
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_packed_errors(call, error, message, under_jit):
  with pytest.raises(error) as info:
    jax.jit(call)() if under_jit else call()
  assert str(info.value) == message


# --- dequantize_linear of packed bytes == of the unpacked array -----------------------

# (shape, scale shape, axis/block_size); the last dim a multiple of 4 (and
# blocks along it too) lets the Pallas kernel read the bytes, the others are
# unpacked by XLA first.
LAYOUTS = {
    "per-tensor": ((8, 12), (), {}),
    "per-axis 0": ((8, 12), (8,), {"axis": 0}),
    "per-axis last": ((6, 12), (12,), {"axis": 1}),
    "blocked last 4": ((8, 12), (8, 3), {"axis": 1, "block_size": 4}),
    "blocked last 8 ragged": ((3, 20), (3, 3), {"axis": 1, "block_size": 8}),
    "blocked 0 ragged": ((7, 8), (3, 8), {"axis": 0, "block_size": 3}),
    "blocked last 6 straddling bytes": ((4, 12), (4, 2), {"axis": 1, "block_size": 6}),
    "block-wise broadcast": ((8, 12), (2, 3), {}),
    "odd last dim": ((5, 7), (5,), {"axis": 0}),
    "rank 1": ((13,), (), {}),
    "rank 0": ((), (), {}),
    "empty": ((0, 8), (), {}),
}


@functools.cache
def _packed_dequantize(layout, dtype, implementation, under_jit):
  shape, _, kwargs = LAYOUTS[layout]
  dequantize = functools.partial(
      jq.dequantize_linear, packed_shape=shape, packed_dtype=dtype,
      implementation=implementation, **kwargs,
  )
  return jax.jit(dequantize) if under_jit else dequantize


INT2, UINT2 = TWO_BIT_DTYPES


# dtype, implementation and mode as a 2 x 2 x 2 orthogonal array: every pair of
# their values meets in each layout. Under jit the op's own jitted program is
# traced inside the outer one (the same unpacking and kernel); sign extension
# is int2's against uint2's in both implementations and both modes.
@pytest.mark.parametrize("dtype, implementation, under_jit", [
    (INT2, "xla", False), (UINT2, "xla", True), (INT2, "pallas", True), (UINT2, "pallas", False),
], ids=["int2-xla-eager", "uint2-xla-jit", "int2-pallas-jit", "uint2-pallas-eager"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@hypothesis.given(seed=st.integers(0, 2**32 - 1))
@hypothesis.settings(max_examples=3)
def test_packed_dequantize_equals_unpacked(layout, dtype, implementation, under_jit, seed):
  shape, scale_shape, kwargs = LAYOUTS[layout]
  rng = np.random.default_rng(seed)
  x = jnp.asarray(_random(dtype, shape, rng))
  scale = jnp.asarray(rng.uniform(0.01, 2.0, scale_shape).astype(np.float32))
  zero_point = jnp.asarray(_random(dtype, scale_shape, rng))
  expected = jq.dequantize_linear(x, scale, zero_point, implementation="xla", **kwargs)
  dequantize = _packed_dequantize(layout, dtype, implementation, under_jit)
  assert_bits_equal(dequantize(jq.pack(x), scale, zero_point), expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES, ids=dtype_name)
def test_empty_packed_dequantize_keeps_its_shape(dtype, implementation):
  # The Pallas path once returned (0, 0) here: the empty bytes skipped unpacking.
  y = jq.dequantize_linear(jnp.zeros(0, jnp.uint8), 1.0, packed_shape=(0, 8),
                           packed_dtype=dtype, implementation=implementation)
  assert y.shape == (0, 8) and y.dtype == jnp.float32


# --- onnxruntime and onnx.reference on the same bytes -----------------------------------

# (shape, scale shape, DequantizeLinear attributes); odd sizes leave padding
# bits in the last byte of x or of the zero point.
ORACLE_LAYOUTS = {
    "per-tensor, 15 elements": ((3, 5), (), {}),
    "per-axis 0": ((4, 6), (4,), {"axis": 0}),
    "per-axis 1, 3 zero points": ((5, 3), (3,), {"axis": 1}),
    "blocked 1 ragged": ((3, 10), (3, 3), {"axis": 1, "block_size": 4}),
    "blocked 0 ragged": ((7, 8), (3, 8), {"axis": 0, "block_size": 3}),
    "blocked 1 by 8": ((2, 16), (2, 2), {"axis": 1, "block_size": 8}),
}


def _packed_tensor(name, packed, shape, dtype):
  return helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape,
                            np.asarray(packed).tobytes(), raw=True)


def _dequantize_model(x, scale, zero_point, *, opset=25, **attributes):
  """One DequantizeLinear whose x and zero point are initializers holding jq.pack's bytes."""
  initializers = [_packed_tensor("x", jq.pack(x), x.shape, x.dtype),
                  numpy_helper.from_array(scale, "scale")]
  if zero_point is not None:
    initializers.append(
        _packed_tensor("zero_point", jq.pack(zero_point), zero_point.shape, zero_point.dtype))
  node = helper.make_node("DequantizeLinear", [t.name for t in initializers], ["y"],
                          **attributes)
  graph = helper.make_graph(
      [node], "dequantize", [],
      [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], initializers,
  )
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
  model.ir_version = 11
  return model


def _onnxruntime_session(model):
  options = onnxruntime.SessionOptions()
  options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
  options.intra_op_num_threads = 1
  return onnxruntime.InferenceSession(
      model.SerializeToString(), options, providers=["CPUExecutionProvider"])


# Every layout and dtype with a zero point (packed, its padding bits included);
# without one, one dtype per layout in turn, each dtype at least once: a
# missing zero point is 0 whatever the layout and dtype.
ORACLE_CASES = [
    *[(layout, dtype, True) for layout in ORACLE_LAYOUTS for dtype in SUB_BYTE_INTEGER_DTYPES],
    *[(layout, SUB_BYTE_INTEGER_DTYPES[i % len(SUB_BYTE_INTEGER_DTYPES)], False)
      for i, layout in enumerate(ORACLE_LAYOUTS)],
]


@pytest.mark.parametrize("layout, dtype, with_zero_point", ORACLE_CASES, ids=[
    f"{'zero_point' if with_zero_point else 'no_zero_point'}-{layout}-{dtype_name(dtype)}"
    for layout, dtype, with_zero_point in ORACLE_CASES])
def test_packed_dequantize_matches_onnx_oracles(layout, dtype, with_zero_point):
  shape, scale_shape, attributes = ORACLE_LAYOUTS[layout]
  rng = np.random.default_rng(sum(shape))
  x = _random(dtype, shape, rng)
  scale = rng.uniform(0.01, 2.0, scale_shape).astype(np.float32)
  zero_point = _random(dtype, scale_shape, rng) if with_zero_point else None
  model = _dequantize_model(x, scale, zero_point, **attributes)
  (from_onnxruntime,) = _onnxruntime_session(model).run(None, {})
  (from_reference,) = ReferenceEvaluator(model).run(None, {})
  assert_bits_equal(from_onnxruntime, np.asarray(from_reference, np.float32))
  packed, options = jq.pack(x), {"axis": 1} | attributes
  if with_zero_point:
    # jaxquant reads the zero point from the same bytes as the oracles.
    zero_point = jq.unpack(jq.pack(zero_point), scale_shape, dtype)
  for implementation in IMPLEMENTATIONS:
    assert_bits_equal(
        jq.dequantize_linear(packed, scale, zero_point, packed_shape=shape,
                             packed_dtype=dtype, implementation=implementation, **options),
        from_onnxruntime,
    )


@pytest.mark.parametrize("opset", [21, 24])
def test_onnxruntime_refuses_packed_int2_before_opset_25(opset):
  # int2 and uint2 joined DequantizeLinear in opset 25; int4 in 21.
  model = _dequantize_model(np.zeros((2, 4), ml_dtypes.int2), np.float32(1), None,
                            opset=opset)
  with pytest.raises(Exception, match=r"tensor\(int2\)"):
    _onnxruntime_session(model)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape, scale, options", [
    ((0, 4), 0.5, {}),
    ((2, 0, 6), 0.5, {}),
    ((0, 4), np.ones(4, np.float32), {"axis": 1}),
    ((3, 0), np.ones(0, np.float32), {"axis": 1}),
    ((0, 4), np.ones((0, 2), np.float32), {"axis": 1, "block_size": 2}),
], ids=str)
def test_empty_packed_shapes_keep_their_shape(shape, scale, options, implementation):
  # The Pallas path gave (0, 0) for (0, 4), (0, 1, 0) for (2, 0, 6), and a raw
  # broadcasting error with a per-axis scale.
  y = jq.dequantize_linear(jnp.zeros(0, jnp.uint8), scale, packed_shape=shape,
                           packed_dtype=jnp.int4, implementation=implementation, **options)
  assert y.shape == shape and y.dtype == jnp.float32


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape, dtype", [
    ((0, 8), jnp.int4), ((0, 16), jnp.uint2), ((3, 0, 8), jnp.int4), ((0, 6), jnp.int4),
], ids=str)
def test_empty_rows_of_whole_words_dequantize(shape, dtype, implementation):
  # Rows of whole 32-bit words are read as words: (0, 8) int4 raised a
  # ZeroDivisionError, reshaping zero bytes to (-1, 4).
  rows = jq.pack(jnp.zeros(shape, dtype), layout="rows")
  y = jq.dequantize_linear(rows, 0.5, packed_shape=shape, packed_dtype=dtype,
                           implementation=implementation)
  assert y.shape == shape and y.dtype == jnp.float32


_PACKED_QUANTIZE_LAYOUTS = [
    # (x shape, scale shape, options): bytes within rows (the lane path), bytes
    # straddling rows or blocks, rank 0 and empty (the codes-then-pack path).
    ((6, 8), (6, 4), dict(axis=1, block_size=2)),
    ((4, 12), (12,), dict(axis=1)),
    ((2, 3, 8), (2, 3, 2), dict(axis=2, block_size=4)),
    ((8, 6), (3, 6), dict(axis=0, block_size=3)),
    ((5, 7), (), {}),
    ((3,), (), {}),
    ((), (), {}),
    ((0, 4), (), {}),
]
# quantize_linear is itself jitted: under an outer jit a layout compiles the
# same program again, so that call runs on one layout of each path, 2- and
# 4-bit lanes within rows and a bit stream ending in padding.
_PACKED_QUANTIZE_UNDER_JIT = [(2, 3, 8), (5, 7)]


# Every dtype on the default path, which computes the codes per lane or packs
# them after. Pallas quantizes in its kernel and packs the result as jq.pack
# does (to_codes, pack_codes): one dtype per branch of those, int2 (signed,
# whose sign extension XLA:CPU once left in the byte), uint4 (unsigned, the
# 4-bit words), float4 (its own bits) and float6 (codes in 3-byte groups).
PACKED_QUANTIZE_CASES = [
    *[(None, dtype) for dtype in [*SUB_BYTE_DTYPES, jnp.float6_e2m3fn]],
    *[("pallas", dtype) for dtype in [jnp.int2, jnp.uint4, jnp.float4_e2m1fn, jnp.float6_e2m3fn]],
]


@pytest.mark.slow
@pytest.mark.parametrize("implementation, dtype", PACKED_QUANTIZE_CASES, ids=[
    f"{implementation}-{dtype_name(dtype)}" for implementation, dtype in PACKED_QUANTIZE_CASES])
def test_packed_quantize_is_pack_of_quantize(dtype, implementation):
  rng = np.random.default_rng(0)
  codes_dtype = dict(dtype=dtype) if dtype == jnp.float6_e2m3fn else {}
  for shape, scale_shape, options in _PACKED_QUANTIZE_LAYOUTS:
    x = (4 * rng.standard_normal(shape)).astype(np.float32)
    flat = x.reshape(-1)
    flat[::7], flat[1::11], flat[2::13] = np.nan, 0.5, -np.inf  # NaN, a tie, saturation
    scale = rng.uniform(0.3, 2.0, scale_shape).astype(np.float32)

    def quantize(x, scale, packed, options=options):
      return jq.quantize_linear(x, scale, output_dtype=dtype, packed=packed,
                                implementation=implementation, **options)

    expected = jq.pack(quantize(x, scale, False), **codes_dtype)
    calls = [quantize(x, scale, True)]
    if shape in _PACKED_QUANTIZE_UNDER_JIT:
      calls.append(jax.jit(quantize, static_argnums=2)(x, scale, True))
    for packed in calls:
      assert packed.dtype == jnp.uint8 and packed.shape == expected.shape
      np.testing.assert_array_equal(packed, expected, err_msg=f"{shape} {options}")
    if implementation is None:  # no implementation below: the pallas cases' calls are these
      np.testing.assert_array_equal(
          jq.dequantize_linear(expected, scale, packed_shape=shape, packed_dtype=dtype,
                               **options),
          jq.dequantize_linear(quantize(x, scale, False), scale, **options,
                               **{"packed_" + k: v for k, v in codes_dtype.items()}))


@pytest.mark.parametrize("dtype, zero_point", [(jnp.int4, 3), (jnp.uint4, 9), (jnp.int2, -1)],
                         ids=["int4", "uint4", "int2"])
def test_packed_quantize_with_zero_point(dtype, zero_point):
  x = (5 * np.random.default_rng(1).standard_normal((4, 8))).astype(np.float32)
  zero_point = jnp.asarray(zero_point, dtype)
  np.testing.assert_array_equal(
      jq.quantize_linear(x, 0.7, zero_point, packed=True),
      jq.pack(jq.quantize_linear(x, 0.7, zero_point)))


def test_pack_under_one_jit_with_negative_int2():
  # XLA:CPU once left -2's sign extension in the byte when quantize and pack fused.
  x = np.array([np.nan, 0.5, 1.2, -0.3, 0.9, 1.7, -1.1, 0.2], np.float32)
  fused = jax.jit(lambda x: jq.pack(jq.quantize_linear(x, 1.0, output_dtype=jnp.int2)))(x)
  np.testing.assert_array_equal(fused, [0b00_01_00_10, 0b00_11_01_01])


def test_packed_quantize_refuses_whole_byte_dtypes():
  with pytest.raises(ValueError, match="packed must be False for int8"):
    jq.quantize_linear(np.zeros(4, np.float32), 1.0, jnp.int8(0), packed=True)


def test_float4_packs_inside_a_loop():
  # XLA:CPU emitted invalid LLVM IR for the float4 -> uint4 bitcast in a
  # while loop: pack in lax.scan crashed compiling. Every code, both ways.
  codes = jnp.arange(16, dtype=jnp.uint8)
  values = lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
  want = jq.pack(values)
  assert_bits_equal(want, np.array([16 * (k + 1) + k for k in range(0, 16, 2)], np.uint8))
  stacked = jnp.stack([values, values[::-1]])
  got = lax.scan(lambda carry, x: (carry, jq.pack(x)), 0, stacked)[1]
  assert_bits_equal(got[0], want)
  assert_bits_equal(got[1], jq.pack(values[::-1]))
