"""Tensor-parallel checks on 8 virtual CPU devices, run by tests/sharding/test_sharding.py in a subprocess (the pytest
process has one CPU device). Prints one JSON object on the last line of stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/sharding_worker.py

For each model and (TP, DP): greedy tokens, prompt logprobs and sample logprobs of a small batch (plus an n=2 seeded
sampled request, whose pages are shared and copied on write), per-device bytes of parameters and KV caches, the
partition specs, the devices and load of each data-parallel replica, and for TP 2 (TP 8 for the MoE models) the
collectives in the compiled decode step; for the MoE models also the routed experts' bytes per device. Also an
orbax checkpoint restored straight into a TP-2 layout. Results are keyed "TP" for one replica
and "dpD-tpT" for D replicas.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from configs.presets import MODEL_PRESETS, get_model_config  # noqa: E402
from inference import LLM, SamplingParams  # noqa: E402
from inference.runtime.batch import ModelInput  # noqa: E402
from inference.runtime.compile_cache import enable_compilation_cache  # noqa: E402
from inference.sampling.sampler import SamplingTensors  # noqa: E402
from models.decoder import build_decoder  # noqa: E402
from models.loaders.orbax_checkpoint import restore_weights, save_checkpoint  # noqa: E402
from sharding import bytes_per_device, checkpoint_shardings, make_mesh  # noqa: E402
from sharding.partition import export_weights  # noqa: E402
from tests.tiny_folder import make_tiny_hf_folder  # noqa: E402

# SmolLM2's grouping (9 query heads, 3 KV heads), which TP 2, 4 and 8 do not divide.
MODEL_PRESETS["tiny-llama-9q3kv"] = get_model_config("tiny-llama").replace(
    name="tiny-llama-9q3kv", num_heads=9, num_kv_heads=3, head_dim=16)
# Also a vocabulary and an MLP width that TP 8 does not divide (500 -> 504, 100 -> 104), with tied embeddings.
MODEL_PRESETS["tiny-odd"] = get_model_config("tiny-llama").replace(
    name="tiny-odd", num_heads=9, num_kv_heads=3, head_dim=16, vocab_size=500, intermediate_size=100,
    tie_word_embeddings=True)
# DeepSeek-V2 in miniature with an expert width TP 8 does not divide (20 -> 24 per routed expert, shared 40 -> 48).
MODEL_PRESETS["tiny-deepseek-odd"] = get_model_config("tiny-deepseek-v2").replace(
    name="tiny-deepseek-odd", moe_intermediate_size=20)
# Multi-head attention (as many KV heads as query heads).
MODEL_PRESETS["tiny-mha"] = get_model_config("tiny-llama").replace(name="tiny-mha", num_kv_heads=4)

PROMPTS = [[5, 17, 300, 42, 9, 11, 200, 13, 77, 401, 3], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, n=2, seed=1)
SMOL_TEXTS = ["The capital of France is Paris, and the capital of Italy is", "Once upon a time there was",
              "def add(a, b):\n    return"]


def collectives(llm: LLM) -> dict[str, int]:
    runner = llm.runner
    inp = ModelInput.empty(num_tokens=4, num_seqs=4, pages_per_seq=4, max_q_len=1)
    sampling = SamplingTensors.from_params([], [], [], pad_to=4)
    text = runner.decode_step.lower(runner.param_leaves, runner.kv_caches, inp, sampling, use_filters=False,
                                    logprobs=False, prompt_logprobs=False).compile().as_text()
    counts: collections.Counter = collections.Counter()
    for m in re.finditer(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(",
                         text):
        counts[f"{m.group(2)} {m.group(1).split('{')[0]}"] += 1
    return dict(counts)


def expert_bytes(runner) -> dict:
    """Bytes of the routed experts' [E, D, F] / [E, F, D] weights: the largest any device holds, and the (padded)
    arrays counted once."""
    experts = [leaf for name, leaf in zip(_leaf_names(runner), runner.param_leaves)
               if re.search(r"\.mlp\.(gate|up|down)_proj\.value$", name) and leaf.ndim == 3]
    per_device = bytes_per_device(experts)
    return {"per_device": max(per_device.values()), "global": sum(x.nbytes for x in experts),
            "shapes": sorted({",".join(map(str, x.shape)) for x in experts})}


def run(model: str, tp: int, dp: int = 1) -> dict:
    start = time.perf_counter()
    kv_bytes = 16 << 20 if model == "smollm2-135m" else 1 << 20  # the real model: 45 KiB of KV per token
    llm = LLM(model, tensor_parallel_size=tp, data_parallel_size=dp, kv_cache_memory_bytes=kv_bytes, page_size=4,
              max_num_seqs=8, max_num_batched_tokens=64, compilation_cache_dir=None)
    built = time.perf_counter()
    # The real model: greedy requests only (each variant is a 30-layer compile), on text (arbitrary ids put its
    # logprobs near -20, where float32 noise of a 30-layer sum reaches 2e-4 between reduction orders).
    light = model == "smollm2-135m"
    prompts = [llm.tokenizer.encode(t) for t in SMOL_TEXTS] if light else PROMPTS
    outs = llm.generate(prompt_token_ids=prompts + ([] if light else [PROMPTS[0]]),
                        sampling_params=[GREEDY] * 3 + ([] if light else [SAMPLED]))
    greedy = outs[:3]
    result = {
        "prompt_ids": prompts,
        "tokens": [o.outputs[0].token_ids for o in greedy],
        "sampled": None if light else [c.token_ids for c in outs[3].outputs],
        "prompt_logprobs": [[entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                            for o in greedy],
    }
    if not light:  # swapping weights keeps their shardings (every replica's) and reuses the compiled steps
        llm.update_weights(llm.get_params())
        result["tokens_after_update"] = llm.generate(prompt_token_ids=PROMPTS[:1],
                                                     sampling_params=GREEDY)[0].outputs[0].token_ids
    runner = llm.runner
    params_dev = bytes_per_device(runner.param_leaves)
    kv_dev = bytes_per_device(runner.kv_caches)
    result.update(
        param_bytes_per_device=max(params_dev.values()), param_devices=len(params_dev),
        param_bytes_total=sum(params_dev.values()),
        param_bytes_global=sum(x.nbytes for x in runner.param_leaves),  # the padded model, counted once
        param_bytes_replicated=sum(x.nbytes for x in runner.param_leaves if x.sharding.is_fully_replicated),
        kv_bytes_per_device=max(kv_dev.values()), kv_devices=len(kv_dev), kv_bytes_total=sum(kv_dev.values()),
        kv_spec=str(runner.kv_caches[0].sharding.spec) if tp > 1 else None,
        specs={} if runner.param_shardings is None else {
            name: str(s.spec) for name, s in zip(_leaf_names(runner), runner.param_shardings)},
        kv_heads=runner.kv_caches[0].shape[0],  # head-major caches (kernels_pallas/kv_cache/layout.py)
        num_pages=runner.num_pages,
        build_s=built - start, generate_s=time.perf_counter() - built,
        compiles=runner.num_compilations(),
    )
    if dp > 1:  # every replica: its devices and the largest bytes any of them holds
        per_replica = [(bytes_per_device(r.param_leaves), bytes_per_device(r.kv_caches)) for r in llm.runners]
        result["replica_devices"] = [sorted(d.id for d in params) for params, _ in per_replica]
        result["replica_kv_devices"] = [sorted(d.id for d in kv) for _, kv in per_replica]
        result["replica_param_bytes_per_device"] = [max(params.values()) for params, _ in per_replica]
        result["replica_kv_bytes_per_device"] = [max(kv.values()) for _, kv in per_replica]
        result["replica_requests"] = list(llm.engine.num_assigned)
    if (tp == 2 and dp == 1 and model == "tiny-llama") or (tp == 8 and model.startswith("tiny-deepseek")):
        result["collectives"] = collectives(llm)
    if model.startswith("tiny-deepseek"):
        result["expert_bytes"] = expert_bytes(runner)
    return result


def api_run() -> dict:
    """chat, stream and a background loop with one replica and with two (a tiny model that has a tokenizer)."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    conversations = [[{"role": "user", "content": "question " * (i + 1)}] for i in range(4)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_tiny_hf_folder(Path(tmp) / "hf"))
        for name, dp in (("1", 1), ("dp2", 2)):
            llm = LLM(folder, data_parallel_size=dp, kv_cache_memory_bytes=1 << 20, page_size=4, max_num_seqs=8,
                      max_num_batched_tokens=64, compilation_cache_dir=None)
            chat = [o.outputs[0].text for o in llm.chat(conversations, params)]
            streamed: dict[str, list[int]] = {}
            for delta in llm.stream(["sea", "a longer prompt", "x"], params):
                streamed.setdefault(delta.request_id, []).extend(delta.token_ids)
            loop = llm.background()
            try:
                streams = [loop.submit(llm.tokenizer.encode(t), params) for t in ("x y", "zzz", "q")]
                background = [s.result().outputs[0].token_ids for s in streams]
            finally:
                loop.close()
            out[name] = {"chat": chat, "stream": [streamed[k] for k in sorted(streamed, key=int)],
                         "background": background,
                         "assigned": list(getattr(llm.engine, "num_assigned", [])),
                         "unfinished": llm.engine.has_unfinished_requests(), "left": len(llm.engine.requests)}
    return out


def orbax_run() -> dict:
    """tiny-llama's weights saved with orbax and restored straight into a TP-2 layout (every array placed by the
    restore itself), then generating; and the padded path for a head count TP 2 does not divide."""
    config = get_model_config("tiny-llama")
    mesh = make_mesh(model=2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ckpt")
        save_checkpoint(folder, config, export_weights(build_decoder(config, seed=0)))
        shardings = checkpoint_shardings(config, mesh)
        restored = restore_weights(folder, config, shardings)
        placed = all(restored[name].sharding == s for name, s in shardings.items())
        per_device = bytes_per_device(list(restored.values()))
        out = run(folder, 2)
    return {"placed_by_restore": placed, "restored_bytes_per_device": max(per_device.values()),
            "restored_bytes_total": sum(int(a.nbytes) for a in restored.values()),
            "padded_needs_host": checkpoint_shardings(get_model_config("tiny-llama-9q3kv"), mesh) is None,
            "tokens": out["tokens"], "prompt_logprobs": out["prompt_logprobs"]}


def warmup_run() -> dict:
    """Decode compile counts around serving at TP 2: warm-up must leave nothing for the first requests to compile
    (the caches' sharding after a step must equal the one they were created with)."""
    llm = LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory_bytes=1 << 18, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=32, compilation_cache_dir=None)
    warmed = llm.warmup(prefill=False, extras=False)
    before = llm.runner.num_compilations()["decode"]
    llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=SamplingParams(temperature=0.0, max_tokens=6,
                                                                               ignore_eos=True))
    return {"warmed": warmed, "decode_compiles_after_warmup": llm.runner.num_compilations()["decode"] - before}


def _leaf_names(runner) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(runner.params)
    return [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in flat]


def main(argv: list[str]) -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    enable_compilation_cache(os.environ.get("SHARDING_WORKER_CACHE") or os.path.join(root, ".jax_cache"))
    out = {"devices": jax.device_count(), "results": {}, "timings": {}, "max_tokens": GREEDY.max_tokens}
    for model, sizes in PLAN.items():
        t, cpu = time.perf_counter(), time.process_time()
        out["results"][model] = {key(tp, dp): run(model, tp, dp) for tp, dp in sizes}
        out["timings"][model] = {"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}
    for name, fn in (("orbax", orbax_run), ("api", api_run), ("warmup", warmup_run)):
        t, cpu = time.perf_counter(), time.process_time()
        out[name] = fn()
        out["timings"][name] = {"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}
    print(json.dumps(out))


TP_ALL = ((1, 1), (2, 1), (4, 1), (8, 1))
# model -> (TP, DP) runs, kept few because each run compiles its own steps (a DP run once per replica): every TP size
# on the grouping that no size divides (9q3kv), the sizes where the others change layout (MHA: split at 2, KV heads
# replicated at 8; tiny-mistral, tiny-llama's shapes plus a sliding window: TP 4 and 8 and DP 2 x TP 4).
# SmolLM2 itself (30 layers) runs once, at DP 2 x TP 4 (heads padded 9/3 -> 12/4); the test compares it with the
# session's one-device SmolLM2, and tiny-llama-9q3kv covers its grouping at every size.
PLAN = {"tiny-llama": ((1, 1), (2, 1)), "tiny-llama-9q3kv": TP_ALL + ((2, 2),), "tiny-odd": ((1, 1), (8, 1)),
        "tiny-mha": ((1, 1), (2, 1), (8, 1)), "tiny-mistral": ((1, 1), (4, 1), (8, 1), (4, 2)), "smollm2-135m": ((4, 2),),
        "tiny-deepseek-v2": ((1, 1), (8, 1), (4, 2)),  # MLA: 4 heads padded to 8 at TP 8, 1 a device at TP 4; MoE
        "tiny-deepseek-odd": ((1, 1), (8, 1))}  # and the experts' width padded


def key(tp: int, dp: int) -> str:
    return str(tp) if dp == 1 else f"dp{dp}-tp{tp}"


if __name__ == "__main__":
    main(sys.argv[1:])
