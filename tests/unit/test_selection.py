"""Choosing the crux outside the target (#9): first-k, source-guided and retriever-guided recompute."""

import pytest
import torch

from cag import selection
from cag.assembler import Assembler, first_k_positions
from cag.kv import KVChunk, ModelFingerprint, text_sha256
from cag.prompt import layout_for

DOC = ("The tower has four floors. Zorblat keeps 417 maps in the tower. "
       "The stairs were rebuilt in spring. Visitors leave by the east door.")


def test_first_k_picks_exactly_k_per_chunk():
    got = first_k_positions([10, 3, 7], n_prefix=5, k=4)
    assert got.tolist() == [5, 6, 7, 8, 15, 16, 17, 18, 19, 20, 21]  # the 3-token chunk gives all it has


def test_first_k_through_place(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(DOC), tiny.prefill("Another chunk of text here.")]
    placed = asm.place(chunks, recompute_select="first_k", first_k=3)
    assert placed.recomputed_tokens == 6


def test_sentence_spans_cover_sentences():
    spans = selection.sentence_spans(DOC)
    assert [DOC[s:e] for s, e in spans][1] == "Zorblat keeps 417 maps in the tower."
    assert len(spans) == 4


class FakeAssembler:
    """An assembler whose question attention is constructed, in one layer of two heads: the
    neutral question has a positional bias toward the last tokens in both, the real question
    adds mass on the planted span in head 0 and, given a `distractor`, more on it in head 1."""

    def __init__(self, chunk, planted, distractor=None):
        self.chunk, self.planted, self.distractor = chunk, planted, distractor
        self.prefix_ids = torch.tensor([1, 2])

    def question_ids(self, q):
        return torch.tensor([0 if q == selection.NEUTRAL_QUESTION else 1])

    def context_attention(self, chunks, q_ids, per_head=False, num_layers=None):
        n = sum(c.num_tokens for c in chunks)
        mass = torch.zeros(1, 2, 2 + n)
        mass[..., 2:] = torch.linspace(0.0, 1.0, n)  # recency bias, shared by every question
        if q_ids.item() == 1:
            mass[0, 0, 2 + self.planted] += 0.3
            if self.distractor is not None:
                mass[0, 1, 2 + self.distractor] += 0.8
        return mass if per_head else mass.mean(dim=(0, 1))

    def heads_attention(self, chunks, questions, heads=None):
        per_head = [self.context_attention(chunks, q, per_head=True) for q in questions]
        if heads is None:
            return per_head
        layers, hs = zip(*heads)
        return [m[list(layers), list(hs)] for m in per_head]


def fake_chunk(text):
    words = [(m.start(), m.end()) for m in __import__("re").finditer(r"\S+", text)]
    n = len(words)
    return KVChunk(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2), torch.arange(n),
                   torch.tensor(words), text_sha256(text), ModelFingerprint("llama", "c", "t", "w", 1, 1, 2), {})


def test_source_selector_picks_the_planted_span_not_the_nearest():
    chunk = fake_chunk(DOC)
    second = selection.sentence_spans(DOC)[1]
    planted = torch.tensor([j for j, (s, e) in enumerate(chunk.offsets.tolist()) if s >= second[0] and e <= second[1]])
    fake = FakeAssembler(chunk, planted)
    spans = selection.source_guided_spans(fake, [chunk], [chunk], [DOC], "How many maps?", budget_tokens=7)
    assert spans == [[second]]
    # Raw mass (no contrast) would have taken the last sentence, nearest the question.
    raw = fake.context_attention([chunk], torch.tensor([1]))[2:]
    last = selection.sentence_spans(DOC)[-1]
    assert raw[-1] > raw[planted].max() and spans[0][0] != last


def test_retrieval_heads_pick_the_planted_span_the_average_of_all_heads_misses(tmp_path):
    chunk = fake_chunk(DOC)
    spans = selection.sentence_spans(DOC)
    inside = lambda span: torch.tensor([j for j, (s, e) in enumerate(chunk.offsets.tolist())  # noqa: E731
                                        if s >= span[0] and e <= span[1]])
    fake = FakeAssembler(chunk, inside(spans[1]), distractor=inside(spans[0]))
    every = selection.source_guided_spans(fake, [chunk], [chunk], [DOC], "How many maps?", budget_tokens=5)
    assert every == [[spans[0]]]  # head 1's distractor dominates the average
    table = tmp_path / "heads.json"
    table.write_text('{"fp-1": {"heads": [[0, 0]]}}')
    heads = selection.retrieval_heads("fp-1", table)
    assert heads == [(0, 0)] and selection.retrieval_heads("other", table) is None
    chosen = selection.source_guided_spans(fake, [chunk], [chunk], [DOC], "How many maps?", budget_tokens=7,
                                           heads=heads)
    assert chosen == [[spans[1]]]


def test_per_head_question_mass_averages_to_the_plain_one(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(DOC), tiny.prefill(OTHER)]
    q = asm.question_ids("How many maps?")
    per_head = asm.context_attention(chunks, q, per_head=True)
    assert per_head.shape[:2] == (tiny.model.config.num_hidden_layers, tiny.model.config.num_attention_heads)
    torch.testing.assert_close(per_head.mean(dim=(0, 1)), asm.context_attention(chunks, q))


def test_heads_attention_is_each_questions_context_attention(tiny):
    """One placement for several questions, a few heads: what `context_attention` gives those heads."""
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(DOC), tiny.prefill(OTHER)]
    questions = [asm.question_ids("How many maps?"), asm.question_ids(selection.NEUTRAL_QUESTION)]
    assert questions[0].numel() != questions[1].numel()  # the shorter one uses part of the room
    heads = [(1, 0), (0, 1)]
    every = asm.heads_attention(chunks, questions)
    chosen = asm.heads_attention(chunks, questions, heads)
    for q, all_heads, few in zip(questions, every, chosen):
        want = asm.context_attention(chunks, q, per_head=True)
        torch.testing.assert_close(all_heads, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(few, want[[1, 0], [0, 1]], atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        asm.heads_attention(chunks, [], heads)


def test_heads_attention_of_the_last_token(tiny):
    """`last_token`: the row of the question's last token, which predicts the answer's first; for a
    one-token question that is the mean over its tokens."""
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(DOC), tiny.prefill(OTHER)]
    question = asm.question_ids("How many maps?")
    (last,), (mean,) = asm.heads_attention(chunks, [question], last_token=True), asm.heads_attention(chunks, [question])
    assert last.shape == mean.shape and not torch.allclose(last, mean)
    assert bool((last.sum(-1) <= 1 + 1e-5).all()) and bool((last >= 0).all())
    one = question[-1:]
    (a,), (b,) = asm.heads_attention(chunks, [one], last_token=True), asm.heads_attention(chunks, [one])
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_budget_is_respected_and_positions_are_placed():
    chunk = fake_chunk(DOC)
    spans = [selection.sentence_spans(DOC)[:2]]
    pos = selection.spans_to_positions([chunk, chunk], [spans[0], []], n_prefix=3)
    assert pos.min() >= 3 and pos.max() < 3 + chunk.num_tokens
    assert len(pos) == sum(1 for s, e in chunk.offsets.tolist() if e <= spans[0][1][1])


def test_retriever_spans_pick_the_most_similar_sentence():
    def embed(texts):  # bag of letters: the sentence sharing the question's words wins
        return torch.stack([torch.bincount(torch.tensor([ord(c) % 64 for c in t.lower()]), minlength=64).float()
                            for t in texts])
    chunk = fake_chunk(DOC)
    spans = selection.retriever_spans(embed, [chunk], [DOC], "Zorblat keeps 417 maps in the tower?", 7)
    assert spans[0] == [selection.sentence_spans(DOC)[1]]


def test_retriever_spans_use_the_sentence_vectors_the_index_kept():
    """Vectors embedded at build give the same choice, and only the question (and a chunk without
    vectors, or with vectors of other sentences) is embedded at query time."""
    calls = []

    def embed(texts):
        calls.append(list(texts))
        return torch.stack([torch.bincount(torch.tensor([ord(c) % 64 for c in t.lower()]), minlength=64).float()
                            for t in texts])
    chunk, q = fake_chunk(DOC), "Zorblat keeps 417 maps in the tower?"
    vectors = embed([DOC[a:b] for a, b in selection.sentence_spans(DOC)]).numpy()
    calls.clear()
    want = selection.retriever_spans(embed, [chunk, chunk], [DOC, DOC], q, 12)
    assert len(calls[-1]) == 1 + 2 * len(vectors)
    assert selection.retriever_spans(embed, [chunk, chunk], [DOC, DOC], q, 12,
                                     sentence_vectors=[vectors, vectors]) == want
    assert calls[-1] == [q]
    assert selection.retriever_spans(embed, [chunk, chunk], [DOC, DOC], q, 12,
                                     sentence_vectors=[vectors, vectors[:1]]) == want  # a stale entry is re-embedded
    assert len(calls[-1]) == 1 + len(vectors)


def test_the_best_sentence_is_taken_whole_when_the_budget_is_smaller():
    """A budget below one sentence (20% of a short context) still recomputes the best sentence whole:
    its first tokens alone would cut an answer at the sentence's end in half."""
    def embed(texts):
        return torch.stack([torch.bincount(torch.tensor([ord(c) % 64 for c in t.lower()]), minlength=64).float()
                            for t in texts])
    chunk = fake_chunk(DOC)
    best = selection.sentence_spans(DOC)[1]  # "Zorblat keeps 417 maps in the tower." (7 words)
    assert selection.retriever_spans(embed, [chunk], [DOC], "Zorblat keeps 417 maps in the tower?", 3) == [[best]]
    # Past the best sentence the budget still binds: the next one is cut to what is left.
    spans = selection.retriever_spans(embed, [chunk], [DOC], "Zorblat keeps 417 maps in the tower?", 9)
    assert spans[0][-1] == best or spans[0][0] == best
    taken = selection.spans_to_positions([chunk], spans, n_prefix=0)
    assert taken.numel() == 9


def test_source_guided_end_to_end_on_a_tiny_model(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(DOC), tiny.prefill("Another chunk of text here. It says little.")]
    texts = [DOC, "Another chunk of text here. It says little."]
    budget = 8
    spans = selection.source_guided_spans(asm, chunks, chunks, texts, "How many maps?", budget)
    pos = selection.spans_to_positions(chunks, spans, asm.prefix_ids.numel())
    longest = max(len(idx) for c, t in zip(chunks, texts)
                  for idx in selection._token_sentences(c, selection.sentence_spans(t)))
    assert 0 < pos.numel() <= max(budget, longest)  # the budget, or the best sentence whole
    placed = asm.place(chunks, recompute_select="source", positions=pos)
    assert placed.recomputed_tokens == pos.numel()


OTHER = "The harbour is quiet. Boats leave at dawn. Nobody counts them."


def test_source_chunk_selector_takes_the_planted_chunk_whole():
    chunk, other = fake_chunk(DOC), fake_chunk(OTHER)
    second = selection.sentence_spans(DOC)[1]
    planted = torch.tensor([j for j, (s, e) in enumerate(chunk.offsets.tolist()) if s >= second[0] and e <= second[1]])
    fake = FakeAssembler(chunk, planted)  # recency bias points at `other`, placed last
    spans = selection.source_guided_chunks(fake, [chunk, other], [chunk, other], [DOC, OTHER], "How many maps?",
                                           budget_tokens=1)  # below one chunk: the best one is still taken
    assert spans == [[(0, len(DOC))], []]
    pos = selection.spans_to_positions([chunk, other], spans, n_prefix=2)
    assert pos.tolist() == list(range(2, 2 + chunk.num_tokens))


def test_whole_chunks_fill_the_budget_best_first_and_stop_at_the_first_misfit():
    chunks = [fake_chunk(DOC), fake_chunk(OTHER), fake_chunk("Short one.")]
    sizes = [c.num_tokens for c in chunks]
    texts = [DOC, OTHER, "Short one."]
    got = selection.retriever_chunks([0.2, 0.9, 0.5], chunks, texts, budget_tokens=sizes[1] + sizes[2])
    assert got == [[], [(0, len(OTHER))], [(0, len("Short one."))]]
    got = selection.retriever_chunks([0.2, 0.9, 0.5], chunks, texts, budget_tokens=sizes[1] + sizes[2] - 1)
    assert got == [[], [(0, len(OTHER))], []]


def test_source_chunk_end_to_end_on_a_tiny_model(tiny):
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    texts = [DOC, "Another chunk of text here. It says little."]
    chunks = [tiny.prefill(t) for t in texts]
    spans = selection.source_guided_chunks(asm, chunks, chunks, texts, "How many maps?", budget_tokens=1)
    pos = selection.spans_to_positions(chunks, spans, asm.prefix_ids.numel())
    assert pos.numel() in (chunks[0].num_tokens, chunks[1].num_tokens)  # exactly one whole chunk
    placed = asm.place(chunks, recompute_select="source_chunk", positions=pos)
    assert placed.recomputed_tokens == pos.numel()


def test_retrieval_heads_run_only_the_layers_up_to_the_deepest(tiny):
    """With heads given, the source forward stops after their deepest layer: the same scores, fewer layers."""
    asm = Assembler(tiny, layout_for(tiny.tokenizer))
    chunks = [tiny.prefill(DOC), tiny.prefill(OTHER)]
    every = selection.contrastive_attention(asm, chunks, "How many maps?", per_head=True)
    heads = [(0, 1), (0, 0)]
    layers_run = []
    hook = tiny.model.model.layers[1].register_forward_hook(lambda *a: layers_run.append(1))
    try:
        got = selection.contrastive_attention(asm, chunks, "How many maps?", heads=heads)
    finally:
        hook.remove()
    assert layers_run == []  # layer 1 never ran: only layer 0 holds a chosen head
    torch.testing.assert_close(got, every[[0, 0], [1, 0]].mean(dim=0))


def test_rank_fusion_prefers_what_both_choices_rank_high_and_ignores_their_scales():
    source = [[0.9, 0.5, 0.1], [0.2]]  # attention contrasts
    retriever = [[10.0, 40.0, 30.0], [20.0]]  # another scale entirely: only the order counts
    fused = selection.fused_sentence_scores(source, retriever)
    flat = {(c, s): v for c, row in enumerate(fused) for s, v in enumerate(row)}
    assert max(flat, key=flat.get) == (0, 1)  # 2nd for the source, 1st for the retriever
    assert flat[(0, 0)] > flat[(1, 0)]  # 1st and 4th beats 4th and 3rd
    k = selection.RRF_K
    assert flat[(0, 1)] == pytest.approx(1 / (k + 2) + 1 / (k + 1))
    assert selection.fused_sentence_scores([[3.0, 1.0]]) == [[1 / (k + 1), 1 / (k + 2)]]
    with pytest.raises(ValueError):
        selection.fused_sentence_scores([[1.0, 2.0]], [[1.0]])


def test_source_retriever_spans_take_the_sentence_both_point_at():
    """The source's planted sentence and the retriever's best differ; the fused choice takes the one
    the other also ranks second over the ones only one of them likes."""
    chunk = fake_chunk(DOC)
    spans = selection.sentence_spans(DOC)
    inside = lambda span: torch.tensor([j for j, (s, e) in enumerate(chunk.offsets.tolist())  # noqa: E731
                                        if s >= span[0] and e <= span[1]])
    fake = FakeAssembler(chunk, inside(spans[1]))
    source_only = selection.source_guided_spans(fake, [chunk], [chunk], [DOC], "How many maps?", budget_tokens=7)
    assert source_only == [[spans[1]]]
    sentences = [DOC[a:b] for a, b in spans]

    def embed(texts):  # the question is most like sentence 3, then 1, 2 and 0
        out = []
        for t in texts:
            v = torch.zeros(len(sentences))
            if t in sentences:
                v[sentences.index(t)] = 1.0
            else:  # the question
                v[:] = torch.tensor([0.1, 0.8, 0.3, 1.0])
            out.append(v + 0.05)
        return torch.stack(out)
    assert selection.retriever_spans(embed, [chunk], [DOC], "How many maps?", 6) == [[spans[3]]]
    fused = selection.source_retriever_spans(fake, [chunk], [chunk], [DOC], "How many maps?", 7, embed)
    assert fused == [[spans[1]]]  # 1st for the source and 2nd for the retriever beats 4th and 1st
    assert selection.source_retriever_spans(fake, [chunk], [chunk], [""], "q?", 7, embed) == [[]]


def test_focus_keeps_every_chunk_that_fits_and_otherwise_the_closest_ones_in_their_order():
    calls = []

    def embed(texts):  # one dimension per keyword (and a constant, so no vector is zero)
        calls.append(list(texts))
        return torch.tensor([[t.lower().count(w) for w in ("zorblat", "harbour", "short")] + [0.01] for t in texts],
                            dtype=torch.float32)
    texts, q = [OTHER, DOC, "Short one."], "Where does Zorblat keep maps?"
    sizes = [30, 40, 5]
    assert selection.focus(embed, texts, sizes, q, budget_tokens=75) == [0, 1, 2] and not calls  # fits: no embedding
    assert selection.focus(embed, texts, sizes, q, budget_tokens=74) == [0, 1]  # DOC, then the tie in given order
    assert selection.focus(embed, texts, sizes, q, budget_tokens=45) == [1]     # stops at the first misfit
    assert selection.focus(embed, texts, sizes, q, budget_tokens=10) == [1]     # the best one always
    assert selection.best_within([30, 40, 5], [0.1, 0.9, 0.5], 70) == [1, 2]


def test_the_focus_budget_is_the_targets_calibrated_one_and_every_chunk_elsewhere(tmp_path):
    import json

    entries = json.loads(selection.FOCUS_FILE.read_text())
    assert {e["model"]: e["tokens"] for e in entries.values()} == {"qwen2.5-0.5b": 1024, "gemma3-270m": 0}
    assert all(selection.focus_tokens(fp) == e["tokens"] for fp, e in entries.items())
    assert selection.focus_tokens("0" * 20) == 0                              # never calibrated: every chunk
    own = tmp_path / "focus.json"
    own.write_text(json.dumps({"abc": {"tokens": 300}}))
    assert selection.focus_tokens("abc", own) == 300


def test_best_sentences_are_the_k_best_scored_over_every_chunk():
    from stores.chunker import sentence_spans

    texts = [OTHER, DOC]
    scores = [[0.1, 0.7, 0.2], [0.3, 0.9, 0.0, 0.5]]
    other, doc = sentence_spans(OTHER), sentence_spans(DOC)
    assert selection.best_sentences(texts, scores, 1) == [[], [doc[1]]]
    assert selection.best_sentences(texts, scores, 2) == [[other[1]], [doc[1]]]
    assert selection.best_sentences(texts, scores, 3) == [[other[1]], [doc[1], doc[3]]]  # in their order
    assert selection.best_sentences(texts, scores, 99) == [other, doc]
    assert selection.best_sentences(texts, scores, 0) == [[], []]


def test_a_best_sentence_is_read_whole_across_line_wraps():
    from stores.chunker import sentence_spans

    text = ("Notice\nanything missing?  Google was founded that year. We paid via a company called\n"
            "Cybercash,\nsince we had to.\n\nA new paragraph\nstarts here.")
    spans = sentence_spans(text)
    pieces = [text[s:e] for s, e in spans]
    assert pieces[:5] == ["Notice", "anything missing?", "Google was founded that year.",
                          "We paid via a company called", "Cybercash,"]   # the index's sentences end at lines
    whole = [text[slice(*selection.wrapped_sentence(text, spans, i))] for i in range(len(spans))]
    assert whole[0] == whole[1] == "Notice\nanything missing?"
    assert whole[2] == "Google was founded that year."                    # ends at its full stop
    assert whole[3] == whole[4] == whole[5] == "We paid via a company called\nCybercash,\nsince we had to."
    assert whole[6] == whole[7] == "A new paragraph\nstarts here."      # a blank line ends a paragraph
    scores = [[0.0, 0.0, 0.1, 0.9, 0.2, 0.0, 0.0, 0.0]]
    assert selection.best_sentences([text], scores, 1) == [[spans[3]]]
    assert selection.best_sentences([text], scores, 1, wrapped=True) == [[(spans[3][0], spans[5][1])]]
