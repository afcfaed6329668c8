"""The weights ulbtorch's kernels stream, moved into 2 MiB pages.

A one-token GEMV reads every byte of its weights once, in order. With 4 KiB
pages that stream takes a TLB miss every 4 KiB, and under a hypervisor each
miss is a two-level page walk, so 2 MiB pages speed the stream up
(benchmarks/hugepages.py times both placements). PyTorch's allocator gives
huge pages only to tensors of 2 MiB and more, and only with
THP_MEM_ALLOC_ENABLE=1; most packed matrices are smaller.

So move_to_hugepages copies the packed weights of a model (and the bf16 weights
of its LinearBF16 layers) into one private anonymous mapping advised
MADV_HUGEPAGE (Linux transparent huge pages, "madvise" or "always" mode), in
module order, and points each layer at its bytes. Every tensor keeps a storage
of its own (torch.frombuffer), so state_dict, safetensors, torch.save and
deepcopy treat them as before; the mapping lives while any of them does.
Weights already in an arena stay where they are, so moving a model again (to
add a layer converted since) copies only the rest. Where the kernel has no
transparent huge pages it does nothing.
"""
from __future__ import annotations

import itertools
import mmap
import re
import sys
import weakref
from dataclasses import dataclass

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # the kernels' tile loads
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
# Address ranges [lo, hi) of the arenas alive, each dropped when its mapping is freed.
_live_arenas: dict[int, tuple[int, int]] = {}
_arena_ids = itertools.count()


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"),
    or None where there is none (not Linux, or no THP)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(_THP_ENABLED) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


def available() -> bool:
    """Whether a mapping advised MADV_HUGEPAGE can get huge pages here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


class HugePageArena:
    """One private anonymous mapping of at least `nbytes` bytes from a 2 MiB
    boundary, advised MADV_HUGEPAGE before any page is touched; tensor()
    hands out its bytes in order."""

    def __init__(self, nbytes: int):
        if not available():
            raise OSError(f"no transparent huge pages here (mode {thp_mode()!r} in {_THP_ENABLED})")
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # The extra huge page: the mapping starts on a 4 KiB boundary only.
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self.address = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        self._start = (-self.address) % HUGE_PAGE
        self._next = self._start
        self.size = size
        key = next(_arena_ids)
        _live_arenas[key] = (self.address, self.address + size + HUGE_PAGE)
        weakref.finalize(self._map, _live_arenas.pop, key, None)

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor of like's dtype and shape (contiguous) on the next bytes,
        filled with like's values."""
        nbytes = like.numel() * like.element_size()
        offset = -(-self._next // _ALIGN) * _ALIGN
        if offset + nbytes > self._start + self.size:
            raise ValueError(f"arena of {self.size} bytes is full")
        self._next = offset + nbytes
        out = torch.frombuffer(self._map, dtype=like.dtype, count=like.numel(), offset=offset).view(like.shape)
        return out.copy_(like)

    def huge_bytes(self) -> int:
        """Bytes of the arena the kernel backs with huge pages now
        (AnonHugePages of its mappings in /proc/self/smaps)."""
        lo, hi = self.address, self.address + self.size + HUGE_PAGE
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                if head:
                    start, end = int(head.group(1), 16), int(head.group(2), 16)
                    inside = start < hi and end > lo
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1]) * 1024
        return total


def in_arena(t: torch.Tensor) -> bool:
    """Whether t's bytes lie in a HugePageArena of this process. (A mapping
    being freed on another thread may still be listed for a moment after its
    addresses are reused: a tensor there is then taken as placed and stays
    in 4 KiB pages, which costs speed, never results.)"""
    if t.device.type != "cpu" or t.layout != torch.strided:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(lo <= ptr < hi for lo, hi in tuple(_live_arenas.values()))


@dataclass
class HugePageReport:
    tensors: int = 0     # tensors moved
    nbytes: int = 0      # their bytes
    huge_bytes: int = 0  # bytes of the arena in huge pages after the copy
    mode: str | None = None  # thp_mode()
    already: int = 0     # tensors found in an arena already, left there

    def __str__(self) -> str:
        mib = 1 << 20
        kept = f"; {self.already} already in 2 MiB pages" if self.already else ""
        if not self.tensors:
            return f"weights left in place (transparent huge pages: {self.mode}{kept})"
        return (f"{self.tensors} weights ({self.nbytes / mib:.1f} MiB) moved to one arena, backed by "
                f"{self.huge_bytes // HUGE_PAGE} pages of 2 MiB (transparent huge pages: {self.mode}{kept})")


def _streamed_weights(model: nn.Module, plain_linears: bool) -> list[tuple[dict, str]]:
    """(the dict that holds it, key) of every tensor the kernels stream: the
    packed buffer of each low-bit layer and the bf16 weight of each
    LinearBF16 (with plain_linears, the weight of every nn.Linear), CPU and
    contiguous, each once (tied weights are one)."""
    from .nn import LinearBF16, LowBitLinear

    found, seen = [], set()
    for m in model.modules():
        if isinstance(m, LowBitLinear):
            holder, key = m._buffers, "packed"
        elif (isinstance(m, LinearBF16) and m.weight.dtype == torch.bfloat16) or (
                plain_linears and type(m) is nn.Linear):
            holder, key = m._parameters, "weight"
        else:
            continue
        t = holder[key]
        if t is None or not t.is_cpu or not t.is_contiguous() or id(t) in seen or t.numel() == 0:
            continue
        seen.add(id(t))
        found.append((holder, key))
    return found


def move_to_hugepages(model: nn.Module, *, plain_linears: bool = False) -> HugePageReport:
    """Copy the weights ulbtorch streams (see the module doc) into one arena
    of 2 MiB pages, in module order, and point the layers at the copies; the
    old tensors are freed unless referenced elsewhere. Results are unchanged
    bit for bit. plain_linears: the weights of plain nn.Linear layers too (a
    bf16 model compared in the same pages). A no-op (report.tensors == 0)
    without transparent huge pages. Tensors already in an arena stay
    (report.already). A deep copy of the model is in ordinary pages again
    (torch copies tensors into new storage)."""
    report = HugePageReport(mode=thp_mode())
    targets = _streamed_weights(model, plain_linears)
    placed = [in_arena(h[k]) for h, k in targets]
    report.already = sum(placed)
    targets = [t for t, p in zip(targets, placed) if not p]
    if not targets or not available():
        return report
    sizes = [-(-h[k].numel() * h[k].element_size() // _ALIGN) * _ALIGN for h, k in targets]
    arena = HugePageArena(sum(sizes))
    # Ordinary tensors even under inference_mode: the model may run with autograd later.
    with torch.inference_mode(False), torch.no_grad():
        for holder, key in targets:
            old = holder[key]
            new = arena.tensor(old)
            if isinstance(old, nn.Parameter):
                old.data = new  # the same Parameter: tied weights and optimizers still see it
            else:
                holder[key] = new
    report.tensors, report.nbytes, report.huge_bytes = len(targets), sum(sizes), arena.huge_bytes()
    return report
