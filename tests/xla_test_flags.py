"""The XLA flags of the test processes: XLA:CPU compiles at LLVM's -O0.

Most of the suite's time is XLA:CPU compiling small programs (each tiny model's step variants, once per engine
configuration), and LLVM's optimization passes are most of such a compile; the programs then run on a few tokens.
At -O0 they compile in about two thirds of the time, and the SmolLM2 tests, which run real work, take about as long
(BENCHMARKS.md, "CI time"). The level changes no result beyond float rounding, which the tests' tolerances allow;
where a test compares bits, both sides are compiled alike. Users' programs keep XLA's default level: the benchmarks run
without these flags.

The deviceless TPU and GPU compiles (`scripts/tools/aot_compile.py`, run in child processes) check what the real
compilers produce (registers, spills, memory), so they must see a user's flags: `accelerator_env` drops these.
"""

from __future__ import annotations

import os

FLAGS = ("--xla_backend_optimization_level=0",)


def with_test_flags(flags: str = "") -> str:
    """`flags` plus the test flags that `flags` does not already set (a caller's own level wins)."""
    extra = [f for f in FLAGS if f.split("=")[0] not in flags]
    return " ".join([flags.strip(), *extra]).strip()


def cpu_env(**extra: str) -> dict[str, str]:
    """os.environ for a child process that runs on CPU: the test flags added to `extra`'s XLA_FLAGS (or the
    current one)."""
    flags = extra.pop("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "JAX_PLATFORMS": "cpu", **extra, "XLA_FLAGS": with_test_flags(flags)}


def accelerator_env(**extra: str) -> dict[str, str]:
    """os.environ for a child process that compiles for a TPU or GPU: without the test flags."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FLAGS)
    return {**os.environ, **extra, "XLA_FLAGS": flags}
