"""LoRA on device: stacked adapter slots per target projection and the batched low-rank delta.

Each target projection (`layers.{i}.q_proj`, ... in `models/weights.py`'s names) gets one `LoRAWeights`: A
`[slots, in, r_max]`, B `[slots, r_max, out]` and a per-slot `scaling` (alpha / r, or alpha / sqrt(r) for rsLoRA).
Slot 0 is "no adapter": all zeros, scaling 0. A step carries one slot index per token (`ModelInput.lora_slots`),
so requests with different adapters (and none) share a batch, and the compiled step depends only on the slot
arrays' shapes: loading, evicting or replacing an adapter writes into the arrays and never recompiles.

Why a masked dense product rather than a gather (BGMV) or a grouped matmul over sorted tokens (SGMV): with S
slots, `h = x @ A_s` for every slot is one [T, in] x [in, S*r] matmul, the per-token mask (one-hot of the slot
times its scaling) zeroes every other slot's columns, and one [T, S*r] x [S*r, out] matmul adds the delta. It is
exact -- the masked terms are exact zeros, so each token gets x A_slot B_slot * scaling up to summation order --
and it is two dense matmuls, which XLA:CPU (and a TPU's MXU) runs well; the cost is S*r extra columns per
projection, small next to the base weight while S*r << the projection's width. Gathering A and B per token
would copy T * r * (in + out) values per projection per step (a prefill of 512 tokens: tens of MB), and sorting
tokens by slot for `ragged_dot` needs a permutation in and out of every projection.

Adapters are applied to `models.layers.Linear` by `bind_lora` inside the jitted step (on the model merged there):
each targeted Linear gets a `LoRABinding` holding its slot arrays and the step's token slots, and adds the delta
to its output. The adapter arrays are not model parameters, so `update_weights`, quantization, checkpoint export
and the parameter shardings never see them. A trainer binds one adapter the same way (`adapter_bound`: a single
slot, every token on it; `inference/rl/logprobs.py`), so its LoRA forward is this delta, differentiable in A and B.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig
from models.weights import expected_shapes

#: The projections an adapter may target (PEFT's module names), and where each lives inside a DecoderLayer.
TARGET_MODULES: dict[str, str] = {"q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj",
                                  "o_proj": "attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                                  "down_proj": "mlp.down_proj"}


@struct.dataclass
class LoRAWeights:
    """One projection's adapter slots: a [S, in, r], b [S, r, out], scaling [S] (slot 0 zero: no adapter)."""

    a: jax.Array
    b: jax.Array
    scaling: jax.Array


def lora_delta(x: jax.Array, weights: LoRAWeights, token_slots: jax.Array) -> jax.Array:
    """The low-rank update of x[..., in] for each token's slot (token_slots[...], x's leading shape): see the
    module docstring for why every slot's product is computed and masked."""
    slots, d_in, rank = weights.a.shape
    lead = x.shape[:-1]
    flat = x.reshape(-1, d_in)
    h = (flat @ weights.a.transpose(1, 0, 2).reshape(d_in, slots * rank)).reshape(-1, slots, rank)
    mask = jax.nn.one_hot(token_slots.reshape(-1), slots, dtype=jnp.float32) * weights.scaling.astype(jnp.float32)
    h = (h * mask[:, :, None].astype(h.dtype)).reshape(-1, slots * rank)
    out = h @ weights.b.reshape(slots * rank, -1)
    return out.reshape(*lead, -1).astype(x.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class LoRABinding:
    """What a Linear holds during one step: its adapter slots and the step's per-token slot indices. A plain
    dataclass, not a pytree: nnx refuses arrays in a Module's static attribute outside a trace, and an opaque
    object shows it none, so the eager `log_probs(..., lora=...)` can bind it as the jitted step does."""

    weights: LoRAWeights
    token_slots: jax.Array  # i32[T]

    def __call__(self, x: jax.Array) -> jax.Array:
        return lora_delta(x, self.weights, self.token_slots)


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Canonical name -> (in, out) of every projection an adapter may target in this model (MoE layers have no
    dense gate/up/down; MLA layers no q/k/v of the plain kind): the layout `LoRASlots` allocates."""
    shapes = expected_shapes(config)
    out = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "layers" and parts[2] in TARGET_MODULES and len(shape) == 2:
            out[name] = (int(shape[0]), int(shape[1]))
    return out


def empty_slots(shapes: dict[str, tuple[int, int]], num_slots: int, max_rank: int, dtype) -> dict[str, LoRAWeights]:
    """Zeroed slot arrays (every slot "no adapter") for the projections in `shapes`."""
    return {name: LoRAWeights(a=jnp.zeros((num_slots, d_in, max_rank), dtype),
                              b=jnp.zeros((num_slots, max_rank, d_out), dtype),
                              scaling=jnp.zeros((num_slots,), jnp.float32))
            for name, (d_in, d_out) in shapes.items()}


def _target_linear(model, name: str):
    _, layer, module = name.split(".")
    linear = model.layers[int(layer)]
    for part in TARGET_MODULES[module].split("."):
        linear = getattr(linear, part)
    return linear


def bind_lora(model, lora: dict[str, LoRAWeights], token_slots: jax.Array) -> None:
    """Attach each projection's slots and the step's token slots to the model's Linears (a model merged inside the
    traced step: the bindings live only as long as that trace)."""
    for name, weights in lora.items():
        _target_linear(model, name).lora = LoRABinding(weights=weights, token_slots=token_slots)


def single_adapter(pairs: dict[str, tuple[jax.Array, jax.Array]], scaling: float,
                   shapes: dict[str, tuple[int, int]]) -> dict[str, LoRAWeights]:
    """One adapter's (a [in, r], b [r, out]) pairs as one-slot `LoRAWeights` (its slot 0 is this adapter, scaling
    `scaling`), checked against `shapes` (`target_shapes`). A trainer binds these with every token on slot 0, so it
    runs the engine's own `lora_delta` with A and B as differentiable inputs rather than a second LoRA forward."""
    if not pairs:
        raise ValueError("the LoRA adapter has no projections; give {name: (a, b)} for at least one of "
                         f"{sorted(shapes)[:3]}...")
    out = {}
    for name, pair in pairs.items():
        if name not in shapes:
            raise ValueError(f"LoRA adapter targets {name!r}, which this model cannot adapt; names are "
                             f"models/weights.py's, e.g. {sorted(shapes)[:2]}")
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"LoRA adapter entry {name} must be an (a, b) pair of arrays")
        a, b = jnp.asarray(pair[0]), jnp.asarray(pair[1])
        d_in, d_out = shapes[name]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != d_in or b.shape[1] != d_out or a.shape[1] != b.shape[0]:
            raise ValueError(f"LoRA adapter entry {name}: a {list(a.shape)}, b {list(b.shape)}; it needs "
                             f"a [{d_in}, r] and b [r, {d_out}] (x @ a @ b)")
        out[name] = LoRAWeights(a=a[None], b=b[None], scaling=jnp.full((1,), scaling, jnp.float32))
    return out


@contextlib.contextmanager
def adapter_bound(model, pairs: dict[str, tuple[jax.Array, jax.Array]], scaling: float) -> Iterator[None]:
    """Run `model` (a Decoder) with one adapter on every token, then take the bindings off again, so a Decoder the
    caller keeps (or closes over in a jitted function) holds no traced arrays afterwards. The token slots are one
    slot 0 that `lora_delta`'s mask broadcasts over any number of tokens (the cache-free forward projects q/k/v per
    sequence under a vmap, so the token count differs between projections)."""
    lora = single_adapter(pairs, scaling, target_shapes(model.config))
    bind_lora(model, lora, jnp.zeros((1,), jnp.int32))
    try:
        yield
    finally:
        for name in lora:
            _target_linear(model, name).lora = None


def init_adapter(shapes: dict[str, tuple[int, int]], rank: int, key: jax.Array
                 ) -> dict[str, tuple[jax.Array, jax.Array]]:
    """A fresh adapter for training, as PEFT initialises one (`init_lora_weights=True`): A kaiming-uniform with
    a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)), and B zero, so the adapted model starts exactly at the base
    model and the first update moves B. `shapes`: the projections to adapt (`target_shapes`, or a subset)."""
    if rank < 1:
        raise ValueError(f"a LoRA rank must be >= 1, got {rank}")
    out = {}
    for name, key_i in zip(sorted(shapes), jax.random.split(key, len(shapes))):
        d_in, d_out = shapes[name]
        bound = 1.0 / float(d_in) ** 0.5
        out[name] = (jax.random.uniform(key_i, (d_in, rank), jnp.float32, -bound, bound),
                     jnp.zeros((rank, d_out), jnp.float32))
    return out
