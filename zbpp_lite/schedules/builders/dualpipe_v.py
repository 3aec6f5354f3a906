"""dualpipe-v: DualPipeV, DualPipe cut in half onto the V placement, with overlapped F&B pairs.

Sources: DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437, section 3.2.1: DualPipe,
the overlapped forward-and-backward chunk); the "cut-in-half" V form by Sea AI Lab, published as
DualPipeV in DeepSeek's DualPipe repository and as PyTorch's ``ScheduleDualPipeV``. The V
placement is that of ZB-V (Qi et al., arXiv 2405.15362, section 3): p ranks, 2p stages, rank r
holding stage r (chunk 0, going down) and stage 2p-1-r (chunk 1, coming back), so rank 0 holds
the first and the last stage.

A rank's list, in DualPipeV's eight phases (p ranks, m microbatches, rank r; "F0" is the forward
of chunk 0, "B1" the backward of chunk 1, "F0&B1" an overlapped pair, :class:`Overlap`):

====  ==========================  ==================  =========================================
no.   phase                       times               backward kind
====  ==========================  ==================  =========================================
1     F0                          2(p - r - 1)
2     F0 F1                       r + 1
3     B1 W1 F1                    p - r - 1           split, its W right after
4     F0&B1  F1&B0  (main)        m - 2p + r + 1      full (BW); on the last rank the first
                                                      F0&B1 runs as F0 then BW1, not overlapped
5     B1  F1&B0                   p - r - 1           full (BW)
6     B1 B0                       r + 1               BW, the last r + 1 of them split (B; W
                                                      queued)
7     W  B0                       p - r - 1           B split, W queued; W the oldest queued
8     W                           r + 1               the queued W, oldest first
====  ==========================  ==================  =========================================

Each kind of each chunk takes the next microbatch in turn. DualPipeV needs m >= 2p (phase 4
runs at least once on rank 0); for m < 2p the builder refuses with a ValueError saying so.

What it achieves (simulated, T_comm = 0, m >= 2p). DualPipe's published bubble,
(PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and B its full backward (our T_B + T_W), is
(p - 1)(T_F&B + T_B - 2 T_W): it equals the makespan less the busy time of the last rank (the
rank with the most pairs; with the default T_F&B = T_F + T_BW every rank's) whenever
T_F = T_B, T_W <= T_F and max(T_F, T_BW) <= T_F&B <= T_F + T_BW. Where it does not apply: with
T_F != T_B a pair's two inputs arrive at different times and the pair waits for the later one
(T_F = 2, T_B = T_W = 1, p = 4: bubble 12, the form says 9); with T_W > T_F a W no longer fits the
gap it is placed in (the form undercounts, even goes negative); with T_F&B < max(T_F, T_BW) the
pair would be faster than its longer part, which no overlap gives; with T_comm > 0 the waits
depend on the transfers. Peak activation memory: 2p + 1 stage activations on every rank
(DualPipe's "PP + 1"; ZB-V holds 2p).

Unit costs with no overlap (T_F = T_B = T_W = 1, T_F&B = 3, p = 4, m = 8): makespan 54, the same
as PyTorch's own DualPipeV order with its pairs (tests/artifacts/torch_DualPipeV_comms.csv: the
same lists); PyTorch's compute-only CSV writes each pair as two actions, which need not wait for
each other's input: 51. A pair pays off once it overlaps (T_F&B = 2: makespan 44).
"""

from __future__ import annotations

from collections import defaultdict, deque

from ..ir import Action, Entry, Overlap, Schedule, v_placement
from ._common import assemble, check_sizes


class _Rank:
    """One rank's list under construction: the next microbatch per (kind, chunk), the queue of
    W deferred by split backwards (first in, first out)."""

    def __init__(self, num_ranks: int, rank: int):
        self.stage = (rank, 2 * num_ranks - 1 - rank)  # chunk 0, chunk 1
        self.row: list[Entry] = []
        self._next: dict[tuple[str, int], int] = defaultdict(int)
        self._weights: deque[Action] = deque()

    def _take(self, kind: str, chunk: int) -> int:
        j = self._next[kind, chunk]
        self._next[kind, chunk] += 1
        return j

    def f(self, chunk: int) -> Action:
        return Action("F", self.stage[chunk], self._take("F", chunk))

    def b(self, chunk: int, split: bool = False) -> Action:
        """The chunk's next backward: BW, or with ``split`` B with its W queued."""
        j = self._take("B", chunk)
        if split:
            self._weights.append(Action("W", self.stage[chunk], j))
            return Action("B", self.stage[chunk], j)
        return Action("BW", self.stage[chunk], j)

    def w(self) -> Action:
        return self._weights.popleft()

    def add(self, *entries: Entry) -> None:
        self.row.extend(entries)


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on p = ``num_ranks`` ranks and 2p stages (V placement), m = ``num_microbatches``.

    Returns:
        A :class:`Schedule` whose lists hold :class:`Overlap` pairs (F with a full backward BW)
        besides F, B, W and BW actions; 3 * 2p * m actions, m F per stage.

    Raises:
        ValueError: sizes that are not integers >= 1, or m < 2p (the message gives the least m
            that works for this p).
    """
    check_sizes("dualpipe-v", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ValueError(
            f"dualpipe-v needs at least 2p = {2 * p} microbatches on {p} rank(s), got m={m}: its main "
            f"phase needs the V filled twice over; use m >= {2 * p}, or zb-v, which works for any m"
        )
    rows = []
    for r in range(p):
        k = _Rank(p, r)
        last = r == p - 1
        # 1. warm-up: F0 x 2(p-r-1)
        for _ in range(2 * (p - r - 1)):
            k.add(k.f(0))
        # 2. F0 F1 x (r+1)
        for _ in range(r + 1):
            k.add(k.f(0), k.f(1))
        # 3. B1 W1 F1 x (p-r-1), each backward split with its W right after
        for _ in range(p - r - 1):
            k.add(k.b(1, split=True), k.w(), k.f(1))
        # 4. main: F0&B1 F1&B0 x (m-2p+r+1); the last rank runs its first F0&B1 as two actions
        for i in range(m - 2 * p + r + 1):
            if i == 0 and last:
                k.add(k.f(0), k.b(1))
            else:
                k.add(Overlap(k.f(0), k.b(1)))
            k.add(Overlap(k.f(1), k.b(0)))
        # 5. B1 F1&B0 x (p-r-1)
        for _ in range(p - r - 1):
            k.add(k.b(1), Overlap(k.f(1), k.b(0)))
        # 6. B1 B0 x (r+1); the last r+1 backwards split, their W queued
        split_from = r + 1  # of the phase's 2(r+1) backwards, the last r+1 are split
        for i in range(r + 1):
            k.add(k.b(1, split=2 * i >= split_from), k.b(0, split=2 * i + 1 >= split_from))
        # 7. W B0 x (p-r-1), the W the oldest queued, the B0 split
        for _ in range(p - r - 1):
            k.add(k.w(), k.b(0, split=True))
        # 8. W x (r+1), the rest of the queue
        for _ in range(r + 1):
            k.add(k.w())
        rows.append(k.row)
    return assemble("dualpipe-v", rows, v_placement(p), m)
