"""Model configuration as plain, frozen data.

A layer's attention kind, the RoPE variant and the tie of the LM head are config values, not subclasses: one
forward path reads them. Loaders (GGUF, HF) translate their metadata into this; presets in `configs/` build it
directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear", "llama3" or "yarn" (HF `rope_type`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (DeepSeek-style) knobs.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3", "yarn"):
            raise ValueError(f"unsupported rope scaling type {self.kind!r}; expected linear, llama3 or yarn")


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyperparameters (Llama family naming)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"
    name: str = ""
    # ---- Family variants (defaults are plain Llama). Hugging Face naming where HF has a name for the thing.
    # Attention window in tokens: a query at position p sees keys at positions > p - sliding_window (HF
    # masking_utils.sliding_window_overlay), i.e. itself and the previous sliding_window - 1 tokens. None: no window.
    sliding_window: int | None = None
    # Per-layer "sliding_attention" / "full_attention" (HF `layer_types`). None with a window: every layer slides
    # (Mistral). Ignored when sliding_window is None.
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    norm_style: str = "rms"  # "rms": x̂ * w; "gemma": x̂ * (1 + w), the weight stored as HF stores it
    post_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs before the residual adds
    embed_scale: float | None = None  # embeddings times this, rounded to the embedding dtype (Gemma: sqrt(hidden))
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) after scaling, before the mask
    final_logit_softcap: float | None = None  # same on the LM head's logits
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None: head_dim ** -0.5
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3); None: as global layers

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs each KV head to serve the same number of query heads")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; expected silu or gelu_tanh")
        if self.norm_style not in ("rms", "gemma"):
            raise ValueError(f"unsupported norm_style {self.norm_style!r}; expected rms or gemma")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig.sliding_window must be positive or None, got {self.sliding_window}")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, tuple):
                object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = set(self.layer_types) - set(LAYER_TYPES)
            if bad:
                raise ValueError(f"unsupported layer type {sorted(bad)[0]!r}; expected one of {LAYER_TYPES}")
        for field in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta",
                      "embed_scale"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive or None, got {value}")

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer` in tokens, None for full (global) attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of `layer`: sliding layers use `rope_local_theta` unscaled when it is set."""
        if self.rope_local_theta is not None and self.is_sliding(layer):
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attn_scale(self) -> float:
        """Multiplier of q·k: query_pre_attn_scalar ** -0.5 when set, else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """KV cache bytes one token occupies across all layers: 2 (K and V) * L * K * H * b."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d
        if self.attention_bias:
            attn += q + 2 * kv
        per_layer = attn + 3 * d * f + 2 * d + (2 * d if self.post_norms else 0)
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embed = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
