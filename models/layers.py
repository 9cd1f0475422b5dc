"""Building blocks of a decoder layer: norms, projections, rotary embeddings, the gated MLP.

Parameters are `nnx.Param`s in `[in, out]` layout, matching `models/weights.py`, so loading is a name lookup.
Math runs in float32 regardless of the parameter dtype where precision matters (norms, RoPE, softmax).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas import rope_cpu
from kernels_pallas.backend import target_backend
from kernels_pallas.matmul.few_rows_cpu import few_rows_kernel_takes, few_rows_matmul_cpu
from kernels_pallas.matmul.invariant_cpu import invariant_matmul, invariant_row_sum, invariant_rsqrt
from kernels_pallas.native import gate
from models.config import ModelConfig, RopeScaling
from models.quantization.modes import embedding_lookup, is_quantized, quantized_matmul


# XLA:GPU rewrites a dot of under 10M multiply-adds (its `IsMatrixMultiplicationTooSmallForRewriting` threshold)
# into an elementwise multiply, materialized weights-sized, and a reduce, which it may then fuse into the KV cache
# scatter (issue 33: one decode sequence's K/V projections, 1 x 4096 x 1024). Packed-token rows below this count
# are padded with zeros on GPU so every projection stays a GEMM; the tensor cores' tile is 16 rows or more, so the
# padding reads no extra weight bytes.
GPU_MIN_GEMM_ROWS = 8


def pad_rows_for_gemm(x: jax.Array) -> jax.Array:
    """x[T, D] with T < GPU_MIN_GEMM_ROWS padded to that many rows when tracing for GPU; else x unchanged."""
    if x.ndim != 2 or x.shape[0] >= GPU_MIN_GEMM_ROWS or target_backend() != "gpu":
        return x
    return jnp.pad(x, ((0, GPU_MIN_GEMM_ROWS - x.shape[0]), (0, 0)))


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). The kernel Param may hold a `QuantizedWeight` (models/quantization/modes.py); its matmul
    is then `matmul_method`, or the one `models.quantization.modes.pick_method` chooses when that is None. `lora`:
    a `models.lora.LoRABinding` that the jitted step attaches for one trace (`bind_lora`); its delta is added."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.kernel = nnx.Param(normal_init(rngs, (in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.matmul_method: str | None = None
        self.lora = None
        self.batch_invariant = False  # models/batch_invariant.py: the row-invariant C++ matmul
        # Whether a few float32 rows may take the C++ kernel (few_rows_cpu.py): `Decoder(mesh=)` turns it off, since
        # an FFI call of weights split over a mesh would make XLA gather them.
        self.few_rows_kernel = True

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value()
        rows = x if self.batch_invariant else pad_rows_for_gemm(x)
        if is_quantized(kernel):
            y = quantized_matmul(rows, kernel, self.matmul_method)
        elif self.batch_invariant:
            y = invariant_matmul(rows, kernel)
        elif self.few_rows_kernel and few_rows_kernel_takes(rows, kernel):  # a few float32 rows on CPU
            y = few_rows_matmul_cpu(rows, kernel)
        else:
            y = rows @ kernel
        y = y[:x.shape[0]] if rows is not x else y
        y = y + self.bias[...] if self.bias is not None else y
        return y if self.lora is None else y + self.lora(x)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. style "rms" scales by w (Llama); "gemma" by (1 + w), w stored as HF stores it
    (zero-initialised), computed in float32 and cast back once, as Gemma2RMSNorm does."""

    def __init__(self, dim: int, eps: float, *, style: str = "rms", dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype) if style == "rms" else jnp.zeros((dim,), dtype))
        self.eps = eps
        self.style = style
        self.batch_invariant = False  # models/batch_invariant.py: a fixed-order mean square, an exact rsqrt

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        squares = x32 * x32
        mean = (invariant_row_sum(squares)[..., None] / x.shape[-1] if self.batch_invariant
                else jnp.mean(squares, axis=-1, keepdims=True))
        normed = x32 * (invariant_rsqrt if self.batch_invariant else jax.lax.rsqrt)(mean + self.eps)
        w = self.weight[...].astype(jnp.float32)
        return (normed * (w if self.style == "rms" else 1.0 + w)).astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding; `attend` reuses it as the LM head when embeddings are tied.

    `embedding` is a float [vocab, dim] Param, or holds a `QuantizedWeight` of the transposed [dim, vocab] (LM-head)
    layout: lookups then dequantize only the selected columns, `attend` runs the quantized matmul."""

    def __init__(self, vocab_size: int, dim: int, *, scale: float | None = None, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.embedding = nnx.Param(normal_init(rngs, (vocab_size, dim), dtype))
        self.scale = scale
        self.dtype = dtype
        self.matmul_method: str | None = None
        self.batch_invariant = False  # models/batch_invariant.py: `attend` through the row-invariant C++ matmul
        self.few_rows_kernel = True  # as `Linear.few_rows_kernel`, for the tied LM head

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.embedding.get_value()
        if is_quantized(table):
            x = embedding_lookup(table, tokens, self.dtype)
        else:
            x = jnp.take(table, tokens, axis=0)
        if self.scale is None:
            return x
        # Gemma multiplies by the scale cast to the embedding dtype (sqrt(3072) becomes 55.5 in bf16), as HF does.
        return x * jnp.asarray(self.scale, dtype=x.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        table = self.embedding.get_value()
        if is_quantized(table):
            return quantized_matmul(x, table, self.matmul_method)
        if self.batch_invariant:
            return invariant_matmul(x, table, transposed=True)
        if self.few_rows_kernel and few_rows_kernel_takes(x, table):
            return few_rows_matmul_cpu(x, table, transposed=True)
        return x @ table.T


def activation(x: jax.Array, kind: str) -> jax.Array:
    """The MLP gate nonlinearity a config names: "silu" or "gelu_tanh"."""
    return jax.nn.silu(x) if kind == "silu" else jax.nn.gelu(x, approximate=True)


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama, GeGLU (tanh GELU) for Gemma. `intermediate_size` overrides the
    config's width (DeepSeek's shared experts)."""

    def __init__(self, config: ModelConfig, *, intermediate_size: int | None = None, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, dtype=dtype, rngs=rngs)
        self.act = config.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.gate_proj(x), self.act) * self.up_proj(x))


@functools.lru_cache(maxsize=64)
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, with Hugging Face's scaling rules (float32)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"rope scaling {scaling.kind!r} is not supported by the rotary embedding yet")


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN (Peng et al. 2023): high frequencies kept, low ones interpolated by `factor`, a linear ramp between,
    as transformers' `_compute_yarn_parameters` computes it."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated = inv_freq / scaling.factor
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin of positions[T] x inv_freq[D/2], float32 [T, D/2]. On CPU, where the gate lets it run, a C++
    kernel computes them (`kernels_pallas.rope_cpu`): fused into the rotation, XLA:CPU re-evaluated them per head
    and output element."""
    if gate.runs_here(rope_cpu.KERNEL):
        return rope_cpu.rope_tables_cpu(positions, inv_freq)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *, interleaved: bool = False,
               scale: float = 1.0) -> jax.Array:
    """RoPE on `x[..., T, H, D]` at integer `positions[T]`. Rotate-half pairs (i, i + D/2) by default (Hugging Face
    Llama); `interleaved` pairs (2i, 2i + 1) as DeepSeek's complex form does. `scale` multiplies cos and sin
    (YaRN's attention factor)."""
    cos, sin = rope_tables(positions, inv_freq)  # [T, D/2]
    cos, sin = (cos * scale)[:, None, :], (sin * scale)[:, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        pairs = x32.reshape(*x32.shape[:-1], -1, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x32.shape)
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
