"""FP8 under tensor parallelism on 8 virtual CPU devices, run by tests/models/test_fp8.py in a subprocess (the pytest
process has one CPU device). Prints one JSON object on the last line of stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/fp8_tp_worker.py

tiny-llama (4 query / 2 KV heads: padded to 16 / 8 at TP 8) with quantization="fp8" and an fp8 KV cache at TP 1 and
TP 8: greedy tokens and their logprobs, whether every weight of the TP 8 model is on the e4m3 grid of its channel
(quantized after padding, so zero-padded channels must stay finite zeros), the q / o projections' partition specs,
and the error an FP8 checkpoint gets under TP.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402
import pathlib  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from inference import LLM, SamplingParams  # noqa: E402
from models.decoder import weight_targets  # noqa: E402

PROMPTS = [[5, 17, 42, 7, 99], [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
KW = dict(quantization="fp8", kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20, page_size=4, max_num_seqs=4,
          max_num_batched_tokens=64, compilation_cache_dir=None)


def on_channel_grids(kernel: np.ndarray) -> bool:
    """Whether each column of an [in, out] weight is (its max / 448) times e4m3 codes: FP8 per output channel."""
    scale = np.abs(kernel).max(axis=0) / 448
    codes = kernel / np.where(scale > 0, scale, 1)
    return bool(np.isfinite(kernel).all() and np.allclose(codes, codes.astype(jnp.float8_e4m3fn).astype(np.float32),
                                                          rtol=1e-5, atol=1e-5))


def main() -> None:
    results = {}
    for tp in (1, 8):
        llm = LLM("tiny-llama", tensor_parallel_size=tp, **KW)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        runner = llm.runner
        state = jax.tree.unflatten(runner.param_treedef, runner.param_leaves)
        targets = {name: np.asarray(p.get_value())
                   for name, p in weight_targets(nnx.merge(runner.graphdef, state)).items()}
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        results[tp] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs],
            "on_grid": {name: on_channel_grids(w) for name, w in targets.items() if w.ndim == 2 and name != "embed"},
            "q_proj_shape": list(targets["layers.0.q_proj"].shape),
            "specs": {path: str(s.spec) for path, s in zip(paths, runner.param_shardings or [])
                      if "layers'][0]" in path and ("q_proj" in path or "o_proj" in path)},
        }
    from tests.models.test_fp8_checkpoint import write_fp8_folder
    with tempfile.TemporaryDirectory() as folder:
        write_fp8_folder(pathlib.Path(folder), "fp8")
        try:
            LLM(folder, tensor_parallel_size=2, **{k: v for k, v in KW.items() if k != "kv_cache_dtype"})
            results["checkpoint_error"] = None
        except ValueError as e:
            results["checkpoint_error"] = str(e)
    print(json.dumps({"devices": jax.device_count(), "results": results}))


if __name__ == "__main__":
    main()
