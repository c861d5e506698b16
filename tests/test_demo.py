"""``python -m jaxquant`` runs and reports every scheme."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs():
  result = subprocess.run(
      [sys.executable, "-m", "jaxquant", "--size", "256", "--repeats", "1"],
      capture_output=True, text=True, timeout=300, check=True,
  )
  for scheme in ("int8, per-axis", "int4, blocked", "float8_e4m3fn, per-tensor"):
    assert scheme in result.stdout
  # Integer schemes must stay within half a step: the column prints 0.500 at most.
  for line in result.stdout.splitlines():
    if line.startswith(("int8", "int4")):
      assert float(line.split()[-3]) <= 0.5, line


@pytest.mark.slow
def test_demo_tune_says_what_it_applied():
  result = subprocess.run(
      [sys.executable, "-m", "jaxquant", "--size", "256", "--repeats", "1", "--tune"],
      capture_output=True, text=True, timeout=300, check=True,
  )
  (line,) = [line for line in result.stdout.splitlines() if line.startswith("tune_cpu: ")]
  # Applied before the first computation: the allocator settings (glibc) or nothing.
  assert "M_ARENA_MAX=1" in line or line == "tune_cpu: nothing applied", line
  assert "--tune (jaxquant.tune_cpu()" not in result.stdout


@pytest.mark.parametrize("option, value", [("--size", "0"), ("--repeats", "0"),
                                           ("--block-size", "-1"), ("--size", "x")])
def test_demo_refuses_a_size_below_one(option, value, capsys):
  # --repeats 0 printed 0.0 GB/s; --size 0 raised JAX's own errors.
  from jaxquant import _demo  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    _demo.main([option, value])
  assert f"argument {option}: must be a positive int, got '{value}'" in capsys.readouterr().err
