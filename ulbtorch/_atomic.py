"""Files published into a directory so that a crash (a kill, a power loss, a
full disk) leaves each name holding either its previous content or its new
one: every file is written into a staging directory beside the target,
synced, then renamed into place, and the directory synced after each rename.

The staging directory is named after the host and the process, so that a
later save can remove what a killed one left (nothing can on SIGKILL)."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket

PREFIX = ".ulbtorch-save-"


def _fsync(path: str) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writer_gone(name: str) -> bool:
    """Whether the staging directory `name` belongs to a process of this host
    that no longer runs (an unknown name, or another host's, is left alone)."""
    host, sep, rest = name[len(PREFIX):].rpartition("-")[0].rpartition("-")
    if not sep or host != socket.gethostname() or not rest.isdigit():
        return False
    try:
        os.kill(int(rest), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that id runs
        return False
    return False


def remove_stale(directory: str) -> None:
    """Remove the staging directories that killed saves left in `directory`."""
    for name in os.listdir(directory):
        if name.startswith(PREFIX) and _writer_gone(name):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


class Staging:
    """A staging directory inside `directory`: write files at path(name), then
    publish(name) renames each into `directory` (in the order called)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.root = os.path.join(directory, f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.root)
        # The mode the user's umask gives a new file: the files written here by
        # other libraries (safetensors writes 0600) are set to it before publishing.
        probe = os.path.join(self.root, ".mode")
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        self.mode = os.stat(probe).st_mode & 0o777
        os.unlink(probe)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def write_text(self, name: str, text: str) -> None:
        with open(self.path(name), "x", encoding="utf-8") as f:
            f.write(text)

    def publish(self, name: str) -> None:
        staged = self.path(name)
        os.chmod(staged, self.mode)
        _fsync(staged)
        os.replace(staged, os.path.join(self.directory, name))
        _fsync(self.directory)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def staging(directory: str):
    """A Staging in `directory` (created if need be), removed on the way out
    whether the block published everything or raised."""
    if not os.path.isdir(directory):
        os.makedirs(directory)
        _fsync(os.path.dirname(os.path.abspath(directory)))  # the new directory's own entry
    remove_stale(directory)
    stage = Staging(directory)
    try:
        yield stage
    finally:
        stage.remove()
