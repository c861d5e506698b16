"""The public API explains itself: real signatures, Python's keyword errors, one compile per dtype."""

import dataclasses
import re
import inspect
import pydoc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _linear
from quant_testing import assert_same_under_x64
from quant_testing import assert_vmap_is_a_loop
from quant_testing import elementwise_calls
from quant_testing import model_calls

PUBLIC = [getattr(jq, name) for name in jq.__all__]
# The quantized-parameter containers, rules and observer states are data, not ops.
CLASSES = [value for value in PUBLIC if inspect.isclass(value)]


@pytest.mark.parametrize("function", [f for f in PUBLIC if f not in CLASSES],
                         ids=lambda f: f.__name__)
def test_public_names_are_plain_functions_with_their_signature(function):
  assert inspect.isfunction(function), type(function)
  parameters = inspect.signature(function).parameters
  assert parameters and "args" not in parameters and "kwargs" not in parameters
  text = pydoc.render_doc(function, renderer=pydoc.plaintext)
  assert f"{function.__name__}(" in text and "PjitFunction" not in text


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_public_classes_are_documented_frozen_dataclasses(cls):
  assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
  assert "Attributes:" in cls.__doc__


@pytest.mark.parametrize("call, keyword, suggestion", [
    (lambda: jq.quantize_linear(jnp.ones(2), 1.0, dtype=jnp.int8), "dtype", "output_dtype"),
    (lambda: jq.dequantize_linear(jnp.ones(2, jnp.int8), 1.0, axes=0), "axes", "axis"),
    (lambda: jq.dynamic_quantize_linear(jnp.ones(2), output_dtype=jnp.int8), "output_dtype",
     "dtype"),
    (lambda: jq.fake_quantize(jnp.ones(2), 1.0, implementation="xla"), "implementation", None),
    (lambda: jq.quantized_add(jnp.ones(2, jnp.int8), 1.0, None, jnp.ones(2, jnp.int8), 1.0,
                              None, 1.0, blocksize=2), "blocksize", None),
])
def test_unknown_keyword_is_pythons_type_error(call, keyword, suggestion):
  with pytest.raises(TypeError) as info:
    call()
  message = str(info.value)
  assert f"got an unexpected keyword argument '{keyword}'" in message, message
  if suggestion:
    assert message.endswith(f"did you mean '{suggestion}'?"), message
  assert "Error interpreting argument" not in message


def test_dtype_spellings_share_one_compilation():
  x = jnp.ones(4)
  before = _linear._quantize_linear._cache_size()  # pylint: disable=protected-access
  results = [jq.quantize_linear(x, 1.0, output_dtype=spelling)
             for spelling in (jnp.int8, np.int8, "int8", np.dtype("int8"))]
  assert _linear._quantize_linear._cache_size() == before + 1  # pylint: disable=protected-access
  assert all(r.dtype == jnp.int8 for r in results)
  before = jq.dynamic_quantize_linear._cache_size()
  for spelling in (jnp.int4, "int4", np.dtype(jnp.int4)):
    assert jq.dynamic_quantize_linear(x, dtype=spelling)[0].dtype == jnp.int4
  assert jq.dynamic_quantize_linear._cache_size() == before + 1


def test_ops_still_run_under_an_outer_jit_and_vmap():
  f = jax.jit(jax.vmap(lambda x: jq.dequantize_linear(
      jq.quantize_linear(x, 0.5, output_dtype="int8"), 0.5)))
  np.testing.assert_array_equal(f(jnp.ones((3, 4))), np.ones((3, 4), np.float32))



@pytest.mark.parametrize("name", elementwise_calls())
def test_x64_gives_x32_dtypes_and_bits(name):
  """Float32 arguments and Python-number options under x64: nothing computes in float64.

  The matmul ops and drop-ins: test_matmul.py and test_dot_general.py."""
  assert_same_under_x64(*elementwise_calls()[name])


# The ops' own files map the others (test_linear.py, test_fake.py, test_dynamic.py, ...).
@pytest.mark.parametrize("name", [
    "unpack int4", "pack int2 rows", "choose_qparams mse blocked",
    "choose_qparams percentile per-row", "quantize_params and dequantize_params int4",
    "observer_qparams moving average", "observer_qparams percentile",
])
def test_vmap_is_a_loop(name):
  """A batch of weights quantized, packed or stored, or of activations observed, at once."""
  function, args = elementwise_calls(0)[name]
  assert_vmap_is_a_loop(function, [args, elementwise_calls(1)[name][1]], [0] * len(args))

def _error(call):
  with pytest.raises((TypeError, ValueError)) as info:
    call()
  return type(info.value), str(info.value)


@pytest.mark.parametrize("good, bad", [
    # Each pair compares equal (and hashes alike) but only the first is valid:
    # the remembered options of the good call must not answer for the bad one.
    (lambda: jq.dequantize_linear(jnp.ones(4, jnp.int8), 1.0, axis=0),
     lambda: jq.dequantize_linear(jnp.ones(4, jnp.int8), 1.0, axis=False)),
    (lambda: jq.dequantize_linear(jnp.ones(4, jnp.int8), 1.0, axis=0),
     lambda: jq.dequantize_linear(jnp.ones(4, jnp.int8), 1.0, axis=0.0)),
    (lambda: jq.quantize_linear(jnp.ones(4), 1.0, saturate=True),
     lambda: jq.quantize_linear(jnp.ones(4), 1.0, saturate=1)),
    (lambda: jq.unpack(jnp.zeros(1, jnp.uint8), (2,), jnp.int4),
     lambda: jq.unpack(jnp.zeros(1, jnp.uint8), (2.0,), jnp.int4)),
    (lambda: jq.fake_quantize_learnable(jnp.ones(4), jnp.float32(1.0), grad_factor=1.0),
     lambda: jq.fake_quantize_learnable(jnp.ones(4), jnp.float32(1.0), grad_factor=True)),
])
def test_a_bad_option_raises_on_every_call_after_an_equal_good_one(good, bad):
  good()
  first = _error(bad)
  good()
  assert _error(bad) == _error(bad) == first


def test_a_repeated_call_returns_the_first_calls_result_and_compiles_once():
  x = jnp.linspace(-3.0, 3.0, 24).reshape(4, 6)
  scale = jnp.full((4, 2), 0.25)
  def call():
    return jq.quantize_linear(x, scale, axis=1, block_size=3, output_dtype="int4",
                              precision=np.float32, packed=True)
  before = _linear._quantize_linear._cache_size()  # pylint: disable=protected-access
  first = call()
  for _ in range(3):
    np.testing.assert_array_equal(call(), first)
  assert _linear._quantize_linear._cache_size() == before + 1  # pylint: disable=protected-access
  # A static option given positionally, and as a list (unhashable: normalised every call).
  packed = jq.pack(jnp.arange(-3, 3, dtype=jnp.int4))
  for shape in ((6,), [6], (6,), [6]):
    np.testing.assert_array_equal(jq.unpack(packed, shape, jnp.int4),
                                  np.arange(-3, 3).astype(np.int8).astype(jnp.int4))


@pytest.mark.parametrize("name", [*model_calls(), *elementwise_calls()])
def test_an_eager_call_compiles_only_the_first_time(name):
  """Called outside jit (a notebook, a Flax model run op by op), a repeated call compiles
  nothing: the drop-ins' statistics, closures made anew each call, compiled every call
  (40-130 ms a call where one compiled call takes well under one)."""
  function, args = {**model_calls(), **elementwise_calls()}[name]
  jax.block_until_ready(function(*args))
  compiled = []
  listener = lambda event, duration, **kwargs: compiled.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    jax.block_until_ready(function(*args))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert "/jax/core/compile/backend_compile_duration" not in compiled


@pytest.mark.parametrize("call, message", [
    (lambda: jq.dequantize_linear(jnp.ones(2, jnp.int8), 1.0, scale=1.0),
     "multiple values for argument 'scale'"),
    (lambda: jq.dequantize_linear(jnp.ones(2, jnp.int8), axes=0),
     "dequantize_linear() "),
    (lambda: jq.dequantize_linear(jnp.ones(2, jnp.int8)), "missing a required argument"),
    (lambda: jq.dequantize_linear(jnp.ones(2, jnp.int8), 1.0, None, 1),
     "too many positional arguments"),
])
def test_a_malformed_call_raises_pythons_type_error_every_time(call, message):
  for _ in range(3):
    with pytest.raises(TypeError, match=re.escape(message)):
      call()
