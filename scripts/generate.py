"""Batch generation from the command line: JSONL in, JSONL out, resumable.

    python scripts/generate.py                                   # a few built-in questions, printed readably
    python scripts/generate.py --prompt="Once upon a time" --max_tokens=32
    python scripts/generate.py --input=rows.jsonl --output=out.jsonl --temperature=0.7 --seed=1 --num_samples=4
    python scripts/generate.py --input=rows.jsonl --output=out.jsonl --data_parallel_size=2 --tensor_parallel_size=4
    python scripts/generate.py --lora=sql=/path/to/adapter --prompt="SELECT" --prompt_lora=sql  # rows: "lora": "sql"

Several processes (hosts), each started with the same flags plus its own --process_id (or the PAGEJAX_* variables,
see sharding/distributed.py):

    python scripts/generate.py --input=rows.jsonl --output=out.jsonl --num_processes=2 --process_id=0 \\
        --coordinator_address=10.0.0.1:8476     # and =1 on the other host

Each process takes every num_processes-th row (grain's per-process sharding), writes its results to
`out.jsonl.process-0000i-of-0000n` and, once all are done, process 0 appends them to --output in input order.
The output path must be on a filesystem every process sees.

Input rows: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [{"role": ..., "content": ...}, ...]}, with an
optional per-row "max_tokens", "json_schema" (a JSON Schema the row's completions must match; --json_schema=FILE
sets one for every row) and sampling parameters of its own over the flags' ("temperature", "top_p", "top_k",
"seed", "stop", "n", the penalties...: jsonl_io.ROW_SAMPLING_FIELDS); a null one is no value of its own, as
in the OpenAI API. Other keys are not read.
Rows stream through the engine: at most --max_in_flight requests are queued at once,
refilled as requests finish, and each finished row is written (and flushed) at once, so the output is in finish
order, not input order, and one slow request holds back nobody else. Rows are fsynced every --fsync_every rows or
--fsync_seconds seconds; a rerun with the same --output skips ids already there, whatever their order, so an
interrupted job loses nothing and duplicates nothing (Ctrl-C says how many rows are saved and exits with 130).
With --seed, --seed_mode=per_row (default) seeds each row with the seed plus a stable hash of its id, so identical
prompts still get different samples and a rerun reproduces them; --seed_mode=shared gives every row the seed.
Without --output, --input results go to stdout as JSONL, and --prompt / built-in results are printed as Q/A text.
The logic lives in `inference.tools.jsonl_io`.

The first run compiles the model's steps (tens of seconds on CPU) and says so, with a line per compiled step; they
are cached (--compilation_cache_dir) so later runs start at once. Presets without shipped weights (tiny-*, the
real-size configs) are random-weight test models with no tokenizer: they cannot run text rows, and are refused.
A usage error prints one line (exit 2); --help prints this text and the flags (exit 0). A job that ran to its end
exits 0 when every row of its input has a result and 3 when some have error rows, written by this run or an earlier
one (a bad row, a prompt too long for the context: each has its "error"); bad input that stops the job before it
starts (an unreadable input or output file, a duplicate id) exits 1 with the file and line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grain
from absl import app, flags
from tqdm.auto import tqdm

from inference import SamplingParams
from inference.tools import jsonl_io

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root, for `scripts`
# The engine flags (model, cache, parallelism, quantization) and the engine built from them, shared with serve.py.
from scripts.engine_flags import MODEL as _MODEL, build_llm, lora_requests  # noqa: E402

FLAGS = flags.FLAGS

BUILTIN_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
                     "Name a primary color."]

_INPUT = flags.DEFINE_string("input", None, "JSONL file of rows with an id and a prompt or messages.")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "A prompt (repeatable); used instead of --input.")
_PROMPT_LORA = flags.DEFINE_string("prompt_lora", None, "Run every --prompt with this --lora adapter (by its NAME); "
                                   "--input rows name theirs in a 'lora' field.")
_CHAT = flags.DEFINE_bool("chat", False, "Send each --prompt as a user message through the chat template.")
_OUTPUT = flags.DEFINE_string("output", None, "JSONL file to append results to (resumable); default stdout.")
_MAX_IN_FLIGHT = flags.DEFINE_integer("max_in_flight", 64, "Most rows queued in the engine at once (refilled as "
                                     "rows finish); bounds memory, not speed, once above --max_num_seqs.",
                                     lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Deprecated alias of --max_in_flight (rows no longer run in "
                                   "lockstep batches).", lower_bound=1)
_RETRY_FAILED = flags.DEFINE_bool("retry_failed", False, "Resuming: run again the rows whose results in --output are "
                                  "error rows (those rows are removed from it first); by default a rerun skips them.")
_FSYNC_EVERY = flags.DEFINE_integer("fsync_every", 64, "fsync the output after this many rows (each row is flushed "
                                    "at once regardless).", lower_bound=1)
_FSYNC_SECONDS = flags.DEFINE_float("fsync_seconds", 5.0, "fsync the output at least this often while rows arrive.",
                                    lower_bound=0.0)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 256, "Most tokens generated per completion.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
_MIN_P = flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p times the top probability (0 = off).")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed (same seed, same samples); see --seed_mode.")
_SEED_MODE = flags.DEFINE_enum("seed_mode", "per_row", ["per_row", "shared"],
                               "per_row: each row gets --seed plus a stable hash of its id; shared: every row --seed.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Completions per prompt (vLLM's n).")
_STOP = flags.DEFINE_multi_string("stop", None, "Stop string (repeatable).")
_LOGPROBS = flags.DEFINE_integer("logprobs", None, "Return this many top logprobs per generated token.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Keep generating past the EOS token.")
_JSON_SCHEMA = flags.DEFINE_string("json_schema", None, "JSON Schema file every completion must match (structured "
                                   "outputs; a row's own 'json_schema' replaces it).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 for a multi-process job (jax.distributed).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in a multi-process job.")
_DIST_AUTO = flags.DEFINE_bool("distributed_auto", None,
                               "Let JAX detect the cluster (TPU pod, SLURM, Open MPI) instead of the three flags.")


def sampling_params() -> SamplingParams:
    """Built before the model loads, so a bad flag costs no load time."""
    try:
        structured = None
        if _JSON_SCHEMA.value:
            from inference.structured.params import StructuredOutputsParams
            with open(_JSON_SCHEMA.value, encoding="utf-8") as f:
                structured = StructuredOutputsParams(json=f.read())
        return SamplingParams(n=_NUM_SAMPLES.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                              top_k=_TOP_K.value, min_p=_MIN_P.value, seed=_SEED.value, max_tokens=_MAX_TOKENS.value,
                              stop=_STOP.value, ignore_eos=_IGNORE_EOS.value, logprobs=_LOGPROBS.value,
                              structured_outputs=structured)
    except OSError as e:
        sys.exit(f"error: cannot read --json_schema: {e}")
    except ValueError as e:
        usage_error(f"bad sampling flags: {e}")


def input_rows() -> list[dict[str, Any]]:
    """Rows from --input, else --prompt, else the built-in questions (asked as chat: the default model is Instruct)."""
    if _INPUT.value and _PROMPT.value:
        raise app.UsageError("pass --input or --prompt, not both")
    if _PROMPT_LORA.value is not None and not _PROMPT.value:
        raise app.UsageError("--prompt_lora applies to --prompt rows; --input rows name their adapter in a 'lora' "
                             "field")
    if _INPUT.value:
        return jsonl_io.read_input(_INPUT.value)
    if _PROMPT.value:
        key = "messages" if _CHAT.value else "prompt"
        texts = _PROMPT.value
    else:
        key, texts = "messages", BUILTIN_QUESTIONS
    as_value = (lambda t: [{"role": "user", "content": t}]) if key == "messages" else (lambda t: t)
    lora = {}
    if _PROMPT_LORA.value is not None:
        if _PROMPT_LORA.value not in lora_requests():
            raise app.UsageError(f"--prompt_lora={_PROMPT_LORA.value!r} is not the NAME of a --lora NAME=PATH flag "
                                 f"(given: {sorted(lora_requests())})")
        lora = {"lora": _PROMPT_LORA.value}  # each row then picks it as a JSONL row's 'lora' field would
    return [{"id": i, key: as_value(t), **lora} for i, t in enumerate(texts)]


def check_model_can_run(rows: list[dict[str, Any]]) -> None:
    """Refuse up front a random-weight preset (no tokenizer) given text rows, instead of failing every row; warn
    that such a model's output is noise. Cheap: reads the preset table, loads nothing."""
    from configs.presets import is_random_weight_preset

    if not is_random_weight_preset(_MODEL.value):
        return
    print(f"warning: {_MODEL.value} is a random-weight test model (no shipped weights): its output is noise",
          file=sys.stderr)
    kinds = sorted({key for row in rows for key in ("messages", "prompt") if key in row})
    if kinds:
        raise ValueError(f"{_MODEL.value} is a random-weight test model with no tokenizer, so it cannot run "
                         f"{' or '.join(repr(k) for k in kinds)} rows; use --model=smollm2-135m (the default), a "
                         ".gguf file or a model folder with a tokenizer")


def stop_together(name: str, error: Exception | None) -> None:
    """Every process of a job passes here with its own outcome so far; if any failed, all exit here (a failed one
    with its own error, the others naming it) instead of the others waiting at a later barrier for a process that
    has gone. A ValueError or OSError (bad input, an unwritable file) exits with its one line; anything else, an
    engine failure, keeps its traceback. In a single process only `error` counts."""
    from sharding import distributed

    failed = distributed.failed_processes(name, error is None)
    if failed:
        distributed.shutdown()  # every process is here and knows: they leave the job together
    if isinstance(error, (ValueError, OSError)):
        sys.exit(f"error: {error}")
    if error is not None:
        raise error
    if failed:
        sys.exit(f"error: process{'es' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of this job "
                 "stopped with an error (see its output), so this one stops too; a rerun of the same command "
                 "resumes after the rows already written")


def repaired_output_ids(index: int) -> dict:
    """Process 0's (or the single process's) reading of --output: its ids, each with whether its row is an error
    row, after repairing a crash's cut-short last line (`load_done_ids` rewrites the file, so only process 0 may).
    The other processes read it in `resumed_ids`, once every process is past that repair."""
    return jsonl_io.load_done_ids(_OUTPUT.value, _RETRY_FAILED.value) if _OUTPUT.value and index == 0 else {}


def resumed_ids(index: int, shard: str | None, repaired: dict) -> dict:
    """Ids a rerun skips: those in --output (`repaired`, process 0's reading of it) and in a multi-process job also
    those in this process's own shard."""
    if shard is None:
        return repaired
    done = repaired if index == 0 else jsonl_io.load_done_ids(_OUTPUT.value)
    return done | jsonl_io.load_done_ids(shard, _RETRY_FAILED.value)


def finish_job(index: int, count: int, input_ids: list, error: Exception | None) -> None:
    """The end of a multi-process job: once every shard is complete and fsynced, process 0 merges them into
    --output. A process that failed while generating raises its own error here and the others exit naming it; the
    shards keep every row written, so a rerun resumes after them."""
    from sharding import distributed

    stop_together("pagejax-generate-done", error)
    merge_error = None
    if index == 0:
        try:
            merged = jsonl_io.merge_shards(_OUTPUT.value, [jsonl_io.shard_path(_OUTPUT.value, i, count)
                                                           for i in range(count)], input_ids)
            print(f"merged {merged} rows from {count} process shards into {_OUTPUT.value}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 -- the others wait for it at the next barrier
            merge_error = e
    stop_together("pagejax-merged", merge_error)
    distributed.shutdown()


Rendered = tuple[dict, str | None, SamplingParams | None, Any, str | None]  # row, text, params, LoRARequest, error


def stream_rows(llm: Any, rendered: Iterable[Rendered], max_in_flight: int,
                with_logprobs: bool) -> Iterator[dict[str, Any]]:
    """Output rows one at a time, as their requests finish.

    At most `max_in_flight` requests are in the engine at once: the window is refilled before every step, so the
    engine always has work queued behind its running batch while the rows not yet admitted cost nothing. Rows that
    failed to render, or that the engine rejects, come out at once as error rows. The engine is stepped here, in
    this thread, so a KeyboardInterrupt lands between steps or inside one and leaves no thread behind.
    """
    source = iter(rendered)
    in_flight: dict[str, dict] = {}
    exhausted = False
    while True:
        while not exhausted and len(in_flight) < max_in_flight:
            item = next(source, None)
            if item is None:
                exhausted = True
                break
            row, text, params, lora, error = item
            if error is not None:
                yield jsonl_io.error_row(row, error)
                continue
            [submitted] = llm.submit([text], params, lora_request=lora)  # queued, or its error output
            if submitted.error is not None:
                yield jsonl_io.result_row(row, submitted.error, with_logprobs)
            else:
                in_flight[submitted.request_id] = row
        if not in_flight:
            if exhausted:
                return
            continue
        finished = [out for out in llm.engine.step() if out.finished and out.request_id in in_flight]
        if not llm.engine.has_unfinished_requests():  # aborted meanwhile: no step reports them
            seen = {out.request_id for out in finished}
            finished += [llm.engine.output_of(rid) for rid in in_flight if rid not in seen]
        for out in finished:
            row = in_flight.pop(out.request_id)
            llm.engine.pop_finished(out.request_id)
            yield jsonl_io.result_row(row, out, with_logprobs)


def params_for_row(params: SamplingParams) -> Callable[[dict], SamplingParams]:
    """The row's sampling params (`jsonl_io.row_params`: its own max_tokens, temperature, ...) and, with
    --seed_mode=per_row and no seed of its own, the job's seed mixed with its id."""
    per_row_seed = params.seed is not None and _SEED_MODE.value == "per_row"

    def of(row: dict) -> SamplingParams:
        p = jsonl_io.row_params(row, params)
        own_seed = row.get("seed") is not None  # null: no seed of its own (jsonl_io.row_params)
        return p.replace(seed=jsonl_io.row_seed(params.seed, row["id"])) if per_row_seed and not own_seed else p
    return of


def print_readable(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        question = row["prompt"] if "prompt" in row else row["messages"][-1]["content"]
        answers = [f"[error] {row['error']}"] if "error" in row else [o["text"].strip() for o in row["outputs"]]
        tqdm.write(f"Q: {question}\n" + "\n".join(f"A: {a}" for a in answers) + "\n", file=sys.stdout)


@dataclasses.dataclass
class _Saved:
    """What an interrupt reports: where rows go and how many are there (including a previous run's)."""
    path: str | None = None
    rows: int = 0


HELP_FLAGS = ("-h", "-?", "--help", "-help", "--helpshort", "--helpfull")
EXIT_ROWS_FAILED = 3  # the job ran to its end, and some rows got error rows


def usage_error(message: str) -> None:
    """One line and a pointer to --help, exit 2 (the usual code for bad usage), instead of absl's pages of help."""
    print(f"error: {message}\nrun with --help for the flags", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing with --help on stdout and exit 0, a bad flag as one line and exit 2, and absl / JAX
    INFO logging off unless --verbosity asks for it (JAX logs at INFO that it found no TPU, which reads like an
    error on a machine that has none)."""
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        module = sys.modules[__name__]
        full = "--helpfull" in argv[1:]
        print(f"{module.__doc__}\nflags:\n{FLAGS.get_help() if full else FLAGS.module_help(module)}")
        sys.exit(0)
    try:
        rest = FLAGS(list(argv))
    except flags.Error as e:
        usage_error(str(e))
    if not FLAGS["verbosity"].present:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger("jax").setLevel(logging.WARNING)
    return rest


def main(argv: Sequence[str]) -> None:
    """Ctrl-C at any point ends with one line saying what is saved and exit code 130 (the shell's SIGINT code), not
    a traceback: the rows written so far are flushed and fsynced, and a rerun resumes after them."""
    saved = _Saved()
    try:
        _main(argv, saved)
    except app.UsageError as e:
        usage_error(str(e))
    except KeyboardInterrupt:
        where = f"saved to {saved.path}; rerun the same command to resume" if saved.path else "written to stdout"
        print(f"interrupted: {saved.rows} rows {where}", file=sys.stderr)
        sys.exit(130)


def _main(argv: Sequence[str], saved: _Saved) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    start = time.perf_counter()
    params = sampling_params()
    from inference.runtime.compile_progress import CompileProgress  # imports JAX: after the cheap flag checks

    with CompileProgress(_MODEL.value, lambda line: tqdm.write(line, file=sys.stderr)):
        _generate(params, saved, start)


def _generate(params: SamplingParams, saved: _Saved, start: float) -> None:
    from sharding import distributed

    try:
        job = distributed.resolve(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _DIST_AUTO.value)
    except ValueError as e:
        raise app.UsageError(str(e))
    if job.is_multi_process and _OUTPUT.value is None:
        raise app.UsageError("a multi-process job needs --output (each process writes a shard of it)")
    index, count = distributed.initialize(job)
    shard = jsonl_io.shard_path(_OUTPUT.value, index, count) if count > 1 else None
    if _INPUT.value and _OUTPUT.value and os.path.realpath(_INPUT.value) == os.path.realpath(_OUTPUT.value):
        raise app.UsageError(f"--output is the --input file ({_INPUT.value}); write the results elsewhere")
    # Every process passes the same barriers in the same order, whatever fails (`stop_together`).
    error: Exception | None = None
    try:
        adapters = lora_requests()
        rows = input_rows()
        repaired = repaired_output_ids(index)
    except Exception as e:  # noqa: BLE001 -- stop_together exits with it, the others with it named
        error = e
    stop_together("pagejax-output-repaired", error)
    try:
        if not rows:
            print(f"warning: {_INPUT.value} has no rows; nothing to generate", file=sys.stderr)
        if shard or _OUTPUT.value:
            jsonl_io.check_writable(shard or _OUTPUT.value)
        done = resumed_ids(index, shard, repaired)
        mine = rows if count == 1 else list(distributed.shard_for_process(grain.MapDataset.source(rows)))
        pending = [row for row in mine if row["id"] not in done]
        check_model_can_run(pending)
        llm = build_llm() if pending else None  # a finished job reruns without loading the model
        if llm is not None:
            from inference.engine.llm_engine import freeze_heap

            freeze_heap()  # this process holds the one model to its end: out of the collector's full collections
    except Exception as e:  # noqa: BLE001 -- a model that fails to load (out of memory, say) too
        error = e
    stop_together("pagejax-ready", error)

    row_params = params_for_row(params)

    def render(row: dict) -> Rendered:
        try:
            return (row, jsonl_io.prompt_text(row, llm.tokenizer), row_params(row), jsonl_io.row_lora(row, adapters),
                    None)
        except ValueError as e:
            return row, None, None, None, str(e)

    max_in_flight = _BATCH_SIZE.value if _BATCH_SIZE.value is not None else _MAX_IN_FLIGHT.value
    if _BATCH_SIZE.value is not None:
        print("warning: --batch_size is deprecated; it now sets --max_in_flight", file=sys.stderr)
    readable = _OUTPUT.value is None and _INPUT.value is None
    target = shard or _OUTPUT.value
    saved.path, saved.rows = target, len(done)
    num_failed = num_tokens = 0
    gen_start = time.perf_counter()
    try:
        sink = open(target, "a", encoding="utf-8") if target else sys.stdout
        writer = jsonl_io.RowWriter(sink, durable=sink is not sys.stdout, fsync_every=_FSYNC_EVERY.value,
                                    fsync_seconds=_FSYNC_SECONDS.value)
        try:
            with tqdm(total=len(pending), unit="row", desc="generate", file=sys.stderr) as bar:
                for result in stream_rows(llm, map(render, pending), max_in_flight, params.logprobs is not None):
                    if readable:
                        print_readable([result])
                    else:
                        writer.write(result)
                    saved.rows += 1
                    num_failed += "error" in result
                    num_tokens += sum(len(o["token_ids"]) for o in result["outputs"])
                    bar.update(1)
                    bar.set_postfix_str(f"{num_tokens / max(time.perf_counter() - gen_start, 1e-9):.1f} tok/s",
                                        refresh=False)
        finally:
            writer.close()
            if sink is not sys.stdout:
                sink.close()
    except Exception as e:  # noqa: BLE001 -- an engine or a disk failure: the others learn of it at the next barrier
        if count == 1:
            raise
        error = e
    if count > 1:
        finish_job(index, count, [row["id"] for row in rows], error)
    gen_s, wall_s = time.perf_counter() - gen_start, time.perf_counter() - start
    print(f"{f'process {index}/{count}: ' if count > 1 else ''}"
          f"rows done {len(pending)}, skipped {len(mine) - len(pending)}, failed {num_failed}; {num_tokens} output "
          f"tokens; wall {wall_s:.1f}s (generate {gen_s:.1f}s); {num_tokens / max(gen_s, 1e-9):.1f} output tok/s",
          file=sys.stderr)
    failed_before = sum(1 for row in mine if done.get(row["id"]))  # error rows an earlier run wrote
    if num_failed or failed_before:
        where = f"their error rows are in {_OUTPUT.value}" if _OUTPUT.value else "their error rows are in the output"
        earlier = f" ({failed_before} from earlier runs)" if failed_before else ""
        print(f"{num_failed + failed_before} rows failed{earlier}; {where} (a rerun skips them; --retry_failed runs "
              "them again)", file=sys.stderr)
        sys.exit(EXIT_ROWS_FAILED)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
