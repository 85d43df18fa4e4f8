"""GossipDataParallel on a GPU over the NCCL transport. Skipped, visibly, without a CUDA build
and a GPU. One GPU cannot hold two NCCL ranks, so this runs at world size 1; multi-rank NCCL
needs a machine with several GPUs."""

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

from gossip_ext import _C

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and hasattr(_C, "NcclTransport")),
    reason="needs a CUDA GPU and a CUDA build of gossip_ext",
)


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


def _nccl_transport(key: str, timeout_s: float):
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    return _C.NcclTransport(store, key, 0, 1, 0, timedelta(seconds=timeout_s))


def _receive_from_self_that_never_comes(rank: int, world_size: int) -> dict:
    import time
    from datetime import timedelta

    transport = _nccl_transport("test/abort", 2.0)
    buffer = torch.full((1024,), 7.0, device="cuda")
    work = transport.exchange([], [(0, buffer)], 5)  # a receive from self; its send never comes
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=2))
        error = None
    except TimeoutError as e:
        error = str(e)
    return {"error": error, "elapsed": time.monotonic() - start}


def test_a_round_the_watchdog_aborts_raises_at_wait_instead_of_being_absorbed():
    # Note [Gossip stream ordering], rule 3: an aborted round completes its end event with a
    # partial buffer; wait() must raise rather than let an absorb read it.
    result = run_ranks(1, _receive_from_self_that_never_comes)[0]
    assert result["error"] is not None, "wait() returned for an aborted round"
    assert "round 5" in result["error"] and "peers [0]" in result["error"], result["error"]
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
        gossip_ext.NPeerDynamicDirectedExponentialGraph(peers_per_itr=2)._options(),
        mixing._options(),
        synchronous=config["synchronous"],
        timeout=timedelta(seconds=3),
        message_dtype=config.get("message_dtype"),
    )
    return _C.GossipEngine(params, [f"p{i}" for i in range(len(params))], transport, options)


def _loopback_rounds(rank: int, world_size: int) -> dict:
    results = {}
    for index, (name, config) in enumerate(LOOPBACK_CONFIGS.items()):
        # Odd sizes, two dtype groups: several messages per peer each round.
        params = [
            torch.randn(1001, device="cuda"),
            torch.randn(3, 333, dtype=torch.float64, device="cuda"),
        ]
        before = [p.clone() for p in params]
        transport = _C.LoopbackTransport(_nccl_transport(f"test/loopback/{index}", 3.0), 2, 5)
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
        # A dropped send: the receive never completes; the parameters stay the model.
        transport.drop_sends(1)
        model = [p.clone() for p in params]
        engine.start_round()
        try:
            engine.finish_round()
            results[name]["timeout"] = None
        except TimeoutError as error:
            results[name]["timeout"] = str(error)
        results[name]["unchanged_after_timeout"] = all(
            torch.equal(p, m) for p, m in zip(params, model)
        )
    # A diverged rank: its own messages carry the Inf back; the flag is read one call later.
    params = [torch.randn(64, device="cuda")]
    params[0][5] = float("inf")
    engine = _engine(
        LOOPBACK_CONFIGS["sent in place"],
        _C.LoopbackTransport(_nccl_transport("test/loopback/nonfinite", 3.0), 0, 3),
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


def test_rounds_through_nccl_to_self_keep_the_model_and_time_out_cleanly():
    results = run_ranks(1, _loopback_rounds)[0]
    for name in LOOPBACK_CONFIGS:
        r = results[name]
        tol = 1e-2 if "compressed" in name else 1e-5
        assert r["rounds"] == 4 and r["bytes"] > 0, (name, r)
        assert r["max_change"] < tol, (name, r)
        assert r["timeout"] is not None, (name, "a round missing a message was absorbed")
        assert "gossip round 4" in r["timeout"] and "peers [0]" in r["timeout"], (name, r)
        if "overlap" not in name or "compressed" not in name:
            assert r["unchanged_after_timeout"], (name, r)
    assert results["nonfinite"] is not None and "NaN or Inf" in results["nonfinite"]
