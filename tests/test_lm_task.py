"""The real task of the benchmarks: the standard library's sources split by file, byte batches
that depend on (seed, step, rank) alone, and a small byte-level transformer that learns them."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.tasks import byte_lm, stdlib_text
from harness.tasks.byte_lm import ByteLM, ByteLMConfig
from harness.tasks.stdlib_text import StdlibText

ROOT = Path(__file__).resolve().parent.parent  # the folder holding harness/


@pytest.fixture(scope="module")
def data() -> StdlibText:
    return StdlibText.load()


def test_the_split_is_by_file_disjoint_and_deterministic(data):
    files = stdlib_text.source_files()
    assert len(files) > 500  # the whole standard library, not a handful
    assert not any("site-packages" in f for f in files)
    train, heldout = stdlib_text.split(files)
    assert set(train).isdisjoint(heldout)
    assert sorted(train + heldout) == files
    # About one file in twenty, by a hash of the path: the same whatever the listing order.
    assert 0.02 < len(heldout) / len(files) < 0.09
    assert stdlib_text.split(list(reversed(files))) == (train[::-1], heldout[::-1])
    assert data.train_files == tuple(train) and data.heldout_files == tuple(heldout)
    # The bytes are the files' own, separated by a zero byte.
    first = (stdlib_text.stdlib_root() / heldout[0]).read_bytes()
    assert bytes(data.heldout[: len(first)].tolist()) == first


def test_a_batch_depends_on_seed_step_and_rank_only(data):
    x, y = data.batch(step=3, rank=1, batch_size=4, context=32, seed=7)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    torch.manual_seed(12345)  # the global generator plays no part
    again = data.batch(step=3, rank=1, batch_size=4, context=32, seed=7)
    assert torch.equal(again[0], x)
    for other in ({"step": 4}, {"rank": 2}, {"seed": 8}):
        args = {"step": 3, "rank": 1, "seed": 7, **other}
        assert not torch.equal(data.batch(batch_size=4, context=32, **args)[0], x), other


def test_a_batch_is_the_same_in_another_process(data):
    code = (
        "from harness.tasks.stdlib_text import StdlibText\n"
        "x, _ = StdlibText.load().batch(step=5, rank=2, batch_size=2, context=16, seed=1)\n"
        "print(x.tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    x, _ = data.batch(step=5, rank=2, batch_size=2, context=16, seed=1)
    assert out.stdout.strip() == str(x.tolist())


def test_heldout_windows_are_fixed_and_from_heldout_files(data):
    windows = data.heldout_windows(context=64, count=10)
    assert windows.shape == (10, 65)
    assert torch.equal(windows, data.heldout_windows(context=64, count=10))
    assert torch.equal(windows[0], data.heldout[:65].long())


def test_bad_arguments_name_themselves(data):
    with pytest.raises(ValueError, match="batch_size"):
        data.batch(step=0, rank=0, batch_size=0, context=8)
    with pytest.raises(ValueError, match="width must be a multiple of heads"):
        ByteLMConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="longer than the context"):
        ByteLM(ByteLMConfig(layers=1, width=16, heads=2, context=8))(torch.zeros(1, 9).long())
    with pytest.raises(ValueError, match="warmup"):
        byte_lm.make_optimizer(ByteLM(ByteLMConfig(layers=1, width=16, heads=2)), 1e-3, 10, 10)


def test_an_untrained_model_scores_about_eight_bits_and_training_lowers_it(data):
    torch.manual_seed(0)
    config = ByteLMConfig(layers=2, width=64, heads=4, context=64)
    model = ByteLM(config)
    windows = data.heldout_windows(context=config.context, count=16)
    before = byte_lm.heldout_bits_per_byte(model, windows)
    assert abs(before - 8.0) < 0.5, before  # close to uniform over 256 bytes
    opt, schedule = byte_lm.make_optimizer(model, lr=3e-3, warmup=5, total_steps=60)
    for step in range(60):
        x, y = data.batch(step=step, rank=0, batch_size=16, context=config.context)
        loss = byte_lm.next_byte_loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    after = byte_lm.heldout_bits_per_byte(model, windows)
    assert after < before - 2.0, (before, after)
    assert model.training  # evaluation restores the mode it found


def test_the_default_model_has_a_few_million_parameters():
    count = sum(p.numel() for p in ByteLM().parameters())
    assert 1_000_000 <= count <= 10_000_000, count


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    model = ByteLM(ByteLMConfig(layers=1, width=16, heads=2, context=8))
    opt, schedule = byte_lm.make_optimizer(model, lr=1.0, warmup=4, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    # No weight decay on vectors or on the positions.
    decayed = opt.param_groups[0]["params"]
    assert all(p.dim() >= 2 for p in decayed) and all(p is not model.positions for p in decayed)
