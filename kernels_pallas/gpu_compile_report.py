"""What the real GPU compiler said about a deviceless compile: ptxas registers / spills per kernel and the shared
memory of each Triton or Mosaic GPU kernel, parsed from the compilers' logs (read by `scripts/tools/aot_compile.py`,
the one deviceless-compile harness, and the GPU kernel's tests).

XLA logs the Triton side only when the process starts with `TF_CPP_MIN_LOG_LEVEL=0` and `TF_CPP_VMODULE=`
`LOG_VMODULE` (read once, at startup), to the C++ stderr; Mosaic GPU prints ptxas's report and its resources to
the C++ stdout when `MOSAIC_GPU_ENV` is set. `capture_compiler_logs` collects both around a compile.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

LOG_VMODULE = "subprocess_compilation=2,xtile_compiler=2"
MOSAIC_GPU_ENV = {"MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_RESOURCES": "1"}  # jax 0.10 has no resources dump

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"Shared memory usage: (\d+) B|smem_scratch_bytes=(\d+)")  # Triton's | Mosaic GPU's


def parse_compile_log(text: str) -> dict:
    """{"kernels": {name: {arch, registers, spill_stores, spill_loads, stack_frame}}, "shared_memory": [bytes, ...]}.

    `kernels` has every function ptxas compiled (XLA's own fusions too; the last entry of a name wins);
    `shared_memory` is the usage of each Triton or Mosaic GPU kernel in log order (neither names the kernel on that
    line; a compile of one `pallas_call` has one)."""
    kernels, name = {}, None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name = m.group(1)
            kernels[name] = {"arch": m.group(2)}
        elif name and (m := _SPILLS.search(line)):
            kernels[name].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                 spill_loads=int(m.group(3)))
        elif name and (m := _REGS.search(line)):
            kernels[name]["registers"] = int(m.group(1))
    return {"kernels": kernels, "shared_memory": [int(m.group(1) or m.group(2)) for m in _SHARED.finditer(text)]}


@contextlib.contextmanager
def capture_native_fd(fd: int = 2):
    """Collect what native code writes to file descriptor `fd` (2: stderr, where ptxas's report goes; 1: stdout,
    where Mosaic GPU's dumps go) inside the block; yields a list that holds the text once the block exits (Python's
    own stream on that descriptor is flushed into it too)."""
    stream = sys.stderr if fd == 2 else sys.stdout
    out: list[str] = []
    stream.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield out
        finally:
            stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


@contextlib.contextmanager
def capture_compiler_logs():
    """The C++ stderr (XLA's ptxas report) and stdout (Mosaic GPU's) inside the block, as one list of texts."""
    with capture_native_fd(2) as err, capture_native_fd(1) as out:
        logs: list[str] = []
        yield logs
    logs += err + out
