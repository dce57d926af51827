"""multi_lora.json with LORAPLEX_MODEL_DIR: entries that fit the served base model by shape are served (equal to
transformers + peft), the others are skipped with one warning line each naming the entry and the mismatch.

The model repository is a copy whose config.pbtxt names a model_dir that does not exist there: the served
checkpoint is LORAPLEX_MODEL_DIR's (the demo model), as with any operator's override.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tiny_llama import tiny_config
from tritonserver_fixture import copy_model_repository, make_triton_server_fixture
from transformers import AutoConfig, LlamaForCausalLM

from loraplex.clients.adapters import adapter_request
from loraplex.clients.generate import stream_generate

PROMPT = "The quick brown fox"
HEADERS = {"x-tenant-id": "acme"}


def repository(tmp: Path) -> Path:
    """lora_llm + lora_adapters with a multi_lora.json of one fitting entry and two that do not."""
    from loraplex.models.builtin.demo import build_demo, default_out_dir

    demo = build_demo(default_out_dir())
    repo = copy_model_repository(tmp)
    adapters = tmp.parent / "multi"
    shutil.copytree(demo["demo-b"], adapters / "fits", dirs_exist_ok=True)
    base = AutoConfig.from_pretrained(demo["model"]).to_dict()
    torch.manual_seed(0)
    wider = LlamaForCausalLM(tiny_config(**{**{k: base[k] for k in ("vocab_size", "num_hidden_layers",
                                                                    "num_attention_heads", "num_key_value_heads",
                                                                    "intermediate_size")},
                                            "hidden_size": base["hidden_size"] * 2})).eval()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(wider), config).save_pretrained(str(adapters / "wider"))
    entries = {"fits": str(adapters / "fits"), "wider": str(adapters / "wider"), "absent": str(adapters / "none")}
    (repo / "lora_llm" / "1" / "multi_lora.json").write_text(json.dumps(entries))
    for model in ("lora_llm", "lora_adapters"):
        pbtxt = repo / model / "config.pbtxt"
        text = pbtxt.read_text()
        if "../../.cache/demo/model" in text:
            pbtxt.write_text(text.replace("../../.cache/demo/model", "../elsewhere/model"))
    return repo


triton_server = make_triton_server_fixture(model_repository=repository)


def skipped_lines(server) -> list[str]:
    return [line for line in Path(server.log_path).read_text(errors="replace").splitlines()
            if "skipping adapter" in line]


def test_fitting_entries_are_served_and_equal_peft(triton_server, demo):
    from peft_reference import greedy_tokens
    from transformers import AutoTokenizer

    result = stream_generate(triton_server.grpc_url, PROMPT, {"lora_name": "fits", "temperature": 0,
                                                               "max_tokens": 8, "ignore_eos": True}, headers=HEADERS)
    assert result.error is None, result.error
    tokenizer = AutoTokenizer.from_pretrained(demo["model"])
    want = tokenizer.decode(greedy_tokens(str(demo["model"]), str(demo["demo-b"]), tokenizer(PROMPT).input_ids, 8,
                                          ignore_eos=True), skip_special_tokens=True)
    assert result.text == want and want


def test_misfits_are_skipped_with_one_warning_each(triton_server):
    lines = skipped_lines(triton_server)  # lora_llm's start-up; lora_adapters has not read the file yet
    assert len([line for line in lines if "'wider'" in line]) == 1
    assert len([line for line in lines if "'absent'" in line]) == 1
    assert not [line for line in lines if "'fits'" in line]
    wider = next(line for line in lines if "'wider'" in line)
    assert "does not fit the served base model" in wider and "has shape" in wider
    for name in ("wider", "absent"):
        result = stream_generate(triton_server.grpc_url, PROMPT, {"lora_name": name, "max_tokens": 2},
                                 headers=HEADERS)
        assert result.error is not None and f"LoRA {name} is not supported" in str(result.error)


def test_lora_adapters_lists_the_fitting_entries_only(triton_server):
    result = adapter_request(triton_server.grpc_url, "list", headers=HEADERS)
    assert "fits" in result["shared"] and not {"wider", "absent"} & set(result["shared"])
    assert result["next"] is None
