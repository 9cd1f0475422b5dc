"""The fold's fast path (inference/engine/fold.py): rows whose token and length cannot end them by EOS, a stop token
or a limit skip `check_stop`, and give exactly the general path's outputs at every edge: min_tokens over an EOS,
stop_token_ids, max_tokens on the step of a stop token, detokenize=False, a stop string across two tokens (kept or
cut), and rows recomputed after a preemption."""

from __future__ import annotations

import collections
import dataclasses
import os

import numpy as np
import pytest

from inference import SamplingParams
from inference.engine import fold
from inference.engine.llm_engine import Engine
from inference.engine.plain_rows import PlainRows
from inference.engine.sequence import Sequence
from inference.loading.tokenizer import IncrementalDetokenizer
from inference.spec_decode.ngram import NgramProposer, PromptLookupProposer
from tests.inference.test_persistent_batch import drive

STEPS = 14  # tokens of the reference generation each case is cut from


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """The tiny random Llama with SmolLM2's tokenizer and its first 4096 ids (so stop strings see real text, and
    byte tokens that are not whole UTF-8 alone come up; the sampler's work over the full 49,152 ids took much of
    these tests' time)."""
    from inference import LLM
    from scripts.bench.overhead_bench import tiny_model_folder

    folder = tiny_model_folder(os.path.join(tmp_path_factory.mktemp("tiny"), "tiny"), vocab=4096)
    return LLM(folder, dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, page_size=8,
               kv_cache_memory_bytes=1 << 21, max_model_len=128, seed=0, compilation_cache_dir=None)


def _run(llm, requests, *, async_scheduling: bool, general_only: bool, monkeypatch, eos: set[int] = frozenset(),
         recompute_at: int | None = None, plain: list[int] | None = None) -> tuple[dict, int]:
    """Every request's final (token_ids, text, finish_reason, stop_reason), and how many tokens took the general
    path. `general_only`: no row takes the fast path (the fold before it); `recompute_at`: every running sequence
    is preempted and recomputed before that step; `plain`: counts the tokens whose text the batched plain update
    appended without a decode (`IncrementalDetokenizer.add_plains`). The texts every step's outputs showed, by
    request, are returned in the dict too (under its request id + "/steps")."""
    plain = plain if plain is not None else [0]
    config = dataclasses.replace(llm.engine.scheduler.config, async_scheduling=async_scheduling)
    llm.engine.reset_prefix_cache()
    engine = Engine(llm.runner, llm.tokenizer, config)
    engine.eos_token_ids = engine.eos_token_ids | set(eos)
    general = [0]
    after_token = fold.after_token
    add_plains = IncrementalDetokenizer.add_plains

    def counted_plain(self, tokens, texts):
        plain[0] += 1 if isinstance(tokens, int) else len(tokens)
        return add_plains(self, tokens, texts)

    monkeypatch.setattr(IncrementalDetokenizer, "add_plains", counted_plain)

    def counted(*args):
        general[0] += 1
        return after_token(*args)

    monkeypatch.setattr(fold, "after_token", counted)
    if general_only:
        monkeypatch.setattr(fold, "fast_row", lambda engine, seq: None)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals, step = {}, 0
    while engine.has_unfinished_requests():
        if step == recompute_at:
            assert engine.recompute_running() > 0
        step += 1
        for out in engine.step():
            finals.setdefault(out.request_id + "/steps", []).append(out.outputs[0].text)
            if out.finished:
                c = out.outputs[0]
                finals[out.request_id] = (c.token_ids, c.text, c.finish_reason, c.stop_reason)
                engine.pop_finished(out.request_id)
    monkeypatch.undo()
    assert not engine.requests and engine.block_manager.num_free_pages == engine.block_manager.num_pages
    return finals, general[0]


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy tokens and text of three prompts, no stop condition but the length."""
    prompts = [[5, 900, 1200, 77, 31], [4000, 12, 12, 9, 300, 301], [42] * 9]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    return [(p, o.outputs[0].token_ids, o.outputs[0].text) for p, o in zip(prompts, outs)]


def _cases(llm, reference) -> tuple[list, set[int], dict]:
    """Requests at the fast path's edges, the extra EOS ids they need, and what some of them must give."""
    (p0, r0, _), (p1, r1, _), (p2, r2, t2) = reference
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS)
    detok = llm.tokenizer.detokenizer(prompt_ids=p2)
    ends = []  # the text length after each of r2's tokens
    for token in r2:
        detok.add(token)
        ends.append(len(detok.text))
    cut = next(k for k in range(2, STEPS - 1) if ends[k - 1] > 0 and ends[k] > ends[k - 1] and
               t2[ends[k - 1] - 1] not in t2[:ends[k - 1] - 1])  # a boundary between two tokens' text
    across = t2[ends[cut - 1] - 1:ends[cut - 1] + 1]  # the last character of one token and the first of the next
    requests = [
        ("stop-id", p0, greedy.replace(stop_token_ids=[r0[4]], ignore_eos=True)),
        ("stop-id-below-min", p0, greedy.replace(stop_token_ids=[r0[1]], min_tokens=4, ignore_eos=True)),
        ("stop-id-at-max", p1, greedy.replace(stop_token_ids=[r1[5]], max_tokens=6, ignore_eos=True)),
        ("eos", p1, greedy),
        ("eos-below-min", p1, greedy.replace(min_tokens=6)),
        ("eos-at-max", p1, greedy.replace(max_tokens=4)),
        ("eos-ignored", p1, greedy.replace(ignore_eos=True, max_tokens=9)),
        ("no-text", p0, greedy.replace(detokenize=False, ignore_eos=True, max_tokens=11)),
        ("stop-across", p2, greedy.replace(stop=[across], ignore_eos=True)),
        ("stop-across-kept", p2, greedy.replace(stop=[across], include_stop_str_in_output=True, ignore_eos=True)),
        ("stop-below-min", p2, greedy.replace(stop=[across], min_tokens=STEPS - 2, ignore_eos=True)),
        # Complete in the text of the last token below min_tokens: only the first checked token's look-back (as long
        # as the longer stop string) finds it.
        ("stop-found-at-min", p2, greedy.replace(stop=[across, "\x00" * 12], min_tokens=cut + 1, ignore_eos=True)),
        ("sampled", p0, SamplingParams(temperature=0.9, seed=3, max_tokens=STEPS, stop=["e"])),
    ]
    first = r0.index(r0[4])
    expected = {
        "stop-id": (r0[:first + 1], "stop", r0[4]),
        "stop-id-at-max": (r1[:r1.index(r1[5]) + 1], "stop", r1[5]),
        "eos": (r1[:r1.index(r1[3]) + 1], "stop", None),
        "eos-at-max": (r1[:min(4, r1.index(r1[3]) + 1)], "stop" if r1.index(r1[3]) < 4 else "length", None),
        "eos-ignored": (r1[:9], "length", None),
        "no-text": (r0[:11], "length", None),
        "stop-across": (r2[:cut + 1], "stop", across),
    }
    texts = {"stop-across": t2[:ends[cut - 1] - 1], "stop-across-kept": t2[:ends[cut - 1] + 1], "no-text": ""}
    return requests, {r1[3]}, (expected, texts)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fast_path_gives_the_general_paths_outputs(llm, reference, monkeypatch, async_scheduling):
    requests, eos, (expected, texts) = _cases(llm, reference)
    plain = [0]
    fast, fast_general = _run(llm, requests, async_scheduling=async_scheduling, general_only=False,
                              monkeypatch=monkeypatch, eos=eos, plain=plain)
    slow, slow_general = _run(llm, requests, async_scheduling=async_scheduling, general_only=True,
                              monkeypatch=monkeypatch, eos=eos)
    assert fast == slow
    for rid, (tokens, reason, stop_reason) in expected.items():
        assert (fast[rid][0], fast[rid][2], fast[rid][3]) == (tokens, reason, stop_reason), rid
    for rid, text in texts.items():
        assert fast[rid][1] == text, rid
    assert fast["stop-across-kept"][2:] == ("stop", fast["stop-across"][3])
    if len(texts["stop-across"]) + 12 >= len(fast["stop-found-at-min"][1]) + 2:  # the look-back reaches it
        assert fast["stop-found-at-min"][2:] == ("stop", fast["stop-across"][3])
    assert len(fast["stop-id-below-min"][0]) >= 4 and len(fast["eos-below-min"][0]) >= 6
    assert any(len(set(v)) > 2 for k, v in fast.items() if k.endswith("/steps"))  # texts read while they grew
    total = sum(len(v[0]) for k, v in slow.items() if not k.endswith("/steps"))
    assert slow_general == total  # every token took the general path there
    assert fast_general < total / 2  # and most took the fast path here
    assert plain[0] > total / 4  # many of those as one batched text update (no detokenizer add, no look-back)


def test_look_back_only_where_a_stop_can_end(llm, monkeypatch):
    """A row off the plain path looks back for its stop strings at its first checked token (past min_tokens: the
    text before it may hold a whole match), then only when its new text holds a stop string's last character."""
    engine = Engine(llm.runner, llm.tokenizer, llm.engine.scheduler.config)
    monkeypatch.setattr(engine.plain_rows, "table", lambda *args: engine.plain_rows._no_row.table)  # no row is plain
    looked, match = [0], fold.match_stop_string

    def counted(*args):
        looked[0] += 1
        return match(*args)

    monkeypatch.setattr(fold, "match_stop_string", counted)
    prompt, params = [5, 900, 1200], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=3)
    for stop, last in (["\x00\x00"], "\x00"), (["e\x00", "\x00e"], "e"):
        looked[0] = 0
        engine.add_request(stop[0], prompt, params.replace(stop=stop))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        tokens = outs[-1].outputs[0].token_ids
        detok = llm.tokenizer.detokenizer(prompt_ids=prompt)
        pieces = [detok.add(t) for t in tokens]  # each token's new text
        assert len(tokens) == 12 and outs[-1].outputs[0].text == "".join(pieces)
        # The 1st token takes the general path, the 2nd and 3rd are below min_tokens, the 4th is the first checked,
        # and the 12th reaches max_tokens (the general path again).
        assert looked[0] == 1 + sum(last in piece for piece in pieces[4:-1])
    assert looked[0] > 1  # the greedy text has an "e" past the 4th token


def test_plain_update_is_add(llm):
    """`add_plains` leaves a detokenizer as `add` of each token does and its texts are `add`'s deltas, for every run
    of tokens it may be used for (plain texts, the detokenizer plain before them), over real text with multi-byte
    characters between: one token at a time (as an int and its text) and whole runs at once."""
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("Plain text, then émojis 🙂🙃 and 漢字 between words.\n\nMore text: 12345 end.")
    plain = tokenizer.plain_texts(True)
    assert plain and all(text and tokenizer.decode([i]) == text for i, text in list(plain.items())[::97])
    longest = 0
    for whole_runs in (False, True):
        a, b = tokenizer.detokenizer(prompt_ids=[1, 2]), tokenizer.detokenizer(prompt_ids=[1, 2])
        used, run = 0, []

        def flush():
            nonlocal longest
            if len(run) == 1 and not whole_runs:  # one token and its text, as a reader at every step settles it
                b.add_plains(run[0], plain[run[0]])
            else:
                b.add_plains(run, [plain[t] for t in run])
            longest = max(longest, len(run))
            run.clear()
            assert (b.text, b._ids, b._prefix_offset, b._read_offset, b._whole, b.plain) == \
                (a.text, a._ids, a._prefix_offset, a._read_offset, a._whole, a.plain)

        for token in ids:
            if token in plain and b.plain:  # b stays plain through a run
                assert plain[token] == a.add(token)
                run.append(token)
                used += 1
                if not whole_runs:
                    flush()
                continue
            flush()
            assert b.add(token) == a.add(token)
        flush()
        assert 0 < used < len(ids)  # some tokens are pieces of a multi-byte character
        assert a.finish() == b.finish()
    assert longest > 3


def test_fast_path_after_a_preemption(llm, reference, monkeypatch):
    """Rows recomputed after every running sequence is preempted mid-generation fold as before."""
    requests, eos, _ = _cases(llm, reference)
    runs = [_run(llm, requests, async_scheduling=True, general_only=general, monkeypatch=monkeypatch, eos=eos,
                 recompute_at=6)[0] for general in (False, True)]
    assert runs[0] == runs[1]
    plain, _ = _run(llm, requests, async_scheduling=True, general_only=False, monkeypatch=monkeypatch, eos=eos)
    assert {rid: v for rid, v in runs[0].items() if rid != "sampled"} == \
        {rid: v for rid, v in plain.items() if rid != "sampled"}  # greedy: the preemption changed no token


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_deferred_text_under_random_arrivals_aborts_and_streamed_reads(llm, monkeypatch, async_scheduling):
    """64 requests arriving at random steps, with stop strings, aborts and every step's outputs read (the text of
    the plain rows settled mid-run, with a token in flight): every step's text and each final output equal the
    general path's (no row plain, no text deferred). Each time the fold's rows change, the rows carried from the
    last fold (`PlainRows._carry`) equal the rows read afresh."""
    rng = np.random.default_rng(5)
    vocab = llm.runner.config.vocab_size
    requests = []
    for i in range(64):
        prompt = rng.integers(1, vocab, int(rng.integers(3, 30))).tolist()
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=int(rng.integers(4, 24)),
                                stop=[["e"], ["the", " a"], [], ["\n"]][i % 4], ignore_eos=i % 5 != 0,
                                include_stop_str_in_output=i % 3 == 0, min_tokens=i % 4)
        requests.append((f"r{i}", prompt, params))
    arrivals = rng.poisson(4, 100).tolist()
    aborts = {rid: int(rng.integers(2, 8)) for rid, _, _ in requests if rng.random() < 0.15}
    carried = collections.Counter()
    runs = []
    for general_only in (False, True):
        engine = _engine(llm, monkeypatch, general_only, carried, async_scheduling=async_scheduling)
        seen = []
        finals = drive(engine, requests, arrivals, dict(aborts), seen)
        seen += [(rid, out.outputs[0].text, out.outputs[0].finish_reason) for rid, out in sorted(finals.items())]
        monkeypatch.undo()
        runs.append(seen)
    assert runs[0] == runs[1]
    assert {"stop", "length", "abort"} <= {entry[-1] for entry in runs[0] if len(entry) == 3}
    assert carried["joined"] >= 3 and carried["left"] >= 3, carried  # the carry ran, with rows joining and leaving


def _engine(llm, monkeypatch, general_only: bool, counts: collections.Counter, proposer=None, **config) -> Engine:
    """A fresh engine on the test's model: with `general_only` no row takes the fast path; else every carry of the
    plain rows is checked (`_checked_carry`). `proposer`: speculative decoding's."""
    llm.engine.reset_prefix_cache()
    engine = Engine(llm.runner, llm.tokenizer, dataclasses.replace(llm.engine.scheduler.config, **config),
                    proposer=proposer)
    if general_only:
        monkeypatch.setattr(fold, "fast_row", lambda engine, seq: None)
    else:
        monkeypatch.setattr(PlainRows, "_carry", _checked_carry(counts))
    return engine


def _checked_carry(counts: collections.Counter):
    """`PlainRows._carry` that checks its rows against the rows read afresh, counting what it saw."""
    carry = PlainRows._carry

    def checked(self, old, seqs):
        base = self._base
        rows, fresh = carry(self, old, seqs), self._build(seqs)
        counts["from_base"] += base is not None and self._base is None  # carried from the kept rows
        for name in ("limit", "plain_from", "text", "timed", "plain_state", "deferring"):
            np.testing.assert_array_equal(getattr(rows, name), getattr(fresh, name), err_msg=name)
        np.testing.assert_array_equal(rows.tables[rows.table_of], fresh.tables[fresh.table_of])
        assert all(a is b for a, b in zip(rows.times, fresh.times)) and rows.seqs == fresh.seqs
        counts["joined"] += bool(set(seqs) - set(old.seqs))
        counts["left"] += bool(set(old.seqs) - set(seqs))
        return rows

    return checked


@pytest.mark.parametrize("async_scheduling,speculative", [(True, False), (False, False), (True, True)])
def test_plain_rows_carried_under_the_offline_policy(llm, monkeypatch, async_scheduling, speculative):
    """`LLM.generate`'s steps (finished outputs only; the auto policy runs prompts in steps of their own) alternate
    the fold's rows between a prefill step's new rows and the decode rows: the decode rows come back to the rows
    kept from before (`PlainRows._base`), every carry equals the rows read afresh, and the outputs are the general
    path's. With prompt lookup (repetitive prompts, greedy), whose verifying rows fold their tokens outside the
    plain rows, no rows are kept aside."""
    rng = np.random.default_rng(8)
    vocab = llm.runner.config.vocab_size
    pattern = rng.integers(1, vocab, 4).tolist()
    requests = [(f"r{i}", (pattern * 6)[:int(rng.integers(8, 24))] if speculative else
                 rng.integers(1, vocab, int(rng.integers(3, 30))).tolist(),
                 SamplingParams(temperature=0.0 if speculative else 0.8, seed=i, max_tokens=int(rng.integers(6, 30)),
                                stop=[["e"], ["the", " a"], []][i % 3], ignore_eos=True)) for i in range(48)]
    arrivals = rng.poisson(2, 200).tolist()
    counts, runs = collections.Counter(), []
    for general_only in (False, True):
        engine = _engine(llm, monkeypatch, general_only, counts, async_scheduling=async_scheduling, policy="auto",
                         proposer=PromptLookupProposer(NgramProposer(k=2)) if speculative else None)
        finals = drive(engine, requests, arrivals, {}, finished_only=True)
        monkeypatch.undo()
        runs.append({rid: (out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].finish_reason)
                     for rid, out in finals.items()})
    assert runs[0] == runs[1] and len(runs[0]) == len(requests)
    if speculative:
        assert engine.stats.spec_passes > 0 and counts["from_base"] == 0, counts
    else:
        assert counts["from_base"] >= 3, counts  # rows came back to the kept rows


def test_token_tables_and_settled_text(llm):
    """A kind of row's token table (`PlainRows.table`): a stop id, a token whose text can end a stop string
    (whatever came before), a token that is not whole UTF-8 alone, and a token past the vocabulary never keep a row
    plain; a row that does not detokenize is kept plain by every token but its stop ids. A sequence's deferred text is
    appended when read, without an in-flight placeholder, and the run goes on after the read."""
    from inference.engine.plain_rows import can_end_stop

    tokenizer, vocab = llm.tokenizer, llm.runner.config.vocab_size
    plain = tokenizer.plain_texts(True)
    rows = PlainRows(vocab)
    eos = next(iter(llm.engine.eos_token_ids))
    with_x = next(i for i, text in plain.items() if "x" in text and i != eos)
    no_x = [i for i, text in plain.items() if "x" not in text and i != eos][:50]
    partial = next(i for i in range(vocab) if i not in plain)
    table = rows.table(frozenset({eos}), True, True, plain, frozenset("x"))
    assert table.shape == (vocab + 1,) and not table[vocab]
    assert not table[eos] and not table[with_x] and not table[partial] and table[no_x].all()
    assert rows.table(frozenset({eos}), True, True, plain, frozenset("x")) is table  # made once
    bare = rows.table(frozenset({eos}), False, True, plain, frozenset())
    assert not bare[eos] and not bare[vocab] and bare[:vocab].sum() == vocab - 1
    # A longer stop string "zx": a token with an "x" that cannot end it ("ex") keeps the row plain; one that starts
    # with a suffix of it ("x...", after a "z") or holds it whole does not.
    inside = next(i for i, text in plain.items() if "x" in text[1:] and "zx" not in text and text[0] != "x")
    starts = next(i for i, text in plain.items() if text.startswith("x"))
    longer = rows.table(frozenset({eos}), True, True, plain, frozenset({"zx"}))
    assert longer[inside] and not longer[starts] and not longer[eos] and longer[no_x].all()
    assert [can_end_stop(t, "<|a>x") for t in ("x", ">x", "a>xy", "<|a>x!", "ex", "x>", "<|a>")] == \
        [True, True, True, True, False, True, False]
    # Made from the tokens holding each stop's last character (kept by character): the same as over every token.
    stops = frozenset({"zx", "\n\nQuestion", "e"})
    brute = np.zeros(vocab + 1, bool)
    brute[[i for i, text in plain.items() if i < vocab and not any(can_end_stop(text, s) for s in stops)]] = True
    brute[eos] = False
    np.testing.assert_array_equal(rows.table(frozenset({eos}), True, True, plain, stops), brute)

    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1, 2], num_prompt_tokens=2,
                   params=SamplingParams(), seed=0, arrival_order=0)
    seq.detokenizer = tokenizer.detokenizer(prompt_ids=[1, 2])
    seq.fast_row = fold.FastRow(100, frozenset({eos}), True, (), 0, (), 0, None, plain, table)
    reference = tokenizer.detokenizer(prompt_ids=[1, 2])
    seq.token_ids += no_x[:3]
    seq.deferred_from = 2
    seq.token_ids.append(-1)  # a token in flight
    assert seq.output_text == "".join(reference.add(t) for t in no_x[:3])
    assert seq.deferred_from == 5 and seq.text_len == len(seq.output_text)  # the run goes on from the placeholder
    seq.token_ids[-1] = no_x[3]
    seq.token_ids.append(with_x)
    seq.settle_text(len(seq.token_ids) - 1)  # the fold, before a token that is not plain
    assert seq.deferred_from is None and seq.output_text == reference.text + reference.add(no_x[3])
    assert seq.detokenizer.add(with_x) == reference.add(with_x)
    # Parts of characters (`Tokenizer.partial_bytes`) keep a row plain where every stop string ends in an ASCII
    # character that is not among their bytes; a run with them settles through the detokenizer, as each add would.
    partial_bytes = tokenizer.partial_bytes(True)
    parts = [i for i in partial_bytes if i < vocab]
    spaced = [i for i in parts if ord(" ") in partial_bytes[i]]  # " \xe2\x80": a space, then a character's start
    assert parts and spaced and set(parts).isdisjoint(plain)
    assert not rows.table(frozenset({eos}), True, True, plain, frozenset("x"))[parts].any()  # none given
    with_parts = rows.table(frozenset({eos}), True, True, plain, frozenset({"x", "a b"}), partial_bytes)
    assert with_parts[parts].all() and with_parts[no_x].all() and not with_parts[with_x]
    spaced_stop = PlainRows(vocab).table(frozenset({eos}), True, True, plain, frozenset({"x", "a "}), partial_bytes)
    assert not spaced_stop[spaced].any() and spaced_stop[[i for i in parts if i not in spaced]].all()
    wide_stop = PlainRows(vocab).table(frozenset({eos}), True, True, plain, frozenset({"x", "é"}), partial_bytes)
    assert not wide_stop[parts].any() and wide_stop[no_x].all()  # a stop string ending in a non-ASCII character
    for run in ([parts[0], parts[1], no_x[0], spaced[0], no_x[1]], [no_x[0], parts[2]], [parts[3]]):
        seq = Sequence(seq_id=1, request_id="r", index=0, token_ids=[1, 2], num_prompt_tokens=2,
                       params=SamplingParams(), seed=0, arrival_order=0)
        seq.detokenizer, reference = tokenizer.detokenizer(prompt_ids=[1, 2]), tokenizer.detokenizer(prompt_ids=[1, 2])
        seq.fast_row = fold.FastRow(100, frozenset({eos}), True, (), 0, (), 0, None, plain, with_parts)
        seq.token_ids += run
        seq.deferred_from = 2
        assert seq.output_text == "".join(map(reference.add, run)) and seq.text_len == len(seq.output_text)
        seq.token_ids.append(no_x[2])  # the run goes on, from a detokenizer that may hold bytes back now
        assert seq.output_text == reference.text + reference.add(no_x[2])
        assert seq.detokenizer.finish() == reference.finish()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_parts_of_characters_give_the_general_paths_outputs(llm, monkeypatch, async_scheduling):
    """Rows that sample parts of multi-byte characters (random mixes of them, so also bytes that never make a
    character: U+FFFD) among plain tokens, under stop strings that let them keep a row plain or not (one ends in
    U+FFFD itself), read at every step: every step's text and every final output equal the general path's, and runs
    with parts of characters were folded as plain rows."""
    tokenizer, vocab = llm.tokenizer, llm.runner.config.vocab_size
    parts = [i for i in tokenizer.partial_bytes(True) if i < vocab]
    words = [t for w in ("a", " a", " the", "e", " ", "\n", "日本", "é") for t in tokenizer.encode(w) if t < vocab]
    allowed = sorted(set(parts + words))
    stops = [[], ["a"], [" "], ["the", "\n"], ["\ufffd"], ["日"]]
    requests = [(f"p{i}", [5 + i, 900, 1200, 77], SamplingParams(
        temperature=1.0, seed=i, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed, stop=stops[i % 6],
        include_stop_str_in_output=i % 4 == 0)) for i in range(12)]
    deferred_parts = [0]
    settle = Sequence.settle_text

    def counted(self, end=None):
        if self.deferred_from is not None:
            run = self.token_ids[self.deferred_from:end]
            deferred_parts[0] += sum(1 for t in run if t >= 0 and t not in self.fast_row.plain)
        return settle(self, end)

    monkeypatch.setattr(Sequence, "settle_text", counted)  # until the first run's end (it undoes the patches)
    fast, _ = _run(llm, requests, async_scheduling=async_scheduling, general_only=False, monkeypatch=monkeypatch)
    slow, _ = _run(llm, requests, async_scheduling=async_scheduling, general_only=True, monkeypatch=monkeypatch)
    assert fast == slow
    assert deferred_parts[0] > 20
    reasons = [fast[f"p{i}"][2] for i in range(12)]
    assert "stop" in reasons and "length" in reasons
    assert any("\ufffd" in fast[f"p{i}"][1] for i in range(12))  # bytes that never made a character
