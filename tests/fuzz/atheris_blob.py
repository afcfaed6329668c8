"""A coverage-guided (libFuzzer, through atheris) target for everything that
reads a packed blob: the fuzzer's bytes choose a valid blob of blob_cases
(first byte) and either replace it (second byte odd) or are XORed over its
start, header first; blob_cases.exercise then checks every entry point.
Not part of the suite (pytest collects test_*.py only); run it as
tests/fuzz/README.md says."""
import os
import sys

import atheris
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["ulbtorch", "blob_cases"]):
    from blob_cases import cases, exercise

CASES = cases(0)


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    case = CASES[data[0] % len(CASES)]
    body = data[2:]
    if data[1] & 1:
        exercise(body)
        return
    blob = bytearray(case.blob)
    for i, v in enumerate(body[:len(blob)]):
        blob[i] ^= v
    exercise(bytes(blob), case)


if __name__ == "__main__":
    torch.set_num_threads(1)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
