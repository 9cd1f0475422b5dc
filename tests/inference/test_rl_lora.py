"""`log_probs(..., lora=...)`: the trainer's teacher-forced logprobs under a LoRA adapter equal the engine's for a
request with that adapter (served from its PEFT folder), and they are differentiable in the adapter's A/B alone
(the gradient matches a finite difference), with the base weights frozen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference import LoRARequest, SamplingParams
from inference.lora.peft import adapter_scaling, load_peft_adapter, save_peft_adapter
from inference.rl.logprobs import log_probs, processed_tensors
from models.lora import init_adapter, target_shapes
from tests.inference.test_rl_logprobs import PROCESSED, PROMPTS, TOL, completion_mask, rollout

RANK, ALPHA = 4, 8.0
SCALING = adapter_scaling(ALPHA, RANK, use_rslora=False)


def random_adapter(config, seed: int, std: float = 0.3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A trained-looking adapter (B nonzero, unlike a fresh one) on every projection of layer 0 and only q/v of
    layer 1: an adapter that leaves some projections alone."""
    rng = np.random.default_rng(seed)
    shapes = {k: v for k, v in target_shapes(config).items()
              if k.startswith("layers.0.") or k in ("layers.1.q_proj", "layers.1.v_proj")}
    return {k: ((rng.standard_normal((i, RANK)) * std).astype(np.float32),
                (rng.standard_normal((RANK, o)) * std).astype(np.float32)) for k, (i, o) in shapes.items()}


@pytest.fixture(scope="module")
def adapter(tiny_llama_lora, tmp_path_factory):
    weights = random_adapter(tiny_llama_lora.config, seed=3)
    folder = save_peft_adapter(str(tmp_path_factory.mktemp("rl_lora") / "a"), weights, alpha=ALPHA)
    return LoRARequest("rl-logprobs", 2, folder), weights


def test_saved_adapter_loads_back_exactly(tiny_llama_lora, adapter, tiny_llama):
    request, weights = adapter
    assert tiny_llama_lora.add_lora(request) == request.lora_int_id  # loads it now; a second add is a no-op
    assert tiny_llama_lora.add_lora(request) == request.lora_int_id
    with pytest.raises(ValueError, match="enable_lora=True"):
        tiny_llama.add_lora(request)
    loaded = load_peft_adapter(request.lora_path, tiny_llama_lora.config, max_rank=8)
    assert loaded.rank == RANK and loaded.scaling == SCALING and sorted(loaded.weights) == sorted(weights)
    for name, (a, b) in weights.items():
        np.testing.assert_array_equal(loaded.weights[name][0], a)
        np.testing.assert_array_equal(loaded.weights[name][1], b)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_log_probs_with_the_adapter_equal_the_engines(tiny_llama_lora, adapter, mode):
    llm = tiny_llama_lora
    request, weights = adapter
    extra = PROCESSED if mode == "processed" else {}
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, seed=21 + i, **{"temperature": 1.0, **extra})
              for i in range(len(PROMPTS))]
    ids, prompt_lens, lengths, engine = rollout(llm, params, lora_request=request)
    mask = completion_mask(prompt_lens, lengths, ids.shape[1])
    model = (llm.runner.graphdef, llm.get_params())
    sampling, use_filters = (None, False) if mode == "raw" else processed_tensors(params, ids, prompt_lens)
    fn = jax.jit(log_probs, static_argnames=("use_filters",))
    got = np.asarray(fn(model, ids, sampling=sampling, use_filters=use_filters, lora=weights, lora_scaling=SCALING))
    np.testing.assert_allclose(got[mask], engine[mask], rtol=0, atol=TOL)  # the base model's tolerance
    base = np.asarray(fn(model, ids, sampling=sampling, use_filters=use_filters))
    assert np.abs(base[mask] - got[mask]).max() > 1e-2  # the adapter really changes the distribution


def test_gradient_in_the_adapter_alone_matches_a_finite_difference(tiny_llama_lora, adapter):
    llm = tiny_llama_lora
    _, weights = adapter
    graphdef, base = llm.runner.graphdef, llm.get_params()
    ids = jnp.asarray([PROMPTS[1] + [1, 2, 3, 4]], jnp.int32)

    @jax.jit
    def objective(lora):
        return jnp.sum(log_probs((graphdef, base), ids, lora=lora, lora_scaling=SCALING)[:, -4:])

    lora = jax.tree.map(jnp.asarray, weights)
    grads = jax.grad(objective)(lora)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == 2 * len(weights) and all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)  # every A and every B gets a gradient
    norm = float(jnp.sqrt(sum(jnp.vdot(g, g) for g in leaves)))

    def slope(direction, eps: float) -> float:
        """Central finite difference of the objective along a unit direction (f32: eps balances rounding and
        curvature)."""
        ends = [objective(jax.tree.map(lambda x, d, s=s: x + s * eps * d, lora, direction)) for s in (1, -1)]
        return float(ends[0] - ends[1]) / (2 * eps)

    along = jax.tree.map(lambda g: g / norm, grads)  # the directional derivative along the gradient is its norm
    assert abs(slope(along, 3e-3) - norm) <= 1e-2 * norm
    keys = jax.random.split(jax.random.key(0), len(leaves))
    noise = [jax.random.normal(k, g.shape) for k, g in zip(keys, leaves)]
    scale = float(jnp.sqrt(sum(jnp.vdot(n, n) for n in noise)))
    direction = jax.tree.unflatten(jax.tree.structure(grads), [n / scale for n in noise])
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(leaves, jax.tree.leaves(direction)))
    assert abs(slope(direction, 3e-2) - analytic) <= 1e-2 * norm  # a random direction: error small next to |grad|


def test_a_fresh_adapter_starts_at_the_base_model(tiny_llama_lora):
    llm = tiny_llama_lora
    model = (llm.runner.graphdef, llm.get_params())
    fresh = init_adapter(target_shapes(llm.config), RANK, jax.random.key(1))
    assert all(float(jnp.abs(a).max()) > 0 and not b.any() for a, b in fresh.values())  # PEFT: A random, B zero
    ids = np.asarray([PROMPTS[0]], np.int32)
    np.testing.assert_array_equal(np.asarray(log_probs(model, ids, lora=fresh, lora_scaling=SCALING)),
                                  np.asarray(log_probs(model, ids)))


def test_bad_adapters_are_named(tiny_llama_lora):
    llm = tiny_llama_lora
    model = (llm.runner.graphdef, llm.get_params())
    ids = np.zeros((1, 4), np.int32)
    a, b = np.zeros((64, 2), np.float32), np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="together"):
        log_probs(model, ids, lora={"layers.0.q_proj": (a, b)})
    with pytest.raises(ValueError, match="cannot adapt"):
        log_probs(model, ids, lora={"layers.99.q_proj": (a, b)}, lora_scaling=1.0)
    with pytest.raises(ValueError, match=r"needs a \["):
        log_probs(model, ids, lora={"layers.0.q_proj": (a[:3], b)}, lora_scaling=1.0)
    with pytest.raises(ValueError, match="not a projection"):
        save_peft_adapter("/tmp/unused", {"embed": (a, b)}, alpha=1.0)
