"""The CUDA sources live in the top-level kernels/ folder: sources only, never an importable `kernels`."""

import importlib.util
import os
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


def test_an_installed_kernels_package_is_never_shadowed_by_the_sources_folder(tmp_path):
    """Hugging Face's `kernels` (which transformers imports where it is installed) wins over our kernels/ folder,
    even from the checkout's root with it first on sys.path (as `python -c` and pytest's rootdir do): the folder
    has no __init__.py, so it is at most a namespace portion. A stand-in package shows it where HF's is absent."""
    stand_in = tmp_path / "site" / "kernels"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("")
    path = os.pathsep.join(filter(None, [str(stand_in.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    probe = "import importlib.util; print(importlib.util.find_spec('kernels').origin)"
    origin = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                            check=True).stdout.strip()
    assert Path(origin) == stand_in / "__init__.py", origin
    here = importlib.util.find_spec("kernels")  # in this process: HF's where it is installed
    if here is not None and here.origin:
        assert not Path(here.origin).resolve().is_relative_to(ROOT / "kernels"), here.origin
