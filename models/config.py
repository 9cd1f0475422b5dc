"""Model configuration as plain, frozen data.

A layer's attention kind, the RoPE variant and the tie of the LM head are config values, not subclasses: one
forward path reads them. Loaders (GGUF, HF) translate their metadata into this; presets in `configs/` build it
directly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear", "llama3" or "yarn" (HF `rope_type`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN knobs, as Hugging Face's `_compute_yarn_parameters` reads them (None: the key is absent).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # multiplies cos and sin; None: derived from factor and the mscales
    truncate: bool = True  # round the YaRN correction range outwards

    def yarn_mscale(self, mscale: float | None = 1.0) -> float:
        """0.1·mscale·ln(factor) + 1 for factor > 1, else 1 (YaRN's attention temperature)."""
        return 1.0 if self.factor <= 1 else 0.1 * (mscale or 1.0) * math.log(self.factor) + 1.0

    @property
    def rope_attention_factor(self) -> float:
        """The factor Hugging Face multiplies the rotary cos/sin by (1 except for YaRN)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.mscale) / self.yarn_mscale(self.mscale_all_dim)
        return self.yarn_mscale()

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3", "yarn"):
            raise ValueError(f"unsupported rope scaling type {self.kind!r}; expected linear, llama3 or yarn")


#: Layer kinds that keep a constant-size recurrent state instead of a KV cache (transformers' names):
#: "linear_attention" is Gated DeltaNet (Qwen3-Next), "mamba" is Mamba2 (Nemotron-H, Granite-4.0-H hybrids).
STATE_LAYER_TYPES = ("linear_attention", "mamba")
LAYER_TYPES = ("full_attention", "sliding_attention", *STATE_LAYER_TYPES)


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
    # (Mistral). Without a window, only the state-layer kinds (STATE_LAYER_TYPES) are read: a hybrid model's layers.
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    norm_style: str = "rms"  # "rms": x̂ * w; "gemma": x̂ * (1 + w), the weight stored as HF stores it
    post_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs before the residual adds
    embed_scale: float | None = None  # embeddings times this, rounded to the embedding dtype (Gemma: sqrt(hidden))
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) after scaling, before the mask
    final_logit_softcap: float | None = None  # same on the LM head's logits
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None: head_dim ** -0.5
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3); None: as global layers
    rope_interleaved: bool = False  # rotate (x0, x1), (x2, x3), ... pairs (DeepSeek) instead of the two halves
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * this) dims of each head (Qwen3-Next: 0.25)
    # q_proj yields, per head, the query then as many gate values; the attention output is multiplied by
    # sigmoid(gate) before o_proj (Qwen3-Next's gated attention; transformers' name in Qwen3.5 configs).
    attn_output_gate: bool = False
    # ---- Multi-head latent attention (DeepSeek-V2 §2.1.2). With kv_lora_rank set, a layer caches one latent of
    # kv_lora_rank values plus a shared RoPE key of qk_rope_head_dim per token (no per-head K/V); queries have
    # qk_nope_head_dim + qk_rope_head_dim per head and values v_head_dim. head_dim / num_kv_heads are then unused.
    q_lora_rank: int | None = None  # None: a full-rank q_proj
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # ---- Mixture of experts (DeepSeek-V2 MoE): layers from first_k_dense_replace on, when num_experts > 0, replace
    # the MLP by num_shared_experts always-on experts plus num_experts_per_tok of num_experts routed ones.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # "greedy" or "group_limited_greedy" (top topk_group of n_group expert groups)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1 (Qwen MoE; DeepSeek-V2: no)
    # Qwen MoE's one shared expert: its width (0: num_shared_experts * moe_intermediate_size) and a sigmoid gate
    # (a [hidden, 1] projection) scaling its output per token.
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # ---- Cross-layer attention (Brandon et al. 2024): each run of cla_factor layers reads the KV cache its first
    # layer writes; the others have no K/V projections and no cache of their own.
    cla_factor: int = 1
    # ---- Gated DeltaNet ("linear_attention" layers; transformers' Qwen3NextConfig names): Hk key heads of Dk,
    # Hv value heads of Dv (Hv a multiple of Hk), a causal conv1d of linear_conv_kernel_dim taps over q|k|v.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # ---- Mamba2 ("mamba" layers; transformers' Bamba / Granite-4.0-H names where they exist): mamba_num_heads heads
    # of mamba_head_dim (their product is the mixer's width), B and C in mamba_n_groups groups of ssm_state_size, a
    # causal conv1d of mamba_d_conv taps over x|B|C, dt clamped to mamba_time_step_limit after its softplus.
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_chunk_size: int = 256
    mamba_time_step_limit: tuple[float, float] = (0.0, math.inf)
    # ---- Scalar multipliers (Granite): each residual branch is scaled by residual_multiplier before its add, the
    # logits are divided by logits_scaling. use_rope=False: attention without positions (Granite-4.0-H's "nope").
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    use_rope: bool = True

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
        if self.cla_factor < 1:
            raise ValueError(f"ModelConfig.cla_factor must be >= 1, got {self.cla_factor}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and give an even "
                             f"rotary width (head_dim {self.head_dim} -> {self.rotary_dim})")
        if self.attn_output_gate and self.is_mla:
            raise ValueError("attn_output_gate is supported for GQA attention, not MLA")
        if self.has_state_layers and (self.cla_factor > 1 or self.is_mla):
            raise ValueError("state layers (linear_attention / mamba) are supported beside GQA attention layers "
                             "without cross-layer attention (cla_factor=1) and without MLA")
        if "linear_attention" in (self.layer_types or ()):
            for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim"):
                if getattr(self, field) <= 0:
                    raise ValueError(f"ModelConfig.{field} must be positive for linear_attention (Gated DeltaNet) "
                                     f"layers, got {getattr(self, field)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                                 f"linear_num_key_heads={self.linear_num_key_heads}")
            if self.linear_conv_kernel_dim < 2:
                raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}")
        if "mamba" in (self.layer_types or ()):
            self._check_state_fields("mamba (Mamba2)", ("mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                                                        "mamba_n_groups", "mamba_chunk_size"),
                                     ("mamba_num_heads", "mamba_n_groups"), "mamba_d_conv")
        if self.logits_scaling <= 0:
            raise ValueError(f"ModelConfig.logits_scaling must be positive, got {self.logits_scaling}")
        if self.is_mla:
            if self.cla_factor > 1:
                raise ValueError("cross-layer attention (cla_factor > 1) is not supported with MLA; the latent cache "
                                 "is already shared by all heads")
            for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, field) <= 0:
                    raise ValueError(f"ModelConfig.{field} must be positive for multi-head latent attention, got "
                                     f"{getattr(self, field)}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(f"a mixture of experts needs 0 < num_experts_per_tok <= num_experts and a positive "
                                 f"moe_intermediate_size, got {self.num_experts_per_tok}, {self.num_experts}, "
                                 f"{self.moe_intermediate_size}")
            if self.topk_method not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"unsupported topk_method {self.topk_method!r}; expected greedy or "
                                 "group_limited_greedy")
            if self.topk_method == "group_limited_greedy" and (
                    self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group
                    or self.num_experts_per_tok > self.topk_group * self.num_experts // self.n_group):
                raise ValueError(f"group-limited routing needs n_group ({self.n_group}) to divide num_experts "
                                 f"({self.num_experts}), 0 < topk_group ({self.topk_group}) <= n_group, and "
                                 "enough experts in the chosen groups for num_experts_per_tok")

    def _check_state_fields(self, kind: str, positive: tuple[str, ...], multiple: tuple[str, str], conv: str) -> None:
        """A state layer kind's fields: each of `positive` > 0, multiple[0] a multiple of multiple[1], conv >= 2."""
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive for {kind} layers, got {getattr(self, field)}")
        if getattr(self, multiple[0]) % getattr(self, multiple[1]):
            raise ValueError(f"{multiple[0]}={getattr(self, multiple[0])} is not a multiple of "
                             f"{multiple[1]}={getattr(self, multiple[1])}")
        if getattr(self, conv) < 2:
            raise ValueError(f"{conv} must be >= 2, got {getattr(self, conv)}")

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
        """Multiplier of q·k: query_pre_attn_scalar ** -0.5 when set, else head_dim ** -0.5; MLA: the query width
        (nope + rope) ** -0.5, times YaRN's mscale(mscale_all_dim)² as DeepSeek-V2 applies it."""
        if self.is_mla:
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            rs = self.rope_scaling
            if rs is not None and rs.mscale_all_dim:
                scale *= rs.yarn_mscale(rs.mscale_all_dim) ** 2
            return scale
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_expert_width(self) -> int:
        """The shared experts' total width (one GatedMLP), 0 for none."""
        return self.shared_expert_intermediate_size or self.num_shared_experts * self.moe_intermediate_size

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward block is the mixture of experts."""
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    def is_state_layer(self, layer: int) -> bool:
        """Whether `layer` keeps a recurrent state (STATE_LAYER_TYPES) instead of attending over a KV cache."""
        return self.layer_types is not None and self.layer_types[layer] in STATE_LAYER_TYPES

    @property
    def has_state_layers(self) -> bool:
        return self.layer_types is not None and any(t in STATE_LAYER_TYPES for t in self.layer_types)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The state layers' indices, in layer order (their caches follow the KV caches in that order)."""
        return tuple(i for i in range(self.num_layers) if self.is_state_layer(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over a KV cache (every layer of a model without state layers)."""
        return tuple(i for i in range(self.num_layers) if not self.is_state_layer(i))

    def kv_layer(self, layer: int) -> int:
        """Index of the KV cache `layer` reads: with cross-layer attention, that of the first layer of its run; in a
        hybrid model, its rank among the attention layers (state layers have no KV cache)."""
        if not self.has_state_layers:
            return layer // self.cla_factor
        if self.is_state_layer(layer):
            raise ValueError(f"layer {layer} is a {self.layer_types[layer]} layer: it has a state cache "
                             "(cache_index), not a KV cache")
        return self.attention_layers.index(layer)

    def cache_index(self, layer: int) -> int:
        """Layer `layer`'s entry in the step's cache list: the KV caches first (`kv_layer` numbering), then one
        `RecurrentState` per state layer in layer order."""
        if self.is_state_layer(layer):
            return self.num_kv_layers + self.state_layers.index(layer)
        return self.kv_layer(layer)

    def state_cache_spec(self, layer: int, num_slots: int, dtype="float32"):
        """State layer `layer`'s cache of `num_slots` slots (slot 0 the null slot) as a `RecurrentState` of
        `jax.ShapeDtypeStruct`s (kernels_pallas/recurrent/layout.py): the conv state in `dtype` (the model's), the
        recurrent state in float32."""
        kind = self.layer_types[layer] if self.layer_types is not None else "full_attention"
        from kernels_pallas.recurrent.layout import recurrent_state_spec

        if kind == "linear_attention":
            return recurrent_state_spec(num_slots, self.linear_conv_dim, self.linear_conv_kernel_dim,
                                        self.linear_num_value_heads, self.linear_key_head_dim,
                                        self.linear_value_head_dim, dtype)
        if kind == "mamba":  # the same two leaves: conv [N, C, K-1], SSD state [N, heads, head_dim, d_state]
            return recurrent_state_spec(num_slots, self.mamba_conv_dim, self.mamba_d_conv, self.mamba_num_heads,
                                        self.mamba_head_dim, self.ssm_state_size, dtype)
        raise ValueError(f"layer {layer} ({kind}) has no state cache layout; state layers are {STATE_LAYER_TYPES} "
                         "(a kind without a branch here needs one added)")

    def state_bytes_per_sequence(self, dtype="float32") -> int:
        """State bytes one sequence holds across all state layers (one slot each; the conv state in `dtype`),
        constant in its length: the memory budget's and the cost model's one formula."""
        from kernels_pallas.recurrent.layout import state_bytes

        return sum(state_bytes(self.state_cache_spec(i, 1, dtype)) for i in self.state_layers)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's conv1d: q and k (Hk·Dk each), then v (Hv·Dv)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def mamba_intermediate_size(self) -> int:
        """A Mamba2 mixer's width: its heads times head_dim (transformers' expand * hidden_size)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of a Mamba2 layer's conv1d: x (the width), then B and C (groups * d_state each)."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.ssm_state_size

    def owns_kv(self, layer: int) -> bool:
        """Whether `layer` computes and writes K/V (false for the later layers of a CLA run)."""
        return layer % self.cla_factor == 0

    @property
    def num_kv_layers(self) -> int:
        """How many layers have a KV cache of their own (state layers have none)."""
        if self.has_state_layers:
            return len(self.attention_layers)
        return -(-self.num_layers // self.cla_factor)

    @property
    def kv_width(self) -> int:
        """Cache elements per token per caching layer: 2·K·H, or the latent plus the RoPE key for MLA."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_cache_spec(self, num_pages: int, page_size: int, dtype="float32"):
        """One caching layer's paged cache as `jax.ShapeDtypeStruct`s: `kernels_pallas.kv_cache_spec`'s layout
        (a `(pages, scales)` pair for an int8 or fp8 cache), or MLA's latent pages `[pages, page_size, kv_lora_rank +
        qk_rope_head_dim]`, which have no head axis (flat pages on TPU, which lays that shape out pages-minor:
        `kernels_pallas/kv_cache/latent_layout.py`)."""
        import jax
        import jax.numpy as jnp

        from kernels_pallas.kv_cache.layout import kv_cache_spec
        from kernels_pallas.kv_cache.latent_layout import latent_cache_shape

        dtype = jnp.dtype(dtype)
        if self.is_mla:
            if dtype == jnp.int8:
                raise ValueError("an int8 KV cache is supported for K/V caches, not for MLA's latent cache (fp8 is: "
                                 "a saturating cast, no scales)")
            return jax.ShapeDtypeStruct(latent_cache_shape(num_pages, page_size, self.kv_width), dtype)
        return kv_cache_spec(num_pages, page_size, self.num_kv_heads, self.head_dim, dtype)

    def kv_cache_page_size(self, cache) -> int:
        """The page size of a cache built from `kv_cache_spec` (an array, or an int8 cache's pages + scales)."""
        from kernels_pallas.kv_cache.latent_layout import latent_page_size

        shape = cache.shape
        return latent_page_size(shape, self.kv_width) if self.is_mla else shape[2]

    def kv_cache_bytes(self, num_pages: int, page_size: int, dtype="float32") -> int:
        """Bytes of the whole paged cache (every caching layer) as `kv_cache_spec` lays it out, padding included."""
        import math

        import jax

        leaves = jax.tree.leaves(self.kv_cache_spec(num_pages, page_size, dtype))
        return self.num_kv_layers * sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)

    def kv_bytes_per_token(self, bytes_per_element: float, scale_bytes: int = 0) -> float:
        """KV cache bytes one token occupies across all layers: 2·L·K·H·b, with L the caching layers (fewer under
        CLA) and 2·K·H replaced by the latent + RoPE width for MLA (576·L·b for DeepSeek-V2). `scale_bytes`: an
        int8 / fp8 cache's per-token scale for each of the 2·K heads (4 for float32 scales)."""
        scales = 0 if self.is_mla else 2 * self.num_kv_heads * scale_bytes
        return self.num_kv_layers * (self.kv_width * bytes_per_element + scales)

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """The KV cache groups, one per distinct window of the caches (None, full attention, first): the caches
        of a group share a page pool and one page table per sequence (inference/engine/pages/kv_cache_manager.py). A
        cache read by several layers (CLA) belongs to the widest window among them."""
        windows = {self._cache_window(self.kv_layer(i)) for i in self.attention_layers}
        return tuple(sorted(windows, key=lambda w: -1 if w is None else w))

    def kv_group(self, layer: int) -> int:
        """Index into `kv_group_windows` of the cache `layer` reads: which page table its attention uses."""
        return self.kv_group_windows.index(self._cache_window(self.kv_layer(layer)))

    def _cache_window(self, cache: int) -> int | None:
        windows = [self.layer_window(i) for i in self.attention_layers if self.kv_layer(i) == cache]
        return None if None in windows else max(windows)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
