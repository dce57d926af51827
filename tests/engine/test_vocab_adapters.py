"""Adapters beyond the seven projections (issue 40 item 2, decision 067), exact against transformers + peft: LoRA on
embed_tokens and on lm_head, and trainable tokens (two adapters training the same ids with different rows), mixed
with base rows and a projection adapter in one batch, on an untied Llama (the native one-call decode, the torch path
and the kernels on the shim), a tied one (the lm_head reads the trained rows) and Gemma 2 (the embedding's rows
change before its scale, the lm_head's logits before its soft-cap). Greedy tokens equal peft's, and each step's
logprob of the chosen token equals peft's teacher-forced log-softmax."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from family_checkpoints import DENSE_FAMILIES, SMALL
from exactness import assert_matches_oracle, run_greedy_logprobs

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.kernels import dispatch
from loraplex.models.llama import AttentionBatch

MAX_TOKENS = 8
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "untied": dict(TINY),  # the demo model's family: Llama, lm_head apart from the embedding
    "tied": dict(TINY, tie_word_embeddings=True),  # the lm_head reads the trained tokens' rows too
    "gemma2": {**SMALL, **DENSE_FAMILIES["gemma2"], "num_hidden_layers": 2},  # embedding scale, final soft-cap
}
# bytes of the prompts (id = 3 + byte): ' ', 'e', 'o', 'h', 'T'; tok-a and tok-b train the same ids
TRAINED = [3 + ord(c) for c in " eohT"]
PROMPTS = {"base": "The quick brown fox", "embed": "Hello there, world", "lm": "To be or not to be",
           "tok-a": "The other one", "tok-b": "The other one", "mixed": "The quick brown fox"}


def build_adapter(model_dir: str, out, seed: int, save_embedding_layers="auto", **config) -> str:
    """A peft adapter with random non-zero LoRA weights and trained rows unlike the base rows."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = {"r": 8, "lora_alpha": 16, **config}
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_embedding_B" in name:
                p.mul_(0.02)  # peft leaves A and B at randn: a delta the size of the embedding's rows
            elif "lora_B" in name:
                p.mul_(0.3)
            elif "trainable_tokens_delta" in name:
                p.add_(p.std() * torch.randn_like(p))  # init: the base rows
    peft_model.save_pretrained(out, save_embedding_layers=save_embedding_layers)
    return str(out)


def build_adapters(model_dir: str, root, tied: bool = False) -> dict[str, str]:
    # tied embeddings: the mixed adapter ties its lm_head LoRA to the embedding's (peft's ensure_weight_tying)
    mixed = dict(ensure_weight_tying=True) if tied else dict(rank_pattern={"lm_head": 4})
    return {
        "embed": build_adapter(model_dir, root / "embed", 1, target_modules=["embed_tokens", "q_proj"]),
        "lm": build_adapter(model_dir, root / "lm", 2, save_embedding_layers=False, target_modules=["lm_head"],
                            r=4, lora_alpha=8, use_rslora=True),
        "tok-a": build_adapter(model_dir, root / "tok-a", 3, target_modules=["v_proj"], trainable_token_indices=TRAINED),
        "tok-b": build_adapter(model_dir, root / "tok-b", 4, target_modules=["v_proj"], trainable_token_indices=TRAINED),
        "mixed": build_adapter(model_dir, root / "mixed", 5, target_modules=["embed_tokens", "lm_head", "down_proj"],
                               **mixed),
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (model dir, adapters), each built on first use."""
    from loraplex.models.builtin.demo import build_tiny_llama

    cache = {}

    def get(name: str):
        if name not in cache:
            root = tmp_path_factory.mktemp(f"vocab-{name}")
            model_dir = str(build_tiny_llama(root / "model", **MODELS[name]))
            cache[name] = model_dir, build_adapters(model_dir, root, MODELS[name].get("tie_word_embeddings", False))
        return cache[name]

    return get


def run_batch(engine, batch: dict[str, str | None]):
    """Greedy requests (request id -> adapter or None) on PROMPTS[id], stepped to the end: (requests, tokens,
    logprobs)."""
    return run_greedy_logprobs(engine, {rid: (PROMPTS[rid], lora) for rid, lora in batch.items()}, MAX_TOKENS)


def assert_equal_peft(model_dir, adapters, batch, requests, tokens, logprobs, what):
    assert_matches_oracle(lambda lora: (model_dir, adapters.get(lora)),
                          {rid: (PROMPTS[rid], lora) for rid, lora in batch.items()}, requests, tokens, logprobs, what)


def engine_for(model_dir, adapters, max_loras=None):
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", max_model_len=128,
                                  num_kv_blocks=64, block_size=4, max_loras=max_loras or len(adapters),
                                  max_lora_rank=8, multi_lora=adapters))


BATCH = {"base": None, "embed": "embed", "lm": "lm", "tok-a": "tok-a", "tok-b": "tok-b", "mixed": "mixed"}


@pytest.mark.parametrize("model,mode", [("untied", "auto"), ("untied", "reference"), ("untied", "shim"),
                                        ("tied", "auto"), ("gemma2", "auto")])
def test_vocab_adapters_in_one_batch_equal_peft(built, monkeypatch, model, mode):
    monkeypatch.setenv(dispatch.ENV, mode)
    monkeypatch.setattr(dispatch, "MODE", dispatch.read_mode())
    model_dir, adapters = built(model)
    engine = engine_for(model_dir, adapters)
    requests, tokens, logprobs = run_batch(engine, BATCH)
    assert_equal_peft(model_dir, adapters, BATCH, requests, tokens, logprobs, f"{model}/{mode}")
    assert logprobs["tok-a"] != logprobs["tok-b"]  # one prompt, the same ids: each adapter's own rows
    assert engine.adapters.pinned_count() == 0


def test_multi_lora_fitting_reads_the_vocabulary_tensors(built, tmp_path):
    """multi_lora.json keeps adapters whose embed_tokens / lm_head tensors fit the base model (an lm_head-only
    adapter too) and skips one trained on another vocabulary, naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from loraplex.triton.model_config import adapter_mismatch, base_shapes, fitting_adapters

    model_dir, adapters = built("untied")
    assert fitting_adapters(adapters, model_dir) == adapters
    resized = tmp_path / "resized"
    shutil.copytree(adapters["embed"], resized)
    tensors = load_file(str(resized / "adapter_model.safetensors"))
    key = "base_model.model.model.embed_tokens.lora_embedding_A"
    tensors[key] = torch.zeros(8, tensors[key].shape[1] + 8)
    save_file(tensors, str(resized / "adapter_model.safetensors"))
    why = adapter_mismatch(str(resized), *base_shapes(model_dir))
    assert why is not None and why.startswith(f"{key} has shape [8, 272]"), why
    assert fitting_adapters({**adapters, "resized": str(resized)}, model_dir) == adapters


class EagerGraphs:
    """Stands in for the CUDA decode graphs on the CPU: each decode step "replays" the forward the graphs capture,
    run eagerly, which takes no vocabulary plan (a captured embedding lookup cannot see one)."""

    def __init__(self, runner):
        self.runner, self.replays = runner, 0

    def serves(self, step) -> bool:
        return step.is_decode

    def run(self, step, adapter_slots):
        r = self.runner
        attn = AttentionBatch(*(r._tensor(a) for a in (step.positions, step.slot_mapping, step.block_tables,
                                                        step.context_lens, step.cu)), True)
        lora = None if adapter_slots is None else r.lora.rows(r._tensor(np.asarray(adapter_slots, np.int32)))
        self.replays += 1
        return r.model.forward(r._tensor(step.input_ids), attn, r.kv_cache, lora)


@pytest.mark.parametrize("batch,replayed", [({"lm": "lm", "base": None}, True),
                                            ({"tok-a": "tok-a", "lm": "lm"}, False)],
                         ids=["lm_head-only", "embedding-rows"])
def test_decode_graphs_replay_only_steps_without_embedding_parts(built, batch, replayed):
    """A step whose rows' adapters change the embedding runs eagerly; lm_head parts come after the graph."""
    model_dir, adapters = built("untied")
    engine = engine_for(model_dir, adapters)
    engine.runner.graphs = graphs = EagerGraphs(engine.runner)
    requests, tokens, logprobs = run_batch(engine, batch)
    assert bool(graphs.replays) == replayed
    assert_equal_peft(model_dir, adapters, batch, requests, tokens, logprobs, "graphs")


def _edit(folder, config=None, tensors=None):
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    if config is not None:
        data = json.loads((folder / "adapter_config.json").read_text())
        config(data)
        (folder / "adapter_config.json").write_text(json.dumps(data))
    if tensors is not None:
        data = load_file(str(folder / "adapter_model.safetensors"))
        tensors(data)
        save_file(data, str(folder / "adapter_model.safetensors"))


EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"
REFUSED = {
    # a token added beyond the base vocabulary (264 rows): the logits would widen for every tenant
    "new-token": ("tok-a", dict(config=lambda c: c["trainable_token_indices"].__setitem__(-1, 264)),
                  "trainable_token_indices lists token id 264, outside the base model's vocabulary (0..263)"),
    "modules-to-save": ("tok-a", dict(config=lambda c: c.update(modules_to_save=["lm_head"])),
                        "modules_to_save (fully trained modules) is not supported: a fully trained embed_tokens or "
                        "lm_head is a [vocab x hidden] copy per adapter slot"),
    # peft's saved copy of the base embedding, from another checkpoint (checked against the served one at load)
    "other-base": ("embed", dict(tensors=lambda t: t[EMBED_COPY][5].add_(0.5)),
                   f"tensor {EMBED_COPY}, peft's copy of the base embed_tokens, differs from the served base model's "
                   f"(row 5)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_vocabulary_adapters_fail_their_requests_with_the_reason(built, tmp_path, case):
    import shutil

    source, edits, message = REFUSED[case]
    model_dir, adapters = built("untied")
    folder = tmp_path / case
    shutil.copytree(adapters[source], folder)
    _edit(folder, **edits)
    engine = engine_for(model_dir, {"bad": str(folder)}, max_loras=1)
    for rid, lora in (("bad", "bad"), ("base", None)):
        params = {"temperature": 0, "max_tokens": 2} | ({"lora_name": lora} if lora else {})
        engine.add_request(engine.make_request(rid, "Hello", SamplingParams.from_dict(params), "t"))
    errors, done = {}, set()
    while engine.has_work():
        for out in engine.step():
            errors[out.request_id] = out.error
            done.add(out.request_id)
    assert errors["base"] is None and done == {"bad", "base"}
    assert message in str(errors["bad"]), errors["bad"]
