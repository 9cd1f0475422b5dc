"""The kept input rows (inference/engine/input_rows.py): every general build's page tables and sampling rows,
gathered from rows kept across steps, equal the ones read from the sequences, array for array, under continuous
batching with preemption, prefix-cache hits, copy on write, forks, aborts, speculative verification and sliding-window
KV cache groups; a sequence is read into a row once, and finished sequences leave their rows."""

from __future__ import annotations

import numpy as np
import pytest

from inference import SamplingParams
from inference.engine import llm_engine
from inference.runtime.batch import build_model_input
from inference.sampling.sampler import SamplingTensors
from tests.llm_configs import TINY_ENGINE, TINY_SPEC


def _compare(a, b, path="") -> None:
    """Every array leaf of two pytrees of numpy arrays (inputs, sampling tensors) equal."""
    if hasattr(a, "__dataclass_fields__"):
        for name in a.__dataclass_fields__:
            _compare(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, path


@pytest.fixture
def checked(monkeypatch):
    """Check every general build of the engines made in the test against a build from the sequences; returns the
    counts of checked builds and rows."""
    counts = {"builds": 0, "rows": 0}
    build = llm_engine.build_model_input
    from_params = SamplingTensors.from_params.__func__

    def build_both(batch, *args, kept_tables=None, **kwargs):
        assert kept_tables is not None, "the engine builds every step from its kept rows"
        got = build(batch, *args, kept_tables=kept_tables, **kwargs)
        _compare(got[0], build_model_input(batch, *args, **kwargs)[0], "input")
        assert got[1] == build_model_input(batch, *args, **kwargs)[1]
        counts["builds"] += 1
        counts["rows"] += len(batch.seqs)
        counts["seeds"] = [s.seed for s in batch.seqs]  # the engine's next `from_params` is of these rows
        return got

    def sampling_both(cls, params, seeds, steps, pad_to, *args, rows=None, **kwargs):
        assert rows is not None
        got = from_params(cls, params, seeds, steps, pad_to, *args, rows=rows, **kwargs)
        _compare(got, from_params(cls, params, counts["seeds"], steps, pad_to, *args, **kwargs), "sampling")
        return got

    monkeypatch.setattr(llm_engine, "build_model_input", build_both)
    monkeypatch.setattr(SamplingTensors, "from_params", classmethod(sampling_both))
    return counts


def _requests(rng: np.random.Generator, count: int, vocab: int = 500):
    """Prompts behind a few shared prefixes (prefix-cache hits and copy on write), some with n=2 (forks), a mix of
    greedy, seeded and filtered sampling."""
    prefixes = [rng.integers(1, vocab, int(rng.integers(5, 14))).tolist() for _ in range(3)]
    out = []
    for i in range(count):
        prompt = prefixes[i % 3] + rng.integers(1, vocab, int(rng.integers(1, 20))).tolist()
        params = SamplingParams(n=2 if i % 5 == 0 else 1, temperature=0.0 if i % 3 == 0 else 0.9,
                                top_k=[0, 5, 50][i % 3], top_p=[1.0, 0.8][i % 2], seed=i,
                                max_tokens=int(rng.integers(2, 30)), ignore_eos=True)
        out.append((f"r{i}", prompt, params))
    return out


def _drive(engine, requests, rng: np.random.Generator) -> dict[str, list]:
    """Requests join a few a step, a tenth are aborted after a few steps; each one's final token ids."""
    pending, finals, step = list(requests), {}, 0
    aborts = {rid: int(rng.integers(2, 8)) for rid, _, _ in requests if rng.random() < 0.1}
    while pending or engine.has_unfinished_requests():
        for _ in range(int(rng.poisson(2))):
            if pending:
                engine.add_request(*pending.pop(0))
        step += 1
        for out in engine.step():
            if out.finished or aborts.get(out.request_id, 1 << 30) <= step:
                if not out.finished:
                    engine.abort(out.request_id)
                    out = engine.output_of(out.request_id)
                finals[out.request_id] = [c.token_ids for c in out.outputs]
                engine.pop_finished(out.request_id)
        engine.input_rows.check(engine.scheduler.running)
    return finals


@pytest.mark.parametrize("policy,async_scheduling", [("mixed", True), ("prefill_first", False)])
def test_kept_rows_equal_the_sequences_under_churn_and_preemption(checked, policy, async_scheduling):
    """A 40-page pool (preemptions), prefix hits, forks and aborts: every build equals the one from the sequences,
    and the engine's outputs equal those of an engine with a pool large enough for all."""
    pages = 40
    small = TINY_ENGINE.build(kv_cache_memory_bytes=pages * 4 * 2 * 2 * 2 * 16 * 4, max_num_seqs=8,
                              scheduling_policy=policy, async_scheduling=async_scheduling)
    assert small.runner.num_pages == pages
    requests = _requests(np.random.default_rng(0), 60)
    got = _drive(small.engine, requests, np.random.default_rng(1))
    engine = small.engine
    assert engine.scheduler.num_preemptions > 0, "the pool should have been too small"
    assert engine.block_manager.prefix_hits_tokens > 0
    # Rows are read once per sequence (again only after their rows were dropped), not once per step.
    assert checked["builds"] > 50 and engine.input_rows.rows_read < checked["rows"] / 3
    assert len(engine.input_rows) <= engine.input_rows.capacity
    large = TINY_ENGINE.build(kv_cache_memory_bytes=1 << 22, max_num_seqs=8, scheduling_policy=policy,
                              async_scheduling=async_scheduling)
    want = _drive(large.engine, requests, np.random.default_rng(1))
    assert large.engine.scheduler.num_preemptions == 0
    greedy = {rid for rid, _, params in requests if params.temperature == 0.0}
    for rid in greedy & got.keys() & want.keys():
        if len(got[rid][0]) == len(want[rid][0]):  # an abort cuts at a step, which differs with the pool
            assert got[rid] == want[rid], rid


def test_rows_run_out_and_are_taken_back(checked):
    """More sequences than rows over a run (two rows a batch slot): rows of sequences that left are freed, those of
    finished sequences at their release."""
    llm = TINY_ENGINE.build(max_num_seqs=2)
    engine = llm.engine
    assert engine.input_rows.capacity == 4
    requests = _requests(np.random.default_rng(2), 12)
    finals = _drive(engine, requests, np.random.default_rng(3))
    assert len(finals) == 12 and engine.input_rows.rows_read >= 12
    # The last releases reach the rows with the next step's changes: then only the new sequence holds one.
    engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=2))
    engine.step()
    assert len(engine.input_rows) == 1


def test_speculative_verification_and_window_groups_read_kept_rows(checked):
    """Draft slots grown and truncated (ngram speculation), and a sliding-window model's two KV cache groups (pages
    released behind the window, null pages): the kept rows stay equal to the tables."""
    rng = np.random.default_rng(4)
    repeat = [rng.integers(1, 400, 6).tolist() * 4 for _ in range(6)]  # repeated n-grams: drafts get accepted
    spec = TINY_SPEC.build(speculative_method="ngram", num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec.generate(prompt_token_ids=repeat, sampling_params=params)
    assert spec.engine.stats.spec_accepted > 0
    builds = checked["builds"]
    windowed = TINY_ENGINE.replace(model="tiny-gemma2").build(max_num_seqs=4)
    assert windowed.engine.block_manager.num_groups == 2
    windowed.generate(prompt_token_ids=[r * 2 for r in repeat], sampling_params=params)
    assert checked["builds"] > builds


def test_rows_follow_table_changes_and_drop_absent_sequences():
    """The rows alone: a whole table read at a touch, one entry at an append, a finished sequence's row freed at its
    release, and rows of sequences that left unnoticed dropped when a step needs rows."""
    from inference.engine.input_rows import InputRows
    from inference.engine.pages.block_manager import TableChanges
    from inference.engine.sequence import Sequence, SequenceStatus

    def seq(i: int, pages: list[int]) -> Sequence:
        s = Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=[1, 2, 3], num_prompt_tokens=3,
                     params=SamplingParams(temperature=0.5, top_k=7, seed=i), seed=i, arrival_order=i)
        s.block_tables = [list(pages)]
        return s

    rows = InputRows(max_seqs=2, max_pages=8, num_groups=1)
    a, b, c, d, e, f = (seq(i, [10 * i + 1, 10 * i + 2]) for i in range(6))
    ra = rows.rows([a, b])
    assert ra.tolist() == rows.rows([a, b]).tolist() and rows.rows_read == 2
    a.block_tables[0].append(99)
    b.block_tables[0][:] = [7]
    rows.apply(TableChanges({b}, [(a, 2, 99)]))
    rows.check([a, b])
    kept = rows.kept_tables(ra)
    assert kept.lens.tolist() == [3, 1] and kept.tables[0, ra, :3].tolist() == [[1, 2, 99], [7, 0, 0]]
    np.testing.assert_array_equal(rows.sampling[ra[0]], [0.5, 7, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(rows.seed_key[ra[1]], [0, 1])
    a.block_tables[0][:] = [5, 6, 8]  # a page appended, then the table changed again (released, grown) before the step
    rows.apply(TableChanges({a}, [(a, 3, 9)]))
    rows.check([a])
    b.status = SequenceStatus.FINISHED
    b.block_tables[0].clear()
    rows.apply(TableChanges({b}, []))
    assert len(rows) == 1
    rows.rows([c, d])  # 3 of 4 rows
    rows.rows([e, f])  # two new, one row free: a, c and d, absent from this step, are dropped
    assert len(rows) == 2 and rows.rows_read == 6
    rows.check([e, f])


def test_needs_bits_are_the_parts_a_request_needs():
    """`SamplingParams.needs` is each optional part's own test as a bit, and a step's are its rows' OR."""
    from inference.engine.input_rows import InputRows
    from inference.engine.sequence import Sequence
    from inference.sampling import params as P

    cases = [(SamplingParams(), 0), (SamplingParams(temperature=0.0, top_k=5), 0),
             (SamplingParams(top_p=0.9), P.NEEDS_FILTERS), (SamplingParams(presence_penalty=0.5), P.NEEDS_PENALTIES),
             (SamplingParams(min_tokens=2), P.NEEDS_LOGIT_RULES),
             (SamplingParams(logit_bias={3: 1.0}), P.NEEDS_LOGIT_RULES),
             (SamplingParams(logprobs=0), P.NEEDS_LOGPROBS), (SamplingParams(prompt_logprobs=1), P.NEEDS_PROMPT_LOGPROBS),
             (SamplingParams(allowed_token_ids=[1, 2]), P.NEEDS_ALLOWED),
             (SamplingParams(top_k=3, repetition_penalty=1.1, logprobs=2), P.NEEDS_FILTERS | P.NEEDS_PENALTIES
              | P.NEEDS_LOGPROBS)]
    for params, bits in cases:
        assert params.needs == bits, params
    rows = InputRows(max_seqs=len(cases), max_pages=4, num_groups=1)
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=[1], num_prompt_tokens=1, params=p, seed=i,
                     arrival_order=i) for i, (p, _) in enumerate(cases)]
    got = rows.rows(seqs)
    assert rows.needs_of(got[:2]) == 0 and rows.needs_of(got[2:4]) == P.NEEDS_FILTERS | P.NEEDS_PENALTIES
    assert rows.needs_of(got) == (1 << 6) - 1
