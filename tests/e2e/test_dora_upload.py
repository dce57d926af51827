"""A DoRA adapter (use_dora) uploaded through the lora_adapters Triton model and served by lora_llm: greedy tokens
equal peft's (the magnitudes' output scale is computed once at load from the base weights, decision 052)."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import token_ids_of
from peft_reference import greedy_tokens
from tritonserver_fixture import make_triton_server_fixture

from loraplex.clients.adapters import upload_adapter
from loraplex.clients.generate import stream_generate
from loraplex.tenancy.tenants import key_digest

KEY = "dora-upload-key"
WORK = Path(tempfile.mkdtemp(prefix="loraplex-dora-"))
TENANTS_FILE = WORK / "tenants.json"
TENANTS_FILE.write_text(json.dumps({"tenants": {"acme": {"api_key_sha256": key_digest(KEY).hex()}}}))
GREEDY = {"temperature": 0, "logprobs": 0, "max_tokens": 8}

triton_server = make_triton_server_fixture(env={"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)},
                                           adapter_store=lambda tmp, demo: WORK / "store")


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    shutil.rmtree(WORK, ignore_errors=True)


@pytest.fixture(scope="module")
def dora_folder(demo, tmp_path_factory):
    """A peft DoRA adapter for the demo model whose magnitudes differ from the merged norms (scale != 1)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo["model"]).float()
    torch.manual_seed(7)
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], use_dora=True,
        init_lora_weights=False, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
    folder = tmp_path_factory.mktemp("dora")
    pm.save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_uploaded_dora_adapter_is_served_like_peft(triton_server, demo, dora_folder):
    from transformers import AutoTokenizer

    upload_adapter(triton_server.grpc_url, "dora", dora_folder, headers={"x-api-key": KEY})
    prompt = "DoRA scales each output"
    result = stream_generate(triton_server.grpc_url, prompt, dict(GREEDY, lora_name="dora"),
                             headers={"x-api-key": KEY}, return_logprobs=True)
    assert result.error is None, result.error
    ids = AutoTokenizer.from_pretrained(demo["model"])(prompt).input_ids
    tokens = token_ids_of(result)
    assert tokens == greedy_tokens(str(demo["model"]), str(dora_folder), ids, GREEDY["max_tokens"])
    assert tokens != greedy_tokens(str(demo["model"]), None, ids, GREEDY["max_tokens"])  # the adapter matters


def test_uploaded_vocabulary_adapters_are_served_like_peft_in_one_batch(triton_server, demo, tmp_path):
    """Adapters beyond the projections (decision 067), uploaded and generated from at once: two training the same
    token ids with different rows, and LoRA on embed_tokens and lm_head saved with peft's default copies of the
    base weights (checked against the served base, then dropped)."""
    from concurrent.futures import ThreadPoolExecutor

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(demo["model"]).float()
    trained = [3 + ord(c) for c in " aeo"]
    specs = {"tok-a": dict(target_modules=["v_proj"], trainable_token_indices=trained),
             "tok-b": dict(target_modules=["v_proj"], trainable_token_indices=trained),
             "vocab-lora": dict(target_modules=["embed_tokens", "lm_head"])}
    folders = {}
    for seed, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(seed)
        pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **spec))
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "trainable_tokens_delta" in pname:
                    p.add_(p.std() * torch.randn_like(p))
                elif "lora_embedding_B" in pname:
                    p.mul_(0.02)
        folders[name] = tmp_path / name
        pm.save_pretrained(str(folders[name]))
        upload_adapter(triton_server.grpc_url, name, folders[name], headers={"x-api-key": KEY})
    prompt = "a tale of one sea"
    with ThreadPoolExecutor(len(specs)) as pool:
        results = dict(zip(specs, pool.map(lambda name: stream_generate(
            triton_server.grpc_url, prompt, dict(GREEDY, lora_name=name), headers={"x-api-key": KEY},
            return_logprobs=True), specs)))
    ids = AutoTokenizer.from_pretrained(demo["model"])(prompt).input_ids
    for name, result in results.items():
        assert result.error is None, (name, result.error)
        want = greedy_tokens(str(demo["model"]), str(folders[name]), ids, GREEDY["max_tokens"])
        assert token_ids_of(result) == want, name
    assert token_ids_of(results["tok-a"]) != token_ids_of(results["tok-b"])  # the same ids, each its own rows
