"""float6_e2m3fn and float6_e3m2fn (ONNX opset 28): codes, packing, oracles, kernels, QAT.

XLA (jaxlib 0.10.2) has no float6 primitive type, so no JAX array holds
float6: jaxquant carries float6 values as their 6-bit codes, one per uint8
byte, in ml_dtypes' bit layout. ``quantize_linear`` returns those codes,
``dequantize_linear`` reads a NumPy float6 array, ONNX's packed bytes
(``packed_shape=``) or the codes (``packed_dtype=`` alone), and ``pack`` /
``unpack`` write and read ONNX's 6-bit stream (four codes in three bytes).

Oracles: ml_dtypes 0.6.0 is the float6 arithmetic (its values and its
saturating round-to-nearest-even cast), ``onnx.reference`` 1.23.2 runs
QuantizeLinear and DequantizeLinear at opset 28 (through float32 carriers and
Cast nodes, ``tests/onnx_oracle.py``), ``onnx.numpy_helper`` packs and unpacks
the bytes. onnxruntime 1.32.0 is no oracle here: it does not register the
float6 tensor types ("MLDataType for: tensor(float6e2m3) is not currently
registered or supported"), pinned by ``test_onnxruntime_has_no_float6``.

Where they differ from docs/numerics.md (R5, R10 in its "Oracle deviations"):
NaN gives jaxquant's +max where ml_dtypes and ``onnx.reference`` give -0.0
(R10, as R6 for float4), and ``onnx.reference`` turns -0.0 into +0.0 with an
explicit zero point +0 (R5, as for float4). The randomized comparisons check
those elements against the documented model of ``tests/quant_testing.py``.
"""

from __future__ import annotations

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from onnx import helper
from onnx import numpy_helper
import pytest

import jaxquant as jq
from jaxquant import _dtypes
import onnx_oracle
from pallas_kernels.dequantize import decode_codes
from quant_testing import assert_bits_equal
from quant_testing import assert_matches_oracle
from quant_testing import BF16
from quant_testing import division_precision
from quant_testing import dtype_name
from quant_testing import examples
from quant_testing import F16
from quant_testing import F32
from quant_testing import FLOAT6_DTYPES
from quant_testing import ieee_quotient
from quant_testing import IMPLEMENTATIONS
from quant_testing import Layout
from quant_testing import layouts_for
from quant_testing import quantize_inputs
from quant_testing import scales
from quant_testing import shapes
from quant_testing import spec_quantize
from quant_testing import tensor_type

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OPSET = 28  # the opset that added float6


def _codes(values):
  """A NumPy float6 array's codes (a view: no copy)."""
  return np.asarray(values).view(np.uint8)


def _all_values(dtype):
  """Every float6 value, in code order (64 codes, -0.0 included)."""
  return np.arange(64, dtype=np.uint8).view(dtype)


def _max_code(dtype):
  return int(_codes(np.array(ml_dtypes.finfo(dtype).max, dtype)))


def _random_codes(rng, shape, dtype):
  return rng.integers(0, 64, shape).astype(np.uint8).view(dtype)


# --- the dtype table and the code arithmetic -----------------------------------------


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_table_entry_matches_ml_dtypes(dtype):
  info = _dtypes.quantized_dtype("dtype", dtype)
  finfo = ml_dtypes.finfo(dtype)
  assert (info.bits, info.is_integer, info.has_nan, info.as_codes) == (6, False, False, True)
  assert (info.min, info.max) == (float(finfo.min), float(finfo.max))
  assert info.array_dtype == np.uint8
  assert (info.max, float(finfo.smallest_subnormal)) == {
      "float6_e2m3fn": (7.5, 0.125), "float6_e3m2fn": (28.0, 0.0625)}[info.name]


def test_xla_still_has_no_float6():
  # Why codes: if a jaxlib gains the type, this fails and the design can be revisited.
  with pytest.raises(Exception, match="F6E2M3FN|float6"):
    jnp.asarray(np.array([1.5], ml_dtypes.float6_e2m3fn))


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_decode_every_code(dtype):
  values = _all_values(dtype)
  expected = values.astype(np.float32)
  assert_bits_equal(decode_codes(jnp.asarray(_codes(values)), np.dtype(dtype)), expected)
  # dequantize's formula decodes with the same function: scale 1 is the identity.
  assert_bits_equal(jq.dequantize_linear(values, 1.0), expected)
  assert_bits_equal(jq.dequantize_linear(_codes(values), 1.0, packed_dtype=dtype), expected)


def _encode_cases(dtype):
  """float32 values around every rounding decision of the float6 grid."""
  grid = np.unique(_all_values(dtype).astype(np.float64))
  midpoints = (grid[1:] + grid[:-1]) / 2  # ties, exact in float32
  finfo = ml_dtypes.finfo(dtype)
  normal = float(finfo.smallest_normal)
  values = np.concatenate([grid, midpoints, -midpoints]).astype(np.float32)
  neighbours = np.concatenate([
      np.nextafter(values, np.float32(np.inf)), np.nextafter(values, np.float32(-np.inf))])
  rng = np.random.default_rng(0)
  specials = np.array([
      0.0, -0.0, np.inf, -np.inf, 1e30, -1e30, 3.4e38, -3.4e38, float(finfo.max) * 1.03,
      2.0 ** -126, -(2.0 ** -126)], np.float32)
  subnormal_range = rng.uniform(-normal, normal, 2000).astype(np.float32)
  wide = rng.normal(0, float(finfo.max), 5000).astype(np.float32)
  cases = np.concatenate([values, neighbours, specials, subnormal_range, wide])
  # J1: XLA:CPU flushes float32 subnormals, which the float6 grid rounds to +-0 anyway.
  return cases[(cases == 0) | (np.abs(cases) >= np.finfo(np.float32).tiny)]


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_encode_matches_ml_dtypes_cast(dtype):
  x = _encode_cases(dtype)
  codes = np.asarray(jq.quantize_linear(x, 1.0, output_dtype=dtype))
  assert codes.dtype == np.uint8
  np.testing.assert_array_equal(codes, _codes(x.astype(dtype)))


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_ties_round_to_even_codes(dtype):
  grid = np.unique(_all_values(dtype).astype(np.float64))
  midpoints = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
  codes = np.asarray(jq.quantize_linear(midpoints, 1.0, output_dtype=dtype))
  assert np.all(codes % 2 == 0)  # an even code is an even significand
  # One float32 step toward 0 rounds to the neighbour nearer 0 (-0.0 below 0).
  inward = np.asarray(jq.quantize_linear(np.nextafter(midpoints, np.float32(0)), 1.0,
                                         output_dtype=dtype))
  nearer_zero = np.copysign(np.where(midpoints < 0, grid[1:], grid[:-1]), midpoints)
  np.testing.assert_array_equal(inward, _codes(nearer_zero.astype(dtype)))


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_special_values(dtype):
  maximum = _max_code(dtype)
  x = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0], np.float32)
  y = jq.quantize_linear(x, 1.0, output_dtype=dtype)
  # NaN: +max (R10: ml_dtypes and onnx.reference give -0.0); -0.0 keeps its sign.
  np.testing.assert_array_equal(y, [maximum, maximum, maximum, maximum | 32, maximum,
                                    maximum | 32, 0, 32])
  # Scale 0: +-inf by sign, 0/0 = NaN.
  y = jq.quantize_linear(np.array([3.0, -3.0, 0.0], np.float32), 0.0, output_dtype=dtype)
  np.testing.assert_array_equal(y, [maximum, maximum | 32, maximum])
  # saturate has no effect: float6 has no encoding to overflow into.
  assert_bits_equal(jq.quantize_linear(x, 1.0, output_dtype=dtype, saturate=False),
                    jq.quantize_linear(x, 1.0, output_dtype=dtype))


# --- zero points ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_zero_point_is_added_before_rounding(dtype):
  x = np.array([0.3, -0.0, 0.0, 2.6, -100.0, np.nan], np.float32)
  zero_point = np.array(1.5, dtype)
  expected = spec_quantize(
      x.astype(np.float64), np.full(x.shape, 1.5), np.dtype(dtype))
  y = jq.quantize_linear(x, 1.0, zero_point)
  np.testing.assert_array_equal(y, _codes(expected))
  # A Python number takes the dtype: rounded to it as x is (1.3 -> 1.25 in both).
  np.testing.assert_array_equal(jq.quantize_linear(x, 1.0, 1.5, output_dtype=dtype), y)
  np.testing.assert_array_equal(
      jq.quantize_linear(x, 1.0, 1.3, output_dtype=dtype),
      jq.quantize_linear(x, 1.0, np.array(1.3, dtype)))
  # A zero point of +-0 is no zero point: -0.0 stays -0.0 (R5 in onnx.reference).
  for zero in (0.0, -0.0):
    np.testing.assert_array_equal(
        jq.quantize_linear(x, 1.0, np.array(zero, dtype)),
        jq.quantize_linear(x, 1.0, output_dtype=dtype))


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_dequantize_zero_point_forms_agree(dtype):
  values = _all_values(dtype)
  zero_point = np.array(-1.5, dtype)
  expected = ((values.astype(np.float32) - np.float32(-1.5)) * np.float32(0.5))
  for zp in (zero_point, -1.5, jnp.asarray(_codes(zero_point))):
    assert_bits_equal(jq.dequantize_linear(values, 0.5, zp), expected)
    assert_bits_equal(
        jq.dequantize_linear(_codes(values), 0.5, zp, packed_dtype=dtype), expected)


# --- onnx.reference at opset 28 --------------------------------------------------------


def _zero_points(rng, shape, dtype):
  """Every value equally likely, +-0 often (R5 lives there), or no zero point."""
  codes = rng.integers(0, 64, shape).astype(np.uint8)
  zeros = rng.choice(np.array([0, 32], np.uint8), shape)
  return np.where(rng.random(shape) < 0.3, zeros, codes).view(dtype)


@st.composite
def _quantize_cases(draw, dtype):
  x_dtype, scale_dtype = draw(st.sampled_from(
      [(F32, F32)] * 3 + [(F16, F16), (BF16, BF16)]
      + [(x, s) for x in (F32, F16, BF16) for s in (F32, F16, BF16)]))
  precision = draw(st.sampled_from([None, None, F32, F16, BF16]))
  layout = draw(layouts_for(draw(shapes(max_rank=5))))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  special_rate = draw(st.sampled_from([0.0, 0.05, 0.3]))
  scale = scales(rng, layout.scale_shape, scale_dtype, special_rate)
  zero_point = None
  if draw(st.booleans()):
    zero_point = _zero_points(rng, layout.scale_shape, dtype)
  x = quantize_inputs(
      rng, dtype, x_dtype, np.asarray(layout.full(scale)), None, special_rate)
  static = {"axis": layout.axis, "block_size": layout.block_size}
  if zero_point is None or draw(st.booleans()):
    static["output_dtype"] = dtype
  if draw(st.booleans()):
    static["saturate"] = draw(st.booleans())
  if precision is not None:
    static["precision"] = precision
  return x, scale, zero_point, layout, static, draw(st.sampled_from(["direct", "outer_jit"]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
@hypothesis.settings(max_examples=examples(0.75))
@hypothesis.given(data=st.data())
def test_quantize_matches_reference(dtype, data):
  x, scale, zero_point, layout, static, style = data.draw(_quantize_cases(dtype))
  if style == "direct":
    actual = jq.quantize_linear(x, scale, zero_point, **static)
  else:
    # A NumPy float6 zero point cannot be traced: it is closed over.
    actual = jax.jit(lambda x, scale: jq.quantize_linear(x, scale, zero_point, **static))(
        x, scale)
  assert actual.dtype == np.uint8
  precision = division_precision(scale.dtype, static.get("precision"))
  scale_full = np.asarray(layout.full(scale))
  zero_point_full = None if zero_point is None else layout.full(zero_point).astype(np.float64)
  with np.errstate(all="ignore"):
    quotient = ieee_quotient(x, scale_full, precision)
    spec = spec_quantize(quotient, zero_point_full, np.dtype(dtype))
    shifted = quotient if zero_point_full is None else quotient + zero_point_full
  deviating = np.isnan(shifted)  # R10
  if zero_point is not None:
    deviating |= (quotient == 0) & np.signbit(quotient) & (zero_point_full == 0)  # R5
  onnx_scale, attributes = layout.onnx(scale)
  onnx_zero_point, _ = layout.onnx(zero_point)
  if "output_dtype" in static:
    attributes["output_dtype"] = tensor_type(dtype)
  attributes["precision"] = tensor_type(precision)  # R8
  expected = onnx_oracle.run_reference(
      "QuantizeLinear", {"x": x, "scale": onnx_scale, "zero_point": onnx_zero_point},
      np.dtype(dtype), opset=OPSET, **attributes)
  assert_matches_oracle(
      np.asarray(actual).view(dtype), expected,
      context=(f"onnx.reference: quantize_linear to {dtype_name(dtype)}, {layout}, {static}, "
               f"{style}"),
      inputs={"x": x, "scale": scale_full, "zero_point": zero_point_full},
      deviating=deviating, spec=spec)


@st.composite
def _dequantize_cases(draw, dtype):
  scale_dtype = draw(st.sampled_from([F32, F32, F16, BF16]))
  output_dtype = draw(st.sampled_from([None, None, F32, F16, BF16]))
  layout = draw(layouts_for(draw(shapes(max_rank=5))))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  scale = scales(rng, layout.scale_shape, scale_dtype,
                               draw(st.sampled_from([0.0, 0.05, 0.3])))
  zero_point = None
  if draw(st.booleans()):
    zero_point = _zero_points(rng, layout.scale_shape, dtype)
  x = _random_codes(rng, layout.x_shape, dtype)
  static = {"axis": layout.axis, "block_size": layout.block_size}
  if output_dtype is not None:
    static["output_dtype"] = output_dtype
  return x, scale, zero_point, layout, static, draw(st.sampled_from(["numpy", "codes",
                                                                     "packed"]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
@hypothesis.settings(max_examples=examples(0.75))
@hypothesis.given(data=st.data())
def test_dequantize_matches_reference(dtype, data):
  x, scale, zero_point, layout, static, form = data.draw(_dequantize_cases(dtype))
  if form == "numpy":
    actual = jq.dequantize_linear(x, scale, zero_point, **static)
  elif form == "codes":
    actual = jq.dequantize_linear(_codes(x), scale, zero_point, packed_dtype=dtype, **static)
  else:
    actual = jq.dequantize_linear(jq.pack(x), scale, zero_point, packed_shape=x.shape,
                                  packed_dtype=dtype, **static)
  output_dtype = static.get("output_dtype", scale.dtype)
  onnx_scale, attributes = layout.onnx(scale)
  onnx_zero_point, _ = layout.onnx(zero_point)
  if "output_dtype" in static:
    attributes["output_dtype"] = tensor_type(output_dtype)
  expected = onnx_oracle.run_reference(
      "DequantizeLinear", {"x": x, "scale": onnx_scale, "zero_point": onnx_zero_point},
      output_dtype, opset=OPSET, **attributes)
  assert_matches_oracle(
      actual, expected,
      context=(f"onnx.reference: dequantize_linear of {dtype_name(dtype)}, {layout}, {static}, "
               f"{form}"),
      inputs={"x": x, "scale": np.asarray(layout.full(scale))})


def test_onnxruntime_has_no_float6():
  x = _all_values(ml_dtypes.float6_e2m3fn)
  try:
    y = onnx_oracle.run_onnxruntime("DequantizeLinear", {"x": x, "scale": np.float32(2)},
                                    np.dtype(np.float32), opset=OPSET)
  except Exception as error:  # onnxruntime raises its own exception types
    assert "float6" in str(error), error
    return
  # A release that registers float6 is an oracle from then on.
  assert_bits_equal(y, jq.dequantize_linear(x, np.float32(2)))


# --- packing: ONNX's 6-bit stream ---------------------------------------------------------


def _onnx_bytes(x):
  return np.frombuffer(numpy_helper.from_array(x).raw_data, np.uint8)


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("shape", [()] + [(n,) for n in range(10)] + [(2, 3), (3, 0, 2)],
                         ids=str)
def test_pack_matches_onnx_and_round_trips(dtype, shape):
  x = _random_codes(np.random.default_rng(sum(shape) + len(shape)), shape, dtype)
  packed = jq.pack(x)
  assert packed.dtype == np.uint8 and packed.shape == (-(-x.size * 6 // 8),)
  np.testing.assert_array_equal(packed, _onnx_bytes(x))
  np.testing.assert_array_equal(jq.pack(_codes(x), dtype=dtype), packed)
  unpacked = jq.unpack(packed, shape, dtype)
  assert unpacked.dtype == np.uint8 and unpacked.shape == shape
  np.testing.assert_array_equal(unpacked, _codes(x))
  # ONNX reads the bytes written here as the same values.
  tensor = helper.make_tensor("x", tensor_type(dtype), shape,
                              np.asarray(packed).tobytes(), raw=True)
  np.testing.assert_array_equal(_codes(numpy_helper.to_array(tensor)), _codes(x))


def test_pack_layout_by_hand():
  # Codes 1, 2, 3, 4: 000001 | 000010 | 000011 | 000100, lowest bits first.
  codes = jnp.array([1, 2, 3, 4], jnp.uint8)
  np.testing.assert_array_equal(jq.pack(codes, dtype=jnp.float6_e3m2fn),
                                [0b10_000001, 0b0011_0000, 0b000100_00])
  # Bits above 6 are not part of a code, and unpack ignores the stream's tail.
  np.testing.assert_array_equal(jq.pack(codes | 0xC0, dtype=jnp.float6_e3m2fn),
                                jq.pack(codes, dtype=jnp.float6_e3m2fn))
  np.testing.assert_array_equal(
      jq.unpack(jnp.array([0xFF, 0xFF], jnp.uint8), (2,), jnp.float6_e2m3fn), [63, 63])


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_pack_and_unpack_under_jit_and_vmap(dtype):
  codes = _codes(_random_codes(np.random.default_rng(3), (3, 8), dtype))
  pack = jax.jit(functools.partial(jq.pack, dtype=dtype))
  packed = pack(codes)
  unpack = jax.jit(jq.unpack, static_argnums=(1, 2))
  np.testing.assert_array_equal(unpack(packed, (3, 8), dtype), codes)
  rows = jax.vmap(pack)(codes)  # 8 codes of 6 bits fill 6 whole bytes per row
  assert rows.shape == (3, 6)
  np.testing.assert_array_equal(rows.reshape(-1), packed)


# --- dequantize_linear: NumPy values, packed bytes, codes ------------------------------------

LAYOUTS = {
    "per-tensor": Layout("per-tensor", (6, 10), ()),
    "per-axis 0": Layout("per-axis", (6, 10), (6,), axis=0),
    "blocked 1 ragged": Layout("blocked", (6, 10), (6, 3), axis=1, block_size=4),
    "blocked 0": Layout("blocked", (6, 10), (2, 10), axis=0, block_size=3),
    "rank 0": Layout("per-tensor", (), ()),
    "empty": Layout("per-tensor", (0, 5), ()),
}


def _options(layout):
  return {"axis": layout.axis, "block_size": layout.block_size}


# Each layout under each implementation, each with one of the two dtypes (the
# other under the other implementation), so every pair of the three meets;
# test_dequantize_matches_reference runs both dtypes over layouts and forms too.
@pytest.mark.parametrize("name, dtype, implementation", [
    (name, FLOAT6_DTYPES[(i + k) % 2], implementation)
    for i, name in enumerate(LAYOUTS) for k, implementation in enumerate(IMPLEMENTATIONS)
], ids=lambda value: dtype_name(value) if isinstance(value, np.dtype) else str(value))
def test_dequantize_forms_agree(name, dtype, implementation):
  layout = LAYOUTS[name]
  rng = np.random.default_rng(len(layout.x_shape) + len(layout.scale_shape))
  x = _random_codes(rng, layout.x_shape, dtype)
  scale = rng.uniform(0.01, 2.0, layout.scale_shape).astype(np.float32)
  zero_point = _zero_points(rng, layout.scale_shape, dtype)
  expected = ((x.astype(np.float32) - layout.full(zero_point).astype(np.float32))
              * layout.full(scale))
  kwargs = dict(_options(layout), implementation=implementation)
  codes, packed, zp_codes = _codes(x), np.asarray(jq.pack(x)), _codes(zero_point)
  by_codes = functools.partial(jq.dequantize_linear, packed_dtype=dtype, **kwargs)
  by_bytes = functools.partial(jq.dequantize_linear, packed_shape=x.shape, packed_dtype=dtype,
                               **kwargs)
  results = {
      "numpy, eager": jq.dequantize_linear(x, scale, zero_point, **kwargs),
      "codes, eager": by_codes(codes, scale, zero_point),
      "bytes, eager": by_bytes(packed, scale, zero_point),
      "codes, jit, traced": jax.jit(by_codes)(codes, scale, zp_codes),
      "bytes, jit, traced": jax.jit(by_bytes)(packed, scale, zp_codes),
      "numpy, jit, closed over": jax.jit(
          lambda: jq.dequantize_linear(x, scale, zero_point, **kwargs))(),
      "codes, jit, closed over": jax.jit(lambda: by_codes(codes, scale, zero_point))(),
      "bytes, jit, closed over": jax.jit(lambda: by_bytes(packed, scale, zero_point))(),
  }
  for form, y in results.items():
    assert y.shape == x.shape, form
    assert_bits_equal(y, expected)


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_dequantize_ignores_code_bits_above_six(dtype):
  # uint8 codes are read by their low 6 bits, as pack reads them: for x and the zero point.
  rng = np.random.default_rng(7)
  codes = rng.integers(0, 64, 40).astype(np.uint8)
  high = codes | rng.choice(np.array([0x40, 0x80, 0xC0], np.uint8), codes.size)
  expected = jq.dequantize_linear(codes, 0.5, np.uint8(9), packed_dtype=dtype)
  assert_bits_equal(
      jq.dequantize_linear(high, 0.5, np.uint8(9 | 0xC0), packed_dtype=dtype), expected)
  np.testing.assert_array_equal(jq.pack(high, dtype=dtype), jq.pack(codes, dtype=dtype))


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_dequantize_under_vmap(dtype):
  x = _random_codes(np.random.default_rng(4), (5, 12), dtype)
  scale = np.linspace(0.5, 2.0, 5).astype(np.float32)
  expected = jq.dequantize_linear(x, scale, axis=0)
  by_codes = jax.vmap(lambda c, s: jq.dequantize_linear(c, s, packed_dtype=dtype))
  assert_bits_equal(by_codes(_codes(x), scale), expected)
  rows = np.stack([np.asarray(jq.pack(row)) for row in x])  # 12 codes: 9 bytes a row
  by_bytes = jax.vmap(lambda b, s: jq.dequantize_linear(b, s, packed_shape=(12,),
                                                        packed_dtype=dtype))
  assert_bits_equal(by_bytes(rows, scale), expected)


# --- quantize_linear: XLA and Pallas, jit and vmap ---------------------------------------------


# Each layout with each scale dtype, the float6 dtype alternating, so every pair
# of the three meets.
@pytest.mark.parametrize("name, scale_dtype, dtype", [
    (name, scale_dtype, FLOAT6_DTYPES[(i + k) % 2])
    for i, name in enumerate(name for name in LAYOUTS if name != "empty")
    for k, scale_dtype in enumerate([F32, F16, BF16])
], ids=lambda value: dtype_name(value) if isinstance(value, np.dtype) else str(value))
def test_quantize_pallas_equals_xla(name, scale_dtype, dtype):
  layout = LAYOUTS[name]
  rng = np.random.default_rng(5)
  scale = rng.uniform(0.01, 2.0, layout.scale_shape).astype(scale_dtype)
  x = quantize_inputs(rng, dtype, F32, np.asarray(layout.full(scale)), None, 0.1)
  zero_point = _zero_points(rng, layout.scale_shape, dtype)
  kwargs = _options(layout)
  run = functools.partial(jq.quantize_linear, x, scale, zero_point, **kwargs)
  expected = run(implementation="xla")
  assert_bits_equal(run(implementation="pallas"), expected)
  assert_bits_equal(jax.jit(lambda x: jq.quantize_linear(x, scale, zero_point, **kwargs))(x),
                    expected)
  if layout.kind == "per-tensor" and x.ndim == 2:
    rows = jax.vmap(lambda row: jq.quantize_linear(row, scale, zero_point))(x)
    assert_bits_equal(rows, expected)


# --- fake quantization ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("x_dtype", [F32, F16, BF16], ids=dtype_name)
def test_fake_quantize_is_dequantize_of_quantize(dtype, x_dtype):
  rng = np.random.default_rng(6)
  scale = np.float32(0.25)
  grid_scale = np.full((64, 8), scale)
  x = quantize_inputs(rng, np.dtype(dtype), x_dtype, grid_scale, None, 0.1)
  for zero_point in (None, np.array(1.5, dtype), -2.0):
    q = jq.quantize_linear(x, scale, zero_point, output_dtype=dtype)
    expected = jq.dequantize_linear(q, scale, zero_point, packed_dtype=dtype,
                                    output_dtype=x_dtype)
    assert_bits_equal(jq.fake_quantize(x, scale, zero_point, dtype=dtype), expected)


@pytest.mark.parametrize("dtype", FLOAT6_DTYPES, ids=dtype_name)
def test_fake_quantize_gradient_is_masked_straight_through(dtype):
  maximum = float(ml_dtypes.finfo(dtype).max)
  # Past max: the quotient rounded to float6's significand (exponent unbounded).
  step = {"float6_e2m3fn": 0.5, "float6_e3m2fn": 4.0}[dtype_name(dtype)]  # ulp at max
  x = np.array([0.3, -1.0, maximum, -maximum, maximum + step / 2 - 0.01,
                maximum + step / 2, maximum + step, np.inf, np.nan], np.float32)
  expected = np.array([1, 1, 1, 1, 1, 0, 0, 0, 0], np.float32)  # the tie rounds up to even 2**k
  grad = jax.grad(lambda x: jq.fake_quantize(x, 1.0, dtype=dtype).sum())(x)
  np.testing.assert_array_equal(grad, expected)
  identity = jax.grad(lambda x: jq.fake_quantize(x, 1.0, dtype=dtype,
                                                 gradient="identity").sum())(x)
  np.testing.assert_array_equal(identity, np.ones_like(x))
  # jit, a closed-over NumPy zero point (the mask tests x / s + z), and jvp.
  zero_point = np.array(-step, dtype)
  grad = jax.jit(jax.grad(lambda x: jq.fake_quantize(x, 1.0, zero_point, dtype=dtype).sum()))(x)
  np.testing.assert_array_equal(grad, [1, 1, 1, 0, 1, 1, 1, 0, 0])
  _, tangent = jax.jvp(lambda x: jq.fake_quantize(x, 1.0, dtype=dtype), (x,), (np.ones_like(x),))
  np.testing.assert_array_equal(tangent, expected)


def test_fake_quantize_learnable_refuses_float6():
  # As float8 and float4: LSQ's zero point and range are the integer dtypes'.
  with pytest.raises(TypeError, match="dtype must be an integer quantized dtype"):
    jq.fake_quantize_learnable(jnp.ones(4), 1.0, dtype=jnp.float6_e2m3fn)


# --- errors, in the library's one format -------------------------------------------------

E2M3, E3M2 = np.dtype(ml_dtypes.float6_e2m3fn), np.dtype(ml_dtypes.float6_e3m2fn)
X, CODES = np.zeros(4, np.float32), np.zeros(4, np.uint8)


@pytest.mark.parametrize("call, error, message", [
    (lambda: jq.quantize_linear(X, 1.0, np.zeros((), E3M2), output_dtype=E2M3), ValueError,
     "quantize_linear: output_dtype must be None or zero_point's dtype float6_e3m2fn, got "
     "float6_e2m3fn."),
    (lambda: jq.quantize_linear(X, 1.0, jnp.uint8(0), output_dtype=E2M3), ValueError,
     "quantize_linear: output_dtype must be None or zero_point's dtype uint8, got "
     "float6_e2m3fn."),
    (lambda: jq.dequantize_linear(np.zeros(4, E2M3), 1.0, np.zeros((), E3M2)), TypeError,
     "dequantize_linear: zero_point.dtype must be float6_e2m3fn (the quantized dtype) or its "
     "uint8 codes, got float6_e3m2fn."),
    (lambda: jq.dequantize_linear(CODES, 1.0, jnp.int8(0), packed_dtype=E2M3), TypeError,
     "dequantize_linear: zero_point.dtype must be float6_e2m3fn (the quantized dtype) or its "
     "uint8 codes, got int8."),
    (lambda: jq.dequantize_linear(np.zeros(4, E2M3), 1.0, packed_shape=(4,)), TypeError,
     "dequantize_linear: packed_shape must be None for a NumPy float6_e2m3fn x (it holds "
     "values, not packed bytes), got (4,)."),
    (lambda: jq.dequantize_linear(np.zeros(4, E2M3), 1.0, packed_dtype=jnp.int4), TypeError,
     "dequantize_linear: packed_dtype must be None or x's dtype float6_e2m3fn, got int4."),
    (lambda: jq.dequantize_linear(np.zeros(4, np.int8), 1.0, packed_dtype=E3M2), TypeError,
     "dequantize_linear: x.dtype must be uint8 (one code per byte) for "
     "packed_dtype=float6_e3m2fn without packed_shape, got int8."),
    (lambda: jq.dequantize_linear(np.zeros(4, np.uint8), 1.0, packed_shape=(6,),
                                  packed_dtype=E3M2), ValueError,
     "dequantize_linear: packed.shape must be (5,) to unpack into shape (6,), got (4,)."),
    (lambda: jq.pack(CODES), TypeError,
     "pack: x.dtype must be int2, uint2, int4, uint4, float4_e2m1fn, float6_e2m3fn or "
     "float6_e3m2fn (or uint8 codes with dtype=), got uint8."),
    (lambda: jq.pack(np.zeros(4, E2M3), dtype=E3M2), TypeError,
     "pack: dtype must be None or x's dtype float6_e2m3fn, got float6_e3m2fn."),
    (lambda: jq.pack(np.zeros(4, np.int8), dtype=E2M3), TypeError,
     "pack: x.dtype must be uint8 for dtype=float6_e2m3fn, got int8."),
    (lambda: jq.unpack(np.zeros(4, np.uint8), (4,), E2M3), ValueError,
     "unpack: packed.shape must be (3,) to unpack into shape (4,), got (4,)."),
    (lambda: jq.fake_quantize(X, 1.0, np.zeros((), E3M2), dtype=E2M3), TypeError,
     "fake_quantize: zero_point.dtype must be float6_e2m3fn (the quantized dtype) or its "
     "uint8 codes, got float6_e3m2fn."),
], ids=[
    "q-zero-point-other-float6", "q-uint8-zero-point", "dq-zero-point-other-float6",
    "dq-zero-point-int8", "dq-numpy-x-with-packed-shape", "dq-numpy-x-other-packed-dtype",
    "dq-codes-not-uint8", "dq-packed-too-short", "pack-codes-without-dtype",
    "pack-numpy-x-other-dtype", "pack-int8-codes", "unpack-wrong-size",
    "fq-zero-point-other-float6",
])
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_float6_errors(call, error, message, under_jit):
  with pytest.raises(error) as info:
    jax.jit(call)() if under_jit else call()
  assert str(info.value) == message


_TRACED_FLOAT6 = "must be a NumPy float6 array or uint8 codes (XLA has no float6 type, so " \
    "float6 values cross a jit boundary as codes: docs/numerics.md, \"float6\"), got a JAX " \
    "array of float6_e2m3fn."


@pytest.mark.parametrize("call, argument", [
    (lambda v: jq.dequantize_linear(v, 1.0), "dequantize_linear: x"),
    (lambda v: jq.pack(v), "pack: x"),
    (lambda v: jq.quantize_linear(X, 1.0, v[0]), "quantize_linear: zero_point"),
    (lambda v: jq.dequantize_linear(CODES, 1.0, v[0], packed_dtype=E2M3),
     "dequantize_linear: zero_point"),
    (lambda v: jq.fake_quantize(X, 1.0, v[0], dtype=E2M3), "fake_quantize: zero_point"),
], ids=["dq-x", "pack-x", "q-zero-point", "dq-zero-point", "fq-zero-point"])
def test_float6_traced_by_the_callers_jit_is_refused_at_trace_time(call, argument):
  # A NumPy float6 array passed to the caller's jit arrives as a float6 tracer,
  # which XLA cannot compile: it crashed XLA ("Invalid bitcast i6 to i8") or
  # raised lax's own TypeError.
  values = np.array([1.0, -2.0, 0.5, 3.0], E2M3)
  with pytest.raises(TypeError) as info:
    jax.jit(call).trace(values)
  assert str(info.value) == f"{argument} {_TRACED_FLOAT6}"
