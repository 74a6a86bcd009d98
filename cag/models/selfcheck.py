"""Start-up self-check: prove on the loaded model that `cag`'s cache handling is exact.

Everything `cag` does rests on two claims about a model: keys can be stripped of
their position and given a new one, and a cache built from stored tensors makes
the model continue exactly as if it had read the text. Both are checked when a
model is first loaded in a process (and by ``cag models verify``); a model that
fails is refused, in the spirit of LMCache's RoPE check at start-up.

The checks, all in fp32:

1. ``rotation_identity``: ``rotate(derotate(k)) == k`` on random keys at random
   positions up to the model's context length (max abs diff, fp32 rounding).
2. ``native_cache``: the model prefills a context (longer than its sliding window,
   where it has one), then reads a continuation against that cache; the logits
   equal a single full forward over context + continuation (≤ 1e-4).
3. ``chunk_roundtrip``: the same cache taken apart into a `KVChunk` (keys
   de-rotated), serialised in fp32, decoded, re-rotated at the same positions and
   rebuilt: the continuation's logits stay within 1e-3 of the full forward.
4. ``offset_keys``: a chunk prefilled at positions 0.. and re-rotated to an offset
   equals, relative to its size, the keys the model computes when the same tokens
   sit at that offset (RoPE makes attention depend on relative position only, so
   this is exact up to rounding; the figure is reported and held to 1e-3).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from cag.kv import KVChunk, text_sha256

# Thresholds of the design's invariants (fp32).
NATIVE_TOLERANCE = 1e-4
ROUNDTRIP_TOLERANCE = 1e-3
ROTATION_TOLERANCE = 1e-4
OFFSET_TOLERANCE = 1e-3

CONTINUATION_TOKENS = 8
OFFSET = 1000

# Original prose, so the check needs no data package. It is repeated as needed
# to pass a model's sliding window.
CHECK_TEXT = (
    "The lighthouse keeper of Vessel Point kept a ledger of every ship that passed. "
    "In the spring of the long drought she counted forty-one schooners, nine steamers "
    "and a single barge loaded with copper bells, which rang all night as it drifted "
    "past the reef. The harbour master did not believe her, so she wrote the numbers "
    "twice, once in ink and once in pencil, and sealed the second copy in a jar. "
    "Years later, when the archive burned, the jar was the only record left, and the "
    "town learned that the barge had belonged to a foundry that no map remembers. "
    "Children still climb the stairs to read her handwriting on the wall, where she "
    "copied the tide tables every evening, adding a note about the weather, the gulls "
    "and the colour of the sea at dusk. "
)


class SelfCheckFailed(RuntimeError):
    """The model failed the self-check; `cag` refuses to use it."""

    def __init__(self, report: "SelfCheckReport") -> None:
        self.report = report
        super().__init__(
            f"self-check failed for {report.model}: " + "; ".join(report.failures)
            + ". cag refuses this model: its caches would not reproduce its own forward."
        )


@dataclass
class SelfCheckReport:
    model: str
    family: str
    context_tokens: int
    rotation_max_abs: float
    native_max_abs: float
    roundtrip_max_abs: float
    offset_max_rel: float
    seconds: float
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def _check_ids(loaded) -> torch.Tensor:
    """Sink prefix + check text, long enough to pass the sliding window."""
    window = loaded.adapter.sliding_window if "sliding_attention" in loaded.adapter.layer_types else 0
    want = max(200, window + 64) + CONTINUATION_TOKENS
    ids, _ = loaded.tokenize(CHECK_TEXT)
    repeats = -(-want // max(1, ids.numel()))
    ids, _ = loaded.tokenize(CHECK_TEXT * repeats)
    ids = ids[:want]
    return torch.cat([torch.tensor(loaded.sink_ids, dtype=torch.long), ids])


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@torch.inference_mode()
def run_selfcheck(loaded, *, seed: int = 0) -> SelfCheckReport:
    """Run all four checks on an fp32 model; returns the figures and any failures."""
    if loaded.dtype != torch.float32:
        raise ValueError("the self-check runs in fp32; load the model in float32 first")
    started = time.perf_counter()
    model, adapter = loaded.model, loaded.adapter
    gen = torch.Generator().manual_seed(seed)

    # 1. rotate ∘ derotate is the identity.
    limit = min(getattr(model.config, "max_position_embeddings", 8192) or 8192, 32768)
    tokens = 64
    keys = torch.randn(adapter.num_layers, adapter.num_kv_heads, tokens, adapter.head_dim, generator=gen)
    positions = torch.randint(0, limit, (tokens,), generator=gen)
    rotation = max(
        _max_abs(adapter.rotate(adapter.derotate(keys, positions), positions), keys),
        _max_abs(adapter.derotate(adapter.rotate(keys, positions), positions), keys),
    )

    # 2. the model's own cache reproduces a full forward.
    ids = _check_ids(loaded)
    context, continuation = ids[:-CONTINUATION_TOKENS], ids[-CONTINUATION_TOKENS:]
    full = model(input_ids=ids[None]).logits[0, -CONTINUATION_TOKENS:]
    prefilled = model(input_ids=context[None], past_key_values=DynamicCache(config=model.config),
                      use_cache=True).past_key_values
    if all(layer.keys.shape[-2] == context.numel() for layer in prefilled.layers):
        # Nothing was evicted, so these are the tensors check 3 needs; take them
        # before the continuation below appends to the cache in place.
        k, v = adapter.cache_tensors(prefilled)
    else:
        # A sliding window dropped tokens: prefill again into a cache that keeps all.
        raw = model(input_ids=context[None], past_key_values=DynamicCache(), use_cache=True)
        k, v = adapter.cache_tensors(raw.past_key_values)
    native = model(input_ids=continuation[None], past_key_values=prefilled).logits[0]
    native_diff = _max_abs(native, full)

    # 3. the same context through a KVChunk round trip (fp32 storage).
    positions = torch.arange(context.numel())
    chunk = KVChunk(adapter.derotate(k, positions), v, context, torch.zeros(context.numel(), 2, dtype=torch.long),
                    text_sha256(CHECK_TEXT), loaded.fingerprint, {"role": "selfcheck"})
    decoded = KVChunk.from_bytes(chunk.to_bytes("float32"), expect_model=loaded.fingerprint)
    cache = loaded.build_cache([decoded])
    roundtrip = model(input_ids=continuation[None], past_key_values=cache).logits[0]
    roundtrip_diff = _max_abs(roundtrip, full)

    # 4. re-rotation to an offset equals the model's keys at that offset.
    piece = context[:64]
    stored = loaded.prefill_tokens(piece[len(loaded.sink_ids):], text_hash=text_sha256(""),
                                   sink_ids=loaded.sink_ids)
    n_sink = len(loaded.sink_ids)
    shifted = model(input_ids=piece[None], position_ids=torch.arange(OFFSET, OFFSET + piece.numel())[None],
                    past_key_values=DynamicCache(), use_cache=True)
    k_at_offset, _ = adapter.cache_tensors(shifted.past_key_values)
    k_at_offset = k_at_offset[:, :, n_sink:]
    moved = adapter.rotate(stored.keys, torch.arange(OFFSET + n_sink, OFFSET + piece.numel()))
    offset_rel = _max_abs(moved, k_at_offset) / k_at_offset.abs().max().item()

    failures = []
    if not rotation <= ROTATION_TOLERANCE:
        failures.append(f"rotate(derotate(k)) differs from k by {rotation:.2e} > {ROTATION_TOLERANCE:.0e}")
    if not native_diff <= NATIVE_TOLERANCE:
        failures.append(f"native cache logits differ by {native_diff:.2e} > {NATIVE_TOLERANCE:.0e}")
    if not roundtrip_diff <= ROUNDTRIP_TOLERANCE:
        failures.append(f"KVChunk round-trip logits differ by {roundtrip_diff:.2e} > {ROUNDTRIP_TOLERANCE:.0e}")
    if not offset_rel <= OFFSET_TOLERANCE:
        failures.append(f"keys re-rotated to offset {OFFSET} differ by {offset_rel:.2e} (relative) "
                        f"> {OFFSET_TOLERANCE:.0e}")
    return SelfCheckReport(
        model=loaded.name, family=adapter.family, context_tokens=int(context.numel()),
        rotation_max_abs=rotation, native_max_abs=native_diff, roundtrip_max_abs=roundtrip_diff,
        offset_max_rel=offset_rel, seconds=time.perf_counter() - started, failures=failures,
    )
