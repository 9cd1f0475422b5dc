"""The batch-invariant float32 matmul: a C++ kernel (`csrc/invariant_matmul_cpu.cc`) through XLA's FFI.

Why: XLA:CPU's dot gives a row a result that depends on how many rows the matmul has (BENCHMARKS.md, "Batch
invariance today"), so a request's logits depend on what else is in the batch and a trainer's sequence-long forward
cannot reproduce an engine's decode step bit for bit. The kernel's contract is that y[m, n] is one fused-multiply-add
chain over k in index order, whatever M, the row's position or the thread count; `invariant_matmul_reference` spells
the same contract in JAX (a `lax.fori_loop` of fmas, slow, for tests).

`invariant_matmul` is differentiable: a `jax.custom_vjp` whose forward is the kernel and whose backward is XLA's
plain matmuls (a gradient needs no invariance, and the forward's value is what a logprob ratio compares).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.native import gate

KERNEL = gate.CpuKernel("pagejax_invariant_matmul_cpu", "PagejaxInvariantMatmulCpu")


def _check(x: jax.Array, w: jax.Array, transposed: bool) -> None:
    k_w = w.shape[1] if transposed else w.shape[0] if w.ndim == 2 else None
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or w.ndim != 2 or x.ndim < 1 or x.shape[-1] != k_w:
        layout = "[N, K]" if transposed else "[K, N]"
        raise ValueError(f"invariant_matmul takes float32 x [..., K] and w {layout}, got {x.dtype}{list(x.shape)} "
                         f"and {w.dtype}{list(w.shape)}; batch_invariant=True needs float32, unquantized weights")


def _kernel_call(x: jax.Array, w: jax.Array, transposed: bool, portable: bool) -> jax.Array:
    kernel = KERNEL.build("portable") if portable else KERNEL
    gate.require(kernel)
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0] if transposed else w.shape[1]
    rows = x.reshape(-1, k)
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    y = jax.ffi.ffi_call(kernel.target, out, vmap_method="sequential")(rows, w, transposed=transposed)
    return y.reshape(*lead, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _invariant(x: jax.Array, w: jax.Array, transposed: bool, portable: bool) -> jax.Array:
    return _kernel_call(x, w, transposed, portable)


def _fwd(x, w, transposed, portable):
    return _kernel_call(x, w, transposed, portable), (x, w)


def _bwd(transposed, portable, residuals, g):
    x, w = residuals
    w_kn = w.T if transposed else w
    dx = g @ w_kn.T
    dw_kn = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
    return dx, (dw_kn.T if transposed else dw_kn)


_invariant.defvjp(_fwd, _bwd)


def invariant_matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False, portable: bool = False) -> jax.Array:
    """float32 x [..., K] @ w [K, N] (or @ w.T for w [N, K] with `transposed`, a tied LM head) -> float32 [..., N],
    each element one fma chain over k in order (the module docstring). CPU only; `portable` runs the build without
    AVX-512 (what such a CPU runs; tests compare both). Differentiable (XLA matmuls backward)."""
    _check(x, w, transposed)
    return _invariant(x, w, transposed, portable)


SUM_CHUNK = 64  # invariant_row_sum: chains of 64, then one chain over the chunk sums (error ~ (64 + N / 64) ulp)


def invariant_row_sum(x: jax.Array) -> jax.Array:
    """float32 x [..., N] -> [...]: each row's sum in a fixed order, whatever the row count. Why: XLA:CPU's row
    reductions of short rows (RMSNorm over 64 features, a log-softmax over 256 logits) vectorize across rows, so
    their bits depend on how many rows there are (tests/inference/test_batch_invariance.py). Two invariant matmuls
    of ones against the rows: each 64-element chunk summed in order, then the chunk sums in order (the row
    zero-padded to whole chunks; adding 0 is exact). The rows are the matmul's transposed operand, so they fill the
    kernel's vector lanes (as its x, one lane of sixteen would be used)."""
    if x.dtype != jnp.float32:
        raise ValueError(f"invariant_row_sum takes float32, got {x.dtype}")
    lead, n = x.shape[:-1], x.shape[-1]
    chunks = -(-n // SUM_CHUNK)
    rows = jnp.pad(x.reshape(-1, n), ((0, 0), (0, chunks * SUM_CHUNK - n)))

    def sums(v: jax.Array, width: int) -> jax.Array:  # v [R * width] -> the R in-order sums of its rows
        return invariant_matmul(jnp.ones((1, width), jnp.float32), v.reshape(-1, width), transposed=True)[0]

    return sums(sums(rows, SUM_CHUNK), chunks).reshape(lead)


def invariant_rsqrt(x: jax.Array) -> jax.Array:
    """1 / sqrt(x) from two correctly rounded IEEE operations: the same bits at any shape. Why: XLA:CPU's rsqrt is
    not one function everywhere; jax 0.12.0.1's programs at LLVM -O0 gave a one-row RMSNorm other bits than the same
    row among 300 (tests/inference/test_batch_invariance.py). The barrier keeps XLA from rewriting 1 / sqrt(x) back
    into rsqrt(x) (it does, and then the bits differ the same way)."""
    return 1.0 / jax.lax.optimization_barrier(jnp.sqrt(x))


def invariant_matmul_reference(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """The kernel's order in JAX: acc = acc + x[..., k] * w[k, :] for k = 0 .. K-1 (`lax.fori_loop`). JAX has no
    fma op, so this rounds the product separately and agrees with the kernel to rounding, not bitwise; the bitwise
    contract is tested between the kernel's AVX-512 and portable (std::fma) builds and across row counts."""
    _check(x, w, transposed)
    w_kn = w.T if transposed else w
    rows = x.reshape(-1, x.shape[-1])

    def step(k, acc):
        return acc + rows[:, k, None] * w_kn[k][None, :]

    acc = jax.lax.fori_loop(0, rows.shape[1], step, jnp.zeros((rows.shape[0], w_kn.shape[1]), jnp.float32))
    return acc.reshape(*x.shape[:-1], w_kn.shape[1])


__all__ = ["KERNEL", "invariant_matmul", "invariant_matmul_reference", "invariant_row_sum", "invariant_rsqrt"]
