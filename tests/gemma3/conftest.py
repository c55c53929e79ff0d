"""The Gemma 3 model, loaded once per test process (float32, the PyPI package's GGUF),
and the peer's figures (examples/gemma3/peer/transformers_fixture.json, made by
`make gemma3-peer`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).parents[2] / "examples" / "gemma3" / "peer" / "transformers_fixture.json"


@pytest.fixture(scope="session")
def model() -> Any:
    import attn_gemma3

    # make test points ATTN_GEMMA3_CACHE into the checkout; a bare pytest uses ~/.cache
    return attn_gemma3.load(dtype="float32", cache_dir=os.environ.get("ATTN_GEMMA3_CACHE"))


@pytest.fixture(scope="session")
def peer() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())
