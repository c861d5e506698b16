"""The benchmark scripts still run (tiny sizes; their times mean nothing here)."""

import os
import pathlib
import subprocess
import sys

import pytest

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


def test_kernel_benchmark_runs_and_checks_bits():
  # The script asserts that every kernel equals XLA bit for bit before timing.
  rows, output = _table_rows("kernels.py", "--elements", "16384", prefix="| ")
  assert len(rows) == 1 + 5, output


def test_fake_quant_benchmark_runs():
  rows, output = _table_rows("fake.py", "--sizes", "16384", prefix="| fake")
  assert len(rows) == 3, output


def test_linear_benchmark_runs():
  rows, output = _table_rows("linear.py", "--sizes", "16384", prefix=("quantize", "dequantize",
                                                                      "dynamic"))
  assert len(rows) == 7, output
