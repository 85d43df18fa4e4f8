"""What a user reads is the model (Note [The parameters are the model]).

Users of DDP read the parameters whenever they like: right after ``opt.step()``, through
``model.module.state_dict()``, after ``model.eval()``, through the wrapper's ``state_dict()``. In
every mode each of those reads must be a valid model: the de-biased parameters of the last
absorbed round, or those of the latest optimizer step, never a share in flight.

Every read is checked against tests/training_reference.py, the plain-PyTorch push-sum simulator,
replayed up to the point of the read: the reading rank's event log is cut there, the others run
to their end (their later events cannot reach the reading rank's past).
"""

from __future__ import annotations

import pytest
import reference
import torch
from multiprocess import run_ranks
from torch import nn
from training_reference import log_gossip, replay

import gossip_ext

D = 4
LR = 0.05
STEPS = 5
EVAL_AT = (1, 3)  # steps after which the loop calls eval() (and evaluates), then train()

MODES = {
    "sync": {},
    "overlap": {"overlap": True},
    "bounded_async": {"synch_freq": 2},
    "push_pull": {"push_sum": False, "graph": gossip_ext.RingGraph(peers_per_itr=2)},
    "compressed": {"message_dtype": torch.bfloat16},
    "compressed_overlap": {"message_dtype": torch.bfloat16, "overlap": True},
    "compressed_float16": {"message_dtype": torch.float16},
    "quantized": {"message_dtype": "int8"},
    "quantized_overlap": {"message_dtype": "int8", "overlap": True},
    "hierarchical": {"nprocs_per_node": 2},
    "float16_model": {},
    "bfloat16_model": {},
}
# A model of 16-bit parameters gossips 16-bit messages: the kernels whose every operand is 16-bit.
# Its 41 parameters are more than the widest vector loop takes at once (32), so that the CPU
# kernels' vector code runs, not only their scalar tail.
MODEL_DTYPE = {"float16_model": torch.float16, "bfloat16_model": torch.bfloat16}
WIDE_D = 40
# bfloat16 messages round each message to 8 bits of mantissa (float16: 11); the error feedback
# keeps the mean but not each worker's value, so compressed modes are checked to the message
# precision. A half-absorbed round would be off by a third or half of the parameters' size (about
# 0.3 here).
# A 16-bit model computes its gradients and steps in its own precision, against the reference's
# float64.
TOLERANCE = {
    "compressed": 2e-2,
    "compressed_overlap": 2e-2,
    "compressed_float16": 3e-3,
    # int8 blocks: a level is 1/127 of the block's largest value (Note [Quantized messages]).
    "quantized": 2e-2,
    "quantized_overlap": 2e-2,
    "float16_model": 3e-3,
    "bfloat16_model": 2e-2,
}


def _width(mode: str) -> int:
    return WIDE_D if mode in MODEL_DTYPE else D


def _data(world_size: int, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4321)
    return torch.randn(world_size, 3, d, generator=g), torch.randn(world_size, 3, 1, generator=g)


def _snapshot(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _train_and_read(rank: int, world_size: int, mode: str) -> dict:
    kwargs = MODES[mode]
    m = kwargs.get("nprocs_per_node", 1)
    dtype = MODEL_DTYPE.get(mode, torch.float32)
    x, y = (t.to(dtype) for t in _data(world_size, _width(mode)))
    torch.manual_seed(0)
    module = nn.Linear(_width(mode), 1).to(dtype)
    model = gossip_ext.GossipDataParallel(module, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.register_optimizer(opt)
    events: list[str] = []
    reads = []  # (what, len(events) at the read, parameters read)

    def read(what: str, params: list[torch.Tensor]) -> None:
        reads.append((what, len(events), params))

    for step in range(STEPS):
        log_gossip(model, lambda: model(x[rank]), events)
        loss = ((model.module(x[rank]) - y[rank]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        log_gossip(model, opt.step, events, step=True)
        read(f"after step {step}", _snapshot(module))
        state = model.module.state_dict()  # views of the parameters: copied when read
        read(
            f"module.state_dict() after step {step}",
            [state["weight"].clone(), state["bias"].clone()],
        )
        if step in EVAL_AT:
            log_gossip(model, model.eval, events)
            read(f"after eval() at step {step}", _snapshot(module))
            with torch.no_grad():
                model(x[rank])  # an evaluation forward changes nothing either
            read(f"after an eval forward at step {step}", _snapshot(module))
            model.train()
    wrapper_state = {}
    log_gossip(model, lambda: wrapper_state.update(model.state_dict()), events)
    read(
        "GossipDataParallel.state_dict()",
        [wrapper_state["module.weight"].clone(), wrapper_state["module.bias"].clone()],
    )
    torch.manual_seed(0)
    return {
        "init": _snapshot(nn.Linear(_width(mode), 1).to(dtype)),
        "events": events,
        "reads": reads,
        "is_leader": rank % m == 0,
    }


def _expected_at(world_size: int, mode: str, results: list[dict], node: int, cut: int):
    """The reference model of gossiping node ``node`` after the first ``cut`` of its events."""
    kwargs = MODES[mode]
    m = kwargs.get("nprocs_per_node", 1)
    nodes = world_size // m
    x, y = _data(world_size, _width(mode))
    graph = kwargs.get("graph")
    kind = "ring" if graph is not None else "npeer_exponential"
    p = graph.peers_per_itr if graph is not None else 1
    books = reference.graph_phone_books(kind, nodes, p)
    leaders = [results[i * m] for i in range(nodes)]

    def grad_fn(i, z):
        # A node's gradient is the mean of its processes' (nprocs_per_node > 1 averages them).
        weight, bias = (t.requires_grad_() for t in z)
        losses = [
            ((x[r].double() @ weight.T + bias - y[r].double()) ** 2).mean()
            for r in range(i * m, (i + 1) * m)
        ]
        (sum(losses) / m).backward()
        return [weight.grad, bias.grad]

    events = [list(r["events"]) for r in leaders]
    events[node] = events[node][:cut]
    return replay(
        init=[r["init"] for r in leaders],
        grad_fn=grad_fn,
        lr=LR,
        events=events,
        out_peers=lambda i, r: reference.out_peers(books, p, i, r),
        complete=[node],
    )[node]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_read_between_steps_is_a_valid_model(mode):
    world_size = 4 if mode == "hierarchical" else 3
    m = MODES[mode].get("nprocs_per_node", 1)
    results = run_ranks(world_size, _train_and_read, mode)
    tol = TOLERANCE.get(mode, 1e-5)
    for rank, result in enumerate(results):
        leader = results[rank - rank % m]
        for index, (what, cut, params) in enumerate(result["reads"]):
            if result["is_leader"]:
                want = _expected_at(world_size, mode, results, rank // m, cut)
            else:
                # A process that does not gossip reads what its machine's gossiping process
                # read at the same point (that one is checked against the reference).
                want = [t.double() for t in leader["reads"][index][2]]
            for got, expected in zip(params, want):
                torch.testing.assert_close(
                    got.double(),
                    expected,
                    rtol=tol,
                    atol=tol,
                    msg=lambda msg, what=what, rank=rank: f"{mode}, rank {rank}, {what}: {msg}",
                )


def _identical_data_compressed(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    x, y = _data(1)
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module, message_dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.register_optimizer(opt)
    reads = []
    for _ in range(STEPS):
        loss = ((model(x[0]) - y[0]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        reads.append(_snapshot(module))
    return reads


def test_compressed_messages_read_after_a_step_equal_plain_sgd_on_identical_data():
    # Every rank trains on the same batch from the same start, so every average is of equal
    # models and the synchronous trajectory is plain SGD on one process. A read right after the
    # step must equal it to float32 rounding: the message's rounding error is not in the
    # parameters while the round is in flight (it is folded in when the round is absorbed).
    results = run_ranks(3, _identical_data_compressed)
    x, y = _data(1)
    torch.manual_seed(0)
    plain = nn.Linear(D, 1)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for step in range(STEPS):
        loss = ((plain(x[0]) - y[0]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for rank, reads in enumerate(results):
            for got, want in zip(reads[step], plain.parameters()):
                torch.testing.assert_close(
                    got, want.detach(), rtol=1e-6, atol=1e-6, msg=f"rank {rank}, step {step}"
                )
