"""The peers schedule: set_peers_per_itr() between steps, on real processes over gloo.

The oracle is the mixing matrix of tests/reference.py, built from docs/design.md's definition of the
graphs, applied round after round with the peers per round in force at that round.
"""

from __future__ import annotations

import os

import reference
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

N = 4
D = 3
ROUNDS_AT = ((1, 3), (2, 3), (1, 2))  # (peers_per_itr, rounds) in order


def _initial(rank: int) -> torch.Tensor:
    return torch.arange(D, dtype=torch.float32) + 10.0 * rank * rank


def _gossip_with_schedule(rank: int, world_size: int, ckpt: str | None) -> dict:
    module = nn.Linear(D, 1, bias=False)
    model = gossip_ext.GossipDataParallel(module)
    with torch.no_grad():
        module.weight.copy_(_initial(rank))
    per_round = []
    for peers, rounds in ROUNDS_AT:
        model.set_peers_per_itr(peers)
        for _ in range(rounds):
            before = model.bytes_sent
            model.transfer_params()
            model.sync_comms()
            per_round.append(model.bytes_sent - before)
    result = {"z": module.weight.detach().clone().reshape(-1), "bytes": per_round}
    if ckpt is not None:
        torch.save(model.state_dict(), os.path.join(ckpt, f"{rank}.pt"))
        fresh = gossip_ext.GossipDataParallel(nn.Linear(D, 1, bias=False))
        fresh.load_state_dict(torch.load(os.path.join(ckpt, f"{rank}.pt"), weights_only=False))
        result["restored_peers"] = fresh.peers_per_itr
        result["restored_round"] = fresh.gossip_round
    return result


def _reference() -> torch.Tensor:
    books = reference.graph_phone_books("npeer_exponential", N)
    x = torch.stack([_initial(r) for r in range(N)]).double()
    t = 0
    for peers, rounds in ROUNDS_AT:
        for _ in range(rounds):
            x = reference.mixing_matrix(books, peers, t) @ x
            t += 1
    return x


def test_changing_peers_per_itr_between_steps_follows_the_reference_schedule(tmp_path):
    results = run_ranks(N, _gossip_with_schedule, str(tmp_path))
    expected = _reference()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["z"].double(), expected[rank], rtol=1e-6, atol=1e-5)
        # A float32 message of D elements per out-peer: twice the bytes with two peers.
        message = D * 4
        assert result["bytes"] == [message] * 3 + [2 * message] * 3 + [message] * 2
        assert result["restored_peers"] == 1 and result["restored_round"] == 8


def _checkpoint_keeps_peers(rank: int, world_size: int, ckpt: str) -> dict:
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1, bias=False))
    model.set_peers_per_itr(2)
    model.transfer_params()
    torch.save(model.state_dict(), os.path.join(ckpt, f"{rank}.pt"))
    fresh = gossip_ext.GossipDataParallel(nn.Linear(D, 1, bias=False))
    fresh.load_state_dict(torch.load(os.path.join(ckpt, f"{rank}.pt"), weights_only=False))
    before = fresh.bytes_sent
    fresh.transfer_params()
    fresh.sync_comms()
    return {"peers": fresh.peers_per_itr, "bytes": fresh.bytes_sent - before}


def test_the_checkpoint_keeps_peers_per_itr(tmp_path):
    for result in run_ranks(N, _checkpoint_keeps_peers, str(tmp_path)):
        assert result == {"peers": 2, "bytes": 2 * D * 4}


def _disagree(rank: int, world_size: int) -> str:
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1, bias=False))
    try:
        model.set_peers_per_itr(1 + rank % 2)
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_that_disagree_on_peers_per_itr_all_raise():
    for message in run_ranks(N, _disagree):
        assert "peers_per_itr" in message and "rank 1" in message


def _bad_value(rank: int, world_size: int) -> list[str]:
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1, bias=False))
    errors = []
    for value in (0, N, 1.5):
        try:
            model.set_peers_per_itr(value)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    return errors


def test_a_bad_peers_per_itr_names_the_argument():
    for errors in run_ranks(N, _bad_value):
        assert len(errors) == 3, errors
        assert all("peers_per_itr" in e for e in errors), errors
        assert errors[2].startswith("TypeError")
