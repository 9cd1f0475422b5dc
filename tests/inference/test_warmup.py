"""Warm-up covers serving: every step shape a batch can take is enumerated (prefill, speculative verification), the
folded extras leave every row's tokens as they were, and after `warmup()` a varied workload compiles nothing, on a
plain engine and on a speculating one (draft model) over the same runner."""

import json

import jax
import numpy as np
import pytest

from inference import LLM, SamplingParams
from inference.engine.compile_budget import count_variants
from inference.engine.config import SpeculativeConfig
from inference.engine.llm_engine import Engine
from inference.engine.scheduled_batch import ScheduledBatch
from inference.engine.sequence import Sequence
from inference.runtime.batch import BucketLimits, build_model_input
from inference.runtime.step_variants import StepFlags, fold_extras
from inference.runtime.warmup import StepShape, prefill_shapes, verify_shapes
from inference.sampling.sampler import SamplingTensors, sample_with_logprobs
from inference.spec_decode.draft import load_draft, make_draft_proposer
from inference.structured.params import StructuredOutputsParams
from scripts.tools.compile_budget import count_before_after
from tests.llm_configs import engine_swapped
from tests.tiny_folder import make_tiny_hf_folder

CUT = dict(query_buckets=False, page_buckets=False)


def _seq(i: int, computed: int, count: int, page: int, drafts: int = 0) -> Sequence:
    seq = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1] * (computed + count - drafts),
                   num_prompt_tokens=max(computed + count - drafts - 1, 1), params=SamplingParams(), seed=0,
                   arrival_order=i)
    seq.num_computed_tokens = computed
    seq.spec_tokens = [2] * drafts
    seq.block_tables = [list(range(-(-(computed + count) // page)))]
    return seq


def _shape(inp) -> StepShape:
    return StepShape(inp.tokens.shape[0], inp.attn.kv_lens.shape[0], inp.attn.page_indices.shape[-1],
                     inp.attn.max_q_len)


@pytest.mark.parametrize("limits", [BucketLimits(max_tokens=24, max_seqs=3, max_pages_per_seq=10, fine_pages=True),
                                    BucketLimits(max_tokens=64, max_seqs=8, max_pages_per_seq=16),
                                    BucketLimits(max_tokens=64, max_seqs=8, max_pages_per_seq=16, **CUT)])
def test_prefill_shapes_hold_every_batch_shape(limits):
    rng = np.random.default_rng(3)
    page = 4
    shapes = set(prefill_shapes(limits, page))
    seen = set()
    for _ in range(6000):
        budget, seqs, counts = limits.max_tokens, [], []
        for i in range(int(rng.integers(1, limits.max_seqs + 1))):
            if budget == 0:
                break
            context = limits.max_pages_per_seq * page
            computed = int(rng.integers(0, context)) if rng.random() < 0.5 else 0
            room = min(budget, context - computed)
            count = min(room, int(2 ** rng.uniform(0, np.log2(room + 1))))  # short chunks as often as long
            seqs.append(_seq(i, computed, count, page))
            counts.append(count)
            budget -= count
        batch = ScheduledBatch(seqs, counts)
        if batch.is_decode:
            continue
        shape = _shape(build_model_input(batch, page, limits)[0])
        assert shape in shapes, (shape, counts)
        seen.add(shape)
    # the enumeration is not padded with shapes no batch reaches (most of them came up at random)
    assert len(seen) >= 0.8 * len(shapes), (len(seen), len(shapes))


def test_cut_axes_shrink_the_shapes():
    """Under the C++ kernel's limits (no query or page buckets) a prefill shape is (tokens, sequences) only."""
    full = BucketLimits(max_tokens=512, max_seqs=32, max_pages_per_seq=128)
    cut = BucketLimits(max_tokens=512, max_seqs=32, max_pages_per_seq=128, **CUT)
    shapes = prefill_shapes(cut, 16)
    assert all(s.max_q_len == s.num_tokens and s.pages_per_seq == 128 for s in shapes)
    assert len({(s.num_tokens, s.num_seqs) for s in prefill_shapes(full, 16)}) == len(shapes) < 50
    assert len(prefill_shapes(full, 16)) > 10 * len(shapes)


@pytest.mark.parametrize("limits", [BucketLimits(max_tokens=32, max_seqs=6, max_pages_per_seq=12),
                                    BucketLimits(max_tokens=32, max_seqs=6, max_pages_per_seq=12, **CUT)])
def test_verify_shapes_hold_every_verification_batch(limits):
    rng = np.random.default_rng(5)
    page, k = 4, 3
    shapes = set(verify_shapes(limits, page, k))
    seen = set()
    for _ in range(1500):
        n = int(rng.integers(1, limits.max_seqs + 1))
        drafts = rng.integers(0, k + 1, n) * (rng.random(n) < rng.random())  # dense and sparse drafting
        drafts[int(rng.integers(n))] = int(rng.integers(1, k + 1))  # a verification step: some row has drafts
        longest = int(2 ** rng.uniform(0, np.log2(limits.max_pages_per_seq * page - k)))  # short contexts too
        seqs = [_seq(i, int(rng.integers(1, longest + 1)), 1 + int(d), page, int(d)) for i, d in enumerate(drafts)]
        inp, _ = build_model_input(ScheduledBatch(seqs, [1 + int(d) for d in drafts]), page, limits, num_spec=k)
        assert _shape(inp) in shapes
        seen.add(_shape(inp))
    assert len(seen) == len(shapes)


def test_folded_extras_leave_tokens_and_logits_alone():
    """An all-ones mask and no-op penalties padded to the context change no row: the same tokens, greedy and
    sampled (filtered too), and for rows with logprobs the same values."""
    from inference.sampling.params import SamplingParams as P

    vocab, rows = 300, 6
    logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 3
    params = [P(temperature=0.0), P(temperature=0.9, seed=1), P(temperature=0.8, top_k=7, top_p=0.9),
              P(temperature=1.0, min_p=0.05), P(temperature=0.7, logprobs=3), P(temperature=0.0, logprobs=2)]
    sampling = SamplingTensors.from_params(params, list(range(rows)), [3] * rows, pad_to=rows)
    folded = fold_extras(sampling, StepFlags(True, True), vocab_size=vocab, penalty_len=64)
    assert folded.token_mask is not None and folded.penalties.prompt_ids.shape == (rows, 64)
    plain = jax.jit(lambda x, t: sample_with_logprobs(x, t, use_filters=True, num_top=5))
    a, b = plain(logits, sampling), plain(logits, folded)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprob, b.logprob)
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    assert fold_extras(sampling, StepFlags(True, False), vocab_size=vocab, penalty_len=64) is sampling
    pen = [P(temperature=0.0, repetition_penalty=1.5)] + params[1:]
    penalized = SamplingTensors.from_params(pen, list(range(rows)), [3] * rows, pad_to=rows,
                                            prompt_token_ids=[[5, 6]] * rows, output_token_ids=[[7]] * rows)
    want = plain(logits, penalized)
    got = plain(logits, fold_extras(penalized, StepFlags(True, True), vocab_size=vocab, penalty_len=64))
    np.testing.assert_array_equal(want.tokens, got.tokens)
    np.testing.assert_array_equal(want.logprob, got.logprob)
    with pytest.raises(ValueError, match="exceed the folded length 8"):
        fold_extras(penalized, StepFlags(extras=True), vocab_size=vocab, penalty_len=8)
    # With the runner's sharding the large parts live on the device: the no-op ones made once (the same arrays at
    # every step, nothing to send), a real mask and real ids put there too; the per-row parts stay numpy.
    where = jax.sharding.make_single_device_sharding(jax.devices()[0])
    first, again = (fold_extras(sampling, StepFlags(True, True), vocab_size=vocab, penalty_len=64, sharding=where)
                    for _ in range(2))
    assert first.token_mask is again.token_mask and first.penalties.prompt_ids is again.penalties.prompt_ids
    masked = SamplingTensors.from_params(pen, list(range(rows)), [3] * rows, pad_to=rows,
                                         prompt_token_ids=[[5, 6]] * rows, output_token_ids=[[7]] * rows,
                                         token_mask=np.full((rows, 10), -1, np.int32))
    real = fold_extras(masked, StepFlags(True, True), vocab_size=vocab, penalty_len=64, sharding=where)
    for folded in (first, real):
        big = (folded.token_mask, folded.penalties.prompt_ids, folded.penalties.output_ids)
        assert all(isinstance(x, jax.Array) and x.committed and x.sharding == where for x in big)
        assert isinstance(folded.temperature, np.ndarray) and isinstance(folded.mask_in_raw, np.ndarray)
    np.testing.assert_array_equal(plain(logits, real).tokens, want.tokens)


def _tiny_folder_without_window(path):
    """The tiny Mistral fixture with full attention, so a layer of it can be its draft model."""
    folder = make_tiny_hf_folder(path)
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = None
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _workload(rng, structured: bool):
    shared = rng.integers(3, 256, 17).tolist()
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in (3, 9, 15, 22, 30)]
    prompts += [shared + [5], shared + [6, 7]]  # the second one hits the first one's cached pages
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=1, max_tokens=8, ignore_eos=True, stop=["a", "zz"]),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=2, max_tokens=5, n=2,
                             allowed_token_ids=list(range(3, 40))),
              SamplingParams(temperature=1.0, min_p=0.1, seed=3, max_tokens=3, prompt_logprobs=1, n=2),
              SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0.7, seed=4, max_tokens=4, n=2, frequency_penalty=0.4, top_p=0.8),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={7: 5.0, 9: -100.0})]
    if not structured:  # the speculating engine: no penalties (refused with speculation)
        params[4] = params[4].replace(repetition_penalty=1.0, presence_penalty=0.0)
        params[5] = params[5].replace(frequency_penalty=0.0)
    else:  # sparse logit edits of another kind, folded into the extras as logit_bias is (refused with speculation)
        params[1] = params[1].replace(min_tokens=3, bad_words=["zz"])
        prompts.append(rng.integers(3, 256, 11).tolist())
        params.append(SamplingParams(temperature=0.0, max_tokens=8,
                                     structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])))
    return prompts, params


def test_warmed_up_engines_compile_nothing(tmp_path):
    folder = _tiny_folder_without_window(tmp_path / "tiny")
    llm = LLM(str(folder), max_num_batched_tokens=8, max_num_seqs=2, page_size=8, max_model_len=32,
              kv_cache_memory_bytes=1 << 18, seed=0, compilation_cache_dir=None)
    expected = count_variants(llm.engine)
    assert set(expected) == {"decode", "prefill", "copy_pages"}  # async scheduling's token feed is in the step
    budget = count_before_after(llm.engine)  # what scripts/tools/compile_budget.py reports
    assert budget["total_after"] == sum(expected.values()) < budget["before_without_penalty_lengths"]
    compiled = llm.warmup()
    counts = llm.runner.num_compilations()
    assert compiled == sum(expected.values()) == sum(counts.values())  # each variant one executable, none twice
    rng = np.random.default_rng(0)
    prompts, params = _workload(rng, structured=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    outs += llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4])
    assert all(o.error is None and o.finished for o in outs)
    assert outs[-1].prompt_logprobs is not None and outs[0].outputs[0].logprobs is not None
    assert outs[7].outputs[0].text in ("yes", "no", "maybe")
    assert all(3 <= t < 40 for o in outs[2].outputs for t in o.token_ids)  # allowed_token_ids, through the mask
    assert llm.engine.block_manager.prefix_hits_tokens > 0
    assert llm.runner.num_compilations() == counts

    # A second engine over the same runner speculates with a one-layer draft of the same model: its warm-up adds
    # the verification steps and the draft's own steps only.
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, model=f"{folder}:layers=0")
    draft = load_draft(spec.model, target_config=llm.runner.config, target_tokenizer=llm.tokenizer)
    proposer = make_draft_proposer(draft, k=2, num_pages=llm.runner.num_pages, page_size=llm.runner.page_size)
    engine = Engine(llm.runner, llm.tokenizer, llm.engine.scheduler.config, proposer=proposer,
                    speculative_config=spec)
    expected = count_variants(engine)
    assert expected["verify"] > 0 and expected["draft"] > 0
    compiled = engine.warmup()
    assert compiled == expected["verify"] + expected["draft"]
    counts, draft_counts = llm.runner.num_compilations(), proposer.num_compilations()
    with engine_swapped(llm, engine):
        prompts, params = _workload(np.random.default_rng(1), structured=False)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert all(o.error is None and o.finished for o in outs)
    assert engine.stats.spec_passes > 0  # drafts were verified
    assert llm.runner.num_compilations() == counts and proposer.num_compilations() == draft_counts
