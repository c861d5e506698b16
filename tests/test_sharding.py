"""Every op on 8 simulated devices equals one device, keeps x's sharding, gathers no data.

The devices exist only in a fresh process (XLA reads
``--xla_force_host_platform_device_count`` at start-up), so
``tests/sharding_check.py`` runs in a subprocess and reports each case as a
JSON line; these tests read the report (docs/sharding.md).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

CHECK = pathlib.Path(__file__).with_name("sharding_check.py")
# One worker runs the subprocess (the module fixture), not each worker.
pytestmark = pytest.mark.xdist_group("8 devices")


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
  environment = dict(
      os.environ, JAX_PLATFORMS="cpu",
      XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                 + " --xla_force_host_platform_device_count=8").strip(),
  )
  run = subprocess.run(
      [sys.executable, str(CHECK)], env=environment, capture_output=True, text=True,
      timeout=600, check=False,
  )
  assert run.returncode == 0, run.stderr[-4000:]
  reported = [json.loads(line) for line in run.stdout.splitlines()]
  return {case["case"]: case for case in reported}


def _cuts_bytes(name: str) -> bool:
  """25 int4 columns per shard: a shard edge cuts a byte of the packed rows."""
  return "packed rows" in name and "ragged" in name and " 1d " in name


@pytest.mark.slow
def test_every_case_ran(cases):
  ops = {name.split()[3] for name in cases if name.startswith("jit")}
  assert {"quantize_linear", "dequantize_linear", "dequantize_linear(packed",
          "fake_quantize", "fake_quantize_learnable", "dynamic_quantize_linear",
          "fake_quantize_dynamic", "quantized_add", "matmul_nbits",
          "dot_general_dynamic_int8", "dot_general_static_int8", "dot_general_weight_only",
          "matmul_integer",
          "qlinear_matmul", "quantized_dot_general", "conv_general_dilated_dynamic_int8",
          "conv_general_dilated_static_int8", "conv_general_dilated_weight_only",
          "conv_general_dilated_fake_quant", "dot_general_fake_quant"} <= ops, ops
  assert any(name.startswith("jit 2d") for name in cases)
  assert any(name.startswith("shard_map") for name in cases)
  assert any("pack rows" in name for name in cases)
  assert any(name.startswith("explicit") for name in cases)


def _float_conv_split_along_features(name: str) -> bool:
  """A float convolution split along the kernel's output features, against one device's."""
  words = name.split()
  return (words[0] == "jit" and words[4] == "O"
          and words[3] in ("conv_general_dilated_weight_only", "conv_general_dilated_fake_quant"))


def _float_dot_split_along_k(name: str) -> bool:
  """A served model's float (weight-only) dot whose second layer is split along K."""
  return name.startswith("served") and "weight_only" in name


def _observes_a_float_dot(name: str) -> bool:
  """A calibrated layer whose input is a float dot of split rows or columns."""
  return name.startswith("calibrate") and name.endswith(" down")


def _float_gradient(name: str) -> bool:
  """An int8 drop-in's straight-through gradient: float dots of per-shard shapes, and sums
  across devices for the kernel's where x's rows are split."""
  return name.startswith("drop-in gradient")


@pytest.mark.slow
def test_bit_identical_to_one_device(cases):
  assert [name for name, case in cases.items()
          if not case["equal"] and not _float_conv_split_along_features(name)
          and not _float_dot_split_along_k(name) and not _observes_a_float_dot(name)
          and not _float_gradient(name)] == []


@pytest.mark.slow
def test_calibration_of_split_batches_and_parameters(cases):
  """calibrate on 8 devices, the batches split along their rows and the parameters whole
  or split Megatron-style: the first layer's input scale and zero point bit for bit one
  device's; the second's, observing a float dot, within float32 rounding."""
  calibrated = {name: case for name, case in cases.items() if name.startswith("calibrate")}
  assert len(calibrated) == 4, calibrated
  assert all(case["close"] for case in calibrated.values()), calibrated
  assert all(case["equal"] for name, case in calibrated.items()
             if not _observes_a_float_dot(name)), calibrated


@pytest.mark.slow
def test_checked_on_a_split_x_keeps_it_split_and_moves_nothing(cases):
  """The checked mode's value checks run on each shard (a bad scale on one shard is
  reported with its global index, asserted in the check itself)."""
  case = cases["checked 1d quantize_linear per-column -"]
  assert case["equal"] and case["sharding"] and case["collectives"] == [], case


@pytest.mark.slow
def test_served_model_split_megatron_style_moves_no_weight(cases):
  """Kernels stored in an NNX model's layers, split along the first layer's outputs
  and the second's inputs: the integer models (int8 kernels stored as they are and
  transposed) are one device's bit for bit, the weight-only one within float32
  rounding (its K-split float sums), and none gathers, exchanges or permutes
  anything a weight shard's quarter in size."""
  served = {name: case for name, case in cases.items() if name.startswith("served")}
  assert len(served) == 3, served
  assert all(case["close"] and case["sharding"] and case["collectives"] == []
             for case in served.values()), served
  for flow in ("dynamic_int8", "dynamic_int8_transposed"):
    assert served[f"served 1d {flow} megatron -"]["equal"], served


@pytest.mark.slow
def test_float_convolutions_split_along_features_are_each_devices_convolution(cases):
  """XLA:CPU's float convolution adds in an order that depends on the output features.

  Split along O, each device convolves 4 of the kernel's 32 features: bit for
  bit one device's convolution of each 4-feature slice (``O(per-shard)``), not
  always its convolution of all 32 (measured: 86% of the outputs differ, by at
  most 2.1e-6 on outputs up to 4.6, float32 rounding of 144-term sums): the
  partition itself is exact. The int8 convolutions, exact in any order,
  equal one device's whole.
  """
  split = {name: case for name, case in cases.items() if _float_conv_split_along_features(name)}
  per_shard = {name: case for name, case in cases.items() if " O(per-shard) " in name}
  assert len(split) == len(per_shard) == 2, (split, per_shard)
  assert all(case["equal"] and case["sharding"] for case in per_shard.values()), per_shard
  assert all(case["sharding"] for case in split.values()), split


def _windowed(name: str) -> bool:
  """Dynamic statistics of blocks cut by shard edges: windows of x, reduced in place."""
  return "dynamic" in name and ("straddling" in name or "ragged" in name)


def _appends_to_split_rows(name: str) -> bool:
  """An integer matmul split along a's rows, with a zero point on a (every uint8 a)."""
  words = name.split()
  return (words[0] == "jit"
          and words[3] in ("matmul_integer", "qlinear_matmul", "dot_general_static_int8")
          and words[4].startswith("rows") and "no-zero-point" not in words[4])


def _cuts_words(name: str) -> bool:
  """A packed int4 kernel split along O, 2 bytes of each row a device: half a 4-byte word."""
  return "conv_general_dilated_weight_only" in name and " O" in name


@pytest.mark.slow
def test_xla_keeps_sharding_and_gathers_no_data(cases):
  checked = {name: case for name, case in cases.items()
             if name.startswith("jit") and " pallas " not in name and not _cuts_bytes(name)
             and not _windowed(name) and not _appends_to_split_rows(name)
             and not _cuts_words(name)}
  assert any("straddling" in name for name in checked)
  assert any("ragged" in name for name in checked)
  assert {name: case["collectives"] for name, case in checked.items()
          if case["collectives"]} == {}
  assert [name for name, case in checked.items() if not case["sharding"]] == []


@pytest.mark.slow
def test_blocks_cut_by_shards_exchange_halos_not_gathers(cases):
  """XLA partitions a windowed reduction by sending each shard its neighbours' edge.

  Halos measured here: a whole 24-column shard where shards hold 1.5 blocks of
  16, 32 of 25 columns around the short last block; bounded by two shards,
  never x.
  """
  windowed = {name: case for name, case in cases.items()
              if name.startswith("jit") and " xla " in name and _windowed(name)}
  assert len(windowed) >= 4
  assert all(case["equal"] and case["sharding"] for case in windowed.values()), windowed
  assert {name: [c for c in case["collectives"] if not c.startswith("collective-permute")]
          for name, case in windowed.items()} == {name: [] for name in windowed}
  assert all(case["halo_elements"] <= 2 * case["shard_elements"] for case in windowed.values())


@pytest.mark.slow
def test_blocked_statistics_gradients_split_ties_across_shards(cases):
  """d/dx of blocked dynamic scales, ties split evenly, equals one device's on automatic and
  explicit meshes, x's sharding kept: nothing moves where shards hold whole blocks, halos
  where they cut blocks, and x gathered only where an explicit mesh's shards hold 1.5 blocks,
  as for the statistics themselves (before: a ShardingTypeError on explicit meshes, from
  reduce_window's transpose padding the split dim)."""
  gradients = {name: case for name, case in cases.items() if name.startswith("gradient")}
  assert len(gradients) == 6, gradients
  assert all(case["equal"] and case["sharding"] for case in gradients.values()), gradients
  assert {name: [c for c in case["collectives"] if not c.startswith("collective-permute")]
          for name, case in gradients.items()} == {
              name: ["all-gather f32[8,192]"] if "explicit" in name and "straddling" in name
              else [] for name in gradients}
  assert all(not case["collectives"] for name, case in gradients.items() if "aligned" in name)


@pytest.mark.slow
def test_int8_drop_in_gradients_on_split_operands(cases):
  """The int8 drop-ins' straight-through gradients with x split along its rows or along K
  (the kernel too), an image along its batch or its input features (the kernel's too), on
  automatic and explicit meshes: one device's to float32 rounding (a float dot or convolution
  of one shard's shape; the kernel's gradient summed across devices where rows are split),
  x's gradient split as x is, and no operand moved. A contraction split on an explicit mesh
  takes out_sharding in the derivative's float product too: without it the convolution's
  raised a ShardingTypeError (found by mutation testing)."""
  gradients = {name: case for name, case in cases.items() if _float_gradient(name)}
  assert len(gradients) == 16, gradients
  assert all(case["close"] and case["sharding"] and case["collectives"] == []
             for case in gradients.values()), gradients


@pytest.mark.slow
def test_dims_split_over_two_mesh_axes_count_every_axis(cases):
  """A dim split over both axes of an explicit 2-D mesh is in as many shards as both axes
  hold (8, not one axis's 4): blocks and packed bytes that those shards cut are reduced and
  packed by automatic sharding, one device's bits (counted per axis, a ShardingTypeError from
  reduce_window and a ValueError from the packed rows' split), and a kernel's shard finds its
  blocks from its index among all 8 (r * 2 + c)."""
  split = {name: case for name, case in cases.items() if name.startswith("two-axis")}
  assert len(split) == 4, split
  assert all(case["equal"] for case in split.values()), split


@pytest.mark.slow
def test_uneven_splits_run_with_one_devices_bits(cases):
  """An operand that automatic sharding splits unevenly (7 rows over 8 devices; 6 int4
  columns, 3 bytes, over 2): every op on both paths gives one device's bits. A kernel's
  partition callback read such a split through the operand's real shape, which JAX
  refuses for an uneven split (IndivisibleError, before the fix); one whose packed
  bytes a shard cannot hold whole is gathered."""
  uneven = {name: case for name, case in cases.items() if name.startswith("uneven")}
  assert len(uneven) == 18, sorted(uneven)
  assert [name for name, case in uneven.items() if not case["equal"]] == []


@pytest.mark.slow
def test_shards_of_one_row_read_their_blocks_parameters(cases):
  """Blocks of rows cut by one-row shards: one device's bits, x never gathered.

  Each kernel reads its shard's block parameter and moves nothing; XLA's
  partitioner sends devices their blocks' scales (collective-permutes of scale
  rows). Dynamic quantization's statistics of a block are its rows' partials,
  here a row each: what crosses devices is then as large as a shard.
  """
  one_row = {name: case for name, case in cases.items() if name.startswith("one-row")}
  assert len(one_row) == 10, one_row
  assert all(case["equal"] and case["sharding"] for case in one_row.values()), one_row
  static = {name: case for name, case in one_row.items() if "dynamic" not in name}
  assert {name: case["collectives"] for name, case in static.items()
          if " pallas " in name and case["collectives"]} == {}
  assert all(c.startswith("collective-permute") and case["halo_elements"] <= 3 * 16
             for case in static.values() for c in case["collectives"]), static


@pytest.mark.slow
def test_explicit_mesh_packs_rows_and_refuses_flat_across_shards(cases):
  explicit = {name: case for name, case in cases.items()
              if name.startswith("explicit") and "pack" in name}
  assert len(explicit) == 3
  assert all(case["equal"] and case["sharding"] for case in explicit.values()), explicit
  assert all(not case["collectives"] for case in explicit.values()), explicit


@pytest.mark.slow
def test_inside_shard_map_with_default_options(cases):
  inside = {name: case for name, case in cases.items() if name.startswith("shard_map")}
  assert any(" pallas " in name for name in inside)
  assert any("lowers for tpu" in name for name in inside)
  assert any("lowers for cuda" in name for name in inside)
  # Per-axis parameters beside the shard (interpret mode's loop refused them).
  assert any(" pallas " in name and "per-column replicated" in name for name in inside)
  assert all(case["equal"] and case["sharding"] for case in inside.values()), inside


@pytest.mark.slow
def test_packed_rows_cut_by_a_shard_edge_gather(cases):
  """Cases that move data: a byte split between two shards, one device's bits.

  Automatic sharding gathers the bytes (and, for the kernel, its float
  output). On an explicit mesh (before: a ShardingTypeError at the packing's
  reshape) no even split holds the bytes, so they are packed by automatic
  sharding and typed whole along the rows: their gathers are all that moves,
  and each device dequantizes whole rows, the output whole like them.
  """
  cut = {name: case for name, case in cases.items() if _cuts_bytes(name)}
  assert {name.split()[0] for name in cut} == {"jit", "typed"}, cut
  assert all(case["collectives"] and case["equal"] for case in cut.values()), cut
  typed = {name: case["collectives"] for name, case in cut.items() if name.startswith("typed")}
  assert {name: [c for c in collectives if not c.startswith("all-gather u8[")]
          for name, collectives in typed.items()} == {name: [] for name in typed}


@pytest.mark.slow
def test_packed_kernel_split_within_words_gathers_neighbours_bytes(cases):
  """Dequantizing reads the packed rows in 4-byte words (8 int4 values).

  A device holding 4 output features (2 bytes of each row) receives its
  neighbour's 2: an all-gather of uint8 bytes over pairs of devices, two
  shards of the packed kernel, never x or the float kernel. Same bits as the
  per-shard convolutions, and the output's sharding.
  """
  cut = {name: case for name, case in cases.items() if _cuts_words(name)}
  assert len(cut) == 2 and all(case["sharding"] and case["collectives"]
                               for case in cut.values()), cut
  assert cut["jit 1d xla conv_general_dilated_weight_only O(per-shard) -"]["equal"]
  for case in cut.values():
    for collective in case["collectives"]:
      gathered = re.fullmatch(r"all-gather u8\[([\d,]+)\]", collective)
      assert gathered, collective
      # Two int4 values a byte; shard_elements is a 16th of a device's kernel shard.
      values = 2 * math.prod(int(d) for d in gathered.group(1).split(","))
      assert values <= 2 * 16 * case["shard_elements"], collective


@pytest.mark.slow
def test_integer_matmul_split_along_rows_moves_a(cases):
  """a's zero point appends a row of ones to a's rows (rhs's sums over K, docs/numerics.md).

  Concatenated along the split dim, a is moved to a split along K and back to
  shards of one more row (two all-to-alls of its int8 bytes), and the
  product's rows to their devices (collective-permutes of int32 rows). Same
  bits and output sharding; without a zero point nothing moves.
  """
  split = {name: case for name, case in cases.items() if _appends_to_split_rows(name)}
  assert len(split) >= 4 and all(
      case["equal"] and case["sharding"] and case["collectives"]
      for case in split.values()), split
  assert {name: [c for c in case["collectives"]
                 if not c.startswith(("all-to-all (s8[", "collective-permute s32["))]
          for name, case in split.items()} == {name: [] for name in split}


@pytest.mark.slow
def test_explicit_mesh_layers_move_no_operand(cases):
  """Layers on an explicit mesh: one device's bits, the split kept, no operand moved.

  Integer matmuls with a zero point on a's split rows (before: a
  ShardingTypeError from the row of ones appended across the split), blocked
  parameters with a zero point expanded against split rows (before: "select
  cases must have the same shardings") and the int8 drop-ins split along K,
  given lax's out_sharding (before: the error that out_sharding is needed,
  from their inner dots; their int32 partial products are added across
  devices, less than a shard of the activations), as are matmul_integer,
  qlinear_matmul and quantized_dot_general (before: no out_sharding to give,
  so K split raised as jnp.matmul's does without one). An observer of a split
  batch (before: a ShardingTypeError at its flattening) gathers the batch once.
  A (batch, M, K) activation split along M (before: a ShardingTypeError at the
  merge of its free dims into rows) keeps its split. An int8 kernel stored
  transposed, whole or split along K (its values' minor dim), does the same.
  """
  explicit = {name: case for name, case in cases.items()
              if name.startswith("explicit") and "pack" not in name}
  assert len(explicit) == 17, explicit
  assert all(case["equal"] and case["sharding"] for case in explicit.values()), explicit
  observers = [name for name in explicit if " observe " in name]
  assert {name: case["collectives"] for name, case in explicit.items()} == {
      name: ["all-gather f32[16,512]"] if name in observers else [] for name in explicit}


@pytest.mark.slow
def test_typed_meshes_hold_what_automatic_ones_do(cases):
  """Every element-wise op and layout of the jit cases on explicit meshes, both paths.

  One device's bits and x's sharding everywhere (before: ShardingTypeErrors
  from blocked parameters expanded unsplit, from block statistics whose
  windows the shards cut, and from the kernels' block views where shards
  cut blocks, and from vmap of XLA's dynamic statistics, whose NaN cond became a
  select of x). Windows of XLA's dynamic statistics that the shards cut are
  reduced by automatic sharding: halos where 25 columns a shard end in a
  short block (ragged), x gathered where shards hold 1.5 blocks of 16
  (straddling; automatic sharding alone exchanges halos there). The kernels
  are partitioned as under automatic sharding and move nothing; nothing
  else moves but packed bytes cut by a shard edge (above).
  """
  typed = {name: case for name, case in cases.items()
           if name.startswith("typed") and not _cuts_bytes(name)}
  assert len(typed) >= 110, len(typed)
  assert {"vmap(dynamic_quantize_linear)", "vmap(fake_quantize_dynamic)"} <= {
      name.split()[3] for name in typed}
  assert {(name.split()[1], name.split()[2]) for name in typed} >= {
      (mesh, implementation) for mesh in ("1d", "2d") for implementation in ("xla", "pallas")}
  assert all(case["equal"] and case["sharding"] for case in typed.values()), [
      name for name, case in typed.items() if not (case["equal"] and case["sharding"])]
  moved = {name for name, case in typed.items() if case["collectives"]}
  assert moved == {name for name in typed if " xla " in name and _windowed(name)
                   and " 1d " in name and "straddling" in name}, moved


@pytest.mark.slow
def test_choose_qparams_moves_nothing_where_shards_hold_whole_blocks(cases):
  """Every method, per tensor, per column and in blocks, on automatic and explicit meshes.

  One device's bits and the split kept. Where each shard holds whole blocks (its
  columns; 32-column blocks of 256 columns on 8 devices) no float data moves:
  percentile per column gathers only int32 indices of jnp.nanpercentile's gather
  (3 a column). Per tensor, percentile's sort and mse's view of x as one block
  gather x. On an explicit mesh percentile's blocks are found by automatic
  sharding (before: ShardingTypeErrors) and its blocked scale comes back whole.
  """
  chosen = {name: case for name, case in cases.items() if name.startswith("choose_qparams")}
  assert len(chosen) == 26, chosen
  assert [name for name, case in chosen.items() if not case["equal"]] == []
  assert [name for name, case in chosen.items() if not case["sharding"]] == [
      "choose_qparams explicit 1d percentile blocked"]
  moved = {name: case["collectives"] for name, case in chosen.items() if case["collectives"]}
  assert {name.split(" ", 3)[3] for name in moved} == {
      "percentile per-tensor", "mse per-tensor", "percentile per-column"}, moved
  assert all(c.startswith("all-gather s32[") for name, collectives in moved.items()
             if name.endswith("per-column") for c in collectives), moved


def _splits_k(name: str) -> bool:
  """matmul_nbits with a split along K, the contracted dim."""
  return "matmul_nbits" in name and name.endswith(" K -")


def _pallas_cuts_blocks(name: str) -> bool:
  """The 1-D mesh's 24- and 25-column shards against blocks of 16."""
  return " pallas " in name and " 1d " in name and ("straddling" in name or "ragged" in name)


@pytest.mark.slow
def test_pallas_under_jit_runs_one_kernel_per_shard(cases):
  """custom_partitioning: each device runs the kernel on its shard, x is never gathered."""
  pallas = {name: case for name, case in cases.items()
            if name.startswith("jit") and " pallas " in name and not _cuts_bytes(name)
            and not _splits_k(name)}
  ops = {name.split()[3] for name in pallas}
  assert {"quantize_linear", "dequantize_linear", "dequantize_linear(packed",
          "dynamic_quantize_linear", "quantized_add", "matmul_nbits",
          "vmap(matmul_nbits)"} <= ops, ops
  for mesh in ("1d", "2d"):
    for layout in ("per-tensor", "per-axis", "blocked"):
      assert any(f" {mesh} " in name and f" {layout} " in name for name in pallas)
  assert any(" 2d " in name and "straddling" in name for name in pallas)  # 96 columns: 6 blocks
  assert any("vmap(" in name for name in pallas)
  assert {name: case["collectives"] for name, case in pallas.items()
          if case["collectives"]} == {}
  assert [name for name, case in pallas.items() if not case["sharding"]] == []


@pytest.mark.slow
def test_pallas_blocks_cut_by_shards_gather_no_data(cases):
  """Shard edges through blocks: each shard finds its blocks' parameters from its offset.

  Dynamic quantization's per-block statistics gather each shard's partials
  of the blocks it touches (parameter-sized), not x.
  """
  cut = {name: case for name, case in cases.items()
         if _pallas_cuts_blocks(name) and not _cuts_bytes(name)}
  assert {name.split()[3] for name in cut} == {
      "quantize_linear", "dequantize_linear", "dequantize_linear(packed",
      "dynamic_quantize_linear"}, cut
  assert any("straddling" in name for name in cut) and any("ragged" in name for name in cut)
  assert all(case["equal"] and case["sharding"] for case in cut.values()), cut
  assert {name: case["collectives"] for name, case in cut.items()
          if case["collectives"]} == {}


@pytest.mark.slow
def test_matmul_nbits_kernel_split_along_k_gathers_a_along_k(cases):
  """K stays whole in each device's kernel: a split along K is gathered, never summed in parts.

  Float partials added across devices would round differently from one
  device's dot; the gather is of a alone.
  """
  split = {name: case for name, case in cases.items() if _splits_k(name)}
  assert split and all(case["equal"] for case in split.values()), split
  assert {name: [c for c in case["collectives"] if not c.startswith("all-gather f32")]
          for name, case in split.items()} == {name: [] for name in split}


@pytest.mark.parametrize("dtype, bits", [("int4", 4), ("int2", 2), ("float6_e2m3fn", 6)])
@pytest.mark.parametrize("columns", [6, 7, 12])
def test_rows_layout_round_trips_and_equals_flat_bytes_on_whole_byte_rows(dtype, bits, columns):
  codes = jnp.asarray(
      np.random.default_rng(columns).integers(0, 1 << bits, (2, 3, columns)), jnp.uint8)
  rows = jq.pack(codes, dtype=dtype, layout="rows")
  assert rows.shape == (2, 3, -(-columns * bits // 8))
  flat = jq.pack(codes, dtype=dtype)
  if columns * bits % 8 == 0:
    np.testing.assert_array_equal(rows.reshape(-1), flat)
  np.testing.assert_array_equal(
      jq.unpack(rows, codes.shape, dtype), jq.unpack(flat, codes.shape, dtype))
  scale = jnp.asarray(np.linspace(0.5, 2.0, 3), jnp.float32)
  want = jq.dequantize_linear(codes, scale, axis=1, packed_dtype=dtype)
  for implementation in ("xla", "pallas"):
    np.testing.assert_array_equal(jq.dequantize_linear(
        rows, scale, axis=1, packed_shape=codes.shape, packed_dtype=dtype,
        implementation=implementation), want)


@pytest.mark.xla_cpu
def test_expanded_blocked_scale_is_fused_not_written():
  """One loop fusion reads x and the small scale: no x-sized scale exists."""
  x = jnp.zeros((64, 100), jnp.int8)
  scale = jnp.ones((64, 4), jnp.float32)  # blocks of 32, the last one short
  hlo = jax.jit(lambda x, scale: jq.dequantize_linear(x, scale, axis=1, block_size=32)).lower(
      x, scale).compile().as_text()
  entry = [line for line in hlo[hlo.index("ENTRY"):].splitlines() if " = " in line]
  assert len(entry) == 3, entry  # x, scale, the fusion
  assert "fusion(" in entry[-1] and "f32[64,100]" in entry[-1], entry
