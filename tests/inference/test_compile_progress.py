"""CompileProgress (inference/runtime/compile_progress.py) on JAX's own monitoring events: a cache lookup that turns
into a compile is announced, once, with a line per compiled step; a lookup the cache answers prints nothing."""

from __future__ import annotations

import time

from jax import monitoring

from inference.runtime import compile_progress as cp


def test_announces_compiles_and_stays_quiet_on_cache_hits():
    lines: list[str] = []
    with cp.CompileProgress("m", lines.append, announce_after_s=0.05):
        monitoring.record_event(cp._LOOKUP)
        monitoring.record_event(cp._HIT)  # answered by the cache in time: nothing to say
        time.sleep(0.2)
        assert lines == []
        monitoring.record_event(cp._LOOKUP)
        time.sleep(0.2)  # still compiling after announce_after_s: the headline
        assert len(lines) == 1 and lines[0].startswith("compiling decode steps for m, ")
        monitoring.record_event_duration_secs(cp._COMPILED, 3.0, fun_name="_step")
        monitoring.record_event_duration_secs(cp._COMPILED, 0.01, fun_name="_lambda")  # a helper jit: not counted
        monitoring.record_event_duration_secs(cp._COMPILED, 2.0, fun_name="_step")
    monitoring.record_event_duration_secs(cp._COMPILED, 5.0, fun_name="_step")  # after exit: not listened to
    assert [line.split(" (")[0] for line in lines[1:]] == ["  compiled 1 step", "  compiled 2 steps"]
    assert "(5 s of compiling" in lines[2]
