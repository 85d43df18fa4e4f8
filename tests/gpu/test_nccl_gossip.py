"""GossipDataParallel and its NCCL transport on GPUs. Skipped, visibly, without a CUDA build and a
GPU. One GPU cannot hold two NCCL ranks: on one GPU, real rounds cross NCCL through
LoopbackTransport (one process plays a rank of a larger world, sending to itself), and a stalled
peer is emulated by holding the round behind the compute stream past the timeout, which NCCL
accepts (a receive from self without its send it rejects outright). A peer that really stalls
needs two GPUs, and its test skips below two."""

import pytest
import torch
from multiprocess import run_ranks
from nccl_rounds import held_round, hold_stream, nccl_transport
from torch import nn

from gossip_ext._torch_check import _C

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and hasattr(_C, "NcclTransport")),
        reason="needs a CUDA GPU and a CUDA build of gossip_ext",
    ),
]


def _train_on_gpu(rank: int, world_size: int) -> dict:
    import gossip_ext

    torch.manual_seed(0)
    module = nn.Linear(8, 1).cuda()
    model = gossip_ext.GossipDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 1, device="cuda")
    torch.manual_seed(0)
    ref = nn.Linear(8, 1).cuda()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = ((m(x) - y) ** 2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
        model.transfer_params()
    model.sync_comms()
    return {
        "gossip": [p.detach().cpu() for p in module.parameters()],
        "plain": [p.detach().cpu() for p in ref.parameters()],
        "rounds": model.gossip_round,
    }


def test_world_of_one_on_nccl_trains_like_plain_sgd():
    result = run_ranks(1, _train_on_gpu)[0]
    assert result["rounds"] == 5
    for got, want in zip(result["gossip"], result["plain"]):
        torch.testing.assert_close(got, want)


def test_a_round_past_its_timeout_raises_at_wait_and_stays_raised():
    # Note [Gossip stream ordering], rule 3: the watchdog fails the round, then aborts the
    # communicator, which completes the end event; wait() must raise rather than let an absorb
    # read the buffers, and so must every later round. The round waits behind a compute stream
    # that sleeps past the transport's timeout (4 s against 1 s): a peer that never answers.
    result = run_ranks(1, held_round, "test/slow-round", 1.0, 4.0, 1.0, 5)[0]
    assert result["error"] is not None, "wait() returned for a round the watchdog aborted"
    assert "round 5" in result["error"] and "peers [0]" in result["error"], result["error"]
    assert result["later"] == result["error"], result
    assert result["elapsed"] < 30.0, result["elapsed"]


def _one_peer_stalls(rank: int, world_size: int) -> dict:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.distributed_c10d._get_default_store()
    transport = _C.NcclTransport(store, "test/stall", rank, 2, rank, timedelta(seconds=2))
    transport.connect_peers([1 - rank])
    result = {"error": None, "elapsed": 0.0}
    if rank == 0:
        buffer = torch.zeros(1 << 16, device="cuda")
        start = time.monotonic()
        try:
            work = transport.exchange([(1, buffer.clone())], [(1, buffer)], 3)
            work.wait(timedelta(seconds=2))
        except TimeoutError as e:
            result["error"] = str(e)
        result["elapsed"] = time.monotonic() - start
        store.set("test/stall/done", "1")
    else:
        store.wait(["test/stall/done"], timedelta(seconds=60))  # alive, and never posts
    return result


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a stalled NCCL peer needs two GPUs")
def test_a_stalled_peer_on_another_gpu_times_out_naming_it():
    result = run_ranks(2, _one_peer_stalls)[0]
    assert result["error"] is not None, "a round with a silent peer completed"
    assert "round 3" in result["error"] and "peers [1]" in result["error"], result["error"]
    assert result["elapsed"] < 30.0, result["elapsed"]


# One GPU plays rank 2 of 5 through LoopbackTransport: every message of every round crosses NCCL
# to itself, and a rank that absorbs its own shares keeps its model.
LOOPBACK_CONFIGS = {
    "sent in place": {"synchronous": True},
    "overlap": {"synchronous": False},
    "travelling weights": {"synchronous": True, "self_weight": 0.3},
    "compressed": {"synchronous": True, "message_dtype": torch.bfloat16},
    "compressed overlap": {"synchronous": False, "message_dtype": torch.float16},
}


def _engine(config: dict, transport, params):
    from datetime import timedelta

    import gossip_ext

    mixing = (
        gossip_ext.SelfWeightMixing(config["self_weight"])
        if "self_weight" in config
        else gossip_ext.UniformMixing()
    )
    options = _C.EngineOptions(
        gossip_ext.NPeerDynamicDirectedExponentialGraph(peers_per_itr=2).compiled_options(),
        mixing.compiled_options(),
        synchronous=config["synchronous"],
        timeout=timedelta(seconds=3),
        message_dtype=config.get("message_dtype"),
    )
    return _C.GossipEngine(params, [f"p{i}" for i in range(len(params))], transport, options)


def _loopback_params() -> list:
    # Odd sizes, two dtype groups: several messages per peer each round.
    return [
        torch.randn(1001, device="cuda"),
        torch.randn(3, 333, dtype=torch.float64, device="cuda"),
    ]


def _loopback_rounds(rank: int, world_size: int) -> dict:
    results = {}
    for index, (name, config) in enumerate(LOOPBACK_CONFIGS.items()):
        params = _loopback_params()
        before = [p.clone() for p in params]
        transport = _C.LoopbackTransport(nccl_transport(f"test/loopback/{index}", 30.0), 2, 5)
        engine = _engine(config, transport, params)
        for _ in range(4):
            engine.start_round()
            engine.finish_round()
        engine.synchronize()
        results[name] = {
            "max_change": max((p - b).abs().max().item() for p, b in zip(params, before)),
            "bytes": engine.bytes_sent,
            "rounds": engine.round,
        }
    # A diverged rank: its own messages carry the Inf back; the flag is read one call later.
    params = [torch.randn(64, device="cuda")]
    params[0][5] = float("inf")
    engine = _engine(
        LOOPBACK_CONFIGS["sent in place"],
        _C.LoopbackTransport(nccl_transport("test/loopback/nonfinite", 30.0), 0, 3),
        params,
    )
    engine.start_round()
    engine.finish_round()
    try:
        engine.synchronize()
        results["nonfinite"] = None
    except FloatingPointError as error:
        results["nonfinite"] = str(error)
    return results


def test_rounds_through_nccl_to_self_keep_the_model():
    # A rank that absorbs its own shares keeps its model only if every message arrived whole: a
    # receive buffer NCCL left unwritten would move the parameters by their mixing share.
    results = run_ranks(1, _loopback_rounds)[0]
    for name in LOOPBACK_CONFIGS:
        r = results[name]
        tol = 1e-2 if "compressed" in name else 1e-5
        assert r["rounds"] == 4 and r["bytes"] > 0, (name, r)
        assert r["max_change"] < tol, (name, r)
    assert results["nonfinite"] is not None and "NaN or Inf" in results["nonfinite"]


def _engine_round_past_its_timeout(rank: int, world_size: int, name: str) -> dict:
    params = _loopback_params()
    transport = _C.LoopbackTransport(nccl_transport("test/loopback/slow", 3.0), 2, 5)
    engine = _engine(LOOPBACK_CONFIGS[name], transport, params)
    engine.start_round()
    engine.finish_round()
    engine.synchronize()
    model = [p.clone() for p in params]
    hold_stream(8.0)  # the next round waits behind the compute stream, past the timeout
    errors = []
    for call in (engine.start_round, engine.finish_round, engine.synchronize):
        try:
            call()
        except TimeoutError as error:
            errors.append(str(error))
    torch.cuda.synchronize()
    return {
        "errors": errors,
        "unchanged": all(torch.equal(p, m) for p, m in zip(params, model)),
    }


@pytest.mark.parametrize("name", ["sent in place", "overlap"])
def test_an_engine_round_past_its_timeout_leaves_the_model(name):
    result = run_ranks(1, _engine_round_past_its_timeout, name)[0]
    assert result["errors"], "a round the watchdog aborted was absorbed"
    assert "gossip round 1" in result["errors"][0] and "peers [0]" in result["errors"][0], result
    assert result["unchanged"], "the parameters changed in a round that timed out"
