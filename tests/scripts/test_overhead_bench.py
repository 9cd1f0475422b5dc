"""The overhead benchmark's garbage-collector timer counts what the collector does."""

import gc

from scripts.bench.overhead_bench import GcTimer


def test_gc_timer_counts_each_generation():
    timer = GcTimer()
    gc.callbacks.append(timer)
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        gc.callbacks.remove(timer)
    assert timer.count[2] >= 1 and timer.count[0] >= 1  # automatic collections may add to these
    assert timer.ms[2] > 0.0
    ms, count = timer.snapshot()
    count[0] += 5  # a snapshot is a copy
    assert timer.count[0] == count[0] - 5
