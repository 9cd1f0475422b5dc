"""The device side of LoRA: `models/lora.py`'s stacked slot arrays for one runner, written one slot at a time.

`max_loras + 1` slots per target projection, shaped for the runner's (possibly padded) model, with rank
`max_lora_rank`; slot 0 stays zero ("no adapter"). An adapter of lower rank fills the first r columns of A and
rows of B (the rest stay zero: exact), and one that targets only some projections leaves the others zero. Writing
a slot is one jitted call over every projection with the slot index traced and the arrays donated, so it
compiles once and updates in place; the step reads the arrays as an argument, so nothing else recompiles.

Under tensor parallelism A and B shard like the weight they modify (`sharding.partition`): a column-parallel
projection (q/k/v/gate/up, output split) keeps A whole and splits B's output axis; a row-parallel one (o/down,
input split) splits A's input axis and keeps B whole, so XLA sums the [T, S*r] partial products with one small
all-reduce. The padding `pad_for_tensor_parallel` adds to heads and MLP width is zeros at the end of those axes,
so an adapter is padded the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from inference.lora.peft import LoRAAdapter
from models.config import ModelConfig
from models.lora import LoRAWeights, empty_slots, target_shapes


def _write_slot(arrays: dict[str, LoRAWeights], slot: jax.Array, new: dict[str, LoRAWeights]
                ) -> dict[str, LoRAWeights]:
    return {name: LoRAWeights(a=w.a.at[slot].set(new[name].a.astype(w.a.dtype)),
                              b=w.b.at[slot].set(new[name].b.astype(w.b.dtype)),
                              scaling=w.scaling.at[slot].set(new[name].scaling))
            for name, w in arrays.items()}


class LoRASlots:
    def __init__(self, config: ModelConfig, *, max_loras: int, max_rank: int, dtype=jnp.float32,
                 mesh: jax.sharding.Mesh | None = None):
        """`config`: the runner's model config (the padded one under tensor parallelism)."""
        self.shapes = target_shapes(config)
        if not self.shapes:
            raise ValueError(f"model {config.name} has no projection LoRA can adapt (q/k/v/o/gate/up/down)")
        self.num_slots = max_loras + 1
        self.max_rank = max_rank
        self.dtype = dtype
        shardings = None if mesh is None else self._shardings(mesh)
        zeros = jax.jit(lambda: empty_slots(self.shapes, self.num_slots, max_rank, dtype), out_shardings=shardings)
        self.arrays: dict[str, LoRAWeights] = zeros()
        self._write = jax.jit(_write_slot, donate_argnums=(0,), out_shardings=shardings)

    def _shardings(self, mesh: jax.sharding.Mesh) -> dict[str, LoRAWeights]:
        from jax.sharding import NamedSharding, PartitionSpec as P

        from sharding.partition import partition_spec

        out = {}
        for name, shape in self.shapes.items():
            spec = tuple(partition_spec(name, shape, mesh)) + (None, None)
            out[name] = LoRAWeights(a=NamedSharding(mesh, P(None, spec[0], None)),
                                    b=NamedSharding(mesh, P(None, None, spec[1])), scaling=NamedSharding(mesh, P()))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every slot array, summed over devices' shares."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.arrays))

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put `adapter` into `slot` (1..max_loras), or zero it (None)."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.num_slots - 1}")
        new = {}
        for name, (d_in, d_out) in self.shapes.items():
            a = np.zeros((d_in, self.max_rank), np.float32)
            b = np.zeros((self.max_rank, d_out), np.float32)
            scaling = 0.0
            if adapter is not None and name in adapter.weights:
                wa, wb = adapter.weights[name]
                a[:wa.shape[0], :wa.shape[1]] = wa
                b[:wb.shape[0], :wb.shape[1]] = wb
                scaling = adapter.scaling
            new[name] = LoRAWeights(a=a, b=b, scaling=np.float32(scaling))
        self.arrays = self._write(self.arrays, np.int32(slot), new)

    def num_compilations(self) -> int:
        """Compiled variants of the slot write (1 after the first load: every later load reuses it)."""
        return self._write._cache_size()
