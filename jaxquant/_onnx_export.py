"""A quantized dense layer as an ONNX graph (onnx is an optional extra, imported on use)."""

from __future__ import annotations

from typing import Any, Literal

from jax.typing import ArrayLike
import numpy as np

from jaxquant import _dtypes
from jaxquant import _packing
from jaxquant import _params
from jaxquant import _validate


def _onnx():
  try:
    import onnx  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(
        "export_onnx needs the onnx package: pip install 'jaxquant[test]' or "
        "'jaxquant[notebooks]' (or pip install onnx)."
    ) from error
  return onnx


def _weight_tensor(onnx, name: str, weight: _params.QuantizedArray):
  """The quantized values as an initializer of their ONNX type (packed bytes are ONNX's layout)."""
  values = np.asarray(weight.values)
  if weight.transposed:
    values = np.ascontiguousarray(values.T)
  if weight.packed:
    if values.ndim > 1:  # pack's row layout (a sharded weight): ONNX reads the flat one
      values = np.asarray(_packing.pack(
          _packing.unpack(values, weight.shape, weight.dtype), dtype=weight.dtype))
    data_type = onnx.helper.np_dtype_to_tensor_dtype(weight.dtype)
    return onnx.helper.make_tensor(name, data_type, weight.shape, values.tobytes(), raw=True)
  _validate.check(
      values.dtype == weight.dtype, "weight",
      f"packed (its {weight.dtype.name} values are uint8 codes)", "unpacked codes",
  )
  return onnx.numpy_helper.from_array(values, name)


def _row_scale_nodes(onnx) -> list[Any]:
  """``s = max|x| / 127`` per row, NaNs ignored, 1 for a row of zeros: as the drop-ins'."""
  helper = onnx.helper
  return [
      helper.make_node("Abs", ["x"], ["x_abs"]),
      helper.make_node("IsNaN", ["x_abs"], ["x_nan"]),
      helper.make_node("Where", ["x_nan", "zero", "x_abs"], ["x_magnitude"]),
      helper.make_node("ReduceMax", ["x_magnitude", "last_axis"], ["x_max"], keepdims=0),
      helper.make_node("Div", ["x_max", "int8_max"], ["x_quotient"]),
      helper.make_node("Equal", ["x_max", "zero"], ["x_zero_row"]),
      helper.make_node("Where", ["x_zero_row", "one", "x_quotient"], ["x_scale"]),
      # Per row is per index of axis 0 (int8: opset 21's output_dtype, no zero point).
      helper.make_node("QuantizeLinear", ["x", "x_scale"], ["x_q"], axis=0,
                       output_dtype=onnx.TensorProto.INT8),
  ]


def _row_scale_constants(onnx) -> list[Any]:
  return [
      onnx.numpy_helper.from_array(np.float32(0), "zero"),
      onnx.numpy_helper.from_array(np.float32(1), "one"),
      onnx.numpy_helper.from_array(np.float32(127), "int8_max"),
      onnx.numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
  ]


def _check_int8_weight(weight, scale, graph):
  _validate.check(
      weight.dtype == np.dtype(np.int8) and weight.zero_point is None
      and not weight.block_size and (scale.size == 1 or weight.axis == 1),
      "weight", "int8 without zero point, per tensor or per output column, "
      f"for a {graph} graph", repr(weight),
  )


@_validate.reports_as("export_onnx")
def export_onnx(
    weight: _params.QuantizedArray,
    bias: ArrayLike | None = None,
    *,
    activations: Literal["float", "dynamic_int8", "fake_quant"] = "float",
    input_scale: ArrayLike | None = None,
    input_zero_point: ArrayLike | None = None,
    opset: int = 25,
) -> Any:
  r"""A dense layer ``y = x @ w + b`` with quantized ``w`` as an ONNX model.

  One graph per flow, by ``activations`` and ``input_scale``:

  * ``"float"`` (weight-only): a QDQ graph, ``MatMul(x, DequantizeLinear(w))``
    then ``Add(b)``. The weight is stored as its ONNX type (int8, int4 and
    int2 packed as :func:`pack` lays them out, float8, ...) with its scale,
    zero point, ``axis`` and ``block_size``; DequantizeLinear reproduces
    :meth:`QuantizedArray.dequantize` bit for bit, the float MatMul to
    float32 rounding (its summation order is the runtime's).
  * ``"float"`` with ``input_scale`` (static int8, :func:`dot_general_static_int8`'s
    arithmetic): ``QuantizeLinear(x)``, ``MatMulInteger`` with the input
    zero point (int32, exact), ``Cast`` to float32, ``Mul`` by the constant
    ``input_scale * w.scale`` and ``Add(b)``.
  * ``"dynamic_int8"`` (:func:`dot_general_dynamic_int8`'s arithmetic): each
    row's scale ``max|x| / 127`` (``Abs``, ``ReduceMax``, ``Div``; NaNs
    ignored, 1 for a zero row), ``QuantizeLinear`` per row to int8,
    ``MatMulInteger`` (int32, exact), then ``DequantizeLinear`` of the int32
    accumulator by the row scale times ``w.scale`` (``Mul``: the scales
    multiplied first, as jaxquant does), ``Add(b)``.
  * ``"fake_quant"`` (a QAT model deployed with :func:`dot_general_fake_quant`):
    the row-scaled ``QuantizeLinear`` of ``"dynamic_int8"``, ``DequantizeLinear``,
    then the QDQ graph's float ``MatMul`` with ``DequantizeLinear(w)``.

  The integer graphs (static and dynamic int8) run in onnxruntime bit for bit
  as the drop-ins with ``rhs=weight``; in the float ones every tensor up to
  the float MatMul is bit for bit jaxquant's, the MatMul differs by its
  summation order (docs/models.md gives the measured ulps). ``w`` must be
  int8 without zero point, per tensor or per output column, for the integer graphs.

  Args:
    weight: a :class:`QuantizedArray` of shape ``(in, out)``.
    bias: float32 ``(out,)``, or ``None``.
    activations: ``"float"``, ``"dynamic_int8"`` or ``"fake_quant"`` (static).
    input_scale: the input's float32 per-tensor scale for a static int8 graph
      (with ``activations="float"``).
    input_zero_point: its int8 zero point (``None``: 0).
    opset: the ONNX opset (25 reads int2; DequantizeLinear's blocks and
      QuantizeLinear's ``output_dtype`` need 21), at most the newest the
      installed onnx knows; the model gets the IR version that goes with it.

  Returns:
    An ``onnx.ModelProto`` with float32 input ``x`` (``(batch, in)``) and output ``y``.

  Raises:
    ImportError: if onnx is not installed.
    TypeError: if ``weight`` is not a :class:`QuantizedArray`.
    ValueError: if ``weight`` is not 2-D, does not fit an integer graph, or
      for an unknown ``activations`` or one given with ``input_scale``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> w = jq.quantize_params(jnp.ones((4, 2)), jq.QuantizationRule(dtype=jnp.int4))
    >>> model = jq.export_onnx(w)
    >>> [node.op_type for node in model.graph.node]
    ['DequantizeLinear', 'MatMul']
    >>> model = jq.export_onnx(jq.quantize_params(jnp.ones((4, 2)), jq.QuantizationRule()),
    ...                        activations="dynamic_int8")
    >>> [node.op_type for node in model.graph.node][-4:]
    ['MatMulInteger', 'Unsqueeze', 'Mul', 'DequantizeLinear']
  """
  onnx = _onnx()
  helper = onnx.helper
  _validate.check(
      isinstance(weight, _params.QuantizedArray), "weight", "a QuantizedArray",
      type(weight).__name__, error=TypeError,
  )
  _params.element(weight, "weight")
  _validate.check(len(weight.shape) == 2, "weight.shape", "(in, out)", weight.shape)
  _validate.check(
      activations in ("float", "dynamic_int8", "fake_quant"), "activations",
      "'float', 'dynamic_int8' or 'fake_quant'", repr(activations),
  )
  _validate.check(
      input_scale is None or activations == "float", "activations",
      "'float' with input_scale (a static int8 graph)", repr(activations),
  )
  _validate.check(
      input_zero_point is None or input_scale is not None, "input_zero_point",
      "None without input_scale (it belongs to a static int8 graph)", input_zero_point,
  )
  info = _dtypes.quantized_dtype("weight.dtype", weight.dtype)
  # DequantizeLinear's blocks and QuantizeLinear's output_dtype are opset 21's; float4
  # came in 23 and int2 in 25.
  minimum = 25 if info.bits == 2 else 23 if info.bits == 4 and not info.is_integer else 21
  opset = _validate.static_int("opset", opset)
  _validate.check(opset >= minimum, "opset", f"at least {minimum} (for {info.name})", opset)
  newest = onnx.defs.onnx_opset_version()
  _validate.check(opset <= newest, "opset", f"at most {newest} (the newest onnx "
                  f"{onnx.__version__} knows)", opset)
  n_in, n_out = weight.shape
  for argument, value, size in (("input_scale", input_scale, 1),
                                ("input_zero_point", input_zero_point, 1), ("bias", bias, n_out)):
    _validate.check(value is None or np.size(value) == size, f"{argument}.shape",
                    f"{size} element{'s' if size > 1 else ''}", np.shape(value))
  scale = np.asarray(weight.scale, np.float32)
  initializers = [_weight_tensor(onnx, "w_q", weight)]
  nodes = []
  product = "y" if bias is None else "xw"
  if activations == "dynamic_int8":
    _check_int8_weight(weight, scale, "dynamic int8")
    initializers += _row_scale_constants(onnx) + [
        onnx.numpy_helper.from_array(np.array([1], np.int64), "row_axis"),
        # One per column even per tensor: y_scale needs the accumulator's shape.
        onnx.numpy_helper.from_array(
            np.ascontiguousarray(np.broadcast_to(scale.reshape(-1), (n_out,))), "w_scale"),
    ]
    nodes += _row_scale_nodes(onnx) + [
        helper.make_node("MatMulInteger", ["x_q", "w_q"], ["accumulator"]),
        helper.make_node("Unsqueeze", ["x_scale", "row_axis"], ["x_scale_column"]),
        helper.make_node("Mul", ["x_scale_column", "w_scale"], ["y_scale"]),
        # float32(acc) * y_scale, one scale per element (blocks of 1). As Cast and
        # Mul, onnxruntime's MatMulIntegerToFloatFusion (on by default) would
        # fold the scales into the product in another order, off by an ulp.
        helper.make_node("DequantizeLinear", ["accumulator", "y_scale"], [product], axis=1,
                         block_size=1),
    ]
  elif input_scale is None:
    initializers.append(onnx.numpy_helper.from_array(scale, "w_scale"))
    inputs = ["w_q", "w_scale"]
    if weight.zero_point is not None:
      initializers.append(
          onnx.numpy_helper.from_array(np.asarray(weight.zero_point), "w_zero_point"))
      inputs.append("w_zero_point")
    # axis even for one scale: a single block is still blocked along it.
    attributes = {} if weight.axis is None else {"axis": weight.axis}
    if weight.block_size:
      attributes["block_size"] = weight.block_size
    nodes.append(helper.make_node("DequantizeLinear", inputs, ["w"], **attributes))
    x = "x"
    if activations == "fake_quant":
      initializers += _row_scale_constants(onnx)
      nodes += _row_scale_nodes(onnx) + [
          helper.make_node("DequantizeLinear", ["x_q", "x_scale"], ["x_dq"], axis=0)]
      x = "x_dq"
    nodes.append(helper.make_node("MatMul", [x, "w"], [product]))
  else:
    _check_int8_weight(weight, scale, "static int8")
    input_scale = np.asarray(input_scale, np.float32).reshape(())
    zero_point = np.asarray(_dtypes.zero_point_array(
        "input_zero_point", 0 if input_zero_point is None else input_zero_point, np.int8))
    initializers += [
        onnx.numpy_helper.from_array(input_scale, "x_scale"),
        onnx.numpy_helper.from_array(zero_point.reshape(()), "x_zero_point"),
        # dot_general_static_int8 multiplies the two scales first, in float32.
        onnx.numpy_helper.from_array(
            (input_scale * scale).reshape(-1).astype(np.float32), "y_scale"),
    ]
    nodes += [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["x_q"]),
        helper.make_node("MatMulInteger", ["x_q", "w_q", "x_zero_point"], ["accumulator"]),
        helper.make_node("Cast", ["accumulator"], ["accumulator_float"],
                         to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", ["accumulator_float", "y_scale"], [product]),
    ]
  if bias is not None:
    initializers.append(onnx.numpy_helper.from_array(
        np.asarray(bias, np.float32).reshape(n_out), "b"))
    nodes.append(helper.make_node("Add", ["xw", "b"], ["y"]))
  graph = helper.make_graph(
      nodes, "jaxquant_dense",
      [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", n_in])],
      [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", n_out])],
      initializer=initializers,
  )
  model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
  # The IR version that goes with the opset (13 for 25: int2 and uint2 tensors came with it).
  model.ir_version = helper.find_min_ir_version_for(model.opset_import)
  return model
