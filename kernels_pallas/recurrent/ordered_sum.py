"""A sum over a short axis in a fixed order, for the state layers' batch-invariant mode.

XLA:CPU vectorizes a reduce by the shape around it: the same row summed in a [2, 4, 128] array and in a [64, 4, 128]
one can differ in the last bit, over the reduced axis whether it is the minor one or not, and where the shape's
threshold lies moves between jax releases (0.12.1 moved it for the conv's 4 taps at 8 rows). A recurrent step's
sums then depend on how many sequences share the step, and the conv's on how many tokens do, so a prompt split
into chunks, or a sequence batched with others, gave other bits. A chain of adds, left to right, has one order at
every shape: XLA does not reassociate floating-point adds.

For long rows (an RMSNorm over the hidden size) the C++ `invariant_row_sum` (kernels_pallas/matmul/invariant_cpu.py)
is the fixed-order sum: its vector lanes run across rows; this chain is for the axes of a few to a few hundred
elements inside the state layers' steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """x summed over `axis` as ((x_0 + x_1) + x_2) + ..., the same bits whatever x's other dimensions are."""
    axis = axis % x.ndim
    return functools.reduce(jnp.add, (jax.lax.index_in_dim(x, i, axis, keepdims=False)
                                      for i in range(x.shape[axis])))
