"""Serve a model over the OpenAI API (inference/entrypoints/openai/): /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics.

    python scripts/serve.py                                    # SmolLM2-135M-Instruct on http://127.0.0.1:8000
    python scripts/serve.py --model=model.gguf --port=9000 --served_model_name=my-model --max_waiting=64
    PAGEJAX_API_KEY=... python scripts/serve.py --host=0.0.0.0   # clients send Authorization: Bearer <key>
    python scripts/serve.py --lora=sql=/path/to/sql-adapter        # requests with model="sql" run that adapter
    python scripts/serve.py --warmup                               # compile every step variant before binding

The engine flags (model, KV cache, dtype, quantization, parallelism) are the batch launcher's
(scripts/engine_flags.py). SIGTERM or Ctrl-C stops accepting connections, lets every in-flight request finish, then
exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Sequence

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root, for `scripts`
from scripts.engine_flags import build_llm, lora_requests  # noqa: E402

API_KEY_ENV = "PAGEJAX_API_KEY"

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (0.0.0.0 for every interface).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535)
_API_KEY = flags.DEFINE_string("api_key", None, f"Require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV}, "
                               "else no authentication).")
_SERVED_NAME = flags.DEFINE_multi_string("served_model_name", None, "Name(s) clients pass as `model` (default: "
                                         "--model). Repeatable.")
_MAX_WAITING = flags.DEFINE_integer("max_waiting", None, "Sequences that may wait beyond the running slots "
                                    "(--max_num_seqs); more get 503 + Retry-After. Default: unbounded.",
                                    lower_bound=0)
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 4 << 20, "Largest request body; larger ones get 413.",
                                 lower_bound=1)
_RUNTIME_LORA = flags.DEFINE_bool("allow_runtime_lora", False, "Enable POST /v1/load_lora_adapter and "
                                  "/v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): clients can "
                                  "make the server read adapter folders; turns LoRA on even without --lora.")
_WARMUP = flags.DEFINE_bool("warmup", False, "Compile every step variant serving can run before binding "
                            "(LLM.warmup: decode, prefill, logprob, structured-output and speculative steps), so no "
                            "request waits for a compile.")
_LOG_LEVEL = flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"],
                               "uvicorn's log level.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    api_key = _API_KEY.value if _API_KEY.value is not None else os.environ.get(API_KEY_ENV) or None
    loras = list(lora_requests().values())  # --lora NAME=PATH: served as model NAME
    try:
        llm = build_llm(enable_lora=_RUNTIME_LORA.value)
        if _WARMUP.value:
            start = time.perf_counter()
            compiled = llm.warmup()
            print(f"warm-up: {compiled} step variants compiled in {time.perf_counter() - start:.1f} s", flush=True)
        from inference.entrypoints.openai.server import serve

        serve(llm, host=_HOST.value, port=_PORT.value, log_level=_LOG_LEVEL.value, api_key=api_key,
              served_model_name=_SERVED_NAME.value, max_waiting=_MAX_WAITING.value, max_body_bytes=_MAX_BODY.value,
              lora_modules=loras, allow_runtime_lora=_RUNTIME_LORA.value)
    except (ValueError, OSError) as e:  # a bad model or adapter: one line, before the server binds
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    app.run(main)
