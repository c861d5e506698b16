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


def test_readme_python_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) == 2
  namespaces = []
  for block in blocks:
    namespaces.append({})
    exec(compile(block, str(README), "exec"), namespaces[-1])  # pylint: disable=exec-used
  # The first example's comment promises half a step at most.
  quantized = namespaces[0]
  jnp = quantized["jnp"]
  error = jnp.abs(quantized["w"] - quantized["w_hat"])
  step = jnp.repeat(quantized["scale"], 32, axis=1)
  assert float(jnp.max(error / step)) <= 0.5
  # The QAT example trains: weights and scales both get gradients.
  grad_weights, grad_scale = namespaces[1]["grads"]
  assert grad_scale.shape == (128, 4)
  assert float(jnp.mean(grad_weights != 0)) > 0.9  # the straight-through estimator passes
  assert bool(jnp.all(grad_scale != 0))
