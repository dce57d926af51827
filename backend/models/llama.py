"""The decoder every supported family shares (models.family: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4,
Mixtral, Qwen3-MoE) over a paged KV cache with per-token LoRA."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex import kernels
from loraplex.kernels import cpu_native, reference
from loraplex.lora.backends.base import LoraPlan
from loraplex.lora.shapes import MODULES, PARENTS, module_shapes
from loraplex.models import bf16_prefill
from loraplex.models.family import CHECKPOINT_FUSED, FAMILIES, Family, family_of, rope_settings
from loraplex.models.loader import load_hf_config, load_safetensors
from loraplex.models.quant import linear as qlinear
from loraplex.models.quant.formats import is_quant_tensor
from loraplex.models.quant.forms import dequantize, is_quantized
from loraplex.models.quant.forms import split as split_form
from loraplex.models.quant.plan import resolve as resolve_quantization
from loraplex.models.quant.weights import prepare as prepare_quantized, served_weight
from loraplex.models.rope import RotaryEmbedding, attention_scaling

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
    # CPU steps with prefill, where the model runs prompt rows on AMX tiles (bf16_prefill): bool [T], the rows of
    # sequences with more than one new token
    prompt_rows: torch.Tensor | None = None


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
    some = next(b for b in biases if b is not None)
    return torch.cat([b if b is not None else some.new_zeros(layer[m].shape[0]) for b, m in zip(biases, parts)])


def split_checkpoint_fused(w: dict, architecture: str, num_layers: int, sizes: dict[str, list[int]]) -> None:
    """A checkpoint's fused projections (Phi-3's qkv_proj, gate_up_proj) split in place into ours, along the output;
    sizes: each of our modules' output width."""
    for fused, parts in CHECKPOINT_FUSED.get(architecture, {}).items():
        for i in range(num_layers):
            name = f"model.layers.{i}.{PARENTS[parts[0]]}.{fused}"
            for suffix in (".weight", ".bias"):
                t = w.pop(name + suffix, None)
                if t is not None:
                    widths = [sizes[m] for m in parts]
                    pieces = split_form(t, widths) if is_quantized(t) else t.split(widths)
                    for m, piece in zip(parts, pieces):
                        w[f"model.layers.{i}.{PARENTS[m]}.{m}{suffix}"] = piece if is_quantized(piece) else piece.contiguous()


def _llama_family(cfg, head_dim: int) -> Family:
    """Llama's quirks (none): a config built by hand, without a known architecture (benchmarks' shapes)."""
    n = int(cfg.num_hidden_layers)
    return Family("LlamaForCausalLM", attn_scale=head_dim**-0.5, layer_windows=(None,) * n,
                  layer_rope=("default",) * n, head_dim=head_dim, rotary_dim=head_dim)


class LlamaModel:
    """Weights of a checkpoint of any supported family and its forward pass.

    ``family`` (models.family) holds the checkpoint's quirks. Every family keeps the packed or fused
    projections; the native one-call decode serves the families whose layers it computes
    (Family.one_call_decode), the others decode on the per-op forward, whose steps cover each quirk.

    ``fp16_weights`` (CPU, fp32): the projections and ``lm_head`` keep their weights in fp16
    and multiply in fp32 (kernels.packed_linear: the native GEMM, else FBGEMM), reading half the
    bytes; the embedding is rounded the same way, so a tied ``lm_head`` and the lookups see one
    set of values. Without it, fp32 on the CPU packs the same weights as fp32 panels where the
    native GEMM is built (decision 037). Packed weights take q/k/v and gate/up
    together (FUSED); a decode step then runs in one native call, its LoRA deltas included.

    ``quantization`` (models/quant, decision 072): auto serves the checkpoint's own format (a plain one in full
    precision), none dequantizes a quantized checkpoint, int8 / fp8 / int4 quantize a full-precision one at load;
    ``quantization_fallback`` reference runs a format the device has no kernel for through the torch reference.
    Quantized projections hold canonical forms (models/quant/forms.py): on the CPU packed (int8 through
    kernels.linear_pack_int8), elsewhere run by their kernels; ``quant`` says what is served.
    """

    def __init__(self, model_dir: str, dtype: torch.dtype, device, max_len: int | None = None, config=None,
                 fp16_weights: bool = False, quantization: str = "auto", quantization_fallback: str = "off"):
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
        known = any(a in FAMILIES for a in (getattr(cfg, "architectures", None) or []))
        fam = family_of(cfg, self.head_dim) if known else _llama_family(cfg, self.head_dim)
        # a window no shorter than the longest sequence changes nothing: full attention keeps the fast paths
        windows = tuple(w if w is not None and w < self.max_len else None for w in fam.layer_windows)
        self.family = fam = dataclasses.replace(fam, layer_windows=windows)
        self.scale = fam.attn_scale
        # ops whose kernel cannot serve this model -> why (logged once); they take the torch path
        self.kernel_fallbacks = kernels.check_model(self.head_dim, self.num_heads, self.num_kv_heads, dtype, device)
        native = kernels.native_layer_ops(device, dtype, self.head_dim)
        self.ops = cpu_native if native else kernels  # the layer ops it calls: native directly, or dispatched
        self.quant = resolve_quantization(quantization, cfg, device, dtype, quantization_fallback, fp16_weights,
                                          fam.moe)
        w = load_safetensors(model_dir, dtype, device, is_quant_tensor if self.quant.checkpoint else None)
        prepare_quantized(w, self.quant, dtype, device)
        split_checkpoint_fused(w, fam.architecture, self.num_layers, {m: o for m, (_, o) in module_shapes(cfg).items()})
        self.embed = w.pop("model.embed_tokens.weight")
        self.lm_head = w.pop("lm_head.weight", None)
        if self.lm_head is None:
            self.lm_head = self.embed  # tied embeddings
        self.norm = self._norm_weight(w.pop("model.norm.weight"))
        self.embed_scale = None if fam.embed_scale is None else torch.tensor(fam.embed_scale, dtype=dtype, device=device)
        self.layers = [self._take_layer(w, i) for i in range(self.num_layers)]
        names = sorted(n for n in w if not n.endswith("rotary_emb.inv_freq"))  # old conversions saved the buffer
        if names:  # a tensor no step reads would be a quirk served wrong, with no error
            raise ValueError(f"{model_dir}: {len(names)} checkpoint tensors are not used by the "
                             f"{fam.architecture} forward (e.g. {', '.join(names[:3])}): a feature of this checkpoint "
                             "is not implemented")
        settings = {t: rope_settings(cfg, t) for t in fam.layer_rope}  # one rotary table per layer type
        self.ropes = {t: RotaryEmbedding(s, fam.rotary_dim, self.max_len, device, dtype,
                                         attention_scaling(s, cfg.max_position_embeddings)) for t, s in settings.items()}
        self.rope = self.ropes[fam.layer_rope[0]]
        self.fp16_weights = fp16_weights
        self.packed: list[dict] | None = None  # per layer: module or FUSED name -> kernels.linear_pack
        self.fused_sizes: dict[str, list[int]] = {}  # FUSED name -> its modules' output widths
        self.packed_lm_head = None
        self.native_decode = None  # cpu_native.DecodeForward: a decode step in one native call, LoRA included
        self.prefill_parts = 0  # bf16 parts of the prefill's GEMMs on AMX tiles, 0: off (set_prefill_dtype)
        self._bf16_rows = None  # the step's bf16_prefill.PrefillRows, while forward runs one
        self.lm_head_t = None  # CPU fp32: the lm_head as [hidden, vocab], contiguous
        self.fused_weights: list[dict] | None = None  # per layer: FUSED name -> (weight, bias), unpacked models
        if fp16_weights:
            if torch.device(device).type != "cpu" or dtype != torch.float32:
                raise ValueError("fp16 weights are a CPU option with dtype float32; on CUDA set dtype float16")
            self._pack(half=True)
        elif self.quant.quantized and torch.device(device).type == "cpu":
            self._pack(half=False, panels=kernels.native_panels(device, dtype, self.head_dim))
        elif kernels.native_panels(device, dtype, self.head_dim):
            self._pack(half=False)
        elif torch.device(device).type == "cpu" and dtype == torch.float32:
            # one mm over a contiguous W.T: linear reads [vocab, hidden] slowly for a decode's few rows (decision 042)
            self.lm_head_t = self.lm_head.t().contiguous()
            if self.lm_head is not self.embed:
                self.lm_head = None  # only the transposed copy is read
        if self.packed is None and fused_base_enabled(device):
            self._fuse_base()

    def _pack(self, half: bool, panels: bool = True) -> None:
        """The projections and lm_head packed by kernels.linear_pack (fp16 if half, else fp32: quantized ones by
        quant.linear.pack, plain ones as fp32 panels where panels), FUSED merged."""
        tied = self.lm_head is self.embed
        if half:
            self.embed = self.embed.half().float()  # the values the packed weights hold
            pack = functools.partial(kernels.linear_pack, half=True)
        else:
            pack = functools.partial(qlinear.pack, panels=panels)
        self.packed_lm_head = pack(self.embed if tied else self.lm_head)
        if tied:
            self.lm_head = self.embed
        else:
            self.lm_head = self.lm_head.half().float() if half else None  # fp32: only the panels are read
        self.packed = []
        fused_modules = {m for parts in FUSED.values() for m in parts}
        self.fused_sizes = self._fused_sizes()
        for layer in self.layers:
            packed = {m: pack(layer[m], layer.get(m + ".bias"))
                      for m in MODULES if m not in fused_modules and layer.get(m) is not None}
            for name, parts in FUSED.items():
                if layer.get(parts[0]) is not None:  # a MoE layer has no gate/up: its experts are models/moe.py's
                    packed[name] = pack(qlinear.fuse([layer[m] for m in parts]), _fused_bias(layer, parts))
            for m in MODULES:
                layer[m] = None  # only the packed copy is read: the fp32 one would double the memory
            self.packed.append(packed)
        fam = self.family
        native = all(isinstance(p, cpu_native.Panels) for p in (self.packed_lm_head, *(p for layer in self.packed
                                                                                        for p in layer.values())))
        if self.ops is cpu_native and native and fam.one_call_decode:
            variants = [{"window": w, "softcap": fam.attn_softcap} for w in fam.layer_windows]
            self.native_decode = cpu_native.DecodeForward(
                [{**layer, **packed, **v} for layer, packed, v in zip(self.layers, self.packed, variants)], self.norm,
                self.rope.cos, self.rope.signed_sin, self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale)

    def _fuse_base(self) -> None:
        """q/k/v and gate/up concatenated once into one weight each (one GEMM, its output split by views:
        decision 057); the separate weights are dropped."""
        self.fused_sizes = self._fused_sizes()
        self.fused_weights = []
        for layer in self.layers:
            fused = {}
            for name, parts in FUSED.items():
                if layer.get(parts[0]) is None:
                    continue
                fused[name] = (qlinear.fuse([layer[m] for m in parts]), _fused_bias(layer, parts))
                for m in parts:
                    layer[m] = None
            self.fused_weights.append(fused)

    def set_prefill_dtype(self, mode: str) -> None:
        """prefill_dtype (decision 074): the bf16 parts a CPU step's prompt rows multiply the packed projections in,
        on AMX tiles (bf16_prefill); ValueError where mode asks for bf16 and this model or CPU cannot."""
        self.prefill_parts = bf16_prefill.parts(mode, self.device, self.dtype, self.packed)

    def _fused_sizes(self) -> dict[str, list[int]]:
        """FUSED name -> its modules' output widths."""
        shapes = module_shapes(self.config)
        return {name: [shapes[m][1] for m in parts] for name, parts in FUSED.items()}

    def base_weight(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One projection's base weight [out, in] and bias (None without), for DoRA's norms at adapter load:
        the layer's own tensor, or, once packed or fused away, read again from the checkpoint."""
        w, bias = self.layers[layer][module], self.layers[layer].get(module + ".bias")
        if is_quantized(w):
            w = dequantize(w)
        elif w is None:
            from safetensors import safe_open

            fused = next(((f, parts) for f, parts in CHECKPOINT_FUSED.get(self.family.architecture, {}).items()
                          if module in parts), None)
            prefix = f"model.layers.{layer}.{PARENTS[module]}.{fused[0] if fused else module}."
            raw = {}  # the layer's tensors as stored (a quantized one's: all of its encoding)
            for f in sorted(Path(self.model_dir).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    raw.update({k: st.get_tensor(k) for k in st.keys() if k.startswith(prefix)})
            w = (served_weight(raw, prefix + "weight", self.quant, self.device, self.dtype) if self.quant.source
                 else raw.get(prefix + "weight"))
            if fused is not None and w is not None:
                widths = [module_shapes(self.config)[m][1] for m in fused[1]]
                w = w.split(widths)[fused[1].index(module)]
        return w, bias

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's weight as the norm multiplies by it: Gemma's (1 + w), computed in fp32 as HF does."""
        return (1.0 + weight.float()).to(weight.dtype) if self.family.norm_offset else weight

    def _take_layer(self, w: dict, i: int) -> dict:
        """Layer i's tensors, popped from the checkpoint's: projections, norms (named by role), experts."""
        p, fam = f"model.layers.{i}.", self.family
        moe = None
        if fam.moe:
            from loraplex.models.moe import take_moe

            moe = take_moe(w, i, self.config, self.dtype, self.device)
        modules = MODULES if moe is None else MODULES[:4]
        layer = {m: w.pop(f"{p}{PARENTS[m]}.{m}.weight") for m in modules}
        for m in modules:  # q/k/v biases (Qwen2), o_proj's and the MLP's where a config sets them
            layer[m + ".bias"] = w.pop(f"{p}{PARENTS[m]}.{m}.bias", None)
        if moe is not None:
            layer["moe"] = moe
        norms = {"input_norm": "input_layernorm"}
        if fam.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's; the MLP's come before
            norms.update(post_attn_norm="post_attention_layernorm", post_norm="pre_feedforward_layernorm",
                         post_ff_norm="post_feedforward_layernorm")
        else:
            norms["post_norm"] = "post_attention_layernorm"
        if fam.qk_norm:
            norms.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
        for role, name in norms.items():
            layer[role] = self._norm_weight(w.pop(p + name + ".weight"))
        return layer

    def _proj(self, layer_idx: int, module: str, x: torch.Tensor, lora: LoraPlan | None) -> torch.Tensor:
        if self._bf16_rows is not None:  # a prefill step's prompt rows in bf16
            y = bf16_prefill.linear(x, self.packed[layer_idx][module], self.prefill_parts, self._bf16_rows)
        elif self.packed is not None:
            y = qlinear.packed_linear(x, self.packed[layer_idx][module])
        else:
            layer = self.layers[layer_idx]
            y = qlinear.linear(x, layer[module], layer.get(module + ".bias"))
        if lora is not None:
            lora.apply(y, x, layer_idx, module)
        return y

    def _projs(self, layer_idx: int, fused: str, x: torch.Tensor, lora: LoraPlan | None) -> tuple[torch.Tensor, ...]:
        """FUSED[fused]'s modules' outputs for input x, each with its LoRA delta: one GEMM split by views if packed."""
        modules = FUSED[fused]
        if self._bf16_rows is not None:  # a prefill step's prompt rows in bf16
            ys = bf16_prefill.linear(x, self.packed[layer_idx][fused], self.prefill_parts,
                                     self._bf16_rows).split(self.fused_sizes[fused], dim=1)
        elif self.packed is not None:
            ys = qlinear.packed_linear(x, self.packed[layer_idx][fused]).split(self.fused_sizes[fused], dim=1)
        elif self.fused_weights is not None:
            weight, bias = self.fused_weights[layer_idx][fused]
            ys = qlinear.linear(x, weight, bias).split(self.fused_sizes[fused], dim=1)
        else:
            layer = self.layers[layer_idx]
            ys = tuple(qlinear.linear(x, layer[m], layer.get(m + ".bias")) for m in modules)
        if lora is not None:
            lora.apply_group(ys, x, layer_idx, modules)
        return ys

    def forward(self, input_ids, attn: AttentionBatch, kv_cache, lora: LoraPlan | None, vocab=None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes the new K/V into kv_cache. lora (a plan of
        loraplex.lora.backends, None: no adapter) adds each projection's deltas; a one-call plan's go inside the
        native decode forward. vocab (a lora/vocab.py VocabPlan, or None) changes the embedding lookup's rows of
        adapters on embed_tokens, before any embedding scale, as peft.

        Each residual add is left to the next norm (kernels.add_rms_norm), as vLLM's fused add-norm.
        """
        ops, h = self.ops, self.embed[input_ids]
        if vocab is not None:  # vocab hooks: the adapters' embedding rows, before the scale
            h = vocab.embed(h, input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        # a CPU step with enough prompt rows runs them in bf16 op by op, its other rows in fp32 (decision 074)
        bf16 = self._bf16_rows = bf16_prefill.prefill_rows(attn.prompt_rows) if self.prefill_parts else None
        if attn.is_decode and self.native_decode is not None and (lora is None or lora.one_call) and bf16 is None:
            slots, token_slots = (None, None) if lora is None else (lora.backend.slots, lora.token_slots)
            return self.native_decode(h, attn.positions, attn.slot_mapping, attn.block_tables, attn.context_lens,
                                      kv_cache, slots, token_slots)
        delta, fam = None, self.family
        for i, layer in enumerate(self.layers):
            x = ops.add_rms_norm(h, delta, layer["input_norm"], self.eps)
            o = self._attention(i, layer, x, attn, kv_cache, lora)
            if fam.sandwich_norms:
                o = ops.add_rms_norm(o, None, layer["post_attn_norm"], self.eps)
            x = ops.add_rms_norm(h, o, layer["post_norm"], self.eps)
            if "moe" in layer:
                delta = layer["moe"](x, lora, i)
            else:
                gate, up = self._projs(i, "gate_up", x, lora)
                act = ops.silu_mul(gate, up) if fam.activation == "silu" else F.gelu(gate, approximate="tanh") * up
                delta = self._proj(i, "down_proj", act, lora)
            if fam.sandwich_norms:
                delta = ops.add_rms_norm(delta, None, layer["post_ff_norm"], self.eps)
        return ops.add_rms_norm(h, delta, self.norm, self.eps)

    def _attention(self, i: int, layer: dict, x, attn: AttentionBatch, kv_cache, lora) -> torch.Tensor:
        """Layer i's attention block up to o_proj's output [T, hidden]: q/k/v, their norms (Qwen3, Gemma 3),
        RoPE (all or part of each head), the cache write, paged attention (in a window, soft-capped)."""
        ops, fam, t = self.ops, self.family, x.shape[0]
        q, k, v = self._projs(i, "qkv", x, lora)
        if fam.qk_norm:  # per head, before RoPE
            q = ops.add_rms_norm(q.reshape(t * self.num_heads, self.head_dim), None, layer["q_norm"], self.eps)
            k = ops.add_rms_norm(k.reshape(t * self.num_kv_heads, self.head_dim), None, layer["k_norm"], self.eps)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        rope = self.ropes[fam.layer_rope[i]]
        if fam.rotary_dim == self.head_dim:
            q, k = ops.rotate_qk(q, k, attn.positions, rope.cos, rope.signed_sin)
        else:  # partial rotary (Phi-3/4-mini): the first rotary_dim dimensions turn, the rest pass
            r = fam.rotary_dim
            qr, kr = reference.rotate_qk(q[..., :r], k[..., :r], attn.positions, rope.cos, rope.signed_sin)
            q, k = torch.cat([qr, q[..., r:]], -1), torch.cat([kr, k[..., r:]], -1)
        k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
        ops.write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
        variant = {}
        if fam.layer_windows[i] is not None:
            variant["window"] = fam.layer_windows[i]
        if fam.attn_softcap:
            variant["softcap"] = fam.attn_softcap
        if attn.is_decode:
            decode = kernels.paged_attention_decode if variant else ops.paged_attention_decode
            o = decode(q, k_cache, v_cache, attn.block_tables, attn.context_lens, self.scale, **variant)
        else:
            o = kernels.paged_attention_prefill(q, k_cache, v_cache, attn.block_tables, attn.cu_query_lens,
                                                attn.context_lens, self.scale, **variant)
        return self._proj(i, "o_proj", o.reshape(t, -1), lora)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None, vocab=None) -> torch.Tensor:
        """Vocabulary logits in fp32; the CPU's GEMMs write them into `out` [rows, vocab] when given (a buffer
        reused step after step), the others return a new tensor. vocab (a lora/vocab.py VocabPlan, or None) adds
        the rows' adapters on lm_head, before any soft-cap, as peft."""
        if self.packed_lm_head is not None:
            logits = qlinear.packed_linear(hidden, self.packed_lm_head, out)
        elif self.lm_head_t is not None:
            logits = torch.mm(hidden, self.lm_head_t, out=out)
        else:
            logits = qlinear.linear(hidden, self.lm_head).float()
        if vocab is not None:  # vocab hooks: the adapters' lm_head parts, before the soft-cap
            vocab.logits(logits, hidden)
        cap = self.family.final_softcap
        return logits if not cap else logits.div_(cap).tanh_().mul_(cap)  # Gemma 2's final soft-cap, as HF

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """Zeroed cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


__all__ = ["LlamaModel", "AttentionBatch", "MODULES"]
