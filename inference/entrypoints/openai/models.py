"""The names clients pass as `model`: the base model's, and one per LoRA adapter (vLLM's `--lora-modules`).

A request whose `model` is an adapter's name runs with that adapter; GET /v1/models lists the base model and every
adapter (with `parent` = the base model's id, as vLLM does). With `allow_runtime_lora`, POST /v1/load_lora_adapter
and /v1/unload_lora_adapter add and remove adapters while the server runs (vLLM gates them behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING: anyone who can reach the server can make it read a folder).

Loading an adapter registers it with the engine's `LoRAManager` at once (`register` reads and validates the files),
so a bad path is the load request's 400 with the loader's message, never a failure of a later generation request.
Unloading removes the name first (new requests for it are 404s); the engine forgets the adapter's host copy and
device slot only once no request of this server still runs with it, counted here per adapter, so unloading never
disturbs a request in flight. Adapter ids only grow: an id keys the prefix cache, so a reused id could hit pages
another adapter computed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Sequence

from inference.entrypoints.openai.errors import OpenAIError
from inference.lora.request import LoRARequest

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Adapter:
    request: LoRARequest
    in_flight: int = 0  # requests of this server running with it
    unloaded: bool = False  # removed from the names; the engine forgets it when in_flight reaches 0


class ServedModels:
    """The served names. `base_names`: the base model's (the first is the id responses carry); `engine`: the
    `Engine` whose `lora` manager the adapters live in (an engine without one: a server without LoRA)."""

    def __init__(self, base_names: Sequence[str], engine, *, loras: Sequence[LoRARequest] = (),
                 allow_runtime_lora: bool = False, max_model_len: int | None = None, created: int = 0):
        self.base_names = tuple(base_names)
        if not self.base_names:
            raise ValueError("a server needs at least one served model name")
        self.engine = engine
        self.manager = getattr(engine, "lora", None)
        self.allow_runtime_lora = allow_runtime_lora
        self.max_model_len, self.created = max_model_len, created
        if (loras or allow_runtime_lora) and self.manager is None:
            raise ValueError("LoRA adapters (or allow_runtime_lora) need an LLM built with enable_lora=True "
                             "(the launcher: pass --lora NAME=PATH, or --allow_runtime_lora)")
        self._adapters: dict[str, _Adapter] = {}  # served adapters by name
        self._unloading: dict[int, _Adapter] = {}  # unloaded adapters with requests in flight, by id
        self._lock = threading.Lock()
        for request in loras:  # validated now: a server does not start with an adapter it cannot load
            if request.lora_name in self.base_names or request.lora_name in self._adapters:
                raise ValueError(f"LoRA adapter name {request.lora_name!r} is given twice (or is the base model's "
                                 "served name); give each adapter its own name")
            self.manager.register(request)
            self._adapters[request.lora_name] = _Adapter(request)
        known = [*(a.request.lora_int_id for a in self._adapters.values()), *(self.manager.adapters
                                                                             if self.manager else ())]
        self._next_id = max(known, default=0) + 1

    @property
    def base_name(self) -> str:
        return self.base_names[0]

    def names(self) -> list[str]:
        with self._lock:
            return [*self.base_names, *self._adapters]

    # ---- requests ---------------------------------------------------------------------------------------------
    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None for the base model, or no name); 404 naming the served models for any
        other name (an adapter's name on a server without LoRA included)."""
        if model is None or model in self.base_names:
            return None
        with self._lock:
            adapter = self._adapters.get(model)
        if adapter is None:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                              f"{', '.join(map(repr, self.names()))} (GET /v1/models)", param="model",
                              code="model_not_found")
        return adapter.request

    def hold(self, lora: LoRARequest | None, count: int) -> None:
        """Count `count` engine requests in flight with `lora` until each is `release`d; 404 if it was unloaded
        since `resolve`."""
        if lora is None:
            return
        with self._lock:
            adapter = self._adapters.get(lora.lora_name)
            if adapter is None or adapter.request != lora:
                raise OpenAIError(404, f"the LoRA adapter {lora.lora_name!r} was unloaded", param="model",
                                  code="model_not_found")
            adapter.in_flight += count

    def release(self, lora: LoRARequest | None, count: int = 1) -> None:
        """Requests that `hold` counted have finished; an unloaded adapter leaves the engine with its last one."""
        if lora is None:
            return
        with self._lock:
            adapter = self._adapters.get(lora.lora_name)
            if adapter is None or adapter.request != lora:
                adapter = self._unloading[lora.lora_int_id]
            adapter.in_flight -= count
            forget = adapter.unloaded and adapter.in_flight == 0
            if forget:
                del self._unloading[lora.lora_int_id]
        if forget:
            self._forget(lora.lora_int_id)

    def response_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response carries: the adapter's name, else the base model's first name (vLLM's)."""
        return lora.lora_name if lora is not None else self.base_name

    # ---- /v1/models -------------------------------------------------------------------------------------------
    def cards(self) -> list[dict]:
        base = [{"id": n, "object": "model", "created": self.created, "owned_by": "pagejax", "root": n,
                 "parent": None, "max_model_len": self.max_model_len} for n in self.base_names]
        with self._lock:
            loras = [{"id": name, "object": "model", "created": self.created, "owned_by": "pagejax",
                      "root": a.request.lora_path, "parent": self.base_name, "max_model_len": self.max_model_len}
                     for name, a in self._adapters.items()]
        return base + loras

    # ---- runtime loading --------------------------------------------------------------------------------------
    def load(self, name: str, path: str) -> str:
        """Register a new adapter (blocking: it reads the files; run it off the event loop). 400 for an empty
        name or path, a name in use, or an adapter the loader rejects (its message)."""
        self._check_runtime()
        if not name or not path:
            raise OpenAIError(400, "both 'lora_name' and 'lora_path' must be non-empty", param="lora_name"
                              if not name else "lora_path", code="invalid_value")
        if name in self.base_names:
            raise OpenAIError(400, f"the LoRA adapter name {name!r} is the base model's served name; pick another",
                              param="lora_name", code="invalid_value")
        with self._lock:
            if name in self._adapters:
                raise OpenAIError(400, f"the LoRA adapter {name!r} has already been loaded; unload it first "
                                  "(POST /v1/unload_lora_adapter) to load another under that name",
                                  param="lora_name", code="invalid_value")
            lora_id, self._next_id = self._next_id, self._next_id + 1
        try:
            request = LoRARequest(name, lora_id, path)
            self.manager.register(request)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="lora_path", code="invalid_lora") from None
        except Exception as exc:  # noqa: BLE001 - the files are the client's: whatever breaks reading them is theirs
            raise OpenAIError(400, f"cannot read the LoRA adapter at {path!r} ({type(exc).__name__}: {exc}); check "
                              "its adapter_config.json and adapter_model.safetensors", param="lora_path",
                              code="invalid_lora") from None
        with self._lock:
            if name in self._adapters:  # a concurrent load of the same name won the race
                raise OpenAIError(400, f"the LoRA adapter {name!r} has already been loaded", param="lora_name",
                                  code="invalid_value")
            self._adapters[name] = _Adapter(request)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """Remove an adapter's name now (404 if it is not served); the engine forgets it after its last request."""
        self._check_runtime()
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise OpenAIError(404, f"the LoRA adapter {name!r} cannot be found; loaded adapters: "
                                  f"{sorted(self._adapters)}", param="lora_name", code="model_not_found")
            adapter.unloaded = True
            forget = adapter.in_flight == 0
            if not forget:
                self._unloading[adapter.request.lora_int_id] = adapter
        if forget:
            self._forget(adapter.request.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _forget(self, lora_id: int) -> None:
        try:
            self.engine.remove_lora(lora_id)
        except ValueError as exc:  # a request from outside the server (LLM.generate on the same engine) uses it
            log.warning("LoRA adapter %d stays loaded in the engine: %s", lora_id, exc)

    def _check_runtime(self) -> None:
        if not self.allow_runtime_lora:
            raise OpenAIError(404, "loading and unloading LoRA adapters at run time is off; start the server with "
                              "--allow_runtime_lora (build_app(..., allow_runtime_lora=True)) to enable it",
                              code="runtime_lora_disabled")
