"""``jax.export`` with a symbolic batch dimension, as serving stacks export a model.

Each op is exported once for ``(b, 64)`` inputs, and the exported program is
called on concrete batches; its results must equal the op's XLA evaluation
called directly. The Pallas implementation of each op that has one exports
for several platforms at once, CPU's interpret mode among them.
"""

import dataclasses

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _dispatch
from quant_testing import assert_bits_equal

FEATURES = 64


def _blocked_scale(x):
  return jnp.full((x.shape[0], FEATURES // 32), 0.05, jnp.float32)


def _int8(x):
  return jq.quantize_linear(x, 0.05, output_dtype=jnp.int8)


def _uint8(x):
  return jq.quantize_linear(x, 0.05, np.uint8(128))


# Per-channel parameters as NumPy constants (jnp.linspace's bits differ under jit and eagerly).
_CHANNEL_RNG = np.random.default_rng(8)
CHANNEL_SCALE = _CHANNEL_RNG.uniform(0.01, 0.1, FEATURES).astype(np.float32)
CHANNEL_ZERO_POINT = _CHANNEL_RNG.integers(-5, 5, FEATURES).astype(np.int8)
# A (64, 8) int8 weight with per-column scales and zero points.
WEIGHT = _CHANNEL_RNG.integers(-128, 128, (FEATURES, 8)).astype(np.int8)
WEIGHT_SCALE = _CHANNEL_RNG.uniform(0.01, 0.02, 8).astype(np.float32)
WEIGHT_ZERO_POINT = _CHANNEL_RNG.integers(-3, 3, 8).astype(np.int8)


# Each op as a function of x and the implementation.
OPS = {
    "quantize per-tensor": lambda x, i: jq.quantize_linear(
        x, 0.05, output_dtype=jnp.int8, implementation=i),
    "quantize per-channel": lambda x, i: jq.quantize_linear(
        x, jnp.linspace(0.01, 0.1, FEATURES), axis=1, output_dtype=jnp.int8, implementation=i),
    "quantize blocked": lambda x, i: jq.quantize_linear(
        x, _blocked_scale(x), axis=1, block_size=32, output_dtype=jnp.int4, implementation=i),
    "quantize blocked along the batch": lambda x, i: jq.quantize_linear(
        x, jnp.full((-(-x.shape[0] // 4), FEATURES), 0.05), axis=0, block_size=4,
        output_dtype=jnp.int8, implementation=i),
    "dequantize per-channel": lambda x, i: jq.dequantize_linear(
        _int8(x), CHANNEL_SCALE, CHANNEL_ZERO_POINT, axis=1,
        implementation=i),
    "dequantize per-row": lambda x, i: jq.dequantize_linear(
        _int8(x), jnp.full(x.shape[:1], 0.05), jnp.full(x.shape[:1], 3, jnp.int8), axis=0,
        implementation=i),
    "dequantize blocked": lambda x, i: jq.dequantize_linear(
        jq.quantize_linear(x, 0.05, output_dtype=jnp.int8), _blocked_scale(x), axis=1,
        block_size=32, implementation=i),
    # Rows of a symbolic count packed one by one, and unpacked to a symbolic shape.
    "pack rows then unpack": lambda x, i: jq.unpack(
        jq.pack(jq.quantize_linear(x, 0.05, output_dtype=jnp.int4), layout="rows"), x.shape,
        jnp.int4),
    # One bit stream of 7 * b int4 (b int2) codes: its padding to whole bytes is symbolic.
    "quantize packed, an odd count": lambda x, i: jq.quantize_linear(
        x[:, :7], 0.05, output_dtype=jnp.int4, packed=True, implementation=i),
    "pack int2 of a symbolic count": lambda x, i: jq.pack(
        jq.quantize_linear(x[:, 0], 0.05, output_dtype=jnp.int2)),
    "dequantize packed int4": lambda x, i: jq.dequantize_linear(
        jq.pack(jq.quantize_linear(x, 0.05, output_dtype=jnp.int4)), _blocked_scale(x),
        axis=1, block_size=32, packed_shape=x.shape, implementation=i),
    "dynamic per-tensor": lambda x, i: jq.dynamic_quantize_linear(x, implementation=i),
    "dynamic per-token": lambda x, i: jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=0, implementation=i),
    "dynamic per-channel": lambda x, i: jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=1, implementation=i),
    "dynamic blocked": lambda x, i: jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=1, block_size=32, symmetric=True, implementation=i),
    # Statistics of blocks along the batch: the last one short for batches of 2 and 7.
    "dynamic blocked along the batch": lambda x, i: jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=0, block_size=4, implementation=i),
    "quantized_add": lambda x, i: jq.quantized_add(
        jq.quantize_linear(x, 0.05, output_dtype=jnp.int8), 0.05, None,
        jq.quantize_linear(-x, 0.1, output_dtype=jnp.int8), 0.1, None, 0.07, implementation=i),
    "fake_quantize blocked": lambda x, i: jq.fake_quantize(
        x, _blocked_scale(x), axis=1, block_size=32, dtype=jnp.int4),
    "fake_quantize per-channel": lambda x, i: jq.fake_quantize(
        x, CHANNEL_SCALE, CHANNEL_ZERO_POINT, axis=1),
    "fake_quantize_learnable": lambda x, i: jq.fake_quantize_learnable(x, 0.05, 1.0),
    "fake_quantize_learnable per-channel": lambda x, i: jq.fake_quantize_learnable(
        x, CHANNEL_SCALE, CHANNEL_SCALE * 100, axis=1),
    "fake_quantize_dynamic per-token": lambda x, i: jq.fake_quantize_dynamic(x, axis=0),
    # Each statistic of the recipes: the batch kept (per row), reduced (per tensor, per
    # column), in blocks across it (32 columns) and along it.
    "choose_qparams absmax": lambda x, i: jq.choose_qparams(x),
    "choose_qparams minmax per-row": lambda x, i: jq.choose_qparams(
        x, jnp.uint8, axis=0, method="minmax"),
    "choose_qparams percentile per-column": lambda x, i: jq.choose_qparams(
        x, axis=1, method="percentile", percentile=99.0),
    "choose_qparams mse blocked": lambda x, i: jq.choose_qparams(
        x, jnp.int4, axis=1, block_size=32, method="mse"),
    "choose_qparams qmax_plus_half blocked along the batch": lambda x, i: jq.choose_qparams(
        x, jnp.int4, axis=0, block_size=4, method="qmax_plus_half"),
    # Zero points and scales per row: as long as the symbolic batch.
    "matmul_integer per-row": lambda x, i: jq.matmul_integer(
        _uint8(x), WEIGHT, jnp.full(x.shape[:1], 128, jnp.uint8), WEIGHT_ZERO_POINT),
    "qlinear_matmul per-row": lambda x, i: jq.qlinear_matmul(
        _uint8(x), jnp.full(x.shape[:1], 0.05), jnp.full(x.shape[:1], 128, jnp.uint8), WEIGHT,
        WEIGHT_SCALE, WEIGHT_ZERO_POINT, 0.5, np.uint8(3)),
    "quantized_dot_general per-row": lambda x, i: jq.quantized_dot_general(
        _uint8(x), WEIGHT, (((1,), (0,)), ((), ())), lhs_scale=jnp.full((x.shape[0], 1), 0.05),
        lhs_zero_point=jnp.full((x.shape[0], 1), 128, jnp.uint8), rhs_scale=WEIGHT_SCALE[None],
        rhs_zero_point=WEIGHT_ZERO_POINT[None]),
    # matmul_nbits exports in test_matmul.py (its own test of a symbolic batch, both
    # implementations).
}
# Ops with an implementation option: the others (fake quantization's is quantize's) have
# only the XLA evaluation.
KERNEL_OPS = [name for name in OPS
              if not name.startswith(("fake", "matmul", "qlinear", "choose", "pack",
                                      "quantized_dot"))]


def _export(op, implementation, platforms=None, **kwargs):
  (batch,) = export.symbolic_shape("b")
  return export.export(
      jax.jit(lambda x: op(x, implementation)), platforms=platforms, **kwargs
  )(jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))


# Ops whose blocks or bytes run along the batch, called on a batch of 2 (within one block
# of 4, an even count of codes) and of 7 (a short last block, a partial byte). To the
# others every batch is alike: 7 rows.
ALONG_THE_BATCH = frozenset(name for name in OPS if name.endswith(
    ("along the batch", "an odd count", "of a symbolic count")))


# The Pallas implementations: test_pallas_exports_for_several_platforms_at_once, whose
# program holds (and runs) the CPU one this test would export.
@pytest.mark.parametrize("name", OPS)
def test_export_with_a_symbolic_batch(name):
  op = OPS[name]
  exported = _export(op, "xla")
  rng = np.random.default_rng(0)
  for rows in (2, 7) if name in ALONG_THE_BATCH else (7,):
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    for got, want in zip(jax.tree.leaves(exported.call(x)),
                         jax.tree.leaves(op(x, "xla"))):
      assert got.shape == want.shape and got.dtype == want.dtype
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# Triton kernels are custom calls without JAX's export compatibility guarantee:
# exporting them is the user's explicit choice.
TRITON = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_pallas_exports_for_several_platforms_at_once(name):
  # Each platform's kernel is lowered for that platform only (Mosaic for TPU,
  # Triton for CUDA, interpret mode for CPU); a symbolic batch runs as a
  # dynamic grid on TPU and, as Triton has none, as the XLA formula on CUDA.
  exported = _export(OPS[name], "pallas", platforms=("cpu", "cuda", "tpu"),
                     disabled_checks=TRITON)
  assert exported.platforms == ("cpu", "cuda", "tpu")
  module = exported.mlir_module()
  assert "tpu_custom_call" in module
  x = np.random.default_rng(2).normal(size=(5, FEATURES)).astype(np.float32)
  for got, want in zip(jax.tree.leaves(exported.call(x)),
                       jax.tree.leaves(OPS[name](x, "xla"))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# int8 out: CUDA runs XLA for an int4 result (pallas_kernels._blockwise.triton_holds).
INT8_BLOCKED = "quantize blocked along the batch"


def test_a_concrete_batch_exports_triton_kernels_for_cuda():
  batch = 16
  exported = export.export(
      jax.jit(lambda x: OPS[INT8_BLOCKED](x, "pallas")), platforms=("cuda",),
      disabled_checks=TRITON,
  )(jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))
  assert "xla.gpu.triton" in exported.mlir_module()


def test_default_implementation_picks_the_kernel_per_platform_when_lowered(monkeypatch):
  """One exported program: the kernel where PALLAS_FASTER lists the op, XLA elsewhere."""

  def exported(platforms, implementation=None):
    return export.export(
        jax.jit(lambda x: OPS[INT8_BLOCKED](x, implementation)), platforms=platforms,
        disabled_checks=TRITON,
    )(jax.ShapeDtypeStruct((16, FEATURES), jnp.float32))

  def interpreted(module):
    # On CPU a kernel runs in interpret mode: a loop over its grid, which the
    # XLA formula has none of.
    return "stablehlo.while" in module

  assert interpreted(exported(("cpu",), "pallas").mlir_module())
  assert "xla.gpu.triton" not in exported(("cpu", "cuda")).mlir_module()  # nothing listed
  monkeypatch.setattr(
      _dispatch, "PALLAS_FASTER", {"cuda": frozenset({_dispatch.Route("quantize_linear")})})
  jax.clear_caches()  # the ops' traces read the table
  try:
    both = exported(("cpu", "cuda"))
    cpu = exported(("cpu",)).mlir_module()
  finally:
    jax.clear_caches()
  assert "xla.gpu.triton" in both.mlir_module()
  assert not interpreted(cpu)
  x = np.random.default_rng(3).normal(size=(16, FEATURES)).astype(np.float32)
  np.testing.assert_array_equal(both.call(x), OPS[INT8_BLOCKED](x, "xla"))


def test_export_round_trips_through_serialization():
  op = OPS["dynamic per-token"]
  restored = export.deserialize(_export(op, "xla").serialize())
  x = np.random.default_rng(1).normal(size=(3, FEATURES)).astype(np.float32)
  for got, want in zip(restored.call(x), op(x, "xla")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# The eight lax.dot_general / lax.conv_general_dilated drop-ins as a model calls them:
# a Dense layer's (64, 32) kernel and a 3x3 Conv's (3, 3, 8, 16) HWIO kernel, stored by
# quantize_params (int8 per output feature; int4 in blocks of 32 along K, packed) where
# the op takes a QuantizedArray. The static int8 dot reads a sequence, (b, 5, 64): its
# zero point appends a row of ones to lhs along the longest free dim (docs/numerics.md),
# where b cannot be compared with 5; the fake-quant dot's per-token scale covers both.
_DROP_IN_RNG = np.random.default_rng(4)
DENSE_KERNEL = jnp.asarray(_DROP_IN_RNG.normal(size=(64, 32)) / 8, jnp.float32)
CONV_KERNEL = jnp.asarray(_DROP_IN_RNG.normal(size=(3, 3, 8, 16)) / 8, jnp.float32)
DENSE_INT8 = jq.quantize_params(DENSE_KERNEL, jq.QuantizationRule())
DENSE_INT4 = jq.quantize_params(
    DENSE_KERNEL, jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=32))
CONV_INT8 = jq.quantize_params(CONV_KERNEL, jq.QuantizationRule())
DENSE = (((1,), (0,)), ((), ()))
SEQUENCE_DENSE = (((2,), (0,)), ((), ()))
NHWC = dict(dimension_numbers=("NHWC", "HWIO", "NHWC"))
STATIC = dict(input_scale=np.float32(0.02), input_zero_point=np.int8(3))

# name -> (function of x, x's shape after the batch).
DROP_INS = {
    "dot_general_dynamic_int8": (
        lambda x: jq.dot_general_dynamic_int8(x, DENSE_INT8, DENSE), (64,)),
    "dot_general_static_int8": (
        lambda x: jq.dot_general_static_int8(x, DENSE_INT8, SEQUENCE_DENSE, **STATIC), (5, 64)),
    "dot_general_weight_only": (
        lambda x: jq.dot_general_weight_only(x, DENSE_INT4, DENSE), (64,)),
    "dot_general_fake_quant": (
        lambda x: jq.dot_general_fake_quant(x, DENSE_KERNEL, SEQUENCE_DENSE), (5, 64)),
    "conv_general_dilated_dynamic_int8": (lambda x: jq.conv_general_dilated_dynamic_int8(
        x, CONV_INT8, (1, 1), "SAME", **NHWC), (6, 6, 8)),
    "conv_general_dilated_static_int8": (lambda x: jq.conv_general_dilated_static_int8(
        x, CONV_INT8, (2, 2), "SAME", **NHWC, **STATIC), (7, 7, 8)),
    # A float kernel: quantized inside, in blocks of 4 input features.
    "conv_general_dilated_weight_only": (lambda x: jq.conv_general_dilated_weight_only(
        x, CONV_KERNEL, (1, 1), "SAME", **NHWC, dtype=jnp.int4, block_size=4), (6, 6, 8)),
    "conv_general_dilated_fake_quant": (lambda x: jq.conv_general_dilated_fake_quant(
        x, CONV_KERNEL, (1, 1), "SAME", **NHWC), (6, 6, 8)),
}


@pytest.mark.parametrize("name", DROP_INS)
def test_drop_ins_export_with_a_symbolic_batch(name):
  """Bit for bit the op called under jit at each batch, the float ones included.

  The int8 drop-ins add their products in int32 (exact in any order) before
  a float32 epilogue; on XLA:CPU a dot with a symbolic row count takes the
  exact bfloat16 dot where a concrete one of at most 256 rows (any number on
  a CPU with AMX int8 tiles) takes the int8 dot: the same integers. The float
  dots and convolutions (weight-only, fake-quant) could differ by their
  summation order, had XLA picked another
  algorithm for the exported program: measured, it does not (the exported
  program is compiled for the concrete batch it is called with). Exported
  for CPU and CUDA at once: for CUDA the int8 drop-ins lower another
  contraction (the bfloat16 dot, the convolution by taps), which must take
  a symbolic batch too, and the packed int4 weight dequantizes in a Triton
  kernel (``_dispatch.PALLAS_FASTER``), which export takes only when told.
  """
  op, shape = DROP_INS[name]
  function = jax.jit(op)
  (batch,) = export.symbolic_shape("b")
  exported = export.export(function, platforms=("cpu", "cuda"), disabled_checks=TRITON)(
      jax.ShapeDtypeStruct((batch, *shape), jnp.float32))
  rng = np.random.default_rng(5)
  for rows in (1, 4):
    x = rng.normal(size=(rows, *shape)).astype(np.float32)
    assert_bits_equal(exported.call(x), function(x), f"batch {rows}")


# Each window option once, the two integer convolutions in turn: both compute the output
# length in integer_conv_by_taps (each exports in test_drop_ins_export_with_a_symbolic_batch too).
@pytest.mark.parametrize("options, static", [
    (dict(window_strides=(1,), padding="VALID"), False),
    (dict(window_strides=(2,), padding="VALID"), True),
    (dict(window_strides=(1,), padding="VALID", rhs_dilation=(2,)), False),
    (dict(window_strides=(1,), padding=[(1, 0)]), True),
], ids=["valid-dynamic", "stride-2-static", "dilated-dynamic", "explicit-static"])
def test_integer_convolutions_export_with_a_symbolic_length(options, static):
  """A sequence of symbolic length (nnx.Conv's CAUSAL or CIRCULAR padding calls VALID).

  The CUDA branch (the convolution by taps, which every platform traces)
  did Python arithmetic on the output length: "Symbolic dimension
  comparison 't - 2' > '0' is inconclusive", for CPU too.
  """
  kernel = _DROP_IN_RNG.normal(size=(3, 2, 4)).astype(np.float32)
  op = jq.conv_general_dilated_static_int8 if static else jq.conv_general_dilated_dynamic_int8
  function = jax.jit(lambda x: op(x, kernel, dimension_numbers=("NWC", "WIO", "NWC"), **options,
                                  **(dict(input_scale=np.float32(0.1)) if static else {})))
  exported = export.export(function, platforms=("cpu", "cuda"))(
      jax.ShapeDtypeStruct(export.symbolic_shape("b, t") + (2,), jnp.float32))
  x = np.random.default_rng(1).normal(size=(2, 9, 2)).astype(np.float32)
  assert_bits_equal(exported.call(x), function(x))


@pytest.mark.parametrize("name", ["dot_general_fake_quant", "conv_general_dilated_fake_quant"])
def test_fake_quant_drop_in_gradients_export_with_a_symbolic_batch(name):
  """d/dx and d/dw of a sum of the output, bit for bit the gradient under jit.

  The activations' scale is held constant: its statistics are not
  differentiated.
  """
  op = {"dot_general_fake_quant": lambda x, w: jq.dot_general_fake_quant(x, w, SEQUENCE_DENSE),
        "conv_general_dilated_fake_quant": lambda x, w: jq.conv_general_dilated_fake_quant(
            x, w, (1, 1), "SAME", **NHWC)}[name]
  shape = DROP_INS[name][1]
  kernel = DENSE_KERNEL if name.startswith("dot") else CONV_KERNEL
  gradient = jax.jit(jax.grad(lambda x, w: jnp.sum(op(x, w)), argnums=(0, 1)))
  (batch,) = export.symbolic_shape("b")
  exported = export.export(gradient)(
      jax.ShapeDtypeStruct((batch, *shape), jnp.float32),
      jax.ShapeDtypeStruct(kernel.shape, jnp.float32))
  rng = np.random.default_rng(6)
  for rows in (1, 4):
    x = rng.normal(size=(rows, *shape)).astype(np.float32)
    for got, want, of in zip(exported.call(x, kernel), gradient(x, kernel), ("x", "w")):
      assert np.any(np.asarray(want) != 0)
      assert_bits_equal(got, want, f"d/d{of}, batch {rows}")


@pytest.mark.parametrize("name", ["dynamic_quantize_linear scale", "fake_quantize_dynamic"])
def test_dynamic_gradients_export_with_a_symbolic_batch(name):
  """The scale's derivative (the min and max's, split among ties) and
  ``fake_quantize_dynamic``'s straight-through one, bit for bit under jit.

  JAX's own derivative of a variadic reduce builds a tree of pairs from
  static shapes; the statistics' derivative is jaxquant's own for that reason.
  """
  op = {
      "dynamic_quantize_linear scale": lambda x: jnp.sum(
          jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0)[1]),
      "fake_quantize_dynamic": lambda x: jnp.sum(jnp.sin(jq.fake_quantize_dynamic(x))),
  }[name]
  gradient = jax.jit(jax.grad(op))
  (batch,) = export.symbolic_shape("b")
  exported = export.export(gradient, platforms=("cpu", "cuda"))(
      jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))
  rng = np.random.default_rng(7)
  for rows in (1, 5):
    # Every row's max appears twice: a tie the derivative splits.
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    x[:, 1] = x.max(axis=1)
    want = gradient(x)
    assert np.any(np.asarray(want) != 0)
    assert_bits_equal(exported.call(x), want, f"batch {rows}")


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _assert_leaves_equal(got, want, message):
  """Leaf by leaf, not :func:`assert_tree_bits_equal`: a tree an exported program returns
  keeps the symbolic shape in its static metadata, a structure of its own."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want), message
  for got_leaf, want_leaf in zip(got, want):
    assert_bits_equal(got_leaf, want_leaf, message)


@pytest.mark.parametrize("momentum", [0.9, None])
def test_observe_exports_with_a_symbolic_batch(momentum):
  """A calibration step on a batch of any size: the range and the histogram (rebinned as
  the range grows, NaNs left out) bit for bit under jit, from a state that has seen a batch."""
  update = jax.jit(jq.observe)
  rng = np.random.default_rng(9)
  state = update(jq.init_observer(momentum=momentum, bins=64),
                 rng.normal(size=(6, FEATURES)).astype(np.float32))
  (batch,) = export.symbolic_shape("b")
  exported = export.export(update)(
      _abstract(state), jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))
  for rows in (1, 6):
    x = (rng.normal(size=(rows, FEATURES)) * 4).astype(np.float32)
    x[0, 0] = np.nan
    got, want = exported.call(state, x), update(state, x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert np.any(np.asarray(want.histogram) != np.asarray(state.histogram))
    for field in ("low", "high", "histogram", "histogram_range", "count"):
      assert_bits_equal(getattr(got, field), getattr(want, field), f"{field}, batch {rows}")


# A stack of layers (scanned, or experts), its length symbolic: int4 kernels in blocks of
# 16 along their inputs (packed), uint8 gates with a zero point per output feature (over
# every layer), biases float.
STACKED_RULES = (jq.QuantizationRule("kernel", dtype=jnp.int4, axis=-2, block_size=16),
                 jq.QuantizationRule("gate", dtype=jnp.uint8, method="minmax"))
STACKED_SHAPES = {"kernel": (64, 32), "gate": (64, 8), "bias": (32,)}


def _stacked(layers, seed):
  rng = np.random.default_rng(seed)
  return {name: rng.normal(size=(layers, *shape)).astype(np.float32)
          for name, shape in STACKED_SHAPES.items()}


def _stacked_abstract():
  (layers,) = export.symbolic_shape("b")
  return {name: jax.ShapeDtypeStruct((layers, *shape), jnp.float32)
          for name, shape in STACKED_SHAPES.items()}


@pytest.mark.slow
def test_quantize_params_exports_for_a_symbolic_count_of_stacked_layers():
  """The stored leaves and the dequantized tree bit for bit under jit.

  A ``QuantizedArray``'s logical shape is static (aux data), so the tree an exported
  program returns keeps the symbolic one (docs/models.md): dequantize inside the
  program, or give the array its shape back.
  """

  def stored_and_dequantized(params):
    stored = jq.quantize_params(params, STACKED_RULES)
    return stored, jq.dequantize_params(stored)

  function = jax.jit(stored_and_dequantized)
  exported = export.export(function)(_stacked_abstract())
  for layers in (1, 3):
    params = _stacked(layers, layers)
    got, want = exported.call(params), function(params)
    _assert_leaves_equal(got, want, f"{layers} layers")
    kernel = got[0]["kernel"]
    assert export.is_symbolic_dim(kernel.shape[0]) and kernel.packed
    assert_bits_equal(dataclasses.replace(kernel, shape=want[0]["kernel"].shape).dequantize(),
                      want[1]["kernel"], f"{layers} layers")


def test_learnable_parameters_export_where_each_scale_covers_a_static_count():
  """LSQ's gradient factor is static: blocks of 16 inputs export; one scale per output
  feature over every layer covers a symbolic count, refused by name."""
  kernel = {"kernel": _stacked_abstract()["kernel"]}
  learnable = jax.jit(lambda w, rule: jq.quantize_params(w, rule, learnable=True),
                      static_argnums=1)
  exported = export.export(learnable)(kernel, STACKED_RULES[0])
  w = {"kernel": _stacked(3, 0)["kernel"]}
  got, want = exported.call(w), learnable(w, STACKED_RULES[0])
  assert got["kernel"].grad_factor == want["kernel"].grad_factor
  _assert_leaves_equal(got, want, "blocks of 16")
  with pytest.raises(ValueError, match="keeping every symbolic dim.* got 64\\*b elements"):
    export.export(learnable)(kernel, jq.QuantizationRule(dtype=jnp.int4))


@pytest.mark.parametrize("name, call", [
    ("matmul_integer", lambda a, b: jq.matmul_integer(a, b)),
    # The innermost public op names an error.
    ("quantized_dot_general", lambda a, b: jq.dot_general_dynamic_int8(
        a.astype(jnp.float32), b.astype(jnp.float32), (((1,), (0,)), ((), ())))),
])
def test_a_symbolic_contraction_depth_is_a_named_error(name, call):
  """The exact int8 dot is chosen by its depth on every platform: a symbolic depth is
  refused by name (it was JAX's InconclusiveDimensionOperation from inside the dot)."""
  depth, = export.symbolic_shape("k")
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int8)
  with pytest.raises(ValueError, match=f"{name}: the contracting dim must be static"):
    export.export(jax.jit(call))(spec((3, depth)), spec((depth, 4)))
