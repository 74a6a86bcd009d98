"""The copy prior: the continuation of the answer's longest suffix in the context, mixed in at weight w.

The mixture's arithmetic is tested through the token-level prior of eval/calibrate_copy_prior.py, whose
suffixes are plain token ids; the served text-level prior on each family's tiny tokenizer."""

import math

import pytest
import torch

from eval.calibrate_copy_prior import TokenCopyPrior as CopyPrior


def test_the_longest_suffix_decides_what_follows():
    prior = CopyPrior([[5, 1, 2, 3], [9, 2, 4, 2, 7]], weight=0.5)
    assert prior.continuations([]) == {}
    assert prior.continuations([8]) == {}                       # occurs nowhere
    assert prior.continuations([2]) == {3: 1, 4: 1, 7: 1}        # three places, one token long each
    assert prior.continuations([1, 2]) == {3: 1}                 # the longer match wins
    assert prior.continuations([6, 4, 2]) == {7: 1}              # ...and the longest of several
    assert prior.continuations([3]) == {}                        # a chunk's last token has no next; no crossing


def test_a_copied_token_wins_unless_the_model_leads_by_more_than_w_over_1_minus_w():
    prior = CopyPrior([[1, 2, 3]], weight=0.3, max_order=4)
    logits = torch.log(torch.tensor([0.05, 0.05, 0.05, 0.25, 0.6]))   # the model favours 4; the context says 3
    out = prior(logits, [1, 2])
    probs = out.exp()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    assert math.isclose(float(probs[3]), 0.7 * 0.25 + 0.3, rel_tol=1e-5)
    assert int(out.argmax()) == 3                               # 0.6 − 0.25 < 0.3 / 0.7
    confident = torch.log(torch.tensor([0.01, 0.01, 0.01, 0.02, 0.95]))
    assert int(prior(confident, [1, 2]).argmax()) == 4          # 0.93 > 0.43: the model keeps its token


def test_nothing_changes_without_a_match_or_at_weight_zero():
    logits = torch.randn(6)
    assert torch.equal(CopyPrior([[1, 2]], weight=0.5)(logits, [5]), logits)
    assert torch.equal(CopyPrior([[1, 2]], weight=0.0)(logits, [1]), logits)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="weight"):
        CopyPrior([[1]], weight=1.5)
    with pytest.raises(ValueError, match="max_order"):
        CopyPrior([[1]], weight=0.5, max_order=0)


def test_the_text_prior_continues_a_name_the_model_split_otherwise(tiny):
    from cag.copy_prior import TextCopyPrior

    tok = tiny.tokenizer
    context = "The keeper of the hut is Skuske Repoziv, since 1807."
    prior = TextCopyPrior([context], tok, weight=0.5)
    answer = tok("Skuske Repo", add_special_tokens=False)["input_ids"]
    following = prior.continuations(answer)
    assert following, "the suffix occurs in the context"
    for token in following:
        assert "ziv, since 1807.".startswith(tok.decode([token])), tok.decode([token])
    assert prior.continuations(tok("Qqxq", add_special_tokens=False)["input_ids"]) == {}
    assert prior.continuations([]) == {}
    logits = torch.zeros(len(tok))
    assert int(prior(logits, answer).argmax()) in following   # a flat model follows the context


def test_the_model_keeps_its_own_chance_to_stop():
    logits = torch.log(torch.tensor([0.7, 0.1, 0.1, 0.1]))             # token 0 ends the answer
    plain = CopyPrior([[1, 2, 3]], weight=0.5)(logits, [1, 2]).exp()
    aware = CopyPrior([[1, 2, 3]], weight=0.5, stop_ids=[0])(logits, [1, 2]).exp()
    assert int(plain.argmax()) == 3                                    # 0.5·0.1 + 0.5 > 0.35: copies on
    assert int(aware.argmax()) == 0 and math.isclose(float(aware[0]), 0.7, rel_tol=1e-5)
    assert math.isclose(float(aware[3]), 0.5 * 0.1 + 0.5 * 0.3, rel_tol=1e-5)
    assert math.isclose(float(aware.sum()), 1.0, rel_tol=1e-5)


def test_a_copied_answer_does_not_stop_inside_a_word_of_the_context(tiny):
    from cag.copy_prior import TextCopyPrior

    tok = tiny.tokenizer
    stop = 0
    prior = TextCopyPrior(["The hut of Vimlem Quolubou keeps goats."], tok, 0.5, stop_ids=[stop])
    size = len(tok)

    def wants_to_stop():
        logits = torch.full((size,), -5.0)
        logits[stop] = 5.0          # the model is sure the answer is done
        return logits

    inside = tok("Vimlem Quolubo", add_special_tokens=False)["input_ids"]
    assert prior.continuations(inside) and int(prior(wants_to_stop(), inside).argmax()) != stop
    whole = tok("Vimlem Quolubou", add_special_tokens=False)["input_ids"]
    assert int(prior(wants_to_stop(), whole).argmax()) == stop     # " keeps" starts a new word: it may stop


def test_the_code_rule_keeps_a_code_whole_through_its_inner_punctuation(tiny):
    from cag.copy_prior import TextCopyPrior

    tok = tiny.tokenizer
    stop = 0
    text = "The vault's code is 60.836.86. Nobody else knows it."
    size = len(tok)

    def wants_to_stop():
        logits = torch.full((size,), -5.0)
        logits[stop] = 5.0
        return logits

    part = tok("60.836", add_special_tokens=False)["input_ids"]
    whole = tok("60.836.86", add_special_tokens=False)["input_ids"]
    letters = TextCopyPrior([text], tok, 0.5, stop_ids=[stop], words="letters")
    code = TextCopyPrior([text], tok, 0.5, stop_ids=[stop])                 # the default
    assert int(letters(wants_to_stop(), part).argmax()) == stop      # "." is not a letter: it may stop
    assert int(code(wants_to_stop(), part).argmax()) != stop         # ".86" goes on: it may not
    assert int(code(wants_to_stop(), whole).argmax()) == stop        # ". Nobody": the code is done
    with pytest.raises(ValueError, match="words"):
        TextCopyPrior([text], tok, 0.5, words="sentences")



def test_a_pointer_starts_the_answer_where_the_text_it_points_at_starts(tiny):
    from cag.copy_prior import TextCopyPrior

    tok = tiny.tokenizer
    prior = TextCopyPrior(["The code is JF/46355 here."], tok, 0.5, first={"JF/46355 here.": 0.9, "here.": 0.1},
                          first_weight=0.4)
    jf = tok("JF/46355 here.", add_special_tokens=False)["input_ids"][0]
    assert prior.continuations([]) == {}                      # the text prior itself needs a suffix
    logits = torch.zeros(len(tok))
    probs = prior(logits, []).exp()
    flat = 1.0 / len(tok)
    assert math.isclose(float(probs[jf]), 0.6 * flat + 0.4 * 0.9, rel_tol=1e-4)
    assert int(probs.argmax()) == jf and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-4)
    plain = TextCopyPrior(["The code is JF/46355 here."], tok, 0.5)
    assert torch.equal(plain(logits, []), logits)             # no pointer: the first token is the model's


def test_code_start_moves_a_first_token_spelled_only_inside_a_code_to_the_codes_start(tiny):
    from cag.copy_prior import TextCopyPrior

    tok = tiny.tokenizer
    text = "Tours are booked under cedar-67-lemon. Nobody comes."
    more = text + " " + " ".join(f"{'cedar-67-lemon'[:k]}x" for k in range(2, 9))   # its first pieces, elsewhere
    cedar = tok("cedar-67-lemon", add_special_tokens=False)["input_ids"][0]
    six = tok("67-lemon", add_special_tokens=False)["input_ids"][0]
    assert cedar != six and tok.decode([six]).strip() and not "cedar".startswith(tok.decode([six]).strip())
    logits = torch.full((len(tok),), -10.0)
    logits[six] = 10.0                                         # the model enters the code at its digits
    plain = TextCopyPrior([text], tok, 0.5)
    started = TextCopyPrior([more], tok, 0.5, code_start=True)
    assert int(plain(logits, []).argmax()) == six
    out = started(logits, [])
    assert int(out.argmax()) == cedar and math.isclose(float(out[cedar]), float(plain(logits, [])[six]))  # a swap
    # ...and the code is then copied from where it was entered, not from every place its first piece occurs
    head = tok.decode([cedar]).strip()
    (nxt,) = started.continuations([cedar])
    assert "cedar-67-lemon"[len(head):].startswith(tok.decode([nxt]).strip())
    elsewhere = TextCopyPrior([text + " 67 people came."], tok, 0.5, code_start=True)
    assert int(elsewhere(logits, []).argmax()) == six          # the context also starts a word with it: left alone
    logits[six], logits[cedar] = -10.0, 10.0
    assert torch.equal(TextCopyPrior([text], tok, 0.5, code_start=True)(logits, []), plain(logits, []))  # its start


def test_pointer_starts_weigh_the_words_a_head_attends_to(tiny):
    from cag.assembler import Assembler
    from cag.copy_prior import pointer_starts
    from cag.prompt import layout_for

    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    texts = ["The keeper of the hut is Skuske Repoziv.", "Goats graze on the hill."]
    chunks = [tiny.prefill(t) for t in texts]
    starts = pointer_starts(asm, chunks, texts, asm.question_ids("Who keeps the hut?"), 1, 0)
    assert starts and all(w >= 0 for w in starts.values())
    assert sum(starts.values()) <= 1 + 1e-5                   # a share of one head's attention
    words = {w for t in texts for w in t.split()}
    assert {s.split()[0] for s in starts} <= words            # every key starts at a word of the chunks
    spaced = pointer_starts(asm, chunks, texts, asm.question_ids("Who keeps the hut?"), 1, 0, chat=False)
    assert all(s.startswith(" ") for s in spaced)
    # within chosen sentences only: the same masses on their words, none elsewhere
    within = pointer_starts(asm, chunks, texts, asm.question_ids("Who keeps the hut?"), 1, 0,
                            sentences=[[(0, len(texts[0]))], []])
    assert set(within) == {w for w in texts[0].split() if w in starts}
    assert all(abs(within[w] - starts[w]) < 1e-6 for w in within if w not in texts[1].split())
    assert not set(within) & (set(texts[1].split()) - set(texts[0].split()))
    half = pointer_starts(asm, chunks, texts, asm.question_ids("Who keeps the hut?"), 1, 0,
                          sentences=[[(0, 10)], [(0, 5)]])          # "The keeper" and "Goats"
    assert set(half) == {"The", "keeper", "Goats"}
    from cag.copy_prior import question_words

    asked = question_words("Who is the keeper of the HUT?")
    assert asked == {"who", "is", "the", "keeper", "of", "hut"}
    skipped = pointer_starts(asm, chunks, texts, asm.question_ids("Who keeps the hut?"), 1, 0, skip=asked)
    assert set(skipped) == {w for w in starts if w.strip(".").lower() not in asked}   # "hut." and "The" too
    assert all(abs(skipped[w] - starts[w]) < 1e-6 for w in skipped)


def test_a_sentences_first_word_counts_when_its_token_carries_the_space_before_it(tiny):
    from cag.assembler import Assembler
    from cag.copy_prior import pointer_starts
    from cag.prompt import layout_for
    from stores.chunker import sentence_spans

    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    text = "The hut stands on the hill. stone keeps it. Goats graze."
    chunk = tiny.prefill(text)
    second = sentence_spans(text)[1]                          # trimmed: it starts at "s", after the space
    assert text[slice(*second)] == "stone keeps it."
    # the tiny tokenizers spell " s" as one token, as Qwen2.5 spells " Google": it starts outside the span
    assert (second[0] - 1, second[0] + 1) in [tuple(o) for o in chunk.offsets.tolist()]
    starts = pointer_starts(asm, [chunk], [text], asm.question_ids("Who keeps the hut?"), 1, 0,
                            sentences=[[second]])
    assert set(starts) == {"stone", "keeps", "it."}


def test_the_pointer_file_names_a_head_and_its_weight(tmp_path):
    import json

    from cag.copy_prior import pointer_head

    path = tmp_path / "pointer_heads.json"
    path.write_text(json.dumps({"fp": {"model": "m", "head": [16, 7], "weight": 0.4}}))
    assert pointer_head("fp", path) == (16, 7, 0.4)
    assert pointer_head("other", path) is None
    assert pointer_head("fp", tmp_path / "missing.json") is None
    from cag.copy_prior import PointerRules, pointer_rules

    assert pointer_rules("fp", path) == PointerRules() == pointer_rules("other", path)  # none chosen: all off
    chosen = tmp_path / "chosen.json"                                      # (files are read once per path)
    chosen.write_text(json.dumps({"fp": {"model": "m", "head": [16, 7], "weight": 0.4, "code_start": True,
                                         "sentences": 2, "skip_question": True, "anchor": True,
                                         "end_stops": True, "wrapped": True, "sentence_stops": True}}))
    assert pointer_head("fp", chosen) == (16, 7, 0.4)
    assert pointer_rules("fp", chosen) == PointerRules(sentences=2, skip_question=True, wrapped=True,
                                                       sentence_stops=True, code_start=True, anchor=True,
                                                       end_stops=True)
    assert pointer_rules("other", chosen) == PointerRules()


def test_anchor_pointer_copies_the_pointers_word_its_first_token_started(tiny):
    from cag.copy_prior import TextCopyPrior

    tok = tiny.tokenizer
    code = "prism-walnut-62"
    text = f"Guests sign in with {code}. " + " ".join(f"{code[:k]}x" for k in range(1, 9))  # its pieces, elsewhere
    first = tok(code, add_special_tokens=False)["input_ids"][0]
    head = tok.decode([first]).strip()
    loose = TextCopyPrior([text], tok, 0.5, first={code + ".": 0.8, "Guests": 0.2})
    anchored = TextCopyPrior([text], tok, 0.5, first={code + ".": 0.8, "Guests": 0.2}, anchor_pointer=True)
    (nxt,) = anchored.continuations([first])                   # the pointer's word, from where it was started
    assert code[len(head):].startswith(tok.decode([nxt]).strip()) and anchored._anchor == code
    # without it: a piece too short to match, or one that goes on in several places
    assert loose.continuations([first]) != {nxt: 1}
    unpointed = TextCopyPrior([text], tok, 0.5, anchor_pointer=True)   # no pointer: nothing to anchor to
    assert unpointed.continuations([first]) == loose.continuations([first]) and unpointed._anchor is None


def test_end_stops_end_an_answer_copied_to_a_chunks_final_full_stop(tiny):
    from cag.copy_prior import TextCopyPrior
    from cag.generate import stop_token_ids

    tok = tiny.tokenizer
    stops = sorted(stop_token_ids(tok))
    texts = ["Tours are booked under lemon-canyon-90.", "It was 90. Then 0.5 of them left"]
    answer = tok("lemon-canyon-90.", add_special_tokens=False)["input_ids"]
    assert TextCopyPrior(texts, tok, 0.5, stop_ids=stops).continuations(answer) == {}   # nothing follows there
    ended = TextCopyPrior(texts, tok, 0.5, stop_ids=stops, end_stops=True)
    assert ended.continuations(answer) == {stops[0]: 1}
    cut = tok("them left", add_special_tokens=False)["input_ids"]                         # no full stop: no end
    assert ended.continuations(cut) == {}


def test_sentence_stops_end_an_answer_at_its_best_sentences_end_and_no_token_crosses_it(tiny):
    from cag.copy_prior import TextCopyPrior
    from cag.generate import stop_token_ids
    from stores.chunker import sentence_spans

    tok = tiny.tokenizer
    stops = sorted(stop_token_ids(tok))
    text = "Good runners get tired at higher speeds.People who invent things are in the same position."
    best = sentence_spans(text)[:1]                                       # "Good runners ... higher speeds."
    assert text[slice(*best[0])].endswith("speeds.")
    plain = TextCopyPrior([text], tok, 0.5, stop_ids=stops)
    stopping = TextCopyPrior([text], tok, 0.5, stop_ids=stops, sentence_stops=[best])
    to_end = tok("higher speeds.", add_special_tokens=False)["input_ids"]
    assert stops[0] not in plain.continuations(to_end)                  # it runs on into "People"
    assert stopping.continuations(to_end) == {stops[0]: 1}             # the sentence the pointer chose ends here
    # one character short of the end: what is proposed spells no further than the sentence's end
    short = tok("higher speeds", add_special_tokens=False)["input_ids"]
    assert all(tok.decode([t]) == "."[:len(tok.decode([t]))] for t in stopping.continuations(short))
    other = tok("same position.", add_special_tokens=False)["input_ids"]      # not a best sentence's end
    assert stops[0] not in stopping.continuations(other)
    # an empty text is dropped, its spans with it
    assert TextCopyPrior(["", text], tok, 0.5, stop_ids=stops, sentence_stops=[[], best]).continuations(to_end) \
        == stopping.continuations(to_end)


def test_the_evened_twin_gives_each_pointed_word_the_same_mass_and_starts_fresh(tiny):
    from cag.copy_prior import TextCopyPrior

    tok = tiny.tokenizer
    text = "Guests sign in with prism-walnut-62 at the gate."
    prior = TextCopyPrior([text], tok, 0.5, first={"prism-walnut-62": 0.9, "Guests": 0.1}, anchor_pointer=True)
    prior._anchor = "prism-walnut-62"                                     # as after a first token
    twin = prior.evened()
    assert twin._word_mass == {"prism-walnut-62": 0.5, "Guests": 0.5} and twin._anchor is None
    assert sum(twin._first.values()) == pytest.approx(1.0) and prior._word_mass["prism-walnut-62"] == 0.9
    assert twin._texts == prior._texts and twin.anchor_pointer and twin.first_weight == prior.first_weight
    assert TextCopyPrior([text], tok, 0.5).evened()._first == {}          # no pointer: none to even
