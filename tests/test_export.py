"""``jax.export`` with a symbolic batch dimension, as serving stacks export a model.

Each op is exported once for ``(b, 64)`` inputs, on each implementation, and
the exported program is called on concrete batches; its results must equal
the op's XLA evaluation called directly. Pallas ops also export for several
platforms at once.
"""

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _dispatch

FEATURES = 64


def _blocked_scale(x):
  return jnp.full((x.shape[0], FEATURES // 32), 0.05, jnp.float32)


# Each op as a function of x and the implementation; the fake-quant ops have
# only the XLA evaluation (their kernels are quantize's).
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
    "dequantize blocked": lambda x, i: jq.dequantize_linear(
        jq.quantize_linear(x, 0.05, output_dtype=jnp.int8), _blocked_scale(x), axis=1,
        block_size=32, implementation=i),
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
    "quantized_add": lambda x, i: jq.quantized_add(
        jq.quantize_linear(x, 0.05, output_dtype=jnp.int8), 0.05, None,
        jq.quantize_linear(-x, 0.1, output_dtype=jnp.int8), 0.1, None, 0.07, implementation=i),
    "fake_quantize blocked": lambda x, i: jq.fake_quantize(
        x, _blocked_scale(x), axis=1, block_size=32, dtype=jnp.int4),
    "fake_quantize_learnable": lambda x, i: jq.fake_quantize_learnable(x, 0.05, 1.0),
    "fake_quantize_dynamic per-token": lambda x, i: jq.fake_quantize_dynamic(x, axis=0),
}
KERNEL_OPS = [name for name in OPS if not name.startswith("fake")]


def _export(op, implementation, platforms=None, **kwargs):
  (batch,) = export.symbolic_shape("b")
  return export.export(
      jax.jit(lambda x: op(x, implementation)), platforms=platforms, **kwargs
  )(jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))


@pytest.mark.parametrize(
    "name, implementation",
    [(name, "xla") for name in OPS] + [(name, "pallas") for name in KERNEL_OPS],
)
def test_export_with_a_symbolic_batch(name, implementation):
  op = OPS[name]
  exported = _export(op, implementation)
  rng = np.random.default_rng(0)
  for rows in (2, 7):
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


def test_a_concrete_batch_exports_triton_kernels_for_cuda():
  batch = 16
  exported = export.export(
      jax.jit(lambda x: OPS["quantize blocked"](x, "pallas")), platforms=("cuda",),
      disabled_checks=TRITON,
  )(jax.ShapeDtypeStruct((batch, FEATURES), jnp.float32))
  assert "xla.gpu.triton" in exported.mlir_module()


def test_default_implementation_picks_the_kernel_per_platform_when_lowered(monkeypatch):
  """One exported program: the kernel where PALLAS_FASTER lists the op, XLA elsewhere."""

  def exported(platforms, implementation=None):
    return export.export(
        jax.jit(lambda x: OPS["quantize blocked"](x, implementation)), platforms=platforms,
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
  np.testing.assert_array_equal(both.call(x), OPS["quantize blocked"](x, "xla"))


def test_export_round_trips_through_serialization():
  op = OPS["dynamic per-token"]
  restored = export.deserialize(_export(op, "xla").serialize())
  x = np.random.default_rng(1).normal(size=(3, FEATURES)).astype(np.float32)
  for got, want in zip(restored.call(x), op(x, "xla")):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
