"""Helpers shared by the ulbtorch benchmarks.

- shapes.json loading (default: benchmarks/shapes.json, shipped with the repo)
- in-process DRAM read bandwidth per thread count
- cold-rotation sizing (how many distinct matrices so weights stream from DRAM)
- median timing with warmup
- aligned tables, optionally written as JSON and/or markdown

Timings on the shared development machines vary from run to run: every script
measures what it compares in the same process and reports ratios.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Sequence

import torch

MiB = 1 << 20


def l3_bytes() -> int:
    """The largest level-3 cache the OS reports for CPU 0, 0 if none."""
    best = 0
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "level")) as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(d, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * unit)
    return best


# Bytes a cold rotation (and the read probe's buffer) spans: 600 MiB, or 2.5x
# the L3 where that is more: the Zen VMs have 32 MiB of L3, but the Xeon VM
# of benchmarks/results/xeon_amx reports 480 MiB, which a 600 MiB rotation
# does not safely leave.
COLD_MIB = max(600, math.ceil(2.5 * l3_bytes() / MiB))


def quick_note(rotate_mib: float, what: str = "small rotations and few reps") -> str:
    """The closing line of a --quick run: its rotations are cold only where
    they are well above the L3 (not on the Xeon VM, which reports 480 MiB)."""
    l3 = l3_bytes()
    if rotate_mib * MiB < 2 * l3:
        return (f"(--quick: {what}; rotations of {rotate_mib:.0f} MiB against the {l3 / MiB:.0f} MiB L3 this CPU "
                "reports, so weights may stay in cache: not cold, a smoke test only)")
    return f"(--quick: {what}; indicative only)"


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SHAPES = os.path.join(REPO_ROOT, "benchmarks", "shapes.json")

# Bits per stored weight of each packed format (storage, not information).
FORMAT_BITS = {"int2_sym": 2, "int2": 2, "ternary": 2, "binary": 1, "int4": 4, "int8": 8}
# Friendly names accepted on the command line.
# Short spellings; every format's own name works too (parse_formats).
FORMAT_ALIASES = {"2": "int2_sym", "2bit": "int2_sym", "1.58": "ternary", "t": "ternary", "1": "binary",
                  "1bit": "binary", "4": "int4", "8": "int8"}


# ---- command line -------------------------------------------------------------

def add_shapes_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="path to shapes.json (default: benchmarks/shapes.json)")


def parse_list(s: str | None, cast=str) -> list | None:
    if s is None:
        return None
    return [cast(v.strip()) for v in s.split(",") if v.strip()]


def parse_grouped(s: str, cast=str) -> list[tuple]:
    """"A,B:32" -> [(A, 0), (B, 32)]: items with an optional group size
    (0 = one scale per row). ValueError on a non-integer group size."""
    return [(cast(v.partition(":")[0]), int(v.partition(":")[2] or 0)) for v in parse_list(s) or []]


def parse_formats(s: str) -> list[str]:
    import ulbtorch  # not at import: a benchmark may set ULB_* variables before the library loads

    names = {**{name: name for name in ulbtorch.FORMATS}, **FORMAT_ALIASES}
    out = []
    for f in parse_list(s):
        if f.lower() not in names:
            raise SystemExit(f"unknown format {f!r}; use one of {sorted(names)}")
        out.append(names[f.lower()])
    return out


def load_shapes(path: str | None = None) -> dict:
    path = path or DEFAULT_SHAPES
    if not os.path.exists(path):
        raise SystemExit(f"shapes file {path} not found (pass --shapes PATH)")
    with open(path) as f:
        return json.load(f)


# ---- timing -------------------------------------------------------------------

def median_time(fn: Callable[[], Any], *, reps: int = 20, warmup: int = 3, inner: int = 1) -> float:
    """Median wall time of one call of fn, in seconds.

    Each sample times `inner` back-to-back calls (use it for calls of a few
    microseconds so the timer's own cost does not count) and divides.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def calls_per_sample(est_seconds: float, target_s: float = 2e-3, max_calls: int = 10_000) -> int:
    """How many calls to batch into one timing sample (about target_s each)."""
    if est_seconds <= 0:
        return max_calls
    return int(min(max_calls, max(1, math.ceil(target_s / est_seconds))))


class Rotation:
    """Calls fn(item) over the items cyclically, so each call meets weights
    that the previous len(items)-1 calls have pushed out of cache.

    The items are walked in an order shuffled with `seed`. Candidates that
    share items (an op and the read probe of the same blobs) and walk them in
    one order compare badly: side by side, each reads what the one before it
    just pulled into L3; staggered, each reads another part of the
    allocation, and blobs stream at speeds that depend on where they lie.
    Five identical copies of one op, 48 comparisons with the first copy over
    0.4-4 MiB blobs: root-mean-square deviation 3.7% (max 14%) side by side,
    2.7% (max 7.5%) staggered, 1.6% (max 5.9%) each in its own shuffled order."""

    def __init__(self, items: Sequence, fn: Callable[[Any], Any], seed: int = 0):
        self.items = list(items)
        random.Random(seed).shuffle(self.items)
        self.fn, self.i = fn, 0

    def __call__(self):
        item = self.items[self.i]
        self.i = self.i + 1 if self.i + 1 < len(self.items) else 0
        return self.fn(item)


def time_rotating(items: Sequence, fn: Callable[[Any], Any], *, reps: int = 15, warmup_passes: int = 1,
                  min_sample_s: float = 2e-3) -> float:
    """Median seconds per call of fn over a cold rotation of items (see
    time_interleaved, of which this is the one-candidate case)."""
    return time_interleaved([(items, fn)], reps=reps, warmup_passes=warmup_passes, min_sample_s=min_sample_s)[0]


def time_interleaved(candidates: Sequence[tuple[Sequence, Callable[[Any], Any]]], *, reps: int = 15,
                     warmup_passes: int = 1, min_sample_s: float = 2e-3,
                     samples_out: list[list[float]] | None = None) -> list[float]:
    """Median seconds per call of each (items, fn) over its own cold rotation,
    with the samples taken in turn (a sample of each candidate, then the next
    round, starting one candidate later), so that DRAM bandwidth drifting
    during the measurement weighs on all candidates alike and their ratios
    hold. Each candidate is warmed up with `warmup_passes` full passes (page
    faults, thread pool start); a sample is at least one call and about
    min_sample_s long. samples_out, if given, receives every candidate's
    per-round seconds per call (for ratios taken round by round; see
    median_ratio)."""
    rots = [Rotation(items, fn, seed=c) for c, (items, fn) in enumerate(candidates)]
    inner = []
    for rot, (items, _) in zip(rots, candidates):
        for _ in range(max(1, warmup_passes) * len(items)):
            rot()
        probe = min(len(items), 8)
        t0 = time.perf_counter()
        for _ in range(probe):
            rot()
        inner.append(calls_per_sample((time.perf_counter() - t0) / probe, min_sample_s))
    samples: list[list[float]] = [[] for _ in rots]
    n = len(rots)
    for r in range(max(1, reps)):
        # Each round starts one candidate later, so none is always first (each
        # still follows the same neighbour; a shuffled order measured the same).
        for j in range(n):
            i = (r + j) % n
            rot = rots[i]
            t0 = time.perf_counter()
            for _ in range(inner[i]):
                rot()
            samples[i].append((time.perf_counter() - t0) / inner[i])
    if samples_out is not None:
        samples_out[:] = samples
    return [statistics.median(s) for s in samples]


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over rounds of num[r] / den[r]: two candidates' samples of one
    round were taken moments apart, so their ratio cancels the DRAM speed
    of that moment, which on a shared VM drifts by more than the effects
    measured (the C tools of benchmarks/c report the same statistic)."""
    return statistics.median(a / b for a, b in zip(num, den))


def cold_rotation(n_bytes_each: int, total_target: int = COLD_MIB * MiB, min_total: int = 256 * MiB,
                  max_count: int = 1_000_000) -> int:
    """Number of distinct matrices of n_bytes_each to rotate through so that
    no call finds its weights in cache (COLD_MIB): about total_target
    bytes in all and never less than min_total; at least 2."""
    n_bytes_each = max(1, int(n_bytes_each))
    n = math.ceil(total_target / n_bytes_each)
    n = max(n, math.ceil(min_total / n_bytes_each), 2)
    return int(min(n, max_count))


def replicate(base: Sequence[torch.Tensor], count: int) -> list[torch.Tensor]:
    """count distinct tensors (separate allocations) cycling over the contents
    of base: memory addresses are what make a rotation cold, not values."""
    out = list(base[:count])
    i = 0
    while len(out) < count:
        out.append(base[i % len(base)].clone())
        i += 1
    return out


@contextmanager
def num_threads(n: int):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def step_bytes(model) -> int:
    """Bytes one decode step reads whole: every parameter and buffer but the
    token embedding (a row of it a step); tensor subclasses (torchao) by
    their inner tensors."""
    skip = {id(t) for m in model.modules() if isinstance(m, torch.nn.Embedding) for t in m.parameters()}
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in skip:
            continue
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
        else:
            total += t.numel() * t.element_size()
    return total


# ---- memory bandwidth ---------------------------------------------------------

def _probe(streams: int):
    def read(t):
        import ulbtorch

        return ulbtorch.runtime.read_probe(t, streams=streams)
    return read


def probe_item(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a contiguous tensor: what raw_probe reads."""
    return t.data_ptr(), t.numel() * t.element_size()


def raw_probe(threads: int, streams: int) -> Callable[[tuple[int, int]], Any]:
    """The read probe as lean a call as the eager GEMV's: read(item), one
    ctypes call on a probe_item. runtime.read_probe checks its arguments in
    Python, which after a cold stream costs more a call than this and would
    flatter "% stream"."""
    import ctypes

    import ulbtorch

    probe, out = ulbtorch.runtime._lib.ulb_read_probe_streams, ctypes.c_uint64()
    ref = ctypes.byref(out)
    return lambda it: probe(it[0], it[1], threads, streams, ref)


BETA_SLICE = 64 * MiB  # a beta sample: one probe call, long enough that its call cost does not count


def beta_slices(size_mib: int, hugepages: bool = False) -> list[torch.Tensor]:
    """BETA_SLICE-byte slices of a fresh size_mib buffer (in 2 MiB pages with
    hugepages): read one a round, in turn, beside the candidates of
    time_interleaved, they give the read bandwidth of the same moments; DRAM
    speed drifts between runs of one hour on the shared VMs, which moved
    every percentage of a beta measured once at the start."""
    big = torch.ones(max(size_mib * MiB, BETA_SLICE), dtype=torch.uint8)
    if hugepages:
        big = in_hugepages([big])[0]
    return [big[o:o + BETA_SLICE] for o in range(0, big.numel() - BETA_SLICE + 1, BETA_SLICE)]


def pct_of_beta(blob_bytes: int, beta_samples: Sequence[float], samples: Sequence[float]) -> float:
    """% of the read bandwidth of the same rounds: median over rounds of
    (blob_bytes / samples[r]) / (BETA_SLICE / beta_samples[r])."""
    return 100 * blob_bytes / BETA_SLICE * median_ratio(beta_samples, samples)


def in_round_beta_note(values: Sequence[float]) -> str:
    """The summary's words for the betas read in turn with the shapes."""
    if not values:
        return ""
    return (f"; read in turn with the shapes (what the percentages divide by): median "
            f"{statistics.median(values):.1f}, {min(values):.1f}-{max(values):.1f}")


_READ_KERNELS = {
    # Copy-free reductions: each reads every byte once and writes nothing.
    "int64.sum": lambda t: t.view(torch.int64).sum(),
    "int64.max": lambda t: t.view(torch.int64).max(),
    "fp32.sum": lambda t: t.view(torch.float32).sum(),
    # ulbtorch's read probe: one run per thread, as the GEMV kernels read, and
    # four runs read a line of each in turn, which some cores (Zen 3) read
    # faster than one (kernels/src/probe.c).
    "probe": _probe(1),
    "probe.x4": _probe(4),
}


def in_hugepages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of tensors, back to back in one arena of 2 MiB pages
    (ulbtorch.hugepages), for timing what the library's placement buys."""
    from ulbtorch.hugepages import HugePageArena

    arena = HugePageArena(sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors))
    return [arena.tensor(t) for t in tensors]


def measure_read_bandwidth(threads: Iterable[int] = (1, 2), size_bytes: int = COLD_MIB * MiB, reps: int = 5,
                           methods: Sequence[str] | None = None, verbose: bool = False,
                           hugepages: bool = False) -> dict[int, dict]:
    """DRAM read bandwidth (GB/s, 1e9 bytes/s) per thread count, in-process.

    Reads a size_bytes buffer (far larger than L3) with a few copy-free
    reductions and ulbtorch's read probe and keeps, per thread count, the
    best of the per-method medians: the fastest this machine was seen to read
    memory, the roof for a memory-bound GEMV. Returns {threads: {"gbps": x,
    "method": name, "all": {...}, "probe_streams": 1 or 4}}, the last the
    probe's faster setting (1 if only one was measured), for reading other
    buffers as fast.
    """
    methods = list(methods or _READ_KERNELS)
    t = torch.empty(size_bytes // 8, dtype=torch.int64)
    t.fill_(1)  # touch every page
    if hugepages:
        t = in_hugepages([t])[0]
    buf = t.view(torch.uint8)
    out = {}
    for nt in threads:
        with num_threads(nt):
            per = {}
            for m in methods:
                f = _READ_KERNELS[m]
                med = median_time(lambda: f(buf), reps=reps, warmup=1)
                per[m] = buf.numel() / med / 1e9
            best = max(per, key=per.get)
            streams = 4 if per.get("probe.x4", 0) > per.get("probe", math.inf) else 1
            out[nt] = {"gbps": per[best], "method": best, "all": per, "probe_streams": streams}
            if verbose:
                print(f"  read bandwidth, {nt} thread(s): " +
                      ", ".join(f"{m} {v:.1f}" for m, v in per.items()) + f" GB/s -> {per[best]:.1f}")
    del t, buf
    return out


# ---- environment ---------------------------------------------------------------

def environment() -> dict:
    import ulbtorch
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "ulbtorch": getattr(ulbtorch, "__version__", "?"), "machine": platform.machine(),
           **_cpu_id(), "cores": os.cpu_count(), "isa": ulbtorch.runtime.get_isa(),
           "supported_isas": ulbtorch.runtime.supported_isas()}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def _cpu_id() -> dict:
    """The CPU's model name and, on x86, its CPUID family and model (what
    tells Zen 4 from Zen 5 where a VM names both "AMD EPYC")."""
    fields = {"model name": "cpu", "cpu family": "cpu_family", "model": "cpu_model"}
    out = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in fields and fields[key.strip()] not in out:
                    out[fields[key.strip()]] = value.strip()
                if not line.strip() and out:
                    break
    except OSError:
        pass
    out.setdefault("cpu", platform.processor() or "?")
    return out


def print_environment(env: dict | None = None) -> dict:
    env = env or environment()
    print(f"# {env['cpu']} ({env['cores']} cores), torch {env['torch']}, ulbtorch {env['ulbtorch']}, "
          f"ISA {env['isa']} (supported: {', '.join(env['supported_isas'])})")
    return env


def select_isa(name: str | None) -> None:
    """Switch the kernels to one ISA for the whole run (None: keep the default)."""
    if name:
        import ulbtorch
        ulbtorch.runtime.set_isa(name)


# ---- tables ---------------------------------------------------------------------

def fmt_value(v: Any, spec: str | None = None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return format(v, spec) if spec else f"{v:.3g}"
    return str(v)


class Table:
    """Rows of dicts with a fixed column list; prints aligned and renders markdown."""

    def __init__(self, columns: Sequence[tuple[str, str, str | None]], title: str = "",
                 min_widths: dict[str, int] | None = None):
        # columns: (key, header, format spec or None); format spec None = text, left-aligned
        self.columns = list(columns)
        self.title = title
        self.min_widths = min_widths or {}
        self.rows: list[dict] = []

    def add(self, row: dict, echo: bool = False) -> None:
        self.rows.append(row)
        if echo:
            if len(self.rows) == 1:
                self._print_header()
            print(self._line(self._cells(row)), flush=True)

    def _cells(self, row: dict) -> list[str]:
        return [fmt_value(row.get(k), spec) for k, _, spec in self.columns]

    def _widths(self) -> list[int]:
        # Fixed minimum widths so rows printed as they come stay aligned.
        return [max(len(h), self.min_widths.get(k, 9 if spec else 8)) for k, h, spec in self.columns]

    def _line(self, cells: Sequence[str]) -> str:
        w = self._widths()
        return "  ".join(c.rjust(w[i]) if self.columns[i][2] else c.ljust(w[i]) for i, c in enumerate(cells))

    def _print_header(self) -> None:
        if self.title:
            print(f"\n## {self.title}")
        print(self._line([h for _, h, _ in self.columns]))
        print(self._line(["-" * w for w in self._widths()]))

    def print(self) -> None:
        if self.title:
            print(f"\n## {self.title}")
        cells = [self._cells(r) for r in self.rows]
        heads = [h for _, h, _ in self.columns]
        w = [max([len(heads[i])] + [len(c[i]) for c in cells]) for i in range(len(heads))]
        just = lambda i, s: s.rjust(w[i]) if self.columns[i][2] else s.ljust(w[i])  # noqa: E731
        print("  ".join(just(i, h) for i, h in enumerate(heads)))
        print("  ".join("-" * x for x in w))
        for c in cells:
            print("  ".join(just(i, s) for i, s in enumerate(c)))

    def markdown(self) -> str:
        heads = [h for _, h, _ in self.columns]
        lines = [f"### {self.title}", ""] if self.title else []
        lines.append("| " + " | ".join(heads) + " |")
        lines.append("|" + "|".join("---:" if spec else "---" for _, _, spec in self.columns) + "|")
        for r in self.rows:
            lines.append("| " + " | ".join(self._cells(r)) + " |")
        return "\n".join(lines) + "\n"


def command_line() -> str:
    """The command that is running, as one would type it from the current
    directory: what benchmarks/results/render.py prints beside each number."""
    import shlex
    return shlex.join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def write_outputs(tables: Sequence[Table], *, json_path: str | None = None, md_path: str | None = None,
                  meta: dict | None = None, notes: Sequence[str] = (), extra: dict | None = None) -> None:
    """Write every table's rows (plus meta, the command and `extra`) as JSON
    and/or the tables as markdown."""
    meta = {"command": command_line(), **(meta or {})}
    if json_path:
        payload = {"meta": meta, "notes": list(notes),
                   "tables": {t.title or f"table{i}": t.rows for i, t in enumerate(tables)}, **(extra or {})}
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        print(f"wrote {json_path}")
    if md_path:
        parts = ["`" + json.dumps(meta, default=str) + "`\n"]
        parts += [t.markdown() for t in tables]
        parts += [f"- {n}" for n in notes]
        with open(md_path, "w") as f:
            f.write("\n".join(parts) + "\n")
        print(f"wrote {md_path}")


def geomean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x and x > 0 and not math.isnan(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def die(msg: str) -> None:
    print(msg, file=sys.stderr)
    sys.exit(2)
