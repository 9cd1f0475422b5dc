"""State slots: the constant-size recurrent state of a hybrid model's state layers (Gated DeltaNet, Mamba2), one slot
per running sequence, beside the paged KV cache.

Why slots and not pages: a state layer's cache does not grow with the context; a sequence needs exactly one state
(conv window + recurrent state, `ModelConfig.state_cache_spec`) whatever its length, and a step reads and overwrites
it in place. So the device holds N slots per state layer (`RecurrentState`, `kernels_pallas/recurrent/layout.py`),
slot 0 the null slot padding rows read and write, and this module keeps the host bookkeeping: which sequence owns
which slot, and which device copies must run before the next step (`copy_state_slots`, as page copies do).

- A sequence gets a slot when it is admitted and gives it back when it finishes, is aborted or is preempted
  (preemption recomputes from the start or from a checkpoint, so nothing of the old state is needed). A fresh slot
  needs no clearing: a sequence with no context before its chunk starts from zeros (state_interface point 3).
- `fork(parent, child)` (the `n` samples of a prompt) gives the child a slot and queues a copy of the parent's state:
  unlike KV pages a state is overwritten by every step, so it cannot be shared copy-on-write.
- Prefix checkpoints: the state after the first m full pages of a prompt is copied into a checkpoint slot keyed by
  the chain hash of page m (`BlockManager`'s hash, which names the whole prefix, its LoRA root and the cache
  generation), so a later request whose KV prefix hit reaches page m can resume exactly there: its slot gets a copy
  of the checkpoint. A KV hit with no checkpoint at its end is cut back to the longest one that has one
  (`KVCacheManager.match_prefix(state_ok=...)`). Checkpoints live in the same pool as sequence slots and are
  evicted least recently used whenever a sequence or a newer checkpoint needs the slot, except that a sequence's
  newer checkpoint sends its previous one to the front of the line: under pressure the longest prefix of a prompt
  (what a repeated request hits) outlives its shorter ones (what a request sharing only part of it hits).

Speculative verification writes the state after each verified position of row i to the reserved slots
`spec_slot(i, j)` (`AttentionMetadata.state_spec_slots`); the sequence's own slot ends at its last draft, so when
drafts are rejected `keep_spec_state` queues a copy of the state at the accepted prefix into it.

Copies are queued in order and run before the next step as one gather-then-scatter (every source is read before
any destination is written), so `_queue` rewrites a copy whose source a pending copy writes to read that copy's
source instead, and drops a pending copy whose destination a later one overwrites: the batch then equals running
the copies one by one.
"""

from __future__ import annotations

import collections

from inference.engine.sequence import Sequence

NULL_SLOT = 0  # padding rows read and write it; never allocated


class OutOfStateSlotsError(RuntimeError):
    pass


class StateSlotManager:
    def __init__(self, num_slots: int, *, max_checkpoints: int | None = None, enable_prefix_caching: bool = True,
                 spec_rows: int = 0, num_spec: int = 0):
        """`num_slots` device slots including the null slot 0; `max_checkpoints`: most slots prefix checkpoints may
        hold at once (None: every slot no sequence holds); `spec_rows` x `num_spec`: the last slots, reserved for
        speculative verification's per-position states (`num_spec` drafts in up to `spec_rows` rows)."""
        self.spec_base = num_slots - spec_rows * num_spec
        self.num_spec = num_spec
        if self.spec_base < 2:
            raise ValueError(f"a state cache needs the null slot and at least one sequence slot, got {num_slots} "
                             "slots; raise kv_cache_memory_bytes or lower max_num_seqs")
        self.num_slots = num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.max_checkpoints = num_slots - 1 if max_checkpoints is None else max_checkpoints
        self.free_slots: collections.deque[int] = collections.deque(range(1, self.spec_base))
        self.owner: dict[Sequence, int] = {}
        self.checkpoints: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.pending_copies: list[tuple[int, int]] = []
        self.checkpoint_hits = 0
        self._last_saved: dict[Sequence, bytes] = {}  # each running sequence's latest checkpoint

    # ---- stats ------------------------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        """Slots a sequence could take now: free ones and evictable checkpoints."""
        return len(self.free_slots) + len(self.checkpoints)

    def can_allocate(self, count: int = 1) -> bool:
        return self.num_free_slots >= count

    # ---- sequences --------------------------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free_slots:
            return self.free_slots.popleft()
        if self.checkpoints:
            _, slot = self.checkpoints.popitem(last=False)
            return slot
        raise OutOfStateSlotsError("no free state slot and no checkpoint to evict")

    def allocate(self, seq: Sequence) -> int:
        """Give `seq` a slot (idempotent); its state starts from zeros unless a copy into it is queued."""
        if seq.state_slot != NULL_SLOT:
            return seq.state_slot
        try:
            slot = self._take()
        except OutOfStateSlotsError:
            raise OutOfStateSlotsError(f"sequence {seq.seq_id} needs a state slot but all {self.num_slots - 1} are "
                                       "held by running sequences; lower max_num_seqs or raise the cache budget")
        self.owner[seq] = seq.state_slot = slot
        return slot

    def release(self, seq: Sequence) -> None:
        """Return the sequence's slot (finish, abort, preemption). Queued copies into it stay harmless: whoever
        takes the slot next starts from zeros or gets a later copy, which supersedes them."""
        slot = self.owner.pop(seq, None)
        self._last_saved.pop(seq, None)
        seq.state_slot = NULL_SLOT
        if slot is not None:
            self.free_slots.append(slot)

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Give `child` a slot holding a copy of `parent`'s state (queued for before the next step)."""
        if parent.state_slot == NULL_SLOT:
            raise ValueError(f"fork: parent sequence {parent.seq_id} holds no state slot")
        slot = self.allocate(child)
        self._queue(parent.state_slot, slot)
        return slot

    def spec_slot(self, row: int, position: int) -> int:
        """Where verification writes the state after position `position` (< num_spec) of batch row `row`'s chunk."""
        return self.spec_base + row * self.num_spec + position

    def keep_spec_state(self, seq: Sequence, row: int, accepted: int) -> None:
        """After verifying `seq`'s drafts in batch row `row`: its slot holds the state after its last draft; with
        `accepted` < its drafts, the state after the accepted prefix (position `accepted`) replaces it."""
        self._queue(self.spec_slot(row, accepted), seq.state_slot)

    # ---- prefix checkpoints -----------------------------------------------------------------------------------
    def has_checkpoint(self, key: bytes) -> bool:
        return key in self.checkpoints

    def save_checkpoint(self, seq: Sequence, key: bytes) -> bool:
        """Copy `seq`'s current state into a checkpoint slot under `key` (the chain hash of the page its computed
        tokens end at). Only takes a free slot or the least recently used checkpoint's, never a sequence's. Returns
        whether a checkpoint was queued."""
        if not self.enable_prefix_caching or self.max_checkpoints < 1 or seq.state_slot == NULL_SLOT:
            return False
        prev = self._last_saved.get(seq)
        if prev in self.checkpoints and prev != key:
            self.checkpoints.move_to_end(prev, last=False)  # evicted first: this sequence's shorter prefix
        self._last_saved[seq] = key
        if key in self.checkpoints:
            self.checkpoints.move_to_end(key)
            return False
        if len(self.checkpoints) >= self.max_checkpoints or not self.free_slots:
            if not self.checkpoints:
                return False
            _, slot = self.checkpoints.popitem(last=False)
        else:
            slot = self.free_slots.popleft()
        self.checkpoints[key] = slot
        self._queue(seq.state_slot, slot)
        return True

    def restore(self, seq: Sequence, key: bytes) -> None:
        """Start `seq` (which holds a slot) from the checkpoint under `key`: a copy into its slot."""
        slot = self.checkpoints[key]
        self.checkpoints.move_to_end(key)
        self._queue(slot, seq.state_slot)
        self.checkpoint_hits += 1

    def reset_prefix_cache(self) -> int:
        """Forget every checkpoint (after a weight update); returns how many were freed."""
        freed = len(self.checkpoints)
        self.free_slots.extend(self.checkpoints.values())
        self.checkpoints.clear()
        return freed

    # ---- device copies ----------------------------------------------------------------------------------------
    def _queue(self, src: int, dst: int) -> None:
        for s, d in reversed(self.pending_copies):  # read what the pending copies will have written
            if d == src:
                src = s
                break
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d != dst]
        if src != dst:
            self.pending_copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) slot copies queued since the last call; run them on device before the next step."""
        copies, self.pending_copies = self.pending_copies, []
        return copies
