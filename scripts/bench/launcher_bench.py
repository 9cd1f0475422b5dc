"""The launcher's old lockstep batches against its streaming window, on one model in one process.

    PYTHONPATH=. python scripts/bench/launcher_bench.py                 # 200 rows, mixed lengths, the tiny test model
    PYTHONPATH=. python scripts/bench/launcher_bench.py --model=smollm2-135m --rows=200

Both modes run the same rows (prompts and per-row max_tokens drawn from a fixed mix, --ignore_eos so the lengths
are what the mix says) through the same compiled engine, alternating, after a warm-up of each. Lockstep is what
scripts/generate.py did before streaming: `LLM.generate` on --window rows at a time, written and fsynced per batch.
Streaming is `generate.stream_rows` with the same window and `RowWriter`. Each written row's time is recorded, so
"rows saved by a kill at T seconds" is the count of rows on disk by T, for the same T in both modes.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from inference import SamplingParams
from inference.tools import jsonl_io
from scripts import generate


def make_rows(count: int, lengths: list[int]) -> list[dict]:
    rng = random.Random(0)
    return [{"id": i, "prompt": f"row {i}:", "max_tokens": rng.choice(lengths)} for i in range(count)]


def lockstep(llm, rows, base: SamplingParams, window: int, path: str) -> list[float]:
    """Times (from start) at which each row reached the file, the old way: a batch is written when it all ends."""
    times, start = [], time.perf_counter()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(0, len(rows), window):
            batch = rows[i:i + window]
            outs = llm.generate([r["prompt"] for r in batch], [jsonl_io.row_params(r, base) for r in batch])
            jsonl_io.write_rows(f, [jsonl_io.result_row(r, o, False) for r, o in zip(batch, outs)])
            times += [time.perf_counter() - start] * len(batch)
    return times


def streaming(llm, rows, base: SamplingParams, window: int, path: str) -> list[float]:
    times, start = [], time.perf_counter()
    rendered = ((r, r["prompt"], jsonl_io.row_params(r, base), None) for r in rows)
    with open(path, "w", encoding="utf-8") as f:
        writer = jsonl_io.RowWriter(f)
        for result in generate.stream_rows(llm, rendered, window, False):
            writer.write(result)
            times.append(time.perf_counter() - start)
        writer.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tiny random model folder of the tests")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--window", type=int, default=64, help="lockstep batch size = streaming max_in_flight")
    parser.add_argument("--lengths", default="4,8,16,32,100", help="per-row max_tokens drawn from these")
    parser.add_argument("--max_num_seqs", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="lockstep/streaming pairs, alternating")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="launcher-bench-")
    model = args.model
    if model is None:
        from tests.tiny_folder import make_tiny_hf_folder
        model = str(make_tiny_hf_folder(Path(tmp) / "model"))
    from inference.engine.llm_engine import freeze_heap
    from inference.entrypoints.llm import LLM

    llm = LLM(model, kv_cache_memory_bytes=16 << 20, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=256,
              compilation_cache_dir=None)
    rows = make_rows(args.rows, [int(x) for x in args.lengths.split(",")])
    base = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    tokens = sum(r["max_tokens"] for r in rows)
    llm.warmup(prefill=False, extras=False)
    freeze_heap()  # as scripts/generate.py does once its model is loaded
    for run in (lockstep, streaming):  # compiles whatever warmup did not, outside the timed runs
        run(llm, rows[:args.window], base, args.window, os.path.join(tmp, "warm.jsonl"))
    results: dict[str, list[list[float]]] = {"lockstep": [], "streaming": []}
    for _ in range(args.rounds):
        for name, run in (("lockstep", lockstep), ("streaming", streaming)):
            results[name].append(run(llm, rows, base, args.window, os.path.join(tmp, f"{name}.jsonl")))
    wall = {name: min(t[-1] for t in runs) for name, runs in results.items()}
    print(f"{args.rows} rows, {tokens} output tokens, max_tokens from {args.lengths}, window {args.window}, "
          f"max_num_seqs {args.max_num_seqs}, model {args.model or 'tiny test folder'}; best of {args.rounds}")
    for name, runs in results.items():
        walls = ", ".join(f"{t[-1]:.2f}" for t in runs)
        print(f"  {name:9s} wall {wall[name]:.2f}s ({walls}); {tokens / wall[name]:.0f} tok/s; "
              f"first row on disk at {min(t[0] for t in runs):.2f}s")
    print(f"  streaming / lockstep throughput: {wall['lockstep'] / wall['streaming']:.2f}x")
    for frac in (0.1, 0.25, 0.5, 0.75):
        at = frac * wall["lockstep"]
        saved = {name: sum(x <= at for x in runs[-1]) for name, runs in results.items()}
        print(f"  kill at {at:.2f}s ({frac:.0%} of lockstep wall): rows saved lockstep {saved['lockstep']}, "
              f"streaming {saved['streaming']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
