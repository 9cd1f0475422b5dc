"""Weight sync from a trainer's FSDP layout into the engine's replicas, timed on 8 virtual CPU devices.

    python scripts/bench/rl_sync_benchmark.py --model=smollm2-135m --tp=3 --dp=2
    python scripts/bench/rl_sync_benchmark.py --model=llama-3-8b --num_layers=1 --dtype=bfloat16 --tp=2 --dp=1

The trainer's parameters live FSDP-sharded over all 8 devices (`inference/rl/weight_sync.py: fsdp_shardings`); the
engine's targets are the runner's own shardings (`sharding.partition.param_shardings` on each replica's `1 x tp`
mesh). The measured move is `inference/runtime/reshard.py: reshard_all`, what `LLM.update_weights` calls for each
replica, side by side with plain `jax.device_put` (which JAX 0.10 routes through the host between different device
sets) in the same run. Weights are constants of the model's real shapes (values do not change a copy's speed);
--num_layers keeps a real-size preset within this machine's memory (every layer has the same shapes). The first
sync compiles the transfer programs (reported apart); then best of --repeats. The last line printed
is one JSON object.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from configs.presets import get_model_config  # noqa: E402
from inference.rl.weight_sync import fsdp_shardings  # noqa: E402
from inference.runtime.reshard import reshard_all  # noqa: E402
from models.decoder import Decoder  # noqa: E402
from sharding.mesh import make_mesh, replica_meshes  # noqa: E402
from sharding.partition import needs_padding, param_shardings  # noqa: E402

flags.DEFINE_string("model", "smollm2-135m", "a preset name (configs/presets.py)")
flags.DEFINE_integer("num_layers", None, "keep this many layers (a real-size preset within host memory)")
flags.DEFINE_string("dtype", "float32", "parameter dtype")
flags.DEFINE_integer("tp", 2, "engine tensor-parallel size")
flags.DEFINE_integer("dp", 2, "engine data-parallel replicas")
flags.DEFINE_integer("repeats", 3, "timed syncs after the first (best reported)")
FLAGS = flags.FLAGS


def _sync(move, leaves, targets) -> float:
    start = time.perf_counter()
    out = [move(leaves, shardings) for shardings in targets]  # what each replica's runner does
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    del out
    return seconds


def main(argv) -> None:
    del argv
    config = get_model_config(FLAGS.model)
    if FLAGS.num_layers:
        config = config.replace(num_layers=FLAGS.num_layers)
    if needs_padding(config, FLAGS.tp):
        raise ValueError(f"{FLAGS.model} needs head/vocab/MLP padding at TP {FLAGS.tp}; pick a TP that divides them")
    dtype = jnp.dtype(FLAGS.dtype)
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0))))
    specs = jax.tree.leaves(abstract)
    trainer_mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
    leaves = [jax.jit(lambda s=s: jnp.full(s.shape, 0.01, s.dtype), out_shardings=sh)()
              for s, sh in zip(specs, fsdp_shardings(abstract, trainer_mesh))]
    targets = [param_shardings(abstract, mesh) for mesh in replica_meshes(make_mesh(data=FLAGS.dp, model=FLAGS.tp))]
    nbytes = sum(x.nbytes for x in leaves)
    moved = nbytes * FLAGS.dp  # every replica receives the whole model (in shards)
    result = {"model": FLAGS.model, "num_layers": config.num_layers, "dtype": FLAGS.dtype, "tp": FLAGS.tp,
              "dp": FLAGS.dp, "param_bytes": nbytes, "bytes_moved": moved, "num_leaves": len(leaves)}
    for name, move in (("reshard", reshard_all), ("device_put", jax.device_put)):
        first = _sync(move, leaves, targets)
        best = min(_sync(move, leaves, targets) for _ in range(FLAGS.repeats))
        result[name] = {"first_s": first, "best_s": best, "gb_per_s": moved / best / 1e9}
    result["device_put_over_reshard_time"] = result["device_put"]["best_s"] / result["reshard"]["best_s"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    result.update(date=time.strftime("%Y-%m-%d"), commit=commit, machine=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), jax=jax.__version__)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
