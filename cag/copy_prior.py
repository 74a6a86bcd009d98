"""Copy prior: the answer's next token also drawn from what follows its own tail in the context.

A translated cache finds the right fact and spells it wrong ("Rousath Vrolsesun" for "Rousrath
Vrolsesvun", "1800" for 1807: eval/results/eval-kc-plain-more/results.jsonl.gz). The question's attention
lands on the fact, but copying a string exactly needs the keys right across the network's depth,
which no map has reached (README, "Known limitations"). The context's tokens themselves are known
exactly (the chunks' text), so decoding can take the induction step itself: find the longest suffix
of the answer so far that occurs in the context, and mix the model's next-token distribution with the
tokens that follow that suffix there,

    p(t) = (1 − w) · p_model(t) + w · p_copy(t),      p_copy: those continuations' frequencies,

as a pointer-generator network mixes copying and generating (See et al., 2017), with a fixed weight w
where the network learns a gate. The first answer token has no suffix yet: where a pointer head is calibrated
for the target (`pointer_heads.json`, `eval/probe_pointer.py`), its copy distribution is where that head looks
from the question's last token, at its own weight; else it is the model's alone, as is every token whose suffix
occurs nowhere in the context. With one continuation, copying wins unless the model's favourite leads it by
more than w / (1 − w) in probability.

Given `stop_ids`, the model keeps its own probability of ending the answer (else at w ≥ 0.5 a unique match
copies on to the end of the budget), except where the answer stands inside a word that the context
continues: a model that splits a rare name otherwise than the text did would stop halfway through it.
A word there runs through inner punctuation (`words="code"`: "60.836.86", "BB/7304"; the default since it
found 3 more of 24 calibration codes than letters and digits alone, `words="letters"`). Each rule was
measured on the gate's calibration items (eval/results/copy_prior/README.md); the served weight is 0.5,
on translated paths only (the target's own chunks copy exactly already and lose free answers to it).

A translated cache often enters a code of words and digits at its digits: "67-lemon" for cedar-67-lemon,
"91. problems" for pebble-heron-91. With `code_start` (chosen per target in `pointer_heads.json`), a first
token that the context spells only inside a code, after its inner punctuation, swaps with that code's first
token, and the answer is then copied from that code (its own continuation, not every place its first piece
occurs) to its end. Calibration word-code needles into Qwen2.5: 27 → 42 of 72 found, none lost, and no answer of
the gate's items changed (eval/results/copy_prior/README.md, "Entering a code at its start").
"""

from __future__ import annotations

import copy
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

POINTER_FILE = Path(__file__).with_name("pointer_heads.json")
_TRAILING = ".,;:!?)\"'"  # punctuation that ends a sentence or clause, not a code


class TextCopyPrior:
    """The copy distribution of a placed context, for `cag.generate.stream_tokens`, its suffix matched
    in the context's characters (the token-level prior it beat lives in eval/calibrate_copy_prior.py).

    A model that copies a rare name often splits it otherwise than the context's tokenization did
    (" Repo" + ... where the text was tokenized " Rep" + "oz" + "iv"), and a token-level suffix then
    matches nothing. Here the answer so far is decoded, its longest suffix (`min_chars` to `max_chars`
    characters) is looked up in the chunks' text, and each occurrence proposes the longest vocabulary
    token that spells the start of what follows it there.
    """

    def __init__(self, texts: Sequence[str], tokenizer: Any, weight: float, *, min_chars: int = 2,
                 max_chars: int = 64, stop_ids: Sequence[int] = (), words: str = "code",
                 first: dict[str, float] | None = None, first_weight: float | None = None,
                 code_start: bool = False, chat: bool = True, anchor_pointer: bool = False,
                 end_stops: bool = False, sentence_stops: Sequence[Sequence[tuple[int, int]]] | None = None) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"copy prior weight must be in [0, 1], got {weight}")
        if not 1 <= min_chars <= max_chars:
            raise ValueError(f"need 1 <= min_chars <= max_chars, got {min_chars}, {max_chars}")
        if words not in WORD_RULES:
            raise ValueError(f"words must be one of {sorted(WORD_RULES)}, got {words!r}")
        self.weight, self.min_chars, self.max_chars = float(weight), int(min_chars), int(max_chars)
        self._goes_on = WORD_RULES[words]
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        # `sentence_stops`: per text, the spans of the sentences the pointer chose from; an answer copied up to one's
        # final punctuation ends there as at a chunk's end (`end_stops`): the pointer chose within that sentence
        ends = list(sentence_stops) if sentence_stops is not None else [()] * len(texts)
        kept = [(t, frozenset(e for _, e in spans)) for t, spans in zip(texts, ends) if t]
        self._texts, self._sentence_ends = [t for t, _ in kept], [e for _, e in kept]
        self._tokenizer = tokenizer
        self._vocab: dict[str, int] | None = None  # built at the second answer token, after the first is out
        self._longest = 0
        # The first token's copy distribution: where a pointer head of the target looks from the question's
        # last token (texts that start there → weight), each spelled by its tokenizer's first token.
        self.first_weight = self.weight if first_weight is None else float(first_weight)
        # `code_start` (see `_code_started`): the pointer's mass per word, to choose among codes; `chat`: the
        # layout's answers start without a space (else a word is spelled after one, as `pointer_starts` does)
        self.code_start, self._chat = bool(code_start), bool(chat)
        self._anchor: str | None = None  # the code a `code_start` swap entered: copied to its end
        # `anchor_pointer`: a first token that starts a word the pointer chose copies that word to its end (the
        # pointer's favourite of those it starts), not whatever follows the token anywhere in the context
        self.anchor_pointer = bool(anchor_pointer)
        # `end_stops`: where the answer's suffix ends a chunk's text at a full stop, what follows there is the
        # answer's end (a stop token), not nothing: else a fact that closes its chunk runs on from any shorter
        # suffix ("lemon-canyon-90.90. 90.")
        self.end_stops = bool(end_stops)
        self._point([(text, w) for text, w in (first or {}).items() if w > 0])

    def _point(self, starts: list[tuple[str, float]]) -> None:
        """The first token's copy distribution from the pointer's words and masses, each spelled by its first token."""
        self._starts = starts
        self._first: dict[int, float] = {}
        self._word_mass = {text.strip().rstrip(_TRAILING): w for text, w in starts}
        self._pointer_word: dict[int, tuple[float, str]] = {}
        if starts:  # one batched call: a 4K context has thousands of word starts, read before the first token
            encoded = self._tokenizer([text for text, _ in starts], add_special_tokens=False)["input_ids"]
            for ids, (text, w) in zip(encoded, starts):
                if ids:
                    self._first[ids[0]] = self._first.get(ids[0], 0.0) + float(w)
                    if w > self._pointer_word.get(ids[0], (0.0, ""))[0]:
                        self._pointer_word[ids[0]] = (float(w), text.strip().rstrip(_TRAILING))

    def evened(self) -> "TextCopyPrior":
        """A twin, before any answer token, whose pointer gives each word it chose the same mass: the evaluation's
        control for what the rules find from the chunks' text alone (`eval/harness.py`, ``copy_only``)."""
        twin = copy.copy(self)
        twin._anchor = None
        twin._point([(text, 1.0 / len(self._starts)) for text, _ in self._starts])
        return twin

    def continuations(self, generated: Sequence[int]) -> dict[int, int]:
        """The tokens that start what follows the answer's longest suffix in the chunks' text, with counts."""
        return self._follow(generated)[0]

    def _follow(self, generated: Sequence[int]) -> tuple[dict[int, int], bool]:
        """`continuations`, and whether the answer stands inside a word wherever the context goes on."""
        if not generated:
            return {}, False
        text = self._tokenizer.decode(list(generated), skip_special_tokens=True)
        answer = text.strip()
        if self.anchor_pointer and self._anchor is None and len(generated) == 1 and generated[0] in self._pointer_word:
            self._anchor = self._pointer_word[generated[0]][1]
        if self._anchor is not None and len(answer) < len(self._anchor) and self._anchor.startswith(answer):
            # inside the code the first token entered: its own continuation, not every place its prefix occurs
            if self._vocab is None:
                self._vocab, self._longest = _spellings(self._tokenizer)
            token = self._first_token(self._anchor[len(answer):][:self._longest])
            if token is not None:
                return {token: 1}, True
        n = 0
        while n < min(len(text), self.max_chars) and any(text[-(n + 1):] in t for t in self._texts):
            n += 1
        if n < self.min_chars:
            return {}, False
        if self._vocab is None:  # once per tokenizer (`_spellings`), never before the first token is chosen
            self._vocab, self._longest = _spellings(self._tokenizer)
        suffix, found, inside = text[-n:], {}, True
        for t, sentence_ends in zip(self._texts, self._sentence_ends):
            at = t.find(suffix)
            while at >= 0:
                rest = t[at + n: at + n + self._longest]
                # a copied token does not cross a best sentence's end (".People" of "speeds.People"), so the
                # answer can stand at it, and there it proposes only the end: the pointer chose within that sentence
                rest = rest[:min((e - at - n for e in sentence_ends if e > at + n), default=len(rest))]
                sentence_end = at + n in sentence_ends
                if (sentence_end or (not rest and self.end_stops)) and self.stop_ids and suffix[-1:] in ".!?":
                    found[self.stop_ids[0]] = found.get(self.stop_ids[0], 0) + 1
                    inside = False
                    if sentence_end:
                        at = t.find(suffix, at + 1)
                        continue
                token = self._first_token(rest)
                if token is not None:
                    found[token] = found.get(token, 0) + 1
                    inside = inside and self._goes_on(text[-1], rest)
                at = t.find(suffix, at + 1)
        return found, inside and bool(found)

    def _first_token(self, rest: str) -> int | None:
        """The longest vocabulary token that spells the start of `rest`."""
        for k in range(len(rest), 0, -1):
            token = self._vocab.get(rest[:k])
            if token is not None:
                return token
        return None

    def __call__(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        if self.weight <= 0:
            return logits
        if not generated:
            return self._code_started(mixed(logits, self._first, self.first_weight, self.stop_ids))
        following, mid_word = self._follow(generated)
        # An answer copied from the context does not end inside one of its words ("Quolubo" of "Quolubou"):
        # there the model's wish to stop is mixed like any other token's.
        return mixed(logits, following, self.weight, () if mid_word else self.stop_ids)

    def _code_started(self, log_probs: torch.Tensor) -> torch.Tensor:
        """With `code_start`: where the first token's favourite is spelled, in the context, only inside a code
        after its inner punctuation ("67" of "cedar-67-lemon", "9" of "pebble-heron-91"), it swaps with the first
        token of that code (the pointer's favourite of several, else the first met): a translated cache enters a
        code of words and digits at its digits."""
        if not self.code_start:
            return log_probs
        best = int(log_probs.argmax())
        spelled = self._tokenizer.decode([best], skip_special_tokens=True).strip()
        if not spelled:
            return log_probs
        codes: list[str] = []
        for text in self._texts:
            for word in text.split():
                word = word.lstrip("(\"'").rstrip(_TRAILING)
                if word.startswith(spelled):
                    return log_probs  # the context starts a word with it: the model may mean that one
                if any(word[i - 1] in "-/." and word[i - 2].isalnum() and word.startswith(spelled, i)
                       for i in range(2, len(word))):
                    codes.append(word)
        if not codes:
            return log_probs
        word = max(codes, key=lambda w: self._word_mass.get(w, 0.0))  # ties: the first met (max keeps it)
        ids = self._tokenizer(word if self._chat else " " + word, add_special_tokens=False)["input_ids"]
        if not ids or ids[0] == best or ids[0] >= log_probs.shape[-1]:
            return log_probs
        out = log_probs.clone()
        out[best], out[ids[0]] = log_probs[ids[0]], log_probs[best]
        self._anchor = word
        return out


def _letters_go_on(last: str, rest: str) -> bool:
    """Inside a word: a letter or digit on both sides ("Quolubo|u")."""
    return last.isalnum() and rest[:1].isalnum()


def _code_goes_on(last: str, rest: str) -> bool:
    """Inside a word, its inner punctuation included: "60.836|.86", "BB/|7304", "Vranpand|-Skusus" go on,
    "23.9 years|. It" does not."""
    if last.isspace() or not rest or rest[0].isspace():
        return False
    return rest[0].isalnum() or rest[1:2].isalnum()


# Where the answer stands inside a word of the context, the model's wish to stop is mixed like any other
# token's (eval/results/copy_prior/README.md measures each rule).
WORD_RULES = {"letters": _letters_go_on, "code": _code_goes_on}


_SPELLINGS: "weakref.WeakKeyDictionary[Any, tuple[dict[str, int], int]]" = weakref.WeakKeyDictionary()


def _spellings(tokenizer) -> tuple[dict[str, int], int]:
    """Each vocabulary token's text → its id (the first id where two spell the same), and the longest
    text; once per tokenizer (about a second for a 150k-262k vocabulary). Special tokens and pieces of a
    character are left out: the context's text never continues with them."""
    if tokenizer not in _SPELLINGS:
        special = set(getattr(tokenizer, "all_special_ids", []))
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        vocab: dict[str, int] = {}
        for i, piece in enumerate(pieces):
            if piece is None or i in special:
                continue
            spelled = tokenizer.convert_tokens_to_string([piece])
            if spelled and "\ufffd" not in spelled:
                vocab.setdefault(spelled, i)
        _SPELLINGS[tokenizer] = (vocab, max(map(len, vocab), default=1))
    return _SPELLINGS[tokenizer]


def mixed(logits: torch.Tensor, following: dict[int, float], weight: float,
           stop_ids: Sequence[int] = ()) -> torch.Tensor:
    """log((1 − w) softmax(logits) + w · following / Σ following); the logits as they are if nothing follows.

    With `stop_ids` the model keeps its own probability s of ending the answer and the mixture shares the
    rest, (1 − w) p(t) + w (1 − s) c(t): an answer that is complete stops although the context goes on."""
    following = {t: n for t, n in following.items() if t < logits.shape[-1]}  # tokens the head can emit
    if not following:
        return logits
    model = torch.softmax(logits.float(), -1)
    probs = model * (1.0 - weight)
    mass = 1.0
    stop_ids = [i for i in stop_ids if i < logits.shape[-1]]
    if stop_ids:
        stops = torch.tensor(stop_ids, device=probs.device)
        probs[stops] = model[stops]
        mass = 1.0 - float(model[stops].sum())
    total = sum(following.values())
    ids = torch.tensor(list(following), device=probs.device)
    share = torch.tensor([v / total for v in following.values()], device=probs.device)
    probs[ids] += weight * mass * share
    return probs.log()


@lru_cache(maxsize=None)
def _pointer_file(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def pointer_head(fingerprint_id: str, path: Path | None = None) -> tuple[int, int, float] | None:
    """(layer, head, weight) of the target's calibrated pointer head, or None."""
    entry = _pointer_file(path or POINTER_FILE).get(fingerprint_id)
    if not entry:
        return None
    layer, head = entry["head"]
    return int(layer), int(head), float(entry["weight"])


@dataclass(frozen=True)
class PointerRules:
    """The first-token rules a target's calibration chose (its entry in `pointer_heads.json`); all off elsewhere.

    - `sentences`: the pointer chooses among the words of the retriever's k best sentences (0: anywhere; the
      whole chunks that hold them found less, eval/results/sentence_pointer, measured at commit 300ffcb);
    - `skip_question`: ...and never a word of the question;
    - `wrapped`: a best sentence is read whole across the text's line wraps (`cag.selection.best_sentences`);
    - `sentence_stops`: an answer copied to the end of a best sentence ends there (`TextCopyPrior(sentence_stops=)`);
    - `code_start`, `anchor`, `end_stops`: `TextCopyPrior`'s rules of those names (`anchor` is `anchor_pointer`).
    """
    sentences: int = 0
    skip_question: bool = False
    wrapped: bool = False
    sentence_stops: bool = False
    code_start: bool = False
    anchor: bool = False
    end_stops: bool = False


def pointer_rules(fingerprint_id: str, path: Path | None = None) -> PointerRules:
    """The target's entry read field by field (the file's keys are `PointerRules`' names), each as its type."""
    entry = _pointer_file(path or POINTER_FILE).get(fingerprint_id) or {}
    return PointerRules(**{f.name: type(f.default)(entry[f.name]) for f in fields(PointerRules) if f.name in entry})


def bare_word(word: str) -> str:
    """A word as the pointer compares it with the question's: lower case, its outer punctuation gone."""
    return word.strip(_TRAILING + "(\"'").lower()


def question_words(question: str) -> frozenset[str]:
    return frozenset(w for w in map(bare_word, question.split()) if w)


def pointer_starts(assembler, chunks: Sequence[Any], texts: Sequence[str], question_ids: torch.Tensor,
                   layer: int, head: int, *, chat: bool = True,
                   sentences: Sequence[Sequence[tuple[int, int]]] | None = None,
                   skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """Where (`layer`, `head`) of the target looks from the question's last token over `chunks` (placed as
    stored after the prompt head): the attention on each token that starts a word, summed per word (its first
    64 characters; after a space where the layout's answers start with one, `chat=False`).

    `sentences`: per chunk, the character spans the pointer may choose from (the retriever's best sentences,
    `cag.selection.best_sentences`); a word starting elsewhere gets no mass. None: anywhere.
    `skip`: words (`bare_word`) that get no mass: the question's own, which an answer rarely starts with."""
    (mass,) = assembler.heads_attention(chunks, [question_ids], [(layer, head)], last_token=True)
    mass, at, starts = mass[0], assembler.prefix().num_tokens, {}
    for c, (chunk, text) in enumerate(zip(chunks, texts)):
        allowed = None if sentences is None else sentences[c]
        for i, (a, _) in enumerate(chunk.offsets.tolist()):
            if not (a == 0 or text[a].isspace() or text[a - 1].isspace()):
                continue  # inside a word
            # where the word's first letter is: a token that carries the space before it (" Google") starts
            # outside its sentence's span, which is trimmed, and a sentence's first word would never count
            ahead = text[a:a + 65]
            letter = a + len(ahead) - len(ahead.lstrip())
            if allowed is not None and not any(s <= letter < e for s, e in allowed):
                continue  # outside the sentences the retriever chose
            words = ahead.split(maxsplit=1)
            if words and skip and bare_word(words[0]) in skip:
                continue
            if words:
                # The word alone spells the same first token (a tokenizer's pieces never cross a space), and
                # a word met many times is tokenized once.
                key = words[0] if chat else " " + words[0]
                starts[key] = starts.get(key, 0.0) + float(mass[at + i])
        at += chunk.num_tokens
    return starts
