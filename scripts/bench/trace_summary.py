"""A profiler trace summarized by kernel name per step: the GPU report's view of where a step's time goes.

Its own module, without absl flags, so the summary can be tested (and reused) beside the launchers, whose flags share
one absl namespace with the benchmark's.
"""

from __future__ import annotations

import re

import numpy as np


def summarize_trace(planes, top: int = 10) -> dict:
    """Kernels by name per step from a profiler trace. GPU: kernel events on the device's stream lines, steps the
    most frequent program on its "XLA Modules" line. CPU (--smoke): XLA's thunk events on its threads, steps the
    most frequent jitted call on the python thread (the line named after the script). A step is preferably a
    program whose name says "step" (the runner's `packed_step`). Busy = the union of kernel intervals within a step."""
    device = [p for p in planes if p.name.startswith("/device:")]
    kernels, steps = [], []
    for plane in device or planes:
        for line in plane.lines:
            events = list(line.events)
            if device and line.name.startswith("Stream") or not device and line.name.startswith("tf_XLA"):
                kernels += [(e.name, e.start_ns, e.end_ns) for e in events
                            if not e.name.startswith("end: ") and "::" not in e.name]  # not runtime bookkeeping
            elif device and line.name == "XLA Modules" or not device and not line.name.startswith("tf_"):
                steps += [(e.name, e.start_ns, e.end_ns) for e in events if device or e.name.startswith("Pjit")]
    if not steps or not kernels:
        lines = sorted({f'{p.name}: {ln.name}' for p in planes for ln in p.lines})
        raise RuntimeError(f"no {'kernel' if steps else 'step'} events in the trace (lines: {lines})")
    names = [re.sub(r"\(\d+\)$", "", s[0]) for s in steps]
    step_name = max([n for n in set(names) if "step" in n.lower()] or set(names), key=names.count)
    starts, end = [], -1
    for _, a, b in sorted(s for s, n in zip(steps, names) if n == step_name):
        if a >= end:  # a call nested in the step's own event (CPU) is not another step
            starts.append(a)
            end = b
    bounds = list(zip(starts, starts[1:]))
    busy, per_kernel = [], {}
    for lo, hi in bounds:
        inside = sorted((max(a, lo), min(b, hi)) for _, a, b in kernels if a < hi and b > lo)
        total, end = 0, lo
        for a, b in inside:
            total += max(0, b - max(a, end))
            end = max(end, b)
        busy.append(total)
    for name, a, b in kernels:
        if bounds and bounds[0][0] <= a < bounds[-1][1]:
            kind = re.sub(r"[._]\d+$", "", name)
            per_kernel[kind] = per_kernel.get(kind, 0) + (b - a)
    n = max(len(bounds), 1)
    spacing = [hi - lo for lo, hi in bounds]
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {"step": step_name, "steps": len(bounds),
            "spacing_ms_median": float(np.median(spacing)) / 1e6 if spacing else None,
            "busy_ms_median": float(np.median(busy)) / 1e6 if busy else None,
            "busy_fraction": float(np.sum(busy) / np.sum(spacing)) if spacing else None,
            "top_kernels": [{"name": k, "ms_per_step": v / n / 1e6} for k, v in ranked]}
