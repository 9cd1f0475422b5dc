"""Before / after on a shared machine: a bench script run against another checkout's code beside this one's.

Why alternate processes: these machines are shared and their load moves, so two trees measured minutes apart differ
by more than most changes. Each size runs in a fresh process of the baseline tree, then of this tree, in turn, and
rounds repeat the whole alternation; a figure that compares sizes (how the host's cost grows with the batch) is
read per round and summarised by the median of the rounds (`size_growth`).

The script must put `env_var`'s tree first on `sys.path` before it imports the project (so the baseline process runs
the baseline's engine with this script's timers and workload) and write `{"rows": [...]}` to its `--json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import numpy as np


def checkout_of(baseline: str, root: str) -> str:
    """A checkout of `baseline`: the path itself, or a detached git worktree of that commit of `root`'s repository
    made for this run (`remove_checkout` takes it away)."""
    if os.path.isdir(baseline):
        return os.path.abspath(baseline)
    tree = tempfile.mkdtemp(prefix="ab_baseline_")
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", tree, baseline], check=True, capture_output=True)
    return tree


def remove_checkout(baseline: str, root: str, tree: str) -> None:
    """Remove the worktree `checkout_of` made (a path given as the baseline is the caller's and stays)."""
    if not os.path.isdir(baseline):
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], capture_output=True)


def run_in(tree: str, script: str, args: list[str], env_var: str) -> list[dict]:
    """The rows `script` writes when run with `args` in a fresh process whose imports come from `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, script, *args, f"--json={out.name}"], cwd=tree,
                       env={**os.environ, env_var: tree}, check=True)
        with open(out.name) as f:
            return json.load(f)["rows"]


def alternate(baseline: str, root: str, script: str, sizes: list[int], rounds: int,
              args_of: Callable[[int], list[str]], env_var: str) -> Iterator[dict]:
    """Every size of both trees, alternating, `rounds` times: each row tagged with its tree ("base" or "this") and
    its round. `args_of(size)`: the script's arguments for one size."""
    base = checkout_of(baseline, root)
    try:
        for round_ in range(rounds):
            for size in sizes:
                for name, tree in (("base", base), ("this", root)):
                    for row in run_in(tree, script, args_of(size), env_var):
                        yield {**row, "tree": name, "round": round_}
    finally:
        remove_checkout(baseline, root, base)


def size_growth(rows: list[dict], value: str = "host_p50_ms") -> dict | None:
    """How one tree's `value` grows from its smallest size (`seqs`) to its largest, per round and the median of the
    rounds' ratios; None with one size."""
    sizes = sorted({r["seqs"] for r in rows})
    if len(sizes) < 2:
        return None
    by = {(r.get("round", 0), r["seqs"]): r[value] for r in rows}
    ratios = [by[k, sizes[-1]] / by[k, sizes[0]] for k in sorted({k for k, _ in by})
              if (k, sizes[0]) in by and (k, sizes[-1]) in by]
    return {"from": sizes[0], "to": sizes[-1], "ratios": ratios, "median": float(np.median(ratios))}
