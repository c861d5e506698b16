"""Package hygiene: one version, the license, py.typed in the wheel, the API docs build.

The wheel is built from a copy of the package's sources, so the working tree
gets no build/ directory; mypy checks a user's script against that wheel
installed into a directory of its own (mypy cannot follow the editable
install's import hook). The docs are built with warnings as errors, from
scratch, and must document every name in ``jaxquant.__all__``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

import jaxquant

# One worker builds the wheel (the module fixture), not each worker.
pytestmark = pytest.mark.xdist_group("wheel")
ROOT = pathlib.Path(__file__).resolve().parents[1]
# sha256 of the Apache License 2.0 text as apache.org distributes it
# (https://www.apache.org/licenses/LICENSE-2.0.txt), which pip-installed
# Apache-2.0 packages (jax, onnx) ship unchanged.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

USER_SCRIPT = """\
import jax
import jax.numpy as jnp
import jaxquant as jq

x = jnp.linspace(-1.0, 1.0, 8)
q: jax.Array = jq.quantize_linear(x, 0.1, output_dtype=jnp.int8)
y: jax.Array = jq.dequantize_linear(q, 0.1)
version: str = jq.__version__
"""


def _run(*command: str) -> None:
  result = subprocess.run(command, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr


def test_version_is_written_once_and_installed_metadata_agrees():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert "version" not in project and "version" in project["dynamic"]
  assert importlib.metadata.version("jaxquant") == jaxquant.__version__


def test_license_is_the_apache_2_0_text_pyproject_names():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
  assert hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_0_SHA256


def test_changelog_has_the_current_version():
  changelog = (ROOT / "CHANGELOG.md").read_text()
  assert re.search(rf"^## \[{re.escape(jaxquant.__version__)}\] - \d{{4}}-\d\d-\d\d$",
                   changelog, re.MULTILINE)


def test_readme_documents_the_fast_and_full_test_commands():
  readme = (ROOT / "README.md").read_text()
  section = readme[readme.index("## Running the tests"):]
  assert 'pytest -m "not slow"' in section and "HYPOTHESIS_PROFILE=thorough" in section
  markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
      "ini_options"]["markers"]
  assert any(marker.startswith("slow:") for marker in markers)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  source = tmp_path_factory.mktemp("source")
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, source)
  for package in ("jaxquant", "pallas_kernels"):
    shutil.copytree(ROOT / package, source / package,
                    ignore=shutil.ignore_patterns("__pycache__"))
  out = tmp_path_factory.mktemp("wheel")
  _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
       "-w", str(out), str(source))
  (wheel,) = out.glob("jaxquant-*.whl")
  return wheel


@pytest.mark.slow
def test_wheel_ships_py_typed_and_the_license(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  assert "jaxquant/py.typed" in names
  assert f"jaxquant-{jaxquant.__version__}.dist-info/licenses/LICENSE" in names
  assert wheel.name.startswith(f"jaxquant-{jaxquant.__version__}-")


@pytest.mark.slow
def test_mypy_accepts_a_user_script_against_the_installed_wheel(wheel, tmp_path):
  site = tmp_path / "site"
  _run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
       str(wheel))
  script = tmp_path / "user.py"
  script.write_text(USER_SCRIPT)
  # jaxquant is analysed, jax and NumPy are not (a quarter of the CPU time).
  config = tmp_path / "mypy.ini"
  config.write_text("[mypy]\n[mypy-jax.*,jaxlib.*,numpy.*,ml_dtypes.*]\nfollow_imports = skip\n")

  def mypy():
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental",
         "--cache-dir", os.devnull, str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
    )

  result = mypy()
  assert result.returncode == 0, result.stdout + result.stderr
  # Without the marker mypy refuses the package: what the test would catch.
  (site / "jaxquant" / "py.typed").unlink()
  result = mypy()
  assert "missing library stubs or py.typed marker" in result.stdout, result.stdout


@pytest.mark.slow
def test_docs_build_without_warnings_and_document_every_public_name(tmp_path):
  _run(sys.executable, "-m", "sphinx", "-W", "-E", "-q", "-b", "html",
       "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html"))
  api = (tmp_path / "html" / "api.html").read_text()
  documented = set(re.findall(r'id="jaxquant\.(\w+)"', api))
  assert set(jaxquant.__all__) <= documented, set(jaxquant.__all__) - documented
  assert (tmp_path / "html" / "numerics.html").exists()
