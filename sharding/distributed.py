"""Multi-process start-up: `jax.distributed.initialize` from flags or the environment, one code path everywhere.

Each process (one per host on a TPU pod or a multi-GPU cluster; several on one machine for tests) calls
`initialize(DistributedConfig...)` before any other JAX call. Afterwards `jax.devices()` lists every process's
devices and `jax.local_devices()` this process's own. pagejax runs *process-level data parallelism*: every process
builds its own `LLM` (its replicas and tensor-parallel meshes over its local devices only,
inference/entrypoints/llm.py), takes its share of the input (`shard_for_process`, grain's per-process sharding) and
writes its own output shard; a barrier (`failed_processes`, which also says who failed) then lets process 0 merge
the shards (scripts/generate.py). No array spans processes, so there is no cross-host traffic while generating; a
model too large for one host's devices would need a mesh that spans hosts, which this does not do.

Where the settings come from (flags win over the environment):

    coordinator address  --coordinator_address   PAGEJAX_COORDINATOR_ADDRESS   host:port of process 0
    process count        --num_processes         PAGEJAX_NUM_PROCESSES
    this process's id    --process_id            PAGEJAX_PROCESS_ID            0 .. count-1
    auto-detect          --distributed_auto      PAGEJAX_DISTRIBUTED_AUTO=1    JAX reads the cluster itself
                                                                               (TPU pod metadata, SLURM, Open MPI)

On CPU the processes exchange collectives over gloo; the setting only
affects the CPU client, so GPU and TPU processes run the same code.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Mapping

import jax
import numpy as np

ENV_COORDINATOR = "PAGEJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "PAGEJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PAGEJAX_PROCESS_ID"
ENV_AUTO = "PAGEJAX_DISTRIBUTED_AUTO"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the job. All None and `auto=False`: a single process, nothing to initialise."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    initialization_timeout_s: int = 300

    @property
    def is_multi_process(self) -> bool:
        return self.auto or self.coordinator_address is not None or (self.num_processes or 1) > 1

    def validate(self) -> None:
        if self.auto:
            if self.coordinator_address is not None or self.num_processes is not None or self.process_id is not None:
                raise ValueError("distributed auto-detection takes no coordinator address, process count or id; "
                                 "pass either auto or all three")
            return
        if not self.is_multi_process:
            if self.process_id not in (None, 0):
                raise ValueError(f"process_id={self.process_id} without a multi-process job; pass "
                                 "coordinator_address and num_processes too")
            return
        given = {"coordinator_address": self.coordinator_address, "num_processes": self.num_processes,
                 "process_id": self.process_id}
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"a multi-process job needs coordinator_address, num_processes and process_id; "
                             f"{', '.join(missing)} missing (flags --{missing[0]} or ${_ENV_OF[missing[0]]})")
        if ":" not in self.coordinator_address:
            raise ValueError(f"coordinator_address {self.coordinator_address!r} must be host:port")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")


_ENV_OF = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES, "process_id": ENV_PROCESS_ID}


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, auto: bool | None = None,
            environ: Mapping[str, str] | None = None) -> DistributedConfig:
    """The job's settings: each argument given wins, else its environment variable, else unset; validated."""
    environ = os.environ if environ is None else environ
    config = DistributedConfig(
        coordinator_address=coordinator_address or environ.get(ENV_COORDINATOR) or None,
        num_processes=num_processes if num_processes is not None else _env_int(environ, ENV_NUM_PROCESSES),
        process_id=process_id if process_id is not None else _env_int(environ, ENV_PROCESS_ID),
        auto=bool(auto) if auto is not None else environ.get(ENV_AUTO, "") in ("1", "true", "True"))
    config.validate()
    return config


def initialize(config: DistributedConfig) -> tuple[int, int]:
    """Join the job (before any other JAX call); returns (this process's index, process count). A single-process
    config initialises nothing and returns (0, 1)."""
    config.validate()
    if not config.is_multi_process:
        return 0, 1
    # Only the CPU client reads this (gloo is its default in JAX 0.10.2; set so a changed default cannot break us).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.auto:
        jax.distributed.initialize(initialization_timeout=config.initialization_timeout_s)
    else:
        jax.distributed.initialize(coordinator_address=config.coordinator_address,
                                   num_processes=config.num_processes, process_id=config.process_id,
                                   initialization_timeout=config.initialization_timeout_s)
    return jax.process_index(), jax.process_count()


def failed_processes(name: str, ok: bool) -> list[int]:
    """A barrier that also says who failed: every process reaches it with whether its own part went well, and each
    learns the indices of those whose part did not. Then all can stop together, instead of the others waiting at a
    later barrier for a process that has already exited. A single process gets [] or [0] back at once."""
    if jax.process_count() == 1:
        return [] if ok else [0]
    from jax.experimental import multihost_utils

    h = zlib.crc32(name.encode())
    got = np.asarray(multihost_utils.process_allgather(np.array([h, int(ok)], dtype=np.uint32))).reshape(-1, 2)
    if (got[:, 0] != h).any():  # the processes took different paths to here: a bug, never a user's error
        raise RuntimeError(f"processes met at different barriers: this one at {name!r}")
    return [int(i) for i in np.flatnonzero(got[:, 1] == 0)]


def shutdown() -> None:
    """Leave the job (a no-op in a single process): lets the coordinator see a clean exit."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()


def shard_for_process(dataset, shard_options=None):
    """This process's share of a `grain.MapDataset`: every `count`-th element starting at its index (round robin,
    so a file sorted by length still spreads evenly). `shard_options` defaults to grain's `ShardByJaxProcess`."""
    import grain

    options = shard_options or grain.sharding.ShardByJaxProcess()
    return dataset.slice(slice(options.shard_index, None, options.shard_count))


__all__ = ["DistributedConfig", "failed_processes", "initialize", "resolve", "shard_for_process", "shutdown"]
