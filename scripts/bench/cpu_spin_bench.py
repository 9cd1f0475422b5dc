"""The C++ kernels' worker spin (`csrc/parallel_for.h`, $PAGEJAX_CPU_SPIN_US) against XLA's own thread pool: a chain
shaped like SmolLM2-135M's MLPs at batch 32 -- 30 x (int8 W8A8 gate and up, XLA's `silu(gate) * up` fusion, int8
down, an RMS norm), [32, 576] rows -- timed in child processes, one per spin value, the values alternating round by
round (the spin is read once per process). A spinning worker holds a core that XLA's 2-way fusions between the
kernel calls may want; not spinning makes every kernel call wake its worker. BENCHMARKS.md records the runs.

    python scripts/bench/cpu_spin_bench.py --spins=200,0 --rounds=3
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = flags.FLAGS
flags.DEFINE_list("spins", ["200", "0"], "PAGEJAX_CPU_SPIN_US values to compare (microseconds).")
flags.DEFINE_integer("rounds", 3, "Alternating rounds (one child process per value and round).")

CHILD = """
import sys, time
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from kernels_pallas.matmul.int8_cpu import int8_matmul_cpu
from models.quantization import formats
rng = np.random.default_rng(0)
def weight(shape):
    qw = formats.quantize_int8(rng.standard_normal(shape).astype(np.float32))
    return jnp.asarray(qw.q), jnp.asarray(qw.scale).reshape(-1)
layers = [(weight((576, 1536)), weight((576, 1536)), weight((1536, 576))) for _ in range(30)]
x = jnp.asarray(rng.standard_normal((32, 576)).astype(np.float32))
@jax.jit
def chain(x, layers):
    for gate, up, down in layers:
        h = jax.nn.silu(int8_matmul_cpu(x, *gate)) * int8_matmul_cpu(x, *up)
        x = x + int8_matmul_cpu(h, *down) * 1e-3
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x
jax.block_until_ready(chain(x, layers))
times = []
for _ in range(9):
    start = time.perf_counter()
    for _ in range(5):
        out = chain(x, layers)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / 5)
print(float(np.median(times)))
"""


def main(argv):
    del argv
    results = {spin: [] for spin in FLAGS.spins}
    for _ in range(FLAGS.rounds):
        for spin in FLAGS.spins:
            env = {**os.environ, "PAGEJAX_CPU_SPIN_US": spin, "JAX_PLATFORMS": "cpu"}
            proc = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT)], env=env, capture_output=True,
                                  text=True, check=True)
            results[spin].append(float(proc.stdout.strip().splitlines()[-1]) * 1e3)
            print(f"spin {spin:>5} us: {results[spin][-1]:8.2f} ms per chain, load {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(json.dumps({"ms_per_chain": results, "load_after": os.getloadavg()}))


if __name__ == "__main__":
    app.run(main)
