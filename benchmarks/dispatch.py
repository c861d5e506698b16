"""Synchronous against asynchronous dispatch on XLA:CPU: small calls, and a training loop.

    python benchmarks/dispatch.py [--repeats 3] [--calls 400] [--steps 100]

``jaxquant.tune_cpu(async_dispatch=False)`` makes XLA:CPU run a jitted call
on the calling thread. The setting is read once, when JAX creates its CPU
client, so each mode runs in its own interpreter: the modes alternate,
``--repeats`` times each, and each figure is the median over rounds of the
median call within a round.

* call and wait: one call then ``block_until_ready``, as a server or a
  notebook cell does: ``quantize_linear`` (int8, per tensor) at 16K-1M
  elements, and a 1024 x 1024 float32 layer and ``dot_general_dynamic_int8``
  at M = 1 and 16 rows, ``--calls`` calls each;
* training loop: five rounds of ``--steps`` steps of a small fake-quantized
  MLP (784 -> 512 -> 10, straight-through gradients), each batch drawn with
  NumPy while the previous step may still run, waiting only at the end of a
  round: ms per step at batch 32 and 256.

Prints one table: milliseconds per call or step in each mode and their ratio
(async / sync: > 1 means synchronous dispatch is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

_PROGRAM = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import jaxquant as jq
sys.path.insert(0, sys.argv[2])
from _timing import median_ms
jq.tune_cpu(mmap_threshold=None, vector_width=None, async_dispatch=sys.argv[1] == "async")
rng = np.random.default_rng(0)
results = {}
calls, steps = int(sys.argv[3]), int(sys.argv[4])

def call_and_wait(name, function, *args):
  # One function at a time: a warm-up call, then ``calls`` calls each waited on.
  results[name] = median_ms(lambda: function(*args), repeats=calls)

quantize = jax.jit(lambda x: jq.quantize_linear(x, jnp.float32(0.02), output_dtype=jnp.int8))
for elements in (1 << 14, 1 << 16, 1 << 18, 1 << 20):
  x = jnp.asarray(rng.standard_normal((elements // 1024, 1024)).astype(np.float32))
  call_and_wait(f"call and wait: quantize_linear int8, {elements // 1024}K elements", quantize, x)
dims = (((1,), (0,)), ((), ()))
w = jnp.asarray(rng.standard_normal((1024, 1024)).astype(np.float32))
w_int8 = jq.quantize_params(w, jq.QuantizationRule(dtype=jnp.int8))
dense = jax.jit(lambda x, w: x @ w)
dynamic = jax.jit(lambda x, w: jq.dot_general_dynamic_int8(x, w, dims))
for rows in (1, 16):
  x = jnp.asarray(rng.standard_normal((rows, 1024)).astype(np.float32))
  call_and_wait(f"call and wait: float32 layer, M = {rows}", dense, x, w)
  call_and_wait(f"call and wait: dot_general_dynamic_int8 layer, M = {rows}", dynamic, x, w_int8)

def loss(params, x, y):
  hidden = jax.nn.relu(jq.fake_quantize(x, 0.02) @ jq.fake_quantize(params[0], 0.002))
  return jnp.mean((hidden @ params[1] - y) ** 2)

@jax.jit
def step(params, x, y):
  value, grads = jax.value_and_grad(loss)(params, x, y)
  return [p - 0.01 * g for p, g in zip(params, grads)], value

for batch in (32, 256):
  params = [jnp.asarray(rng.standard_normal((784, 512)).astype(np.float32) * 0.03),
            jnp.asarray(rng.standard_normal((512, 10)).astype(np.float32) * 0.03)]
  def draw():
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    return x, np.eye(10, dtype=np.float32)[rng.integers(0, 10, batch)]
  params, value = step(params, *draw())
  value.block_until_ready()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(steps):
      params, value = step(params, *draw())
    value.block_until_ready()
    times.append((time.perf_counter() - start) / steps)
  results[f"training loop: ms per step, batch {batch}"] = 1e3 * float(np.median(times))
print(json.dumps(results))
"""


def _run(mode: str, calls: int, steps: int) -> dict[str, float]:
  env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", _PROGRAM, mode, str(pathlib.Path(__file__).parent),
                        str(calls), str(steps)],
                       capture_output=True, text=True,
                       env=env, check=True, timeout=600)
  return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3, help="interpreters per mode")
  parser.add_argument("--calls", type=int, default=400, help="calls per case, each waited on")
  parser.add_argument("--steps", type=int, default=100, help="training steps per timed round")
  args = parser.parse_args()
  runs: dict[str, list[dict[str, float]]] = {"async": [], "sync": []}
  for _ in range(args.repeats):
    for mode in runs:
      runs[mode].append(_run(mode, args.calls, args.steps))
  print(f"load average {os.getloadavg()}, {args.repeats} interpreters per mode")
  print("| case | async ms | sync ms | async / sync |")
  print("|---|---|---|---|")
  for case in runs["async"][0]:
    medians = {mode: statistics.median(run[case] for run in runs[mode]) for mode in runs}
    print(f"| {case} | {medians['async']:.4f} | {medians['sync']:.4f} | "
          f"{medians['async'] / medians['sync']:.2f} |")


if __name__ == "__main__":
  main()
