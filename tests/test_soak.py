"""Soak, short: many rounds in a row keep memory flat, the push-sum weights summing to n and the
mass conserved, and never hang (the long runs: benchmarks/soak.py; the loops: soak_loops.py)."""

from __future__ import annotations

import pytest
import reference
import torch
from soak_loops import GLOO_MODES, TOLERANCE, SoakRun, self_weight, soak_gloo, soak_inproc

WORLD_SIZE = 4
RSS_BOUND_MIB = 4.0  # growth of the resident set after the warm-up


def _reference_weights(rounds: int, uniform: bool) -> list[float]:
    """The push-sum weights after `rounds` rounds, in fp64 from the independent schedule."""
    books = reference.graph_phone_books("npeer_exponential", WORLD_SIZE, 1)
    w = torch.ones(WORLD_SIZE, dtype=torch.float64)
    for t in range(rounds):
        new = torch.zeros_like(w)
        for i in range(WORLD_SIZE):
            peers = reference.out_peers(books, 1, i, t)
            keep, send = reference.mixing_weights(len(peers), None if uniform else self_weight(i))
            new[i] += keep * w[i]
            for j in peers:
                new[j] += send * w[i]
        w = new
    return w.tolist()


@pytest.mark.parametrize("uniform", [False, True], ids=["self_weight", "uniform_in_place"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_inproc_soak_holds_weights_mass_and_memory(dtype, uniform):
    rounds = 1000
    run = soak_inproc(rounds, dtype, uniform=uniform, check_every=50, warmup=200, timeout_s=30)
    assert run.problems(RSS_BOUND_MIB) == []
    assert run.checks == 17  # rounds 200, 250, ..., 1000
    expected = _reference_weights(rounds, uniform)
    assert run.final_weights == pytest.approx(expected, abs=TOLERANCE[dtype])


def test_gloo_soak_every_mode_holds_weights_and_memory():
    steps = 200
    runs = soak_gloo(steps, check_every=20, warmup=60, timeout_s=30)
    assert [run.name for run in runs] == [f"gloo, {mode}" for mode in GLOO_MODES]
    for run in runs:
        assert run.problems(RSS_BOUND_MIB) == []
        assert run.rounds == steps and run.checks == 8  # steps 60, 80, ..., 200
        assert len(run.rss) == WORLD_SIZE


def _run(**changes) -> SoakRun:
    fields = {
        "name": "synthetic",
        "dtype": torch.float32,
        "world_size": WORLD_SIZE,
        "rounds": 100,
        "expected_rounds": 100,
        "wall_s": 1.0,
        "warmup": 20,
        "rss": [[(20, 300.0), (60, 300.5), (100, 300.2)]],
        "weight_sum_error": 1e-6,
        "final_weights": [0.7, 0.8, 1.0, 1.5],
        "weights_should_move": True,
        "checks": 3,
        "mass_error": 1e-6,
        "consensus_error": 1e-6,
    }
    fields.update(changes)
    return SoakRun(**fields)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rss": [[(20, 300.0), (60, 300.5)], [(20, 310.0), (60, 314.5)]]}, "process 1 grew"),
        ({"weight_sum_error": 2e-5}, "sum of push-sum weights"),
        (
            {
                "dtype": torch.float64,
                "weight_sum_error": 2e-9,
                "mass_error": 0.0,
                "consensus_error": 0.0,
            },
            "sum of push-sum weights",
        ),
        ({"mass_error": 2e-5}, "mean of the numerators"),
        ({"consensus_error": 2e-5}, "initial mean"),
        ({"final_weights": [1.0] * 4}, "never moved"),
        ({"rounds": 99}, "99 rounds done, 100 expected"),
        ({"checks": 1}, "only 1 check"),
        ({"inconsistencies": ["rank 2 ended with a non-finite loss nan"]}, "non-finite loss"),
    ],
)
def test_soak_checks_fail_on_a_broken_run(changes, message):
    assert _run().problems(RSS_BOUND_MIB) == []
    problems = _run(**changes).problems(RSS_BOUND_MIB)
    assert len(problems) == 1 and message in problems[0], problems
