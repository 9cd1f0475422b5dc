"""Sharded attention on 8 virtual CPU devices, run by tests/kernels_pallas/test_kernel_sharding.py in a subprocess (the
pytest process has one CPU device). Prints one JSON object on the last line of stdout: per check, the max abs error of
the sharded call against the unsharded one and the per-device shard shapes."""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import ragged_paged_attention, ragged_paged_mla_attention  # noqa: E402
from kernels_pallas.kv_cache.writes import quantize_cache  # noqa: E402
from kernels_pallas.sharded import sharded_ragged_paged_attention, sharded_ragged_paged_mla_attention  # noqa: E402
from sharding import make_mesh  # noqa: E402
from tests.kernels_pallas.test_ragged_paged_attention import make_case  # noqa: E402


def main() -> None:
    results = {}
    rng = np.random.default_rng(0)
    # 16 query heads over 8 KV heads (GQA 2): TP 8 puts one KV head and its two query heads on each device.
    args = list(map(jnp.asarray, make_case(rng, [1, 5, 2], [19, 5, 30], num_q_heads=16, num_kv_heads=8,
                                           head_dim=64, page_size=8, pages_per_seq=4, num_pages=14)))
    kw = dict(sm_scale=0.125, sliding_window=12, soft_cap=4.0)
    checks = [("reference_tp8", make_mesh(1, 8), "reference", {}, None),
              ("reference_int8_dp2_tp4", make_mesh(2, 4), "reference", {}, "int8"),
              ("gpu_interpret_int8_tp2", make_mesh(1, 2), "gpu", {"interpret": True}, "int8"),
              ("cpu_kernel_int8_dp2_tp4", make_mesh(2, 4), "cpu", {}, "int8"),
              ("cpu_kernel_fp8_tp8", make_mesh(1, 8), "cpu", {}, jnp.float8_e4m3fn)]
    for name, mesh, impl, extra, cache in checks:
        call_args, scales = list(args), None
        if cache is not None:
            call_args[1], scales = quantize_cache(args[1], cache)
        want = ragged_paged_attention(*call_args, kv_scales=scales, impl="reference", **kw)
        fn = jax.jit(lambda *a, s=None, mesh=mesh, impl=impl, extra=extra: sharded_ragged_paged_attention(
            *a, mesh=mesh, kv_scales=s, impl=impl, **extra, **kw))
        got = fn(*call_args, s=scales)
        results[name] = {"max_err": float(jnp.max(jnp.abs(got - want))),
                         "shard_shape": list(got.addressable_shards[0].data.shape),
                         "num_shards": len({tuple(str(i) for i in s.index) for s in got.addressable_shards})}
    # MLA: 8 query heads split over 4 devices, the latent cache replicated.
    ql, qr = args[0][:, :8, :48], args[0][:, :8, 48:]
    latent = args[1][0, :, :, :64]  # [num_pages, page_size, 64] = Dl 48 + Dr 16
    mla_args = (ql, qr, latent, *args[2:])
    mla_kw = dict(sm_scale=0.2, sliding_window=12)
    want = ragged_paged_mla_attention(*mla_args, **mla_kw)
    got = jax.jit(lambda *a: sharded_ragged_paged_mla_attention(*a, mesh=make_mesh(1, 4), **mla_kw))(*mla_args)
    results["mla_reference_tp4"] = {"max_err": float(jnp.max(jnp.abs(got - want))),
                                    "shard_shape": list(got.addressable_shards[0].data.shape),
                                    "num_shards": len({tuple(str(i) for i in s.index) for s in got.addressable_shards})}
    try:
        sharded_ragged_paged_attention(*args, mesh=make_mesh(1, 3), **kw)
        results["bad_axis_error"] = None
    except ValueError as e:
        results["bad_axis_error"] = str(e)
    print(json.dumps({"devices": jax.device_count(), "results": results}))


if __name__ == "__main__":
    main()
