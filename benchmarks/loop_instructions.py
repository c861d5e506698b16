"""Instructions per 8 lanes in the hot loop of quantize, quantized add and dynamic quantize.

XLA:CPU compiles each fusion to an object file (``--xla_dump_to``); this
script disassembles the op's (``objdump``), takes each vectorized innermost
loop and counts its instructions per 8 elements. Deterministic, unlike timings
on a shared machine. The elements of one iteration are read off its divisions
(one per element: ``ymm`` 8 lanes, ``zmm`` 16), or, in a loop without any
(dynamic quantize's reduction), off the distinct vectors it loads.

  python benchmarks/loop_instructions.py [--width 256|512] [--show]

``--width`` is ``--xla_cpu_prefer_vector_width`` (``jaxquant.tune_cpu()`` sets
512); ``--show`` prints each loop.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

_LANES = {"xmm": 4, "ymm": 8, "zmm": 16}
_NAMES = (
    "quantize int8 per tensor", "quantize uint8 per tensor", "quantized add int8",
    "dynamic quantize uint8 per tensor",
)
_INSTRUCTION = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")


def _loops(disassembly: str) -> list[list[tuple[str, str]]]:
  """The innermost loops: the instructions from a backward jump's target to the jump."""
  lines = []
  for line in disassembly.splitlines():
    match = _INSTRUCTION.match(line)
    if match:
      lines.append((int(match.group(1), 16), match.group(2), match.group(3)))
  loops = []
  for index, (_, mnemonic, operands) in enumerate(lines):
    target = re.match(r"([0-9a-f]+) <", operands)
    if mnemonic.startswith("j") and target and int(target.group(1), 16) < lines[index][0]:
      start = int(target.group(1), 16)
      body = [(m, o) for address, m, o in lines[: index + 1] if address >= start]
      if not any(m.startswith("j") for m, _ in body[:-1]):  # innermost
        loops.append(body)
  return loops


def _lanes(loop: list[tuple[str, str]]) -> int:
  """Elements per iteration: the lanes of its float divisions, else of the vectors it loads."""
  divisions = [o for m, o in loop if m.startswith("vdivp")]
  if divisions:
    return sum(_LANES[re.search(r"%([xyz]mm)", o).group(1)] for o in divisions)
  loads = {}
  for _, operands in loop:
    address, register = re.search(r"\S*\(%[^)]*\)", operands), re.search(r"%([xyz]mm)", operands)
    if address and register:
      loads[address.group(0)] = _LANES[register.group(1)]
  return sum(loads.values())


def hot_loops(
    dump: pathlib.Path, module: str = ""
) -> list[tuple[str, int, list[tuple[str, str]]]]:
  """``(object file, lanes, loop)`` for each vectorized innermost loop of ``module`` in ``dump``."""
  found = []
  for obj in sorted(dump.glob(f"*{module}*.o" if module else "*.o")):
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
        check=True).stdout
    for loop in _loops(text):
      lanes = _lanes(loop)
      if lanes:
        found.append((obj.name, lanes, loop))
  return found


def _ops():
  """The ops measured, on runtime (not constant) parameters, as the benchmark suite calls them."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import jaxquant as jq  # pylint: disable=import-outside-toplevel

  size = 1 << 24
  x = jnp.ones((size // 1024, 1024), jnp.float32)
  q = jnp.ones((size // 1024, 1024), jnp.int8)
  scale, zero_point = jnp.float32(0.02), jnp.int8(3)
  return {
      "quantize int8 per tensor": (
          jax.jit(jq.quantize_linear), (x, scale, zero_point)),
      "quantize uint8 per tensor": (
          jax.jit(jq.quantize_linear), (x, scale, zero_point.astype(np.uint8))),
      "quantized add int8": (
          jax.jit(jq.quantized_add),
          (q, scale, zero_point, q, jnp.float32(0.03), jnp.int8(-3), jnp.float32(0.05),
           jnp.int8(0))),
      "dynamic quantize uint8 per tensor": (jax.jit(jq.dynamic_quantize_linear), (x,)),
  }


def _compile(name: str) -> None:
  """Compiles one op; the dump directory comes from ``XLA_FLAGS``."""
  function, arguments = _ops()[name]
  function.lower(*arguments).compile()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=256, choices=(256, 512))
  parser.add_argument("--show", action="store_true", help="print each loop")
  parser.add_argument("--op", help=argparse.SUPPRESS)  # one op, in a child process
  arguments = parser.parse_args()
  if arguments.op:
    _compile(arguments.op)
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=import-outside-toplevel
  print(f"jax {jax.__version__}, --xla_cpu_prefer_vector_width={arguments.width}")
  for name in _NAMES:
    with tempfile.TemporaryDirectory() as dump:
      # The flags are read when the backend starts: one process per op.
      environment = dict(
          os.environ,
          XLA_FLAGS=f"--xla_dump_to={dump} --xla_cpu_prefer_vector_width={arguments.width}")
      subprocess.run(
          [sys.executable, __file__, "--op", name], env=environment, check=True)
      module = "jit_" + getattr(_ops()[name][0], "__name__", "")
      for obj, lanes, loop in hot_loops(pathlib.Path(dump), module):
        per_8 = 8 * len(loop) / lanes
        kinds = collections.Counter(m for m, _ in loop)
        print(f"{name}: {len(loop)} instructions per {lanes} lanes = {per_8:.2f} per 8 lanes"
              f" ({obj})")
        if arguments.show:
          for mnemonic, operands in loop:
            print(f"    {mnemonic:12} {operands}")
          print("    " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))


if __name__ == "__main__":
  main()
