"""Store a text as a KV chunk, then answer from the chunk without reading the text again.

    python examples/chunk_roundtrip.py [--model qwen2.5-0.5b]

Prefills a paragraph once, serialises its cache to bytes (what a store keeps),
decodes it, places it after the model's shared sink prefix and generates an
answer; then answers the same question by reading the text, for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch

import cag
from cag.kv import KVChunk

TEXT = ("The archive of Velmora was founded in 1894 by the cartographer Idris Sollen. "
        "Its oldest map shows the drowned village of Keth, and its reading room is open "
        "only on Thursdays.")
QUESTION = "\n\nQ: On which day of the week is the reading room open?\nA: The reading room is open on"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()

    lm = cag.load_model(args.model, dtype="bfloat16")
    stored = lm.prefill(TEXT).to_bytes("bfloat16")
    print(f"chunk: {len(lm.tokenize(TEXT)[0])} tokens, {len(stored):,} bytes")

    chunk = KVChunk.from_bytes(stored, expect_model=lm.fingerprint)
    prefix = lm.prefix_chunk()
    question, _ = lm.tokenize(QUESTION)
    context = lm.context_ids([prefix, chunk])
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False,
                  pad_token_id=lm.tokenizer.pad_token_id or 0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        from_cache = lm.model.generate(torch.cat([context, question])[None],
                                       past_key_values=lm.build_cache([prefix, chunk]), **kwargs)
        t1 = time.perf_counter()
        from_text = lm.model.generate(torch.cat([context, question])[None], **kwargs)
        t2 = time.perf_counter()
    n = context.numel() + question.numel()
    print(f"from cache: {lm.tokenizer.decode(from_cache[0, n:])!r}  ({t1 - t0:.2f}s)")
    print(f"from text:  {lm.tokenizer.decode(from_text[0, n:])!r}  ({t2 - t1:.2f}s)")


if __name__ == "__main__":
    main()
