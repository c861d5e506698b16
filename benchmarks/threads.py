"""jaxquant against onnxruntime on all cores (spinning or not) and on one thread, each alone.

    python benchmarks/threads.py [--size 1048576] [--repeats 101] [--sync]
    taskset -c 0 python benchmarks/threads.py      # jaxquant on one core

XLA:CPU's idle worker threads sleep; onnxruntime's spin, waiting for work
(its default; ``session.intra_op.allow_spinning = 0`` turns it off). Where a
call is short, waking a sleeping thread costs about what a second core saves.
This times the suite's per-tensor QuantizeLinear int8, quantized add int8 and
DynamicQuantizeLinear uint8 (benchmarks/run.py's cases, after
``jaxquant.tune_cpu()``): jaxquant; onnxruntime with its default threads,
spinning and not; and onnxruntime on one thread (``intra_op_num_threads=1``:
its threads do not keep to ``taskset``'s cores, jaxquant's do). Each peer is
timed alone, ``--repeats`` calls in a row (median), so that no peer's threads
are left spinning into another's call. ``--sync`` runs jaxquant's calls on the
calling thread (``tune_cpu(async_dispatch=False)``). Prints a markdown table
with the cores the process may run on and the load average.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
import warnings

import numpy as np

import jaxquant as jq

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import run  # pylint: disable=wrong-import-position
from _timing import median_ms  # pylint: disable=wrong-import-position

# (op, layout, types): the suite's rows compared here.
ROWS = (
    ("quantize", "per-tensor", "float32 -> int8"),
    ("add", "per-tensor", "int8 + int8 -> int8"),
    ("dynamic", "per-tensor", "float32 -> uint8"),
)


# onnxruntime's sessions besides its default, by column: keyword arguments of run._ort_session.
ORT_VARIANTS = {"not spinning": {"spinning": False}, "one thread": {"threads": 1}}


def _peers(op, layout, types, elements, **session):
  """The suite's peers of one row, its onnxruntime session made with ``session``."""
  cases = run.CASES[op](elements, np.random.default_rng(0), pallas=False,
                        ort_session=functools.partial(run._ort_session, **session))  # pylint: disable=protected-access
  # The generator builds its cases one by one: stop at the row wanted.
  return next(c for c in cases if (c.layout, c.types) == (layout, types)).peers


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", type=int, default=1 << 20, help="elements (a multiple of 1024)")
  parser.add_argument("--repeats", type=int, default=101)
  parser.add_argument("--sync", action="store_true",
                      help="jaxquant.tune_cpu(async_dispatch=False): calls on the calling thread")
  args = parser.parse_args()
  jq.tune_cpu(async_dispatch=False if args.sync else None)
  cores = len(os.sched_getaffinity(0))
  print(f"{cores} core(s) for this process; jaxquant dispatch "
        f"{'synchronous' if args.sync else 'asynchronous (JAX default)'}; "
        f"{run._size(args.size)} elements; median of {args.repeats} calls, each peer alone; "  # pylint: disable=protected-access
        f"load average {os.getloadavg()[0]:.2f}")
  print("| op | jaxquant us | onnxruntime us | onnxruntime, not spinning us "
        "| onnxruntime, one thread us |")
  print("|---|---|---|---|---|")
  for op, layout, types in ROWS:
    default = _peers(op, layout, types, args.size)
    peers = {"jaxquant": default["jaxquant"], "onnxruntime": default["onnxruntime"]}
    for column, session in ORT_VARIANTS.items():
      peers[column] = _peers(op, layout, types, args.size, **session)["onnxruntime"]
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      medians = {name: median_ms(call, repeats=args.repeats) for name, call in peers.items()}
    print(f"| {op} {types} | " + " | ".join(f"{ms * 1e3:.1f}" for ms in medians.values()) + " |",
          flush=True)
  print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
