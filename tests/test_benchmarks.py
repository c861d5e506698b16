"""The benchmark scripts still run (tiny sizes; their times mean nothing here)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernel_benchmark_runs_and_checks_bits():
  # The script asserts that every kernel equals XLA bit for bit before timing.
  result = subprocess.run(
      [sys.executable, "benchmarks/kernels.py", "--elements", "16384", "--repeats", "1"],
      cwd=ROOT, capture_output=True, text=True, check=True, timeout=600,
      env={**os.environ, "PYTHONPATH": str(ROOT)},
  )
  rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
  assert len(rows) == 1 + 5, result.stdout


def test_fake_quant_benchmark_runs():
  result = subprocess.run(
      [sys.executable, "benchmarks/fake.py", "--sizes", "16384", "--repeats", "1"],
      cwd=ROOT, capture_output=True, text=True, check=True, timeout=600,
      env={**os.environ, "PYTHONPATH": str(ROOT)},
  )
  rows = [line for line in result.stdout.splitlines() if line.startswith("| fake")]
  assert len(rows) == 3, result.stdout
