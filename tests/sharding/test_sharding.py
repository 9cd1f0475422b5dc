"""Tensor and data parallelism: mesh, partition rules, exact head/vocab/MLP/expert padding (here, on one device),
and the sharded engine, data-parallel replicas and an orbax restore into shards on 8 virtual CPU devices
(tests/sharding/sharding_worker.py in a subprocess, since this process has one device)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from configs.presets import get_model_config
from models.decoder import build_decoder
from sharding import make_mesh, pad_heads, padding_report
from sharding.partition import (export_weights, kv_cache_sharding, needs_padding, pad_for_tensor_parallel,
                                partition_spec)
from tests.virtual_devices import run_worker

MESH8 = AbstractMesh((1, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
SMOL_GROUPING = get_model_config("tiny-llama").replace(num_heads=9, num_kv_heads=3, head_dim=16)


# ---- in this process (one device) -----------------------------------------------------------------------------------
def test_make_mesh_is_auto_data_by_model():
    mesh = make_mesh(model=1)
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 1, "model": 1}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="devices"):
        make_mesh(model=jax.device_count() + 1)


@pytest.mark.parametrize("name, shape, spec", [
    ("embed", (512, 64), P("model", None)),
    ("embed.embedding", (512, 64), P("model", None)),
    ("lm_head", (64, 512), P(None, "model")),
    ("layers.0.q_proj", (64, 128), P(None, "model")),
    ("layers.0.attn.k_proj.kernel", (64, 64), P(None, "model")),
    ("layers.1.attn.v_proj.bias", (64,), P("model")),
    ("layers.1.k_bias", (64,), P("model")),
    ("layers.0.attn.o_proj.kernel", (128, 64), P("model", None)),
    ("layers.0.mlp.gate_proj.kernel", (64, 128), P(None, "model")),
    ("layers.0.up_proj", (64, 128), P(None, "model")),
    ("layers.0.mlp.down_proj.kernel", (128, 64), P("model", None)),
    ("layers.0.attn_norm", (64,), P()),
    ("layers.0.attn.q_norm.weight", (16,), P()),
    ("final_norm.weight", (64,), P()),
    ("layers.0.attn.q_proj.kernel", (64, 144), P(None, "model")),
    ("layers.0.attn.q_proj.kernel", (64, 36), P(None, None)),  # 36 % 8: not divisible -> that dim replicated
    ("layers.0.attn.q_proj.kernel.scale", (144,), P()),  # a 1-D scale: not a weight's [in/g, out]; replicated
    # Quantized weights (fp8 / int8 codes and their [in/g, out] scales): the weight's axes; the embedding's
    # quantized form is [hidden, vocab].
    ("layers.0.attn.q_proj.kernel.value.q", (64, 128), P(None, "model")),
    ("layers.0.attn.q_proj.kernel.value.scale", (1, 128), P(None, "model")),
    ("layers.0.attn.o_proj.kernel.value.q", (128, 64), P("model", None)),
    ("layers.0.attn.o_proj.kernel.value.scale", (1, 64), P(None, None)),  # per channel: whole on every device
    ("layers.0.mlp.down_proj.kernel.value.scale", (16, 64), P("model", None)),  # 128-row groups follow the rows
    ("layers.0.mlp.down_proj.kernel.value.zero_point", (16, 64), P("model", None)),
    ("embed.embedding.value.q", (64, 512), P(None, "model")),
    ("embed.embedding.value.scale", (1, 512), P(None, "model")),
    ("lm_head.kernel.value.q", (64, 512), P(None, "model")),
    ("layers.0.attn_norm.weight.value.q", (64,), P()),  # a leaf no rule names stays replicated
    # Routed experts [E, D, F] / [E, F, D], canonical name and NNX path: F on "model", E whole (no expert parallelism).
    ("layers.1.experts.gate_proj", (8, 64, 32), P(None, None, "model")),
    ("layers.1.mlp.up_proj", (8, 64, 32), P(None, None, "model")),
    ("layers.1.experts.down_proj", (8, 32, 64), P(None, "model", None)),
    ("layers.1.mlp.down_proj", (8, 32, 64), P(None, "model", None)),
    ("layers.1.mlp.gate_proj", (8, 64, 20), P(None, None, None)),  # 20 % 8 (unpadded): replicated
    ("layers.1.shared.gate_proj", (64, 64), P(None, "model")),  # shared experts: the dense MLP's rules
    ("layers.1.mlp.shared.down_proj.kernel", (64, 64), P("model", None)),
    ("layers.1.mlp.shared.up_proj.kernel.scale", (64,), P()),
    ("layers.1.mlp.router", (64, 8), P()),
    ("layers.1.router", (64, 8), P()),
])
def test_partition_rules(name, shape, spec):
    assert partition_spec(name, shape, MESH8) == spec


def test_kv_cache_is_split_over_whole_kv_heads_only():
    assert kv_cache_sharding(MESH8, 8).spec == P("model")  # head-major caches (kernels_pallas/kv_cache/layout.py)
    assert kv_cache_sharding(MESH8, 3).spec == P()  # unpadded 3 KV heads on 8 devices: replicated, never split


@pytest.mark.parametrize("preset, changes, tp", [
    ("tiny-llama", dict(num_heads=9, num_kv_heads=3, head_dim=16), 8),  # SmolLM2's grouping
    ("tiny-llama", dict(num_heads=9, num_kv_heads=3, head_dim=16), 2),
    ("tiny-llama", dict(num_heads=9, num_kv_heads=3, vocab_size=500, intermediate_size=100,
                        tie_word_embeddings=True), 8),
    ("tiny-qwen2", dict(num_heads=6, num_kv_heads=3), 4),  # q/k/v biases
    ("tiny-qwen3", dict(num_heads=6, num_kv_heads=3), 4),  # QK-norm
    ("tiny-gemma2", {}, 8),  # soft caps, post-norms, GeGLU, embedding scale
])
def test_padding_is_exact(preset, changes, tp):
    """The padded model computes the same logits as the original (on one device, cache-free forward)."""
    try:
        config = get_model_config(preset).replace(**changes)
    except ValueError:
        pytest.skip(f"no preset {preset}")
    weights = export_weights(build_decoder(config, seed=3))
    padded_config, padded = pad_for_tensor_parallel(config, weights, tp)
    assert padded_config.num_kv_heads % tp == 0 and padded_config.num_heads % tp == 0
    assert padded_config.q_per_kv == config.q_per_kv
    assert padded_config.vocab_size % tp == 0 and padded_config.intermediate_size % tp == 0
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, config.vocab_size, (2, 13)))
    want = jax.jit(build_decoder(config, weights).forward)(tokens)
    got = jax.jit(build_decoder(padded_config, padded).forward)(tokens)
    np.testing.assert_allclose(np.asarray(got[..., :config.vocab_size]), np.asarray(want), atol=1e-5, rtol=0)


def test_expert_padding_is_exact():
    """An expert width TP 8 does not divide (20 -> 24, shared experts 40 -> 48): zero columns / rows only, the same
    logits, and the width reported."""
    config = get_model_config("tiny-deepseek-v2").replace(moe_intermediate_size=20)
    assert needs_padding(config, 8) and not needs_padding(config, 4)
    weights = export_weights(build_decoder(config, seed=3))
    padded_config, padded = pad_for_tensor_parallel(config, weights, 8)
    assert padded_config.moe_intermediate_size == 24 and padded_config.intermediate_size == 96
    gate, down = padded["layers.1.experts.gate_proj"], padded["layers.1.experts.down_proj"]
    assert gate.shape == (8, 64, 24) and down.shape == (8, 24, 64) and padded["layers.1.shared.up_proj"].shape == (
        64, 48) and padded["layers.1.shared.down_proj"].shape == (48, 64)
    assert np.array_equal(gate[..., :20], weights["layers.1.experts.gate_proj"]) and not gate[..., 20:].any()
    assert not down[:, 20:].any() and not padded["layers.1.shared.gate_proj"][:, 40:].any()
    assert padded["layers.0.gate_proj"].shape == (64, 96)  # the dense first layer divides already
    assert padding_report(config, padded_config)["moe_intermediate_size"] == (20, 24)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, config.vocab_size, (2, 13)))
    want = jax.jit(build_decoder(config, weights).forward)(tokens)
    got = jax.jit(build_decoder(padded_config, padded).forward)(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_pad_heads_keeps_gqa_grouping_and_reports_cost():
    weights = export_weights(build_decoder(SMOL_GROUPING, seed=0))
    config, padded = pad_heads(SMOL_GROUPING, weights, 8)
    assert (config.num_heads, config.num_kv_heads) == (24, 8)
    q = padded["layers.0.q_proj"].reshape(64, 24, 16)
    assert np.array_equal(q[:, :9], weights["layers.0.q_proj"].reshape(64, 9, 16)) and not q[:, 9:].any()
    assert not padded["layers.0.o_proj"][9 * 16:].any() and not padded["layers.0.k_proj"][:, 3 * 16:].any()
    assert pad_heads(SMOL_GROUPING, weights, 3)[0] is SMOL_GROUPING  # 3 KV heads already divide TP 3: untouched
    smol = get_model_config("smollm2-135m")
    report = padding_report(smol, smol.replace(num_heads=24, num_kv_heads=8))
    assert report["num_heads"] == (9, 24) and report["num_kv_heads"] == (3, 8)
    assert report["kv_overhead"] == pytest.approx(8 / 3 - 1)
    assert 0.3 < report["param_overhead"] < 0.35  # q, k, v, o grow 2.7x; MLP, embedding and norms do not


# ---- 8 virtual devices, in a subprocess -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker() -> dict:
    return run_worker("tests/sharding/sharding_worker.py")


# model -> (KV heads, TP sizes run alone, TP sizes run as 2 data-parallel replicas)
MODELS = {"tiny-llama": (2, (1, 2), ()), "tiny-llama-9q3kv": (3, (1, 2, 4, 8), (2,)),
          "tiny-odd": (3, (1, 8), ()), "tiny-mha": (4, (1, 2, 8), ()), "tiny-mistral": (2, (1, 4, 8), (4,))}


def _runs(worker, model: str) -> list[tuple[str, dict]]:
    _, tps, dp2 = MODELS[model]
    runs = worker["results"][model]
    return [(f"TP {tp}", runs[str(tp)]) for tp in tps] + [(f"DP 2 x TP {tp}", runs[f"dp2-tp{tp}"]) for tp in dp2]


@pytest.mark.parametrize("model", list(MODELS))
def test_parallel_outputs_equal_one_device(worker, model):
    ref = worker["results"][model]["1"]
    for name, run in _runs(worker, model):
        assert run["tokens"] == ref["tokens"], f"{name}: greedy tokens differ"
        assert run["sampled"] == ref["sampled"], f"{name}: seeded n=2 samples differ"
        assert run["tokens_after_update"] == ref["tokens"][0]
        for got, want in zip(run["prompt_logprobs"], ref["prompt_logprobs"]):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)


@pytest.mark.slow
def test_smollm2_data_and_tensor_parallel_equal_one_device(worker, smollm2):
    """The real SmolLM2 (9 query / 3 KV heads, padded to 12 / 4) as 2 replicas x TP 4 against one device."""
    from inference import SamplingParams

    run = worker["results"]["smollm2-135m"]["dp2-tp4"]
    greedy = SamplingParams(temperature=0.0, max_tokens=worker["max_tokens"], ignore_eos=True, prompt_logprobs=1)
    ref = smollm2.generate(prompt_token_ids=run["prompt_ids"], sampling_params=greedy)
    assert run["tokens"] == [o.outputs[0].token_ids for o in ref]
    for got, out in zip(run["prompt_logprobs"], ref):
        want = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert run["kv_heads"] == 4 and run["replica_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("model", [m for m, (_, _, dp2) in MODELS.items() if dp2])
def test_data_parallel_replicas_are_disjoint_and_balanced(worker, model):
    """Each replica holds a whole TP-sharded model on its own devices: per device exactly what the same TP alone
    holds; both replicas get requests."""
    runs = worker["results"][model]
    for tp in MODELS[model][2]:
        run = runs[f"dp2-tp{tp}"]
        devices = run["replica_devices"]
        assert len(devices) == 2 and all(len(d) == tp for d in devices) and not set(devices[0]) & set(devices[1])
        assert run["replica_kv_devices"] == devices
        assert run["replica_param_bytes_per_device"] == [runs[str(tp)]["param_bytes_per_device"]] * 2
        assert run["replica_kv_bytes_per_device"] == [runs[str(tp)]["kv_bytes_per_device"]] * 2
        assert run["num_pages"] == runs["1"]["num_pages"]  # each replica gets the whole KV budget
        assert sorted(run["replica_requests"]) == [2, 3]  # 5 requests, least outstanding tokens first


def test_mla_tensor_and_data_parallel_equal_one_device(worker):
    """DeepSeek-V2 in miniature (MLA + MoE): query heads split (zero-padded 4 -> 8 at TP 8), the latent cache
    replicated on every device of a replica (it has no head axis), outputs equal to one device."""
    runs = worker["results"]["tiny-deepseek-v2"]
    ref = runs["1"]
    for name in ("8", "dp2-tp4"):  # 1 head a device in each replica at TP 4; 4 heads padded to 8 at TP 8
        run = runs[name]
        assert run["tokens"] == ref["tokens"] and run["sampled"] == ref["sampled"], name
        assert run["tokens_after_update"] == ref["tokens"][0]
        for got, want in zip(run["prompt_logprobs"], ref["prompt_logprobs"]):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)
    for tp in (8,):
        run = runs[str(tp)]
        assert run["kv_devices"] == tp and run["kv_bytes_per_device"] == ref["kv_bytes_total"]  # replicated
        assert run["param_bytes_per_device"] < ref["param_bytes_total"]


@pytest.mark.parametrize("model, widths", [("tiny-deepseek-v2", (32, 32)), ("tiny-deepseek-odd", (20, 24))])
def test_moe_experts_split_over_model_axis(worker, model, widths):
    """The routed experts at TP 8: each device holds 1/8 of their (padded) bytes, the outputs equal one device's
    (with the expert width zero-padded where TP does not divide it), and the compiled decode step never gathers an
    expert weight (its only all-gathers are of activations)."""
    runs = worker["results"][model]
    ref, run = runs["1"], runs["8"]
    assert run["tokens"] == ref["tokens"] and run["sampled"] == ref["sampled"]
    for got, want in zip(run["prompt_logprobs"], ref["prompt_logprobs"]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    real, padded = widths
    assert ref["expert_bytes"]["global"] * padded == run["expert_bytes"]["global"] * real
    assert run["expert_bytes"]["per_device"] * 8 == run["expert_bytes"]["global"]
    assert run["specs"]["layers.1.mlp.gate_proj.value"] == str(P(None, None, "model"))
    assert run["specs"]["layers.1.mlp.down_proj.value"] == str(P(None, "model", None))
    assert run["specs"]["layers.1.mlp.router.value"] == str(P())
    gathered = {k.split("[", 1)[1].rstrip("]") for k in run["collectives"] if k.startswith("all-gather")}
    assert not gathered & set(run["expert_bytes"]["shapes"]), run["collectives"]
    assert any(k.startswith("all-reduce") for k in run["collectives"])  # row-parallel down_proj partial sums


def test_decode_never_compiles_after_warmup_under_tensor_parallelism(worker):
    assert worker["warmup"]["warmed"] > 0 and worker["warmup"]["decode_compiles_after_warmup"] == 0


def test_data_parallel_chat_stream_and_background(worker):
    """Two replicas behind one LLM: chat, stream and a background loop give what one device gives, both replicas
    take requests, and nothing is left behind."""
    one, two = worker["api"]["1"], worker["api"]["dp2"]
    for key in ("chat", "stream", "background"):
        assert two[key] == one[key], key
    assert all(len(tokens) == 5 for tokens in two["stream"] + two["background"])
    assert len(two["assigned"]) == 2 and min(two["assigned"]) >= 3  # 10 requests, spread over both replicas
    assert not two["unfinished"] and two["left"] == 0


def test_orbax_restores_straight_into_shards(worker):
    """A checkpoint restored with target shardings: every array arrives in its TP-2 layout (half the bytes per
    device), and the model built from it generates what the preset does."""
    result, ref = worker["orbax"], worker["results"]["tiny-llama"]["2"]
    assert result["placed_by_restore"]
    assert result["restored_bytes_per_device"] * 2 <= result["restored_bytes_total"] + 4096  # norms replicated
    assert result["padded_needs_host"]  # 9/3 heads at TP 2: padded on the host, then placed
    assert result["tokens"] == ref["tokens"]
    for got, want in zip(result["prompt_logprobs"], ref["prompt_logprobs"]):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("model", list(MODELS))
def test_bytes_per_device_shrink_with_tp(worker, model):
    kv_heads, sizes, _ = MODELS[model]
    runs = worker["results"][model]
    ref = runs["1"]
    previous = None
    for tp in sizes:
        run = runs[str(tp)]
        assert run["num_pages"] == ref["num_pages"]  # the same cache (in tokens) at every TP
        assert run["param_devices"] == tp and run["kv_devices"] == tp
        # KV: each device holds ceil(K / tp) whole KV heads of the K real ones (padding heads at the tail).
        assert run["kv_bytes_per_device"] * kv_heads == ref["kv_bytes_total"] * -(-kv_heads // tp)
        # Parameters: exactly 1/tp of the padded model's split weights plus the replicated norms.
        split = run["param_bytes_global"] - run["param_bytes_replicated"]
        assert run["param_bytes_per_device"] * tp == split + tp * run["param_bytes_replicated"]
        assert tp == 1 or run["param_bytes_replicated"] < 0.01 * ref["param_bytes_total"]
        # Padding (heads up to 2.7x, here on a model whose attention is a large share) costs less than 2x in total.
        assert run["param_bytes_global"] < 2 * ref["param_bytes_total"]
        if previous is not None:
            assert run["param_bytes_per_device"] < previous
        previous = run["param_bytes_per_device"]
    if "2" in runs and kv_heads % 2 == 0:  # nothing to pad at TP 2: exactly half, up to the replicated norms
        assert runs["2"]["param_bytes_per_device"] <= ref["param_bytes_total"] / 2 + 4096


def test_specs_and_collectives(worker):
    run = worker["results"]["tiny-llama"]["2"]
    specs = run["specs"]
    assert specs["embed.embedding.value"] == str(P("model", None))
    assert specs["lm_head.kernel.value"] == str(P(None, "model"))
    assert specs["layers.0.attn.q_proj.kernel.value"] == str(P(None, "model"))
    assert specs["layers.0.attn.o_proj.kernel.value"] == str(P("model", None))
    assert specs["layers.0.mlp.down_proj.kernel.value"] == str(P("model", None))
    assert specs["layers.0.attn_norm.weight.value"] == str(P())
    assert run["kv_spec"] == str(P("model"))  # whole KV heads per device: the caches' leading axis
    # A decode step of 4 tokens: one all-reduce for the embedding gather and two per layer (o_proj, down_proj),
    # then one all-gather of the [4, vocab] logits (never of the [hidden, vocab] LM-head weight).
    assert run["collectives"] == {"all-reduce f32[4,64]": 5, "all-gather f32[4,512]": 1}
