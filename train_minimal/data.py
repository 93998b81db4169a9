"""The token stream: a deterministic synthetic corpus (or a user's file) and the sampler
that cuts one global batch per step out of it, independent of the world size.

Tokens are bytes. Sample `i` of the stream is the window of `seq_len + 1` tokens that starts
at an offset drawn from a hash of `(seed, i)`, so any sample can be produced without the ones
before it. Step k (counting from 0 at data position 0) takes samples
`[position, position + global_batch)`; rank r of N takes the r-th contiguous slice of
`global_batch / N` of them. Which samples a step sees therefore depends only on the data
position, never on the world size, and resuming needs nothing but the position.

Example:
    >>> corpus = synthetic_corpus(seed=0)
    >>> bytes(corpus[:25])
    b'850+636=1486\\n511+269=780\\n'
    >>> stream = TokenStream(corpus, seq_len=8, seed=0)
    >>> inputs, targets = stream.batch(position=0, global_batch=4, rank=1, world_size=2)
    >>> inputs.shape, targets.shape
    (torch.Size([2, 8]), torch.Size([2, 8]))
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from train_minimal.config import ConfigError

# The synthetic corpus: this many lines of `a+b=c\n` with a, b < 1000 (about 250 kB).
SYNTHETIC_LINES = 24_000
SYNTHETIC_MAX_OPERAND = 1000
_MASK_64 = (1 << 64) - 1


def synthetic_corpus(seed: int) -> np.ndarray:
    """Return the built-in corpus as uint8 tokens: lines `a+b=c` of random 3-digit sums.

    The operands are random, the format and the sums are learnable, so the loss falls from
    ln(vocab) to well under 2 nats within a few hundred steps.
    """
    generator = np.random.default_rng(seed)
    operands = generator.integers(0, SYNTHETIC_MAX_OPERAND, size=(SYNTHETIC_LINES, 2))
    text = "".join(f"{a}+{b}={a + b}\n" for a, b in operands.tolist())
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).copy()


def file_corpus(path: str | Path, vocab: int, seq_len: int) -> np.ndarray:
    """Return a file's bytes as uint8 tokens; raise ConfigError when a byte does not fit the
    vocabulary or the file is shorter than one sample."""
    if not Path(path).is_file():
        raise ConfigError(f"--data {path}: no such file")
    tokens = np.fromfile(Path(path), dtype=np.uint8)
    if tokens.size < seq_len + 1:
        raise ConfigError(f"--data {path}: {tokens.size} bytes, fewer than one sample of --seq-len {seq_len} + 1")
    largest = int(tokens.max())
    if largest >= vocab:
        raise ConfigError(f"--data {path}: holds byte value {largest}, which needs --vocab {largest + 1} or more "
                         f"(this run has --vocab {vocab}; byte-level text wants 256)")
    return tokens


def mix64(value: int) -> int:
    """Return splitmix64 of a 64-bit integer: a fixed, platform-independent hash."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK_64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return value ^ (value >> 31)


class TokenStream:
    """Global-batch sampler over a corpus: sample i is a window at offset hash(seed, i)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        if tokens.size < seq_len + 1:
            raise ValueError(f"corpus of {tokens.size} tokens is shorter than one sample ({seq_len} + 1)")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.starts = tokens.size - seq_len  # number of distinct windows

    def sample(self, index: int) -> np.ndarray:
        """Return sample `index`: `seq_len + 1` tokens (inputs plus the next-token target)."""
        start = mix64(mix64(self.seed & _MASK_64) ^ index) % self.starts
        return self.tokens[start:start + self.seq_len + 1]

    def batch(self, position: int, global_batch: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's (inputs, targets), int64 of shape (global_batch / world_size,
        seq_len), for the global batch that starts at data position `position`."""
        per_rank = global_batch // world_size
        first = position + rank * per_rank
        rows = np.stack([self.sample(index) for index in range(first, first + per_rank)]).astype(np.int64)
        window = torch.from_numpy(rows)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
