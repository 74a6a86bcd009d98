"""Baseline beside the crux path: direct context of the retriever's top chunk alone (top_k=1)."""
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, '.')
from pathlib import Path
from eval.repair_ablation import load_items
from eval import metrics
from cag.context import CachedContext
items = load_items('synthetic-kb', 50)
ctx = CachedContext(store=Path.home() / '.cache/cag/repair_ablation/synthetic-kb-smollm2-135m', target='qwen2.5-0.5b',
                    mapper='auto', top_k=1, min_retention=0.0, max_new_tokens=16)
found, f1 = [], []
for it in items:
    a = ctx.answer_direct(it.question)
    found.append(metrics.contains_answer(a.text, it.answers)); f1.append(metrics.token_f1(a.text, it.answers))
print(json.dumps({"n": len(items), "found": sum(found) / len(items), "f1": sum(f1) / len(items)}))
