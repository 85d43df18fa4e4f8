"""GossipStrategy under a real Lightning Trainer, on gloo processes: it trains exactly as the
hand-written loop with the same objects, resumes a checkpoint bit for bit, saves the workers'
average for inference, validates on the choice it names, and refuses what it cannot run."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

pytest.importorskip(
    "pytorch_lightning", reason="the Lightning extra: pip install gossip_ext[lightning]"
)

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from lightning_workers import (  # noqa: E402
    Regression,
    as_torchrun_worker,
    fit,
    fit_and_checkpoint,
    hand_written_loop,
    loader,
    nesterov,
    parameters,
    trainer,
)
from multiprocess import error_of, run_ranks  # noqa: E402
from torchrun import failure_report, torchrun  # noqa: E402

import gossip_ext  # noqa: E402
from gossip_ext.lightning import GossipStrategy  # noqa: E402

WORLD = 3  # with two, a round of the 1-peer graph averages the two models exactly


# How the user's LightningModule and Trainer step: Lightning's loop, the user's own steps, and
# Lightning's loop accumulating all three batches of an epoch into one clipped step.
STYLES = {
    "automatic": ({}, {}),
    "manual": ({"manual": True}, {}),
    "accumulate-clip": (
        {"accumulate_grad_batches": 3, "gradient_clip_val": 0.5},
        {"accumulate": 3, "clip": 0.5},
    ),
}


def _both(rank: int, world_size: int, algorithm: tuple, style: str):
    lightning_kwargs, loop_kwargs = STYLES[style]
    lightning = fit(rank, world_size, algorithm, epochs=2, **lightning_kwargs)
    return lightning, hand_written_loop(rank, algorithm, epochs=2, **loop_kwargs)


THE_SAME_AS_BY_HAND = {
    "sgp": ((gossip_ext.SGP(),), "automatic"),
    "overlap-int8": ((gossip_ext.SGP(overlap=True, message_dtype="int8"),), "automatic"),
    "diloco": ((None, gossip_ext.DiLoCo(nesterov, every=4)), "automatic"),
    "sgp-manual": ((gossip_ext.SGP(),), "manual"),
    "sgp-accumulate-clip": ((gossip_ext.SGP(),), "accumulate-clip"),
}


@pytest.mark.parametrize("case", sorted(THE_SAME_AS_BY_HAND))
def test_the_trainer_trains_as_the_hand_written_loop_with_the_same_objects(launch, case):
    ranks = launch(case)
    for lightning, by_hand in ranks:
        (losses, params), (hand_losses, hand_params) = lightning, by_hand
        assert len(losses) == len(hand_losses) == 6
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(hand_losses), rtol=0, atol=1e-6
        )
        for p, q in zip(params, hand_params):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    # The workers' models differ (their data do): each trained its own.
    assert not torch.equal(ranks[0][0][1][0], ranks[1][0][1][0])


class _KeepsTheWrapper(pl.Callback):
    def on_train_start(self, trainer, module):
        self.wrapper = trainer.strategy.model


def _fit_asynchronously(rank: int, world_size: int, algorithm: tuple):
    as_torchrun_worker(rank, world_size)
    module, kept = Regression(), _KeepsTheWrapper()
    run = trainer(world_size, GossipStrategy(*algorithm), max_epochs=6, callbacks=[kept])
    run.fit(module, train_dataloaders=loader(rank))
    # What the strategy's teardown left: every message sent absorbed (settle()).
    weights = [None] * world_size
    torch.distributed.all_gather_object(weights, kept.wrapper.ps_weight)
    return module.losses, parameters(module), parameters(Regression()), weights


ASYNCHRONOUS = {
    "async-sgp": (gossip_ext.AsyncSGP(),),
    "async-diloco": (None, gossip_ext.AsyncDiLoCo(lr=0.7, every=3)),
}


@pytest.mark.parametrize("case", sorted(ASYNCHRONOUS))
def test_the_asynchronous_modes_train_and_end_at_rest(launch, case):
    """No loop can equal an asynchronous run step for step (arrivals decide what is absorbed):
    the Trainer runs every step, every worker ends with a finite trained model, and fit ends
    with the gossip at rest: the push-sum weights sum to the number of workers again, nothing
    of the mass in flight."""
    for losses, params, untrained, weights in launch(case):
        assert len(losses) == 18 and all(torch.isfinite(torch.tensor(losses)))
        assert all(bool(p.isfinite().all()) for p in params)
        assert any(not torch.equal(p, q) for p, q in zip(params, untrained))
        assert sum(weights) == pytest.approx(WORLD, abs=1e-5), weights


def _resume(rank: int, world_size: int, root: str):
    whole = fit_and_checkpoint(rank, world_size, f"{root}/whole", epochs=2, resume=None)
    first = fit_and_checkpoint(rank, world_size, f"{root}/first", epochs=1, resume=None)
    checkpoint = f"{root}/first/{first[2][0]}"
    resumed = fit_and_checkpoint(rank, world_size, f"{root}/first", epochs=2, resume=checkpoint)
    saved = torch.load(checkpoint, weights_only=False)
    own = torch.load(f"{checkpoint}.rank{rank}" if rank else checkpoint, weights_only=False)
    return whole, first, resumed, saved["state_dict"], own["gossip_ext_worker"], first[1]


def test_a_resumed_checkpoint_continues_the_uninterrupted_run_bit_for_bit(launch):
    ranks = launch("resume")
    for rank, (whole, first, resumed, _, own, _) in enumerate(ranks):
        ranks_files = [f"epoch=0-step=3.ckpt.rank{r}" for r in range(1, WORLD)]
        assert first[2] == ["epoch=0-step=3.ckpt", *ranks_files]
        assert own["rank"] == rank and own["world_size"] == WORLD
        assert whole[0][3:] == resumed[0], rank  # the second epoch's losses
        for p, q in zip(whole[1], resumed[1]):
            assert torch.equal(p, q), rank
    # The checkpoint's state_dict, loaded for inference, is the mean of the workers' own models
    # (SGP's uniform mixing: every push-sum weight 1), and loads into the LightningModule.
    average = ranks[0][3]
    names = [name for name, _ in Regression().named_parameters()]
    for i, name in enumerate(names):
        mean = sum(rank[5][i] for rank in ranks) / WORLD
        torch.testing.assert_close(average[name], mean, rtol=0, atol=1e-6)
    assert not torch.equal(ranks[0][5][0], ranks[1][5][0])
    Regression().load_state_dict(average)


def _validated(rank: int, world_size: int, validate_on: str):
    as_torchrun_worker(rank, world_size)
    module = Regression()
    strategy = GossipStrategy(gossip_ext.SGP(), validate_on=validate_on)
    run = trainer(world_size, strategy, max_epochs=1)
    run.fit(module, train_dataloaders=loader(rank), val_dataloaders=loader(0))
    # What the validation saw was evaluated on the batches of rank 0: redo it by hand.
    own = parameters(module)
    x, y = loader(0).dataset.tensors
    with torch.no_grad():
        own_loss = torch.nn.functional.mse_loss(module(x), y).item()
    return module.validated, own_loss, own, float(run.callback_metrics["val_loss"])


@pytest.mark.parametrize("validate_on", ["average", "worker"])
def test_validation_runs_on_the_model_it_names_and_training_goes_on_with_its_own(
    launch, validate_on
):
    ranks = launch(f"validate-on-{validate_on}")
    assert not torch.equal(ranks[0][2][0], ranks[1][2][0])  # each worker kept its own model
    # One batch size for every batch, so the mean of the batches' losses is the whole set's.
    seen = [sum(rank[0]) / len(rank[0]) for rank in ranks]
    own = [rank[1] for rank in ranks]
    if validate_on == "worker":
        assert seen == pytest.approx(own, abs=1e-6)
    else:
        assert seen == pytest.approx([seen[0]] * WORLD, abs=1e-6)  # one model: the average
        assert seen[0] != pytest.approx(own[0], abs=1e-4)
    assert ranks[0][3] == pytest.approx(sum(seen) / WORLD, abs=1e-6)  # sync_dist: the mean


def _refusals(rank: int, world_size: int):
    as_torchrun_worker(rank, world_size)
    two_optimizers = trainer(world_size, GossipStrategy(), max_epochs=1)
    return error_of(lambda: two_optimizers.fit(Regression(optimizers=2), loader(rank)))


def test_what_it_cannot_run_is_refused_naming_why(launch):
    for error in launch("refusals"):
        assert error is not None and error[0] is ValueError, error
        assert "gave 2 optimizers" in error[1], error
    with pytest.raises(ValueError, match="validate_on must be 'average' or 'worker', got 'mean'"):
        GossipStrategy(validate_on="mean")
    with pytest.raises(ValueError, match="nprocs_per_node=2"):
        GossipStrategy(nprocs_per_node=2)


# Every case above, in one launch of WORLD ranks, one after another: each rank imports Lightning
# once (3 s of CPU) instead of once a case. Each case fits Trainers of its own over the same
# process group, as a rank of _resume fits three; the refusals come last, the asynchronous modes
# before them (each ends at rest: nothing of theirs reaches the next case).
def _cases(root: str) -> dict[str, tuple]:
    cases = {}
    for name, (algorithm, style) in THE_SAME_AS_BY_HAND.items():
        cases[name] = (_both, algorithm, style)
    cases["resume"] = (_resume, root)
    for validate_on in ("average", "worker"):
        cases[f"validate-on-{validate_on}"] = (_validated, validate_on)
    for name, algorithm in ASYNCHRONOUS.items():
        cases[name] = (_fit_asynchronously, algorithm)
    cases["refusals"] = (_refusals,)
    return cases


def _every_case(rank: int, world_size: int, root: str) -> dict[str, object]:
    """Each case's result on this rank, or the traceback of what it raised (the case's test
    fails with it; the cases after it still run)."""
    results = {}
    for name, (function, *args) in _cases(root).items():
        try:
            results[name] = function(rank, world_size, *args)
        except Exception:
            results[name] = _Raised(traceback.format_exc())
    return results


class _Raised(str):
    """What a case raised on a rank: its traceback."""


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """``launch(case)``: each rank's result of ``case``, from the one launch of every case."""
    ranks = run_ranks(WORLD, _every_case, str(tmp_path_factory.mktemp("lightning")))

    def results_of(case: str) -> list:
        for rank, results in enumerate(ranks):
            if isinstance(results[case], _Raised):
                pytest.fail(f"{case} raised on rank {rank}:\n{results[case]}")
        return [results[case] for results in ranks]

    return results_of


def test_the_strategy_is_registered_under_its_name():
    run = trainer(1, "gossip", max_epochs=1)
    assert isinstance(run.strategy, GossipStrategy)


def test_the_lightning_example_learns_under_torchrun_and_keeps_every_worker_s_checkpoint(tmp_path):
    example = Path(__file__).resolve().parent.parent / "examples" / "lightning_train.py"
    done = torchrun(2, example, "--epochs", "2", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, failure_report(done)
    accuracy = float(re.search(r"accuracy (\d\.\d+)", done.stdout).group(1))
    assert accuracy > 0.5, done.stdout  # four classes: chance is 0.25
    saved = sorted(p.name for p in (tmp_path / "lightning_checkpoints").iterdir())
    assert saved == [f"epoch={e}-step={s}.ckpt{r}" for e, s in ((0, 48), (1, 96))
                     for r in ("", ".rank1")], saved  # fmt: skip
