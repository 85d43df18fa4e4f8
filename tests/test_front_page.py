"""The README's front page serves a DDP user read top-down: what it is, how to install it, a
quickstart that runs as written (with its imports), then the headline and the two commands; and
every row of its table of modes is a configuration the library accepts."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torchrun import failure_report, torchrun

import gossip_ext

README = Path(__file__).resolve().parent.parent / "README.md"


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_front_page_reads_top_down():
    text = README.read_text()
    order = ["Install", "Quickstart", "The headline result", "The two commands"]
    positions = [text.index(f"## {heading}\n") for heading in order]
    assert positions == sorted(positions), dict(zip(order, positions))


# What the quickstart leaves to the reader: a model, its data and its loss.
_READERS_OWN = """
import torch
from torch import nn

def MyModel():
    torch.manual_seed(0)
    return nn.Linear(4, 1)

g = torch.Generator().manual_seed(int(__import__("os").environ["RANK"]))
loader = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
loss_fn = nn.functional.mse_loss
"""


def quickstart_script(folder: Path) -> Path:
    """The README's quickstart as a script in ``folder``, with the reader's own model, data and
    loss; each rank writes the steps it took to a file of its own there (stdout interleaves)."""
    quickstart = _section(README.read_text(), "Quickstart")
    code = re.search(r"```python\n(.*?)```", quickstart, re.S).group(1)
    assert "import gossip_ext" in code and "import torch" in code, code
    script = folder / "quickstart.py"
    report = "\nopen(f'steps{dist.get_rank()}', 'w').write(str(model.step_count))\n"
    script.write_text(_READERS_OWN + code + report)
    return script


def test_the_quickstart_runs_as_written_under_torchrun(tmp_path):
    done = torchrun(2, quickstart_script(tmp_path), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, failure_report(done)
    for rank in (0, 1):
        assert (tmp_path / f"steps{rank}").read_text() == "6", done.stdout


def test_every_row_of_the_modes_table_is_a_configuration_the_library_accepts():
    quickstart = _section(README.read_text(), "Quickstart")
    names = re.search(r"With `from gossip_ext import ([^`]*)`", quickstart).group(1)
    scope = {name.strip(): getattr(gossip_ext, name.strip()) for name in names.split(",")}
    scope.update(
        gossip_ext=gossip_ext,
        torch=torch,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
        H=8,
        k=4,
        f=2,
    )
    rows = re.findall(r"^\| [^|]+ \| `([^`]+)`", quickstart, re.M)
    checked = 0
    for spelling in rows:
        if "fully_shard" in spelling or spelling.startswith("average="):
            continue  # a sharded module's setup; an argument of the objects above
        spelling = spelling.replace('"HOST:PORT"', '"127.0.0.1:29400"')  # a placeholder
        given = eval(f"dict({spelling})", scope)  # noqa: S307 - the README's own text
        config = gossip_ext.algorithms.Configuration(
            given.get("gossip", gossip_ext.SGP()), given.get("outer"), given.get("membership")
        )
        assert config.gossip is not None or config.outer is not None, spelling
        checked += 1
    assert checked >= 8, rows
