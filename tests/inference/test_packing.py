"""One buffer per step (inference/runtime/packing.py): the unpacked arrays equal the originals, bit for bit and
dtype for dtype; device arrays pass through; and an engine's steady decode steps, which the runner hands the device
as one packed buffer, compile nothing after the first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from inference import SamplingParams
from inference.runtime.batch import ModelInput, TokenFeed
from inference.runtime.packing import pack, unpack
from inference.sampling.sampler import SamplingTensors
from tests.llm_configs import TINY_ENGINE


def test_unpacked_arrays_equal_the_originals():
    rng = np.random.default_rng(0)
    inp = ModelInput.empty(num_tokens=16, num_seqs=4, pages_per_seq=6, max_q_len=8)
    inp = inp.replace(tokens=rng.integers(0, 1 << 30, 16).astype(np.int32),
                      feed=TokenFeed(prev=jnp.arange(8, dtype=jnp.int32), dst=np.full(4, 16, np.int32),
                                     src=np.zeros(4, np.int32)))
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3), SamplingParams(temperature=0.0)]
    sampling = SamplingTensors.from_params(params, [11, 2 ** 62 + 5], [0, 7], pad_to=4)
    extra = {"f": np.array([[-0.0, np.nan], [np.inf, 1e-40]], np.float32), "b": np.array([True, False, True]),
             "u": np.array([0xFFFFFFFF, 1], np.uint32), "i64": np.arange(3, dtype=np.int64)}
    tree = (inp, sampling, extra)
    packing, buffer, passed = pack(tree)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    # what is not a 4-byte or bool numpy array passes through: the device-side tokens and the int64 array
    assert len(passed) == 2 and any(isinstance(x, jax.Array) for x in passed)
    before, after = jax.tree.leaves(tree), jax.tree.leaves(jax.jit(unpack, static_argnums=0)(packing, buffer, passed))
    assert len(before) == len(after)
    for a, b in zip(before, after):
        a, b = np.asarray(jnp.asarray(a)), np.asarray(b)  # a jitted int64 input is int32 (x64 off), packed or not
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == b.tobytes()  # bit for bit (NaN, -0.0, denormals included)


def test_steady_decode_steps_compile_nothing_and_send_one_buffer():
    llm = TINY_ENGINE.build()
    engine, runner = llm.engine, llm.runner
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", list(range(3 + i, 12 + 2 * i)), params)
    sent = []
    original = runner.packed_decode_step

    def spy(param_leaves, kv_caches, buffer, passed, *args, **kwargs):
        sent.append((buffer, [x for x in passed if isinstance(x, np.ndarray)]))
        return original(param_leaves, kv_caches, buffer, passed, *args, **kwargs)

    spy._cache_size = original._cache_size  # num_compilations reads the jit's own count
    runner.packed_decode_step = spy
    try:
        for _ in range(6):  # every sequence decoding, every decode shape met once
            engine.step()
        compiled = sum(runner.num_compilations().values())
        count = len(sent)
        for _ in range(8):
            engine.step()
        assert sum(runner.num_compilations().values()) == compiled
    finally:
        runner.packed_decode_step = original
    assert len(sent) > count
    for buffer, host_passed in sent[count:]:
        # One host -> device copy: the buffer, a numpy array the jit places on the device itself (its in_shardings).
        assert isinstance(buffer, np.ndarray) and buffer.dtype == np.int32 and not host_passed
    while engine.has_unfinished_requests():
        engine.step()
