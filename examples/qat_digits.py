"""Quantization-aware training (QAT) of a small CNN on scikit-learn's digits.

    PYTHONPATH=. python examples/qat_digits.py [--seed 0]

The model is three 3x3 valid convolutions of 8 channels each (8x8 -> 6x6 ->
4x4 -> 2x2, ReLU) and a dense layer from the 32 features left to 10 classes:
1,544 weights. It is trained in float32, then quantized three ways
(``QUANTIZATIONS``), each both after training (PTQ: no training at all) and by
fine-tuning the float model through fake quantization (QAT):

* **int8**: weights int8, one symmetric scale per output channel recomputed
  from the weights at every step (``max|w| / 127``, ``jq.fake_quantize``);
  activations int8.
* **int4**: weights int4 in blocks of 32 along the input axis (the blocked
  scale layout of ``jq.quantize_linear``: shape ``(out, ceil(in / 32))``, a
  ragged last block for the 72 inputs of a 3x3x8 convolution); activations
  int4. PTQ uses ``max|w| / 7`` per block; QAT starts from those scales and
  *learns* them (LSQ: ``jq.fake_quantize_learnable`` with
  ``jq.lsq_grad_factor``).
* **int2**: as int4 with int2 weights. Symmetric int2 uses only -1, 0 and 1
  (ternary weights); activations stay int4.

A convolution is a matmul over 3x3 patches, so every weight is a matrix
``(out, in)``: a convolution's is ONNX's ``(out, channels, 3, 3)`` Conv weight
flattened to ``(out, channels * 9)`` (``lax.conv_general_dilated_patches``
orders patch features the same way). Activations are the input of every layer,
quantized dynamically with ``jq.fake_quantize_dynamic``: asymmetric, one scale
and zero point per example (``axis=0``), so a prediction never depends on the
rest of the batch.

Why a model this small: on the digits a wide model has weights to spare, and
max-scale int4 PTQ of a 64-128-128-10 MLP is already within a point of
float, leaving QAT nothing to recover. A compact model is where quantization
hurts and QAT earns its keep, as on real edge models.

Training runs through fake quantization (float in, float out,
straight-through gradients). Evaluation runs real quantized inference: the
weights become integer arrays (``jq.quantize_linear``) and are dequantized
(``jq.dequantize_linear``); activations go through
``jq.dynamic_quantize_linear`` and back. Fake quantization is bit for bit
``dequantize(quantize(x))``, so both give identical logits, which
``quantized_test_logits`` asserts.

Data: 1797 8x8 images, a fixed stratified split (1347 train / 450 test: one
test example is 0.22 points), pixels scaled to [0, 1]. Every random choice is
seeded, so a run is deterministic on a given machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.typing import DTypeLike
import jax.numpy as jnp
import numpy as np
import optax
from sklearn import datasets
from sklearn import model_selection

import jaxquant as jq

Params = list[dict[str, jax.Array]]

IMAGE_SIZE = 8
CONV_CHANNELS = (8, 8, 8)
KERNEL_SIZE = 3
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Quantization:
  """How a model's weights and activations are quantized.

  Attributes:
    weight_dtype: integer dtype of the weights (symmetric, zero point 0).
    block_size: 0 for one scale per output channel, else one scale per
      ``block_size`` weights along the input axis.
    learned_scales: learn the weight scales with LSQ instead of recomputing
      ``max|w| / qmax`` from the weights at every step.
    activation_dtype: integer dtype of the dynamically quantized activations.
  """

  weight_dtype: DTypeLike
  block_size: int
  learned_scales: bool
  activation_dtype: DTypeLike

  @property
  def weight_layout(self) -> dict[str, int]:
    """The ``axis`` / ``block_size`` keywords for a weight shaped (out, in)."""
    if self.block_size:
      return dict(axis=1, block_size=self.block_size)
    return dict(axis=0)


QUANTIZATIONS = {
    "int8": Quantization(
        jnp.int8, block_size=0, learned_scales=False, activation_dtype=jnp.int8
    ),
    "int4": Quantization(
        jnp.int4, block_size=32, learned_scales=True, activation_dtype=jnp.int4
    ),
    # Symmetric int2 uses only -1, 0 and 1 (ternary weights): where PTQ breaks.
    "int2": Quantization(
        jnp.int2, block_size=32, learned_scales=True, activation_dtype=jnp.int4
    ),
}


@dataclasses.dataclass(frozen=True)
class Data:
  train_images: jax.Array
  train_labels: jax.Array
  test_images: jax.Array
  test_labels: jax.Array


def load_data() -> Data:
  """The digits, pixels in [0, 1], split 75/25 with a fixed seed (stratified)."""
  digits = datasets.load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  train_images, test_images, train_labels, test_labels = model_selection.train_test_split(
      images, labels, test_size=0.25, random_state=0, stratify=labels
  )
  return Data(*(jnp.asarray(a) for a in (train_images, train_labels, test_images, test_labels)))


def init_params(key: jax.Array) -> Params:
  """He-initialised layers; weights are (out, in), as ONNX and PyTorch store them."""
  channels = (1, *CONV_CHANNELS)
  side = IMAGE_SIZE - len(CONV_CHANNELS) * (KERNEL_SIZE - 1)
  fan_ins = [c * KERNEL_SIZE**2 for c in channels[:-1]] + [side * side * channels[-1]]
  fan_outs = [*CONV_CHANNELS, NUM_CLASSES]
  params = []
  for layer_key, fan_in, fan_out in zip(jax.random.split(key, len(fan_ins)), fan_ins, fan_outs):
    weight = jax.random.normal(layer_key, (fan_out, fan_in)) * jnp.sqrt(2.0 / fan_in)
    params.append(dict(weight=weight, bias=jnp.zeros(fan_out)))
  return params


def patches(images: jax.Array) -> jax.Array:
  """(N, H, W, C) -> (N, H-2, W-2, C*9): a 3x3 valid convolution becomes a matmul."""
  return jax.lax.conv_general_dilated_patches(
      images, (KERNEL_SIZE, KERNEL_SIZE), (1, 1), "VALID",
      dimension_numbers=("NHWC", "OIHW", "NHWC"),
  )


def forward(
    params: Params,
    images: jax.Array,
    *,
    weight: Callable[[dict[str, jax.Array]], jax.Array] = lambda layer: layer["weight"],
    activation: Callable[[jax.Array], jax.Array] = lambda inputs: inputs,
) -> jax.Array:
  """The CNN's logits, with ``weight(layer)`` and ``activation(inputs)`` as quantizers.

  ``activation`` sees every layer's input (N, H, W, C) before the patches are
  taken: one value per pixel and channel, not nine copies of it.
  """
  hidden = images.reshape(-1, IMAGE_SIZE, IMAGE_SIZE, 1)
  for layer in params[:-1]:
    hidden = jax.nn.relu(patches(activation(hidden)) @ weight(layer).T + layer["bias"])
  features = activation(hidden).reshape(hidden.shape[0], -1)
  return features @ weight(params[-1]).T + params[-1]["bias"]


def max_scale(weight: jax.Array, quantization: Quantization) -> jax.Array:
  """The symmetric scale ``max|w| / qmax`` per output channel or per block."""
  _, scale, _ = jq.dynamic_quantize_linear(
      weight, dtype=quantization.weight_dtype, symmetric=True, **quantization.weight_layout
  )
  return scale


def with_learned_scales(params: Params, quantization: Quantization) -> Params:
  """Adds a ``weight_scale`` to every layer, started at the max-based scale (PTQ's)."""
  return [dict(layer, weight_scale=max_scale(layer["weight"], quantization)) for layer in params]


def weight_scale(layer: dict[str, jax.Array], quantization: Quantization) -> jax.Array:
  if quantization.learned_scales:
    return layer["weight_scale"]
  return max_scale(layer["weight"], quantization)


def fake_quantized_weight(layer: dict[str, jax.Array], quantization: Quantization) -> jax.Array:
  weight, scale = layer["weight"], weight_scale(layer, quantization)
  if not quantization.learned_scales:
    return jq.fake_quantize(
        weight, scale, dtype=quantization.weight_dtype, **quantization.weight_layout
    )
  elements_per_scale = weight.size // scale.size
  # No zero point: symmetric LSQ, as published. Adam divides by the
  # gradient's running RMS, so grad_factor changes little here; it matters
  # under SGD, the optimizer LSQ was designed with.
  return jq.fake_quantize_learnable(
      weight, scale, dtype=quantization.weight_dtype,
      grad_factor=jq.lsq_grad_factor(elements_per_scale, dtype=quantization.weight_dtype),
      **quantization.weight_layout,
  )


def fake_quantized_forward(
    params: Params, images: jax.Array, quantization: Quantization
) -> jax.Array:
  """The forward pass QAT trains: fake-quantized weights and activations."""
  return forward(
      params, images,
      weight=functools.partial(fake_quantized_weight, quantization=quantization),
      activation=functools.partial(
          jq.fake_quantize_dynamic, dtype=quantization.activation_dtype, axis=0
      ),
  )


def quantize_model(params: Params, quantization: Quantization) -> Params:
  """The model as deployed: integer weights (int8, int4 or int2), their scales, float biases."""
  layers = []
  for layer in params:
    scale = weight_scale(layer, quantization)
    weight = jq.quantize_linear(
        layer["weight"], scale, output_dtype=quantization.weight_dtype,
        **quantization.weight_layout,
    )
    layers.append(dict(weight=weight, scale=scale, bias=layer["bias"]))
  return layers


def quantized_forward(
    layers: Params, images: jax.Array, quantization: Quantization
) -> jax.Array:
  """Inference from the integer weights, activations quantized per example."""

  def weight(layer):
    return jq.dequantize_linear(layer["weight"], layer["scale"], **quantization.weight_layout)

  def activation(inputs):
    quantized, scale, zero_point = jq.dynamic_quantize_linear(
        inputs, dtype=quantization.activation_dtype, axis=0
    )
    return jq.dequantize_linear(quantized, scale, zero_point, axis=0)

  return forward(layers, images, weight=weight, activation=activation)


def train(
    forward: Callable[[Params, jax.Array], jax.Array],
    params: Params,
    data: Data,
    *,
    learning_rate: float,
    epochs: int,
    seed: int,
    batch_size: int = 64,
) -> tuple[Params, list[float]]:
  """Adam with a cosine-decayed learning rate; returns the params and the mean loss per epoch."""
  steps_per_epoch = data.train_images.shape[0] // batch_size
  optimizer = optax.adam(
      optax.cosine_decay_schedule(learning_rate, epochs * steps_per_epoch)
  )

  def loss_fn(params, images, labels):
    logits = forward(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @jax.jit
  def train_step(params, optimizer_state, images, labels, batch):
    # The batch is gathered inside the step: one dispatch per step, not three.
    loss, grads = jax.value_and_grad(loss_fn)(params, images[batch], labels[batch])
    updates, optimizer_state = optimizer.update(grads, optimizer_state, params)
    return optax.apply_updates(params, updates), optimizer_state, loss

  optimizer_state = optimizer.init(params)
  shuffle = np.random.default_rng(seed)
  epoch_losses = []
  for _ in range(epochs):
    order = shuffle.permutation(data.train_images.shape[0])
    losses = []
    # The last partial batch is dropped (a new shape would compile a new step);
    # reshuffling every epoch still visits every example.
    for step in range(steps_per_epoch):
      batch = order[step * batch_size:(step + 1) * batch_size]
      params, optimizer_state, loss = train_step(
          params, optimizer_state, data.train_images, data.train_labels, batch
      )
      losses.append(loss)
    epoch_losses.append(float(jnp.mean(jnp.stack(losses))))
  return params, epoch_losses


def accuracy(logits: jax.Array, labels: jax.Array) -> float:
  return float(jnp.mean(jnp.argmax(logits, axis=-1) == labels))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> float:
  return float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())


@functools.partial(jax.jit, static_argnames="quantization")
def _quantized_logits(layers, images, quantization):
  return quantized_forward(layers, images, quantization)


@functools.partial(jax.jit, static_argnames="quantization")
def _fake_quantized_logits(params, images, quantization):
  return fake_quantized_forward(params, images, quantization)


def quantized_test_logits(
    params: Params, data: Data, quantization: Quantization
) -> jax.Array:
  """Test logits of real quantized inference, checked against the fake-quantized forward."""
  layers = quantize_model(params, quantization)
  logits = _quantized_logits(layers, data.test_images, quantization)
  # Bit for bit: fake quantization is dequantize(quantize(x)), so both
  # matmuls see identical operands.
  np.testing.assert_array_equal(
      np.asarray(logits), np.asarray(_fake_quantized_logits(params, data.test_images, quantization))
  )
  return logits


def run(
    seed: int = 0,
    *,
    float_epochs: int = 60,
    qat_epochs: int = 30,
    float_learning_rate: float = 3e-3,
    qat_learning_rate: float = 1e-3,
) -> dict[str, Any]:
  """Trains the float model, then quantizes it with every scheme in ``QUANTIZATIONS``.

  For each scheme ``bits`` (``"int8"``, ``"int4"``, ``"int2"``) there are two
  models: ``f"{bits}_ptq"``, the float model quantized as it is, and
  ``f"{bits}_qat"``, the float model fine-tuned through fake quantization for
  ``qat_epochs``. Both are evaluated by real quantized inference.

  Returns:
    A dict of dicts keyed by model name (``"float"``, ``"int8_ptq"``, ...):
    ``accuracy`` and ``test_loss`` on the test set; ``train_losses``, the mean
    training loss per epoch of ``"float"`` and each ``"*_qat"`` (the QAT
    curves continue from the float model); ``params`` of the trained models;
    ``logits``, the test logits of every quantized model (equal bit for bit to
    its fake-quantized forward). Also ``seconds``, the wall time.
  """
  start = time.perf_counter()
  data = load_data()
  float_params, float_losses = train(
      forward, init_params(jax.random.key(seed)), data,
      learning_rate=float_learning_rate, epochs=float_epochs, seed=seed,
  )
  logits = dict(float=jax.jit(forward)(float_params, data.test_images))
  params = dict(float=float_params)
  train_losses = dict(float=float_losses)
  for index, (bits, quantization) in enumerate(QUANTIZATIONS.items()):
    # PTQ is also where QAT starts: learned scales begin at max|w| / qmax.
    ptq_params = (
        with_learned_scales(float_params, quantization) if quantization.learned_scales
        else float_params
    )
    logits[f"{bits}_ptq"] = quantized_test_logits(ptq_params, data, quantization)
    qat_params, train_losses[f"{bits}_qat"] = train(
        functools.partial(fake_quantized_forward, quantization=quantization), ptq_params,
        data, learning_rate=qat_learning_rate, epochs=qat_epochs, seed=seed + 1 + index,
    )
    params[f"{bits}_qat"] = qat_params
    logits[f"{bits}_qat"] = quantized_test_logits(qat_params, data, quantization)
  return dict(
      accuracy={name: accuracy(value, data.test_labels) for name, value in logits.items()},
      test_loss={name: cross_entropy(value, data.test_labels) for name, value in logits.items()},
      train_losses=train_losses,
      params=params,
      logits=logits,
      seconds=time.perf_counter() - start,
  )


def _describe(name: str) -> tuple[str, str, str]:
  """The model, weights and activations columns of the table."""
  bits, _, method = name.partition("_")
  if not method:
    return name, "float32", "float32"
  quantization = QUANTIZATIONS[bits]
  layout = (f"blocks of {quantization.block_size}" if quantization.block_size
            else "per channel")
  scales = ("learned scales (LSQ)" if method == "qat" and quantization.learned_scales
            else "max scales")
  activations = jnp.dtype(quantization.activation_dtype).name
  return f"{bits} {method.upper()}", f"{bits}, {layout}, {scales}", f"{activations}, per example"


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  results = run(args.seed)
  print("| model | weights | activations | test accuracy | test loss |")
  print("|---|---|---|---|---|")
  for name, accuracy_value in results["accuracy"].items():
    model, weights, activations = _describe(name)
    print(f"| {model} | {weights} | {activations} | {100 * accuracy_value:.2f}% | "
          f"{results['test_loss'][name]:.3f} |")
  print(f"\n{results['seconds']:.1f} s. Quantized models ran real quantized inference "
        "(integer weights and activations, dequantized), equal bit for bit to fake quantization.")


if __name__ == "__main__":
  main()
