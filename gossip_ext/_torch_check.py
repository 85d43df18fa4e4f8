"""Loads the compiled extension, and refuses it under another torch than it was compiled against.

torch's C++ ABI is not kept between releases, nor between two builds of one release (its +cpu and
+cu130 wheels), and a module built against one torch may well load under another and go wrong
later. So setup.py records ``torch.__version__`` in gossip_ext._C as it compiles it
(``_C.built_with_torch()``), and importing this module (``import gossip_ext`` does, first) compares
that string with the running torch's, exactly: a different local suffix is a different torch too.

The usual way there: ``pip install`` without ``--no-deps`` resolves the dependencies after the
build, and may install another torch than the one just compiled against.
"""

import torch

REBUILD = "pip install --no-build-isolation --no-deps ."


def check_built_with(built: str, running: str) -> None:
    """Raises ImportError naming both versions, and the command that rebuilds, if the torch the
    extension was built against (``built``) is not the running one (``running``).

    .. note::
        The two are compared as strings: ``torch.__version__`` compares as a version, for which
        "2.13" equals "2.13.0".
    """
    if str(built) != str(running):
        raise ImportError(
            f"gossip_ext was built against torch {built}, but torch {running} is running: its "
            "compiled extension (gossip_ext._C) works only with the torch it was built against. "
            f"Rebuild it against the running torch: `{REBUILD}` in the gossip_ext checkout "
            f"(`bash tools/build.sh` for an editable install), or run it with torch {built}."
        )


def load_failed(running: str, error: ImportError) -> ImportError:
    """The error to raise when gossip_ext._C does not load at all: not built, or built against
    another torch whose symbols this one lacks."""
    return ImportError(
        f"gossip_ext's compiled extension (gossip_ext._C) could not be loaded with torch "
        f"{running}: {error}. If it is not built, or was built against another torch, build it "
        f"against the running torch: `{REBUILD}` in the gossip_ext checkout (`bash tools/build.sh` "
        "for an editable install)."
    )


try:
    from gossip_ext import _C  # registers torch.ops.gossip_ext
except ImportError as error:
    raise load_failed(torch.__version__, error) from error
check_built_with(_C.built_with_torch(), torch.__version__)
