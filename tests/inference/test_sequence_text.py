"""A sequence's output text kept as its pieces (inference/engine/sequence.py): appending costs the piece, not the
text so far; `output_text` joins it; `text_from` (a stop string's look-back) joins only the pieces it spans; and a
`text_snapshot` taken for a step's output reads the text of that moment after later appends, joins and cuts."""

from __future__ import annotations

from inference import SamplingParams
from inference.engine.sequence import Sequence
from inference.engine.stop import match_stop_string


def _sequence(**params) -> Sequence:
    return Sequence(seq_id=0, request_id="r", index=0, token_ids=[1, 2], num_prompt_tokens=2,
                    params=SamplingParams(**params), seed=0, arrival_order=0)


def test_pieces_join_and_look_back():
    seq = _sequence()
    assert seq.output_text == "" and seq.text_len == 0 and seq.text_from(0) == ""
    for piece in ["ab", "", "cde", "f", "ghij"]:
        seq.append_text(piece)
    full = "abcdefghij"
    assert seq.text_parts == ["ab", "cde", "f", "ghij"]  # "" adds no piece
    for start in range(-2, 13):
        assert seq.text_from(start) == full[max(start, 0):], start
    assert seq.output_text == full and seq.text_len == len(full)
    assert seq.text_parts == [full]  # joined once, then kept joined


def test_snapshots_keep_their_moment():
    seq = _sequence()
    seq.append_text("abc")
    seq.append_text("def")
    first = seq.text_snapshot()
    seq.append_text("gh")
    assert seq.output_text == "abcdefgh"  # the join makes a new list: `first` still has its pieces
    second = seq.text_snapshot()
    seq.output_text = "ab"  # a cut
    seq.append_text("Z")
    for (parts, count), want in ((first, "abcdef"), (second, "abcdefgh"), (seq.text_snapshot(), "abZ")):
        assert "".join(parts[:count]) == want
    assert seq.text_len == 3


def test_a_stop_string_across_pieces_cuts_the_whole_text():
    for keep, want in ((False, "hello wor"), (True, "hello world</s>")):
        seq = _sequence(stop=["ld</s>"], include_stop_str_in_output=keep)
        for piece in ["hello", " wor", "ld<", "/s", ">", " more"]:
            before = seq.text_len
            seq.append_text(piece)
            stop = match_stop_string(seq, max(0, before - len("ld</s>") + 1), seq.params.stop)
            if stop is not None:
                break
        assert stop == "ld</s>" and seq.output_text == want and seq.text_len == len(want)
