"""gossip_ext.algorithms: the algorithm objects check their own arguments, the flat keywords of
earlier releases translate into the same objects, and both spellings train alike."""

import importlib
import re
from datetime import timedelta

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext
from gossip_ext import algorithms as A
from gossip_ext import flat_keywords as F


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.5, nesterov=True)


# Every flat spelling the guides (docs/) and the compat layers use, and the objects it stands for.
TRANSLATIONS = [
    ({}, (A.SGP(), None, None)),
    ({"overlap": True}, (A.SGP(overlap=True), None, None)),
    (
        {"overlap": True, "start_in_forward": True},
        (A.SGP(overlap=True, start_in_forward=True), None, None),
    ),
    ({"synch_freq": 2}, (A.SGP(synch_freq=2), None, None)),
    (
        {"push_sum": False, "graph": gossip_ext.RingGraph(peers_per_itr=2)},
        (A.PushPull(graph=gossip_ext.RingGraph(peers_per_itr=2)), None, None),
    ),
    ({"message_dtype": "int8"}, (A.SGP(message_dtype="int8"), None, None)),
    ({"base_algorithm": "localsgd", "global_avg_freq": 4}, (None, A.Average(4), None)),
    ({"global_avg_freq": 8}, (A.SGP(), A.Average(8), None)),
    (
        {"slowmo_freq": 6, "slowmo_momentum": 0.3, "slowmo_lr": 0.9},
        (A.SGP(), A.SlowMo(6, momentum=0.3, lr=0.9), None),
    ),
    (
        {
            "slowmo_freq": 6,
            "slowmo_memory_efficient": True,
            "slowmo_num_shards": 2,
            "base_algorithm": "localsgd",
        },
        (None, A.SlowMo(6, memory_efficient=True, num_shards=2), None),
    ),
    (  # fairscale's LocalSGD with SlowMo: plain averages between the SlowMo steps
        {"base_algorithm": "localsgd", "global_avg_freq": 1, "slowmo_freq": 2},
        (None, A.SlowMo(2, average_every=1), None),
    ),
    (
        {"base_algorithm": "localsgd", "sync_every": 64, "outer_optimizer": _outer_sgd},
        (None, A.DiLoCo(_outer_sgd, every=64), None),
    ),
    (
        {
            "base_algorithm": "localsgd",
            "sync_every": 16,
            "outer_optimizer": _outer_sgd,
            "fragments": 4,
            "fragment_delay": 1,
            "outer_dtype": "int4",
            "outer_device": "cpu",
        },
        (
            None,
            A.DiLoCo(
                _outer_sgd,
                every=16,
                average=A.Exact(dtype="int4", device="cpu"),
                fragments=4,
                delay=1,
            ),
            None,
        ),
    ),
    (
        {"sync_every": 8, "outer_optimizer": _outer_sgd, "outer_average": "gossip"},
        (A.SGP(), A.DiLoCo(_outer_sgd, every=8, average=A.ByGossip()), None),
    ),
    (
        {"membership": "127.0.0.1:29400", "min_workers": 3},
        (A.SGP(), None, A.Elastic("127.0.0.1:29400", min_workers=3)),
    ),
]


@pytest.mark.parametrize("flat, objects", TRANSLATIONS)
def test_flat_keywords_translate_into_the_objects_and_back(flat, objects):
    assert F.from_flat(flat) == objects
    back = F.to_flat(*objects)
    for name, value in flat.items():
        if name == "global_avg_freq" or (name == "sync_every" and "outer_optimizer" not in flat):
            continue  # the two spellings of an exact average every k steps: checked below
        assert back[name] == value, name
    assert set(back) == set(F.FLAT_DEFAULTS)


def test_an_exact_average_every_k_steps_has_one_object_whatever_its_flat_spelling():
    # sync_every without an outer optimizer is LocalSGD's plain average, as global_avg_freq is.
    assert F.from_flat({"base_algorithm": "localsgd", "sync_every": 5}) == (
        None,
        A.Average(5),
        None,
    )
    assert F.to_flat(None, A.Average(5), None)["sync_every"] == 5
    assert F.to_flat(A.SGP(), A.Average(5), None)["global_avg_freq"] == 5


def test_an_elastic_job_s_name_and_timings_have_no_flat_keyword_and_are_never_dropped():
    flat = F.to_flat(A.SGP(), None, A.Elastic("h:1", min_workers=2))
    assert (flat["membership"], flat["min_workers"]) == ("h:1", 2)
    for unspellable, words in [
        ({"silent_s": 2.0}, "silent_s=2.0"),
        ({"heartbeat_s": 0.05}, "heartbeat_s=0.05"),
        ({"job": "run-7"}, "job='run-7'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words) + ".*pass the Elastic object"):
            F.to_flat(A.SGP(), None, A.Elastic("h:1", **unspellable))


def test_localsgd_averaged_by_gossip_keeps_its_own_graph():
    ring = gossip_ext.RingGraph()
    flat = {
        "base_algorithm": "localsgd",
        "sync_every": 8,
        "outer_optimizer": _outer_sgd,
        "outer_average": "gossip",
        "graph": ring,
        "message_dtype": torch.bfloat16,
    }
    gossip, outer, _ = F.from_flat(flat)
    assert gossip is None
    assert outer.average == A.ByGossip(graph=ring, message_dtype=torch.bfloat16)
    back = F.to_flat(gossip, outer, None)
    assert (back["graph"], back["message_dtype"], back["outer_average"]) == (
        ring,
        torch.bfloat16,
        "gossip",
    )
    with pytest.raises(ValueError, match="engine of its own, but gossip is set"):
        F.to_flat(A.SGP(), A.DiLoCo(_outer_sgd, every=8, average=A.ByGossip(graph=ring)), None)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (
            lambda: A.SGP(synch_freq=-1),
            ValueError,
            r"SGP\(synch_freq=...\): synch_freq must be >= 0, got -1",
        ),
        (lambda: A.SGP(overlap=1), TypeError, r"SGP\(overlap=...\): overlap must be a bool"),
        (lambda: A.SGP(overlap=True, synch_freq=2), ValueError, "two different schedules"),
        (lambda: A.PushPull(start_in_forward=True), ValueError, "needs overlap=True"),
        (lambda: A.SGP(message_dtype="int3"), ValueError, r"message_dtype must be .* got 'int3'"),
        (lambda: A.SGP(graph="ring"), TypeError, r"SGP\(graph=...\): graph must be a gossip_ext"),
        (lambda: A.Average(0), ValueError, r"Average\(every=...\): every must be >= 1"),
        (lambda: A.Average(True), TypeError, r"every must be an int, got True"),
        (
            lambda: A.SlowMo(4, momentum=1.0),
            ValueError,
            r"SlowMo\(momentum=...\): momentum must be in",
        ),
        (lambda: A.SlowMo(4, lr=0.0), ValueError, r"SlowMo\(lr=...\): lr must be positive"),
        (
            lambda: A.SlowMo(4, num_shards=0),
            ValueError,
            r"num_shards=...\): num_shards must be >= 1",
        ),
        (
            lambda: A.SlowMo(4, average_every=0),
            ValueError,
            r"average_every=...\): average_every must be >= 1",
        ),
        (lambda: A.DiLoCo("sgd", every=4), TypeError, r"DiLoCo\(optimizer=...\): optimizer must"),
        (lambda: A.DiLoCo(_outer_sgd, every=4, fragments=5), ValueError, r"fragments=...\)"),
        (lambda: A.DiLoCo(_outer_sgd, every=8, fragments=4, delay=2), ValueError, "delay"),
        (lambda: A.DiLoCo(_outer_sgd, every=8, alpha=2.0), ValueError, r"alpha=...\)"),
        (lambda: A.DiLoCo(_outer_sgd, every=8, average="gossip"), TypeError, "ByCollective"),
        (lambda: A.Exact(dtype="int3"), ValueError, r"ByCollective\(dtype=...\)"),
        (lambda: A.Exact(device="gpu:x"), ValueError, r"ByCollective\(device=...\)"),
        (lambda: A.Elastic("nohost"), ValueError, "HOST:PORT"),
        (
            lambda: A.Elastic("h:1", min_workers=0),
            ValueError,
            r"min_workers=...\): min_workers must be",
        ),
    ],
)
def test_each_object_checks_its_own_arguments_and_names_them(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_the_wrapper_refuses_objects_beside_flat_keywords_and_unknown_keywords():
    net = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"gossip given as objects beside the flat keywords"):
        gossip_ext.GossipDataParallel(net, A.SGP(), overlap=True)
    with pytest.raises(TypeError, match=r"outer given as objects .*\['sync_every'\]"):
        gossip_ext.GossipDataParallel(net, outer=A.Average(4), sync_every=4)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['overlapp'\]"):
        gossip_ext.GossipDataParallel(net, overlapp=True)
    with pytest.raises(
        TypeError, match=r"gossip must be SGP\(...\), PushPull\(...\), AsyncSGP\(...\) or None"
    ):
        gossip_ext.GossipDataParallel(net, gossip="sgp")
    with pytest.raises(TypeError, match=r"outer must be Average"):
        gossip_ext.GossipDataParallel(net, outer=A.Exact())


def _train(rank: int, world_size: int, spelling: str) -> dict:
    torch.manual_seed(rank)
    net = nn.Linear(4, 1)
    if spelling == "objects":
        model = gossip_ext.GossipDataParallel(
            net,
            A.SGP(graph=gossip_ext.RingGraph(), overlap=True),
            A.DiLoCo(_outer_sgd, every=3, fragments=2),
        )
    else:
        model = gossip_ext.GossipDataParallel(
            net,
            graph=gossip_ext.RingGraph(),
            overlap=True,
            sync_every=3,
            outer_optimizer=_outer_sgd,
            fragments=2,
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.register_optimizer(opt)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(7):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "algorithms": model.algorithms,
    }


def _train_both(rank: int, world_size: int) -> dict:
    return {spelling: _train(rank, world_size, spelling) for spelling in ("objects", "flat")}


def test_both_spellings_train_the_same_model():
    runs = run_ranks(3, _train_both)
    by_objects = [run["objects"] for run in runs]
    by_flat = [run["flat"] for run in runs]
    for a, b in zip(by_objects, by_flat):
        assert a["algorithms"][0] == b["algorithms"][0]
        assert a["algorithms"][1].every == b["algorithms"][1].every == 3
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)
    assert not torch.equal(by_objects[0]["params"][0], by_objects[1]["params"][0]), (
        "the ranks trained alike: the test would not see a difference in gossip"
    )


def _rules(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    params = [torch.zeros(3, 2), torch.zeros(5), torch.zeros(4)]
    group = dist.group.WORLD
    ring = gossip_ext.RingGraph()
    built = {}
    for name, outer in {
        "average": A.Average(4),
        "average_int8": A.Average(4, average=A.ByCollective(dtype="int8")),
        "slowmo": A.SlowMo(4, momentum=0.3, lr=0.9),
        "slowmo_sharded": A.SlowMo(4, memory_efficient=True, num_shards=1),
        "diloco": A.DiLoCo(_outer_sgd, every=8),
        "streaming": A.DiLoCo(_outer_sgd, every=8, fragments=2, delay=1),
        "streaming_by_gossip": A.DiLoCo(_outer_sgd, every=8, fragments=2, average=A.ByGossip()),
    }.items():
        rule = outer.rule(
            params,
            group,
            graph=ring,
            mixing=gossip_ext.UniformMixing(),
            timeout=timedelta(seconds=30),
        )
        built[name] = None if rule is None else (type(rule).__name__, rule.describe())
    return built


def _rules_and_nothing_averaging(rank: int, world_size: int) -> dict:
    return {
        "rules": _rules(rank, world_size),
        "nothing_averages": {
            s: _nothing_averages(rank, world_size, s) for s in ("objects", "flat")
        },
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The outer steps' rules and the jobs where nothing averages: one set of 2 processes."""
    return run_ranks(2, _rules_and_nothing_averaging)


def test_each_outer_step_builds_its_own_rule(two_ranks):
    built = two_ranks[0]["rules"]
    # A plain average keeps nothing; in compressed messages, the model of the last average.
    assert built["average"] == ("PlainAverage", "PlainAverage")
    assert built["average_int8"] == ("GlobalAverage", "GlobalAverage")
    assert built["slowmo"] == ("SlowMomentum", ("SlowMo", 0.3, 0.9, 1))
    assert built["slowmo_sharded"][0] == "SlowMomentum"
    assert built["diloco"][0] == "OuterOptimizer"
    kind, description = built["streaming"]
    assert kind == "StreamingOuter" and description[0] == "StreamingDiLoCo"
    assert len(description[1]) == 2 and description[2] == 1  # two fragments, delay 1
    assert built["streaming_by_gossip"][0] == "StreamingOuter"


# ----------------------------------------------------------------------------- descriptions


def test_each_object_describes_itself_in_plain_values_for_the_ranks_comparison():
    # The default graph and mixing described as the ones they stand for: SGP() and SGP with
    # them spelled out configure the same rounds.
    spelled = A.SGP(
        graph=gossip_ext.NPeerDynamicDirectedExponentialGraph(), mixing=gossip_ext.UniformMixing()
    )
    assert A.SGP().describe() == spelled.describe()
    assert A.SGP(message_dtype=torch.bfloat16).describe()["message_dtype"] == "torch.bfloat16"
    assert A.SGP().describe()["kind"] == "SGP" and A.PushPull().describe()["kind"] == "PushPull"
    # check_finite is each rank's own choice, not the rounds'.
    assert "check_finite" not in A.SGP().describe()
    assert A.SGP(check_finite=False).describe() == A.SGP().describe()
    diloco = A.DiLoCo(lambda ps: torch.optim.SGD(ps, lr=0.7), every=8, average=A.Exact("int4"))
    assert diloco.describe() == {
        "kind": "DiLoCo",
        "every": 8,
        "average": {"kind": "ByCollective", "dtype": "int4", "device": None},
        "fragments": 1,
        "delay": 0,
        "alpha": 0.0,
    }  # the optimizer is described by the rule it builds
    assert A.Average(every=3).describe() == {
        "kind": "Average",
        "every": 3,
        "average": {"kind": "ByCollective", "dtype": None, "device": None},
    }
    assert A.Average(every=3).describe() != A.Average(every=4).describe()
    ring = A.ByGossip(graph=gossip_ext.RingGraph()).describe()
    assert ring["graph"] == "RingGraph(peers_per_itr=1)" and ring["mixing"] is None


def test_the_engine_is_built_by_the_gossip_object_else_by_an_outer_steps_bygossip():
    def optimizer(ps):
        return torch.optim.SGD(ps, lr=0.7)

    def owner(gossip, outer):
        return A.Configuration(gossip, outer).engine_owner

    sgp, by_gossip = A.SGP(overlap=True), A.ByGossip(graph=gossip_ext.RingGraph())
    assert owner(sgp, None) is sgp
    assert owner(sgp, A.DiLoCo(optimizer, every=4, average=A.ByGossip())) is sgp
    assert owner(None, A.DiLoCo(optimizer, every=4, average=by_gossip)) is by_gossip
    assert owner(None, A.DiLoCo(optimizer, every=4)) is None
    assert owner(None, A.Average(every=4)) is None
    assert owner(None, A.SlowMo(every=4)) is None


# ----------------------------------------------------------------------------- the user's words


@pytest.mark.parametrize(
    "make, words",
    [
        (
            lambda: A.DiLoCo(torch.optim.SGD, every=4),
            [
                "DiLoCo(optimizer=...): optimizer must build a configured optimizer",
                "the class torch.optim.SGD",
                "lambda params: torch.optim.SGD(params, lr=...)",
            ],
        ),
        (  # the flat spelling: the same check, in the keyword the user wrote
            lambda: gossip_ext.GossipDataParallel(
                nn.Linear(2, 1), outer_optimizer=torch.optim.Adam, sync_every=4
            ),
            ["outer_optimizer must build a configured optimizer", "torch.optim.Adam"],
        ),
        (
            lambda: gossip_ext.GossipDataParallel(
                nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
            ),
            ["already wrapped in DistributedDataParallel", "module.module"],
        ),
        (  # FSDP is looked for only once imported: whoever wrapped the module imported it
            lambda: gossip_ext.GossipDataParallel(
                importlib.import_module("torch.distributed.fsdp").FullyShardedDataParallel.__new__(
                    importlib.import_module("torch.distributed.fsdp").FullyShardedDataParallel
                )
            ),
            ["already wrapped in FullyShardedDataParallel", "module.module"],
        ),
    ],
)
def test_a_mistake_is_named_in_the_spelling_the_user_wrote(make, words):
    with pytest.raises(TypeError) as raised:
        make()
    for word in words:
        assert word in str(raised.value), str(raised.value)


def _nothing_averages(rank: int, world_size: int, spelling: str) -> str:
    kwargs = {"gossip": None} if spelling == "objects" else {"base_algorithm": "localsgd"}
    try:
        gossip_ext.GossipDataParallel(nn.Linear(2, 1), **kwargs)
    except ValueError as error:
        return str(error)
    return ""


def test_a_job_where_nothing_averages_is_refused_in_the_users_spelling(two_ranks):
    by_objects = [run["nothing_averages"]["objects"] for run in two_ranks]
    by_flat = [run["nothing_averages"]["flat"] for run in two_ranks]
    for error in by_objects:
        assert "gossip=None and outer=None" in error and "base_algorithm" not in error, error
    for error in by_flat:
        assert "base_algorithm='localsgd' runs no gossip" in error, error
