"""The fast loop, ``pytest -m "not slow"``, still calls every public function.

``tests/conftest.py`` marks the repeated cases of parametrized tests ``slow``;
this checks, on the session's own collection, that what is left names each
public function in the code of some test or doctest example, so a mark that
takes an op out of the loop fails here rather than going unnoticed.
"""

import inspect
import io
import textwrap
import tokenize

import pytest

import jaxquant as jq

# The classes are what the functions return; test_api.py checks their API.
PUBLIC_FUNCTIONS = [name for name in jq.__all__ if not isinstance(getattr(jq, name), type)]


def _code_names(item: pytest.Item) -> set[str]:
  """The identifiers in the item's code: a doctest's examples or a test function's body."""
  dtest = getattr(item, "dtest", None)
  if dtest is not None:
    source = "".join(example.source for example in dtest.examples)
  else:
    source = textwrap.dedent(inspect.getsource(item.function))
  tokens = tokenize.generate_tokens(io.StringIO(source).readline)
  # Strings and comments are not calls: a name in a message or a comment does not count.
  return {token.string for token in tokens if token.type == tokenize.NAME}


def test_fast_loop_calls_every_public_function(request):
  config = request.config
  if (config.args_source is not pytest.Config.ArgsSource.TESTPATHS or config.option.keyword
      or config.option.markexpr not in ("", "not slow")):
    pytest.skip(reason='needs the whole suite collected: `pytest -m "not slow"` or `pytest`')
  fast = [item for item in request.session.items if not item.get_closest_marker("slow")]
  named = set().union(*map(_code_names, fast))
  missing = [name for name in PUBLIC_FUNCTIONS if name not in named]
  assert not missing, f"no test in the fast loop calls {missing}"
