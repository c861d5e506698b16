"""Observers: running and moving-average ranges, histograms, their qparams, calibrate."""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from quant_testing import assert_bits_equal
from quant_testing import MSE_CLIP_RATIOS

BATCHES = [np.asarray(jax.random.normal(jax.random.key(i), (32, 16)) * (i + 1), np.float32)
           for i in range(4)]


def _observed(batches, **options):
  state = jq.init_observer(**options)
  for batch in batches:
    state = jq.observe(state, batch)
  return state


def test_running_min_max_ignores_nan():
  batches = BATCHES + [np.array([np.nan, 1.0], np.float32)]
  state = _observed(batches)
  values = np.concatenate([b.ravel() for b in BATCHES])
  assert state.low == values.min() and state.high == values.max()
  assert state.count == len(batches)
  assert state.histogram.sum() == values.size + 1                        # the NaN is not counted
  assert state.histogram_range == np.abs(values).max()


# Momentum 0 (each batch's own range) cannot round differently between call styles,
# 0 * low and 1 * min(x) being exact: one style suffices for it.
@pytest.mark.parametrize("momentum, mode", [
    (0.9, "jit"), (0.9, "vmap"), (0.9, "scan"), (0.9, "disable_jit"), (0.0, "jit")])
def test_moving_average(momentum, mode):
  """NumPy's float32 recurrence, each product rounded, bit for bit in every call style.

  XLA:CPU fused ``m * low`` into the add (one rounding) under vmap and scan,
  and not op by op: 12 of 200 random states differed between modes.
  """
  rng = np.random.default_rng(0)
  batches = [rng.normal(0, 3, (rows, 6)).astype(np.float32) for rows in (32, 1, 7, 20) * 8]
  step = {"jit": jax.jit(jq.observe), "disable_jit": jq.observe,
          "vmap": lambda s, x: jax.tree.map(lambda a: a[0], jax.vmap(jq.observe)(
              jax.tree.map(lambda a: a[None], s), x[None])),
          # Jitted, as a training step calls scan: called eagerly, scan compiled its body
          # anew for each batch (15 s for the 32, against 1.5 s).
          "scan": jax.jit(lambda s, x: jax.lax.scan(lambda c, x: (jq.observe(c, x), None), s,
                                                    x[None])[0])}[mode]
  state = jq.init_observer(momentum=momentum)
  with jax.disable_jit(mode == "disable_jit"):
    for batch in batches:
      state = step(state, jnp.asarray(batch))
  m = np.float32(momentum)
  low, high = batches[0].min(), batches[0].max()
  for batch in batches[1:]:
    low = np.float32(m * low) + np.float32((np.float32(1) - m) * batch.min())
    high = np.float32(m * high) + np.float32((np.float32(1) - m) * batch.max())
  assert_bits_equal(state.low, np.float32(low))
  assert_bits_equal(state.high, np.float32(high))
  assert state.count == len(batches)


def test_histogram_keeps_every_value_through_rebinning():
  """Rebinning splits counts over the new bins, keeping each one (to float32 rounding)."""
  state = _observed(BATCHES, bins=64)
  values = np.abs(np.concatenate([b.ravel() for b in BATCHES]))
  assert float(state.histogram.sum()) == pytest.approx(values.size, rel=1e-6)
  # The last batch has the widest range, so its own values are binned exactly.
  width = float(state.histogram_range) / 64
  own = np.histogram(np.abs(BATCHES[-1]), bins=64, range=(0, float(state.histogram_range)))[0]
  assert np.all(np.asarray(state.histogram)[-8:] >= own[-8:])
  assert width > 0


def test_a_range_growing_every_batch_keeps_its_percentiles():
  """Regrouping splits each bin's count over the new bins it overlaps. Moving whole bins
  drifted: with batch i holding the value i (0..299), the median came out 299."""
  observe = jax.jit(jq.observe)
  state = jq.init_observer(bins=8)
  for i in range(300):
    state = observe(state, jnp.array([float(i)]))
  assert float(state.histogram.sum()) == pytest.approx(300, rel=1e-6)
  width = float(state.histogram_range) / 8
  median = float(jq.observer_qparams(state, jnp.int8, method="percentile", percentile=50.0)[0])
  assert abs(median * 127 - 149.5) <= width / 2


def test_observe_inside_a_jitted_forward_pass():
  """The observer state is an argument and a result of the jitted step, like any pytree."""
  w = jax.random.normal(jax.random.key(9), (16, 4))

  @jax.jit
  def forward(state, x):
    state = jq.observe(state, x)
    return state, x @ w

  state = jq.init_observer()
  for batch in BATCHES:
    state, _ = forward(state, batch)
  eager = _observed(BATCHES)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(a, b)


def test_qparams_methods():
  state = _observed(BATCHES)
  values = np.concatenate([b.ravel() for b in BATCHES])
  scale, zero_point = jq.observer_qparams(state, jnp.uint8)
  _, expected_scale, expected_zero_point = jq.dynamic_quantize_linear(values)
  np.testing.assert_array_equal(scale, expected_scale)
  np.testing.assert_array_equal(zero_point, expected_zero_point)
  magnitude = np.abs(values).max()
  scale, zero_point = jq.observer_qparams(state, jnp.int8, method="absmax")
  np.testing.assert_array_equal(scale, magnitude / np.float32(127))
  assert zero_point == 0 and zero_point.dtype == jnp.int8
  scale, _ = jq.observer_qparams(state, jnp.int4, method="qmax_plus_half")
  np.testing.assert_array_equal(scale, magnitude / np.float32(7.5))
  # A histogram's percentile is an upper bin edge, and rebinning split earlier
  # batches' counts in proportion: close to NumPy's, not equal.
  scale, _ = jq.observer_qparams(state, jnp.int8, method="percentile", percentile=99.0)
  tolerance = 0.01 * float(state.histogram_range)
  assert abs(float(scale) * 127 - np.percentile(np.abs(values), 99.0)) <= tolerance
  scale, _ = jq.observer_qparams(state, jnp.int4, method="mse")
  assert 0.2 * magnitude / 7 <= float(scale) < magnitude / 7       # int4 clips Gaussian tails
  scale, zero_point = jq.observer_qparams(state, jnp.float8_e4m3fn, method="absmax")
  np.testing.assert_array_equal(scale, magnitude / np.float32(448))


def test_one_batch_s_histogram_is_numpy_s():
  """Equal bins of |x| over [0, max |x|], the largest value in the last."""
  state = _observed(BATCHES[:1], bins=64)
  magnitude = np.abs(BATCHES[0])
  assert state.histogram_range == magnitude.max()
  np.testing.assert_array_equal(
      state.histogram, np.histogram(magnitude, 64, (0, float(magnitude.max())))[0])


@pytest.mark.parametrize("percentile, edge", [(25.0, 1), (50.0, 2), (60.0, 3), (100.0, 4)])
def test_histogram_percentile_is_the_upper_edge_of_the_bin_reaching_it(percentile, edge):
  """One value in each of 4 bins of width 3.5 / 4: the p-th percentile is the upper edge
  of the first bin whose cumulative count reaches p% of the values."""
  state = jq.observe(jq.init_observer(bins=4), jnp.array([0.5, -1.5, 2.5, -3.5]))
  np.testing.assert_array_equal(state.histogram, np.ones(4, np.float32))
  scale, _ = jq.observer_qparams(state, jnp.int8, method="percentile", percentile=percentile)
  np.testing.assert_allclose(float(scale) * 127, edge * 3.5 / 4, rtol=1e-6)


def test_histogram_mse_picks_the_clip_of_least_expected_error():
  """Among the clip ratios of choose_qparams times the range, the clip whose expected
  squared error over the bins is least: a bin's centre above the clip costs its distance
  to it squared, one below the rounding error of a uniform value, step**2 / 12."""
  state = _observed(BATCHES, bins=16)  # coarse bins: their centres matter
  histogram = np.asarray(state.histogram, np.float64)
  width = float(state.histogram_range) / 16
  centres = (np.arange(16) + 0.5) * width
  for dtype in (jnp.int2, jnp.int4, jnp.int8):
    qmax = jnp.iinfo(dtype).max
    clips = [ratio * float(state.histogram_range) for ratio in MSE_CLIP_RATIOS]
    errors = [np.sum(histogram * np.where(centres > clip, (centres - clip) ** 2,
                                          (clip / qmax) ** 2 / 12)) for clip in clips]
    scale, _ = jq.observer_qparams(state, dtype, method="mse")
    np.testing.assert_allclose(float(scale), clips[int(np.argmin(errors))] / qmax, rtol=1e-6)


def test_histogram_mse_keeps_the_largest_clip_of_equal_errors():
  """Magnitudes so small that every squared error underflows to 0: every clip ties, and
  the first, the largest |x|, is kept (absmax's scale, not a fifth of it)."""
  state = jq.observe(jq.init_observer(), jnp.array([1e-25, -3e-25, 2e-25], jnp.float32))
  mse, _ = jq.observer_qparams(state, jnp.int8, method="mse")
  absmax, _ = jq.observer_qparams(state, jnp.int8, method="absmax")
  assert mse == absmax == np.float32(3e-25) / np.float32(127)


@pytest.mark.parametrize("momentum", [None, 0.5])
def test_a_batch_of_one_value_is_a_range(momentum):
  """A batch whose min equals its max holds values: it is observed, not skipped as empty."""
  state = _observed([np.full((2, 3), 3.0, np.float32)], momentum=momentum)
  assert state.low == state.high == 3
  scale, zero_point = jq.observer_qparams(state, jnp.uint8)
  _, expected_scale, expected_zero_point = jq.dynamic_quantize_linear(np.float32([3.0]))
  assert scale == expected_scale and zero_point == expected_zero_point
  state = jq.observe(state, np.full((2, 3), 5.0, np.float32))
  assert state.high == (4 if momentum else 5) and state.low == (4 if momentum else 3)


def test_empty_observer_gives_scale_one():
  for method in ("minmax", "absmax", "percentile", "mse"):
    scale, _ = jq.observer_qparams(jq.init_observer(), jnp.int8, method=method)
    assert scale == 1, method


NAN_BATCH = np.full((2, 3), np.nan, np.float32)


@pytest.mark.parametrize("momentum", [None, 0.5])
@pytest.mark.parametrize("order", ["first", "between", "last"])
def test_a_batch_of_nans_leaves_the_range_as_it_was(momentum, order):
  """NaNs are ignored: a batch of nothing else is observed as no values at all."""
  batches = {"first": [NAN_BATCH] + BATCHES[:2], "between": [BATCHES[0], NAN_BATCH, BATCHES[1]],
             "last": BATCHES[:2] + [NAN_BATCH]}[order]
  state = _observed(batches, momentum=momentum)
  expected = _observed(BATCHES[:2], momentum=momentum)
  np.testing.assert_array_equal(state.low, expected.low)
  np.testing.assert_array_equal(state.high, expected.high)
  assert state.count == 3


@pytest.mark.parametrize("method", ["minmax", "absmax", "qmax_plus_half", "percentile", "mse"])
def test_an_observer_of_nans_only_gives_an_empty_one_s_qparams(method):
  state = _observed([NAN_BATCH, NAN_BATCH], momentum=0.5)
  scale, zero_point = jq.observer_qparams(state, jnp.int8, method=method)
  expected_scale, expected_zero_point = jq.observer_qparams(jq.init_observer(), jnp.int8,
                                                            method=method)
  assert scale == expected_scale == 1
  assert zero_point == expected_zero_point


@pytest.mark.parametrize("call, error, match", [
    (lambda: jq.init_observer(momentum=1.0), ValueError, "momentum"),
    (lambda: jq.init_observer(bins=1), ValueError, "bins"),
    (lambda: jq.observe(jq.init_observer(), np.ones(3, np.int32)), TypeError, "x.dtype"),
    (lambda: jq.observer_qparams(jq.init_observer(), jnp.float8_e4m3fn), ValueError, "method"),
    (lambda: jq.observer_qparams(jq.init_observer(), method="max"), ValueError, "method"),
])
def test_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()


class _Dense:
  """dot_general=None stands for Flax's "use lax.dot_general" (nnx.LinearGeneral)."""

  def __init__(self, w, dot_general=lax.dot_general):
    self.kernel, self.dot_general = w, dot_general

  def __call__(self, x):
    dot_general = self.dot_general or lax.dot_general
    return dot_general(x, self.kernel, (((x.ndim - 1,), (0,)), ((), ())))


class _Conv:
  def __init__(self, w):
    self.kernel, self.conv_general_dilated = w, lax.conv_general_dilated

  def __call__(self, x):
    return self.conv_general_dilated(x, self.kernel, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))


class _Model:
  def __init__(self):
    self.conv = _Conv(jax.random.normal(jax.random.key(1), (3, 3, 1, 4)))
    self.blocks = [_Dense(jax.random.normal(jax.random.key(2), (4 * 16, 8))),
                   _Dense(jax.random.normal(jax.random.key(3), (8, 3)), dot_general=None)]
    self.unused = _Dense(jnp.eye(2))

  def __call__(self, x):
    x = jax.nn.relu(self.conv(x)).reshape(x.shape[0], -1)
    return self.blocks[1](jax.nn.relu(self.blocks[0](x)))


@pytest.mark.slow
def test_calibrate_observes_every_layer_input_and_restores_the_model():
  model = _Model()
  originals = [model.conv.conv_general_dilated, model.blocks[0].dot_general,
               model.blocks[1].dot_general]
  batches = [jax.random.normal(jax.random.key(10 + i), (8, 4, 4, 1)) for i in range(3)]
  ops = jq.calibrate(model, batches)
  assert [model.conv.conv_general_dilated, model.blocks[0].dot_general,
          model.blocks[1].dot_general] == originals
  assert sorted(ops["dot_general"]) == ["blocks/0", "blocks/1"]          # "unused" never ran
  assert sorted(ops["conv_general_dilated"]) == ["conv"]
  # The first layer's input range is the batches' own.
  values = np.concatenate([np.asarray(b).ravel() for b in batches])
  scale, zero_point = jq.observer_qparams(jq.observe(jq.init_observer(), values), jnp.int8)
  np.testing.assert_array_equal(ops["conv_general_dilated"]["conv"].keywords["input_scale"], scale)
  np.testing.assert_array_equal(
      ops["conv_general_dilated"]["conv"].keywords["input_zero_point"], zero_point)
  reference = model(batches[0])
  assert jq.replace_ops(model, **ops) == ["conv", "blocks/0", "blocks/1"]
  quantized = model(batches[0])
  assert np.abs(quantized - reference).max() <= 0.05 * np.abs(reference).max()


@pytest.mark.parametrize("options", [
    dict(method="percentile", percentile=50.0), dict(method="mse", bins=64),
    dict(method="absmax", momentum=0.5)])
def test_calibrate_s_options_reach_the_observers_and_their_qparams(options):
  """Each option of calibrate is the observer's or observer_qparams' own."""
  model = _Dense(jax.random.normal(jax.random.key(2), (16, 8)))
  ops = jq.calibrate(model, BATCHES, **options)
  state = _observed(BATCHES, momentum=options.get("momentum"), bins=options.get("bins", 1024))
  scale, zero_point = jq.observer_qparams(state, jnp.int8, method=options["method"],
                                          percentile=options.get("percentile", 99.99))
  keywords = ops["dot_general"][""].keywords
  np.testing.assert_array_equal(keywords["input_scale"], scale)
  np.testing.assert_array_equal(keywords["input_zero_point"], zero_point)


def test_calibrate_restores_the_model_when_a_batch_fails():
  model = _Model()
  original = model.blocks[0].dot_general
  with pytest.raises(TypeError):
    jq.calibrate(model, [jnp.ones((2, 4, 4, 1), jnp.int32)])
  assert model.blocks[0].dot_general is original


@pytest.mark.parametrize("options", [dict(momentum=1.0), dict(bins=1), dict(method="median"),
                                     dict(method="percentile", percentile=0.0)])
def test_calibrate_checks_its_options_before_touching_the_model(options):
  """Before: a bad momentum or bins left the layers recording (the model then raised a
  KeyError), and a bad method was found only after every batch had run."""
  model = _Model()
  original = model.blocks[0].dot_general
  taken = []

  def batches():
    taken.append(1)
    yield jnp.ones((2, 4, 4, 1))

  with pytest.raises(ValueError):
    jq.calibrate(model, batches(), **options)
  assert model.blocks[0].dot_general is original and not taken
  model(jnp.ones((2, 4, 4, 1)))


def test_infinities_reach_the_range_not_the_histogram():
  """absmax and minmax give an infinite scale (as choose_qparams does); the histogram bins
  finite values only, so one batch with an infinity does not stretch it for good."""
  finite = _observed(BATCHES)
  with_inf = _observed(BATCHES[:2] + [np.array([1.0, np.inf, -2.0], np.float32)] + BATCHES[2:])
  for method in ("minmax", "absmax"):
    assert np.isinf(jq.observer_qparams(with_inf, jnp.int8, method=method)[0])
  np.testing.assert_array_equal(with_inf.histogram_range, finite.histogram_range)


class _Einsum:
  """nnx.Einsum's call: ``einsum_op(equation, x, kernel)``, jnp.einsum by default."""

  def __init__(self, w):
    self.kernel, self.einsum_op = w, jnp.einsum

  def __call__(self, x):
    return self.einsum_op("btd,dk->btk", x, self.kernel)


def test_calibrate_observes_an_einsum_layer_s_input():
  """jnp.einsum is jitted itself: its dot_general's input is observed from inside that trace."""
  model = _Einsum(jax.random.normal(jax.random.key(4), (16, 3)))
  batches = [b.reshape(2, -1, 16) for b in BATCHES[:2]]
  ops = jq.calibrate(model, batches)
  assert model.einsum_op is jnp.einsum
  scale, zero_point = jq.observer_qparams(_observed(batches), jnp.int8)
  np.testing.assert_array_equal(ops["dot_general"][""].keywords["input_scale"], scale)
  np.testing.assert_array_equal(ops["dot_general"][""].keywords["input_zero_point"], zero_point)
  assert jq.replace_ops(model, **ops) == [""]
  np.testing.assert_array_equal(model(batches[0]), jq.dot_general_static_int8(
      batches[0], model.kernel, (((2,), (0,)), ((), ())), input_scale=scale,
      input_zero_point=zero_point))
