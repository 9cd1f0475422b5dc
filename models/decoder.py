"""The decoder: one forward path for every Llama-family variant the config describes (Llama, Mistral, Qwen2/3,
Gemma 2/3 text differ only in ModelConfig fields: windows, norms, soft caps, scales).

Layers live in a Python list and the forward loops over them in Python: on CPU, per-layer arrays in an unrolled
loop compiled and ran faster than `lax.scan` over stacked weights (shared/JAX_CPU_NOTES.md, section 7), and the KV
cache is likewise a list of per-layer page arrays that the step donates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import Attention, AttentionMetadata
from models.config import ModelConfig
from models.layers import Embed, GatedMLP, Linear, RMSNorm
from models.quantized import (QUANTIZATION_MODES, int4_group_size, is_quantized, quantize_embedding,
                              quantize_linear)
from models.weights import check_weights


def _norm(config: ModelConfig, dtype) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, style=config.norm_style, dtype=dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm block; with `post_norms` (Gemma 2/3) the attention and MLP outputs are normed again before each
    residual add: x + post_attn_norm(attn(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x)))."""

    def __init__(self, config: ModelConfig, layer: int = 0, *, dtype, attn_impl: str, rngs: nnx.Rngs):
        self.attn_norm = _norm(config, dtype)
        self.attn = Attention(config, layer, dtype=dtype, attn_impl=attn_impl, rngs=rngs)
        self.post_attn_norm = _norm(config, dtype) if config.post_norms else None
        self.mlp_norm = _norm(config, dtype)
        self.mlp = GatedMLP(config, dtype=dtype, rngs=rngs)
        self.post_mlp_norm = _norm(config, dtype) if config.post_norms else None

    def _residual(self, x, attn_out):
        if self.post_attn_norm is not None:
            attn_out = self.post_attn_norm(attn_out)
        x = x + attn_out
        mlp_out = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            mlp_out = self.post_mlp_norm(mlp_out)
        return x + mlp_out

    def __call__(self, x, positions, kv_pages, meta):
        attn_out, kv_pages = self.attn(self.attn_norm(x), positions, kv_pages, meta)
        return self._residual(x, attn_out), kv_pages

    def forward_dense(self, x, positions):
        return self._residual(x, self.attn.forward_dense(self.attn_norm(x), positions))


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attn_impl: str = "auto", rngs: nnx.Rngs):
        self.config = config
        self.embed = Embed(config.vocab_size, config.hidden_size, scale=config.embed_scale, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, attn_impl=attn_impl, rngs=rngs)
                                for i in range(config.num_layers)])
        self.final_norm = _norm(config, dtype)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs))

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_caches: list[jax.Array],
                 meta: AttentionMetadata) -> tuple[jax.Array, list[jax.Array]]:
        """Packed tokens[T] -> (final hidden states [T, D], updated per-layer KV caches)."""
        x = self.embed(tokens)
        new_caches = []
        for layer, kv_pages in zip(self.layers, kv_caches):
            x, kv_pages = layer(x, positions, kv_pages, meta)
            new_caches.append(kv_pages)
        return self.final_norm(x), new_caches

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states -> float32 logits over the vocabulary (soft-capped when the config says so)."""
        out = self.embed.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        out = out.astype(jnp.float32)
        cap = self.config.final_logit_softcap
        return out if cap is None else cap * jnp.tanh(out / cap)

    def forward(self, tokens: jax.Array) -> jax.Array:
        """Cache-free reference forward: tokens[B, L] -> logits[B, L, V], positions 0..L-1."""
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer.forward_dense(x, positions)
        return self.logits(self.final_norm(x))


def weight_targets(model: Decoder) -> dict[str, nnx.Param]:
    """Canonical weight name (models/weights.py) -> the model's parameter that holds it."""
    targets: dict[str, nnx.Param] = {"embed": model.embed.embedding, "final_norm": model.final_norm.weight}
    if model.lm_head is not None:
        targets["lm_head"] = model.lm_head.kernel
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        targets[p + "attn_norm"] = layer.attn_norm.weight
        targets[p + "mlp_norm"] = layer.mlp_norm.weight
        if layer.post_attn_norm is not None:
            targets[p + "post_attn_norm"] = layer.post_attn_norm.weight
            targets[p + "post_mlp_norm"] = layer.post_mlp_norm.weight
        if layer.attn.q_norm is not None:
            targets[p + "q_norm"] = layer.attn.q_norm.weight
            targets[p + "k_norm"] = layer.attn.k_norm.weight
        for name in ("q", "k", "v", "o"):
            proj = getattr(layer.attn, f"{name}_proj")
            targets[p + f"{name}_proj"] = proj.kernel
            if proj.bias is not None:
                targets[p + f"{name}_bias"] = proj.bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            targets[p + name] = getattr(layer.mlp, name).kernel
    return targets


def load_weights(model: Decoder, weights: dict[str, np.ndarray], source: str = "checkpoint") -> None:
    """Copy canonical weights into the model in place, cast to each parameter's dtype."""
    check_weights(model.config, weights, source)
    for name, param in weight_targets(model).items():
        if is_quantized(param.get_value()):
            raise ValueError(f"load_weights: {name} is quantized; load float weights before quantize_decoder")
        param.set_value(jnp.asarray(weights[name], dtype=param.get_value().dtype))


def linear_weight_names(model: Decoder) -> list[str]:
    """Canonical names of the layer projections (q/k/v/o, gate/up/down) and the untied LM head."""
    suffixes = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [n for n in weight_targets(model) if n == "lm_head" or n.rsplit(".", 1)[-1] in suffixes]


def quantize_decoder(model: Decoder, mode: str, *, gguf_weights: dict | None = None,
                     group_size: int | None = None) -> Decoder:
    """Replace the model's linear weights (and embedding) by QuantizedWeights in place; returns the model.

    mode "int8": per-channel int8 everywhere (W8A8 matmuls); "int4": the layer projections grouped asymmetric int4
    (`group_size`, default 32 if it divides every input dimension, else 64) with the LM head and embedding per-channel
    int8; "gguf": the QuantizedWeights in `gguf_weights` (`models.quantized.load_gguf_quantized`), float elsewhere.
    See models/quantized.py. Norms and biases stay float.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES} or None, got {mode!r}")
    targets = weight_targets(model)
    linears = linear_weight_names(model)
    if mode == "gguf":
        if gguf_weights is None:
            raise ValueError("quantization='gguf' needs the GGUF file's quantized tensors (gguf_weights)")
        for name, qw in gguf_weights.items():
            want = targets[name].get_value().shape
            want = want[::-1] if name == "embed" else want
            if tuple(qw.shape) != tuple(want):
                raise ValueError(f"GGUF tensor {name} is {qw.shape}, the model expects {want}")
            targets[name].set_value(qw)
        return model
    layer_linears = [n for n in linears if n != "lm_head"]
    if mode == "int4" and group_size is None:
        group_size = int4_group_size([targets[n].get_value().shape[0] for n in layer_linears])
    for name in linears:
        param = targets[name]
        w = param.get_value()
        if is_quantized(w):
            raise ValueError(f"quantize_decoder: {name} is already quantized")
        param.set_value(quantize_linear(w, "int8" if name == "lm_head" else mode,
                                        None if name == "lm_head" or mode == "int8" else group_size))
    if not is_quantized(targets["embed"].get_value()):
        targets["embed"].set_value(quantize_embedding(targets["embed"].get_value()))
    return model


def build_decoder(config: ModelConfig, weights: dict[str, np.ndarray] | None = None, *, dtype=jnp.float32,
                  attn_impl: str = "auto", seed: int = 0, source: str = "checkpoint",
                  quantization: str | None = None, gguf_weights: dict | None = None) -> Decoder:
    """A decoder with random weights, or with `weights` when given (random init is then skipped); `quantization`
    ("int8", "int4", "gguf"; see `quantize_decoder`) quantizes it after loading."""
    if weights is None:
        model = Decoder(config, dtype=dtype, attn_impl=attn_impl, rngs=nnx.Rngs(seed))
    else:
        model = nnx.eval_shape(lambda: Decoder(config, dtype=dtype, attn_impl=attn_impl, rngs=nnx.Rngs(seed)))
        load_weights(model, weights, source)
    if quantization is not None:
        quantize_decoder(model, quantization, gguf_weights=gguf_weights)
    return model
