"""build_model_input's vectorized arrays against a plain per-sequence loop over the same batch."""

import numpy as np
import pytest

from inference.engine.scheduled_batch import ScheduledBatch
from inference.engine.sequence import Sequence
from inference.runtime.batch import BucketLimits, build_model_input
from inference.sampling.params import SamplingParams

PAGE = 4


def reference_arrays(batch: ScheduledBatch, shape: dict, lora_slots):
    """The per-sequence loop the engine used before vectorizing: token by token, table by table."""
    groups = len(batch.seqs[0].block_tables)
    t, s, p = shape["tokens"], shape["seqs"], shape["pages"]
    out = {"tokens": np.zeros(t, np.int32), "positions": np.zeros(t, np.int32),
           "slot_mapping": np.full((groups, t), -1, np.int32), "target_ids": np.full(t, -1, np.int32),
           "kv_lens": np.zeros(s, np.int32), "page_indices": np.zeros((groups, s, p), np.int32),
           "cu_q_lens": np.zeros(s + 1, np.int32), "logits_indices": np.zeros(s, np.int32),
           "lora_slots": np.zeros(t, np.int32)}
    offset = 0
    for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        source = seq.token_ids + seq.spec_tokens
        for j in range(count):
            pos = seq.num_computed_tokens + j
            out["tokens"][offset + j] = source[pos]
            out["positions"][offset + j] = pos
            for g, table in enumerate(seq.block_tables):
                out["slot_mapping"][g, offset + j] = table[pos // PAGE] * PAGE + pos % PAGE
            if pos + 1 < seq.num_prompt_tokens:
                out["target_ids"][offset + j] = seq.token_ids[pos + 1]
            out["lora_slots"][offset + j] = lora_slots[i]
        for g, table in enumerate(seq.block_tables):
            out["page_indices"][g, i, :len(table)] = table
        offset += count
        out["kv_lens"][i] = seq.num_computed_tokens + count
        out["cu_q_lens"][i + 1] = offset
        out["logits_indices"][i] = offset - 1
    out["cu_q_lens"][len(batch.seqs) + 1:] = offset
    if groups == 1:
        out["slot_mapping"], out["page_indices"] = out["slot_mapping"][0], out["page_indices"][0]
    return out


def random_batch(rng: np.random.Generator, num_seqs: int, groups: int, decode: bool, spec: bool) -> ScheduledBatch:
    seqs, counts, next_page = [], [], 1
    for i in range(num_seqs):
        prompt = int(rng.integers(2, 40))
        generated = int(rng.integers(1, 10)) if decode else 0
        ids = rng.integers(0, 1000, prompt + generated).tolist()
        seq = Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=ids, num_prompt_tokens=prompt,
                       params=SamplingParams(), seed=i, arrival_order=i)
        drafts = rng.integers(0, 1000, int(rng.integers(0, 3))).tolist() if spec else []
        seq.spec_tokens = drafts
        seq.num_computed_tokens = len(ids) - 1 if decode else int(rng.integers(0, prompt))
        count = 1 + len(drafts) if decode else int(rng.integers(1, prompt - seq.num_computed_tokens + 1))
        pages = -(-(seq.num_computed_tokens + count) // PAGE)
        seq.block_tables = [list(range(next_page + g * 1000, next_page + g * 1000 + pages)) for g in range(groups)]
        next_page += pages
        seqs.append(seq)
        counts.append(count)
    return ScheduledBatch(seqs, counts)


@pytest.mark.parametrize("decode,spec,groups", [(True, False, 1), (False, False, 1), (False, False, 2),
                                                (True, True, 1), (True, False, 2)])
def test_vectorized_batch_matches_the_per_sequence_loop(decode, spec, groups):
    rng = np.random.default_rng(7)
    limits = BucketLimits(max_tokens=1024, max_seqs=64, max_pages_per_seq=32)
    for trial in range(5):
        batch = random_batch(rng, int(rng.integers(1, 40)), groups, decode, spec)
        lora = rng.integers(0, 4, len(batch.seqs)).tolist()
        inp, real = build_model_input(batch, PAGE, limits, num_spec=2 if spec else 0, lora_slots=lora)
        shape = {"tokens": inp.tokens.shape[0], "seqs": inp.attn.kv_lens.shape[0],
                 "pages": inp.attn.page_indices.shape[-1]}
        want = reference_arrays(batch, shape, lora)
        assert real == sum(batch.num_new_tokens)
        got = {"tokens": inp.tokens, "positions": inp.positions, "slot_mapping": inp.attn.slot_mapping,
               "target_ids": inp.target_ids, "kv_lens": inp.attn.kv_lens, "page_indices": inp.attn.page_indices,
               "cu_q_lens": inp.attn.cu_q_lens, "logits_indices": inp.logits_indices, "lora_slots": inp.lora_slots}
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} (trial {trial})")
            assert got[name].dtype == np.int32, name
        assert int(inp.attn.num_seqs[0]) == len(batch.seqs)
