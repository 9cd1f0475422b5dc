"""Weight sync from a trainer's FSDP-8 layout into an engine at TP 2 x DP 2 on 8 virtual CPU devices, run by
tests/sharding/test_rl_sync.py in a subprocess (the pytest process has one CPU device). Prints one JSON object on
the last line of stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/rl_sync_worker.py
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from inference import LLM, SamplingParams  # noqa: E402
from inference.rl.weight_sync import to_fsdp  # noqa: E402
from inference.runtime.compile_cache import enable_compilation_cache  # noqa: E402

PROMPTS = [[5, 17, 300, 42, 9, 11], [7, 8, 9], [1, 2, 3, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def main() -> None:
    enable_compilation_cache(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), ".jax_cache"))
    llm = LLM("tiny-llama", tensor_parallel_size=2, data_parallel_size=2, kv_cache_memory_bytes=1 << 20,
              page_size=4, max_num_seqs=4, max_num_batched_tokens=32, compilation_cache_dir=None)
    before = tokens(llm)
    trainer_mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
    # The trainer's new weights: the engine's, changed, on its own FSDP-8 layout.
    trained = to_fsdp(jax.tree.map(lambda x: x * 1.25, llm.get_params()), trainer_mesh)
    trained_host = jax.device_get(trained)
    compiles = [r.num_compilations() for r in llm.runners]
    # A host round trip would come back host -> device, which the guard refuses (explicit transfers included; on
    # CPU the device -> host leg is not guarded, the return leg is). Device-to-device copies stay allowed.
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        llm.update_weights(trained)
    after = tokens(llm)
    recompiled = [r.num_compilations() for r in llm.runners] != compiles
    exact, same_shardings = True, True
    for runner in llm.runners:
        for leaf, want, sharding in zip(runner.param_leaves, jax.tree.leaves(trained_host), runner.param_shardings):
            exact &= bool(np.array_equal(np.asarray(leaf), want))
            same_shardings &= leaf.sharding == sharding
    llm.update_weights(trained_host)  # the same weights through the host: the reference for the tokens
    via_host = tokens(llm)
    trainer_devices = len({d for x in jax.tree.leaves(trained) for d in x.devices()})
    print(json.dumps(dict(devices=jax.device_count(), trainer_devices=trainer_devices,
                          replica_devices=[len(r.mesh.devices.flat) for r in llm.runners], before=before,
                          after=after, via_host=via_host, recompiled=recompiled, exact=exact,
                          same_shardings=same_shardings)))


if __name__ == "__main__":
    main()
