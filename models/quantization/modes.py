"""Quantized decoders: how `Linear` and `Embed` hold a `QuantizedWeight`, and which matmul they run.

A quantized projection keeps its `nnx.Param` and stores a `models.quantization.formats.QuantizedWeight` in it instead
of a float array. `QuantizedWeight` is a `flax.struct.dataclass`, so `nnx.split` / `jax.tree.flatten` see its arrays
(codes, scales, zero points or offsets) as ordinary parameter leaves: the runner's flat leaf list, `get_params` /
`update_weights` and jit all work unchanged, and no float copy of the weight is ever a parameter.

Modes (`LLM(quantization=...)`, `models.decoder.quantize_decoder`):

    "int8"  every linear weight (q/k/v/o, gate/up/down, the LM head) symmetric int8 per output channel; the token
            embedding too (per token row: the [hidden, vocab] transposed view quantized per column, looked up with
            `take_columns`, so a tied embedding is stored once). Matmuls run `matmul(method="int8")`: the activation
            is quantized dynamically per row (symmetric int8, one scale per token) and the dot is int8 x int8 ->
            int32 -- the W8A8 scheme. It is the fastest form measured on CPU and never materializes a float weight.
    "int4"  the layer linears asymmetric 4-bit in groups of `group_size` input rows (32 when it divides every input
            dimension, else 64), packed two per byte, in the min form x̂ = scale * z + min per group and column
            (`quantize_int4_minmax`: an integer zero point, `quantization.quantize_int4`, shifts the grid and
            measured KL 0.56 vs 0.005 nats on SmolLM2, whose weights already lie on Q4_1 grids); the LM head and
            embedding stay int8 per channel (as llama.cpp's Q4 mixes keep the output tensor at higher precision: the
            head is the most error-sensitive matrix and the largest, and per-channel int8 is also its fastest form).
            Grouped weights run `matmul(method="dequant")`: see `pick_method`.
    "int4-awq"  "int4" after AWQ-style scaling (`models.quantization.awq`): per-input-channel scales searched on
            calibration activations and folded into the float weights (norms, v_proj / up_proj columns) before
            quantizing, so the quantized model has exactly the "int4" structure and matmuls. `LLM` calibrates on the
            shipped calibration text at load time.
    "fp8"   every linear weight, the LM head and the embedding float8_e4m3fn per output channel (per token row for
            the embedding), as "int8" is laid out; an FP8 checkpoint (models/loaders/fp8_checkpoint.py) keeps its
            own codes and per-tensor / per-channel / 128x128 block scales. Matmuls run `matmul(method="fp8")` where
            the chip has FP8 (Hopper, Ada, Blackwell GPUs: activations quantized to e4m3 per token, FP8 x FP8 with a
            float32 accumulator) and weight-only "dequant" on TPU v5e/v6e (the codes converted to bf16 inside the
            dot, exact). XLA:CPU has no FP8 units and would write a float32 copy of every weight every call, so on
            CPU `quantize_decoder` holds the e4m3-rounded values as float32 (same numbers, float32 speed and
            memory). Both are logged once at load.
    "gguf"  a .gguf model keeps the blocks it ships (Q8_0 / Q4_0 / Q4_1, via `models.quantization.gguf_blocks`, codes
            copied, never decoded to float; Q/K rows un-permuted on the blocks). Tensors of other types stay float.
            For the default SmolLM2 that is Q4_1 layer linears (group 32, the "min" form s * q + m) and a Q8_0 tied
            embedding / LM head.

`pick_method(qw, rows)` chooses the matmul from the weight's form and the (static, trace-time) number of rows:
per-channel int8 weights use "int8"; grouped weights use "dequant" (an exact, weight-only dequantization: on CPU
up to 32 rows the C++ kernel `kernels_pallas.matmul.grouped_cpu`, which reads the codes in place), except, where
XLA's dot runs, a large grouped matrix (the Q8_0 LM head, 576 x 49152) with few rows: there "dequant" writes a
108 MiB float32 copy per call and the "int8" path is faster. Numbers: BENCHMARKS.md (scripts/bench/quant_table.py,
scripts/bench/quant_bench.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.formats import (QuantizedWeight, dequantize, fp8_matmul_supported, grouped_kernel_runs,
                                         matmul, pack_int4, quantize, quantize_fp8, quantize_int8)

QUANTIZATION_MODES = ("int8", "int4", "int4-awq", "gguf", "fp8")
#: Grouped weights with more elements than this use the "int8" matmul instead of "dequant" (see the module docstring).
DEQUANT_MAX_ELEMENTS = 8 << 20


def check_quantization_args(mode: str | None, group_size: int | None) -> None:
    """Reject a quantization mode or int4 group size that can never work, before any weight is touched: the one
    check behind `LLM(quantization=, quantization_group_size=)` (inference/engine/config.py), `build_decoder` and
    `quantize_decoder`."""
    if mode is not None and mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES} or None, got {mode!r}")
    if group_size is None:
        return
    if mode not in ("int4", "int4-awq"):
        raise ValueError(f"quantization_group_size applies to quantization='int4' or 'int4-awq', not {mode!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"quantization_group_size must be a positive integer (32, 64 or 128), got {group_size!r}")


def is_quantized(value: Any) -> bool:
    return isinstance(value, QuantizedWeight)


def pick_method(qw: QuantizedWeight, rows: int) -> str:
    """The `quantization.matmul` method for `rows` activation rows (static at trace time)."""
    if qw.is_fp8:
        return "fp8" if fp8_matmul_supported() else "dequant"
    if qw.bits == 8 and qw.group_size == qw.shape[0]:
        return "int8"  # per channel: W8A8, no float weight
    if qw.shape[0] * qw.shape[1] > DEQUANT_MAX_ELEMENTS and not grouped_kernel_runs(rows):
        return "int8"
    return "dequant"


def quantized_matmul(x: jax.Array, qw: QuantizedWeight, method: str | None = None) -> jax.Array:
    """x[..., in] @ W in x's dtype, with `method` or the one `pick_method` chooses."""
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    return matmul(x, qw, method or pick_method(qw, rows))


def embedding_lookup(qw: QuantizedWeight, tokens: jax.Array, dtype) -> jax.Array:
    """Rows of a quantized [hidden, vocab] (LM-head layout) embedding: tokens[...] -> [..., hidden]."""
    flat = tokens.reshape(-1)
    return qw.take_columns(flat, dtype).reshape(*tokens.shape, qw.shape[0])


# --------------------------------------------------------------------------------------------------------------------
# Quantizing float weights.

def int4_group_size(dims: list[int]) -> int:
    """32 if it divides every input dimension, else 64; ValueError when neither does."""
    for g in (32, 64):
        if all(d % g == 0 for d in dims):
            return g
    raise ValueError(f"int4 quantization needs input dimensions divisible by 32 or 64, got {sorted(set(dims))}")


def quantize_int4_minmax(w: Any, group_size: int) -> QuantizedWeight:
    """Asymmetric 4-bit in the "min" form (GGUF Q4_1's): per group of input rows and column, scale = (max - min) / 15,
    offset = min, z = round((w - min) / scale), x̂ = scale * z + offset.

    Unlike `quantization.quantize_int4` (integer zero point, range widened to include 0) the grid is not shifted by
    rounding the zero point, so the error is at most scale/2 with the tightest scale, and weights that already lie on
    a Q4_1 grid (SmolLM2's, dequantized from its GGUF) are reproduced exactly when a group uses codes 0 and 15.
    """
    z, scale, lo = minmax_int4_codes(w, group_size)
    k, n = z.shape
    return QuantizedWeight(q=pack_int4(z, group_size), scale=scale, offset=lo, bits=4, group_size=group_size,
                           shape=(k, n)).validate()


def minmax_int4_codes(w: Any, group_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The min-form int4 quantizer's unpacked codes z [in, out] (uint8 0..15), scale and min [in/g, out]."""
    w = jnp.asarray(w, jnp.float32)
    k, n = w.shape
    if k % group_size:
        raise ValueError(f"group_size={group_size} does not divide the input dimension {k}")
    wg = w.reshape(k // group_size, group_size, n)
    lo, hi = jnp.min(wg, axis=1), jnp.max(wg, axis=1)
    scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(jnp.float32)
    z = quantize(wg - lo[:, None, :], scale[:, None, :], 0, bits=4).reshape(k, n)
    return z, scale, lo.astype(jnp.float32)


def fake_quant_int4(w: Any, group_size: int) -> jax.Array:
    """Quantize-dequantize with the min-form int4 quantizer, unpacked (what `quantize_int4_minmax(w, g).dequantize()`
    gives, without the byte packing; AWQ's scale search evaluates it many times)."""
    z, scale, lo = minmax_int4_codes(w, group_size)
    k, n = z.shape
    per_group = lambda a: a[:, None, :]  # noqa: E731
    return dequantize(z.reshape(k // group_size, group_size, n), per_group(scale), offset=per_group(lo)).reshape(k, n)


def quantize_linear(w: Any, mode: str, group_size: int | None = None) -> QuantizedWeight:
    """A float [in, out] weight -> QuantizedWeight for `mode` "int8" / "fp8" (per channel) or "int4" (grouped)."""
    if mode == "int8":
        return quantize_int8(w, group_size)
    if mode == "fp8":
        return quantize_fp8(w, group_size)
    if mode == "int4":
        return quantize_int4_minmax(w, group_size or int4_group_size([np.shape(w)[0]]))
    raise ValueError(f"mode must be 'int8', 'fp8' or 'int4' to quantize a float weight, got {mode!r}")


def quantize_embedding(embedding: Any, mode: str = "int8") -> QuantizedWeight:
    """[vocab, hidden] float -> int8 (or, mode "fp8", e4m3) QuantizedWeight of the [hidden, vocab] view, one scale
    per token row."""
    w = jnp.asarray(embedding, jnp.float32).T
    return quantize_fp8(w) if mode == "fp8" else quantize_int8(w)


# --------------------------------------------------------------------------------------------------------------------
# Accounting.

def param_bytes(state: Any) -> int:
    """Bytes of every array leaf of a parameter pytree (an nnx.State, a module's params, a QuantizedWeight)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)
               if hasattr(x, "dtype"))
