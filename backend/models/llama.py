"""LLaMA-family forward (Llama, Mistral, Qwen2) over a paged KV cache with per-token LoRA."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex import kernels
from loraplex.kernels import cpu_native
from loraplex.lora.backends.base import LoraPlan
from loraplex.lora.shapes import MODULES, PARENTS
from loraplex.models.loader import load_hf_config, load_safetensors
from loraplex.models.rope import RotaryEmbedding

# Projections that read the same input, packed as one fp16 weight (one GEMM, its output split by views):
# fewer, longer weight streams for the same bytes, and the same values (each output column is its own sum;
# decision 041).
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


@dataclass(slots=True)
class AttentionBatch:
    """Where the step's tokens go and what they attend to."""

    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]: block * block_size + offset
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]: cached + new tokens
    cu_query_lens: torch.Tensor  # int32 [B+1]
    is_decode: bool  # every sequence has exactly one new token


FUSED_BASE_ENV = "LORAPLEX_FUSED_BASE"


def fused_base_enabled(device) -> bool:
    """Whether an unpacked model fuses q/k/v and gate/up into one GEMM each: LORAPLEX_FUSED_BASE on, off or
    auto (default: CUDA only); ValueError on anything else."""
    mode = os.environ.get(FUSED_BASE_ENV) or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{FUSED_BASE_ENV}={mode!r} is not one of auto, on, off")
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def _fused_bias(layer: dict, parts: tuple[str, ...]) -> torch.Tensor | None:
    """The modules' biases end to end (zeros for one without), or None when none has one."""
    biases = [layer.get(m + ".bias") for m in parts]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else layer[m].new_zeros(layer[m].shape[0]) for b, m in zip(biases, parts)])


class LlamaModel:
    """Weights of a LLaMA-family checkpoint and its forward pass.

    ``fp16_weights`` (CPU, fp32): the projections and ``lm_head`` keep their weights in fp16
    and multiply in fp32 (kernels.packed_linear: the native GEMM, else FBGEMM), reading half the
    bytes; the embedding is rounded the same way, so a tied ``lm_head`` and the lookups see one
    set of values. Without it, fp32 on the CPU packs the same weights as fp32 panels where the
    native GEMM is built (decision 037). Packed weights take q/k/v and gate/up
    together (FUSED); a decode step then runs in one native call, its LoRA deltas included.
    """

    def __init__(self, model_dir: str, dtype: torch.dtype, device, max_len: int | None = None, config=None,
                 fp16_weights: bool = False):
        self.config = cfg = config if config is not None else load_hf_config(model_dir)
        self.dtype, self.device = dtype, device
        self.model_dir = model_dir
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.max_len = max_len or cfg.max_position_embeddings
        self.scale = self.head_dim**-0.5
        # ops whose kernel cannot serve this model -> why (logged once); they take the torch path
        self.kernel_fallbacks = kernels.check_model(self.head_dim, self.num_heads, self.num_kv_heads, dtype, device)
        native = kernels.native_layer_ops(device, dtype, self.head_dim)
        self.ops = cpu_native if native else kernels  # the layer ops it calls: native directly, or dispatched
        w = load_safetensors(model_dir, dtype, device)
        self.embed = w.pop("model.embed_tokens.weight")
        self.lm_head = w.pop("lm_head.weight", None)
        if self.lm_head is None:
            self.lm_head = self.embed  # tied embeddings
        self.norm = w.pop("model.norm.weight")
        self.layers = [self._take_layer(w, i) for i in range(self.num_layers)]
        self.rope = RotaryEmbedding(cfg, self.head_dim, self.max_len, device, dtype)
        self.fp16_weights = fp16_weights
        self.packed: list[dict] | None = None  # per layer: module or FUSED name -> kernels.linear_pack
        self.fused_sizes: dict[str, list[int]] = {}  # FUSED name -> its modules' output widths
        self.packed_lm_head = None
        self.native_decode = None  # cpu_native.DecodeForward: a decode step in one native call, LoRA included
        self.lm_head_t = None  # CPU fp32: the lm_head as [hidden, vocab], contiguous
        self.fused_weights: list[dict] | None = None  # per layer: FUSED name -> (weight, bias), unpacked models
        if fp16_weights:
            if torch.device(device).type != "cpu" or dtype != torch.float32:
                raise ValueError("fp16 weights are a CPU option with dtype float32; on CUDA set dtype float16")
            self._pack(half=True)
        elif kernels.native_panels(device, dtype, self.head_dim):
            self._pack(half=False)
        elif torch.device(device).type == "cpu" and dtype == torch.float32:
            # one mm over a contiguous W.T: linear reads [vocab, hidden] slowly for a decode's few rows (decision 042)
            self.lm_head_t = self.lm_head.t().contiguous()
            if self.lm_head is not self.embed:
                self.lm_head = None  # only the transposed copy is read
        if self.packed is None and fused_base_enabled(device):
            self._fuse_base()

    def _pack(self, half: bool) -> None:
        """The projections and lm_head packed by kernels.linear_pack (fp16 if half, else fp32), FUSED merged."""
        tied = self.lm_head is self.embed
        if half:
            self.embed = self.embed.half().float()  # the values the packed weights hold
        self.packed_lm_head = kernels.linear_pack(self.embed if tied else self.lm_head, half=half)
        if tied:
            self.lm_head = self.embed
        else:
            self.lm_head = self.lm_head.half().float() if half else None  # fp32: only the panels are read
        self.packed = []
        fused_modules = {m for parts in FUSED.values() for m in parts}
        self.fused_sizes = {name: [self.layers[0][m].shape[0] for m in parts] for name, parts in FUSED.items()}
        pack = functools.partial(kernels.linear_pack, half=half)
        for layer in self.layers:
            packed = {m: pack(layer[m], layer.get(m + ".bias")) for m in MODULES if m not in fused_modules}
            for name, parts in FUSED.items():
                packed[name] = pack(torch.cat([layer[m] for m in parts]), _fused_bias(layer, parts))
            for m in MODULES:
                layer[m] = None  # only the packed copy is read: the fp32 one would double the memory
            self.packed.append(packed)
        if self.ops is cpu_native and isinstance(self.packed_lm_head, cpu_native.Panels):
            self.native_decode = cpu_native.DecodeForward(
                [{**layer, **packed} for layer, packed in zip(self.layers, self.packed)], self.norm, self.rope.cos,
                self.rope.signed_sin, self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale)

    def _fuse_base(self) -> None:
        """q/k/v and gate/up concatenated once into one weight each (one GEMM, its output split by views:
        decision 057); the separate weights are dropped."""
        self.fused_sizes = {name: [self.layers[0][m].shape[0] for m in parts] for name, parts in FUSED.items()}
        self.fused_weights = []
        for layer in self.layers:
            fused = {}
            for name, parts in FUSED.items():
                fused[name] = (torch.cat([layer[m] for m in parts]), _fused_bias(layer, parts))
                for m in parts:
                    layer[m] = None
            self.fused_weights.append(fused)

    def base_weight(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One projection's base weight [out, in] and bias (None without), for DoRA's norms at adapter load:
        the layer's own tensor, or, once packed or fused away, read again from the checkpoint."""
        w, bias = self.layers[layer][module], self.layers[layer].get(module + ".bias")
        if w is None:
            from safetensors import safe_open

            name = f"model.layers.{layer}.{PARENTS[module]}.{module}.weight"
            for f in sorted(Path(self.model_dir).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    if name in st.keys():
                        w = st.get_tensor(name)
                        break
        return w, bias

    @staticmethod
    def _take_layer(w: dict, i: int) -> dict:
        p = f"model.layers.{i}."
        names = {
            "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
            "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
            "down_proj": "mlp.down_proj",
        }
        layer = {m: w.pop(p + n + ".weight") for m, n in names.items()}
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            layer[m + ".bias"] = w.pop(p + names[m] + ".bias", None)
        layer["input_norm"] = w.pop(p + "input_layernorm.weight")
        layer["post_norm"] = w.pop(p + "post_attention_layernorm.weight")
        return layer

    def _proj(self, layer_idx: int, module: str, x: torch.Tensor, lora: LoraPlan | None) -> torch.Tensor:
        if self.packed is not None:
            y = kernels.packed_linear(x, self.packed[layer_idx][module])
        else:
            layer = self.layers[layer_idx]
            y = F.linear(x, layer[module], layer.get(module + ".bias"))
        if lora is not None:
            lora.apply(y, x, layer_idx, module)
        return y

    def _projs(self, layer_idx: int, fused: str, x: torch.Tensor, lora: LoraPlan | None) -> tuple[torch.Tensor, ...]:
        """FUSED[fused]'s modules' outputs for input x, each with its LoRA delta: one GEMM split by views if packed."""
        modules = FUSED[fused]
        if self.packed is not None:
            ys = kernels.packed_linear(x, self.packed[layer_idx][fused]).split(self.fused_sizes[fused], dim=1)
        elif self.fused_weights is not None:
            weight, bias = self.fused_weights[layer_idx][fused]
            ys = F.linear(x, weight, bias).split(self.fused_sizes[fused], dim=1)
        else:
            layer = self.layers[layer_idx]
            ys = tuple(F.linear(x, layer[m], layer.get(m + ".bias")) for m in modules)
        if lora is not None:
            lora.apply_group(ys, x, layer_idx, modules)
        return ys

    def forward(self, input_ids, attn: AttentionBatch, kv_cache, lora: LoraPlan | None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes the new K/V into kv_cache. lora (a plan of
        loraplex.lora.backends, None: no adapter) adds each projection's deltas; a one-call plan's go inside the
        native decode forward.

        Each residual add is left to the next norm (kernels.add_rms_norm), as vLLM's fused add-norm.
        """
        ops, h = self.ops, self.embed[input_ids]
        if attn.is_decode and self.native_decode is not None and (lora is None or lora.one_call):
            slots, token_slots = (None, None) if lora is None else (lora.backend.slots, lora.token_slots)
            return self.native_decode(h, attn.positions, attn.slot_mapping, attn.block_tables, attn.context_lens,
                                      kv_cache, slots, token_slots)
        t, delta = h.shape[0], None
        for i, layer in enumerate(self.layers):
            x = ops.add_rms_norm(h, delta, layer["input_norm"], self.eps)
            q, k, v = self._projs(i, "qkv", x, lora)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            q, k = ops.rotate_qk(q, k, attn.positions, self.rope.cos, self.rope.signed_sin)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            ops.write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
            if attn.is_decode:
                o = ops.paged_attention_decode(q, k_cache, v_cache, attn.block_tables, attn.context_lens, self.scale)
            else:
                o = kernels.paged_attention_prefill(
                    q, k_cache, v_cache, attn.block_tables, attn.cu_query_lens, attn.context_lens, self.scale
                )
            x = ops.add_rms_norm(h, self._proj(i, "o_proj", o.reshape(t, -1), lora), layer["post_norm"], self.eps)
            gate, up = self._projs(i, "gate_up", x, lora)
            delta = self._proj(i, "down_proj", ops.silu_mul(gate, up), lora)
        return ops.add_rms_norm(h, delta, self.norm, self.eps)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Vocabulary logits in fp32; the CPU's GEMMs write them into `out` [rows, vocab] when given (a buffer
        reused step after step), the others return a new tensor."""
        if self.packed_lm_head is not None:
            return kernels.packed_linear(hidden, self.packed_lm_head, out)
        if self.lm_head_t is not None:
            return torch.mm(hidden, self.lm_head_t, out=out)
        return F.linear(hidden, self.lm_head).float()

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """Zeroed cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


__all__ = ["LlamaModel", "AttentionBatch", "MODULES"]
