"""Forward + backward time of the fake-quant ops against peers, in one run.

    python benchmarks/fake.py [--sizes 1048576 4194304] [--repeats 7]

Each row times one training-step worth of work, ``value_and_grad`` of
``sum(w * fake_quantize(x))`` with respect to x (and to the scale and zero
point for the learnable op), jitted, on a (rows, 1024) float32 array. Peers,
on the same data:
  * ``jnp``: the masked straight-through estimator a user writes by hand,
    ``where(mask, x - stop_gradient(x), 0) + stop_gradient(fake)`` with
    ``x / scale`` and ``jnp.round``, jitted. Not bit-exact (docs/numerics.md, "XLA traps": XLA
    turns the division into a multiply); only a speed bar.
  * ``torch``: PyTorch's CPU ``fake_quantize_per_tensor_affine``,
    ``fake_quantize_per_channel_affine`` and
    ``_fake_quantize_learnable_per_channel_affine``, forward and backward.
Reported: best-of-N milliseconds and jaxquant's speed-up over each peer
(> 1 means jaxquant is faster). Compare ratios within a run only.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxquant as jq
from _timing import best_ms


def _hand_rolled(x, scale):
  rounded = jnp.round(x / scale)
  mask = (rounded >= -128) & (rounded <= 127)
  fake = jnp.clip(rounded, -128, 127) * scale
  return jnp.where(mask, x - jax.lax.stop_gradient(x), 0) + jax.lax.stop_gradient(fake)


def _step(fake_quantize, weights, argnums=0):
  """A jitted value_and_grad of ``sum(weights * fake_quantize(*args))``."""
  return jax.jit(jax.value_and_grad(
      lambda *args: jnp.sum(weights * fake_quantize(*args)), argnums=argnums))


def _torch_time(forward, tensors, weights, repeats):
  def step():
    for tensor in tensors:
      tensor.grad = None
    (forward(*tensors) * weights).sum().backward()
    return None
  return best_ms(step, repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22])
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)")
  print("| op | elements | layout | jaxquant ms | vs jnp STE | vs torch |")
  print("|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for size in args.sizes:
    columns = 1024
    rows = size // columns
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    weights = rng.standard_normal((rows, columns)).astype(np.float32)
    channel_scale = rng.uniform(0.01, 0.03, columns).astype(np.float32)
    channel_zero_point = rng.integers(-5, 5, columns).astype(np.float32)
    x_jax, weights_jax = jnp.asarray(x), jnp.asarray(weights)
    x_torch, weights_torch = torch.tensor(x, requires_grad=True), torch.tensor(weights)

    scale = jnp.asarray(channel_scale)
    zero_point = jnp.asarray(channel_zero_point)
    torch_scale = torch.tensor(channel_scale, requires_grad=True)
    torch_zero_point = torch.tensor(channel_zero_point, requires_grad=True)
    torch_int_zero_point = torch.zeros(columns, dtype=torch.int32)
    cases = [
        ("fake_quantize", "per-tensor", _step(lambda x: jq.fake_quantize(x, 0.02), weights_jax),
         (x_jax,), _step(lambda x: _hand_rolled(x, 0.02), weights_jax),
         lambda x: torch.fake_quantize_per_tensor_affine(x, 0.02, 0, -128, 127), [x_torch]),
        ("fake_quantize", "per-axis",
         _step(lambda x: jq.fake_quantize(x, scale, axis=1), weights_jax), (x_jax,),
         _step(lambda x: _hand_rolled(x, scale), weights_jax),
         lambda x: torch.fake_quantize_per_channel_affine(
             x, torch_scale.detach(), torch_int_zero_point, 1, -128, 127), [x_torch]),
        ("fake_quantize_learnable", "per-axis",
         _step(lambda x, scale, zero_point: jq.fake_quantize_learnable(
             x, scale, zero_point, axis=1), weights_jax, argnums=(0, 1, 2)),
         (x_jax, scale, zero_point), None,
         lambda x, scale, zero_point: torch._fake_quantize_learnable_per_channel_affine(
             x, scale, zero_point, 1, -128, 127, 1.0),
         [x_torch, torch_scale, torch_zero_point]),
    ]
    rows_out = []
    for op, layout, ours, operands, hand, torch_forward, torch_tensors in cases:
      rows_out.append((
          op, layout, best_ms(lambda: ours(*operands), args.repeats),
          None if hand is None else best_ms(lambda: hand(x_jax), args.repeats),
          _torch_time(torch_forward, torch_tensors, weights_torch, args.repeats),
      ))
    for op, layout, ours, hand_ms, torch_ms in rows_out:
      versus_hand = "-" if hand_ms is None else f"{hand_ms / ours:.2f}"
      print(f"| {op} | {size} | {layout} | {ours:.2f} | {versus_hand} | "
            f"{torch_ms / ours:.2f} |")


if __name__ == "__main__":
  main()
