"""Warm-up covers serving: every prefill shape a batch can take is enumerated, and after `warmup(prefill=True)` a
varied workload compiles no step."""

import numpy as np

from inference import LLM, SamplingParams
from inference.engine.scheduler import ScheduledBatch
from inference.engine.sequence import Sequence
from inference.runtime.batch import BucketLimits, build_model_input
from inference.runtime.warmup import StepShape, prefill_shapes
from tests.tiny_folder import make_tiny_hf_folder


def test_prefill_shapes_hold_every_batch_shape():
    rng = np.random.default_rng(3)
    page = 4
    for limits in (BucketLimits(max_tokens=24, max_seqs=3, max_pages_per_seq=10, fine_pages=True),
                   BucketLimits(max_tokens=64, max_seqs=8, max_pages_per_seq=16)):
        shapes = set(prefill_shapes(limits, page))
        seen = set()
        for _ in range(3000):
            budget, seqs, counts = limits.max_tokens, [], []
            for i in range(int(rng.integers(1, limits.max_seqs + 1))):
                if budget == 0:
                    break
                context = limits.max_pages_per_seq * page
                computed = int(rng.integers(0, context)) if rng.random() < 0.5 else 0
                room = min(budget, context - computed)
                count = min(room, int(2 ** rng.uniform(0, np.log2(room + 1))))  # short chunks as often as long
                seq = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1] * (computed + count),
                               num_prompt_tokens=computed + count, params=SamplingParams(), seed=0, arrival_order=i)
                seq.num_computed_tokens = computed
                seq.block_tables = [list(range(-(-(computed + count) // page)))]
                seqs.append(seq)
                counts.append(count)
                budget -= count
            batch = ScheduledBatch(seqs, counts)
            if batch.is_decode:
                continue
            inp, _ = build_model_input(batch, page, limits)
            shape = StepShape(inp.tokens.shape[0], inp.attn.kv_lens.shape[0], inp.attn.page_indices.shape[-1],
                                 inp.attn.max_q_len)
            assert shape in shapes, (shape, counts)
            seen.add(shape)
        # the enumeration is not padded with shapes no batch reaches (most of them came up at random)
        assert len(seen) >= 0.8 * len(shapes), (len(seen), len(shapes))


def test_no_step_compiles_after_full_warmup(tmp_path):
    llm = LLM(str(make_tiny_hf_folder(tmp_path / "tiny")), max_num_batched_tokens=8, max_num_seqs=2, page_size=8,
              max_model_len=32, kv_cache_memory_bytes=1 << 18, seed=0)
    limits = llm.engine.limits
    expected_prefill = len(prefill_shapes(limits, llm.engine.page_size))
    compiled = llm.warmup(prefill=True)
    counts = llm.runner.num_compilations()
    assert counts["prefill"] == 2 * expected_prefill  # filters off / on
    assert compiled == counts["prefill"] + counts["decode"]
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 17).tolist()
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (3, 9, 15, 22, 30)]
    prompts += [shared + [5], shared + [6, 7]]  # the second one hits the first one's cached pages
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=1, max_tokens=8, ignore_eos=True, stop=["a", "zz"]),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=2, max_tokens=5, n=2),
              SamplingParams(temperature=1.0, min_p=0.1, seed=3, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=2, stop=["b"]),
              SamplingParams(temperature=0.7, seed=4, max_tokens=4, n=2),
              SamplingParams(temperature=0.0, max_tokens=3)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    outs += llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4])
    assert all(o.error is None and o.finished for o in outs)
    assert llm.engine.block_manager.prefix_hits_tokens > 0
    assert llm.runner.num_compilations() == counts
