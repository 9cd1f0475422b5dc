"""Load a llama.cpp GGUF file into a `ModelConfig` and the canonical flat float32 weight layout.

GGUF stores metadata (hyperparameters, tokenizer) and block-quantized tensors in one file. We read it with the
`gguf` package, dequantize each tensor to float32 with vectorized numpy (the model computes in bf16/f32; keeping the
quantized form is a later optimization), rename tensors to the names in `models.weights`, transpose linears to
`[in, out]` and undo llama.cpp's Q/K row permutation so the decoder can use Hugging Face "rotate half" RoPE for
every source format.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling
from models.loaders.read_errors import named_errors
from models.optional_deps import require
from models.quantization.formats import QuantizedWeight
from models.quantization.gguf_blocks import SUPPORTED_QUANT_TYPES as BLOCK_QUANT_TYPES, from_reader_tensor
from models.weights import check_weights

_gguf = require("gguf", "Reading a GGUF file")
Q = _gguf.GGMLQuantizationType
GGUFReader = _gguf.GGUFReader

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# llama.cpp's converter permutes Q/K rows for these architectures only (LlamaModel.permute); Qwen2 keeps HF order.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})


@dataclasses.dataclass(frozen=True)
class GGUFInfo:
    """What the tokenizer needs from GGUF metadata (the file has no tokenizer.json)."""

    tokens: tuple[str, ...] = dataclasses.field(repr=False)
    token_types: tuple[int, ...] = dataclasses.field(repr=False)
    merges: tuple[str, ...] = dataclasses.field(repr=False)
    tokenizer_model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre_tokenizer: str  # llama.cpp pre-tokenizer name, e.g. "smollm", "gpt2", "llama-bpe", "qwen2"
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    chat_template: str | None = dataclasses.field(default=None, repr=False)
    scores: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    architecture: str = ""
    hf_tokenizer_json: str | None = dataclasses.field(default=None, repr=False)  # `tokenizer.huggingface.json`


class _ArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of the memmap.

    `np.memmap.__getitem__`/`__array_finalize__` dominate GGUFReader's parse of the ~100k tokenizer strings; a
    base-class ndarray view of the same mapping parses several times faster, still without reading tensor data.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


# --------------------------------------------------------------------------------------------------------------------
# Dequantization: vectorized over all blocks of a tensor at once; bit-identical to gguf.quants.dequantize.

def _split_blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(-1, block_bytes)


def _f16_scale(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles are elements 0..15 of a block, high nibbles 16..31 (ggml's Q4 layout)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _deq_q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = _split_blocks(raw, 34)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16_scale(blocks, 0)


def _deq_q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = _split_blocks(raw, 18)
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16_scale(blocks, 0) * q.astype(np.float32)


def _deq_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = _split_blocks(raw, 20)
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    return _f16_scale(blocks, 0) * q + _f16_scale(blocks, 2)


def _deq_bf16(raw: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_DEQUANTIZERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: lambda raw: np.array(raw, dtype=np.float32),  # a copy: a view would pin the read-only file mapping
    Q.F16: lambda raw: np.asarray(raw).astype(np.float32),
    Q.BF16: _deq_bf16,
    Q.Q4_0: _deq_q4_0,
    Q.Q4_1: _deq_q4_1,
    Q.Q8_0: _deq_q8_0,
}
SUPPORTED_QUANT_TYPES = tuple(q.name for q in _DEQUANTIZERS)


def dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of `shape` (numpy order, rows last-dim-contiguous) from a GGUF tensor's raw data."""
    return _DEQUANTIZERS[qtype](raw).reshape(shape)


# --------------------------------------------------------------------------------------------------------------------
# Q/K permutation.

def permute_qk_llamacpp(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf `LlamaModel.permute` (HF rotate-half rows -> interleaved pairs); for tests."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Inverse of `permute_qk_llamacpp`, as transformers' `_reverse_permute_weights`; rows are the output dim.

    Pass the KV head count for K (the converter permuted K per KV head).
    """
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------------------------
# Reading the file and its metadata.

def _open_reader(path: str) -> GGUFReader:
    """Parse the header; turn the reader's raw numpy/struct failures into one clear ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file not found: {path!r}")
    try:
        reader = _ArrayReader(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means the same thing to the caller
        raise ValueError(f"{path}: cannot read the file; it is truncated or not a GGUF file "
                         f"({type(exc).__name__}: {exc})") from exc
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: tensor {t.name!r} extends past the end of the file ({size} bytes); the file is "
                             "truncated (incomplete download?)")
    return reader


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value pair as Python values; float32 scalars rounded to their shortest decimal (1e-5, not 9.99e-6)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        value = field.contents()
        if field.types and field.types[0].name == "FLOAT32":
            value = float(str(np.float32(value))) if not isinstance(value, list) else value
        out[key] = value
    return out


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _gguf_info(meta: dict[str, Any], arch: str) -> GGUFInfo:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return GGUFInfo(
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)),
        merges=tuple(meta.get("tokenizer.ggml.merges") or ()),
        tokenizer_model=str(meta.get("tokenizer.ggml.model", "")),
        pre_tokenizer=str(meta.get("tokenizer.ggml.pre", "default")),
        bos_token_id=_int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_int_or_none(meta.get("tokenizer.ggml.eos_token_id")),
        unk_token_id=_int_or_none(meta.get("tokenizer.ggml.unknown_token_id")),
        pad_token_id=_int_or_none(meta.get("tokenizer.ggml.padding_token_id")),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        scores=tuple(float(s) for s in meta.get("tokenizer.ggml.scores") or ()),
        architecture=arch,
        hf_tokenizer_json=meta.get("tokenizer.huggingface.json"),
    )


# --------------------------------------------------------------------------------------------------------------------
# RoPE scaling.

def llama3_rope_factors(theta: float, head_dim: int, scaling: RopeScaling) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores as `rope_freqs.weight` for Llama 3.1-style scaling."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig, lo, hi = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (orig / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < orig / hi, 1.0, np.where(wavelen > orig / lo, scaling.factor, mid))


def fit_llama3_rope_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int) -> RopeScaling | None:
    """Recover Llama 3 scaling parameters from a `rope_freqs` tensor (llama.cpp writes no metadata keys for it).

    Only the per-frequency factors matter to the model, so any parameters that reproduce them are correct. The
    smooth band gives two equations for three unknowns: we assume Meta's low_freq_factor=1 (and high_freq_factor=4
    when the band has fewer than two frequencies), then check that the parameters reproduce the tensor; a mismatch
    is an error rather than silently wrong positions.
    """
    f = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    wavelen = 2 * math.pi / theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    error = ValueError(f"rope_freqs tensor does not match Llama 3 RoPE scaling (theta={theta}, head_dim={head_dim}); "
                       "this RoPE variant is not supported")
    if f.shape[0] != head_dim // 2:
        raise error
    band = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    smooth = (1 / f[band] - 1 / factor) / (1 - 1 / factor)  # = orig/((hi-1) wavelen) - 1/(hi-1) when lo = 1
    if band.sum() >= 2:
        a, b = np.polyfit(1 / wavelen[band], smooth, 1)
        hi = float(1 - 1 / b)
        orig = a * (hi - 1)
    elif band.sum() == 1:
        hi = 4.0
        orig = float((smooth[0] * (hi - 1) + 1) * wavelen[band][0])
    else:  # a pure step: any orig/hi with orig/hi above the unscaled wavelengths and orig below the scaled ones
        unscaled, scaled = wavelen[f <= 1 + 1e-4].max(initial=1.0), wavelen[f >= factor * (1 - 1e-4)].min()
        hi = min(4.0, math.sqrt(scaled / unscaled))
        orig = math.sqrt(hi * unscaled * scaled)
    scaling = RopeScaling(kind="llama3", factor=round(factor, 4), low_freq_factor=1.0, high_freq_factor=round(hi, 4),
                          original_max_position_embeddings=int(round(orig)))
    if not np.allclose(llama3_rope_factors(theta, head_dim, scaling), f, rtol=1e-3):
        raise error
    return scaling


def _rope_scaling(meta: dict[str, Any], arch: str, rope_freqs: np.ndarray | None, theta: float, head_dim: int,
                  context_length: int) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    orig = int(meta.get(f"{arch}.rope.scaling.original_context_length") or context_length)
    if kind is None and factor and factor != 1.0:
        kind = "linear"  # legacy `rope.scale_linear` key
    if kind in (None, "none"):
        return fit_llama3_rope_scaling(rope_freqs, theta, head_dim) if rope_freqs is not None else None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(factor or 1.0), original_max_position_embeddings=orig)
    if kind == "yarn":
        return RopeScaling(kind="yarn", factor=float(factor or 1.0), original_max_position_embeddings=orig,
                           beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)))
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}; supported: none, linear, yarn, llama3 rope_freqs")


# --------------------------------------------------------------------------------------------------------------------
# Config.

def _config(meta: dict[str, Any], arch: str, tensor_names: set[str], rope_freqs: np.ndarray | None,
            info: GGUFInfo, embed_rows: int, path: str) -> ModelConfig:
    def req(key: str) -> int:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}; cannot build the model config")
        return int(meta[f"{arch}.{key}"])

    hidden, heads = req("embedding_length"), req("attention.head_count")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    rot = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rot != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count={rot} < head_dim={head_dim}) are "
                         "not supported")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    context = int(meta.get(f"{arch}.context_length", 4096))
    eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return ModelConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(info.tokens) or embed_rows),
        hidden_size=hidden, intermediate_size=req("feed_forward_length"), num_layers=req("block_count"),
        num_heads=heads, num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads), head_dim=head_dim,
        rope_theta=theta, rope_scaling=_rope_scaling(meta, arch, rope_freqs, theta, head_dim, context),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names, max_position_embeddings=context,
        attention_bias="blk.0.attn_q.bias" in tensor_names, bos_token_id=info.bos_token_id,
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)), family=arch,
        name=str(meta.get("general.name", "")))


# --------------------------------------------------------------------------------------------------------------------
# Tensor names.

_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q_proj", "attn_k.weight": "k_proj", "attn_v.weight": "v_proj", "attn_output.weight": "o_proj",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "ffn_gate.weight": "gate_proj", "ffn_up.weight": "up_proj", "ffn_down.weight": "down_proj",
}
_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
_NON_WEIGHTS = {"rope_freqs.weight"}  # folded into ModelConfig.rope_scaling
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def canonical_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.q_proj`; ValueError for tensors this decoder has no slot for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in the llama/qwen2 decoder layout")


def _convert(name: str, w: np.ndarray, config: ModelConfig, permuted_qk: bool) -> np.ndarray:
    """HF [out, in] layout -> canonical: undo Q/K permutation, transpose linears to [in, out]."""
    leaf = name.rsplit(".", 1)[-1]
    if permuted_qk and leaf in ("q_proj", "q_bias"):
        w = unpermute_qk(w, config.num_heads)
    elif permuted_qk and leaf in ("k_proj", "k_bias"):
        w = unpermute_qk(w, config.num_heads, config.num_kv_heads)
    if leaf in _LINEARS:
        w = w.T
    return np.ascontiguousarray(w, dtype=np.float32)


def _arch(meta: dict[str, Any], path: str) -> str:
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


_CORRUPT_FIX = "the file is corrupt or truncated, or its converter wrote what this loader does not know: download " \
    "or convert it again"


def load_gguf_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """Only the tokenizer metadata (no dequantization): for building a tokenizer without loading weights."""
    path = os.fspath(path)
    with named_errors(path, "the GGUF metadata", _CORRUPT_FIX):
        meta = _metadata(_open_reader(path))
        return _gguf_info(meta, _arch(meta, path))


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, np.ndarray], GGUFInfo]:
    """Read a llama/qwen2 GGUF: config, canonical float32 weights (see `models.weights`), tokenizer metadata."""
    path = os.fspath(path)
    with named_errors(path, "the GGUF file", _CORRUPT_FIX):
        return _load_gguf(path)


def _load_gguf(path: str) -> tuple[ModelConfig, dict[str, np.ndarray], GGUFInfo]:
    reader = _open_reader(path)
    meta = _metadata(reader)
    arch = _arch(meta, path)
    for t in reader.tensors:
        if t.tensor_type not in _DEQUANTIZERS:
            raise ValueError(f"{path}: tensor {t.name!r} is stored as {t.tensor_type.name}, which this loader cannot "
                             f"dequantize; supported types: {', '.join(SUPPORTED_QUANT_TYPES)}. Re-quantize the model "
                             "(e.g. llama-quantize ... Q8_0) or load the original safetensors folder")
    by_name = {t.name: t for t in reader.tensors}
    rope_t = by_name.get("rope_freqs.weight")
    rope_freqs = dequantize(rope_t.data, rope_t.tensor_type, tuple(int(d) for d in rope_t.data.shape)) \
        if rope_t is not None else None
    info = _gguf_info(meta, arch)
    embed_rows = int(by_name["token_embd.weight"].shape[-1]) if "token_embd.weight" in by_name else 0
    config = _config(meta, arch, set(by_name), rope_freqs, info, embed_rows, path)
    permuted_qk = arch in _PERMUTED_QK_ARCHITECTURES
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in _NON_WEIGHTS:
            continue
        try:
            name = canonical_name(t.name)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists dims fastest-first
        weights[name] = _convert(name, dequantize(t.data, t.tensor_type, shape), config, permuted_qk)
    check_weights(config, weights, path)
    return config, weights, info


def load_gguf_quantized(path: str, config) -> dict[str, QuantizedWeight]:
    """Canonical name -> QuantizedWeight for every Q8_0/Q4_0/Q4_1 linear and embedding tensor of a GGUF file.

    Linears come out [in, out]; "embed" comes out as the [hidden, vocab] LM-head view (its columns are token rows).
    Q/K rows are un-permuted on the blocks for the architectures whose converter permuted them, so the dequantized
    weights equal `load_gguf`'s float weights exactly. Other tensor types are left out.
    """
    with named_errors(path, "the GGUF file's quantized tensors", _CORRUPT_FIX):
        return _load_gguf_quantized(path, config)


def _load_gguf_quantized(path: str, config) -> dict[str, QuantizedWeight]:
    reader = _open_reader(path)
    arch = _arch(_metadata(reader), path)
    permuted = arch in _PERMUTED_QK_ARCHITECTURES
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        if t.name in _NON_WEIGHTS or t.tensor_type.name not in BLOCK_QUANT_TYPES:
            continue
        name = canonical_name(t.name)
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in _LINEARS and name != "embed":
            continue
        transform: Callable[[np.ndarray], np.ndarray] | None = None
        if permuted and leaf == "q_proj":
            transform = functools.partial(unpermute_qk, n_head=config.num_heads)
        elif permuted and leaf == "k_proj":
            transform = functools.partial(unpermute_qk, n_head=config.num_heads,
                                          n_head_kv=config.num_kv_heads)
        qw = from_reader_tensor(t, row_transform=transform)
        # Device arrays owned by JAX (copies): nothing keeps the file mapping alive.
        out[name] = jax.tree.map(jnp.asarray, qw)
    return out
