"""Start one real ``tritonserver`` per test module.

Usage in a test module (``tests/`` is on ``sys.path`` through ``tests/conftest.py``)::

    from tritonserver_fixture import make_triton_server_fixture

    # One server for the whole module, on free ports, with the project's
    # model_repository/, the demo model and a temporary adapter store that
    # already holds the demo adapters (demo-a, demo-b).
    triton_server = make_triton_server_fixture(engine_config={"block_size": 16})

    def test_something(triton_server):
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        ...  # triton_server.http_url, .metrics_url, .log_path, .env as well

The fixture's name is whatever the module assigns it to. Arguments (all optional):

* ``engine_config``: dict (or JSON string) passed as ``LORAPLEX_ENGINE_CONFIG``;
* ``env``: more environment variables for the server;
* ``model_repository``: a path, or a callable ``f(tmp_dir: Path) -> Path`` that builds
  one (see ``copy_model_repository`` to start from a copy of the project's);
* ``model_dir``: base model folder (default: the demo model, ``LORAPLEX_MODEL_DIR``);
* ``adapter_store``: a path, or a callable ``f(tmp_dir, demo_paths) -> Path``
  (default: a fresh temporary folder holding copies of the demo adapters);
* ``ready_timeout``, ``extra_args`` (extra tritonserver flags), ``scope``.

The server runs in its own process group and is stopped (SIGINT, then SIGKILL of the
group after a grace period) when the module's tests are done. If it does not become
ready, the fixture fails with the tail of its log.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pytest

from loraplex.tritonserver import TritonServer, TritonServerError, engine_env, project_root

DEFAULT_MODEL_REPOSITORY = project_root() / "model_repository"


def copy_model_repository(dst: Path, models: Sequence[str] | None = None,
                          src: Path = DEFAULT_MODEL_REPOSITORY) -> Path:
    """Copy the project's model repository (or only ``models`` of it) to ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    names = models if models is not None else [p.name for p in src.iterdir() if p.is_dir()]
    for name in names:
        shutil.copytree(src / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def seed_demo_adapters(store: Path, demo: Mapping[str, Path]) -> Path:
    """Fill ``store`` with copies of the demo adapters, one folder per adapter name."""
    from loraplex.serve import seed_adapter_store

    seed_adapter_store(store, Path(demo["adapters"]))
    return store


def make_triton_server_fixture(
    *,
    engine_config: Mapping[str, Any] | str | None = None,
    env: Mapping[str, str] | None = None,
    model_repository: str | os.PathLike | Callable[[Path], Path] | None = None,
    model_dir: str | os.PathLike | None = None,
    adapter_store: str | os.PathLike | Callable[[Path, Mapping[str, Path]], Path] | None = None,
    ready_timeout: float = 180.0,
    extra_args: Sequence[str] = (),
    scope: str = "module",
):
    """A pytest fixture that yields a ready ``TritonServer`` for the module (see the module doc)."""

    @pytest.fixture(scope=scope)
    def _triton_server(demo, tmp_path_factory):
        tmp = tmp_path_factory.mktemp("tritonserver")
        if model_repository is None:
            repo = DEFAULT_MODEL_REPOSITORY
        elif callable(model_repository):
            repo = Path(model_repository(tmp / "model_repository"))
        else:
            repo = Path(model_repository)
        if adapter_store is None:
            store = seed_demo_adapters(tmp / "adapters", demo)
        elif callable(adapter_store):
            store = Path(adapter_store(tmp / "adapters", demo))
        else:
            store = Path(adapter_store)
        store.mkdir(parents=True, exist_ok=True)
        server_env = engine_env(model_dir if model_dir is not None else demo["model"], store, engine_config)
        server_env["OMP_NUM_THREADS"] = "1"  # tests share 2 cores with pytest itself: no spinning intra-op threads
        server_env.update(env or {})
        server = TritonServer(
            model_repository=repo, env=server_env, log_path=tmp / "tritonserver.log",
            ready_timeout=ready_timeout, extra_args=list(extra_args),
        )
        try:
            server.start_and_wait()
        except TritonServerError as exc:
            pytest.fail(f"tritonserver did not start: {exc}", pytrace=False)
        try:
            yield server
        finally:
            server.stop(grace=10)

    return _triton_server
