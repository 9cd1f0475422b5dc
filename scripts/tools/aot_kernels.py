"""The attention kernel cases of `aot_compile.py` (`--what=kernels`, `--what=mosaic_gpu`): each case's shapes and
dtypes, and what it compiles (the kernel the chip's backend runs, MLA's kernel or reference) through the harness."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from kernels_pallas.backend import compiling_for
from kernels_pallas.kv_cache.layout import kv_cache_spec
from scripts.tools.aot_harness import CHIPS, chip_mesh, compile_case


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kind: str  # "decode" (64 x 1 query), "prefill" (4 x 512) or "mixed" (32 decodes + 2 x 256 prefill chunks)
    dtype: str  # cache dtype: float32, bfloat16, int8, float8_e4m3fn (queries bf16 for int8 and fp8)
    head_dim: int
    num_kv_heads: int
    group: int = 4  # query heads per KV head
    page_size: int = 16
    context: int = 2048  # tokens per sequence
    window: bool = False  # a 1024-token sliding window and a soft cap of 50 (Gemma 2/3)
    impl: str = "gpu"  # on GPU chips: "gpu" (Pallas Triton) or "mosaic_gpu" (Pallas Mosaic GPU, Hopper)
    num_kv_splits: int | None = None  # None: the kernel's default

    @property
    def name(self) -> str:
        return (f"{self.kind}_{self.dtype}_d{self.head_dim}_kv{self.num_kv_heads}_g{self.group}"
                f"_p{self.page_size}" + ("_window_softcap" if self.window else "")
                + (f"_split{self.num_kv_splits}" if self.num_kv_splits else "")
                + ("_mosaic_gpu" if self.impl == "mosaic_gpu" else ""))

    @property
    def batch(self) -> tuple[int, int]:
        """(sequences, tokens): the static shape of the step."""
        return {"decode": (64, 64), "prefill": (4, 2048), "mixed": (34, 544)}[self.kind]

    def inputs(self, sharding) -> tuple:
        """Abstract (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs[, kv_scales]) and max_q_len."""
        num_seqs, num_tokens = self.batch
        q_len = {"decode": 1, "prefill": 512, "mixed": 256}[self.kind]
        pages_per_seq = -(-self.context // self.page_size)
        spec = kv_cache_spec(num_seqs * pages_per_seq + 1, self.page_size, self.num_kv_heads, self.head_dim,
                             self.dtype)
        cache, scales = spec if isinstance(spec, tuple) else (spec, None)
        q_dtype = jnp.float32 if self.dtype == "float32" else jnp.bfloat16
        s32 = jnp.int32
        shapes = [((num_tokens, self.num_kv_heads * self.group, self.head_dim), q_dtype),
                  (cache.shape, cache.dtype), ((num_seqs,), s32), ((num_seqs, pages_per_seq), s32),
                  ((num_seqs + 1,), s32), ((1,), s32)] + ([(scales.shape, scales.dtype)] if scales else [])
        return tuple(jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes), q_len


def kernel_cases(quick: bool = False) -> list[KernelCase]:
    """quick: the CI grid (dtypes x head_dim {64, 128} x KV heads {3, 8} x decode/prefill, and mixed at D 128 /
    Hkv 8). Full: head_dim up to
    256, KV heads 1-16, and for bf16 / int8 page sizes 32 and 64, GQA ratios 1, 2 and 8, mixed batches and a
    sliding window with a soft cap."""
    head_dims, kv_heads = ((64, 128), (3, 8)) if quick else ((64, 128, 256), (1, 3, 5, 8, 16))
    cases = [KernelCase(kind, dtype, d, h) for kind, dtype, d, h in
             itertools.product(("decode", "prefill"), ("bfloat16", "float32", "int8"), head_dims, kv_heads)]
    # the mixed batch at D 128 / Hkv 8: with decode and prefill above, every entry of the Triton kernel's tuning
    # table (kernels_pallas/attention/gpu_tuning.py) for each GPU chip
    cases += [KernelCase("mixed", dtype, 128, 8) for dtype in ("bfloat16", "float32", "int8")]
    if not quick:
        for kind, dtype in itertools.product(("decode", "prefill", "mixed"), ("bfloat16", "int8")):
            cases += [KernelCase(kind, dtype, 128, 8, page_size=p) for p in (32, 64)]
            cases += [KernelCase(kind, dtype, 128, 8, group=g) for g in (1, 2, 8)]
            cases += [KernelCase(kind, dtype, 128, 8, window=True)]
    return cases


def mosaic_gpu_cases() -> list[KernelCase]:
    """The Mosaic GPU kernel (bf16 / f16 queries, a cache of that dtype, int8 or fp8; no f32): decode with and
    without split-KV, a mixed batch, head_dim 64 over 64-token pages with window and soft cap, an int8 cache at D 128
    and at D 64 over 32-token pages with split-KV, an fp8 (e4m3) cache at D 128. The Triton kernel's twin of each is in `kernel_cases`, or is one
    `KernelCase` away. The CUDA plugin compiles a Mosaic GPU kernel once per process, so ptxas reports it for the
    first chip of a run only: one GPU chip per run for its figures."""
    m = functools.partial(KernelCase, impl="mosaic_gpu")
    return [m("decode", "bfloat16", 128, 8), m("decode", "bfloat16", 128, 8, num_kv_splits=4),
            m("mixed", "bfloat16", 128, 8), m("decode", "bfloat16", 64, 4, group=8, page_size=64, window=True),
            m("decode", "int8", 128, 8), m("decode", "int8", 64, 4, group=8, page_size=32, num_kv_splits=4),
            m("decode", "float8_e4m3fn", 128, 8)]


def compile_kernel(chip: str, case: KernelCase, **kernel_kw) -> dict:
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels_pallas.attention.dispatch import ragged_paged_attention

    backend = CHIPS[chip][0]
    args, q_len = case.inputs(NamedSharding(chip_mesh(chip, 1), P()))
    if case.num_kv_splits:
        kernel_kw = {"num_kv_splits": case.num_kv_splits, **kernel_kw}
    if backend == "tpu":
        from kernels_pallas.attention.tpu import ragged_paged_attention_tpu

        kernel = functools.partial(ragged_paged_attention_tpu, **kernel_kw)
    elif case.impl == "mosaic_gpu":
        from kernels_pallas.attention.mosaic_gpu import ragged_paged_attention_mosaic_gpu

        kernel = functools.partial(ragged_paged_attention_mosaic_gpu, **kernel_kw)
    elif kernel_kw:
        from kernels_pallas.attention.gpu import ragged_paged_attention_gpu

        kernel = functools.partial(ragged_paged_attention_gpu, **kernel_kw)
    else:
        kernel = functools.partial(ragged_paged_attention, impl="gpu")

    extra = dict(sliding_window=1024, soft_cap=50.0) if case.window else {}

    def fn(q, kv, lens, pages, cu, ns, *scales):
        return kernel(q, kv, lens, pages, cu, ns, sm_scale=case.head_dim ** -0.5, max_q_len=q_len,
                      kv_scales=scales[0] if scales else None, **extra)

    row = compile_case(chip, 1, fn, args, cache_shapes=(args[1].shape,))
    return {"case": case.name, "what": "kernel"} | row


def compile_mla(chip: str, kind: str) -> dict:
    """MLA over DeepSeek-V2-Lite's latent cache (16 heads, latent 512 + RoPE key 64, bf16) in the shape the
    backend keeps it (`kv_cache/latent_layout.py`): the Pallas Triton kernel on GPU; on TPU the pure-JAX reference
    (there is no TPU MLA kernel yet)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels_pallas.mla.dispatch import ragged_paged_mla_attention
    from kernels_pallas.kv_cache.latent_layout import latent_cache_shape

    num_seqs, q_len = (64, 1) if kind == "decode" else (4, 512)
    page_size, context, heads = 16, 2048, 16
    pages_per_seq = context // page_size
    sharding = NamedSharding(chip_mesh(chip, 1), P())
    bf16, s32 = jnp.bfloat16, jnp.int32
    with compiling_for(CHIPS[chip][0]):
        latent = latent_cache_shape(num_seqs * pages_per_seq + 1, page_size, 576)
    shapes = [((num_seqs * q_len, heads, 512), bf16), ((num_seqs * q_len, heads, 64), bf16), (latent, bf16),
              ((num_seqs,), s32), ((num_seqs, pages_per_seq), s32), ((num_seqs + 1,), s32), ((1,), s32)]
    args = tuple(jax.ShapeDtypeStruct(sh, d, sharding=sharding) for sh, d in shapes)
    fn = functools.partial(ragged_paged_mla_attention, sm_scale=0.07, max_q_len=q_len)
    return {"case": f"mla_{kind}_bfloat16_deepseek-v2-lite", "what": "kernel"} | compile_case(
        chip, 1, fn, args, cache_shapes=(latent,))
