"""Tiny randomly initialised models of every supported family, built in-process.

They are small enough that a test builds one in milliseconds, and exact: the
same seed gives the same weights on every machine. The tokenizer is a byte-level
BPE trained on a few sentences, so offsets behave as in the real models.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

from cag.models.loaded import LoadedModel

FAMILIES = ("llama", "qwen2", "gemma3")
TINY_SLIDING_WINDOW = 8  # shorter than every test context, so window eviction is exercised

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "Cache-augmented generation reuses the keys and values of documents.",
    "Zorblat the archivist keeps 417 maps in the tower of Velmora, wrote Idris.",
    "Numbers like 3.14159 and dates like 2026-12-01 appear in text; so do émigrés and 日本.",
    "Paragraphs end with blank lines.\n\nNew paragraphs begin after them.",
]


@lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")


def _common(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)


def tiny_model(family: str, seed: int = 0):
    """A random (model, tokenizer) pair of `family`, fp32, eval mode."""
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(**_common(vocab), num_hidden_layers=3, num_key_value_heads=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
        model = LlamaForCausalLM(config)
    elif family == "qwen2":
        config = Qwen2Config(**_common(vocab), num_hidden_layers=3, num_key_value_heads=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        model = Qwen2ForCausalLM(config)
    elif family == "gemma3":
        config = Gemma3TextConfig(
            **_common(vocab), num_hidden_layers=4, num_key_value_heads=1,
            sliding_window=TINY_SLIDING_WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(f"unknown family {family!r}")
    _sharpen(model)
    return model.eval(), tokenizer


@torch.no_grad()
def _sharpen(model) -> None:
    """Re-draw weights at unit scale: the default 0.02 init gives near-uniform
    attention and logits, under which almost any cache bug would go unseen."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0.0, 1.0 / p.shape[1] ** 0.5 if "embed" not in name else 1.0)
        elif "bias" in name:
            p.normal_(0.0, 0.5)


def tiny_loaded(family: str, seed: int = 0) -> LoadedModel:
    model, tokenizer = tiny_model(family, seed)
    return LoadedModel.from_pretrained(model, tokenizer, name=f"tiny-{family}")
