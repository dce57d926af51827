"""The CUDA sources live in the top-level kernels/ folder: sources only, never an importable `kernels`."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from loraplex.kernels.instances import FAMILIES
from loraplex.kernels.sources import KERNEL_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_holds_only_cuda_sources_and_every_family_finds_its_own():
    assert KERNEL_DIR == ROOT / "kernels"
    assert {p.suffix for p in KERNEL_DIR.iterdir()} <= {".cu", ".h"}, sorted(p.name for p in KERNEL_DIR.iterdir())
    for family in FAMILIES.values():
        assert (KERNEL_DIR / family.source).is_file(), family.source


def test_no_import_of_kernels_resolves_inside_the_checkout():
    # Run from the checkout's root with it first on sys.path (as `python -c` and pytest's rootdir do):
    # Hugging Face's `kernels` (which transformers imports) must not be shadowed by our folder.
    probe = ("import importlib.util; s = importlib.util.find_spec('kernels'); "
             "print('\\n'.join(s.submodule_search_locations or [s.origin]) if s else '')")
    found = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\n")
    here = importlib.util.find_spec("kernels")
    found += list(here.submodule_search_locations or [here.origin]) if here else []
    assert not [p for p in found if p.strip() and Path(p.strip()).resolve().is_relative_to(ROOT / "kernels")], found
