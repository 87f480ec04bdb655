"""Recurrent state: the part of a sequence that is not K/V.

A hybrid model (qwen35) keeps K/V for its attention layers and, for each gated DeltaNet
layer, a fixed-size state that summarizes every token before it: a conv window (the last
d_conv - 1 inputs of the short convolution) and the delta rule's state matrix per head.
One sequence is both: its K/V (edgeinfer.kv.contiguous.KVCache or one SequenceKV of the
paged pool) carries a `RecurrentState` as `kv.recurrent`, advanced by the same forward
passes, forked, cut back and released with it.

K/V can be cut back to any token; a state cannot. It can only be put back to a point it
kept a snapshot of. So a sequence answers "how far back can I go?" instead of the callers
assuming any token: `truncate(n)` restores the latest snapshot at or before n (the zero
state at 0) and reports the point it reached, and the K/V are cut to the same point.

Snapshots are taken inside a forward pass, at token counts asked for beforehand
(`keep_at`): the kernels copy the state after those tokens (kernels_cpu/delta_net.py,
`snap_at`). Three kinds:
- rollback points (`keep_rollback`): every token of a speculative verify pass, so rejected
  drafts roll the state back; dropped as soon as the next forward pass starts past them.
- kept points (`keep_at`): turn ends, for the prefix cache (a regenerate, an edit of the last
  message, a resent history), at most `max_kept` of them (the oldest go first), so the memory
  they take is bounded: max_kept x `nbytes`.
- block marks (`mark_blocks`): in a paged sequence, the state at every `every` blocks and
  at the last block boundary each forward pass crosses (the end of every prefill chunk, of
  the prompt's full blocks, each block a decode completes). The prefix cache takes them
  (`take_mark`) as it registers those blocks, so the state goes along its hash chain
  (edgeinfer.kv.state_cache); marks nobody takes are dropped by the next pass.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edgeinfer.models.config import ModelConfig

MAX_KEPT = 4  # kept snapshots per sequence (turn ends): memory max_kept x the state's size


class RecurrentStateError(Exception):
    """A request a recurrent state cannot serve (a context shift, say)."""


class RecurrentState:
    """The recurrent layers' state of one sequence, and its snapshots."""

    def __init__(self, config: "ModelConfig", max_kept: int = MAX_KEPT) -> None:
        dn = config.delta_net
        assert dn is not None, "a recurrent state needs the model's DeltaNet shape"
        self.config = config
        self.layers = tuple(i for i in range(config.n_layer) if config.is_recurrent(i))
        # conv[layer]: (d_conv - 1, conv_dim); ssm[layer]: (n_v_heads, head_v_dim, head_k_dim)
        self.conv = {i: np.zeros(dn.conv_state_shape, np.float32) for i in self.layers}
        self.ssm = {i: np.zeros(dn.ssm_state_shape, np.float32) for i in self.layers}
        self.n_tokens = 0  # tokens the state summarizes (once the current forward pass ends)
        self.max_kept = max_kept
        # token count -> ({layer: conv}, {layer: ssm}); kept: turn ends (LRU), rollback: transient
        self.kept: OrderedDict[int, tuple[dict, dict]] = OrderedDict()
        self.rollback: dict[int, tuple[dict, dict]] = {}
        self._want_kept: set[int] = set()
        self._want_rollback: set[int] = set()
        self._chunk: tuple[int, int] = (0, 0)  # (start, n) of the forward pass in progress
        self._taking: dict[int, tuple[dict, dict]] = {}
        self.mark_block = 0  # block size of the paged sequence whose boundaries are marked (0: none)
        self.mark_every = 0  # ... and every how many tokens (a multiple of it) within a pass
        self.marks: dict[int, tuple[dict, dict]] = {}
        self._want_marks: set[int] = set()

    # -- the forward pass ------------------------------------------------------------------------
    def begin(self, start: int, n: int) -> None:
        """A forward pass of n tokens after `start` begins (the sequence's append)."""
        self.rollback = {m: s for m, s in self.rollback.items() if m > start}  # behind: never needed
        self._want_rollback = {m for m in self._want_rollback if m > start}
        self._chunk = (start, n)
        self._taking = {}
        self.n_tokens = start + n
        bs, every = self.mark_block, self.mark_every
        self.marks = {m: s for m, s in self.marks.items() if m > start - bs}
        self._want_marks = set()
        if bs and (start + n) // bs * bs > start:
            self._want_marks = {(start + n) // bs * bs, *range((start // every + 1) * every, start + n + 1, every)}

    def snap_at(self) -> np.ndarray:
        """Token counts 1..n within the current pass after which the kernels copy the state."""
        start, n = self._chunk
        want = {m - start for m in self._want_kept | self._want_rollback if start < m <= start + n}
        want |= {m - start for m in self._want_marks}
        return np.array(sorted(want), dtype=np.int64)

    def put_snapshots(self, layer: int, conv: np.ndarray, ssm: np.ndarray) -> None:
        """The kernels' copies for `layer`, in snap_at() order."""
        start = self._chunk[0]
        for j, rel in enumerate(self.snap_at()):
            convs, ssms = self._taking.setdefault(start + int(rel), ({}, {}))
            convs[layer], ssms[layer] = conv[j], ssm[j]
        if layer == self.layers[-1]:  # the last recurrent layer: the snapshots are complete
            for m, snap in self._taking.items():
                if m in self._want_rollback:
                    self.rollback[m] = snap
                if m in self._want_kept:
                    self._keep(m, snap)
                if m in self._want_marks:
                    self.marks[m] = snap
            self._taking = {}

    # -- what the sequence may be cut back to ------------------------------------------------------
    def keep_at(self, n: int) -> None:
        """Keep a snapshot after n tokens (a turn end) when a forward pass crosses it."""
        if n == self.n_tokens and n > 0:
            self._keep(n, self._copy())
        elif n > self.n_tokens:
            self._want_kept.add(n)

    def keep_rollback(self, start: int, stop: int) -> None:
        """The next forward pass may be cut back to any count in start..stop (speculative
        verify): keep the state after each of its tokens until a later pass goes past them."""
        if start == self.n_tokens:
            self.rollback[start] = self._copy()
        self._want_rollback |= set(range(start + 1, stop + 1))

    def mark_blocks(self, block_size: int, every: int) -> None:
        """Mark every `every` blocks and the last block boundary each forward pass crosses."""
        self.mark_block, self.mark_every = block_size, block_size * max(1, every)

    def take_mark(self, m: int) -> tuple[dict, dict] | None:
        """The state after m tokens if a forward pass marked it (the snapshot stays shared)."""
        return self.marks.pop(m, None)

    def restore(self, m: int, snap: tuple[dict, dict]) -> None:
        """Put the state to `snap`, the state after m tokens (a snapshot of the prefix cache);
        it is kept as a point this sequence can be cut back to."""
        convs, ssms = snap
        for i in self.layers:
            assign(self.conv[i], convs[i])
            assign(self.ssm[i], ssms[i])
        self.n_tokens = m
        self.rollback.clear()
        self.marks.clear()
        self._want_rollback = set()
        self._want_kept = {p for p in self._want_kept if p > m}
        self.kept = OrderedDict((p, s) for p, s in self.kept.items() if p < m)
        self._keep(m, snap)

    def points(self) -> list[int]:
        """Token counts this state can be put back to (0 always)."""
        return sorted({0, self.n_tokens, *self.kept, *self.rollback})

    def reachable(self, n: int) -> int:
        """The largest count <= n this state can be put back to."""
        return max(p for p in self.points() if p <= n)

    def truncate(self, n: int) -> int:
        """Put the state back to reachable(n); returns that count."""
        m = self.reachable(max(0, n))
        if m == self.n_tokens:
            pass
        elif m == 0:
            for i in self.layers:
                self.conv[i].fill(0)
                self.ssm[i].fill(0)
        else:
            convs, ssms = self.kept[m] if m in self.kept else self.rollback[m]
            for i in self.layers:
                assign(self.conv[i], convs[i])
                assign(self.ssm[i], ssms[i])
        self.n_tokens = m
        self.kept = OrderedDict((p, s) for p, s in self.kept.items() if p <= m)
        self.rollback = {p: s for p, s in self.rollback.items() if p <= m}
        self.marks = {p: s for p, s in self.marks.items() if p <= m}
        self._want_kept = {p for p in self._want_kept if p > m}
        self._want_rollback = set()
        return m

    def fork(self) -> "RecurrentState":
        """An independent copy (n > 1 choices, a branch of the conversation): snapshots shared
        (they are never written after they are taken)."""
        child = RecurrentState.__new__(RecurrentState)
        child.__dict__.update(self.__dict__)
        child.conv = {i: a.copy() for i, a in self.conv.items()}
        child.ssm = {i: a.copy() for i, a in self.ssm.items()}
        child.kept = OrderedDict(self.kept)
        child.rollback = dict(self.rollback)
        child.marks = dict(self.marks)
        child._want_kept, child._want_rollback = set(self._want_kept), set(self._want_rollback)
        child._taking = {}
        return child

    def reset(self) -> None:
        self.truncate(0)
        self.kept.clear()
        self.rollback.clear()
        self.marks.clear()
        self._want_kept.clear()

    # -- saving ------------------------------------------------------------------------------------
    def export(self) -> dict[str, np.ndarray]:
        """The current state as named arrays (saved sessions): conv.L / ssm.L per layer."""
        out = {f"conv.{i}": host_copy(self.conv[i]) for i in self.layers}
        out.update({f"ssm.{i}": host_copy(self.ssm[i]) for i in self.layers})
        return out

    def load(self, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        """Set the state from `export`'s arrays (shapes checked: ValueError)."""
        for i in self.layers:
            for name, dst in ((f"conv.{i}", self.conv[i]), (f"ssm.{i}", self.ssm[i])):
                a = np.asarray(arrays.get(name, np.zeros(0)))
                if a.shape != tuple(dst.shape):
                    raise ValueError(f"saved state {name} has shape {a.shape}, expected {tuple(dst.shape)}")
                assign(dst, a)
        self.n_tokens = n_tokens
        self.kept.clear()
        self.rollback.clear()
        self.marks.clear()

    # -- accounting --------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the live state (one snapshot costs the same)."""
        return sum(a.nbytes for a in self.conv.values()) + sum(a.nbytes for a in self.ssm.values())

    @property
    def snapshot_bytes(self) -> int:
        return (len(self.kept) + len(self.rollback) + len(self.marks)) * self.nbytes

    # -- internals ---------------------------------------------------------------------------------
    def _copy(self) -> tuple[dict, dict]:
        return ({i: a.copy() for i, a in self.conv.items()}, {i: a.copy() for i, a in self.ssm.items()})

    def _keep(self, m: int, snap: tuple[dict, dict]) -> None:
        self._want_kept.discard(m)
        self.kept[m] = snap
        self.kept.move_to_end(m)
        while len(self.kept) > self.max_kept:
            self.kept.popitem(last=False)


# A layer's arrays are numpy, or GPUArrays once an offloaded layer ran there
# (edgeinfer.backends.cuda_recurrence): these four work on either.
def assign(dst, src) -> None:
    """dst[...] = src, across host and VRAM."""
    if isinstance(dst, np.ndarray):
        dst[...] = src if isinstance(src, np.ndarray) else src.get()
    elif isinstance(src, np.ndarray):
        dst.set(np.ascontiguousarray(src, np.float32))
    else:
        from edgeinfer.kernels_cuda.launch import copy_rows_between

        copy_rows_between(dst, 0, src, 0, dst.shape[0])


def host_copy(a) -> np.ndarray:
    return a.copy() if isinstance(a, np.ndarray) else a.get()


def host_snapshot(snap: tuple[dict, dict]) -> tuple[dict, dict]:
    """A snapshot with every layer's arrays in host memory (the state cache keeps them there)."""
    convs, ssms = snap
    if all(isinstance(a, np.ndarray) for a in (*convs.values(), *ssms.values())):
        return snap
    return {i: host_copy(a) for i, a in convs.items()}, {i: host_copy(a) for i, a in ssms.items()}


def state_of(kv) -> RecurrentState | None:
    """The sequence's recurrent state, or None for a model with K/V only."""
    return getattr(kv, "recurrent", None)


def state_nbytes(config: "ModelConfig") -> int:
    """Bytes of one sequence's recurrent state (and of each snapshot of it)."""
    dn = config.delta_net
    n = sum(1 for i in range(config.n_layer) if config.is_recurrent(i))
    return 4 * n * (int(np.prod(dn.conv_state_shape)) + int(np.prod(dn.ssm_state_shape)))


def new_state(config: "ModelConfig") -> RecurrentState | None:
    """A fresh state for a sequence of this model (None when every layer keeps K/V)."""
    return RecurrentState(config) if config.has_recurrent else None


def keep_rollback(kv, start: int, stop: int) -> None:
    """Tell a sequence that the next forward pass (tokens start..stop) may be cut back to any
    of its tokens (a speculative verify pass). K/V can always be cut back: only a recurrent
    state needs to keep copies."""
    state = state_of(kv)
    if state is not None:
        state.keep_rollback(start, stop)


def keep_at(kv, n: int) -> None:
    """Tell a sequence to keep a snapshot after n tokens (a turn end) for later reuse."""
    state = state_of(kv)
    if state is not None:
        state.keep_at(n)
