# Run from the repository root: python eval/results/gate-sentence-crux-lookups/run.py (2026-12-05, ~7 min here)
import sys
sys.path.insert(0, '.')
from pathlib import Path
from eval.calibration_lookup import calibration_lookup
from eval.run import run_eval
cmd = ("python -c 'run_eval(calibration_lookup(seed=0)[:30], ..., source=smollm2-135m, targets=[qwen2.5-0.5b], "
       "methods=[bottleneck], max_new_tokens=16, recompute_ratio=0.2, recompute_select=retriever, "
       "translated_key_scale=0.4)' (the gate's 30 lookups, translated path with the sentence crux)")
run_eval(calibration_lookup(seed=0)[:30], Path('eval/results/gate-sentence-crux-lookups'), source='smollm2-135m',
         targets=['qwen2.5-0.5b'], methods=['bottleneck'], max_new_tokens=16, recompute_ratio=0.2,
         recompute_select='retriever', translated_key_scale=0.4, command=cmd, progress=True)
