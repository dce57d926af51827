"""Adapter uploads through real tritonservers: lora_adapters (CLI, plain tritonclient), refusals that leave the
store unchanged, two replicas on one store, and lora_llm serving each tenant its own upload (peft as the oracle).

Two servers at most: `triton_server` (replica A, the whole module) and `replica_b` on the same store, started
after A has uploads, so it also shows that a restart keeps them.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import shutil
import struct
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import token_ids_of, wait_for_metric
from peft_reference import greedy_tokens
from safetensors.torch import load, save
from tritonclient.utils import InferenceServerException
from tritonserver_fixture import demo_server, make_triton_server_fixture, seed_demo_adapters

from loraplex.clients.adapters import adapter_request, read_adapter_folder, upload_adapter
from loraplex.clients.adapters import main as adapters_main
from loraplex.clients.generate import stream_generate
from loraplex.exceptions import AUTH_ERROR
from loraplex.tenancy.tenants import key_digest
from loraplex.launch.tritonserver import TritonServerError

KEYS = {"acme": "acme-upload-key", "globex": "globex-upload-key", "metered": "metered-key", "queued": "queued-key",
        "versioned": "versioned-key"}
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Demo model: 4 layers, hidden 128, 4 heads of 32, 2 KV heads, intermediate 344: sum(in + out) over the seven
# projections is 2312 per layer, so a rank-16 all-modules F32 adapter has 4 * 2312 * 16 * 4 = 591,872 data bytes.
RANK16_DATA_BYTES = 4 * 2312 * 16 * 4
MAX_ADAPTER_BYTES = RANK16_DATA_BYTES + 64 * 1024  # + room for the safetensors header; the F64 copy is twice over
QUOTAS = {"max_adapter_rank": 16, "max_adapter_bytes": MAX_ADAPTER_BYTES}
TENANTS = {"acme": QUOTAS, "globex": QUOTAS, "metered": {"tokens_per_minute": 40},
           "versioned": {**QUOTAS, "max_adapters": 2},
           "queued": {"max_queued_requests": 1, "max_concurrent_requests": 1}}
WORK = Path(tempfile.mkdtemp(prefix="loraplex-uploads-"))
TENANTS_FILE, STORE = WORK / "tenants.json", WORK / "store"
TENANTS_FILE.write_text(json.dumps({"tenants": {t: {"api_key_sha256": key_digest(KEYS[t]).hex(), **q}
                                                for t, q in TENANTS.items()}}))
ENV = {"LORAPLEX_TENANTS_FILE": str(TENANTS_FILE)}
GREEDY = {"temperature": 0, "logprobs": 0, "max_tokens": 8}


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    shutil.rmtree(WORK, ignore_errors=True)


triton_server = make_triton_server_fixture(env=ENV, adapter_store=lambda tmp, demo: seed_demo_adapters(STORE, demo))


@pytest.fixture(scope="module")
def replica_b(triton_server, demo, tmp_path_factory):
    """A second tritonserver on the same store (started when first needed, after replica A's uploads)."""
    server = demo_server(tmp_path_factory.mktemp("replica-b"), demo, env=ENV, adapter_store=STORE)
    try:
        server.start_and_wait()
    except TritonServerError as exc:
        pytest.fail(f"replica B did not start: {exc}", pytrace=False)
    yield server
    server.stop(grace=10)


@pytest.fixture(scope="module")
def folders(demo, tmp_path_factory):
    """PEFT adapter folders for the demo model, built with peft: name -> folder."""
    from transformers import AutoModelForCausalLM

    from loraplex.models.builtin.demo import build_peft_adapter

    base = AutoModelForCausalLM.from_pretrained(demo["model"]).float()
    root = tmp_path_factory.mktemp("peft")
    specs = {"acme-support": (8, ("q_proj", "v_proj"), 11), "globex-support": (8, ("q_proj", "o_proj", "down_proj"), 12),
             "rank16-all": (16, ALL, 13), "rank32": (32, ("q_proj",), 14), "acme-v2": (4, ("k_proj", "up_proj"), 15)}
    made = {name: build_peft_adapter(demo["model"], root / name, r=r, alpha=2 * r, target_modules=mods, seed=seed,
                                     model=copy.deepcopy(base))
            for name, (r, mods, seed) in specs.items()}
    return made


def snapshot(root: Path = STORE) -> dict[str, str]:
    """Every path under the store with its sha256 (folders as 'dir')."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def key(tenant: str) -> dict:
    return {"x-api-key": KEYS[tenant]}


def call(server, action, name=None, config=None, weights=None, headers=None, protocol="grpc"):
    url = server.grpc_url if protocol == "grpc" else server.http_address
    return adapter_request(url, action, name, config, weights, headers=headers, protocol=protocol)


def refused(server, action, name=None, config=None, weights=None, headers=None, code="INVALID_ARG",
            protocol="grpc") -> str:
    """The error message of a request that must fail with ``code``, checked to leave the store unchanged."""
    before = snapshot()
    with pytest.raises(InferenceServerException) as info:
        call(server, action, name, config, weights, headers, protocol)
    assert snapshot() == before
    grpc_codes = {"INVALID_ARG": "StatusCode.INVALID_ARGUMENT", "NOT_FOUND": "StatusCode.NOT_FOUND"}
    http_codes = {"INVALID_ARG": "400", "NOT_FOUND": "404"}
    assert info.value.status() == (grpc_codes if protocol == "grpc" else http_codes)[code], info.value
    message = info.value.message()
    assert str(STORE) not in message and str(WORK) not in message
    return message


# management: CLI, plain tritonclient ------------------------------------------------------

def test_upload_list_info_delete_with_the_cli(triton_server, folders, capsys):
    url = ["--url", triton_server.grpc_url, "--api-key", KEYS["acme"]]
    assert adapters_main([*url, "upload", str(folders["acme-support"]), "--name", "support"]) == 0
    uploaded = json.loads(capsys.readouterr().out)
    _, weights = read_adapter_folder(folders["acme-support"])
    assert (uploaded["name"], uploaded["rank"], uploaded["target_modules"]) == ("support", 8, ["q_proj", "v_proj"])
    assert uploaded["bytes"] == len(weights) and len(uploaded["digest"]) == 64 and uploaded["created"].endswith("Z")
    assert adapters_main([*url, "list"]) == 0
    assert json.loads(capsys.readouterr().out) == {"adapters": [uploaded]}
    assert adapters_main([*url, "info", "support"]) == 0
    assert json.loads(capsys.readouterr().out) == uploaded
    assert adapters_main([*url, "info", "nope"]) == 1
    assert capsys.readouterr().err.strip() == "loraplex-adapters: error: adapter 'nope' not found"
    assert adapters_main(["--url", triton_server.grpc_url, "list"]) == 1  # no key
    assert AUTH_ERROR in capsys.readouterr().err


def test_the_cli_refuses_a_pickle_only_folder_locally(tmp_path, folders, capsys):
    torch.save(load((folders["acme-support"] / "adapter_model.safetensors").read_bytes()), tmp_path / "adapter_model.bin")
    shutil.copy(folders["acme-support"] / "adapter_config.json", tmp_path)
    assert adapters_main(["--url", "127.0.0.1:1", "--api-key", "x", "upload", str(tmp_path), "--name", "p"]) == 1
    assert "holds only adapter_model.bin (a pickle); the server refuses pickle files" in capsys.readouterr().err


def test_plain_tritonclient_grpc_and_http(triton_server, folders):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    config, weights = read_adapter_folder(folders["rank16-all"])
    assert len(weights) <= MAX_ADAPTER_BYTES  # the largest adapter the quota allows fits
    http = httpclient.InferenceServerClient(triton_server.http_address)
    inputs = []
    for name, value in (("action", b"upload"), ("adapter_name", b"big"), ("adapter_config", config.encode()),
                        ("adapter_weights", weights)):
        tensor = httpclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_))
        inputs.append(tensor)
    uploaded = json.loads(http.infer("lora_adapters", inputs, headers=key("acme")).as_numpy("result")[0])
    assert (uploaded["name"], uploaded["rank"], uploaded["target_modules"]) == ("big", 16, sorted(ALL))
    grpc = grpcclient.InferenceServerClient(triton_server.grpc_url)
    inputs = []
    for name, value in (("action", b"info"), ("adapter_name", b"big")):
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value], dtype=np.object_))
        inputs.append(tensor)
    assert json.loads(grpc.infer("lora_adapters", inputs, headers=key("acme")).as_numpy("result")[0]) == uploaded
    assert call(triton_server, "delete", "big", headers=key("acme"), protocol="http") == uploaded
    assert [a["name"] for a in call(triton_server, "list", headers=key("acme"))["adapters"]] == ["support"]


# refusals: each leaves the store unchanged -------------------------------------------------

def test_other_tenants_adapters_are_not_found_like_missing_ones(triton_server, folders):
    upload_adapter(triton_server.grpc_url, "acme-private", folders["acme-support"], headers=key("acme"))
    assert "acme-private" not in json.dumps(call(triton_server, "list", headers=key("globex")))
    for action in ("info", "delete"):
        theirs = refused(triton_server, action, "acme-private", headers=key("globex"), code="NOT_FOUND")
        missing = refused(triton_server, action, "no-such-one", headers=key("globex"), code="NOT_FOUND")
        assert theirs == "adapter 'acme-private' not found" and missing == "adapter 'no-such-one' not found"
        assert refused(triton_server, action, "acme-private", headers=key("globex"), code="NOT_FOUND",
                       protocol="http") == theirs
    assert call(triton_server, "info", "acme-private", headers=key("acme"))["name"] == "acme-private"


@pytest.mark.parametrize("headers", [None, {"x-api-key": "wrong"}, {"x-tenant-id": "acme"},
                                     {"x-tenant-id": "acme", "x-api-key": "wrong"}],
                         ids=["missing key", "wrong key", "spoofed tenant", "spoofed tenant + wrong key"])
def test_a_missing_or_wrong_key_is_refused(triton_server, folders, headers):
    config, weights = read_adapter_folder(folders["acme-support"])
    assert refused(triton_server, "upload", "support", config, weights, headers=headers) == AUTH_ERROR
    assert refused(triton_server, "delete", "support", headers=headers) == AUTH_ERROR
    assert refused(triton_server, "list", headers=headers, protocol="http") == AUTH_ERROR


def test_a_spoofed_tenant_header_beside_a_valid_key_is_ignored(triton_server):
    spoofed = {**key("globex"), "x-tenant-id": "acme"}
    assert "support" not in {a["name"] for a in call(triton_server, "list", headers=spoofed)["adapters"]}
    assert refused(triton_server, "delete", "support", headers=spoofed, code="NOT_FOUND") == \
        "adapter 'support' not found"


def _lying_header(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    first = min(k for k in header if k != "__metadata__")
    header[first]["shape"] = [header[first]["shape"][0], 10**9]
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def _pickle(data: bytes) -> bytes:
    buf = io.BytesIO()
    torch.save(load(data), buf)
    return buf.getvalue()


def _wrong_shapes(data: bytes) -> bytes:
    tensors = load(data)
    name = min(k for k in tensors if "lora_A" in k)
    tensors[name] = torch.zeros(tensors[name].shape[0], 96)
    return save(tensors)


BAD_UPLOADS = {  # case -> (source adapter, how to break its weights, fragment of the message)
    "oversized": ("rank16-all", lambda d: save({k: v.double() for k, v in load(d).items()}),
                  f"above the max_adapter_bytes quota ({MAX_ADAPTER_BYTES} bytes) of tenant 'acme'"),
    "rank over quota": ("rank32", None, "has rank 32, above the max_adapter_rank quota (16) of tenant 'acme'"),
    "pickle": ("acme-support", _pickle, "pickle is refused"),
    "malformed": ("acme-support", lambda d: b"\x07\x00\x00\x00\x00\x00\x00\x00{nope!}", "not a valid safetensors"),
    "lying header": ("acme-support", _lying_header, "needs"),
    "truncated": ("acme-support", lambda d: d[: len(d) // 2], "not a valid safetensors"),
    "wrong shapes": ("acme-support", _wrong_shapes, "expected [8, 128]"),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_uploads_are_refused(triton_server, folders, case):
    source, breaker, fragment = BAD_UPLOADS[case]
    config, weights = read_adapter_folder(folders[source])
    weights = breaker(weights) if breaker else weights
    for name in ("support", "brand-new"):  # replacing an existing adapter, and a new name
        message = refused(triton_server, "upload", name, config, weights, headers=key("acme"))
        assert fragment in message, message
    assert call(triton_server, "info", "support", headers=key("acme"))["rank"] == 8


def test_a_regex_bomb_in_the_config_is_refused_and_the_stub_serves_on(triton_server, folders):
    """Nested counted repeats that regex.compile would unroll into 8 million atoms (2.1 GB): refused before compiling."""
    config, weights = read_adapter_folder(folders["acme-support"])
    bomb = json.dumps({**json.loads(config), "target_modules": "(?:(?:(?:a{200}){200}){200})"})
    message = refused(triton_server, "upload", "bomb", bomb, weights, headers=key("acme"))
    assert "target_modules pattern" in message and "expands past 1024 atoms" in message, message
    assert "adapters" in call(triton_server, "list", headers=key("acme"))  # the stub still answers


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "x" * 65, "caf\u00e9", "", "..", "../../etc/passwd",
                                  "a\\b", "x\ny"], ids=repr)
def test_unsafe_names_are_refused(triton_server, folders, name):
    config, weights = read_adapter_folder(folders["acme-support"])
    assert "invalid adapter name" in refused(triton_server, "upload", name, config, weights, headers=key("acme"))
    for action in ("info", "delete"):
        assert "invalid adapter name" in refused(triton_server, action, name, headers=key("acme"))


def test_inputs_that_do_not_fit_the_action_are_refused(triton_server):
    assert "unknown action 'rename'" in refused(triton_server, "rename", "x", headers=key("acme"))
    assert "upload needs the input(s) adapter_config, adapter_weights" in refused(
        triton_server, "upload", "x", headers=key("acme"))
    assert "list takes no input(s) adapter_config" in refused(triton_server, "list", "x", "{}", headers=key("acme"))


def test_20_replacements_under_one_name_leave_the_current_and_two_retired_versions(triton_server, folders):
    """max_adapters 2 counts every version on disk: one current and two replaced ones (kept for requests in
    flight), then each further replacement is refused and leaves the store unchanged."""
    config, weights = read_adapter_folder(folders["acme-support"])
    versions = STORE / ".tenants" / hashlib.sha256(b"versioned").hexdigest()[:32] / "versions" / "x"
    for i in range(20):
        variant = weights[:-4] + struct.pack("<f", 0.001 * (i + 1))  # the last float: a distinct version
        if i < 3:
            assert call(triton_server, "upload", "x", config, variant, key("versioned"))["name"] == "x"
            continue
        message = refused(triton_server, "upload", "x", config, variant, headers=key("versioned"))
        assert message.startswith("tenant 'versioned' already has 3 adapter version(s) on disk (1 current and "
                                  "2 replaced or deleted, kept 600 s for requests in flight (the oldest is removed "
                                  "in "), message
        assert message.endswith("s)), its max_adapters quota (2 plus the version a replacement retires): retry then")
    assert len(list(versions.iterdir())) == 3
    assert call(triton_server, "info", "x", headers=key("versioned"))["digest"] == hashlib.sha256(
        len(config.encode()).to_bytes(8, "little") + config.encode()
        + weights[:-4] + struct.pack("<f", 0.003)).hexdigest()


# replicas, restart ---------------------------------------------------------------------------

def test_a_second_replica_sees_the_uploads_and_each_others_changes(triton_server, replica_b, folders):
    a_list = call(triton_server, "list", headers=key("acme"))
    assert a_list == call(replica_b, "list", headers=key("acme"))  # a fresh server: the uploads survived
    assert {"support", "acme-private"} <= {x["name"] for x in a_list["adapters"]}
    uploaded = upload_adapter(replica_b.grpc_url, "from-b", folders["acme-v2"], headers=key("acme"))
    assert call(triton_server, "info", "from-b", headers=key("acme")) == uploaded
    call(triton_server, "delete", "from-b", headers=key("acme"))
    assert refused(replica_b, "info", "from-b", headers=key("acme"), code="NOT_FOUND") == "adapter 'from-b' not found"


# generation: each tenant its own adapter --------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


def _generate(server, tenant: str, prompt: str, lora: str | None):
    params = dict(GREEDY, **({"lora_name": lora} if lora else {}))
    return stream_generate(server.grpc_url, prompt, params, headers=key(tenant), return_logprobs=True)


def test_same_named_uploads_serve_each_tenant_its_own(triton_server, folders, demo, tokenizer):
    upload_adapter(triton_server.grpc_url, "shared-name", folders["acme-support"], headers=key("acme"))
    upload_adapter(triton_server.grpc_url, "shared-name", folders["globex-support"], headers=key("globex"))
    prompt = "Tenants share one base model"
    ids = tokenizer(prompt).input_ids
    outputs = {}
    for tenant, folder in (("acme", folders["acme-support"]), ("globex", folders["globex-support"])):
        result = _generate(triton_server, tenant, prompt, "shared-name")
        assert result.error is None, result.error
        outputs[tenant] = token_ids_of(result)
        assert outputs[tenant] == greedy_tokens(str(demo["model"]), str(folder), ids, GREEDY["max_tokens"]), tenant
    assert outputs["acme"] != outputs["globex"]


def test_another_tenants_adapter_cannot_be_used_and_fails_like_a_missing_name(triton_server, folders):
    before = _generate(triton_server, "globex", "hello", "acme-only")
    upload_adapter(triton_server.grpc_url, "acme-only", folders["acme-support"], headers=key("acme"))
    after = _generate(triton_server, "globex", "hello", "acme-only")
    assert before.error is not None and after.error is not None
    assert after.error.message() == before.error.message()
    assert "acme-only" in before.error.message()
    assert _generate(triton_server, "acme", "hello", "acme-only").error is None


def test_an_upload_through_one_replica_is_served_by_the_other_at_once(triton_server, replica_b, folders, demo,
                                                                        tokenizer):
    prompt = "replicas share the store"
    ids = tokenizer(prompt).input_ids
    for folder in (folders["acme-support"], folders["acme-v2"]):  # a new name, then a new version of it
        upload_adapter(triton_server.grpc_url, "roaming", folder, headers=key("acme"))
        result = _generate(replica_b, "acme", prompt, "roaming")
        assert result.error is None, result.error
        assert token_ids_of(result) == greedy_tokens(str(demo["model"]), str(folder), ids, GREEDY["max_tokens"])
    call(replica_b, "delete", "roaming", headers=key("acme"))
    assert _generate(triton_server, "acme", prompt, "roaming").error is not None


# ---- request quotas (tenants `metered` and `queued` of the tenants file) ------------------------
def test_tokens_per_minute_refuses_with_unavailable_once_the_minute_is_spent(triton_server):
    headers = {"x-api-key": KEYS["metered"]}
    too_big = stream_generate(triton_server.grpc_url, "spend", {"max_tokens": 40}, headers=headers)
    assert "more than the tenant's tokens_per_minute=40; lower max_tokens or n" in str(too_big.error)
    first = stream_generate(triton_server.grpc_url, "spend", {"max_tokens": 30, "ignore_eos": True,
                                                             "temperature": 0}, headers=headers)
    assert first.error is None and first.final_count == 1  # 6 prompt tokens + 30 reserved, all used
    refused = stream_generate(triton_server.grpc_url, "more", {"max_tokens": 2}, headers=headers)
    assert refused.error is not None and "tokens_per_minute=40 (36 tokens served or reserved" in str(refused.error)
    assert "retry later" in str(refused.error)
    other = stream_generate(triton_server.grpc_url, "others are served", {"max_tokens": 2},
                            headers={"x-api-key": KEYS["acme"]})
    assert other.error is None


def test_max_queued_requests_refuses_and_max_concurrent_requests_queues(triton_server):
    headers = {"x-api-key": KEYS["queued"]}
    results = {}

    def run(name, max_tokens):
        results[name] = stream_generate(triton_server.grpc_url, name, {"max_tokens": max_tokens,
                                                                        "ignore_eos": True}, headers=headers)

    running = threading.Thread(target=run, args=("running", 1000))  # in flight for 0.5 s and more
    running.start()
    assert wait_for_metric(triton_server, "loraplex_num_sequences", 1.0, state="running") == 1.0
    waiting = threading.Thread(target=run, args=("waiting", 4))
    waiting.start()  # over max_concurrent_requests=1: it queues
    assert wait_for_metric(triton_server, "loraplex_num_sequences", 1.0, state="waiting") == 1.0
    refused = stream_generate(triton_server.grpc_url, "refused", {"max_tokens": 2}, headers=headers)
    assert refused.error is not None and "max_queued_requests=1" in str(refused.error)
    running.join(120)
    waiting.join(120)
    assert results["running"].error is None and results["waiting"].error is None
    assert results["waiting"].final_count == 1
