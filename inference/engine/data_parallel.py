"""Data parallelism: D independent engine replicas behind the one-engine interface `LLM` and `EngineLoop` use.

Replicate for throughput: each replica is a full `Engine` (its own runner, weights, KV pages, block manager and
scheduler) on its own `1 x T` slice of a `D x T` device mesh (`sharding.replica_meshes`). Replicas share nothing
and never communicate, so data parallelism costs D copies of the weights and no collectives.

A new request goes to the replica with the fewest outstanding tokens (prompt plus the most it may generate, times
`n`, summed over its unfinished requests): a cheap estimate known at admission that keeps long and short requests
from piling onto one replica. Results come back keyed by request id, so callers keep input order.

`step()` steps every replica that has work at once, each on its own worker thread: a replica's Python scheduling and
batch building run while the other replicas' jitted steps execute, and every thread blocks on its own device->host
read-back with the GIL released, so the replicas' device work overlaps (dispatch all, then read back) without the
engine having to split its step in two.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

from inference.engine.llm_engine import Engine, Request
from inference.engine.metrics import EngineStats
from inference.engine.outputs import RequestOutput
from inference.sampling.params import SamplingParams


class _Requests(Mapping):
    """Read-only view of every replica's `requests`, found through the request's replica (no merged copy)."""

    def __init__(self, owner: DataParallelEngine):
        self._owner = owner

    def __getitem__(self, request_id: str) -> Request:
        replica = self._owner._replica_of.get(request_id)
        if replica is None:
            raise KeyError(request_id)
        return self._owner.engines[replica].requests[request_id]

    def __iter__(self) -> Iterator[str]:
        for engine in self._owner.engines:
            yield from list(engine.requests)

    def __len__(self) -> int:
        return sum(len(engine.requests) for engine in self._owner.engines)


class DataParallelEngine:
    """The `EngineClient` interface (inference/engine/client.py) over several `Engine` replicas (see the module
    docstring)."""

    def __init__(self, engines: list[Engine]):
        if not engines:
            raise ValueError("DataParallelEngine needs at least one engine replica")
        self.engines = list(engines)
        self.runners = [e.runner for e in self.engines]
        self.runner = self.runners[0]  # the first replica, for code that inspects one runner (config, compiles)
        self.tokenizer = self.engines[0].tokenizer
        self.max_model_len = self.engines[0].max_model_len
        self.outstanding = [0] * len(self.engines)  # estimated tokens still to process, per replica
        self.num_assigned = [0] * len(self.engines)  # requests sent to each replica so far (load reports, tests)
        self._replica_of: dict[str, int] = {}
        self._cost: dict[str, int] = {}  # live (unfinished) requests' estimates
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.engines)

    # ---- submission -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request on the least-loaded replica. Raises ValueError (and queues nothing) if it can never run."""
        cost = params.n * (len(prompt_token_ids) + (params.max_tokens if params.max_tokens is not None
                                                    else max(self.max_model_len - len(prompt_token_ids), 0)))
        with self._lock:
            if request_id in self._replica_of:
                raise ValueError(f"request id {request_id!r} is already in use")
            replica = min(range(len(self.engines)), key=lambda r: (self.outstanding[r], r))
            self.engines[replica].add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                              arrival_time=arrival_time, priority=priority)
            self._replica_of[request_id] = replica
            self._cost[request_id] = cost
            self.outstanding[replica] += cost
            self.num_assigned[replica] += 1

    def abort(self, request_id: str) -> None:
        replica = self._replica_of.get(request_id)
        if replica is None:
            return
        self.engines[replica].abort(request_id)
        self._settle(request_id)

    def _settle(self, request_id: str) -> None:
        """A request finished: its estimate no longer loads its replica."""
        with self._lock:
            cost = self._cost.pop(request_id, None)
            if cost is not None:
                self.outstanding[self._replica_of[request_id]] -= cost

    # ---- stepping ---------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def settle(self) -> None:
        """Every replica's in-flight step folded (async scheduling); the next `step` reports their outputs."""
        for engine in self.engines:
            engine.settle()

    def drain(self) -> list[RequestOutput]:
        """Every replica's in-flight step folded (async scheduling); their outputs."""
        outputs = [out for engine in self.engines for out in engine.drain()]
        for out in outputs:
            if out.finished:
                self._settle(out.request_id)
        return outputs

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One step of every replica that has work, run concurrently; the outputs of all of them (`finished_only`:
        of the requests that finished, as `Engine.step`)."""
        active = [e for e in self.engines if e.has_unfinished_requests()]
        if len(active) <= 1:
            results = [e.step(finished_only) for e in active]
        else:
            results = list(self._executor().map(functools.partial(Engine.step, finished_only=finished_only), active))
        outputs = [out for result in results for out in result]
        for out in outputs:
            if out.finished:
                self._settle(out.request_id)
        return outputs

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="pagejax-replica")
        return self._pool

    def warmup(self, prefill: bool = True, extras: bool = True) -> int:
        """`Engine.warmup` on every replica (concurrently: each replica's devices need their own executables);
        returns the number of variants compiled over all replicas."""
        return sum(self._executor().map(lambda e: e.warmup(prefill=prefill, extras=extras), self.engines))

    def close(self) -> None:
        """Stop the worker threads (a later step starts them again)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # ---- outputs and bookkeeping ------------------------------------------------------------------------------
    @property
    def requests(self) -> Mapping[str, Request]:
        return _Requests(self)

    def output_of(self, request_id: str) -> RequestOutput:
        return self.engines[self._replica_of[request_id]].output_of(request_id)

    def pop_finished(self, request_id: str) -> None:
        replica = self._replica_of.get(request_id)
        if replica is None:
            return
        engine = self.engines[replica]
        request = engine.requests.get(request_id)
        if request is not None and not request.finished:
            return
        self._settle(request_id)
        engine.pop_finished(request_id)
        with self._lock:
            del self._replica_of[request_id]

    def reset_prefix_cache(self) -> None:
        for engine in self.engines:
            engine.reset_prefix_cache()

    def recompute_running(self) -> int:
        return sum(engine.recompute_running() for engine in self.engines)

    def reset_stats(self) -> None:
        for engine in self.engines:
            engine.reset_stats()

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters summed (a fresh object: bump the replicas' own stats, not this)."""
        total = EngineStats()
        for engine in self.engines:
            for field, value in vars(engine.stats).items():
                setattr(total, field, getattr(total, field) + value)
        return total

    def metrics_summary(self) -> dict[str, float]:
        return {**self.stats.summary(),
                "preemptions": sum(e.scheduler.num_preemptions for e in self.engines),
                "replicas": len(self.engines)}


__all__ = ["DataParallelEngine"]
