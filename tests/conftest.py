"""Shared fixtures: the offline demo (built once per session) and the tritonserver helper.

``tests/support/`` (the test helpers: servers, the peft oracle, harnesses) is put on ``sys.path``
so any test module, in any subfolder, can write ``from tritonserver_fixture import
make_triton_server_fixture`` (see that module).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SUPPORT_DIR = Path(__file__).resolve().parent / "support"
if str(SUPPORT_DIR) not in sys.path:
    sys.path.insert(0, str(SUPPORT_DIR))


@pytest.fixture(scope="session")
def demo() -> dict[str, Path]:
    """Paths of the demo model, tokenizer and adapters (``.cache/demo``), built if missing."""
    from loraplex.models.builtin.demo import build_demo, default_out_dir

    return build_demo(Path(os.environ.get("LORAPLEX_DEMO_DIR", default_out_dir())))


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One intra-op thread in the test process: on a busy 2-core machine (a tritonserver beside
    pytest), spinning OpenMP workers make a 7 ms step take ~1 s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
