"""The engine-step cases of `aot_compile.py` (`--what=steps`): the jitted prefill and decode steps of real-size
presets at TP 1 and 8, built from abstract weights, caches and inputs (nothing allocated), each row beside the cost
model's weight, KV and state bytes."""

from __future__ import annotations

import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.backend import compiling_for
from scripts.tools.aot_harness import CHIPS, abstract, chip_mesh, compile_case


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
    from inference.tools import model_bytes

    weights = model_bytes.weight_bytes(config, weight_bytes or jnp.dtype(case.dtype).itemsize)
    kv = config.kv_cache_bytes(num_pages, case.page_size, case.dtype)
    per = case.num_chips
    kv_per_device = kv if config.is_mla else kv / per  # MLA's latent cache is replicated
    return {"weights": int(weights / per), "kv": int(kv_per_device), "total": int(weights / per + kv_per_device)}


def cut_layer_kinds(kinds: tuple[str, ...], n: int) -> tuple[str, ...]:
    """The layer kinds of an n-layer cut of a model: its first n, except that every kind the model has keeps a layer
    (Granite-4.0-H's first attention layer is its sixth: a 2-layer cut of plain first layers would have no KV cache
    and compile no attention)."""
    distinct = list(dict.fromkeys(kinds))
    if len(distinct) > n:
        raise ValueError(f"--layers={n} cannot hold one layer of each of the model's kinds {sorted(distinct)}: "
                         f"pass --layers={len(distinct)} or more")
    picked = list(kinds[:n])
    missing = [k for k in distinct if k not in picked]
    for i in reversed(range(n)):
        if missing and picked.count(picked[i]) > 1:
            picked[i] = missing.pop()
    return tuple(picked)


def kv_pages_that_fit(config, chip: str, case: StepCase, wanted: int, weight_bytes: float | None = None) -> int:
    """Pages of cache the engine would give this step: `wanted`, or what 90% of the chips' HBM holds beside the
    weights (at least one page per sequence, so a model that cannot fit still meets the compiler's verdict)."""
    from configs.chips import CHIP_PRESETS
    from inference.tools import model_bytes

    free = 0.9 * CHIP_PRESETS[chip].hbm_bytes * case.num_chips - model_bytes.weight_bytes(
        config, weight_bytes or jnp.dtype(case.dtype).itemsize)
    per_page = config.kv_cache_bytes(1, case.page_size, case.dtype)
    return int(max(case.shape[1], min(wanted, free // per_page)))


def compile_step(chip: str, case: StepCase, hlo_dir: str | None = None, quantization: str | None = None) -> dict:
    """Lower and compile the engine's jitted step as `ModelRunner.execute` runs it (inference/runtime/runner.py: the
    packed step, one int32 buffer of the step's arrays) for `case` from abstract inputs;
    with `hlo_dir`, its optimized HLO goes to `hlo_dir/<chip>_<case>.hlo`; `quantization` ("fp8", "int8"): the
    weights as `LLM(quantization=...)` holds them, with the GEMMs' operand dtypes reported (`dot_operand_dtypes`)."""
    from flax import nnx

    from configs import get_model_config
    from inference.runtime.batch import ModelInput
    from inference.runtime.packing import pack
    from inference.runtime.runner import StepLayout, jit_packed_step, noop_feed_arrays
    from inference.sampling.sampler import SamplingTensors
    from inference.sampling.params import SamplingParams
    from models.decoder import Decoder, quantize_decoder
    from sharding.partition import kv_cache_sharding, needs_padding, param_shardings, replicated

    config = get_model_config(case.preset)
    if case.layers:
        kinds = config.layer_types and cut_layer_kinds(config.layer_types, case.layers)
        config = config.replace(num_layers=case.layers, layer_types=kinds, name=f"{config.name}-{case.layers}-layers")
    if case.num_chips > 1 and needs_padding(config, case.num_chips):
        return {"case": case.name, "what": "step", "chip": chip, "status": "skipped",
                "error": f"{case.preset} needs head padding for TP {case.num_chips}"}
    mesh = chip_mesh(chip, case.num_chips)
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
    # The step `ModelRunner.execute` runs: its numpy arrays packed into one int32 buffer, with the token feed every
    # step carries (a no-op one here, of the case's sequence width), the feed's previous tokens passed as an array.
    sampling = SamplingTensors.from_params([SamplingParams()] * seqs, [0] * seqs, [0] * seqs, seqs)
    packing, buffer, passed = pack((empty.replace(feed=noop_feed_arrays(tokens, seqs, seqs)), sampling))
    layout = StepLayout(kv_sharding=None if case.num_chips == 1 else kv_sharding,
                        logits_sharding=None if case.num_chips == 1 else rep,
                        vocab_axis="model" if case.num_chips > 1 and config.vocab_size % case.num_chips == 0
                        else None)
    step = jit_packed_step(graphdef, treedef, layout)

    def fn(leaves, caches, buffer, passed):  # the packed step's flags are positional: no adapters, no extras
        return step(leaves, caches, buffer, passed, None, packing, False, False, False)

    local = tuple(kv_sharding.shard_shape(spec.shape))  # one device's cache, as the partitioned HLO has it
    state_shapes = tuple(x.shape for st in states for x in jax.tree.leaves(st))
    row = compile_case(chip, case.num_chips, fn, (leaves, caches, abstract(buffer, rep), abstract(passed, rep)),
                       cache_shapes=(local, *state_shapes),
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
