"""The cost model reproduces the CS336 lecture-10 arithmetic and its launcher's contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from configs.chips import CHIP_PRESETS, ChipSpec, get_chip
from configs.presets import MODEL_PRESETS, get_model_config
from inference.tools import cost_model as cm
from inference.tools import cost_model_io as cio
from inference.tools import model_bytes as mb
from models.config import ModelConfig
from models.weights import num_params

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "tools", "cost_model.py")
LECTURE_CHIP = ChipSpec(name="lecture-h100", flops_per_s=989e12, bandwidth_bytes_per_s=3.35e12)
GB = 1e9


@pytest.fixture(scope="module")
def llama13b() -> ModelConfig:
    return get_model_config("llama-2-13b")


@pytest.fixture(scope="module")
def lecture_rows(llama13b: ModelConfig) -> dict[tuple[int, int], cm.StepEstimate]:
    report = cm.cost_report(llama13b, [1, 64, 256], 1024, LECTURE_CHIP, 2, kv_heads=(None, 8))
    return {(r.kv_heads, r.batch): r for r in report.rows}


def _run_script(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, cwd=REPO, timeout=60)


# ---- The lecture's Llama 2 13B table --------------------------------------------------------------------------


def test_parameter_count_matches_lecture(llama13b: ModelConfig) -> None:
    params = mb.param_count(llama13b)
    # The lecture's P = 2VD + 3DFL + (2DNH + 2DKH)L omits the norm vectors ...
    assert params.matrices == 13_015_449_600
    # ... which the full count (and ModelConfig.num_params) includes: two per layer plus the final one.
    assert params.norms == (2 * 40 + 1) * 5120
    assert params.total == num_params(llama13b) == 13_015_864_320


def test_weights_and_kv_per_sequence(llama13b: ModelConfig) -> None:
    summary = cm.summarize(llama13b, 1024, 2)
    assert round(summary.weight_bytes / GB, 2) == 26.03
    assert summary.kv_bytes_per_token == 2 * 2 * 40 * 40 * 128 == 819_200
    assert summary.kv_bytes_per_sequence == 2 * 2 * 1024 * 40 * 40 * 128  # M = 2bBSLKH with B = 1
    assert round(summary.kv_bytes_per_sequence / GB, 3) == 0.839


@pytest.mark.parametrize("kv_heads, batch, weights, kv, total", [
    (40, 1, 26.03, 0.84, 26.87),
    (40, 64, 26.03, 53.69, 79.72),
    (40, 256, 26.03, 214.75, 240.78),
    (8, 64, 22.68, 10.74, 33.41),
    (8, 256, 22.68, 42.95, 65.63),
])
def test_lecture_memory_table(lecture_rows, kv_heads, batch, weights, kv, total) -> None:
    row = lecture_rows[(kv_heads, batch)].json_row()
    assert (round(row["weights_gb"], 2), round(row["kv_cache_gb"], 2), round(row["total_gb"], 2)) == (
        weights, kv, total)


def test_lecture_step_time_and_throughput(lecture_rows) -> None:
    b1, b64 = lecture_rows[(40, 1)], lecture_rows[(40, 64)]
    assert round(b1.step_s * 1e3, 2) == 8.02
    assert round(b64.step_s * 1e3, 2) == 23.80
    assert round(b1.tokens_per_s) == 125
    assert round(b64.tokens_per_s) == 2_689
    # Throughput approaches β / C as the batch grows; step time grows with it.
    c = mb.kv_bytes_per_sequence(get_model_config("llama-2-13b"), 1024, 2)
    assert lecture_rows[(40, 256)].tokens_per_s < LECTURE_CHIP.bandwidth_bytes_per_s / c


def test_kv_heads_override_shrinks_kv_projections(llama13b: ModelConfig) -> None:
    gqa = cm.with_kv_heads(llama13b, 8)
    assert gqa.num_kv_heads == 8 and llama13b.num_kv_heads == 40
    assert mb.param_count(gqa).matrices == 13_015_449_600 - 2 * 5120 * 32 * 128 * 40
    assert mb.kv_bytes_per_token(gqa, 2) * 5 == mb.kv_bytes_per_token(llama13b, 2)
    assert cm.with_kv_heads(llama13b, None) is llama13b


# ---- Intensity and roofline -----------------------------------------------------------------------------------


def test_linear_intensity_exact_formula() -> None:
    assert cm.linear_intensity(3, 5, 7, 2) == pytest.approx(2 * 3 * 5 * 7 / (2 * (3 * 5 + 5 * 7 + 3 * 7)))


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_linear_intensity_is_about_batch_when_small(batch: int) -> None:
    d, f = 5120, 13824
    exact = cm.linear_intensity(batch, d, f, 2)
    assert cm.linear_intensity_approx(batch, 2) == batch
    assert exact < batch
    assert exact == pytest.approx(batch, rel=batch / d + batch / f)


def test_linear_intensity_saturates_for_large_token_counts() -> None:
    d, f = 5120, 13824
    assert cm.linear_intensity(10**9, d, f, 2) == pytest.approx(d * f / (d + f), rel=1e-4)


@pytest.mark.parametrize("context", [1, 128, 1024, 32768])
def test_decode_attention_intensity_is_s_over_s_plus_one(context: int) -> None:
    assert cm.attention_intensity(context, 1, 40, 40, 2) == pytest.approx(context / (context + 1))
    assert cm.attention_intensity(context, 1, 40, 40, 2) < 1


def test_attention_intensity_prefill_and_gqa() -> None:
    assert cm.attention_intensity(1024, 1024, 32, 32, 2) == pytest.approx(512)  # square prefill: S/2
    g = 40 // 8  # GQA: each cached KV byte serves g query heads, so decode intensity ≈ g
    assert cm.attention_intensity(1024, 1, 40, 8, 2) == pytest.approx(1024 * g / (1024 + g))


def test_roofline_crossover_and_bound(llama13b: ModelConfig) -> None:
    h100 = get_chip("h100")
    assert h100.crossover_intensity == pytest.approx(989e12 / 3.35e12)
    assert round(h100.crossover_intensity) == 295
    assert cm.bound(1.0, h100) == "memory" and cm.bound(300.0, h100) == "compute"
    small = cm.estimate_decode_step(llama13b, 1, 1024, h100)
    assert (small.linear_bound, small.attention_bound) == ("memory", "memory")
    large = cm.estimate_decode_step(llama13b, 1024, 1024, h100)
    assert large.linear_bound == "compute" and large.attention_bound == "memory"


def test_chip_presets() -> None:
    expected = {"h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12), "v5e": (197e12, 819e9),
                "v6e": (918e12, 1.64e12)}
    assert {k: (c.flops_per_s, c.bandwidth_bytes_per_s) for k, c in CHIP_PRESETS.items()} == expected
    assert get_chip("TPU-v5e") is CHIP_PRESETS["v5e"]
    custom = cio.resolve_chip("h100", bandwidth=4e12)
    assert (custom.flops_per_s, custom.bandwidth_bytes_per_s) == (989e12, 4e12)
    other = cio.resolve_chip("my-chip", flops=1e15, bandwidth=2e12)
    assert (other.name, other.crossover_intensity, other.hbm_bytes) == ("my-chip", 500.0, None)


# ---- KV hooks for sliding windows and MLA ---------------------------------------------------------------------


def test_sliding_window_hook_caps_windowed_layers() -> None:
    windowed = get_model_config("mistral-7b")  # sliding_window=4096 on every layer
    base = windowed.replace(sliding_window=None)
    assert mb.kv_bytes_per_sequence(windowed, 2048, 2) == mb.kv_bytes_per_sequence(base, 2048, 2)
    assert mb.kv_bytes_per_sequence(windowed, 32768, 2) == mb.kv_bytes_per_sequence(base, 4096, 2)
    alternating = windowed.replace(
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(32)))
    per_layer = mb.kv_bytes_per_token(base, 2) / 32
    assert mb.kv_bytes_per_sequence(alternating, 32768, 2) == 16 * per_layer * (4096 + 32768)


def test_moe_decode_reads_only_the_routed_experts() -> None:
    lite = get_model_config("deepseek-v2-lite")
    expert = 3 * 2048 * 1408 * 2
    total = mb.weight_bytes(lite, 2)
    assert mb.weight_bytes_read(lite, 1, 2) == pytest.approx(total - 26 * (64 - 6) * expert)
    assert mb.weight_bytes_read(lite, 1, 2) < mb.weight_bytes_read(lite, 8, 2) < mb.weight_bytes_read(lite, 512, 2)
    assert mb.weight_bytes_read(lite, 512, 2) == pytest.approx(total, rel=1e-6)
    assert mb.weight_bytes_read(get_model_config("llama-2-13b"), 1, 2) == mb.weight_bytes(
        get_model_config("llama-2-13b"), 2)


def test_mla_and_cla_cache_sizes() -> None:
    lite = get_model_config("deepseek-v2-lite")
    assert mb.kv_bytes_per_token(lite, 2) == 27 * (512 + 64) * 2
    assert mb.kv_bytes_per_sequence(lite, 1000, 2) == 1000 * 27 * 576 * 2
    cla = get_model_config("llama-2-7b").replace(cla_factor=2)
    assert mb.kv_bytes_per_token(cla, 2) == mb.kv_bytes_per_token(get_model_config("llama-2-7b"), 2) / 2


# ---- Presets ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, params", [
    ("llama-2-7b", 6_738_415_616), ("llama-2-13b", 13_015_864_320), ("llama-3-8b", 8_030_261_248),
    ("mistral-7b", 7_241_732_096), ("qwen2.5-7b", 7_615_616_512), ("qwen3-8b", 8_190_735_360),
    ("gemma-2-9b", 9_241_705_984), ("gemma-3-12b", 11_766_034_176), ("deepseek-v2-lite", 15_706_484_224),
])
def test_real_presets_match_published_parameter_counts(name: str, params: int) -> None:
    assert num_params(MODEL_PRESETS[name]) == mb.param_count(MODEL_PRESETS[name]).total == params


# ---- config.json input -----------------------------------------------------------------------------------------

_TINY_HF = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 2,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 128}}


def _write_config(tmp_path, **changes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_TINY_HF, **changes}))
    return str(path)


def test_config_json_path(tmp_path) -> None:
    path = _write_config(tmp_path)
    config = cio.load_model_config(path)
    assert (config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (2, 16, True)
    assert config.rope_scaling is not None and config.rope_scaling.kind == "llama3"
    assert cio.load_model_config(str(tmp_path)) == config  # a folder holding config.json
    assert mb.kv_bytes_per_token(config, 2) == 2 * 2 * 2 * 16 * 2
    assert mb.param_count(config).total == num_params(config)


def test_config_json_reads_windows_mla_and_experts_as_the_loader_does(tmp_path) -> None:
    mistral = cio.load_model_config(_write_config(tmp_path, model_type="mistral", sliding_window=128))
    assert mb.kv_bytes_per_sequence(mistral, 1000, 2) == 128 * mb.kv_bytes_per_token(mistral, 2)
    deepseek = cio.load_model_config(_write_config(
        tmp_path, model_type="deepseek_v2", kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, rope_scaling=None))
    assert mb.kv_bytes_per_token(deepseek, 2) == 2 * 40 * 2 and deepseek.num_experts == 8
    with pytest.raises(ValueError, match="unsupported model_type"):
        cio.load_model_config(_write_config(tmp_path, model_type="mixtral"))


def test_launcher_reads_config_json(tmp_path) -> None:
    result = _run_script(f"--model={_write_config(tmp_path)}", "--batch=2", "--context=100", "--json")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["kv_cache_gb"] == pytest.approx(2 * 100 * 2 * 2 * 2 * 16 * 2 / GB)


# ---- Launcher output -------------------------------------------------------------------------------------------

_KEYS = {"kv_heads", "batch", "weights_gb", "kv_cache_gb", "total_gb", "step_ms", "tokens_per_s"}


@pytest.mark.parametrize("extra, kv_heads, rounded_kv", [
    ((), 40, [0.84, 53.69, 214.75]),
    (("--kv_heads=8",), 8, [0.17, 10.74, 42.95]),
])
def test_launcher_json_rows(extra, kv_heads, rounded_kv) -> None:
    result = _run_script("--model=llama-2-13b", "--batch=1,64,256", "--context=1024", "--bandwidth=3.35e12",
                         "--json", *extra)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list) and len(rows) == 3
    assert all(set(r) == _KEYS for r in rows)
    assert [r["batch"] for r in rows] == [1, 64, 256]
    assert {r["kv_heads"] for r in rows} == {kv_heads}
    assert [round(r["kv_cache_gb"], 2) for r in rows] == rounded_kv


def test_launcher_table_and_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.png"
    result = _run_script("--model=llama-2-13b", "--batch=1,64", "--bandwidth=3.35e12", "--kv_heads=40,8",
                         f"--plot={out}")
    assert result.returncode == 0, result.stderr
    assert "13,015,449,600" in result.stdout and "23.80" in result.stdout and "2,689" in result.stdout
    assert out.stat().st_size > 0


# ---- Bad input -------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors(llama13b: ModelConfig) -> None:
    with pytest.raises(ValueError, match="unknown chip 'a100'"):
        get_chip("a100")
    with pytest.raises(ValueError, match="batch must be positive"):
        cm.estimate_decode_step(llama13b, 0, 1024, LECTURE_CHIP)
    with pytest.raises(ValueError, match="kv_heads=7 does not divide num_heads=40"):
        cm.with_kv_heads(llama13b, 7)
    with pytest.raises(ValueError, match="context must be positive"):
        mb.kv_bytes_per_sequence(llama13b, 0, 2)
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        cio.load_model_config("no-such-model")
    with pytest.raises(ValueError, match="--batch: 'x' is not an integer"):
        cio.parse_int_list(["x"], "--batch")
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be positive"):
        cio.resolve_chip("h100", bandwidth=0.0)


@pytest.mark.parametrize("flag, message", [
    ("--chip=a100", "unknown chip 'a100'"),
    ("--batch=1,0", "--batch must be positive, got 0"),
    ("--kv_heads=7", "kv_heads=7 does not divide num_heads=40"),
])
def test_launcher_reports_bad_input(flag: str, message: str) -> None:
    result = _run_script("--model=llama-2-13b", flag)
    assert result.returncode != 0
    assert message in result.stderr


def test_plot_without_matplotlib_says_to_install_it(monkeypatch, tmp_path):
    """The notebook's plot cell calls plot_report directly: the message names the package, not a CLI flag."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    report = cm.cost_report(get_model_config("llama-2-13b"), [1], 1024, get_chip("h100"))
    with pytest.raises(ImportError, match="needs matplotlib, which is not installed: pip install matplotlib"):
        cio.plot_report(report, str(tmp_path / "x.png"))


def test_fp8_halves_the_hopper_decode_bound() -> None:
    """FP8 weights and cache (1 byte an element) against bf16 on H100/H200: Llama-3-8B's batch-1 step reads 8.03 GB
    instead of 16.06 GB, 1.67 ms a token on an H200 (4.8 TB/s) instead of 3.35 ms."""
    config = get_model_config("llama-3-8b")
    assert mb.format_bytes("fp8") == 1 and mb.format_bytes("bf16") == 2
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        mb.format_bytes("fp4")
    h200 = get_chip("h200")
    bf16, fp8 = (cm.estimate_decode_step(config, 1, 1024, h200, mb.format_bytes(f)) for f in ("bf16", "fp8"))
    assert fp8.step_s == pytest.approx(bf16.step_s / 2)
    assert fp8.weight_bytes == pytest.approx(8.03e9, rel=1e-3)
    table = cio.bounds_table(config, [1, 64], 1024)
    assert "h100" in table and "h200" in table and table.count("fp8") == 4
    assert f"{fp8.step_s * 1e3:7.2f}" in table


def test_hybrid_state_bytes_are_constant_beside_growing_kv():
    """Three Gated DeltaNet layers and one attention layer: only the attention layer's KV grows with the context;
    the state is conv windows (bf16) plus float32 delta-rule states, the same at every context."""
    base = MODEL_PRESETS["tiny-llama"]
    config = base.replace(num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4)
    conv_channels = 2 * 2 * 8 + 4 * 16
    state = 3 * (conv_channels * 3 * 2 + 4 * 8 * 16 * 4)
    assert mb.state_bytes_per_sequence(config, 2) == state
    kv_token = 2 * base.num_kv_heads * base.head_dim * 2  # one caching layer
    for context in (16, 4096):
        assert mb.kv_bytes_per_sequence(config, context, 2) == context * kv_token
    step = cm.estimate_decode_step(config, 8, 4096, LECTURE_CHIP)
    assert step.kv_bytes == 8 * (4096 * kv_token + 2 * state)  # a state is read and rewritten whole
    table = cio.state_vs_kv(config, [16, 4096])
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows[0][2] == rows[1][2] == f"{state / 1e6:.2f}" and float(rows[1][1]) > float(rows[0][1])
    assert mb.state_bytes_per_sequence(base, 2) == 0
