"""The one switch for the C++ CPU kernels: whether a call site takes a kernel or its pure-JAX path.

Every site that can run a C++ kernel (attention's `impl="auto"`, the KV-cache writes, the RoPE tables, the
quantized matmuls; the engine asks the attention dispatcher) asks `runs_here(KERNEL)`, with the `CpuKernel` its
wrapper module declares. Asking in one place keeps the sites from disagreeing (one building the library while
another has decided it is off) and gives each fallback one log line with its reason.

`runs_here` is three facts:
  * the backend of the program being traced is CPU (`kernels_pallas.backend.target_backend()`). Asked on every
    call and never cached: inside `compiling_for("tpu")` (a deviceless compile on a CPU host) the same process
    traces for another chip, and a cached answer would put a CPU-only FFI call into a TPU program;
  * the kernel is usable in this process (`unavailable_reason(kernel) is None`): PAGEJAX_CPU_KERNELS is not "0",
    and the library builds, loads and registers the kernel's handler (`native/build.py`). Decided once per
    process per kernel (cached): a build is seconds of g++, and a kernel must not switch on or off between two
    traces of one program;
  * the kernel was measured faster than its pure-JAX path on this CPU's ISA (`host_isa`), or was not measured there:
    `MEASURED`, a table from `scripts/bench/cpu_kernel_gate.py` recorded in BENCHMARKS.md ("C++ CPU kernels per
    ISA"). A kernel that builds is not therefore faster: on AVX2 the int8 matmul's portable loop was slower than
    XLA's int8 dot, and the gate took it anyway. For a matmul the answer can depend on its rows (M): the table can
    name the rows (`Rows`) it was faster at, and the call site passes its row count (`runs_here(KERNEL, rows=M)`),
    so a decode step takes the kernel and a prefill chunk XLA's dot where that is what was measured. A kernel's own
    `CpuKernel.rows` bounds the rows it serves on every ISA.

PAGEJAX_CPU_KERNELS=0 in the environment switches every automatic choice to the pure-JAX paths (A/B runs,
debugging a kernel, a machine whose compiler miscompiles). It is read once, on the first question, so set it
before the process starts tracing. It does not stop an explicit request: `impl="cpu"` or a direct call of a
wrapper (`ragged_paged_attention_cpu`, `int8_matmul_cpu`, ...) builds the kernel (`require`) and raises
`KernelBuildError` if it cannot, because a caller who names a kernel wants that kernel or an error, not a silent
substitute.

When the target is CPU, `runs_here` logs its choice once per kernel and process (logger `kernels_pallas.native.gate`):
INFO for the path taken by the table (kernel or pure JAX, with the ISA and why), a WARNING when the kernel is
unavailable: the pure-JAX paths are correct but slower, and a missing compiler should not pass unnoticed. `choices`
gives the same decisions as data (the benchmarks print them).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import platform

from kernels_pallas.backend import target_backend
from kernels_pallas.native import build

ENV_SWITCH = "PAGEJAX_CPU_KERNELS"
log = logging.getLogger(__name__)


#: The library builds a wrapper can name, each (its -D defines, its -march): "native" (what the gate runs),
#: "portable" (the scalar loops), "avx2" (the AVX2 + FMA paths, which tests run on AVX-512 machines too),
#: "avx_vnni" (AVX2 with AVX-VNNI and no AVX-512, as on Intel's client CPUs since Alder Lake: the int8 dot's
#: 256-bit vpdpbusd, which tests run wherever the CPU has AVX-VNNI), "no_amx" (native without the int8 matmul's AMX
#: tiles: its AVX-512 VNNI loops, which tests run on AMX machines too).
_BUILD_FLAGS = {"native": ((), "native"), "portable": (("PAGEJAX_PORTABLE",), "native"), "avx2": ((), "x86-64-v3"),
                "avx_vnni": ((), "alderlake"), "no_amx": (("PAGEJAX_NO_AMX",), "native")}
BUILDS = tuple(_BUILD_FLAGS)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A range of row counts (a matmul's M), both ends included; `hi=None` is unbounded."""

    lo: int = 1
    hi: int | None = None

    def __post_init__(self):
        if self.lo < 0 or (self.hi is not None and self.hi < self.lo - 1):
            raise ValueError(f"Rows({self.lo}, {self.hi}): expected 0 <= lo and lo - 1 <= hi (hi = lo - 1: empty)")

    def __contains__(self, rows: int) -> bool:
        return rows >= self.lo and (self.hi is None or rows <= self.hi)

    def __and__(self, other: "Rows") -> "Rows":
        his = [h for h in (self.hi, other.hi) if h is not None]
        lo, hi = max(self.lo, other.lo), min(his) if his else None
        return Rows(lo, lo - 1) if hi is not None and hi < lo else Rows(lo, hi)  # lo - 1: empty

    def __str__(self) -> str:
        if self.hi is None:
            return "any rows" if self.lo <= 1 else f"{self.lo}+ rows"
        return f"{self.lo}-{self.hi} rows"


ANY_ROWS = Rows()


@dataclasses.dataclass(frozen=True)
class CpuKernel:
    """One C++ kernel of `csrc/`: the XLA FFI target its wrapper calls, the C symbol of its handler in the library,
    and the -D defines and -march of the library build it comes from. Declared next to the wrapper; hashable, so the
    gate caches its decision per kernel. `rows`: the row counts a matmul kernel serves on every ISA (a call site with
    other rows takes its pure-JAX path); `MEASURED` may narrow them per ISA."""

    target: str
    symbol: str
    defines: tuple[str, ...] = ()
    march: str = "native"
    rows: Rows = ANY_ROWS

    def build(self, name: str) -> "CpuKernel":
        """The kernel from library build `name` (one of BUILDS), each its own FFI target."""
        if name not in BUILDS:
            raise ValueError(f"unknown kernel build {name!r}; expected one of {BUILDS}")
        if name == "native":
            return self
        defines, march = _BUILD_FLAGS[name]
        return dataclasses.replace(self, target=f"{self.target}_{name}", defines=(*self.defines, *defines),
                                   march=march)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _amx_granted() -> bool:
    """Whether Linux hands this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+), as the
    int8 kernel asks before it uses the tiles (csrc/int8_amx.h): kernels from 5.9 list the CPU's AMX flags but refuse
    it, and the kernel then runs its VNNI loops, which this ISA's `MEASURED` row does not describe."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


@functools.cache
def host_isa() -> str:
    """The vector ISA the native build targets on this CPU, as `MEASURED` names it: "avx512-amx" (AVX-512 VNNI and
    AMX-INT8 tiles), "avx512-vnni", "avx512", "avx2" (with FMA), "neon-dotprod" (ARMv8.2 sdot), "neon", or
    "baseline"."""
    flags, machine = _cpu_flags(), platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon-dotprod" if "asimddp" in flags or machine == "arm64" else "neon"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512-amx" if {"amx_tile", "amx_int8"} <= flags and _amx_granted() else "avx512-vnni"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "baseline"


#: Kernels that stay off on an ISA where they were not measured (the others run where they build): the few-rows
#: float32 matmul replaces XLA's dot in every small-batch float32 decode step and rounds differently, so a CPU it was
#: not measured on keeps XLA's dot, and its results, as before.
OFF_WHERE_NOT_MEASURED = frozenset({"pagejax_few_rows_matmul_cpu"})

#: Whether each kernel (its FFI target) beat its pure-JAX path on an ISA, measured by scripts/bench/
#: cpu_kernel_gate.py at SmolLM2-135M's shapes (BENCHMARKS.md, "C++ CPU kernels per ISA", which names the CPUs):
#: True (at every row count measured), False, or the `Rows` of a matmul where it was faster (XLA's dot elsewhere; the
#: int8 matmul's results are the same bits either way). A kernel missing from an ISA's row was not measured there
#: and runs where it builds (unless OFF_WHERE_NOT_MEASURED).
MEASURED: dict[str, dict[str, bool | Rows]] = {
    # A 2-core Intel Xeon with AVX-512 VNNI (issue 38, round 7): the W8A8 kernel beats XLA's int8 dot at 1 row
    # (2.1x), ties it at 4-16 and loses from 32 (0.76x; batch-32 decode 1.06-1.12x faster end to end on XLA's dot);
    # the few-rows float32 matmul beats XLA's dot at 1-4 rows, not at 8. The rest beat XLA at 1 and 32 rows.
    "avx512-vnni": {"pagejax_ragged_paged_attention_cpu": True, "pagejax_int8_matmul_cpu": Rows(1, 8),
                    "pagejax_grouped_matmul_cpu": True, "pagejax_write_rows_cpu": True,
                    "pagejax_rope_tables_cpu": True, "pagejax_few_rows_matmul_cpu": Rows(1, 4)},
    # The same Xeon with the W8A8 kernel's AMX tiles (issue 38, round 8): it beats XLA's int8 dot from 1 to 32 rows
    # (1.15x at 16 and 32), ties at 64 and loses at 128; the VNNI row above was measured with the tiles left out.
    "avx512-amx": {"pagejax_ragged_paged_attention_cpu": True, "pagejax_int8_matmul_cpu": Rows(1, 32),
                   "pagejax_grouped_matmul_cpu": True, "pagejax_write_rows_cpu": True,
                   "pagejax_rope_tables_cpu": True, "pagejax_few_rows_matmul_cpu": Rows(1, 4)},
    # An AVX2 EPYC (BENCHMARKS.md): the int8 matmul's AVX2 path, the attention kernel (f32, int8 and fp8 caches), the
    # KV write and the RoPE tables beat XLA at 1 and 32 rows; the grouped matmul's vector path beats XLA's dot of the
    # dequantized weight at 1 row but not at 32.
    # The few-rows float32 matmul beats XLA's dot at 2-8 rows, not at 1 (issue 38, round 6). A CPU with AVX-VNNI and
    # no AVX-512 (Intel's client CPUs) takes this row too; its W8A8 dot is twice this row's (round 9).
    "avx2": {"pagejax_ragged_paged_attention_cpu": True, "pagejax_int8_matmul_cpu": True,
             "pagejax_grouped_matmul_cpu": False, "pagejax_write_rows_cpu": True, "pagejax_rope_tables_cpu": True,
             "pagejax_few_rows_matmul_cpu": Rows(2, 8)},
}


@functools.cache
def disabled_by_environment() -> bool:
    """Whether PAGEJAX_CPU_KERNELS=0 is set (read once per process, see the module docstring)."""
    return os.environ.get(ENV_SWITCH) == "0"


def require(kernel: CpuKernel) -> None:
    """Build the library and register `kernel` (once per process; `build.register` caches), raising
    `build.KernelBuildError` with the compiler's or loader's message. For explicit calls, which must not fall back;
    ignores PAGEJAX_CPU_KERNELS."""
    build.register(kernel.target, kernel.symbol, kernel.defines, kernel.march)


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


def measured_choice(kernel: CpuKernel, isa: str) -> tuple[Rows | None, str]:
    """(the rows at which `kernel` should run on `isa` by the `MEASURED` table, None for none; why)."""
    faster = MEASURED.get(isa, {}).get(kernel.target)
    if faster is None and kernel.target in OFF_WHERE_NOT_MEASURED:
        return None, f"not measured on {isa}: off there (it would change float32 results unmeasured)"
    if faster is None:
        return kernel.rows, f"not measured on {isa}: runs where it builds"
    if faster is False:
        return None, f"measured slower than its pure-JAX path on {isa} (BENCHMARKS.md)"
    if faster is True:
        return kernel.rows, f"measured faster than its pure-JAX path on {isa} (BENCHMARKS.md)"
    rows = kernel.rows & faster
    if rows.hi is not None and rows.lo > rows.hi:
        return None, f"measured faster on {isa} only at {faster}, none of the {kernel.rows} it serves"
    return rows, (f"measured faster than its pure-JAX path on {isa} at {faster} (BENCHMARKS.md); its pure-JAX path "
                  f"at other row counts")


@functools.cache
def choice(kernel: CpuKernel) -> tuple[Rows | None, str]:
    """(the rows at which CPU call sites take `kernel` in this process, None for none; why), logged once: the build
    (`unavailable_reason`) and then the measured table for this CPU's ISA."""
    reason = unavailable_reason(kernel)
    if reason is not None:
        log.warning("C++ CPU kernel %s does not run, its pure-JAX path does: %s", kernel.target, reason)
        rows, why = None, reason
    else:
        rows, why = measured_choice(kernel, host_isa())
        said = "does not run (pure JAX does)" if rows is None else "runs" if rows == ANY_ROWS else f"runs for {rows}"
        log.info("C++ CPU kernel %s %s: %s", kernel.target, said, why)
    _DECISIONS[kernel.target] = {"runs": rows is not None, "rows": None if rows is None else str(rows), "why": why}
    return rows, why


def choices() -> dict[str, object]:
    """This CPU's ISA and the decisions `choice` took so far in this process, by FFI target ({"runs", "rows",
    "why"}): for a benchmark's JSON, which paths a run took."""
    return {"isa": host_isa(), "kernels": dict(_DECISIONS)}


_DECISIONS: dict[str, dict[str, object]] = {}  # what `choice` decided, by target (each written once: it is cached)


def runs_here(kernel: CpuKernel, rows: int | None = None) -> bool:
    """Whether a call site takes `kernel`: the program is traced for CPU (asked per call, `compiling_for` may
    change it) and `choice(kernel)` (cached: built, and not measured slower on this ISA), at `rows` rows where the
    call site is a matmul (None: at some row count). Off CPU the kernel is not built at all."""
    if target_backend() != "cpu":
        return False
    served, _ = choice(kernel)
    return served is not None and (rows is None or rows in served)
