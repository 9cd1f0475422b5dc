"""Aggregate metrics: latency percentiles over requests and the engine's own counters (padding, cache hits)."""

from __future__ import annotations

import dataclasses

import numpy as np

from inference.engine.outputs import RequestOutput


def percentiles(values: list[float]) -> dict[str, float]:
    """mean / p50 / p90 / p99 of a list of seconds (empty dict for no values)."""
    arr = np.asarray(values, np.float64)
    if arr.size == 0:
        return {}
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99))}


@dataclasses.dataclass
class EngineStats:
    """Counters the engine bumps every step; `summary()` turns them into rates."""

    prefill_steps: int = 0
    decode_steps: int = 0
    real_tokens: int = 0  # tokens that carried work
    padded_tokens: int = 0  # token slots the compiled step computed (bucket sizes)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_passes: int = 0  # sequence-steps that verified drafts
    spec_proposed: int = 0
    spec_accepted: int = 0

    def record_step(self, is_decode: bool, real: int, padded: int) -> None:
        if is_decode:
            self.decode_steps += 1
        else:
            self.prefill_steps += 1
        self.real_tokens += real
        self.padded_tokens += padded

    def record_speculation(self, proposed: int, accepted: int) -> None:
        self.spec_passes += 1
        self.spec_proposed += proposed
        self.spec_accepted += accepted

    def summary(self) -> dict[str, float]:
        return {
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "padding_waste": 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0,
            "prefix_cache_hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "spec_acceptance_rate": self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0,
            # tokens a speculating sequence gains per target pass: accepted drafts plus the one always emitted
            "spec_tokens_per_pass": (self.spec_accepted + self.spec_passes) / self.spec_passes if self.spec_passes
            else 0.0,
        }


def summarize_requests(outputs: list[RequestOutput], wall_s: float) -> dict[str, float | dict]:
    """Throughput and latency over finished requests: TTFT and inter-token latency percentiles, tokens/s."""
    done = [o for o in outputs if o.error is None and o.metrics is not None]
    ttft = [o.metrics.ttft for o in done if o.metrics.ttft is not None]
    itl = [x for o in done for x in o.metrics.inter_token_latencies]
    out_tokens = sum(len(c.token_ids) for o in done for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in done)
    return {
        "requests": len(done),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tok_s": out_tokens / wall_s if wall_s else 0.0,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
    }
