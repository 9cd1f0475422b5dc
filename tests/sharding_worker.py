"""Tensor-parallel checks on 8 virtual CPU devices, run by tests/test_sharding.py in a subprocess (the pytest process
has one CPU device). Prints one JSON object on the last line of stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py

For each model and TP: greedy tokens, prompt logprobs and sample logprobs of a small batch (plus an n=2 seeded
sampled request, whose pages are shared and copied on write), per-device bytes of parameters and KV caches, the
partition specs, and for TP 2 the collectives in the compiled decode step.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from configs.presets import MODEL_PRESETS, get_model_config  # noqa: E402
from inference import LLM, SamplingParams  # noqa: E402
from inference.batch import ModelInput  # noqa: E402
from inference.compile_cache import enable_compilation_cache  # noqa: E402
from inference.sampler import SamplingTensors  # noqa: E402
from sharding import bytes_per_device  # noqa: E402

# SmolLM2's grouping (9 query heads, 3 KV heads), which TP 2, 4 and 8 do not divide.
MODEL_PRESETS["tiny-llama-9q3kv"] = get_model_config("tiny-llama").replace(
    name="tiny-llama-9q3kv", num_heads=9, num_kv_heads=3, head_dim=16)
# Also a vocabulary and an MLP width that TP 8 does not divide (500 -> 504, 100 -> 104), with tied embeddings.
MODEL_PRESETS["tiny-odd"] = get_model_config("tiny-llama").replace(
    name="tiny-odd", num_heads=9, num_kv_heads=3, head_dim=16, vocab_size=500, intermediate_size=100,
    tie_word_embeddings=True)

PROMPTS = [[5, 17, 300, 42, 9, 11, 200, 13, 77, 401, 3], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, n=2, seed=1)


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


def run(model: str, tp: int) -> dict:
    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_bytes=1 << 20, page_size=4, max_num_seqs=8,
              max_num_batched_tokens=64, compilation_cache_dir=None)
    built = time.perf_counter()
    outs = llm.generate(prompt_token_ids=PROMPTS + [PROMPTS[0]], sampling_params=[GREEDY] * 3 + [SAMPLED])
    greedy = outs[:3]
    result = {
        "tokens": [o.outputs[0].token_ids for o in greedy],
        "sampled": [c.token_ids for c in outs[3].outputs],
        "prompt_logprobs": [[entry[t] for entry, t in zip(o.prompt_logprobs[1:], ids[1:])]
                            for o, ids in zip(greedy, PROMPTS)],
    }
    # Swapping weights keeps their shardings and reuses the compiled steps.
    llm.update_weights(llm.get_params())
    again = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)[0].outputs[0].token_ids
    runner = llm.runner
    params_dev = bytes_per_device(runner.param_leaves)
    kv_dev = bytes_per_device(runner.kv_caches)
    result.update(
        tokens_after_update=again,
        param_bytes_per_device=max(params_dev.values()), param_devices=len(params_dev),
        param_bytes_total=sum(params_dev.values()),
        param_bytes_global=sum(x.nbytes for x in runner.param_leaves),  # the padded model, counted once
        param_bytes_replicated=sum(x.nbytes for x in runner.param_leaves if x.sharding.is_fully_replicated),
        kv_bytes_per_device=max(kv_dev.values()), kv_devices=len(kv_dev), kv_bytes_total=sum(kv_dev.values()),
        kv_spec=str(runner.kv_caches[0].sharding.spec) if tp > 1 else None,
        specs={} if runner.param_shardings is None else {
            name: str(s.spec) for name, s in zip(_leaf_names(runner), runner.param_shardings)},
        kv_heads=runner.kv_caches[0].shape[2] // 2,
        num_pages=runner.num_pages,
        build_s=built - start, generate_s=time.perf_counter() - built,
        compiles=runner.num_compilations(),
    )
    if tp == 2 and model == "tiny-llama":
        result["collectives"] = collectives(llm)
    return result


def _leaf_names(runner) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(runner.params)
    return [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in flat]


def main(argv: list[str]) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    enable_compilation_cache(os.environ.get("SHARDING_WORKER_CACHE") or os.path.join(root, ".jax_cache"))
    plan = {"tiny-llama": (1, 2, 4, 8), "tiny-llama-9q3kv": (1, 2, 4, 8), "tiny-odd": (1, 8)}
    out = {"devices": jax.device_count(), "results": {}}
    for model, sizes in plan.items():
        out["results"][model] = {str(tp): run(model, tp) for tp in sizes}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
