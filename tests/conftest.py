"""Shared test configuration: the fast loop's selection and hypothesis profiles.

``pytest -m "not slow"`` is the edit-test loop, ``pytest`` the whole suite.
Besides the tests marked ``slow`` by hand, :func:`pytest_collection_modifyitems`
marks ``slow`` the cases of a parametrized test that add no new call mode
(``CALL_MODES``), and hypothesis properties: the loop keeps each test's first
case and one case per implementation, jit mode and lowering platform, and
leaves the sweeps over dtypes, shapes, layouts and seeds to the full run. In
the API and error tables (``CASE_TABLES``) every value of every parameter runs
once, so each error case is still raised in the loop.

``HYPOTHESIS_PROFILE`` picks the hypothesis profile (README, "Running the tests"):

* ``ci`` (default): 40 examples per property, derandomized, so every run
  draws the same examples and a failure reproduces as it is;
* ``dev``: 60 examples, drawn afresh each run, to find new failures while
  developing (hypothesis prints the seed blob to reproduce one);
* ``thorough``: 1000 fresh examples per property, for a long run before a
  release or after changing the numerics.
"""

import os
import tempfile

import hypothesis
import jax
import pytest

from quant_testing import xla_cpu

# Most of a test's time is XLA compiling programs the last run compiled too:
# JAX's persistent cache keeps them on disk (keyed by the program, the
# compiler and its options, so a changed op recompiles), and the next run
# loads them. JAX_COMPILATION_CACHE_DIR moves it; JAX_ENABLE_COMPILATION_CACHE=false
# turns it off. Each xdist worker has its own: JAX writes an entry without a lock
# (unless the cache has a size limit, when every write scans the whole cache), so a
# worker reading an entry another is writing got a truncated one (a warning, and a
# compile again: seen in two full runs).
if jax.config.jax_compilation_cache_dir is None:
  jax.config.update("jax_compilation_cache_dir", os.path.join(
      tempfile.gettempdir(), "jaxquant-tests-xla-cache",
      os.environ.get("PYTEST_XDIST_WORKER", "main")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# XLA:GPU multiplies float32 matrices in TF32 by default; the suite's references
# (NumPy, XLA:CPU) multiply in float32, as jaxquant's own dots at HIGHEST do.
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")

# Parameters that pick how an op is called rather than what it computes.
CALL_MODES = frozenset({"implementation", "mode", "under_jit", "style", "platform", "backend"})
# Files of one-line API and error cases, milliseconds each.
CASE_TABLES = frozenset({"test_api.py", "test_errors.py"})

# Each new shape compiles a fresh XLA program, so examples cost milliseconds,
# not microseconds; deadlines would only measure the compiler.
hypothesis.settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "dev", max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "thorough", max_examples=1000, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Files that keep one worker busy for minutes (a subprocess, trained models, notebooks,
# fuzzing): scheduled first, so that no worker is left running one alone at the end.
LONG_FILES = ("tests/test_sharding.py", "tests/test_notebooks.py", "tests/test_fuzz.py",
              "tests/test_flax_models.py")


# A run of fewer files is spread test by test, so that one file still keeps every worker busy.
FILES_TO_GROUP = 8


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark, and before xdist reads groups
def pytest_collection_modifyitems(items):
  """Marks ``slow`` the repeated cases (module docstring); one xdist worker per file.

  A file's tests call the same ops on the same shapes and dtypes: on one worker
  each program compiles once, spread over two workers each compiles it. Tests
  without an ``xdist_group`` of their own are grouped by file (``--dist
  loadgroup``) in a run of ``FILES_TO_GROUP`` files or more, and the groups run in
  collection order (``--no-loadscope-reorder``), ``LONG_FILES`` first.
  """
  _mark_repeated_cases_slow(items)
  if len({_file(item) for item in items}) < FILES_TO_GROUP:
    return
  for item in items:
    if item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(_file(item)))
  items.sort(key=lambda item: _file(item) not in LONG_FILES)  # stable: files stay whole


def _file(item: pytest.Item) -> str:
  return item.nodeid.split("::", 1)[0]


def _mark_repeated_cases_slow(items):
  """Marks ``slow`` the cases that repeat what an earlier case covered (module docstring)."""
  covered: dict[str, set[tuple[str, str]]] = {}
  for item in items:
    if item.get_closest_marker("slow"):
      continue
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
      item.add_marker(pytest.mark.slow)
      continue
    callspec = getattr(item, "callspec", None)
    if callspec is None:
      continue
    whole_table = item.path.name in CASE_TABLES
    values = {(name, repr(value)) for name, value in callspec.params.items()
              if whole_table or name in CALL_MODES}
    test = f"{item.parent.nodeid}::{item.originalname}"
    if test in covered and values <= covered[test]:
      item.add_marker(pytest.mark.slow)
    else:
      covered.setdefault(test, set()).update(values)


@pytest.fixture(autouse=True)
def _on_xla_cpu(request):
  """Runs a test marked ``xla_cpu`` on the host's CPU device (a no-op without an accelerator)."""
  if request.node.get_closest_marker("xla_cpu") is None:
    yield
    return
  with xla_cpu():
    yield
