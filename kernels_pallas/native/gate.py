"""The one switch for the C++ CPU kernels: whether a call site takes a kernel or its pure-JAX path.

Every site that can run a C++ kernel (attention's `impl="auto"`, the KV-cache writes, the RoPE tables, the
quantized matmuls; the engine asks the attention dispatcher) asks `runs_here(KERNEL)`, with the `CpuKernel` its
wrapper module declares. Asking in one place keeps the sites from disagreeing (one building the library while
another has decided it is off) and gives each fallback one log line with its reason.

`runs_here` is two facts:
  * the backend of the program being traced is CPU (`kernels_pallas.backend.target_backend()`). Asked on every
    call and never cached: inside `compiling_for("tpu")` (a deviceless compile on a CPU host) the same process
    traces for another chip, and a cached answer would put a CPU-only FFI call into a TPU program;
  * the kernel is usable in this process (`unavailable_reason(kernel) is None`): PAGEJAX_CPU_KERNELS is not "0",
    and the library builds, loads and registers the kernel's handler (`native/build.py`). Decided once per
    process per kernel (cached): a build is seconds of g++, and a kernel must not switch on or off between two
    traces of one program.

PAGEJAX_CPU_KERNELS=0 in the environment switches every automatic choice to the pure-JAX paths (A/B runs,
debugging a kernel, a machine whose compiler miscompiles). It is read once, on the first question, so set it
before the process starts tracing. It does not stop an explicit request: `impl="cpu"` or a direct call of a
wrapper (`ragged_paged_attention_cpu`, `int8_matmul_cpu`, ...) builds the kernel (`require`) and raises
`KernelBuildError` if it cannot, because a caller who names a kernel wants that kernel or an error, not a silent
substitute.

When the target is CPU and a kernel is unavailable, `runs_here` logs a WARNING with the reason, once per kernel
and process (logger `kernels_pallas.native.gate`): the pure-JAX paths are correct but slower, and a missing
compiler should not pass unnoticed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

from kernels_pallas.backend import target_backend
from kernels_pallas.native import build

ENV_SWITCH = "PAGEJAX_CPU_KERNELS"
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CpuKernel:
    """One C++ kernel of `csrc/`: the XLA FFI target its wrapper calls, the C symbol of its handler in the library,
    and the -D defines of the library build it comes from. Declared next to the wrapper; hashable, so the gate
    caches its decision per kernel."""

    target: str
    symbol: str
    defines: tuple[str, ...] = ()

    def portable(self) -> "CpuKernel":
        """The same kernel from a library built with PAGEJAX_PORTABLE (no ISA extensions beyond the baseline): what a
        CPU without AVX-512 runs. A separate FFI target, so tests can compare both paths in one process."""
        return CpuKernel(f"{self.target}_portable", self.symbol, (*self.defines, "PAGEJAX_PORTABLE"))


@functools.cache
def disabled_by_environment() -> bool:
    """Whether PAGEJAX_CPU_KERNELS=0 is set (read once per process, see the module docstring)."""
    return os.environ.get(ENV_SWITCH) == "0"


def require(kernel: CpuKernel) -> None:
    """Build the library and register `kernel` (once per process; `build.register` caches), raising
    `build.KernelBuildError` with the compiler's or loader's message. For explicit calls, which must not fall back;
    ignores PAGEJAX_CPU_KERNELS."""
    build.register(kernel.target, kernel.symbol, kernel.defines)


@functools.cache
def unavailable_reason(kernel: CpuKernel) -> str | None:
    """None when `kernel` may run in this process (not switched off, built and registered), else why not. Cached per
    kernel: the build is attempted at most once per process per kernel. Independent of the target backend."""
    if disabled_by_environment():
        return f"the C++ CPU kernels are disabled by {ENV_SWITCH}=0"
    try:
        require(kernel)
    except build.KernelBuildError as e:
        return str(e)
    return None


@functools.cache
def _log_fallback(kernel: CpuKernel, reason: str) -> None:
    log.warning("C++ CPU kernel %s does not run, its pure-JAX path does: %s", kernel.target, reason)


def runs_here(kernel: CpuKernel) -> bool:
    """Whether a call site takes `kernel`: the program is traced for CPU (asked per call, `compiling_for` may
    change it) and the kernel is usable in this process (`unavailable_reason`, cached). Off CPU the kernel is not
    built at all. On CPU without it, logs the reason once per kernel."""
    if target_backend() != "cpu":
        return False
    reason = unavailable_reason(kernel)
    if reason is not None:
        _log_fallback(kernel, reason)
    return reason is None
