"""pack_int4 / unpack_int4 against onnx.numpy_helper's TensorProto packing."""

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from onnx import numpy_helper
import pytest

import jaxquant as jq

FOUR_BIT = [ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float4_e2m1fn]


def _random(dtype, shape, rng):
  codes = rng.integers(0, 16, shape).astype(np.uint8)
  return codes.astype(ml_dtypes.uint4).view(dtype)


@pytest.mark.parametrize("dtype", FOUR_BIT, ids=lambda d: d.__name__)
@hypothesis.given(shape=st.lists(st.integers(0, 5), max_size=4), seed=st.integers(0, 2**32 - 1))
@hypothesis.settings(max_examples=25)
def test_pack_matches_onnx_layout_and_round_trips(dtype, shape, seed):
  x = _random(dtype, tuple(shape), np.random.default_rng(seed))
  packed = jq.pack_int4(x)
  onnx_bytes = np.frombuffer(numpy_helper.from_array(x).raw_data, np.uint8)
  np.testing.assert_array_equal(packed, onnx_bytes)
  unpacked = jq.unpack_int4(packed, x.shape, dtype)
  assert unpacked.dtype == dtype and unpacked.shape == x.shape
  np.testing.assert_array_equal(np.asarray(unpacked).view(np.uint8), x.view(np.uint8))


def test_odd_length_pads_a_zero_high_nibble():
  np.testing.assert_array_equal(jq.pack_int4(jnp.array([1, -1, 7], jnp.int4)), [0xF1, 0x07])


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
