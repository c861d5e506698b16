"""Fused quantize: float blocks in, quantized blocks out, scales read per block.

The formula comes from the caller (jaxquant's ``quantize_formula``); on
Triton its division and rounding are made IEEE-exact (``_exact``), so the
kernel agrees with XLA bit for bit. It is also the second pass of
``dynamic_quantize``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    blocks: Sequence[int] | None = None,
    backend: _blockwise.Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
) -> jax.Array:
  r"""Quantizes ``x`` with the caller's ``formula``, in one fused Pallas kernel.

  .. math::

    y_i = \mathrm{formula}\left(x_i, \mathrm{scale}_{\pi(i)},
        \mathrm{zero\_point}_{\pi(i)}\right)

  element-wise, the parameters read through the block index maps as in
  :func:`pallas_kernels.dequantize` (never expanded in HBM). jaxquant passes its
  ``quantize_formula`` (:func:`jaxquant.quantize_linear` with
  ``implementation="pallas"``). On Triton the formula's float32 division and
  ``jnp.round`` are rewritten to the IEEE-exact forms XLA computes (division
  rounded to nearest on CUDA, round half to even from ``floor``), so the
  kernel agrees with XLA evaluating the same formula bit for bit.

  Args:
    x: the float input.
    scale: same rank as x; each dim x's size ``n``, 1, or ``ceil(n / blocks[k])``
      (one scale per block of ``blocks[k]`` elements, the last possibly short).
    zero_point: like ``scale``, or ``None`` (passed to ``formula`` as ``None``).
    formula: the element-wise quantization ``formula(x, scale, zero_point)``,
      written in ``jnp`` and returning ``output_dtype``; it sees blocks of the
      operands, broadcast NumPy-style.
    output_dtype: the quantized dtype.
    blocks: per dim of x, the elements one parameter value covers (default 1).
    backend: ``"tpu"`` (Mosaic) or ``"triton"``; ``None`` picks per platform
      when the call is lowered (interpret mode on CPU).
    interpret: run in Pallas interpret mode on every platform.
    max_block: caps on the tile's (rows, lanes); default per backend.

  Returns:
    The quantized array of ``output_dtype``, shaped like x.

  Raises:
    TypeError: from JAX (typically a reshape) for operands outside the
      contract above. The kernel checks nothing itself: its caller,
      :func:`jaxquant.quantize_linear`, validates dtypes and shapes.

  Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels
    >>> def formula(x, scale, zero_point):
    ...   q = jnp.round(x / scale) + zero_point  # ties to even
    ...   return jnp.clip(q, -128, 127).astype(jnp.int8)
    >>> x = jnp.array([[-0.75, -0.25, 0.25, 0.75], [1.25, 100.0, -100.0, 0.0]])
    >>> scale, zero_point = jnp.full((1, 1), 0.5), jnp.zeros((1, 1), jnp.int8)
    >>> pallas_kernels.quantize(x, scale, zero_point, formula=formula,
    ...                         output_dtype=jnp.int8, interpret=True)
    Array([[  -2,    0,    0,    2],
           [   2,  127, -128,    0]], dtype=int8)
  """
  (y,) = _blockwise.elementwise(
      lambda *args: (formula(*args),), [x, scale, zero_point], [output_dtype],
      blocks=blocks, backend=backend, interpret=interpret, max_block=max_block, name="quantize",
  )
  return y
