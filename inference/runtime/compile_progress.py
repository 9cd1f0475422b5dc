"""Says when XLA is compiling, for launchers: a first run otherwise sits silent for tens of seconds.

JAX reports every compile through `jax.monitoring`: with the persistent cache on, a lookup event comes before each
compile and a hit event when the cache had it; the backend-compile duration event comes after a real compile. So a
lookup that is neither a hit nor done within `announce_after_s` is a compile in progress: one line says what is
happening ("compiling decode steps for <model>, cached in <dir>"), then one line per finished step compile with the
count and the seconds so far. A rerun that loads everything from the cache prints nothing. Without the cache there
is no lookup event, so the first slow compile is announced when it ends.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from jax import monitoring

from inference.runtime.compile_cache import configured_cache_dir

_LOOKUP = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"
_COMPILED = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT

#: Compiles shorter than this (small helper jits) are not reported one by one.
MIN_REPORTED_S = 0.5

class CompileProgress:
    """Announces compiles of `model`'s steps while it is active (`with CompileProgress(...):`)."""

    def __init__(self, model: str, write: Callable[[str], None], *, announce_after_s: float = 1.0):
        self.model, self.write = model, write
        self.announce_after_s = announce_after_s
        self.announced = False
        self.num_compiled = 0
        self.compile_s = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def __enter__(self) -> CompileProgress:
        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_listener(self._on_event)
        monitoring.unregister_event_duration_listener(self._on_duration)
        self._cancel()

    def _headline(self) -> str:
        cache_dir = configured_cache_dir()  # read when it happens: the LLM sets the cache up after we start
        where = f"cached in {cache_dir} (later runs load them)" if cache_dir else \
            "not cached (no compilation cache dir): every run compiles"
        return f"compiling decode steps for {self.model}, {where}"

    def _announce(self) -> None:
        with self._lock:
            if not self.announced:
                self.announced = True
                self.write(self._headline())

    def _cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _on_event(self, event: str, **_) -> None:
        if event == _LOOKUP:
            self._cancel()
            with self._lock:
                self._timer = threading.Timer(self.announce_after_s, self._announce)
                self._timer.daemon = True
                self._timer.start()
        elif event == _HIT:
            self._cancel()

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        if event != _COMPILED:
            return
        self._cancel()
        if seconds < MIN_REPORTED_S:
            return
        self._announce()
        self.num_compiled += 1
        self.compile_s += seconds
        self.write(f"  compiled {self.num_compiled} step{'s' if self.num_compiled > 1 else ''} "
                   f"({self.compile_s:.0f} s of compiling, {time.monotonic() - self._start:.0f} s since start)")

