"""Generate PyTorch pipelining compute-only CSVs (run in a venv with torch 2.13)."""
import sys
import torch.distributed.pipelining.schedules as S

class Stage:
    def __init__(self, idx, num_stages, group_size, group_rank):
        self.stage_index, self.num_stages = idx, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = idx == 0, idx == num_stages - 1
        self.submod = None
    def has_backward(self): return True

out = sys.argv[1]
cases = [("GPipe", S.ScheduleGPipe, 1, 4, 8), ("1F1B", S.Schedule1F1B, 1, 4, 8),
         ("Interleaved1F1B", S.ScheduleInterleaved1F1B, 2, 4, 8), ("LoopedBFS", S.ScheduleLoopedBFS, 2, 4, 8),
         ("InterleavedZeroBubble", S.ScheduleInterleavedZeroBubble, 2, 4, 8),
         ("ZBVZeroBubble", S.ScheduleZBVZeroBubble, 2, 4, 8), ("DualPipeV", S.ScheduleDualPipeV, 2, 4, 8),
         ("Interleaved1F1B_p2m6", S.ScheduleInterleaved1F1B, 2, 2, 6), ("ZBVZeroBubble_p2m3", S.ScheduleZBVZeroBubble, 2, 2, 3)]
for name, cls, per_rank, p, m in cases:
    n = per_rank * p
    if per_rank == 1:
        sched = cls(Stage(0, n, p, 0), n_microbatches=m)
    else:
        if name.startswith(("ZBV", "DualPipe")):
            stages = [Stage(0, n, p, 0), Stage(n - 1, n, p, 0)]
        else:
            stages = [Stage(r * p, n, p, 0) for r in range(per_rank)]
        sched = cls(stages, n_microbatches=m)
    path = f"{out}/torch_{name}.csv"
    import csv
    import re
    order = sched.pipeline_order if hasattr(sched, "pipeline_order") else sched._get_pipeline_order()
    if name == "DualPipeV":  # also keep PyTorch's lowered form, with comms and overlapped pairs
        sched._dump_csv(f"{out}/torch_DualPipeV_comms.csv")
    compute = re.compile(r"^\d+[FIWB]\d+$")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for rank in sorted(order):
            row = []
            for a in order[rank]:
                if a is None:
                    continue
                text = str(a)
                if text.endswith("OVERLAP_F_B"):  # "(0F7;7B3)OVERLAP_F_B": two consecutive actions
                    row += text[1:text.index(")")].split(";")
                elif compute.match(text):
                    row.append(text)
            w.writerow(row)
    print("wrote", path)
