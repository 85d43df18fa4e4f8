"""The outer steps compute the same bits as before their averagings became objects of one
interface: every rule x averaging x whole-or-streamed of ``outer_grid.py``, 22 steps on 3 gloo
processes, against the digests recorded for this machine's CPU vendor (``outer_grid.py`` says
which code computed each, and why the bits depend on the CPU)."""

import json

import pytest
from multiprocess import run_ranks
from outer_grid import DIGESTS, WORLD_SIZE, cpu_vendor, train_grid


def test_every_combination_ends_with_the_bits_it_did_before():
    with open(DIGESTS) as f:
        every = json.load(f)
    if cpu_vendor() not in every:
        pytest.skip(
            f"digests are recorded for {sorted(every)} CPUs, and this one is {cpu_vendor()}: "
            "torch's own kernels give other bits there (python3 tests/outer_grid.py adds them)"
        )
    expected = every[cpu_vendor()]
    results = run_ranks(WORLD_SIZE, train_grid)
    found = {name: [r[name] for r in results] for name in results[0]}
    assert sorted(found) == sorted(expected)
    changed = [name for name in expected if found[name] != expected[name]]
    assert not changed, f"these configurations end with other parameters than before: {changed}"
