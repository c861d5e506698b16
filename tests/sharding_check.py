"""Every op on 8 simulated CPU devices against one device; run by tests/test_sharding.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python tests/sharding_check.py

Prints one JSON object per case: ``equal`` (bit for bit the unsharded
result), ``close`` (within float32 rounding of it), ``collectives`` (all-gathers, all-to-alls and collective-permutes
in the compiled program whose result, a tuple's arrays together, is as large
as a shard of x or larger),
``halo_elements`` (the largest collective-permute), ``sharding`` (whether
every x-shaped output has x's sharding).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import jaxquant as jq

ROWS = 8
# (name, columns, block_size, per-shard columns on the column axis of each mesh).
# 8 shards of 256 columns hold 32-column blocks whole; 192 / 8 = 24 columns
# cut through 16-column blocks; 200 columns in 16s end in a short block.
BLOCKED = {"aligned": (256, 32), "straddling": (192, 16), "ragged": (200, 16)}
MESHES = {"1d": ((8,), ("c",), P(None, "c")), "2d": ((4, 2), ("r", "c"), P("r", "c"))}
# A result is one array or a tuple of them: an all-to-all of a split dim returns
# one piece per device, `(s8[2,1,512], s8[2,1,512], ...)`.
_COLLECTIVE = re.compile(
    r"= (\([^()]*\)|\w+\[[\d,]*\])[^=]*? (all-gather|all-to-all|collective-permute)"
    r"(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def make_mesh(name: str, axis_type: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
  """The mesh of ``MESHES[name]``, every axis of ``axis_type``."""
  shape, names, _ = MESHES[name]
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def collectives(hlo: str) -> list[tuple[str, str, int]]:
  """(op, type, elements) of each data-moving collective in a compiled program."""
  found = []
  for result, op in _COLLECTIVE.findall(hlo):
    arrays = _ARRAY.findall(result)
    kind = ", ".join(f"{dtype}[{dims}]" for dtype, dims in arrays)
    found.append((op, kind if len(arrays) == 1 else f"({kind})", sum(
        int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for _, dims in arrays)))
  return found


def layouts(columns, block_size):
  rng = np.random.default_rng(columns)
  scale_blocked = rng.uniform(0.01, 0.05, (ROWS, -(-columns // block_size))).astype(np.float32)
  return {
      "per-tensor": (np.float32(0.02), np.int8(3), dict(axis=1)),
      "per-axis": (rng.uniform(0.01, 0.05, columns).astype(np.float32),
                   rng.integers(-4, 4, columns).astype(np.int8), dict(axis=1)),
      "blocked": (scale_blocked, rng.integers(-4, 4, scale_blocked.shape).astype(np.int8),
                  dict(axis=1, block_size=block_size)),
  }


def ops(implementation):
  """name -> (function of (x, q, scale, zero_point), which outputs are x-shaped)."""
  impl = dict(implementation=implementation)

  def learnable(x, q, s, z, **kw):
    return jq.fake_quantize_learnable(x, s, z.astype(jnp.float32), **kw)

  def learnable_grad(x, q, s, z, **kw):
    # d/dx only: d/dscale sums over a block across shards, in another order.
    return jax.grad(lambda x: jnp.sum(learnable(x, q, s, z, **kw) * x))(x)

  return {
      "quantize_linear": lambda x, q, s, z, **kw: jq.quantize_linear(x, s, z, **kw, **impl),
      "dequantize_linear": lambda x, q, s, z, **kw: jq.dequantize_linear(q, s, z, **kw, **impl),
      "dequantize_linear(packed rows)": lambda x, q, s, z, **kw: jq.dequantize_linear(
          jq.pack(q, layout="rows"), s, None, packed_shape=q.shape, **kw, **impl),
      "fake_quantize": lambda x, q, s, z, **kw: jq.fake_quantize(x, s, z, **kw),
      "fake_quantize_learnable": learnable,
      "fake_quantize_learnable grad": learnable_grad,
  }


def dynamic_ops(implementation):
  return {
      "dynamic_quantize_linear": functools.partial(
          jq.dynamic_quantize_linear, implementation=implementation),
      "fake_quantize_dynamic": jq.fake_quantize_dynamic,
  }


def report(case, got, want, compiled, x_sharding, shard_elements):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  equal = all(
      g.shape == w.shape and g.dtype == w.dtype and np.array_equal(
          np.asarray(g), np.asarray(w), equal_nan=True)
      for g, w in zip(got_leaves, want_leaves, strict=True))
  # Float sums split across devices add in another order: within float32 rounding.
  close = all(
      g.shape == w.shape and g.dtype == w.dtype and np.allclose(
          np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=1e-5, atol=1e-5,
          equal_nan=True)
      for g, w in zip(got_leaves, want_leaves, strict=True))
  sharding = all(
      g.sharding.is_equivalent_to(x_sharding, g.ndim)
      for g in got_leaves if g.shape == got_leaves[0].shape and g.ndim == len(x_sharding.spec))
  found = [] if compiled is None else collectives(compiled)
  result = dict(
      case=case, equal=equal, close=close, sharding=sharding, shard_elements=shard_elements,
      collectives=None if compiled is None else [
          f"{op} {kind}" for op, kind, elements in found if elements >= shard_elements],
      halo_elements=max([e for op, _, e in found if op == "collective-permute"], default=0))
  print(json.dumps(result), flush=True)


# One device's result of each case of jit_cases (named without its prefix), shared by its
# automatic and its typed run: the same call on the same arrays, compiled once.
_ONE_DEVICE = {}


def one_device(case, f, *args):
  if case not in _ONE_DEVICE:
    _ONE_DEVICE[case] = f(*args)
  return _ONE_DEVICE[case]


def one_element_shard_cases():
  """Blocks along rows cut by shards of one row: each shard reads its block's parameter.

  A kernel's shard of one row skipped the view of its blocked dim (a dim of one
  element has none when whole), so it broadcast every block's parameter.
  """
  mesh = make_mesh("1d")
  x_sharding = NamedSharding(mesh, P("c", None))
  rng = np.random.default_rng(11)
  x = rng.normal(0, 5, (ROWS, 16)).astype(np.float32)
  q = rng.integers(-8, 8, (ROWS, 16)).astype(jnp.int4)
  blocked = rng.uniform(0.1, 2, (3, 16)).astype(np.float32)  # blocks of 3 rows, ragged
  broadcast = rng.uniform(0.1, 2, (2, 8)).astype(np.float32)  # 4 x 2 elements each
  pairs = rng.uniform(0.1, 2, (4, 16)).astype(np.float32)  # blocks of 2 rows
  for implementation in ("xla", "pallas"):
    impl = dict(implementation=implementation)
    for case, f, args in [
        ("quantize_linear blocked", lambda x, s: jq.quantize_linear(
            x, s, axis=0, block_size=3, output_dtype=jnp.int8, **impl), (x, blocked)),
        ("dequantize_linear blocked", lambda q, s: jq.dequantize_linear(
            q, s, axis=0, block_size=3, **impl), (q, blocked)),
        ("quantize_linear block-wise broadcast", lambda x, s: jq.quantize_linear(
            x, s, output_dtype=jnp.int8, **impl), (x, broadcast)),
        ("dequantize_linear(packed rows) blocked", lambda q, s: jq.dequantize_linear(
            jq.pack(q, layout="rows"), s, axis=0, block_size=2, packed_shape=q.shape, **impl),
         (q, pairs)),
        ("dynamic_quantize_linear blocked", lambda x: jq.dynamic_quantize_linear(
            x, dtype=jnp.int8, axis=0, block_size=3, **impl), (x,)),
    ]:
      f = jax.jit(f)
      sharded = (jax.device_put(args[0], x_sharding), *args[1:])
      report(f"one-row 1d {implementation} {case}", f(*sharded),
             f(*args), f.lower(*sharded).compile().as_text(), x_sharding, args[0].size // 8)


def jit_cases(mesh_name, axis_type=AxisType.Auto):
  """Every element-wise op and layout under jit; on an explicit mesh, the ``typed`` cases."""
  prefix = "typed" if axis_type == AxisType.Explicit else "jit"
  implementations = ("xla", "pallas")
  mesh, spec = make_mesh(mesh_name, axis_type), MESHES[mesh_name][2]
  x_sharding = NamedSharding(mesh, spec)
  replicated = NamedSharding(mesh, P())
  for shard_name, (columns, block_size) in BLOCKED.items():
    if mesh_name == "2d" and shard_name == "ragged":
      continue  # the 1-D mesh's short last block; spares the suite's time
    rng = np.random.default_rng(columns + 1)
    x = (rng.standard_normal((ROWS, columns)) * 0.1).astype(np.float32)
    q = rng.integers(-8, 8, (ROWS, columns)).astype(jnp.int4)
    xs, qs = jax.device_put(x, x_sharding), jax.device_put(q, x_sharding)
    shard_elements = x.size // mesh.size
    # The default implementation of blocked packed int4 dequantization chooses
    # per platform when lowered (the route _dispatch.PALLAS_FASTER lists): its
    # results' types held no split, so an explicit mesh gathered them.
    for implementation in (*implementations, None):
      for layout, (s, z, kw) in layouts(columns, block_size).items():
        if layout != "blocked" and shard_name != "aligned":
          continue
        for name, op in ops(implementation).items():
          if implementation == "pallas" and name.startswith("fake"):
            continue
          if implementation is None and (layout, name) != (
              "blocked", "dequantize_linear(packed rows)"):
            continue
          zero_point = None if "packed" in name else z
          if "dequantize" in name:
            zero_point = None if zero_point is None else zero_point.astype(jnp.int4)
          f = jax.jit(functools.partial(op, **kw))
          args = (xs, qs, jax.device_put(s, replicated),
                  None if zero_point is None else jax.device_put(zero_point, replicated))
          compiled = f.lower(*args).compile().as_text()
          case = f"{mesh_name} {implementation or 'default'} {name} {layout} {shard_name}"
          report(f"{prefix} {case}", f(*args), one_device(case, f, x, q, s, zero_point),
                 compiled, x_sharding, shard_elements)
      for name, op in dynamic_ops(implementation).items():
        if implementation == "pallas" and name.startswith("fake") or implementation is None:
          continue
        for layout, kw in [("per-tensor", {}), ("per-axis", dict(axis=0)),
                           ("blocked", dict(axis=1, block_size=block_size))]:
          if layout != "blocked" and shard_name != "aligned":
            continue
          f = jax.jit(functools.partial(op, **kw))
          compiled = f.lower(xs).compile().as_text()
          case = f"{mesh_name} {implementation} {name} {layout} {shard_name}"
          report(f"{prefix} {case}", f(xs), one_device(case, f, x), compiled, x_sharding,
                 shard_elements)
    if shard_name == "aligned":
      a = rng.integers(-128, 127, (ROWS, columns)).astype(np.int8)
      b = rng.integers(-128, 127, (ROWS, columns)).astype(np.int8)
      for implementation in implementations:
        f = jax.jit(lambda a, b: jq.quantized_add(
            a, 0.02, np.int8(1), b, 0.03, np.int8(-2), 0.05, np.int8(0),
            implementation=implementation))
        args = (jax.device_put(a, x_sharding), jax.device_put(b, x_sharding))
        case = f"{mesh_name} {implementation} quantized_add per-tensor aligned"
        report(f"{prefix} {case}", f(*args), one_device(case, f, a, b),
               f.lower(*args).compile().as_text(), x_sharding, shard_elements)
      for packing in ("pack rows", "unpack rows"):
        packed = jq.pack(q, layout="rows")
        f = jax.jit(functools.partial(jq.pack, layout="rows")) if packing == "pack rows" else (
            jax.jit(lambda p: jq.unpack(p, q.shape, jnp.int4)))
        argument, local = (qs, q) if packing == "pack rows" else (
            jax.device_put(packed, x_sharding), packed)
        case = f"{mesh_name} - {packing} - aligned"
        report(f"{prefix} {case}", f(argument), one_device(case, f, local),
               f.lower(argument).compile().as_text(), x_sharding, shard_elements // 2)


def matmul_nbits_cases():
  """matmul_nbits: a split along its rows, the packed weight along N, K whole.

  Every device keeps at least 2 rows and 64 columns of the output: XLA:CPU's
  dot (the XLA path's, and the kernel's in interpret mode) sums a
  matrix-vector product, or fewer than 64 columns, in another order than a
  larger product, so narrower shards differ from one device in the last bit
  on both paths alike (docs/sharding.md).
  """
  k, block_size, bits = 256, 32, 4
  cases = [  # (mesh, what is split, a's shape, a's spec, N, the weight's spec, the output's)
      ("2d", "rows+N", (16, k), P("r", None), 256, P("c"), P("r", "c")),
      ("2d", "batch+N", (4, 8, k), P("r", None, None), 256, P("c"), P("r", None, "c")),
      ("1d", "rows", (16, k), P("c", None), 256, P(), P("c", None)),
      ("1d", "N", (16, k), P(), 512, P("c"), P(None, "c")),
      ("1d", "K", (16, k), P(None, "c"), 256, P(), P()),  # gathered along K
  ]
  rng = np.random.default_rng(5)
  for mesh_name, layout, a_shape, a_spec, n, weight_spec, out_spec in cases:
    mesh = make_mesh(mesh_name)
    a = rng.standard_normal(a_shape).astype(np.float32)
    weight = (rng.integers(0, 256, (n, k // block_size, block_size * bits // 8), np.uint8),
              rng.uniform(0.01, 0.05, (n, k // block_size)).astype(np.float32),
              rng.integers(0, 256, (n, k // block_size * bits // 8), np.uint8))
    arguments = (jax.device_put(a, NamedSharding(mesh, a_spec)),
                 *(jax.device_put(w, NamedSharding(mesh, weight_spec)) for w in weight))
    # XLA splits K itself and adds the float partials across devices (another order).
    for implementation in ("xla", "pallas") if layout != "K" else ("pallas",):
      f = jax.jit(functools.partial(
          jq.matmul_nbits, K=k, N=n, bits=bits, block_size=block_size,
          implementation=implementation))
      calls = [(f"jit {mesh_name} {implementation} matmul_nbits {layout} -", f)]
      if layout == "batch+N":
        calls.append((f"jit {mesh_name} {implementation} vmap(matmul_nbits) {layout} -",
                      jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))))
      for case, call in calls:
        report(case, call(*arguments), call(a, *weight), call.lower(*arguments).compile().as_text(),
               NamedSharding(mesh, out_spec), min(a.size, weight[1].size) // mesh.size)


def dot_general_cases():
  """The dynamic and static int8 layers, 4096 deep (contracted in slices:
  docs/numerics.md), split along K (row-parallel), along N (column-parallel) and
  along rows: int32 partials added across devices are exact, and no device
  receives another's weight."""
  k, n, rows = 4096, 64, 16
  mesh = make_mesh("1d")
  rng = np.random.default_rng(6)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  weight = jq.quantize_params(
      jnp.asarray(rng.standard_normal((k, n)).astype(np.float32) / 64),
      jq.QuantizationRule(dtype=jnp.int8))
  dimension_numbers = (((1,), (0,)), ((), ()))
  layers = {
      "dot_general_dynamic_int8": jax.jit(
          lambda x, w: jq.dot_general_dynamic_int8(x, w, dimension_numbers)),
      "dot_general_static_int8": jax.jit(lambda x, w: jq.dot_general_static_int8(
          x, w, dimension_numbers, input_scale=0.02, input_zero_point=np.int8(-7))),
  }
  for layout, x_spec, values_spec, scale_spec, out_spec in [
      ("K", P(None, "c"), P("c", None), P(), P()),
      ("N", P(), P(None, "c"), P("c"), P(None, "c")),
      ("rows", P("c", None), P(), P(), P("c", None)),
  ]:
    arguments = (jax.device_put(x, NamedSharding(mesh, x_spec)), dataclasses.replace(
        weight, values=jax.device_put(weight.values, NamedSharding(mesh, values_spec)),
        scale=jax.device_put(weight.scale, NamedSharding(mesh, scale_spec))))
    for name, f in layers.items():
      # Counted from a 16th of a weight shard: slices of K cut with lax.slice moved
      # pieces of each shard between devices (collective-permutes of 128-256 rows).
      report(f"jit 1d xla {name} {layout} -", f(*arguments), f(x, weight),
             f.lower(*arguments).compile().as_text(), NamedSharding(mesh, out_spec),
             weight.values.size // mesh.size // 16)
  # out_sharding on an automatic mesh: the result placed as asked, whatever the operands',
  # and equal to the product without it.
  rows_split = NamedSharding(mesh, P("c", None))
  for name, options in [("dot_general_dynamic_int8", {}),
                        ("dot_general_static_int8", dict(input_scale=0.02))]:
    drop_in = functools.partial(getattr(jq, name), dimension_numbers=dimension_numbers,
                                **options)
    f = jax.jit(functools.partial(drop_in, out_sharding=rows_split))
    report(f"jit 1d xla {name} out_sharding-rows -", f(x, weight), jax.jit(drop_in)(x, weight),
           f.lower(x, weight).compile().as_text(), rows_split,
           weight.values.size // mesh.size // 16)


def conv_cases():
  """The conv drop-ins (a 3x3 NHWC convolution, 16 -> 32 features) split along the batch
  (8 examples, the kernel replicated) and along the kernel's output features (HWIO's O,
  the input replicated). The dynamic int8 conv's activation scale is per example, the
  kernel's per output feature: either split leaves every device whole scales, and the
  int32 sums are exact.

  Split along O, the float convolutions (weight-only, fake-quant) are each device's
  convolution of 4 output features, which XLA:CPU sums in another order than one
  convolution of 32 (one device convolving each 4-feature slice of the kernel gives
  the sharded bits): they are compared with that too, as ``O(per-shard)``. The int4
  weight-only kernel, quantized where it lies, is packed per row, 2 bytes of each
  device's 4 features, and its dequantization reads 4-byte words
  (``_packing.unpack_integers``): each device gathers its neighbour's bytes of every
  row, two shards of the packed kernel (with 8 features a device, a word each, none).
  """
  mesh = make_mesh("1d")
  rng = np.random.default_rng(9)
  x = rng.standard_normal((8, 10, 10, 16)).astype(np.float32)
  kernel = (rng.standard_normal((3, 3, 16, 32)) / 12).astype(np.float32)
  numbers = dict(window_strides=(1, 1), padding="SAME",
                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
  int8 = jq.QuantizationRule()
  int4 = jq.QuantizationRule(dtype=jnp.int4, axis=-2, block_size=8)  # packed

  def int8_sharded(kernel, spec):
    """A stored int8 kernel with its values and per-feature scale placed as ``spec``."""
    weight = jq.quantize_params(jnp.asarray(kernel), int8)
    return dataclasses.replace(
        weight, values=jax.device_put(weight.values, NamedSharding(mesh, spec)),
        scale=jax.device_put(weight.scale, NamedSharding(mesh, P(spec[-1]) if spec else P())))

  # name -> (the drop-in, the kernel it takes on one device, the kernel sharded as spec).
  ops = {
      "conv_general_dilated_dynamic_int8": (
          jq.conv_general_dilated_dynamic_int8,
          lambda k: jq.quantize_params(jnp.asarray(k), int8), int8_sharded),
      "conv_general_dilated_static_int8": (
          functools.partial(jq.conv_general_dilated_static_int8,
                            input_scale=np.float32(0.03), input_zero_point=np.int8(-5)),
          lambda k: jq.quantize_params(jnp.asarray(k), int8), int8_sharded),
      "conv_general_dilated_weight_only": (
          jq.conv_general_dilated_weight_only,
          lambda k: jq.quantize_params(jnp.asarray(k), int4),
          lambda k, spec: jq.quantize_params(jax.device_put(k, NamedSharding(mesh, spec)), int4)),
      "conv_general_dilated_fake_quant": (
          jq.conv_general_dilated_fake_quant, jnp.asarray,
          lambda k, spec: jax.device_put(k, NamedSharding(mesh, spec))),
  }
  features = kernel.shape[-1] // mesh.size
  for name, (op, local, sharded) in ops.items():
    f = jax.jit(lambda x, w, op=op: op(x, w, **numbers))
    want = f(x, local(kernel))
    for layout, x_spec, kernel_spec, out_spec in [
        ("batch", P("c", None, None, None), P(), P("c", None, None, None)),
        ("O", P(), P(None, None, None, "c"), P(None, None, None, "c")),
    ]:
      arguments = (jax.device_put(x, NamedSharding(mesh, x_spec)), sharded(kernel, kernel_spec))
      got, compiled = f(*arguments), f.lower(*arguments).compile().as_text()
      # Counted from a 16th of a shard of the kernel: a scale moved is smaller.
      shard_elements = kernel.size // mesh.size // 16
      report(f"jit 1d xla {name} {layout} -", got, want, compiled,
             NamedSharding(mesh, out_spec), shard_elements)
      if layout == "O" and name in ("conv_general_dilated_weight_only",
                                    "conv_general_dilated_fake_quant"):
        per_shard = jnp.concatenate([
            f(x, local(kernel[..., i:i + features]))
            for i in range(0, kernel.shape[-1], features)], axis=-1)
        report(f"jit 1d xla {name} O(per-shard) -", got, per_shard, compiled,
               NamedSharding(mesh, out_spec), shard_elements)

def integer_matmul_cases():
  """The integer matmuls split along rows, N, K and a batch dim: int32 sums wrap exactly in
  any order, so partials added across devices (a split along K) equal one device too.

  matmul_integer is 49152 deep (24 slices of 2048, docs/numerics.md), with the dtypes'
  extremes in the first rows and columns, where the int32 sums wrap. A zero point on a
  (every uint8 a) appends a row of ones to a's rows (rhs's sums over K): a split along a's
  rows moves a and the product's rows between devices (docs/sharding.md).
  """
  m, k, n = 16, 49152, 64
  rng = np.random.default_rng(8)
  a = rng.integers(0, 256, (m, k), np.uint8)
  b = rng.integers(-128, 128, (k, n), np.int8)
  a_zero_point = rng.integers(0, 256, m).astype(np.uint8)
  b_zero_point = rng.integers(-128, 128, n).astype(np.int8)
  a[:2], a_zero_point[:2] = [[255], [0]], [0, 255]
  b[:, :2], b_zero_point[:2] = [-128, 127], [127, -128]

  def check(mesh_name, op, layout, f, arguments, specs, out_spec):
    mesh = make_mesh(mesh_name)
    sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(arguments, specs)]
    want = f(*arguments)
    # Counted from a shard of the output, the smallest array here: a's pieces or the
    # product's rows moving between devices show.
    report(f"jit {mesh_name} xla {op} {layout} -", f(*sharded), want,
           f.lower(*sharded).compile().as_text(), NamedSharding(mesh, out_spec),
           want.size // mesh.size)

  matmul_integer = jax.jit(jq.matmul_integer)
  for mesh_name, layout, a_spec, b_spec, a_zero_point_spec, b_zero_point_spec, out_spec in [
      ("1d", "rows", P("c", None), P(), P("c"), P(), P("c", None)),
      ("1d", "N", P(), P(None, "c"), P(), P("c"), P(None, "c")),
      ("1d", "K", P(None, "c"), P("c", None), P(), P(), P(None, None)),
      ("2d", "rows+N", P("r", None), P(None, "c"), P("r"), P("c"), P("r", "c")),
      ("2d", "K+N", P(None, "r"), P("r", "c"), P(), P("c"), P(None, "c")),
  ]:
    # Split along N, a's zero point is one element (per tensor).
    check(mesh_name, "matmul_integer", layout, matmul_integer,
          (a, b, a_zero_point[:1] if layout == "N" else a_zero_point, b_zero_point),
          (a_spec, b_spec, a_zero_point_spec, b_zero_point_spec), out_spec)
  # An int8 a without a zero point: no row of ones, nothing moves.
  check("1d", "matmul_integer", "rows(int8,no-zero-point)", matmul_integer,
        (a.view(np.int8), b, None, b_zero_point), (P("c", None), P(), P(), P()), P("c", None))

  depth = 1024
  # y_scale 128: 4-13% of the outputs saturate, the others take 90-200 values.
  qlinear_matmul = jax.jit(lambda a, a_zero_point, b, b_scale, b_zero_point: jq.qlinear_matmul(
      a, np.float32(0.02), a_zero_point, b, b_scale, b_zero_point, np.float32(128.0),
      np.uint8(128)))
  b_scale = rng.uniform(0.01, 0.05, n).astype(np.float32)
  for parameters, b_parameters in [("per-tensor", (b_scale[:1], b_zero_point[:1])),
                                   ("per-column", (b_scale, b_zero_point))]:
    for layout, a_spec, a_zero_point_spec, b_spec, per_column_spec, out_spec in [
        ("rows", P("c", None), P("c"), P(), P(), P("c", None)),
        ("N", P(), P(), P(None, "c"), P("c"), P(None, "c")),
        ("K", P(None, "c"), P(), P("c", None), P(), P(None, None)),
    ]:
      b_parameters_spec = per_column_spec if parameters == "per-column" else P()
      check("1d", "qlinear_matmul", f"{layout},{parameters}", qlinear_matmul,
            (a[:, :depth], a_zero_point, b[:depth], *b_parameters),
            (a_spec, a_zero_point_spec, b_spec, b_parameters_spec, b_parameters_spec),
            out_spec)

  batch, rows, depth = 8, 16, 512
  lhs = rng.integers(0, 256, (batch, rows, depth), np.uint8)
  rhs = rng.integers(-128, 128, (batch, depth, n), np.int8)
  lhs_zero_point = rng.integers(0, 256, (batch, rows, 1)).astype(np.uint8)
  rhs_scale = rng.uniform(0.01, 0.05, (batch, 1, n)).astype(np.float32)
  rhs_zero_point = rng.integers(-128, 128, (batch, 1, n)).astype(np.int8)
  quantized_dot_general = jax.jit(
      lambda lhs, rhs, lhs_zero_point, rhs_scale, rhs_zero_point: jq.quantized_dot_general(
          lhs, rhs, (((2,), (1,)), ((0,), (0,))), lhs_scale=np.float32(0.02),
          lhs_zero_point=lhs_zero_point, rhs_scale=rhs_scale, rhs_zero_point=rhs_zero_point))
  for mesh_name, layout, lhs_spec, rhs_spec in [
      ("1d", "batch", P("c", None, None), P("c", None, None)),
      ("2d", "batch+N", P("r", None, None), P("r", None, "c")),
  ]:
    check(mesh_name, "quantized_dot_general", layout, quantized_dot_general,
          (lhs, rhs, lhs_zero_point, rhs_scale, rhs_zero_point),
          (lhs_spec, rhs_spec, lhs_spec, rhs_spec, rhs_spec), rhs_spec)


def weight_only_cases():
  """The float layers on int4 weights in blocks of 32 along K, quantized where they lie.

  Weight-only (packed): split along N, quantize_params packs each row (a flat
  stream cannot be split by column) and every device dequantizes and multiplies
  its own columns; split along rows, the weight is replicated. QAT
  (dot_general_fake_quant on a learnable FakeQuantizedArray, activations per
  row): the same splits. Not along K: XLA adds the float partials across
  devices, in another order than one device's dot (the int8 layer above is
  exact there)."""
  k, n, rows = 1024, 512, 16
  mesh = make_mesh("1d")
  rng = np.random.default_rng(7)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) / 32).astype(np.float32)
  dimension_numbers = (((1,), (0,)), ((), ()))
  rule = jq.QuantizationRule(dtype=jnp.int4, axis=0, block_size=32)
  layers = {"dot_general_weight_only": (jq.dot_general_weight_only, False),
            "dot_general_fake_quant": (jq.dot_general_fake_quant, True)}
  for name, (layer, learnable) in layers.items():
    quantized = functools.partial(jq.quantize_params, rules=rule, learnable=learnable)
    f = jax.jit(lambda x, w, layer=layer: layer(x, w, dimension_numbers))
    want = f(x, quantized(jnp.asarray(w)))
    for layout, x_spec, w_spec, out_spec in [
        ("N", P(), P(None, "c"), P(None, "c")),
        ("rows", P("c", None), P(), P("c", None)),
    ]:
      weight = quantized(jax.device_put(w, NamedSharding(mesh, w_spec)))
      stored = weight.value if learnable else weight.values
      assert stored.sharding.is_equivalent_to(
          NamedSharding(mesh, w_spec), stored.ndim), (name, layout, stored.sharding)
      arguments = (jax.device_put(x, NamedSharding(mesh, x_spec)), weight)
      report(f"jit 1d xla {name} {layout} -", f(*arguments), want,
             f.lower(*arguments).compile().as_text(), NamedSharding(mesh, out_spec),
             stored.size // mesh.size // 16)


def vmap_cases():
  """vmap over a leading dim of x: the kernels' batch is one more partitioned dim.

  On the explicit mesh (``typed``) also the dynamic statistics per tensor and per
  axis, x split along the vmapped dim and a dim each example keeps: their NaN
  ``cond`` is a select under vmap, which an explicit mesh types.
  """
  columns, block_size = BLOCKED["aligned"]
  rng = np.random.default_rng(11)
  x = (rng.standard_normal((4, ROWS, columns)) * 0.1).astype(np.float32)
  x[1, 2, 3] = np.nan  # one example takes the NaN-aware statistics, the others not
  s, _, kw = layouts(columns, block_size)["blocked"]
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = make_mesh("2d", axis_type)
    x_sharding = NamedSharding(mesh, P("r", None, "c"))
    xs = jax.device_put(x, x_sharding)
    prefix = "typed" if axis_type == AxisType.Explicit else "jit"
    for implementation in ("xla", "pallas"):
      cases = [
          ("vmap(quantize_linear)", "blocked", lambda x: jq.quantize_linear(
              x, s, **kw, output_dtype=jnp.int8, implementation=implementation)),
          ("vmap(dynamic_quantize_linear)", "blocked", lambda x: jq.dynamic_quantize_linear(
              x, **kw, implementation=implementation))]
      for layout, layout_kw in [("per-tensor", {}), ("per-axis", dict(axis=0))]:
        if axis_type == AxisType.Explicit:
          cases.append(("vmap(dynamic_quantize_linear)", layout, functools.partial(
              jq.dynamic_quantize_linear, **layout_kw, implementation=implementation)))
        if axis_type == AxisType.Explicit and implementation == "xla":
          cases.append(("vmap(fake_quantize_dynamic)", layout,
                        functools.partial(jq.fake_quantize_dynamic, **layout_kw)))
      for name, layout, op in cases:
        f = jax.jit(jax.vmap(op))
        report(f"{prefix} 2d {implementation} {name} {layout} aligned", f(xs), f(x),
               f.lower(xs).compile().as_text(), x_sharding, x.size // mesh.size)


def shard_map_cases():
  """The ops inside ``jax.shard_map`` with its default options, on the 2-D mesh.

  Inside shard_map an op sees one shard: blocked parameters are sharded with
  x (blocks whole in a shard), and dynamic quantization's statistics are the
  shard's own. Each is compared with the op applied to every shard on one
  device.
  """
  shape, _, spec = MESHES["2d"]
  mesh = make_mesh("2d", AxisType.Explicit)
  columns, block_size = BLOCKED["aligned"]
  rng = np.random.default_rng(7)
  x = (rng.standard_normal((ROWS, columns)) * 0.1).astype(np.float32)
  q = rng.integers(-8, 8, (ROWS, columns)).astype(jnp.int4)
  s, _, kw = layouts(columns, block_size)["blocked"]
  rows, cols = ROWS // shape[0], columns // shape[1]
  shards = [(slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols),
             slice(j * cols // block_size, (j + 1) * cols // block_size))
            for i in range(shape[0]) for j in range(shape[1])]
  x_sharding = NamedSharding(mesh, spec)

  def check(case, op, data, *params, out_specs=spec):
    got = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(spec,) * (1 + len(params)),
                                out_specs=out_specs))(
        *(jax.device_put(a, x_sharding) for a in (data, *params)))
    want = np.zeros(jax.tree.leaves(got)[0].shape, jax.tree.leaves(got)[0].dtype)
    for r, c, blocks in shards:
      local = [p[r, c] if p.shape == data.shape else p[r, blocks] for p in params]
      want[r, c] = np.asarray(jax.tree.leaves(op(data[r, c], *local))[0])
    report(f"shard_map 2d {case}", jax.tree.leaves(got)[0], jnp.asarray(want), None,
           x_sharding, 0)

  for implementation in ("xla", "pallas"):
    impl = dict(implementation=implementation)
    check(f"{implementation} quantize_linear blocked aligned",
          lambda x, s: jq.quantize_linear(x, s, **kw, output_dtype=jnp.int8, **impl), x, s)
    check(f"{implementation} dequantize_linear blocked aligned",
          lambda q, s: jq.dequantize_linear(q, s, **kw, **impl), q, s)
    check(f"{implementation} dynamic_quantize_linear blocked aligned",
          lambda x: jq.dynamic_quantize_linear(x, **kw, **impl), x,
          out_specs=(spec, spec, spec))
    check(f"{implementation} quantized_add per-tensor",
          lambda a, b: jq.quantized_add(a, 0.02, None, b, 0.03, None, 0.05, **impl),
          q.astype(np.int8), q.astype(np.int8)[::-1])
  # Per-axis parameters beside a shard of rows: a column's scale replicated, a
  # row's split with x; interpret mode's loop refused operands still marked
  # varying. Every row is quantized on its own, so one device's whole result is
  # the shards' together.
  rows_spec = P("r", None)
  rows_sharding = NamedSharding(mesh, rows_spec)
  column_scale = rng.uniform(0.01, 0.05, columns).astype(np.float32)
  row_scale = rng.uniform(0.01, 0.05, ROWS).astype(np.float32)
  for implementation in ("xla", "pallas"):
    impl = dict(implementation=implementation)
    for case, op, params, specs, out_specs in [
        ("quantize_linear per-column replicated",
         lambda x, s: jq.quantize_linear(x, s, axis=1, output_dtype=jnp.int8, **impl),
         (column_scale,), (P(),), rows_spec),
        ("dequantize_linear per-column replicated",
         lambda x, s: jq.dequantize_linear(jq.quantize_linear(x, 0.01, output_dtype=jnp.int8),
                                           s, axis=1, **impl),
         (column_scale,), (P(),), rows_spec),
        ("quantize_linear per-row split",
         lambda x, s: jq.quantize_linear(x, s, axis=0, output_dtype=jnp.int8, **impl),
         (row_scale,), (P("r"),), rows_spec),
        ("dynamic_quantize_linear per-row",
         lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0, **impl), (), (),
         (rows_spec, P("r"), P("r")))]:
      got = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(rows_spec, *specs),
                                  out_specs=out_specs))(
          jax.device_put(x, rows_sharding),
          *(jax.device_put(p, NamedSharding(mesh, spec)) for p, spec in zip(params, specs)))
      report(f"shard_map 2d {implementation} {case}", got, op(x, *params), None,
             rows_sharding, 0)
  # A kernel's output varies over the axes its inputs vary over: claiming it
  # replicated (out_specs=P()) must be refused, as for XLA's ops.
  try:
    jax.jit(jax.shard_map(
        lambda x: jq.quantize_linear(x, 0.5, implementation="pallas"), mesh=mesh,
        in_specs=spec, out_specs=P()))(jax.device_put(x, x_sharding))
    refused = False
  except ValueError:
    refused = True
  print(json.dumps(dict(case="shard_map 2d pallas output replicated refused",
                        equal=refused, sharding=refused, collectives=None)), flush=True)
  # The same kernels inside shard_map lower for TPU (Mosaic) and CUDA (Triton).
  for platform, marker in [("tpu", "tpu_custom_call"), ("cuda", "triton")]:
    lowered = jax.jit(jax.shard_map(
        lambda x, s: jq.quantize_linear(x, s, **kw, output_dtype=jnp.int8,
                                        implementation="pallas"),
        mesh=mesh, in_specs=(spec, spec), out_specs=spec,
    )).trace(jax.device_put(x, x_sharding), jax.device_put(s, x_sharding)).lower(
        lowering_platforms=(platform,)).as_text()
    found = marker in lowered.lower()
    print(json.dumps(dict(case=f"shard_map 2d pallas quantize_linear lowers for {platform}",
                          equal=found, sharding=found, collectives=None)), flush=True)
  check("xla fake_quantize blocked aligned", lambda x, s: jq.fake_quantize(x, s, **kw), x, s)
  check("xla fake_quantize_learnable blocked aligned",
        lambda x, s: jq.fake_quantize_learnable(x, s, **kw), x, s)
  check("xla fake_quantize_dynamic blocked aligned",
        lambda x: jq.fake_quantize_dynamic(x, **kw), x)


def explicit_mesh_packing_cases():
  """Under an explicit-sharding mesh the sharding is part of the type."""
  mesh, spec = make_mesh("2d", AxisType.Explicit), MESHES["2d"][2]
  q = np.random.default_rng(3).integers(-8, 8, (ROWS, 64)).astype(jnp.int4)
  qs = jax.device_put(q, NamedSharding(mesh, spec))
  report("explicit 2d - pack rows - aligned", jq.pack(qs, layout="rows"),
         jq.pack(q, layout="rows"), None, NamedSharding(mesh, spec), 0)
  try:
    jq.pack_int4(qs)
    refused = False
  except ValueError as error:
    refused = "layout='rows'" in str(error)
  print(json.dumps(dict(case="explicit 2d - flat pack of column shards refused",
                        equal=refused, sharding=refused, collectives=None)), flush=True)
  # The default implementation chooses per platform when lowered for this
  # route (blocked packed int4): its results' types held no split, so a
  # weight of split rows came back whole on every device.
  mesh, spec = make_mesh("1d", AxisType.Explicit), P("c", None)
  rng = np.random.default_rng(4)
  q = rng.integers(-8, 8, (64, 16)).astype(jnp.int4)
  scale = rng.uniform(0.01, 0.05, (64, 2)).astype(np.float32)
  f = jax.jit(lambda p, s: jq.dequantize_linear(p, s, axis=1, block_size=8,
                                                packed_shape=q.shape, packed_dtype=jnp.int4))
  want = f(jq.pack(q, layout="rows"), scale)
  with jax.set_mesh(mesh):  # where a split is read from the types
    args = (jax.device_put(jq.pack(q, layout="rows"), NamedSharding(mesh, spec)),
            jax.device_put(scale, NamedSharding(mesh, spec)))
    report("explicit 1d default dequantize_linear(packed rows) blocked, rows split", f(*args),
           want, f.lower(*args).compile().as_text(), NamedSharding(mesh, spec), q.size // 8)


def explicit_mesh_layer_cases():
  """Layers on an explicit mesh, where a split is part of an array's type.

  * a of shape (batch, M, K) split along M: the int8 dot does not merge a's free
    dims into rows there (an explicit mesh cannot type that reshape).
  * A zero point on a (every uint8 a) with a's rows split: under automatic
    sharding the row of ones appended to a's rows (rhs's sums over K) moves a
    between devices (integer_matmul_cases); here the row goes along a whole
    dim, or, where a has none, rhs's sums are a product of their own.
  * The int8 drop-ins, matmul_integer, qlinear_matmul and quantized_dot_general
    split along K (out_sharding then required, as by lax and jnp.matmul): the
    integer product's dots and int32 sums are placed by automatic sharding.
  * Blocked parameters expanded along a split dim take x's split (a select
    takes only cases split alike).
  * An observer of a split batch gathers it (its histogram is one scatter over
    the flattened batch).
  """
  mesh = make_mesh("1d", AxisType.Explicit)
  rng = np.random.default_rng(9)
  rows, depth, n = 16, 512, 64
  a = rng.integers(0, 256, (rows, depth), np.uint8)
  a_zero_point = rng.integers(0, 256, rows).astype(np.uint8)
  b = rng.integers(-128, 128, (depth, n), np.int8)
  x = rng.standard_normal((rows, depth)).astype(np.float32)
  weight_float = jnp.asarray(rng.standard_normal((depth, n)), jnp.float32) / 16
  weight = jq.quantize_params(weight_float, jq.QuantizationRule(dtype=jnp.int8))
  # Stored (n, depth): the split of K is the values' second dim.
  transposed = jq.quantize_params(weight_float, jq.QuantizationRule(dtype=jnp.int8,
                                                                    transposed=True))
  image = rng.standard_normal((2, 5, 5, 16)).astype(np.float32)
  kernel = (rng.standard_normal((3, 3, 16, 8)) / 8).astype(np.float32)
  # Blocks of 2 rows: a device's 2 rows are one block.
  blocked_scale = rng.uniform(0.01, 0.05, (rows // 2, depth)).astype(np.float32)
  blocked_zero_point = rng.integers(-8, 8, (rows // 2, depth)).astype(np.int8)
  dense = lambda x: (((x.ndim - 1,), (0,)), ((), ()))
  static = lambda x, w, **options: jq.dot_general_static_int8(
      x, w, dense(x), input_scale=0.02, input_zero_point=np.int8(-7), **options)
  dynamic = lambda x, w, **options: jq.dot_general_dynamic_int8(x, w, dense(x), **options)
  conv = lambda x, w, **options: jq.conv_general_dilated_dynamic_int8(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), **options)
  qlinear_matmul = lambda a, a_zero_point, b, **options: jq.qlinear_matmul(
      a, np.float32(0.02), a_zero_point, b, np.float32(0.03), np.int8(5), np.float32(4.0),
      np.uint8(128), **options)
  quantized_dot_general = lambda a, b, **options: jq.quantized_dot_general(
      a, b, dense(a), lhs_scale=np.float32(0.02), lhs_zero_point=np.uint8(128),
      rhs_scale=np.float32(0.03), **options)
  blocked = lambda x, s, z: jq.quantize_linear(x, s, z, axis=0, block_size=2)
  observed = lambda x: jq.observe(jq.init_observer(momentum=0.9), x)
  replicated = P()

  def put(argument, spec):
    if spec is None:
      return argument
    # A stored kernel's leaves: values split as given, its scale (per column) whole.
    return jax.tree.map(lambda leaf: jax.device_put(leaf, NamedSharding(
        mesh, spec if np.ndim(leaf) == len(spec) else P())), argument)

  for op, f, arguments, specs, out_spec in [
      ("matmul_integer rows", jq.matmul_integer, (a, b, a_zero_point),
       (P("c", None), P(), P("c")), P("c", None)),
      ("qlinear_matmul rows", qlinear_matmul, (a, a_zero_point, b),
       (P("c", None), P("c"), P()), P("c", None)),
      # A batch of sequences split along the sequence: the free dims are not merged.
      ("matmul_integer (b,M) M", jq.matmul_integer, (a.reshape(2, 8, depth), b),
       (P(None, "c", None), P()), P(None, "c", None)),
      ("qlinear_matmul (b,M) M", qlinear_matmul, (a.reshape(2, 8, depth), np.uint8(3), b),
       (P(None, "c", None), P(), P()), P(None, "c", None)),
      ("dot_general_static_int8 rows", static, (x, weight), (P("c", None), None), P("c", None)),
      # A batch of sequences split: the row goes along the whole sequence dim.
      ("dot_general_static_int8(b,T) rows", static, (x.reshape(8, 2, depth), weight),
       (P("c", None, None), None), P("c", None, None)),
      # Contracted dims split: lax's contractions then take out_sharding.
      ("matmul_integer K", jq.matmul_integer, (a, b, a_zero_point),
       (P(None, "c"), P("c", None), P()), replicated),
      ("qlinear_matmul K", qlinear_matmul, (a, a_zero_point, b),
       (P(None, "c"), P(), P("c", None)), replicated),
      ("quantized_dot_general K", quantized_dot_general, (a, b),
       (P(None, "c"), P("c", None)), replicated),
      ("dot_general_dynamic_int8 K", dynamic, (x, jax.tree.map(np.asarray, weight)),
       (P(None, "c"), P("c", None)), replicated),
      ("dot_general_static_int8 K", static, (x, jax.tree.map(np.asarray, weight)),
       (P(None, "c"), P("c", None)), replicated),
      ("dot_general_static_int8 transposed rows", static, (x, transposed),
       (P("c", None), None), P("c", None)),
      ("dot_general_dynamic_int8 transposed K", dynamic, (x, jax.tree.map(np.asarray, transposed)),
       (P(None, "c"), P(None, "c")), replicated),
      ("conv_general_dilated_dynamic_int8 C", conv, (image, kernel),
       (P(None, None, None, "c"), P(None, None, "c", None)), replicated),
      # Parameters whole on every device, expanded unsplit.
      ("quantize_linear blocked rows", blocked, (x, blocked_scale, blocked_zero_point),
       (P("c", None), P(), P()), P("c", None)),
      # A calibration batch split: the observer's statistics are of the whole batch.
      ("observe rows", observed, (x,), (P("c", None),), replicated),
      ("observe columns", observed, (x,), (P(None, "c"),), replicated),
  ]:
    sharded = [put(argument, spec) for argument, spec in zip(arguments, specs)]
    want = jax.jit(f)(*arguments)
    if op.endswith((" K", " C")):
      f = functools.partial(f, out_sharding=replicated)
    with jax.set_mesh(mesh):
      jitted = jax.jit(f)
      got, compiled = jitted(*sharded), jitted.lower(*sharded).compile().as_text()
    # Counted from a shard of the activations: they, or a weight as large, moving show.
    report(f"explicit 1d xla {op} -", got, want, compiled, NamedSharding(mesh, out_spec),
           np.size(arguments[0]) // mesh.size)


def choose_qparams_cases():
  """choose_qparams by every method on the 1-D mesh, automatic and explicit: per tensor,
  per column (the split dim) and in blocks of 32 columns (qmax_plus_half, absmax's
  statistic, in blocks only). Automatic sharding places the symmetric recipes' zero
  point, a constant of zeros, whole on every device: their scale alone is reported there
  (on an explicit mesh the zeros are split as the scale)."""
  columns, block_size = BLOCKED["aligned"]
  x = (np.random.default_rng(12).standard_normal((ROWS, columns)) * 0.1).astype(np.float32)
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = make_mesh("1d", axis_type)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "c")))
    for layout, options, out_spec in [
        ("per-tensor", {}, P()), ("per-column", dict(axis=1), P("c")),
        ("blocked", dict(axis=1, block_size=block_size), P(None, "c"))]:
      for method in ("absmax", "qmax_plus_half", "minmax", "percentile", "mse"):
        if method == "qmax_plus_half" and layout != "blocked":
          continue
        f = jax.jit(functools.partial(
            jq.choose_qparams, dtype=jnp.uint8 if method == "minmax" else jnp.int4,
            method=method, **options))
        with jax.set_mesh(mesh):
          got, compiled = f(xs), f.lower(xs).compile().as_text()
        want = f(x)
        if axis_type == AxisType.Auto and method != "minmax":
          got, want = got[0], want[0]
        report(f"choose_qparams {axis_type.name.lower()} 1d {method} {layout}", got, want,
               compiled, NamedSharding(mesh, out_spec), x.size // mesh.size)


def statistics_gradient_cases():
  """d/dx of blocked dynamic statistics (the scale of ``dynamic_quantize_linear``), on
  automatic and explicit 1-D meshes, blocks whole in each shard and cut by shard edges, with
  a maximum shared by several elements of a block: each gets an equal part, as on one
  device (a JVP of windowed reductions)."""
  for shard_name, (columns, block_size) in BLOCKED.items():
    x = np.random.default_rng(13).standard_normal((ROWS, columns)).astype(np.float32)
    x[:, 0:3] = x[:, 5:8] = 9.0  # tied maxima in the first block, some across its shard
    f = jax.jit(jax.grad(lambda x, block_size=block_size: jnp.sum(
        jq.dynamic_quantize_linear(x, axis=1, block_size=block_size)[1])))
    for axis_type in (AxisType.Auto, AxisType.Explicit):
      mesh = make_mesh("1d", axis_type)
      sharding = NamedSharding(mesh, P(None, "c"))
      xs = jax.device_put(x, sharding)
      with jax.set_mesh(mesh):
        got, compiled = f(xs), f.lower(xs).compile().as_text()
      report(f"gradient {axis_type.name.lower()} 1d dynamic_quantize_linear blocked {shard_name}",
             got, one_device(f"gradient {shard_name}", f, x), compiled, sharding,
             x.size // mesh.size)


def drop_in_gradient_cases():
  """d/dx and d/dkernel of the int8 drop-ins (straight-through: the float product of the
  fake-quantized operands) on automatic and explicit 1-D meshes, x split along its rows (data
  parallel) or along K with the kernel (row-parallel, out_sharding replicated), an image along
  its batch or its input features with the kernel's (out_sharding replicated): one device's
  gradients, to float32 rounding where a split contraction adds partials across devices."""
  rng = np.random.default_rng(14)
  rows, depth, n = 16, 256, 32
  x = rng.standard_normal((rows, depth)).astype(np.float32)
  kernel = (rng.standard_normal((depth, n)) / 16).astype(np.float32)
  cotangent = rng.standard_normal((rows, n)).astype(np.float32)
  image = rng.standard_normal((8, 5, 5, 16)).astype(np.float32)
  filters = (rng.standard_normal((3, 3, 16, 32)) / 8).astype(np.float32)
  image_cotangent = rng.standard_normal((8, 5, 5, 32)).astype(np.float32)
  dense = (((1,), (0,)), ((), ()))
  conv = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  static = dict(input_scale=0.01, input_zero_point=np.int8(-7))
  rows_or_k = [("rows", P("c", None), P()), ("K", P(None, "c"), P("c", None))]
  batch_or_features = [("N", P("c", None, None, None), P()),
                       ("C", P(None, None, None, "c"), P(None, None, "c", None))]
  drop_ins = {
      "dot_general_dynamic_int8": (lambda x, w, **o: jq.dot_general_dynamic_int8(
          x, w, dense, **o), (x, kernel, cotangent), rows_or_k),
      "dot_general_static_int8": (lambda x, w, **o: jq.dot_general_static_int8(
          x, w, dense, **static, **o), (x, kernel, cotangent), rows_or_k),
      "conv_general_dilated_dynamic_int8": (
          lambda x, w, **o: jq.conv_general_dilated_dynamic_int8(x, w, **conv, **o),
          (image, filters, image_cotangent), batch_or_features),
      "conv_general_dilated_static_int8": (
          lambda x, w, **o: jq.conv_general_dilated_static_int8(x, w, **conv, **static, **o),
          (image, filters, image_cotangent), batch_or_features),
  }
  for (name, (drop_in, (x, kernel, cotangent), layouts)), axis_type in itertools.product(
      drop_ins.items(), (AxisType.Auto, AxisType.Explicit)):
    def gradients(x, kernel, drop_in=drop_in, options=None, cotangent=cotangent):
      return jax.grad(lambda x, w: jnp.sum(cotangent * drop_in(x, w, **(options or {}))),
                      argnums=(0, 1))(x, kernel)

    for layout, x_spec, kernel_spec in layouts:
      # A contraction split across devices: lax's takes out_sharding (the result's).
      options = dict(out_sharding=P()) if layout in ("K", "C") else {}
      mesh = make_mesh("1d", axis_type)
      arguments = (jax.device_put(x, NamedSharding(mesh, x_spec)),
                   jax.device_put(kernel, NamedSharding(mesh, kernel_spec)))
      f = jax.jit(functools.partial(gradients, options=options))
      with jax.set_mesh(mesh):
        got, compiled = f(*arguments), f.lower(*arguments).compile().as_text()
      report(f"drop-in gradient {axis_type.name.lower()} 1d {name} {layout}", got,
             one_device(f"gradient {name}", jax.jit(gradients), x, kernel),
             compiled, NamedSharding(mesh, x_spec), x.size // mesh.size)


def two_axis_split_cases():
  """A dim split over both axes of an explicit 2-D mesh (8 shards, ``P(("r", "c"))``).

  Whether a shard edge cuts a block, or a byte of packed rows, depends on the
  shard count, the product of both axes' sizes: 6 rows a shard cut blocks of 4
  (48 rows; 4 shards, one axis's, would hold 12: whole blocks), and 5 int4
  columns a shard cut a byte (40 columns; 10 a shard would not). A kernel's shard
  reads its blocks' parameters at its index among all 8.
  """
  mesh = make_mesh("2d", AxisType.Explicit)
  rng = np.random.default_rng(16)
  x = rng.standard_normal((48, 32)).astype(np.float32)
  codes = rng.integers(-8, 8, (4, 40)).astype(jnp.int4)
  scale = rng.uniform(0.01, 0.05, (12, 32)).astype(np.float32)
  zero_point = rng.integers(-8, 8, (12, 32)).astype(np.int8)
  for op, f, argument, spec in [
      # The kernel finds each element's block from its shard's first row: the shard's index
      # among 8, both axes' (r * 2 + c).
      ("quantize_linear pallas blocked rows", lambda x: jq.quantize_linear(
          x, scale, zero_point, axis=0, block_size=4, implementation="pallas"), x,
       P(("r", "c"), None)),
      ("dynamic_quantize_linear blocked rows", lambda x: jq.dynamic_quantize_linear(
          x, dtype=jnp.int8, axis=0, block_size=4), x, P(("r", "c"), None)),
      ("choose_qparams blocked rows", lambda x: jq.choose_qparams(x, axis=0, block_size=4),
       x, P(("r", "c"), None)),
      ("pack rows int4 columns", lambda c: jq.pack(c, layout="rows"), codes,
       P(None, ("r", "c"))),
  ]:
    sharded = jax.device_put(argument, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
      jitted = jax.jit(f)
      got, compiled = jitted(sharded), jitted.lower(sharded).compile().as_text()
    report(f"two-axis 2d {op} -", got, jax.jit(f)(argument), compiled,
           NamedSharding(mesh, spec), argument.size // mesh.size)


def uneven_split_cases():
  """Operands that XLA splits unevenly (7 rows over 8 devices, 3 bytes over 2): automatic
  sharding allows it, and a kernel's partition callback must read such a split and gather
  the dim rather than fail. Each op under ``jit`` on an operand constrained to such a
  split, both implementations: one device's bits. The packed case has 6 int4 columns over
  2 devices, a whole count of codes per shard but not of bytes."""
  rng = np.random.default_rng(17)
  x = rng.standard_normal((7, 12)).astype(np.float32)
  q = rng.integers(-100, 100, (7, 12)).astype(np.int8)
  codes = rng.integers(-8, 8, (7, 6)).astype(jnp.int4)
  columns = rng.uniform(0.01, 0.05, 12).astype(np.float32)
  blocked = rng.uniform(0.01, 0.05, (7, 3)).astype(np.float32)
  # 9 rows over 4 devices, 3 a shard: XLA:CPU sums a dot of one row in another order.
  k, n, block_size = 64, 64, 32
  a = rng.standard_normal((9, k)).astype(np.float32)
  weight = (rng.integers(0, 256, (n, k // block_size, block_size // 2), np.uint8),
            rng.uniform(0.01, 0.05, (n, k // block_size)).astype(np.float32),
            rng.integers(0, 256, (n, k // block_size // 2), np.uint8))
  for implementation in ("xla", "pallas"):
    impl = dict(implementation=implementation)
    for case, mesh_name, spec, f, argument in [
        ("quantize_linear per-tensor rows", "1d", P("c", None), lambda x: jq.quantize_linear(
            x, np.float32(0.02), np.int8(3), **impl), x),
        ("quantize_linear per-axis columns", "1d", P(None, "c"), lambda x: jq.quantize_linear(
            x, columns, axis=1, **impl), x),
        ("quantize_linear blocked rows", "1d", P("c", None), lambda x: jq.quantize_linear(
            x, blocked, axis=1, block_size=4, output_dtype=jnp.int4, **impl), x),
        ("dequantize_linear per-axis rows", "1d", P("c", None), lambda q: jq.dequantize_linear(
            q, columns, axis=1, **impl), q),
        ("dequantize_linear(packed rows) columns", "2d", P(None, "c"),
         lambda p: jq.dequantize_linear(p, np.float32(0.5), packed_shape=codes.shape,
                                        packed_dtype=jnp.int4, **impl),
         jq.pack(codes, layout="rows")),
        ("dynamic_quantize_linear per-tensor rows", "1d", P("c", None),
         lambda x: jq.dynamic_quantize_linear(x, **impl), x),
        ("dynamic_quantize_linear per-row rows", "1d", P("c", None),
         lambda x: jq.dynamic_quantize_linear(x, dtype=jnp.int8, axis=0, **impl), x),
        ("quantized_add rows", "1d", P("c", None), lambda q: jq.quantized_add(
            q, 0.02, 1, q.T.reshape(q.shape), 0.03, -2, 0.04, 0, **impl), q),
        ("matmul_nbits rows", "2d", P("r", None), lambda a: jq.matmul_nbits(
            a, *weight, K=k, N=n, block_size=block_size, **impl), a),
    ]:
      mesh = make_mesh(mesh_name)

      def constrained(argument, f=f, sharding=NamedSharding(mesh, spec)):
        return f(jax.lax.with_sharding_constraint(argument, sharding))

      jitted = jax.jit(constrained)
      report(f"uneven {mesh_name} {implementation} {case} -", jitted(argument),
             jax.jit(f)(argument), None, NamedSharding(mesh, P()), argument.size)


def checked_cases():
  """``checked`` of a jitted per-column quantize, x and its parameters split along the
  columns: good values give one device's bits with x's split and move nothing; a bad
  scale on one device's shard is reported with its global index."""
  from jax.experimental import checkify  # pylint: disable=import-outside-toplevel

  mesh = make_mesh("1d")
  rng = np.random.default_rng(13)
  x = rng.standard_normal((ROWS, 256)).astype(np.float32)
  scale = (rng.random(256) + 0.5).astype(np.float32)
  zero_point = rng.integers(-3, 3, 256).astype(np.int8)
  quantize = jax.jit(lambda x, s, z: jq.quantize_linear(x, s, z, axis=1))
  placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in
            zip((x, scale, zero_point), (P(None, "c"), P("c"), P("c")))]
  checked = jq.checked(quantize)
  report("checked 1d quantize_linear per-column -", checked(*placed),
         quantize(x, scale, zero_point), quantize.lower(*placed).compile().as_text(),
         NamedSharding(mesh, P(None, "c")), x.size // mesh.size)
  scale[200] = np.nan  # in the seventh device's shard
  placed[1] = jax.device_put(scale, NamedSharding(mesh, P("c")))
  try:
    checked(*placed)
  except checkify.JaxRuntimeError as error:
    assert str(error).startswith(
        "quantize_linear: scale must be finite and > 0, got nan at index (200,)"), error
  else:
    raise AssertionError("a NaN scale on a shard was not reported")


def _mlp(mesh, *, seed):
  """A 256-512-256 Flax NNX MLP: ``(nnx, graphdef, state, state split Megatron-style)``,
  the first layer along its outputs and the second along its inputs."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class MLP(nnx.Module):

    def __init__(self, rngs):
      self.up = nnx.Linear(256, 512, rngs=rngs)
      self.down = nnx.Linear(512, 256, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  graphdef, state = nnx.split(MLP(nnx.Rngs(seed)))
  megatron = nnx.State({"up": {"kernel": P(None, "c"), "bias": P("c")},
                        "down": {"kernel": P("c", None), "bias": P()}})
  placed = jax.device_put(state, jax.tree.map(
      lambda spec: NamedSharding(mesh, spec), megatron, is_leaf=lambda leaf: isinstance(leaf, P)))
  return nnx, graphdef, state, placed


def calibration_cases():
  """``calibrate`` of an NNX MLP on batches split along their rows, its parameters whole
  (data parallel) or split Megatron-style: the first layer's calibrated input scale and
  zero point are one device's bits (its input is the batch); the second layer observes
  the first one's float output, which XLA:CPU's float dot sums in an order that depends
  on the rows and columns each device holds: within float32 rounding."""
  mesh = make_mesh("1d")
  nnx, graphdef, state, megatron = _mlp(mesh, seed=1)
  rng = np.random.default_rng(14)
  batches = [rng.standard_normal((64, 256)).astype(np.float32) for _ in range(3)]
  split = [jax.device_put(batch, NamedSharding(mesh, P("c", None))) for batch in batches]
  layouts = {"data-parallel": state, "megatron": megatron}
  want = jq.calibrate(nnx.merge(graphdef, state), batches)["dot_general"]
  for layout, params in layouts.items():
    got = jq.calibrate(nnx.merge(graphdef, params), split)["dot_general"]
    for path in ("up", "down"):
      report(f"calibrate 1d {layout} {path}", tuple(got[path].keywords.values()),
             tuple(want[path].keywords.values()), None, NamedSharding(mesh, P()), 0)


def served_model_cases():
  """A Flax NNX MLP served from kernels stored in its layers, split as Megatron splits
  it (the first layer along its outputs, the second along its inputs): one device's
  logits (weight-only's float dot, split along K, within float32 rounding of them),
  and no device receives another's weight. The kernels are quantized where they lie
  (quantize_params keeps each dim's split)."""
  mesh = make_mesh("1d")
  x = np.random.default_rng(8).standard_normal((16, 256)).astype(np.float32)
  nnx, graphdef, state, placed = _mlp(mesh, seed=0)
  for flow, rule, op in [
      ("dynamic_int8", jq.QuantizationRule(pattern="kernel"), jq.dot_general_dynamic_int8),
      ("dynamic_int8_transposed", jq.QuantizationRule(pattern="kernel", transposed=True),
       jq.dot_general_dynamic_int8),
      ("weight_only_int4", jq.QuantizationRule(pattern="kernel", dtype=jnp.int4, axis=-2,
                                               block_size=32), jq.dot_general_weight_only),
  ]:
    quantize = jax.jit(functools.partial(jq.quantize_params, rules=rule))
    model = nnx.merge(graphdef, quantize(state))
    jq.replace_ops(model, dot_general=op)
    served_graphdef, stored = nnx.split(model)
    forward = jax.jit(lambda stored, x, g=served_graphdef: nnx.merge(g, stored)(x))
    sharded = quantize(placed)
    for layer in ("up", "down"):
      values = sharded[layer]["kernel"].get_value().values
      assert values.addressable_shards[0].data.size * mesh.size == values.size, values.sharding
    report(f"served 1d {flow} megatron -", forward(sharded, x), forward(stored, x),
           forward.lower(sharded, x).compile().as_text(), NamedSharding(mesh, P()),
           256 * 512 // mesh.size // 4)


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  for mesh_name in MESHES:
    jit_cases(mesh_name)
    jit_cases(mesh_name, AxisType.Explicit)
  matmul_nbits_cases()
  weight_only_cases()
  dot_general_cases()
  conv_cases()
  integer_matmul_cases()
  vmap_cases()
  one_element_shard_cases()
  shard_map_cases()
  explicit_mesh_packing_cases()
  explicit_mesh_layer_cases()
  choose_qparams_cases()
  statistics_gradient_cases()
  drop_in_gradient_cases()
  two_axis_split_cases()
  uneven_split_cases()
  checked_cases()
  calibration_cases()
  served_model_cases()
