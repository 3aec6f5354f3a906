"""One suite over every transport: the lowered program's sends and receives carried by threads of one
process, by processes of one machine (``processes.connect``'s shared-memory rings over a real socket
pair, both ends here), or by a toy transport written below, give jax.grad's gradients. Across hosts
(JAX's distributed runtime) the same runs in tests/test_distributed.py, which launches two processes.
Tuple activations (test_byo_model's residual MLP) cross as their leaves."""

from __future__ import annotations

import threading

import jax
import pytest

import zbpp_lite as zb
from test_byo_model import DEVICES, _assert_close, _data, byo_parts, loss_fn, run_one_process_per_rank, whole_model_loss
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.runtime.transport import Threads

DELAY = 0.01  # seconds the toy transport holds every message


class Delayed(Threads):
    """A toy transport, as one would add one: every value reaches the receiver's inbox DELAY s after it
    was sent, from a timer thread (the sender never waits)."""

    def send(self, step, rank, key, value):
        threading.Timer(DELAY, Threads.send, (self, step, rank, key, value)).start()


def _run(transport: str, schedule: zb.Schedule, model: StagedModel, x, y) -> dict:
    """``{rank: StepResult}`` of one step over ``transport``."""
    if transport == "processes":
        return run_one_process_per_rank(model, schedule, lambda executor: executor.run(model.params, x, y))
    make = {"threads": Threads, "delayed": Delayed}[transport]
    result = PipelineExecutor(model, schedule, DEVICES[:2], transport=make()).run(model.params, x, y)
    return dict.fromkeys(range(2), result)


@pytest.mark.filterwarnings("ignore::zbpp_lite.runtime.executor.PlanMemoryWarning")  # zb-v planned at unit costs
@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
@pytest.mark.parametrize("transport", ["threads", "processes", "delayed"])
def test_every_transport_gives_jax_grads_gradients(transport, name):
    m = 4
    schedule = zb.build_schedule(name, 2, m, **({"costs": zb.Costs()} if name == "zb-v" else {}))
    model = StagedModel(byo_parts(schedule.num_stages), schedule.num_stages, loss_fn)
    x, y = _data(m)
    results = _run(transport, schedule, model, x, y)
    ref_loss, ref_grads = jax.value_and_grad(whole_model_loss)(model.params, x, y)
    assert results[schedule.placement[-1]].loss == pytest.approx(float(ref_loss), rel=1e-5)
    for s in range(schedule.num_stages):
        for i in model.parts[s]:
            _assert_close(results[schedule.placement[s]].grads[i], ref_grads[i])
    if transport == "delayed":  # every crossing waited for the toy transport's delay
        events = {str(e.action): e for e in results[0].timeline.events}
        assert events["1F0"].start - events["0F0"].end >= DELAY
