# Run from the repository root: python eval/results/gate-sentence-crux-codes/run.py (2026-12-05, ~10 min here)
import sys
sys.path.insert(0, '.')
from pathlib import Path
from eval.gate_fidelity import copy_items, COPY_SEED
from eval.run import run_eval
cmd = ("python -c 'run_eval(copy_items(24, COPY_SEED), ..., source=smollm2-135m, targets=[qwen2.5-0.5b], "
       "methods=[bottleneck], max_new_tokens=16, recompute_ratio=0.2, recompute_select=retriever, "
       "translated_key_scale=0.4)' (the gate's 24 code needles, translated path with the sentence crux)")
run_eval(copy_items(24, COPY_SEED), Path('eval/results/gate-sentence-crux-codes'), source='smollm2-135m',
         targets=['qwen2.5-0.5b'], methods=['bottleneck'], max_new_tokens=16, recompute_ratio=0.2,
         recompute_select='retriever', translated_key_scale=0.4, command=cmd, progress=True)
