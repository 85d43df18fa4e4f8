"""The planner's checks: benchmarks/plan_papers.py on published settings, its figures held to the
papers' where it claims to meet them and to hand-worked ones where it solves an input; and
benchmarks/plan_grid.py on an lm_compare run made by hand; benchmarks/plan_consensus.py's table
in docs/scaling.md, its 64-worker column recomputed by the engine."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import plan_consensus  # noqa: E402
import plan_grid  # noqa: E402
import plan_papers  # noqa: E402


@pytest.fixture(scope="module")
def checks():
    return plan_papers.main(["--no-record"])


def test_sgp_s_solved_compute_gives_its_published_time_and_all_reduce_is_checked(checks):
    sgp, all_reduce = [c for c in checks if c.paper.startswith("SGP")]
    assert sgp.predicted == "1.60 h" and sgp.met
    # 14,075 steps of 90 epochs; SGP's round is one 102 MB message at 10 Gbit/s (82 ms) and the
    # kernels: the rest of 1.6 h over those steps is the compute.
    steps = 90 * 1_281_167 / (32 * 256)
    assert f"({steps:,.0f} steps)" in sgp.what
    compute = 1.6 * 3600 / steps - 25_557_032 * 4 * 8 / 10e9
    assert f"({compute * 1e3:.0f} ms)" in sgp.what
    # All-reduce SGD is the published check: the planner's is faster than published, said so.
    assert not all_reduce.met and "bus bandwidth" in all_reduce.why


def test_diloco_sends_h_times_less_and_decoupled_diloco_s_learners_keep_their_goodput(checks):
    (reduction,) = [c for c in checks if c.paper.startswith("DiLoCo")]
    assert reduction.predicted == "500x less" and reduction.met
    dp, learners = [c for c in checks if c.paper.startswith("Decoupled")]
    assert dp.predicted == "27%"
    # Stopped e^(-x) of the time at 27%: x = ln(1 / 0.27); 8 learners each up 8 / (8 + x).
    x = math.log(1 / 0.27)
    assert learners.predicted == f"{8 / (8 + x):.0%}" and learners.met


def test_the_streaming_diloco_table_is_every_published_cell_and_the_planner_asks_no_less():
    rows, _ = plan_papers.streaming_table()
    assert len(rows) == 15 and all(len(r["predicted"]) == 5 for r in rows)
    for r in rows:
        for published, predicted, utilization in zip(
            r["published"], r["predicted"], plan_papers.UTILIZATIONS
        ):
            # At half utilization every method's bytes take the compute's time: within 1.5x.
            if utilization == 0.5:
                assert predicted == pytest.approx(published, rel=0.5), r
            # The outer steps' modes overlap less than the paper's simulation: the planner never
            # promises a utilization at less bandwidth than it needed there.
            if r["method"] != "Data-Parallel":
                assert predicted >= published / plan_papers.STREAMING_TOLERANCE, r


def test_the_grid_check_reads_an_lm_compare_run():
    """Workers alone at 50 ms a step; DDP at the planner's own figure, overlap SGP a fifth slower
    than it predicts, on one setting of 4 workers at 100 Mbit/s."""
    from gossip_ext.plan import Cluster, Model

    model = Model(params=440_000, step_seconds=0.05, width=plan_grid.WIDTH)
    cluster = Cluster(workers=4, link_bits=1e8, kernel_bytes=1e10)
    ddp = plan_grid.MODES["ddp"].step(model, cluster).seconds
    sgp = plan_grid.MODES["overlap_sgp_int8"].step(model, cluster).seconds
    rows = {
        "alone": {"params": 440_000, "step_ms": 50.0, "wire_bytes_per_step": 0.0},
        "ddp": {"params": 440_000, "step_ms": 1e3 * ddp, "wire_bytes_per_step": 2.7e6},
        "overlap_sgp_int8": {"params": 440_000, "step_ms": 1.2e3 * sgp},
    }
    run = {
        "protocol": {"steps": 120, "warmup": 20},
        "settings": [{"workers": 4, "rate": 1e8, "rows": rows}],
    }
    found = {f["system"]: f for f in plan_grid.compare(run, 1e10)}
    assert found["ddp"]["step"] == pytest.approx((ddp, ddp))
    # 2 * 3/4 of 440,000 float32 gradients.
    assert found["ddp"]["bytes"] == pytest.approx((1.5 * 4 * 440_000, 2.7e6))
    assert found["overlap_sgp_int8"]["bytes"][1] is None
    said = plan_grid.goals(list(found.values()))
    assert said == (
        "Step time within 15%: 1 of 2; missed: overlap_sgp_int8 (4 x 100 Mbit/s, -17%)."
    )
    assert "| ddp (DDP) | " in plan_grid.table(list(found.values()))
    # A byte's CPU, 1 ns, paid on 2 cores by 4 workers: 2 ns of each worker's step for each of
    # DDP's bytes sent and received.
    shared = {f["system"]: f for f in plan_grid.compare(run, 1e10, host_cpu=1e-9, cores=2)}
    extra = shared["ddp"]["step"][0] - ddp
    assert extra == pytest.approx(2 * 1.5 * 4 * 440_000 * 2e-9, rel=1e-6)
    # PowerSGD all-reduces plainly for its first 20 steps of 120: a sixth of its steps are DDP's.
    powersgd = plan_grid.MODES["powersgd_r4"]
    rows["powersgd_r4"] = {"params": 440_000, "step_ms": 100.0}
    (entry,) = [f for f in plan_grid.compare(run, 1e10) if f["system"] == "powersgd_r4"]
    plain = plan_grid.DDP(bucket_bytes=float("inf"))
    mean = 20 * plain.step(model, cluster).seconds + 100 * powersgd.step(model, cluster).seconds
    assert entry["step"][0] == pytest.approx(mean / 120)


def test_the_consensus_table_is_the_engine_s():
    from gossip_ext.graphs import NPeerDynamicDirectedExponentialGraph

    plan_consensus.main(["--check"])  # exits naming the command that rewrites it
    # On the default graph 64 workers are averaged after log2 64 = 6 rounds, not before.
    found = plan_consensus.distances(NPeerDynamicDirectedExponentialGraph(), 64, None)
    assert found[6] < 1e-6 < found[5]
    assert plan_consensus.cell(found) == f"{next(k for k, d in enumerate(found) if d <= 1e-2)} / 6"
    cap = plan_consensus.CAP
    assert plan_consensus.cell([1.0] * 5) == f">{cap} / >{cap} (1e+00 after {cap})"
