"""The README's commands and example stay true."""

import pathlib
import re
import tomllib

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_the_two_commands():
  lines = README.read_text().splitlines()[:8]
  assert any("python -m jaxquant" in line for line in lines)
  assert any('pip install -e ".[test]" && pytest' in line for line in lines)
  ci = (README.parent / ".ci" / "run").read_text()
  assert 'pip install -e ".[test]" && pytest' in ci


@pytest.mark.slow
def test_readme_python_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) == 2
  namespaces = []
  for block in blocks:
    namespaces.append({})
    exec(compile(block, str(README), "exec"), namespaces[-1])  # pylint: disable=exec-used
  # The first example's comment promises half a step at most (up to float32
  # rounding of the dequantized value).
  quantized = namespaces[0]
  jnp = quantized["jnp"]
  error = jnp.abs(quantized["w"] - quantized["w_hat"])
  step = jnp.repeat(quantized["scale"], 32, axis=1)
  assert float(jnp.max(error / step)) <= 0.5 + 1e-5
  # The QAT example trains: weights and scales both get gradients.
  grad_weights, grad_scale = namespaces[1]["grads"]
  assert grad_scale.shape == (128, 4)
  assert float(jnp.mean(grad_weights != 0)) > 0.9  # the straight-through estimator passes
  assert bool(jnp.all(grad_scale != 0))


def test_oracles_are_pinned_to_the_versions_the_readme_names():
  # A newer oracle must never turn the suite red: the test extra pins each one
  # exactly, and the README names the same versions.
  pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
  pins = dict(
      requirement.split("==") for requirement in pyproject["project"]["optional-dependencies"]["test"]
      if "==" in requirement
  )
  readme = README.read_text()
  for oracle in ("onnx", "onnxruntime", "torch", "hypothesis", "ml_dtypes"):
    assert oracle in pins, f"{oracle} is not pinned in the test extra"
    assert pins[oracle] in readme, f"README does not name {oracle} {pins[oracle]}"


def test_ci_installs_into_a_fresh_venv():
  ci = (README.parent / ".ci" / "run").read_text()
  assert "-m venv" in ci and "activate" in ci


def test_docs_cite_tests_that_exist():
  # docs/numerics.md pins each rule to a test by name: the names must not drift.
  root = README.parent
  for doc in [README, *sorted((root / "docs").glob("*.md"))]:
    for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", doc.read_text()):
      assert re.search(rf"^def {name}\(", (root / path).read_text(), flags=re.M), (
          f"{doc.name} cites {path}::{name}, which does not exist")
