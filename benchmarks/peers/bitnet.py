"""bitnet.cpp (github.com/microsoft/BitNet) as a peer: why it does not run
from the checkout given, in a sentence the benchmark prints.

bitnet.cpp is llama.cpp with BitNet's I2_S and TL1/TL2 kernels, kept in a
fork pinned as the submodule 3rdparty/llama.cpp; a checkout without that
submodule's files (a snapshot of the repository alone, or a clone without
--recursive) cannot be built.
"""
from __future__ import annotations

import configparser
import os
import subprocess

SUBMODULE = "3rdparty/llama.cpp"


def pinned(checkout: str) -> str:
    """"<url> at <commit>" of the submodule, as far as the checkout tells."""
    url = "?"
    cfg = configparser.ConfigParser()
    try:
        cfg.read(os.path.join(checkout, ".gitmodules"))
        url = cfg.get(f'submodule "{SUBMODULE}"', "url", fallback="?")
    except configparser.Error:
        pass
    try:
        out = subprocess.run(["git", "-C", checkout, "ls-tree", "HEAD", SUBMODULE], capture_output=True, text=True,
                             timeout=30).stdout.split()
        commit = out[2] if len(out) >= 3 else "?"
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    return f"{url} at {commit}"


def skip_reason(checkout: str | None) -> str | None:
    """Why bitnet.cpp is not timed from checkout (never None yet: with
    the submodule there, the build is still a step by hand)."""
    if not checkout:
        return "no --bitnet-dir given (a clone of github.com/microsoft/BitNet with --recursive)"
    if not os.path.isfile(os.path.join(checkout, "setup_env.py")):
        return f"{checkout} is not a bitnet.cpp checkout (no setup_env.py)"
    if not os.path.isfile(os.path.join(checkout, SUBMODULE, "CMakeLists.txt")):
        return (f"{checkout} has no files in its llama.cpp submodule {SUBMODULE} ({pinned(checkout)}): "
                "git submodule update --init --recursive")
    return (f"{checkout} has its submodule, but vs_llamacpp.py does not build bitnet.cpp yet (its setup_env.py "
            "generates kernels for the checkpoints it names, not for a shapes.json config)")
