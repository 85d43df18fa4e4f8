"""gossip_ext's own messages sealed on the wire (Note [Sealed messages]; Elastic(messages=...)), on
real processes over gloo: rounds through the sealed transport give the plain transport's bits,
sealed or encrypted; a rank whose key differs (a message forged on the way) is refused before it
is absorbed, naming it, and the parameters keep their model; an elastic job with a secret trains
with sealed messages and NCCL is refused with them. The reference is the plain transport's round."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from elastic_job import STEPS, Job
from multiprocess import run_ranks

import gossip_ext
from gossip_ext._torch_check import _C
from gossip_ext.errors import PeerTimeoutError
from gossip_ext.gossip import transport

pytestmark = pytest.mark.skipif(
    not transport.available_sealing(),
    reason="this build has no sealed messages (no OpenSSL libcrypto at build time)",
)

ROUNDS = 4


def _key(sender: int, receiver: int, forger: int = -1) -> bytes:
    # A forger seals its messages with a key of its own: to its peers they are forged.
    salt = b"forged" if sender == forger else b"job"
    return hashlib.sha256(salt + bytes([sender, receiver])).digest()


def _rounds(rank, world_size, mode, forger):
    group = dist.group.WORLD
    wire = _C.ProcessGroupTransport(group)
    if mode != "plain":
        # The forger alone keys its own messages otherwise; its peers expect the job's key.
        mine = forger if rank == forger else -1
        sealing = transport.Sealing(lambda s, r: _key(s, r, mine), encrypt=mode == "encrypted")
        wire = sealing.wrap(wire, group)
    params = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    engine = _C.GossipEngine(
        [params],
        ["w"],
        wire,
        _C.EngineOptions(
            gossip_ext.NPeerDynamicDirectedExponentialGraph().compiled_options(),
            gossip_ext.UniformMixing().compiled_options(),
            synchronous=True,
            timeout=timedelta(seconds=10),
        ),
    )
    try:
        for _ in range(ROUNDS):
            before = params.clone()  # the model the failed round must leave
            engine.start_round()
            engine.finish_round()
    except PeerTimeoutError as error:
        kept = torch.equal(params, before)
        return {"error": str(error), "peers": list(error.peers), "kept": kept}
    return {"params": params.clone(), "name": wire.name}


def test_sealed_and_encrypted_rounds_give_the_plain_rounds_bits():
    plain = run_ranks(4, _rounds, "plain", -1)
    for mode in ("sealed", "encrypted"):
        sealed = run_ranks(4, _rounds, mode, -1)
        for rank in range(4):
            assert torch.equal(sealed[rank]["params"], plain[rank]["params"]), (mode, rank)
            assert sealed[rank]["name"] == f"{mode}(process_group(gloo))"


def test_a_forged_message_is_refused_before_it_is_absorbed_naming_its_sender():
    results = run_ranks(4, _rounds, "sealed", 2)
    # Rank 2's out-peers in the first round (+1: rank 3) refuse its message; the parameters
    # keep the model they held before the round.
    refused = [r for r in range(4) if "error" in results[r] and results[r]["peers"] == [2]]
    assert 3 in refused, results
    for rank in refused:
        assert "refused a message from peer 2" in results[rank]["error"]
        assert "not absorbed" in results[rank]["error"]
        assert results[rank]["kept"], rank


def test_nccl_and_the_messages_option_are_refused_where_they_cannot_be_kept():
    with pytest.raises(ValueError, match="messages"):
        gossip_ext.Elastic("h:1", messages="secret")
    sealing = transport.Sealing(lambda s, r: _key(s, r))
    with pytest.raises(ValueError, match="NCCL transport's cannot be sealed"):
        transport.make_transport(
            transport.NCCL, None, torch.device("cuda", 0), timedelta(seconds=1), None, sealing
        )


def test_an_elastic_job_with_a_secret_trains_with_its_messages_sealed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a job secret, 16 bytes or more\n")
    secret.chmod(0o600)
    job = Job(tmp_path / "job", env={"GOSSIP_EXT_JOB_SECRET_FILE": str(secret)})
    try:
        for name in ("w0", "w1"):
            job.start(name, "--min-workers", "2")  # SGP, messages="sealed" by default
        job.wait(120)
        results = {name: job.result(name) for name in ("w0", "w1")}
        logs = {name: job.log(name) for name in ("w0", "w1")}
    finally:
        job.close()
    for name, result in results.items():
        assert result["error"] is None and result["final_step"] == STEPS, (name, logs[name])
        assert "its messages sealed" in logs[name], logs[name]
