"""What adapters on embed_tokens and lm_head cost a step and a slot (decision 067), at a model's shapes.

In process, no checkpoint needed: a decode step of ``--rows`` rows, half on base and half spread over four
slots (an embedding LoRA, an lm_head LoRA, and two adapters training the same ``--tokens`` ids, one of them tied
to the lm_head), against the same step's embedding lookup and lm_head GEMM alone. Then the device bytes one
slot holds for each part at ``--rank``, beside what a fully trained (modules_to_save) embed_tokens or lm_head
would take per slot. Shapes default to SmolLM2-135M's; ``--vocab 128256 --hidden 4096`` gives Llama-3-8B's.

    python benchmarks/vocab_adapters.py [--rows 32] [--rank 16] [--tokens 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from loraplex.lora.vocab import VocabAdapter, VocabSlots


class _Adapter:
    def __init__(self, vocab: VocabAdapter):
        self.vocab, self.name = vocab, "bench"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    v, h, r, n = args.vocab, args.hidden, args.rank, args.tokens
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(100, 100 + n)
    parts = [VocabAdapter(vocab_size=v, embed_lora=(torch.randn(r, v, generator=g), torch.randn(h, r, generator=g), 2.0)),
             VocabAdapter(vocab_size=v, lm_lora=(torch.randn(r, h, generator=g), torch.randn(v, r, generator=g), 2.0)),
             VocabAdapter(vocab_size=v, embed_tokens=(ids, torch.randn(n, h, generator=g))),
             VocabAdapter(vocab_size=v, embed_tokens=(ids, torch.randn(n, h, generator=g)))]
    parts[3].lm_tokens = parts[3].embed_tokens
    slots = VocabSlots(8, "cpu")
    for s, part in enumerate(parts):
        slots.load(s, slots.prepare(_Adapter(part)))
    seq_slots = np.array([s % 4 if s % 2 else -1 for s in range(args.rows)], np.int32)
    cu = np.arange(args.rows + 1, dtype=np.int32)
    table, lm_head_t = torch.randn(v, h, generator=g), torch.randn(h, v, generator=g)
    input_ids = torch.randint(0, v, (args.rows,), generator=g)
    hidden = torch.randn(args.rows, h, generator=g)
    out = torch.empty(args.rows, v)

    def base():
        table[input_ids]
        torch.mm(hidden, lm_head_t, out=out)

    def with_adapters():
        plan = slots.plan(seq_slots, cu, seq_slots, torch.from_numpy)
        plan.embed(table[input_ids], input_ids)
        plan.logits(torch.mm(hidden, lm_head_t, out=out), hidden)

    times = {base: [], with_adapters: []}
    for i in range(args.repeats + 10):  # interleaved, so a busy machine slows both alike; medians
        for fn, seen in times.items():
            start = time.perf_counter()
            fn()
            if i >= 10:
                seen.append((time.perf_counter() - start) * 1e3)
    base_ms, adapters_ms = (float(np.median(seen)) for seen in times.values())
    print(f"vocab {v}, hidden {h}, {args.rows} rows ({args.rows // 2} on 4 vocabulary slots), {args.threads} thread(s)")
    print(f"  lookup + lm_head GEMM: {base_ms:.3f} ms; with the slots' parts: {adapters_ms:.3f} ms (medians) "
          f"(+{adapters_ms - base_ms:.3f} ms, {adapters_ms / base_ms:.3f}x)")
    mib = 1 / (1 << 20)
    print(f"  one slot, fp32: embedding LoRA rank {r} {slots.held[0].nbytes() * mib:.2f} MiB, lm_head LoRA "
          f"{slots.held[1].nbytes() * mib:.2f} MiB, {n} trained tokens {slots.held[2].nbytes() * mib:.2f} MiB "
          f"(tied to lm_head: {slots.held[3].nbytes() * mib:.2f} MiB); a fully trained module "
          f"(modules_to_save): {v * h * 4 * mib:.1f} MiB")


if __name__ == "__main__":
    main()
