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
  r"""Adds quantized ``a`` and ``b`` by the caller's ``formula`` in one Pallas kernel.

  .. math::

    y_i = \mathrm{formula}\left(a_{\alpha(i)}, b_{\beta(i)}, p_1, \ldots, p_k\right)

  element-wise over ``broadcast_shapes(a.shape, b.shape)``, where ``a`` and
  ``b`` get leading size-1 dims up to the output's rank and
  :math:`\alpha(i)_d = i_d` where a has the output's size along dim d and 0
  where it has size 1 (likewise :math:`\beta` for b): the block index maps
  broadcast, so neither operand is materialised at the output's shape. The
  parameters :math:`p_j` ride along as one-element blocks. jaxquant passes
  the dequantize-add-requantize formula of :func:`jaxquant.quantized_add`.
  On Triton the formula's float32 division and ``jnp.round`` are rewritten
  to IEEE-exact forms, as in :func:`quantize`.

  Args:
    a, b: quantized operands, broadcastable NumPy-style.
    parameters: per-tensor scales and zero points (scalars or ``None``),
      passed to ``formula`` after ``a`` and ``b`` in this order.
    formula: the element-wise quantized add ``formula(a, b, *parameters)``,
      written in ``jnp`` and returning ``output_dtype``; it sees blocks of the
      operands, broadcast NumPy-style.
    output_dtype: the result's dtype.
    backend: ``"tpu"`` (Mosaic) or ``"triton"``; ``None`` picks per platform
      when the call is lowered (interpret mode on CPU).
    interpret: run in Pallas interpret mode on every platform.
    max_block: caps on the tile's (rows, lanes); default per backend.

  Returns:
    The sum of ``output_dtype``, shaped ``broadcast_shapes(a.shape, b.shape)``.

  Raises:
    TypeError: from JAX (typically a reshape) when a and b do not broadcast.
      The kernel checks nothing itself (a non-scalar parameter may even pass
      silently): its caller, :func:`jaxquant.quantized_add`, validates dtypes
      and shapes.

  Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels
    >>> def formula(a, b, a_scale, b_scale):
    ...   total = jnp.round(a * a_scale + b * b_scale)  # ties to even
    ...   return jnp.clip(total, -128, 127).astype(jnp.int8)
    >>> a = jnp.array([[10], [100]], jnp.int8)
    >>> b = jnp.array([0, 1, 2, 60], jnp.int8)
    >>> parameters = [jnp.float32(1.0), jnp.float32(0.5)]
    >>> pallas_kernels.quantized_add(a, b, parameters, formula=formula,
    ...                              output_dtype=jnp.int8, interpret=True)
    Array([[ 10,  10,  11,  40],
           [100, 100, 101, 127]], dtype=int8)
  """
  rank = max(a.ndim, b.ndim)
  (y,) = _blockwise.elementwise(
      lambda *args: (formula(*args),),
      _same_rank([a, b, *parameters], rank),
      [output_dtype],
      backend=backend, interpret=interpret, max_block=max_block, name="quantized_add",
  )
  return y
