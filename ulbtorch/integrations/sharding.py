"""Tensor-parallel sharding of packed weights, independent of any server.

A checkpoint stores each logical weight (q_proj, gate_proj, ...) as one
packed blob. A rank unpacks it, keeps its slice and writes it into the rows
of the merged matrix it owns (merged QKV, gate/up); the merged matrix is
packed once, after loading.
"""
from __future__ import annotations

import torch

from .. import ops
from ..formats import n_groups


class ShardAssembler:
    """Codes and scales of one rank's part of a (possibly merged) linear layer.

    out_sizes: this rank's rows of each logical weight, in order; in_size:
    this rank's input columns of the full in_features; row_parallel: the
    layer is split along the input (o_proj, down_proj) instead of the output.
    """

    def __init__(self, name: str, out_sizes: list[int], in_size: int, in_features: int, fmt: str,
                 group_size: int, tp_rank: int, tp_size: int):
        self.name, self.out_sizes, self.fmt, self.group_size = name, list(out_sizes), fmt, group_size
        self.in_size, self.in_features, self.tp_rank, self.tp_size = in_size, in_features, tp_rank, tp_size
        self.row_parallel = in_size != in_features
        if self.row_parallel and group_size and in_size % group_size:
            raise ValueError(f"{name}: tensor parallel size {tp_size} splits in_features={in_features} into "
                             f"{in_size} columns, not a multiple of group_size={group_size}")
        M = sum(self.out_sizes)
        self.codes = torch.zeros(M, in_size, dtype=torch.uint8)
        self.scales = torch.zeros(M, n_groups(group_size, in_size), dtype=torch.float32)
        self.loaded = [False] * len(self.out_sizes)

    def unpack_checked(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and scales of a checkpoint blob in the format the config names."""
        info = ops.packed_info(blob)
        if info["format"] != self.fmt or info["group_size"] != self.group_size:
            raise ValueError(f"{self.name}: checkpoint blob is {info['format']} with group_size "
                             f"{info['group_size']}, the config says {self.fmt} / {self.group_size}")
        return ops.unpack(blob)

    def load(self, blob: torch.Tensor, shard: int = 0) -> None:
        """Take logical weight number `shard` from its full checkpoint blob."""
        self.load_codes(*self.unpack_checked(blob), shard)

    def load_codes(self, codes: torch.Tensor, scales: torch.Tensor, shard: int = 0) -> None:
        """load() of a blob unpacked already (a part of one, such as the gate
        or the up half of an expert's merged gate_up_proj)."""
        rows = self.out_sizes[shard]
        if self.row_parallel:
            if codes.shape != (rows, self.in_features):
                raise ValueError(f"{self.name}: checkpoint weight is {tuple(codes.shape)}, expected "
                                 f"({rows}, {self.in_features})")
            k0 = self.tp_rank * self.in_size
            codes = codes[:, k0:k0 + self.in_size]
            if self.group_size:
                g0 = k0 // self.group_size
                scales = scales[:, g0:g0 + self.scales.shape[1]]
        else:
            if codes.shape[0] != rows * self.tp_size or codes.shape[1] != self.in_size:
                raise ValueError(f"{self.name}: checkpoint weight is {tuple(codes.shape)}; tensor parallel size "
                                 f"{self.tp_size} needs {rows} x {self.tp_size} rows of {self.in_size}")
            r0 = self.tp_rank * rows
            codes, scales = codes[r0:r0 + rows], scales[r0:r0 + rows]
        m0 = sum(self.out_sizes[:shard])
        self.codes[m0:m0 + rows] = codes
        self.scales[m0:m0 + rows] = scales
        self.loaded[shard] = True

    @property
    def complete(self) -> bool:
        return all(self.loaded)

    def pack(self) -> torch.Tensor:
        missing = [i for i, ok in enumerate(self.loaded) if not ok]
        if missing:
            raise ValueError(f"{self.name}: no checkpoint weight for shard(s) {missing}")
        return ops.pack(self.codes, self.scales, self.fmt, self.group_size)


class VocabShardAssembler(ShardAssembler):
    """A vocab-parallel output layer (a server's lm_head): this rank owns
    `rows` rows, the padded share of the vocabulary, of which the first
    vocab_end - vocab_start are checkpoint rows [vocab_start, vocab_end). The
    rest are padding: code 0 with scale 0, so their logits are 0 and the
    server drops them."""

    def __init__(self, name: str, rows: int, in_features: int, fmt: str, group_size: int, vocab_size: int,
                 vocab_start: int, vocab_end: int):
        if not 0 <= vocab_start <= vocab_end <= vocab_size or vocab_end - vocab_start > rows:
            raise ValueError(f"{name}: vocabulary rows [{vocab_start}, {vocab_end}) of {vocab_size} do not fit "
                             f"a partition of {rows} rows")
        super().__init__(name, [rows], in_features, in_features, fmt, group_size, 0, 1)
        self.vocab_size, self.vocab_start, self.vocab_end = vocab_size, vocab_start, vocab_end

    def load(self, blob: torch.Tensor, shard: int = 0) -> None:
        codes, scales = self.unpack_checked(blob)
        if codes.shape != (self.vocab_size, self.in_features):
            raise ValueError(f"{self.name}: checkpoint weight is {tuple(codes.shape)}, expected "
                             f"({self.vocab_size}, {self.in_features}) for a vocabulary of {self.vocab_size}")
        n = self.vocab_end - self.vocab_start
        self.codes[:n] = codes[self.vocab_start:self.vocab_end]
        self.scales[:n] = scales[self.vocab_start:self.vocab_end]
        self.loaded[0] = True
