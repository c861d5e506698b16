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
    blocks: Sequence[int] | None = None,
    backend: _blockwise.Backend | None = None,
    interpret: bool = False,
    max_block: tuple[int, int] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""Quantizes ``x`` with parameters computed from ``x``, in two Pallas passes.

  .. math::

    (\mathrm{scale}, \mathrm{zero\_point}) =
        \mathrm{parameters}\left(\mathrm{reduction}(x, R)\right), \quad
    y_i = \mathrm{formula}\left(x_i, \mathrm{scale}_{\pi(i)},
        \mathrm{zero\_point}_{\pi(i)}\right)

  where :math:`R` holds the dims with ``keep`` False and :math:`\pi(i)_d` is
  :math:`\lfloor i_d / \mathrm{blocks}_d \rfloor` along kept dims and 0 along
  reduced ones (``reduction`` then runs over each block too). The first kernel
  reduces each tile to partial statistics, which ``reduction`` combines again
  in XLA (so it must be associative); ``parameters`` runs in XLA; the second
  pass is :func:`quantize`. x is read exactly twice, whatever the
  granularity. jaxquant passes its NaN-ignoring min/max (or, symmetric, max
  ``|x|``) reduction, the matching scale and zero point rule, and
  ``quantize_formula`` (:func:`jaxquant.dynamic_quantize_linear` with
  ``implementation="pallas"``).

  Args:
    x: the float input.
    keep: per dim of x, whether parameters vary along it (else it is reduced).
    reduction: ``reduction(block, axes)``: associative statistics over ``axes``
      with kept size-1 dims, ignoring NaN (e.g. the NaN-ignoring min and max);
      tile padding also reads as NaN.
    parameters: ``(scale, zero_point)`` from the statistics (run in XLA).
    formula: ``formula(x, scale, zero_point)``, the element-wise quantization.
    output_dtype: what ``formula`` returns.
    blocks: per kept dim of x, the elements one parameter covers there (a
      block, the last one possibly short, padded with NaN); default 1.
    backend: ``"tpu"`` (Mosaic) or ``"triton"``; ``None`` picks per platform
      when the call is lowered (interpret mode on CPU).
    interpret: run in Pallas interpret mode on every platform.
    max_block: caps on the tile's (rows, lanes); default per backend.

  Returns:
    ``(y, scale, zero_point)``: ``y`` shaped like x in ``output_dtype``; the
    parameters as ``parameters`` returns them, shaped like x with the reduced
    dims set to 1 and a blocked dim counting blocks.

  Raises:
    IndexError: from the layout code when ``keep`` is shorter than x's rank
      (a longer one is not detected); other misuse fails inside JAX or the
      callables. The kernels check nothing themselves: their caller,
      :func:`jaxquant.dynamic_quantize_linear`, validates.

  Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels
    >>> def reduction(x, axes):  # the NaN-ignoring max |x|
    ...   return (jnp.nanmax(jnp.abs(x), axes, keepdims=True),)
    >>> def parameters(amax):  # symmetric int8
    ...   return amax / 127, jnp.zeros(amax.shape, jnp.int8)
    >>> def formula(x, scale, zero_point):
    ...   q = jnp.round(x / scale) + zero_point
    ...   return jnp.clip(q, -127, 127).astype(jnp.int8)
    >>> x = jnp.array([[-127.0, 0.0, 63.5, 31.75], [254.0, -1.0, 3.0, -254.0]])
    >>> y, scale, zero_point = pallas_kernels.dynamic_quantize(
    ...     x, (True, False), reduction=reduction, parameters=parameters,
    ...     formula=formula, output_dtype=jnp.int8, interpret=True)
    >>> y, scale  # one scale per row
    (Array([[-127,    0,   64,   32],
           [ 127,    0,    2, -127]], dtype=int8), Array([[1.],
           [2.]], dtype=float32))
  """
  statistics = _blockwise.reduce(
      reduction, x, keep, blocks=blocks, pad_value=np.nan,
      backend=backend, interpret=interpret, max_block=max_block,
      name="dynamic_quantize_statistics",
  )
  scale, zero_point = parameters(*statistics)
  y = quantize.quantize(
      x, scale, zero_point, formula=formula, output_dtype=output_dtype, blocks=blocks,
      backend=backend, interpret=interpret, max_block=max_block,
  )
  return y, scale, zero_point
