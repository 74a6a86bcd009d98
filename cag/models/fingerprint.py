"""Fingerprints: what a KV cache depends on, hashed.

A cache is only valid for the exact architecture, tokenizer and weights that
produced it. Each of the three gets its own hash so that an error can say which
one differs (a retokenised model is a different failure from a re-trained one).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from cag.kv import ModelFingerprint

# Config fields that describe how a model is run, not what it computes.
_RUNTIME_CONFIG_KEYS = {
    "_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype",
    "_attn_implementation", "_attn_implementation_autoset", "_experts_implementation",
    "use_cache", "return_dict", "output_hidden_states", "output_attentions",
    "quantization_config", "architectures", "_model_name_or_path",
}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))


def config_hash(config) -> str:
    data = {k: v for k, v in config.to_dict().items() if k not in _RUNTIME_CONFIG_KEYS}
    return hashlib.sha256(_canonical(data).encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """Hash of the tokenization itself: the fast tokenizer's full JSON plus special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"cag needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
    h = hashlib.sha256(backend.to_str().encode())
    h.update(_canonical(tokenizer.special_tokens_map).encode())
    return h.hexdigest()


def state_dict_hash(model: torch.nn.Module) -> str:
    """Hash of every parameter and buffer, for models that have no file to hash (tests, in-process)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(model, tokenizer, *, family: str, geometry: tuple[int, int, int],
                weights_hash: str, name: str = "") -> ModelFingerprint:
    num_layers, num_kv_heads, head_dim = geometry
    return ModelFingerprint(
        family=family,
        config_hash=config_hash(model.config),
        tokenizer_hash=tokenizer_hash(tokenizer),
        weights_hash=weights_hash,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        name=name,
    )
