"""Recurrent-state snapshots along the prefix cache's hash chain.

K/V blocks are reusable by any later request whose prompt starts with the same tokens
(edgeinfer.kv.prefix_cache). A hybrid model's recurrent state is one summary of every
token before it, so cached K/V blocks are only usable up to a point where the state after
exactly those tokens is known. This cache keeps such states under the hash of the block
they end: the K/V of blocks 0..j-1 plus the state under hash j-1 are a complete sequence
of j blocks, whichever conversation computed them.

Which states: the block marks of edgeinfer.kv.recurrent. A prompt leaves one every
`every_blocks` blocks (EVERY_BLOCKS: 256 tokens at the session's 16-token blocks) and one
at the end of its last full block; decoding leaves one per block it completes. A resent
history, another conversation with the same system prompt, or a switch back to an earlier
chat then prefills only what follows the last such point (at most 255 tokens of a shared
prefix are prefilled again).

Bounded: at most `max_entries` snapshots, least recently used first out. A snapshot costs
the state's size (RecurrentState.nbytes), so the bound is set from a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from edgeinfer.kv.block_pool import BlockHash

Snapshot = tuple[dict, dict]  # ({layer: conv window}, {layer: delta-rule state}), never written

STATE_CACHE_BYTES = 512 << 20  # default budget for snapshots of one model
MIN_ENTRIES, MAX_ENTRIES = 4, 64
EVERY_BLOCKS = 16  # a state every this many blocks of a prompt


class StateCache:
    """Block hash -> the recurrent state after that block (LRU, bounded)."""

    def __init__(self, snapshot_bytes: int, budget_bytes: int = STATE_CACHE_BYTES) -> None:
        self.snapshot_bytes = max(1, int(snapshot_bytes))
        self.max_entries = max(MIN_ENTRIES, min(MAX_ENTRIES, int(budget_bytes) // self.snapshot_bytes))
        self.every_blocks = EVERY_BLOCKS
        self._states: OrderedDict[BlockHash, Snapshot] = OrderedDict()
        self.hits = 0

    def put(self, block_hash: BlockHash, snap: Snapshot) -> None:
        self._states[block_hash] = snap
        self._states.move_to_end(block_hash)
        while len(self._states) > self.max_entries:
            self._states.popitem(last=False)

    def latest(self, hashes: Sequence[BlockHash]) -> tuple[int, Snapshot | None]:
        """(j, state) for the longest chain hashes[:j] with a state after its last block;
        (0, None) when there is none."""
        for j in range(len(hashes), 0, -1):
            snap = self._states.get(hashes[j - 1])
            if snap is not None:
                self._states.move_to_end(hashes[j - 1])
                self.hits += 1
                return j, snap
        return 0, None

    def __len__(self) -> int:
        return len(self._states)

    @property
    def nbytes(self) -> int:
        return len(self._states) * self.snapshot_bytes

    def stats(self) -> dict:
        return {"snapshots": len(self), "max_snapshots": self.max_entries, "snapshot_bytes": self.snapshot_bytes,
                "bytes": self.nbytes, "hits": self.hits}
