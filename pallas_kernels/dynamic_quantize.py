"""Dynamic quantization as a kernel pair: a min/max pass, then a quantize pass.

The first kernel reduces each tile of x to partial statistics (one per tile
and parameter, a small fraction of x) and XLA combines them; the caller turns
them into scales and zero points (a few elements per row or block); the
second kernel quantizes. x is read exactly twice, whatever the granularity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from pallas_kernels import _blockwise
from pallas_kernels import quantize

Reduction = Callable[[jax.Array, tuple[int, ...]], Sequence[jax.Array]]


def dynamic_quantize(
    x: jax.Array,
    keep: Sequence[bool],
    *,
    reduction: Reduction,
    parameters: Callable[..., tuple[jax.Array, jax.Array]],
    formula: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    output_dtype: np.dtype,
    backend: _blockwise.Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Quantizes x with parameters computed from x, in two Pallas passes.

  Args:
    x: the float input, in the caller's blocked view (ragged blocks padded
      with NaN, which the reduction must ignore).
    keep: per dim of x, whether parameters vary along it (else it is reduced).
    reduction: ``reduction(block, axes)``: associative statistics over ``axes``
      with kept size-1 dims, ignoring NaN (e.g. the NaN-ignoring min and max).
    parameters: ``(scale, zero_point)`` from the statistics (run in XLA).
    formula: ``formula(x, scale, zero_point)``, the element-wise quantization.
    output_dtype: what ``formula`` returns.
    backend, interpret, max_block: see ``_blockwise.elementwise``.

  Returns:
    ``(y, scale, zero_point)``; the parameters are shaped like x with the
    reduced dims set to 1.
  """
  statistics = _blockwise.reduce(
      reduction, x, keep, pad_value=np.nan,
      backend=backend, interpret=interpret, max_block=max_block,
      name="dynamic_quantize_statistics",
  )
  scale, zero_point = parameters(*statistics)
  y = quantize.quantize(
      x, scale, zero_point, formula=formula, output_dtype=output_dtype,
      backend=backend, interpret=interpret, max_block=max_block,
  )
  return y, scale, zero_point


def dynamic_quantize_reference(
    x: jax.Array,
    keep: Sequence[bool],
    *,
    reduction: Reduction,
    parameters: Callable[..., tuple[jax.Array, jax.Array]],
    formula: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    output_dtype: np.dtype,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The pure-XLA twin of :func:`dynamic_quantize`."""
  axes = tuple(d for d, k in enumerate(keep) if not k)
  scale, zero_point = parameters(*reduction(x, axes))
  y = quantize.quantize_reference(
      x, scale, zero_point, formula=formula, output_dtype=output_dtype
  )
  return y, scale, zero_point
