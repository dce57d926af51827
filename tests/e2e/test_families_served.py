"""The new families through a real tritonserver, exact against transformers + peft, and through the OpenAI gateway
(issue 40).

One server for the module hosts one copy of lora_llm per family: each copy's config.pbtxt names its family's tiny
checkpoint (tests/support/family_checkpoints.py, moe_models.py) as ``model_dir`` and serves the family's adapters through
multi_lora.json in its version folder, beside an entry that is another family's and does not fit. LORAPLEX_MODEL_DIR is set empty, so
no copy is overridden by the environment. The Phi-3 copy is the one named ``lora_llm``, with ``lora_adapters`` on
the same checkpoint, so the gateway (``loraplex-openai --model-dir`` on that checkpoint) fronts it.

Each streamed greedy request (base rows and every adapter kind, sent together so they share batches) equals
transformers + peft token for token, with one final response, and each token's logprob equals the teacher-forced
log-softmax. The dense families' adapters: attention, all-linear, rsLoRA, DoRA (Phi-3's on its fused projections);
Qwen3-MoE's: attention, LoRA on the fused experts (peft's target_parameters), all-linear with the router, and
per-expert modules as transformers 4.x wrote them (oracle: transformers on the merged weights). A prompt of 3x the sliding window makes the windowed layers attend to part of it only. /v1/models lists
the Phi-3 adapters multi_lora.json gives (not the one that does not fit), and a completion on one equals peft.

One more copy serves the windowed Qwen2 checkpoint with ``quantization: int8`` in its config.pbtxt's engine_config
(issue 41): its LoRA and DoRA adapters equal transformers + peft on the int8-dequantized weights, and its config and
``loraplex_model_info`` say int8.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from family_checkpoints import ADAPTERS, WINDOW, build_family
from helpers import run_gateway
from moe_models import ATTENTION, EXPERT_NAMES, MOE_FAMILIES, build_adapter, build_moe, merged_model, per_expert_adapter
from quant_checkpoints import write_load_quantized
from tritonserver_fixture import DEFAULT_MODEL_REPOSITORY, demo_server

from loraplex.clients.generate import stream_generate

# Soft-capping, sandwich norms, GeGLU (gemma2); q/k norms, local/global windows and rotary bases, tied embeddings
# (gemma3); fused projections and partial rotary (phi3); q/k norms, head_dim decoupled from hidden / heads, top-k
# routing with norm_topk_prob, a dense layer among the sparse ones (qwen3moe); q/k norms and tied embeddings
# (qwen3); windows on every layer, blocks behind them freed (mistral-window) and past max_window_layers
# (qwen2-window); Mixtral's experts (mixtral). Each lora_llm stub costs ~4 s of CPU to start.
FAMILIES = ("gemma2", "gemma3", "phi3", "qwen3", "mistral-window", "qwen2-window", "qwen3moe", "mixtral", "qwen2-int8")
MOE = ("qwen3moe", "mixtral")
QUANTIZED = {"qwen2-int8": ("qwen2-window", "int8", ("attn", "dora"))}  # copy -> (family, quantization, its adapters)
GATEWAY_FAMILY = "phi3"  # served as lora_llm, behind the gateway
SERVED_NAME = "phi3-tiny"  # the gateway's id of its base model
MISFIT = "misfit"  # in each copy's multi_lora.json: an adapter of another family, on modules this one lacks
PROMPTS = ("The quick brown fox jumps over", "ab" * (3 * WINDOW // 2))
MAX_TOKENS = 10
LOGPROB_ATOL = 2e-4  # fp32 throughout, as tests/engine/test_families.py
HEADERS = {"x-tenant-id": "acme"}
MODEL_DIR_PARAMETER = re.compile(r'(key: "model_dir"\s*value: \{ string_value: )"[^"]*"')
ENGINE_CONFIG_PARAMETER = re.compile(r'(key: "engine_config"\s*value: \{ string_value: )"\{\}"')


def model_name(family: str) -> str:
    """The Triton model serving ``family``."""
    return "lora_llm" if family == GATEWAY_FAMILY else f"lora_llm_{family}"


def copy_model(repo: Path, src: str, name: str, model_dir: str, engine_config: dict | None = None) -> Path:
    """model_repository/<src> copied as ``name``, its model_dir parameter set to ``model_dir`` (and its engine_config
    to ``engine_config`` when given)."""
    target = repo / name
    (target / "1").mkdir(parents=True)
    (target / "1" / "model.py").write_text((DEFAULT_MODEL_REPOSITORY / src / "1" / "model.py").read_text())
    config = (DEFAULT_MODEL_REPOSITORY / src / "config.pbtxt").read_text()
    config, named = re.subn(rf'^name: "{src}"$', f'name: "{name}"', config, flags=re.M)
    config, dirs = MODEL_DIR_PARAMETER.subn(rf'\1"{model_dir}"', config)
    assert named == dirs == 1, f"model_repository/{src}/config.pbtxt changed shape"
    if engine_config:
        text = json.dumps(json.dumps(engine_config))  # a pbtxt string holding the JSON
        config, n = ENGINE_CONFIG_PARAMETER.subn(lambda m: m.group(1) + text, config)
        assert n == 1, f"model_repository/{src}/config.pbtxt changed shape"
    (target / "config.pbtxt").write_text(config)
    return target


@dataclass
class Family:
    model_dir: str
    adapters: dict[str, str]  # name -> peft folder
    oracles: dict[str | None, tuple[str, str | None]]  # adapter (None: base) -> (transformers model, peft adapter)


def dense_family(root: Path, name: str) -> Family:
    model_dir, adapters = build_family(root, name)
    return Family(model_dir, adapters, {None: (model_dir, None), **{a: (model_dir, adapters[a]) for a in adapters}})


def moe_family(root: Path, name: str) -> Family:
    model_dir = build_moe(root, name)
    root = root / name
    experts = list(EXPERT_NAMES[MOE_FAMILIES[name]["model_type"]])
    adapters = {"attn": build_adapter(model_dir, root / "attn", 8, 16, 11, ATTENTION),
                # target_modules on the experts: peft (transformers 5) saves them as target_parameters
                "experts": build_adapter(model_dir, root / "experts", 4, 8, 12, ["q_proj", *experts]),
                "all-linear": build_adapter(model_dir, root / "all", 4, 4, 16, "all-linear"),
                "per-expert": per_expert_adapter(model_dir, root / "per-expert", 4, 8, 14)}
    oracles = {None: (model_dir, None), **{a: (model_dir, adapters[a]) for a in ("attn", "experts", "all-linear")},
               "per-expert": (merged_model(model_dir, adapters["per-expert"], root / "merged"), None)}
    return Family(model_dir, adapters, oracles)


def family_repository(repo: Path, families: dict[str, Family]) -> Path:
    """A lora_llm copy per family on its checkpoint, its adapters and a misfit in multi_lora.json; lora_adapters
    on the gateway family's checkpoint."""
    repo.mkdir(parents=True, exist_ok=True)
    for name, family in families.items():
        quantization = {"quantization": QUANTIZED[name][1]} if name in QUANTIZED else None
        target = copy_model(repo, "lora_llm", model_name(name), family.model_dir, quantization)
        # Phi-3's fused projections are no other family's: its adapters fit no other family, and theirs not Phi-3
        other = next(o for o in families if (o == "phi3") != (name == "phi3"))
        misfit = next(iter(families[other].adapters.values()))
        (target / "1" / "multi_lora.json").write_text(json.dumps({**family.adapters, MISFIT: misfit}))
    copy_model(repo, "lora_adapters", "lora_adapters", families[GATEWAY_FAMILY].model_dir)
    return repo


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("families")
    families = {name: (moe_family if name in MOE else dense_family)(root, name) for name in FAMILIES
                if name not in QUANTIZED}
    for name, (base, method, adapters) in QUANTIZED.items():
        family = families[base]
        oracle = write_load_quantized(family.model_dir, root / name, method)  # the weights int8 at load serves
        model_dir = shutil.copytree(family.model_dir, root / name / "model")  # its own path in the log's lines
        families[name] = Family(str(model_dir), {a: family.adapters[a] for a in adapters},
                                {None: (oracle, None), **{a: (oracle, family.adapters[a]) for a in adapters}})
    return families


@pytest.fixture(scope="module")
def triton_server(families, demo, tmp_path_factory):
    server = demo_server(tmp_path_factory.mktemp("tritonserver-families"), demo,
                         model_repository=lambda repo: family_repository(repo, families),
                         adapter_store=lambda store, _demo: store, env={"LORAPLEX_MODEL_DIR": ""},
                         engine_config={"block_size": 4, "num_kv_blocks": 128, "max_loras": 4, "max_lora_rank": 16},
                         ready_timeout=180.0)
    t0 = time.monotonic()
    try:
        server.start_and_wait()
    except Exception as exc:  # noqa: BLE001 - TritonServerError: the log's tail says why
        pytest.fail(f"tritonserver did not start with {len(families)} families: {exc}", pytrace=False)
    print(f"tritonserver with {len(families)} lora_llm copies ready in {time.monotonic() - t0:.1f} s")
    try:
        yield server
    finally:
        server.stop(grace=10)


def chosen(result) -> list[tuple[int, float]]:
    """(token id, logprob) of each token chosen, from the streamed logprobs outputs."""
    pairs = []
    for response in result.responses:
        for entry in json.loads(response["logprobs"][0]) or []:
            token, info = next(iter(entry.items()))
            pairs.append((int(token), float(info["logprob"])))
    return pairs


@pytest.fixture(scope="module")
def served(triton_server, families):
    """(family, prompt, adapter or None) -> the server's StreamResult; every request in flight together."""
    jobs = [(name, prompt, lora) for name, family in families.items() for prompt in PROMPTS
            for lora in (None, *family.adapters)]

    def run(job):
        name, prompt, lora = job
        params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0,
                  **({"lora_name": lora} if lora else {})}
        return stream_generate(triton_server.grpc_url, prompt, params, headers=HEADERS, model=model_name(name),
                               timeout=120, return_logprobs=True)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_served_equals_transformers_and_peft(name, served, families):
    from peft_reference import teacher_forced_logits
    from transformers import AutoTokenizer

    family = families[name]
    tokenizer = AutoTokenizer.from_pretrained(family.model_dir)
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        for lora in (None, *family.adapters):
            result = served[name, prompt, lora]
            where = f"{name} {lora or 'base'} {prompt!r}"
            assert result.error is None and result.final_count == 1, (where, result.error)
            tokens, logprobs = zip(*chosen(result))
            assert len(tokens) == MAX_TOKENS, where
            ref = teacher_forced_logits(*family.oracles[lora], prompt_ids, list(tokens))
            assert list(tokens) == ref.argmax(-1).tolist(), f"{where}: greedy tokens differ from transformers + peft"
            want = torch.log_softmax(ref, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(logprobs), want, atol=LOGPROB_ATOL, rtol=0,
                                       msg=lambda m, where=where: f"{where}: {m}")


def test_an_adapter_of_another_family_is_skipped_by_each_copy(triton_server, families):
    log = Path(triton_server.log_path).read_text(errors="replace")
    for name, family in families.items():
        skipped = [line for line in log.splitlines()
                   if f"skipping adapter '{MISFIT}'" in line and family.model_dir in line]
        # lora_llm's start-up; lora_adapters reads the file once it is asked
        assert len(skipped) == 1 and "does not fit the served base model" in skipped[0], (name, skipped)
        result = stream_generate(triton_server.grpc_url, PROMPTS[0], {"lora_name": MISFIT, "max_tokens": 2},
                                 headers=HEADERS, model=model_name(name))
        assert result.error is not None and f"LoRA {MISFIT} is not supported" in str(result.error), name


@pytest.fixture(scope="module")
def gateway(triton_server, families, tmp_path_factory):
    """``loraplex-openai --model-dir`` on the Phi-3 checkpoint in front of the module's server; yields its URL."""
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with run_gateway(triton_server.grpc_url, families[GATEWAY_FAMILY].model_dir, log, "--served-model-name",
                     SERVED_NAME) as url:
        yield f"{url}/v1"


def test_the_gateway_lists_and_serves_the_phi3_adapters(gateway, families):
    from peft_reference import greedy_tokens
    from transformers import AutoTokenizer

    family = families[GATEWAY_FAMILY]
    sdk = openai.OpenAI(base_url=gateway, api_key="none", max_retries=0, default_headers=HEADERS)
    models = [(m.id, m.parent) for m in sdk.models.list().data]
    assert models == [(SERVED_NAME, None), *((a, SERVED_NAME) for a in sorted(ADAPTERS))]
    tokenizer = AutoTokenizer.from_pretrained(family.model_dir)
    for model, lora in ((SERVED_NAME, None), ("all", "all")):
        reply = sdk.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
        want = greedy_tokens(*family.oracles[lora], tokenizer(PROMPTS[0]).input_ids, MAX_TOKENS, ignore_eos=True)
        assert reply.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), model
        assert reply.usage.completion_tokens == MAX_TOKENS


def test_the_int8_copy_says_int8_in_its_config_and_metrics(triton_server, served):
    """The quantized copy's model config carries its quantization, and its model-info gauge the served format."""
    import urllib.request

    name = model_name("qwen2-int8")
    with urllib.request.urlopen(f"http://{triton_server.http_address}/v2/models/{name}/config", timeout=10) as r:
        config = json.loads(r.read())
    assert json.loads(config["parameters"]["engine_config"]["string_value"]) == {"quantization": "int8"}
    with urllib.request.urlopen(triton_server.metrics_url, timeout=10) as r:
        metrics = r.read().decode()
    info = [line for line in metrics.splitlines() if line.startswith("loraplex_model_info{")]
    ours = [line for line in info if f'model="{name}"' in line]
    assert len(ours) == 1 and 'quantization="int8"' in ours[0] and 'checkpoint_format="none"' in ours[0] \
        and ours[0].endswith(" 1"), info
    assert all('quantization="none"' in line for line in info if line not in ours), info
