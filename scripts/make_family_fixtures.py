"""Write the per-family reference fixtures that tests/models/test_families.py checks without transformers.

For each family (mistral, qwen2, qwen3, gemma2, gemma3_text, deepseek_v2) this builds a tiny random transformers model
whose config exercises the family's details (sliding windows shorter than the test sequence, QKV bias, QK-norm, Gemma
norms, soft caps, query_pre_attn_scalar, per-layer-type RoPE), stores it in bfloat16 (config.json +
model.safetensors, under 200 KB), reloads that folder in float32 with eager attention and records transformers'
logits for a fixed token sequence:

    tests/fixtures/families/<family>/config.json
    tests/fixtures/families/<family>/model.safetensors
    tests/fixtures/families/<family>/reference.npz      input_ids i32[1, L], logits f32[L, vocab], transformers_version,
                                                        greedy_ids i32[GREEDY_TOKENS]: transformers' greedy
                                                        continuation of the first PROMPT_LEN input ids

Needs the `reference` extra (transformers + torch). Run from the repository root:

    python -m scripts.make_family_fixtures [--out tests/fixtures/families] [--family gemma2 ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import numpy as np

SEQ_LEN = 40  # longer than every window below, so windowed layers really drop keys
PROMPT_LEN, GREEDY_TOKENS = 20, 32  # the greedy continuation runs to 52 tokens, several windows long
WINDOW = 8
_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# model_type -> config overrides. Each one exercises what the family adds over Llama.
FAMILIES: dict[str, dict[str, Any]] = {
    # Mistral: the window on every layer.
    "mistral": dict(num_hidden_layers=2, sliding_window=WINDOW, rope_theta=10000.0, tie_word_embeddings=False),
    # Qwen2: q/k/v biases; with use_sliding_window, layers at index >= max_window_layers slide (here layer 1 only).
    "qwen2": dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  rope_theta=10000.0, tie_word_embeddings=False),
    # Qwen3: QK-norm, no bias, no window.
    "qwen3": dict(num_hidden_layers=2, rope_theta=1_000_000.0, tie_word_embeddings=False),
    # Gemma 2: sliding / global alternation, both soft caps (small, so tanh bends), query_pre_attn_scalar != head_dim.
    "gemma2": dict(num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    # Gemma 3 text: QK-norm, 2 local : 1 global via sliding_window_pattern, local RoPE base, linear scaling on the
    # global layer only, no soft caps.
    "gemma3_text": dict(num_hidden_layers=3, sliding_window=WINDOW, sliding_window_pattern=3, query_pre_attn_scalar=24,
                        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # DeepSeek-V2: MLA with a query low rank, YaRN (mscale terms in both the RoPE and the score scale), interleaved
    # RoPE, a dense first layer, then MoE layers with a shared expert and group-limited routing.
    "deepseek_v2": dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                        n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, routed_scaling_factor=1.5, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 32, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
}
FIXTURE_FILES = ("config.json", "model.safetensors", "reference.npz")


def hf_config(family: str):
    import transformers

    return transformers.AutoConfig.for_model(family, **{**_COMMON, **FAMILIES[family]})


def _randomize(model, seed: int) -> None:
    """Weights far from init so every term matters: norms off 1 (or off 0 for Gemma's 1 + w), sizeable biases."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(0.3 * noise if gemma else 1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise if not gemma else 0.15 * noise)  # Gemma multiplies by sqrt(hidden) = 8
            else:
                p.copy_(0.15 * noise)


def build_family(family: str, folder: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Save the tiny `family` model (bf16) into `folder`; return (input_ids [1, L], transformers' f32 logits [L, V],
    its greedy continuation [GREEDY_TOKENS] of the first PROMPT_LEN ids)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    _randomize(model, seed=1000 + list(FAMILIES).index(family))
    model.to(torch.bfloat16).save_pretrained(folder)
    for extra in os.listdir(folder):
        if extra not in FIXTURE_FILES:
            os.remove(os.path.join(folder, extra))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    ids = np.random.default_rng(seed).integers(3, _COMMON["vocab_size"], (1, SEQ_LEN)).astype(np.int32)
    with torch.no_grad():
        logits = ref(input_ids=torch.from_numpy(ids.astype(np.int64))).logits[0].float().numpy()
        # Greedy by hand: `generate(min_new_tokens=...)` would mask EOS, and the engine's ignore_eos does not.
        seq = torch.from_numpy(ids[:, :PROMPT_LEN].astype(np.int64))
        for _ in range(GREEDY_TOKENS):
            seq = torch.cat([seq, ref(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids, logits, seq[0, PROMPT_LEN:].numpy().astype(np.int32)


def write_fixture(family: str, out_dir: str) -> str:
    import transformers

    folder = os.path.join(out_dir, family)
    with tempfile.TemporaryDirectory() as tmp:
        ids, logits, greedy = build_family(family, tmp)
        os.makedirs(folder, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(os.path.join(tmp, name), os.path.join(folder, name))
    np.savez(os.path.join(folder, "reference.npz"), input_ids=ids, logits=logits.astype(np.float32),
             greedy_ids=greedy, transformers_version=np.array(transformers.__version__))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("tests", "fixtures", "families"))
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: all")
    args = parser.parse_args(argv)
    for family in args.family or list(FAMILIES):
        folder = write_fixture(family, args.out)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        print(f"{folder}: {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
