"""Fused quantized add: two dequantizations, the add, the requantization and the clamp in one pass.

``a`` and ``b`` broadcast by the kernel's index maps (a size-1 dim is read
with block index 0), so neither is materialised at the output's shape; the
per-tensor scales and zero points ride along as one-element blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _blockwise

Formula = Callable[..., jax.Array]


def _same_rank(arrays: Sequence[jax.Array | None], rank: int) -> list[jax.Array | None]:
  return [
      None if a is None else jnp.reshape(a, (1,) * (rank - a.ndim) + a.shape)
      for a in arrays
  ]


def quantized_add(
    a: jax.Array,
    b: jax.Array,
    parameters: Sequence[jax.Array | None],
    *,
    formula: Formula,
    output_dtype: np.dtype,
    backend: _blockwise.Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
) -> jax.Array:
  """``formula(a, b, *parameters)`` over the broadcast of a and b, in one Pallas kernel.

  Args:
    a, b: quantized operands, broadcastable NumPy-style.
    parameters: per-tensor scales and zero points (scalars or ``None``).
    formula: the element-wise quantized add, returning ``output_dtype``.
    output_dtype: the result's dtype.
    backend, interpret, max_block: see ``_blockwise.elementwise``.

  Returns:
    The sum, shaped ``broadcast_shapes(a.shape, b.shape)``.
  """
  rank = max(a.ndim, b.ndim)
  (y,) = _blockwise.elementwise(
      lambda *args: (formula(*args),),
      _same_rank([a, b, *parameters], rank),
      [output_dtype],
      backend=backend, interpret=interpret, max_block=max_block, name="quantized_add",
  )
  return y


def quantized_add_reference(
    a: jax.Array,
    b: jax.Array,
    parameters: Sequence[jax.Array | None],
    *,
    formula: Formula,
    output_dtype: np.dtype,
) -> jax.Array:
  """The pure-XLA twin of :func:`quantized_add`."""
  shape = jnp.broadcast_shapes(a.shape, b.shape)
  return jnp.broadcast_to(formula(a, b, *parameters), shape).astype(output_dtype)
