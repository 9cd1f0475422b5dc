"""Deviceless compile of the Mosaic GPU ragged paged attention kernel for H100 / H200 (sm_90a) at real shapes, with
what the compiler said: ptxas registers / spills and Mosaic GPU's shared memory (scratch bytes, barriers).

Run as `python -m kernels_pallas.attention.mosaic_gpu_compile [h100|h200] [--triton] [case ...]` (prints one JSON
row per case; `--triton`: the Triton kernel at the same shapes). Mosaic GPU prints ptxas's report and its
resources only when `MOSAIC_GPU_DUMP_PTXAS=1` and `MOSAIC_GPU_DUMP_RESOURCES=1` are in the environment (set
below, before any compile; XLA's own log settings for Triton's report are read at start-up, so `__main__` restarts
the process with them). The logs go to the native stderr and stdout, collected with
`gpu_compile_report.capture_native_fd`. Needs jax-cuda13-plugin (the GPU compiler) and `JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
os.environ.setdefault("MOSAIC_GPU_DUMP_RESOURCES", "1")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMEM_OPT_IN = 232448  # bytes of shared memory a block may opt into on H100 / H200 (configs/gpu_targets)
KERNEL = "ragged_paged_attention_mosaic_gpu_kernel"

# name: (q_lens, kv_lens, Hq, Hkv, head_dim, page_size, pages_per_seq, kwargs); kwargs' "kv_dtype": the cache's
# dtype (bf16 unless named; "int8" adds its scales), the rest go to the kernel
CASES = {
    # decode: 64 sequences x 2048 tokens, Hq 32 / Hkv 8 / D 128, bf16, 16-token pages
    "decode_64x2048": ([1] * 64, [2048] * 64, 32, 8, 128, 16, 128, {}),
    # the same with split-KV forced on (what a small batch gets by default)
    "decode_64x2048_split4": ([1] * 64, [2048] * 64, 32, 8, 128, 16, 128, {"num_kv_splits": 4}),
    # mixed: 4 prefills of 512 new tokens (on 512 cached) + 60 decodes of 2048
    "mixed_4x512_60x2048": ([512] * 4 + [1] * 60, [1024] * 4 + [2048] * 60, 32, 8, 128, 16, 128, {}),
    # head_dim 64, 64-token pages, sliding window and soft cap
    "decode_d64_p64_window_softcap": ([1] * 32, [4096] * 32, 32, 4, 64, 64, 64,
                                      {"sliding_window": 1024, "soft_cap": 30.0}),
    # int8 cache with its per-token scales (bf16 queries): the decode shape above, and D 64 with split-KV (a
    # program's code does not depend on the batch's shape: the mixed batch compiled to the decode's figures)
    "decode_64x2048_int8": ([1] * 64, [2048] * 64, 32, 8, 128, 16, 128, {"kv_dtype": "int8"}),
    "decode_d64_p32_int8_split4": ([1] * 32, [4096] * 32, 32, 4, 64, 32, 128,
                                   {"kv_dtype": "int8", "num_kv_splits": 4}),
}

_SMEM = re.compile(r"smem_scratch_bytes=(\d+)")


def compile_case(chip: str, name: str, impl: str = "mosaic_gpu") -> dict:
    """Compile case `name` for `chip` with the Mosaic GPU kernel, or with impl="gpu" the Triton kernel at the same
    shapes (its block sizes from its per-chip table), so the two compilers' figures sit side by side."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from kernels_pallas.attention.gpu import ragged_paged_attention_gpu
    from kernels_pallas.attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu
    from kernels_pallas.gpu_compile_report import capture_native_fd, parse_compile_log
    from kernels_pallas.kv_cache.layout import kv_cache_spec

    q_lens, kv_lens, hq, hkv, head_dim, page_size, pps, kw = CASES[name]
    kw = dict(kw)
    kv_dtype = jnp.dtype(kw.pop("kv_dtype", "bfloat16"))
    target = open(os.path.join(REPO, "configs", "gpu_targets", f"{chip}.txtpb")).read()
    topo = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
    mesh = Mesh(np.array(topo.devices), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    seqs = len(q_lens)
    cache = kv_cache_spec(seqs * pps + 1, page_size, hkv, head_dim, kv_dtype)
    cache, scales = cache if kv_dtype == jnp.int8 else (cache, None)
    shapes = [((sum(q_lens), hq, head_dim), jnp.bfloat16), (cache.shape, cache.dtype), ((seqs,), jnp.int32),
              ((seqs, pps), jnp.int32), ((seqs + 1,), jnp.int32), ((1,), jnp.int32)]
    if scales is not None:
        shapes.append((scales.shape, scales.dtype))
    args = [jax.ShapeDtypeStruct(s, d, sharding=rep) for s, d in shapes]
    if impl == "mosaic_gpu":
        kernel = ragged_paged_attention_mosaic_gpu
    else:  # the Triton kernel blocks its queries by max_q_len (static)
        kernel, kw = ragged_paged_attention_gpu, {**kw, "max_q_len": max(q_lens)}
    def fn(*a):
        return kernel(*a[:6], sm_scale=head_dim ** -0.5, kv_scales=a[6] if len(a) > 6 else None, **kw)
    with capture_native_fd(2) as err, capture_native_fd(1) as out:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            lowered = jax.jit(fn).lower(*args)
        lowered.compile()
    log = [err[0] + out[0]]
    report = parse_compile_log(log[0])
    if impl == "mosaic_gpu":
        ptxas = next((v for k, v in report["kernels"].items() if KERNEL in k), None)
        smem = [int(m) for m in _SMEM.findall(log[0])]
    else:
        ptxas = {k: v for k, v in report["kernels"].items() if "attention" in k} or report["kernels"]
        smem = report["shared_memory"]
    return dict(chip=chip, case=name, impl=impl, ptxas=ptxas, shared_memory_bytes=max(smem) if smem else None)


def main(argv):
    """argv: [chip] [--triton] [case ...]; --triton compiles the Triton kernel at the same shapes instead."""
    impl = "gpu" if "--triton" in argv else "mosaic_gpu"
    argv = [a for a in argv if a != "--triton"]
    chip = argv[0] if argv else "h100"
    for name in argv[1:] or list(CASES):
        print(json.dumps(compile_case(chip, name, impl)), flush=True)


if __name__ == "__main__":
    # XLA logs the Triton kernel's ptxas report only with these set when it loads (the package's import of jax
    # already did), so the process restarts itself with them, as scripts/tools/aot_compile.py does.
    want = dict(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="subprocess_compilation=2,xtile_compiler=2")
    if any(os.environ.get(k) != v for k, v in want.items()):
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], {**os.environ, **want})
    main(sys.argv[1:])
