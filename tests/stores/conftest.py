"""Fixtures for the `stores` tests: tiny in-process tokenizers, fake fingerprints and
chunks, a deterministic embedder. Nothing is downloaded."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest
import torch

from cag.kv import KVChunk, ModelFingerprint, text_sha256

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paragraphs are separated by blank lines! Sentences end with a period.",
    "Is this a sentence? Yes, it is. Caches are stored on disk.",
    "Héllo wörld, naïve café: ünïcode text 😀 and 日本語の文。",
]


@pytest.fixture(scope="session")
def word_tokenizer():
    """A WordLevel tokenizer (whitespace + punctuation pre-tokenizer) as a HF fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style: tokens like ' word' start at the space)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def make_fingerprint(name: str = "fake", layers: int = 2, heads: int = 2, head_dim: int = 8) -> ModelFingerprint:
    h = hashlib.sha256(name.encode()).hexdigest()
    return ModelFingerprint(family="fake", config_hash=h[:16], tokenizer_hash=h[16:32], weights_hash=h[32:48],
                            num_layers=layers, num_kv_heads=heads, head_dim=head_dim, name=name)


def make_chunk(text: str, fp: ModelFingerprint, seed: int = 0) -> KVChunk:
    g = torch.Generator().manual_seed(seed)
    n = max(1, len(text.split()))
    shape = (fp.num_layers, fp.num_kv_heads, n, fp.head_dim)
    return KVChunk(
        keys=torch.randn(shape, generator=g), values=torch.randn(shape, generator=g),
        token_ids=torch.arange(n, dtype=torch.int64), offsets=torch.zeros(n, 2, dtype=torch.int64),
        text_hash=text_sha256(text), model=fp, settings={"chunk_tokens": 16},
    )


@pytest.fixture
def fingerprint() -> ModelFingerprint:
    return make_fingerprint("source")


@pytest.fixture
def fp_factory():
    """`make_fingerprint(name, ...)`: a fake `ModelFingerprint`."""
    return make_fingerprint


@pytest.fixture
def chunk_factory():
    """`make_chunk(text, fingerprint, seed)`: a `KVChunk` with random small tensors."""
    return make_chunk


class FakeEmbedder:
    """Deterministic bag-of-words embedder: each lower-cased word hashes to a bucket."""

    def __init__(self, dim: int = 64, id: str = "fake-bow-64") -> None:
        self.dim, self.id = dim, id
        self.calls = 0

    def __call__(self, texts):
        self.calls += 1
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"\w+", t.lower()):
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % self.dim] += 1.0
        return out


@pytest.fixture
def fake_embedder() -> FakeEmbedder:
    return FakeEmbedder()
