"""The benchmark suite: jaxquant against onnxruntime, NumPy, jnp and a memory copy, in one run.

    python -m benchmarks [--ops dequantize quantize dynamic add fake] [--sizes 65536 1048576 ...]
                         [--layouts per-tensor ...] [--types "int8 -> float32" ...]
                         [--repeats 15] [--json benchmarks/results/cpu.json] [--markdown]
                         [--tune] [--cpus N] [--sync]
    python -m benchmarks --from-json benchmarks/results/cpu.json --markdown [filters]
    python -m benchmarks --overhead [--repeats 15]

Every case runs its peers interleaved (one call each, round after round) on the
same data in one process, and reports medians:

  * ``jaxquant``: the public op with ``implementation=None`` (the default path:
    XLA everywhere until a Pallas kernel is measured faster on the backend);
    ``jaxquant-pallas`` too with ``--pallas`` (on CPU, Pallas interpret mode is
    for correctness only and is very slow);
  * ``onnxruntime``: its CPU kernel for the same ONNX op (QuantizeLinear,
    DequantizeLinear, DynamicQuantizeLinear; com.microsoft QLinearAdd, which
    rounds ties differently: a speed bar only), where it has one;
  * ``numpy`` and ``jnp``: the expression a user writes by hand (jnp jitted;
    neither is bit-exact, both are speed bars);
  * ``inexact``: for quantize per tensor and quantized add, jaxquant's own
    element-wise loop without what its bits cost: the quotient formed by
    multiplying by the reciprocal instead of dividing, the two addends summed
    with a plain add that XLA may fuse into an FMA (docs/numerics.md, J6).
    What XLA:CPU reaches when exactness is free: the bar for what bounds a row;
  * ``xla-floor``: for the rows onnxruntime has, XLA:CPU's barest jitted loop
    with the same reads and writes: int8 widened to the float output
    (dequantize), the float's bits truncated to int8 (quantize), those and
    one plain float max (dynamic quantize: two passes over x), a wrapping int8
    ``a + b`` (the add). Nothing rounds or saturates: where onnxruntime is
    faster even than this, the gap is XLA:CPU's loop and threads, not the
    formula's;
  * ``torch``: PyTorch's fake-quant training step, for the fake-quant rows;
  * ``copy``: NumPy copying, between preallocated buffers, as many bytes as the
    op must move (inputs read once, output written once): the memory floor.

Reported per case: jaxquant's milliseconds and GB/s (bytes moved / time), the
ratio ``onnxruntime ms / jaxquant ms`` (> 1: jaxquant is faster), the same
ratio for ``inexact`` and ``xla-floor``, and jaxquant's fraction of the copy
baseline's rate. The JSON holds every peer's median;
notebooks/04_kernels_and_speed.ipynb plots it. Machines are shared: compare
ratios within one run, never absolute times across runs.

``--overhead`` times instead what one call of each public op costs on a
1024-element input, where dispatch, not data, is the cost: the public call
against the same call without jaxquant's binding (``op._body`` called with the
arguments the binding passes on: for the ops jitted whole, the jit itself),
interleaved, microseconds per call (100 calls then one wait), medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import platform
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxquant as jq
from jaxquant import _dtypes
from jaxquant import _numerics

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import cpu_model  # pylint: disable=wrong-import-position
from _timing import cpus  # pylint: disable=wrong-import-position
from _timing import interleaved_median_ms  # pylint: disable=wrong-import-position
from _timing import tune  # pylint: disable=wrong-import-position

COLUMNS = 1024
OPS = ("dequantize", "quantize", "dynamic", "add", "fake")
DEFAULT_SIZES = (1 << 16, 1 << 20, 1 << 24, 1 << 26)
DEFAULT_JSON = pathlib.Path(__file__).resolve().parent / "results" / "cpu.json"


@dataclasses.dataclass
class Case:
  """One row: an op on one layout and size, with its peers as zero-argument functions."""

  op: str
  layout: str
  types: str
  elements: int
  bytes_moved: int
  peers: dict


def _ort_session(nodes, inputs, outputs, *, opset=21, microsoft=False, constants=(),
                 spinning=True, threads=0):
  """A zero-argument function running an onnxruntime CPU session, or ``None`` if it refuses.

  ``inputs`` are ``(name, array)`` fed at every call; ``constants`` become
  initializers (int4 cannot cross ORT's Python API as an input), with graph
  optimizations off so that ORT cannot fold the op away at load time.
  ``spinning=False`` turns off onnxruntime's default of idle pool threads
  spinning for work (``session.intra_op.allow_spinning``); ``threads`` sets
  its intra-op threads (0: its default, one per core).
  """
  try:
    import onnxruntime  # pylint: disable=import-outside-toplevel
    from onnx import helper, numpy_helper  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None

  def info(name, value):
    return helper.make_tensor_value_info(
        name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)

  graph = helper.make_graph(
      nodes, "benchmark", [info(name, value) for name, value in inputs],
      [helper.make_tensor_value_info(name, dtype, None) for name, dtype in outputs],
      initializer=[numpy_helper.from_array(value, name) for name, value in constants],
  )
  imports = [helper.make_opsetid("", opset)]
  if microsoft:
    imports.append(helper.make_opsetid("com.microsoft", 1))
  model = helper.make_model(graph, opset_imports=imports)
  model.ir_version = 10
  options = onnxruntime.SessionOptions()
  options.intra_op_num_threads = threads
  if not spinning:
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
  if constants:
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
  try:
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = dict(inputs)
    session.run(None, feeds)
  except Exception:  # pylint: disable=broad-except
    return None  # not supported by this onnxruntime: the peer is left out
  return functools.partial(session.run, None, feeds)


def _copy(bytes_moved):
  """NumPy copying ``bytes_moved / 2`` bytes: reads and writes ``bytes_moved`` in all."""
  source = np.ones(max(bytes_moved // 2, 1), np.uint8)
  target = np.empty_like(source)
  return functools.partial(np.copyto, target, source)


_LAYOUTS = {
    # name: (axis, block_size, scale shape for (rows, COLUMNS))
    "per-tensor": lambda rows: (1, 0, ()),
    "per-axis": lambda rows: (1, 0, (COLUMNS,)),
    "blocked-32": lambda rows: (1, 32, (rows, COLUMNS // 32)),
    "blocked-128": lambda rows: (1, 128, (rows, COLUMNS // 128)),
}


def _expand_scale(scale, block_size):
  """The scale as a hand-written peer broadcasts it against (rows, COLUMNS)."""
  if block_size:
    return np.repeat(scale, block_size, axis=1)
  return scale if scale.ndim == 0 else scale.reshape(1, -1)


def dequantize_cases(elements, rng, *, pallas, ort_session=_ort_session):
  from onnx import TensorProto  # pylint: disable=import-outside-toplevel
  rows = elements // COLUMNS
  for types, layouts, outputs in [
      ("int8", _LAYOUTS, ("float32", "bfloat16")),
      ("uint8", ("per-tensor",), ("float32",)),
      ("int4 packed", _LAYOUTS, ("float32", "bfloat16")),
  ]:
    for layout in layouts:
      axis, block_size, scale_shape = _LAYOUTS[layout](rows)
      for output in outputs:
        scale = rng.uniform(0.01, 0.03, scale_shape).astype(output)
        full_scale = _expand_scale(scale.astype(np.float32), block_size)
        if types == "int4 packed":
          values = rng.integers(-8, 8, (rows, COLUMNS)).astype(ml_dtypes.int4)
          x = np.asarray(jq.pack(values))
          zero_point = np.zeros(scale_shape, ml_dtypes.int4)
          options = dict(packed_shape=(rows, COLUMNS), packed_dtype=jnp.int4)
          x_bytes = x.size
        else:
          x = rng.integers(0, 256, (rows, COLUMNS)).astype(types) if types == "uint8" else \
              rng.integers(-128, 128, (rows, COLUMNS)).astype(np.int8)
          values = x
          zero_point = np.zeros(scale_shape, x.dtype)
          options = {}
          x_bytes = x.nbytes
        x_j, scale_j = jnp.asarray(x), jnp.asarray(scale)
        zero_point_j = jnp.asarray(zero_point)
        out_dtype = jnp.dtype(output)
        peers = {"jaxquant": functools.partial(
            jq.dequantize_linear, x_j, scale_j, zero_point_j, axis=axis,
            block_size=block_size, **options)}
        if pallas:
          peers["jaxquant-pallas"] = functools.partial(
              jq.dequantize_linear, x_j, scale_j, zero_point_j, axis=axis,
              block_size=block_size, implementation="pallas", **options)
        if output == "float32":
          if types == "int4 packed":
            ort = ort_session(
                [_node("DequantizeLinear", ["x", "s", "z"], ["y"], axis=axis,
                       block_size=block_size)],
                [("s", scale)], [("y", TensorProto.FLOAT)],
                constants=[("x", values), ("z", zero_point)])
          else:
            ort = ort_session(
                [_node("DequantizeLinear", ["x", "s", "z"], ["y"], axis=axis,
                       block_size=block_size)],
                [("x", x), ("s", scale), ("z", zero_point)], [("y", TensorProto.FLOAT)])
          if ort is not None:
            peers["onnxruntime"] = ort
            if types != "int4 packed":
              peers["xla-floor"] = functools.partial(_floor_convert, x_j, out_dtype)
        repeat = block_size

        @jax.jit
        def by_hand_jnp(x, s, repeat=repeat, packed=types == "int4 packed",
                        out_dtype=out_dtype):
          if packed:
            low = (x.astype(jnp.int8) << 4) >> 4
            high = x.astype(jnp.int8) >> 4
            x = jnp.stack([low, high], axis=-1).reshape(rows, COLUMNS)
          s = s.astype(jnp.float32)
          s = jnp.repeat(s, repeat, axis=1) if repeat else s
          return (x.astype(jnp.float32) * s).astype(out_dtype)

        scale_for_jnp = jnp.asarray(scale if block_size or not scale.ndim
                                    else scale.reshape(1, -1))
        peers["jnp"] = functools.partial(by_hand_jnp, x_j, scale_for_jnp)
        if types != "int4 packed":
          peers["numpy"] = functools.partial(
              lambda x, s, dtype: (x.astype(np.float32) * s).astype(dtype),
              x, full_scale, np.dtype(output))
        moved = x_bytes + scale.nbytes + zero_point.nbytes + rows * COLUMNS * out_dtype.itemsize
        yield Case("dequantize", layout, f"{types} -> {output}", rows * COLUMNS, moved, peers)


def _info(quantized):
  return _dtypes.quantized_dtype("dtype", quantized.dtype)


def _inexact(quotient, zero_point):
  """jaxquant's rounding and saturation of a quotient formed without its division."""
  return _numerics.round_and_saturate(quotient, zero_point, _info(zero_point))


@jax.jit
def _inexact_quantize(x, scale, zero_point):
  return _inexact(x * (1 / scale), zero_point)


@jax.jit
def _inexact_add(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_scale,
                 out_zero_point):
  def value(q, scale, zero_point):
    return _numerics.dequantize_formula(q, scale, zero_point, info=_info(q),
                                        output_dtype=jnp.float32)
  total = value(a, a_scale, a_zero_point) + value(b, b_scale, b_zero_point)
  return _inexact(total * (1 / out_scale), out_zero_point)


@functools.partial(jax.jit, static_argnames="dtype")
def _floor_convert(x, dtype):
  """The barest loop from x to ``dtype``: integers widened, floats' bits truncated."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    x = jax.lax.bitcast_convert_type(x, jnp.int32)
  return x.astype(dtype)


@jax.jit
def _floor_dynamic(x):
  return _floor_convert(x, jnp.uint8), jnp.max(x)


@jax.jit
def _floor_add(a, b):
  return a + b


def _node(op, inputs, outputs, **attributes):
  from onnx import helper  # pylint: disable=import-outside-toplevel
  return helper.make_node(op, inputs, outputs, **attributes)


def quantize_cases(elements, rng, *, pallas, ort_session=_ort_session):
  from onnx import TensorProto  # pylint: disable=import-outside-toplevel
  rows = elements // COLUMNS
  x = rng.standard_normal((rows, COLUMNS)).astype(np.float32)
  x_j = jnp.asarray(x)
  for types in ("int8", "int4 packed"):
    for layout in _LAYOUTS:
      axis, block_size, scale_shape = _LAYOUTS[layout](rows)
      scale = rng.uniform(0.01, 0.03, scale_shape).astype(np.float32)
      if types == "int4 packed":
        scale = scale * 20  # int4's range covers the same x
        zero_point = np.zeros(scale_shape, ml_dtypes.int4)
        options = dict(packed=True)
        out_bytes, qmin, qmax = x.size // 2, -8, 7
      else:
        zero_point = np.zeros(scale_shape, np.int8)
        options = {}
        out_bytes, qmin, qmax = x.size, -128, 127
      scale_j, zero_point_j = jnp.asarray(scale), jnp.asarray(zero_point)
      peers = {"jaxquant": functools.partial(
          jq.quantize_linear, x_j, scale_j, zero_point_j, axis=axis, block_size=block_size,
          **options)}
      if pallas:
        peers["jaxquant-pallas"] = functools.partial(
            jq.quantize_linear, x_j, scale_j, zero_point_j, axis=axis,
            block_size=block_size, implementation="pallas", **options)
      if types == "int8":
        ort = ort_session(
            [_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=axis, block_size=block_size)],
            [("x", x), ("s", scale), ("z", zero_point)], [("y", TensorProto.INT8)])
        if ort is not None:
          peers["onnxruntime"] = ort
          peers["xla-floor"] = functools.partial(_floor_convert, x_j, jnp.int8)
        if layout == "per-tensor":
          peers["inexact"] = functools.partial(
              _inexact_quantize, x_j, scale_j, zero_point_j)
      repeat = block_size

      @jax.jit
      def by_hand_jnp(x, s, repeat=repeat, qmin=qmin, qmax=qmax):
        s = jnp.repeat(s, repeat, axis=1) if repeat else s
        q = jnp.clip(jnp.round(x / s), qmin, qmax).astype(jnp.int8)
        if qmax == 7:
          pairs = q.reshape(-1, 2).astype(jnp.uint8)
          return (pairs[:, 0] & 0xF) | (pairs[:, 1] << 4)
        return q

      full_scale = _expand_scale(scale, block_size)
      peers["jnp"] = functools.partial(
          by_hand_jnp, x_j, jnp.asarray(scale if block_size or not scale.ndim
                                        else scale.reshape(1, -1)))
      if types == "int8":
        peers["numpy"] = functools.partial(
            lambda x, s: np.clip(np.rint(x / s), -128, 127).astype(np.int8), x, full_scale)
      moved = x.nbytes + scale.nbytes + zero_point.nbytes + out_bytes
      yield Case("quantize", layout, f"float32 -> {types}", x.size, moved, peers)


def dynamic_cases(elements, rng, *, pallas, ort_session=_ort_session):
  from onnx import TensorProto  # pylint: disable=import-outside-toplevel
  x = rng.standard_normal((elements // COLUMNS, COLUMNS)).astype(np.float32)
  x_j = jnp.asarray(x)
  for layout, axis in (("per-tensor", None), ("per-row", 0)):
    peers = {"jaxquant": functools.partial(jq.dynamic_quantize_linear, x_j, axis=axis)}
    if pallas:
      peers["jaxquant-pallas"] = functools.partial(
          jq.dynamic_quantize_linear, x_j, axis=axis, implementation="pallas")
    if axis is None:
      ort = ort_session(
          [_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], [("x", x)],
          [("y", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("z", TensorProto.UINT8)])
      if ort is not None:
        peers["onnxruntime"] = ort
        peers["xla-floor"] = functools.partial(_floor_dynamic, x_j)

    def by_hand(xp, x, axis=axis):
      over = None if axis is None else 1  # per row: a scale per row, over its columns
      low = xp.minimum(xp.min(x, axis=over, keepdims=True), 0)
      high = xp.maximum(xp.max(x, axis=over, keepdims=True), 0)
      scale = (high - low) / np.float32(255)
      zero_point = xp.clip(xp.round(-low / scale), 0, 255)
      return xp.clip(xp.round(x / scale) + zero_point, 0, 255).astype(np.uint8), scale

    peers["jnp"] = functools.partial(jax.jit(functools.partial(by_hand, jnp)), x_j)
    peers["numpy"] = functools.partial(by_hand, np, x)
    # The floor of two passes: x read for the statistics and again to quantize.
    yield Case("dynamic", layout, "float32 -> uint8", x.size, 2 * x.nbytes + x.size, peers)


def add_cases(elements, rng, *, pallas, ort_session=_ort_session):
  from onnx import TensorProto  # pylint: disable=import-outside-toplevel
  shape = (elements // COLUMNS, COLUMNS)
  a = rng.integers(-128, 128, shape).astype(np.int8)
  b = rng.integers(-128, 128, shape).astype(np.int8)
  a_j, b_j = jnp.asarray(a), jnp.asarray(b)
  scales = [np.float32(0.02), np.float32(0.03), np.float32(0.05)]
  zero_points = [np.int8(1), np.int8(-3), np.int8(0)]
  arguments = (a_j, scales[0], zero_points[0], b_j, scales[1], zero_points[1], scales[2],
               zero_points[2])
  peers = {"jaxquant": functools.partial(jq.quantized_add, *arguments)}
  if pallas:
    peers["jaxquant-pallas"] = functools.partial(
        jq.quantized_add, *arguments, implementation="pallas")
  ort = ort_session(
      [_node("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["y"],
             domain="com.microsoft")],
      [("a", a), ("sa", np.asarray(scales[0])), ("za", np.asarray(zero_points[0])),
       ("b", b), ("sb", np.asarray(scales[1])), ("zb", np.asarray(zero_points[1])),
       ("sc", np.asarray(scales[2])), ("zc", np.asarray(zero_points[2]))],
      [("y", TensorProto.INT8)], microsoft=True)
  if ort is not None:
    peers["onnxruntime"] = ort
    peers["xla-floor"] = functools.partial(_floor_add, a_j, b_j)
  peers["inexact"] = functools.partial(_inexact_add, *arguments)

  def by_hand(xp, a, b):
    total = ((a.astype(np.float32) - 1) * np.float32(0.02)
             + (b.astype(np.float32) + 3) * np.float32(0.03))
    return xp.clip(xp.round(total / np.float32(0.05)), -128, 127).astype(np.int8)

  peers["jnp"] = functools.partial(jax.jit(functools.partial(by_hand, jnp)), a_j, b_j)
  peers["numpy"] = functools.partial(by_hand, np, a, b)
  yield Case("add", "per-tensor", "int8 + int8 -> int8", a.size, 3 * a.size, peers)


def fake_cases(elements, rng, *, pallas, ort_session=_ort_session):
  del pallas, ort_session  # no Pallas kernel of its own, no onnxruntime op
  shape = (elements // COLUMNS, COLUMNS)
  x = rng.standard_normal(shape).astype(np.float32)
  weights = rng.standard_normal(shape).astype(np.float32)
  x_j, weights_j = jnp.asarray(x), jnp.asarray(weights)

  def step(fake_quantize):
    return jax.jit(jax.value_and_grad(lambda x: jnp.sum(weights_j * fake_quantize(x))))

  def by_hand(x, scale=0.02):
    rounded = jnp.round(x / scale)
    mask = (rounded >= -128) & (rounded <= 127)
    fake = jnp.clip(rounded, -128, 127) * scale
    return jnp.where(mask, x - jax.lax.stop_gradient(x), 0) + jax.lax.stop_gradient(fake)

  peers = {
      "jaxquant": functools.partial(step(lambda x: jq.fake_quantize(x, 0.02)), x_j),
      "jnp": functools.partial(step(by_hand), x_j),
  }
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    torch = None
  if torch is not None:
    x_torch = torch.tensor(x, requires_grad=True)
    weights_torch = torch.tensor(weights)

    def torch_step():
      x_torch.grad = None
      loss = (torch.fake_quantize_per_tensor_affine(x_torch, 0.02, 0, -128, 127)
              * weights_torch).sum()
      loss.backward()
      return loss.item()

    peers["torch"] = torch_step
  # Read x and the weights, write the gradient (the value is a scalar).
  yield Case("fake", "per-tensor", "float32 value_and_grad", x.size, 3 * x.nbytes, peers)


CASES = {
    "dequantize": dequantize_cases, "quantize": quantize_cases, "dynamic": dynamic_cases,
    "add": add_cases, "fake": fake_cases,
}


def measure(case, *, repeats, budget_s):
  """Times ``case``'s peers and the copy baseline; returns the JSON row."""
  functions = dict(case.peers, copy=_copy(case.bytes_moved))
  medians, rounds = interleaved_median_ms(functions, repeats=repeats, budget_s=budget_s)
  ours = medians["jaxquant"]
  return {
      "op": case.op, "layout": case.layout, "types": case.types, "elements": case.elements,
      "bytes_moved": case.bytes_moved, "rounds": rounds, "median_ms": medians,
      "gb_per_s": {name: case.bytes_moved / ms / 1e6 for name, ms in medians.items()},
      "vs_onnxruntime": medians["onnxruntime"] / ours if "onnxruntime" in medians else None,
      "of_copy": medians["copy"] / ours,
  }


def _size(elements):
  for unit, shift in (("M", 20), ("K", 10)):
    if elements >= 1 << shift and elements % (1 << shift) == 0:
      return f"{elements >> shift}{unit}"
  return str(elements)


def markdown(rows):
  """The rows as a markdown table (the README's "Speed" section)."""
  lines = [
      "| op | layout | types | elements | jaxquant ms | GB/s | copy GB/s | of copy "
      "| onnxruntime ms | vs onnxruntime | inexact vs onnxruntime | xla-floor vs onnxruntime |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in rows:
    medians = row["median_ms"]
    ort = medians.get("onnxruntime")

    def versus(peer, ort=ort, medians=medians):
      """onnxruntime's time over ``peer``'s, where the row has both."""
      return "-" if ort is None or peer not in medians else f"{ort / medians[peer]:.2f}x"

    lines.append(
        f"| {row['op']} | {row['layout']} | {row['types']} | {_size(row['elements'])} "
        f"| {medians['jaxquant']:.3f} | {row['gb_per_s']['jaxquant']:.1f} "
        f"| {row['gb_per_s']['copy']:.1f} | {row['of_copy']:.2f} "
        f"| {'-' if ort is None else f'{ort:.3f}'} "
        f"| {versus('jaxquant')} | {versus('inexact')} | {versus('xla-floor')} |")
  return "\n".join(lines)


def _machine():
  info = {
      "jax": jax.__version__, "backend": jax.default_backend(),
      "device": jax.devices()[0].device_kind, "cpu_model": cpu_model(),
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(), "python": platform.python_version(),
      "jaxquant": jq.__version__,
      "cpus": cpus(),
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
      "xla_flags": os.environ.get("XLA_FLAGS"),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  try:
    import onnxruntime  # pylint: disable=import-outside-toplevel
    info["onnxruntime"] = onnxruntime.__version__
  except ImportError:
    pass
  try:
    info["load_average"] = os.getloadavg()
  except OSError:
    pass
  return info


def overhead(repeats, calls=100):
  """Microseconds per call of each public op, bound and not, on 1024 elements."""
  x = jnp.linspace(-4.0, 4.0, 1024, dtype=jnp.float32)
  q = jnp.arange(1024, dtype=jnp.int32).astype(jnp.int8)
  s, z = jnp.float32(0.05), jnp.uint8(3)
  a, b = q.reshape(32, 32), q.reshape(32, 32)
  ops = {
      "quantize_linear": (jq.quantize_linear, (x, s), {"output_dtype": jnp.int8}),
      "dequantize_linear": (jq.dequantize_linear, (q, s), {}),
      "dynamic_quantize_linear": (jq.dynamic_quantize_linear, (x,), {}),
      "quantized_add": (jq.quantized_add, (q, s, None, q, s, None, s), {}),
      "fake_quantize": (jq.fake_quantize, (x, s), {"dtype": jnp.int8}),
      "matmul_integer": (jq.matmul_integer, (a, b), {}),
      "qlinear_matmul": (jq.qlinear_matmul, (a.view(jnp.uint8), s, z, b, s, None, s, z), {}),
      "quantized_dot_general": (jq.quantized_dot_general, (a, b, (((1,), (0,)), ((), ()))),
                                {"lhs_scale": s}),
      "matmul_nbits": (jq.matmul_nbits, (x.reshape(1, 1024), jq.pack(q.astype(jnp.int4)),
                                         jnp.full((1, 32), s)),
                       {"K": 1024, "N": 1, "block_size": 32}),
      "pack": (jq.pack, (q.astype(jnp.int4),), {}),
      "unpack": (jq.unpack, (q[:512].view(jnp.uint8), (1024,), jnp.int4), {}),
  }

  def batch(function):
    def run():
      for _ in range(calls - 1):
        function()
      return function()
    return run

  print(f"load average {os.getloadavg()}")
  print(f"{'op':24} {'public us':>9} {'unbound us':>10} {'binding us':>10}")
  rows = []
  for name, (op, positional, keywords) in ops.items():
    arguments = op._arguments(*positional, **keywords)  # pylint: disable=protected-access
    medians, _ = interleaved_median_ms({
        "public": batch(lambda: op(*positional, **keywords)),
        "unbound": batch(lambda: op._body(**arguments)),  # pylint: disable=protected-access
    }, repeats=repeats)
    public, unbound = (medians[k] * 1e3 / calls for k in ("public", "unbound"))
    rows.append({"op": name, "public_us": public, "unbound_us": unbound})
    print(f"{name:24} {public:9.2f} {unbound:10.2f} {public - unbound:10.2f}", flush=True)
  print(f"load average {os.getloadavg()}")
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
  parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                      help="elements per case (multiples of 1024)")
  parser.add_argument("--repeats", type=int, default=15, help="rounds per case (median)")
  parser.add_argument("--budget", type=float, default=3.0,
                      help="seconds per case; fewer rounds (>= 3) when exceeded")
  parser.add_argument("--layouts", nargs="+", default=None, help="only these layouts")
  parser.add_argument("--types", nargs="+", default=None,
                      help='only these types, as printed ("int8 -> float32")')
  parser.add_argument("--from-json", type=pathlib.Path, default=None,
                      help="print the rows saved there (filtered) instead of measuring")
  parser.add_argument("--pallas", action="store_true", help="also time implementation='pallas'")
  parser.add_argument("--json", type=pathlib.Path, default=None,
                      help=f"write the rows here (the committed ones: {DEFAULT_JSON})")
  parser.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
  parser.add_argument("--tune", action="store_true",
                      help="apply jaxquant.tune_cpu() first (glibc heap for large results, "
                           "512-bit vectors); recorded in the JSON's machine info")
  parser.add_argument("--cpus", type=int, default=None,
                      help="apply jaxquant.tune_cpu(cpus=CPUS) first: the process runs on "
                           "that many CPUs (onnxruntime's thread pool pins its own threads, "
                           "and keeps its CPUs); recorded likewise")
  parser.add_argument("--sync", action="store_true",
                      help="apply jaxquant.tune_cpu(async_dispatch=False) first: each jitted "
                           "call runs on the calling thread; recorded likewise")
  parser.add_argument("--overhead", action="store_true",
                      help="time each public op's per-call overhead on 1024 elements instead")
  args = parser.parse_args(argv)
  if args.overhead:
    return overhead(args.repeats)
  # Before anything starts JAX's backend, or it applies nothing.
  tuned = None if args.from_json is not None else tune(
      defaults=args.tune, async_dispatch=False if args.sync else None, cpus=args.cpus)

  def wanted(row):
    return ((not args.layouts or row["layout"] in args.layouts)
            and (not args.types or row["types"] in args.types))

  if args.from_json is not None:
    saved = json.loads(args.from_json.read_text())
    rows = [row for row in saved["rows"] if row["op"] in args.ops
            and row["elements"] in args.sizes and wanted(row)]
    print(markdown(rows))
    return rows
  machine = dict(_machine(), tune_cpu=tuned)
  print(" ".join(f"{key} {value}" for key, value in machine.items()), flush=True)
  print(f"{'op':10} {'layout':11} {'types':27} {'elements':>8} {'jaxquant ms':>11} "
        f"{'GB/s':>6} {'of copy':>7} {'vs onnxruntime':>14}", flush=True)
  rng = np.random.default_rng(0)
  rows = []
  for elements in args.sizes:
    for op in args.ops:
      for case in CASES[op](elements, rng, pallas=args.pallas):
        if not wanted({"layout": case.layout, "types": case.types}):
          continue
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          row = measure(case, repeats=args.repeats, budget_s=args.budget)
        rows.append(row)
        versus = row["vs_onnxruntime"]
        print(f"{row['op']:10} {row['layout']:11} {row['types']:27} "
              f"{_size(row['elements']):>8} {row['median_ms']['jaxquant']:11.3f} "
              f"{row['gb_per_s']['jaxquant']:6.1f} {row['of_copy']:7.2f} "
              f"{'-' if versus is None else f'{versus:.2f}x':>14}", flush=True)
  if args.json is not None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
  if args.markdown:
    print()
    print(markdown(rows))
  return rows


if __name__ == "__main__":
  main()
