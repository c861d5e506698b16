"""Runs one ONNX node in onnx.reference and in onnxruntime: oracles no one here wrote.

onnxruntime's Python binding cannot take or return ml_dtypes arrays (int4,
int2, float8, float6, float4), so such tensors cross the boundary in a carrier
dtype that holds them exactly (int8, uint8 or float32) and an ONNX Cast node
inside the graph converts them. The same graph runs in both oracles. float6
needs ``opset=28`` (its Cast too); onnxruntime 1.32.0 refuses it.

``result_dtype`` is the dtype the runners return; the node's own attributes,
ONNX's ``output_dtype`` among them, pass through ``**attributes``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator
import onnxruntime
from packaging.version import Version

OPSET = 25

# The versions the suite was verified with are pinned in pyproject.toml. Tests
# that pin an oracle's bug ask these, so a release that fixes it keeps them
# green: they then expect the fixed behaviour.
ONNX_VERSION = Version(onnx.__version__)
ONNXRUNTIME_VERSION = Version(onnxruntime.__version__)


def onnxruntime_before(version: str) -> bool:
  """Whether the installed onnxruntime predates ``version``."""
  return ONNXRUNTIME_VERSION < Version(version)
_NATIVE = {np.dtype(d) for d in (
    np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16, np.uint16,
    np.int32, np.uint32, np.int64, np.bool_,
)}


def _carrier(dtype: np.dtype) -> np.dtype:
  if dtype in _NATIVE:
    return dtype
  if dtype == np.dtype(ml_dtypes.bfloat16):
    return np.dtype(np.float32)
  if np.issubdtype(dtype, np.integer) or dtype.name.startswith(("int", "uint")):
    return np.dtype(np.int8 if dtype.name.startswith("int") else np.uint8)
  return np.dtype(np.float32)


def _tensor_type(dtype: np.dtype) -> int:
  return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def build_model(op: str, inputs: dict[str, np.ndarray | None], result_dtype: np.dtype, /,
                domain: str = "", opset: int = OPSET, **attributes) -> onnx.ModelProto:
  """One ``op`` node whose inputs and output pass through carrier Casts where needed."""
  nodes, graph_inputs, node_inputs = [], [], []
  for name, value in inputs.items():
    if value is None:
      node_inputs.append("")
      continue
    carrier = _carrier(value.dtype)
    graph_inputs.append(helper.make_tensor_value_info(name, _tensor_type(carrier), value.shape))
    if carrier != value.dtype:
      cast = {"to": _tensor_type(value.dtype)}
      if value.dtype.name.startswith("float8"):
        # The carrier holds +-inf exactly; the default saturating Cast would
        # turn them into +-max before they reach the node.
        cast["saturate"] = 0
      nodes.append(helper.make_node("Cast", [name], [name + "_cast"], **cast))
      name += "_cast"
    node_inputs.append(name)
  while node_inputs and node_inputs[-1] == "":
    node_inputs.pop()
  output_carrier = _carrier(np.dtype(result_dtype))
  nodes.append(helper.make_node(op, node_inputs, ["y_raw"], domain=domain, **attributes))
  nodes.append(helper.make_node("Cast", ["y_raw"], ["y"], to=_tensor_type(output_carrier)))
  graph = helper.make_graph(
      nodes, op, graph_inputs,
      [helper.make_tensor_value_info("y", _tensor_type(output_carrier), None)],
  )
  opsets = [helper.make_opsetid("", opset)]
  if domain:
    opsets.append(helper.make_opsetid(domain, 1))
  model = helper.make_model(graph, opset_imports=opsets)
  model.ir_version = 11
  return model


def _feeds(inputs):
  return {name: value.astype(_carrier(value.dtype))
          for name, value in inputs.items() if value is not None}


def run_reference(op, inputs, result_dtype, /, **attributes) -> np.ndarray:
  """``op`` in ``onnx.reference``, the output as ``result_dtype``."""
  model = build_model(op, inputs, result_dtype, **attributes)
  (y,) = ReferenceEvaluator(model).run(None, _feeds(inputs))
  return np.asarray(y).astype(result_dtype)


def run_onnxruntime(op, inputs, result_dtype, /, domain="", **attributes) -> np.ndarray:
  """``op`` in onnxruntime's CPU provider, the output as ``result_dtype``."""
  model = build_model(op, inputs, result_dtype, domain=domain, **attributes)
  options = onnxruntime.SessionOptions()
  options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
  # Sessions here run one tiny node: a thread pool per session costs more than it saves.
  options.intra_op_num_threads = 1
  session = onnxruntime.InferenceSession(
      model.SerializeToString(), options, providers=["CPUExecutionProvider"]
  )
  (y,) = session.run(None, _feeds(inputs))
  return np.asarray(y).astype(result_dtype)
