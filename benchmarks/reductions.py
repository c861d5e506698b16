"""Per-output-feature statistics of a weight (reductions down its columns), in one run.

    python benchmarks/reductions.py [--shapes 1024x1024 4096x4096 ...] [--repeats 21]

One scale per index of a (K, N) array's minor dim (a Dense kernel per output
feature, a convolution kernel per output channel, activations per channel)
reduces down its columns. That is what ``dot_general_dynamic_int8`` does to a
float weight in every call and ``quantize_params`` once. Peers, jitted, on the
same data:

* ``jaxquant absmax``: ``choose_qparams(w, int8, axis=-1)``, max|w| (NaN
  ignored, exact): a float max of |w| (redone as the integer max of the
  magnitudes' bits where it is NaN or below the least normal float32), or
  that integer max alone from 32K columns;
* ``jaxquant minmax``: ``choose_qparams(w, uint8, axis=-1, method="minmax")``,
  min and max (NaN ignored): a float min and max, or from 32K columns two
  plain reductions of integer keys;
* ``variadic pair``: one ``lax.reduce`` of the (min, max) keys pair, what
  both used before (and still use where the minor dim is reduced);
* ``jnp``: ``jnp.max(jnp.abs(w), 0)``, the float max a user writes (NaN not
  ignored; XLA:CPU flushes its subnormal operands to zero);
* ``numpy``: ``np.abs(w).max(0)``.

Reported: the median of ``--repeats`` interleaved rounds in milliseconds, and
each peer's time over ``jaxquant absmax``'s. Compare within one run.
"""

from __future__ import annotations

import argparse

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from _timing import interleaved_median_ms
from _timing import load_average


def _keys(w):
  """float32 bits as int32 keys in the floats' order."""
  bits = lax.bitcast_convert_type(w, jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _variadic_pair(w):
  keys = _keys(w)
  initial = _keys(jnp.float32(np.inf)), _keys(jnp.float32(-np.inf))
  return lax.reduce((keys, keys), initial,
                    lambda a, b: (lax.min(a[0], b[0]), lax.max(a[1], b[1])), (0,))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", nargs="+", default=[
      "64x4096", "1024x1024", "4096x1024", "4096x4096", "16384x1024", "16x65536"])
  parser.add_argument("--repeats", type=int, default=21)
  args = parser.parse_args()
  peers = {
      "jaxquant absmax": jax.jit(lambda w: jq.choose_qparams(w, jnp.int8, axis=-1)),
      "jaxquant minmax": jax.jit(
          lambda w: jq.choose_qparams(w, jnp.uint8, axis=-1, method="minmax")),
      "variadic pair": jax.jit(_variadic_pair),
      "jnp": jax.jit(lambda w: jnp.max(jnp.abs(w), 0)),
  }
  print(f"jax {jax.__version__} ({jax.default_backend()}); median of {args.repeats}; "
        f"load average {load_average()}")
  print("| shape | peer | ms | / jaxquant absmax |")
  print("|---|---|---|---|")
  rng = np.random.default_rng(0)
  for shape in args.shapes:
    rows, columns = map(int, shape.split("x"))
    host = rng.standard_normal((rows, columns)).astype(np.float32)
    w = jnp.asarray(host)
    functions = {name: (lambda peer=peer: peer(w)) for name, peer in peers.items()}
    functions["numpy"] = lambda: np.abs(host).max(0)
    medians, _ = interleaved_median_ms(functions, repeats=args.repeats)
    for name, ms in medians.items():
      print(f"| {shape} | {name} | {ms:.3f} | {ms / medians['jaxquant absmax']:.2f} |",
            flush=True)


if __name__ == "__main__":
  main()
