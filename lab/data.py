"""Training data every machine has without a download, and deterministic batches.

The default corpus is the byte-level text of the Python standard library's own
source files (sorted by path, so the same Python gives the same bytes), capped at
a few MiB. Any text file can be given by path instead. Tokens are bytes (vocab 256),
or a real model's tokens when a tokenizer is given (a `tokenizers.Tokenizer`, read
from the model directory's tokenizer.json).

`get_batch(tokens, step, ...)` draws the *global* batch of a step from (seed, step)
alone, so every parallel layout sees the same sequences; a data-parallel rank keeps
its contiguous slice of rows [rank*B/P, (rank+1)*B/P).
"""
from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import torch

DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024
PAD, IGNORE = 0, -100  # the padding token, and the target that counts nowhere (model.IGNORE)


def load_corpus(path: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES, tokenizer=None) -> torch.Tensor:
    """Tokens [N] (int64) of a text file, or of the standard library's sources: its bytes, or with a
    tokenizer (anything whose encode(text).ids gives the ids, e.g. tokenizers.Tokenizer) the ids of its
    text (UTF-8; an undecodable byte becomes U+FFFD). The built-in corpus is read once per process and every
    call returns that one tensor: index it, never write into it."""
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file {path!r} does not exist: pass an existing text file "
                                    f"or leave the path out to use the built-in corpus")
        raw = Path(path).read_bytes()[:max_bytes]
    else:
        raw = _stdlib_bytes(max_bytes)
    if len(raw) < 2:
        raise ValueError(f"corpus {path!r} has {len(raw)} bytes: a training text needs at least 2 "
                         f"(and seq_len + 1 for one sequence)")
    if tokenizer is not None:
        ids = tokenizer.encode(raw.decode("utf-8", errors="replace")).ids
        return torch.tensor(ids, dtype=torch.long)
    if path is None:
        return _stdlib_tokens(max_bytes)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


# (80 ms a read on 2 cores, and a test's rank asks for the corpus once per case)
@functools.lru_cache(maxsize=4)
def _stdlib_bytes(max_bytes: int) -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for f in sorted(stdlib.glob("*.py")):
        chunks.append(f.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


@functools.lru_cache(maxsize=4)
def _stdlib_tokens(max_bytes: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(_stdlib_bytes(max_bytes)), dtype=torch.uint8).long()


def get_batch(tokens: torch.Tensor, step: int, global_batch: int, seq_len: int, seed: int = 0,
              dp_rank: int = 0, dp_size: int = 1, device="cpu", pad_share: float = 0.0):
    """Inputs and targets [global_batch/dp_size, seq_len] of this data-parallel rank at `step`.

    A window of seq_len + 1 tokens starting at s needs s + seq_len <= N - 1, so s is drawn from
    the N - seq_len starts 0 .. N - seq_len - 1 (a corpus of exactly seq_len + 1 tokens has one).
    pad_share > 0: sequence i ends in a padded tail of floor(u_i * pad_share * seq_len) positions,
    u_i uniform in [0, 1) from (seed, step): its inputs become PAD and its targets IGNORE, so the
    sequences of a batch — and the ranks holding them — count different numbers of tokens.
    """
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global batch ({global_batch}) and sequence length ({seq_len}) must be >= 1")
    if global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} is not divisible by the data-parallel size "
                         f"{dp_size}: choose a multiple of {dp_size}")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is shorter than seq_len + 1 = {seq_len + 1}: "
                         f"give a longer text or a shorter sequence length")
    if not 0.0 <= pad_share <= 1.0:
        raise ValueError(f"pad_share {pad_share} must be between 0 and 1")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len, (global_batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    seqs = tokens[idx]
    x, y = seqs[:, :-1].clone(), seqs[:, 1:].clone()
    if pad_share > 0:
        u = torch.rand(global_batch, generator=gen)
        padded = torch.arange(seq_len)[None, :] >= seq_len - (u * pad_share * seq_len).long()[:, None]
        x[padded], y[padded] = PAD, IGNORE
    local = global_batch // dp_size
    rows = slice(dp_rank * local, (dp_rank + 1) * local)
    return x[rows].to(device), y[rows].to(device)
