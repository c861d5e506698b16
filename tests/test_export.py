"""``jax.export`` with a symbolic batch dimension, as serving stacks export a model.

Each op is exported once for ``(b, 64)`` inputs and the exported program is
called on concrete batches; its results must equal the op called directly.
"""

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

FEATURES = 64


def _blocked_scale(x):
  return jnp.full((x.shape[0], FEATURES // 32), 0.05, jnp.float32)


OPS = {
    "quantize per-tensor": lambda x: jq.quantize_linear(x, 0.05, output_dtype=jnp.int8),
    "quantize per-channel": lambda x: jq.quantize_linear(
        x, jnp.linspace(0.01, 0.1, FEATURES), axis=1, output_dtype=jnp.int8),
    "quantize blocked": lambda x: jq.quantize_linear(
        x, _blocked_scale(x), axis=1, block_size=32, output_dtype=jnp.int4),
    "dequantize blocked": lambda x: jq.dequantize_linear(
        jq.quantize_linear(x, 0.05, output_dtype=jnp.int8), _blocked_scale(x), axis=1,
        block_size=32),
    "dynamic per-tensor": lambda x: jq.dynamic_quantize_linear(x),
    "dynamic per-token": lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0),
    "dynamic per-channel": lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=1),
    "dynamic blocked": lambda x: jq.dynamic_quantize_linear(
        x, dtype=jnp.int8, axis=1, block_size=32, symmetric=True),
    "fake_quantize blocked": lambda x: jq.fake_quantize(
        x, _blocked_scale(x), axis=1, block_size=32, dtype=jnp.int4),
    "fake_quantize_learnable": lambda x: jq.fake_quantize_learnable(x, 0.05, 1.0),
    "fake_quantize_dynamic per-token": lambda x: jq.fake_quantize_dynamic(x, axis=0),
    "quantized_add": lambda x: jq.quantized_add(
        jq.quantize_linear(x, 0.05, output_dtype=jnp.int8), 0.05, None,
        jq.quantize_linear(-x, 0.1, output_dtype=jnp.int8), 0.1, None, 0.07),
}


@pytest.mark.parametrize("name", OPS)
def test_export_with_a_symbolic_batch(name):
  op = OPS[name]
  (batch,) = export.symbolic_shape("b")
  exported = export.export(jax.jit(op))(
      jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))
  rng = np.random.default_rng(0)
  for rows in (2, 6):
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    for got, want in zip(jax.tree.leaves(exported.call(x)), jax.tree.leaves(op(x))):
      assert got.shape == want.shape and got.dtype == want.dtype
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_export_round_trips_through_serialization():
  (batch,) = export.symbolic_shape("b")
  op = OPS["dynamic per-token"]
  exported = export.export(jax.jit(op))(jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))
  restored = export.deserialize(exported.serialize())
  x = np.random.default_rng(1).normal(size=(3, FEATURES)).astype(np.float32)
  for got, want in zip(restored.call(x), op(x)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
