"""KV cache bytes of one generation four windows long: the bounded sliding-window cache against keeping every page.

    python scripts/tools/sliding_window_cache.py
    python scripts/tools/sliding_window_cache.py --windows=4 --json=sliding.json

Two measurements, both of the pages one sequence holds (the pool itself is preallocated; what the bound buys is
room for more sequences in it):
- engine: the tiny Mistral (every layer windowed) and Gemma 2 (alternating) fixtures of tests/fixtures/families
  (window 8) generate one sequence `--windows` windows long through the paged engine (page size 4); after every
  step the pages each KV cache group holds for it are counted.
- bookkeeping at real shapes: the Mistral-7B, Gemma-2-9B and Gemma-3-12B presets (window 4096 / 4096 / 1024), a
  KVCacheManager alone (no model) running one sequence's page accounting: 512-token prefill chunks, then one token
  per step, to `--windows` windows of the largest window; page size 16, `--bytes_per_element` (2 = bf16).
Bytes held = sum over groups of pages held x page size x caching layers in the group x KV width x bytes per element;
"every page kept" counts pages_needed(tokens) in every caching layer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

_WINDOWS = flags.DEFINE_integer("windows", 4, "Generation length in windows (of the largest window).")
_BYTES = flags.DEFINE_integer("bytes_per_element", 2, "KV bytes per element for the real-shape bookkeeping.")
_JSON = flags.DEFINE_string("json", None, "Also write the rows as JSON to this path.")

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "families"


def _page_bytes(config, page_size: int, itemsize: int) -> list[int]:
    """Bytes of one page of each KV cache group, over every cache of the group."""
    caches = {config.kv_layer(i): config.kv_group(i) for i in range(config.num_layers)}
    per_group = [sum(1 for g in caches.values() if g == group) for group in range(len(config.kv_group_windows))]
    return [n * page_size * config.kv_width * itemsize for n in per_group]


def _row(name: str, config, mgr, peak: list[int], tokens: int, itemsize: int) -> dict:
    page_bytes = _page_bytes(config, mgr.page_size, itemsize)
    bounded = sum(p * b for p, b in zip(peak, page_bytes))
    full = mgr.pages_needed(tokens) * sum(page_bytes)
    return {"model": name, "windows": list(config.kv_group_windows), "tokens": tokens, "page_size": mgr.page_size,
            "peak_pages_per_group": peak, "bytes_bounded": bounded, "bytes_every_page": full,
            "ratio": round(full / bounded, 2)}


def engine_rows(windows: int) -> list[dict]:
    from inference import LLM, SamplingParams
    from models.loaders.hf_checkpoint import load_hf_folder

    rows = []
    for family in ("mistral", "gemma2"):
        config, _ = load_hf_folder(FIXTURES / family)
        total = windows * config.sliding_window
        llm = LLM(str(FIXTURES / family), kv_cache_memory_bytes=1 << 20, page_size=4, max_num_batched_tokens=32,
                  compilation_cache_dir=None)
        engine, mgr = llm.engine, llm.engine.block_manager
        engine.add_request("r", list(range(1, 9)), SamplingParams(temperature=0.0, max_tokens=total - 8,
                                                                  ignore_eos=True))
        peak = [0] * mgr.num_groups
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                peak = [max(a, b) for a, b in zip(peak, mgr.held_pages(seq))]
        rows.append({"measured": "engine", **_row(f"fixture {family}", config, mgr, peak, total, 4)})
    return rows


def bookkeeping_rows(windows: int, itemsize: int) -> list[dict]:
    from configs import get_model_config
    from inference.engine.pages.kv_cache_manager import KVCacheManager
    from inference.sampling.params import SamplingParams
    from inference.engine.sequence import Sequence as Seq

    rows = []
    for name in ("mistral-7b", "gemma-2-9b", "gemma-3-12b"):
        config = get_model_config(name)
        total = windows * max(w for w in config.kv_group_windows if w is not None)
        mgr = KVCacheManager(total // 16 + 2, 16, config.kv_group_windows)
        seq = Seq(seq_id=0, request_id="r", index=0, token_ids=list(range(512)), num_prompt_tokens=512,
                  params=SamplingParams(), seed=0, arrival_order=0)
        peak = [0] * mgr.num_groups
        mgr.match_prefix(seq)
        while seq.num_computed_tokens < total:
            chunk = 512 if seq.num_computed_tokens < 512 else 1
            if seq.num_computed_tokens + chunk > seq.num_tokens:
                seq.token_ids.append(seq.num_tokens)
            mgr.grow(seq, seq.num_computed_tokens + chunk)
            peak = [max(a, b) for a, b in zip(peak, mgr.held_pages(seq))]
            seq.num_computed_tokens += chunk
            mgr.commit_full_pages(seq)
        rows.append({"measured": "bookkeeping", **_row(name, config, mgr, peak, total, itemsize)})
    return rows


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    rows = bookkeeping_rows(_WINDOWS.value, _BYTES.value) + engine_rows(_WINDOWS.value)
    print("| measured | model | windows | tokens | page | peak pages per group | bytes held | every page kept | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['measured']} | {r['model']} | {r['windows']} | {r['tokens']} | {r['page_size']} | "
              f"{r['peak_pages_per_group']} | {r['bytes_bounded']:,} | {r['bytes_every_page']:,} | {r['ratio']}x |")
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(main)
