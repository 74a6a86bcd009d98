"""Stop ids are computed once per tokenizer: building the vocabulary dict costs 0.24-0.6 s per call
on the real 151k-262k vocabularies, and every answer asked for it before its first token."""

import copy

from cag.generate import stop_token_ids
from tests.tiny import tiny_tokenizer as shared_tokenizer


def tiny_tokenizer():
    """A tokenizer object no other test has asked stop ids of (the shared one is cached)."""
    return copy.deepcopy(shared_tokenizer())


def test_stop_ids_read_the_vocabulary_once_per_tokenizer(monkeypatch):
    tok = tiny_tokenizer()
    calls = []
    real = tok.get_vocab
    monkeypatch.setattr(tok, "get_vocab", lambda: calls.append(1) or real())
    first = stop_token_ids(tok)
    first.add(-1)  # a caller's copy: changing it changes nothing cached
    assert stop_token_ids(tok) == first - {-1}
    assert len(calls) == 1
    other = tiny_tokenizer()
    assert stop_token_ids(other) == first - {-1}  # a second tokenizer computes its own


def test_stop_ids_hold_eos_and_the_known_markers_present():
    tok = tiny_tokenizer()
    ids = stop_token_ids(tok, extra=("<definitely-not-a-token>",))
    assert ids == ({tok.eos_token_id} if tok.eos_token_id is not None else set())
