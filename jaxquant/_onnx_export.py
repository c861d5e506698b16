"""A quantized dense layer as an ONNX graph (onnx is an optional extra, imported on use)."""

from __future__ import annotations

from typing import Any

from jax.typing import ArrayLike
import numpy as np

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
  if weight.packed:
    data_type = onnx.helper.np_dtype_to_tensor_dtype(weight.dtype)
    return onnx.helper.make_tensor(name, data_type, weight.shape, values.tobytes(), raw=True)
  _validate.check(
      values.dtype == weight.dtype, "export_onnx", "weight",
      f"packed (its {weight.dtype.name} values are uint8 codes)", "unpacked codes",
  )
  return onnx.numpy_helper.from_array(values, name)


def export_onnx(
    weight: _params.QuantizedArray,
    bias: ArrayLike | None = None,
    *,
    input_scale: ArrayLike | None = None,
    input_zero_point: ArrayLike | None = None,
    opset: int = 25,
) -> Any:
  r"""A dense layer ``y = x @ w + b`` with quantized ``w`` as an ONNX model.

  Two graphs, by whether the input is quantized:

  * ``input_scale=None``: a QDQ graph, ``MatMul(x, DequantizeLinear(w))``
    then ``Add(b)``. The weight is stored as its ONNX type (int8, int4 and
    int2 packed as :func:`pack` lays them out, float8, ...) with its scale,
    zero point, ``axis`` and ``block_size``; DequantizeLinear reproduces
    :meth:`QuantizedArray.dequantize` bit for bit, the float MatMul to
    float32 rounding (its summation order is the runtime's).
  * with ``input_scale`` (static int8, :func:`dot_general_static_int8`'s
    arithmetic): ``QuantizeLinear(x)``, ``MatMulInteger`` with the input
    zero point (int32, exact), ``Cast`` to float32, ``Mul`` by the constant
    ``input_scale * w.scale`` and ``Add(b)``: onnxruntime computes it bit for
    bit as :func:`dot_general_static_int8` with ``rhs=weight`` does. ``w``
    must be int8 without zero point, per tensor or per output column.

  Args:
    weight: a :class:`QuantizedArray` of shape ``(in, out)``.
    bias: float32 ``(out,)``, or ``None``.
    input_scale: the input's float32 per-tensor scale for a static int8 graph.
    input_zero_point: its int8 zero point (``None``: 0).
    opset: the ONNX opset (25 reads int2; DequantizeLinear's blocks need 21).

  Returns:
    An ``onnx.ModelProto`` with float32 input ``x`` (``(batch, in)``) and output ``y``.

  Raises:
    ImportError: if onnx is not installed.
    TypeError: if ``weight`` is not a :class:`QuantizedArray`.
    ValueError: if ``weight`` is not 2-D, or does not fit the static int8 graph.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxquant as jq
    >>> w = jq.quantize_params(jnp.ones((4, 2)), jq.QuantizationRule(dtype=jnp.int4))
    >>> model = jq.export_onnx(w)
    >>> [node.op_type for node in model.graph.node]
    ['DequantizeLinear', 'MatMul']
  """
  function = "export_onnx"
  onnx = _onnx()
  helper = onnx.helper
  _validate.check(
      isinstance(weight, _params.QuantizedArray), function, "weight", "a QuantizedArray",
      type(weight).__name__, error=TypeError,
  )
  _validate.check(len(weight.shape) == 2, function, "weight.shape", "(in, out)", weight.shape)
  n_in, n_out = weight.shape
  scale = np.asarray(weight.scale, np.float32)
  initializers = [_weight_tensor(onnx, "w_q", weight)]
  nodes = []
  if input_scale is None:
    initializers.append(onnx.numpy_helper.from_array(scale, "w_scale"))
    inputs = ["w_q", "w_scale"]
    if weight.zero_point is not None:
      initializers.append(
          onnx.numpy_helper.from_array(np.asarray(weight.zero_point), "w_zero_point"))
      inputs.append("w_zero_point")
    attributes = {} if scale.size == 1 else {"axis": weight.axis}
    if weight.block_size:
      attributes["block_size"] = weight.block_size
    nodes.append(helper.make_node("DequantizeLinear", inputs, ["w"], **attributes))
    nodes.append(helper.make_node("MatMul", ["x", "w"], ["y" if bias is None else "xw"]))
  else:
    _validate.check(
        weight.dtype == np.dtype(np.int8) and weight.zero_point is None
        and not weight.block_size and (scale.size == 1 or weight.axis == 1),
        function, "weight", "int8 without zero point, per tensor or per output column, "
        "for a static int8 graph", repr(weight),
    )
    input_scale = np.asarray(input_scale, np.float32).reshape(())
    zero_point = np.asarray(0 if input_zero_point is None else input_zero_point, np.int8)
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
        helper.make_node("Mul", ["accumulator_float", "y_scale"],
                         ["y" if bias is None else "xw"]),
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
  model.ir_version = 11
  return model
