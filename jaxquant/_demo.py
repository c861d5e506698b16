"""The demo behind ``python -m jaxquant``.

Quantizes a realistic weight matrix three ways, dequantizes it back, and prints
the error of each scheme and the throughput of both ops on the current backend.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxquant as jq


def _weight(size: int) -> jax.Array:
  """A transformer-like weight: Gaussian rows of varying scale plus a few outliers."""
  key_values, key_rows, key_outliers = jax.random.split(jax.random.key(0), 3)
  row_scale = jnp.exp(0.5 * jax.random.normal(key_rows, (size, 1)))
  weight = 0.02 * row_scale * jax.random.normal(key_values, (size, size))
  outliers = jax.random.bernoulli(key_outliers, 1e-4, (size, size))
  return jnp.where(outliers, 8.0 * weight, weight)


def _seconds(function: Callable[[], jax.Array], repeats: int) -> float:
  jax.block_until_ready(function())  # compile and warm up
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(function())
    best = min(best, time.perf_counter() - start)
  return best


def _schemes(weight: jax.Array, block_size: int):
  """(name, scale, quantized dtype, granularity keywords, bytes per stored weight).

  The integer scales come from ``dynamic_quantize_linear`` (symmetric: zero
  point 0, scale = max|w| / qmax per row or per block). A sub-byte scheme
  stores its weight packed, as ONNX does (two int4 per byte).
  """
  schemes = []
  for name, dtype, granularity, bytes_per_weight in [
      ("int8, per-axis (one scale per row)", jnp.int8, dict(axis=0), 1.0),
      (f"int4, blocked (block {block_size} along columns)", jnp.int4,
       dict(axis=1, block_size=block_size), 0.5),
  ]:
    _, scale, _ = jq.dynamic_quantize_linear(
        weight, dtype=dtype, symmetric=True, **granularity
    )
    schemes.append((name, scale, dtype, granularity, bytes_per_weight))
  per_tensor = jnp.max(jnp.abs(weight)) / float(jnp.finfo(jnp.float8_e4m3fn).max)
  schemes.append(("float8_e4m3fn, per-tensor", per_tensor, jnp.float8_e4m3fn, {}, 1.0))
  return schemes


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
  return value


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxquant", description=__doc__)
  parser.add_argument("--size", type=_positive, default=4096, help="weight is size x size")
  parser.add_argument("--block-size", type=_positive, default=32)
  parser.add_argument("--repeats", type=_positive, default=5, help="timed runs; best is kept")
  parser.add_argument("--tune", action="store_true",
                      help="apply jaxquant.tune_cpu() first (process-wide CPU settings)")
  args = parser.parse_args(argv)
  # Before the first computation, or it applies nothing.
  tuned = jq.tune_cpu() if args.tune else None

  weight = _weight(args.size)
  device = jax.devices()[0]
  print(f"jaxquant {jq.__version__} on jax {jax.__version__}, backend "
        f"{jax.default_backend()} ({device.device_kind})")
  if tuned is not None:
    print("tune_cpu: " + (", ".join(f"{k}={v}" for k, v in tuned.items()) or "nothing applied"))
  print(f"weight: {args.size}x{args.size} float32, {weight.nbytes / 2**20:.0f} MiB\n")
  print(f"{'scheme':44} {'MiB':>6} {'rel. RMS err':>12} {'max err/step':>12} "
        f"{'quantize GB/s':>13} {'dequantize GB/s':>15}")

  for name, scale, dtype, granularity, bytes_per_weight in _schemes(
      weight, args.block_size
  ):
    # Sub-byte weights go straight to their packed bytes and back: an array of
    # a sub-byte dtype costs XLA:CPU a slow conversion and a byte per element.
    packed = bytes_per_weight < 1
    unpacked = (dict(packed_shape=weight.shape, packed_dtype=dtype) if packed else {})

    def quantize(scale=scale, dtype=dtype, granularity=granularity, packed=packed):
      return jq.quantize_linear(
          weight, scale, output_dtype=dtype, packed=packed, **granularity
      )

    quantized = quantize()

    def dequantize(quantized=quantized, scale=scale, granularity=granularity,
                   unpacked=unpacked):
      return jq.dequantize_linear(quantized, scale, **granularity, **unpacked)

    error = dequantize() - weight
    relative_rms = float(jnp.linalg.norm(error) / jnp.linalg.norm(weight))
    if jnp.issubdtype(dtype, jnp.integer):
      # Rounding leaves at most half a quantization step (one scale) per element.
      ones = jnp.ones(weight.shape, dtype)
      step = jq.dequantize_linear(ones, scale, **granularity)
      worst = f"{float(jnp.max(jnp.abs(error) / step)):.3f}"
    else:
      worst = "-"

    quantize_seconds = _seconds(quantize, args.repeats)
    dequantize_seconds = _seconds(dequantize, args.repeats)
    # Bytes that must cross memory: the float side plus the quantized side
    # at its storage width.
    traffic = weight.nbytes + weight.size * bytes_per_weight
    stored_mib = weight.size * bytes_per_weight / 2**20
    print(f"{name:44} {stored_mib:6.1f} {relative_rms:12.2e} {worst:>12} "
          f"{traffic / quantize_seconds / 1e9:13.1f} "
          f"{traffic / dequantize_seconds / 1e9:15.1f}")

  print("\nThe int4 weight goes straight to its packed bytes and back "
        "(quantize_linear(..., packed=True): two nibbles per byte, the ONNX layout).")
  print("max err/step: worst |dequantized - weight| in quantization steps "
        "(<= 0.5 for integer schemes).")
  if jax.default_backend() == "cpu" and not tuned:
    # Outputs over 32 MiB are fresh mmaps that fault once per 4 KiB page on every call.
    print("dequantize on CPU writes a fresh float32 weight per call; with glibc, "
          "--tune (jaxquant.tune_cpu() first thing in a program) keeps it in the heap, "
          "several times faster (README, \"Speed\").")


if __name__ == "__main__":
  main()
