"""Decode at Llama-3-8B's shapes against the HBM roofline: the base model, 8 and 32 adapters of rank 16.

Random weights of Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads,
vocab 128256; no download) in bf16 on CUDA, driven through LlamaModel.forward + logits with a LoRA plan of
the kernel backend (per-row slots), one CUDA graph per batch (--eager: none). For each batch (1, 16, 64, 256)
and row (base, 8 adapters, 32 adapters; sequences spread round-robin over the adapters), it reports decode
tokens/s and the roofline: bytes read per step (every weight once, the lm_head, each sequence's K/V at
--context tokens, the used adapters' A/B rows) over the peak HBM bandwidth (--peak-gbs, default the
device's, hbm_peak.py), and the adapters' throughput as a fraction of the base's at the same batch.

    python benchmarks/decode_roofline.py [--json out.json] [--batches 1 16 64 256] [--peak-gbs 3350]
    python benchmarks/decode_roofline.py --tiny     # a tiny shape on the CPU (a test's smoke run)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Shape:
    """A LLaMA shape."""

    hidden: int = 4096
    intermediate: int = 14336
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection."""
        kv = self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, self.hidden), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (self.hidden, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}


LLAMA3_8B = Shape()
TINY = Shape(hidden=64, intermediate=96, layers=2, heads=2, kv_heads=1, vocab=256)


def step_bytes(shape: Shape, batch: int, context: int, adapters_used: int, rank: int, elem: int = 2) -> int:
    """Bytes one decode step must read: the projections' weights, the lm_head, each sequence's K/V over
    context tokens, and each used adapter's A and B at rank for every projection (the embedding rows and
    activations are negligible and left out)."""
    proj = sum(i * o for i, o in shape.module_shapes().values()) * shape.layers
    kv = batch * context * shape.layers * 2 * shape.kv_heads * shape.head_dim
    lora = adapters_used * rank * sum(i + o for i, o in shape.module_shapes().values()) * shape.layers
    return (proj + shape.hidden * shape.vocab + kv + lora) * elem


def roofline_tokens_s(nbytes: int, batch: int, peak_gbs: float) -> float:
    """Tokens/s if the step took exactly its bytes over the peak bandwidth."""
    return batch / (nbytes / (peak_gbs * 1e9))


def random_weights(shape: Shape, dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (HF names) of random values at shape, made on device."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size, std=0.02):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    w = {"model.embed_tokens.weight": rand(shape.vocab, shape.hidden), "lm_head.weight": rand(shape.vocab, shape.hidden),
         "model.norm.weight": torch.ones(shape.hidden, device=device, dtype=dtype)}
    parents = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for m, (n_in, n_out) in shape.module_shapes().items():
            w[f"{p}{parents[m]}.{m}.weight"] = rand(n_out, n_in)
        w[p + "input_layernorm.weight"] = torch.ones(shape.hidden, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(shape.hidden, device=device, dtype=dtype)
    return w


def hf_config(shape: Shape, max_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab, max_position_embeddings=max_len,
                       rms_norm_eps=1e-5, rope_theta=500000.0)


@contextmanager
def weights_from(tensors: dict):
    """LlamaModel reads tensors instead of a checkpoint's files while inside."""
    from loraplex.models import llama

    load = llama.load_safetensors
    llama.load_safetensors = lambda model_dir, dtype, device, keep=None: tensors
    try:
        yield
    finally:
        llama.load_safetensors = load


def build_model(shape: Shape, dtype, device, max_len: int):
    from loraplex.models.llama import LlamaModel

    with weights_from(random_weights(shape, dtype, device)):
        return LlamaModel("", dtype, device, max_len=max_len, config=hf_config(shape, max_len))


def lora_slots(shape: Shape, num_adapters: int, rank: int, dtype, device):
    """LoraSlots of num_adapters random adapters of rank on every projection (written in place: no files)."""
    from loraplex.lora.slots import LoraSlots

    slots = LoraSlots(shape.layers, shape.module_shapes(), num_adapters, rank, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    for layer in range(shape.layers):
        for m in slots.a[layer]:
            slots.a[layer][m].copy_(torch.randn(slots.a[layer][m].shape, generator=gen, device=device) * 0.01)
            slots.b[layer][m].copy_(torch.randn(slots.b[layer][m].shape, generator=gen, device=device) * 0.01)
    slots._ranks.fill_(rank)
    slots._scales.fill_(2.0)
    return slots


def decode_batch(model, batch: int, context: int, block_size: int, device):
    """(input_ids, AttentionBatch) of batch sequences each at context tokens, blocks laid end to end."""
    from loraplex.models.llama import AttentionBatch

    per_seq = math.ceil(context / block_size)
    tables = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, per_seq)
    last = context - 1
    slot_mapping = tables[:, last // block_size].long() * block_size + last % block_size
    attn = AttentionBatch(
        positions=torch.full((batch,), last, dtype=torch.int64, device=device), slot_mapping=slot_mapping,
        block_tables=tables, context_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        cu_query_lens=torch.arange(batch + 1, dtype=torch.int32, device=device), is_decode=True)
    ids = torch.randint(0, model.vocab_size, (batch,), device=device)
    return ids, attn, batch * per_seq


def time_step(step, device, iters: int) -> float:
    """Median seconds of step over iters runs (after 2 warm-ups)."""
    for _ in range(2):
        step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(args) -> list[dict]:
    from loraplex.lora.backends import KernelLoraBackend

    device = torch.device(args.device)
    shape = TINY if args.tiny else LLAMA3_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(shape, dtype, device, max_len=args.context + 16)
    ids_batches = {b: decode_batch(model, b, args.context, args.block_size, device) for b in args.batches}
    kv_cache = model.allocate_kv_cache(max(n for _i, _a, n in ids_batches.values()), args.block_size)
    kv_cache.normal_(0, 1)  # random keys/values: the bytes read are what matters
    capture = None
    if device.type == "cuda" and not args.eager:
        from loraplex.worker.decode_graphs import cuda_graph_capture

        capture = cuda_graph_capture()
    rows = []
    for num_adapters in args.adapters:
        backend = None
        if num_adapters:
            slots = lora_slots(shape, num_adapters, args.rank, dtype, device)
            backend = KernelLoraBackend(slots, lambda arr: torch.from_numpy(arr).to(device))
        for batch in args.batches:
            ids, attn, _ = ids_batches[batch]
            plan = None
            if backend is not None:
                seq_slots = (np.arange(batch) % num_adapters).astype(np.int32)
                plan = backend.rows(torch.from_numpy(seq_slots).to(device))

            def forward(ids=ids, attn=attn, plan=plan):
                return model.logits(model.forward(ids, attn, kv_cache, plan))

            step = forward
            if capture is not None:
                step, _out = capture(forward)
            seconds = time_step(step, device, args.iters)
            used = min(batch, num_adapters)
            nbytes = step_bytes(shape, batch, args.context, used, args.rank, torch.finfo(dtype).bits // 8)
            tokens_s = batch / seconds
            roof = roofline_tokens_s(nbytes, batch, args.peak_gbs)
            rows.append({"adapters": num_adapters, "batch": batch, "step_ms": seconds * 1e3, "tokens_s": tokens_s,
                         "roofline_tokens_s": roof, "of_roofline": tokens_s / roof, "step_gb": nbytes / 1e9})
            print(f"adapters {num_adapters:>3} batch {batch:>4}: {seconds * 1e3:8.2f} ms/step {tokens_s:10.1f} tok/s"
                  f"  roofline {roof:10.1f} ({tokens_s / roof:6.1%})", flush=True)
            step = forward = None
        backend = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["batch"]: r["tokens_s"] for r in rows if r["adapters"] == 0}
    for r in rows:
        r["of_base"] = r["tokens_s"] / base[r["batch"]] if r["batch"] in base else None
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (checks the script works)")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 8, 32], help="0: the base model")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="cached tokens of each sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peak-gbs", type=float, default=None,
                   help="device peak HBM bandwidth, GB/s (default: the device's; 4800 for the CPU smoke run)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("decode_roofline: no CUDA device (use --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    from hbm_peak import peak_gbs  # a sibling: benchmarks/ is on sys.path when run

    if args.device.startswith("cuda") or args.peak_gbs:
        args.peak_gbs, peak_source = peak_gbs(args.peak_gbs, args.device)
    else:
        args.peak_gbs, peak_source = 4800.0, "nominal (the CPU smoke run)"
    print(f"peak HBM bandwidth {args.peak_gbs:.0f} GB/s ({peak_source})", flush=True)
    rows = measure(args)
    report = {"shape": asdict(TINY if args.tiny else LLAMA3_8B), "device": args.device, "peak_gbs": args.peak_gbs,
              "peak_source": peak_source,
              "context": args.context, "rank": args.rank, "graphs": args.device.startswith("cuda") and not args.eager,
              "rows": rows}
    if args.device.startswith("cuda"):
        report["device_name"] = torch.cuda.get_device_name()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
