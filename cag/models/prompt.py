"""How a question and its context are laid out for one model.

A prompt is three parts: a **head** (the chat template's opening up to where the
context goes: system turn, user turn opening, the instruction), the **context**
(the retrieved chunks), and a **tail** (the question and the rest of the
template, up to where the answer starts). The head does not depend on the
question, so its cache is computed once per model and shared: it holds the
attention sink for every chunk placed after it.

Chunks are *prefilled* after the same head (`head_ids`), whose states are then
dropped (APE's shared prefix). A chunk computed after bare BOS never saw the
instruction or the chat framing it is later read under; prefilled after the head
it reads as the first chunk of the real prompt does, and the first chunk placed
right behind the head equals the joint prefill exactly. This lives in the ground
(`cag.models`) because `LoadedModel.prefill` needs it.

Models with a chat template get it rendered once with placeholders and split at
them, so the layout is the model's own; base models without one get a plain
"context, question, answer" layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CONTEXT = "\x00CAG_CONTEXT\x00"
_QUESTION = "\x00CAG_QUESTION\x00"

INSTRUCTION = "Answer the question using the context. Reply with a short answer only.\n\nContext:\n"
QUESTION_LINE = "\n\nQuestion: {question}"
PLAIN_TAIL = "\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class PromptLayout:
    head: str
    tail_template: str  # contains "{question}"
    chat: bool

    def tail(self, question: str) -> str:
        return self.tail_template.replace("{question}", question.strip())


def layout_for(tokenizer, system_prompt: str | None = None) -> PromptLayout:
    """The layout of `tokenizer`'s chat template, or the plain one without a template."""
    if getattr(tokenizer, "chat_template", None):
        messages = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": INSTRUCTION + _CONTEXT + QUESTION_LINE.format(question=_QUESTION)})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, rest = rendered.split(_CONTEXT)
        return PromptLayout(head=head, tail_template=rest.replace(_QUESTION, "{question}"), chat=True)
    head = (system_prompt.strip() + "\n\n") if system_prompt else ""
    return PromptLayout(head=head, tail_template=PLAIN_TAIL, chat=False)


def head_ids(tokenizer, layout: PromptLayout) -> torch.Tensor:
    """The token ids of `layout`'s head, starting with the attention sink.

    A chat template renders its own first token (Gemma's ``<bos>``, ChatML's
    ``<|im_start|>``); a plain layout gets the tokenizer's BOS in front. A
    head-less layout is the BOS alone. Empty only for a model with neither.
    """
    ids = (tokenizer(layout.head, add_special_tokens=False)["input_ids"] if layout.head else [])
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    if not ids:
        ids = bos
    elif bos and ids[: len(bos)] != bos and not layout.chat:
        ids = bos + list(ids)
    return torch.tensor(ids, dtype=torch.long)
