"""The benchmark scripts and the suite still run (tiny sizes; their times mean nothing here)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from quant_testing import allowed_cpus
from quant_testing import one_cpu_arguments

pytestmark = pytest.mark.slow  # each script starts a fresh interpreter and compiles its ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _table_rows(script, *arguments, prefix):
  """Runs a benchmark script at a tiny size; its markdown rows starting with ``prefix``."""
  result = subprocess.run(
      [sys.executable, f"benchmarks/{script}", *arguments, "--repeats", "1"],
      cwd=ROOT, capture_output=True, text=True, check=True, timeout=600,
      env={**os.environ, "PYTHONPATH": str(ROOT)},
  )
  return [line for line in result.stdout.splitlines() if line.startswith(prefix)], result.stdout


def test_kernel_benchmark_runs_and_checks_bits(tmp_path):
  # Each element-wise row says whether the kernel gave XLA's bits; the
  # matmul rows time the weight-only kernel against XLA and two dense dots.
  results = tmp_path / "kernels.json"
  rows, output = _table_rows("kernels.py", "--elements", "16384", "--json", str(results),
                             prefix="| ")
  written = json.loads(results.read_text())
  assert len(written["elementwise"]) == 9 and len(written["matmul"]) == 4, output
  assert all(row["differing"] == 0 for row in written["elementwise"]), output
  assert len(rows) == 2 + 9 + 4, output


def test_kernel_sweep_runs_every_tiling_within_tolerance():
  # K = N = 256 at two rows: tiles of 2 and 16 rows, three widths of the weight's tile, K in
  # steps of 64 (in 1 or 4 ranges) and 256; each within float32 summation tolerance of the
  # full-precision dot (the script prints a line for any that is not). Here they run in the
  # TPU interpreter, by dot; the Triton path for few rows is test_matmul's to check.
  rows, output = _table_rows("kernels.py", "--matmul-only", "--sweep", "--matmul-rows", "2",
                             "--features", "256", prefix="| 2 | kernel Tiling(")
  assert len(rows) == 2 * 3 * 3, output
  assert "failed" not in output and "relative error" not in output, output


def test_suite_writes_json_and_markdown(tmp_path):
  results = tmp_path / "results.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks", "--sizes", "8192", "--repeats", "1",
       "--ops", "dequantize", "quantize", "dynamic", "add", "fake",
       "--layouts", "per-tensor", "per-row", "--json", str(results), "--markdown"],
      cwd=ROOT, capture_output=True, text=True, check=True, timeout=600,
      env={**os.environ, "PYTHONPATH": str(ROOT)},
  )
  saved = json.loads(results.read_text())
  rows = saved["rows"]
  assert saved["machine"]["cpu_model"], saved["machine"]  # which processor the figures are from
  # Per tensor: dequantize int8 (2 outputs), uint8, int4 (2 outputs); quantize int8
  # and int4; dynamic per tensor and per row; add; fake.
  assert len(rows) == 5 + 2 + 2 + 1 + 1, result.stdout
  for row in rows:
    assert {"jaxquant", "jnp", "copy"} <= set(row["median_ms"]), row
    assert row["of_copy"] > 0 and row["gb_per_s"]["jaxquant"] > 0
  with_onnxruntime = {(row["op"], row["types"]) for row in rows if row["vs_onnxruntime"]}
  assert {("dequantize", "int8 -> float32"), ("quantize", "float32 -> int8"),
          ("dynamic", "float32 -> uint8"), ("add", "int8 + int8 -> int8")} <= with_onnxruntime
  # The bar exactness is measured against, beside the two targets it explains.
  with_inexact = {(row["op"], row["types"]) for row in rows if "inexact" in row["median_ms"]}
  assert with_inexact == {("quantize", "float32 -> int8"), ("add", "int8 + int8 -> int8")}
  # XLA's barest loop over the same bytes beside every row onnxruntime has, but packed int4.
  with_floor = {(row["op"], row["types"]) for row in rows if "xla-floor" in row["median_ms"]}
  assert with_floor == {("dequantize", "int8 -> float32"), ("dequantize", "uint8 -> float32"),
                        ("quantize", "float32 -> int8"), ("dynamic", "float32 -> uint8"),
                        ("add", "int8 + int8 -> int8")}
  table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
  assert len(table) == 1 + len(rows), result.stdout


def test_suite_tune_and_sync_apply_tune_cpu_before_measuring_and_record_it(tmp_path):
  results = tmp_path / "results.json"
  one_cpu = one_cpu_arguments()
  subprocess.run(
      [sys.executable, "-m", "benchmarks", "--tune", "--sync", *one_cpu, "--sizes", "8192",
       "--repeats", "1",
       "--ops", "dequantize", "--layouts", "per-tensor", "--types", "int8 -> float32",
       "--json", str(results)],
      cwd=ROOT, capture_output=True, text=True, check=True, timeout=600,
      env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(ROOT)},
  )
  saved = json.loads(results.read_text())
  machine = saved["machine"]
  assert len(saved["rows"]) == 1
  # Applied before the backend started (else tune_cpu applies nothing and warns).
  assert machine["tune_cpu"]["jax_cpu_enable_async_dispatch"] is False, machine
  if "XLA_FLAGS" in machine["tune_cpu"]:
    assert machine["xla_flags"] == machine["tune_cpu"]["XLA_FLAGS"]
  if one_cpu:
    first = str(allowed_cpus()[0])
    assert machine["tune_cpu"]["sched_setaffinity"] == first, machine
    assert machine["cpus"] == first, machine


def test_fake_quant_benchmark_runs():
  rows, output = _table_rows("fake.py", "--sizes", "16384", prefix="| fake")
  assert len(rows) == 3, output


def test_reductions_benchmark_times_five_peers_per_shape():
  rows, output = _table_rows("reductions.py", "--shapes", "64x32", "8x40000", prefix="| ")
  assert len(rows) == 1 + 2 * 5, output  # the header, then 5 peers a shape


def test_linear_benchmark_runs():
  rows, output = _table_rows("linear.py", "--sizes", "16384", prefix=("quantize", "dequantize",
                                                                      "dynamic"))
  assert len(rows) == 7, output


def test_dispatch_benchmark_runs_both_modes():
  rows, output = _table_rows("dispatch.py", "--calls", "10", "--steps", "5",
                             prefix=("| call", "| training"))
  assert len(rows) == 10, output


def test_threads_benchmark_times_three_ops_three_ways():
  rows, output = _table_rows("threads.py", "--size", "8192", "--sync", prefix="| ")
  assert len(rows) == 4, output  # the header, quantize, add, dynamic
  assert all(len(row.split("|")) == 7 for row in rows), output
