"""QuantizedArray / FakeQuantizedArray as pytree leaves, and quantize_params by rules."""

from __future__ import annotations

import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from quant_testing import assert_bits_equal
from quant_testing import run_on_cpu_devices
from quant_testing import spec_fake_quantize

KEY = jax.random.key(0)
PARAMS = {
    "encoder": {"kernel": jax.random.normal(KEY, (70, 16)), "bias": jnp.ones(16)},
    "head": {"kernel": jax.random.normal(jax.random.key(1), (16, 10)).astype(jnp.bfloat16)},
    "step": jnp.int32(3),
}

LAYOUTS = [
    jq.QuantizationRule(),
    jq.QuantizationRule(axis=None, method="minmax", dtype=jnp.uint8),
    jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=32),        # ragged: 70 = 2 * 32 + 6
    jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=32, packed=False),
    jq.QuantizationRule(dtype=jnp.int2, axis=0, block_size=16, method="mse"),
    jq.QuantizationRule(dtype=jnp.float8_e4m3fn),
    jq.QuantizationRule(dtype=jnp.float4_e2m1fn, axis=-2, block_size=32),
    jq.QuantizationRule(dtype=jnp.float6_e2m3fn, axis=-2, block_size=32),
    jq.QuantizationRule(dtype=jnp.float6_e2m3fn, axis=-2, block_size=32, packed=False),  # codes
    jq.QuantizationRule(transposed=True),
    jq.QuantizationRule(dtype=jnp.int4, axis=0, method="minmax", packed=False, transposed=True),
]


def _rule_id(rule):
  return (f"{np.dtype(rule.dtype).name}-{rule.block_size}"
          + ("-transposed" if rule.transposed else ""))


def _is_quantized(leaf):
  return isinstance(leaf, (jq.QuantizedArray, jq.FakeQuantizedArray))


def _leaves(tree):
  return jax.tree.leaves(tree, is_leaf=_is_quantized)


@pytest.mark.parametrize("rule", LAYOUTS, ids=_rule_id)
def test_dequantize_is_quantize_then_dequantize_linear(rule):
  w = PARAMS["encoder"]["kernel"]
  quantized = jq.quantize_params(w, rule)
  axis = None if rule.axis is None else rule.axis % 2
  scale, zero_point = jq.choose_qparams(w, rule.dtype, axis=axis, block_size=rule.block_size,
                                        method=rule.method)
  q = jq.quantize_linear(w, scale, zero_point, axis=axis, block_size=rule.block_size,
                         output_dtype=rule.dtype)
  codes = "float6" in np.dtype(rule.dtype).name
  expected = jq.dequantize_linear(q, scale, zero_point, axis=axis, block_size=rule.block_size,
                                  packed_dtype=rule.dtype if codes else None)
  np.testing.assert_array_equal(quantized.dequantize(), expected)
  np.testing.assert_array_equal(quantized.scale, scale)
  assert quantized.packed == (rule.packed and np.dtype(rule.dtype).itemsize == 1
                              and jq._dtypes.quantized_dtype("", rule.dtype).bits < 8)
  if quantized.packed:
    assert quantized.values.dtype == jnp.uint8
    bits = jq._dtypes.quantized_dtype("", rule.dtype).bits
    assert quantized.values.size == -(-w.size * bits // 8)


def test_rules_first_match_wins_rank_and_dtype_filters():
  rules = [jq.QuantizationRule("head", dtype=None),
           jq.QuantizationRule("kernel", dtype=jnp.int4, axis=-2, block_size=32),
           jq.QuantizationRule(".*", dtype=jnp.int8, min_ndim=1)]
  quantized = jq.quantize_params(PARAMS, rules)
  assert quantized["head"]["kernel"] is PARAMS["head"]["kernel"]        # kept float
  assert quantized["encoder"]["kernel"].dtype == jnp.int4
  assert quantized["encoder"]["bias"].dtype == jnp.int8                  # min_ndim=1
  assert quantized["step"] is PARAMS["step"]                             # not float
  default = jq.quantize_params(PARAMS, jq.QuantizationRule())
  assert not isinstance(default["encoder"]["bias"], jq.QuantizedArray)   # min_ndim=2
  assert default["head"]["kernel"].output_dtype == jnp.bfloat16
  assert jq.dequantize_params(default)["head"]["kernel"].dtype == jnp.bfloat16
  again = jq.quantize_params(default, jq.QuantizationRule(dtype=jnp.int2))
  assert again["encoder"]["kernel"] is default["encoder"]["kernel"]     # quantized stays


_RNG = np.random.default_rng(5)
# Nested lists, tuples and None; 0-d, one-element and empty leaves; half-precision
# kernels of odd lengths (ragged blocks, a packed byte stream ending mid-byte);
# leaves that are not float arrays.
ODD_TREE = {
    "layers": [{"kernel": jnp.asarray(_RNG.normal(size=(5, 7)), jnp.float32)},
               ({"kernel": jnp.asarray(_RNG.normal(size=(7, 3)), jnp.bfloat16)}, None)],
    "head": (jnp.asarray(_RNG.normal(size=(3, 1)), jnp.float16),),
    "gain": jnp.float32(-1.5), "one": jnp.full((1, 1), 0.3), "empty": jnp.zeros((0, 4)),
    "step": jnp.int32(3), "mask": np.ones((2, 2), bool), "lr": 0.1, "name": "mlp",
}
ODD_RULES = [jq.QuantizationRule("layers|head", axis=-2, block_size=2),
             jq.QuantizationRule(axis=None, min_ndim=0)]


# Learnable, int8 (unpacked) and uint2 (packed, unsigned): packed signed int4 deploys
# from learnable in test_learnable_then_quantize_params_deploys_bit_for_bit.
@pytest.mark.parametrize("dtype, learnable", [
    (jnp.int8, False), (jnp.int4, False), (jnp.uint2, False), (jnp.int8, True),
    (jnp.uint2, True)], ids=lambda value: value if isinstance(value, bool) else value.__name__)
def test_any_pytree_dequantizes_to_the_formula_and_keeps_other_leaves(dtype, learnable):
  """Each matched leaf is round(w / s) * s at its rule's scale, bit for bit (NumPy's), in its own
  dtype; with learnable=True so are the fake-quant forward and the deployed one, at moved scales."""
  rules = [dataclasses.replace(rule, dtype=dtype) for rule in ODD_RULES]
  quantized = jq.quantize_params(ODD_TREE, rules, learnable=learnable)
  if learnable:
    quantized = jax.tree.map(
        lambda leaf: dataclasses.replace(leaf, scale=leaf.scale * 1.1)
        if isinstance(leaf, jq.FakeQuantizedArray) else leaf, quantized, is_leaf=_is_quantized)
  versions = [quantized, jq.quantize_params(quantized)] if learnable else [quantized]
  for version in versions:
    dequantized = jq.dequantize_params(version)
    assert jax.tree.structure(dequantized) == jax.tree.structure(ODD_TREE)
    for (path, leaf), original, stored in zip(
        jax.tree_util.tree_leaves_with_path(dequantized), jax.tree.leaves(ODD_TREE),
        jax.tree.leaves(quantized, is_leaf=_is_quantized)):
      if not _is_quantized(stored):
        assert leaf is original, path
        continue
      assert leaf.dtype == original.dtype and leaf.shape == original.shape, path
      axis, block_size = stored.axis, stored.block_size
      expected = spec_fake_quantize(original, stored.scale, getattr(stored, "zero_point", None),
                                    dtype, axis, block_size)
      assert_bits_equal(leaf, expected, jq._params.path_name(path))
  assert sum(map(_is_quantized, jax.tree.leaves(quantized, is_leaf=_is_quantized))) == 6


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.float8_e4m3fn, jnp.float4_e2m1fn])
def test_leaves_already_quantized_are_returned_unchanged(dtype):
  """A second quantize_params (deploying a model some of whose layers are stored) keeps the
  stored leaves, also those of a float dtype, which a float rule would otherwise match."""
  rule = jq.QuantizationRule(dtype=dtype)
  quantized = jq.quantize_params(PARAMS, rule)
  again = jq.quantize_params(quantized, rule)
  for first, second in zip(_leaves(quantized), _leaves(again)):
    assert first is second


def test_path_names_cover_dicts_lists_and_attributes():
  assert jq._params.path_name(jax.tree_util.tree_flatten_with_path(
      {"layers": [0, {"kernel": 1}]})[0][1][0]) == "layers/1/kernel"


def test_jit_compiles_once_per_layout_and_not_per_value():
  traces = []

  @jax.jit
  def forward(params, x):
    traces.append(1)
    return x @ jq.dequantize_params(params)["encoder"]["kernel"]

  x = jnp.ones((2, 70))
  rule = jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=32)
  first = jq.quantize_params(PARAMS, rule)
  second = jq.quantize_params(jax.tree.map(lambda p: p * 2, PARAMS), rule)
  forward(first, x)
  forward(second, x)
  assert len(traces) == 1
  aux = jax.tree.structure(first)
  assert aux == jax.tree.structure(second)


def test_vmap_over_a_stack_of_quantized_layers():
  stack = jax.random.normal(KEY, (3, 70, 16))
  rule = jq.QuantizationRule(dtype=jnp.int8)
  per_layer = [jq.quantize_params(w, rule) for w in stack]
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer)
  np.testing.assert_array_equal(
      jax.vmap(lambda q: q.dequantize())(stacked),
      jnp.stack([q.dequantize() for q in per_layer]))


def test_grad_reaches_the_float_parts():
  quantized = jq.quantize_params(PARAMS["encoder"]["kernel"], jq.QuantizationRule())
  grad = jax.grad(lambda q: jnp.sum(q.dequantize() ** 2), allow_int=True)(quantized)
  # d/ds sum((q * s)^2) = 2 * s * sum over the column of q^2
  q = quantized.values.astype(jnp.float32)
  np.testing.assert_allclose(grad.scale, 2 * quantized.scale * jnp.sum(q * q, axis=0), rtol=1e-5)
  fake = jq.quantize_params(PARAMS["encoder"]["kernel"], jq.QuantizationRule(), learnable=True)
  grads = jax.grad(lambda f: jnp.sum(f.dequantize()))(fake)
  np.testing.assert_array_equal(grads.value, jnp.ones_like(fake.value))   # straight through
  assert grads.scale.shape == fake.scale.shape and np.any(grads.scale != 0)


# The default int8 layout deploys from learnable bit for bit in
# test_any_pytree_dequantizes_to_the_formula_and_keeps_other_leaves and
# test_a_learnable_stack_trains_and_deploys_each_layer_alone; here int8 deploys transposed.
@pytest.mark.slow
@pytest.mark.parametrize("rule", [jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=32),
                                  jq.QuantizationRule(dtype=jnp.int2, method="qmax_plus_half"),
                                  jq.QuantizationRule(transposed=True)], ids=_rule_id)
def test_learnable_then_quantize_params_deploys_bit_for_bit(rule):
  fake = jq.quantize_params({k: v for k, v in PARAMS.items() if k != "step"}, rule,
                            learnable=True)
  # A few gradient steps move the weights and scales off their PTQ values.
  def loss(params):
    dequantized = jq.dequantize_params(params)
    return sum(jnp.sum(jnp.sin(3 * leaf.astype(jnp.float32)))
               for leaf in jax.tree.leaves(dequantized))
  for _ in range(3):
    fake = jax.tree.map(lambda p, g: p - 0.05 * g, fake, jax.grad(loss)(fake))
  assert not np.array_equal(_leaves(fake)[1].scale,
                            _leaves(jq.quantize_params(PARAMS, rule, learnable=True))[1].scale)
  deployed = jq.quantize_params(fake)
  for fake_leaf, leaf in zip(_leaves(fake), _leaves(deployed)):
    if isinstance(fake_leaf, jq.FakeQuantizedArray):
      assert isinstance(leaf, jq.QuantizedArray) and leaf.dtype == np.dtype(rule.dtype)
      assert leaf.transposed == rule.transposed
      np.testing.assert_array_equal(leaf.dequantize(), fake_leaf.dequantize())


@pytest.mark.parametrize("learnable", [False, True])
def test_numpy_float64_weights_quantize_as_jax_reads_them(learnable):
  """A float64 NumPy weight (np.load, a converted checkpoint) is the float32 array JAX makes of it."""
  w = np.asarray(PARAMS["encoder"]["kernel"], np.float64)
  rule = jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=32)
  quantized = jq.quantize_params({"w": w}, rule, learnable=learnable)
  deployed = jq.dequantize_params(jq.quantize_params(quantized))["w"]
  scale, _ = jq.choose_qparams(w.astype(np.float32), jnp.int4, axis=0, block_size=32)
  expected = jq.fake_quantize(w.astype(np.float32), scale, dtype=jnp.int4, axis=0, block_size=32)
  if learnable:
    expected = jq.dequantize_params(quantized)["w"]
  assert deployed.dtype == expected.dtype == jnp.float32
  assert_bits_equal(deployed, expected)


def test_savez_round_trip_bit_identical(tmp_path):
  quantized = jq.quantize_params(PARAMS, jq.QuantizationRule(dtype=jnp.int4, axis=-2,
                                                             block_size=32))
  leaves, treedef = jax.tree.flatten(quantized)
  np.savez(tmp_path / "params.npz", *[np.asarray(leaf) for leaf in leaves])
  with np.load(tmp_path / "params.npz") as stored:
    loaded = jax.tree.unflatten(treedef, [jnp.asarray(stored[f"arr_{i}"])
                                          for i in range(len(leaves))])
  for before, after in zip(jax.tree.leaves(jq.dequantize_params(quantized)),
                           jax.tree.leaves(jq.dequantize_params(loaded))):
    np.testing.assert_array_equal(before, after)


def test_orbax_round_trip_bit_identical(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  quantized = jq.quantize_params(PARAMS, [jq.QuantizationRule("encoder", dtype=jnp.int2),
                                          jq.QuantizationRule(dtype=jnp.int8)])
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "checkpoint", quantized)
    checkpointer.wait_until_finished()
    loaded = checkpointer.restore(tmp_path / "checkpoint", quantized)
  assert jax.tree.structure(loaded) == jax.tree.structure(quantized)
  for before, after in zip(jax.tree.leaves(jq.dequantize_params(quantized)),
                           jax.tree.leaves(jq.dequantize_params(loaded))):
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.int2])
def test_a_one_row_packed_weight_is_one_layer(dtype):
  """A (1, n) kernel (one input feature) packs in rows of whole bytes, (1, n * bits / 8),
  which the flat layout also fits after one leading dim: the fewer stack dims are read."""
  w = PARAMS["encoder"]["kernel"][:1]
  quantized = jq.quantize_params(w, jq.QuantizationRule(dtype=dtype))
  assert quantized.values.shape == (1, 16 * jq._dtypes.quantized_dtype("", dtype).bits // 8)
  assert jq._params.stacked_dims(quantized) == 0
  q = jq.quantize_linear(w, quantized.scale, axis=1, output_dtype=dtype)
  np.testing.assert_array_equal(quantized.dequantize(),
                                jq.dequantize_linear(q, quantized.scale, axis=1))
  model = jq.export_onnx(quantized)  # one layer's weight
  assert [node.op_type for node in model.graph.node] == ["DequantizeLinear", "MatMul"]


def test_nbytes_counts_packed_storage():
  w = PARAMS["encoder"]["kernel"]
  int4 = jq.quantize_params(w, jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=32))
  assert int4.nbytes == w.size // 2 + int4.scale.size * 4


@pytest.mark.parametrize("learnable", [False, True])
def test_ellipsis_index_is_the_whole_stored_array(learnable):
  """``x[...]`` is how Flax NNX layers read a kernel; other keys would cut blocks."""
  stored = jq.quantize_params(PARAMS["encoder"]["kernel"], jq.QuantizationRule(), learnable=learnable)
  assert stored[...] is stored
  with pytest.raises(TypeError, match=r"key must be \.\.\."):
    stored[0]  # pylint: disable=pointless-statement
  # Not an array: NumPy and jnp name what to do instead of failing in int().
  for convert in (np.asarray, jnp.asarray):
    with pytest.raises(TypeError, match=r"is not an array: its float value is \.dequantize\(\)"):
      convert(stored)


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxquant as jq
    mesh = jax.make_mesh((2,), ("model",))
    w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)),
                       NamedSharding(mesh, P(None, "model")))
    for rule in (jq.QuantizationRule(), jq.QuantizationRule(dtype=jnp.int4, axis=0,
                                                            block_size=16, packed=False)):
      q = jax.jit(lambda w: jq.quantize_params(w, rule))(w)
      assert q.values.sharding.spec == P(None, "model"), q.values.sharding
      assert len(q.values.addressable_shards) == 2
      assert q.values.addressable_shards[0].data.shape == (64, 16)
      y = jax.jit(lambda q: q.dequantize())(q)
      assert y.sharding.spec == P(None, "model"), y.sharding
      np.testing.assert_array_equal(y, jq.quantize_params(np.asarray(w), rule).dequantize())
    print("ok")
""")


@pytest.mark.slow
def test_sharded_parameters_stay_sharded():
  """Two CPU devices in a fresh process (the device count is fixed at jax's start)."""
  assert run_on_cpu_devices(SHARDED, 2, timeout=120).strip() == "ok"


SHARDED_PACKED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxquant as jq
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    forward = jax.jit(lambda x, q: x @ jq.dequantize_params(q))
    for spec, values_spec, ways in [
        (P(None, "model"), P(None, "model"), 2),                    # minor dim split: rows layout
        (P("data", "model"), P("data", "model"), 8),
        (P(None, ("data", "model")), P(None, ("data", "model")), 8),  # 8 ways along the columns
        (P(("data", "model"), None), P(("data", "model"), None), 8),   # 8 ways along rows
    ]:
      w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)), NamedSharding(mesh, spec))
      for rule in (jq.QuantizationRule(dtype=jnp.int4),
                   jq.QuantizationRule(dtype=jnp.int2, axis=0, block_size=8)):
        q = jax.jit(lambda w: jq.quantize_params(w, rule))(w)
        assert q.packed and q.values.sharding.spec == values_spec, (spec, q.values.sharding)
        assert len({s.device for s in q.values.addressable_shards}) == 8
        assert q.values.addressable_shards[0].data.size * ways == q.values.size, spec
        y = jax.jit(lambda q: q.dequantize())(q)
        assert y.sharding.spec == spec, (spec, y.sharding)
        reference = jq.quantize_params(np.asarray(w), rule)
        np.testing.assert_array_equal(y, reference.dequantize())
        # Rows of whole bytes are packed as rows however x is split: the unsharded weight's.
        np.testing.assert_array_equal(q.values, reference.values)
        np.testing.assert_array_equal(jq.unpack(q.values, q.shape, q.dtype),
                                      jq.unpack(reference.values, q.shape, q.dtype))
        out = forward(x, q)
        assert out.sharding.spec == P(None, spec[1]), (spec, out.sharding)  # x is replicated
        np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(reference.dequantize()),
                                   rtol=1e-5, atol=1e-5)
    # On an automatic mesh a tracer carries no sharding: rows of whole bytes keep the split.
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)),
                       NamedSharding(auto, P(None, ("data", "model"))))
    q = jax.jit(lambda w: jq.quantize_params(w, jq.QuantizationRule(dtype=jnp.int4)))(w)
    assert q.values.addressable_shards[0].data.shape == (64, 2), q.values.sharding
    # 4 blocks of 16 rows cannot split over 8 shards: a clear error, not JAX's deep one.
    w = jax.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P(("data", "model"))))
    try:
      jax.jit(lambda w: jq.quantize_params(
          w, jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=16)))(w)
    except ValueError as error:
      assert "rule.block_size" in str(error) and "8 shards" in str(error), error
    else:
      raise AssertionError("blocks that straddle shards were accepted")
    print("ok")
""")


@pytest.mark.slow
def test_sharded_packed_int4_and_int2_stay_sharded_on_8_devices():
  """Packed sub-byte weights sharded along either dim, 8 CPU devices in a fresh process."""
  assert run_on_cpu_devices(SHARDED_PACKED, 8).strip() == "ok"


@pytest.mark.parametrize("rule", [jq.QuantizationRule(), jq.QuantizationRule(axis=None),
                                  jq.QuantizationRule(dtype=jnp.uint8, axis=0, method="minmax")],
                         ids=["per-column", "per-tensor", "per-row"])
def test_transposed_stores_the_values_transposed(rule):
  """The values of the matrix (K, N) stored (N, K); the rest of the layout is the matrix's."""
  w = PARAMS["encoder"]["kernel"]
  stored = jq.quantize_params(w, rule)
  transposed = jq.quantize_params(w, dataclasses.replace(rule, transposed=True))
  assert transposed.transposed and not stored.transposed
  assert transposed.values.shape == (16, 70) and transposed.shape == (70, 16)
  assert (transposed.axis, transposed.stored_shape) == (stored.axis, (16, 70))
  assert_bits_equal(transposed.values, stored.values.T)
  for name in ("scale", "zero_point"):
    jax.tree.map(assert_bits_equal, getattr(transposed, name), getattr(stored, name))
  assert_bits_equal(transposed.dequantize(), stored.dequantize())
  assert_bits_equal(jax.jit(lambda x: x.dequantize())(transposed), stored.dequantize())
  assert transposed.nbytes == stored.nbytes


@pytest.mark.parametrize("rule", [
    jq.QuantizationRule(dtype=jnp.int4, transposed=True),                  # packed
    jq.QuantizationRule(axis=0, block_size=32, transposed=True),
    jq.QuantizationRule(min_ndim=1, transposed=True),                      # the bias
])
@pytest.mark.parametrize("learnable", [False, True])
def test_transposed_is_refused_where_values_cannot_be_swapped(rule, learnable):
  with pytest.raises(ValueError, match=r"^quantize_params: rule\.transposed must be False unless"):
    jq.quantize_params(PARAMS["encoder"], rule, learnable=learnable)


@pytest.mark.parametrize("changes", [dict(shape=(70,)), dict(block_size=32, axis=0)],
                         ids=["vector", "blocked"])
def test_a_transposed_array_built_by_hand_is_checked(changes):
  stored = jq.quantize_params(PARAMS["encoder"]["kernel"], jq.QuantizationRule(axis=None))
  wrong = dataclasses.replace(stored, transposed=True, **changes)
  with pytest.raises(ValueError, match=r"^x\.transposed must be False unless"):
    wrong.dequantize()


@pytest.mark.parametrize("rules, learnable, error, match", [
    ("int8", False, TypeError, "rules"),
    (jq.QuantizationRule(dtype=jnp.float32), False, TypeError, "dtype"),
    (jq.QuantizationRule(axis=3), False, ValueError, "axis"),
    (jq.QuantizationRule(dtype=jnp.float8_e4m3fn), True, TypeError, "integer"),
    (jq.QuantizationRule(method="minmax"), True, ValueError, "method"),
    (jq.QuantizationRule(), "yes", TypeError, "learnable"),
    # Checked before any parameter is matched: a negative stacked_dims
    # quantized biases, a bad pattern raised re.error, a bad method named
    # choose_qparams' argument.
    (jq.QuantizationRule(stacked_dims=-1), False, ValueError,
     r"^quantize_params: rule\.stacked_dims must be a non-negative int, got -1\.$"),
    (jq.QuantizationRule(min_ndim=-1), False, ValueError, r"rule\.min_ndim must be"),
    (jq.QuantizationRule(pattern="("), False, ValueError,
     r"^quantize_params: rule\.pattern must be a regular expression, got '\(' \(missing \)"),
    (jq.QuantizationRule(pattern=None), False, TypeError,
     r"^quantize_params: rule\.pattern must be a regular expression, got None"),
    (jq.QuantizationRule(method="max"), False, ValueError,
     r"^quantize_params: rule\.method must be 'absmax', .*, got 'max'\.$"),
    (jq.QuantizationRule(transposed="yes"), False, TypeError,
     r"^quantize_params: rule\.transposed must be a bool, got 'yes'\.$"),
])
def test_errors_name_the_argument(rules, learnable, error, match):
  with pytest.raises(error, match=match):
    jq.quantize_params(PARAMS, rules, learnable=learnable)


# A stack is read by how a layer's values are stored (unpacked, packed in 2-, 4- or 6-bit
# words, as float6 codes, transposed) and by its scale's and zero point's ranks, not by
# what the codes mean: float8 is stored as int8 is, float4 packs as int4 does (each
# one's values: test_dequantize_is_quantize_then_dequantize_linear), and the transposed
# int4 layout covers transposition.
STACK_LAYOUTS = [rule for rule in LAYOUTS
                 if rule.dtype not in (jnp.float8_e4m3fn, jnp.float4_e2m1fn)
                 and rule != jq.QuantizationRule(transposed=True)]


@pytest.mark.parametrize("rule", STACK_LAYOUTS, ids=_rule_id)
def test_a_stack_is_each_layer_quantized_alone(rule):
  """stacked_dims=2: a (2, 3) grid of (70, 16) layers, each quantized as if alone; the
  stack dequantizes to the stacked layers, and vmap or indexing its arrays gives a layer."""
  stack = jax.random.normal(KEY, (2, 3, 70, 16))
  stored = jq.quantize_params(stack, dataclasses.replace(rule, stacked_dims=2))
  assert stored.shape == (70, 16)
  want = [[jq.quantize_params(layer, rule) for layer in row] for row in stack]
  dequantized = stored.dequantize()
  assert dequantized.shape == stack.shape
  for i, j in np.ndindex(2, 3):
    layer = jax.tree.map(lambda x, i=i, j=j: x[i, j], stored)
    jax.tree.map(np.testing.assert_array_equal, layer, want[i][j])
    np.testing.assert_array_equal(dequantized[i, j], want[i][j].dequantize())
  np.testing.assert_array_equal(jax.vmap(jax.vmap(lambda x: x.dequantize()))(stored), dequantized)


def test_stacked_dims_counts_a_layers_rank():
  params = {"kernel": jnp.ones((4, 8, 8)), "bias": jnp.ones((4, 8))}
  stored = jq.quantize_params(params, jq.QuantizationRule(stacked_dims=1))
  assert isinstance(stored["kernel"], jq.QuantizedArray)
  assert stored["bias"] is params["bias"]
  with pytest.raises(ValueError, match="one layer's QuantizedArray"):
    jq.export_onnx(stored["kernel"])


@pytest.mark.parametrize("rule", [
    jq.QuantizationRule(stacked_dims=1),
    jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=4, stacked_dims=1),
], ids=["int8", "int4-blocked"])
def test_a_learnable_stack_trains_and_deploys_each_layer_alone(rule):
  """Each layer's FakeQuantizedArray is the one it would get alone: its fake-quantized
  weight and its gradients; the stack deploys to each layer's QuantizedArray."""
  stack = jax.random.normal(KEY, (3, 16, 8))
  cotangent = jax.random.normal(jax.random.key(2), stack.shape)
  learnable = jq.quantize_params(stack, rule, learnable=True)
  assert learnable.shape == (16, 8)
  one_layer = dataclasses.replace(rule, stacked_dims=0)
  loss = lambda x: jnp.sum(x.dequantize() * cotangent)
  stack_gradient = jax.grad(loss)(learnable)
  deployed = jq.quantize_params(learnable)
  for i, layer in enumerate(stack):
    alone = jq.quantize_params(layer, one_layer, learnable=True)
    np.testing.assert_array_equal(learnable.dequantize()[i], alone.dequantize())
    gradient = jax.grad(lambda x: jnp.sum(x.dequantize() * cotangent[i]))(alone)
    np.testing.assert_array_equal(stack_gradient.value[i], gradient.value)
    np.testing.assert_array_equal(stack_gradient.scale[i], gradient.scale)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(lambda x, i=i: x[i], deployed), jq.quantize_params(alone))
  np.testing.assert_array_equal(deployed.dequantize(), learnable.dequantize())
  sliced = jax.tree.map(lambda x: x[0], jq.quantize_params(stack, one_layer, learnable=True))
  with pytest.raises(ValueError, match="stacked_dims"):
    sliced.dequantize()


def test_a_learnable_stack_with_one_layer_s_scale_is_refused():
  """The scale must share the weight's stack dims: one layer's scale with a stack of 4."""
  learnable = jq.quantize_params(jax.random.normal(KEY, (4, 16, 8)),
                                 jq.QuantizationRule(stacked_dims=1), learnable=True)
  one_scale = dataclasses.replace(learnable, scale=learnable.scale[0])
  with pytest.raises(ValueError, match="stacked_dims"):
    one_scale.dequantize()


def test_arrays_sliced_under_a_static_layout_are_refused():
  """What nnx.scan does to a stack quantized as one tensor: the arrays lose a dim, the
  static shape does not."""
  stored = jq.quantize_params(jnp.ones((4, 8, 8)), jq.QuantizationRule())
  sliced = jax.tree.map(lambda x: x[0], stored)
  with pytest.raises(ValueError, match="stacked_dims"):
    sliced.dequantize()


SHARD_MAPPED = textwrap.dedent("""
    import dataclasses, jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxquant as jq
    mesh = jax.make_mesh((4,), ("x",))
    q = jq.quantize_params(jax.random.normal(jax.random.key(0), (16, 8)), jq.QuantizationRule())
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    split = dataclasses.replace(q, values=put(q.values, P("x")), scale=put(q.scale, P()))
    specs = dataclasses.replace(q, values=P("x"), scale=P())
    local = jax.jit(jax.shard_map(lambda q: q.dequantize(), mesh=mesh, in_specs=(specs,),
                                  out_specs=P("x")))
    assert np.array_equal(local(split), q.dequantize())
    t = jq.quantize_params(jax.random.normal(jax.random.key(0), (16, 8)),
                           jq.QuantizationRule(transposed=True))  # values (8, 16)
    split = dataclasses.replace(t, values=put(t.values, P(None, "x")), scale=put(t.scale, P()))
    specs = dataclasses.replace(t, values=P(None, "x"), scale=P())
    local = jax.jit(jax.shard_map(lambda t: t.dequantize(), mesh=mesh, in_specs=(specs,),
                                  out_specs=P("x")))
    assert np.array_equal(local(split), q.dequantize())
    print("ok")
""")


def test_unpacked_values_dequantize_inside_shard_map():
  """Inside shard_map the values are a shard of the static shape: not a stack, not sliced."""
  assert run_on_cpu_devices(SHARD_MAPPED, 4, timeout=120).strip() == "ok"
