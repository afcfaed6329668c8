"""What checking a packed blob on load costs: ops.packed_info(blob,
verify=True) (the checksum over the whole blob, every code in range, every
scale finite), the checksum's hash alone (ulb_xxh64) and a plain read of the
same bytes (the read probe, one thread, as verify runs), in GB/s (1e9
bytes/s), taken in turn over one cold rotation of blobs (from DRAM, as a
load reads a file the page cache holds), then on one blob in cache.

    python benchmarks/checksum.py --json benchmarks/results/<machine>/<date>_checksum.json
    python benchmarks/checksum.py --quick          # smoke test: the numbers mean nothing
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

from ulbtorch import ops  # noqa: E402
from ulbtorch._lib import lib  # noqa: E402
from ulbtorch.formats import FORMATS  # noqa: E402


def _blob(fmt: str, M: int, K: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, FORMATS[fmt].max_code + 1, (M, K), generator=g, dtype=torch.uint8)
    return ops.pack(codes, torch.rand(M, 1, generator=g) + 0.5, fmt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="int2_sym,ternary,binary,int4,int8")
    p.add_argument("--shape", default="4096x4096", help="MxK of each blob")
    p.add_argument("--rotate-mib", type=int, default=common.COLD_MIB)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args()
    if args.quick:
        args.shape, args.rotate_mib, args.reps = "256x512", 8, 3
    M, K = (int(v) for v in args.shape.split("x"))
    env = common.print_environment()
    probe = common.raw_probe(1, 1)
    table = common.Table([("format", "format", None), ("blob_mib", "blob MiB", ".1f"),
                          ("verify_cold", "verify GB/s cold", ".2f"), ("hash_cold", "hash GB/s cold", ".2f"),
                          ("read_cold", "plain read GB/s cold", ".2f"), ("verify_pct_read", "verify % of read", ".0f"),
                          ("verify_hot", "verify GB/s hot", ".2f"), ("hash_hot", "hash GB/s hot", ".2f")],
                         title=f"blob checks at load, {M}x{K}, 1 thread")
    for fmt in common.parse_formats(args.formats):
        base = _blob(fmt, M, K)
        n = base.numel()
        blobs = common.replicate([base], common.cold_rotation(n, args.rotate_mib * common.MiB,
                                                              min(args.rotate_mib, 256) * common.MiB))
        items = [common.probe_item(b) for b in blobs]
        verify, hashed, read = common.time_interleaved(
            [(blobs, lambda b: ops.packed_info(b, verify=True)),
             (items, lambda it: lib.ulb_xxh64(it[0], it[1], 0)),
             (items, lambda it: probe(it))], reps=args.reps)
        hot_verify = common.median_time(lambda: ops.packed_info(base, verify=True), reps=args.reps)
        hot_hash = common.median_time(lambda: lib.ulb_xxh64(base.data_ptr(), n, 0), reps=args.reps)
        table.add(dict(format=fmt, blob_mib=n / common.MiB, verify_cold=n / verify / 1e9, hash_cold=n / hashed / 1e9,
                       read_cold=n / read / 1e9, verify_pct_read=100 * read / verify,
                       verify_hot=n / hot_verify / 1e9, hash_hot=n / hot_hash / 1e9), echo=True)
        del blobs, items
    notes = [] if not args.quick else [common.quick_note(args.rotate_mib)]
    common.write_outputs([table], json_path=args.json, md_path=args.markdown,
                         meta={"env": env, "args": vars(args)}, notes=notes)


if __name__ == "__main__":
    main()
