"""JSONL in and out for batch generation: input rows, resumable output files, and result rows.

Kept out of `scripts/generate.py` so the launcher stays glue and the pieces that decide what a resumed job skips
(and what a crash may leave behind) are testable on their own.

Input rows are JSON objects with an `id` (string or integer) and either `prompt` (text) or `messages` (a chat list
of {role, content}). Output rows echo the id and the prompt or messages, then the completions; see `result_row`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from typing import IO, Any, Iterable

from inference.engine.outputs import RequestOutput

RowId = str | int


def _check_id(row: Any, where: str) -> RowId:
    """The row's id; resumption is keyed on it, so a row without a usable one stops the job rather than becoming
    an error row that a rerun could never match."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    row_id = row.get("id")
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        raise ValueError(f"{where}: 'id' must be a string or an integer, got {row_id!r}")
    return row_id


def check_unique_ids(rows: Iterable[dict[str, Any]]) -> None:
    """Duplicate ids would make resumption ambiguous (which of the two is done?), so they are an input error."""
    seen: set[RowId] = set()
    for row in rows:
        if row["id"] in seen:
            raise ValueError(f"duplicate id {row['id']!r} in the input; ids must be unique")
        seen.add(row["id"])


def read_input(path: str) -> list[dict[str, Any]]:
    """All rows of an input JSONL file (blank lines ignored), each with a valid, unique id."""
    rows = []
    with open(path, "rb") as f:
        for number, data in enumerate(f, start=1):
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number}: not UTF-8 ({e}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e})") from None
            _check_id(row, f"{path}:{number}")
            rows.append(row)
    check_unique_ids(rows)
    return rows


def check_writable(path: str) -> None:
    """An OSError naming `path` unless rows can be appended to it (its folder exists and is writable, and the file,
    where it exists, is a writable file): said before a model loads, not after."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OSError(f"cannot write {path}: the folder {folder} does not exist")
    if os.path.exists(path):
        if not os.path.isfile(path) or not os.access(path, os.W_OK):
            raise OSError(f"cannot write {path}: it is not a writable file")
    elif not os.access(folder, os.W_OK):
        raise OSError(f"cannot write {path}: the folder {folder} is not writable")


def load_done_ids(path: str, retry_failed: bool = False) -> dict[RowId, bool]:
    """Ids already in an output file, each with whether its row is an error row, repairing a crash's leftovers
    first.

    A crash mid-write can leave the last line cut short (no newline after it: a row is written with its newline in
    one write); that line is dropped (its row is simply redone) and the file rewritten without it, so appending
    next cannot glue a new row onto garbage. Any other bad line, a whole last one included, is not something this
    script writes (the path may name another file), so it stops the job instead of discarding anything.
    `retry_failed`: error rows are dropped too (rewritten away, as the cut-short line), so their ids run again.
    """
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        raw = f.read()
    lines = [line for line in raw.split(b"\n") if line.strip()]
    cut_short = bool(raw.strip()) and not raw.endswith(b"\n")
    rows, done = [], {}
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line.decode("utf-8"))
            _check_id(row, f"{path}:{number}")
            if not isinstance(row.get("outputs"), list):  # every result row has them (an error row's are [])
                raise ValueError("no outputs")
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if number == len(lines) and cut_short:
                break
            raise ValueError(f"{path}:{number}: not a result row of this launcher; --output must name a new file "
                             "or one an earlier run wrote: fix or move the file before resuming") from None
        if not (retry_failed and "error" in row):
            rows.append(line)
            done[row["id"]] = "error" in row
    repaired = b"".join(line + b"\n" for line in rows)
    if repaired != raw:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(repaired)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return done


def prompt_text(row: dict[str, Any], tokenizer: Any) -> str:
    """The text to generate from: `prompt` as is, or `messages` rendered with the model's chat template.

    Raises ValueError describing what is wrong with the row, which becomes that row's `error`.
    """
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt == has_messages:
        raise ValueError("row needs exactly one of 'prompt' or 'messages'" + (", not both" if has_prompt else ""))
    if has_prompt:
        if not isinstance(row["prompt"], str):
            raise ValueError(f"'prompt' must be a string, got {type(row['prompt']).__name__}")
        return row["prompt"]
    messages = row["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("'messages' must be a non-empty list of {role: str, content: str} objects")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot render 'messages'")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001  Jinja raises its own types; any template failure is this row's problem
        raise ValueError(f"chat template failed: {e}") from None


def _echo(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("id", "prompt", "messages", "lora") if k in row}


def error_row(row: dict[str, Any], error: str) -> dict[str, Any]:
    """The output row of an input row that never reached the engine."""
    return {**_echo(row), "outputs": [], "num_prompt_tokens": 0, "ttft_s": None, "error": error}


def result_row(row: dict[str, Any], out: RequestOutput, with_logprobs: bool) -> dict[str, Any]:
    """The output row for one finished request; `error` appears only when the engine rejected the prompt."""
    outputs = []
    for c in out.outputs:
        entry: dict[str, Any] = {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                                 "finish_reason": c.finish_reason}
        if with_logprobs:
            # JSON object keys are strings, so token ids become "123"; a list of pairs would survive exactly but
            # nobody reads logprobs that way in vLLM-shaped tooling. The values stay plain floats (the rows' format
            # before Logprob objects); ranks and decoded tokens are not written.
            entry["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])]
            entry["cumulative_logprob"] = c.cumulative_logprob
        outputs.append(entry)
    result = {**_echo(row), "outputs": outputs, "num_prompt_tokens": len(out.prompt_token_ids),
              "ttft_s": out.metrics.ttft if out.metrics is not None else None}
    if out.error is not None:
        result["error"] = out.error
    return result


def json_line(row: dict[str, Any]) -> str:
    """A row as one line of UTF-8 JSON; a string no UTF-8 can hold (a lone surrogate, an id "\\udc80") as JSON's
    escape, which reads back as the same string."""
    line = json.dumps(row, ensure_ascii=False) + "\n"
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(row) + "\n"
    return line


def write_rows(f: IO[str], rows: Iterable[dict[str, Any]], durable: bool = True) -> None:
    """One line per row, then flush (and fsync, for files) so a crash after this call loses none of them."""
    for row in rows:
        f.write(json_line(row))
    f.flush()
    if durable:
        os.fsync(f.fileno())


class RowWriter:
    """Writes rows one at a time as they finish: each is flushed at once (a reader or a crashed job's rerun sees it),
    but fsync, which costs a disk round trip, runs only every `fsync_every` rows or `fsync_seconds` seconds, and on
    `close`. A power loss can cost the rows since the last fsync; a killed process loses none (they are flushed)."""

    def __init__(self, f: IO[str], durable: bool = True, fsync_every: int = 64, fsync_seconds: float = 5.0):
        self.f, self.durable = f, durable
        self.fsync_every, self.fsync_seconds = max(1, fsync_every), fsync_seconds
        self.written = 0
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def write(self, row: dict[str, Any]) -> None:
        self.f.write(json_line(row))
        self.f.flush()
        self.written += 1
        self._unsynced += 1
        if self._unsynced >= self.fsync_every or time.monotonic() - self._last_sync >= self.fsync_seconds:
            self.sync()

    def sync(self) -> None:
        if self.durable and self._unsynced:
            os.fsync(self.f.fileno())
        self._unsynced, self._last_sync = 0, time.monotonic()

    def close(self) -> None:
        """Flush and fsync what is written; the file itself stays open (it may be stdout)."""
        self.f.flush()
        self.sync()


def row_seed(seed: int, row_id: RowId) -> int:
    """`seed` plus a stable hash of the row id (crc32 of its JSON form, so 3 and "3" differ): identical prompts get
    different samples, and a resumed or resharded job gives each row the seed it had before. Python's `hash` is
    salted per process, so it would not survive a rerun. Modulo 2**64, as the sampler keys on it: the same samples,
    and a seed near the top of the range stays a valid one."""
    return (seed + zlib.crc32(json.dumps(row_id).encode("utf-8"))) % (1 << 64)


# Sampling parameters a row may set for itself (over the launcher's flags), as in a request to the OpenAI server.
# Logprobs stay the job's (--logprobs: every row's output has the same fields); other SamplingParams fields a row
# names with a value are refused rather than ignored. A null is no value (OpenAI's meaning): the flag holds, so
# `"stop": null` keeps --stop.
ROW_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                       "include_stop_str_in_output", "repetition_penalty", "presence_penalty", "frequency_penalty",
                       "min_tokens", "bad_words")


def row_params(row: dict[str, Any], base: Any) -> Any:
    """The row's SamplingParams: `base`, with the row's own `max_tokens` if it has one (a positive integer), its
    own `json_schema` (a JSON Schema object the completions must match; it replaces --json_schema) if it has one,
    and its own values of `ROW_SAMPLING_FIELDS`. A null value is no value (the launcher's flag holds), as a null
    parameter is in the OpenAI API. Other keys (a row's own data) are not read.

    Raises ValueError describing a bad value or a sampling field a row cannot set, which becomes that row's `error`.
    """
    fields = {f.name for f in dataclasses.fields(base)}
    given = {k: v for k, v in row.items() if v is not None and (k in fields or k == "json_schema")}
    refused = sorted(k for k in given if k not in ROW_SAMPLING_FIELDS and k not in ("max_tokens", "json_schema"))
    if refused:
        raise ValueError(f"a row cannot set {refused[0]!r}; rows may set max_tokens, json_schema and "
                         f"{', '.join(ROW_SAMPLING_FIELDS)} (the launcher's flags set the rest for every row)")
    if "json_schema" in given:
        from inference.structured.params import StructuredOutputsParams
        base = base.replace(structured_outputs=StructuredOutputsParams(json=given.pop("json_schema")))
    if "max_tokens" in given:  # checked with the others (min_tokens is checked against it)
        value = given["max_tokens"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"'max_tokens' must be a positive integer, got {value!r}")
    if not given:
        return base
    try:
        return base.replace(**given)
    except TypeError as exc:  # a value of a type the parameter's own check does not expect
        raise ValueError(f"the row's sampling parameters {sorted(given)} are invalid: {exc}") from None


def row_lora(row: dict[str, Any], adapters: dict[str, Any]) -> Any:
    """The LoRARequest the row's `lora` field names among the launcher's --lora adapters (None, or no field: the
    base model). Raises ValueError describing a bad field, which becomes that row's `error`."""
    name = row.get("lora")
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"'lora' must be the name of a --lora adapter (a string) or null, got {name!r}")
    if name not in adapters:
        known = f"the --lora adapters are {sorted(adapters)}" if adapters else "the launcher was started without --lora"
        raise ValueError(f"'lora' names adapter {name!r}, which is unknown; {known}")
    return adapters[name]


__all__ = ["check_unique_ids", "read_input", "load_done_ids", "prompt_text", "error_row", "result_row",
           "write_rows", "RowWriter", "row_seed", "row_params", "row_lora", "shard_path", "merge_shards"]


# ---- multi-process jobs: one output shard per process, merged by process 0 --------------------------------------
def shard_path(output: str, process_index: int, process_count: int) -> str:
    """Where process `process_index` of `process_count` writes its rows of a job whose output is `output`."""
    return f"{output}.process-{process_index:05d}-of-{process_count:05d}"


def merge_shards(output: str, shard_paths: Iterable[str], input_ids: Iterable[RowId]) -> int:
    """Append the shards' rows to `output` in input order (ids already in `output` are skipped), then delete the
    shards; returns the number of rows appended. A crash between the append and the deletes is harmless: the rerun
    finds those ids done and skips them."""
    done = load_done_ids(output)
    shard_paths = [p for p in shard_paths if os.path.exists(p)]
    by_id: dict[RowId, dict[str, Any]] = {}
    for path in shard_paths:
        load_done_ids(path)  # drops a cut-short last line (a crashed writer's leftover)
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    by_id[row["id"]] = row
    rows = [by_id[i] for i in input_ids if i in by_id and i not in done]
    with open(output, "a", encoding="utf-8") as f:
        write_rows(f, rows)
    for path in shard_paths:
        os.remove(path)
    return len(rows)
