"""The engine flags every launcher shares (model, scheduling, KV cache, dtype, quantization, parallelism, compile
cache), defined once so scripts/generate.py and scripts/serve.py cannot drift apart, and `build_llm()` from them."""

from __future__ import annotations

from typing import Any

from absl import flags

MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model preset name, .gguf file or Hugging Face model folder "
                            "(default: SmolLM2-135M-Instruct, 4-bit GGUF; presets other than it are random-weight "
                            "test models).")
MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Most sequences decoded together.")
MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget of one engine step.")
KV_BYTES = flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV cache size (default: from device memory).")
MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", None, "Longest prompt + completion (default: the model's).")
DTYPE = flags.DEFINE_string("dtype", "auto", "Compute dtype: auto (bfloat16 on TPU/GPU, float32 on CPU), float32, "
                             "bfloat16 or float16.")
QUANTIZATION = flags.DEFINE_string("quantization", None, "Weight quantization: int8, int4, int4-awq or gguf "
                                   "(default: weights in --dtype).")
TP = flags.DEFINE_integer("tensor_parallel_size", 1, "Devices each model replica is sharded over.", lower_bound=1)
DP = flags.DEFINE_integer("data_parallel_size", 1, "Model replicas per process (each on its own devices).",
                          lower_bound=1)
ASYNC_SCHEDULING = flags.DEFINE_bool("async_scheduling", True, "Dispatch each engine step before the previous "
                                     "step's tokens reach the host (same outputs; --noasync_scheduling: one step at "
                                     "a time).")
CACHE_DIR = flags.DEFINE_string("compilation_cache_dir", "default",
                                "Persistent XLA cache dir ('default': ~/.cache/pagejax/xla; '': leave JAX's alone).")

LORA = flags.DEFINE_multi_string("lora", None, "A LoRA adapter as NAME=PATH (a PEFT folder; repeatable); a row "
                                 "runs with the one its 'lora' field names, rows without it run the base model.")
MAX_LORA_RANK = flags.DEFINE_integer("max_lora_rank", 16, "Largest LoRA rank served with --lora.", lower_bound=1)
MAX_LORAS = flags.DEFINE_integer("max_loras", None, "LoRA adapters on the device at once (one batch mixes that many; "
                                 "others wait or are swapped in LRU). Default: the number of --lora flags.",
                                 lower_bound=1)


def lora_requests() -> dict[str, Any]:
    """--lora NAME=PATH flags -> {name: LoRARequest}, ids 1, 2, ... in flag order (checked before the model loads)."""
    from absl import app

    from inference.lora.request import LoRARequest

    adapters: dict[str, Any] = {}
    for spec in LORA.value or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise app.UsageError(f"--lora={spec!r}: give NAME=PATH (a name rows refer to, and a PEFT adapter folder)")
        if name in adapters:
            raise app.UsageError(f"--lora: adapter name {name!r} is given twice")
        adapters[name] = LoRARequest(name, len(adapters) + 1, path)
    return adapters


def build_llm(enable_lora: bool = False) -> Any:
    """The engine, configured from the engine flags (imported here: JAX is slow to import). LoRA is on with --lora
    (or `enable_lora`: the server's runtime adapter loading); by default every --lora adapter gets a device slot."""
    from inference.entrypoints.llm import LLM

    num_loras = MAX_LORAS.value or len(LORA.value or [])
    return LLM(MODEL.value, dtype=DTYPE.value, kv_cache_memory_bytes=KV_BYTES.value,
               max_model_len=MAX_MODEL_LEN.value, max_num_seqs=MAX_NUM_SEQS.value,
               max_num_batched_tokens=MAX_BATCHED.value, compilation_cache_dir=CACHE_DIR.value or None,
               quantization=QUANTIZATION.value, tensor_parallel_size=TP.value, data_parallel_size=DP.value,
               enable_lora=enable_lora or bool(LORA.value), max_loras=max(num_loras, 1),
               max_lora_rank=MAX_LORA_RANK.value, async_scheduling=ASYNC_SCHEDULING.value)
