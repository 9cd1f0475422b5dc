"""LoRA under tensor parallelism on 8 virtual CPU devices, run by tests/sharding/test_lora_tp.py in a subprocess (the
pytest process has one CPU device). Prints one JSON object on the last line of stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/lora_worker.py

The tiny Llama with SmolLM2's grouping (9 query / 3 KV heads: padded to 12 / 4 at TP 2) and an MLP width TP 2 divides,
two adapters (rank 8 on every projection; rank 4 rsLoRA on q/v) and the base model in one batch, at TP 1 and TP 2:
greedy tokens, prompt logprobs, the slot arrays' partition specs and bytes per device, and the tokens after an
update_lora.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs.presets import MODEL_PRESETS, get_model_config  # noqa: E402
from inference import LLM, LoRARequest, SamplingParams  # noqa: E402
from inference.runtime.compile_cache import enable_compilation_cache  # noqa: E402
from sharding import bytes_per_device  # noqa: E402
from tests import lora_adapters  # noqa: E402

MODEL = "tiny-llama-9q3kv"
MODEL_PRESETS[MODEL] = get_model_config("tiny-llama").replace(name=MODEL, num_heads=9, num_kv_heads=3, head_dim=16)
PROMPTS = [[5, 17, 300, 42, 9, 11, 200, 13, 77, 401, 3], [7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)


def run(tp: int, loras: list) -> dict:
    llm = LLM(MODEL, tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory_bytes=1 << 20, page_size=4, max_num_seqs=8, max_num_batched_tokens=64,
              compilation_cache_dir=None)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, lora_request=loras)
    slots = llm.runner.lora.arrays
    result = {"tokens": [o.outputs[0].token_ids for o in outs], "errors": [o.error for o in outs],
              "prompt_logprobs": [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                                  for o in outs],
              "specs": {f"{name}.{part}": str(getattr(getattr(slots[name], part).sharding, "spec", None))
                        for name in ("layers.0.q_proj", "layers.0.k_proj", "layers.0.o_proj", "layers.0.down_proj")
                        for part in ("a", "b")},
              "shapes": {name: [list(slots[name].a.shape), list(slots[name].b.shape)]
                         for name in ("layers.0.q_proj", "layers.0.o_proj")},
              "slot_bytes_per_device": max(bytes_per_device(slots).values()), "slot_bytes_global": sum(
                  x.nbytes for x in jax.tree.leaves(slots))}
    manager = llm.engine.lora
    rng = np.random.default_rng(5)
    new = {n: (rng.standard_normal(a.shape).astype(np.float32) * 0.3, rng.standard_normal(b.shape).astype(np.float32)
               * 0.3) for n, (a, b) in manager.adapters[loras[0].lora_int_id].weights.items()}
    result["tokens_before_update"] = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY,
                                                  lora_request=loras[0])[0].outputs[0].token_ids  # its buckets warm
    compiles = llm.runner.num_compilations(), llm.runner.lora.num_compilations()
    llm.update_lora(loras[0].lora_name, new)
    result["tokens_after_update"] = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY,
                                                 lora_request=loras[0])[0].outputs[0].token_ids
    result["recompiled_after_update"] = (llm.runner.num_compilations(), llm.runner.lora.num_compilations()) != compiles
    return result


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    enable_compilation_cache(os.environ.get("SHARDING_WORKER_CACHE") or os.path.join(root, ".jax_cache"))
    config = MODEL_PRESETS[MODEL]
    with tempfile.TemporaryDirectory() as tmp:
        a = lora_adapters.make_adapter(os.path.join(tmp, "a"), config, rank=8, alpha=16, seed=1, std=0.3)
        b = lora_adapters.make_adapter(os.path.join(tmp, "b"), config, rank=4, alpha=8, seed=2, std=0.3,
                                       use_rslora=True, modules=("q_proj", "v_proj"))
        loras = [LoRARequest("a", 1, a), LoRARequest("b", 2, b), None]
        out = {"devices": jax.device_count(), "results": {str(tp): run(tp, loras) for tp in (1, 2)}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
