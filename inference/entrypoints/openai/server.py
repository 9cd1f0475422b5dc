"""Running the app: `serve(llm, ...)` in the foreground (SIGTERM / SIGINT drain in-flight requests, then exit), or
`ServerThread` in the background of this process (tests, the server benchmark).

Draining is uvicorn's graceful shutdown: on SIGTERM it stops accepting connections and waits for the open ones to
finish, streams included; then the app's lifespan ends, which waits for any request still in the engine and
closes the engine loop.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

import uvicorn

from inference.engine.llm_engine import freeze_heap
from inference.entrypoints.openai.app import build_app


def _config(llm, host: str, port: int, log_level: str, **app_kwargs) -> uvicorn.Config:
    # timeout_keep_alive: idle keep-alive connections must not hold a drain open for long
    return uvicorn.Config(build_app(llm, **app_kwargs), host=host, port=port, log_level=log_level,
                          timeout_keep_alive=2, lifespan="on")


def serve(llm, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **app_kwargs) -> None:
    """Serve `llm` until SIGTERM / SIGINT (see `build_app` for `app_kwargs`); exit 0 once drained.

    This process serves `llm` for the rest of its life, so what is alive now (weights, compiled steps, tokenizer)
    is frozen out of the collector's full collections first (`freeze_heap`). `ServerThread` does not: its process
    (a notebook, a test) goes on to other work."""
    freeze_heap()
    # uvicorn drains, then re-raises the signal it caught under the handler it found: make that a clean exit
    # rather than death by SIGTERM (which would look like a crash to a supervisor).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.Server(_config(llm, host, port, log_level, **app_kwargs)).run()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The server on a thread of this process, on a free port of 127.0.0.1: `with ServerThread(llm) as url: ...`."""

    def __init__(self, llm, *, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning",
                 **app_kwargs):
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(_config(llm, self.host, self.port, log_level, **app_kwargs))
        self._thread = threading.Thread(target=self.server.run, name="pagejax-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"the server failed to start on {self.url} (see the log above)")
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
