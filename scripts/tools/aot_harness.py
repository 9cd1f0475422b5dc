"""The deviceless compile harness of `aot_compile.py`: devices of chips that are not there, abstract inputs, and
one compile of a function with the compiler's verdict, `memory_analysis()` bytes, the optimized HLO's custom calls,
whole-cache copies and GEMM operand dtypes, and (GPU) ptxas's registers / spills.

What is compiled (the cases) is in `aot_kernels.py` and `aot_steps.py`; `tpu_schedule.py` compiles through here too.
"""

from __future__ import annotations

import functools
import os
import re
import time
from typing import Any, Callable

import jax
import numpy as np

from kernels_pallas.backend import compiling_for

GPU_TARGETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "gpu_targets")
# chip -> (backend, topology of 1 chip, topology of 8 chips)
CHIPS = {"v5e": ("tpu", "v5e:1x1", "v5e:2x4"), "v6e": ("tpu", "v6e:1x1", "v6e:2x4"),
         "h100": ("gpu", "1x1x1", "1x1x8"), "h200": ("gpu", "1x1x1", "1x1x8")}
CPU_ONLY_CALLS = ("pagejax_",)  # the C++ CPU kernels' FFI targets (kernels_pallas/native/csrc)


@functools.cache
def devices(chip: str, num_chips: int = 1) -> tuple:
    """Devices of `num_chips` (1 or 8) `chip`s (v5e, v6e, h100, h200) for a deviceless compile."""
    from jax.experimental import topologies

    backend, one, eight = CHIPS[chip]
    name = one if num_chips == 1 else eight
    if backend == "tpu":
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name="default",
                                            chips_per_host_bounds=(1, 1, 1) if num_chips == 1 else (2, 2, 1),
                                            num_slices=1, wrap=(False,) * 3)
    else:
        with open(os.path.join(GPU_TARGETS, f"{chip}.txtpb")) as f:
            topo = topologies.get_topology_desc(platform="cuda", target_config=f.read(), topology=name)
    return tuple(topo.devices)


def compiler_available(chip: str) -> str | None:
    """None when `chip`'s compiler can be reached here, else why not."""
    try:
        devices(chip)
    except Exception as e:  # noqa: BLE001 - any failure means the plugin is absent or broken
        pkg = "libtpu" if CHIPS[chip][0] == "tpu" else "jax-cuda13-plugin and jax-cuda13-pjrt"
        return f"no {chip} compiler ({pkg} of jax {jax.__version__}): {str(e).splitlines()[0][:200]}"
    return None


def chip_mesh(chip: str, num_chips: int):
    """The ("data", "model") mesh of `num_chips` deviceless `chip`s, all on the model axis."""
    from jax.sharding import Mesh

    return Mesh(np.array(devices(chip, num_chips)).reshape(1, num_chips), ("data", "model"))


def abstract(tree, sharding):
    """Every array leaf of `tree` as a ShapeDtypeStruct with `sharding` (a sharding or a matching tree of them)."""
    if not isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), tree)


def hlo_report(compiled, cache_shapes: tuple[tuple[int, ...], ...] = ()) -> dict:
    """Custom calls, CPU-only calls and copies of a KV cache (an array of a cache's size, in any shape: a relayout
    into a reshaped view copies it as much as one of its own shape) in the optimized HLO."""
    text = compiled.as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    wanted = {int(np.prod(s)) for s in cache_shapes}
    copies = [f"{m.group(1)}[{m.group(2)}]" for m in re.finditer(r"= (\w+)\[([\d,]*)\][^ ]* copy\(", text)
              if m.group(2) and int(np.prod([int(d) for d in m.group(2).split(",")])) in wanted]
    return {"custom_calls": targets, "cpu_only_calls": [t for t in targets if t.startswith(CPU_ONLY_CALLS)],
            "cache_copies": copies, "gemm_operands": dot_operand_dtypes(text)}


def dot_operand_dtypes(text: str) -> dict[str, int]:
    """How many GEMMs (dots, cuBLAS / Triton gemm calls) of the optimized HLO `text` take which operand dtypes, e.g.
    {"f8e4m3fn x f8e4m3fn": 224, "bf16 x bf16": 65}: FP8 weights must reach the GEMM as FP8, not converted first."""
    dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
    counts: dict[str, int] = {}
    for m in re.finditer(r"= \w+\[[^\n]*? (?:dot|custom-call)\(%([\w.\-]+), %([\w.\-]+)[,)]([^\n]*)", text):
        if " dot(" not in m.group(0) and not re.search(r'custom_call_target="[^"]*(gemm|matmul)', m.group(3)):
            continue
        key = f"{dtypes.get(m.group(1), '?')} x {dtypes.get(m.group(2), '?')}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def memory_report(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp",
                                                               "generated_code")}


def compile_case(chip: str, num_chips: int, fn: Callable, args: tuple, *,
                 cache_shapes: tuple[tuple[int, ...], ...] = (), donate_argnums: tuple[int, ...] = (),
                 hlo_path: str | None = None) -> dict:
    """Lower and compile `fn(*args)` for `chip` (args already abstract); the verdict and what the compiler said.
    `donate_argnums`: as the engine donates them (the KV cache), or XLA must copy what the step updates.
    `hlo_path`: where to write the optimized HLO text (the HLO guard, `tests/scripts/test_step_hlo.py`)."""
    from kernels_pallas.gpu_compile_report import capture_compiler_logs, parse_compile_log

    backend = CHIPS[chip][0]
    start = time.time()
    row: dict[str, Any] = {"chip": chip, "num_chips": num_chips}
    try:
        # The abstract mesh names the chip: kernels read their block sizes by it, Pallas-Triton lowers for it.
        with compiling_for(backend), jax.sharding.use_abstract_mesh(chip_mesh(chip, num_chips).abstract_mesh), \
                capture_compiler_logs() as log:
            lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*args)
        with capture_compiler_logs() as log2:
            compiled = lowered.compile()
        log = log + log2
    except Exception as e:  # noqa: BLE001 - the compiler's message is the result
        msg = str(e)
        k = max(msg.find("Mosaic failed"), 0)
        oom = "HbmOom" in msg or "Ran out of memory" in msg
        row.update(status="does_not_fit" if oom else "failed", error=" ".join(msg[k:k + 600].split()))
        return row | {"seconds": round(time.time() - start, 1)}
    row.update(status="compiled", memory=memory_report(compiled), **hlo_report(compiled, cache_shapes))
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    if backend == "gpu":
        row["ptxas"] = parse_compile_log("".join(log))
    if row["cpu_only_calls"]:
        row.update(status="failed", error=f"CPU-only FFI calls in a {backend} program: {row['cpu_only_calls']}")
    elif row["cache_copies"]:
        row.update(status="failed", error=f"whole-cache copies: {row['cache_copies']}")
    return row | {"seconds": round(time.time() - start, 1)}
