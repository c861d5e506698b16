"""The README's commands and example stay true."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_the_two_commands():
  lines = README.read_text().splitlines()[:8]
  assert any("python -m jaxquant" in line for line in lines)
  assert any('pip install -e ".[test]" && pytest' in line for line in lines)
  ci = (README.parent / ".ci" / "run").read_text()
  assert 'pip install -e ".[test]" && pytest' in ci


def test_readme_python_example_runs():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert blocks
  for block in blocks:
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)  # pylint: disable=exec-used
  # The example's comment promises half a step at most.
  jnp = namespace["jnp"]
  error = jnp.abs(namespace["w"] - namespace["w_hat"])
  step = jnp.repeat(namespace["scale"], 32, axis=1)
  assert float(jnp.max(error / step)) <= 0.5
