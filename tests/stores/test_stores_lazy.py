"""Importing `stores` is cheap: faiss, diskcache and the embedder load only when used.

(The import floors themselves are held by tests/unit/test_floors.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STORES = Path(__file__).resolve().parents[2] / "stores"


def test_importing_stores_is_lazy():
    code = ("import sys, stores; assert 'faiss' not in sys.modules and 'diskcache' not in sys.modules; "
            "stores.ChunkStore; assert 'faiss' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=STORES.parent, env={"PYTHONPATH": str(STORES.parent), "PATH": ""})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
