"""Host-side timers for the overhead benchmark (scripts/bench/overhead_bench.py): exclusive wall time per phase of
the engine's own functions, and the time spent in Python's cyclic garbage collector.

Why a module of their own: the benchmark loads them from its own folder by path (`overhead_bench.load_sibling`), so
a side-by-side run's baseline tree, first on the path, times its engine with the same timers.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable

_MISSING = object()


class GcTimer:
    """Wall time spent inside Python's cyclic garbage collector, per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self.max_ms = 0.0  # the longest single pause
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._t0) * 1e3
            self.ms[info["generation"]] += ms
            self.count[info["generation"]] += 1
            self.max_ms = max(self.max_ms, ms)

    def snapshot(self) -> tuple[list[float], list[int]]:
        return list(self.ms), list(self.count)


class PhaseProfiler:
    """Exclusive wall time per phase: wrapped calls nest, and a phase's time excludes its wrapped callees'."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)
        self._children: list[float] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._children.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.totals[phase] += dt - self._children.pop()
                if self._children:
                    self._children[-1] += dt
        return timed

    def patch(self, owner: Any, name: str, phase: str) -> None:
        """Replace `owner.name` (an instance's, a class's or a module's attribute) by its timed wrapper."""
        saved = vars(owner).get(name, _MISSING)  # an instance's methods live on its class: restore by deleting
        setattr(owner, name, self.wrap(phase, getattr(owner, name)))
        self._undo.append((owner, name, saved))

    def restore(self) -> None:
        for owner, name, saved in reversed(self._undo):
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        self._undo.clear()
