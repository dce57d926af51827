"""Vocabulary adapters read as peft writes them (lora/vocab.py, decision 067): LoRA on embed_tokens / lm_head,
trainable tokens (tied to the lm_head as peft ties them), peft's base copies, the refusals with their reasons, the
bounds checked from the header before any tensor is allocated, and each slot's rows applied to its own rows only."""

from __future__ import annotations

import copy
import json
import struct

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_llama import tiny_config
from transformers import LlamaForCausalLM

from loraplex.exceptions import AdapterError
from loraplex.lora import adapter as adapter_module
from loraplex.lora import vocab as vocab_module
from loraplex.lora.adapter import load_peft_adapter, max_adapter_tensors, parse_peft_adapter
from loraplex.lora.store import max_weights_bytes
from loraplex.lora.vocab import (EMBED, LM_HEAD, MAX_TRAINABLE_TOKENS, VocabSlots, check_base_copies,
                                 max_vocab_bytes)

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_B = "base_model.model.model.embed_tokens.lora_embedding_B"
LM_A, LM_B = "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"
EMBED_ROWS = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
LM_ROWS = "base_model.model.lm_head.token_adapter.trainable_tokens_delta"
EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"
IDS = [5, 7, 299]


@pytest.fixture(scope="module")
def models():
    """tied -> (config, a tiny random Llama with or without tied embeddings)."""
    out = {}
    for tied in (False, True):
        config = tiny_config(tie_word_embeddings=tied)
        torch.manual_seed(0)
        out[tied] = config, LlamaForCausalLM(config).eval()
    return out


@pytest.fixture(scope="module")
def make(models, tmp_path_factory):
    """make(tied=False, seed=1, **LoraConfig kwargs) -> (folder, peft model); trained rows unlike the base's."""

    def build(tied=False, seed=1, **kw):
        kw.setdefault("target_modules", ["q_proj"])
        torch.manual_seed(seed)
        pm = get_peft_model(copy.deepcopy(models[tied][1]), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                        **kw))
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "trainable_tokens_delta" in name:
                    p.add_(torch.randn_like(p))
        folder = tmp_path_factory.mktemp("vocab-adapter")
        pm.save_pretrained(str(folder))
        return folder, pm

    return build


def load(folder, config, max_rank=16):
    return load_peft_adapter(folder, "t", config, max_rank)


def edit(folder, config=None, tensors=None):
    if config is not None:
        data = json.loads((folder / CONFIG).read_text())
        config(data)
        (folder / CONFIG).write_text(json.dumps(data))
    if tensors is not None:
        data = load_file(str(folder / WEIGHTS))
        tensors(data)
        save_file(data, str(folder / WEIGHTS))
    return folder


def copy_of(folder, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def test_lora_pairs_are_read_as_peft_computes_them(make, models):
    """A and B as peft holds them, its scaling (rank_pattern, rsLoRA), and peft's default base copies, checked
    against the base model and then dropped."""
    config, model = models[False]
    folder, pm = make(target_modules=["embed_tokens", "lm_head", "q_proj"], rank_pattern={"lm_head": 2},
                      use_rslora=True)
    vocab = load(folder, config).vocab
    embed, lm = pm.base_model.model.model.embed_tokens, pm.base_model.model.lm_head
    a, b, scale = vocab.embed_lora
    assert torch.equal(a, embed.lora_embedding_A["default"].detach()) and scale == embed.scaling["default"]
    assert torch.equal(b, embed.lora_embedding_B["default"].detach())
    a, b, scale = vocab.lm_lora
    assert torch.equal(a, lm.lora_A["default"].weight.detach()) and a.shape == (2, 64)
    assert torch.equal(b, lm.lora_B["default"].weight.detach()) and scale == lm.scaling["default"] == 8 / 2 ** 0.5
    assert set(vocab.base_copies) == {EMBED, LM_HEAD}  # save_embedding_layers: peft's default beside such a LoRA
    adapter = load(folder, config)
    check_base_copies(adapter, {EMBED: model.model.embed_tokens.weight, LM_HEAD: model.lm_head.weight}.get)
    assert adapter.vocab.base_copies == {}


def test_ensure_weight_tying_ties_the_lm_head_lora_to_the_embeddings(make, models):
    """With tied embeddings peft gives the lm_head the embedding's pair, transposed (A = B_emb.T, B = A_emb.T)."""
    folder, pm = make(tied=True, target_modules=["embed_tokens"], ensure_weight_tying=True)
    vocab = load(folder, models[True][0]).vocab
    (a_emb, b_emb, scale), (a, b, lm_scale) = vocab.embed_lora, vocab.lm_lora
    assert torch.equal(a, b_emb.t()) and torch.equal(b, a_emb.t()) and lm_scale == scale
    assert lm_scale == pm.base_model.model.lm_head.scaling["default"]
    edit(folder, tensors=lambda t: t[LM_A].mul_(2))
    with pytest.raises(AdapterError, match="ensure_weight_tying ties lm_head's LoRA to embed_tokens', but its "
                                           "tensors are not the embedding's transposed"):
        load(folder, models[True][0])


def test_a_base_copy_must_be_the_served_base_up_to_16_bit_rounding(make, models):
    config, model = models[False]
    folder, _ = make(target_modules=["embed_tokens"])
    base = model.model.embed_tokens.weight.detach()
    adapter = load(folder, config)
    check_base_copies(adapter, {EMBED: base.bfloat16().float()}.get)  # the base saved in bf16, served in fp32
    adapter = load(folder, config)
    other = base.clone()
    other[17, 3] *= 1.02
    with pytest.raises(AdapterError, match=r"peft's copy of the base embed_tokens, differs from the served base "
                                           r"model's \(row 17\)"):
        check_base_copies(adapter, {EMBED: other}.get)


@pytest.mark.parametrize("tied,indices,embed,lm", [
    (False, IDS, IDS, None),  # the input embedding only
    (True, IDS, IDS, "tied"),  # with tied embeddings the lm_head reads the same rows
    (True, {"embed_tokens": IDS, "lm_head": IDS}, IDS, "tied"),
    (True, {"embed_tokens": IDS, "lm_head": [8, 9]}, IDS, [8, 9]),  # other ids: rows of its own
    (False, {"lm_head": [8, 9]}, None, [8, 9]),
], ids=["list-untied", "list-tied", "dict-tied-same", "dict-tied-other", "lm_head-only"])
def test_trainable_tokens_as_peft_ties_them(make, models, tied, indices, embed, lm):
    folder, pm = make(tied=tied, trainable_token_indices=indices)
    saved = load_file(str(folder / WEIGHTS))
    vocab = load(folder, models[tied][0]).vocab
    if embed is None:
        assert vocab.embed_tokens is None
    else:
        assert vocab.embed_tokens[0].tolist() == embed and torch.equal(vocab.embed_tokens[1], saved[EMBED_ROWS])
    if lm == "tied":
        assert vocab.lm_tokens is vocab.embed_tokens and LM_ROWS not in saved
    elif lm is None:
        assert vocab.lm_tokens is None
    else:
        assert vocab.lm_tokens[0].tolist() == lm and torch.equal(vocab.lm_tokens[1], saved[LM_ROWS])


REFUSED = {
    "id-beyond-vocab": (dict(config=lambda c: c["trainable_token_indices"].__setitem__(-1, 300)),
                        "trainable_token_indices lists token id 300, outside the base model's vocabulary (0..299): "
                        "a token added beyond vocab_size would widen every tenant's logits"),
    "id-twice": (dict(config=lambda c: c["trainable_token_indices"].__setitem__(-1, 5)),
                 "trainable_token_indices lists a token id twice"),
    "ids-not-ints": (dict(config=lambda c: c.update(trainable_token_indices=[5, "7", 299])),
                     "trainable_token_indices must be a non-empty list of token ids"),
    "too-many-ids": (dict(config=lambda c: c.update(trainable_token_indices=list(range(MAX_TRAINABLE_TOKENS + 1)))),
                     f"lists {MAX_TRAINABLE_TOKENS + 1} token ids; at most {MAX_TRAINABLE_TOKENS} are served"),
    "other-module": (dict(config=lambda c: c.update(trainable_token_indices={"q_proj": IDS})),
                     "trainable_token_indices names module 'q_proj'; only embed_tokens and lm_head are served"),
    "rows-without-ids": (dict(config=lambda c: c.update(trainable_token_indices=None)),
                         f"tensor {EMBED_ROWS} trains tokens of embed_tokens, which trainable_token_indices does "
                         f"not name"),
    "ids-without-rows": (dict(tensors=lambda t: t.pop(EMBED_ROWS)),
                         "trainable_token_indices trains embed_tokens but the weights have no embed_tokens."
                         "token_adapter.trainable_tokens_delta"),
    "rows-miscounted": (dict(config=lambda c: c.update(trainable_token_indices=[5, 7])),
                        f"tensor {EMBED_ROWS} has shape [3, 64], expected [2, 64]"),
    "lora-and-tokens": (dict(config=lambda c: c.update(target_modules=["q_proj", "embed_tokens"])),
                        "embed_tokens is in target_modules and in trainable_token_indices; peft does not allow both"),
    "modules-to-save-config": (dict(config=lambda c: c.update(modules_to_save=["lm_head"])),
                               "modules_to_save (fully trained modules) is not supported: a fully trained "
                               "embed_tokens or lm_head is a [vocab x hidden] copy per adapter slot (decision 067)"),
    "modules-to-save-tensor": (dict(tensors=lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(
        300, 64)})), "tensor base_model.model.lm_head.weight: modules_to_save (fully trained modules)"),
    "dora-embedding": (dict(config=lambda c: c.update(target_modules=["embed_tokens"], trainable_token_indices=None,
                                                      use_dora=True),
                            tensors=lambda t: t.update({EMBED_A: torch.zeros(4, 300), EMBED_B: torch.zeros(64, 4)})
                            or [t.pop(k) for k in list(t) if "layers" in k or "token_adapter" in k]),
                       "DoRA (use_dora) on embed_tokens is not supported"),
    "base-copy-alone": (dict(tensors=lambda t: t.update({EMBED_COPY: torch.zeros(300, 64)})),
                        f"tensor {EMBED_COPY} is a copy of the base embed_tokens, saved only beside a LoRA on it"),
    "untargeted-pair": (dict(tensors=lambda t: t.update({LM_A: torch.zeros(4, 64), LM_B: torch.zeros(300, 4)})),
                        f"tensor {LM_A} is for lm_head, which adapter_config.json does not target"),
    "unknown-name": (dict(tensors=lambda t: t.update({"base_model.model.lm_head.lora_C.weight": torch.zeros(1)})),
                     "unexpected tensor name base_model.model.lm_head.lora_C.weight on lm_head"),
    "nan-rows": (dict(tensors=lambda t: t[EMBED_ROWS].__setitem__((0, 0), float("nan"))),
                 f"tensor {EMBED_ROWS} contains NaN or infinite values"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_name_the_field_and_the_reason(make, models, tmp_path, case):
    good, _ = make(trainable_token_indices=IDS)
    edits, message = REFUSED[case]
    folder = edit(copy_of(good, tmp_path), **edits)
    with pytest.raises(AdapterError) as info:
        load(folder, models[False][0])
    assert message in str(info.value), str(info.value)


def _file(tensors: dict[str, tuple[str, list[int]]]) -> bytes:
    """A safetensors file of zero-filled tensors: name -> (dtype, shape)."""
    sizes = {"F32": 4, "F64": 8}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


@pytest.mark.parametrize("tensors,message", [
    ({EMBED_A: ("F32", [65, 300]), EMBED_B: ("F32", [64, 65])}, f"tensor {EMBED_A} has rank 65; the server's "
                                                                 f"max_lora_rank is 64"),
    ({EMBED_A: ("F32", [4, 308]), EMBED_B: ("F32", [64, 4])}, f"tensor {EMBED_A} has shape [4, 308], expected "
                                                              f"[4, 300] (the base model's vocab_size"),
    ({EMBED_ROWS: ("F32", [301, 64])}, f"tensor {EMBED_ROWS} has 301 rows; an adapter trains at most 300 token ids"),
    ({EMBED_COPY: ("F64", [300, 64])}, f"tensor {EMBED_COPY} (peft's copy of the base embed_tokens) is F64; at most "
                                       f"4-byte floats"),
    ({EMBED_COPY: ("F32", [308, 64])}, f"tensor {EMBED_COPY} has shape [308, 64], expected [300, 64]"),
], ids=["rank", "resized-vocab", "rows", "f64-copy", "resized-copy"])
def test_shapes_are_bounded_from_the_header_before_any_tensor_is_allocated(models, monkeypatch, tensors, message):
    monkeypatch.setattr(adapter_module, "load_safetensors", lambda data: pytest.fail("tensors were allocated"))
    config = json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["embed_tokens"]}).encode()
    with pytest.raises(AdapterError) as info:
        parse_peft_adapter(config, _file(tensors), "t", models[False][0], 64)
    assert message in str(info.value), str(info.value)


def test_tensor_and_byte_bounds_count_the_vocabulary(models):
    """The header may list 8 more tensors (A, B, the trained rows and peft's base copy of either module); an upload
    may be as large as both pairs at max_lora_rank and MAX_TRAINABLE_TOKENS rows in F64 plus two F32 base copies."""
    config = models[False][0]
    assert max_adapter_tensors(config) == 2 * 2 * 7 + 8
    assert max_vocab_bytes(config, 64) == 8 * 2 * ((300 + 64) * 64 + MAX_TRAINABLE_TOKENS * 64) + 4 * 2 * 300 * 64
    largest = {EMBED_A: ("F64", [64, 300]), EMBED_B: ("F64", [64, 64]), LM_A: ("F64", [64, 64]),
               LM_B: ("F64", [300, 64]), EMBED_COPY: ("F32", [300, 64]),
               "base_model.model.lm_head.base_layer.weight": ("F32", [300, 64])}
    assert len(_file(largest)) < max_vocab_bytes(config, 64) < max_weights_bytes(config, 64)


def test_each_slot_sees_its_own_rows_for_the_same_token_ids():
    """Two slots train the same ids with different rows (tied: the lm_head reads them too), a third adds an
    embedding LoRA; base rows and the other slots' rows are left as they were."""
    vocab, hidden = 10, 4
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([2, 5])
    rows = {s: torch.randn(2, hidden, generator=gen) for s in (0, 2)}
    slots = VocabSlots(max_loras=3, device="cpu")
    for s in (0, 2):
        part = vocab_module.VocabAdapter(vocab_size=vocab, embed_tokens=(ids, rows[s]), lm_tokens=None)
        part.lm_tokens = part.embed_tokens
        slots.load(s, slots.prepare(type("A", (), {"vocab": part, "name": str(s)})()))
    a, b = torch.randn(3, vocab, generator=gen), torch.randn(hidden, 3, generator=gen)
    lora = vocab_module.VocabAdapter(vocab_size=vocab, embed_lora=(a, b, 0.5))
    slots.load(1, slots.prepare(type("A", (), {"vocab": lora, "name": "1"})()))
    # four sequences: slot 0 (2 tokens), base (1), slot 2 (2), slot 1 (1); every one ends on token 5
    seq_slots, cu = np.array([0, -1, 2, 1], np.int32), np.array([0, 2, 3, 5, 6], np.int32)
    input_ids = torch.tensor([5, 1, 5, 2, 5, 5])
    plan = slots.plan(seq_slots, cu, seq_slots, torch.from_numpy)
    table = torch.randn(vocab, hidden, generator=gen)
    h = plan.embed(table[input_ids], input_ids)
    want = table[input_ids].clone()
    want[0], want[3], want[4] = rows[0][1], rows[2][0], rows[2][1]
    want[5] += (a.t()[5] @ b.t()) * 0.5
    torch.testing.assert_close(h, want, rtol=0, atol=1e-6)
    hidden_states = torch.randn(4, hidden, generator=gen)
    logits = hidden_states @ table.t()
    want = logits.clone()
    want[0, ids], want[2, ids] = hidden_states[0] @ rows[0].t(), hidden_states[2] @ rows[2].t()
    plan.logits(logits, hidden_states)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-6)
    slots.clear(0)
    assert slots.plan(np.array([0], np.int32), np.array([0, 1], np.int32), np.array([0]), torch.from_numpy) is None
