"""Does the dynamic work split (seed 002) move work away from a slow core?

One 2-bit GEMV (14336 x 4096 by default, N=1, cold rotation of distinct blobs
unless --hot) on 2 threads, timed call by call in one process:

  equal cores          static equal split vs dynamic split, no slowdown: the
                       dynamic split should cost nothing here
  knob                 pool thread 1 slowed --slowdown x (ulbtorch.runtime.
                       set_thread_slowdown, a test knob: the thread spins for
                       (factor - 1) x its measured work time): static vs
                       dynamic, with the dynamic table's first calls after
                       scheduler_reset() printed to show it converging
  competitor           (--competitor) no knob; a busy pure-Python process
                       pinned to CPU 1 shares that core with pool thread 1

Each scenario times static and dynamic in alternating blocks of calls (the
DRAM speed of a VM drifts within minutes) and prints the median time per call
of each and the gain static/dynamic.

  python benchmarks/scheduler.py --quick                      # smoke test (seconds)
  python benchmarks/scheduler.py                              # slowdown 2.0, 60 timed calls per mode
  python benchmarks/scheduler.py --slowdown 3 --calls 100 --competitor --json sched.json
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import MiB  # noqa: E402
from gemv import OursRotation  # noqa: E402

from ulbtorch import runtime  # noqa: E402

NTHREADS = 2


# ---- the competing process ------------------------------------------------------

def _busy_loop():
    x = 0
    while True:  # pure Python, no allocation: one core's worth of integer work
        x += 1


class Competitor:
    """A busy process for the duration of a `with` block, pinned to `cpu` if
    the affinity mask allows it. Also pins this process's calling thread to
    the other CPU and every other thread of this process (the ulb pool's
    worker among them) to `cpu`, unless pin_pool is False, so that the slowed
    thread is pool thread 1 for the whole run; affinities are restored on exit."""

    def __init__(self, cpu: int = 1, pin_pool: bool = True):
        self.cpu, self.pin_pool = cpu, pin_pool
        self.proc = None
        self.pinned = False
        self.saved: dict[int, set] = {}
        self.note = ""

    def __enter__(self):
        allowed = os.sched_getaffinity(0)
        # fork: the child runs only the loop above (spawn would re-import torch in it)
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.proc = ctx.Process(target=_busy_loop, daemon=True)
        self.proc.start()
        notes = [f"competitor pid {self.proc.pid}"]
        if self.cpu in allowed and len(allowed) >= 2:
            try:
                os.sched_setaffinity(self.proc.pid, {self.cpu})
                self.pinned = True
                notes.append(f"pinned to CPU {self.cpu}")
            except OSError as e:
                notes.append(f"not pinned ({e})")
            if self.pinned and self.pin_pool:
                other = min(allowed - {self.cpu})
                main_tid = threading_native_id()
                try:
                    for tid in map(int, os.listdir("/proc/self/task")):
                        self.saved[tid] = os.sched_getaffinity(tid)
                        os.sched_setaffinity(tid, {other} if tid == main_tid else {self.cpu})
                    notes.append(f"calling thread (pool tid 0) pinned to CPU {other}, other threads of this "
                                 f"process (pool tid 1) to CPU {self.cpu}")
                except OSError as e:
                    notes.append(f"pool threads not pinned ({e})")
        else:
            notes.append(f"not pinned (CPU {self.cpu} not in the affinity mask {sorted(allowed)})")
        self.note = ", ".join(notes)
        time.sleep(0.2)  # let it start spinning
        return self

    def __exit__(self, *exc):
        for tid, mask in self.saved.items():
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass  # thread gone
        self.saved.clear()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2)
        return False


def threading_native_id() -> int:
    import threading
    return threading.get_native_id()


# ---- measurement ---------------------------------------------------------------------

class Runner:
    def __init__(self, items, M, x, bits):
        self.items, self.M, self.x, self.bits, self.i = items, M, x, bits, 0

    def call(self) -> float:
        """One call on the next blob of the rotation; its wall time in seconds."""
        b = self.items[self.i]
        self.i = self.i + 1 if self.i + 1 < len(self.items) else 0
        t0 = time.perf_counter()
        torch.ops.ulb.linear(self.x, b, None, self.M)
        return time.perf_counter() - t0

    def stats(self) -> dict:
        return runtime.scheduler_stats(self.bits)


def _trace_row(i: int, t: float, st: dict) -> dict:
    one, two = st["nthreads"] >= 1, st["nthreads"] >= 2  # else the pool ran one thread (warned in main)
    return dict(call=i, panels0=st["last_panels"][0] if one else None, panels1=st["last_panels"][1] if two else None,
                us0=st["last_us"][0] if one else None, us1=st["last_us"][1] if two else None, wall_us=1e6 * t,
                ratio0=st["ratio"][0] if one else None, ratio1=st["ratio"][1] if two else None)


def _summary(ts: list[float], st: dict) -> dict:
    q = statistics.quantiles(ts, n=10) if len(ts) >= 2 else [ts[0]] * 9
    two = st["nthreads"] >= 2
    return dict(median_us=1e6 * statistics.median(ts), mean_us=1e6 * statistics.fmean(ts), p10_us=1e6 * q[0],
                p90_us=1e6 * q[-1], ratio1=st["ratio"][1] if two else float("nan"),
                panels1=st["last_panels"][1] if two else None)


def run_scenario(r: Runner, *, slowdown: float, calls: int, warmup: int, trace: int, block: int) -> dict:
    """Static and dynamic split on the same rotation, interleaved: `trace`
    dynamic calls straight after scheduler_reset() (traced), `warmup` untimed
    calls of each, then blocks of `block` calls of each in turn (the order
    swapped every round), `calls` timed calls per split in all, so that both
    see the same minutes of DRAM speed. A static call leaves the dynamic
    table alone, so the dynamic blocks carry on from where they stopped.
    gain_rounds: median over rounds of static / dynamic block medians."""
    runtime.set_thread_slowdown(1, slowdown)
    runtime.scheduler_static(False)
    runtime.scheduler_reset()
    rows = [_trace_row(i, r.call(), r.stats()) for i in range(trace)]
    ts = {"static": [], "dynamic": []}
    last = {}
    gains = []
    for split in ("static", "dynamic"):
        runtime.scheduler_static(split == "static")
        for _ in range(warmup):
            r.call()
    rnd = 0
    while len(ts["dynamic"]) < calls:
        n = min(block, calls - len(ts["dynamic"]))
        med = {}
        for split in (("static", "dynamic") if rnd % 2 == 0 else ("dynamic", "static")):
            runtime.scheduler_static(split == "static")
            got = [r.call() for _ in range(n)]
            ts[split] += got
            med[split] = statistics.median(got)
            last[split] = r.stats()
        gains.append(med["static"] / med["dynamic"])
        rnd += 1
    runtime.scheduler_static(False)
    res = {split: _summary(ts[split], last[split]) for split in ts}
    res["dynamic"]["trace"] = rows
    res["dynamic"]["gain_rounds"] = statistics.median(gains)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="14336x4096", help="M x K of the weight (default 14336x4096, llama3-8b up/gate)")
    p.add_argument("--format", default="int2_sym", help="packed format (default int2_sym, 2-bit)")
    p.add_argument("--slowdown", type=float, default=2.0,
                   help="factor of the knob on pool thread 1 (default 2.0; 1 skips the knob scenario)")
    p.add_argument("--calls", type=int, default=60, help="timed calls per mode (median; default 60)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per mode after the trace (default 10)")
    p.add_argument("--block", type=int, default=5,
                   help="calls of one split before the other takes its turn (default 5)")
    p.add_argument("--trace", type=int, default=10, help="calls of the dynamic table printed after reset (default 10)")
    p.add_argument("--hot", action="store_true",
                   help="one matrix over and over (L3-resident) instead of a cold rotation")
    p.add_argument("--competitor", action="store_true",
                   help="also: a busy process pinned to CPU 1 instead of the knob, static vs dynamic")
    p.add_argument("--no-pin-pool", action="store_true",
                   help="with --competitor: do not pin this process's threads (tid 0 to CPU 0, the rest to CPU 1)")
    p.add_argument("--no-baseline", action="store_true", help="skip the equal-cores scenario")
    p.add_argument("--rotate-mib", type=float, default=common.COLD_MIB,
                   help=f"target size of the cold rotation (MiB; default {common.COLD_MIB}: 600, or 2.5x the L3)")
    p.add_argument("--min-rotate-mib", type=float, default=256, help="never rotate over less than this (MiB)")
    p.add_argument("--isa", choices=runtime.ISAS, help="force one kernel ISA")
    p.add_argument("--quick", action="store_true", help="smoke test: 20 calls, 3 warmup, 64 MiB rotation")
    p.add_argument("--json", help="write all rows as JSON here")
    p.add_argument("--markdown", help="write the tables as markdown here")
    args = p.parse_args(argv)
    if args.quick:
        args.calls = min(args.calls, 20)
        args.warmup = min(args.warmup, 3)
        args.rotate_mib = min(args.rotate_mib, 64)
        args.min_rotate_mib = min(args.min_rotate_mib, 48)
    if args.slowdown < 1.0:
        common.die("--slowdown must be >= 1")
    if args.block < 1 or args.calls < 1:
        common.die("--block and --calls must be >= 1")
    fmt = common.parse_formats(args.format)[0]
    bits = common.FORMAT_BITS[fmt]  # the scheduler table of that kernel family
    try:
        M, K = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        common.die(f"--shape wants MxK, got {args.shape!r}")

    common.select_isa(args.isa)
    env = common.print_environment()
    if (os.cpu_count() or 1) < NTHREADS:
        print(f"WARNING: {os.cpu_count()} CPU(s): two threads share a core, the comparison means little")
    gen = torch.Generator().manual_seed(0)
    rot = OursRotation(M, K, fmt, 0, int(args.rotate_mib * MiB), int(args.min_rotate_mib * MiB), False, gen)
    items = rot.items[:1] if args.hot else rot.items
    if args.hot:
        del rot.items[1:]
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    r = Runner(items, M, x, bits)
    where = ("hot: one matrix" if args.hot else
             f"cold: rotation of {len(items)} x {rot.blob_bytes / MiB:.2f} MiB = "
             f"{len(items) * rot.blob_bytes / MiB:.0f} MiB")
    print(f"# {fmt} {M}x{K}, N=1, bf16 activations, {NTHREADS} threads, {where}; "
          f"{args.calls} timed calls per mode after {args.warmup} warmup, in alternating blocks of {args.block}, "
          f"ISA {runtime.get_isa()}")

    scenarios = []
    if not args.no_baseline:
        scenarios.append(("equal cores", 1.0, False))
    if args.slowdown > 1.0:
        scenarios.append((f"thread 1 slowed {args.slowdown:g}x (knob)", args.slowdown, False))
    if args.competitor:
        scenarios.append(("competitor process on CPU 1", 1.0, True))

    summary = common.Table([("scenario", "scenario", None), ("split", "split", None),
                            ("median_us", "median us", ".1f"), ("p10_us", "p10 us", ".1f"),
                            ("p90_us", "p90 us", ".1f"), ("mean_us", "mean us", ".1f"), ("gbps", "GB/s", ".1f"),
                            ("panels1", "panels t1", None), ("ratio1", "ratio[1]", ".3f"),
                            ("gain", "gain (median)", ".2f"), ("gain_mean", "gain (mean)", ".2f"),
                            ("gain_rounds", "gain (rounds)", ".2f")],
                           title="Static equal split vs dynamic split (median per call)",
                           min_widths=dict(scenario=32))
    traces = []
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(NTHREADS)
    try:
        # Start the pool and fault in every blob before anything is timed.
        runtime.set_thread_slowdown(1, 1.0)
        runtime.scheduler_static(True)
        for _ in range(max(len(items), 3)):
            r.call()
        if r.stats()["nthreads"] != NTHREADS:
            print(f"WARNING: the ulb pool ran {r.stats()['nthreads']} thread(s), not {NTHREADS}")
        for name, slow, competitor in scenarios:
            comp = Competitor(1, pin_pool=not args.no_pin_pool) if competitor else None
            try:
                if comp:
                    comp.__enter__()
                    print(f"# {name}: {comp.note}")
                res = run_scenario(r, slowdown=slow, calls=args.calls, warmup=args.warmup, trace=args.trace,
                                   block=args.block)
            finally:
                runtime.set_thread_slowdown(1, 1.0)
                if comp:
                    comp.__exit__(None, None, None)
            if slow > 1.0 or competitor:
                tt = common.Table([("call", "call", None), ("panels0", "panels t0", None),
                                   ("panels1", "panels t1", None), ("us0", "us t0", ".1f"), ("us1", "us t1", ".1f"),
                                   ("wall_us", "wall us", ".1f"), ("ratio0", "ratio[0]", ".3f"),
                                   ("ratio1", "ratio[1]", ".3f")],
                                  title=f"Dynamic split after scheduler_reset(), {name}: first {args.trace} calls "
                                        "(panels and us of the call; ratio = table after it)")
                for row in res["dynamic"]["trace"]:
                    tt.add(row)
                tt.print()
                traces.append(tt)
            for split in ("static", "dynamic"):
                m = res[split]
                dyn = split == "dynamic"
                summary.add(dict(scenario=name, split=split, median_us=m["median_us"], p10_us=m["p10_us"],
                                 p90_us=m["p90_us"], mean_us=m["mean_us"],
                                 gbps=rot.blob_bytes / (m["median_us"] * 1e-6) / 1e9,
                                 ratio1=m["ratio1"] if dyn else None, panels1=m["panels1"],
                                 gain=res["static"]["median_us"] / m["median_us"] if dyn else None,
                                 gain_mean=res["static"]["mean_us"] / m["mean_us"] if dyn else None,
                                 gain_rounds=m["gain_rounds"] if dyn else None))
    finally:
        runtime.set_thread_slowdown(1, 1.0)
        runtime.scheduler_static(False)
        runtime.scheduler_reset()
        torch.set_num_threads(prev_threads)

    summary.print()
    notes = [f"{fmt} {M}x{K}, {where}, {args.calls} calls per mode, ISA {runtime.get_isa()}",
             f"panels t1: 64-row panels of pool thread 1 in the last call, of {-(-M // 64)}; ratio[1]: its share in "
             "the dynamic table after the timed calls; gain: static / dynamic time per call; gain (rounds): median "
             f"over rounds of {args.block} calls of each of static / dynamic block median"]
    if args.slowdown > 1.0:
        notes.append(f"with the knob at {args.slowdown:g}x and otherwise equal cores, the ideal split gives thread 1 "
                     f"1/(1+s) = {1 / (1 + args.slowdown):.3f} of the rows and a gain of (1+s)/2 = "
                     f"{(1 + args.slowdown) / 2:.2f}x; memory-bound calls differ (a thread that spins in the knob "
                     "reads no memory, leaving the other more bandwidth)")
    for n in notes:
        print(f"- {n}")
    if args.quick:
        print(common.quick_note(args.rotate_mib, "few calls and a small rotation"))
    meta = dict(env=env, args=vars(args), blob_bytes=rot.blob_bytes, rotation=len(items))
    common.write_outputs([summary] + traces, json_path=args.json, md_path=args.markdown, meta=meta, notes=notes)


if __name__ == "__main__":
    main()
