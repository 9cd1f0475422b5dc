"""A sum over a short axis in a fixed order, for the state layers' batch-invariant mode.

XLA:CPU vectorizes a reduce by the shape around it: the same row summed in a [2, 4, 128] array and in a [64, 4, 128]
one can differ in the last bit, over the reduced axis whether it is the minor one or not, and where the shape's
threshold lies moves between jax releases (0.12.1 moved it for the conv's 4 taps at 8 rows). A recurrent step's
sums then depend on how many sequences share the step, and the conv's on how many tokens do, so a prompt split
into chunks, or a sequence batched with others, gave other bits. Elementwise adds have one order at every shape (XLA
does not reassociate floating-point adds), so the sum here is pairwise halving: the axis zero-padded to a power of
two, its first half added to its second, until one slice is left. Each level is an add of two contiguous halves,
which vectorizes; a left-to-right chain of adds, the other fixed order, measured 2-4x slower in the Gated DeltaNet
(BENCHMARKS.md has the invariant forms against the reduces).

For long rows (an RMSNorm over the hidden size) the C++ `invariant_row_sum` (kernels_pallas/matmul/invariant_cpu.py)
is the fixed-order sum: its vector lanes run across rows; this one is for the axes of a few to a few hundred
elements inside the state layers' steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """x summed over `axis` pairwise (x_0..x_{h-1} + x_h..x_{2h-1}, halving), the same bits whatever x's other
    dimensions are. Zero padding adds nothing: x + 0 is x."""
    axis = axis % x.ndim
    n = x.shape[axis]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        x = jnp.pad(x, [(0, size - n) if a == axis else (0, 0) for a in range(x.ndim)])
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, half, axis=axis) + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
    return jax.lax.index_in_dim(x, 0, axis, keepdims=False)
