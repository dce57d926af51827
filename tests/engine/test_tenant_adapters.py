"""Tenant-scoped adapters in the engine: uploads resolve per tenant, versions stay put for requests in flight.

Two tenants upload different adapters under one name; each tenant's greedy output equals
peft's for its own. Replacing an adapter while a request runs changes new requests only;
deleting it makes the name unknown to new requests, and the registry of versions stays
bounded. Quotas refuse at arrival.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import peft_reference as ref
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.exceptions import AdapterNotFound, QuotaExceeded
from loraplex.lora.store import AdapterStore
from loraplex.models.loader import load_hf_config
from loraplex.engine.request import SamplingParams
from loraplex.tenancy.tenants import Tenant

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
ACME, GLOBEX = Tenant("acme", b"a"), Tenant("globex", b"g")


def upload(store: AdapterStore, tenant: Tenant, name: str, folder: str, model_dir: str):
    folder = Path(folder)
    return store.upload(tenant, name, (folder / "adapter_config.json").read_text(),
                        (folder / "adapter_model.safetensors").read_bytes(), load_hf_config(model_dir), 64)


@pytest.fixture()
def setup(lora_family, tmp_path):
    family = lora_family("llama-gqa")
    store = AdapterStore(tmp_path / "store")
    upload(store, ACME, "support", family.adapters["all-r16"], family.model_dir)
    upload(store, GLOBEX, "support", family.adapters["mlp-r8"], family.model_dir)
    engine = LLMEngine(EngineConfig(model_dir=family.model_dir, device="cpu", dtype="float32",
                                    adapter_store=str(store.root), max_loras=2, max_cpu_loras=2,
                                    num_kv_blocks=128, block_size=8))
    return family, store, engine


def greedy(lora: str | None = "support", max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams.from_dict({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                                     **({"lora_name": lora} if lora else {})})


def run(engine: LLMEngine, tenant: Tenant, request_id: str, params=None) -> list[int]:
    request = engine.make_request(request_id, PROMPT, params or greedy(), tenant.name, tenant)
    outputs = engine.generate([request])[request_id]
    assert outputs[-1].finished and outputs[-1].error is None, outputs[-1].error
    return [t for o in outputs for t in o.token_ids]


def peft_tokens(family, adapter: str, engine: LLMEngine, max_tokens: int = MAX_TOKENS) -> list[int]:
    ids = engine.tokenizer(PROMPT).input_ids
    return ref.greedy_tokens(family.model_dir, family.adapters[adapter], ids, max_tokens, ignore_eos=True)


def test_same_name_in_two_tenants_gives_each_its_own_adapter(setup):
    family, _, engine = setup
    assert run(engine, ACME, "a") == peft_tokens(family, "all-r16", engine)
    assert run(engine, GLOBEX, "g") == peft_tokens(family, "mlp-r8", engine)
    with pytest.raises(AdapterNotFound) as error:
        engine.make_request("x", PROMPT, greedy(), "initech", Tenant("initech", b"i"))
    assert "LoRA support is not supported, we currently support []" in str(error.value)


def test_a_request_in_flight_keeps_its_version_and_new_ones_see_the_replacement(setup):
    family, store, engine = setup
    first = engine.make_request("first", PROMPT, greedy(max_tokens=24), "acme", ACME)
    engine.add_request(first)
    tokens: dict[str, list[int]] = {"first": [], "second": []}

    def step():
        for output in engine.step():
            assert output.error is None, output.error
            tokens[output.request_id] += output.token_ids

    for _ in range(3):
        step()  # `first` runs on the all-r16 version
    upload(store, ACME, "support", family.adapters["attn-r4"], family.model_dir)
    second = engine.make_request("second", PROMPT, greedy(), "acme", ACME)
    assert second.adapter_key != first.adapter_key
    engine.add_request(second)
    while engine.has_work():
        step()
    assert tokens["second"] == peft_tokens(family, "attn-r4", engine)
    assert tokens["first"] == peft_tokens(family, "all-r16", engine, 24)
    assert engine.versions.registered() == 1 and engine.adapters.total_pins() == 0


def test_a_deleted_adapter_is_unknown_to_new_requests_and_its_version_is_forgotten(setup):
    _, store, engine = setup
    run(engine, ACME, "before")
    store.delete("acme", "support")
    with pytest.raises(AdapterNotFound):
        engine.make_request("after", PROMPT, greedy(), "acme", ACME)
    assert run(engine, GLOBEX, "globex-still") and engine.versions.registered() == 2  # acme's stays idle, bounded


def test_quotas_refuse_at_arrival_and_return_when_requests_end(setup):
    _, _, engine = setup
    limited = Tenant("acme", b"a", max_queued_requests=1)
    first = engine.make_request("q1", PROMPT, greedy(None), "acme", limited)
    engine.add_request(first)
    with pytest.raises(QuotaExceeded, match="max_queued_requests=1"):
        engine.add_request(engine.make_request("q2", PROMPT, greedy(None), "acme", limited))
    engine.generate([])  # runs q1 to the end
    while engine.has_work():
        engine.step()
    engine.add_request(engine.make_request("q3", PROMPT, greedy(None), "acme", limited))
    while engine.has_work():
        engine.step()
    assert engine.quotas.tracked_tenants() == 0
