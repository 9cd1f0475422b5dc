"""One replica of an `LLM`'s engine, built from the loaded model: its mesh (one per data-parallel replica), its
decoder (on one device, or padded and sharded over the mesh; quantized as asked), its LoRA slots and manager, and its
speculative proposer. `LLM.__init__` sizes the caches and assembles the engines from these."""

from __future__ import annotations

import jax

from inference.engine.config import LoRAConfig, ParallelConfig, QuantizationConfig, SpeculativeConfig
from inference.lora.manager import LoRAManager
from inference.lora.slots import LoRASlots
from inference.spec_decode.ngram import NgramProposer, PromptLookupProposer
from inference.spec_decode.proposer import Proposer
from models.decoder import build_decoder, quantize_decoder
from models.quantization.modes import is_quantized


def _gguf_weights(quantization: str | None, loaded) -> dict | None:
    """The GGUF file's quantized tensors for quantization="gguf" (the model must come from a .gguf file)."""
    if quantization != "gguf":
        return None
    if not str(loaded.source).endswith(".gguf"):
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks, but the model comes from {loaded.source}; "
                         "use 'int8' or 'int4' to quantize it")
    from models.loaders.gguf_file import load_gguf_quantized
    return load_gguf_quantized(loaded.source, loaded.config)


def _calibration_tokens(quantization: str | None, loaded):
    """AWQ's calibration token ids for quantization="int4-awq" (models/quantization/awq.py), else None."""
    if quantization != "int4-awq":
        return None
    from inference.loading.shipped_text import calibration_token_ids
    from models.quantization.awq import AWQConfig
    return calibration_token_ids(loaded.tokenizer, loaded.config.vocab_size, AWQConfig().num_tokens)


def replica_meshes_for(parallel: ParallelConfig) -> list:
    """One mesh per data-parallel replica, each `1 x tensor_parallel` over this process's own devices; [None] for a
    single replica on one device (the plain path, no mesh)."""
    if parallel.num_devices == 1:
        return [None]
    from sharding.mesh import make_mesh, replica_meshes
    # Local devices: under jax.distributed every process runs its own replicas (scripts/generate.py splits the
    # input across processes), so a replica never spans hosts.
    return replica_meshes(make_mesh(data=parallel.data_parallel_size, model=parallel.tensor_parallel_size,
                                    devices=jax.local_devices()))


def build_replica_decoder(loaded, mesh, *, dtype, attn_impl: str, seed: int, quantization: QuantizationConfig):
    """The decoder of one replica: on one device (mesh None) or padded for `mesh` and placed shard by shard."""
    weights = loaded.weights
    if loaded.checkpoint is not None:  # an orbax folder: restored straight into the mesh layout where it can be
        from models.loaders.orbax_checkpoint import restore_weights
        from sharding.partition import checkpoint_shardings
        shardings = None if mesh is None else checkpoint_shardings(loaded.config, mesh)
        weights = restore_weights(loaded.checkpoint, loaded.config, shardings)
    if mesh is None:
        return build_decoder(loaded.config, weights, dtype=dtype, attn_impl=attn_impl, seed=seed,
                             source=loaded.source, quantization=quantization.mode,
                             gguf_weights=_gguf_weights(quantization.mode, loaded),
                             quantization_group_size=quantization.group_size,
                             calibration_tokens=_calibration_tokens(quantization.mode, loaded))
    from sharding.partition import shard_decoder
    if weights is not None and any(is_quantized(w) for w in weights.values()):
        raise ValueError(f"{loaded.source} is an FP8 checkpoint; tensor_parallel_size or data_parallel_size > 1 "
                         "loads float weights only (it pads heads, then quantizes): serve it on one device, or its "
                         "float checkpoint with quantization='fp8'")
    model = shard_decoder(loaded.config, weights, mesh, dtype=dtype, attn_impl=attn_impl, seed=seed,
                          source=loaded.source)
    if quantization.mode is not None:  # "fp8" (EngineConfig): the padded, sharded weights quantized in place;
        quantize_decoder(model, quantization.mode)  # the runner places codes and scales (sharding/partition.py)
    return model


def make_lora_manager(lora: LoRAConfig, padded, config, *, dtype, mesh) -> LoRAManager | None:
    """The LoRA slots (for the replica's padded model and mesh) and their manager, or None without LoRA."""
    if not lora.enable_lora:
        return None
    slots = LoRASlots(padded, max_loras=lora.max_loras, max_rank=lora.max_lora_rank, dtype=dtype, mesh=mesh)
    return LoRAManager(slots, config, max_loras=lora.max_loras, max_rank=lora.max_lora_rank)


def make_proposer(spec: SpeculativeConfig, draft=None, **draft_kwargs) -> Proposer | None:
    """The proposer of one replica: prompt lookup, or a draft model with its own KV cache over the target's pages
    (`spec` already validated)."""
    if spec.method is None:
        return None
    if spec.method == "ngram":
        return PromptLookupProposer(NgramProposer(k=spec.num_speculative_tokens))
    from inference.spec_decode.draft import make_draft_proposer
    return make_draft_proposer(draft, k=spec.num_speculative_tokens, **draft_kwargs)
