"""Pallas kernels against the XLA path, in one run: time, GB/s, and share of peak HBM bandwidth.

    python benchmarks/kernels.py [--elements N] [--repeats R]

For each op the same inputs go through ``implementation="xla"`` and
``implementation="pallas"``; the table gives best-of-N milliseconds, the bytes
each must move (inputs read once, outputs written once: the floor for a
memory-bound op) over the time, that rate as a fraction of the card's peak HBM
bandwidth, and the speed-up of the kernel over XLA (> 1: the kernel is faster).
This is the measurement behind ``jaxquant._dispatch.PALLAS_FASTER``.

On a GPU or TPU this times compiled kernels, by default on 64M elements
(4096 columns). On CPU the kernels run in Pallas interpret mode, which is for
correctness only and slow (seconds per call at 64K elements): the default there
is 64K elements and 3 repeats, a check that the script runs and that every
kernel equals XLA bit for bit; read nothing into its times. Each row is
printed as soon as it is measured, after a line naming the op being run.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from _timing import best_ms

# Peak HBM bandwidth in GB/s by device_kind, from the vendors' data sheets.
PEAK_GB_PER_S = {
    "NVIDIA H100 80GB HBM3": 3350.0,
    "NVIDIA H100 PCIe": 2000.0,
    "NVIDIA H200": 4800.0,
    "NVIDIA A100-SXM4-80GB": 2039.0,
    "NVIDIA A100-SXM4-40GB": 1555.0,
    "TPU v4": 1200.0,
    "TPU v5 lite": 819.0,
    "TPU v5p": 2765.0,
    "TPU v6 lite": 1640.0,
}


def _cases(elements, rng):
  """(name, function(implementation, *arrays), arrays, bytes moved) for each kernel.

  The arrays are passed as jit arguments, as a model's weights and
  activations are: closed-over arrays would be constants XLA may fold.
  """
  columns = 4096
  rows = elements // columns
  n = rows * columns
  int8 = jnp.asarray(rng.integers(-128, 128, (rows, columns)), jnp.int8)
  other_int8 = jnp.asarray(rng.integers(-128, 128, (rows, columns)), jnp.int8)
  packed = jq.pack_int4(jnp.asarray(rng.integers(-8, 8, (rows, columns)), jnp.int4))
  floats = jnp.asarray(rng.normal(size=(rows, columns)), jnp.bfloat16)
  per_column = jnp.asarray(rng.uniform(0.01, 0.03, columns), jnp.float32)
  per_block = jnp.asarray(rng.uniform(0.01, 0.03, (rows, columns // 32)), jnp.bfloat16)
  yield ("dequantize int8 -> float32, per column",
         lambda impl, x, s: jq.dequantize_linear(x, s, axis=1, implementation=impl),
         (int8, per_column), n * (1 + 4))
  yield ("dequantize int8 -> bfloat16, per tensor",
         lambda impl, x: jq.dequantize_linear(x, jnp.bfloat16(0.02), implementation=impl),
         (int8,), n * (1 + 2))
  yield ("dequantize packed int4 -> bfloat16, blocks of 32",
         lambda impl, x, s: jq.dequantize_linear(
             x, s, axis=1, block_size=32, packed_shape=(rows, columns), implementation=impl),
         (packed, per_block), n // 2 + n * 2 + per_block.size * 2)
  yield ("quantized_add int8 + int8 -> int8",
         lambda impl, a, b: jq.quantized_add(a, 0.02, jnp.int8(1), b, 0.03, jnp.int8(-3),
                                             0.05, jnp.int8(0), implementation=impl),
         (int8, other_int8), n * 3)
  yield ("dynamic_quantize bfloat16 -> int8, per row",
         lambda impl, x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0,
                                                    implementation=impl),
         (floats,), n * (2 + 2 + 1))  # the floor of two passes: x read twice, y written once


# Defaults per backend: a compiled kernel is timed at a size that fills the
# memory system; interpret mode (CPU) only shows that the script runs.
DEFAULT_ELEMENTS = {"cpu": 1 << 16}
DEFAULT_REPEATS = {"cpu": 3}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  backend = jax.default_backend()
  parser.add_argument("--elements", type=int, default=DEFAULT_ELEMENTS.get(backend, 1 << 26),
                      help="elements per op (a multiple of 4096); default by backend")
  parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS.get(backend, 20))
  args = parser.parse_args()
  device = jax.devices()[0]
  peak = PEAK_GB_PER_S.get(device.device_kind)
  print(f"jax {jax.__version__}, {device.device_kind} ({jax.default_backend()}), "
        f"{args.elements} elements, peak {peak or '?'} GB/s", flush=True)
  print("| op | XLA ms | Pallas ms | XLA GB/s | Pallas GB/s | Pallas % of peak "
        "| Pallas speed-up |")
  print("|---|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for name, run, arrays, moved in _cases(args.elements, rng):
    print(f"running: {name}", file=sys.stderr, flush=True)
    xla = functools.partial(jax.jit(functools.partial(run, "xla")), *arrays)
    pallas = functools.partial(jax.jit(functools.partial(run, "pallas")), *arrays)
    for expected, actual in zip(jax.tree.leaves(xla()), jax.tree.leaves(pallas())):
      if not np.array_equal(np.asarray(expected).view(np.uint8),
                            np.asarray(actual).view(np.uint8)):
        raise AssertionError(f"{name}: the kernel differs from XLA")
    xla_ms, pallas_ms = best_ms(xla, args.repeats), best_ms(pallas, args.repeats)
    xla_rate, pallas_rate = moved / xla_ms / 1e6, moved / pallas_ms / 1e6
    share = f"{100 * pallas_rate / peak:.0f}%" if peak else "?"
    print(f"| {name} | {xla_ms:.3f} | {pallas_ms:.3f} | {xla_rate:.0f} | {pallas_rate:.0f} "
          f"| {share} | {xla_ms / pallas_ms:.2f} |", flush=True)


if __name__ == "__main__":
  main()
