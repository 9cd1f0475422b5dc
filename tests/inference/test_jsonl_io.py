"""The launcher's JSONL output rows keep logprobs as plain floats (their format before Logprob objects) and add the
completion's cumulative_logprob."""

from __future__ import annotations

import json

from inference import CompletionOutput, Logprob, RequestOutput
from inference.tools.jsonl_io import result_row


def test_logprobs_stay_floats_in_output_rows():
    completion = CompletionOutput(index=0, text=" Paris", token_ids=[7042],
                                  logprobs=[{7042: Logprob(-0.25, 1, " Paris"), 260: Logprob(-2.75, 2, " the")}],
                                  finish_reason="length", cumulative_logprob=-0.25)
    out = RequestOutput(request_id="0", prompt="p", prompt_token_ids=[1, 2], prompt_logprobs=None,
                        outputs=[completion], finished=True)
    row = json.loads(json.dumps(result_row({"id": 3, "prompt": "p"}, out, with_logprobs=True)))
    assert row["outputs"][0]["logprobs"] == [{"7042": -0.25, "260": -2.75}]
    assert row["outputs"][0]["cumulative_logprob"] == -0.25
    assert "logprobs" not in result_row({"id": 3, "prompt": "p"}, out, with_logprobs=False)["outputs"][0]
