"""Every system of the comparison, as the benchmark runs it, on 2 local workers for a few steps: so
that the benchmark cannot rot. A system whose package is missing skips, saying what to install
(the test command installs torchft and decent-dp)."""

import contextlib
import math
import tempfile

import pytest
import torch
from multiprocess import train_in_turn

from harness.compare import runner, systems, worker
from harness.tasks import byte_lm
from harness.tasks.byte_lm import ByteLM, ByteLMConfig
from harness.tasks.stdlib_text import StdlibText

TINY = ByteLMConfig(layers=1, width=32, heads=2, context=32)


def _config(system: str, steps: int = 6) -> worker.RunConfig:
    # Streaming DiLoCo syncs one of its 4 fragments every local_steps / 4 steps: 4 here, the
    # first prepared 2 steps earlier (tau = 2).
    local_steps = 16 if "streaming" in system else 2
    return worker.RunConfig(
        system=system,
        recipe=systems.Recipe(steps=steps, warmup=2, local_steps=local_steps),
        model=TINY,
        batch_size=4,
        eval_every=3,
        eval_windows=8,
    )


@pytest.fixture(scope="module")
def every_system() -> dict[str, dict]:
    """Every system this Python can run, on one pair of worker processes forked from the tests'
    preloaded server (tests/multiprocess.py), one system after the other; rank 0's results by
    system. The benchmark runs each in fresh interpreters of its own, for their peak memory."""
    configs = [_config(s) for s in systems.ALL if systems.available(s) is None]
    with contextlib.ExitStack() as stack:
        configs = [
            c.with_lighthouse(stack.enter_context(runner.lighthouse(2)))
            if c.system.startswith("torchft")
            else c
            for c in configs
        ]
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        return train_in_turn(worker.train, configs, 2, folder)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("system", systems.ALL)
def test_every_system_trains_two_workers_and_reports_its_heldout_loss(system, every_system):
    why_not = systems.available(system)
    if why_not:
        pytest.skip(why_not)
    result = every_system[system]
    history = result["history"]
    assert result["system"] == system and result["workers"] == 2
    assert history["step"] == [3, 6]
    assert all(math.isfinite(b) and 0 < b < 9 for b in history["heldout_bpb"]), history
    assert history["time"][0] < history["time"][1]
    assert result["step_ms"] > 0 and result["peak_rss_mib"] > 0


def test_ddp_on_two_workers_matches_one_process_on_both_batches(every_system):
    # An independent reference for the harness: two DDP workers with their own batches take the
    # step one process takes on both batches together, so the held-out loss is the same.
    steps = 6
    result = every_system["ddp"]
    assert result["history"]["step"][-1] == steps
    data = StdlibText.load()
    torch.manual_seed(0)
    model = ByteLM(TINY)
    opt, schedule = byte_lm.make_optimizer(model, 2e-3, 2, steps)
    for step in range(steps):
        parts = [data.batch(step, rank, 4, TINY.context, 0) for rank in (0, 1)]
        inputs = torch.cat([x for x, _ in parts])
        targets = torch.cat([y for _, y in parts])
        loss = byte_lm.next_byte_loss(model, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    want = byte_lm.heldout_bits_per_byte(model, data.heldout_windows(TINY.context, 8))
    assert result["final_bpb"] == pytest.approx(want, abs=1e-4)


def test_an_unknown_system_is_named():
    with pytest.raises(ValueError, match="unknown system 'allreduce'"):
        systems.available("allreduce")


# ----------------------------------------------------------------------------- sync periods

STREAMING = [s for s in systems.ALL if systems.streaming_delay(s) is not None]


def _gossip_ext_refuses(tau: int, local_steps: int) -> bool:
    import gossip_ext

    try:
        gossip_ext.DiLoCo(
            systems.Recipe(1).outer_optimizer,
            every=local_steps,
            fragments=systems.STREAMING_FRAGMENTS,
            delay=tau,
        )
    except ValueError:
        return True
    return False


def _torchft_refuses(tau: int, local_steps: int) -> bool:
    """Whether torchft 0.2.0's DiLoCo refuses the schedule: its checks of the schedule come
    before it touches the manager beyond one flag, so a stand-in manager reaches them."""
    from types import SimpleNamespace

    from torchft.local_sgd import DiLoCo

    fragments = [torch.nn.Linear(2, 2) for _ in range(systems.STREAMING_FRAGMENTS)]
    outer = [torch.optim.SGD(f.parameters(), lr=0.1) for f in fragments]
    inner = torch.optim.SGD([p for f in fragments for p in f.parameters()], lr=0.1)
    manager = SimpleNamespace(_use_async_quorum=False)
    try:
        DiLoCo(manager, fragments, inner, outer, local_steps, pin_memory=False,
               fragment_sync_delay=tau)  # fmt: skip
    except ValueError as error:
        schedule = ("Only 1 fragment", "must divide", "synced before it is reduced")
        if any(words in str(error) for words in schedule):
            return True
        raise
    except Exception:  # noqa: BLE001 - past the schedule's checks: the stand-in manager
        return False
    return False


@pytest.mark.parametrize("system", STREAMING)
def test_a_sync_period_is_refused_exactly_where_the_system_itself_refuses_it(system):
    tau = systems.streaming_delay(system)
    for local_steps in range(1, 25):
        problem = systems.schedule_problem(system, local_steps)
        if system.startswith("torchft"):
            pytest.importorskip("torchft")
            refused = _torchft_refuses(tau, local_steps)
        else:
            # gossip_ext runs any period its check allows; the comparison keeps torchft's
            # schedule (a multiple of the fragments) for both.
            refused = _gossip_ext_refuses(tau, local_steps) or (
                local_steps % systems.STREAMING_FRAGMENTS != 0
            )
        assert (problem is not None) == refused, (system, local_steps, problem)
    for system in systems.ALL:
        if system not in STREAMING:
            assert systems.schedule_problem(system, 1) is None


def test_a_comparison_refuses_a_system_its_sync_period_cannot_run_before_running_any():
    protocol = runner.Protocol(steps=24, ddp_steps=12, local_steps=4)
    with pytest.raises(ValueError, match=r"streaming_diloco_t1_int8 .* at least 8, got 4"):
        runner.run_systems(["alone", "streaming_diloco_t1_int8"], protocol, 2, None, 60)
