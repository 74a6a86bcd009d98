"""Chunks prefilled after the shared prompt head (#12): exact for the first chunk, recorded, never mixed."""

import copy

import pytest
import torch

from cag.assembler import Assembler
from cag.models.loaded import LoadedModel, prefix_ids_for
from cag.models.prompt import head_ids, layout_for
from tests.tiny import tiny_model

CHAT = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
TEXT = "Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris."
QUESTION = "How many maps does Zorblat keep?"


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def chat_lm(request):
    """A tiny model whose tokenizer has a chat template, so the head is more than BOS."""
    model, tok = tiny_model(request.param)
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT
    return LoadedModel.from_pretrained(model, tok, name=f"tiny-chat-{request.param}")


def test_default_prefix_is_the_prompt_head(chat_lm):
    layout = layout_for(chat_lm.tokenizer)
    assert "Answer the question" in layout.head
    want = head_ids(chat_lm.tokenizer, layout)
    assert chat_lm.sink_ids == want.tolist() and len(want) > 10
    assert chat_lm.prefill_prefix == "head"
    chunk = chat_lm.prefill(TEXT)
    assert chunk.settings["prefill_prefix"] == "head" and chunk.settings["sink_ids"] == want.tolist()


def test_first_chunk_after_head_equals_joint_prefill(chat_lm):
    """The first chunk, prefilled after the head and placed right behind it, is the joint prefill."""
    asm = Assembler(chat_lm, layout_for(chat_lm.tokenizer))
    assert asm.prefix_ids.tolist() == chat_lm.sink_ids
    chunk = chat_lm.prefill(TEXT)
    q = asm.question_ids(QUESTION)
    placed = asm.place([chunk])
    with torch.inference_mode():
        got = chat_lm.model(input_ids=q[None], past_key_values=placed.cache).logits[0]
        ids = torch.cat([asm.prefix_ids, chunk.token_ids, q])
        want = chat_lm.model(input_ids=ids[None]).logits[0, -q.numel():]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_bare_bos_prefix_differs_and_is_recorded(chat_lm):
    bos = chat_lm.with_prefill_prefix("bos")
    assert bos.sink_ids == [chat_lm.tokenizer.bos_token_id] and bos.prefill_prefix == "bos"
    a, b = chat_lm.prefill(TEXT), bos.prefill(TEXT)
    assert b.settings["prefill_prefix"] == "bos"
    assert not torch.allclose(a.values[-1].float(), b.values[-1].float(), atol=1e-3)


def test_unknown_prefix_is_refused(chat_lm):
    with pytest.raises(ValueError, match="prefill_prefix"):
        prefix_ids_for(chat_lm.tokenizer, "system")
