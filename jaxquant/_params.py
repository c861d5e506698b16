"""Quantized parameters as pytree leaves, and whole parameter trees quantized by rules."""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
import math
import re
from typing import Any

import jax
from jax.typing import DTypeLike
import jax.numpy as jnp
import numpy as np

from jaxquant import _checked
from jaxquant import _dtypes
from jaxquant import _fake
from jaxquant import _linear
from jaxquant import _packing
from jaxquant import _recipes
from jaxquant import _validate


def _whole(stored: Any, key: Any) -> Any:
  """``x[...]``, which is ``x``: how Flax NNX layers read a parameter (``self.kernel[...]``),
  so that a stored kernel can sit in a layer. Other keys would cut blocks and packed
  bytes: index ``x.dequantize()`` instead."""
  _validate.check(key is Ellipsis, "key", "... (index x.dequantize() for anything else)",
                  repr(key), error=TypeError)
  return stored


def _not_an_array(stored: Any) -> None:
  """What NumPy and ``jnp.asarray`` raise for a stored array, instead of ``int()``'s error:
  a Flax layer whose dtype promotion ``replace_ops`` has not wrapped hands it to them."""
  raise TypeError(
      f"A {type(stored).__name__} is not an array: its float value is .dequantize(). "
      "A Flax NNX layer passes it to a jaxquant drop-in once jq.replace_ops(model, ...) "
      "has set the drop-in; a layer replace_ops does not reach (it has no dot_general, "
      "conv_general_dilated or einsum_op: nnx.Embed, nnx.ConvTranspose) needs its "
      "parameter float: keep it out of the rule's pattern, or dequantize_params "
      "(docs/models.md, 'Serving').")


def _per_layer(function: Any, stack: int) -> Any:
  """``function`` of one layer, mapped over ``stack`` leading dims of its arguments."""
  for _ in range(stack):
    function = jax.vmap(function)
  return function


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scale", "zero_point"],
    meta_fields=["dtype", "shape", "axis", "block_size", "packed", "output_dtype",
                 "transposed"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A quantized tensor: integer (or float8/float6/float4) values with their parameters.

  A pytree whose children are the arrays (``values``, ``scale``,
  ``zero_point``) and whose static layout is aux data, so ``jax.jit`` compiles
  once per layout, ``jax.vmap`` and sharding act on the arrays, and a
  checkpoint stores the arrays. ``scale`` is float and differentiable;
  ``values`` carry no gradient. ``x[...]`` is ``x``, so a Flax NNX layer
  holds one as its kernel (:func:`replace_ops`).

  Attributes:
    values: the quantized values in ``dtype``; with ``packed``, ONNX's packed
      uint8 bytes (:func:`pack`: in its row layout for a matrix whose rows fill
      whole bytes, or that is split after its first dim); for float6
      unpacked, uint8 codes.
    scale: float32 scale: ``()``, ``(shape[axis],)`` or blocked (``shape``'s rank).
    zero_point: in ``dtype`` shaped like ``scale``, or ``None`` (symmetric).
    dtype: the quantized dtype (static).
    shape: the logical shape (static): of one layer, for a stack of layers
      (``QuantizationRule.stacked_dims``), whose arrays carry leading stack dims
      that ``nnx.scan`` and ``jax.vmap`` slice off.
    axis: the quantization axis, non-negative, or ``None`` per tensor (static).
    block_size: block length along ``axis``, 0 if not blocked (static).
    packed: whether ``values`` holds packed bytes (static).
    output_dtype: the float dtype :meth:`dequantize` returns (static).
    transposed: whether ``values`` hold the tensor with its last two dims
      swapped (static): a ``(K, N)`` kernel stored as ``(N, K)``, so that an
      integer dot contracting K reads it along its minor dim
      (``QuantizationRule.transposed``); ``shape``, ``axis``, the scale and
      :meth:`dequantize` stay the tensor's.
  """

  values: jax.Array
  scale: jax.Array
  zero_point: jax.Array | None
  dtype: np.dtype
  shape: tuple[int, ...]
  axis: int | None
  block_size: int
  packed: bool
  output_dtype: np.dtype
  transposed: bool = False

  def dequantize(self) -> jax.Array:
    """The float tensor, :func:`dequantize_linear` of the values (bit for bit); a stack's
    layers each so, stacked."""
    sub_byte = self.packed or _dtypes.quantized_dtype("dtype", self.dtype).as_codes
    dequantize = functools.partial(
        _linear.dequantize_linear, axis=self.stored_axis, block_size=self.block_size,
        output_dtype=self.output_dtype, packed_shape=self.shape if self.packed else None,
        packed_dtype=self.dtype if sub_byte else None,
    )
    values = _per_layer(dequantize, stacked_dims(self))(self.values, self.scale, self.zero_point)
    return jnp.swapaxes(values, -1, -2) if self.transposed else values

  def stored_dim(self, dim: int) -> int:
    """Where one layer's dim ``dim`` (non-negative) lies in its stored ``values``."""
    last = len(self.shape) - 1
    if not self.transposed or dim < last - 1:
      return dim
    return 2 * last - 1 - dim

  @property
  def stored_shape(self) -> tuple[int, ...]:
    """One layer's ``values`` shape, unpacked: ``shape``, its last two dims swapped if
    ``transposed``."""
    shape = tuple(self.shape)
    return shape[:-2] + shape[:-3:-1] if self.transposed else shape

  @property
  def stored_axis(self) -> int | None:
    """``axis`` counted in :attr:`stored_shape`."""
    return None if self.axis is None else self.stored_dim(self.axis % len(self.shape))

  @property
  def nbytes(self) -> int:
    """Bytes held: values, scale and zero point (sub-byte values unpacked count whole bytes)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(self))

  def __getitem__(self, key: Any) -> QuantizedArray:
    return _whole(self, key)

  def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
    _not_an_array(self)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["value", "scale"],
    meta_fields=["dtype", "axis", "block_size", "packed", "grad_factor", "output_dtype",
                 "layer_ndim", "transposed"],
)
@dataclasses.dataclass(frozen=True)
class FakeQuantizedArray:
  """A float weight trained through fake quantization with a learned scale (LSQ).

  Both children are float and trainable: ``jax.grad`` of a loss through
  :meth:`dequantize` gives the weight's straight-through gradient and the
  scale's LSQ gradient. :func:`quantize_params` turns it into the
  :class:`QuantizedArray` whose :meth:`QuantizedArray.dequantize` equals this
  :meth:`dequantize` bit for bit. ``x[...]`` is ``x``, so a Flax NNX layer
  holds one as its kernel (:func:`replace_ops`).

  Attributes:
    value: the float weight.
    scale: the learned float scale (symmetric quantization, zero point 0).
    dtype: the integer quantized dtype (static).
    axis: the quantization axis, or ``None`` per tensor (static).
    block_size: block length along ``axis``, 0 if not blocked (static).
    packed: whether the deployed values are packed (static).
    grad_factor: LSQ's scale gradient factor (static).
    output_dtype: the float dtype :meth:`dequantize` returns, ``None`` for the
      weight's (static). The weight is fake-quantized in its own dtype first, as
      :meth:`QuantizedArray.dequantize` of the deployed weight computes.
    layer_ndim: the rank of one layer's weight, below any leading stack dims
      (``QuantizationRule.stacked_dims``); ``None``: the value's rank (static).
    transposed: whether :func:`quantize_params` deploys it with its values
      stored transposed (``QuantizationRule.transposed``; static).
  """

  value: jax.Array
  scale: jax.Array
  dtype: np.dtype
  axis: int | None
  block_size: int
  packed: bool
  grad_factor: float
  output_dtype: np.dtype | None = None
  layer_ndim: int | None = None
  transposed: bool = False

  def dequantize(self) -> jax.Array:
    """The fake-quantized weight, :func:`fake_quantize_learnable` in the weight's dtype
    (each layer's, for a stack), then cast to ``output_dtype``."""
    fake_quantize = functools.partial(
        _fake.fake_quantize_learnable, dtype=self.dtype, axis=self.axis,
        block_size=self.block_size, grad_factor=self.grad_factor,
    )
    weight = _per_layer(fake_quantize, stacked_dims(self))(self.value, self.scale)
    return weight if self.output_dtype is None else weight.astype(self.output_dtype)

  @property
  def shape(self) -> tuple[int, ...]:
    """One layer's weight shape (the weight's, unless it is a stack)."""
    return tuple(np.shape(self.value)[stacked_dims(self):])

  def __getitem__(self, key: Any) -> FakeQuantizedArray:
    return _whole(self, key)

  def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
    _not_an_array(self)


_CONTAINERS = (QuantizedArray, FakeQuantizedArray)


def stacked_dims(x: QuantizedArray | FakeQuantizedArray, argument: str = "x") -> int:
  """How many leading stack dims x's arrays have beyond its static layout.

  Raises:
    ValueError: if the arrays do not hold ``shape`` (their leading dims sliced
      off, as ``nnx.scan`` does to a stack quantized as one tensor), or the
      scale and zero point lack the values' stack dims.
  """
  if isinstance(x, FakeQuantizedArray):
    stack = np.ndim(x.value) - (np.ndim(x.value) if x.layer_ndim is None else x.layer_ndim)
    _validate.check(
        stack >= 0 and np.ndim(x.scale) >= stack
        and np.shape(x.scale)[:stack] == np.shape(x.value)[:stack],
        f"{argument}.value.shape", f"a layer of rank {x.layer_ndim} after any leading stack "
        "dims that the scale shares (sliced by nnx.scan or nnx.vmap? quantize a stack with "
        "QuantizationRule(stacked_dims=...))", np.shape(x.value))
    return stack
  shape, values = tuple(x.shape), tuple(np.shape(x.values))
  if x.transposed:
    _check_transposable(f"{argument}.transposed", shape, x.block_size, x.packed)
  layouts = _packing.packed_layouts(shape, x.dtype) if x.packed else (x.stored_shape,)
  stacked = [len(values) - len(layout) for layout in layouts
             if len(values) >= len(layout) and values[len(values) - len(layout):] == layout]
  if not x.packed and len(values) == len(shape):
    # Inside jax.shard_map unpacked values are a shard of shape, read as they are.
    stacked = [0]
  # The fewest stack dims where two layouts fit (a one-row matrix, flat or in rows).
  stack = values[:min(stacked)] if stacked else None
  _validate.check(
      stack is not None and all(np.shape(y)[:len(stack)] == stack
                                for y in (x.scale, x.zero_point) if y is not None),
      f"{argument}.values.shape",
      f"{shape}'s values{' packed' if x.packed else ''}, after any leading stack dims "
      "that scale and zero point share (arrays sliced along a dim of the layout, as "
      "nnx.scan or nnx.vmap slice a stack of layers quantized as one tensor? quantize "
      "it with QuantizationRule(stacked_dims=...), each layer on its own)",
      f"{values} (scale {np.shape(x.scale)})",
  )
  return len(stack)


def element(x: Any, argument: str) -> Any:
  """x, checked to be one layer's :class:`QuantizedArray`, not a stack; other x as given."""
  if isinstance(x, QuantizedArray):
    stack = stacked_dims(x, argument)
    _validate.check(
        stack == 0, argument,
        "one layer's QuantizedArray (a stack of layers is sliced by nnx.scan or "
        "nnx.vmap; .dequantize() gives the whole float stack)",
        f"a stack of {np.shape(x.values)[:stack]} QuantizedArrays of shape {x.shape}",
    )
  return x


def _is_container(leaf: Any) -> bool:
  return isinstance(leaf, _CONTAINERS)


@dataclasses.dataclass(frozen=True)
class QuantizationRule:
  """Which parameters :func:`quantize_params` quantizes, and how.

  A parameter matches when ``re.search(pattern, path)`` finds its path (keys
  joined by ``/``, e.g. ``"layers/0/kernel/value"``), it is a float array and
  has at least ``min_ndim`` dimensions. The first matching rule decides.

  Attributes:
    pattern: a regular expression searched in the path.
    dtype: the quantized dtype; ``None`` keeps matching parameters float.
    axis: the quantization axis (negative counts from the end): one scale per
      index of it, or per block with ``block_size``; ``None`` per tensor. The
      default -1 is one scale per output feature of a Flax kernel; with
      ``block_size``, -2 blocks along a Dense or Conv kernel's inputs.
    block_size: block length along ``axis``, 0 if not blocked.
    method: the :func:`choose_qparams` recipe; ``"minmax"`` keeps a zero point.
    min_ndim: parameters of lower rank (biases, norms) are left float.
    packed: store sub-byte dtypes packed (ONNX's layout), else one per byte.
    stacked_dims: leading dims that index a stack of layers (Flax NNX layers
      made by ``nnx.vmap`` and run by ``nnx.scan``): each layer is quantized on
      its own, as if alone (``axis`` and ``min_ndim`` count its dims), and the
      stored arrays keep the stack dims for ``nnx.scan`` to slice.
    transposed: store each matched parameter's values with their last two
      dims swapped (:attr:`QuantizedArray.transposed`): a Dense kernel
      ``(K, N)`` as ``(N, K)``, the contracted dim minor, which XLA:CPU's int8
      dot reads without repacking the weight at every call
      (``dot_general_dynamic_int8``, ``dot_general_static_int8``;
      docs/models.md, "Serving"). Not blocked, unpacked. Drop-ins that read
      :meth:`QuantizedArray.dequantize` (weight-only, fake-quant) get the
      same bits, the float weight swapped back, which can cost more than
      their dot.
  """

  pattern: str = ".*"
  dtype: DTypeLike | None = jnp.int8
  axis: int | None = -1
  block_size: int = 0
  method: _recipes.Method = "absmax"
  min_ndim: int = 2
  packed: bool = True
  stacked_dims: int = 0
  transposed: bool = False


def _check_rule(rule: QuantizationRule) -> None:
  """What a rule states before any parameter is matched (the rest is checked per parameter)."""
  try:
    re.compile(rule.pattern)
  except (re.error, TypeError) as error:
    _validate.fail("rule.pattern", "a regular expression", f"{rule.pattern!r} ({error})",
                   error=TypeError if isinstance(error, TypeError) else ValueError)
  for name in ("min_ndim", "stacked_dims"):
    value = _validate.static_int(f"rule.{name}", getattr(rule, name))
    _validate.check(value >= 0, f"rule.{name}", "a non-negative int", value)
  _recipes.METHOD("rule.method", rule.method)
  _validate.static_bool("rule.transposed", rule.transposed)


def path_name(path: Sequence[Any]) -> str:
  """A pytree path as ``/``-joined keys: ``"layers/0/kernel/value"``."""
  names = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        names.append(str(getattr(key, attribute)))
        break
    else:
      names.append(str(key))
  return "/".join(names)


def _rule_for(rules, name: str, leaf: Any) -> QuantizationRule | None:
  if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)):
    return None
  for rule in rules:
    if re.search(rule.pattern, name) and np.ndim(leaf) - rule.stacked_dims >= rule.min_ndim:
      return rule if rule.dtype is not None else None
  return None


def _layout(leaf: Any, rule: QuantizationRule) -> tuple[int | None, bool]:
  axis = rule.axis
  if axis is not None:
    axis = _validate.normalize_axis(axis, np.ndim(leaf))
  info = _dtypes.quantized_dtype("rule.dtype", rule.dtype)
  if rule.block_size and axis is not None:
    shards = _shards_along(leaf, axis)
    blocks = -(-leaf.shape[axis] // rule.block_size)
    # JAX shards the per-block scale along the same mesh axes, so the block
    # count must split evenly over them (else a ShardingTypeError deep inside).
    _validate.check(
        blocks % shards == 0, "rule.block_size",
        f"one giving a multiple of the {shards} shards along axis {axis} "
        f"({leaf.shape[axis]} elements give {blocks} blocks)", rule.block_size,
    )
  return axis, rule.packed and info.bits < 8


def _sharding(x: Any):
  """x's sharding: its explicit (typed) one when traced, its placement when concrete."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return x.sharding
  return jax.typeof(x).sharding


def _shards_along(x: Any, axis: int) -> int:
  """How many ways explicit mesh axes split x along ``axis`` (Auto axes are XLA's to place)."""
  sharding = _sharding(x)
  spec = tuple(getattr(sharding, "spec", ()))
  names = spec[axis] if axis < len(spec) else None
  if names is None:
    return 1
  names = names if isinstance(names, tuple) else (names,)
  explicit = getattr(sharding.mesh, "explicit_axes", ())
  return int(np.prod([sharding.mesh.shape[name] for name in names if name in explicit]))


def _quantize(leaf: jax.Array, rule: QuantizationRule) -> QuantizedArray:
  axis, packed = _layout(leaf, rule)
  scale, zero_point = _recipes.choose_qparams(
      leaf, rule.dtype, axis=axis, block_size=rule.block_size, method=rule.method
  )
  if rule.method != "minmax":
    zero_point = None
  with _checked.unchecked():  # the scale is the recipe's, not the caller's
    quantized = _from_scale(leaf, scale, zero_point, rule.dtype, axis, rule.block_size, packed)
  return _transposed(quantized) if rule.transposed else quantized


def _check_transposable(argument: str, shape: tuple[int, ...], block_size: int,
                        packed: bool) -> None:
  """Values stored transposed swap a layer's last two dims, unpacked and unblocked."""
  _validate.check(
      len(shape) >= 2 and not packed and not block_size, argument,
      "False unless the layer has two dims or more (after any stack dims) and is neither "
      "blocked nor packed (packed=False, or 8 bits or more)",
      f"True for shape {shape}, block_size={block_size}, packed={packed}",
  )


def _transposed(quantized: QuantizedArray) -> QuantizedArray:
  """One layer's :class:`QuantizedArray` with its values' last two dims swapped."""
  _check_transposable("rule.transposed", quantized.shape, quantized.block_size,
                      quantized.packed)
  return dataclasses.replace(
      quantized, values=jnp.swapaxes(quantized.values, -1, -2), transposed=True)


def _splits_minor_dim(x: jax.Array) -> bool:
  """Whether x is sharded along a dim after its first."""
  return any(tuple(getattr(_sharding(x), "spec", ()))[1:])


def _from_scale(value, scale, zero_point, dtype, axis, block_size, packed) -> QuantizedArray:
  info = _dtypes.quantized_dtype("dtype", dtype)
  values = _linear.quantize_linear(
      value, scale, zero_point, output_dtype=info.dtype, axis=axis, block_size=block_size
  )
  if packed:
    # ONNX's flat layout runs across rows, so it cannot keep a split of a minor
    # dim; packing each row keeps every dim's sharding. Where a row fills whole
    # bytes, the rows are the flat bytes reshaped, and they are taken whatever the
    # sharding: under jit on an automatic mesh a tracer carries none, and the flat
    # bytes of a weight split along its columns were gathered whole.
    columns = value.shape[-1] if value.ndim > 1 else None
    whole_bytes = isinstance(columns, int) and columns * info.bits % 8 == 0
    layout = "rows" if whole_bytes or _splits_minor_dim(value) else "flat"
    values = _packing.pack(values, dtype=info.dtype if info.as_codes else None, layout=layout)
  # dequantize_linear returns float32 at the widest: a float64 weight (NumPy's,
  # which JAX reads as float32, or any under x64) dequantizes to float32.
  output_dtype = np.dtype(value.dtype)
  if output_dtype not in _dtypes.OUTPUT_FLOAT_DTYPES:
    output_dtype = np.dtype(np.float32)
  return QuantizedArray(
      values, scale, zero_point, info.dtype, tuple(value.shape), axis, block_size, packed,
      output_dtype,
  )


def _learnable(leaf: jax.Array, rule: QuantizationRule) -> FakeQuantizedArray:
  axis, packed = _layout(leaf, rule)
  info = _dtypes.quantized_dtype("rule.dtype", rule.dtype, integer=True)
  scale, _ = _recipes.choose_qparams(
      leaf, info.dtype, axis=axis, block_size=rule.block_size, method=rule.method
  )
  _validate.check(
      rule.method != "minmax", "rule.method",
      "a symmetric recipe with learnable=True (the learned scale has zero point 0)",
      repr(rule.method),
  )
  # The LSQ gradient factor is static: under jax.export a symbolic dim must be one
  # the scale keeps (per index of it, or in blocks along it), not one it covers.
  per_scale = math.prod(leaf.shape) // (scale.size or 1)
  _validate.check(
      isinstance(per_scale, int), "rule.axis",
      "one keeping every symbolic dim with learnable=True (the gradient factor "
      "1/sqrt(elements per scale * qmax) is static)", f"{per_scale} elements per scale",
  )
  if rule.transposed:
    _check_transposable("rule.transposed", leaf.shape, rule.block_size, packed)
  return FakeQuantizedArray(
      leaf, scale, info.dtype, axis, rule.block_size, packed,
      _fake.lsq_grad_factor(max(1, per_scale), dtype=info.dtype), layer_ndim=leaf.ndim,
      transposed=rule.transposed,
  )


def _freeze(leaf: FakeQuantizedArray) -> QuantizedArray:
  def freeze(value, scale):
    quantized = _from_scale(
        value, scale, None, leaf.dtype, leaf.axis, leaf.block_size, leaf.packed)
    return _transposed(quantized) if leaf.transposed else quantized

  return _per_layer(freeze, stacked_dims(leaf))(leaf.value, leaf.scale)


@_validate.reports_as("quantize_params")
def quantize_params(
    params: Any,
    rules: QuantizationRule | Sequence[QuantizationRule] = (),
    *,
    learnable: bool = False,
) -> Any:
  """Quantizes the parameters of a pytree that match ``rules``.

  Every float array leaf that a rule matches (see :class:`QuantizationRule`)
  becomes a :class:`QuantizedArray`: its scale from :func:`choose_qparams`
  with the rule's recipe, its values from :func:`quantize_linear`, packed
  with :func:`pack` for sub-byte dtypes. With ``learnable=True`` it becomes
  a :class:`FakeQuantizedArray` instead, its scale initialised by the same
  recipe, for quantization-aware training. A :class:`FakeQuantizedArray`
  already in ``params`` becomes the :class:`QuantizedArray` of its learned
  scale, whose dequantized value equals the fake-quantized one bit for bit:
  one call deploys a QAT model. Other leaves, and leaves already quantized,
  are returned unchanged. Works on any pytree: dicts, Flax NNX ``State``,
  linen variables, optax-style tuples.

  Args:
    params: a pytree of parameters.
    rules: a :class:`QuantizationRule` or a sequence of them (first match wins).
    learnable: make matched parameters :class:`FakeQuantizedArray`.

  Returns:
    ``params`` with matched leaves replaced.

  Raises:
    TypeError: for a rule's dtype that is not a quantized dtype (or, with
      ``learnable``, not an integer one).
    ValueError: for a rule's axis or block size that does not fit a matched
      parameter, or ``learnable`` with ``method="minmax"``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> params = {"kernel": jnp.array([[0.5, -1.0], [0.25, 2.0]]), "bias": jnp.ones(2)}
    >>> quantized = jq.quantize_params(params, jq.QuantizationRule(dtype=jnp.int4))
    >>> quantized["kernel"].values.dtype, quantized["kernel"].scale  # per output column
    (dtype('uint8'), Array([0.07142857, 0.2857143 ], dtype=float32))
    >>> jq.dequantize_params(quantized)["kernel"]
    Array([[ 0.5       , -0.8571429 ],
           [ 0.21428573,  2.        ]], dtype=float32)
  """
  if isinstance(rules, QuantizationRule):
    rules = (rules,)
  rules = tuple(rules)
  for rule in rules:
    _validate.check(
        isinstance(rule, QuantizationRule), "rules",
        "a QuantizationRule or a sequence of them", repr(rule), error=TypeError,
    )
    _check_rule(rule)
  learnable = _validate.static_bool("learnable", learnable)

  def quantize(path, leaf):
    if isinstance(leaf, FakeQuantizedArray):
      return _freeze(leaf)
    if isinstance(leaf, QuantizedArray):
      return leaf
    rule = _rule_for(rules, path_name(path), leaf)
    if rule is None:
      return leaf
    layer = functools.partial(_learnable if learnable else _quantize, rule=rule)
    return _per_layer(layer, rule.stacked_dims)(leaf)

  return jax.tree_util.tree_map_with_path(quantize, params, is_leaf=_is_container)


@_validate.reports_as("dequantize_params")
def dequantize_params(params: Any) -> Any:
  """Replaces every :class:`QuantizedArray` and :class:`FakeQuantizedArray` by its float value.

  Call it inside the jitted forward pass, so the parameters stay quantized in
  memory and XLA fuses the dequantization into their use. The gradient
  reaches the float children (scales; a fake-quantized weight and its scale).

  Args:
    params: a pytree, with quantized leaves or not.

  Returns:
    ``params`` with each quantized leaf replaced by its ``dequantize()``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> params = jq.quantize_params({"w": jnp.array([[1.0, -0.5]])}, jq.QuantizationRule(axis=None))
    >>> jq.dequantize_params(params)["w"]
    Array([[ 1.       , -0.503937]], dtype=float32)
  """
  return jax.tree.map(
      lambda leaf: leaf.dequantize() if _is_container(leaf) else leaf, params,
      is_leaf=_is_container,
  )
