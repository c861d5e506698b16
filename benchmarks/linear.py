"""Throughput of quantize, dequantize and dynamic quantize against peers, in one run.

    python benchmarks/linear.py [--sizes 1048576 16777216] [--repeats 7]

Peers, each on the same data and layout:
  * ``jnp``: the hand-rolled expression a user would write (``x / scale``,
    repeat for blocks), jitted; it is not bit-exact (the reciprocal trap in
    docs/numerics.md), only a speed bar.
  * ``numpy``: the same expression in NumPy.
  * ``onnxruntime``: its CPU QuantizeLinear / DequantizeLinear /
    DynamicQuantizeLinear (opset 21).
Reported: best-of-N milliseconds and jaxquant's speed-up over each peer
(> 1 means jaxquant is faster). Machines here are shared: compare ratios
within a run, never absolute times across runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from onnx import TensorProto, helper
import onnxruntime

import jaxquant as jq
from _timing import best_ms

COLUMNS = 1024


def _onnxruntime(op, x, scale, zero_point, axis, block_size):
  def info(name, value):
    return helper.make_tensor_value_info(
        name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
  out_type = TensorProto.INT8 if op == "QuantizeLinear" else TensorProto.FLOAT
  node = helper.make_node(op, ["x", "s", "z"], ["y"], axis=axis, block_size=block_size)
  graph = helper.make_graph([node], op, [info("x", x), info("s", scale), info("z", zero_point)],
                            [helper.make_tensor_value_info("y", out_type, None)])
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
  model.ir_version = 10
  session = onnxruntime.InferenceSession(model.SerializeToString(),
                                         providers=["CPUExecutionProvider"])
  feeds = {"x": x, "s": scale, "z": zero_point}
  return lambda: session.run(None, feeds)


def _layouts(rows, columns, rng):
  yield ("per-tensor", np.asarray(0.02, np.float32), np.asarray(0, np.int8),
         dict(axis=1, block_size=0), None)
  yield ("per-axis", rng.uniform(0.01, 0.03, columns).astype(np.float32),
         np.zeros(columns, np.int8), dict(axis=1, block_size=0), (1, columns))
  groups = columns // 32
  yield ("blocked-32", rng.uniform(0.01, 0.03, (rows, groups)).astype(np.float32),
         np.zeros((rows, groups), np.int8), dict(axis=1, block_size=32), "blocked")


def _expand(scale, kind):
  """The scale as the peers broadcast it: scalar, a (1, columns) row, or repeated blocks."""
  if kind is None:
    return scale
  if kind == "blocked":
    return np.repeat(scale, 32, axis=1)
  return scale.reshape(kind)


def quantize_numpy(x, scale):
  """The NumPy expression a user would write for int8 (not bit-exact: NaN becomes 0)."""
  return np.clip(np.rint(x / scale), -128, 127).astype(np.int8)


def dequantize_numpy(q, scale):
  return q.astype(np.float32) * scale


def peers(size, rng):
  """The int8 cases of ``size`` elements, as ``(op, layout, {peer: zero-argument function})``.

  ``op`` is ``"quantize"`` or ``"dequantize"``, ``layout`` one of
  ``_layouts``; the peers are ``"jaxquant"``, ``"jnp"``, ``"numpy"`` and
  ``"onnxruntime"``, all on the same data.
  """
  rows = size // COLUMNS
  x = rng.standard_normal((rows, COLUMNS)).astype(np.float32)
  for layout, scale, zero_point, kwargs, kind in _layouts(rows, COLUMNS, rng):
    full_scale = _expand(scale, kind)
    q = np.asarray(jq.quantize_linear(x, scale, zero_point, **kwargs))
    # JAX users hold device arrays; a NumPy argument would add a copy per call.
    x_j, q_j, zero_point_j = jnp.asarray(x), jnp.asarray(q), jnp.asarray(zero_point)
    scale_j = jnp.asarray(scale)
    # jnp broadcasts a scalar or a (1, columns) row itself; blocks are repeated in the jit.
    scale_for_jnp = scale_j if kind in (None, "blocked") else jnp.asarray(full_scale)
    # Bound as defaults: the generator's locals change before a caller may call.
    repeat = kind == "blocked"

    @jax.jit
    def quantize_jnp(x, s, repeat=repeat):
      s = jnp.repeat(s, 32, axis=1) if repeat else s
      return jnp.clip(jnp.round(x / s), -128, 127).astype(jnp.int8)

    @jax.jit
    def dequantize_jnp(q, s, repeat=repeat):
      return q.astype(jnp.float32) * (jnp.repeat(s, 32, axis=1) if repeat else s)

    yield "quantize", layout, {
        "jaxquant": functools.partial(jq.quantize_linear, x_j, scale_j, zero_point_j, **kwargs),
        "jnp": functools.partial(quantize_jnp, x_j, scale_for_jnp),
        "numpy": functools.partial(quantize_numpy, x, full_scale),
        "onnxruntime": _onnxruntime("QuantizeLinear", x, scale, zero_point, **kwargs),
    }
    yield "dequantize", layout, {
        "jaxquant": functools.partial(jq.dequantize_linear, q_j, scale_j, zero_point_j, **kwargs),
        "jnp": functools.partial(dequantize_jnp, q_j, scale_for_jnp),
        "numpy": functools.partial(dequantize_numpy, q, full_scale),
        "onnxruntime": _onnxruntime("DequantizeLinear", q, scale, zero_point, **kwargs),
    }


def dynamic_peers(size, rng):
  """ONNX DynamicQuantizeLinear (uint8, per tensor) of ``size`` elements, as ``peers``.

  The NumPy and jnp peers are the formula of docs/numerics.md written by
  hand: min and max, the scale, the zero point, then quantize.
  """
  x = rng.standard_normal(size).astype(np.float32)
  x_j = jnp.asarray(x)

  def by_hand(xp, x):
    low, high = xp.minimum(xp.min(x), 0), xp.maximum(xp.max(x), 0)
    scale = (high - low) / np.float32(255)
    zero_point = xp.clip(xp.round(-low / scale), 0, 255)
    return xp.clip(xp.round(x / scale) + zero_point, 0, 255).astype(np.uint8), scale

  node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
  graph = helper.make_graph(
      [node], "dynamic", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
      [helper.make_tensor_value_info(name, dtype, None)
       for name, dtype in (("y", TensorProto.UINT8), ("s", TensorProto.FLOAT),
                           ("z", TensorProto.UINT8))])
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
  model.ir_version = 10
  session = onnxruntime.InferenceSession(model.SerializeToString(),
                                         providers=["CPUExecutionProvider"])
  yield "dynamic", "per-tensor", {
      "jaxquant": functools.partial(jq.dynamic_quantize_linear, x_j),
      "jnp": functools.partial(jax.jit(functools.partial(by_hand, jnp)), x_j),
      "numpy": functools.partial(by_hand, np, x),
      "onnxruntime": functools.partial(session.run, None, {"x": x}),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"jax {jax.__version__} ({jax.default_backend()}), onnxruntime {onnxruntime.__version__}")
  print(f"{'op':10} {'elements':>9} {'layout':11} {'jaxquant ms':>11} "
        f"{'vs jnp':>7} {'vs numpy':>8} {'vs onnxruntime':>14}")
  for size in args.sizes:
    for op, layout, functions in itertools.chain(peers(size, rng), dynamic_peers(size, rng)):
      ours_ms = best_ms(functions["jaxquant"], args.repeats)
      ratio = {peer: best_ms(function, args.repeats) / ours_ms
               for peer, function in functions.items() if peer != "jaxquant"}
      print(f"{op:10} {size:9d} {layout:11} {ours_ms:11.2f} "
            f"{ratio['jnp']:7.2f} {ratio['numpy']:8.2f} {ratio['onnxruntime']:14.2f}")


if __name__ == "__main__":
  main()
