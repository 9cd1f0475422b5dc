"""How the model's dots are traced (issue 33): few-row projections padded into GEMMs on GPU only, and float32
models tracing every dot at Precision.HIGHEST. The compiled consequences (no reduce fused into the KV write, no
TF32 dot on an H200) are read from deviceless compiles in tests/scripts/test_step_hlo.py; these check the traced
programs and their values on CPU, cheaply."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import get_model_config
from kernels_pallas.backend import compiling_for
from kernels_pallas.matmul import few_rows_cpu
from kernels_pallas.matmul.few_rows_cpu import few_rows_kernel_takes
from kernels_pallas.native import gate
from models.attention import AttentionMetadata
from models.decoder import Decoder
from models.layers import GPU_MIN_GEMM_ROWS, Linear


def _dots(jaxpr) -> list:
    """Every dot_general equation of a closed jaxpr, nested jaxprs (pjit, custom_vjp, loops) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dots(sub)
    return found


@pytest.mark.parametrize("rows", [1, 3, GPU_MIN_GEMM_ROWS, 12])
def test_few_rows_are_padded_into_a_gemm_on_gpu_only(rows):
    lin = Linear(64, 32, use_bias=True, rngs=nnx.Rngs(0))
    lin.bias.set_value(jnp.arange(32, dtype=jnp.float32))
    x = jax.random.normal(jax.random.key(1), (rows, 64))
    want = np.asarray(x @ lin.kernel[...] + lin.bias[...])
    for backend in ("cpu", "gpu", "tpu"):
        with compiling_for(backend):
            jaxpr = jax.make_jaxpr(lambda v: lin(v))(x)
            got = lin(x)
            few_rows_kernel = few_rows_kernel_takes(x, lin.kernel[...])
        assert few_rows_kernel == (backend == "cpu" and gate.runs_here(few_rows_cpu.KERNEL, rows=rows))
        if few_rows_kernel:  # a few float32 rows on CPU: the C++ kernel, no dot (tests/kernels_pallas)
            assert not _dots(jaxpr.jaxpr) and few_rows_cpu.KERNEL.target in str(jaxpr)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
            continue
        (dot,) = _dots(jaxpr.jaxpr)
        padded = backend == "gpu" and rows < GPU_MIN_GEMM_ROWS
        assert dot.invars[0].aval.shape[0] == (GPU_MIN_GEMM_ROWS if padded else rows), backend
        assert got.shape == (rows, 32)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def _step_jaxpr(dtype):
    config = get_model_config("tiny-llama")
    model = Decoder(config, dtype=dtype, attn_impl="reference", rngs=nnx.Rngs(0))
    pages, page_size, tokens = 8, 16, 2
    cache = jnp.zeros(config.kv_cache_spec(pages, page_size, dtype).shape, dtype)
    meta = AttentionMetadata(slot_mapping=jnp.array([0, 16], jnp.int32), kv_lens=jnp.array([1, 1], jnp.int32),
                             page_indices=jnp.array([[0, 2], [1, 3]], jnp.int32),
                             cu_q_lens=jnp.array([0, 1, 2], jnp.int32), num_seqs=jnp.array([2], jnp.int32))

    def step(tok):
        hidden, _ = model(tok, jnp.zeros((tokens,), jnp.int32), [cache] * config.num_kv_layers, meta)
        return model.logits(hidden)

    with compiling_for("gpu"):  # on CPU a few float32 rows take the C++ kernel, not a dot
        return jax.make_jaxpr(step)(jnp.array([1, 2], jnp.int32))


@pytest.mark.parametrize("dtype,precision", [(jnp.float32, jax.lax.Precision.HIGHEST), (jnp.bfloat16, None)])
def test_float32_models_trace_every_dot_at_highest_precision(dtype, precision):
    """float32 means IEEE float32: XLA:GPU would run a default-precision f32 dot as TF32 and XLA:TPU as one bf16
    pass. bf16 models keep jax's default."""
    dots = _dots(_step_jaxpr(dtype).jaxpr)
    assert len(dots) >= 7  # q, k, v, o, gate, up, down (x layers), and the LM head
    want = None if precision is None else (precision, precision)
    assert {d.params["precision"] for d in dots} == {want}
