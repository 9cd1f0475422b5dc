"""Deviceless ahead-of-time compiles with the real TPU and GPU compilers, on a CPU host.

Interpret mode runs a kernel's semantics, not the compilers' rules (Mosaic tiling, VMEM, shared memory,
registers). This script builds devices of chips that are not there (`jax.experimental.topologies`), gives every
input as a `ShapeDtypeStruct` (so real-size models cost no memory) and compiles:
  (a) each attention kernel over a sweep of shapes and dtypes (`aot_kernels.py: kernel_cases`; the Mosaic GPU
      kernel's cases, `mosaic_gpu_cases`, with `--what=mosaic_gpu`), and
  (b) the engine's jitted prefill and decode steps of real-size presets at TP 1 and 8 (`aot_steps.py: step_cases`),
each through the one compile harness (`aot_harness.py: compile_case`); this file is the command line.
Per case it records the compiler's verdict (or its message), `memory_analysis()` bytes (beside the cost model's
weight + KV bytes for steps), the custom calls and whole-cache copies in the optimized HLO, and on GPU ptxas's
registers / spills and the Triton or Mosaic GPU kernel's shared memory. JSON out; `docs/accelerators.md` holds
the table.

Needs libtpu (TPU) and jax-cuda13-plugin + jax-cuda13-pjrt (GPU) of the installed jax's version; chips whose
compiler is missing are reported as such. GPU register counts need `TF_CPP_MIN_LOG_LEVEL=0` and
`TF_CPP_VMODULE=subprocess_compilation=2,xtile_compiler=2` in the environment at process start (Mosaic GPU's,
`gpu_compile_report.MOSAIC_GPU_ENV`); this script re-executes itself with them.

    JAX_PLATFORMS=cpu python scripts/tools/aot_compile.py --chips=v5e,h100 --what=kernels,steps --out=aot.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

from scripts.tools.aot_harness import CHIPS, compiler_available  # noqa: E402
from scripts.tools.aot_kernels import compile_kernel, compile_mla, kernel_cases, mosaic_gpu_cases  # noqa: E402
from scripts.tools.aot_steps import STEP_PRESETS, compile_step, step_cases  # noqa: E402


# ----------------------------------------------------------------------------------------------------- output

def markdown_table(rows: list[dict]) -> str:
    lines = ["| what | case | chip | chips | status | argument MiB | temp MiB | vs cost model | registers / spills "
             "/ shared mem | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("memory") or {}
        gpu = ""
        if r.get("ptxas"):
            kernels = {k: v for k, v in r["ptxas"]["kernels"].items() if "ragged" in k or "paged" in k} \
                or r["ptxas"]["kernels"]
            regs = max((v.get("registers", 0) for v in kernels.values()), default=0)
            spills = sum(v.get("spill_stores", 0) for v in kernels.values())
            smem = max(r["ptxas"]["shared_memory"] or [0])
            gpu = f"{regs} / {spills} B / {smem} B"
        mib = lambda b: f"{b / 2**20:.1f}" if b is not None else ""  # noqa: E731
        lines.append(f"| {r['what']} | {r['case']} | {r['chip']} | {r['num_chips']} | {r['status']} | "
                     f"{mib(m.get('argument'))} | {mib(m.get('temp'))} | {r.get('argument_vs_cost_model', '')} | "
                     f"{gpu} | {(r.get('error') or '')[:160]} |")
    return "\n".join(lines)


def main(argv) -> None:
    del argv
    flags = FLAGS
    rows: list[dict] = []
    for chip in flags.chips:
        reason = compiler_available(chip)
        if reason is not None:
            rows.append({"what": "setup", "case": "-", "chip": chip, "num_chips": 0, "status": "unavailable",
                         "error": reason})
            continue
        if "kernels" in flags.what:
            for case in kernel_cases(quick=flags.quick):
                rows.append(compile_kernel(chip, case))
                print(json.dumps(rows[-1])[:300], flush=True)
            for kind in ("decode", "prefill"):
                rows.append(compile_mla(chip, kind))
                print(json.dumps(rows[-1])[:300], flush=True)
        if "mosaic_gpu" in flags.what and CHIPS[chip][0] == "gpu":
            for case in mosaic_gpu_cases():
                rows.append(compile_kernel(chip, case))
                print(json.dumps(rows[-1])[:300], flush=True)
        if "steps" in flags.what:
            if flags.hlo_dir:
                os.makedirs(flags.hlo_dir, exist_ok=True)
            batches = tuple(int(b) for b in flags.decode_batches)
            kinds = ("decode",) if flags.decode_only else ("prefill", "decode")
            for case in step_cases(flags.presets, batches, flags.layers, kinds, flags.dtype):
                if str(case.num_chips) not in flags.tp:
                    continue
                rows.append(compile_step(chip, case, flags.hlo_dir, flags.quantization))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "ptxas"})[:400], flush=True)
    with open(flags.out, "w") as f:
        json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
    print(markdown_table(rows))


if __name__ == "__main__":
    from kernels_pallas.gpu_compile_report import LOG_VMODULE, MOSAIC_GPU_ENV

    want = dict(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=LOG_VMODULE, JAX_PLATFORMS="cpu", **MOSAIC_GPU_ENV)
    if any(os.environ.get(k) != v for k, v in want.items()):  # XLA reads its log settings once, at start-up
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **want})
    from absl import app, flags as absl_flags

    absl_flags.DEFINE_list("chips", ["v5e", "v6e", "h100", "h200"], "Chips to compile for.")
    absl_flags.DEFINE_list("what", ["kernels", "steps"], "kernels, steps and/or mosaic_gpu (its kernel cases).")
    absl_flags.DEFINE_list("presets", list(STEP_PRESETS), "Real-size presets for the steps.")
    absl_flags.DEFINE_list("tp", ["1", "8"], "Tensor-parallel sizes for the steps.")
    absl_flags.DEFINE_list("decode_batches", ["64"], "Sequences of each decode step compiled.")
    absl_flags.DEFINE_bool("decode_only", False, "Steps: the decode steps only.")
    absl_flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Steps: weights' and KV cache's dtype.")
    absl_flags.DEFINE_integer("layers", None, "Steps: this many layers of the preset (its widths kept).")
    absl_flags.DEFINE_string("hlo_dir", None, "Steps: write each optimized HLO as DIR/<chip>_<case>.hlo.")
    absl_flags.DEFINE_bool("quick", False, "The small kernel grid CI compiles.")
    absl_flags.DEFINE_enum("quantization", None, ["fp8", "int8"], "Steps with quantized weights (LLM(quantization=)).")
    absl_flags.DEFINE_string("out", "aot_compile.json", "JSON output path.")
    FLAGS = absl_flags.FLAGS
    app.run(main)
