"""A public op's call, bound before the ``jax.jit`` boundary.

Every public op is a plain Python function (``help()`` and
``inspect.signature`` show its real parameters) whose static options are
checked and canonicalised here, once, before any tracing:

* an unknown keyword is Python's ``TypeError``, naming the keyword and the
  closest real one (``dtype`` -> ``output_dtype``);
* a dtype option given as ``jnp.int8``, ``np.int8``, ``"int8"`` or
  ``np.dtype("int8")`` becomes one ``np.dtype``, so they share one compilation;
* an option of the wrong kind (``None`` for an int, a list, a dict) is a
  ``TypeError`` naming the option, not JAX's "Non-hashable static arguments";
* inside :func:`jaxquant.checked`, the values of scales, zero points and
  codes are checked (:mod:`jaxquant._checked`).

A call is dispatch-bound for small inputs, so the binding is kept cheap: the
normalised options are remembered per spelling (a repeated call's cost one
dict lookup), and the common call shapes are bound without
``inspect.Signature.bind``; ``python -m benchmarks --overhead`` measures it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import difflib
import functools
import inspect
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import _checked
from jaxquant import _dispatch
from jaxquant import _validate

Normalizer = Callable[[str, Any], Any]


def dtype(argument: str, value: Any) -> Any:
  """A dtype option as a ``np.dtype`` (``jnp.dtype`` reads ``"int4"`` as int4).

  ``None`` stays ``None``, and so does any other hashable non-dtype: the op's
  own check then names the dtypes it accepts.
  """
  if value is None:
    return None
  try:
    canonical = jnp.dtype(value)
  except (TypeError, ValueError):
    canonical = None
  # NumPy reads a list or a dict as a structured dtype: no dtype meant here.
  if canonical is not None and canonical.names is None:
    return canonical
  _validate.check(
      _hashable(value), argument,
      "a dtype", repr(value), error=TypeError,
  )
  return value


def _hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


integer = _validate.static_int
boolean = _validate.static_bool
# Shapes arrive as lists or ONNX ``TensorProto.dims`` too: made tuples here.
shape = _validate.static_shape


def optional_integer(argument: str, value: Any) -> int | None:
  return None if value is None else integer(argument, value)


def optional_shape(argument: str, value: Any) -> tuple[int, ...] | None:
  return None if value is None else shape(argument, value)


def finite_float(argument: str, value: Any) -> float:
  _validate.check(
      isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool),
      argument, "a Python float", repr(value), error=TypeError,
  )
  _validate.check(math.isfinite(value), argument, "finite", repr(value))
  return float(value)


def sharding(argument: str, value: Any) -> Any:
  """An ``out_sharding``, as ``lax.dot_general`` takes it: ``None``, a ``NamedSharding``
  or a ``PartitionSpec`` (of the context mesh)."""
  _validate.check(
      value is None or isinstance(value, (jax.sharding.NamedSharding, jax.sharding.PartitionSpec)),
      argument, "None, a NamedSharding or a PartitionSpec", repr(value), error=TypeError,
  )
  return value


def choice(*options: Any) -> Normalizer:
  """A normalizer accepting exactly ``options`` (compared by equality, so lists fail)."""
  expected = ", ".join(map(repr, options[:-1])) + f" or {options[-1]!r}"

  def normalize(argument: str, value: Any) -> Any:
    _validate.check(
        any(type(value) is type(option) and value == option for option in options),
        argument, expected, repr(value),
    )
    return value

  return normalize


IMPLEMENTATION = choice(*_dispatch.IMPLEMENTATIONS)


def _unexpected_keyword(name: str, error: TypeError, parameters: Sequence[str]) -> TypeError:
  message = str(error)
  keyword = message.rsplit("'", 2)[-2] if message.count("'") >= 2 else ""
  close = difflib.get_close_matches(keyword, parameters, n=1, cutoff=0.5)
  hint = f"; did you mean {close[0]!r}?" if close else ""
  return TypeError(f"{name}() {message}{hint}")


# Distinct option tuples one op remembers; beyond, options are normalised
# every call (as correct, slower).
_CACHE_SIZE = 256


def _getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
  """``arguments -> tuple of arguments[name] for names``, at C speed."""
  if len(names) == 1:
    get = operator.itemgetter(*names)
    return lambda arguments: (get(arguments),)
  return operator.itemgetter(*names) if names else lambda arguments: ()


def _types(value: Any) -> Any:
  return tuple(map(_types, value)) if type(value) is tuple else type(value)


def _key(values: tuple[Any, ...]) -> tuple[Any, Any]:
  """A cache key for static options that tells equal values of other types apart.

  ``True == 1 == 1.0`` and ``(True,) == (1,)``, but only some of them are a
  valid option. The types come first, so values of other types (a symbolic
  dim and an int) are never compared.
  """
  types = tuple(map(type, values))
  if tuple in types:
    types = _types(values)
  return types, values


def op(
    *,
    jit: bool = False,
    check: Callable[[str, dict[str, Any]], None] | None = None,
    **normalizers: Normalizer,
) -> Callable[[Callable], Callable]:
  """Binds a public op's arguments and canonicalises its static options.

  Args:
    jit: compile the decorated function with ``jax.jit``, its static
      arguments being the keys of ``normalizers``.
    check: ``check(arguments)`` sees every argument by name, after
      normalisation and before the jit boundary (host values, such as Python
      int zero points, are still themselves there), and may replace a host
      value with what the jit boundary must see (``_dtypes.host_zero_point``).
    **normalizers: per static option, ``normalize(argument, value)``
      returning the canonical value or raising ``_validate``'s error naming
      the argument.

  Every argument error leaving the op, from these steps or from the body's
  own validation, is named after the op (``_validate.reports_as``).

  Returns:
    A decorator returning a plain function with the decorated one's
    signature and docstring.
  """

  def decorate(function: Callable) -> Callable:
    name = function.__name__
    signature = inspect.signature(function)
    parameters = list(signature.parameters)
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
           for p in signature.parameters.values()):
      raise TypeError(f"{name}: a public op takes named parameters only")
    body = jax.jit(function, static_argnames=tuple(normalizers)) if jit else function
    names = signature.parameters.keys()
    positional = [p.name for p in signature.parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    # Defaults of static options are normalised once, here.
    defaults = {
        p.name: (normalizers[p.name](p.name, p.default) if p.name in normalizers
                 else p.default)
        for p in signature.parameters.values() if p.default is not inspect.Parameter.empty
    }
    static = tuple(normalizers)
    # A call with fewer positional arguments and no keywords gives no static
    # option: its defaults are normalised already.
    first_static = min([positional.index(n) for n in static if n in positional],
                       default=len(positional))
    steps = tuple(normalizers.items())
    options = _getter(static)
    # Static options as given -> as normalised: a repeated call's options
    # cost one lookup. Only options that normalised without error are kept,
    # so a bad one raises on every call.
    normalised: dict[Any, dict[str, Any]] = {}

    def bind(args, kwargs):
      # ``inspect.Signature.bind`` costs about as much as jit's own dispatch:
      # a call naming known parameters, each once, is bound by hand; any
      # other gets Signature.bind's error.
      arguments = dict(zip(positional, args))
      if kwargs:
        arguments.update(kwargs)
      if len(arguments) == len(args) + len(kwargs) and (not kwargs or kwargs.keys() <= names):
        if len(arguments) < len(names):
          arguments = {**defaults, **arguments}
        if len(arguments) == len(names):
          return arguments
      try:
        bound_arguments = signature.bind(*args, **kwargs)
      except TypeError as error:
        raise _unexpected_keyword(name, error, parameters) from None
      bound_arguments.apply_defaults()
      return bound_arguments.arguments

    def normalise(values):
      key = _key(values)
      try:
        return normalised[key]
      except KeyError:
        pass
      except TypeError:  # an unhashable option (a list shape): normalised every call
        key = None
      result = {argument: normalize(argument, value)
                for (argument, normalize), value in zip(steps, values)}
      if key is not None and len(normalised) < _CACHE_SIZE:
        normalised[key] = result
      return result

    def arguments_of(args, kwargs):
      arguments = bind(args, kwargs)
      if static and (kwargs or len(args) > first_static):
        arguments.update(normalise(options(arguments)))
      if check is not None:
        check(arguments)
      if _checked.enabled():
        _checked.check(name, arguments)
      return arguments

    @functools.wraps(function)
    def bound(*args, **kwargs):
      try:
        return body(**arguments_of(args, kwargs))
      except _validate.ERRORS as error:
        _validate.named(error, name)
        raise

    # What a call passes on, and to what: benchmarks/run.py --overhead times
    # the op without its binding.
    bound._arguments = lambda *args, **kwargs: arguments_of(args, kwargs)  # pylint: disable=protected-access
    bound._body = body  # pylint: disable=protected-access
    if jit:
      # How many programs the op has compiled: the retracing tests read it.
      bound._cache_size = body._cache_size  # pylint: disable=protected-access
    return bound

  return decorate
