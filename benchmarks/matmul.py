"""Quantized linear layers against float32, qwix and onnxruntime, interleaved, in one run.

    python benchmarks/matmul.py [--rows 1 16 64 256 1024] [--features 1024] [--batch 8]
                                [--repeats 21] [--tune] [--sync] [--cpus N]

Layers ``y = x @ W`` with ``x`` (M, K) float32 and ``W`` (K, N), K = N = ``--features``:

* dynamic int8: x quantized to int8 at every call, W stored int8 per column.
    - ``float32``: ``x @ w`` in float32, the bar every ratio is against;
    - ``jaxquant``: ``dot_general_dynamic_int8`` (symmetric, one scale per
      row of x) on a stored int8 :class:`QuantizedArray`;
    - ``jaxquant, stored transposed``: the same on W stored (N, K)
      (``QuantizationRule(transposed=True)``), its contracting dim minor;
      checked bit for bit against ``jaxquant``;
    - ``jaxquant, float W``: the same on the float32 W, quantized per column
      at every call (a model whose layers keep float kernels);
    - ``jaxquant, ONNX model``: ``dynamic_quantize_linear`` (per tensor,
      uint8) + ``quantized_dot_general``, onnxruntime's model bit for bit;
    - ``jnp, ONNX way``: the same quantization, then ``dot_general(uint8,
      int8, preferred_element_type=int32)`` minus the zero point's column sums,
      as a user writes MatMulInteger by hand;
    - ``onnxruntime``: ``onnxruntime.quantization.quantize_dynamic``'s model of
      the float layer (DynamicQuantizeLinear + MatMulInteger, fused by its
      optimizer), per-column int8 weights;
    - ``qwix`` (only where qwix imports; it is no dependency): x quantized
      per row at every call, W stored quantized per column, ``qwix.dot_general``.
* weight-only int4: W in blocks of 32 along K, packed two per byte.
    - ``jaxquant``: ``dot_general_weight_only`` on a packed int4
      :class:`QuantizedArray` (``quantize_params``, ``axis=0, block_size=32``);
    - ``matmul_nbits``: onnxruntime's layout (uint4 codes, zero point 8), XLA;
    - ``jnp``: unpack the nibbles and dequantize with jnp, then ``x @ w``;
    - ``dequantize alone``: jaxquant's first step by itself, writing the
      float32 weight (no product), what weight-only costs beyond the dot;
    - ``onnxruntime``: a MatMulNBits node on the same bytes;
    - ``qwix`` (where it imports): W as qwix int4 in blocks of 32 along K,
      ``qwix.dot_general`` with float x.
* batched dynamic int8, shaped as a mixture of experts: ``x`` (B, M, K), M
  rows for each of B = ``--batch`` experts, and one stored int8 weight per
  expert, (B, K, N) per column; ``dot_general_dynamic_int8`` with a batch dim,
  also on the weights stored transposed, (B, N, K) (qwix: its weight per
  expert and column, x per row), for M <= 256 (beyond, without AMX, the int8
  product runs as a bfloat16 dot, batched or not).

Before timing, the ONNX-model layer is checked bit for bit against
onnxruntime, the weight-only layer against ``lax.dot_general`` of the
dequantized weight, and ``matmul_nbits`` against onnxruntime's MatMulNBits
to float32 summation error. Reported: the median of ``--repeats`` calls, each
peer timed in turn within every repeat, and its ratio to float32 (< 1 is
faster), with the load average before and after. The machines here are
shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import onnx
from onnx import helper, numpy_helper
import onnxruntime
from onnxruntime import quantization

import jaxquant as jq
from _timing import cpu_model
from _timing import cpus
from _timing import interleaved_median_ms
from _timing import load_average
from _timing import tune

try:
  import qwix
except ImportError:
  qwix = None

_DIMS = (((1,), (0,)), ((), ()))
# (B, M, K) x (B, K, N): one weight per batch (expert).
_BATCHED = (((2,), (1,)), ((0,), (0,)))
BLOCK = 32


def _session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
  return onnxruntime.InferenceSession(model.SerializeToString(),
                                      providers=["CPUExecutionProvider"])


def _float_model(weight: np.ndarray) -> onnx.ModelProto:
  k, n = weight.shape
  graph = helper.make_graph(
      [helper.make_node("MatMul", ["x", "w"], ["y"])], "linear",
      [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, k])],
      [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, n])],
      [numpy_helper.from_array(weight, "w")],
  )
  return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def dynamic_int8(weight: np.ndarray, path: str):
  """onnxruntime's dynamically quantized model and jaxquant's layer on its own weights."""
  onnx.save(_float_model(weight), path + ".float.onnx")
  quantization.quantize_dynamic(path + ".float.onnx", path, per_channel=True,
                                weight_type=quantization.QuantType.QInt8)
  model = onnx.load(path)
  initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
  (matmul,) = [node for node in model.graph.node if node.op_type == "MatMulInteger"]
  weight_q = initializers[matmul.input[1]]
  weight_scale = next(v for name, v in initializers.items()
                      if name.endswith("scale") and v.size == weight.shape[1])
  weight_zero_point = initializers.get(matmul.input[3]) if len(matmul.input) > 3 else None
  weight_scale = jnp.asarray(weight_scale.reshape(1, -1))
  weight_zero_point = None if weight_zero_point is None else jnp.asarray(
      weight_zero_point.reshape(1, -1))

  @jax.jit
  def onnx_layer(x, weight_q):
    q, scale, zero_point = jq.dynamic_quantize_linear(x)
    return jq.quantized_dot_general(
        q, weight_q, _DIMS, lhs_scale=scale, lhs_zero_point=zero_point,
        rhs_scale=weight_scale, rhs_zero_point=weight_zero_point)

  @jax.jit
  def onnx_way(x, weight_q):
    q, scale, zero_point = jq.dynamic_quantize_linear(x)
    accumulator = lax.dot_general(q, weight_q, _DIMS, preferred_element_type=jnp.int32)
    accumulator -= zero_point.astype(jnp.int32) * jnp.sum(weight_q, 0, dtype=jnp.int32)
    return accumulator.astype(jnp.float32) * (scale * weight_scale)

  return _session(model), jnp.asarray(weight_q), onnx_layer, onnx_way


def int4_blocked(weight: np.ndarray):
  """Weights in blocks of 32 along K, int4 as uint4 codes with zero point 8, packed."""
  k, n = weight.shape
  blocks = weight.T.reshape(n, k // BLOCK, BLOCK)
  scales = (np.abs(blocks).max(-1) / 7).astype(np.float32)
  codes = np.clip(np.rint(blocks / scales[..., None]) + 8, 0, 15).astype(np.uint8)
  packed = (codes.reshape(n, -1, 2)[..., 0] | (codes.reshape(n, -1, 2)[..., 1] << 4))
  packed = packed.reshape(n, k // BLOCK, BLOCK // 2).astype(np.uint8)
  node = helper.make_node("MatMulNBits", ["x", "b", "scales"], ["y"], domain="com.microsoft",
                          K=k, N=n, bits=4, block_size=BLOCK)
  graph = helper.make_graph(
      [node], "nbits",
      [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, k])],
      [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, n])],
      [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "scales")],
  )
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                  helper.make_opsetid("com.microsoft", 1)])
  packed, scales = jnp.asarray(packed), jnp.asarray(scales)

  @jax.jit
  def layer(x, packed):
    return jq.matmul_nbits(x, packed, scales, K=k, N=n, block_size=BLOCK)

  @jax.jit
  def by_hand(x, packed):
    nibbles = jnp.stack([packed & 15, packed >> 4], -1).reshape(n, k // BLOCK, BLOCK)
    w = (nibbles.astype(jnp.float32) - 8) * scales[..., None]
    return x @ w.reshape(n, k).T

  return _session(model), packed, layer, by_hand


def _qwix_layers(weight: np.ndarray):
  """qwix's dynamic int8 layer and its weight-only int4 layer (blocks of 32 along K).

  The quantized weights are arguments, as the other peers' are: closed over,
  XLA folds qwix's dequantization into a float32 constant.
  """
  int8_weight = qwix.quantize(jnp.asarray(weight), jnp.int8, channelwise_axes=(1,))
  int4_weight = qwix.quantize(jnp.asarray(weight), jnp.int4, channelwise_axes=(1,),
                              tiled_axes={0: BLOCK})
  dynamic = jax.jit(lambda x, w: qwix.dot_general(
      qwix.quantize(x, jnp.int8, channelwise_axes=(0,)), w, _DIMS))
  weight_only = jax.jit(lambda x, w: qwix.dot_general(x, w, _DIMS))
  return (lambda x: dynamic(x, int8_weight)), (lambda x: weight_only(x, int4_weight))


def _qwix_batched(weight: jax.Array):
  """qwix's batched dynamic int8 layer: x per row, the weight per batch and column."""
  quantized = qwix.quantize(weight, jnp.int8, channelwise_axes=(0, 2))
  layer = jax.jit(lambda x, w: qwix.dot_general(
      qwix.quantize(x, jnp.int8, channelwise_axes=(0, 1)), w, _BATCHED))
  return lambda x: layer(x, quantized)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
  parser.add_argument("--features", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=21)
  parser.add_argument("--model-path", default="/tmp/jaxquant_matmul_benchmark.onnx")
  parser.add_argument("--tune", action="store_true",
                      help="jaxquant.tune_cpu() first: no page faults for results over 32 MiB")
  parser.add_argument("--sync", action="store_true",
                      help="jaxquant.tune_cpu(async_dispatch=False) first: each call runs on "
                           "the calling thread (with --tune: both)")
  parser.add_argument("--cpus", type=int, default=None,
                      help="jaxquant.tune_cpu(cpus=CPUS) first: the process runs on that many CPUs "
                           "(onnxruntime's thread pool pins its own threads, and keeps its CPUs)")
  args = parser.parse_args()
  tune(defaults=args.tune, async_dispatch=False if args.sync else None, cpus=args.cpus)
  rng = np.random.default_rng(0)
  k = n = args.features
  weight = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  w = jnp.asarray(weight)
  float32 = jax.jit(lambda x, w: x @ w)
  int8_session, weight_q, int8_onnx_layer, int8_onnx_way = dynamic_int8(weight, args.model_path)
  int8_weight = jq.quantize_params(w, jq.QuantizationRule(dtype=jnp.int8))
  int8_transposed = jq.quantize_params(w, jq.QuantizationRule(dtype=jnp.int8, transposed=True))
  int8_layer = jax.jit(lambda x, w: jq.dot_general_dynamic_int8(x, w, _DIMS))
  int4_weight = jq.quantize_params(
      w, jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=BLOCK))
  int4_layer = jax.jit(lambda x, w: jq.dot_general_weight_only(x, w, _DIMS))
  int4_dequantize = jax.jit(lambda w: w.dequantize())
  int4_session, packed, nbits_layer, int4_by_hand = int4_blocked(weight)
  qwix_int8, qwix_int4 = _qwix_layers(weight) if qwix is not None else (None, None)
  batched_weight = jnp.asarray(
      rng.standard_normal((args.batch, k, n)).astype(np.float32) / np.sqrt(k))
  batched_int8_weight = jq.quantize_params(batched_weight, jq.QuantizationRule(dtype=jnp.int8))
  batched_transposed = jq.quantize_params(
      batched_weight, jq.QuantizationRule(dtype=jnp.int8, transposed=True))
  batched_float32 = jax.jit(lambda x, w: lax.dot_general(x, w, _BATCHED))
  qwix_batched = _qwix_batched(batched_weight) if qwix is not None else None
  batched_int8 = jax.jit(lambda x, w: jq.dot_general_dynamic_int8(x, w, _BATCHED))
  print(f"jax {jax.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"qwix {getattr(qwix, '__version__', None) if qwix else 'not installed'}, "
        f"{jax.device_count()} CPU device(s); K = N = {k}; tune_cpu {args.tune}; "
        f"synchronous dispatch {args.sync}; CPUs {cpus()} ({cpu_model()}); "
        f"median of {args.repeats}; "
        f"load average {load_average()}")
  print("| layer | M | peer | ms | / float32 |")
  print("|---|---|---|---|---|")
  for m in args.rows:
    x_host = rng.standard_normal((m, k)).astype(np.float32)
    x = jnp.asarray(x_host)
    (expected,) = int8_session.run(None, {"x": x_host})
    np.testing.assert_array_equal(int8_onnx_layer(x, weight_q), expected)
    np.testing.assert_array_equal(int8_layer(x, int8_transposed), int8_layer(x, int8_weight))
    np.testing.assert_array_equal(
        int4_layer(x, int4_weight), lax.dot_general(x, int4_weight.dequantize(), _DIMS))
    (expected,) = int4_session.run(None, {"x": x_host})
    np.testing.assert_allclose(nbits_layer(x, packed), expected, rtol=1e-4, atol=1e-4)
    cases = {
        "dynamic int8": {
            "float32": lambda: float32(x, w),
            "jaxquant": lambda: int8_layer(x, int8_weight),
            "jaxquant, stored transposed": lambda: int8_layer(x, int8_transposed),
            "jaxquant, float W": lambda: int8_layer(x, w),
            "jaxquant, ONNX model": lambda: int8_onnx_layer(x, weight_q),
            "jnp, ONNX way": lambda: int8_onnx_way(x, weight_q),
            "onnxruntime": lambda: int8_session.run(None, {"x": x_host}),
            **({"qwix": lambda: qwix_int8(x)} if qwix_int8 else {}),
        },
        "weight-only int4": {
            "float32": lambda: float32(x, w),
            "jaxquant": lambda: int4_layer(x, int4_weight),
            "dequantize alone": lambda: int4_dequantize(int4_weight),
            "matmul_nbits": lambda: nbits_layer(x, packed),
            "jnp": lambda: int4_by_hand(x, packed),
            "onnxruntime": lambda: int4_session.run(None, {"x": x_host}),
            **({"qwix": lambda: qwix_int4(x)} if qwix_int4 else {}),
        },
    }
    if m <= 256:
      xb = jnp.asarray(rng.standard_normal((args.batch, m, k)).astype(np.float32))
      np.testing.assert_array_equal(batched_int8(xb, batched_transposed),
                                    batched_int8(xb, batched_int8_weight))
      cases[f"batched dynamic int8, B = {args.batch}"] = {
          "float32": lambda: batched_float32(xb, batched_weight),
          "jaxquant": lambda: batched_int8(xb, batched_int8_weight),
          "jaxquant, stored transposed": lambda: batched_int8(xb, batched_transposed),
          **({"qwix": lambda: qwix_batched(xb)} if qwix_batched else {}),
      }
    for layer, peers in cases.items():
      medians, _ = interleaved_median_ms(peers, repeats=args.repeats)
      for name, ms in medians.items():
        print(f"| {layer} | {m} | {name} | {ms:.3f} | {ms / medians['float32']:.2f} |",
              flush=True)
  print(f"load average {load_average()}")


if __name__ == "__main__":
  main()
