"""Wall-time measurement shared by the benchmark scripts."""

import os
import platform
import random
import time

import jax

import jaxquant as jq


def load_average() -> str:
  """The 1, 5 and 15 minute load averages, as a benchmark's header prints them."""
  return " ".join(f"{value:.2f}" for value in os.getloadavg())


def cpus() -> str:
  """The CPUs this process may run on, as a benchmark's header prints them."""
  if not hasattr(os, "sched_getaffinity"):  # not Linux
    return f"{os.cpu_count()} (affinity unknown)"
  return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def cpu_model() -> str:
  """The processor's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
      for line in info:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def tune(*, defaults: bool, async_dispatch: bool | None = None, cpus: int | None = None):
  """``jaxquant.tune_cpu`` for a benchmark's flags, before JAX's backend starts.

  ``defaults`` (``--tune``) applies its default settings; otherwise only the
  ones asked for. Returns what it applied, or ``None`` when nothing was asked.
  """
  if not (defaults or async_dispatch is not None or cpus is not None):
    return None
  applied = jq.tune_cpu(**({} if defaults else dict(mmap_threshold=None, vector_width=None)),
                        async_dispatch=async_dispatch, cpus=cpus)
  if cpus is not None and "sched_setaffinity" not in applied:
    raise SystemExit(f"--cpus {cpus}: the process may use no more CPUs than that already")
  return applied


def best_ms(function, repeats):
  """The fastest of ``repeats`` calls of ``function`` after one warm-up, in milliseconds."""
  jax.block_until_ready(function())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(function())
    best = min(best, time.perf_counter() - start)
  return best * 1e3


def interleaved_median_ms(functions, *, repeats, budget_s=None):
  """Median milliseconds of each of ``functions`` (a dict), timed in turn, round after round.

  Interleaving puts every peer under the same machine load, so ratios within
  a run stay meaningful on a shared machine. Each round calls them in a fresh
  (seeded) random order, so that each peer follows every other about equally
  often: a call's time can depend on the call before it (onnxruntime's idle
  threads spin on after a run; NumPy's large temporaries leave the heap and
  the caches in another state), and in a fixed order the peer right after
  onnxruntime or NumPy was measured up to twice as slow as after the others.
  Each function is called once to
  warm up (compile, allocate); with ``budget_s``, fewer rounds (at least 3)
  are run when ``repeats`` rounds would take longer.

  Returns:
    ``({name: median ms}, rounds)``.
  """
  warm = {}
  for name, function in functions.items():
    start = time.perf_counter()
    jax.block_until_ready(function())
    warm[name] = time.perf_counter() - start
  if budget_s is not None:
    repeats = max(3, min(repeats, int(budget_s / max(sum(warm.values()), 1e-9))))
  times = {name: [] for name in functions}
  names = list(functions)
  order = random.Random(0)
  for _ in range(repeats):
    order.shuffle(names)
    for name in names:
      function = functions[name]
      start = time.perf_counter()
      jax.block_until_ready(function())
      times[name].append(time.perf_counter() - start)
  medians = {}
  for name, values in times.items():
    values.sort()
    middle = len(values) // 2
    median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
    medians[name] = median * 1e3
  return medians, repeats


def median_ms(function, *, repeats):
  """Median milliseconds of ``repeats`` calls of ``function`` in a row, after one warm-up."""
  medians, _ = interleaved_median_ms({"function": function}, repeats=repeats)
  return medians["function"]
