"""The engine's configuration: plain frozen dataclasses, each validating its own fields (vLLM's and MaxText's shape).

Why one place: `LLM(**kwargs)` keeps vLLM's flat keyword signature, but an argument value that can never work
(a negative page size, an unknown policy, a draft method without a draft model) should fail before any weight is
loaded, with the parameter named and the fix said, and the same rule should hold for code that builds an `Engine`
directly. `EngineConfig.from_kwargs` maps `LLM`'s keywords onto the parts; checks that need the loaded model (an
int8 KV cache for MLA, a KV budget that holds no page) stay where the model is known.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from models.quantization.modes import check_quantization_args

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# int8 / fp8 (float8_e4m3fn): quantized on write with per-token-per-head scales (kernels_pallas/kv_cache/writes.py)
KV_CACHE_DTYPES = {**DTYPES, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
POLICIES = ("auto", "mixed", "prefill_first")  # "auto": the engine picks (compile_budget.scheduling_policy)
SPECULATIVE_METHODS = ("ngram", "draft")


def check_dtype(dtype: object) -> str:
    """`dtype` if it is "auto" or a name of `DTYPES`, else a ValueError listing the choices: the one check of a model
    dtype name (EngineConfig, and `resolve_dtype` for callers such as the benchmark that skip the config)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {sorted(DTYPES)}")
    return dtype


def check_num_drafts(value: object, name: str = "num_speculative_tokens") -> int:
    """`value` if it is an integer >= 1, else a ValueError naming `name`: the one check of every draft count (the
    engine's num_speculative_tokens, a proposer's k, AdaptiveK's k_max)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (at least 1 draft token per step), got {value!r}")
    return value


def check_positive_int(name: str, value: object, fix: str = "") -> None:
    """ValueError naming `name` unless `value` is an integer >= 1 (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}{'; ' + fix if fix else ''}")


def check_speculative_budget(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int) -> None:
    """Every running sequence may verify k drafts plus one token in one step: the step's token budget must hold that."""
    need = max_num_seqs * (num_speculative_tokens + 1)
    if need > max_num_batched_tokens:
        raise ValueError(f"speculative decoding verifies up to max_num_seqs * (num_speculative_tokens + 1) = {need} "
                         f"tokens in one step, more than max_num_batched_tokens={max_num_batched_tokens}; raise "
                         "max_num_batched_tokens or lower max_num_seqs or num_speculative_tokens")


#: Page sizes (tokens) on TPU: the bounds of `default_page_size`'s rule.
TPU_PAGE_SIZE_RANGE = (16, 256)


def default_page_size(backend: str, max_model_len: int) -> int:
    """The KV page size when none is given. TPU: `next_pow2(max_model_len) / 16`, clamped to 16-256, the guidance
    of JAX's in-tree ragged paged attention and tpu-inference (small pages mean small DMAs and more page-table
    scalars for the kernel; `kernels_pallas/attention/tpu.py` moves one page of all KV heads per DMA); a power of
    two, so an int8 / fp8 cache's scales tile its 128-lane rows. Elsewhere 16 (the GPU kernels' tuning and the CPU
    kernels are measured at 16)."""
    check_positive_int("max_model_len", max_model_len)
    if backend != "tpu":
        return 16
    low, high = TPU_PAGE_SIZE_RANGE
    return min(max((1 << (max_model_len - 1).bit_length()) // 16, low), high)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. `page_size` None: the backend's default for the model length (`default_page_size`).
    `kv_cache_dtype` None follows the model dtype; `kv_cache_memory_bytes` None takes `memory_fraction` of the
    device's free memory (1 GiB where the device reports none)."""

    page_size: int | None = None
    kv_cache_dtype: str | None = None
    kv_cache_memory_bytes: int | None = None
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.page_size is not None:
            check_positive_int("page_size", self.page_size, "tokens per KV page, e.g. 16, or None for the backend's "
                               "default")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; use one of "
                             f"{sorted(KV_CACHE_DTYPES)} or None (the model dtype)")
        if self.kv_cache_memory_bytes is not None:
            check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes,
                               "give a byte count, or None to use memory_fraction of free device memory")
        if not (isinstance(self.memory_fraction, (int, float)) and 0.0 < self.memory_fraction <= 1.0):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}; it is the share of "
                             "free device memory the KV cache takes when kv_cache_memory_bytes is None")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the prefill/decode policy (inference/engine/scheduler.py; "auto": mixed where attention is
    a ragged kernel, prefill_first under the pure-JAX reference, `compile_budget.scheduling_policy`). `max_model_len` None: the
    model's context (capped by the page pool); the engine is given the resolved value. `async_scheduling`: dispatch
    each step before the previous step's tokens reach the host (inference/engine/async_scheduling.py; the outputs
    are the synchronous engine's, bit for bit in batch-invariant mode and to rounding otherwise; steps that cannot
    overlap exactly run synchronously)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    policy: str = "auto"
    max_prefill_streak: int = 4
    max_model_len: int | None = None
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        check_positive_int("max_num_seqs", self.max_num_seqs, "the most sequences running at once")
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens, "the token budget of one step")
        check_positive_int("max_prefill_streak", self.max_prefill_streak)
        if self.max_model_len is not None:
            check_positive_int("max_model_len", self.max_model_len, "or None for the model's context")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r} (scheduling_policy); expected one of "
                             f"{POLICIES}")
        if self.max_num_batched_tokens < self.max_num_seqs and self.policy == "mixed":
            raise ValueError("with the mixed policy max_num_batched_tokens must be at least max_num_seqs, so every "
                             "running sequence can decode in each step")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` None (off), "ngram" (prompt lookup) or "draft" (the draft model `model`);
    `num_speculative_tokens` drafts per step, adapted per request to its acceptance rate when `adaptive`."""

    method: str | None = None
    num_speculative_tokens: int = 4
    model: str | None = None
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.method is None:
            if self.model is not None:
                raise ValueError("speculative_model is set but speculative_method is not; pass "
                                 "speculative_method='draft'")
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative_method {self.method!r}; supported: 'ngram' (prompt lookup), "
                             "'draft' (a draft model, with speculative_model=...)")
        check_num_drafts(self.num_speculative_tokens)
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_model is only used with speculative_method='draft'")
        if self.method == "draft" and self.model is None:
            raise ValueError("speculative_method='draft' needs speculative_model, e.g. 'smollm2-135m:layers=0:30:3,29'")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Weight quantization (models/quantization/modes.py): `mode` None, "int8", "int4", "int4-awq" or "gguf";
    `group_size` the int4 group (None: 32 where it divides every input dimension, else 64)."""

    mode: str | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        check_quantization_args(self.mode, self.group_size)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """`tensor_parallel_size` devices per replica, `data_parallel_size` independent replicas."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size, "1 runs on one device")
        check_positive_int("data_parallel_size", self.data_parallel_size, "1 runs one replica")

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (inference/lora/): `max_loras` device slots (adapters one step can mix) of rank up to
    `max_lora_rank`; vLLM's defaults."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        check_positive_int("max_loras", self.max_loras, "the number of adapters one batch can mix")
        check_positive_int("max_lora_rank", self.max_lora_rank, "the largest adapter rank r to serve, e.g. 16")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM` is configured with: the model and its numerics at the top, one part per concern.

    `dtype`: "auto" (bfloat16 on TPU and GPU, float32 on CPU) or a name of `DTYPES`; `attn_impl`: an attention
    implementation name (kernels_pallas/attention/dispatch.py); `compilation_cache_dir`: see
    inference/runtime/compile_cache.py `apply_cache_setting`; `batch_invariant`: a request's logits do not depend
    on its batch (`check_batch_invariant` says what it refuses and why; models/batch_invariant.py how).
    """

    model: str = "smollm2-135m"
    dtype: str = "auto"
    attn_impl: str = "auto"
    seed: int = 0
    compilation_cache_dir: str | None = "default"
    batch_invariant: bool = False
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    quantization: QuantizationConfig = dataclasses.field(default_factory=QuantizationConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        from kernels_pallas.attention.dispatch import IMPLEMENTATIONS

        check_dtype(self.dtype)
        if self.attn_impl not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attn_impl {self.attn_impl!r}; expected one of {IMPLEMENTATIONS}")
        if self.parallel.num_devices > 1 and self.quantization.mode not in (None, "fp8"):
            raise ValueError(f"tensor_parallel_size or data_parallel_size > 1 with quantization="
                             f"{self.quantization.mode!r} is not supported yet (quantization='fp8' is); use one "
                             "device")
        spec = self.speculative
        if spec.method == "draft" and self.parallel.num_devices > 1:
            raise ValueError("a draft model with tensor_parallel_size or data_parallel_size > 1 is not supported yet; "
                             "use speculative_method='ngram' or one device")
        if self.lora.enable_lora and (spec.method is not None or self.parallel.data_parallel_size > 1):
            raise ValueError("enable_lora with speculative decoding or data_parallel_size > 1 is not supported yet; "
                             "use one replica without speculative_method")
        if self.batch_invariant is not False:
            check_batch_invariant(self)
        if spec.enabled:
            check_speculative_budget(self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens,
                                     spec.num_speculative_tokens)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config of `LLM(**kwargs)`: each of LLM's keyword arguments goes to its part (unknown: TypeError)."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in _KWARG_FIELDS:
                part, field = _KWARG_FIELDS[key]
                parts[part][field] = value
            elif key in _TOP_FIELDS:
                top[key] = value
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        return cls(**top, **{name: kind(**parts[name]) for name, kind in _PARTS.items()})


def check_batch_invariant(config: EngineConfig) -> None:
    """ValueError naming every setting `batch_invariant=True` cannot make invariant, and the fix. The model-dependent
    refusals (MLA, MoE, no C++ kernels) come later, from `models.batch_invariant.make_batch_invariant`."""
    if not isinstance(config.batch_invariant, bool):
        raise ValueError(f"batch_invariant must be True or False, got {config.batch_invariant!r}")
    problems = []
    if config.dtype not in ("auto", "float32"):
        problems.append(f"dtype={config.dtype!r}: the invariant matmul is float32 (use dtype='float32')")
    if config.cache.kv_cache_dtype not in (None, "float32"):
        problems.append(f"kv_cache_dtype={config.cache.kv_cache_dtype!r}: a trainer's forward keeps float32 K/V "
                        "(leave kv_cache_dtype unset)")
    if config.quantization.mode is not None:
        problems.append(f"quantization={config.quantization.mode!r}: the quantized matmuls are not row-invariant "
                        "(use quantization=None)")
    if config.speculative.method is not None:
        problems.append("speculative decoding: a verifying row spends its random key differently from a plain "
                        "decode row, so a seeded request's tokens depend on its drafts (unset speculative_method)")
    if config.lora.enable_lora:
        problems.append("enable_lora: the LoRA delta is XLA matmuls, not row-invariant (enable_lora=False)")
    if config.parallel.num_devices > 1:
        problems.append("tensor_parallel_size / data_parallel_size > 1: a row-parallel projection's psum splits "
                        "the K sum by device, so results would depend on the TP size (untested here; use one device)")
    if config.attn_impl not in ("auto", "cpu"):
        problems.append(f"attn_impl={config.attn_impl!r}: only the C++ CPU kernel is checked invariant "
                        "(use 'auto' or 'cpu')")
    if problems:
        raise ValueError("batch_invariant=True cannot be combined with: " + "; ".join(problems))


_PARTS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig,
          "quantization": QuantizationConfig, "parallel": ParallelConfig, "lora": LoRAConfig}
_TOP_FIELDS = ("model", "dtype", "attn_impl", "seed", "compilation_cache_dir", "batch_invariant")
#: LLM keyword -> (part, field), where the names differ from or do not say the part.
_KWARG_FIELDS = {
    **{name: ("cache", name) for name in ("page_size", "kv_cache_dtype", "kv_cache_memory_bytes", "memory_fraction",
                                          "enable_prefix_caching")},
    **{name: ("scheduler", name) for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                              "async_scheduling")},
    "scheduling_policy": ("scheduler", "policy"),
    "speculative_method": ("speculative", "method"),
    "num_speculative_tokens": ("speculative", "num_speculative_tokens"),
    "speculative_model": ("speculative", "model"), "speculative_adaptive": ("speculative", "adaptive"),
    "quantization": ("quantization", "mode"), "quantization_group_size": ("quantization", "group_size"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "data_parallel_size": ("parallel", "data_parallel_size"),
    **{name: ("lora", name) for name in ("enable_lora", "max_loras", "max_lora_rank")},
}

__all__ = ["CacheConfig", "DTYPES", "EngineConfig", "KV_CACHE_DTYPES", "LoRAConfig", "ParallelConfig",
           "QuantizationConfig", "SchedulerConfig", "SpeculativeConfig", "check_batch_invariant", "check_positive_int",
           "check_speculative_budget", "default_page_size"]
