"""The real TPU (libtpu's Mosaic) and GPU (Triton + ptxas for sm_90a) compilers, run deviceless on this CPU through
`scripts/tools/aot_compile.py`: every attention kernel at real shapes for v5e, v6e and H200 (H100 too, the day its
tuning differs) in bf16, f32 and int8 KV, with no whole-cache copy and no bf16 spills; the Mosaic GPU kernel's cases
for sm_90a; decode
and prefill steps of a real-size preset (2 of its layers, at their real shapes) with memory matching the cost model.

A chip whose compiler is not installed here is skipped with the reason (the README's test command installs
neither; `.ci/run`'s second stage installs libtpu, jax-cuda13-plugin and jax-cuda13-pjrt and runs this file). The
script runs in a child process because XLA reads the settings that make ptxas report registers once, at start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from configs.presets import MODEL_PRESETS
from kernels_pallas.attention.gpu_tuning import BLOCK_SIZES, SPLIT_RULES
from models.weights import num_params
from scripts.tools.aot_harness import CHIPS
from scripts.tools.aot_kernels import kernel_cases, mosaic_gpu_cases
from tests.xla_test_flags import accelerator_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_MEMORY_PER_BLOCK = 232448  # H100/H200 opt-in maximum (configs/gpu_targets)
# beyond every bf16 case, cases that compile without spills (f32 prefill, D 128, 3 KV heads: 172 B, jax 0.10 and 0.12)
SPILL_FREE = {"decode_int8_d128_kv3_g4_p16", "decode_int8_d128_kv8_g4_p16", "prefill_float32_d128_kv8_g4_p16",
              "mixed_int8_d128_kv8_g4_p16", "mixed_float32_d128_kv8_g4_p16"}
STEP_TOLERANCE = 0.02  # compiled argument bytes vs the cost model's weights + KV (+ the step's small inputs)


def _run(tmp_path_factory, *args: str) -> dict:
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tools", "aot_compile.py"), *args, f"--out={out}"],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT, env=accelerator_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    return {(r["chip"], r["case"]): r for r in rows}


def _row(rows: dict, chip: str, case: str) -> dict:
    """The row of (chip, case); skipped with the script's reason where the chip's compiler is not installed."""
    setup = rows.get((chip, "-"))
    if setup is not None and setup["status"] == "unavailable":
        pytest.skip(setup["error"])
    return rows[(chip, case)]


def _selected_chips(request, test: str | None = None) -> set[str]:
    """The chips of the tests this session will run that use the requesting fixture (`-k h100` compiles for H100
    only, as CI's GPU stage does); with `test`, of that test function's only."""
    return {item.callspec.params["chip"] for item in request.session.items
            if request.fixturename in getattr(item, "fixturenames", ()) and "chip" in item.callspec.params
            and test in (None, item.originalname)}


@pytest.fixture(scope="module")
def kernel_rows(request, tmp_path_factory):
    chips = ",".join(c for c in CHIPS if c in _selected_chips(request))
    return _run(tmp_path_factory, f"--chips={chips}", "--what=kernels", "--quick")


def _same_tuning(a: str, b: str) -> bool:
    """Whether chips a and b get the same Triton tuning (entries and split rule, whatever their `source` says)."""
    def values(entry):
        return dataclasses.replace(entry, source="")

    return ({k: values(v) for k, v in BLOCK_SIZES[a].items()} == {k: values(v) for k, v in BLOCK_SIZES[b].items()}
            and values(SPLIT_RULES[a]) == values(SPLIT_RULES[b]))


def _target_lines(chip: str) -> set[str]:
    with open(os.path.join(ROOT, "configs", "gpu_targets", f"{chip}.txtpb")) as f:
        return {line.strip() for line in f}


# H100 and H200 are the same sm_90a SM and share one tuning table today, so a kernel compiles to the same program for
# both: the grid compiles it once, as H200 (the chip that was timed). The day the tables part, H100 joins the grid.
KERNEL_CHIPS = [c for c in CHIPS if not (c == "h100" and _same_tuning("h100", "h200"))]


def test_h100_and_h200_differ_only_in_memory():
    """What lets the kernel grid compile H200 alone: the two targets differ only in HBM size and bandwidth (and the
    name), which no kernel's code depends on; the SM (compute capability, shared memory, registers, cores) is one."""
    differ = _target_lines("h100") ^ _target_lines("h200")
    assert {line.split(":")[0] for line in differ} == {"memory_bandwidth", "device_memory_size",
                                                       "device_description_str"}, differ
    assert "h100" in KERNEL_CHIPS or _same_tuning("h100", "h200")


@pytest.mark.parametrize("case", [c.name for c in kernel_cases(quick=True)])
@pytest.mark.parametrize("chip", KERNEL_CHIPS)
def test_attention_kernel_compiles(chip, case, kernel_rows):
    row = _row(kernel_rows, chip, case)
    assert row["status"] == "compiled", row.get("error")
    assert not row["cache_copies"] and not row["cpu_only_calls"]
    if CHIPS[chip][0] == "gpu":
        kernels = {k: v for k, v in row["ptxas"]["kernels"].items() if "paged" in k}
        assert kernels, f"ptxas reported no attention kernel: {sorted(row['ptxas']['kernels'])}"
        if "bfloat16" in case or case in SPILL_FREE:
            assert all(v["spill_stores"] == 0 and v["spill_loads"] == 0 for v in kernels.values()), kernels
        assert all(v["registers"] <= 255 for v in kernels.values())
        assert 0 < max(row["ptxas"]["shared_memory"]) <= SHARED_MEMORY_PER_BLOCK
    else:
        assert "tpu_custom_call" in row["custom_calls"]


@pytest.fixture(scope="module")
def step_rows(request, tmp_path_factory):
    rows = {}
    chips = _selected_chips(request)
    for chip, tp in (("v5e", 8), ("h100", 1)):
        if chip not in chips:
            continue
        rows |= _run(tmp_path_factory, f"--chips={chip}", "--what=steps", "--presets=llama-3-8b", f"--tp={tp}",
                     "--layers=2")  # 2 of the 32 layers at their real shapes: every layer compiles alike
    return rows


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("chip,tp", [("v5e", 8), ("h100", 1)])
def test_real_size_step_compiles_with_the_cost_models_memory(chip, tp, kind, step_rows):
    """Llama-3-8B's jitted step (bf16 weights, a paged bf16 cache, the sampler; 2 of its layers at their real
    shapes) compiles; what it holds per device is the cost model's weights + KV cache, and XLA makes no copy of any
    layer's cache."""
    row = _row(step_rows, chip, f"llama-3-8b_l2_{kind}_tp{tp}")
    assert row["status"] == "compiled", row.get("error")
    assert not row["cache_copies"] and not row["cpu_only_calls"]
    assert abs(row["memory"]["argument"] / row["cost_model"]["total"] - 1) < STEP_TOLERANCE
    assert row["memory"]["alias"] >= row["cost_model"]["kv"]  # the donated cache is updated in place


@pytest.fixture(scope="module")
def fp8_step_rows(request, tmp_path_factory):
    rows = {}
    whole = _selected_chips(request, "test_fp8_steps_compile_with_fp8_gemms_on_hopper")
    split = _selected_chips(request, "test_fp8_codes_and_scales_are_split_under_tensor_parallelism")
    # 2 of the 32 layers at their real shapes (each layer compiles alike, and cheaper; v6e, the same weight-only path
    # as v5e, compiled by hand: its libtpu compile took 4-8 minutes a step on the shared 2-core machine); H200 at
    # TP 8: decode only. Each compile only where a selected test reads it (CI's newest-jax stage runs H200 at TP 1).
    for chip, extra, chips in (("h200", ("--tp=1",), whole), ("h200", ("--tp=8", "--decode_only"), split),
                               ("v5e", ("--tp=1",), whole)):
        if chip in chips:
            rows |= _run(tmp_path_factory, f"--chips={chip}", "--what=steps", "--presets=llama-3-8b",
                         "--quantization=fp8", "--layers=2", *extra)
    return rows


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("chip", ["h200", "v5e"])
def test_fp8_steps_compile_with_fp8_gemms_on_hopper(chip, kind, fp8_step_rows):
    """Llama-3-8B with quantization="fp8": on the H200 every GEMM of the step takes float8_e4m3fn operands (the
    weights reach the tensor cores as FP8, activations quantized per token) and the weights take 1 byte a weight
    (the compiled arguments are the cost model's 1-byte weights + the KV cache); on v5e (no FP8 units) the
    same model compiles with weight-only dots. Both compile 2 of the model's 32 layers (`--layers=2`)."""
    row = _row(fp8_step_rows, chip, f"llama-3-8b_l2_{kind}_tp1")
    assert row["status"] == "compiled", row.get("error")
    assert not row["cache_copies"] and not row["cpu_only_calls"]
    assert abs(row["memory"]["argument"] / row["cost_model"]["total"] - 1) < STEP_TOLERANCE
    if CHIPS[chip][0] == "gpu":
        two_layers = dataclasses.replace(MODEL_PRESETS["llama-3-8b"], num_layers=2)
        assert abs(row["cost_model"]["weights"] / num_params(two_layers) - 1) < 0.01  # one byte a weight
        assert row["gemm_operands"] and set(row["gemm_operands"]) == {"f8e4m3fn x f8e4m3fn"}, row["gemm_operands"]
        kernels = row["ptxas"]["kernels"]
        assert all(v["spill_stores"] == 0 and v["spill_loads"] == 0 for v in kernels.values()), kernels


@pytest.mark.parametrize("chip", ["h200"])
def test_fp8_codes_and_scales_are_split_under_tensor_parallelism(chip, fp8_step_rows):
    """The H200 decode step at TP 8 with quantization="fp8" (2 layers): each device holds 1/8 of the FP8 codes and
    scales (the compiled arguments are the cost model's per-device weights + KV cache; replicated codes, as before
    sharding/partition.py named a QuantizedWeight's leaves, were 12.3 GB against 5.3 GB at 32 layers), and its
    GEMMs stay FP8 x FP8."""
    row = _row(fp8_step_rows, chip, "llama-3-8b_l2_decode_tp8")
    assert row["status"] == "compiled", row.get("error")
    assert not row["cache_copies"] and not row["cpu_only_calls"]
    assert abs(row["memory"]["argument"] / row["cost_model"]["total"] - 1) < STEP_TOLERANCE
    assert row["gemm_operands"] and set(row["gemm_operands"]) == {"f8e4m3fn x f8e4m3fn"}, row["gemm_operands"]


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("chip", KERNEL_CHIPS)
def test_mla_compiles(chip, kind, kernel_rows):
    """DeepSeek-V2-Lite's latent attention over 8193 pages: the Triton kernel on GPU (no bf16 spills), the pure-JAX
    reference on TPU (no TPU MLA kernel yet), and no copy of the latent cache on either. At this page count
    XLA:TPU lays a `[pages, 16, 576]` cache out pages-minor and copied it whole around the reference's gather
    (every layer of a real-size decode step: docs/accelerators.md); TPU's flat pages
    (kernels_pallas/kv_cache/latent_layout.py) keep it in place, and this cheap kernel-level compile is the case
    that showed the copy."""
    row = _row(kernel_rows, chip, f"mla_{kind}_bfloat16_deepseek-v2-lite")
    assert row["status"] == "compiled" and not row["cache_copies"], row.get("error")
    assert not row["cpu_only_calls"]
    if CHIPS[chip][0] == "gpu":
        kernels = {k: v for k, v in row["ptxas"]["kernels"].items() if "paged" in k}  # the shared Triton kernel
        assert kernels and all(v["spill_stores"] == 0 for v in kernels.values()), row["ptxas"]["kernels"]


@pytest.fixture(scope="module")
def mosaic_gpu_rows(request, tmp_path_factory):
    """One run per chip: the CUDA plugin compiles a Mosaic GPU kernel once per process (H100 and H200 are both
    sm_90a), so a second chip in the same run gets no ptxas report."""
    rows = {}
    for chip in (c for c in CHIPS if c in _selected_chips(request)):
        rows |= _run(tmp_path_factory, f"--chips={chip}", "--what=mosaic_gpu")
    return rows


@pytest.mark.parametrize("case", [c.name for c in mosaic_gpu_cases()])
@pytest.mark.parametrize("chip", [c for c in KERNEL_CHIPS if CHIPS[c][0] == "gpu"])
def test_mosaic_gpu_compiles_for_hopper_without_spills(chip, case, mosaic_gpu_rows):
    """The Mosaic GPU kernel (kernels_pallas/attention/mosaic_gpu.py) for sm_90a at real shapes: no ptxas spills,
    registers under the 255 ceiling, shared memory within the 227 KiB a block may opt into, no whole-cache copy.
    The figures are in the kernel's docstring."""
    row = _row(mosaic_gpu_rows, chip, case)
    assert row["status"] == "compiled", row.get("error")
    assert not row["cache_copies"] and not row["cpu_only_calls"]
    ptxas = next((v for k, v in row["ptxas"]["kernels"].items() if "ragged_paged_attention_mosaic_gpu" in k), None)
    smem = row["ptxas"]["shared_memory"]
    where = f"{chip} {case}: {ptxas}, shared memory {smem}"
    assert ptxas is not None and ptxas["arch"] == "sm_90a", where
    assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0, where
    assert ptxas["registers"] <= 255, where
    # jax 0.10's Mosaic GPU prints no resources (MOSAIC_GPU_DUMP_RESOURCES is newer); it rejects shared memory over
    # the limit at lowering, so there a successful compile is the check
    import jax

    assert (not smem and jax.__version_info__ < (0, 11)) or 0 < max(smem) <= SHARED_MEMORY_PER_BLOCK, where


def test_a_layer_cut_of_a_hybrid_keeps_each_kind_of_layer():
    """`--layers=2` of Granite-4.0-H-Micro (attention first at layer 6) compiles a Mamba layer and an attention
    layer, not two Mamba layers without a KV cache (which divided by zero sizing the cache)."""
    from scripts.tools.aot_steps import cut_layer_kinds

    kinds = MODEL_PRESETS["granite-4.0-h-micro"].layer_types
    assert kinds[:2] == ("mamba", "mamba") and cut_layer_kinds(kinds, 2) == ("mamba", "full_attention")
    assert cut_layer_kinds(kinds, 7) == kinds[:7]  # the first attention layer is already in the first 7
    with pytest.raises(ValueError, match="--layers=2 or more"):
        cut_layer_kinds(kinds, 1)
