"""A small run of benchmarks/cluster.py: 2 workers in network namespaces behind 1 Gbit/s NICs."""

import os
import sys

import pytest

from harness import cpu_caps, netns

REASON = netns.unavailable()
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
def test_small_cluster_run_measures_the_cap_and_tears_down(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    monkeypatch.setattr(sys, "argv", ["benchmarks/cluster.py"])
    import cluster

    plot = tmp_path / "cluster.png"
    results = cluster.main(
        ["--workers", "2", "--bandwidth", "1gbit", "--params", "1e6", "--steps", "8",
         "--modes", "ddp,sgp,overlap-bf16", "--no-record", "--plot", str(plot)]
    )  # fmt: skip
    r = results[(2, 1e9)]
    # The cap is real: a gloo send between two namespaces runs near 1 Gbit/s, not at loopback's
    # tens of Gbit/s, and not far below it either.
    assert 0.5 < r["link"]["pair"] < 1.2, r["link"]
    # A round of 4 MB cannot beat its wire time at 1 Gbit/s (32 ms).
    f32 = r["round"]["float32"]
    assert f32["bytes"] == pytest.approx(4e6, rel=0.01)
    assert f32["seconds"] >= 0.9 * f32["wire"], f32
    assert r["round"]["bfloat16"]["bytes"] == f32["bytes"] / 2
    assert set(r["modes"]) == {"compute", "ddp", "sgp", "overlap-bf16"}
    assert r["modes"]["ddp"]["steps"] == 8 and r["modes"]["ddp"]["to_target"] is not None
    for mode in ("sgp", "overlap-bf16"):
        m = r["modes"][mode]
        assert m["step"] > 0 and m["steps"] >= cluster.WINDOW, (mode, m)
    assert plot.stat().st_size > 10_000
    # Every namespace, and with them every veth and the bridge, is gone.
    assert netns.leftovers() == []


@pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
def test_cluster_tears_down_on_error():
    with pytest.raises(RuntimeError, match=r"worker \d exited"):
        with netns.EmulatedCluster(2, 1e9) as cluster:
            assert len(netns.leftovers()) == 3  # two workers and the bridge's namespace
            cluster.run("harness.netns:no_such_function", None, timeout=60)
    assert netns.leftovers() == []


def test_rates_parse_like_tc():
    assert netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("100mbit") == 1e8
    assert netns.parse_rate("2.5Gbit") == 2.5e9
    for bad in ("fast", "1gbps", "-1gbit", "0mbit"):
        with pytest.raises(ValueError, match="bandwidth"):
            netns.parse_rate(bad)


def spin_for(rank, world_size, init_method, seconds):
    """A worker of the test below: computes for ``seconds`` of wall time, returns its CPU time
    (rank 0's: the cluster returns rank 0's result)."""
    import time

    began, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - began < seconds:
        sum(i * i for i in range(1000))
    return time.process_time() - cpu


CAPS_REASON = REASON or cpu_caps.unavailable()


@pytest.mark.skipif(CAPS_REASON is not None, reason=f"CPU caps unavailable: {CAPS_REASON}")
def test_a_capped_worker_computes_within_its_share_and_the_groups_go():
    # Two workers on (at least) two cores would each take a whole core; capped at a quarter of
    # one, each gets a quarter of its wall time, whatever the other does.
    tests = os.path.dirname(os.path.abspath(__file__))
    with netns.EmulatedCluster(2, 1e9, cpu_cores=0.25) as cluster:
        cpu = cluster.run("test_cluster:spin_for", 2.0, timeout=60, sys_path=tests)
    assert 0.3 < cpu < 0.65, cpu  # 0.5 s of CPU in 2 s, with the scheduler's slack
    assert not [n for n in os.listdir(cpu_caps.MOUNT) if n.startswith(f"gossipx-{os.getpid()}-")]
    assert netns.leftovers() == []
