"""Probe: with the answer chunk recomputed exactly (retriever_chunk), do the translated neighbours'
keys draw too much attention? Scale translated keys by alpha and count found answers."""
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, '.')
from pathlib import Path
from eval.repair_ablation import load_items
from eval import metrics
from cag.context import CachedContext

alphas = [float(a) for a in sys.argv[1:]] or [1.0, 0.85, 0.7]
items = load_items('synthetic-kb', 50)
ctx = CachedContext(store=Path.home() / '.cache/cag/repair_ablation/synthetic-kb-smollm2-135m', target='qwen2.5-0.5b',
                    mapper='auto', top_k=4, min_retention=0.0, translation_cache_mb=0, max_new_tokens=16,
                    recompute_select='retriever_chunk', recompute_ratio=0.25)
orig = CachedContext._target_chunks
state = {"alpha": 1.0}
def patched(self, hits, timings, notes):
    chunks, used = orig(self, hits, timings, notes)
    a = state["alpha"]
    if a != 1.0:
        for c in chunks:
            c.keys = c.keys * a
    return chunks, used
CachedContext._target_chunks = patched
out = {}
for a in alphas:
    state["alpha"] = a
    found = []
    for it in items:
        ans = ctx.answer(it.question)
        found.append(metrics.found(ans.text, it.answers) if hasattr(metrics, 'found') else
                     float(any(metrics.normalize_answer(g) in metrics.normalize_answer(ans.text) for g in it.answers)))
    out[a] = sum(found) / len(found)
    print(f"alpha {a}: found {sum(found)}/{len(found)}", flush=True)
json.dump(out, open('/tmp/probe/keyscale.json', 'w'))
