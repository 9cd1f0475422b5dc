"""AWQ-style activation-aware scaling before int4 quantization (Lin et al., 2023, "AWQ").

A few input channels of a linear layer carry much larger activations than the rest; rounding their weights costs
more output error than rounding others. Scaling weight row i by s_i > 1 and the input channel by 1/s_i leaves the
float product unchanged, x W = (x / s)(s W), but gives row i a finer share of its group's 4-bit grid. AWQ picks

    s = mean_tokens|x|^alpha,  normalised by sqrt(max(s) * min(s)),   alpha in a grid (0, 0.1, .., 0.9)

per group of linears that share an input, minimising the output error || x W - (x / s) Q(s W) ||^2 on calibration
activations, where Q is the int4 quantizer the model then uses (`models.quantization.modes.quantize_int4_minmax`,
grouped min form). AWQ's paper searches 20 alphas over 128 x 512 tokens; here 10 alphas over 256 tokens keep load-time
calibration of SmolLM2 to seconds (the search is matmul-bound; on SmolLM2 int4 g64 the smaller search cut the
summed calibration output error nearly as much as 512 tokens x 20 alphas did). alpha = 0 is s = 1, plain int4, so on the
calibration data the chosen scales are never worse than plain int4 per group.

Where 1/s goes. Every group of this architecture has an exact place to fold it, so there is no explicit input-scale
op: the quantized model keeps exactly the "int4" structure, parameters and matmuls (an extra elementwise multiply
per linear would cost a pass over the activations and a different compiled step for nothing):

    q/k/v     share attn_norm's output -> attn_norm.weight / s (RMSNorm is elementwise after normalisation: exact;
              Gemma's (1 + w) form: w' = (1 + w) / s - 1).
    gate/up   share mlp_norm's output  -> mlp_norm.weight / s (same).
    o_proj    its input is softmax(QK^T) V, linear in V -> v_proj's output columns (and bias) / s, as AWQ does.
              With GQA a KV head's value channels feed every query head of its group, so s is tied across the group:
              the statistic is averaged over the group's query heads and one scale per (KV head, dim) is used.
    down_proj its input is act(gate) * up, linear in up -> up_proj's output columns / s.

Folding into v_proj / up_proj columns is free for their own quantization: the min-form quantizer is per output
column, so a column scale rescales that column's scale and offset and leaves the codes unchanged. Layers are
processed in order on float activations (the scaled float model is the same function as the original).

Calibration: `calibration_dataset` is a grain pipeline (`grain.MapDataset`) that cuts token ids into fixed-length
chunks and batches them; the hidden states go layer by layer through the cache-free forward
(`DecoderLayer.forward_dense`, jitted once), with attn_norm, o_proj, gate_proj and down_proj wrapped by recorders
that return the inputs of the four groups (`_capture_inputs`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.optional_deps import require
from models.quantization.modes import fake_quant_int4, int4_group_size, is_quantized

if TYPE_CHECKING:
    import grain

log = logging.getLogger(__name__)

#: The groups of linears searched per layer, named by their shared input: q/k/v, o, gate/up, down.
GROUPS = ("qkv", "o", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class AWQConfig:
    """group_size: the int4 group (None: 32 when it divides every input dimension, else 64, as plain int4).
    num_tokens / seq_len / batch_size: calibration tokens, chunk length and chunks per batch."""

    group_size: int | None = None
    alphas: tuple[float, ...] = tuple(i / 10 for i in range(10))
    num_tokens: int = 256
    seq_len: int = 128
    batch_size: int = 2

    def __post_init__(self):
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas) or 0.0 not in self.alphas:
            raise ValueError(f"alphas must be values in [0, 1] that include 0 (plain int4), got {self.alphas}")
        if self.seq_len < 1 or self.batch_size < 1 or self.num_tokens < self.seq_len:
            raise ValueError(f"need num_tokens >= seq_len >= 1 and batch_size >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """The search of one group: the chosen alpha and the output error (mean squared) of plain int4 and of AWQ."""

    layer: int
    group: str
    alpha: float
    error_plain: float
    error_awq: float


# --------------------------------------------------------------------------------------------------------------------
# Calibration data.

def calibration_dataset(token_ids: Sequence[int], seq_len: int, batch_size: int) -> grain.MapDataset:
    """Token ids -> a grain MapDataset of int32 [batch, seq_len] batches (the tail that fills no chunk is dropped)."""
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    num_chunks = len(ids) // seq_len
    if num_chunks < 1:
        raise ValueError(f"{len(ids)} calibration tokens fill no chunk of seq_len={seq_len}; pass more text")
    grain = require("grain", "AWQ calibration")
    return (grain.MapDataset.range(num_chunks)
            .map(lambda i: ids[i * seq_len:(i + 1) * seq_len])
            .batch(batch_size))


# --------------------------------------------------------------------------------------------------------------------
# The search.

def awq_scales(x_mean: jax.Array, alpha: float | jax.Array) -> jax.Array:
    """s = x_mean^alpha (x_mean clamped at 1e-4 as in AWQ), normalised so that max(s) * min(s) = 1."""
    s = jnp.maximum(jnp.asarray(x_mean, jnp.float32), 1e-4) ** alpha
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


@functools.partial(jax.jit, static_argnames="group_size")
def grid_errors(x: jax.Array, w: jax.Array, x_mean: jax.Array, alphas: jax.Array, group_size: int) -> jax.Array:
    """Mean squared output error of the scaled int4 layer, x[N, in] @ W[in, out], for each alpha -> [len(alphas)]."""

    ref = x @ w

    def error(alpha):
        s = awq_scales(x_mean, alpha)
        w_hat = fake_quant_int4(w * s[:, None], group_size) / s[:, None]
        return jnp.mean((x @ w_hat - ref) ** 2)

    return jax.lax.map(error, alphas)


def search_scales(x: jax.Array, w: jax.Array, group_size: int, alphas: Sequence[float],
                  tie: tuple[int, int, int] | None = None) -> tuple[jax.Array, float, float, float]:
    """Best per-input-channel scales for x[N, in] @ w[in, out] -> (s[in], alpha, error at alpha=0, best error).

    `tie=(kv_heads, group, head_dim)`: the input is attention output laid out (kv head, query head in group, dim);
    the statistic is averaged over the group so that s is shared by the query heads of one KV head."""
    x_mean = jnp.mean(jnp.abs(x), axis=0)
    if tie is not None:
        x_mean = jnp.broadcast_to(x_mean.reshape(tie).mean(axis=1, keepdims=True), tie).reshape(-1)
    errors = np.asarray(grid_errors(x, w, x_mean, jnp.asarray(alphas, jnp.float32), group_size))
    best = int(np.argmin(errors))
    alpha = float(alphas[best])
    return awq_scales(x_mean, alpha), alpha, float(errors[list(alphas).index(0.0)]), float(errors[best])


# --------------------------------------------------------------------------------------------------------------------
# Capturing layer inputs and folding scales.

class _Recorder(nnx.Module):
    """Wraps a module for one eager forward: keeps each input (or output) it sees, returns the module's output."""

    def __init__(self, inner, sink: list, keep_output: bool):
        self.inner = inner
        self.sink = sink
        self.keep_output = keep_output

    def __call__(self, x):
        y = self.inner(x)
        self.sink.append(y if self.keep_output else x)
        return y


# group -> (parent path, module, keep its output): the q/k/v input is recorded as attn_norm's output because the
# attention applies its projections under vmap (a recorder there would see batch tracers).
_OWNERS = {"qkv": ("", "attn_norm", True), "o": ("attn", "o_proj", False), "gate_up": ("mlp", "gate_proj", False),
           "down": ("mlp", "down_proj", False)}


def _parent(layer, path: str):
    return getattr(layer, path) if path else layer


@nnx.jit
def _capture_inputs(layer, hidden: jax.Array, positions: jax.Array, shared_kv) -> tuple[jax.Array, Any, dict]:
    """Run the float layer as `Decoder.forward` does, on hidden[B, L, D] (`shared_kv`: the owner layer's (k, v) for
    a layer that shares its KV, else None) -> (output, own (k, v), group -> inputs [B*L, in]).

    Jitted (one compilation for identical layers): the recorders are installed on the traced copy of the layer, they
    collect tracers, and the function returns them; the layer's structure is restored before the trace ends."""
    sinks = {g: [] for g in GROUPS}
    originals = {g: getattr(_parent(layer, parent), name) for g, (parent, name, _) in _OWNERS.items()}
    for g, (parent, name, keep_output) in _OWNERS.items():
        setattr(_parent(layer, parent), name, _Recorder(originals[g], sinks[g], keep_output))
    try:
        out, kv = layer.forward_dense(hidden, positions, shared_kv)
    finally:
        for g, (parent, name, _) in _OWNERS.items():
            setattr(_parent(layer, parent), name, originals[g])
    inputs = {g: sinks[g][0].reshape(-1, sinks[g][0].shape[-1]).astype(jnp.float32) for g in GROUPS}
    return out, kv, inputs


def _kernel(linear) -> jax.Array:
    return jnp.asarray(linear.kernel.get_value(), jnp.float32)


def _set(param: nnx.Param, value: jax.Array) -> None:
    param.set_value(jnp.asarray(value, param.get_value().dtype))


def _fold_into_norm(norm, s: jax.Array) -> None:
    w = jnp.asarray(norm.weight.get_value(), jnp.float32)
    _set(norm.weight, w / s if norm.style == "rms" else (1.0 + w) / s - 1.0)


def _fold_into_columns(linear, s: jax.Array) -> None:
    _set(linear.kernel, _kernel(linear) / s[None, :])
    if linear.bias is not None:
        _set(linear.bias, jnp.asarray(linear.bias.get_value(), jnp.float32) / s)


def _scale_rows(linears, s: jax.Array) -> None:
    for lin in linears:
        _set(lin.kernel, _kernel(lin) * s[:, None])


def check_awq_model(model) -> None:
    """ValueError unless every layer has the q/k/v/o attention and gated MLP that the folds above assume."""
    for i, layer in enumerate(model.layers):
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears = [*projs, *(getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))]
        if not all(hasattr(p, "kernel") for p in linears):  # MoE's experts and MLA's projections differ
            raise ValueError(f"int4-awq supports layers with q/k/v/o projections and a gated MLP; layer {i} differs "
                             "(MLA or MoE?); use quantization='int4'")
        if any(is_quantized(p.kernel.get_value()) for p in projs):
            raise ValueError("AWQ scales a float model; apply it before quantize_decoder")


def apply_awq(model, token_ids: Sequence[int], config: AWQConfig = AWQConfig()) -> list[GroupResult]:
    """Search AWQ scales for every layer of a float `Decoder` on `token_ids` and fold them into its weights, in place.

    The model stays float and computes the same function (up to float rounding); quantize it afterwards
    (`quantize_decoder(model, "int4")`, which "int4-awq" does). Returns one GroupResult per (layer, group).
    """
    check_awq_model(model)
    cfg = model.config
    layer0 = model.layers[0]
    dims = [layer0.attn.q_proj.kernel.get_value().shape[0], layer0.attn.o_proj.kernel.get_value().shape[0],
            layer0.mlp.down_proj.kernel.get_value().shape[0]]
    group_size = config.group_size or int4_group_size(dims)
    ids = np.asarray(token_ids, np.int32).reshape(-1)[:config.num_tokens]
    batches = list(calibration_dataset(ids, config.seq_len, config.batch_size))
    positions = jnp.arange(config.seq_len, dtype=jnp.int32)
    hidden = [model.embed(jnp.asarray(b)) for b in batches]
    capture = lambda layer, hs, kvs: list(zip(*[_capture_inputs(layer, h, positions, kv)  # noqa: E731
                                                 for h, kv in zip(hs, kvs)]))
    tie = (cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    # With cross-layer KV sharing a layer's v_proj also feeds the layers that share its cache, so scaling its
    # columns would change them: the o_proj group is left unscaled there.
    shares_kv = any(not cfg.owns_kv(i) for i in range(cfg.num_layers))
    results: list[GroupResult] = []
    kv = None
    for i, layer in enumerate(model.layers):
        owns = cfg.owns_kv(i)
        outputs, own_kv, per_batch = capture(layer, hidden, [None] * len(hidden) if owns else kv)
        inputs = {g: jnp.concatenate([d[g] for d in per_batch]) for g in GROUPS}
        kv = own_kv if owns else kv
        attn, mlp = layer.attn, layer.mlp
        plan = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
                "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
        for g in GROUPS:
            if g == "o" and shares_kv:
                continue
            w = jnp.concatenate([_kernel(lin) for lin in plan[g]], axis=1)
            s, alpha, err0, err = search_scales(inputs[g], w, group_size, config.alphas, tie if g == "o" else None)
            results.append(GroupResult(i, g, alpha, err0, err))
            if alpha == 0.0:
                continue  # s = 1: nothing to fold
            _scale_rows(plan[g], s)
            if g == "qkv":
                _fold_into_norm(layer.attn_norm, s)
            elif g == "gate_up":
                _fold_into_norm(layer.mlp_norm, s)
            elif g == "o":
                _fold_into_columns(attn.v_proj, s.reshape(tie)[:, 0, :].reshape(-1))
            else:
                _fold_into_columns(mlp.up_proj, s)
        hidden = outputs
    gain = sum(r.error_plain for r in results) / max(sum(r.error_awq for r in results), 1e-30)
    log.info("AWQ: %d groups, %d scaled, summed calibration output error plain/awq = %.3f", len(results),
             sum(r.alpha > 0 for r in results), gain)
    return results
