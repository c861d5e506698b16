"""Opt-in process settings that speed up XLA:CPU."""

from __future__ import annotations

import ctypes
import os
import platform
import warnings

import jax
from jax._src import xla_bridge

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_VECTOR_WIDTH_FLAG = "--xla_cpu_prefer_vector_width"
_ASYNC_DISPATCH = "jax_cpu_enable_async_dispatch"
_AFFINITY = "sched_setaffinity"

# What tune_cpu applied in this process: the settings cannot be undone, so a
# second call reports them again instead of applying anything.
_applied: dict[str, int | str] | None = None


def _glibc() -> ctypes.CDLL | None:
  try:
    libc = ctypes.CDLL(None)
  except OSError:  # Windows has no process-wide C namespace to open.
    return None
  if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
    return None  # musl, macOS: other allocators, other parameters.
  return libc


def tune_cpu(
    *, mmap_threshold: int | None = 1 << 30, vector_width: int | None = 512,
    async_dispatch: bool | None = None, cpus: int | None = None,
) -> dict[str, int | str | bool]:
  """Applies process-wide settings that make XLA:CPU's ops faster: large results, small calls.

  Opt-in, since they change the whole process, not just jaxquant, and must be
  made **before JAX initialises its backend** (before the first computation,
  ``jax.devices()`` or ``jit`` call; importing JAX and jaxquant is fine).

  * ``mmap_threshold``: glibc's allocator keeps blocks up to this many bytes
    in its heap instead of a fresh ``mmap`` per allocation. XLA:CPU allocates
    every result afresh; above 32 MiB (glibc's default ceiling) each one is a
    new mapping that the kernel zero-fills page by page on every call, which
    costs more than the op (a 16M-element int8 -> float32 dequantize spends
    most of its time in 16,385 page faults). Three ``mallopt`` calls: one
    arena for every thread (``M_ARENA_MAX=1``: a worker thread's own arena
    cannot hold blocks over 64 MiB, and XLA's results are allocated on its
    worker threads), ``M_MMAP_THRESHOLD=mmap_threshold``, and
    ``M_TRIM_THRESHOLD`` at its maximum (else a freed block at the heap's top
    is returned to the kernel and faulted in again). The cost: the heap keeps
    freed memory for reuse, so the resident size stays near its high-water
    mark (several result-sized blocks for a loop of large calls), and
    threads share one arena's lock. glibc on Linux only.
  * ``vector_width``: XLA:CPU vectorizes for 256-bit registers by default,
    also on AVX-512 CPUs; ``512`` sets
    ``XLA_FLAGS=--xla_cpu_prefer_vector_width=512`` (the exact division of
    quantize runs on twice as many lanes). Same bits: no fast-math is
    involved. x86-64 only; an ``XLA_FLAGS`` that already sets the width is
    left as it is. The variable is inherited by subprocesses.
  * ``async_dispatch`` (default ``None``: left alone): ``False`` sets JAX's
    ``jax_cpu_enable_async_dispatch`` to ``False``, so that a jitted call runs
    on the calling thread and returns once its result is ready, instead of
    being queued to another thread that the caller then waits on. Where idle
    cores sleep (virtual machines most of all), waking that thread and then the
    caller costs tens of microseconds per call, more than a small op itself:
    for a program that calls and waits (serving, a notebook). Not for a loop
    that dispatches steps ahead of their results (training): it then waits on
    each step instead of preparing the next (README, "Speed", has both
    measured). Single-device computations only (JAX's rule).
  * ``cpus`` (default ``None``: left alone): run the process, each of its
    threads and every thread started later, on the first ``cpus`` of the
    CPUs it may use (``os.sched_setaffinity``, as ``taskset -c`` does), and so
    XLA:CPU's thread pool, which XLA sizes by them. Where waking another core
    costs more than the work handed to it (a small virtual machine), one CPU
    runs small ops and small int8 layers faster, and large ops slower (README,
    "Speed", has both measured). A library that pins its own threads keeps
    its CPUs (onnxruntime's thread pool does). Linux only.

  Calling it again returns what the first call applied and changes nothing.

  Args:
    mmap_threshold: bytes; ``None`` leaves the allocator alone.
    vector_width: ``256`` or ``512`` bits; ``None`` leaves ``XLA_FLAGS`` alone.
    async_dispatch: ``False`` for synchronous dispatch on XLA:CPU, ``True``
      for JAX's default; ``None`` leaves the setting alone.
    cpus: how many CPUs to run on; ``None`` (or as many as the process may
      use already) leaves the affinity alone.

  Returns:
    The settings applied, by name (``"M_ARENA_MAX"``, ``"M_MMAP_THRESHOLD"``,
    ``"M_TRIM_THRESHOLD"``, ``"XLA_FLAGS"``, ``"jax_cpu_enable_async_dispatch"``,
    ``"sched_setaffinity"``: the CPUs chosen, as ``"0,1"``);
    empty when nothing was (called after JAX's backend started, which also
    warns; or nothing asked for applies here: not glibc, not x86-64, not Linux).

  Raises:
    ValueError: for a ``vector_width`` other than 256, 512 or ``None``, a
      ``mmap_threshold`` that is not a positive int below 2**31, or an
      ``async_dispatch`` that is not a bool or ``None``, or ``cpus`` that is
      not a positive int or ``None``.

  Example (not run here: it would retune the test process)::

    import jaxquant as jq

    jq.tune_cpu()  # first thing in the program, before any computation
    # {'M_ARENA_MAX': 1, 'M_MMAP_THRESHOLD': 1073741824,
    #  'M_TRIM_THRESHOLD': 2147483647, 'XLA_FLAGS': '--xla_cpu_prefer_vector_width=512'}
  """
  global _applied
  if vector_width not in (None, 256, 512):
    raise ValueError(f"tune_cpu: vector_width must be 256, 512 or None, got {vector_width!r}")
  # A bool is an int to Python: True would be a threshold of one byte.
  if mmap_threshold is not None and not (
      isinstance(mmap_threshold, int) and not isinstance(mmap_threshold, bool)
      and 0 < mmap_threshold < 1 << 31):
    raise ValueError(
        "tune_cpu: mmap_threshold must be a positive int below 2**31 (bytes) or None, "
        f"got {mmap_threshold!r}"
    )
  if async_dispatch is not None and not isinstance(async_dispatch, bool):
    raise ValueError(
        f"tune_cpu: async_dispatch must be True, False or None, got {async_dispatch!r}")
  if cpus is not None and not (
      isinstance(cpus, int) and not isinstance(cpus, bool) and cpus > 0):
    raise ValueError(f"tune_cpu: cpus must be a positive int or None, got {cpus!r}")
  if _applied is not None:
    return dict(_applied)
  if mmap_threshold is None and vector_width is None and async_dispatch is None and cpus is None:
    return {}
  if xla_bridge.backends_are_initialized():
    warnings.warn(
        "jaxquant.tune_cpu: JAX's backend is already initialised, so its worker threads "
        "have their own allocator arenas, XLA has read XLA_FLAGS and the CPU client's "
        "dispatch and thread pool are set; nothing was changed. "
        "Call it before the first computation.", RuntimeWarning, stacklevel=2,
    )
    return {}
  applied: dict[str, int | str | bool] = {}
  libc = _glibc() if mmap_threshold is not None else None
  if libc is not None:
    for name, parameter, value in [
        ("M_ARENA_MAX", _M_ARENA_MAX, 1),
        ("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, mmap_threshold),
        ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, (1 << 31) - 1),
    ]:
      if libc.mallopt(parameter, value):  # 1 on success
        applied[name] = value
  flags = os.environ.get("XLA_FLAGS", "")
  if (vector_width is not None and platform.machine().lower() in ("x86_64", "amd64")
      and _VECTOR_WIDTH_FLAG not in flags):
    os.environ["XLA_FLAGS"] = f"{flags} {_VECTOR_WIDTH_FLAG}={vector_width}".strip()
    applied["XLA_FLAGS"] = f"{_VECTOR_WIDTH_FLAG}={vector_width}"
  if async_dispatch is not None:
    # Read when the CPU client is created, which has not happened yet (above).
    jax.config.update(_ASYNC_DISPATCH, async_dispatch)
    applied[_ASYNC_DISPATCH] = async_dispatch
  allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
  if cpus is not None and cpus < len(allowed):
    # Every thread: some started already (NumPy's BLAS pool, at its import).
    for thread in os.listdir("/proc/self/task"):
      try:
        os.sched_setaffinity(int(thread), allowed[:cpus])
      except ProcessLookupError:  # ended since it was listed
        pass
    applied[_AFFINITY] = ",".join(map(str, allowed[:cpus]))
  _applied = applied
  return dict(applied)
