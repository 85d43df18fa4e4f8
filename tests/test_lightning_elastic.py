"""GossipStrategy with an elastic membership under a real Lightning Trainer: each worker a run of
its own (``devices=1``) meeting the others through a membership service, as a user starts them.
It trains as the hand-written elastic loop with the same objects (to 1e-6), survives a worker
killed mid-run, takes in a replacement, and every worker that was not killed exits 0."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "pytorch_lightning", reason="the Lightning extra: pip install gossip_ext[lightning]"
)

import torch  # noqa: E402
from elastic_job import Job  # noqa: E402

import gossip_ext  # noqa: E402
from gossip_ext.lightning import GossipStrategy  # noqa: E402

STEPS = 12  # an epoch and a half: the sampler's second order too
SCRIPT = "lightning_elastic_worker"
# The ranks' forkserver (tests/multiprocess.py) does not preload Lightning, whose import starts a
# thread of its own that a fork would not carry: every worker imports it, 3-4 s of CPU each.
_IMPORTS = "two jobs of two workers (or three), each importing Lightning on its own (3-4 s of CPU)"


def _job_of_two(out: Path, *extra: str) -> dict[int, dict]:
    """Two workers that form the first epoch together; their results by worker id."""
    job = Job(out)
    try:
        for name in ("a", "b"):
            job.start(name, "--min-workers", "2", "--steps", str(STEPS), *extra, script=SCRIPT)
        job.wait()
        for name in ("a", "b"):
            assert job.workers[name].returncode == 0, job.log(name)
        results = [job.result(name) for name in ("a", "b")]
    finally:
        job.close()
    return {r["worker_id"]: r for r in results}


@pytest.mark.slow(_IMPORTS)
def test_the_trainer_equals_the_hand_written_elastic_loop(tmp_path):
    trainer = _job_of_two(tmp_path / "trainer")
    by_hand = _job_of_two(tmp_path / "loop", "--loop")
    assert sorted(trainer) == sorted(by_hand) == [0, 1]
    for worker in (0, 1):
        t, h = trainer[worker], by_hand[worker]
        assert len(t["losses"]) == len(h["losses"]) >= 12
        torch.testing.assert_close(t["losses"], h["losses"], rtol=0, atol=1e-6)
        torch.testing.assert_close(t["final"], h["final"], rtol=0, atol=1e-6)
        # Gossip ran between the two: both in one epoch of two the whole run.
        assert all(s["world_size"] == 2 for s in t["steps"]), worker
        # sync_dist reduced over this worker alone: its own loss.
        assert [s["logged"] for s in t["steps"]] == pytest.approx(t["losses"], abs=1e-6)
    # Each worker's checkpoint is a file of its own, named by its id, holding its own model.
    names = [f"epoch=1-step={STEPS}.ckpt.worker{worker}" for worker in (0, 1)]
    assert trainer[0]["checkpoints"] == trainer[1]["checkpoints"] == names
    for worker in (0, 1):
        saved = torch.load(tmp_path / "trainer" / "checkpoints" / names[worker], weights_only=False)
        state = saved["state_dict"]
        own = torch.cat([state[k].flatten() for k in ("net.0.weight", "net.0.bias",
                                                      "net.2.weight", "net.2.bias")])  # fmt: skip
        assert torch.equal(own, trainer[worker]["final"]), worker
    # The two workers drew different orders (seeded by their ids), and each round of two
    # workers averages them exactly: they end on one model, the last round delivered by the
    # leave at the end of fit.
    assert trainer[0]["losses"][:8] != trainer[1]["losses"][:8]
    torch.testing.assert_close(trainer[0]["final"], trainer[1]["final"], rtol=0, atol=1e-6)


@pytest.mark.slow(_IMPORTS + "; the replacement starts only once the killed worker is gone")
def test_a_worker_killed_mid_run_is_survived_and_a_replacement_joins(tmp_path):
    job = Job(tmp_path)
    try:
        # a holds its pace while b is gone, so that the replacement is in before it finishes.
        job.start("a", "--steps", "80", "--pace", "0.05", "--hold-for-joiner", "0.25",
                  script=SCRIPT)  # fmt: skip
        job.start("b", "--steps", "80", "--pace", "0.05", "--kill-at", "8", script=SCRIPT)
        job.wait_for_step("b", 8)
        assert job.workers["b"].wait(30) == -9
        job.start("c", "--steps", "20", script=SCRIPT)
        job.wait()
        assert job.workers["a"].returncode == 0, job.log("a")
        assert job.workers["c"].returncode == 0, job.log("c")
        a, c = job.result("a"), job.result("c")
    finally:
        job.close()
    # Each ran its Trainer's max_steps to the end and left the job.
    assert a["finished"] and c["finished"] and a["global_step"] == 80 and c["global_step"] == 20
    # a trained with b, alone once b died, then with c.
    sizes = [s["world_size"] for s in a["steps"]]
    changes = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert changes[:3] == [2, 1, 2], sizes
    # The replacement took the job's step count (and model) from a, not its own start.
    assert c["steps"][0]["step"] > 8, c["steps"][0]["step"]
    assert all(s["world_size"] == 2 for s in c["steps"][:5]), c["steps"][:5]
    for result in (a, c):
        assert all(bool(s["params"].isfinite().all()) for s in result["steps"])


def test_what_an_elastic_job_cannot_do_is_refused_naming_why():
    membership = gossip_ext.Elastic("127.0.0.1:29400")
    with pytest.raises(ValueError, match="validate_on='average' is refused with an elastic"):
        GossipStrategy(membership=membership, validate_on="average")
    with pytest.raises(TypeError, match="membership must be a gossip_ext.Elastic, got str"):
        GossipStrategy(membership="127.0.0.1:29400")
    strategy = GossipStrategy(membership=membership)
    assert strategy.validate_on == "worker"
    with pytest.raises(ValueError, match="ckpt_path='last.ckpt' is refused"):
        strategy.load_checkpoint("last.ckpt")
