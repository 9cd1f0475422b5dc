"""A script written against vLLM's documented offline API runs on pagejax with only its import line changed.

`VLLM_SCRIPT` is what a vLLM user writes (SamplingParams with penalties, logprobs, prompt_logprobs, seed, n, stop,
bad_words, detokenize; `LLM.generate` with a str and a TokensPrompt; `LLM.chat`; reading `Logprob.logprob`, `.rank`,
`.decoded_token`, `cumulative_logprob`, `finish_reason`, `prompt_logprobs`). The test swaps `from vllm import` for
`from inference import` and nothing else, runs it on the session's SmolLM2, and checks what it returns.
"""

from __future__ import annotations

import math

VLLM_SCRIPT = '''
from vllm import LLM, SamplingParams, TokensPrompt


def evaluate(llm):
    tokenizer = llm.get_tokenizer()
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=1)
    text_out, tokens_out = llm.generate([prompt, TokensPrompt(prompt_token_ids=tokenizer.encode(prompt))], greedy)
    completion = text_out.outputs[0]
    assert completion.token_ids == tokens_out.outputs[0].token_ids
    ranks, decoded, total = [], [], 0.0
    for i, token in enumerate(completion.token_ids):
        lp = completion.logprobs[i][token]
        ranks.append(lp.rank)
        decoded.append(lp.decoded_token == tokenizer.decode([token], skip_special_tokens=False))
        total += lp.logprob
    prompt_ranks = [text_out.prompt_logprobs[i][t].rank for i, t in enumerate(text_out.prompt_token_ids) if i > 0]

    sampled = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=1234, max_tokens=12, stop=["\\n"],
                             repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2)
    first = [c.text for c in llm.generate(prompt, sampled)[0].outputs]
    again = [c.text for c in llm.generate(prompt, sampled)[0].outputs]

    banned = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, bad_words=["Paris"]))[0].outputs[0]
    ids_only = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, detokenize=False))[0].outputs[0]

    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=16))
    return {
        "text": completion.text, "ranks": ranks, "decoded_ok": decoded, "sum": total,
        "cumulative_logprob": completion.cumulative_logprob, "finish_reason": completion.finish_reason,
        "first_prompt_logprobs": text_out.prompt_logprobs[0], "prompt_ranks": prompt_ranks,
        "sampled": first, "sampled_again": again, "banned_text": banned.text,
        "ids_only_text": ids_only.text, "ids_only_tokens": list(ids_only.token_ids),
        "greedy_tokens": completion.token_ids,
        "chat": chat[0].outputs[0].text, "chat_finish": chat[0].outputs[0].finish_reason,
    }
'''


def test_vllm_script_runs_with_only_the_import_changed(smollm2):
    ported = VLLM_SCRIPT.replace("from vllm import", "from inference import")
    assert ported.count("\n") == VLLM_SCRIPT.count("\n") and ported != VLLM_SCRIPT
    namespace: dict = {}
    exec(compile(ported, "vllm_script.py", "exec"), namespace)
    r = namespace["evaluate"](smollm2)

    assert "Paris" in r["text"] and r["finish_reason"] == "length"
    assert r["ranks"] == [1] * 8 and all(r["decoded_ok"])  # greedy: every sampled token is the argmax
    assert math.isclose(r["cumulative_logprob"], r["sum"], rel_tol=1e-6) and r["sum"] < 0
    assert r["first_prompt_logprobs"] is None and all(rank >= 1 for rank in r["prompt_ranks"])
    assert len(r["sampled"]) == 2 and r["sampled"] == r["sampled_again"]  # seeded: reproducible
    assert not any("\n" in text for text in r["sampled"])
    assert "Paris" not in r["banned_text"] and r["banned_text"]
    assert r["ids_only_text"] == "" and r["ids_only_tokens"] == r["greedy_tokens"]
    assert r["chat"] and r["chat_finish"] in ("stop", "length")
