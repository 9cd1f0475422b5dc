"""The cost of LoRA serving: decode throughput with 4 active adapters against none, in one run.

    python scripts/bench/benchmark.py --mode=lora --model=smollm2-135m --batch=16 --input_len=64 --output_len=64 --json

Three runs over the same random prompts (greedy, EOS ignored), each warmed up by itself once
(`scripts/bench/benchmark.py: run_pagejax`), interleaved for `rounds` rounds, the best of each kept: "none", an LLM
without LoRA; "lora_base", an `LLM(enable_lora=True, max_loras=4)` whose requests all run the base model (slot 0);
"lora_4", the same LLM with the requests spread round-robin over 4 random adapters of rank --lora_rank on all
seven projections. The masked delta (models/lora.py) computes every slot's product for every token, so
"lora_base" and "lora_4" should cost alike; the ratios to "none" are the price of serving LoRA at all
(`scripts/bench/benchmark.py --mode=lora` runs it; --lora_rank sets the rank).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inference import LLM, LoRARequest  # noqa: E402
from tests import lora_adapters  # noqa: E402

NUM_ADAPTERS = 4


def run_lora(model: str, batch: int, input_len: int, output_len: int, rank: int, seed: int, *, make_prompts,
             run_pagejax, rounds: int = 2) -> dict:
    """The three runs of the module docstring and their ratios to "none"; `make_prompts` and `run_pagejax` are
    scripts/bench/benchmark.py's (passed in: that file runs as __main__, so importing it here would define its flags
    twice)."""
    common = dict(max_num_seqs=batch, max_num_batched_tokens=max(512, input_len))
    plain = LLM(model, **common)
    prompts = make_prompts(batch, input_len, plain.config.vocab_size, seed)
    result: dict = {"config": {"model": model, "batch": batch, "input_len": input_len, "output_len": output_len,
                               "rank": rank, "num_adapters": NUM_ADAPTERS}}
    llm = LLM(model, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=rank, **common)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, lora_adapters.make_adapter(
            os.path.join(tmp, f"a{i}"), llm.config, rank=rank, alpha=2 * rank, seed=i, std=0.02))
            for i in range(NUM_ADAPTERS)]
        t0 = time.perf_counter()
        for lora in loras:
            llm.engine.lora.register(lora)  # read and validated on the host; the first step puts them in slots
        result["adapter_register_s"] = (time.perf_counter() - t0) / NUM_ADAPTERS
        spread = [loras[i % NUM_ADAPTERS] for i in range(len(prompts))]
        runs: dict = {}
        for _ in range(rounds):  # interleaved, best of `rounds`: a shared machine's load drifts between runs
            for name, run in (("none", lambda: run_pagejax(plain, prompts, output_len)),
                              ("lora_base", lambda: run_pagejax(llm, prompts, output_len)),
                              ("lora_4", lambda: run_pagejax(llm, prompts, output_len, lora_request=spread))):
                got = run()
                runs.setdefault(f"{name}_rounds", []).append(got["decode_tok_s"])
                if name not in runs or got["decode_tok_s"] > runs[name]["decode_tok_s"]:
                    runs[name] = got
    result["runs"] = {k: v for k, v in runs.items() if not k.endswith("_rounds")}
    result["decode_tok_s_per_round"] = {k[:-len("_rounds")]: v for k, v in runs.items() if k.endswith("_rounds")}
    runs = result["runs"]
    result["slot_bytes"] = llm.runner.lora.nbytes
    result["ratio"] = {name: {k: runs[name][k] / runs["none"][k] for k in ("decode_tok_s", "output_tok_s")}
                       for name in ("lora_base", "lora_4")}
    for name, run in runs.items():
        print(f"{name:9}: decode {run['decode_tok_s']:.1f} tok/s, end to end {run['output_tok_s']:.1f} tok/s, "
              f"TTFT {run['ttft_mean_s'] * 1e3:.0f} ms", file=sys.stderr)
    for name, ratio in result["ratio"].items():
        print(f"{name} / none: decode x{ratio['decode_tok_s']:.3f}, end to end x{ratio['output_tok_s']:.3f}",
              file=sys.stderr)
    return result
