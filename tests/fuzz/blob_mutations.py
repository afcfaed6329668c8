"""Random mutations of valid packed blobs through every entry point
(blob_cases.exercise), for a number of cases from a seed; exits non-zero at
the first property that fails, and a crash ends the process. tests/test_fuzz_blobs.py
runs it in a subprocess with a small budget:

    python tests/fuzz/blob_mutations.py --cases 20000 --seed 1
"""
import argparse
import collections
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from blob_cases import cases, exercise, mutate  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    valid = cases(args.seed)
    for c in valid:
        assert exercise(c.blob, c) == "loaded", f"the valid blob {c.name} did not load"
    seen = collections.Counter()
    for i in range(args.cases):
        c = rng.choice(valid)
        data, what = mutate(c.blob, rng)
        try:
            seen[exercise(data, c)] += 1
        except Exception as e:
            print(f"case {i} (seed {args.seed}): {c.name}, {what}: {type(e).__name__}: {e}", file=sys.stderr)
            raise
    print(" ".join(f"{k}={v}" for k, v in sorted(seen.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
