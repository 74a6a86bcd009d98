from __future__ import annotations

import time

import pytest

from stores.chunker import Chunker, ChunkerSettings, chunk_text, tokenizer_id

PARA = ("The quick brown fox jumps over the lazy dog. Is this a sentence? Yes, it is. "
        "Caches are stored on disk.")


def check_invariants(doc, chunks):
    assert "".join(c.text for c in chunks) == doc
    pos = 0
    for i, c in enumerate(chunks):
        assert c.index == i
        assert c.start == pos and c.end == pos + len(c.text) and doc[c.start:c.end] == c.text
        assert c.text  # no empty chunk
        pos = c.end
    assert pos == len(doc)


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("size", [5, 16, 64])
def test_concatenation_offsets_and_size_bound(word_tokenizer, size):
    doc = "\n\n".join(f"{PARA} Paragraph {i}." for i in range(12))
    chunks = Chunker(word_tokenizer, chunk_tokens=size).split(doc)
    check_invariants(doc, chunks)
    assert len(chunks) > 1
    for c in chunks:
        assert c.n_tokens <= size
        assert n_tokens(word_tokenizer, c.text) == c.n_tokens  # word-level: exact
    assert sum(c.n_tokens for c in chunks) == n_tokens(word_tokenizer, doc)


def test_deterministic(word_tokenizer):
    doc = "\n\n".join(PARA * (i % 3 + 1) for i in range(10))
    a = Chunker(word_tokenizer, chunk_tokens=24).split(doc)
    b = Chunker(word_tokenizer, chunk_tokens=24).split(doc)
    assert a == b


def test_prefers_paragraph_boundaries(word_tokenizer):
    # each paragraph is 26 tokens; two fit into 60, so every cut is after a blank line
    doc = "\n\n".join(PARA for _ in range(8))
    chunks = Chunker(word_tokenizer, chunk_tokens=60).split(doc)
    check_invariants(doc, chunks)
    for c in chunks[:-1]:
        assert c.text.endswith("\n\n"), repr(c.text[-20:])
        assert c.text.count("\n\n") == 2
    assert all(not c.text[0].isspace() for c in chunks)


def test_falls_back_to_sentence_then_whitespace_then_token(word_tokenizer):
    doc = " ".join(["One sentence here ends now."] * 20)  # no paragraphs
    chunks = Chunker(word_tokenizer, chunk_tokens=15).split(doc)
    check_invariants(doc, chunks)
    assert all(c.text.rstrip().endswith(".") for c in chunks)

    doc = " ".join(["word"] * 100)  # no sentences
    chunks = Chunker(word_tokenizer, chunk_tokens=7).split(doc)
    check_invariants(doc, chunks)
    assert [c.n_tokens for c in chunks[:-1]] == [7] * (len(chunks) - 1)
    assert all(c.text.endswith(" ") for c in chunks[:-1])

    doc = "x" * 5000  # one enormous word is one WordLevel token: it cannot be cut
    chunks = Chunker(word_tokenizer, chunk_tokens=4).split(doc)
    check_invariants(doc, chunks)
    assert len(chunks) == 1


def test_enormous_sentence_bpe_token_cuts(bpe_tokenizer):
    doc = "abcdefghij" * 400  # no whitespace at all: only token boundaries
    chunks = Chunker(bpe_tokenizer, chunk_tokens=32).split(doc)
    check_invariants(doc, chunks)
    assert len(chunks) > 10
    assert all(c.n_tokens <= 32 for c in chunks)
    # cuts sit on token boundaries: each chunk re-tokenizes to exactly its count
    for c in chunks:
        assert n_tokens(bpe_tokenizer, c.text) == c.n_tokens


def test_unicode(bpe_tokenizer, word_tokenizer):
    doc = ("Héllo wörld, naïve café: ünïcode text 😀😀 and 日本語の文。次の文！\n\n" * 30)
    for tok in (bpe_tokenizer, word_tokenizer):
        chunks = Chunker(tok, chunk_tokens=20).split(doc)
        check_invariants(doc, chunks)
        assert all(c.n_tokens <= 20 for c in chunks)
    # byte-level tokens never get split between chunks
    chunks = Chunker(bpe_tokenizer, chunk_tokens=20).split(doc)
    assert sum(c.n_tokens for c in chunks) == n_tokens(bpe_tokenizer, doc)


@pytest.mark.parametrize("doc", ["", " ", "   \n\n\t  ", "word", "\n\nword\n\n"])
def test_edge_cases(word_tokenizer, doc):
    chunks = Chunker(word_tokenizer, chunk_tokens=4).split(doc)
    if doc == "":
        assert chunks == []
    else:
        check_invariants(doc, chunks)
    if doc.strip() == "" and doc:
        assert len(chunks) == 1 and chunks[0].n_tokens == 0


def test_large_document_is_linear(word_tokenizer):
    doc = "\n\n".join(f"{PARA} Number {i}." for i in range(25_000))  # ~2.6 MB, > segment size
    assert len(doc) > 2_000_000
    t0 = time.perf_counter()
    chunks = Chunker(word_tokenizer, chunk_tokens=256).split(doc)
    elapsed = time.perf_counter() - t0
    check_invariants(doc, chunks)
    assert all(c.n_tokens <= 256 for c in chunks)
    assert elapsed < 20, elapsed


def test_settings_stable_dict(word_tokenizer):
    s = ChunkerSettings(chunk_tokens=128, tokenizer=tokenizer_id(word_tokenizer))
    assert s.to_dict() == {"chunk_tokens": 128, "min_fill": 0.5, "tokenizer": tokenizer_id(word_tokenizer),
                           "version": 1}
    assert list(s.to_dict()) == sorted(s.to_dict())
    assert tokenizer_id(word_tokenizer) == tokenizer_id(word_tokenizer.backend_tokenizer)
    with pytest.raises(Exception):
        s.chunk_tokens = 3  # frozen
    with pytest.raises(Exception):
        ChunkerSettings(chunk_tokens=0, tokenizer="x")
    assert Chunker(word_tokenizer).settings.chunk_tokens == 256
    assert chunk_text(PARA, word_tokenizer, 8)[0].n_tokens <= 8


def test_rejects_slow_or_non_tokenizer():
    with pytest.raises(TypeError):
        Chunker(object())
