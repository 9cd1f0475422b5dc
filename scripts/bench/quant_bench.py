"""Time f32 vs quantized-weight matmuls side by side on this machine and inspect the compiled HLO.

    python scripts/bench/quant_bench.py                      # SmolLM2 shapes 1x576x1536, 32x576x1536, 1x576x49152
    python scripts/bench/quant_bench.py --shapes=32x576x1536 --rounds=50

For each shape (M x K x N: activation [M, K] @ weight [K, N]) and each weight format /
`models.quantization.formats.matmul` method it prints the median time, the ratio to the f32 matmul, the compiled temp
memory, whether the compiled HLO holds a float32 (or int32) array of the full weight (shape [K, N], [K/g, g, N] or
[K/g, g/2, N]; s8[K/g, g/2, N] are the unpacked int4 nibbles, 1 byte per weight), and the max error relative to
max|x @ W_dequantized|. Variants are timed interleaved, round-robin, so machine load hits all alike.
"""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from models.quantization import formats as qz

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["1x576x1536", "32x576x1536", "1x576x49152"], "M x K x N matmul shapes.")
flags.DEFINE_integer("rounds", 20, "Timed calls per variant (median reported).")
flags.DEFINE_list("int4_groups", ["32", "64"], "Group sizes for the int4 formats (must divide K).")


def _full_weight_arrays(hlo: str, m: int, k: int, n: int, groups: list[int]) -> list[str]:
    """Float/int32 arrays in the HLO shaped like the whole weight; '(=acc)' marks a shape that is also the per-group
    accumulator [K/g, M, N] (M == g), where the text alone cannot tell them apart (see the temp memory column)."""
    all_groups = set(groups) | {32, k}
    shapes = {(k, n), (n, k)} | {(k // g, g, n) for g in all_groups} | {(k // g, g // 2, n) for g in all_groups}
    acc_shapes = {(k // g, mm, n) for g in all_groups for mm in (m, max(m, 2))}
    found = set()
    nibbles = {(k // g, g // 2, n) for g in all_groups}
    for dtype, dims in re.findall(r"\b(f32|s32|bf16|f16|s8)\[([\d,]+)\]", hlo):
        shape = tuple(int(d) for d in dims.split(","))
        if shape in shapes and (dtype != "s8" or shape in nibbles):  # s8: unpacked int4 nibbles (1 byte each)
            found.add(f"{dtype}[{dims}]" + ("(=acc)" if shape in acc_shapes else ""))
    return sorted(found)


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    groups = [int(g) for g in FLAGS.int4_groups]
    for spec in FLAGS.shapes:
        m, k, n = (int(d) for d in spec.lower().split("x"))
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        wj = jnp.asarray(w)
        variants = {"f32": (jax.jit(lambda x, w: x @ w), wj, None)}
        formats = {"int8/channel": qz.quantize_int8(w), "int8/g32": qz.quantize_int8(w, 32)}
        formats.update({f"int4/g{g}": qz.quantize_int4(w, g) for g in groups if k % g == 0})
        for fname, qw in formats.items():
            qw = jax.tree_util.tree_map(jnp.asarray, qw)
            methods = ("dequant", "int8") if fname == "int8/channel" else qz.MATMUL_METHODS
            for method in methods:
                variants[f"{fname} {method}"] = (jax.jit(functools.partial(qz.matmul, method=method)), qw, qw)
        rows = {}
        for name, (f, wt, qw) in variants.items():
            compiled = f.lower(x, wt).compile()
            mem = compiled.memory_analysis()
            temp = getattr(mem, "temp_size_in_bytes", -1) if mem is not None else -1
            y = np.asarray(f(x, wt))
            ref = np.asarray(x) @ (np.asarray(qw.dequantize(), np.float64) if qw is not None else w.astype(np.float64))
            err = float(np.abs(y - ref).max() / np.abs(ref).max())
            wbytes = qw.nbytes if qw is not None else w.nbytes
            rows[name] = dict(times=[], temp=temp, err=err, wbytes=wbytes,
                              full=_full_weight_arrays(compiled.as_text(), m, k, n, groups))
        for _ in range(FLAGS.rounds):
            for name, (f, wt, _) in variants.items():
                t0 = time.perf_counter()
                f(x, wt).block_until_ready()
                rows[name]["times"].append(time.perf_counter() - t0)
        base = float(np.median(rows["f32"]["times"]))
        print(f"\n== {m}x{k}x{n}  (x [{m},{k}] @ W [{k},{n}]), median of {FLAGS.rounds}; f32 = {base * 1e3:.3f} ms "
              f"= {2 * m * k * n / base / 1e9:.1f} GFLOP/s")
        print(f"{'variant':<22}{'ms':>9}{'x f32':>8}{'W MiB':>8}{'temp MiB':>10}{'rel err':>10}  weight-shaped "
              "f32/s32 (and s8 nibble) arrays in the HLO; the f32 row's is its parameter")
        for name, r in rows.items():
            t = float(np.median(r["times"]))
            print(f"{name:<22}{t * 1e3:>9.3f}{t / base:>8.2f}{r['wbytes'] / 2**20:>8.2f}{r['temp'] / 2**20:>10.2f}"
                  f"{r['err']:>10.1e}  {', '.join(r['full']) or '-'}")


if __name__ == "__main__":
    app.run(main)
