"""Best-of-N wall time, shared by the benchmark scripts."""

import time

import jax


def best_ms(function, repeats):
  """The fastest of ``repeats`` calls of ``function`` after one warm-up, in milliseconds."""
  jax.block_until_ready(function())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(function())
    best = min(best, time.perf_counter() - start)
  return best * 1e3
