"""What the real GPU compiler said about a deviceless compile: ptxas registers / spills per kernel and Triton's
shared memory, parsed from XLA's log (read by `scripts/tools/aot_compile.py` and the GPU kernel's tests).

XLA logs them only when the process starts with `TF_CPP_MIN_LOG_LEVEL=0` and `TF_CPP_VMODULE=` `LOG_VMODULE`
(read once, at startup); the log goes to the C++ stderr, which `capture_native_stderr` collects around a compile.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

LOG_VMODULE = "subprocess_compilation=2,xtile_compiler=2"

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"Shared memory usage: (\d+) B")


def parse_compile_log(text: str) -> dict:
    """{"kernels": {name: {arch, registers, spill_stores, spill_loads, stack_frame}}, "shared_memory": [bytes, ...]}.

    `kernels` has every function ptxas compiled (XLA's own fusions too; the last entry of a name wins);
    `shared_memory` is Triton's usage of each Triton kernel in log order (XLA does not name the kernel on that
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
    return {"kernels": kernels, "shared_memory": [int(m.group(1)) for m in _SHARED.finditer(text)]}


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


def capture_native_stderr():
    """`capture_native_fd(2)`: the C++ stderr, where XLA's GPU compiler logs ptxas's report."""
    return capture_native_fd(2)
