"""Offline throughput and latency benchmark, optionally side by side with transformers in the same process.

    python scripts/bench/benchmark.py --model=smollm2-135m --batch=32 --input_len=128 --output_len=128 --json
    python scripts/bench/benchmark.py --batch=1,32 --compare=hf --json        # needs the `reference` extra
    python scripts/bench/benchmark.py --batch=1,32 --compare=llamacpp --json  # needs the `llamacpp` extra
    python scripts/bench/benchmark.py --batch=1,32 --compare=hf --plot=bench.png   # scripts/bench/plot_benchmarks.py
    python scripts/bench/benchmark.py --mode=serving --request_rate=2 --num_requests=64 --shared_prefix_len=64 --json

Prompts are random token ids of a fixed length (speed does not depend on the text), or, with --prompts_file, a
prompt set of varied lengths: the launcher's input JSONL (rows with "prompt" or chat "messages"), the first B rows
for batch size B (repeated when the file has fewer); transformers then runs them left-padded. Generation is greedy
with EOS ignored so every request produces exactly `output_len` tokens. Each batch size runs twice: once to compile
every shape the run meets (reported as warm-up), then measured. Serving mode sends requests with Poisson arrivals at
--request_rate per second, prompt lengths uniform in [input_len/2, 3*input_len/2] (optionally behind a shared prefix, to
exercise the prefix cache), and reports TTFT and inter-token latency percentiles. With --json the last line printed is
one JSON object: {"pagejax": {...}, "hf": {...}, "ratio": {...}}, where each side has ttft_s, output_tok_s and
decode_tok_s per batch size ("llamacpp" in place of "hf" with --compare=llamacpp: llama.cpp runs the same GGUF, its own
quantized weights, through scripts/bench/llamacpp_bench.py; transformers runs through scripts/bench/hf_bench.py, each in a child
process).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file
from inference import LLM, SamplingParams  # noqa: E402
from inference.engine.llm_engine import freeze_heap  # noqa: E402
from inference.engine.metrics import summarize_requests  # noqa: E402
from inference.entrypoints.llm import resolve_dtype  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, .gguf file or HF folder.")
flags.DEFINE_enum("mode", "offline", ["offline", "serving", "server", "lora"], "Fixed batches, Poisson arrivals "
                  "(serving), Poisson arrivals over HTTP beside the same arrivals offline (server; "
                  "scripts/bench/server_bench.py), or LoRA's cost: decode with 4 active adapters vs none "
                  "(scripts/bench/benchmark_lora.py; the first --batch).")
flags.DEFINE_integer("lora_rank", 16, "--mode=lora: the rank of the 4 random adapters.")
flags.DEFINE_list("batch", ["1", "32"], "Batch sizes to measure (offline); the largest caps running sequences.")
flags.DEFINE_float("request_rate", 2.0, "Serving: mean arrivals per second.")
flags.DEFINE_integer("num_requests", 64, "Serving: requests to send.")
flags.DEFINE_integer("shared_prefix_len", 0, "Serving: tokens of a prefix every prompt shares.")
flags.DEFINE_integer("input_len", 128, "Prompt tokens per request.")
flags.DEFINE_string("prompts_file", None, "Offline: prompts from this JSONL (the launcher's input format) instead of "
                    "random ids of --input_len tokens.")
flags.DEFINE_integer("output_len", 128, "Generated tokens per request.")
flags.DEFINE_string("dtype", "auto", "Weight and KV dtype: auto (bfloat16 on TPU/GPU, float32 on CPU), float32, "
                    "bfloat16, float16.")
flags.DEFINE_string("attn_impl", "auto", "pagejax's attention (LLM(attn_impl=)): auto, reference, cpu, tpu, gpu.")
flags.DEFINE_string("quantization", None, "pagejax's weights: None (--dtype), int8, int4, gguf (LLM(quantization=)).")
flags.DEFINE_string("kv_cache_dtype", None, "pagejax's KV cache: None (the model dtype), float32, bfloat16, int8.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Prefill token budget per step.")
flags.DEFINE_enum("scheduling_policy", "auto", ["auto", "mixed", "prefill_first"], "pagejax's scheduling policy "
                  "(LLM(scheduling_policy=)); serving mode reports the ITL percentiles each gives.")
flags.DEFINE_enum("compare", None, ["hf", "llamacpp", "plain"], "Also run, on the same prompts: transformers' "
                  "generate (hf), llama.cpp on the same GGUF (llamacpp; needs llama-cpp-python), or pagejax without "
                  "speculation (plain, with --speculative).")
flags.DEFINE_string("baseline_python", None, "--compare=hf/llamacpp: the Python that runs the other side (default: "
                    "this one). Point it at a venv with the `reference` extra to keep torch out of this environment.")
flags.DEFINE_integer("llamacpp_threads", 0, "--compare=llamacpp: llama.cpp's threads (0: every core). Use 1 on a "
                     "busy machine: its spinning workers collapse when the cores are shared (scripts/bench/llamacpp_bench.py).")
flags.DEFINE_string("plot", None, "Write a PNG of the results here (scripts/bench/plot_benchmarks.py; needs matplotlib).")
flags.DEFINE_boolean("json", False, "Print one JSON object as the last line.")
flags.DEFINE_integer("seed", 0, "Seed for the random prompts.")
flags.DEFINE_enum("speculative", None, ["ngram", "draft"], "Speculative decoding method: prompt lookup, or a draft "
                  "model (--speculative_model).")
flags.DEFINE_string("speculative_model", "smollm2-135m:layers=0:30:3,29", "The draft with --speculative=draft: a "
                    "model, MODEL:layers=..., or a draft file from scripts/tools/distill_draft.py.")
flags.DEFINE_boolean("speculative_adaptive", False, "Adapt each request's draft count to its acceptance rate.")
flags.DEFINE_integer("num_speculative_tokens", 4, "Draft tokens verified per step when speculating.")
flags.DEFINE_boolean("repetitive", False, "Offline: prompts that repeat a 16-token pattern (where prompt lookup "
                     "has something to find); default random tokens.")


def make_prompts(batch: int, length: int, vocab: int, seed: int, repetitive: bool = False) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if repetitive:
        return [(rng.integers(100, vocab - 100, 16).tolist() * (length // 16 + 1))[:length] for _ in range(batch)]
    return rng.integers(100, vocab - 100, size=(batch, length)).tolist()


def file_prompts(path: str, batch: int, llm: LLM) -> list[list[int]]:
    """The first `batch` prompts of a launcher-format JSONL, tokenized (cycling when the file has fewer rows)."""
    from inference.tools.jsonl_io import prompt_text, read_input

    rows = read_input(path)
    if not rows:
        raise ValueError(f"--prompts_file {path} has no rows")
    return [llm.tokenizer.encode(prompt_text(rows[i % len(rows)], llm.tokenizer)) for i in range(batch)]


def run_pagejax(llm: LLM, prompts: list[list[int]], output_len: int, lora_request=None) -> dict:
    """Greedy generation of `prompts`, warmed up by the same run once; `lora_request`: LoRA adapters (one for all, or
    one per prompt) for an `LLM(enable_lora=True)`."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    kw = {} if lora_request is None else {"lora_request": lora_request}
    llm.generate(prompt_token_ids=prompts, sampling_params=params, **kw)  # the same run once: every shape compiles
    llm.engine.reset_prefix_cache()  # the measured run computes its prompts, as the warm-up did
    llm.engine.reset_stats()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, **kw)
    wall = time.perf_counter() - t0
    summary = summarize_requests(outs, wall)
    itl = summary["itl_s"].get("mean")
    summary.update(warmup_s=warmup_s, decode_tok_s=len(prompts) / itl if itl else None,
                   prefill_tok_s=sum(map(len, prompts)) / max(o.metrics.ttft for o in outs),
                   engine=llm.engine.metrics_summary())
    summary["ttft_mean_s"] = summary["ttft_s"]["mean"]
    summary["first_tokens"] = [o.outputs[0].token_ids[:8] for o in outs]
    return summary


def serving_workload(llm: LLM) -> tuple[list[list[int]], np.ndarray, SamplingParams]:
    """The serving modes' prompts, Poisson gaps between arrivals (seconds) and sampling parameters."""
    rng = np.random.default_rng(FLAGS.seed)
    vocab = llm.config.vocab_size
    prefix = rng.integers(100, vocab - 100, FLAGS.shared_prefix_len).tolist()
    lengths = rng.integers(max(FLAGS.input_len // 2, 1), FLAGS.input_len * 3 // 2 + 1, FLAGS.num_requests)
    prompts = [prefix + rng.integers(100, vocab - 100, int(n)).tolist() for n in lengths]
    gaps = rng.exponential(1.0 / FLAGS.request_rate, FLAGS.num_requests)
    return prompts, gaps, SamplingParams(temperature=0.0, max_tokens=FLAGS.output_len, ignore_eos=True)


def run_serving(llm: LLM, warmup: bool = True) -> dict:
    """Poisson arrivals against the engine, stepped in this thread; arrival times are the scheduled ones.
    `warmup` False: the caller has compiled what the run needs (an unmeasured run of the same workload), not every
    decode bucket of the engine's limits."""
    prompts, gaps, params = serving_workload(llm)
    if warmup:
        llm.warmup(prefill=False, extras=False)  # every decode bucket; prefill buckets compile on first use
    freeze_heap()  # as the server does before traffic
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params.replace(max_tokens=4))
    llm.engine.reset_prefix_cache()
    llm.engine.reset_stats()
    engine, outputs, sent = llm.engine, [], 0
    start = time.perf_counter()
    arrivals = start + np.cumsum(gaps)
    while sent < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while sent < len(prompts) and arrivals[sent] <= now:
            engine.add_request(f"s{sent}", prompts[sent], params, arrival_time=float(arrivals[sent]))
            sent += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(arrivals[sent] - now, 0))
            continue
        for out in engine.step():
            if out.finished:
                outputs.append(out)
                engine.pop_finished(out.request_id)
    summary = summarize_requests(outputs, time.perf_counter() - start)
    summary.update(request_rate=FLAGS.request_rate, engine=engine.metrics_summary(),
                   scheduling_policy=engine.scheduler.config.policy)
    return summary


def run_server(llm: LLM) -> dict:
    """The serving workload over HTTP: the OpenAI server on a thread of this process, the clients (one per
    request, Poisson arrivals) in a child process (scripts/bench/server_bench.py); what the clients measured."""
    from inference.entrypoints.openai.server import ServerThread

    prompts, gaps, params = serving_workload(llm)
    llm.engine.reset_prefix_cache()  # the offline run's pages must not serve these prompts
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "gaps_s": gaps.tolist(), "max_tokens": params.max_tokens}, f)
    try:
        with ServerThread(llm, served_model_name="bench", log_level="error") as url:
            cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "server_bench.py"), f"--server_url={url}",
                   "--served_model=bench", f"--workload={f.name}"]
            return run_child(cmd, "the HTTP clients")
    finally:
        os.unlink(f.name)


def run_child(cmd: list[str], what: str) -> dict:
    """Run a child process of this benchmark; the JSON object on its last stdout line."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_baseline_in_child(side: str, gguf_path: str, prompts: list[list[int]]) -> dict:
    """The transformers (side "hf") or llama.cpp ("llamacpp") side, on the same prompts, in a child process of this
    run: torch's and XLA's CPU thread pools in one process slowed transformers down ~10x here, which would flatter
    the ratio."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    python = FLAGS.baseline_python or sys.executable
    if side == "hf":
        cmd = [python, os.path.join(os.path.dirname(__file__), "hf_bench.py"), f"--gguf={gguf_path}",
               f"--prompts={f.name}"]
    else:
        cmd = [python, os.path.join(os.path.dirname(__file__), "llamacpp_bench.py"), f"--gguf={gguf_path}",
               f"--prompts={f.name}", f"--threads={FLAGS.llamacpp_threads}"]
    cmd.append(f"--output_len={FLAGS.output_len}")
    try:
        return run_child(cmd, f"the {side} side")
    finally:
        os.unlink(f.name)


def machine() -> str:
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "")
    except OSError:
        name = ""
    import jax

    return f"{platform.node()} {name} x{len(os.sched_getaffinity(0))} cores, jax {jax.__version__} " \
           f"{jax.default_backend()}"


def main(argv: list[str]) -> None:
    del argv
    batches = [int(b) for b in FLAGS.batch]
    if FLAGS.mode == "lora":
        from scripts.bench import benchmark_lora

        result = benchmark_lora.run_lora(FLAGS.model, batches[0], FLAGS.input_len, FLAGS.output_len,
                                         FLAGS.lora_rank, FLAGS.seed, make_prompts=make_prompts,
                                         run_pagejax=run_pagejax)
        if FLAGS.json:
            print(json.dumps({"machine": machine(), **result}))
        return
    if FLAGS.compare == "llamacpp":
        from scripts.bench import llamacpp_bench

        llamacpp_bench.import_llama_cpp()  # before minutes of pagejax work: fail now if it is missing
    t0 = time.perf_counter()
    llm = LLM(FLAGS.model, dtype=FLAGS.dtype, max_num_seqs=max(batches), speculative_method=FLAGS.speculative,
              num_speculative_tokens=FLAGS.num_speculative_tokens, speculative_adaptive=FLAGS.speculative_adaptive,
              speculative_model=FLAGS.speculative_model if FLAGS.speculative == "draft" else None,
              max_num_batched_tokens=max(FLAGS.max_num_batched_tokens, FLAGS.input_len),
              quantization=FLAGS.quantization, kv_cache_dtype=FLAGS.kv_cache_dtype, attn_impl=FLAGS.attn_impl,
              scheduling_policy=FLAGS.scheduling_policy)
    result: dict = {"pagejax": {"load_s": time.perf_counter() - t0}, "machine": machine(),
                    "config": {"model": FLAGS.model, "input_len": FLAGS.input_len, "output_len": FLAGS.output_len,
                               "dtype": resolve_dtype(FLAGS.dtype), "quantization": FLAGS.quantization,
                               "kv_cache_dtype": FLAGS.kv_cache_dtype, "attn_impl": FLAGS.attn_impl,
                               "prompts_file": FLAGS.prompts_file}}
    if FLAGS.mode == "server":  # the same arrivals offline, then over HTTP; each once unmeasured, to compile
        run_serving(llm), run_server(llm)  # the batches the arrivals form differ run to run: so do their shapes
        offline = result["pagejax"]["serving"] = run_serving(llm)
        http = result["http"] = run_server(llm)
        result["ratio"] = {"output_tok_s": http["output_tok_s"] / offline["output_tok_s"],
                           **{f"{k}_{q}": http[k][q] / offline[k][q] for k in ("ttft_s", "itl_s")
                              for q in ("p50", "p90", "p99")}}
        print("HTTP / offline: " + ", ".join(f"{k} {v:.2f}" for k, v in result["ratio"].items()), file=sys.stderr)
    if FLAGS.mode in ("serving", "server"):
        served = result["pagejax"]["serving"] if FLAGS.mode == "server" else run_serving(llm)
        result["pagejax"]["serving"] = served
        print(f"serving at {FLAGS.request_rate}/s: TTFT p50 {served['ttft_s']['p50'] * 1e3:.0f} ms p99 "
              f"{served['ttft_s']['p99'] * 1e3:.0f} ms, ITL p50 {served['itl_s']['p50'] * 1e3:.0f} ms p99 "
              f"{served['itl_s']['p99'] * 1e3:.0f} ms, {served['output_tok_s']:.1f} output tok/s, prefix hit rate "
              f"{served['engine']['prefix_cache_hit_rate']:.2f}", file=sys.stderr)
        batches = []
    if FLAGS.compare:
        result[FLAGS.compare], result["ratio"] = {}, {}
    plain = None
    if FLAGS.compare == "plain":
        plain = LLM(FLAGS.model, dtype=FLAGS.dtype, max_num_seqs=max(batches), attn_impl=FLAGS.attn_impl,
                    max_num_batched_tokens=max(FLAGS.max_num_batched_tokens, FLAGS.input_len))
    for batch in batches:
        prompts = (file_prompts(FLAGS.prompts_file, batch, llm) if FLAGS.prompts_file else
                   make_prompts(batch, FLAGS.input_len, llm.config.vocab_size, FLAGS.seed, FLAGS.repetitive))
        ours = run_pagejax(llm, prompts, FLAGS.output_len)
        ours["prompt_tokens"] = {"mean": float(np.mean([len(p) for p in prompts])),
                                 "min": min(map(len, prompts)), "max": max(map(len, prompts))}
        result["pagejax"][f"batch_{batch}"] = ours
        line = (f"pagejax batch {batch}: TTFT {ours['ttft_mean_s'] * 1e3:.0f} ms, decode {ours['decode_tok_s']:.1f} "
                f"tok/s, end to end {ours['output_tok_s']:.1f} tok/s, warm-up {ours['warmup_s']:.1f} s")
        print(line, file=sys.stderr)
        if FLAGS.compare in ("hf", "llamacpp"):
            from inference.loading.model_loader import packaged_file
            from configs.presets import PRESET_WEIGHTS

            path = packaged_file(*PRESET_WEIGHTS[FLAGS.model]) if FLAGS.model in PRESET_WEIGHTS else FLAGS.model
            other = run_baseline_in_child(FLAGS.compare, path, prompts)
            result[FLAGS.compare][f"batch_{batch}"] = other
            ratio = result["ratio"][f"batch_{batch}"] = {k: ours[k] / other[k] for k in ("output_tok_s",
                                                                                          "decode_tok_s")}
            ratio["ttft_s"] = ours["ttft_mean_s"] / other["ttft_mean_s"]
            if "first_tokens" in other:  # greedy agreement on the first tokens: both sides ran the same prompts
                pairs = [(a, b) for x, y in zip(ours["first_tokens"], other["first_tokens"]) for a, b in zip(x, y)]
                ratio["first_token_agreement"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
            print(f"{FLAGS.compare:7} batch {batch}: TTFT {other['ttft_mean_s'] * 1e3:.0f} ms, decode "
                  f"{other['decode_tok_s']:.1f} tok/s, end to end {other['output_tok_s']:.1f} tok/s", file=sys.stderr)
        if plain is not None:
            base = result["plain"][f"batch_{batch}"] = run_pagejax(plain, prompts, FLAGS.output_len)
            result["ratio"][f"batch_{batch}"] = {k: ours[k] / base[k] for k in ("output_tok_s", "decode_tok_s")}
            print(f"plain   batch {batch}: decode {base['decode_tok_s']:.1f} tok/s, end to end "
                  f"{base['output_tok_s']:.1f} tok/s; speculation accepted "
                  f"{ours['engine']['spec_acceptance_rate']:.2f} of drafts, "
                  f"{ours['engine']['spec_tokens_per_pass']:.2f} tokens per pass", file=sys.stderr)
    from kernels_pallas.native import gate

    result["cpu_kernels"] = gate.choices()  # the ISA and, per C++ kernel asked, whether it ran and why
    result["load_average"] = os.getloadavg()  # other work on the machine slows both sides of a comparison
    print(f"C++ CPU kernels ({result['cpu_kernels']['isa']}): " + "; ".join(
        f"{target} " + ("off" if not c["runs"] else "on" if c["rows"] == str(gate.ANY_ROWS) else f"on for {c['rows']}")
        for target, c in result["cpu_kernels"]["kernels"].items()),
        file=sys.stderr)
    if FLAGS.plot:
        from scripts.bench import plot_benchmarks

        plot_benchmarks.plot_results(result, FLAGS.plot)
    if FLAGS.json:
        print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
