"""The decoder: one forward path for every variant the config describes. Llama, Mistral, Qwen2/3 and Gemma 2/3
text differ only in ModelConfig fields (windows, norms, soft caps, scales); DeepSeek-V2 swaps in latent attention
(models/mla.py) and the mixture of experts (models/moe.py) per layer; cross-layer attention shares one cache among
`cla_factor` layers. A hybrid model's state layers (`ModelConfig.is_state_layer`: Gated DeltaNet, Mamba2) put a
`STATE_MIXERS` module in the attention's place, with the attention's call signature over a `RecurrentState` cache.

Layers live in a Python list and the forward loops over them in Python: on CPU, per-layer arrays in an unrolled
loop compiled and ran faster than `lax.scan` over stacked weights, and the KV
cache is likewise a list of per-layer page arrays that the step donates.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.backend import target_backend
from models.attention import Attention, AttentionMetadata
from models.config import ModelConfig
from models.gated_deltanet import GatedDeltaNet
from models.layers import Embed, GatedMLP, Linear, RMSNorm
from models.mamba2 import MAMBA2_WEIGHT_PATHS, Mamba2Mixer
from models.mla import MLAttention
from models.moe import MoE
from models.quantization.awq import AWQConfig, apply_awq
from models.quantization.formats import fp8_matmul_supported
from models.quantization.modes import (QUANTIZATION_MODES, check_quantization_args, int4_group_size, is_quantized,
                                       quantize_embedding, quantize_linear)
from models.weights import check_weights, expected_shapes


# Layer kind -> the token mixer a state layer runs in the attention's place. Its constructor takes (config, layer, *,
# dtype, attn_impl, mesh, rngs); `mixer(x[T, D], positions, state: RecurrentState, meta) -> (out, state')` over the
# ragged batch (the state slots in `meta.state_slots`), and `mixer.forward_dense(x[B, L, D], positions, shared_kv)
# -> (out, shared_kv)` runs each row from a zero state (the cache-free reference path).
STATE_MIXERS: dict[str, type[nnx.Module]] = {
    "linear_attention": GatedDeltaNet,
    "mamba": Mamba2Mixer,
}


def _mixer(config: ModelConfig, layer: int, **kw) -> nnx.Module:
    if not config.is_state_layer(layer):
        return (MLAttention if config.is_mla else Attention)(config, layer, **kw)
    kind = config.layer_types[layer]
    if kind not in STATE_MIXERS:
        raise ValueError(f"layer {layer} is a {kind!r} layer, which has no mixer in models/decoder.py STATE_MIXERS")
    return STATE_MIXERS[kind](config, layer, **kw)


def _norm(config: ModelConfig, dtype) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, style=config.norm_style, dtype=dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm block; with `post_norms` (Gemma 2/3) the attention and MLP outputs are normed again before each
    residual add: x + post_attn_norm(attn(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x))). In a state
    layer `attn` is its token mixer (`STATE_MIXERS`) and the cache it takes and returns is its `RecurrentState`."""

    def __init__(self, config: ModelConfig, layer: int = 0, *, dtype, attn_impl: str,
                 mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        self.attn_norm = _norm(config, dtype)
        self.attn = _mixer(config, layer, dtype=dtype, attn_impl=attn_impl, mesh=mesh, rngs=rngs)
        self.post_attn_norm = _norm(config, dtype) if config.post_norms else None
        self.mlp_norm = _norm(config, dtype)
        self.mlp = MoE(config, dtype=dtype, rngs=rngs) if config.is_moe(layer) else GatedMLP(config, dtype=dtype,
                                                                                            rngs=rngs)
        self.post_mlp_norm = _norm(config, dtype) if config.post_norms else None
        self.residual_multiplier = config.residual_multiplier

    def _residual(self, x, attn_out):
        if self.post_attn_norm is not None:
            attn_out = self.post_attn_norm(attn_out)
        x = x + self._scaled(attn_out)
        mlp_out = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            mlp_out = self.post_mlp_norm(mlp_out)
        return x + self._scaled(mlp_out)

    def _scaled(self, branch):
        """A residual branch times `residual_multiplier` (Granite; 1.0 elsewhere, skipped)."""
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier

    def __call__(self, x, positions, kv_pages, meta):
        attn_out, kv_pages = self.attn(self.attn_norm(x), positions, kv_pages, meta)
        return self._residual(x, attn_out), kv_pages

    def forward_dense(self, x, positions, shared_kv=None):
        attn_out, kv = self.attn.forward_dense(self.attn_norm(x), positions, shared_kv)
        return self._residual(x, attn_out), kv


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attn_impl: str = "auto",
                 mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        """`mesh`: tensor parallelism over its "model" axis; every attention layer then runs per head shard under
        shard_map. A build-time argument (not set on the layers later), so a built module never changes."""
        self.config = config
        self.embed = Embed(config.vocab_size, config.hidden_size, scale=config.embed_scale, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, attn_impl=attn_impl, mesh=mesh, rngs=rngs)
                                for i in range(config.num_layers)])
        self.final_norm = _norm(config, dtype)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs))
        # models/batch_invariant.py sets it (with its layers'); the step and log_probs read it for the sampler's sums.
        self.batch_invariant = False
        if mesh is not None:  # weights split over the mesh: no C++ few-rows matmul (an FFI call would gather them)
            for _, node in nnx.iter_graph(self):
                if isinstance(node, (Linear, Embed)):
                    node.few_rows_kernel = False
        # float32 means IEEE float32 dots on every backend: XLA:GPU runs an f32 dot of default precision as TF32
        # (1e-3 off on an H200: BENCHMARKS.md, the H200 section) and XLA:TPU as one bf16 pass. "highest" sets
        # `Precision.HIGHEST` on every dot traced inside the forward (projections, the reference attention's
        # einsums, the LM head, MoE's ragged dots). Other dtypes keep jax's default.
        self.matmul_precision = "highest" if jnp.dtype(dtype) == jnp.float32 else None

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_caches: list[jax.Array],
                 meta: AttentionMetadata) -> tuple[jax.Array, list[jax.Array]]:
        """Packed tokens[T] -> (final hidden states [T, D], updated caches): one KV cache per caching layer, then
        one `RecurrentState` per state layer (`ModelConfig.cache_index`)."""
        with jax.default_matmul_precision(self.matmul_precision):
            x = self.embed(tokens)
            caches = list(kv_caches)
            for i, layer in enumerate(self.layers):
                j = self.config.cache_index(i)
                x, caches[j] = layer(x, positions, caches[j], meta)
            return self.final_norm(x), caches

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states -> float32 logits over the vocabulary (soft-capped when the config says so)."""
        with jax.default_matmul_precision(self.matmul_precision):
            out = self.embed.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        out = out.astype(jnp.float32)
        if self.config.logits_scaling != 1.0:  # Granite divides its logits
            out = out / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        return out if cap is None else cap * jnp.tanh(out / cap)

    def forward(self, tokens: jax.Array) -> jax.Array:
        """Cache-free reference forward: tokens[B, L] -> logits[B, L, V], positions 0..L-1."""
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        with jax.default_matmul_precision(self.matmul_precision):
            x = self.embed(tokens)
            kv = None  # a layer that owns its KV ignores the previous one's; a CLA layer reads and passes it on
            for layer in self.layers:
                x, kv = layer.forward_dense(x, positions, kv)
            x = self.final_norm(x)
        return self.logits(x)


# Canonical per-layer weight name (models/weights.py) -> attribute path inside a DecoderLayer.
_LAYER_PATHS = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "mlp_norm.weight", "post_attn_norm": "post_attn_norm.weight",
    "post_mlp_norm": "post_mlp_norm.weight", "q_norm": "attn.q_norm.weight", "k_norm": "attn.k_norm.weight",
    **{f"{n}_proj": f"attn.{n}_proj.kernel" for n in ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b")},
    **{f"{n}_bias": f"attn.{n}_proj.bias" for n in ("q", "k", "v")},
    "q_a_norm": "attn.q_a_norm.weight", "kv_a_norm": "attn.kv_a_norm.weight",
    **{n: f"mlp.{n}.kernel" for n in ("gate_proj", "up_proj", "down_proj")},
    "router": "mlp.router", **{f"experts.{n}": f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")},
    **{f"shared.{n}": f"mlp.shared.{n}.kernel" for n in ("gate_proj", "up_proj", "down_proj")},
    "shared_expert_gate": "mlp.shared_gate.kernel",
    **{n: f"attn.{n}.kernel" for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")},
    "conv1d": "attn.conv1d", "dt_bias": "attn.dt_bias", "A_log": "attn.A_log", "linear_norm": "attn.norm.weight",
    **MAMBA2_WEIGHT_PATHS,
}


def _attribute(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def weight_targets(model: Decoder) -> dict[str, nnx.Param]:
    """Canonical weight name (models/weights.py) -> the model's parameter that holds it."""
    targets: dict[str, nnx.Param] = {"embed": model.embed.embedding, "final_norm": model.final_norm.weight}
    if model.lm_head is not None:
        targets["lm_head"] = model.lm_head.kernel
    for name in expected_shapes(model.config):
        if name.startswith("layers."):
            _, i, leaf = name.split(".", 2)
            targets[name] = _attribute(model.layers[int(i)], _LAYER_PATHS[leaf])
    return targets


def export_weights(model: Decoder) -> dict[str, np.ndarray]:
    """The model's parameters under their canonical names (models/weights.py), as host numpy arrays: the inverse of
    `load_weights`, e.g. to save a random-weight preset or to prune a built model into a draft."""
    return {name: np.asarray(param.get_value()) for name, param in weight_targets(model).items()}


def load_weights(model: Decoder, weights: dict[str, np.ndarray], source: str = "checkpoint") -> None:
    """Copy canonical weights into the model in place, cast to each parameter's dtype."""
    check_weights(model.config, weights, source)
    for name, param in weight_targets(model).items():
        if is_quantized(param.get_value()):
            raise ValueError(f"load_weights: {name} is quantized; load float weights before quantize_decoder")
        if is_quantized(weights[name]):  # an FP8 checkpoint's codes and scales (models/loaders/fp8_checkpoint.py)
            param.set_value(weights[name])
            continue
        param.set_value(jnp.asarray(weights[name], dtype=param.get_value().dtype))


def linear_weight_names(model: Decoder) -> list[str]:
    """Canonical names of the layer projections (q/k/v/o, gate/up/down, shared experts) and the untied LM head.
    MLA's low-rank projections and the routed experts stay float under quantization."""
    suffixes = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkvz",
                "in_proj_ba", "out_proj")
    return [n for n in weight_targets(model)
            if n == "lm_head" or (n.rsplit(".", 1)[-1] in suffixes and ".experts." not in n)]


def quantize_decoder(model: Decoder, mode: str, *, gguf_weights: dict | None = None,
                     group_size: int | None = None, calibration_tokens=None) -> Decoder:
    """Replace the model's linear weights (and embedding) by QuantizedWeights in place; returns the model.

    mode "int8": per-channel int8 everywhere (W8A8 matmuls); "int4": the layer projections grouped asymmetric int4
    (`group_size`, default 32 if it divides every input dimension, else 64) with the LM head and embedding per-channel
    int8; "int4-awq": AWQ scales searched on `calibration_tokens` and folded into the float weights
    (`models.quantization.awq.apply_awq`), then "int4"; "gguf": the QuantizedWeights in `gguf_weights`
    (`models.loaders.gguf_file.load_gguf_quantized`), float elsewhere; "fp8": float8_e4m3fn per channel everywhere,
    or, when an FP8 checkpoint's weights are already loaded, those as they are; on CPU held as float32 of the e4m3
    values (`_hold_fp8_for_the_chip`). See models/quantization/modes.py.
    Norms and biases stay float.
    """
    if mode is None:
        raise ValueError(f"quantize_decoder needs a mode, one of {QUANTIZATION_MODES}")
    check_quantization_args(mode, None)
    if mode == "int4-awq":
        if calibration_tokens is None:
            raise ValueError("quantization='int4-awq' needs calibration_tokens "
                             "(inference.loading.shipped_text.calibration_token_ids)")
        apply_awq(model, calibration_tokens, AWQConfig(group_size=group_size))
        mode = "int4"
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
    if mode == "fp8" and any(is_quantized(targets[n].get_value()) for n in linears):
        return _hold_fp8_for_the_chip(model, targets)  # an FP8 checkpoint: its own choice of FP8 tensors
    layer_linears = [n for n in linears if n != "lm_head"]
    if mode == "int4" and group_size is None:
        group_size = int4_group_size([targets[n].get_value().shape[0] for n in layer_linears])
    for name in linears:
        param = targets[name]
        w = param.get_value()
        if is_quantized(w):
            raise ValueError(f"quantize_decoder: {name} is already quantized (an FP8 checkpoint's tensors take "
                             "quantization='fp8' or None)")
        per_channel = mode if mode == "fp8" else "int8"
        param.set_value(quantize_linear(w, per_channel if name == "lm_head" else mode,
                                        None if name == "lm_head" or mode in ("int8", "fp8") else group_size))
    if not is_quantized(targets["embed"].get_value()):
        embed_mode = "fp8" if mode == "fp8" else "int8"
        targets["embed"].set_value(quantize_embedding(targets["embed"].get_value(), embed_mode))
    return _hold_fp8_for_the_chip(model, targets) if mode == "fp8" else model


def _hold_fp8_for_the_chip(model: Decoder, targets: dict) -> Decoder:
    """FP8 weights stay e4m3 codes where the matmul reads them in place: FP8 GPUs (FP8 x FP8) and TPU (XLA fuses the
    codes' convert into the dot). XLA:CPU has no FP8 units and writes a float32 copy of every weight on every call
    (SmolLM2 decoded 0.6 tok/s that way against float32's 24.8 in the same run: BENCHMARKS.md), so on CPU each FP8
    weight is held as the float32 of its e4m3-rounded values: the same numbers at float32's speed and memory."""
    log = logging.getLogger(__name__)
    if fp8_matmul_supported():
        return model
    if target_backend() != "cpu":
        log.info("quantization='fp8': this chip has no FP8 matmul; the FP8 weights run weight-only dots (codes "
                 "converted to the activation dtype inside the dot, exact)")
        return model
    log.info("quantization='fp8' on CPU: no FP8 units, so the weights are rounded to e4m3 and held as float32 "
             "(exact values, float32 speed; no memory saved)")
    for name, param in targets.items():
        w = param.get_value()
        if is_quantized(w) and w.is_fp8:
            param.set_value(w.dequantize(model.embed.dtype).T if name == "embed" else w.dequantize(model.embed.dtype))
    return model


def build_decoder(config: ModelConfig, weights: dict[str, np.ndarray] | None = None, *, dtype=jnp.float32,
                  attn_impl: str = "auto", seed: int = 0, source: str = "checkpoint",
                  quantization: str | None = None, gguf_weights: dict | None = None,
                  quantization_group_size: int | None = None, calibration_tokens=None) -> Decoder:
    """A decoder with random weights, or with `weights` when given (random init is then skipped); `quantization`
    ("int8", "int4", "int4-awq", "gguf"; see `quantize_decoder`) quantizes it after loading."""
    check_quantization_args(quantization, quantization_group_size)
    if weights is None:
        model = Decoder(config, dtype=dtype, attn_impl=attn_impl, rngs=nnx.Rngs(seed))
    else:
        model = nnx.eval_shape(lambda: Decoder(config, dtype=dtype, attn_impl=attn_impl, rngs=nnx.Rngs(seed)))
        load_weights(model, weights, source)
        if quantization is None and any(is_quantized(w) for w in weights.values()):
            quantization = "fp8"  # an FP8 checkpoint: held as this chip wants FP8 weights (`quantize_decoder`)
    if quantization is not None:
        quantize_decoder(model, quantization, gguf_weights=gguf_weights, group_size=quantization_group_size,
                         calibration_tokens=calibration_tokens)
    return model
