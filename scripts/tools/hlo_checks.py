"""Reading a compiled step's optimized HLO text (`compiled.as_text()`, or the `.hlo` files
`aot_compile.py --hlo_dir` writes) for what makes a decode step slower than its bytes: work fused into the KV
write, copies of a whole cache, TF32 dots in a float32 program, and how many fusions (kernel launches) it has.

Why a KV write must hold no dot or long reduce: XLA:GPU maps a scatter fusion one thread per written element, so a
reduction fused into it is redone serially per element. At one decode sequence it strength-reduced the M = 1 K/V
projections into multiply + reduce and fused the reduce into the cache scatter: the write then took 36% of an
H200 step (BENCHMARKS.md, the H200 section; issue 33). The text format parsed here is XLA's HLO printer's, which is
stable across the jax versions the project supports (0.10 - 0.12).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

# A reduction this long inside a write is a projection (hidden sizes are >= 1024); int8 KV's per-head scale is a
# max over head_dim (<= 256) and belongs there.
LONG_REDUCE = 1024
WRITES = ("scatter", "dynamic-update-slice")  # the ops that update an array in place

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # "bf16[8,257,16,256]{3,2,1,0}" or a tuple "(f32[..], ...)"
    op: str
    rest: str  # operands and attributes, as printed

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, dims) of the result, or of each element of a tuple result."""
        return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(self.shape)]

    @property
    def operands(self) -> list[str]:
        args = self.rest.split(")", 1)[0]
        return re.findall(r"%([\w.\-]+)", args)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.rest)
        return m.group(1) if m else None


def parse(text: str) -> dict[str, list[Instruction]]:
    """Computation name -> its instructions, in order."""
    comps: dict[str, list[Instruction]] = {}
    current = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(1), [])
            continue
        if current is None:
            continue
        m = _INSTRUCTION.match(line)
        if m:
            current.append(Instruction(*m.groups()))
    return comps


def _called(comps, name: str, seen: set[str] | None = None) -> list[Instruction]:
    """The instructions of computation `name` and of every computation it calls (nested fusions, regions)."""
    seen = set() if seen is None else seen
    if name in seen or name not in comps:
        return []
    seen.add(name)
    out = list(comps[name])
    for inst in comps[name]:
        for key in ("calls", "to_apply", "body", "condition"):
            target = inst.attr(key)
            if target:
                out += _called(comps, target.lstrip("%"), seen)
    return out


def _top_level(comps) -> list[Instruction]:
    """The instructions outside fusion bodies: the entry's, loops' bodies', the regions'."""
    bodies = {i.attr("calls").lstrip("%") for insts in comps.values() for i in insts if i.op == "fusion"}
    return [inst for name, insts in comps.items() if name not in bodies for inst in insts]


def fusions(text: str) -> list[tuple[Instruction, list[Instruction]]]:
    """Every fusion instruction outside fusion bodies (the entry, loops' bodies), with its body's instructions."""
    comps = parse(text)
    return [(i, _called(comps, i.attr("calls").lstrip("%"))) for i in _top_level(comps) if i.op == "fusion"]


def reduced_extent(inst: Instruction, shapes: dict[str, tuple[int, ...]]) -> int:
    """How many elements each output element of a reduce sums over."""
    dims = [int(d) for d in (inst.attr("dimensions") or "{}").strip("{}").split(",") if d]
    operand = shapes.get(inst.operands[0], ())
    return math.prod(operand[d] for d in dims if d < len(operand))


def work_in_writes(text: str, long_reduce: int = LONG_REDUCE) -> list[str]:
    """Fusions that write an array in place (a scatter or dynamic-update-slice: the KV cache write) and also
    compute a dot, a convolution or a reduce over >= `long_reduce` elements: "fusion: what" per finding."""
    findings = []
    for fusion, body in fusions(text):
        if not any(i.op in WRITES for i in body):
            continue
        shapes = {i.name: i.arrays[0][1] for i in body if len(i.arrays) == 1}
        for inst in body:
            if inst.op in ("dot", "convolution"):
                findings.append(f"{fusion.name}: {inst.op} {inst.name}")
            elif inst.op == "reduce" and (n := reduced_extent(inst, shapes)) >= long_reduce:
                findings.append(f"{fusion.name}: reduce {inst.name} over {n} elements")
    return findings


def whole_cache_copies(text: str, cache_elements: int) -> list[str]:
    """Instructions outside fusion bodies that produce a new array of a cache's size: a `copy`, or a fusion that
    is not an in-place write (its body holds no scatter / dynamic-update-slice). The donated cache updated in place
    is neither."""
    comps = parse(text)
    found = []
    for inst in _top_level(comps):
        if not any(math.prod(dims) == cache_elements and dims for _, dims in inst.arrays):
            continue
        if inst.op == "copy":
            found.append(f"{inst.name}: copy {inst.shape}")
        elif inst.op == "fusion" and not any(i.op in WRITES for i in _called(comps, inst.attr("calls").lstrip("%"))):
            found.append(f"{inst.name}: fusion {inst.shape}")
    return sorted(found)


def fusion_counts(text: str) -> dict[str, int]:
    """Fusions by kind (kLoop, kInput, kCustom, ...) and in all: each is one kernel launch or more."""
    kinds = collections.Counter(f.attr("kind") for f, _ in fusions(text))
    return dict(sorted(kinds.items())) | {"total": sum(kinds.values())}


def reduced_precision_dots(text: str) -> list[str]:
    """f32 dots that may run below IEEE f32: XLA:GPU runs an f32 dot of DEFAULT (or HIGH) precision as TF32 (or
    bf16 passes); `Precision.HIGHEST` prints `operand_precision={highest,highest}` and an explicit f32 algorithm
    prints `algorithm=dot_f32_f32_f32`. Dots of other dtypes are not reported."""
    found = []
    for insts in parse(text).values():
        shapes = {i.name: i.arrays[0] for i in insts if len(i.arrays) == 1}
        for inst in insts:
            if inst.op != "dot":
                continue
            operand_types = {shapes[o][0] for o in inst.operands[:2] if o in shapes}
            if "f32" not in operand_types:
                continue
            algorithm = inst.attr("algorithm")
            precision = inst.attr("operand_precision") or "{default,default}"
            if algorithm in ("dot_f32_f32_f32",) or (algorithm is None and precision == "{highest,highest}"):
                continue
            found.append(f"{inst.name}: {inst.shape} algorithm={algorithm} operand_precision={precision}")
    return found
