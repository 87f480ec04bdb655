"""SentencePiece-style BPE (`tokenizer.ggml.model = llama`) as llama.cpp runs it.

A port of `llm_tokenizer_spm_session`: split into UTF-8 characters (by lead byte, no
validation), then repeatedly merge the adjacent pair whose concatenation is a token with
the highest score (ties: leftmost), via a heap — O(n log n). Symbols that are not tokens
fall back to `<0xXX>` byte tokens. Spaces must already be escaped to U+2581.
"""

from __future__ import annotations

import heapq

from edgeinfer.errors import TokenizerError

_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # by the lead byte's high nibble


class SPMSession:
    def __init__(self, id_of: dict[bytes, int], scores: list[float], n_tokens: int) -> None:
        self.id_of = id_of
        self.scores = scores
        self.n_tokens = n_tokens
        self._byte_ids: dict[int, int] = {}

    def byte_token(self, b: int) -> int:
        tid = self._byte_ids.get(b)
        if tid is None:
            tid = self.id_of.get(f"<0x{b:02X}>".encode())
            if tid is None:
                tid = self.id_of.get(bytes((b,)))
            if tid is None:
                raise TokenizerError(f"vocabulary has no byte token for 0x{b:02X}")
            self._byte_ids[b] = tid
        return tid

    def encode(self, text: bytes, out: list[int]) -> None:
        starts: list[int] = []
        lens: list[int] = []
        off, n = 0, len(text)
        while off < n:
            length = min(_UTF8_LEN[text[off] >> 4], n - off)
            starts.append(off)
            lens.append(length)
            off += length
        count = len(starts)
        prev = list(range(-1, count - 1))
        nxt = list(range(1, count + 1))
        if count:
            nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        id_of, scores = self.id_of, self.scores

        def try_add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            size = lens[left] + lens[right]
            tid = id_of.get(text[starts[left]:starts[left] + size])
            if tid is None or tid >= self.n_tokens:
                return
            # max-heap on score, then the smaller left index first
            heapq.heappush(heap, (-scores[tid], left, right, size))

        for i in range(1, count):
            try_add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if lens[left] == 0 or lens[right] == 0 or lens[left] + lens[right] != size:
                continue
            lens[left] += lens[right]
            lens[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])

        i = 0 if count else -1
        while i != -1:
            piece = text[starts[i]:starts[i] + lens[i]]
            tid = id_of.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_token(b) for b in piece)
            i = nxt[i]
