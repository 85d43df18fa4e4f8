"""benchmarks/sharded_compare.py and harness.compare.sharded, small: the arguments, the process
layout (replica r holds ranks 2r and 2r+1, its processes in one namespace), every system for a
few steps on loopback through the benchmark's own configuration, HSDP and ``alone`` against one
process on the same batches, and on the emulated network (as root) what a replica sends a step."""

import contextlib
import dataclasses
import math
import os
import sys
import tempfile

import pytest
import torch
from multiprocess import forkserver_context, train_in_turn

from harness import netns
from harness.compare import runner, sharded, systems
from harness.tasks import byte_lm
from harness.tasks.byte_lm import ByteLM
from harness.tasks.stdlib_text import StdlibText

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
TESTS = os.path.dirname(os.path.abspath(__file__))
REASON = netns.unavailable()
TINY = ["--width", "32", "--layers", "1", "--context", "32", "--eval-windows", "8"]
TINY_MODEL = byte_lm.ByteLMConfig(layers=1, width=32, heads=4, context=32)
STEPS = ["--steps", "4", "--hsdp-steps", "4", "--warmup", "2", "--eval-every", "2"]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCHMARKS)
    try:
        import sharded_compare

        yield sharded_compare
    finally:
        sys.path.remove(BENCHMARKS)


@pytest.fixture(scope="module", autouse=True)
def _preloaded_forkserver():
    # The loopback runs fork from the tests' forkserver, which imported torch once
    # (tests/multiprocess.py); the benchmark spawns fresh interpreters.
    forkserver_context()


def test_the_defaults_are_the_issues_measurement(bench):
    args = bench.parse_args([])
    assert args.systems == list(sharded.SYSTEMS)
    assert args.rates == [1e8, 1e9] and (args.replicas, args.shards) == (2, 2)
    assert (args.steps, args.hsdp_steps, args.width) == (960, 480, 256)
    assert bench.parse_args(["--loopback"]).rates == [None]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "20"], "must exceed --warmup"),
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--replicas", "1"], "--replicas must be >= 2"),
        (["--sync-every", "0"], "--sync-every must be >= 1"),
        (["--systems", "ddp"], "invalid choice"),
    ],
)
def test_bad_arguments_are_usage_errors(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_each_system_gets_the_protocol(bench):
    args = bench.parse_args(["--sync-every", "8", "--steps", "100"])
    hsdp, diloco = bench.config(args, "hsdp"), bench.config(args, "diloco")
    assert (hsdp.recipe.steps, diloco.recipe.steps) == (50, 100)
    assert hsdp.recipe.lr == systems.PEAK_LR["ddp"] and diloco.recipe.local_steps == 8
    assert diloco.recipe.outer_lr == 0.7 and diloco.recipe.outer_momentum == 0.5
    assert hsdp.world_size == 4 and hsdp.model.width == 256 and hsdp.batch_size == 4
    assert bench.config(bench.parse_args(["--lr", "1e-3"]), "sgp_overlap").recipe.lr == 1e-3
    with pytest.raises(ValueError, match="unknown system 'ddp'"):
        sharded.available("ddp")


def test_a_namespace_takes_at_most_its_processes():
    with pytest.raises(ValueError, match="per_namespace must be >= 1"):
        netns.EmulatedCluster(2, 1e9).run("harness.netns:x", None, 1, per_namespace=0)


def _config(bench, system: str):
    args = bench.parse_args(["--loopback", *TINY, *STEPS, "--sync-every", "2"])
    return bench.config(args, system)


@pytest.fixture(scope="module")
def every_system(bench) -> dict[str, dict]:
    """Every system this Python can run, through the benchmark's own configuration, on one set
    of 2 x 2 processes forked from the tests' preloaded server, one system after the other;
    rank 0's results by system."""
    configs = [_config(bench, s) for s in sharded.SYSTEMS if sharded.available(s) is None]
    with contextlib.ExitStack() as stack:
        configs = [
            dataclasses.replace(c, lighthouse=stack.enter_context(runner.lighthouse(c.replicas)))
            if c.system.startswith("torchft")
            else c
            for c in configs
        ]
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        return train_in_turn(sharded.train, configs, 4, folder)


@pytest.fixture(scope="module")
def loopback(every_system):
    """A system's loopback run; a system this Python cannot run skips, naming what to install."""

    def run_of(system: str) -> dict:
        why_not = sharded.available(system)
        if why_not:
            pytest.skip(why_not)
        return every_system[system]

    return run_of


@pytest.mark.timeout(180)
@pytest.mark.parametrize("system", sharded.SYSTEMS)
def test_every_system_trains_on_two_replicas_of_two_shards(system, loopback):
    result = loopback(system)
    assert result["system"] == system and result["workers"] == 4
    assert result["params"] == sum(p.numel() for p in ByteLM(TINY_MODEL).parameters())
    assert result["history"]["step"] == [2, 4]
    assert all(math.isfinite(b) and 0 < b < 9 for b in result["history"]["heldout_bpb"])
    assert result["step_ms"] > 0 and result["wire_bytes_per_step"] is None  # loopback


def _reference(replica_ranks, lr: float) -> float:
    """One process on the batches of ``replica_ranks``' processes together: the model a replica
    of them trains, whose FSDP2 averages their gradients."""
    data = StdlibText.load()
    config = TINY_MODEL
    torch.manual_seed(0)
    model = ByteLM(config)
    opt, schedule = byte_lm.make_optimizer(model, lr, 2, 4)
    for step in range(4):
        parts = [data.batch(step, rank, 4, config.context, 0) for rank in replica_ranks]
        loss = byte_lm.next_byte_loss(
            model, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    return byte_lm.heldout_bits_per_byte(model, data.heldout_windows(config.context, 8))


def test_hsdp_steps_as_one_process_on_every_batch(loopback):
    want = _reference([0, 1, 2, 3], sharded.PEAK_LR["hsdp"])
    assert loopback("hsdp")["final_bpb"] == pytest.approx(want, abs=1e-4)


def test_a_replica_alone_is_its_two_consecutive_ranks(loopback):
    # Each replica trains on its own processes' batches: ranks 0 and 1, ranks 2 and 3; the
    # reported loss is the mean of the replicas'.
    lr = sharded.PEAK_LR["alone"]
    want = (_reference([0, 1], lr) + _reference([2, 3], lr)) / 2
    assert loopback("alone")["final_bpb"] == pytest.approx(want, abs=1e-4)


def test_gossip_ext_and_torchft_take_the_same_diloco_steps(loopback):
    # The same outer Nesterov SGD on the same shards' pseudo-gradients: an independent check
    # of both (H = 2, two outer steps in 4 steps).
    ours, theirs = loopback("diloco"), loopback("torchft_hsdp_diloco")
    assert ours["history"]["heldout_bpb"] == pytest.approx(
        theirs["history"]["heldout_bpb"], abs=1e-4
    )
    assert ours["final_bpb"] != pytest.approx(loopback("alone")["final_bpb"], abs=1e-3)


def _made_up(names) -> dict[str, dict]:
    """Results as a run returns them, each system reaching its final 3.0 bpb at its own pace."""
    return {
        name: {
            "lr": 2e-3,
            "step_ms": 100.0 + i,
            "wire_bytes_per_step": 1e6 * i,
            "final_bpb": 3.0,
            "params": 1_661_952,
            "history": {"step": [480, 960], "time": [10.0 + i, 20.0 + i], "heldout_bpb": [3.5, 3]},
        }
        for i, name in enumerate(names)
    }


def test_the_benchmark_reports_and_records_a_short_section(bench, monkeypatch, tmp_path):
    sys.path.insert(0, BENCHMARKS)
    import results

    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n")
    monkeypatch.setattr(results, "RESULTS", str(path))
    args = bench.parse_args([])
    rows = {bench.setting(args, rate): _made_up(sharded.SYSTEMS) for rate in args.rates}
    bench.report_all(args, rows)
    text = path.read_text()
    section = text[text.index(f"## {bench.TITLE} (") :].rstrip("\n").splitlines()
    # RESULTS.md is near its 440 lines: the table lies on its side, a row per setting.
    assert len(section) <= 11, section
    assert section[-2].startswith("| 2 replicas x 2 shards, 100 Mbit/s | ")
    assert section[-1].startswith("| 2 replicas x 2 shards, 1 Gbit/s | ")
    hsdp = section[-4].strip("|").split("|").index(" hsdp ")
    assert "(1.00x)" in section[-1].strip("|").split("|")[hsdp]


def test_a_saved_run_is_reported_again(bench, monkeypatch, tmp_path, loopback, capsys):
    calls = []

    def fake_run(config, rate, timeout):
        calls.append((config.system, rate))
        return loopback(config.system)

    monkeypatch.setattr(sharded, "run", fake_run)
    rows = str(tmp_path / "rows.json")
    argv = ["--loopback", *STEPS, "--systems", "alone", "hsdp", "--no-record", "--rows", rows]
    ran = bench.main(argv)
    assert calls == [("alone", None), ("hsdp", None)]
    again = bench.main(["--from-rows", rows, "--no-record"])
    assert again == ran
    out = capsys.readouterr().out
    assert out.count("| hsdp | 0.002 | 4 |") == 2 and "(1.00x)" in out


# On the emulated network: each replica's two processes in one namespace, the replicas behind
# 1 Gbit/s NICs. What crosses a replica's NIC is what runs between replicas, and FSDP2's
# all-gathers and reduce-scatters (1.5 models a step inside the replica) stay off it.


def _layout_probe(rank: int, world_size: int, init_method: str) -> list:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mine = (rank, os.environ["GOSSIP_EXT_HOST"], os.stat("/proc/self/ns/net").st_ino)
        every = [None] * world_size
        dist.all_gather_object(every, mine)
        return every
    finally:
        dist.destroy_process_group()


def _probe_then_each_system(rank: int, world_size: int, init_method: str, configs) -> dict:
    """A process of the cluster below: the layout probe, then each system in turn, each with a
    rendezvous of its own (the next port of rank 0's store)."""
    address, port = init_method.rsplit(":", 1)
    results = {"layout": _layout_probe(rank, world_size, init_method)}
    for i, config in enumerate(configs, start=1):
        results[config.system] = sharded.train(
            rank, world_size, f"{address}:{int(port) + i}", config
        )
    return results


# A replica's bytes a step, in models (4 bytes a parameter): HSDP all-reduces each shard's
# gradient with its counterpart (a ring of two: half sent in the reduce-scatter, half in the
# all-gather), SGP sends each shard to the other replica once, in bfloat16 half of that.
# (SGP in full precision sends what HSDP does: one model, 2 replicas.)
MODELS_A_STEP = {"alone": 0.0, "hsdp": 1.0, "sgp_overlap_bf16": 0.5}


@pytest.fixture(scope="module")
def on_the_network(bench) -> dict:
    """One cluster of 2 namespaces behind 1 Gbit/s NICs, 2 processes in each: the layout probe
    and every system of MODELS_A_STEP; rank 0's results, and what the cluster left behind."""
    args = bench.parse_args(
        ["--width", "64", "--layers", "1", "--context", "32", "--eval-windows", "8"]
        + ["--steps", "6", "--hsdp-steps", "6", "--warmup", "2", "--eval-every", "6"]
    )
    configs = [bench.config(args, system) for system in MODELS_A_STEP]
    with netns.EmulatedCluster(2, 1e9) as cluster:
        target = "test_sharded_compare:_probe_then_each_system"
        results = cluster.run(target, configs, 180, sys_path=TESTS, per_namespace=2)
    return {**results, "leftovers": netns.leftovers()}


@pytest.mark.skipif(REASON is not None, reason=f"emulated network unavailable: {REASON}")
@pytest.mark.slow("an emulated cluster of 4 fresh interpreters training 3 systems in turn")
@pytest.mark.timeout(180)
def test_a_namespace_holds_a_replicas_consecutive_ranks(on_the_network):
    every = on_the_network["layout"]
    assert [(rank, host) for rank, host, _ in every] == [
        (0, "198.18.0.1"), (1, "198.18.0.1"), (2, "198.18.0.2"), (3, "198.18.0.2"),
    ]  # fmt: skip
    spaces = [space for _, _, space in every]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3]
    assert on_the_network["leftovers"] == []


@pytest.mark.skipif(REASON is not None, reason=f"emulated network unavailable: {REASON}")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("system", list(MODELS_A_STEP))
def test_what_a_replica_sends_a_step(on_the_network, system):
    result = on_the_network[system]
    models = result["wire_bytes_per_step"] / (4 * result["params"])
    # Headers, acknowledgements, a barrier and one evaluation's means: a few percent.
    assert models == pytest.approx(MODELS_A_STEP[system], abs=0.06), models
    assert on_the_network["leftovers"] == []
