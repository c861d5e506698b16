"""Sphinx configuration: the API reference is generated from the docstrings.

``sphinx-build -W -b html docs <out>`` builds it (tests/test_package.py does,
with warnings as errors, so the docs cannot drift from the code).
"""

import inspect
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jaxquant  # pylint: disable=wrong-import-position

project = "jaxquant"
copyright = "the jaxquant authors"  # pylint: disable=redefined-builtin
release = jaxquant.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath"]
# numerics.md and comparison.md link to the repository's tests and sources,
# which are no documents here; on GitHub those links work.
suppress_warnings = ["myst.xref_missing"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
html_theme = "alabaster"


def _api_reference(app, docname, source):
  """Appends one ``autofunction`` (``autoclass``) per name in ``jaxquant.__all__`` to api.rst.

  The page lists the public API as the package exports it, so a new op is
  documented as soon as it is exported.
  """
  del app
  if docname == "api":
    source[0] += "".join(
        f"\n.. {_directive(getattr(jaxquant, name))}:: jaxquant.{name}\n"
        for name in jaxquant.__all__
    )


def _directive(value):
  return "autoclass" if inspect.isclass(value) else "autofunction"


def setup(app):
  app.connect("source-read", _api_reference)
