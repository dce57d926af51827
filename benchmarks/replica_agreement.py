"""How soon replica B sees an adapter operation made through replica A (two tritonservers, one adapter store).

    .venv/bin/python benchmarks/replica_agreement.py [--rounds 20] [--model-dir DIR]

Starts two tritonservers of the demo model (or --model-dir) on one temporary adapter store, warms both,
then for each round: an upload through A, then B's list and a generation naming it; a delete through A,
then B's list and a generation refused; a run-time shared load and unload through A, then B's list and a
generation. It records how many of B's requests were needed (the bound is one: B's first request after
the operation returned) and how long after A's reply B's answer came, and prints the median and maximum.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from loraplex.clients.adapters import adapter_request, build_inputs as adapter_inputs, delete_adapter, read_adapter_folder, upload_adapter
from loraplex.clients.generate import stream_generate
from loraplex.launch.serve import seed_adapter_store
from loraplex.launch.tritonserver import TritonServer, engine_env, project_root
from loraplex.models.builtin.demo import build_demo, default_out_dir
from loraplex.openai.triton_stream import ADMIN_PARAMETER
from loraplex.tenancy.tenants import key_digest

KEY, ADMIN = "acme-agreement-key", "operator-agreement-key"
HEADERS = {"x-api-key": KEY}


def listed(server: TritonServer, name: str) -> bool:
    page = adapter_request(server.grpc_url, "list", headers=HEADERS)
    return name in {a["name"] for a in page["adapters"]} | set(page["shared"])


def served(server: TritonServer, name: str) -> bool:
    params = {"max_tokens": 1, "temperature": 0, "ignore_eos": True, "lora_name": name}
    return stream_generate(server.grpc_url, "hello", params, headers=HEADERS).error is None


def operator(server: TritonServer, action: str, name: str, folder: Path | None = None) -> None:
    config, weights = read_adapter_folder(folder) if folder is not None else (None, None)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer("lora_adapters", adapter_inputs(grpcclient, action, name, config, weights),
                     parameters={ADMIN_PARAMETER: ADMIN})
    finally:
        client.close()


def seen(server: TritonServer, name: str, present: bool, done: float, tries: list, delays: list) -> None:
    """Ask B until its list and a generation agree with `present`; record the requests needed and the delay."""
    for n in range(1, 1001):
        if listed(server, name) == present and served(server, name) == present:
            tries.append(n)
            delays.append(time.perf_counter() - done)
            return
    raise SystemExit(f"replica B never saw {name!r} {'appear' if present else 'go'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    demo = build_demo(default_out_dir())
    work = Path(tempfile.mkdtemp(prefix="replica-agreement-"))
    store = work / "store"
    seed_adapter_store(store, Path(demo["adapters"]))
    (work / "tenants.json").write_text(json.dumps({"tenants": {"acme": {"api_key_sha256": key_digest(KEY).hex(), "max_adapters": 0}}}))
    env = {**engine_env(args.model_dir or demo["model"], store, None, work / "tenants.json"),
           "LORAPLEX_ADMIN_KEY": ADMIN, "OMP_NUM_THREADS": "1"}
    servers = [TritonServer(model_repository=project_root() / "model_repository", env=env,
                            log_path=work / f"{name}.log") for name in ("a", "b")]
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_ready()
        a, b = servers
        for server in servers:  # warm both: lora_adapters' first request, a generation on an adapter
            listed(server, "demo-a") and served(server, "demo-a")
        tries: dict[str, list] = {op: [] for op in ("upload", "delete", "load_shared", "unload_shared")}
        delays: dict[str, list] = {op: [] for op in tries}
        for i in range(args.rounds):
            folder = Path(demo["demo-a" if i % 2 else "demo-b"])
            upload_adapter(a.grpc_url, f"mine-{i}", folder, headers=HEADERS)
            seen(b, f"mine-{i}", True, time.perf_counter(), tries["upload"], delays["upload"])
            delete_adapter(a.grpc_url, f"mine-{i}", headers=HEADERS)
            seen(b, f"mine-{i}", False, time.perf_counter(), tries["delete"], delays["delete"])
            operator(a, "load_shared", f"ops-{i}", folder)
            seen(b, f"ops-{i}", True, time.perf_counter(), tries["load_shared"], delays["load_shared"])
            operator(a, "unload_shared", f"ops-{i}")
            seen(b, f"ops-{i}", False, time.perf_counter(), tries["unload_shared"], delays["unload_shared"])
        print(f"{args.rounds} rounds, two replicas on one store; B's list + one-token generation after A's reply:")
        for op in tries:
            ms = [d * 1000 for d in delays[op]]
            print(f"  {op:14s} requests needed: max {max(tries[op])}   delay ms: median {statistics.median(ms):.1f}"
                  f"  max {max(ms):.1f}")
    finally:
        stops = [threading.Thread(target=s.stop) for s in servers]
        for stop in stops:
            stop.start()
        for stop in stops:
            stop.join()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
