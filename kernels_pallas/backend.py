"""The backend a traced program will run on: what every kernel choice (attention impl, C++ CPU kernels, the MLA
kernel) asks instead of `jax.default_backend()`.

Normally the two are the same. A deviceless ahead-of-time compile (`scripts/tools/aot_compile.py`) traces on a CPU
host for a TPU or GPU that is not there; inside `compiling_for("tpu")` the program is built as it would be on
that chip: the Mosaic kernel, never a CPU-only FFI call.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

BACKENDS = ("cpu", "gpu", "tpu")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("pagejax_target_backend", default=None)


def target_backend() -> str:
    """'cpu', 'gpu' or 'tpu': the backend of the program being traced."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(backend: str) -> Iterator[None]:
    """Trace (lower) programs inside this block for `backend` ('cpu', 'gpu' or 'tpu'). jax.jit caches traces
    without looking at this, so lower a fresh jitted function inside the block."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    token = _TARGET.set(backend)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_device_kind(backend: str) -> str | None:
    """The device kind (e.g. "TPU v6 lite", "NVIDIA H100 80GB HBM3") of the chip a program for `backend` is built
    for: the abstract mesh's device during a deviceless compile (`jax.sharding.use_abstract_mesh`), else the first
    local device of that backend, else None. Kernels pick their tuned block sizes by it."""
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platforms = {"gpu": ("gpu", "cuda", "rocm"), "tpu": ("tpu",), "cpu": ("cpu",)}[backend]
    if abstract is not None and abstract.platform in platforms:
        return abstract.device_kind
    try:
        return jax.devices(backend)[0].device_kind
    except RuntimeError:
        return None
