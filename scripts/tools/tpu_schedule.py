"""Schedule report of the TPU attention kernel: what one call does, before and after a kernel change, without a TPU.

For each workload (Llama-3-8B attention shapes: Hq 32, Hkv 8, D 128, bf16 cache, page 16; a decode of 64 x 2048, a
mixed batch of one 512-token chunk plus 63 decodes, a prefill of 4 x 512) and each kernel (`--before`, default the
kernel at git `main`, and the working tree's):
  * dynamic counts, from the kernel's own parameters replayed over the batch's metadata in Python: grid steps (and
    how many do work), KV DMAs started, DMA waits, q/out DMAs, bytes per KV DMA, KV bytes moved against the bytes
    the batch needs, and pipeline cold starts (a KV fetch that nothing overlaps);
  * static facts of the compiled Mosaic module (libtpu, deviceless, `--xla_mosaic_dump_to`): grid, DMA-issue and
    DMA-wait sites in the final LLO, and the VMEM scratch the module allocates (tile-padded).
JSON out; BENCHMARKS.md holds the table. The replay mirrors each kernel's loop bounds (`_old_kernel_counts`: the
grid `(Hkv, S, cdiv(max_q_len, 8))` kernel; `_item_kernel_counts`: the work-item kernel, with one DMA per page of
one KV head (`210761d`) or of all a grid step's heads); a kernel change that alters them must update its replay.

    python scripts/tools/tpu_schedule.py --chip=v6e --out=tpu_schedule.json
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# name -> (q_lens, kv_lens, max_q_len)
WORKLOADS = {
    "decode_64x2048": ([1] * 64, [2048] * 64, 1),
    "mixed_512chunk_63decodes": ([512] + [1] * 63, [2048] * 64, 512),
    "prefill_4x512": ([512] * 4, [512] * 4, 512),
}
DUMP_DIR = tempfile.mkdtemp(prefix="mosaic_dump_")
LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kv_blocks(kv_len: int, q_len: int, first: int, n_valid: int, block_kv: int) -> tuple[int, int]:
    first_pos = kv_len - q_len + first
    return 0, _cdiv(first_pos + n_valid, block_kv)


def _old_kernel_counts(q_lens, kv_lens, max_q_len, *, group, num_kv_heads, page_size, pages_per_block) -> dict:
    """main's kernel: grid (Hkv, S, cdiv(max_q_len, 8)); per active step group q reads, group out reads, group out
    writes; per KV block one DMA and one wait per valid page; the first block of every step fetched cold."""
    block_q, block_kv = 8, pages_per_block * page_size
    grid = num_kv_heads * len(q_lens) * max(1, _cdiv(max_q_len, block_q))
    active = kv = waits = io = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        seq_pages = _cdiv(kv_len, page_size)
        for qb in range(_cdiv(q_len, block_q)):
            n_valid = min(block_q, q_len - qb * block_q)
            b0, b1 = _kv_blocks(kv_len, q_len, qb * block_q, n_valid, block_kv)
            active += 1
            io += 3 * group
            pages = sum(min(pages_per_block, max(0, seq_pages - b * pages_per_block)) for b in range(b0, b1))
            kv += pages
            waits += pages
    h = num_kv_heads
    return dict(grid_steps=grid, working_steps=active * h, kv_dmas=kv * h, kv_waits=waits * h, q_out_dmas=io * h,
                cold_starts=active * h, block_q=block_q, pages_per_block=pages_per_block)


def _item_kernel_counts(q_lens, kv_lens, max_q_len, *, group, num_kv_heads, page_size, block_q, pages_per_block,
                        decode, heads) -> dict:
    """The work-item kernel: grid (Hkv / heads,); per item one q and one out DMA (decode) or heads * group of each;
    per KV block pages_per_block DMAs (each one page of the step's `heads` KV heads) and one wait; one cold start
    per grid step. `heads` 1 is the kernel of `210761d` (one DMA per (head, page))."""
    block_kv = pages_per_block * page_size
    items = kv = waits = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        for qb in range(_cdiv(q_len, block_q)):
            n_valid = min(block_q, q_len - qb * block_q)
            b0, b1 = _kv_blocks(kv_len, q_len, qb * block_q, n_valid, block_kv)
            items += 1
            kv += (b1 - b0) * pages_per_block
            waits += b1 - b0
    steps = num_kv_heads // heads
    io = items * 2 * (1 if decode else group * heads)
    return dict(grid_steps=steps, working_steps=steps, items=items * steps, kv_dmas=kv * steps,
                kv_waits=waits * steps, q_out_dmas=io * steps, cold_starts=steps, block_q=block_q,
                pages_per_block=pages_per_block, kv_heads_per_dma=heads)


def kernel_counts(module, chip: str, q_lens, kv_lens, max_q_len) -> dict:
    """Replay `module`'s kernel (a `tpu.py`, this tree's or a revision's) over the workload: the grid kernel (its
    `BLOCK_SIZES`, before `210761d`) or the work-item kernel (its `schedule_params`; KV heads per DMA: 1 unless
    the plan says)."""
    c = LLAMA3_8B
    group = c["num_q_heads"] // c["num_kv_heads"]
    page_bytes = c["page_size"] * 2 * c["head_dim"] * 2
    pps = max(kv_lens) // c["page_size"]
    shape = dict(group=group, num_kv_heads=c["num_kv_heads"], page_size=c["page_size"])
    if hasattr(module, "BLOCK_SIZES"):
        ppb = max(1, min(pps, module.BLOCK_SIZES[chip]["kv_tokens"] // c["page_size"]))
        counts = _old_kernel_counts(q_lens, kv_lens, max_q_len, pages_per_block=ppb, **shape)
        counts["kv_heads_per_dma"] = 1
        counts["vmem_scratch_bytes_model"] = 2 * group * 8 * c["head_dim"] * 4 + 2 * ppb * page_bytes
    else:
        plan = module.schedule_params((sum(q_lens), c["num_q_heads"], c["head_dim"]),
                                      (c["num_kv_heads"], 1, c["page_size"], 2 * c["head_dim"]), "bfloat16",
                                      (len(q_lens), pps), max_q_len=max_q_len, chip=chip)
        counts = _item_kernel_counts(q_lens, kv_lens, max_q_len, block_q=plan["block_q"],
                                     pages_per_block=plan["pages_per_block"], decode=plan["decode"],
                                     heads=plan.get("kv_heads_per_block", 1), **shape)
        counts["vmem_scratch_bytes_model"] = plan["vmem_scratch_bytes"]
        counts["vmem_limit_bytes"] = plan["vmem_limit_bytes"]
    counts["bytes_per_kv_dma"] = counts["kv_heads_per_dma"] * page_bytes
    counts["kv_bytes_moved"] = counts["kv_dmas"] * counts["bytes_per_kv_dma"]
    counts["kv_bytes_needed"] = sum(_cdiv(k, c["page_size"]) for k in kv_lens) * c["num_kv_heads"] * page_bytes
    return counts


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_DTYPE_BYTES = {"bf16": 2, "f32": 4, "i8": 1, "i32": 4, "f16": 2}


def _memref_bytes(dims: list[int], dtype: str, tile: tuple[int, ...]) -> int:
    dims = list(dims)
    for k, t in enumerate(tile[::-1]):  # pad the tiled (minor) axes to whole tiles
        dims[-1 - k] = _cdiv(dims[-1 - k], t) * t
    total = _DTYPE_BYTES[dtype]
    for d in dims:
        total *= d
    return total


def mosaic_facts(dump_dir: str, since: float) -> dict:
    """Grid, DMA-issue / DMA-wait sites and VMEM scratch bytes of the final LLO of the kernel dumped after
    `since` (libtpu reads its dump flag once, at start-up: one directory for the whole run)."""
    finals = sorted((f for f in glob.glob(os.path.join(dump_dir, "*post-finalize-llo.txt"))
                     if os.path.getmtime(f) >= since), key=os.path.getmtime)
    if not finals:
        return {"error": "no Mosaic dump (libtpu missing or the flag unsupported)"}
    text = open(finals[-1]).read()
    header = next((line for line in text.splitlines() if "func.func" in line), "")
    scratch = 0
    for m in re.finditer(r"llo\.type = memref<([\dx]+)x(bf16|f32|i8|i32|f16), #tpu\.tiled<\(([\d,]+)\)[^>]*>, "
                         r"#tpu\.memory_space<vmem>>\}", header):
        if "passthrough_operand" in header[max(0, m.start() - 40):m.start()]:
            continue  # an operand XLA placed in VMEM, not the kernel's scratch
        scratch += _memref_bytes([int(d) for d in m.group(1).split("x")], m.group(2),
                                 tuple(int(t) for t in m.group(3).split(",")))
    grid = re.search(r"iteration_bounds = array<i64: ([\d, ]+)>", header)
    return dict(grid=[int(g) for g in grid.group(1).split(",")] if grid else None,
                dma_issue_sites=text.count("llo.enqueue_dma"), dma_wait_sites=text.count("llo.dma_done"),
                vmem_scratch_bytes=scratch)


def compile_facts(module, chip: str, workload: str) -> dict:
    """Compile `module.ragged_paged_attention_tpu` for `chip` on the workload's shapes, with Mosaic's dump on."""
    import jax
    import jax.numpy as jnp

    from scripts.tools import aot_harness

    q_lens, kv_lens, max_q_len = WORKLOADS[workload]
    c = LLAMA3_8B
    pps = max(kv_lens) // c["page_size"]
    num_seqs = len(q_lens)
    shapes = [((sum(q_lens), c["num_q_heads"], c["head_dim"]), jnp.bfloat16),
              ((c["num_kv_heads"], num_seqs * pps + 1, c["page_size"], 2 * c["head_dim"]), jnp.bfloat16),
              ((num_seqs,), jnp.int32), ((num_seqs, pps), jnp.int32), ((num_seqs + 1,), jnp.int32),
              ((1,), jnp.int32)]
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(aot_harness.chip_mesh(chip, 1), PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]

    def fn(*a):
        return module.ragged_paged_attention_tpu(*a, sm_scale=c["head_dim"] ** -0.5, max_q_len=max_q_len,
                                                 chip=chip)

    row = aot_harness.compile_case(chip, 1, fn, tuple(args), cache_shapes=(shapes[1][0],))
    return {"status": row["status"], **({"error": row["error"]} if row.get("error") else {})}


def report(chip: str, before_path: str) -> list[dict]:
    from kernels_pallas.attention import tpu as after

    before = _load(before_path, "tpu_before")
    rows = []
    for name, (q_lens, kv_lens, max_q_len) in WORKLOADS.items():
        for kernel, module in (("before", before), ("after", after)):
            counts = kernel_counts(module, chip, q_lens, kv_lens, max_q_len)
            since = time.time()
            counts["compile"] = compile_facts(module, chip, name)
            counts["mosaic"] = mosaic_facts(DUMP_DIR, since)
            rows.append({"workload": name, "chip": chip, "kernel": kernel, **counts})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = ("grid_steps", "working_steps", "kv_dmas", "kv_waits", "q_out_dmas", "cold_starts", "bytes_per_kv_dma",
            "vmem_scratch_bytes_model")
    lines = ["| workload | kernel | " + " | ".join(cols) + " | KV moved / needed | Mosaic: grid, DMA issue / wait "
             "sites, VMEM scratch KiB |", "|" + "---|" * (len(cols) + 4)]
    for r in rows:
        m = r["mosaic"]
        mos = (f"{m.get('grid')}, {m.get('dma_issue_sites')} / {m.get('dma_wait_sites')}, "
               f"{m.get('vmem_scratch_bytes', 0) / 1024:.0f}") if "error" not in m else m["error"]
        lines.append(f"| {r['workload']} | {r['kernel']} | " + " | ".join(str(r[c]) for c in cols)
                     + f" | {r['kv_bytes_moved'] / r['kv_bytes_needed']:.3f} | {mos} |")
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chip", default="v6e", choices=("v5e", "v6e"))
    parser.add_argument("--before", default="main", help="git revision (or a file path) of the 'before' kernel")
    parser.add_argument("--page_size", type=int, default=LLAMA3_8B["page_size"],
                        help="cache page size (the engine's default: 16; upstream recommends larger on TPU)")
    parser.add_argument("--out", default="tpu_schedule.json")
    args = parser.parse_args()
    LLAMA3_8B["page_size"] = args.page_size
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")
    os.environ["LIBTPU_INIT_ARGS"] = f"{flags} --xla_mosaic_dump_to={DUMP_DIR}".strip()
    before = args.before
    if not os.path.exists(before):
        text = subprocess.run(["git", "-C", ROOT, "show", f"{before}:kernels_pallas/attention/tpu.py"],
                              check=True, capture_output=True, text=True).stdout
        before = os.path.join(tempfile.mkdtemp(), "tpu_before.py")
        with open(before, "w") as f:
            f.write(text)
    rows = report(args.chip, before)
    import jax

    with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "before": args.before, "model": LLAMA3_8B, "rows": rows}, f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
