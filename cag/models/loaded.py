"""A loaded model with what `cag` needs around it: text → `KVChunk` → cache.

`LoadedModel` is the one object the rest of `cag` passes around for a model: the
transformers model and tokenizer, its family adapter, its fingerprint, and the
attention-sink prefix its chunks are prefilled after.

The attention sink and the shared head: models put a large share of attention
on the first token of a sequence. A chunk prefilled on its own would make its
first real token that sink; instead every chunk is prefilled after a prefix
whose own states are dropped. By default (``prefill_prefix="head"``) that prefix
is the model's whole prompt head (`cag.models.prompt`: chat opening and the
instruction, exactly what the assembler places in front of the context at query
time), so a chunk reads as part of the real prompt (APE's shared prefix);
``"bos"`` is the older bare-BOS prefix, kept to read stores built with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from cag.kv import ForeignModelError, KVChunk, ModelFingerprint, text_sha256
from cag.models.adapters import FamilyAdapter, adapter_for, concat_tokens
from cag.models.attention import use_gqa_sdpa
from cag.models.fingerprint import fingerprint, state_dict_hash
from cag.models.prompt import head_ids, layout_for

PREFILL_PREFIXES = ("head", "bos")


class _StopForward(Exception):
    """Raised by a hook to end a forward once the last wanted layer has run."""


class EmptyChunkError(ValueError):
    """A text that tokenizes to nothing cannot be a chunk."""


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: Any
    adapter: FamilyAdapter
    fingerprint: ModelFingerprint
    sink_ids: list[int] = field(default_factory=list)
    prefill_prefix: str = "head"  # what `sink_ids` is: the prompt head, the bare BOS, or "custom"

    @classmethod
    def from_pretrained(cls, model: PreTrainedModel, tokenizer, *, name: str,
                        weights_hash: str | None = None,
                        sink_ids: Sequence[int] | None = None,
                        prefill_prefix: str = "head") -> "LoadedModel":
        """Wrap a transformers model and its (fast) tokenizer.

        `weights_hash`: a hash of the weight files when the caller has one (the
        registry records the GGUF's SHA-256); otherwise the state dict is hashed.
        `prefill_prefix`: what chunks are prefilled after, ``"head"`` (the prompt
        head of `layout_for(tokenizer)`) or ``"bos"``; `sink_ids` overrides both.
        """
        model.eval()
        use_gqa_sdpa(model)  # grouped K/V heads read in place under a mask (cag.models.attention)
        adapter = adapter_for(model)
        if sink_ids is None:
            sink_ids = prefix_ids_for(tokenizer, prefill_prefix).tolist()
        else:
            prefill_prefix = "custom"
        fp = fingerprint(
            model, tokenizer, family=adapter.family,
            geometry=(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim),
            weights_hash=weights_hash or state_dict_hash(model), name=name,
        )
        return cls(name=name, model=model, tokenizer=tokenizer, adapter=adapter,
                   fingerprint=fp, sink_ids=list(sink_ids), prefill_prefix=prefill_prefix)

    def with_prefill_prefix(self, prefill_prefix: str) -> "LoadedModel":
        """The same model (shared weights) prefilling chunks after another prefix."""
        return LoadedModel(self.name, self.model, self.tokenizer, self.adapter, self.fingerprint,
                           prefix_ids_for(self.tokenizer, prefill_prefix).tolist(), prefill_prefix)

    def chunk_settings(self) -> dict[str, Any]:
        """What this model's chunks depend on besides their text (recorded in each chunk)."""
        return {"sink_ids": list(self.sink_ids), "prefill_prefix": self.prefill_prefix}

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ----------------------------------------------------------- text → chunk

    def tokenize(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and character offsets of `text`, no special tokens added."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(enc["input_ids"], dtype=torch.long)
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
        return ids, offsets

    def prefill(self, text: str, *, settings: dict[str, Any] | None = None) -> KVChunk:
        """Prefill `text` after the sink prefix into a position-free `KVChunk`."""
        ids, offsets = self.tokenize(text)
        if ids.numel() == 0:
            raise EmptyChunkError("text tokenizes to no tokens; an empty chunk has no cache")
        return self.prefill_tokens(ids, offsets=offsets, text_hash=text_sha256(text),
                                   settings=settings)

    @torch.inference_mode()
    def prefill_batch(self, texts: Sequence[str], *, settings: dict[str, Any] | None = None) -> list[KVChunk]:
        """Prefill several texts in one forward; equal to `prefill` on each, up to rounding.

        Sequences are right-padded: a causal model never lets a real token see
        the padding after it, and positions still start at 0 for every row, so
        each row's states are those of its own prefill.
        """
        if len(texts) == 1:
            return [self.prefill(texts[0], settings=settings)]
        encoded = [self.tokenize(t) for t in texts]
        for (ids, _), text in zip(encoded, texts):
            if ids.numel() == 0:
                raise EmptyChunkError(f"text {text[:40]!r} tokenizes to no tokens")
        sink = torch.tensor(self.sink_ids, dtype=torch.long)
        rows = [torch.cat([sink, ids]) for ids, _ in encoded]
        width = max(r.numel() for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            batch[i, : r.numel()] = r
            mask[i, : r.numel()] = 1
        cache = DynamicCache()
        self.forward_for_cache(cache, input_ids=batch.to(self.device), attention_mask=mask.to(self.device))
        layers = cache.layers
        all_keys = torch.stack([layer.keys for layer in layers], dim=1)  # [batch, layers, heads, tokens, dim]
        all_values = torch.stack([layer.values for layer in layers], dim=1)
        n_sink = sink.numel()
        return [self._chunk_from_states(all_keys[i, :, :, : n_sink + ids.numel()],
                                        all_values[i, :, :, : n_sink + ids.numel()], n_sink, ids, offsets,
                                        text_sha256(text), list(self.sink_ids), settings)
                for i, ((ids, offsets), text) in enumerate(zip(encoded, texts))]

    def prefix_chunk(self) -> KVChunk:
        """The shared sink prefix itself as a chunk (placed once, at position 0)."""
        if not self.sink_ids:
            raise EmptyChunkError(f"{self.name} has no sink prefix")
        ids = torch.tensor(self.sink_ids, dtype=torch.long)
        return self.prefill_tokens(ids, sink_ids=[], text_hash=text_sha256(""),
                                   settings={"role": "prefix"})

    @torch.inference_mode()
    def prefill_tokens(self, ids: torch.Tensor, *, offsets: torch.Tensor | None = None,
                       text_hash: str, sink_ids: Sequence[int] | None = None,
                       settings: dict[str, Any] | None = None) -> KVChunk:
        sink = list(self.sink_ids if sink_ids is None else sink_ids)
        full = torch.cat([torch.tensor(sink, dtype=torch.long), ids.to(torch.long)])
        # A config-less DynamicCache keeps every token in every layer: the model
        # still masks its sliding layers by the window, but nothing is evicted
        # from the cache, so a chunk longer than the window is stored whole.
        cache = DynamicCache()
        self.forward_for_cache(cache, input_ids=full[None].to(self.device))
        keys, values = self.adapter.cache_tensors(cache)
        if offsets is None:
            offsets = torch.zeros(ids.numel(), 2, dtype=torch.long)
        return self._chunk_from_states(keys, values, len(sink), ids.to(torch.long), offsets, text_hash,
                                       sink, settings)

    def _chunk_from_states(self, keys: torch.Tensor, values: torch.Tensor, n_sink: int, ids: torch.Tensor,
                           offsets: torch.Tensor, text_hash: str, sink: list[int],
                           settings: dict[str, Any] | None) -> KVChunk:
        """Sink + chunk states ``[layers, heads, n_sink + tokens, dim]`` → the chunk's own, de-rotated."""
        total = keys.shape[2]
        keys = self.adapter.derotate(keys[:, :, n_sink:], torch.arange(n_sink, total))
        return KVChunk(keys.contiguous(), values[:, :, n_sink:].contiguous(), ids, offsets, text_hash,
                       self.fingerprint, {"sink_ids": sink, "prefill_prefix": self.prefill_prefix
                                          if sink == self.sink_ids else "custom", **(settings or {})})

    @torch.inference_mode()
    def first_layers_cache(self, ids: torch.Tensor, num_layers: int) -> DynamicCache:
        """The model's own cache of `ids` (no sink added) for layers ``0..num_layers-1`` only.

        The forward is cut once layer ``num_layers - 1`` has written its keys and values
        (`forward_first_layers`), so it costs about ``num_layers / L`` of a prefill. Every
        token is kept in every layer.
        """
        cache = DynamicCache()
        self.forward_first_layers(num_layers, input_ids=ids[None].to(self.device), past_key_values=cache,
                                  use_cache=True)
        return cache

    def forward_first_layers(self, num_layers: int, **forward_kwargs) -> None:
        """Run the decoder over ``forward_kwargs`` through layer ``num_layers-1``'s attention only.

        For callers that need what the first layers leave behind (their cache, their
        captured attention), not an output. The forward is cut by a hook just before
        the MLP of layer ``num_layers-1``: by then that layer's keys and values are in
        the cache and its attention has run, and nothing after it (its MLP, later
        layers, the final norm, the LM head) feeds either. It costs about
        ``num_layers / L`` of the full forward, less that last MLP."""
        if not 1 <= num_layers <= self.adapter.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.adapter.num_layers}], got {num_layers}")

        def stop(*_):
            raise _StopForward

        layer = self.model.model.layers[num_layers - 1]
        mlp = getattr(layer, "mlp", None)
        # Every family this loads has an `mlp` called after attention; any other is cut after the layer.
        handle = mlp.register_forward_pre_hook(stop) if mlp is not None else layer.register_forward_hook(stop)
        try:
            self.model.model(**forward_kwargs)
        except _StopForward:
            pass
        finally:
            handle.remove()

    def forward_for_cache(self, cache: DynamicCache, **forward_kwargs) -> None:
        """Run the decoder over ``forward_kwargs`` for the keys and values it writes into `cache`.

        A forward whose only product is a cache (a chunk's prefill, a recompute) needs
        no LM head, and its last layer's MLP feeds nothing a cache holds: both are
        skipped (`forward_first_layers` over every layer). For a 256-token chunk that is
        the head's logits over the whole vocabulary (more than the rest of the forward
        for Gemma-3's 262k-token vocabulary) and one layer's MLP.
        """
        last = self.adapter.num_layers - 1
        before = cache.get_seq_length(last)
        self.forward_first_layers(self.adapter.num_layers, past_key_values=cache, use_cache=True, **forward_kwargs)
        if cache.get_seq_length(last) <= before:  # a model that writes its cache after the MLP hook fired
            raise RuntimeError(f"{self.name}: the cache-only forward stopped before the last layer wrote its K/V")

    # ---------------------------------------------------------- chunk → cache

    def check_chunk(self, chunk: KVChunk, layers: int | None = None) -> None:
        """Refuse a chunk of another model, or one that lacks layers: a partial chunk
        (`KVChunk.first_layers`) serves only a forward of at most that many `layers`."""
        if chunk.model.id != self.fingerprint.id:
            raise ForeignModelError(
                f"chunk was computed by {chunk.model.describe()}, "
                f"not by {self.fingerprint.describe()}; translate it with a mapper first"
            )
        if chunk.partial and (layers is None or layers > chunk.first_layers):
            raise ValueError(f"this chunk holds only the first {chunk.first_layers} of {self.name}'s layers; "
                             f"this use needs {layers or self.adapter.num_layers}")

    def build_cache(self, chunks: Sequence[KVChunk]) -> DynamicCache:
        """A transformers cache holding `chunks` back to back from position 0.

        Keys are re-rotated at their new positions. Pass the result as
        ``past_key_values=`` to ``model(...)`` or ``model.generate(...)`` together
        with the tokens that follow it; `context_ids(chunks)` gives the ids the
        cache stands for (``generate`` wants them in front of the new tokens).
        """
        if not chunks:
            raise ValueError("no chunks to place")
        for chunk in chunks:
            self.check_chunk(chunk)
        total = sum(c.num_tokens for c in chunks)
        self.adapter.check_placement(total)
        keys = concat_tokens([c.keys for c in chunks], self.dtype)
        values = concat_tokens([c.values for c in chunks], self.dtype)
        # transformers derives every later position from the cache's length, so
        # the cache covers positions 0..total-1: the shared prefix chunk goes first.
        self.adapter.rotate(keys, torch.arange(total), out=keys)
        return self.adapter.fill_cache(keys, values)

    @staticmethod
    def context_ids(chunks: Sequence[KVChunk]) -> torch.Tensor:
        return torch.cat([c.token_ids for c in chunks])


def prefix_ids_for(tokenizer, prefill_prefix: str) -> torch.Tensor:
    """The ids chunks are prefilled after: the default prompt head, or bare BOS."""
    if prefill_prefix == "head":
        return head_ids(tokenizer, layout_for(tokenizer))
    if prefill_prefix == "bos":
        bos = tokenizer.bos_token_id
        return torch.tensor([bos] if bos is not None else [], dtype=torch.long)
    raise ValueError(f"prefill_prefix must be one of {PREFILL_PREFIXES}, got {prefill_prefix!r}")
