"""Megatron-style tensor parallelism as GSPMD shardings, and the load-time padding that makes any model fit the mesh.

Every parameter gets *logical* axes from its name (rules below, matched on the canonical weight name
`layers.3.q_proj` and on the NNX parameter path `layers.3.attn.q_proj.kernel` alike), and logical axes map to mesh
axes (`LOGICAL_TO_MESH`):

    q/k/v/gate/up   [hidden, out]     column parallel: out on "model"    (k/v: KV heads on "model")
    o/down          [in, hidden]      row parallel:    in on "model"     -> XLA all-reduces the partial sums
    experts gate/up [E, hidden, F]    column parallel: F on "model"      (MoE routed experts, models/moe.py)
    experts down    [E, F, hidden]    row parallel:    F on "model"      -> one all-reduce, as o/down
    shared experts  (a GatedMLP)      the gate/up/down rules above
    embed           [vocab, hidden]   vocab parallel:  vocab on "model"  -> masked gather + all-reduce
    lm_head         [hidden, vocab]   vocab parallel:  vocab on "model"  -> logits all-gathered for sampling
    quantized weights  their codes (`...kernel.value.q`) and per-group scales / zero points / offsets [in/g, out]
                       the weight's own axes (a dimension of 1, a per-channel scale's, stays whole); a quantized
                       embedding is stored [hidden, vocab] (models/quantization), so its axes are reversed
    norms, router, biases of o/down, anything unknown: replicated
    KV cache        [Hkv, pages, page_size, 2*D]: the KV-head axis on "model"

XLA inserts the collectives from these shardings (no shard_map). A dimension the mesh axis does not divide is
replicated rather than sharded, so any weight still loads; `pad_for_tensor_parallel` pads the model at load time so
that nothing falls back:

* heads: KV heads are padded with zero heads up to a multiple of TP, then query heads to `kv_padded * group`, so
  query head i still reads KV head i // group. Padded q/k/v columns (and biases) are zero and padded o_proj rows are
  zero: a padded query head only attends to a padded KV head (values 0) and its output is multiplied by zero rows,
  so the model computes exactly the same function. This costs memory (SmolLM2-135M at TP 8: 9 -> 24 query heads,
  3 -> 8 KV heads); `padding_report` gives the numbers.
* vocab: embedding rows and LM-head columns padded with zeros; the runner slices logits back to the real vocab.
* MLP width: zero gate/up columns and down rows (act(0) * 0 = 0); the same for the experts' width F
  (`moe_intermediate_size`: every routed expert and the shared experts' S * F), so a padded expert adds zeros.

The expert axis E itself is never split (that would be expert parallelism, which is not done): every device holds
all E experts, each 1/TP of its width, and the routing runs replicated.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.decoder import Decoder, build_decoder, export_weights, weight_targets
from models.weights import check_weights, expected_shapes, num_params

MODEL_AXIS = "model"

# name pattern -> logical axes of the array, outermost first. First match wins; no match: replicated.
# The routed experts come first: their canonical names (`layers.3.experts.gate_proj`) and NNX paths
# (`layers.3.mlp.gate_proj`, no `.kernel`) also end in gate/up/down_proj, and the 2-D rules below would give them
# the wrong rank (and so no sharding at all).
LOGICAL_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(^|\.)(experts|mlp)\.(gate|up)_proj$", ("experts", "embed", "expert_mlp")),
    (r"(^|\.)(experts|mlp)\.down_proj$", ("experts", "expert_mlp", "embed")),
    (r"(^|\.)embed(\.embedding)?$", ("vocab", "embed")),
    (r"(^|\.)lm_head(\.kernel)?$", ("embed", "vocab")),
    (r"(^|\.)q_proj(\.kernel)?$", ("embed", "heads")),
    (r"(^|\.)(q_bias|q_proj\.bias)$", ("heads",)),
    (r"(^|\.)[kv]_proj(\.kernel)?$", ("embed", "kv_heads")),
    (r"(^|\.)([kv]_bias|[kv]_proj\.bias)$", ("kv_heads",)),
    (r"(^|\.)o_proj(\.kernel)?$", ("heads", "embed")),
    (r"(^|\.)(gate|up)_proj(\.kernel)?$", ("embed", "mlp")),
    (r"(^|\.)down_proj(\.kernel)?$", ("mlp", "embed")),
)
# "experts" -> None: no expert parallelism; the experts' width is split instead (tensor parallelism inside each).
LOGICAL_TO_MESH: dict[str, str | None] = {"vocab": MODEL_AXIS, "heads": MODEL_AXIS, "kv_heads": MODEL_AXIS,
                                          "mlp": MODEL_AXIS, "expert_mlp": MODEL_AXIS, "experts": None,
                                          "embed": None}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def logical_axes(name: str) -> tuple[str, ...] | None:
    for pattern, axes in LOGICAL_RULES:
        if re.search(pattern, name):
            return axes
    return None


#: The leaves of a QuantizedWeight (models/quantization/formats.py) under its parameter's path.
QUANTIZED_LEAF = re.compile(r"\.(value\.)?(q|scale|zero_point|offset)$")


def _leaf_axes(name: str) -> tuple[str, ...] | None:
    """Logical axes of a parameter leaf: its own rule, or for a quantized weight's leaf its weight's (the codes and
    the group-wise scales share the [in, out] axes; a quantized embedding is [hidden, vocab])."""
    base, quantized = QUANTIZED_LEAF.subn("", name)
    axes = logical_axes(base)
    if quantized and axes == ("vocab", "embed"):
        return axes[::-1]
    return axes


def partition_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of the weight `name` of `shape`; dimensions the mesh axis does not divide stay whole."""
    axes = _leaf_axes(name)
    if axes is None or len(axes) != len(shape):
        return P()
    spec = []
    for logical, size in zip(axes, shape):
        mesh_axis = LOGICAL_TO_MESH.get(logical)
        spec.append(mesh_axis if mesh_axis is not None and size % mesh.shape[mesh_axis] == 0 else None)
    return P(*spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_cache_sharding(mesh: Mesh, num_kv_heads: int) -> NamedSharding:
    """KV cache (and an int8 cache's scales) `[Hkv, ...]` (kernels_pallas/kv_cache/layout.py): contiguous blocks of
    whole KV heads per device, aligned with the query-head blocks of q_proj when Hkv is a multiple of the model axis;
    else replicated."""
    if num_kv_heads % mesh.shape[MODEL_AXIS]:
        return replicated(mesh)
    # No trailing None: the spec XLA gives the step's output caches, so warm-up and serving see one sharding and
    # one compiled step per bucket.
    return NamedSharding(mesh, P(MODEL_AXIS))


def _path_name(path) -> str:
    name = jax.tree_util.keystr(path, simple=True, separator=".")
    return name[:-len(".value")] if name.endswith(".value") else name


def param_shardings(params, mesh: Mesh) -> list[NamedSharding]:
    """NamedShardings of the flat leaves of an nnx.State (in `jax.tree.flatten` order)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [NamedSharding(mesh, partition_spec(_path_name(path), tuple(leaf.shape), mesh)) for path, leaf in flat]


# ---- load-time padding ------------------------------------------------------------------------------------------
def _pad_axis(w: np.ndarray, axis: int, new_size: int) -> np.ndarray:
    if w.shape[axis] == new_size:
        return w
    pad = [(0, 0)] * w.ndim
    pad[axis] = (0, new_size - w.shape[axis])
    return np.pad(w, pad)


def pad_heads(config: ModelConfig, weights: dict[str, np.ndarray], tp: int
              ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Pad KV heads with zero heads to a multiple of `tp`, then query heads to `kv_padded * group` (GQA grouping
    kept: query head i still reads KV head i // group). Exact: see the module docstring."""
    if config.is_mla:
        return _pad_mla_heads(config, weights, tp)
    kv = _round_up(config.num_kv_heads, tp)
    if kv == config.num_kv_heads:
        return config, weights
    group, hd = config.q_per_kv, config.head_dim
    heads = kv * group
    out = dict(weights)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        out[p + "q_proj"] = _pad_axis(weights[p + "q_proj"], 1, heads * hd)
        out[p + "o_proj"] = _pad_axis(weights[p + "o_proj"], 0, heads * hd)
        for name in ("k_proj", "v_proj"):
            out[p + name] = _pad_axis(weights[p + name], 1, kv * hd)
        if config.attention_bias:
            out[p + "q_bias"] = _pad_axis(weights[p + "q_bias"], 0, heads * hd)
            for name in ("k_bias", "v_bias"):
                out[p + name] = _pad_axis(weights[p + name], 0, kv * hd)
    return config.replace(num_heads=heads, num_kv_heads=kv), out


def _pad_mla_heads(config: ModelConfig, weights: dict[str, np.ndarray], tp: int
                   ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """MLA has no KV heads (one latent serves all): pad query heads only. A zero head's query scores every key 0,
    so it averages the latents, and its zero kv_b_proj value columns and o_proj rows cancel that: exact."""
    heads = _round_up(config.num_heads, tp)
    if heads == config.num_heads:
        return config, weights
    qk, kv = config.qk_nope_head_dim + config.qk_rope_head_dim, config.qk_nope_head_dim + config.v_head_dim
    out = dict(weights)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        q = p + ("q_proj" if config.q_lora_rank is None else "q_b_proj")
        out[q] = _pad_axis(weights[q], 1, heads * qk)
        out[p + "kv_b_proj"] = _pad_axis(weights[p + "kv_b_proj"], 1, heads * kv)
        out[p + "o_proj"] = _pad_axis(weights[p + "o_proj"], 0, heads * config.v_head_dim)
    return config.replace(num_heads=heads), out


def pad_vocab(config: ModelConfig, weights: dict[str, np.ndarray], tp: int
              ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Zero embedding rows / LM-head columns up to a multiple of `tp`; logits past the real vocab must be dropped
    (the runner slices them off)."""
    vocab = _round_up(config.vocab_size, tp)
    if vocab == config.vocab_size:
        return config, weights
    out = dict(weights)
    out["embed"] = _pad_axis(weights["embed"], 0, vocab)
    if "lm_head" in weights:
        out["lm_head"] = _pad_axis(weights["lm_head"], 1, vocab)
    return config.replace(vocab_size=vocab), out


def pad_mlp(config: ModelConfig, weights: dict[str, np.ndarray], tp: int
            ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Zero gate/up columns and down rows up to a multiple of `tp` (silu(0) * 0 = gelu(0) * 0 = 0: exact)."""
    width = _round_up(config.intermediate_size, tp)
    if width == config.intermediate_size:
        return config, weights
    out = dict(weights)
    for i in range(config.num_layers):
        if config.is_moe(i):  # no dense MLP in this layer (pad_experts pads its experts)
            continue
        p = f"layers.{i}."
        out[p + "gate_proj"] = _pad_axis(weights[p + "gate_proj"], 1, width)
        out[p + "up_proj"] = _pad_axis(weights[p + "up_proj"], 1, width)
        out[p + "down_proj"] = _pad_axis(weights[p + "down_proj"], 0, width)
    return config.replace(intermediate_size=width), out


def pad_experts(config: ModelConfig, weights: dict[str, np.ndarray], tp: int
                ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Zero columns of every routed expert's gate/up and zero rows of its down_proj up to a width F that `tp`
    divides, and the shared experts to S * F (one config field sets both widths). Exact as for the dense MLP: a
    padded column's activation is act(0) * 0 = 0 and meets a zero row of down_proj."""
    width = _round_up(config.moe_intermediate_size, tp)
    if not config.num_experts or width == config.moe_intermediate_size:
        return config, weights
    out = dict(weights)
    shared = width * config.num_shared_experts
    for i in range(config.num_layers):
        if not config.is_moe(i):
            continue
        p = f"layers.{i}."
        for name in ("gate_proj", "up_proj"):
            out[p + "experts." + name] = _pad_axis(weights[p + "experts." + name], 2, width)
            if config.num_shared_experts:
                out[p + "shared." + name] = _pad_axis(weights[p + "shared." + name], 1, shared)
        out[p + "experts.down_proj"] = _pad_axis(weights[p + "experts.down_proj"], 1, width)
        if config.num_shared_experts:
            out[p + "shared.down_proj"] = _pad_axis(weights[p + "shared.down_proj"], 0, shared)
    return config.replace(moe_intermediate_size=width), out


def needs_padding(config: ModelConfig, tp: int) -> bool:
    """Whether `pad_for_tensor_parallel` changes anything at this TP (KV heads, vocab, MLP or expert width do not
    divide)."""
    heads = config.num_heads if config.is_mla else config.num_kv_heads
    widths = (config.intermediate_size,) + ((config.moe_intermediate_size,) if config.num_experts else ())
    return any(n % tp for n in (heads, config.vocab_size, *widths))


def pad_for_tensor_parallel(config: ModelConfig, weights: dict[str, np.ndarray], tp: int
                            ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Heads, vocab, MLP and expert width padded to multiples of `tp` (a no-op for tp == 1 or dims that already
    divide)."""
    for pad in (pad_heads, pad_vocab, pad_mlp, pad_experts):
        config, weights = pad(config, weights, tp)
    return config, weights


def padding_report(config: ModelConfig, padded: ModelConfig, bytes_per_element: int = 4) -> dict[str, float]:
    """Memory cost of padding: total parameter and KV-per-token bytes before and after (summed over devices)."""
    params, params_padded = num_params(config), num_params(padded)
    kv, kv_padded = config.kv_bytes_per_token(bytes_per_element), padded.kv_bytes_per_token(bytes_per_element)
    return {"param_bytes": params * bytes_per_element, "param_bytes_padded": params_padded * bytes_per_element,
            "param_overhead": params_padded / params - 1, "kv_bytes_per_token": kv,
            "kv_bytes_per_token_padded": kv_padded, "kv_overhead": kv_padded / kv - 1,
            "num_heads": (config.num_heads, padded.num_heads),
            "num_kv_heads": (config.num_kv_heads, padded.num_kv_heads),
            "intermediate_size": (config.intermediate_size, padded.intermediate_size),
            "moe_intermediate_size": (config.moe_intermediate_size, padded.moe_intermediate_size)}


# ---- loading straight into shards ---------------------------------------------------------------------------------
def shard_decoder(config: ModelConfig, weights: dict[str, np.ndarray] | None, mesh: Mesh, *, dtype=jnp.float32,
                  attn_impl: str = "auto", seed: int = 0, source: str = "checkpoint") -> Decoder:
    """A decoder padded for the mesh's model axis whose parameters are placed shard by shard.

    Each canonical weight goes from host memory to its NamedSharding with one `jax.device_put` (every device
    receives only its slice); the model is built with `nnx.eval_shape`, so no unsharded copy exists on a device.
    `weights=None` (random presets) initialises the unpadded model on the default device first, exactly as the
    single-device path does, and exports it: that one full copy is transient and fine for test-size models.
    The returned model's config is the padded one.
    """
    if weights is None:
        weights = export_weights(build_decoder(config, dtype=dtype, attn_impl=attn_impl, seed=seed))
    check_weights(config, weights, source)
    padded, weights = pad_for_tensor_parallel(config, weights, mesh.shape[MODEL_AXIS])
    model = nnx.eval_shape(lambda: Decoder(padded, dtype=dtype, attn_impl=attn_impl, mesh=mesh, rngs=nnx.Rngs(seed)))
    for name, param in weight_targets(model).items():
        value, want = weights[name], param.get_value().dtype
        # Arrays already on devices (an orbax restore into `checkpoint_shardings`) stay there: device_put to the
        # sharding they already have is a no-op, and a dtype cast runs shard by shard.
        value = value.astype(want) if isinstance(value, jax.Array) else np.asarray(value, dtype=want)
        spec = partition_spec(name, value.shape, mesh)
        param.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
    return model


def checkpoint_shardings(config: ModelConfig, mesh: Mesh) -> dict[str, NamedSharding] | None:
    """Target shardings of the canonical weights for restoring a checkpoint straight into `mesh` (each device
    reads only its slice); None when the model must be padded for this TP first (padding happens on the host)."""
    if needs_padding(config, mesh.shape[MODEL_AXIS]):
        return None
    return {name: NamedSharding(mesh, partition_spec(name, shape, mesh))
            for name, shape in expected_shapes(config).items()}


def bytes_per_device(arrays) -> dict[jax.Device, int]:
    """Bytes each device holds of `arrays` (any pytree of jax.Arrays), from their addressable shards."""
    totals: dict[jax.Device, int] = {}
    for array in jax.tree.leaves(arrays):
        for shard in array.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals
