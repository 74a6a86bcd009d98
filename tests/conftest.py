import os
import sys
from pathlib import Path

import pytest

# Tests import the `tests.tiny` helpers by package path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.tiny import FAMILIES, tiny_loaded  # noqa: E402


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request):
    """A tiny random `LoadedModel` of each family (shared: tests must not mutate it)."""
    return tiny_loaded(request.param)
