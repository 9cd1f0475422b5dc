"""The import graph's layering, read from the source (parsed with `ast`, nothing imported).

Every module of `configs/`, `kernels_pallas/`, `models/`, `sharding/`, `inference/` and `scripts/` is parsed; every
import statement counts, wherever it stands (module level, inside a function, under `if`/`try`), so lazy imports are
edges too. `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`. Importing `a.b.c`
also runs `a/__init__.py` and `a/b/__init__.py`, so it is an edge to every package `__init__` on the way that the
importer is not already inside (a package's own submodules run after its `__init__` has started; outsiders pay for
its re-exports).

The checks: no import cycle; no edge from a lower layer to a higher one in `LAYERS` (the same table is in
docs/architecture.md, checked below); every module placed in `LAYERS`; every package directory has an
`__init__.py` with a docstring. A new module goes into the table at the lowest layer its imports allow.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "kernels_pallas", "models", "sharding", "inference", "scripts")

# Bottom first. A module may import from its own layer (the cycle check still applies) and from any layer below.
# An entry names a module and, when it is a package, everything under it; the longest entry that matches a module
# places it, so `kernels_pallas` places the package's `__init__` (and any module not named more precisely) at the
# top of kernels_pallas. `pkg.__init__` names only that package's `__init__.py`. Keep this table and the one in
# docs/architecture.md the same (a test below compares them).
LAYERS: tuple[tuple[str, ...], ...] = (
    # Leaves: chip data, backend detection, the GPU compiler-log parser.
    ("configs.chips", "kernels_pallas.backend", "kernels_pallas.gpu_compile_report"),
    # kernels_pallas
    ("kernels_pallas.kv_cache.layout", "kernels_pallas.recurrent.layout"),
    ("kernels_pallas.native",),
    ("kernels_pallas.kv_cache", "kernels_pallas.matmul", "kernels_pallas.recurrent"),
    ("kernels_pallas.attention", "kernels_pallas.attention.mosaic_gpu_tiles"),
    ("kernels_pallas.mla",),
    ("kernels_pallas.sharded",),
    ("kernels_pallas",),
    # models
    ("models.config", "models.optional_deps"),
    ("models.weights",),
    ("models.quantization.formats", "models.quantization.gguf_blocks", "models.lora"),
    ("models.quantization.modes",),
    ("models.quantization",),
    ("models.layers",),
    ("models.attention", "models.mamba2"),
    ("models.mla", "models.moe", "models.gated_deltanet"),
    ("models.decoder", "models.batch_invariant"),
    ("models.loaders", "models.loaders.hf_names"),
    ("models",),
    # configs.presets: instances of models.config, above every model module; the configs __init__ re-exports them.
    ("configs",),
    ("sharding",),
    # inference
    # plain-data configs (validated arguments, no engine code); LoRA adapters (PEFT loading, device slots)
    ("inference.engine.config", "inference.lora"),
    # StructuredOutputsParams (a SamplingParams field) sits beside it; the matchers sit with the tokenizer they need.
    ("inference.sampling.params", "inference.structured.__init__", "inference.structured.params"),
    ("inference.sampling.sampler", "inference.sampling.token_mask", "inference.sampling.logit_bias",
     "inference.sampling.penalties"),
    ("inference.sampling",),
    ("inference.loading", "inference.structured", "inference.rl"),  # grammar matchers; RL's logprobs (no engine)
    # The engine's host bookkeeping sits below the runtime (which reads `ScheduledBatch`), its
    # driver above it, so inference/engine/__init__.py stays free of imports: it runs before any of them.
    ("inference.engine.__init__", "inference.engine.sequence", "inference.engine.outputs"),
    ("inference.engine.stop", "inference.engine.metrics", "inference.engine.pages", "inference.engine.logprobs"),
    ("inference.engine.scheduled_batch", "inference.engine.scheduler"),
    ("inference.runtime", "inference.runtime.compile_progress", "inference.runtime.warmup",
     "inference.runtime.step_variants"),
    ("inference.spec_decode",),
    ("inference.engine", "inference.engine.async_scheduling", "inference.engine.compile_budget",
     "inference.engine.fold"),
    # The offline API and the HTTP server over its engine loop (one row: the server imports streaming).
    ("inference.entrypoints", "inference.entrypoints.openai", "inference.entrypoints.prompts",
     "inference.entrypoints.replica"),
    ("inference.tools", "inference.tools.model_bytes", "inference.tools.cost_model_io"),
    ("inference",),
    ("scripts", "scripts.tools.aot_harness", "scripts.tools.aot_kernels", "scripts.tools.aot_steps"),
)


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # "path:line"
    via: str = ""  # the imported module when the edge is to a package __init__ on its way


def discover(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
    """Module name -> file, for every .py under the packages (a package is named by its `__init__.py`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _known_prefix(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, is_package: bool, node, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [t for t in (_known_prefix(alias.name, modules) for alias in node.names) if t]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    targets = []
    for alias in node.names:
        full = f"{source}.{alias.name}"
        target = full if full in modules else _known_prefix(source, modules)
        if target:
            targets.append(target)
    return targets


def build_graph(root: pathlib.Path, packages=PACKAGES) -> tuple[dict[str, list[Edge]], dict[str, pathlib.Path]]:
    """Module -> its import edges (explicit ones, and the package `__init__`s each import runs on its way)."""
    modules = discover(root, packages)
    graph: dict[str, list[Edge]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            for target in _targets(module, is_package, node, modules):
                parts = target.split(".")
                for i in range(1, len(parts)):
                    parent = ".".join(parts[:i])
                    inside = module == parent or module.startswith(parent + ".")
                    if parent in modules and not inside and parent != module:
                        edges.setdefault(parent, Edge(module, parent, where, via=target))
                if target != module:
                    edges[target] = Edge(module, target, where)
        graph[module] = sorted(edges.values(), key=lambda e: e.dst)
    return graph, modules


def layer_of(module: str, layers=LAYERS) -> int | None:
    best, best_len = None, -1
    for index, entries in enumerate(layers):
        for entry in entries:
            if entry == module + ".__init__":
                return index
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def _describe(edge: Edge) -> str:
    via = f" (its package __init__, on the way to {edge.via})" if edge.via else ""
    return f"{edge.src} -> {edge.dst}{via} at {edge.where}"


def find_cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One concrete cycle per strongly connected component with more than one module (Tarjan, iterative)."""
    adjacency = {m: [e.dst for e in edges if e.dst in graph] for m, edges in graph.items()}
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(adjacency[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter[0]
                    counter[0] += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(adjacency[succ])))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(set(component))
    cycles = []
    for component in components:
        start = min(component)
        # Breadth-first from `start` back to itself, inside the component: the shortest cycle through it.
        edge_to: dict[str, Edge] = {}
        frontier, seen, closing = [start], {start}, None
        while frontier and closing is None:
            nxt = []
            for node in frontier:
                for edge in graph[node]:
                    if edge.dst == start:
                        closing = edge
                        break
                    if edge.dst in component and edge.dst not in seen:
                        seen.add(edge.dst)
                        edge_to[edge.dst] = edge
                        nxt.append(edge.dst)
                if closing:
                    break
            frontier = nxt
        path, node = [closing], closing.src
        while node != start:
            path.append(edge_to[node])
            node = edge_to[node].src
        cycles.append(path[::-1])
    return cycles


def unplaced_modules(graph, layers=LAYERS) -> list[str]:
    return sorted(m for m in graph if layer_of(m, layers) is None)


def wrong_way_edges(graph: dict[str, list[Edge]], layers=LAYERS) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        src = layer_of(module, layers)
        for edge in edges:
            dst = layer_of(edge.dst, layers)
            if src is not None and dst is not None and dst > src:
                found.append(f"{_describe(edge)}: layer {src} {layers[src]} imports layer {dst} {layers[dst]}")
    return found


@pytest.fixture(scope="module")
def graph():
    return build_graph(ROOT)[0]


def test_every_module_is_placed_in_a_layer(graph):
    assert not unplaced_modules(graph), f"add these modules to LAYERS (and docs/architecture.md): " \
                                        f"{unplaced_modules(graph)}"


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    if cycles:
        pytest.fail("import cycles:\n" + "\n".join(
            " -> ".join([c[0].src] + [e.dst for e in c]) + "\n    " + "\n    ".join(_describe(e) for e in c)
            for c in cycles), pytrace=False)


def test_no_edge_against_the_layer_order(graph):
    wrong = wrong_way_edges(graph)
    if wrong:
        pytest.fail("imports against the layer order (bottom first) in LAYERS:\n" + "\n".join(wrong), pytrace=False)


def test_every_layer_entry_names_a_module(graph):
    # A stale entry (a module moved or renamed) would silently place nothing.
    stale = [e for entries in LAYERS for e in entries
             if not any(m == e.removesuffix(".__init__") or m.startswith(e + ".") for m in graph)]
    assert not stale, f"LAYERS entries that match no module: {stale}"


def test_every_package_directory_has_an_init_with_a_docstring():
    missing, undocumented = [], []
    for package in PACKAGES:
        for directory in [ROOT / package, *sorted(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            if directory.name == "__pycache__" or not any(directory.glob("*.py")):
                continue  # data folders (inference/data, configs/gpu_targets, native/csrc) are not packages
            init = directory / "__init__.py"
            if not init.exists():
                missing.append(str(directory.relative_to(ROOT)))
            elif not ast.get_docstring(ast.parse(init.read_text())):
                undocumented.append(str(init.relative_to(ROOT)))
    assert not missing, f"package directories without __init__.py: {missing}"
    assert not undocumented, f"package __init__.py without a docstring: {undocumented}"


def _doc_layers() -> list[tuple[str, ...]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers:begin -->(.*?)<!-- layers:end -->", text, re.S)
    assert block, "docs/architecture.md lost its <!-- layers:begin/end --> table"
    rows = [line for line in block.group(1).splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return [tuple(re.findall(r"`([\w.]+)`", row.split("|")[2])) for row in rows]


def test_docs_table_is_the_same_as_layers():
    assert tuple(_doc_layers()) == LAYERS


# -- the checker checks: a synthetic graph, and a synthetic tree through the parser ------------------------------

def _synthetic(edges: dict[str, list[str]]) -> dict[str, list[Edge]]:
    return {m: [Edge(m, d, f"{m}.py:1") for d in ds] for m, ds in edges.items()}


def test_checker_catches_a_cycle_and_a_wrong_way_edge():
    layers = (("low",), ("mid",), ("high",))
    graph = _synthetic({"low": ["high"], "mid": ["low", "mid.a"], "mid.a": ["mid.b"], "mid.b": ["mid.a"],
                        "high": ["mid"], "stray": []})
    cycles = find_cycles(graph)
    members = sorted(sorted({e.src for e in c}) for c in cycles)
    assert members == [["high", "low", "mid"], ["mid.a", "mid.b"]]
    for cycle in cycles:  # each reported cycle closes on itself
        assert cycle[0].src == cycle[-1].dst and all(a.dst == b.src for a, b in zip(cycle, cycle[1:]))
    wrong = wrong_way_edges(graph, layers)
    assert len(wrong) == 1 and wrong[0].startswith("low -> high at low.py:1")
    assert unplaced_modules(graph, layers) == ["stray"]
    assert layer_of("mid.a", layers) == 1 and layer_of("middle", layers) is None
    assert layer_of("mid", (("mid.__init__",), ("mid",))) == 0 and layer_of("mid.a", (("mid.__init__",), ("mid",))) == 1
    assert not find_cycles(_synthetic({"a": ["b"], "b": ["c"], "c": []}))


def test_parser_counts_lazy_relative_and_submodule_imports(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    files = {
        "pkg/__init__.py": "from pkg.sub import deep\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "def f():\n    from other import tool  # lazy, and `tool` is a module\n",
        "pkg/low.py": "from . import sub\nfrom .sub.deep import f\n",
        "other/__init__.py": "NAME = 1\n",
        "other/tool.py": "import pkg.low\nfrom other import NAME\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph, _ = build_graph(tmp_path, ("pkg", "other"))
    dsts = {m: {e.dst for e in edges} for m, edges in graph.items()}
    assert dsts["pkg.sub.deep"] == {"other", "other.tool"}  # lazy edge, plus the other/__init__ it runs
    assert dsts["pkg.low"] == {"pkg.sub", "pkg.sub.deep"}  # relative; no edge to its own package's __init__
    assert dsts["other.tool"] == {"pkg", "pkg.low", "other"}  # `import pkg.low` runs pkg/__init__ first
    cycles = find_cycles(graph)
    assert len(cycles) == 1 and {e.src for e in cycles[0]} >= {"pkg.sub.deep", "other.tool"}
    layers = (("pkg",), ("other",))
    assert {w.split(" at ")[0] for w in wrong_way_edges(graph, layers)} == {
        "pkg.sub.deep -> other (its package __init__, on the way to other.tool)", "pkg.sub.deep -> other.tool"}
