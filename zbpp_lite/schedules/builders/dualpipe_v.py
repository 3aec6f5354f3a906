"""dualpipe-v: DualPipeV, DualPipe cut in half onto the V placement, with overlapped F&B pairs.

Sources: arXiv 2412.19437 section 3.2.1 (DualPipe, the overlapped F&B chunk); the V form by Sea AI Lab
(DualPipeV in DeepSeek's DualPipe repository, PyTorch's ``ScheduleDualPipeV``); the V placement of ZB-V
(arXiv 2405.15362 section 3: rank r holds stage r, chunk 0, and 2p-1-r, chunk 1). A rank's list runs the
eight phases commented in :func:`dualpipe_v` (warm-up F0, F0 F1, split B1 W1 F1, main F0&B1 F1&B0 pairs
with full backwards, then drains with queued W); each kind of each chunk takes the next microbatch.

Simulated (T_comm = 0, m >= 2p): DualPipe's bubble (PP/2 - 1)(F&B + B - 3W), here (p - 1)(T_F&B + T_B -
2 T_W), holds when T_F = T_B, T_W <= T_F and max(T_F, T_BW) <= T_F&B <= T_F + T_BW; with T_F != T_B a pair
waits for its later input (T_F = 2, T_B = T_W = 1, p = 4: 12, not 9); with T_W > T_F it undercounts.
Peak memory 2p + 1 stage activations per rank (DualPipe's "PP + 1"; ZB-V: 2p). Unit costs, T_F&B = 3,
p = 4, m = 8: makespan 54, as PyTorch's DualPipeV order (tests/artifacts/torch_DualPipeV_comms.csv);
pairs split into two actions: 51; T_F&B = 2: 44.
"""

from __future__ import annotations

from collections import defaultdict, deque

from ..ir import Action, Entry, Overlap, Schedule, v_placement
from ._common import assemble, check_sizes


class _Rank:
    """One rank's list under construction: next microbatch per (kind, chunk), and the FIFO of deferred W."""

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


def dualpipe_v(num_ranks: int, num_microbatches: int, overlap: bool = True) -> Schedule:
    """DualPipeV on p = ``num_ranks`` ranks and 2p stages (V placement), m = ``num_microbatches`` >= 2p.

    Args:
        overlap: keep each F&B pair as one :class:`Overlap` entry (costed T_F&B, both inputs awaited).
            ``False`` writes it as its two actions in order (PyTorch's compute-only CSV), so the F may start
            early: shorter where a pair saves nothing (unit costs, p = 4, m = 8: 51 against 54).

    Returns:
        A :class:`Schedule` of F, B, W, BW actions and (unless ``overlap=False``) :class:`Overlap` pairs
        of an F with a BW; 3 * 2p * m actions, m F per stage.

    Raises:
        ValueError: sizes that are not integers >= 1, or m < 2p (the message gives the least m).
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
    schedule = assemble("dualpipe-v", rows, v_placement(p), m)
    return schedule if overlap else schedule.split_pairs()
