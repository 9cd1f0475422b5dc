"""Batch-invariant numerics for a built decoder: `make_batch_invariant(model)` switches every projection and the LM
head to the row-invariant C++ matmul (`kernels_pallas/matmul/invariant_cpu.py`), the norms to a fixed-order mean
square (`invariant_row_sum`) and a correctly rounded rsqrt (`invariant_rsqrt`), the state layers (Gated DeltaNet,
Mamba2) to their invariant forms (`kernels_pallas/recurrent/ordered_sum.py`), and the cache-free forward's attention
to the paged C++ kernel (`kernels_pallas/attention/causal.py`).

Why these: they are the ops whose float program for one row depends on the other rows. XLA:CPU's dot picks its
blocking (and so its summation order) from the row count, its reduces vectorize by the shape, and its rsqrt has
given one row other bits than many; RoPE (C++ tables), activations, residual adds and the sampler's max and argmax
are row-wise in XLA:CPU (the sampler's sums take `invariant_row_sum` itself), and the paged attention kernel gives
a query row the same bits whatever chunk or query block it falls in (tests/inference/test_batch_invariance.py and
the state layers' tests check each). With both switched, a request's logits are the same bits
whatever else is in the batch, and `Decoder.forward` (a trainer's forward, `inference.rl.log_probs`) computes each
position the way the engine's paged step does.

The flags are plain attributes of the modules, so they live in the graphdef: a jitted step traced from a switched
model is a different program, and the default (`batch_invariant` False everywhere) is untouched.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from kernels_pallas.attention import cpu as attention_cpu
from kernels_pallas.backend import target_backend
from kernels_pallas.matmul import invariant_cpu
from kernels_pallas.native import gate
from models.attention import Attention
from models.decoder import Decoder
from models.gated_deltanet import GatedDeltaNet
from models.layers import Embed, Linear, RMSNorm
from models.quantization.modes import is_quantized


def batch_invariance_problems(model: Decoder) -> list[str]:
    """Why `model` cannot be made batch-invariant (empty when it can): each entry names the problem and the fix."""
    config = model.config
    problems = []
    if config.is_mla:
        problems.append("multi-head latent attention (MLA) runs its own einsums and attention; use a GQA model")
    if any(config.is_moe(i) for i in range(config.num_layers)):
        problems.append("a mixture of experts routes tokens through grouped matmuls (ragged_dot) that are not "
                        "row-invariant; use a dense model")
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (Linear, Embed)):
            w = node.kernel.get_value() if isinstance(node, Linear) else node.embedding.get_value()
            name = ".".join(str(p) for p in path)
            if is_quantized(w):
                problems.append(f"{name} holds quantized weights; load the model unquantized (quantization=None)")
                break
            if w.dtype != jnp.float32:
                problems.append(f"{name} is {w.dtype}; the invariant matmul is float32 (pass dtype='float32')")
                break
    return problems


def make_batch_invariant(model: Decoder) -> Decoder:
    """Switch `model` (in place; returned) to the batch-invariant kernels, or raise ValueError listing what stands in
    the way. Needs the C++ CPU kernels (a compiler; not PAGEJAX_CPU_KERNELS=0): there is no invariant matmul on
    other backends yet."""
    problems = batch_invariance_problems(model)
    if target_backend() != "cpu":
        problems.append(f"the backend is {target_backend()}; the invariant matmul is a C++ CPU kernel (no Pallas "
                        "one yet): run on CPU")
    for kernel in (invariant_cpu.KERNEL, attention_cpu.KERNEL):
        reason = gate.unavailable_reason(kernel)
        if reason is not None:
            problems.append(f"batch_invariant needs the C++ CPU kernels, and {kernel.target} cannot run: {reason}")
    if problems:
        raise ValueError("batch_invariant=True is not possible for this model: " + "; ".join(problems))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, (Decoder, Linear, Embed, RMSNorm, Attention, GatedDeltaNet)):
            node.batch_invariant = True
    return model


__all__ = ["batch_invariance_problems", "make_batch_invariant"]
