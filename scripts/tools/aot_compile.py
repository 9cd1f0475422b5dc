"""Deviceless ahead-of-time compiles with the real TPU and GPU compilers, on a CPU host.

Interpret mode runs a kernel's semantics, not the compilers' rules (Mosaic tiling, VMEM, shared memory,
registers). This script builds devices of chips that are not there (`jax.experimental.topologies`), gives every
input as a `ShapeDtypeStruct` (so real-size models cost no memory) and compiles:
  (a) each attention kernel over a sweep of shapes and dtypes (`kernel_cases`; the Mosaic GPU kernel's cases,
      `mosaic_gpu_cases`, with `--what=mosaic_gpu`), and
  (b) the engine's jitted prefill and decode steps of real-size presets at TP 1 and 8 (`step_cases`).
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

import dataclasses
import functools
import itertools
import json
import os
import re
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.backend import compiling_for  # noqa: E402
from kernels_pallas.kv_cache.layout import kv_cache_spec  # noqa: E402

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


def _mesh(chip: str, num_chips: int):
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
        with compiling_for(backend), jax.sharding.use_abstract_mesh(_mesh(chip, num_chips).abstract_mesh), \
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


# ------------------------------------------------------------------------------------------------ (a) kernels

@dataclasses.dataclass(frozen=True)
class KernelCase:
    kind: str  # "decode" (64 x 1 query), "prefill" (4 x 512) or "mixed" (32 decodes + 2 x 256 prefill chunks)
    dtype: str  # cache dtype: float32, bfloat16, int8, float8_e4m3fn (queries bf16 for int8 and fp8)
    head_dim: int
    num_kv_heads: int
    group: int = 4  # query heads per KV head
    page_size: int = 16
    context: int = 2048  # tokens per sequence
    window: bool = False  # a 1024-token sliding window and a soft cap of 50 (Gemma 2/3)
    impl: str = "gpu"  # on GPU chips: "gpu" (Pallas Triton) or "mosaic_gpu" (Pallas Mosaic GPU, Hopper)
    num_kv_splits: int | None = None  # None: the kernel's default

    @property
    def name(self) -> str:
        return (f"{self.kind}_{self.dtype}_d{self.head_dim}_kv{self.num_kv_heads}_g{self.group}"
                f"_p{self.page_size}" + ("_window_softcap" if self.window else "")
                + (f"_split{self.num_kv_splits}" if self.num_kv_splits else "")
                + ("_mosaic_gpu" if self.impl == "mosaic_gpu" else ""))

    @property
    def batch(self) -> tuple[int, int]:
        """(sequences, tokens): the static shape of the step."""
        return {"decode": (64, 64), "prefill": (4, 2048), "mixed": (34, 544)}[self.kind]

    def inputs(self, sharding) -> tuple:
        """Abstract (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs[, kv_scales]) and max_q_len."""
        num_seqs, num_tokens = self.batch
        q_len = {"decode": 1, "prefill": 512, "mixed": 256}[self.kind]
        pages_per_seq = -(-self.context // self.page_size)
        spec = kv_cache_spec(num_seqs * pages_per_seq + 1, self.page_size, self.num_kv_heads, self.head_dim,
                             self.dtype)
        cache, scales = spec if isinstance(spec, tuple) else (spec, None)
        q_dtype = jnp.float32 if self.dtype == "float32" else jnp.bfloat16
        s32 = jnp.int32
        shapes = [((num_tokens, self.num_kv_heads * self.group, self.head_dim), q_dtype),
                  (cache.shape, cache.dtype), ((num_seqs,), s32), ((num_seqs, pages_per_seq), s32),
                  ((num_seqs + 1,), s32), ((1,), s32)] + ([(scales.shape, scales.dtype)] if scales else [])
        return tuple(jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes), q_len


def kernel_cases(quick: bool = False) -> list[KernelCase]:
    """quick: the CI grid (dtypes x head_dim {64, 128} x KV heads {3, 8} x decode/prefill, and mixed at D 128 /
    Hkv 8). Full: head_dim up to
    256, KV heads 1-16, and for bf16 / int8 page sizes 32 and 64, GQA ratios 1, 2 and 8, mixed batches and a
    sliding window with a soft cap."""
    head_dims, kv_heads = ((64, 128), (3, 8)) if quick else ((64, 128, 256), (1, 3, 5, 8, 16))
    cases = [KernelCase(kind, dtype, d, h) for kind, dtype, d, h in
             itertools.product(("decode", "prefill"), ("bfloat16", "float32", "int8"), head_dims, kv_heads)]
    # the mixed batch at D 128 / Hkv 8: with decode and prefill above, every entry of the Triton kernel's tuning
    # table (kernels_pallas/attention/gpu_tuning.py) for each GPU chip
    cases += [KernelCase("mixed", dtype, 128, 8) for dtype in ("bfloat16", "float32", "int8")]
    if not quick:
        for kind, dtype in itertools.product(("decode", "prefill", "mixed"), ("bfloat16", "int8")):
            cases += [KernelCase(kind, dtype, 128, 8, page_size=p) for p in (32, 64)]
            cases += [KernelCase(kind, dtype, 128, 8, group=g) for g in (1, 2, 8)]
            cases += [KernelCase(kind, dtype, 128, 8, window=True)]
    return cases


def mosaic_gpu_cases() -> list[KernelCase]:
    """The Mosaic GPU kernel (bf16 / f16 queries, a cache of that dtype, int8 or fp8; no f32): decode with and
    without split-KV, a mixed batch, head_dim 64 over 64-token pages with window and soft cap, an int8 cache at D 128
    and at D 64 over 32-token pages with split-KV, an fp8 (e4m3) cache at D 128. The Triton kernel's twin of each is in `kernel_cases`, or is one
    `KernelCase` away. The CUDA plugin compiles a Mosaic GPU kernel once per process, so ptxas reports it for the
    first chip of a run only: one GPU chip per run for its figures."""
    m = functools.partial(KernelCase, impl="mosaic_gpu")
    return [m("decode", "bfloat16", 128, 8), m("decode", "bfloat16", 128, 8, num_kv_splits=4),
            m("mixed", "bfloat16", 128, 8), m("decode", "bfloat16", 64, 4, group=8, page_size=64, window=True),
            m("decode", "int8", 128, 8), m("decode", "int8", 64, 4, group=8, page_size=32, num_kv_splits=4),
            m("decode", "float8_e4m3fn", 128, 8)]


def compile_kernel(chip: str, case: KernelCase, **kernel_kw) -> dict:
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels_pallas.attention.dispatch import ragged_paged_attention

    backend = CHIPS[chip][0]
    args, q_len = case.inputs(NamedSharding(_mesh(chip, 1), P()))
    if case.num_kv_splits:
        kernel_kw = {"num_kv_splits": case.num_kv_splits, **kernel_kw}
    if backend == "tpu":
        from kernels_pallas.attention.tpu import ragged_paged_attention_tpu

        kernel = functools.partial(ragged_paged_attention_tpu, **kernel_kw)
    elif case.impl == "mosaic_gpu":
        from kernels_pallas.attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

        kernel = functools.partial(ragged_paged_attention_mosaic_gpu, **kernel_kw)
    elif kernel_kw:
        from kernels_pallas.attention.gpu import ragged_paged_attention_gpu

        kernel = functools.partial(ragged_paged_attention_gpu, **kernel_kw)
    else:
        kernel = functools.partial(ragged_paged_attention, impl="gpu")

    extra = dict(sliding_window=1024, soft_cap=50.0) if case.window else {}

    def fn(q, kv, lens, pages, cu, ns, *scales):
        return kernel(q, kv, lens, pages, cu, ns, sm_scale=case.head_dim ** -0.5, max_q_len=q_len,
                      kv_scales=scales[0] if scales else None, **extra)

    row = compile_case(chip, 1, fn, args, cache_shapes=(args[1].shape,))
    return {"case": case.name, "what": "kernel"} | row


def compile_mla(chip: str, kind: str) -> dict:
    """MLA over DeepSeek-V2-Lite's latent cache (16 heads, latent 512 + RoPE key 64, bf16) in the shape the
    backend keeps it (`kv_cache/latent_layout.py`): the Pallas Triton kernel on GPU; on TPU the pure-JAX reference
    (there is no TPU MLA kernel yet)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels_pallas.mla.dispatch import ragged_paged_mla_attention
    from kernels_pallas.kv_cache.latent_layout import latent_cache_shape

    num_seqs, q_len = (64, 1) if kind == "decode" else (4, 512)
    page_size, context, heads = 16, 2048, 16
    pages_per_seq = context // page_size
    sharding = NamedSharding(_mesh(chip, 1), P())
    bf16, s32 = jnp.bfloat16, jnp.int32
    with compiling_for(CHIPS[chip][0]):
        latent = latent_cache_shape(num_seqs * pages_per_seq + 1, page_size, 576)
    shapes = [((num_seqs * q_len, heads, 512), bf16), ((num_seqs * q_len, heads, 64), bf16), (latent, bf16),
              ((num_seqs,), s32), ((num_seqs, pages_per_seq), s32), ((num_seqs + 1,), s32), ((1,), s32)]
    args = tuple(jax.ShapeDtypeStruct(sh, d, sharding=sharding) for sh, d in shapes)
    fn = functools.partial(ragged_paged_mla_attention, sm_scale=0.07, max_q_len=q_len)
    return {"case": f"mla_{kind}_bfloat16_deepseek-v2-lite", "what": "kernel"} | compile_case(
        chip, 1, fn, args, cache_shapes=(latent,))


# -------------------------------------------------------------------------------------------------- (b) steps

STEP_PRESETS = ("llama-3-8b", "qwen3-8b", "gemma-3-12b", "deepseek-v2-lite")


@dataclasses.dataclass(frozen=True)
class StepCase:
    preset: str
    kind: str  # "prefill" (4 x 512 tokens) or "decode" (64 sequences)
    num_chips: int  # tensor-parallel size
    context: int = 4096  # tokens of cache per sequence
    page_size: int = 16
    decode_batch: int = 64  # sequences of a decode step
    layers: int | None = None  # the preset's layer count when None; fewer keep its widths (a cheaper compile)
    dtype: str = "bfloat16"  # of the weights and the KV cache

    @property
    def name(self) -> str:
        batch = f"_b{self.decode_batch}" if self.kind == "decode" and self.decode_batch != 64 else ""
        layers = f"_l{self.layers}" if self.layers else ""
        dtype = "" if self.dtype == "bfloat16" else f"_{self.dtype}"
        return f"{self.preset}{layers}_{self.kind}{batch}{dtype}_tp{self.num_chips}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, sequences, longest query) of the step's bucket."""
        return (2048, 4, 512) if self.kind == "prefill" else (self.decode_batch, self.decode_batch, 1)


def step_cases(presets=STEP_PRESETS, decode_batches=(64,), layers: int | None = None,
               kinds=("prefill", "decode"), dtype: str = "bfloat16") -> list[StepCase]:
    """Prefill and decode (one case per decode batch) at TP 1 and 8."""
    return [StepCase(p, kind, tp, decode_batch=b, layers=layers, dtype=dtype)
            for p, kind, tp in itertools.product(presets, kinds, (1, 8))
            for b in (decode_batches if kind == "decode" else (64,))]


def cost_model_bytes(config, case: StepCase, num_pages: int, weight_bytes: float | None = None) -> dict:
    """What the cost model says the step holds: the weights (in the case's dtype, or `weight_bytes` a weight: 1 for
    fp8 / int8) and the KV cache in the case's dtype (per device under TP)."""
    from inference.tools import cost_model

    weights = cost_model.weight_bytes(config, weight_bytes or jnp.dtype(case.dtype).itemsize)
    kv = config.kv_cache_bytes(num_pages, case.page_size, case.dtype)
    per = case.num_chips
    kv_per_device = kv if config.is_mla else kv / per  # MLA's latent cache is replicated
    return {"weights": int(weights / per), "kv": int(kv_per_device), "total": int(weights / per + kv_per_device)}


def kv_pages_that_fit(config, chip: str, case: StepCase, wanted: int, weight_bytes: float | None = None) -> int:
    """Pages of cache the engine would give this step: `wanted`, or what 90% of the chips' HBM holds beside the
    weights (at least one page per sequence, so a model that cannot fit still meets the compiler's verdict)."""
    from configs.chips import CHIP_PRESETS
    from inference.tools import cost_model

    free = 0.9 * CHIP_PRESETS[chip].hbm_bytes * case.num_chips - cost_model.weight_bytes(
        config, weight_bytes or jnp.dtype(case.dtype).itemsize)
    per_page = config.kv_cache_bytes(1, case.page_size, case.dtype)
    return int(max(case.shape[1], min(wanted, free // per_page)))


def compile_step(chip: str, case: StepCase, hlo_dir: str | None = None, quantization: str | None = None) -> dict:
    """Lower and compile the engine's jitted step (inference/runtime/runner.py) for `case` from abstract inputs;
    with `hlo_dir`, its optimized HLO goes to `hlo_dir/<chip>_<case>.hlo`; `quantization` ("fp8", "int8"): the
    weights as `LLM(quantization=...)` holds them, with the GEMMs' operand dtypes reported (`dot_operand_dtypes`)."""
    from flax import nnx

    from configs import get_model_config
    from inference.runtime.batch import ModelInput
    from inference.runtime.runner import StepLayout, jit_step
    from inference.sampling.sampler import SamplingTensors
    from inference.sampling.params import SamplingParams
    from models.decoder import Decoder, quantize_decoder
    from sharding.partition import kv_cache_sharding, needs_padding, param_shardings, replicated

    config = get_model_config(case.preset)
    if case.layers:
        kinds = config.layer_types and config.layer_types[:case.layers]  # the first layers' kinds (a hybrid's too)
        config = config.replace(num_layers=case.layers, layer_types=kinds, name=f"{config.name}-{case.layers}-layers")
    if case.num_chips > 1 and needs_padding(config, case.num_chips):
        return {"case": case.name, "what": "step", "chip": chip, "status": "skipped",
                "error": f"{case.preset} needs head padding for TP {case.num_chips}"}
    mesh = _mesh(chip, case.num_chips)
    rep = replicated(mesh)
    backend = CHIPS[chip][0]

    def build():
        model = Decoder(config, dtype=jnp.dtype(case.dtype), attn_impl="auto",
                        mesh=mesh if case.num_chips > 1 else None, rngs=nnx.Rngs(0))
        return model if quantization is None else quantize_decoder(model, quantization)

    with compiling_for(backend):
        model = nnx.eval_shape(build)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    if case.num_chips > 1:
        leaves = abstract(leaves, param_shardings(state, mesh))
    else:
        leaves = abstract(leaves, rep)
    tokens, seqs, max_q = case.shape
    pages_per_seq = -(-case.context // case.page_size)
    per_weight = None if quantization is None else 1  # fp8 / int8: 1 byte a weight
    num_pages = kv_pages_that_fit(config, chip, case, seqs * pages_per_seq + 1, per_weight)
    with compiling_for(backend):  # MLA's latent cache has a backend's shape (kernels_pallas/kv_cache/latent_layout.py)
        spec = config.kv_cache_spec(num_pages, case.page_size, case.dtype)
    kv_sharding = rep if (case.num_chips == 1 or config.is_mla) else kv_cache_sharding(mesh, config.num_kv_heads)
    caches = [jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=kv_sharding)
              for _ in range(config.num_kv_layers)]
    # A hybrid model's state caches follow (ModelConfig.cache_index): a slot per sequence and the null slot,
    # replicated; a copy of one in the HLO is a whole-state copy (`cache_copies`).
    states = [abstract(config.state_cache_spec(i, seqs + 1, case.dtype), rep) for i in config.state_layers]
    caches += states
    groups = len(config.kv_group_windows)
    empty = ModelInput.empty(tokens, seqs, pages_per_seq, max_q, num_groups=groups)
    if states:
        empty = empty.replace(attn=empty.attn.replace(state_slots=np.arange(1, seqs + 1, dtype=np.int32)))
    inp = abstract(empty, rep)
    sampling = abstract(SamplingTensors.from_params([SamplingParams()] * seqs, [0] * seqs, [0] * seqs, seqs), rep)
    layout = StepLayout(kv_sharding=None if case.num_chips == 1 else kv_sharding,
                        logits_sharding=None if case.num_chips == 1 else rep,
                        vocab_axis="model" if case.num_chips > 1 and config.vocab_size % case.num_chips == 0
                        else None)
    step = jit_step(graphdef, treedef, layout)
    fn = functools.partial(step, use_filters=False, logprobs=False, prompt_logprobs=False)
    local = tuple(kv_sharding.shard_shape(spec.shape))  # one device's cache, as the partitioned HLO has it
    state_shapes = tuple(x.shape for st in states for x in jax.tree.leaves(st))
    row = compile_case(chip, case.num_chips, fn, (leaves, caches, inp, sampling), cache_shapes=(local, *state_shapes),
                       donate_argnums=(1,), hlo_path=hlo_dir and os.path.join(hlo_dir, f"{chip}_{case.name}.hlo"))
    row["cost_model"] = cost_model_bytes(config, case, num_pages, per_weight)
    if states:
        from kernels_pallas.recurrent.layout import state_bytes
        row["cost_model"]["state"] = sum(state_bytes(st) for st in states)
    row["cache_shape"] = list(local)
    if quantization is not None and row.get("status") == "compiled":
        row["quantization"] = quantization
    if row.get("memory"):
        m = row["memory"]
        row["argument_vs_cost_model"] = round(m["argument"] / row["cost_model"]["total"], 3)
    return {"case": case.name, "what": "step"} | row


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
