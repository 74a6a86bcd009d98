"""Fixtures for the mapper tests: tiny models, one of them with a second tokenizer."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

from cag.models.loaded import LoadedModel
from tests.tiny import _CORPUS, TINY_SLIDING_WINDOW, _sharpen, tiny_loaded

# Calibration texts: varied enough that tiny maps have something to fit.
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "A stitch in time saves nine, and the archivist keeps maps of every tower.",
    "Cache-augmented generation reuses keys and values computed for documents.",
    "Zorblat wrote 417 letters to Idris about the tower of Velmora in 2026.",
    "Numbers like 3.14159 appear in text; so do émigrés, naïve cafés and 日本.",
    "Paragraphs end with blank lines.\n\nNew paragraphs begin after them, slowly.",
    "The lazy dog sleeps while the brown fox runs across the quiet field.",
    "Keys and values of every layer are stored without position for reuse.",
    "Velmora's tower holds maps, letters and the archivist's small red book.",
    "In time the river floods the bank, and the fox moves its den uphill.",
    "Generation with a cache avoids prefilling the same document twice.",
    "Idris answered Zorblat in a letter dated 2026-12-01, quite briefly.",
]


@lru_cache(maxsize=1)
def other_tokenizer() -> PreTrainedTokenizerFast:
    """A second byte-level BPE: prefix space, smaller vocab, other merges than tests.tiny's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(reversed(_CORPUS)) * 3 + TEXTS[:4], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


@lru_cache(maxsize=1)
def gemma_other() -> LoadedModel:
    tokenizer = other_tokenizer()
    torch.manual_seed(7)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_attention_heads=4,
        head_dim=16, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        num_hidden_layers=4, num_key_value_heads=1, sliding_window=TINY_SLIDING_WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    model = Gemma3ForCausalLM(config)
    _sharpen(model)
    # tests.tiny's gemma3 has saturated (one-hot) logits through its tied unit-scale
    # embeddings, which makes KL/top-1 vacuous; soften them via the final norm (1 + w).
    with torch.no_grad():
        model.model.norm.weight.fill_(-0.95)
    return LoadedModel.from_pretrained(model.eval(), tokenizer, name="tiny-gemma3-othertok")


@pytest.fixture(scope="session")
def llama() -> LoadedModel:
    return tiny_loaded("llama")


@pytest.fixture(scope="session")
def qwen() -> LoadedModel:
    return tiny_loaded("qwen2")


@pytest.fixture(scope="session")
def gemma2tok() -> LoadedModel:
    return gemma_other()


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return list(TEXTS)
