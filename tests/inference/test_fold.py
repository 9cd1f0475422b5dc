"""The fold's fast path (inference/engine/fold.py): rows whose token and length cannot end them by EOS, a stop token
or a limit skip `check_stop`, and give exactly the general path's outputs at every edge: min_tokens over an EOS,
stop_token_ids, max_tokens on the step of a stop token, detokenize=False, a stop string across two tokens (kept or
cut), and rows recomputed after a preemption."""

from __future__ import annotations

import dataclasses
import os

import pytest

from inference import SamplingParams
from inference.engine import fold
from inference.engine.llm_engine import Engine
from inference.loading.tokenizer import IncrementalDetokenizer

STEPS = 14  # tokens of the reference generation each case is cut from


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """The tiny random Llama with SmolLM2's tokenizer and vocabulary (so stop strings see real text)."""
    from inference import LLM
    from scripts.bench.overhead_bench import tiny_model_folder

    folder = tiny_model_folder(os.path.join(tmp_path_factory.mktemp("tiny"), "tiny"))
    return LLM(folder, dtype="float32", max_num_seqs=16, max_num_batched_tokens=128, page_size=8,
               kv_cache_memory_bytes=1 << 21, max_model_len=128, seed=0, compilation_cache_dir=None)


def _run(llm, requests, *, async_scheduling: bool, general_only: bool, monkeypatch, eos: set[int] = frozenset(),
         recompute_at: int | None = None, plain: list[int] | None = None) -> tuple[dict, int]:
    """Every request's final (token_ids, text, finish_reason, stop_reason), and how many tokens took the general
    path. `general_only`: no row takes the fast path (the fold before it); `recompute_at`: every running sequence
    is preempted and recomputed before that step; `plain`: counts the tokens whose text the batched plain update
    appended without a decode (`IncrementalDetokenizer.add_plain`)."""
    plain = plain if plain is not None else [0]
    config = dataclasses.replace(llm.engine.scheduler.config, async_scheduling=async_scheduling)
    llm.engine.reset_prefix_cache()
    engine = Engine(llm.runner, llm.tokenizer, config)
    engine.eos_token_ids = engine.eos_token_ids | set(eos)
    general = [0]
    after_token = fold.after_token
    add_plain = IncrementalDetokenizer.add_plain

    def counted_plain(self, token, text):
        plain[0] += 1
        return add_plain(self, token, text)

    monkeypatch.setattr(IncrementalDetokenizer, "add_plain", counted_plain)

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
    assert len(fast["stop-id-below-min"][0]) >= 4 and len(fast["eos-below-min"][0]) >= 6
    total = sum(len(v[0]) for v in slow.values())
    assert slow_general == total  # every token took the general path there
    assert fast_general < total / 2  # and most took the fast path here
    assert plain[0] > total / 4  # many of those as one batched text update (no detokenizer add, no look-back)


def test_plain_update_is_add(llm):
    """`add_plain` leaves a detokenizer as `add` does and its text is `add`'s delta, for every token it may be used
    for (a plain text, the detokenizer plain), over real text with multi-byte characters between."""
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("Plain text, then émojis 🙂🙃 and 漢字 between words.\n\nMore text: 12345 end.")
    plain = tokenizer.plain_texts(True)
    assert plain and all(text and tokenizer.decode([i]) == text for i, text in list(plain.items())[::97])
    a, b = tokenizer.detokenizer(prompt_ids=[1, 2]), tokenizer.detokenizer(prompt_ids=[1, 2])
    used = 0
    for token in ids:
        expected = a.add(token)
        if token in plain and b.plain:
            b.add_plain(token, plain[token])
            assert plain[token] == expected
            used += 1
        else:
            b.add(token)
        assert (b.text, b._ids, b._prefix_offset, b._read_offset, b._whole, b.plain) == \
            (a.text, a._ids, a._prefix_offset, a._read_offset, a._whole, a.plain)
    assert 0 < used < len(ids)  # some tokens are pieces of a multi-byte character
    assert a.finish() == b.finish()


def test_fast_path_after_a_preemption(llm, reference, monkeypatch):
    """Rows recomputed after every running sequence is preempted mid-generation fold as before."""
    requests, eos, _ = _cases(llm, reference)
    runs = [_run(llm, requests, async_scheduling=True, general_only=general, monkeypatch=monkeypatch, eos=eos,
                 recompute_at=6)[0] for general in (False, True)]
    assert runs[0] == runs[1]
    plain, _ = _run(llm, requests, async_scheduling=True, general_only=False, monkeypatch=monkeypatch, eos=eos)
    assert {rid: v for rid, v in runs[0].items() if rid != "sampled"} == \
        {rid: v for rid, v in plain.items() if rid != "sampled"}  # greedy: the preemption changed no token
