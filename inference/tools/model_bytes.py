"""What a model holds, in bytes: parameters by kind, the weight bytes (and those one decode step reads), the KV cache
per token and per sequence, and a hybrid model's state cache. The cost model (`cost_model.py`) turns these into step
times; `scripts/tools/aot_compile.py` sets the compiler's `memory_analysis()` beside them.

- KV cache: M = 2·b·B·S·L·K·H bytes (keys and values, B sequences of S cached tokens, L layers, K KV heads of
  width H, b bytes per element). Everything about *which* elements a layer caches lives in
  `kv_bytes_per_token` and its two per-layer hooks, so sliding-window and MLA variants extend one place.
- State cache (a hybrid model's state layers: Gated DeltaNet, Mamba2): a constant number of bytes per sequence,
  `ModelConfig.state_bytes_per_sequence`, whatever its context.

Nothing here imports JAX: plain integer arithmetic over a `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import math

from models.config import ModelConfig
from models.weights import expected_shapes

# --------------------------------------------------------------------------------------------------------------
# Parameters and weight bytes
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Parameter count by kind.

    `matrices` is the lecture's simplified P = 2VD + 3DFL + (2DNH + 2DKH)L (for untied embeddings): it omits the
    small norm vectors and biases. `total` adds them back and equals `models.weights.num_params`; the weight bytes
    the step-time model reads are `total · b`, since every parameter is read each step.
    """

    embeddings: int
    attention: int
    mlp: int
    norms: int
    biases: int

    @property
    def matrices(self) -> int:
        return self.embeddings + self.attention + self.mlp

    @property
    def total(self) -> int:
        return self.matrices + self.norms + self.biases


_ATTENTION_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")


def param_count(config: ModelConfig) -> ParamCount:
    """Count parameters by kind, from the weight layout the config implies (models/weights.py): so MLA's low-rank
    projections, experts, CLA's missing K/V and Gemma's extra norms are counted exactly as loaded."""
    counts = dict(embeddings=0, attention=0, mlp=0, norms=0, biases=0)
    for name, shape in expected_shapes(config).items():
        leaf = name.rsplit(".", 1)[-1]
        kind = ("embeddings" if name in ("embed", "lm_head") else "biases" if leaf.endswith("_bias")
                else "norms" if leaf.endswith("norm") else "attention" if leaf in _ATTENTION_LEAVES else "mlp")
        counts[kind] += math.prod(shape)
    return ParamCount(**counts)


#: Bytes per weight / cache element of the formats pagejax stores. fp8 is float8_e4m3fn (quantization="fp8",
#: kv_cache_dtype="fp8") and int8 one byte too; their float32 scales (one per output channel of a weight, one per
#: token and KV head of a cache: 4 / head_dim bytes per element, 3% at head_dim 128) are not counted.
FORMAT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}


def format_bytes(name: str) -> float:
    """Bytes per element of a storage format name (FORMAT_BYTES)."""
    if name not in FORMAT_BYTES:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(FORMAT_BYTES)}")
    return FORMAT_BYTES[name]


def weight_bytes(config: ModelConfig, bytes_per_element: float) -> float:
    """Bytes of all weights at `bytes_per_element` (2 for bf16): what one decode step of a dense model reads."""
    return param_count(config).total * bytes_per_element


def weight_bytes_read(config: ModelConfig, batch: int, bytes_per_element: float) -> float:
    """Weight bytes one decode step of `batch` sequences reads. Dense models read every weight. A mixture of experts
    reads only the routed experts some token picked: under uniform routing E·(1 − (1 − k/E)^B) of the E per layer
    (k at batch 1, nearly all once B ≫ E/k), so small batches of a sparse model cost far less than its size."""
    total = weight_bytes(config, bytes_per_element)
    if not config.num_experts:
        return total
    e, k = config.num_experts, config.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    moe_layers = sum(config.is_moe(i) for i in range(config.num_layers))
    expert_bytes = 3 * config.hidden_size * config.moe_intermediate_size * bytes_per_element
    return total - moe_layers * (e - touched) * expert_bytes


# --------------------------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------------------------


def _kv_elements_per_token(config: ModelConfig, layer: int) -> int:
    """Cache elements one token adds to one layer: 2·K·H for ordinary attention, the latent plus the RoPE key for
    MLA (512 + 64 = 576 for DeepSeek-V2), nothing for a CLA layer that reads an earlier layer's cache or a state
    layer (its state does not grow: `state_bytes_per_sequence`)."""
    return config.kv_width if config.owns_kv(layer) and not config.is_state_layer(layer) else 0


def _cached_tokens(config: ModelConfig, layer: int, context: int) -> int:
    """Tokens a layer keeps for a sequence of `context` tokens: windowed layers keep at most their window."""
    window = config.layer_window(layer)
    return context if window is None else min(context, window)


def kv_bytes_per_token(config: ModelConfig, bytes_per_element: float) -> float:
    """KV cache bytes one token occupies across all layers (2·L·K·H·b for ordinary attention); sliding windows
    bound tokens rather than bytes per token (see `kv_bytes_per_sequence`)."""
    return config.kv_bytes_per_token(bytes_per_element)


def kv_bytes_per_sequence(config: ModelConfig, context: int, bytes_per_element: float) -> float:
    """KV cache bytes of one sequence with `context` cached tokens: 2·b·S·L·K·H, windowed layers capped."""
    check_positive("context", context)
    elements = sum(_kv_elements_per_token(config, i) * _cached_tokens(config, i, context)
                   for i in range(config.num_layers))
    return elements * bytes_per_element


def state_bytes_per_sequence(config: ModelConfig, bytes_per_element: float) -> float:
    """State-cache bytes of one sequence (0 without state layers), the same at every context: the recurrent states
    in float32 always, the conv windows in the activations' dtype (bfloat16 unless `bytes_per_element` is 4)."""
    if not config.has_state_layers:
        return 0.0
    return float(config.state_bytes_per_sequence("float32" if bytes_per_element >= 4 else "bfloat16"))


def check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
