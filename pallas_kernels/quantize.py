"""Fused quantize: float blocks in, quantized blocks out, scales read per block.

The formula comes from the caller (jaxquant's ``quantize_formula``); on
Triton its division and rounding are made IEEE-exact (``_exact``), so the
kernel agrees with XLA bit for bit. It is also the second pass of
``dynamic_quantize``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from pallas_kernels import _blockwise

Formula = Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]


def quantize(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    formula: Formula,
    output_dtype: np.dtype,
    backend: _blockwise.Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
) -> jax.Array:
  """``formula(x, scale, zero_point)`` in one Pallas kernel.

  Args:
    x: the float input.
    scale: same rank as x; each dim x's size or 1.
    zero_point: like ``scale``, or ``None``.
    formula: the element-wise quantization, returning ``output_dtype``.
    output_dtype: the quantized dtype.
    backend, interpret, max_block: see ``_blockwise.elementwise``.

  Returns:
    The quantized array, shaped like x.
  """
  (y,) = _blockwise.elementwise(
      lambda *args: (formula(*args),), [x, scale, zero_point], [output_dtype],
      backend=backend, interpret=interpret, max_block=max_block, name="quantize",
  )
  return y


def quantize_reference(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None,
    *,
    formula: Formula,
    output_dtype: np.dtype,
) -> jax.Array:
  """The pure-XLA twin of :func:`quantize`."""
  return formula(x, scale, zero_point).astype(output_dtype)
