"""The adapter store at N adapters: what start-up and each request cost (decision 053).

    python benchmarks/adapter_store_scale.py [--adapters 10000]

Builds a throwaway store of N tenant pointers, N run-time shared pointers and N shared folders
(tiny files), then prints, best of 5: the old start-up walk (``store.shared()``) and the memory
its dict holds, the catalog's construction now, resolving each kind of name, one 1,000-name
list page and the unknown-LoRA error, just after the folders changed and once their listings
are cached (their mtime 2 s old).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

from loraplex.lora.catalog import AdapterCatalog
from loraplex.lora.store import SHARED_DIR, AdapterStore, tenant_dir_name


def build(root: Path, n: int) -> list[Path]:
    """The store's three folders of n entries each."""
    own = root / ".tenants" / tenant_dir_name("acme") / "adapters"
    loaded = root / SHARED_DIR / "adapters"
    own.mkdir(parents=True)
    loaded.mkdir(parents=True)
    meta = {"version": "v1", "digest": "0", "rank": 4, "target_modules": ["q_proj"], "bytes": 1, "created": 0.0}
    for i in range(n):
        (root / f"folder-{i:05d}").mkdir()
        (root / f"folder-{i:05d}" / "adapter_config.json").write_text("{}")
        (own / f"own-{i:05d}.json").write_text(json.dumps({**meta, "name": f"own-{i:05d}"}))
        (loaded / f"loaded-{i:05d}.json").write_text(json.dumps({**meta, "name": f"loaded-{i:05d}"}))
    return [own, loaded, root]


def best_ms(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapters", type=int, default=10_000)
    n = ap.parse_args().adapters
    root = Path(tempfile.mkdtemp(prefix="store-scale-")) / "store"
    folders = build(root, n)
    store = AdapterStore(root)
    tracemalloc.start()
    shared = store.shared()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(shared) == n
    print(f"store.shared() over {n} folders (the old start-up walk): {best_ms(store.shared):.1f} ms, "
          f"{held / 1e6:.2f} MB held")
    print(f"AdapterCatalog(store, {{}}) (start-up now): {best_ms(lambda: AdapterCatalog(store, {})) * 1000:.1f} us")
    catalog = AdapterCatalog(store, {})
    last = f"{n - 1:05d}"
    for name in (f"own-{last}", f"loaded-{n // 2:05d}", f"folder-{last}"):
        print(f"resolve {name}: {best_ms(lambda: catalog.resolve('acme', name), 200) * 1000:.1f} us")
    for when in ("just changed", "cached"):
        if when == "cached":
            for folder in folders:
                stamp = folder.stat().st_mtime - 10
                os.utime(folder, (stamp, stamp))
        print(f"unknown-LoRA error, listings {when}: {best_ms(lambda: catalog.visible_text('acme')):.1f} ms")
        print(f"list page of 1000 of {3 * n} names, listings {when}: "
              f"{best_ms(lambda: store.page('acme', 'loaded-04000', 1000)):.1f} ms")


if __name__ == "__main__":
    main()
