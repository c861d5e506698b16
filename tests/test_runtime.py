"""``tune_cpu``: process-wide, so every call that applies anything runs in a fresh subprocess."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

import jaxquant as jq
from quant_testing import allowed_cpus

GLIBC_X86 = (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
             and platform.machine() == "x86_64")
FLAG = "--xla_cpu_prefer_vector_width=512"

# Page faults per call of a dequantize whose float32 result (64 MiB) is far
# above glibc's default mmap ceiling (32 MiB): a fresh mapping per call faults
# in each of its 16,384 pages unless the allocator keeps the block. A tuned
# heap grows for the first few calls (measured: 7) and then stops faulting; under
# load a later call may still grow it once (measured in CI: one call in eight).
FAULTS = """
import resource
import jax, jax.numpy as jnp, numpy as np
x = jnp.asarray(np.zeros(1 << 24, np.int8))
f = jax.jit(lambda x: jq.dequantize_linear(x, jnp.float32(0.5)))
for _ in range(16):
  f(x).block_until_ready()
per_call = []
for _ in range(9):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  per_call.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = sorted(per_call)[4]  # the median call: one call may still grow the heap
"""


def _run(*code, **environment):
  """Runs the ``code`` pieces in a fresh interpreter; returns the JSON it prints last."""
  env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
  # tune_cpu tunes XLA:CPU: on a machine with an accelerator, the programs run on its CPU.
  env.update(JAX_PLATFORMS="cpu", **environment)
  program = "import json, warnings\nimport jaxquant as jq\n" + "".join(
      textwrap.dedent(piece) for piece in code)
  result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.skipif(not GLIBC_X86, reason="the allocator settings are glibc's, the flag x86's")
@pytest.mark.slow  # a fresh interpreter counting page faults of 64 MiB results
def test_applies_both_settings_once_and_the_faults_go():
  out = _run("""
    import os
    first = jq.tune_cpu()
    flags = os.environ["XLA_FLAGS"]
  """, FAULTS, """
    second = jq.tune_cpu(vector_width=256)
    print(json.dumps(dict(first=first, second=second, flags=flags, faults=faults)))
  """)
  assert out["first"] == {
      "M_ARENA_MAX": 1, "M_MMAP_THRESHOLD": 1 << 30, "M_TRIM_THRESHOLD": (1 << 31) - 1,
      "XLA_FLAGS": FLAG,
  }
  assert out["second"] == out["first"]  # idempotent: nothing re-applied
  assert out["flags"] == FLAG
  # Untuned, every call faults in all 16,384 pages (the next test).
  assert out["faults"] < 1024, out


@pytest.mark.skipif(not GLIBC_X86, reason="glibc's mmap threshold")
@pytest.mark.slow  # a fresh interpreter counting page faults of 64 MiB results
def test_untuned_large_results_fault_in_every_page():
  out = _run(FAULTS, "print(json.dumps(faults))")
  assert out >= 16384


def test_after_the_backend_started_it_warns_and_changes_nothing():
  out = _run("""
    import os
    import jax
    jax.devices()
    allowed = os.sched_getaffinity(0)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      applied = jq.tune_cpu(cpus=1)
    print(json.dumps(dict(applied=applied, flags=os.environ.get("XLA_FLAGS"),
                          same_cpus=os.sched_getaffinity(0) == allowed,
                          warnings=[str(w.message) for w in caught])))
  """)
  assert out["applied"] == {} and out["flags"] is None and out["same_cpus"]
  assert len(out["warnings"]) == 1 and "already initialised" in out["warnings"][0]


@pytest.mark.skipif(not GLIBC_X86, reason="the flag is x86's")
def test_a_width_the_user_set_is_kept_and_none_leaves_each_setting_alone():
  out = _run("""
    import os
    applied = jq.tune_cpu(mmap_threshold=None)
    print(json.dumps(dict(applied=applied, flags=os.environ["XLA_FLAGS"])))
  """, XLA_FLAGS="--xla_cpu_prefer_vector_width=256")
  assert out == {"applied": {}, "flags": "--xla_cpu_prefer_vector_width=256"}
  out = _run("""
    import os
    applied = jq.tune_cpu(vector_width=None, mmap_threshold=256 << 20)
    print(json.dumps(dict(applied=applied, flags=os.environ.get("XLA_FLAGS"))))
  """)
  assert out["flags"] is None
  assert out["applied"]["M_MMAP_THRESHOLD"] == 256 << 20
  assert "XLA_FLAGS" not in out["applied"]
  assert "jax_cpu_enable_async_dispatch" not in out["applied"]


# A call whose computation takes a while (a sort of 4M floats: ~0.3 s here):
# dispatched asynchronously it returns at once, its result not ready yet.
READY_ON_RETURN = """
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sort(jnp.sin(x)))
x = jnp.arange(1 << 22, dtype=jnp.float32)
f(x).block_until_ready()
ready = f(x).is_ready()
"""


def test_synchronous_dispatch_returns_when_the_result_is_ready():
  out = _run("applied = jq.tune_cpu(mmap_threshold=None, vector_width=None, async_dispatch=False)\n",
             READY_ON_RETURN, "print(json.dumps(dict(applied=applied, ready=ready)))")
  assert out == {"applied": {"jax_cpu_enable_async_dispatch": False}, "ready": True}
  # JAX's default, asynchronous: the same call returns before its result is ready.
  assert _run(READY_ON_RETURN, "print(json.dumps(ready))") is False


# Every thread of this process and the CPUs it may run on, after XLA's thread pool has
# run a computation split across it.
THREADS = """
import glob
import jax, jax.numpy as jnp
x = jnp.ones((1 << 24,), jnp.float32)
jax.jit(lambda x: jnp.sin(x) * 2)(x).block_until_ready()
threads = {}
for status in glob.glob("/proc/self/task/*/status"):
  with open(status) as lines:
    fields = dict(line.rstrip("\\n").split(":\\t", 1) for line in lines if ":\\t" in line)
  threads[fields["Pid"]] = fields["Cpus_allowed_list"]
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_cpus_runs_every_thread_xla_starts_on_the_first_cpus():
  allowed = allowed_cpus()  # the subprocess inherits them
  out = _run("applied = jq.tune_cpu(mmap_threshold=None, vector_width=None, cpus=1)\n",
             THREADS, "print(json.dumps(dict(applied=applied, threads=threads)))")
  if len(allowed) == 1:  # already one CPU: nothing to apply
    assert out["applied"] == {}, out
    return
  untuned = _run(THREADS, "print(json.dumps(threads))")
  assert out["applied"] == {"sched_setaffinity": str(allowed[0])}, out
  assert set(out["threads"].values()) == {str(allowed[0])}, out["threads"]
  # XLA sizes its thread pools by the CPUs the process may use.
  assert len(out["threads"]) < len(untuned), (out["threads"], untuned)
  assert _run("print(json.dumps(jq.tune_cpu(mmap_threshold=None, vector_width=None, "
              f"cpus={len(allowed)})))") == {}


def test_without_glibc_the_allocator_is_left_alone():
  out = _run("""
    import jaxquant._runtime as runtime
    runtime._glibc = lambda: None
    print(json.dumps(jq.tune_cpu(vector_width=None)))
  """)
  assert out == {}


@pytest.mark.parametrize("keywords", [
    dict(vector_width=384), dict(mmap_threshold=0), dict(mmap_threshold=1 << 31),
    dict(mmap_threshold=1.5e9), dict(mmap_threshold=True), dict(async_dispatch=0),
    dict(async_dispatch="sync"), dict(cpus=0), dict(cpus=True), dict(cpus=1.0),
])
def test_invalid_settings_raise_before_anything_is_applied(keywords):
  # In this process: validation comes first, so nothing is tuned here.
  with pytest.raises(ValueError, match="tune_cpu"):
    jq.tune_cpu(**keywords)
