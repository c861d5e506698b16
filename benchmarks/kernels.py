"""Pallas kernels against the XLA path, in one run: time, GB/s, and share of peak HBM bandwidth.

    python benchmarks/kernels.py [--elements N] [--repeats R] [--matmul-rows M ...]
                                 [--sweep] [--json PATH]

Element-wise ops: for each, the same inputs go through
``implementation="xla"`` and ``implementation="pallas"``; the table gives the
milliseconds per call, the bytes each must move (inputs read once, outputs
written once: the floor for a memory-bound op) over the time, that rate as a
fraction of the card's peak HBM bandwidth, the speed-up of the kernel over
XLA (> 1: the kernel is faster), and whether the two gave the same bits.
This is the measurement behind ``jaxquant._dispatch.PALLAS_FASTER``; each
row names the route (op, dtype, layout) an entry there would hold.

Weight-only matmul: ``matmul_nbits`` (int4 in blocks of 32 along K, K = N =
4096) on XLA (dequantize, then a float32 dot) and on the fused kernel, with
two dense products of the same shape beside them: float32 at full precision
(the bar: the kernel's own arithmetic) and bfloat16. ``--sweep`` also times
the kernel's other tilings (``pallas_kernels.matmul.Tiling``).

On a GPU or TPU this times compiled kernels, by default on 64M elements
(4096 columns). Each time is the best of ``--repeats`` rounds of ten calls
issued back to back, so that the host's dispatch overlaps the device's work
as it does in a model. On CPU the kernels run in Pallas interpret mode,
which is for correctness only and slow: the default there is 64K elements,
3 repeats and one matmul shape, a check that the script runs and that every
kernel equals XLA bit for bit (the element-wise table's last column, and a
line per matmul shape); read nothing into its times. Each row is
printed as soon as it is measured, after a line naming the op being run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from pallas_kernels import matmul as pallas_matmul

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
CALLS_PER_ROUND = 10


def per_call_ms(function, rounds):
  """Milliseconds per call: the best of ``rounds`` rounds of calls issued back to back."""
  jax.block_until_ready(function())
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    results = [function() for _ in range(CALLS_PER_ROUND)]
    jax.block_until_ready(results)
    best = min(best, (time.perf_counter() - start) / CALLS_PER_ROUND)
  return best * 1e3


def differing(expected, actual) -> int:
  """How many elements of two results differ in their bits."""
  count = 0
  for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    e, a = np.asarray(e), np.asarray(a)
    width = e.dtype.itemsize
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    count += int(np.count_nonzero(e.view(view) != a.view(view)))
  return count


def _elementwise_cases(elements, rng):
  """(name, route, function(implementation, *arrays), arrays, bytes moved) per kernel.

  The arrays are passed as jit arguments, as a model's weights and
  activations are: closed-over arrays would be constants XLA may fold.
  """
  columns = 4096
  rows = elements // columns
  n = rows * columns
  int8 = jnp.asarray(rng.integers(-128, 128, (rows, columns)), jnp.int8)
  other_int8 = jnp.asarray(rng.integers(-128, 128, (rows, columns)), jnp.int8)
  packed = jq.pack_int4(jnp.asarray(rng.integers(-8, 8, (rows, columns)), jnp.int4))
  floats = jnp.asarray(rng.normal(size=(rows, columns)), jnp.float32)
  bfloats = floats.astype(jnp.bfloat16)
  per_column = jnp.asarray(rng.uniform(0.01, 0.03, columns), jnp.float32)
  per_block = jnp.asarray(rng.uniform(0.01, 0.03, (rows, columns // 32)), jnp.bfloat16)
  yield ("dequantize int8 -> float32, per tensor", ("dequantize_linear", "int8", "per-tensor"),
         lambda impl, x: jq.dequantize_linear(x, jnp.float32(0.02), jnp.int8(3),
                                              implementation=impl),
         (int8,), n * (1 + 4))
  yield ("dequantize int8 -> float32, per column", ("dequantize_linear", "int8", "per-axis"),
         lambda impl, x, s: jq.dequantize_linear(x, s, axis=1, implementation=impl),
         (int8, per_column), n * (1 + 4))
  yield ("dequantize int8 -> bfloat16, per tensor", ("dequantize_linear", "int8", "per-tensor"),
         lambda impl, x: jq.dequantize_linear(x, jnp.bfloat16(0.02), implementation=impl),
         (int8,), n * (1 + 2))
  yield ("dequantize packed int4 -> bfloat16, blocks of 32",
         ("dequantize_linear", "int4", "blocked"),
         lambda impl, x, s: jq.dequantize_linear(
             x, s, axis=1, block_size=32, packed_shape=(rows, columns), implementation=impl),
         (packed, per_block), n // 2 + n * 2 + per_block.size * 2)
  yield ("quantize float32 -> int8, per tensor", ("quantize_linear", "int8", "per-tensor"),
         lambda impl, x: jq.quantize_linear(x, jnp.float32(0.02), jnp.int8(3),
                                            implementation=impl),
         (floats,), n * (4 + 1))
  yield ("quantize bfloat16 -> int4, blocks of 32", ("quantize_linear", "int4", "blocked"),
         lambda impl, x, s: jq.quantize_linear(
             x, s, axis=1, block_size=32, output_dtype=jnp.int4, implementation=impl),
         (bfloats, per_block), n * 2 + n // 2 + per_block.size * 2)
  yield ("quantized_add int8 + int8 -> int8", ("quantized_add", "int8", "per-tensor"),
         lambda impl, a, b: jq.quantized_add(a, 0.02, jnp.int8(1), b, 0.03, jnp.int8(-3),
                                             0.05, jnp.int8(0), implementation=impl),
         (int8, other_int8), n * 3)
  yield ("dynamic_quantize float32 -> uint8, per tensor",
         ("dynamic_quantize_linear", "uint8", "per-tensor"),
         lambda impl, x: jq.dynamic_quantize_linear(x, implementation=impl),
         (floats,), n * (4 + 4 + 1))  # the floor of two passes: x read twice
  yield ("dynamic_quantize bfloat16 -> int8, per row",
         ("dynamic_quantize_linear", "int8", "per-axis"),
         lambda impl, x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0,
                                                    implementation=impl),
         (bfloats,), n * (2 + 2 + 1))


def _nbits_weight(rng, k, n, block_size=32):
  """A MatMulNBits int4 weight: packed uint4 codes (N, K / 2) and per-block scales."""
  packed = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)
  scales = jnp.asarray(rng.uniform(0.01, 0.03, (n, k // block_size)), jnp.float32)
  return packed, scales


def _matmul_cases(rows, features, rng, sweep):
  """(name, function of (x, packed, scales), arrays, bytes moved) per matmul of one shape."""
  k = n = features
  block = 32
  packed, scales = _nbits_weight(rng, k, n, block)
  x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
  weight = jq.matmul_nbits(jnp.eye(k, dtype=jnp.float32), packed, scales, K=k, N=n,
                           block_size=block, implementation="xla").T  # (N, K) dequantized
  dims = (((1,), (1,)), ((), ()))
  io = rows * k * 4 + rows * n * 4
  yield ("float32 dot, full precision", lambda x, w: jax.lax.dot_general(
      x, w, dims, precision=jax.lax.Precision.HIGHEST), (x, weight), io + n * k * 4)
  yield ("bfloat16 dot", lambda x, w: jax.lax.dot_general(x, w, dims),
         (x.astype(jnp.bfloat16), weight.astype(jnp.bfloat16)), io // 2 + n * k * 2)
  nbits_bytes = io + packed.size + scales.size * 4
  for implementation in ("xla", "pallas"):
    yield (f"matmul_nbits int4, {implementation}",
           lambda x, p, s, impl=implementation: jq.matmul_nbits(
               x, p, s, K=k, N=n, block_size=block, implementation=impl),
           (x, packed, scales), nbits_bytes)
  if not sweep:
    return
  formula = lambda codes, s, z: (codes.astype(jnp.float32) - 8.0) * s
  zero_points = jnp.full(scales.shape, 8, jnp.uint8)
  rows_pow2 = 1 << (rows - 1).bit_length()
  # tl.dot's 16 rows or more; fewer rows than that also as products summed (no dot).
  tile_ms = sorted({min(64, max(16, rows_pow2))} | ({rows_pow2} if rows_pow2 < 16 else set()))
  for tile_m, tile_n, step, split in itertools.product(
      tile_ms, (16, 32, 64), (64, 256), (1, 4, 16)):
    if k % (split * step):
      continue
    tiles = pallas_matmul.Tiling(m=tile_m, n=tile_n, k=step, num_stages=3, split=split)
    yield (f"kernel {tiles}",
           lambda x, p, s, tiles=tiles: pallas_matmul.dequantize_matmul(
               x, p, s, zero_points, formula=formula, block_size=block, bits=4, tiles=tiles),
           (x, packed, scales), nbits_bytes)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  parser.add_argument("--elements", type=int, default=1 << 16 if on_cpu else 1 << 26,
                      help="elements per element-wise op (a multiple of 4096)")
  parser.add_argument("--repeats", type=int, default=3 if on_cpu else 20)
  parser.add_argument("--matmul-rows", type=int, nargs="*",
                      default=[2] if on_cpu else [1, 16, 128, 1024])
  parser.add_argument("--features", type=int, default=64 if on_cpu else 4096,
                      help="the matmul's K = N")
  parser.add_argument("--sweep", action="store_true", help="time the kernel's other tilings")
  parser.add_argument("--matmul-only", action="store_true",
                      help="leave out the element-wise kernels")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  device = jax.devices()[0]
  peak = PEAK_GB_PER_S.get(device.device_kind)
  print(f"jax {jax.__version__}, {device.device_kind} ({backend}), "
        f"{args.elements} elements, peak {peak or '?'} GB/s", flush=True)
  rows = []
  print("| op | route | XLA ms | Pallas ms | XLA GB/s | Pallas GB/s | Pallas % of peak "
        "| Pallas speed-up | same bits |")
  print("|---|---|---|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  cases = () if args.matmul_only else _elementwise_cases(args.elements, rng)
  for name, route, run, arrays, moved in cases:
    print(f"running: {name}", file=sys.stderr, flush=True)
    xla = functools.partial(jax.jit(functools.partial(run, "xla")), *arrays)
    pallas = functools.partial(jax.jit(functools.partial(run, "pallas")), *arrays)
    try:
      differ = differing(xla(), pallas())
      xla_ms, pallas_ms = per_call_ms(xla, args.repeats), per_call_ms(pallas, args.repeats)
    except Exception as error:  # pylint: disable=broad-except
      # A kernel the compiler refuses is a result too; the other rows still run.
      print(f"| {name} | {'/'.join(route)} | failed: {type(error).__name__}: "
            f"{str(error).splitlines()[0][:160]} | | | | | | |", flush=True)
      rows.append(dict(op=name, route=route, failed=f"{type(error).__name__}: {error}"[:2000]))
      continue
    xla_rate, pallas_rate = moved / xla_ms / 1e6, moved / pallas_ms / 1e6
    share = f"{100 * pallas_rate / peak:.0f}%" if peak else "?"
    print(f"| {name} | {'/'.join(route)} | {xla_ms:.3f} | {pallas_ms:.3f} | {xla_rate:.0f} "
          f"| {pallas_rate:.0f} | {share} | {xla_ms / pallas_ms:.2f} "
          f"| {'yes' if not differ else f'no: {differ} differ'} |", flush=True)
    rows.append(dict(op=name, route=route, xla_ms=xla_ms, pallas_ms=pallas_ms,
                     bytes=moved, differing=differ))
  matmuls = []
  print(f"\nweight-only int4 matmul, K = N = {args.features}, blocks of 32 "
        "(ratio: time over the float32 dot's)")
  print("| M | product | ms | GB/s | ratio to float32 |")
  print("|---|---|---|---|---|")
  for m in args.matmul_rows:
    bar = None
    results = {}
    for name, run, arrays, moved in _matmul_cases(m, args.features, rng, args.sweep):
      print(f"running: M={m} {name}", file=sys.stderr, flush=True)
      call = functools.partial(jax.jit(run), *arrays)
      try:
        results[name] = jax.block_until_ready(call())
        ms = per_call_ms(call, args.repeats)
      except Exception as error:  # pylint: disable=broad-except
        # A tiling the compiler refuses (registers, shared memory) is a result too.
        print(f"| {m} | {name} | failed: {type(error).__name__}: "
              f"{str(error).splitlines()[0][:120]} | | |", flush=True)
        continue
      bar = bar or ms
      print(f"| {m} | {name} | {ms:.4f} | {moved / ms / 1e6:.0f} | {ms / bar:.2f} |", flush=True)
      matmuls.append(dict(rows=m, product=name, ms=ms, bytes=moved))
    if {"matmul_nbits int4, xla", "matmul_nbits int4, pallas"} <= results.keys():
      # Expected on CPU (interpret mode) and TPU; Triton sums K in steps (docs/numerics.md).
      same = np.array_equal(*(np.asarray(results[f"matmul_nbits int4, {i}"]).view(np.uint32)
                              for i in ("xla", "pallas")))
      print(f"M={m} matmul_nbits int4: pallas and xla same bits: {same}", flush=True)
    reference = np.asarray(results["float32 dot, full precision"], np.float64)
    for name, value in results.items():
      error = np.linalg.norm(np.asarray(value, np.float64) - reference) / np.linalg.norm(
          reference)
      if error > (1e-2 if "bfloat16" in name else 1e-5):
        print(f"M={m} {name}: relative error {error:.2e}", flush=True)
  if args.json:
    with open(args.json, "w") as file:
      json.dump(dict(device=device.device_kind, jax=jax.__version__, peak_gb_per_s=peak,
                     elements=args.elements, elementwise=rows, matmul=matmuls), file, indent=1)


if __name__ == "__main__":
  main()
