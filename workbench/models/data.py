"""A tiny deterministic character-level dataset shipped with the package.

    from workbench.models.data import TOKENIZER, batches
    inputs, targets = next(batches(cfg, batch_size=8, seed=0))   # (B, S) each, targets shifted by 1
    TOKENIZER.decode(inputs[0])

The text, ``data/fables.txt`` (36 KB, 56 fables of a few sentences each about
animals sharing work), was written for this project by a small seeded grammar
and is shipped under the project's license.  Its vocabulary is small and
repetitive on purpose: the "tiny" model visibly learns it within a hundred
steps on a CPU (the loss falls from ln(75) = 4.3 to below 2.5), so a loss curve
in the course means something.  Character-level modelling as in Karpathy's
char-rnn and nanoGPT's shakespeare_char.

The tokenizer maps a fixed alphabet of 75 characters (newline, space,
punctuation, digits, letters) to ids 0..74, so any plain English string
encodes, not only the corpus.  Batches are a pure function of
(seed, step): the same seed gives the same batches on every machine, and
``get_batch(..., step=i)`` gives batch i without drawing the i before it.
"""
from __future__ import annotations

import functools
import hashlib
import string
from importlib import resources
from typing import Iterator

import torch

__all__ = ["ALPHABET", "Tokenizer", "TOKENIZER", "load_text", "tokens", "get_batch", "batches",
           "VAL_FRACTION"]

# newline, space, punctuation, digits, upper and lower case: 1 + 12 + 10 + 26 + 26 = 75
ALPHABET = "\n" + " !\"'(),-.:;?" + string.digits + string.ascii_uppercase + \
    string.ascii_lowercase
VAL_FRACTION = 0.1          # the last 10% of the text is held out for validation


class Tokenizer:
    """Characters <-> ids over a fixed alphabet (id = position in the alphabet)."""

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("Tokenizer: the alphabet repeats a character")
        self.itos = alphabet
        self.stoi = {c: i for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> torch.Tensor:
        """str -> (len(text),) int64 ids."""
        bad = sorted(set(text) - self.stoi.keys())
        if bad:
            raise ValueError(f"Tokenizer.encode: characters {bad[:8]!r} are not in the "
                             f"{self.vocab_size}-character alphabet (letters, digits, space, "
                             "newline and !\"'(),-.:;?); replace or drop them")
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        """ids (a 1-d tensor or a list of ints) -> str."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.itos[i] for i in ids)


TOKENIZER = Tokenizer()


def load_text(name: str = "fables") -> str:
    """The shipped text ``data/<name>.txt``."""
    path = resources.files(__package__).joinpath("data", f"{name}.txt")
    if not path.is_file():
        raise ValueError(f"load_text: no shipped text {name!r} (have: fables)")
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=4)
def _tokens(name: str) -> torch.Tensor:
    return TOKENIZER.encode(load_text(name))


def tokens(name: str = "fables", split: str = "train") -> torch.Tensor:
    """The text as int64 ids, the "train" (first 90%) or "val" (last 10%) part."""
    data = _tokens(name)
    cut = int(len(data) * (1 - VAL_FRACTION))
    if split == "train":
        return data[:cut]
    if split == "val":
        return data[cut:]
    raise ValueError(f"split={split!r}; use 'train' or 'val'")


def get_batch(cfg, batch_size: int, seed: int = 0, step: int = 0, split: str = "train",
              name: str = "fables") -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of the stream ``seed``: ``batch_size`` windows of
    ``cfg.seq_len`` characters at random offsets; targets are inputs shifted by one.
    Returns (inputs, targets), each (B, S) int64 on the CPU."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"get_batch: batch_size={batch_size!r} must be an int >= 1")
    if cfg.vocab_size < TOKENIZER.vocab_size:
        raise ValueError(f"get_batch: cfg.vocab_size={cfg.vocab_size} is smaller than the "
                         f"tokenizer's {TOKENIZER.vocab_size} characters; use vocab_size="
                         f"{TOKENIZER.vocab_size} (the 'tiny' preset does)")
    data, S = tokens(name, split), cfg.seq_len
    if len(data) < S + 1:
        raise ValueError(f"get_batch: the {split} text has {len(data)} characters, fewer than "
                         f"seq_len + 1 = {S + 1}")
    g = torch.Generator().manual_seed(_stream(seed, step, split))
    starts = torch.randint(0, len(data) - S, (batch_size,), generator=g)   # (B,)
    idx = starts[:, None] + torch.arange(S)                                # (B, S)
    return data[idx], data[idx + 1]                                        # (B, S), (B, S)


def _stream(seed: int, step: int, split: str) -> int:
    """A 32-bit seed for (seed, step, split); the CPU generator (mt19937) keeps only the
    low 32 bits of what it is given, so seed * 2**32 + step would collide across seeds."""
    key = f"{int(seed)}:{int(step)}:{split}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


def batches(cfg, batch_size: int, seed: int = 0, split: str = "train", steps: int | None = None,
            name: str = "fables") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """get_batch for step 0, 1, 2, ... (``steps`` of them, or forever)."""
    step = 0
    while steps is None or step < steps:
        yield get_batch(cfg, batch_size, seed, step, split, name)
        step += 1
