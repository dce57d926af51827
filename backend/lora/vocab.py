"""Adapters on the vocabulary: LoRA on embed_tokens and lm_head, and peft's trainable tokens (decision 067).

peft writes them as (after ``base_model.model.``):
  model.embed_tokens.lora_embedding_A [r, vocab], .lora_embedding_B [hidden, r]   delta = (A.T[ids] @ B.T) * scale
  lm_head.lora_A.weight [r, hidden], lm_head.lora_B.weight [vocab, r]             delta = B (A x) * scale
  <embed_tokens | lm_head>.token_adapter.trainable_tokens_delta [n, hidden]       the n trained ids' rows, which
      replace the base rows (trainable_token_indices names the ids); with tied embeddings the lm_head reads the
      embedding's rows unless the config trains lm_head on other ids
  <embed_tokens | lm_head>.base_layer.weight [vocab, hidden]   peft's copy of the base weight, saved by default
      beside a LoRA on either: accepted only when it equals the served base weight (checked once, then dropped)

Each slot holds its adapter's parts at their own sizes, bounded by the checkpoint's (vocab, hidden,
max_lora_rank, MAX_TRAINABLE_TOKENS ids per module); a step's plan adds them to the rows of that slot only,
the embedding's before any embedding scale (Gemma) and the lm_head's before any final soft-cap, as peft.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.exceptions import AdapterError

EMBED, LM_HEAD = "model.embed_tokens", "lm_head"
VOCAB_MODULES = (EMBED, LM_HEAD)
SHORT = {EMBED: "embed_tokens", LM_HEAD: "lm_head"}
# names a config may give them (target_modules entries, trainable_token_indices keys)
CONFIG_NAMES = {"embed_tokens": EMBED, "model.embed_tokens": EMBED, "lm_head": LM_HEAD}
MAX_TRAINABLE_TOKENS = 1024  # token ids one adapter trains per module (embed_tokens, lm_head)
# per module: LoRA A and B, the trainable tokens' rows, peft's copy of the base weight
MAX_VOCAB_TENSORS = 2 * 4
_PREFIX = "base_model.model."
_KINDS = {EMBED: {"lora_embedding_A": "A", "lora_embedding_B": "B"},
          LM_HEAD: {"lora_A.weight": "A", "lora_B.weight": "B"}}
_NAMED = re.compile(r"^(?:(lora_[AB])\.(?!weight$)[\w-]+(\.weight)|(lora_embedding_[AB])\.[\w-]+)$")
_TOKENS, _BASE = "token_adapter.trainable_tokens_delta", "base_layer.weight"
_FLOATS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
BASE_COPY_RTOL = 2.0 ** -8  # a base copy saved in a 16-bit float rounds each value by at most this much
MODULES_TO_SAVE_REASON = (
    "modules_to_save (fully trained modules) is not supported: a fully trained embed_tokens or lm_head is a "
    "[vocab x hidden] copy per adapter slot (decision 067); train LoRA on embed_tokens / lm_head, or "
    "trainable_token_indices for new or retrained tokens, instead")


def vocab_module(tensor_name: str) -> tuple[str, str] | None:
    """(module, the name's rest) of a tensor on embed_tokens or lm_head; None for any other tensor."""
    short = tensor_name[len(_PREFIX):] if tensor_name.startswith(_PREFIX) else tensor_name
    for module in VOCAB_MODULES:
        if short.startswith(module + "."):
            return module, short[len(module) + 1:]
    return None


def max_vocab_bytes(hf_config, max_lora_rank: int) -> int:
    """Most bytes the vocabulary tensors of a valid adapter take: both LoRA pairs at max_lora_rank and the most
    trainable tokens in F64, and peft's two base copies in F32."""
    vocab, hidden = int(hf_config.vocab_size), int(hf_config.hidden_size)
    return 8 * 2 * ((vocab + hidden) * max_lora_rank + MAX_TRAINABLE_TOKENS * hidden) + 4 * 2 * vocab * hidden


def _kind(module: str, rest: str, tensor_name: str, where: str) -> str:
    """'A', 'B', 'T' (trainable tokens' rows) or 'base'; AdapterError naming what else the tensor is."""
    named = _NAMED.match(rest)  # an adapter-name segment (lora_A.default.weight), as adapter.py accepts
    if named:
        rest = named.group(3) or named.group(1) + named.group(2)
    if rest in _KINDS[module]:
        return _KINDS[module][rest]
    if rest == _TOKENS:
        return "T"
    if rest == _BASE:
        return "base"
    short = SHORT[module]
    if rest == "weight" or rest.startswith("modules_to_save"):
        raise AdapterError(f"{where}: tensor {tensor_name}: {MODULES_TO_SAVE_REASON}")
    if rest.startswith("lora_magnitude_vector"):
        raise AdapterError(f"{where}: tensor {tensor_name}: DoRA on {short} is not supported")
    if rest.endswith(".bias"):
        raise AdapterError(f"{where}: tensor {tensor_name}: LoRA bias (lora_bias) is not supported")
    raise AdapterError(f"{where}: unexpected tensor name {tensor_name} on {short}")


def check_vocab_header(header: dict[str, dict], hf_config, max_lora_rank: int, where: str) -> None:
    """The vocabulary tensors' shapes (and the base copies' dtypes) from the safetensors header, before any tensor
    is allocated: no larger than the checkpoint's shapes, max_lora_rank and MAX_TRAINABLE_TOKENS allow."""
    vocab, hidden = int(hf_config.vocab_size), int(hf_config.hidden_size)
    for tensor_name, entry in header.items():
        found = vocab_module(tensor_name)
        if found is None:
            continue
        module, rest = found
        kind, shape = _kind(module, rest, tensor_name, where), list(entry["shape"])
        if entry["dtype"] not in _FLOATS:
            raise AdapterError(f"{where}: tensor {tensor_name} has dtype {entry['dtype']}, expected a floating-point "
                               f"dtype")
        if kind == "base":
            expected, why = [vocab, hidden], "the base model's [vocab_size, hidden_size]"
            if _FLOATS[entry["dtype"]] > 4:
                raise AdapterError(f"{where}: tensor {tensor_name} (peft's copy of the base {SHORT[module]}) is "
                                   f"{entry['dtype']}; at most 4-byte floats are accepted")
        elif kind == "T":
            n = shape[0] if shape else 0
            if not 1 <= n <= min(vocab, MAX_TRAINABLE_TOKENS):
                raise AdapterError(f"{where}: tensor {tensor_name} has {n} rows; an adapter trains at most "
                                   f"{min(vocab, MAX_TRAINABLE_TOKENS)} token ids per module")
            expected, why = [n, hidden], "[token ids, hidden_size]"
        else:
            r = shape[0] if kind == "A" else (shape[1] if len(shape) == 2 else 0)
            if not 1 <= r <= max_lora_rank:
                raise AdapterError(f"{where}: tensor {tensor_name} has rank {r}; the server's max_lora_rank is "
                                   f"{max_lora_rank}")
            in_f, out_f = (vocab, hidden) if module == EMBED else (hidden, vocab)
            expected = [r, in_f] if kind == "A" else [out_f, r]
            why = "the base model's vocab_size and hidden_size"
        if shape != expected:
            raise AdapterError(f"{where}: tensor {tensor_name} has shape {shape}, expected {expected} ({why})")


@dataclass(slots=True)
class VocabAdapter:
    """One adapter's vocabulary parts in host memory (each None where it has none)."""

    vocab_size: int = 0
    embed_lora: tuple[torch.Tensor, torch.Tensor, float] | None = None  # A [r, vocab], B [hidden, r], scale
    lm_lora: tuple[torch.Tensor, torch.Tensor, float] | None = None  # A [r, hidden], B [vocab, r], scale
    embed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # ids int64 [n], rows float32 [n, hidden]
    lm_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # the same; tied: the embedding's
    # peft's saved copies of the base weights: module -> (tensor name, tensor), until checked (check_base_copies)
    base_copies: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((p[0].shape[0] for p in (self.embed_lora, self.lm_lora) if p is not None), default=0)

    def nbytes(self) -> int:
        lm_tokens = self.lm_tokens if self.lm_tokens is not self.embed_tokens else None
        parts = [*(self.embed_lora or ())[:2], *(self.lm_lora or ())[:2], *(self.embed_tokens or ()), *(lm_tokens or ())]
        return sum(t.nbytes for t in parts) + sum(t.nbytes for _, t in self.base_copies.values())

    def modules(self) -> list[str]:
        """The short names of the modules it changes."""
        return [SHORT[m] for m, parts in ((EMBED, (self.embed_lora, self.embed_tokens)),
                                          (LM_HEAD, (self.lm_lora, self.lm_tokens))) if any(p is not None for p in parts)]


def parse_vocab(cfg: dict, tensors: dict[str, torch.Tensor], targeted: Callable[[str], bool],
                rank_alpha: Callable[[str], tuple[int, float]], scale: Callable[[float, int], float], hf_config,
                max_lora_rank: int, dtype: torch.dtype, use_dora: bool, where: str) -> VocabAdapter | None:
    """The vocabulary parts of an adapter: its config (target_modules as ``targeted`` reads it per peft module name,
    ranks by ``rank_alpha``, trainable_token_indices, ensure_weight_tying) and the tensors vocab_module names
    (checked by check_vocab_header). None when it has none."""
    vocab, hidden = int(hf_config.vocab_size), int(hf_config.hidden_size)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    found: dict[str, dict[str, tuple[str, torch.Tensor]]] = {m: {} for m in VOCAB_MODULES}
    for tensor_name, t in tensors.items():
        module, rest = vocab_module(tensor_name)
        kind = _kind(module, rest, tensor_name, where)
        if kind in found[module]:
            raise AdapterError(f"{where}: duplicate tensors {found[module][kind][0]} and {tensor_name}")
        found[module][kind] = (tensor_name, t)
    lora_on = {m for m in VOCAB_MODULES if targeted(m)}
    tied_lora = cfg.get("ensure_weight_tying") is True and tied and EMBED in lora_on
    if tied_lora:
        lora_on.add(LM_HEAD)  # peft ties the lm_head's LoRA to the embedding's
    tokens = _token_indices(cfg.get("trainable_token_indices"), vocab, tied, where)
    out = VocabAdapter(vocab_size=vocab)
    for module in VOCAB_MODULES:
        short, have = SHORT[module], found[module]
        if module in lora_on and module in tokens:
            raise AdapterError(f"{where}: {short} is in target_modules and in trainable_token_indices; peft does not "
                               f"allow both on one module")
        if module in lora_on:
            if use_dora:
                raise AdapterError(f"{where}: DoRA (use_dora) on {short} is not supported")
            lora = _lora_pair(module, have, rank_alpha(module), scale, max_lora_rank, vocab, hidden, dtype, where)
            if module == EMBED:
                out.embed_lora = lora
            else:
                out.lm_lora = lora
        elif "A" in have or "B" in have:
            raise AdapterError(f"{where}: tensor {have.get('A', have.get('B'))[0]} is for {short}, which "
                               f"adapter_config.json does not target (target_modules)")
        if module in tokens and tokens[module] is not None:
            if "T" not in have:
                raise AdapterError(f"{where}: trainable_token_indices trains {short} but the weights have no "
                                   f"{short}.{_TOKENS}")
            ids = tokens[module]
            rows = _checked(*have["T"], (len(ids), hidden), where)
            part = (torch.tensor(ids, dtype=torch.int64), rows)
            if module == EMBED:
                out.embed_tokens = part
            else:
                out.lm_tokens = part
        elif "T" in have:
            raise AdapterError(f"{where}: tensor {have['T'][0]} trains tokens of {short}, which "
                               f"trainable_token_indices does not name" + (" (tied to embed_tokens: peft saves no "
                                                                             "rows of its own)" if module in tokens else ""))
        if "base" in have:
            if module not in lora_on:
                raise AdapterError(f"{where}: tensor {have['base'][0]} is a copy of the base {short}, saved only "
                                   f"beside a LoRA on it; {MODULES_TO_SAVE_REASON}")
            out.base_copies[module] = have["base"]
    if tied_lora and not (torch.equal(out.lm_lora[0], out.embed_lora[1].t())
                          and torch.equal(out.lm_lora[1], out.embed_lora[0].t())):
        raise AdapterError(f"{where}: ensure_weight_tying ties lm_head's LoRA to embed_tokens', but its tensors are "
                           f"not the embedding's transposed (peft would serve whichever it loaded last)")
    if tokens.get(LM_HEAD, 0) is None:
        out.lm_tokens = out.embed_tokens  # tied: the lm_head's rows are the embedding's
    if out.embed_lora is None and out.lm_lora is None and out.embed_tokens is None and out.lm_tokens is None:
        return None
    return out


def _token_indices(value, vocab: int, tied: bool, where: str) -> dict[str, list[int] | None]:
    """module -> the ids trainable_token_indices trains on it (None: the lm_head tied to the embedding's), as peft
    reads a list (the input embedding; with tied embeddings the lm_head too) or a dict of module names."""
    if value is None:
        return {}
    field_name = "trainable_token_indices"
    listed = isinstance(value, list)
    if listed:
        value = {"embed_tokens": value}
    if not isinstance(value, dict) or not value:
        raise AdapterError(f"{where}: {field_name} must be a list of token ids or a dict of module name -> ids")
    per_module: dict[str, list[int]] = {}
    for key, ids in value.items():
        module = CONFIG_NAMES.get(key)
        if module is None:
            raise AdapterError(f"{where}: {field_name} names module {str(key)[:80]!r}; only embed_tokens and "
                               f"lm_head are served")
        if module in per_module:
            raise AdapterError(f"{where}: {field_name} names {SHORT[module]} twice")
        per_module[module] = _ids(ids, vocab, field_name if listed else f"{field_name}[{key!r}]", where)
    if tied and EMBED in per_module and per_module.get(LM_HEAD, per_module[EMBED]) == per_module[EMBED]:
        return {EMBED: per_module[EMBED], LM_HEAD: None}  # peft ties the lm_head to the embedding's rows
    return dict(per_module)


def _ids(ids, vocab: int, name: str, where: str) -> list[int]:
    """A checked list of token ids: 1..MAX_TRAINABLE_TOKENS distinct integers below vocab_size."""
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise AdapterError(f"{where}: {name} must be a non-empty list of token ids")
    if len(ids) > MAX_TRAINABLE_TOKENS:
        raise AdapterError(f"{where}: {name} lists {len(ids)} token ids; at most {MAX_TRAINABLE_TOKENS} are served "
                           f"per module (decision 067)")
    for i in ids:
        if not 0 <= i < vocab:
            raise AdapterError(
                f"{where}: {name} lists token id {i}, outside the base model's vocabulary (0..{vocab - 1}): a token "
                f"added beyond vocab_size would widen every tenant's logits and sampling; train one of the base "
                f"vocabulary's unused or reserved ids instead (docs/adapters.md)")
    if len(set(ids)) != len(ids):
        raise AdapterError(f"{where}: {name} lists a token id twice")
    return ids


def _lora_pair(module, have, rank_alpha, scale, max_lora_rank, vocab, hidden, dtype, where):
    short = SHORT[module]
    r, alpha = rank_alpha
    if r > max_lora_rank:
        raise AdapterError(f"{where}: {short} has rank {r}, above the server's max_lora_rank {max_lora_rank}")
    if "A" not in have or "B" not in have:
        if not have.keys() & {"A", "B"}:
            raise AdapterError(f"{where}: adapter_config.json targets {short} but the weights have no LoRA pair "
                               f"for it")
        present = have.get("A", have.get("B"))[0]
        raise AdapterError(f"{where}: incomplete LoRA pair for {short}: {present} present, its partner missing")
    in_f, out_f = (vocab, hidden) if module == EMBED else (hidden, vocab)
    a = _checked(*have["A"], (r, in_f), where, dtype)
    b = _checked(*have["B"], (out_f, r), where, dtype)
    return a, b, scale(alpha, r)


def _checked(tensor_name: str, t: torch.Tensor, expected: tuple, where: str,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if tuple(t.shape) != tuple(expected):
        raise AdapterError(f"{where}: tensor {tensor_name} has shape {list(t.shape)}, expected {list(expected)}")
    if not t.dtype.is_floating_point:
        raise AdapterError(f"{where}: tensor {tensor_name} has dtype {t.dtype}, expected a floating-point dtype")
    out = t.to(dtype).contiguous()
    if not bool(torch.isfinite(t).all()) or not bool(torch.isfinite(out).all()):
        raise AdapterError(f"{where}: tensor {tensor_name} contains NaN or infinite values (in {dtype})")
    return out


def check_base_copies(adapter, base: Callable[[str], torch.Tensor] | None) -> None:
    """Check peft's saved copies of the base weights against the served ones (base(module) -> [vocab, hidden]),
    then drop them: AdapterError where a copy differs by more than a 16-bit float's rounding (an adapter trained
    on another checkpoint, or a changed embedding, which would need a full copy per slot)."""
    vocab = adapter.vocab
    if vocab is None or not vocab.base_copies:
        return
    where = f"adapter {adapter.name!r}"
    if base is None:
        raise AdapterError(f"{where}: it carries copies of the base weights, which cannot be checked here")
    for module, (tensor_name, copy) in list(vocab.base_copies.items()):
        served = base(module)
        for start in range(0, copy.shape[0], 4096):  # row blocks: no full-size temporaries
            mine, theirs = served[start:start + 4096].float().cpu(), copy[start:start + 4096].float()
            bad = (theirs - mine).abs() > BASE_COPY_RTOL * mine.abs() + 1e-7
            if bool(bad.any()):
                row = start + int(bad.any(dim=1).nonzero()[0, 0])
                raise AdapterError(
                    f"{where}: tensor {tensor_name}, peft's copy of the base {SHORT[module]}, differs from the served "
                    f"base model's (row {row}): the adapter was trained on another checkpoint or with a changed "
                    f"{SHORT[module]}, which is not served; {MODULES_TO_SAVE_REASON.split(': ', 1)[1]}")
    vocab.base_copies = {}


def base_vocab_weights(model) -> Callable[[str], torch.Tensor]:
    """base(module) -> the served [vocab, hidden] weight of a LlamaModel's embed_tokens or lm_head (read again
    from the checkpoint where only packed panels hold the lm_head)."""
    def base(module: str) -> torch.Tensor:
        if module == EMBED or model.lm_head is model.embed:
            return model.embed
        if model.lm_head is not None:
            return model.lm_head
        if model.lm_head_t is not None:
            return model.lm_head_t.t()
        from safetensors import safe_open

        for f in sorted(Path(model.model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                if "lm_head.weight" in st.keys():
                    return st.get_tensor("lm_head.weight")
        return model.embed
    return base


@dataclass(slots=True)
class _Held:
    """One slot's vocabulary parts on the device, in the compute dtype (rows in float32)."""

    embed_a_t: torch.Tensor | None = None  # A.T [vocab, r]: the rows a lookup gathers
    embed_b_t: torch.Tensor | None = None  # B.T [r, hidden]
    embed_scale: float = 0.0
    embed_index: torch.Tensor | None = None  # int64 [vocab]: each trained id's row, -1 elsewhere
    embed_rows: torch.Tensor | None = None  # float32 [n, hidden]
    lm_a: torch.Tensor | None = None  # [r, hidden]
    lm_b: torch.Tensor | None = None  # [vocab, r]
    lm_scale: float = 0.0
    lm_ids: torch.Tensor | None = None  # int64 [n]
    lm_rows: torch.Tensor | None = None  # float32 [n, hidden]

    @property
    def embeds(self) -> bool:
        return self.embed_a_t is not None or self.embed_index is not None

    @property
    def logits(self) -> bool:
        return self.lm_a is not None or self.lm_ids is not None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.embed_a_t, self.embed_b_t, self.embed_index, self.embed_rows, self.lm_a,
                                      self.lm_b, self.lm_ids, self.lm_rows) if t is not None)


class VocabSlots:
    """Each adapter slot's vocabulary parts, sized to its adapter (nothing for slots without any)."""

    def __init__(self, max_loras: int, device, dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device(device)
        self.dtype = dtype  # the model's: the parts are rounded to the LoRA dtype at parse, held in this one
        self.held: list[_Held | None] = [None] * max_loras
        self.loaded: set[int] = set()  # slots holding any
        self.base: Callable[[str], torch.Tensor] | None = None  # base_vocab_weights(model), set by the runner

    def bind(self, model) -> None:
        """Serve model's vocabulary: its dtype, and its base weights for checking peft's copies."""
        self.dtype, self.base = model.dtype, base_vocab_weights(model)

    def prepare(self, adapter) -> _Held | None:
        """The adapter's parts on the device (base copies checked first); nothing is written to a slot."""
        vocab = adapter.vocab
        if vocab is None:
            return None
        check_base_copies(adapter, self.base)
        dev, dt = self.device, self.dtype
        held = _Held()
        if vocab.embed_lora is not None:
            a, b, held.embed_scale = vocab.embed_lora
            held.embed_a_t = a.t().to(device=dev, dtype=dt).contiguous()
            held.embed_b_t = b.t().to(device=dev, dtype=dt).contiguous()
        if vocab.embed_tokens is not None:
            ids, rows = vocab.embed_tokens
            index = torch.full((vocab.vocab_size,), -1, dtype=torch.int64)
            index[ids] = torch.arange(len(ids))
            held.embed_index, held.embed_rows = index.to(dev), rows.to(dev, torch.float32)
        if vocab.lm_lora is not None:
            a, b, held.lm_scale = vocab.lm_lora
            held.lm_a, held.lm_b = a.to(device=dev, dtype=dt), b.to(device=dev, dtype=dt)
        if vocab.lm_tokens is not None:
            ids, rows = vocab.lm_tokens
            held.lm_ids, held.lm_rows = ids.to(dev), rows.to(dev, torch.float32)
        return held

    def load(self, slot: int, held: _Held | None) -> None:
        """Put prepare()'s parts in a slot (None: the slot holds none)."""
        self.held[slot] = held
        (self.loaded.add if held is not None else self.loaded.discard)(slot)

    def clear(self, slot: int) -> None:
        self.load(slot, None)

    def memory_bytes(self) -> int:
        return sum(h.nbytes() for h in self.held if h is not None)

    def plan(self, seq_slots: np.ndarray, cu: np.ndarray, sample_slots: np.ndarray,
             to_tensor: Callable[[np.ndarray], torch.Tensor]) -> VocabPlan | None:
        """The step's plan: seq_slots (int [B], -1: base) each sequence's slot, cu (int [B+1]) its rows,
        sample_slots the slot of each sampled row (the logits' rows); None when no row's slot holds any part."""
        used = self.loaded.intersection(seq_slots.tolist()) if self.loaded else ()
        if not used:
            return None
        embeds, logits, row_slots = [], [], None
        for s in sorted(used):
            held = self.held[s]
            if held.embeds:
                if row_slots is None:
                    row_slots = np.repeat(seq_slots, np.diff(cu))
                embeds.append((held, to_tensor(np.flatnonzero(row_slots == s))))
            picked = np.flatnonzero(sample_slots == s) if held.logits else ()
            if len(picked):
                logits.append((held, to_tensor(picked)))
        return VocabPlan(embeds, logits) if embeds or logits else None


class VocabPlan:
    """One step's rows of each slot with vocabulary parts: embeds [(parts, token rows)], logits [(parts, logit
    rows)]. Independent of the tokens, so a repeated decode batch reuses it."""

    __slots__ = ("embeds", "logit_rows")

    def __init__(self, embeds: list, logit_rows: list):
        self.embeds, self.logit_rows = embeds, logit_rows

    def embed(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """h (the embedding lookup [T, hidden], before any scale) with each row's adapter parts, in place."""
        for held, rows in self.embeds:
            ids = input_ids.index_select(0, rows)
            if held.embed_a_t is not None:  # peft: (A.T[ids] @ B.T) * scale, added to the lookup
                after_a = held.embed_a_t.index_select(0, ids)
                h.index_add_(0, rows, (after_a @ held.embed_b_t) * held.embed_scale)
            if held.embed_index is not None:  # the trained ids' rows replace the base rows
                j = held.embed_index.index_select(0, ids)
                new = held.embed_rows.index_select(0, j.clamp(min=0)).to(h.dtype)
                h.index_copy_(0, rows, torch.where((j >= 0).unsqueeze(1), new, h.index_select(0, rows)))
        return h

    def logits(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """logits [rows, vocab] (fp32, before any soft-cap) with each row's lm_head parts, in place; hidden: the
        rows' final hidden states."""
        for held, rows in self.logit_rows:
            x = hidden.index_select(0, rows)
            if held.lm_a is not None:  # peft: lora_B(lora_A(x)) * scale, added to the base logits
                delta = F.linear(F.linear(x, held.lm_a), held.lm_b) * held.lm_scale
                logits.index_add_(0, rows, delta.float())
            if held.lm_ids is not None:  # the trained ids' columns: x against their rows
                values = F.linear(x, held.lm_rows.to(x.dtype)).float()
                logits.index_put_((rows.unsqueeze(1), held.lm_ids.unsqueeze(0)), values)


__all__ = ["EMBED", "LM_HEAD", "MAX_TRAINABLE_TOKENS", "MAX_VOCAB_TENSORS", "VocabAdapter", "VocabPlan",
           "VocabSlots", "base_vocab_weights", "check_base_copies", "check_vocab_header", "max_vocab_bytes",
           "parse_vocab", "vocab_module"]
