"""A short soak through a real tritonserver: benchmarks/soak.py's waves and checks at a small scale.

200 concurrent streams from 10 tenants over 20 adapters with 4 device slots and 8 host
slots, one wave: every stream exact, each (prompt, adapter)'s longest stream equal to
transformers + peft (the others are its prefixes), then no KV block, adapter pin or queued
sequence left, the stub's threads back to idle and its RSS flat.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scripts import load_benchmark
from tritonserver_fixture import make_triton_server_fixture

ADAPTERS = 20

soak = load_benchmark("soak")
triton_server = make_triton_server_fixture(
    engine_config={"max_loras": 4, "max_cpu_loras": 8},
    adapter_store=lambda store, demo: soak.populate_store(store, soak.build_adapters(demo["model"], ADAPTERS)),
)


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


def test_short_soak_is_exact_and_leaves_nothing_behind(triton_server, tokenizer):
    args = soak.parse_args(["--streams", "200", "--tenants", "10", "--adapters", str(ADAPTERS), "--duration", "0",
                            "--client-procs", "2", "--median-tokens", "8", "--max-tokens", "64"])
    names = sorted(p.name for p in Path(triton_server.env["LORAPLEX_ADAPTER_STORE"]).iterdir())
    assert len(names) == ADAPTERS
    jobs = soak.make_wave(args, names, 0)
    assert {j.params.get("lora_name") for j in jobs} == {None, *names}  # the base model and every adapter
    assert max(j.params["max_tokens"] for j in jobs) > 4 * min(j.params["max_tokens"] for j in jobs)
    store = Path(triton_server.env["LORAPLEX_ADAPTER_STORE"])
    oracle = soak.peft_oracle(triton_server.env["LORAPLEX_MODEL_DIR"], {n: store / n for n in names}, tokenizer)
    report = soak.run_soak(triton_server, args, names, tokenizer, log=lambda *a, **k: None, oracle=oracle)
    assert report.violations == []
    assert report.peft_checked == len({(j.prompt, j.params.get("lora_name")) for j in jobs})
    assert (report.waves, report.streams, report.errors) == (1, 200, 0)
    assert report.tokens == sum(j.params["max_tokens"] for j in jobs)
    assert report.threads_after == report.threads_idle
