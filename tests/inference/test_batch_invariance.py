"""`LLM(batch_invariant=True)`: one request's logprobs (raw top-k dicts, bit for bit) and its greedy and seeded tokens
do not depend on its companions, its position in the batch, the prefill chunk size, a prefix-cache hit or a forced
preemption; `inference.rl.log_probs` returns the engine's logprobs bitwise, raw and processed, greedy and sampled.
Also the pieces: the row-wise ops a row's bits go through are the same for any row count, the C++ paged attention
gives a query row the same bits in any chunking, and the settings the mode cannot make invariant are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import SamplingParams
from inference.engine.config import EngineConfig
from inference.rl.logprobs import log_probs, processed_tensors
from inference.sampling.sampler import compute_logprobs
from kernels_pallas.attention.causal import dense_causal_attention, paged_causal_attention
from kernels_pallas.attention.cpu import ragged_paged_attention_cpu
from configs.presets import MODEL_PRESETS
from models.batch_invariant import make_batch_invariant
from models.decoder import build_decoder
from models.layers import RMSNorm, activation, apply_rope, rope_inv_freq
from tests.llm_configs import LLMConfig

TINY = LLMConfig("tiny-llama", dict(kv_cache_memory_bytes=4 << 20, page_size=4, max_num_seqs=8,
                                    max_num_batched_tokens=16, batch_invariant=True))
ROWS = (1, 2, 5, 8, 17, 64)  # around XLA:CPU's row blocking (2-17 rows broke its RMSNorm at width 64)


def _rows_invariant(f, width: int) -> None:
    x = jnp.asarray(np.random.default_rng(width).standard_normal((300, width)), jnp.float32)
    full = np.asarray(jax.jit(f)(x))
    for m in ROWS:
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x[:m])), full[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("width", [64, 100, 576])
def test_row_wise_ops_do_not_depend_on_the_row_count(width):
    """XLA:CPU's RMSNorm is not row-invariant at widths 64 and 100 (its mean vectorizes across short rows), so the
    mode sums the squares in a fixed order; activations and RoPE (C++ tables) are row-wise as XLA compiles them."""
    norm = RMSNorm(width, 1e-5)
    norm.batch_invariant = True
    inv = rope_inv_freq(4, 10000.0, None)
    _rows_invariant(lambda x: jnp.concatenate([norm(x), activation(x, "silu") * x + x, apply_rope(
        x.reshape(x.shape[0], -1, 4), jnp.arange(x.shape[0]), inv).reshape(x.shape)], axis=1), width)


@pytest.mark.parametrize("vocab", [256, 512, 49152])
def test_log_softmax_over_the_vocab_does_not_depend_on_the_row_count(vocab):
    tokens = lambda x: jnp.full((x.shape[0],), 3, jnp.int32)  # noqa: E731
    _rows_invariant(lambda x: jnp.concatenate([compute_logprobs(x * 4, tokens(x), 5, invariant=True)[i].reshape(
        x.shape[0], -1) for i in (0, 2)], axis=1), vocab)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, vocab)), jnp.float32)
    np.testing.assert_allclose(np.asarray(compute_logprobs(x, tokens(x), 5, invariant=True)[2]),
                               np.asarray(compute_logprobs(x, tokens(x), 5)[2]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [300, 4096])
def test_top_p_keeps_the_same_tokens_whatever_the_row_count(vocab):
    """Top-p's threshold comes from float sums (the kept mass, its running total over the sorted candidates, and
    the bisection's mass for flat rows): in the mode they run in a fixed order, so the kept set is a row's own."""
    from inference.sampling.sampler import _filter

    def f(x):
        m = x.shape[0]
        return _filter(x * 3, jnp.zeros((m,), jnp.int32), jnp.full((m,), 0.9, jnp.float32),
                       jnp.zeros((m,), jnp.float32), invariant=True)

    _rows_invariant(f, vocab)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, vocab)) * 3, jnp.float32)
    same = _filter(x, jnp.zeros((8,), jnp.int32), jnp.full((8,), 0.9, jnp.float32), jnp.zeros((8,), jnp.float32))
    got = f(x / 3)
    assert (np.isfinite(np.asarray(got)) == np.isfinite(np.asarray(same))).mean() > 0.999  # the same filter


@pytest.mark.parametrize("head_dim", [16, 64])
def test_paged_attention_rows_do_not_depend_on_the_chunking(head_dim):
    """A query row's result is the same bits whether its sequence's prompt is one block, chunks of 1, 3, 7 or 13
    (its KV pages in another order too); and the virtual-cache path equals the dense one to rounding."""
    rng = np.random.default_rng(head_dim)
    kv_heads, group, page_size, length, pages = 2, 3, 4, 41, 11
    kv = jnp.asarray(rng.standard_normal((kv_heads, pages, page_size, 2 * head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((length, kv_heads * group, head_dim)), jnp.float32)
    i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731

    def run(begin, end, cache, order):
        out = ragged_paged_attention_cpu(q[begin:end], cache, i32(end), jnp.asarray(order, jnp.int32)[None],
                                         i32(0, end - begin), i32(1), sm_scale=0.3)
        return np.asarray(out)

    full = run(0, length, kv, np.arange(pages))
    shuffled = rng.permutation(pages)
    moved = kv.at[:, shuffled].set(kv)  # logical page j now lives at shuffled[j]
    for chunk in (1, 3, 7, 13):
        for begin in range(0, length, chunk):
            end = min(length, begin + chunk)
            np.testing.assert_array_equal(run(begin, end, moved, shuffled), full[begin:end], err_msg=f"chunk {chunk}")
    k = jnp.asarray(rng.standard_normal((2, 9, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 9, kv_heads, head_dim)), jnp.float32)
    qb = jnp.asarray(rng.standard_normal((2, 9, kv_heads * group, head_dim)), jnp.float32)
    paged = paged_causal_attention(qb, k, v, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense_causal_attention(qb, k, v, sm_scale=0.3)),
                               rtol=1e-5, atol=1e-5)
    g_paged = jax.grad(lambda q: jnp.sum(jnp.sin(paged_causal_attention(q, k, v, sm_scale=0.3))))(qb)
    g_dense = jax.grad(lambda q: jnp.sum(jnp.sin(dense_causal_attention(q, k, v, sm_scale=0.3))))(qb)
    np.testing.assert_allclose(np.asarray(g_paged), np.asarray(g_dense), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(quantization="int8"), "quantization"), (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(speculative_method="ngram"), "speculative"), (dict(enable_lora=True), "enable_lora"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"), (dict(dtype="bfloat16"), "dtype"),
    (dict(attn_impl="reference"), "attn_impl"), (dict(batch_invariant=1), "True or False")])
def test_settings_it_cannot_make_invariant_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_kwargs(**{"batch_invariant": True, **kwargs})


def test_models_it_cannot_make_invariant_are_refused():
    with pytest.raises(ValueError, match="MLA"):
        make_batch_invariant(build_decoder(MODEL_PRESETS["tiny-deepseek-v2"]))


@pytest.fixture(scope="module")
def llm():
    return TINY.build()


def _top(out) -> tuple[list[int], list[dict[int, float]]]:
    c = out.outputs[0]
    return list(c.token_ids), [{t: lp.logprob for t, lp in entry.items()} for entry in c.logprobs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=5, logprobs_mode="raw")
SEEDED = SamplingParams(temperature=1.0, seed=123, max_tokens=5, ignore_eos=True, logprobs=5, logprobs_mode="raw")


def test_a_requests_logprobs_do_not_depend_on_its_batch(llm):
    rng = np.random.default_rng(0)
    vocab = llm.config.vocab_size
    targets = [rng.integers(1, vocab, 37).tolist(), rng.integers(1, vocab, 22).tolist()]
    params = [GREEDY, SEEDED]
    llm.engine.reset_prefix_cache()
    alone = [_top(llm.generate(prompt_token_ids=[t], sampling_params=p)[0]) for t, p in zip(targets, params)]
    # The prompts are prefix-cached now: hits give the same bits.
    assert [_top(llm.generate(prompt_token_ids=[t], sampling_params=p)[0])
            for t, p in zip(targets, params)] == alone
    for trial in range(20):
        if trial % 2:
            llm.engine.reset_prefix_cache()
        others = [rng.integers(1, vocab, int(rng.integers(1, 30))).tolist() for _ in range(int(rng.integers(0, 5)))]
        batch = list(zip(others, [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=int(i),
                                                 max_tokens=int(rng.integers(2, 7)), ignore_eos=True)
                                  for i in range(len(others))]))
        positions = []
        for t, p in zip(targets, params):  # each target at a random position among the companions
            pos = int(rng.integers(0, len(batch) + 1))
            positions = [q + (q >= pos) for q in positions] + [pos]
            batch.insert(pos, (t, p))
        outs = llm.generate(prompt_token_ids=[b[0] for b in batch], sampling_params=[b[1] for b in batch])
        assert [_top(outs[pos]) for pos in positions] == alone, f"trial {trial}"
    # A larger step budget (one-chunk prefills, other token buckets) gives the same bits.
    other = TINY.build(max_num_batched_tokens=64)
    assert [_top(other.generate(prompt_token_ids=[t], sampling_params=p)[0])
            for t, p in zip(targets, params)] == alone
    # Preempted after two tokens, recomputed from its prompt and those tokens: the same tokens and logprobs.
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.add_request("preempted", targets[0], GREEDY)
    seq = engine.requests["preempted"].seqs[0]
    while seq.num_output_tokens < 2:
        engine.step()
    preemptions = engine.scheduler.num_preemptions
    engine.scheduler.preempt(seq)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == "preempted" and o.finished), final)
    engine.pop_finished("preempted")
    assert engine.scheduler.num_preemptions == preemptions + 1
    assert _top(final) == alone[0]


PROCESSED = dict(logprobs_mode="processed", temperature=0.7, top_k=40, top_p=0.9, min_p=0.02,
                 repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_log_probs_equal_the_engines_bitwise(llm, mode):
    prompts = [[5, 17, 300, 42, 9, 11], [7, 8, 9, 10, 100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    extra = PROCESSED if mode == "processed" else dict(logprobs_mode="raw", temperature=1.0)
    params = [SamplingParams(max_tokens=9, ignore_eos=True, logprobs=0, seed=7, **{**extra, "temperature": 0.0}),
              SamplingParams(max_tokens=9, ignore_eos=True, logprobs=0, seed=8, **extra)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    ids = np.zeros((2, max(map(len, seqs))), np.int32)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
    sampling, use_filters = (None, False) if mode == "raw" else processed_tensors(params, ids, list(map(len, prompts)))
    got = np.asarray(jax.jit(log_probs, static_argnames=("use_filters",))(
        (llm.runner.graphdef, llm.get_params()), ids, sampling=sampling, use_filters=use_filters))
    for b, (p, o) in enumerate(zip(prompts, outs)):
        c = o.outputs[0]
        engine = np.asarray([e[t].logprob for e, t in zip(c.logprobs, c.token_ids)], np.float32)
        assert np.all(np.isfinite(engine))
        np.testing.assert_array_equal(got[b, len(p):len(p) + len(c.token_ids)], engine)


def test_tied_head_qk_norm_and_sliding_windows_too():
    """tiny-gemma3: a tied LM head (the transposed kernel), QK-norm, Gemma norms, sliding-window and full layers
    with two RoPE bases: batch-invariant and equal to `log_probs`, bit for bit."""
    gemma = TINY.replace("tiny-gemma3").build()
    rng = np.random.default_rng(3)
    target = rng.integers(1, gemma.config.vocab_size, 29).tolist()
    alone = _top(gemma.generate(prompt_token_ids=[target], sampling_params=SEEDED)[0])
    for count in (2, 5):
        others = [rng.integers(1, gemma.config.vocab_size, int(rng.integers(3, 30))).tolist() for _ in range(count)]
        outs = gemma.generate(prompt_token_ids=others + [target],
                              sampling_params=[SamplingParams(max_tokens=4, ignore_eos=True)] * count + [SEEDED])
        assert _top(outs[-1]) == alone
    ids = np.asarray([target + alone[0]], np.int32)
    got = np.asarray(jax.jit(log_probs)((gemma.runner.graphdef, gemma.get_params()), ids))[0, len(target):]
    np.testing.assert_array_equal(got, np.asarray([e[t] for e, t in zip(alone[1], alone[0])], np.float32))


def test_grpo_first_inner_ratio_is_exactly_one(llm):
    """scripts/grpo_example.py on the batch-invariant engine: the trainer's `log_probs` under the weights the rollout
    used reproduces the engine's logprobs bitwise, so the importance ratio is exactly 1 on each step's first inner
    step, before and after an update reached the engine."""
    from scripts.grpo_example import run

    old = llm.get_params()
    try:
        records = run(llm, steps=2, problems_per_step=2, group=4, max_tokens=4, inner_steps=1, learning_rate=1e-3,
                      temperature=1.0, seed=0)
    finally:
        llm.update_weights(old)
    assert [r["ratio_max_dev"] for r in records] == [0.0, 0.0]
    assert records[0]["kl"] == 0.0 < records[1]["kl"]  # the second rollout ran on updated weights


def test_async_scheduling_gives_the_synchronous_engines_bits(llm):
    """The default async scheduling changes which rows a step holds (a sequence its in-flight token ends by length
    gets none; one it ends by a stop string wastes one): in this mode that changes no bit, so async and synchronous
    outputs are identical, logprobs included."""
    import dataclasses

    from inference.engine.llm_engine import Engine
    from tests.llm_configs import engine_swapped

    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, llm.config.vocab_size, int(n)).tolist() for n in (5, 13, 22, 3, 9)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=5,
                             logprobs_mode="raw") for i in range(len(prompts))]
    assert llm.engine.async_scheduling
    overlapped = llm.engine.async_stats.overlapped_steps
    want = [_top(o) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.engine.async_stats.overlapped_steps > overlapped  # it really overlapped
    sync = Engine(llm.runner, llm.tokenizer, dataclasses.replace(llm.engine.scheduler.config, async_scheduling=False))
    with engine_swapped(llm, sync):
        got = [_top(o) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
