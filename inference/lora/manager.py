"""The engine's LoRA bookkeeping: adapters by name and id on the host, and which one sits in which device slot.

`register` loads and validates a request's adapter the first time its id is seen (so a bad adapter is the
submitting request's ValueError, before it is queued); the host copy stays, so an evicted adapter reloads without
touching the disk. `slots_for` gives each sequence of a step its slot, loading adapters that are not resident into
a free slot or the least recently used one that no running sequence needs. The scheduler admits a sequence only
while the running sequences need at most `max_loras` adapters (`fits`), so a slot is always available.
"""

from __future__ import annotations

import collections
import logging
import os

import numpy as np

from inference.lora.peft import LoRAAdapter, load_peft_adapter
from inference.lora.request import LoRARequest
from inference.lora.slots import LoRASlots
from models.config import ModelConfig

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, slots: LoRASlots, config: ModelConfig, *, max_loras: int, max_rank: int):
        """`config`: the base model's real (unpadded) config, which adapters are validated against."""
        self.slots = slots
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.adapters: dict[int, LoRAAdapter] = {}
        self.ids: dict[str, int] = {}  # adapter name -> id
        self.resident: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot, LRU first
        self.num_loads = 0  # slot writes so far (loads, reloads after eviction, updates)

    def register(self, request: LoRARequest) -> int:
        """The adapter's id, loading and validating it on first sight; ValueError for a bad adapter or a name/id
        pair that contradicts an earlier one."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest(lora_name, lora_int_id, lora_path), got "
                             f"{type(request).__name__}")
        known = self.ids.get(request.lora_name)
        if known is not None and known != request.lora_int_id:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is registered with id {known}, not "
                             f"{request.lora_int_id}; give each adapter one id")
        if request.lora_int_id in self.adapters:
            known_adapter = self.adapters[request.lora_int_id]
            if known_adapter.name != request.lora_name:
                raise ValueError(f"LoRA id {request.lora_int_id} is adapter {known_adapter.name!r}, not "
                                 f"{request.lora_name!r}; give each adapter its own lora_int_id")
            if known_adapter.path and request.lora_path and \
                    os.path.realpath(known_adapter.path) != os.path.realpath(request.lora_path):
                raise ValueError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) was loaded from "
                                 f"{known_adapter.path}, not {request.lora_path}; new weights under a known name go "
                                 "through update_lora, another adapter needs its own name and id")
            return request.lora_int_id
        adapter = load_peft_adapter(request.lora_path, self.config, self.max_rank, name=request.lora_name)
        self.adapters[request.lora_int_id] = adapter
        self.ids[request.lora_name] = request.lora_int_id
        return request.lora_int_id

    def resolve(self, name_or_id: str | int) -> int:
        """An adapter's id from its name or id; ValueError if it was never registered."""
        if isinstance(name_or_id, bool) or not isinstance(name_or_id, (str, int)):  # True would read as id 1
            raise ValueError(f"a LoRA adapter is named by its name (str) or id (int), got {name_or_id!r}")
        lora_id = self.ids.get(name_or_id) if isinstance(name_or_id, str) else name_or_id
        if lora_id not in self.adapters:
            raise ValueError(f"no LoRA adapter {name_or_id!r} is loaded; known: {sorted(self.ids)}")
        return lora_id

    def remove(self, lora_id: int | str) -> None:
        """Forget an adapter (its host copy, its name and its slot, which becomes free); the caller makes sure no
        sequence still runs with it (`Engine.remove_lora`). Its id is never reused by the server that removed it:
        the prefix cache may still hold pages keyed by it."""
        lora_id = self.resolve(lora_id)  # a name names its id: the maps below are keyed by ids
        adapter = self.adapters.pop(lora_id)
        if self.ids.get(adapter.name) == lora_id:
            del self.ids[adapter.name]
        self.resident.pop(lora_id, None)

    @staticmethod
    def fits(lora_id: int, active: set[int], max_loras: int) -> bool:
        """Whether a sequence with adapter `lora_id` (0: none) may run beside sequences needing `active`."""
        return lora_id == 0 or lora_id in active or len(active) < max_loras

    def slots_for(self, lora_ids: list[int], busy: set[int]) -> list[int]:
        """The slot of each id (0 for no adapter), loading missing adapters; `busy`: ids running sequences use,
        which are never evicted."""
        out = []
        for lora_id in lora_ids:
            if lora_id == 0:
                out.append(0)
                continue
            slot = self.resident.get(lora_id)
            if slot is None:
                slot = self._free_slot(busy | set(lora_ids))
                self.slots.write(slot, self.adapters[lora_id])
                self.num_loads += 1
                self.resident[lora_id] = slot
            self.resident.move_to_end(lora_id)
            out.append(slot)
        return out

    def _free_slot(self, keep: set[int]) -> int:
        used = set(self.resident.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        for lora_id in self.resident:  # least recently used first
            if lora_id not in keep:
                log.info("evicting LoRA adapter %s from slot %d", self.adapters[lora_id].name, self.resident[lora_id])
                return self.resident.pop(lora_id)
        raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters of running sequences; the scheduler "
                           "should not have admitted another adapter")

    def update(self, name_or_id: str | int, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Replace some or all of an adapter's (a [in, r], b [r, out]) pairs in place (same rank and projections);
        a resident adapter's slot is rewritten, with no recompilation."""
        lora_id = self.resolve(name_or_id)
        old = self.adapters[lora_id]
        new = dict(old.weights)
        if not isinstance(weights, dict):
            raise ValueError(f"update_lora: weights must map projection names to (a, b) pairs, got "
                             f"{type(weights).__name__}")
        for name, pair in weights.items():
            if name not in old.weights:
                raise ValueError(f"update_lora: adapter {old.name!r} does not adapt {name}; it adapts "
                                 f"{sorted(old.weights)}")
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"update_lora: {name} must be an (a, b) pair of arrays")
            a, b = (np.asarray(x, np.float32) for x in pair)
            want_a, want_b = old.weights[name][0].shape, old.weights[name][1].shape
            if a.shape != want_a or b.shape != want_b:
                raise ValueError(f"update_lora: {name} got a {list(a.shape)}, b {list(b.shape)}; the adapter needs "
                                 f"a {list(want_a)} and b {list(want_b)} ([in, r] and [r, out])")
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                raise ValueError(f"update_lora: {name} holds NaN or infinite values")
            new[name] = (a, b)
        adapter = LoRAAdapter(name=old.name, rank=old.rank, scaling=old.scaling, weights=new,
                              base_model_name=old.base_model_name, path=old.path)
        self.adapters[lora_id] = adapter
        if lora_id in self.resident:
            self.slots.write(self.resident[lora_id], adapter)
            self.num_loads += 1
