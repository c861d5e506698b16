"""Pallas kernels: bit-identical to XLA (interpret mode here), and lowering for TPU and CUDA.

CPU runs the kernels in interpret mode, which executes the same kernel body,
block specs, padding and index maps as the compiled kernels; the Triton tiling
(and its exact-rounding rewrite) is run in interpret mode too. What only
hardware can show (Mosaic's and Triton's own code generation) is checked as
far as a CPU can: every kernel lowers for both platforms. The tests that pick
a backend's interpreter are marked ``xla_cpu``: on a machine with a GPU they
still run on its CPU, since interpret mode there would compile the kernel
body with XLA:GPU (whose float32 division is not IEEE) instead of emulating
the kernel.
"""

import functools
import math

import chex
import hypothesis
from hypothesis import strategies as st
import jax
from jax import lax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _dispatch
from jaxquant import _dtypes
from jaxquant import _dynamic
from jaxquant import _elementwise
from jaxquant import _numerics
import pallas_kernels
from pallas_kernels import _exact
from pallas_kernels import _tiling
from pallas_kernels.dequantize import decode_codes
from pallas_kernels.dequantize import decode_nibbles
from quant_testing import assert_bits_equal
from quant_testing import bit_width
from quant_testing import equations
from quant_testing import FLOAT6_DTYPES
from quant_testing import FLOAT_DTYPES
from quant_testing import FOUR_BIT_DTYPES
from quant_testing import INTEGER_DTYPES_TO_16_BITS
from quant_testing import QUANTIZED_DTYPES
from quant_testing import SUB_BYTE_DTYPES
from quant_testing import uses_pallas
from quant_testing import xla_dynamic_evaluation
from quant_testing import xla_evaluation

# quantized_add's operands here: the integer dtypes of 4 to 16 bits.
ADD_DTYPES = tuple(d for d in INTEGER_DTYPES_TO_16_BITS if bit_width(d) >= 4)

# The kernels compile once per shape (and per platform branch); a third of
# the profile's examples covers the layouts without turning the suite into a
# compile benchmark (20 under the "ci" profile, 333 under "thorough").
few = hypothesis.settings(max_examples=hypothesis.settings.default.max_examples // 3)


@st.composite
def layouts(draw, *, min_rank=0):
  """(shape, scale shape, axis/block_size kwargs) over every granularity, ragged blocks included."""
  rank = draw(st.integers(min_rank, 4))
  shape = tuple(draw(st.lists(st.integers(1, 37), min_size=rank, max_size=rank)))
  kinds = ["per-tensor"] + (["per-axis", "blocked", "broadcast"] if rank else [])
  kind = draw(st.sampled_from(kinds))
  if kind == "per-tensor":
    return shape, (), {}
  axis = draw(st.integers(0, rank - 1))
  if kind == "per-axis" and rank >= 2:
    return shape, (shape[axis],), {"axis": axis}
  if kind == "blocked":
    block = draw(st.integers(1, shape[axis]))
    blocks = -(-shape[axis] // block)
    block = -(-shape[axis] // blocks)  # the smallest block giving that count: in ONNX's range
    scale_shape = tuple(blocks if d == axis else n for d, n in enumerate(shape))
    return shape, scale_shape, {"axis": axis, "block_size": block}
  scale_shape = tuple(
      draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0])) for n in shape
  )
  return shape, scale_shape, {}


def _quantized_values(rng, shape, dtype):
  info = _dtypes.quantized_dtype("dtype", dtype)
  if info.is_integer:
    return jnp.asarray(rng.integers(info.min, info.max, shape, endpoint=True), dtype)
  values = rng.normal(0, info.max / 8, shape).astype(np.float32)
  values.reshape(-1)[::7] = np.nan
  return values.astype(dtype) if info.as_codes else jnp.asarray(values).astype(dtype)


def _float_values(rng, shape, dtype, scale):
  """Values on rounding ties (k + 1/2) * scale, their neighbours, NaN, inf and far outliers."""
  scale = np.broadcast_to(np.asarray(scale, np.float32), shape)
  steps = rng.integers(-300, 300, shape) + rng.choice([0.0, 0.5, 0.49999997, 0.5000001], shape)
  values = (steps * scale).astype(np.float32)
  flat = values.reshape(-1)
  flat[::11] = np.nan
  flat[3::13] = np.inf
  flat[5::17] = -np.inf
  flat[7::19] = 1e30
  return jnp.asarray(values).astype(dtype)


def _scale(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.uniform(0.01, 2.0, shape).astype(np.float32)).astype(dtype)


def _zero_point(rng, shape, dtype):
  info = _dtypes.quantized_dtype("dtype", dtype)
  if info.is_integer:
    low, high = max(info.min, -100), min(info.max, 100)
    return jnp.asarray(rng.integers(low, high, shape, endpoint=True), dtype)
  values = rng.choice([0.0, 1.0, -2.0], shape).astype(np.float32)
  return values.astype(dtype) if info.as_codes else jnp.asarray(values).astype(dtype)


def _on_device(a):
  """A NumPy float6 array as the uint8 codes a kernel sees; anything else as it is."""
  codes, host_dtype = _dtypes.host_codes("a", a)
  return a if host_dtype is None else jnp.asarray(codes)


# --- the public ops: implementation="pallas" == "xla", bit for bit ------------------


@pytest.mark.slow
@few
@hypothesis.given(
    layout=layouts(), dtype=st.sampled_from(QUANTIZED_DTYPES),
    output_dtype=st.sampled_from(FLOAT_DTYPES), with_zero_point=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_matches_xla(layout, dtype, output_dtype, with_zero_point, seed):
  rng = np.random.default_rng(seed)
  shape, scale_shape, kwargs = layout
  x = _quantized_values(rng, shape, dtype)
  scale = _scale(rng, scale_shape)
  zero_point = _zero_point(rng, scale_shape, dtype) if with_zero_point else None
  run = functools.partial(jq.dequantize_linear, x, scale, zero_point,
                          output_dtype=output_dtype, **kwargs)
  assert_bits_equal(run(implementation="pallas"), run(implementation="xla"))


@pytest.mark.slow
@few
@hypothesis.given(
    layout=layouts(min_rank=1), dtype=st.sampled_from(SUB_BYTE_DTYPES + FLOAT6_DTYPES),
    output_dtype=st.sampled_from(FLOAT_DTYPES), seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_packed_matches_xla(layout, dtype, output_dtype, seed):
  rng = np.random.default_rng(seed)
  shape, scale_shape, kwargs = layout
  x = _quantized_values(rng, shape, dtype)
  scale = _scale(rng, scale_shape)
  zero_point = _zero_point(rng, scale_shape, dtype)
  expected = jq.dequantize_linear(x, scale, zero_point, output_dtype=output_dtype,
                                  implementation="xla", **kwargs)
  for implementation in ("pallas", "xla"):
    actual = jq.dequantize_linear(
        jq.pack(x), scale, zero_point, output_dtype=output_dtype,
        packed_shape=shape, packed_dtype=dtype, implementation=implementation, **kwargs,
    )
    assert_bits_equal(actual, expected)


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.int2, jnp.uint2])
def test_packed_kernel_reads_bytes(dtype):
  # A last dim (and blocks along it) that are multiples of 8 // bits keep the
  # bytes packed into the kernel: its input is a uint8 array, not int4/int2.
  # 2-bit codes enter it one per nibble (spread by XLA), half a byte each.
  bits = _dtypes.quantized_dtype("dtype", dtype).bits
  packed = jnp.zeros((64 * 96 * bits // 8,), jnp.uint8)
  jaxpr = jax.make_jaxpr(functools.partial(
      jq.dequantize_linear, axis=1, block_size=32, packed_shape=(64, 96),
      packed_dtype=dtype, implementation="pallas",
  ))(packed, jnp.ones((64, 3)))
  kernels = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
  assert kernels  # one per platform branch
  for kernel in kernels:
    assert kernel.invars[0].aval.dtype == jnp.uint8
    assert kernel.invars[0].aval.size < 64 * 96  # padded to whole tiles, still bytes


@pytest.mark.slow
@few
@hypothesis.given(
    layout=layouts(), input_dtype=st.sampled_from(FLOAT_DTYPES),
    dtype=st.sampled_from(QUANTIZED_DTYPES), saturate=st.booleans(),
    with_zero_point=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_quantize_matches_xla(layout, input_dtype, dtype, saturate, with_zero_point, seed):
  rng = np.random.default_rng(seed)
  shape, scale_shape, kwargs = layout
  scale = _scale(rng, scale_shape)
  x = _float_values(rng, shape, input_dtype, 1.0 if not scale_shape else 0.25)
  zero_point = _zero_point(rng, scale_shape, dtype) if with_zero_point else None
  run = functools.partial(jq.quantize_linear, x, scale, zero_point, saturate=saturate,
                          output_dtype=None if with_zero_point else dtype, **kwargs)
  assert_bits_equal(run(implementation="pallas"), run(implementation="xla"))


@st.composite
def broadcast_pairs(draw):
  rank = draw(st.integers(0, 4))
  shape = draw(st.lists(st.integers(1, 33), min_size=rank, max_size=rank))
  a = [n if draw(st.booleans()) else 1 for n in shape]
  b = [n if draw(st.booleans()) else 1 for n in shape]
  return tuple(a), tuple(b[draw(st.integers(0, rank)):])


@pytest.mark.slow
@few
@hypothesis.given(
    shapes=broadcast_pairs(), a_dtype=st.sampled_from(ADD_DTYPES),
    b_dtype=st.sampled_from(ADD_DTYPES), out_dtype=st.sampled_from(ADD_DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
def test_quantized_add_matches_xla(shapes, a_dtype, b_dtype, out_dtype, seed):
  rng = np.random.default_rng(seed)
  a, b = (_quantized_values(rng, s, d) for s, d in zip(shapes, (a_dtype, b_dtype)))
  args = (a, _scale(rng, ()), _zero_point(rng, (), a_dtype),
          b, _scale(rng, ()), _zero_point(rng, (), b_dtype),
          _scale(rng, ()), _zero_point(rng, (), out_dtype))
  assert_bits_equal(jq.quantized_add(*args, implementation="pallas"),
                    jq.quantized_add(*args, implementation="xla"))


@pytest.mark.slow
@few
@hypothesis.given(
    layout=layouts(), input_dtype=st.sampled_from(FLOAT_DTYPES),
    dtype=st.sampled_from([jnp.int4, jnp.int8, jnp.uint8, jnp.int16]),
    symmetric=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_dynamic_quantize_matches_xla(layout, input_dtype, dtype, symmetric, seed):
  rng = np.random.default_rng(seed)
  shape, scale_shape, kwargs = layout
  if len(scale_shape) not in (0, 1) and "block_size" not in kwargs:
    kwargs = {}  # block-wise broadcast has no dynamic form
  elif len(scale_shape) == 1 and len(shape) == 1:
    kwargs = {"axis": 0}
  symmetric = symmetric and jnp.iinfo(dtype).min < 0
  x = _float_values(rng, shape, input_dtype, 0.01)
  x = jnp.where(jnp.isinf(x), 0, x)  # an infinite range makes every scale inf (tested in test_dynamic)
  run = functools.partial(jq.dynamic_quantize_linear, x, dtype=dtype, symmetric=symmetric,
                          **kwargs)
  for actual, expected in zip(run(implementation="pallas"), run(implementation="xla")):
    assert_bits_equal(actual, expected)


@pytest.mark.parametrize("shape", [(0,), (3, 0), ()])
def test_empty_and_scalar(shape):
  x = jnp.zeros(shape, jnp.float32)
  assert_bits_equal(jq.quantize_linear(x, 0.5, implementation="pallas"),
                    jq.quantize_linear(x, 0.5))
  for actual, expected in zip(jq.dynamic_quantize_linear(x, implementation="pallas"),
                              jq.dynamic_quantize_linear(x)):
    assert_bits_equal(actual, expected)


_EMPTY_BATCH_OPS = {
    "quantize_linear blocked": lambda x, implementation: jq.quantize_linear(
        x, jnp.full((4, 2), 0.1), axis=1, block_size=32, output_dtype=jnp.int4,
        implementation=implementation),
    "dequantize_linear packed": lambda x, implementation: jq.dequantize_linear(
        jq.pack(x.astype(jnp.int4)), 0.1, packed_shape=x.shape, implementation=implementation),
    "dynamic_quantize_linear per row": lambda x, implementation: jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=0, implementation=implementation),
    "quantized_add": lambda x, implementation: jq.quantized_add(
        x.astype(jnp.int8), 0.1, 0, x.astype(jnp.int8), 0.1, 0, 0.2, 0,
        implementation=implementation),
    "matmul_nbits": lambda x, implementation: jq.matmul_nbits(
        x, jnp.zeros((8, 2, 16), jnp.uint8), jnp.ones((8, 2)), K=64, N=8, block_size=32,
        implementation=implementation),
}


@pytest.mark.parametrize("op", _EMPTY_BATCH_OPS)
def test_vmap_over_an_empty_batch(op):
  """vmap over no examples gives XLA's empty results (a kernel's batched grid divided by
  tiles of no rows: ZeroDivisionError)."""
  batch = jnp.zeros((0, 4, 64), jnp.float32)
  results = {implementation: jax.vmap(functools.partial(
      _EMPTY_BATCH_OPS[op], implementation=implementation))(batch)
             for implementation in ("pallas", "xla")}
  chex.assert_trees_all_equal_shapes_and_dtypes(results["pallas"], results["xla"])


class TransformationsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_vmap_of_kernels_matches_xla(self):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-8, 8, (3, 16, 64)), jnp.int8)
    scale = jnp.linspace(0.1, 1, 3 * 16 * 2).reshape(3, 16, 2)
    for implementation in ("pallas", "xla"):
      dequantize = self.variant(jax.vmap(functools.partial(
          jq.dequantize_linear, axis=1, block_size=32, implementation=implementation)))
      dynamic = self.variant(jax.vmap(functools.partial(
          jq.dynamic_quantize_linear, dtype=jnp.int8, axis=0,
          implementation=implementation)))
      results = (dequantize(x, scale), *dynamic(x.astype(jnp.float32)))
      if implementation == "pallas":
        kernel_results = results
    for actual, expected in zip(kernel_results, results):
      assert_bits_equal(actual, expected)


# --- implementation=None ------------------------------------------------------------


def _int8_add(implementation=None):
  """The int8 quantized add that PALLAS_FASTER lists for CUDA, jitted."""
  return jax.jit(lambda a, b: jq.quantized_add(a, 0.1, jnp.int8(0), b, 0.2, jnp.int8(0), 0.3,
                                               jnp.int8(0), implementation=implementation))


def test_default_implementation_runs_kernels_only_where_measured_faster():
  # PALLAS_FASTER lists what was timed faster on hardware (docs/numerics.md):
  # never the CPU (interpret mode); on CUDA, the int8 quantized add and the
  # per-row int8 dynamic quantize.
  assert set(_dispatch.PALLAS_FASTER) == {"cuda"}
  x = jnp.zeros((8, 128), jnp.int8)
  assert not uses_pallas(jq.dequantize_linear, x, 1.0)
  assert uses_pallas(functools.partial(jq.dequantize_linear, implementation="pallas"), x, 1.0)
  assert uses_pallas(
      functools.partial(jq.dynamic_quantize_linear, implementation="pallas"), x.astype(float)
  )
  add = _int8_add()
  per_row = jax.jit(lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0))
  per_tensor = jax.jit(jq.dynamic_quantize_linear)
  packed = jnp.zeros((8, 64), jnp.uint8)
  blocked_int4 = jax.jit(lambda x, s: jq.dequantize_linear(
      x, s, axis=1, block_size=32, packed_shape=(8, 128), output_dtype=jnp.bfloat16))
  scales = jnp.ones((8, 4), jnp.bfloat16)
  floats = jnp.zeros((8, 128))
  for platform, kernel in (("cuda", True), ("cpu", False), ("tpu", False)):
    def lowered(f, *args):
      text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
      return "__gpu$xla.gpu.triton" in text or "tpu_custom_call" in text
    assert lowered(add, x, x) == kernel, platform
    assert lowered(per_row, floats) == kernel, platform
    assert not lowered(per_tensor, floats), platform
    assert not lowered(blocked_int4, packed, scales), platform


def test_xla_implementation_runs_no_kernel_even_where_one_is_listed():
  """implementation="xla" is XLA on every platform, also for CUDA's int8 quantized
  add, which PALLAS_FASTER lists for implementation=None."""
  x = jnp.zeros((8, 128), jnp.int8)
  assert not uses_pallas(functools.partial(jq.dequantize_linear, implementation="xla"), x, 1.0)
  text = _int8_add("xla").trace(x, x).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" not in text


def test_default_implementation_follows_the_routes_dtype_and_layout(monkeypatch):
  # An entry may name the quantized dtype and the layout it was measured on.
  monkeypatch.setattr(_dispatch, "PALLAS_FASTER", {"cpu": frozenset({
      _dispatch.Route("dequantize_linear", "int8", "blocked")})})
  jax.clear_caches()  # the ops' traces read the table
  try:
    blocks = jnp.ones((8, 4))
    blocked = lambda q: jq.dequantize_linear(q, blocks, axis=1, block_size=32)
    q = jnp.zeros((8, 128), jnp.int8)
    assert uses_pallas(blocked, q)
    assert not uses_pallas(blocked, q.astype(jnp.uint8))  # another dtype
    assert not uses_pallas(lambda q: jq.dequantize_linear(q, 1.0), q)  # another layout
    assert not uses_pallas(lambda q: jq.quantize_linear(
        q.astype(jnp.float32), blocks, axis=1, block_size=32), q)  # another op
  finally:
    jax.clear_caches()


def test_default_implementation_runs_the_kernel_where_the_table_lists_it(monkeypatch):
  # Listed for CPU: None runs these kernels here (one branch per platform,
  # picked when lowered), with the same bits, batching and derivatives.
  monkeypatch.setattr(_dispatch, "PALLAS_FASTER", {"cpu": frozenset({
      _dispatch.Route("quantize_linear"), _dispatch.Route("dequantize_linear")})})
  jax.clear_caches()  # the ops' traces read the table
  try:
    x = jnp.linspace(-3.0, 3.0, 8 * 128).reshape(8, 128)
    quantize = functools.partial(jq.quantize_linear, scale=0.02, output_dtype=jnp.int8)
    assert uses_pallas(quantize, x)
    assert not uses_pallas(jq.dynamic_quantize_linear, x)  # not listed
    q = jq.quantize_linear(x, 0.02, output_dtype=jnp.int8, implementation="xla")
    assert_bits_equal(quantize(x), q)
    assert_bits_equal(jax.vmap(quantize)(x), q)

    def loss(scale, implementation=None):
      y = jq.dequantize_linear(q, scale, implementation=implementation)
      return jnp.sum(jnp.sin(y))

    assert uses_pallas(loss, 0.5)
    assert_bits_equal(jax.grad(loss)(0.5), jax.grad(loss)(0.5, "xla"))
  finally:
    jax.clear_caches()


# --- the kernels under each backend's tiling, against their XLA twins ---------------

# Small caps force several grid steps and padded edges on small arrays.
BACKEND_TILINGS = [("tpu", (32, 128)), ("triton", (2, 64))]
TPU_TILING, TRITON_TILING = BACKEND_TILINGS


def _interpreter(backend):
  """Interpret mode for ``backend``: on CPU, Pallas's TPU interpreter for Mosaic's tiling,
  which raises on a block index out of bounds (the generic one clamps it, reading another
  block), and the generic one for Triton's."""
  return pltpu.InterpretParams() if backend == "tpu" else True


def _kernel_operands(rng, shape, dtype, scale_shape):
  x = _quantized_values(rng, shape, dtype)
  zero_point = _zero_point(rng, scale_shape, dtype)
  return _on_device(x), _scale(rng, scale_shape), _on_device(zero_point)


_DEQUANTIZE_KERNEL_LAYOUTS = {
    "per column, ragged lanes": ((70, 300), (1, 300)),
    "per middle axis": ((5, 70, 33), (1, 70, 1)),
    "blocked view, block 32": ((200, 3, 32), (200, 3, 1)),
}
# The layout code sees a dtype only through the TPU tile's row multiple (the
# 8-bit codes' 32 rows, uint4's 64) and the formula only through its decode:
# int8 runs every layout under each backend, and each other dtype runs under
# both backends, on a different layout under each (uint4's 64-row tile on the
# ragged 70 rows).
_DEQUANTIZE_KERNEL_CASES = [
    *((backend, max_block, jnp.int8, layout)
      for backend, max_block in BACKEND_TILINGS for layout in _DEQUANTIZE_KERNEL_LAYOUTS),
    (*TPU_TILING, jnp.uint4, "per column, ragged lanes"),
    (*TRITON_TILING, jnp.uint4, "per middle axis"),
    (*TPU_TILING, jnp.float8_e4m3fn, "per middle axis"),
    (*TRITON_TILING, jnp.float8_e4m3fn, "blocked view, block 32"),
    (*TPU_TILING, jnp.float6_e2m3fn, "blocked view, block 32"),
    (*TRITON_TILING, jnp.float6_e2m3fn, "per column, ragged lanes"),
    (*TPU_TILING, jnp.float6_e3m2fn, "per column, ragged lanes"),
    (*TRITON_TILING, jnp.float6_e3m2fn, "per middle axis"),
]


@pytest.mark.xla_cpu
@pytest.mark.slow
@pytest.mark.parametrize("backend, max_block, dtype, layout", _DEQUANTIZE_KERNEL_CASES)
def test_dequantize_kernel(backend, max_block, dtype, layout):
  shape, scale_shape = _DEQUANTIZE_KERNEL_LAYOUTS[layout]
  rng = np.random.default_rng(1)
  x, scale, zero_point = _kernel_operands(rng, shape, dtype, scale_shape)
  info = _dtypes.quantized_dtype("dtype", dtype)
  options = {"formula": functools.partial(_numerics.dequantize_formula, info=info,
                                          output_dtype=jnp.bfloat16),
             "output_dtype": np.dtype(jnp.bfloat16)}
  assert_bits_equal(
      pallas_kernels.dequantize(x, scale, zero_point, backend=backend, interpret=_interpreter(backend),
                                max_block=max_block, **options),
      xla_evaluation(options["formula"], x, [scale, zero_point],
                     output_dtype=options["output_dtype"]),
  )


@pytest.mark.xla_cpu
# Triton's tile reads every sub-byte dtype's bytes in
# test_packed_kernel_tile_holds_whole_bytes_under_a_narrow_lane_cap; here a 2-bit
# and a 4-bit dtype run under it.
@pytest.mark.parametrize("backend, max_block, dtype", [
    *((*TPU_TILING, dtype) for dtype in SUB_BYTE_DTYPES),
    (*TRITON_TILING, jnp.int2), (*TRITON_TILING, jnp.float4_e2m1fn),
])
def test_packed_dequantize_kernel(backend, max_block, dtype):
  rng = np.random.default_rng(2)
  x, scale, zero_point = _kernel_operands(rng, (48, 6, 64), dtype, (1, 6, 1))
  info = _dtypes.quantized_dtype("dtype", dtype)
  packed = jq.pack(x).reshape(48, 6, 64 * info.bits // 8)
  options = {"formula": functools.partial(_numerics.dequantize_formula, info=info,
                                          output_dtype=jnp.float32),
             "output_dtype": np.dtype(jnp.float32), "packed_dtype": np.dtype(dtype)}
  expected = jq.dequantize_linear(
      x, scale.reshape(6), zero_point.reshape(6), axis=1, implementation="xla")
  assert_bits_equal(
      pallas_kernels.dequantize(packed, scale, zero_point, backend=backend, interpret=_interpreter(backend),
                                max_block=max_block, **options),
      expected,
  )


@pytest.mark.xla_cpu
# The rounding sees the width, not the dtype: each width meets each cap (a cap of
# 2 lanes is a 4-bit byte exactly, half a 2-bit one), and each dtype runs once.
@pytest.mark.parametrize("dtype, max_block", [
    (jnp.int2, (2, 1)), (jnp.uint2, (4, 2)), (jnp.int4, (2, 1)), (jnp.uint4, (4, 2)),
    (jnp.float4_e2m1fn, (2, 1)),
])
def test_packed_kernel_tile_holds_whole_bytes_under_a_narrow_lane_cap(dtype, max_block):
  """Triton's lane tile is the cap's power of two, which a cap of max_block's lanes below
  the values per byte makes less than a byte's: the tile is rounded up to whole bytes of
  the packed operand (else its block is empty and the strided lanes read out of bounds)."""
  rng = np.random.default_rng(5)
  x, scale, zero_point = _kernel_operands(rng, (6, 64), dtype, (6, 1))
  info = _dtypes.quantized_dtype("dtype", dtype)
  packed = jq.pack(x).reshape(6, 64 * info.bits // 8)
  expected = jq.dequantize_linear(
      x, scale.reshape(6), zero_point.reshape(6), axis=0, implementation="xla")
  assert_bits_equal(
      pallas_kernels.dequantize(
          packed, scale, zero_point, backend="triton", interpret=True, max_block=max_block,
          formula=functools.partial(_numerics.dequantize_formula, info=info,
                                    output_dtype=jnp.float32),
          output_dtype=np.dtype(jnp.float32), packed_dtype=np.dtype(dtype)),
      expected,
  )


@pytest.mark.xla_cpu
@pytest.mark.parametrize("backend, max_block, dtype", [
    *((*TRITON_TILING, dtype) for dtype in (jnp.int8, jnp.uint8, jnp.int4, jnp.float8_e4m3fn,
                                            *FLOAT6_DTYPES)),
    (*TPU_TILING, jnp.int8), (*TPU_TILING, jnp.int4), (*TPU_TILING, jnp.float6_e2m3fn),
])
def test_quantize_kernel_rounds_ties_to_even(backend, max_block, dtype):
  # On Triton the formula runs through _exact's rewrite (jnp.round has no
  # Triton lowering): ties and their neighbours must still round as XLA does.
  # Interpreted for TPU the formula is XLA's own, as in test_quantize_matches_xla
  # (over every dtype): an 8-bit, a 4-bit (64-row tile) and a float6 output here.
  rng = np.random.default_rng(3)
  scale = _scale(rng, (1, 200))
  x = _float_values(rng, (40, 200), jnp.float32, scale)
  info = _dtypes.quantized_dtype("dtype", dtype)
  options = {"formula": functools.partial(_numerics.quantize_formula, info=info,
                                          precision=np.dtype(np.float32), saturate=True),
             "output_dtype": info.array_dtype}
  assert_bits_equal(
      pallas_kernels.quantize(x, scale, None, backend=backend, interpret=_interpreter(backend),
                              max_block=max_block, **options),
      xla_evaluation(options["formula"], x, [scale, None],
                     output_dtype=options["output_dtype"]),
  )


@pytest.mark.xla_cpu
@pytest.mark.slow
@pytest.mark.parametrize("backend, max_block", BACKEND_TILINGS)
def test_quantized_add_kernel(backend, max_block):
  rng = np.random.default_rng(4)
  a = _quantized_values(rng, (9, 1, 130), jnp.int8)
  b = _quantized_values(rng, (40, 1), jnp.uint8)
  infos = [_dtypes.quantized_dtype("dtype", d) for d in (jnp.int8, jnp.uint8, jnp.int8)]
  options = {"formula": functools.partial(_elementwise._add_formula, a_info=infos[0],
                                          b_info=infos[1], out_info=infos[2]),
             "output_dtype": np.dtype(jnp.int8)}
  parameters = [jnp.float32(0.05), jnp.int8(3), jnp.float32(0.07), jnp.uint8(128),
                jnp.float32(0.1), jnp.int8(-2)]
  assert_bits_equal(
      pallas_kernels.quantized_add(a, b, parameters, backend=backend, interpret=_interpreter(backend),
                                   max_block=max_block, **options),
      jq.quantized_add(a, *parameters[:2], b, *parameters[2:], implementation="xla"),
  )


@pytest.mark.xla_cpu
@pytest.mark.slow
# Which dims are kept is the layout's (collapse, partial tiles, combine), the
# same code under both tilings: per tensor, whose partials combine over every
# grid axis, runs under both; the other patterns under one each, most under
# Triton's, which the public ops' tests never run on CPU.
@pytest.mark.parametrize("backend, max_block, keep", [
    (*TPU_TILING, (False, False)), (*TRITON_TILING, (False, False)),
    (*TRITON_TILING, (True, False)), (*TPU_TILING, (False, True)),
    (*TRITON_TILING, (True, False, True)),
])
def test_dynamic_quantize_kernel(backend, max_block, keep):
  rng = np.random.default_rng(5)
  shape = (37, 300) if len(keep) == 2 else (7, 70, 33)
  x = _float_values(rng, shape, jnp.float32, 0.01)
  x = jnp.where(jnp.isinf(x), 0, x)
  info = _dtypes.quantized_dtype("dtype", jnp.uint8)
  options = {
      "reduction": functools.partial(_dynamic._min_max, keepdims=True),
      "parameters": functools.partial(_dynamic._asymmetric_parameters, info=info),
      "formula": functools.partial(_numerics.quantize_formula, info=info,
                                   precision=np.dtype(np.float32), saturate=True),
      "output_dtype": info.dtype,
  }
  actual = pallas_kernels.dynamic_quantize(
      x, keep, backend=backend, interpret=_interpreter(backend), max_block=max_block, **options)
  expected = xla_dynamic_evaluation(x, keep, **options)
  for a, e in zip(actual, expected):
    assert_bits_equal(a, e)


@pytest.mark.xla_cpu
# Whole blocks of 16 and a short last block. Whole blocks under the TPU tiling
# are the public ops' (test_quantize_matches_xla, test_dynamic_quantize_matches_xla).
@pytest.mark.parametrize("backend, columns", [("triton", 192), ("tpu", 200), ("triton", 200)])
def test_kernels_read_blocked_parameters(backend, columns):
  rng = np.random.default_rng(8)
  x = _float_values(rng, (8, columns), jnp.float32, 0.01)
  x = jnp.where(jnp.isinf(x), 0, x)
  count = -(-columns // 16)
  scale = _scale(rng, (8, count))
  info = _dtypes.quantized_dtype("dtype", jnp.int8)
  formula = functools.partial(_numerics.quantize_formula, info=info,
                              precision=np.dtype(np.float32), saturate=True)
  assert_bits_equal(
      pallas_kernels.quantize(x, scale, None, formula=formula, output_dtype=info.dtype,
                              blocks=(1, 16), backend=backend, interpret=_interpreter(backend)),
      xla_evaluation(formula, x, [scale, None], blocks=(1, 16), output_dtype=info.dtype))
  options = {
      "reduction": functools.partial(_dynamic._min_max, keepdims=True),
      "parameters": functools.partial(_dynamic._asymmetric_parameters, info=info),
      "formula": formula, "output_dtype": info.dtype,
  }
  actual = pallas_kernels.dynamic_quantize(
      x, (True, True), blocks=(1, 16), backend=backend, interpret=_interpreter(backend), **options)
  view = jnp.pad(x, ((0, 0), (0, count * 16 - columns)), constant_values=np.nan)
  expected = xla_dynamic_evaluation(view.reshape(8, count, 16), (True, True, False), **options)
  assert_bits_equal(actual[0], expected[0].reshape(8, -1)[:, :columns])
  for a, e in zip(actual[1:], expected[1:]):
    assert_bits_equal(a, e.reshape(8, count))


@pytest.mark.parametrize("columns, shards, block", [(192, 8, 16), (200, 8, 16), (120, 8, 7)])
def test_a_shard_cutting_blocks_finds_its_blocks(columns, shards, block):
  """What each device runs under jit where shard edges cut blocks, on one device.

  The shard's view reads the whole parameter from the shard's offset; the
  per-block maxima of every shard's slots, gathered over a named axis (vmap),
  equal the maxima of whole blocks.
  """
  length, count = columns // shards, -(-columns // block)
  x = jnp.asarray(np.random.default_rng(9).standard_normal((4, columns)), jnp.float32)
  scale = jnp.arange(1, 4 * count + 1, dtype=jnp.float32).reshape(4, count)
  cut = pallas_kernels._blockwise._Cut(shards, length, block)

  def part(start):
    return pallas_kernels._blockwise._Part(
        (4, length), (1, block), (False, False), (None, (start, cut)))

  want = x * jnp.repeat(scale, block, axis=1)[:, :columns]
  for s in range(shards):
    local = x[:, s * length:(s + 1) * length]
    (x_view, scale_view), restore = pallas_kernels._blockwise._block_view(
        [local, scale], [local.shape, scale.shape], part(jnp.int32(s * length)), [1, 1])
    assert_bits_equal(restore(x_view * scale_view), want[:, s * length:(s + 1) * length])

  def shard(local, start):
    view, _, _ = pallas_kernels._blockwise._reduction_view(local, part(start), np.nan)
    return pallas_kernels._blockwise._combine_slots(
        [jnp.nanmax(view, axis=-1)], 1, cut, ("shards",), columns,
        lambda partials, axis: tuple(jnp.nanmax(p, axis) for p in partials), np.nan)[0]

  maxima = jax.vmap(shard, axis_name="shards")(
      x.reshape(4, shards, length).transpose(1, 0, 2), jnp.arange(shards) * length)
  padded = jnp.pad(x, ((0, 0), (0, count * block - columns)), constant_values=np.nan)
  for got in maxima:
    assert_bits_equal(got, jnp.nanmax(padded.reshape(4, count, block), axis=-1))


@pytest.mark.xla_cpu
@pytest.mark.parametrize("backend", ["tpu", "triton"])
# 3 rows of 384 (4224, 11 rows of 384, is the same fold and padding); one row of
# 300, which no multiple of 128 divides.
@pytest.mark.parametrize("size", [1152, 300])
def test_one_dim_folded_into_rows_with_default_tiles(backend, size):
  # A 1-D output is folded into rows of a width dividing it (1152 -> 3 x 384);
  # Triton's power-of-two tile then pads every row (384 -> 512 lanes), so the
  # result must lose that padding before it is flattened. The small caps of
  # the other tests never make such a width.
  rng = np.random.default_rng(7)
  x = _quantized_values(rng, (size,), jnp.int8)
  info = _dtypes.quantized_dtype("dtype", jnp.int8)
  options = {"formula": functools.partial(_numerics.dequantize_formula, info=info,
                                          output_dtype=jnp.float32),
             "output_dtype": np.dtype(jnp.float32)}
  scale = jnp.float32(0.5).reshape(1)
  assert_bits_equal(
      pallas_kernels.dequantize(x, scale, None, backend=backend, interpret=_interpreter(backend), **options),
      xla_evaluation(options["formula"], x, [scale, None],
                     output_dtype=options["output_dtype"]),
  )
  values = _float_values(rng, (size,), jnp.float32, 0.01)
  values = jnp.where(jnp.isinf(values), 0, values)
  reduction = functools.partial(_dynamic._min_max, keepdims=True)
  for keep in [(False,), (True,)]:
    actual = pallas_kernels._blockwise.reduce(
        reduction, values, keep, pad_value=np.nan,
        backend=backend, interpret=_interpreter(backend))
    for a, e in zip(actual, reduction(values, () if keep[0] else (0,))):
      assert_bits_equal(a, e)


# --- the pieces the kernels rely on --------------------------------------------------


def test_round_half_to_even_matches_jnp_round():
  ties = np.arange(-2**12, 2**12, dtype=np.float32) + np.float32(0.5)
  near = np.concatenate([np.nextafter(ties, np.float32(np.inf)),
                         np.nextafter(ties, np.float32(-np.inf))])
  big = np.float32(2.0**23) + np.arange(-8, 8, dtype=np.float32) * np.float32(0.5)
  special = np.array([0.0, -0.0, 0.3, -0.3, np.inf, -np.inf, np.nan, 3e38, -3e38,
                      2**23 - 0.5, -(2**23 - 0.5), 1e-45], np.float32)
  rng = np.random.default_rng(6)
  random = rng.normal(0, 1e4, 10000).astype(np.float32)
  x = jnp.asarray(np.concatenate([ties, near, big, -big, special, random]))
  assert_bits_equal(jax.jit(_exact.round_half_to_even)(x), jnp.round(x))


@pytest.mark.parametrize("dtype", FOUR_BIT_DTYPES)
def test_decode_nibbles_covers_every_code(dtype):
  codes = np.arange(16, dtype=np.uint8)
  expected = np.asarray(jax.lax.bitcast_convert_type(
      jnp.asarray(codes).astype(jnp.uint4), dtype)).astype(np.float32)
  decoded = np.asarray(decode_nibbles(jnp.asarray(codes), np.dtype(dtype)),
                       np.float32)
  assert_bits_equal(decoded, expected)


@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES)
def test_decode_codes_covers_every_packed_code(dtype):
  bits = _dtypes.quantized_dtype("dtype", dtype).bits
  codes = np.arange(2**bits, dtype=np.uint8)
  unsigned = jnp.uint2 if bits == 2 else jnp.uint4
  expected = np.asarray(jax.lax.bitcast_convert_type(
      jnp.asarray(codes).astype(unsigned), dtype)).astype(np.float32)
  decoded = np.asarray(decode_codes(jnp.asarray(codes), np.dtype(dtype)), np.float32)
  assert_bits_equal(decoded, expected)


@hypothesis.given(
    shape=st.lists(st.integers(1, 5000), min_size=2, max_size=4),
    dtypes=st.lists(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int8, jnp.int4,
                                     jnp.float8_e4m3fn, jnp.int16]), min_size=1, max_size=3),
)
def test_tile_shapes_obey_backend_rules(shape, dtypes):
  tpu = _tiling.tile_shape(shape, [np.dtype(d) for d in dtypes], "tpu")
  padded = _tiling.padded_shape(shape, tpu)
  rows, lanes = tpu[-2:]
  assert rows == padded[-2] or rows % max(_tiling.sublanes(d) for d in dtypes) == 0
  assert lanes == padded[-1] or lanes % _tiling.LANES == 0
  assert all(t == 1 for t in tpu[:-2])
  triton = _tiling.tile_shape(shape, [np.dtype(d) for d in dtypes], "triton")
  assert all(t & (t - 1) == 0 for t in triton)
  assert math.prod(triton) <= math.prod(_tiling.MAX_BLOCK["triton"])


# --- lowering for real hardware, from this CPU ----------------------------------------

P = "pallas"
LOWERING_CASES = {
    "dequantize int8 per-column ragged -> f32": (
        lambda x, s: jq.dequantize_linear(x, s, axis=1, implementation=P),
        (jnp.zeros((1000, 4100), jnp.int8), jnp.ones((4100,)))),
    "dequantize uint8 per-row -> bf16": (
        lambda x, s: jq.dequantize_linear(x, s, jnp.zeros(300, jnp.uint8), axis=0,
                                          output_dtype=jnp.bfloat16, implementation=P),
        (jnp.zeros((300, 77), jnp.uint8), jnp.ones((300,)))),
    "dequantize int4 blocked 32 -> f16": (
        lambda x, s: jq.dequantize_linear(x, s.astype(jnp.float16), axis=1, block_size=32,
                                          implementation=P),
        (jnp.zeros((256, 4096), jnp.int4), jnp.ones((256, 128)))),
    "dequantize packed int4 blocked 32 along axis 0": (
        lambda x, s: jq.dequantize_linear(x, s, axis=0, block_size=32,
                                          packed_shape=(4096, 512), implementation=P),
        (jnp.zeros((4096 * 512 // 2,), jnp.uint8), jnp.ones((128, 512)))),
    "dequantize packed uint4 blocked 64 ragged": (
        lambda x, s: jq.dequantize_linear(x, s, axis=1, block_size=64,
                                          packed_shape=(100, 1000), packed_dtype=jnp.uint4,
                                          implementation=P),
        (jnp.zeros((50000,), jnp.uint8), jnp.ones((100, 16)))),
    "dequantize packed int2 blocked 32 -> bf16": (
        lambda x, s, z: jq.dequantize_linear(x, s, z, axis=1, block_size=32,
                                             output_dtype=jnp.bfloat16, packed_shape=(512, 4096),
                                             packed_dtype=jnp.int2, implementation=P),
        (jnp.zeros((512 * 4096 // 4,), jnp.uint8), jnp.ones((512, 128)),
         jnp.zeros((512, 128), jnp.int2))),
    "dequantize packed uint2 per-row ragged lanes": (
        lambda x, s: jq.dequantize_linear(x, s, axis=0, packed_shape=(300, 1000),
                                          packed_dtype=jnp.uint2, implementation=P),
        (jnp.zeros((75000,), jnp.uint8), jnp.ones((300,)))),
    "dequantize float8_e4m3fn per-tensor -> bf16": (
        lambda x: jq.dequantize_linear(x, jnp.bfloat16(2), implementation=P),
        (jnp.zeros((33, 3, 129), jnp.float8_e4m3fn),)),
    "dequantize float6_e2m3fn codes per-row -> bf16": (
        lambda x, s, z: jq.dequantize_linear(x, s, z, axis=0, output_dtype=jnp.bfloat16,
                                             packed_dtype=jnp.float6_e2m3fn,
                                             implementation=P),
        (jnp.zeros((300, 77), jnp.uint8), jnp.ones((300,)), jnp.zeros((300,), jnp.uint8))),
    "dequantize packed float6_e3m2fn blocked 32": (
        lambda x, s: jq.dequantize_linear(x, s, axis=1, block_size=32,
                                          packed_shape=(256, 4096),
                                          packed_dtype=jnp.float6_e3m2fn, implementation=P),
        (jnp.zeros((256 * 4096 * 6 // 8,), jnp.uint8), jnp.ones((256, 128)))),
    "quantize f32 -> int8 per-column": (
        lambda x, s: jq.quantize_linear(x, s, jnp.zeros(4100, jnp.int8), implementation=P),
        (jnp.zeros((1000, 4100)), jnp.ones((4100,)))),
    "quantize bf16 -> float8_e5m2 per-tensor": (
        lambda x: jq.quantize_linear(x, 2.0, output_dtype=jnp.float8_e5m2, implementation=P),
        (jnp.zeros((129, 257), jnp.bfloat16),)),
    "quantize f32 -> int4 blocked 128": (
        lambda x, s: jq.quantize_linear(x, s, output_dtype=jnp.int4, axis=1, block_size=128,
                                        implementation=P),
        (jnp.zeros((64, 4096)), jnp.ones((64, 32)))),
    "quantize f32 -> float6_e2m3fn blocked 32": (
        lambda x, s: jq.quantize_linear(x, s, output_dtype=jnp.float6_e2m3fn, axis=1,
                                        block_size=32, implementation=P),
        (jnp.zeros((64, 4096)), jnp.ones((64, 128)))),
    "quantize bf16 -> float6_e3m2fn per-tensor, zero point": (
        lambda x: jq.quantize_linear(x, 2.0, np.float32(1.5).astype(jnp.float6_e3m2fn),
                                     implementation=P),
        (jnp.zeros((129, 257), jnp.bfloat16),)),
    "quantized_add int8 + uint8 broadcast": (
        lambda a, b: jq.quantized_add(a, 0.1, jnp.int8(1), b, 0.2, jnp.uint8(3), 0.3,
                                      jnp.int8(0), implementation=P),
        (jnp.zeros((64, 1, 1000), jnp.int8), jnp.zeros((7, 1), jnp.uint8))),
    "dynamic_quantize per-tensor uint8": (
        lambda x: jq.dynamic_quantize_linear(x, implementation=P),
        (jnp.zeros((1000, 4100)),)),
    "dynamic_quantize per-row symmetric int8, bf16 in": (
        lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0, symmetric=True,
                                             implementation=P),
        (jnp.zeros((4096, 4096), jnp.bfloat16),)),
    "dynamic_quantize per-block 32 int4, odd rank 3": (
        lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int4, axis=2, block_size=32,
                                             implementation=P),
        (jnp.zeros((3, 17, 100)),)),
}


# A Triton kernel cannot hold these cases' sub-byte operands or results (XLA:GPU
# packs them; one per byte, an H100 ran out of bounds) or write float8 as XLA
# converts to it: CUDA runs their XLA twin (pallas_kernels._blockwise.triton_holds),
# all but the int4 dynamic quantize's statistics, a float32 reduction.
CUDA_RUNS_XLA = frozenset({
    "dequantize int4 blocked 32 -> f16", "dequantize packed int2 blocked 32 -> bf16",
    "quantize bf16 -> float8_e5m2 per-tensor", "quantize f32 -> int4 blocked 128",
    "dynamic_quantize per-block 32 int4, odd rank 3",
})


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("case", LOWERING_CASES, ids=str)
def test_kernel_lowers_for_hardware(case, platform):
  function, args = LOWERING_CASES[case]
  text = jax.jit(function).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  if platform == "tpu":
    assert "tpu_custom_call" in text
  elif case in CUDA_RUNS_XLA:
    assert ("__gpu$xla.gpu.triton" in text) == case.startswith("dynamic")
    assert "div.rn.f32" not in text
  else:
    assert "__gpu$xla.gpu.triton" in text
    # Triton's own float32 division is approximate: quantize must divide with
    # the IEEE instruction.
    assert ("div.rn.f32" in text) == case.startswith(("quantize", "dynamic", "quantized_add"))
    # Triton cannot legalize math.ctlz (on an H100 the quantize kernel failed
    # to compile with it): _exact counts leading zeros without it.
    assert "ctlz" not in text


def test_kernels_lower_for_rocm_without_ptx():
  # ROCm runs the Triton branch too, without the PTX division (AMD's fdiv
  # lowering is IEEE already); unverified on hardware.
  text = jax.jit(lambda x: jq.quantize_linear(x, 2.0, implementation=P)).trace(
      jnp.zeros((64, 256))).lower(lowering_platforms=("rocm",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and "div.rn.f32" not in text


def test_dtypes_triton_cannot_hold_run_xla_on_cuda():
  # Triton's NVIDIA backend has no float8_e4m3fnuz (an AMD format; lowering
  # raised NotImplementedError) and reads int4 one per byte where XLA:GPU packs
  # two (an H100 ran out of bounds): CUDA runs XLA, with XLA's bits.
  calls = {
      jnp.float8_e4m3fnuz: lambda x: jq.dequantize_linear(x, 2.0, implementation=P),
      jnp.int4: lambda x: jq.dequantize_linear(x, 2.0, implementation=P),
      jnp.float32: lambda x: jq.quantize_linear(x, 2.0, output_dtype=jnp.int4,
                                                implementation=P),
  }
  for dtype, call in calls.items():
    x = jnp.zeros((64, 256), dtype)
    text = jax.jit(call).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" not in text, dtype
    assert "tpu_custom_call" in jax.jit(call).trace(x).lower(
        lowering_platforms=("tpu",)).as_text(), dtype


def test_triton_negation_keeps_the_sign_of_zero():
  # Triton lowers negation as 0 - x: +0 for x = +0. Decoding float6 code 32
  # (-0.0) in a Triton kernel on an H100 gave +0.0; the kernel body multiplies by -1.
  x = jnp.float32([0.0, -0.0, 1.5, -np.inf])
  body = _exact.exact(lambda x: -x)
  assert "neg" not in str(jax.make_jaxpr(body)(x))
  assert_bits_equal(body(x), -x)
  codes = jnp.uint8([0, 32])
  assert_bits_equal(_exact.exact(lambda c: decode_codes(c, jnp.float6_e2m3fn))(codes),
                    jnp.float32([0.0, -0.0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_cuda_kernels_divide_without_the_xla_guard(dtype):
  # The guard's zero (clz(v) >> k) steers XLA's simplifier; in a CUDA kernel
  # it would be a binary search per element for nothing. With the PTX
  # division it is zeros, and the division keeps its bits.
  with jax.enable_x64(dtype == jnp.float64):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 128)), dtype)
    divisor = jnp.asarray(rng.uniform(0.5, 2.0, (8, 128)), dtype)
    on_cuda = jax.make_jaxpr(_exact.exact(_numerics.guarded_divide, divide=True))(x, divisor)
    interpreted = jax.make_jaxpr(_exact.exact(_numerics.guarded_divide, divide=False))(x, divisor)
    primitives = {e.primitive.name for e in on_cuda.eqns}
    assert not primitives & {"clz", "shift_left", "shift_right_logical", "iota", "xor"}, primitives
    assert "shift_left" in {e.primitive.name for e in interpreted.eqns}  # clz by binary search
    got = jax.jit(_exact.exact(_numerics.guarded_divide, divide=False))(x, divisor)
    np.testing.assert_array_equal(got, np.asarray(x) / np.asarray(divisor))


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32, jnp.int32, jnp.int64])
def test_count_leading_zeros_equals_clz(dtype):
  width = 8 * jnp.dtype(dtype).itemsize
  unsigned = np.dtype(f"uint{width}")
  rng = np.random.default_rng(width)
  edges = [0, 1, 2, 3] + [(1 << k) + d for k in range(1, width) for d in (-1, 0, 1)]
  raw = np.concatenate([np.array(edges, np.uint64).astype(unsigned),
                        rng.integers(0, np.iinfo(unsigned).max, 4096, dtype=unsigned,
                                     endpoint=True)])
  with jax.enable_x64(width == 64):
    x = jnp.asarray(raw.view(np.dtype(dtype)))
    np.testing.assert_array_equal(jax.jit(_exact.count_leading_zeros)(x), lax.clz(x))


def test_kernels_evaluate_the_default_branch_of_platform_dependent_formulas():
  # A formula's platform branches are XLA's; a kernel evaluates the default.
  def formula(x):
    return lax.platform_dependent(x, cpu=lambda x: x * 2, cuda=lambda x: x * 3,
                                  default=lambda x: x + 1)

  x = jnp.arange(4.0)
  np.testing.assert_array_equal(_exact.exact(formula)(x), x + 1)
  np.testing.assert_array_equal(formula(x), x * 2)  # here, on the CPU


def test_triton_replacements_equal_the_primitives():
  # reduce_precision (bfloat16 precision for quantize), float64 round (x64):
  # Triton lowers neither; _exact's replacements must give the same bits.
  rng = np.random.default_rng(7)
  x = np.concatenate([
      rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32),
      np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, 1e-45, 1.00390625,
                  1.01171875, -1.00390625]),
  ])
  for mantissa_bits in (7, 10, 23):
    want = lax.reduce_precision(jnp.asarray(x), exponent_bits=8, mantissa_bits=mantissa_bits)
    got = jax.jit(functools.partial(_exact.round_mantissa, mantissa_bits=mantissa_bits))(x)
    assert_bits_equal(got, want)
  with jax.enable_x64(True):
    halves = np.concatenate([np.arange(-6, 6) + 0.5, [2.0**52 + 1, -(2.0**53), -0.25, 0.5]])
    wide = jnp.asarray(np.concatenate([halves, rng.normal(0, 1e6, 4096)]), jnp.float64)
    assert_bits_equal(jax.jit(_exact.round_half_to_even)(wide), jnp.round(wide))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("options", [
    {"precision": jnp.bfloat16}, {"scale": jnp.bfloat16(2)},
    {"scale": jnp.bfloat16(2), "output_dtype": jnp.float8_e4m3fn},
], ids=["precision", "scale", "scale-float8"])
def test_bfloat16_precision_quantize_lowers(options, platform):
  # Neither Triton nor Mosaic lowers reduce_precision (the TPU kernel raised
  # NotImplementedError for a bfloat16 scale): its bits are rounded instead.
  options = {"scale": 2.0, **options}
  f = lambda x: jq.quantize_linear(x, implementation=P, **options)
  text = jax.jit(f).trace(jnp.zeros((64, 256))).lower(lowering_platforms=(platform,)).as_text()
  if platform == "cuda" and "output_dtype" in options:
    # Triton cannot write float8 as XLA converts to it: CUDA runs XLA (CUDA_RUNS_XLA).
    assert "__gpu$xla.gpu.triton" not in text
    return
  assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text
  assert "reduce_precision" not in text


def test_kernels_and_per_platform_routes_run_under_disable_jit():
  # A call choosing its path per platform (the default blocked packed int4
  # dequantize, every implementation="pallas" call) recursed forever under
  # jax.disable_jit(): its jitted bind called itself again.
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.integers(-8, 8, (3, 10)), jnp.int4)
  scale = jnp.asarray(rng.uniform(0.5, 2, (3, 3)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)
  calls = [
      lambda: jq.dequantize_linear(jq.pack(q), scale, axis=1, block_size=4,
                                   packed_shape=q.shape, packed_dtype=jnp.int4),
      lambda: jq.quantize_linear(x, scale, axis=1, block_size=4, output_dtype=jnp.int4,
                                 implementation=P),
      lambda: jq.dynamic_quantize_linear(x, implementation=P),
  ]
  for call in calls:
    want = call()
    with jax.disable_jit():
      jax.tree.map(assert_bits_equal, call(), want)
