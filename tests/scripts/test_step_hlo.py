"""The HLO guard (issue 33): Llama-3-8B's decode step compiled deviceless for H200 and TPU v6e at 1, 64 and 256
sequences, its optimized HLO read by `scripts/tools/hlo_checks.py`. It fails if a KV-cache write fuses a dot or a
long reduce (XLA:GPU once fused the one-sequence K/V projection into the cache scatter: 36% of an H200 step) or if
any whole cache is copied; and the float32 H200 step must hold no dot below IEEE f32 (XLA:GPU's default runs f32
dots as TF32).

Cheap on purpose: the preset keeps its real widths (hidden 4096, 32/8 heads of 128, MLP 14336, vocab 128256) with
2 of its 32 layers (`aot_compile.py --layers=2`). The layers are unrolled and identical, so each compiled layer
is the full model's: at one sequence on H200 the 2-layer step had 54 fusions with the V projection's reduce in both
layers' cache scatters and the 32-layer step 626 with it in all 32 (after the fix 52 and 594, none; BENCHMARKS.md
has the full-size table). A chip whose compiler is not installed is skipped with the reason, as in
test_aot_compile.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from scripts.tools import hlo_checks
from tests.scripts.test_aot_compile import _selected_chips
from tests.xla_test_flags import accelerator_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Decode sequences per chip. v6e's compiles are the slow ones (about 40 s and 90 s for 1 and 64 sequences on a busy
# 2-core machine, 140 s for 256) and its steps were clean at all three before and after the change (BENCHMARKS.md).
BATCHES = {"h200": (1, 64, 256), "v6e": (1, 64)}
CHIPS = tuple(BATCHES)


def _compile(tmp_path_factory, chip: str, *extra: str) -> tuple[dict, str] | str:
    """aot_compile.py's rows for `chip` (by case) and the folder of their .hlo files; or why the chip's compiler is
    not here (the test skips with it, so one missing compiler does not skip the other chip's tests)."""
    out = tmp_path_factory.mktemp(f"hlo_{chip}")
    env = accelerator_env(ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # another process may hold libtpu's lockfile
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tools", "aot_compile.py"),
                           f"--chips={chip}", "--what=steps", "--presets=llama-3-8b", "--decode_only", "--tp=1",
                           "--layers=2", f"--hlo_dir={out}", f"--out={out / 'rows.json'}", *extra],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "rows.json").read_text())["rows"]
    setup = [r for r in rows if r["case"] == "-"]
    if setup and setup[0]["status"] == "unavailable":
        return setup[0]["error"]
    return {r["case"]: r for r in rows}, str(out)


def _compiled(result: tuple[dict, str] | str) -> tuple[dict, str]:
    if isinstance(result, str):
        pytest.skip(result)
    return result


@pytest.fixture(scope="module")
def decode_hlo(request, tmp_path_factory):
    """chip -> (rows by case, hlo folder): the bf16 decode steps at the chip's BATCHES."""
    out = {}
    for chip in CHIPS:
        if chip in _selected_chips(request):
            out[chip] = _compile(tmp_path_factory, chip, f"--decode_batches={','.join(map(str, BATCHES[chip]))}")
    return out


def _case(batch: int, dtype: str = "") -> str:
    return f"llama-3-8b_l2_decode{'' if batch == 64 else f'_b{batch}'}{dtype}_tp1"


@pytest.mark.parametrize("chip,batch", [(c, b) for c, bs in BATCHES.items() for b in bs])
def test_decode_step_writes_the_cache_without_fused_work_or_copies(chip, batch, decode_hlo):
    rows, folder = _compiled(decode_hlo[chip])
    row = rows[_case(batch)]
    assert row["status"] == "compiled", row.get("error")
    text = open(os.path.join(folder, f"{chip}_{_case(batch)}.hlo")).read()
    writes = [f for f, body in hlo_checks.fusions(text) if any(i.op == "scatter" for i in body)]
    assert len(writes) >= 2, "expected a cache scatter per layer"  # the guard below must have something to read
    assert hlo_checks.work_in_writes(text) == []
    assert hlo_checks.whole_cache_copies(text, math.prod(row["cache_shape"])) == []
    assert row["memory"]["alias"] >= row["cost_model"]["kv"]  # the donated caches are updated in place


@pytest.fixture(scope="module")
def f32_hlo(request, tmp_path_factory):
    if "h200" not in _selected_chips(request):
        return None
    return _compile(tmp_path_factory, "h200", "--decode_batches=1", "--dtype=float32")


@pytest.mark.parametrize("chip", ["h200"])
def test_float32_step_has_only_ieee_f32_dots_on_gpu(chip, f32_hlo):
    """dtype="float32" traces every dot at Precision.HIGHEST (models/decoder.py): no TF32 on the H200."""
    rows, folder = _compiled(f32_hlo)
    case = _case(1, "_float32")
    assert rows[case]["status"] == "compiled", rows[case].get("error")
    text = open(os.path.join(folder, f"{chip}_{case}.hlo")).read()
    dots = [i for insts in hlo_checks.parse(text).values() for i in insts if i.op == "dot"]
    assert len(dots) >= 5  # the projections and the LM head, as GEMM fusions' dots
    assert hlo_checks.reduced_precision_dots(text) == []


FUSED_WRITE = """\
%fused_scatter (p0: bf16[8,4,16,256], p1: bf16[4096,1024], p2: s32[1]) -> bf16[8,4,16,256] {
  %p0 = bf16[8,4,16,256]{3,2,1,0} parameter(0)
  %p1 = bf16[4096,1024]{1,0} parameter(1)
  %c = f32[] constant(0)
  %cv = f32[4096,1024]{1,0} convert(%p1)
  %r = f32[1024]{0} reduce(%cv, %c), dimensions={0}, to_apply=%add
  %p2 = s32[1]{0} parameter(2)
  ROOT %s = bf16[8,4,16,256]{3,2,1,0} scatter(%p0, %p2, %r), update_window_dims={1}, to_apply=%add
}

%copy_fusion (q0: bf16[8,4,16,256]) -> bf16[8,4,16,256] {
  %q0 = bf16[8,4,16,256]{3,2,1,0} parameter(0)
  ROOT %n = bf16[8,4,16,256]{3,2,1,0} negate(%q0)
}

ENTRY %main (a: bf16[8,4,16,256], b: bf16[4096,1024], c: s32[1], x: f32[2,8], w: f32[8,4]) -> bf16[8,4,16,256] {
  %a = bf16[8,4,16,256]{3,2,1,0} parameter(0)
  %b = bf16[4096,1024]{1,0} parameter(1)
  %c = s32[1]{0} parameter(2)
  %x = f32[2,8]{1,0} parameter(3)
  %w = f32[8,4]{1,0} parameter(4)
  %d = f32[2,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %e = f32[2,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
  %k = bf16[8,4,16,256]{3,2,1,0} copy(%a)
  %f = bf16[8,4,16,256]{3,2,1,0} fusion(%k), kind=kLoop, calls=%copy_fusion
  ROOT %w2 = bf16[8,4,16,256]{3,2,1,0} fusion(%f, %b, %c), kind=kInput, calls=%fused_scatter
}
"""


def test_hlo_checks_find_what_they_guard_against():
    """The readers on a hand-written module holding each fault once: a reduce over 4096 in a scatter fusion, a
    copy and a non-writing fusion of a cache's size, and a default-precision f32 dot beside a HIGHEST one."""
    assert hlo_checks.work_in_writes(FUSED_WRITE) == ["w2: reduce r over 4096 elements"]
    assert hlo_checks.work_in_writes(FUSED_WRITE, long_reduce=8192) == []
    assert hlo_checks.whole_cache_copies(FUSED_WRITE, 8 * 4 * 16 * 256) == [
        "f: fusion bf16[8,4,16,256]{3,2,1,0}", "k: copy bf16[8,4,16,256]{3,2,1,0}"]
    assert [d.split(":")[0] for d in hlo_checks.reduced_precision_dots(FUSED_WRITE)] == ["d"]
    assert hlo_checks.fusion_counts(FUSED_WRITE) == {"kInput": 1, "kLoop": 1, "total": 2}
