"""The QAT example on scikit-learn's digits trains, quantizes and meets its targets.

The margins were measured on seeds 0-4 (the test runs seed 0): float
95.8-97.8%; int8 QAT within 0.22 points of float; int4 PTQ 0.9-4.2 points
below float, and int4 QAT above it by 2.2-4.2 points on the four seeds where
PTQ lost more than 2, equal on the fifth; int2 PTQ 11-37% and int2 QAT
86-91%. The thresholds leave room for another CPU's float rounding
to train slightly different models.

Everything is checked in one test: pytest-xdist spreads the tests of a module
over its workers, and each worker would train all the models again.
"""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "qat_digits.py"


def _load_example():
  spec = importlib.util.spec_from_file_location("qat_digits", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  # dataclasses look their module up in sys.modules while the class is built.
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_qat_example_meets_its_targets():
  example = _load_example()
  # run() asserts on the way that real quantized inference (integer weights,
  # quantized activations) gives the fake-quantized forward's logits bit for bit.
  results = example.run(seed=0)
  accuracy = results["accuracy"]

  assert accuracy["float"] > 0.94, accuracy
  # The targets: int8 QAT within 1 point of float, int4 QAT clearly
  # better than int4 PTQ (here: it wins back what PTQ loses).
  assert accuracy["int8_qat"] >= accuracy["float"] - 0.01, accuracy
  assert accuracy["int4_ptq"] <= accuracy["float"] - 0.015, accuracy
  assert accuracy["int4_qat"] >= accuracy["int4_ptq"] + 0.015, accuracy
  assert accuracy["int4_qat"] >= accuracy["float"] - 0.015, accuracy
  # int2 (ternary weights): PTQ breaks, QAT gives a working model.
  assert accuracy["int2_ptq"] < 0.5, accuracy
  assert accuracy["int2_qat"] > 0.8, accuracy

  losses = results["train_losses"]
  assert sorted(losses) == ["float", "int2_qat", "int4_qat", "int8_qat"]
  for name, curve in losses.items():
    assert len(curve) == (60 if name == "float" else 30), name
    assert np.all(np.isfinite(curve)), name
    assert curve[-1] < curve[0], (name, curve)

  data = example.load_data()
  for bits, quantization in example.QUANTIZATIONS.items():
    params = results["params"][f"{bits}_qat"]
    for layer in example.quantize_model(params, quantization):
      assert layer["weight"].dtype == np.dtype(quantization.weight_dtype), bits
      if quantization.block_size:
        out_features, in_features = layer["weight"].shape
        blocks = -(-in_features // quantization.block_size)
        assert layer["scale"].shape == (out_features, blocks), bits
    # Independently of run()'s own check: the eager fake-quantized forward
    # predicts what the deployed integer model predicted.
    fake_logits = example.fake_quantized_forward(params, data.test_images, quantization)
    np.testing.assert_array_equal(
        np.argmax(np.asarray(fake_logits), axis=-1),
        np.argmax(np.asarray(results["logits"][f"{bits}_qat"]), axis=-1),
    )
