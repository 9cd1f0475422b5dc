"""kernels_pallas.native.gate, the one switch for the C++ CPU kernels: PAGEJAX_CPU_KERNELS=0 sends every call site
to its pure-JAX path (in a fresh process: the decision is once per process), a fallback is logged once per kernel
with its reason, `compiling_for` another backend turns the kernels off without asking (or caching) anything, and
the engine's bucket choice follows the attention dispatcher's."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from configs.presets import get_model_config
from inference.engine.compile_budget import padding_is_free, reads_padded_pages
from kernels_pallas import rope_cpu, write_kv
from kernels_pallas.attention import cpu
from kernels_pallas.attention.dispatch import resolve_impl
from kernels_pallas.backend import compiling_for
from kernels_pallas.kv_cache.layout import kv_cache_spec
from kernels_pallas.kv_cache.writes import WRITE_KERNEL
from kernels_pallas.mla.dispatch import resolve_mla_impl
from kernels_pallas.native import gate
from models import layers
from tests.kernels_pallas.native_gate_worker import KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITES = ("attention", "grouped_matmul", "int8_matmul", "kv_write", "rope")
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                               reason="no C++ compiler: the kernels never run here")


def run_worker(**env) -> dict:
    environ = {key: value for key, value in os.environ.items() if key != "PAGEJAX_CPU_KERNELS"}
    environ.update(env, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels_pallas", "native_gate_worker.py")],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_switched_off_every_site_runs_pure_jax_and_says_why_once():
    out = run_worker(PAGEJAX_CPU_KERNELS="0")
    assert out["sites"] == out["sites_again"] == {name: [] for name in SITES}
    assert len(out["log"]) == len(SITES)  # one line per kernel, though every site was traced twice
    for name, target in out["targets"].items():
        (line,) = [m for m in out["log"] if target in m]
        assert line.startswith("WARNING") and "PAGEJAX_CPU_KERNELS=0" in line, line
    assert out["auto"] == "reference"
    assert out["fine_pages"] and out["mla_fine_pages"]  # the engine follows: the reference reads padded pages
    if shutil.which(os.environ.get("CXX") or "g++"):
        assert out["explicit_cpu"] == ["attention"]  # naming the kernel still runs it


@needs_cxx
def test_switched_on_every_site_takes_its_kernel_and_says_why_once():
    """The control for the test above: the same worker without the switch sees each site's kernel unless
    `gate.MEASURED` has it slower on this CPU's ISA (then its pure-JAX path), and the gate says once per kernel, at
    INFO, whether it runs and why (the ISA and the measured table)."""
    out = run_worker()
    served = {name: gate.measured_choice(KERNELS[name], gate.host_isa())[0] for name in SITES}
    taken = {name for name, rows in served.items() if rows is not None and 2 in rows}  # the worker's matmuls: 2 rows
    assert out["sites"] == out["sites_again"] == {name: [name] if name in taken else [] for name in SITES}
    assert len(out["log"]) == len(SITES)
    for name, target in out["targets"].items():
        (line,) = [m for m in out["log"] if target in m]
        said = " does not run (pure JAX does): measured slower" if served[name] is None else " runs"
        assert line.startswith("INFO") and said in line and gate.host_isa() in line, line
    assert out["auto"] == "cpu" and not out["fine_pages"] and out["mla_fine_pages"]  # no CPU MLA kernel


def test_an_unavailable_kernel_is_logged_once_with_the_reason(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-pagejax")
    # Its own defines: a library of its own, so no earlier build in this process is reused.
    kernel = gate.CpuKernel("pagejax_test_unbuildable", "PagejaxNoSuchSymbol", ("PAGEJAX_TEST_UNBUILDABLE",))
    with caplog.at_level(logging.WARNING, logger=gate.__name__):
        assert not gate.runs_here(kernel)
        assert not gate.runs_here(kernel)
    (record,) = [r for r in caplog.records if r.name == gate.__name__]
    assert record.levelno == logging.WARNING
    assert kernel.target in record.getMessage() and "no C++ compiler 'no-such-compiler-pagejax'" in record.getMessage()
    assert "no C++ compiler" in gate.unavailable_reason(kernel)


def test_compiling_for_another_backend_turns_kernels_off_without_asking(caplog):
    kernel = gate.CpuKernel("pagejax_test_never_asked", "PagejaxNoSuchSymbol", ("PAGEJAX_TEST_NEVER_ASKED",))
    before = gate.unavailable_reason.cache_info()
    with caplog.at_level(logging.WARNING, logger=gate.__name__):
        for backend in ("tpu", "gpu"):
            with compiling_for(backend):
                assert not gate.runs_here(kernel)
                assert not gate.runs_here(cpu.KERNEL)
                pages = jnp.zeros(kv_cache_spec(4, 4, 2, 32).shape, jnp.float32)
                k = jnp.ones((2, 2, 32), jnp.float32)
                slots = jnp.array([0, 5], jnp.int32)
                text = jax.jit(lambda p: write_kv(p, k, k, slots)).lower(pages).as_text()
                assert WRITE_KERNEL.target not in text
                inv_freq = layers.rope_inv_freq(16, 10000.0, None)
                text = jax.jit(lambda p: layers.rope_tables(p, inv_freq)).lower(jnp.arange(3)).as_text()
                assert rope_cpu.KERNEL.target not in text
    assert gate.unavailable_reason.cache_info() == before  # neither asked nor cached: no build was attempted
    assert not [r for r in caplog.records if r.name == gate.__name__]
    # Back on CPU the cached per-process answer decides again.
    assert gate.runs_here(cpu.KERNEL) == (gate.unavailable_reason(cpu.KERNEL) is None)


@pytest.mark.parametrize("page_size", [4, 16])
def test_the_engine_asks_the_dispatcher(page_size, monkeypatch):
    dense, mla = get_model_config("tiny-llama"), get_model_config("tiny-deepseek-v2")
    dispatched = resolve_impl("auto", page_size, dense.head_dim) == "reference"
    assert reads_padded_pages(dense, page_size) == dispatched
    mla_dispatched = resolve_mla_impl("auto", page_size, mla.kv_lora_rank, mla.qk_rope_head_dim) == "reference"
    assert reads_padded_pages(mla, page_size) == mla_dispatched
    monkeypatch.setattr(gate, "runs_here", lambda kernel, rows=None: False)  # as without a compiler
    assert resolve_impl("auto", page_size, dense.head_dim) == "reference"
    assert reads_padded_pages(dense, page_size)
    with compiling_for("tpu"):
        assert resolve_impl("auto", page_size, dense.head_dim) == "tpu"
        assert not reads_padded_pages(dense, page_size)


def test_the_cache_dtype_enters_the_choice(monkeypatch):
    """`resolve_impl` (and so the engine's bucket choice) sends a cache dtype the C++ kernel does not read to the
    reference, and one it reads (fp8 included) to the kernel, whatever `impl="auto"` is asked with."""
    dense = get_model_config("tiny-llama")
    monkeypatch.setattr(gate, "runs_here", lambda kernel, rows=None: True)  # built, measured faster
    for dtype in (None, jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn):
        assert resolve_impl("auto", 16, dense.head_dim, dtype) == "cpu"
        assert padding_is_free(dense, 16, kv_dtype=dtype) and not reads_padded_pages(dense, 16, kv_dtype=dtype)
    assert resolve_impl("auto", 16, dense.head_dim, jnp.float16) == "reference"  # not in cpu.KV_DTYPES
    assert reads_padded_pages(dense, 16, kv_dtype=jnp.float16) and not padding_is_free(dense, 16, kv_dtype="float16")
    assert resolve_impl("cpu", 16, dense.head_dim, jnp.float16) == "cpu"  # a named impl is returned as asked


def test_a_kernel_measured_slower_on_this_isa_does_not_run(monkeypatch, caplog):
    """The table, not the build, decides: a kernel that builds but was measured slower than its pure-JAX path on
    this CPU's ISA takes the pure-JAX path, and says so once at INFO; one not measured there runs."""
    slower = gate.CpuKernel("pagejax_gate_test_slower", WRITE_KERNEL.symbol)  # builds: a real symbol
    unmeasured = gate.CpuKernel("pagejax_gate_test_unmeasured", WRITE_KERNEL.symbol)
    monkeypatch.setitem(gate.MEASURED, gate.host_isa(), {slower.target: False})
    with caplog.at_level(logging.INFO, logger=gate.__name__):
        if gate.unavailable_reason(slower) is not None:
            pytest.skip("the kernel library does not build here")
        assert not gate.runs_here(slower) and not gate.runs_here(slower)
        assert gate.runs_here(unmeasured)
    (record,) = [r for r in caplog.records if slower.target in r.getMessage()]
    assert record.levelno == logging.INFO and "measured slower" in record.getMessage()
    assert gate.choices()["kernels"][slower.target] == {"runs": False, "rows": None, "why": gate.choice(slower)[1]}
    assert "not measured on" in gate.choices()["kernels"][unmeasured.target]["why"]


def test_a_matmul_kernel_runs_at_the_rows_it_was_measured_faster_at(monkeypatch, caplog):
    """`MEASURED` may name a range of rows (`Rows`): the call site passes its row count and takes the kernel only in
    that range, within the rows the kernel itself serves (`CpuKernel.rows`); the log and `choices` say which."""
    ranged = gate.CpuKernel("pagejax_gate_test_ranged", WRITE_KERNEL.symbol, rows=gate.Rows(1, 6))
    monkeypatch.setitem(gate.MEASURED, gate.host_isa(), {ranged.target: gate.Rows(2, 8)})
    with caplog.at_level(logging.INFO, logger=gate.__name__):
        if gate.unavailable_reason(ranged) is not None:
            pytest.skip("the kernel library does not build here")
        assert [gate.runs_here(ranged, rows=m) for m in range(1, 9)] == [False] + [True] * 5 + [False] * 2
        assert gate.runs_here(ranged)  # no row count: it runs at some
        with compiling_for("tpu"):
            assert not gate.runs_here(ranged, rows=4)
    (record,) = [r for r in caplog.records if ranged.target in r.getMessage()]
    assert "runs for 2-6 rows" in record.getMessage() and "at 2-8 rows" in record.getMessage()
    assert gate.choices()["kernels"][ranged.target]["rows"] == "2-6 rows"
    assert gate.ANY_ROWS & gate.Rows(3) == gate.Rows(3) and str(gate.Rows(3)) == "3+ rows"
    assert str(gate.ANY_ROWS) == "any rows" and 10**9 in gate.ANY_ROWS and 0 not in gate.ANY_ROWS
    disjoint = gate.CpuKernel("pagejax_gate_test_disjoint", WRITE_KERNEL.symbol, rows=gate.Rows(1, 4))
    monkeypatch.setitem(gate.MEASURED, "test-isa", {disjoint.target: gate.Rows(8, 16)})
    assert gate.measured_choice(disjoint, "test-isa")[0] is None  # faster only at rows it never serves
    with pytest.raises(ValueError, match="expected 0 <= lo"):
        gate.Rows(5, 2)


def test_host_isa_names_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(gate, "_amx_granted", lambda: True)  # the flags decide below; the grant is tested apart
    for flags, machine, isa in [({"avx2", "fma"}, "x86_64", "avx2"), ({"avx2", "fma", "avx512f"}, "x86_64", "avx512"),
                                ({"avx512f", "avx512bw", "avx512_vnni"}, "x86_64", "avx512-vnni"),
                                ({"avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"}, "x86_64",
                                 "avx512-amx"),
                                ({"sse2"}, "x86_64", "baseline"), ({"asimd", "asimddp"}, "aarch64", "neon-dotprod"),
                                ({"asimd"}, "aarch64", "neon")]:
        monkeypatch.setattr(gate, "_cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(gate.platform, "machine", lambda machine=machine: machine)
        gate.host_isa.cache_clear()
        assert gate.host_isa() == isa
    gate.host_isa.cache_clear()


def test_amx_flags_without_the_tile_state_are_not_avx512_amx(monkeypatch):
    """A kernel that lists the AMX flags but refuses the tile state (Linux 5.9-5.15) runs the VNNI loops."""
    monkeypatch.setattr(gate, "_cpu_flags", lambda: {"avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"})
    monkeypatch.setattr(gate.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(gate, "_amx_granted", lambda: False)
    gate.host_isa.cache_clear()
    assert gate.host_isa() == "avx512-vnni"
    gate.host_isa.cache_clear()


def test_builds_are_separate_targets():
    assert cpu.KERNEL.build("native") is cpu.KERNEL
    avx2 = cpu.KERNEL.build("avx2")
    assert avx2.target == f"{cpu.KERNEL.target}_avx2" and avx2.march == "x86-64-v3"
    no_amx = cpu.KERNEL.build("no_amx")
    assert no_amx.target == f"{cpu.KERNEL.target}_no_amx" and no_amx.defines == ("PAGEJAX_NO_AMX",)
    assert no_amx.march == "native"
    with pytest.raises(ValueError, match="unknown kernel build 'sse'"):
        cpu.KERNEL.build("sse")


def test_portable_variant_is_a_separate_target():
    portable = cpu.KERNEL.build("portable")
    assert portable.target == f"{cpu.KERNEL.target}_portable" and portable.symbol == cpu.KERNEL.symbol
    assert portable.defines == ("PAGEJAX_PORTABLE",)
    assert portable != cpu.KERNEL
