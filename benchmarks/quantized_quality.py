"""What each quantized weight format costs SmolLM2 in quality against full precision (issue 41, item 5).

    python benchmarks/quantized_quality.py [--formats fp32,int8,fp8-channel,fp8-tensor,int4-g128,int4-load]
        [--engine int8] [--window 0] [--stride 0] [--prompts 8] [--prompt-tokens 64] [--greedy-tokens 128]
        [--quick] [--json PATH]

The text: benchmarks/data/alice-chapter-1.txt (Project Gutenberg eBook #11, public domain; its README),
3,026 SmolLM2 tokens. Perplexity = exp(mean negative log-likelihood of every token after the first), each
token predicted from the text before it within sliding windows of --window tokens (default: the model's
context, max_position_embeddings: 8,192 for SmolLM2, so the whole text is one window) moved by --stride
(default: half the window); a window scores only the tokens past the previous window's end, so every token is
scored once, with at least window - stride tokens before it where the text has them.

Rows, all on the same token ids:
  transformers (the oracle of issue 41) on the checkpoint's fp32 weights (`fp32`), then on the dequantized
  weights of each format, quantized by loraplex.models.quant (helper 41-B's functions):
    int8         per output channel, symmetric (`quantize_int8`): the projections and lm_head, as
                 `--quantization int8` serves them (a tied lm_head its own int8 weight; the embedding
                 lookups keep the fp32 one);
    fp8-channel  e4m3 per output channel (`quantize_fp8`), the projections (lm_head full precision, as
                 vLLM's online fp8 and FP8 checkpoints keep it);
    fp8-tensor   e4m3, one scale per tensor (max|W| / 448), the projections;
    int4-g128    groups of 128 inputs, asymmetric, round to nearest (`quantize_int4`: GPTQ's/AWQ's storage
                 without their calibration), the projections; where 128 does not divide a row (SmolLM2's
                 576-wide inputs) its last group is shorter, as GPTQ's `g_idx = k // 128` groups it;
    int4-load    what `quantization: int4` serves: `quantize_int4`'s own groups, 128 where that divides the
                 row, else 64 or 32 (SmolLM2: 64 on the 576-wide inputs, 128 on down_proj's 1,536).
  Our engine (`--engine`: LLMEngine in process, `quantization` as named, every other knob at the server's
  default; `fp32` the control): its model teacher-forced over the same windows (the prompt's forward in
  chunks of 512 tokens, as the runner's chunked prefill), and the decode path (the one-call native decode
  where it serves) teacher-forced one token a step over the text's last --decode-tokens tokens. Each engine
  row is also compared with its own oracle (transformers on the same dequantized weights): the largest
  difference of a target token's logprob, and top-1 agreement.

KL: the mean over the text's positions of KL(fp32 || format) of the next-token distributions (nats), and its
99th percentile: the quantization's effect on every prediction, not only on the text's own tokens.
Greedy agreement: "top-1" = the fraction of the text's positions whose argmax equals fp32's (transformers);
"greedy": --prompts excerpts of the text (--prompt-tokens each, at evenly spaced offsets) continued greedily
for --greedy-tokens tokens (ignoring EOS; transformers' generate, our engine's requests), each compared with
fp32's continuation: how many are identical and the first position where one differs (--greedy-tokens: none).

Goals (issue 41): int8 and fp8 within +1% perplexity of fp32, int4 within +5%. The SmolLM2 checkpoint here
was itself dequantized from a Q4_1 GGUF (loraplex.models.builtin.smollm2): its "full precision" weights lie on
a 4-bit grid of 32-input groups, which int4 with 128-input groups does not reproduce. --quick: the demo model,
the first 256 tokens, 2 prompts of 16 + 8 tokens: a smoke run whose figures mean nothing. Nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "benchmarks" / "data" / "alice-chapter-1.txt"
CHUNK = 512  # tokens per forward within a window (the oracle's and the engine's)
GOALS = {"int8": 1.01, "fp8-channel": 1.01, "fp8-tensor": 1.01, "int4-g128": 1.05, "int4-load": 1.05}  # perplexity / fp32's, at most


@dataclass(frozen=True)
class Format:
    """A weight format: the projections' (and lm_head's, where `lm_head`) weights it serves, dequantized
    (`weights(W)`; None: W as it is)."""

    name: str
    what: str
    weights: object
    lm_head: bool = False


def quantize_fp8_tensor(w: torch.Tensor):
    """e4m3 with one scale for the whole tensor: max|W| / 448."""
    from loraplex.models.quant import Fp8Weight
    from loraplex.models.quant.forms import FP8_MAX

    w = w.float()
    amax = w.abs().max()
    scale = (amax / FP8_MAX if amax > 0 else torch.ones(())).reshape(1)
    return Fp8Weight((w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)


def dequantized_int4_g128(w: torch.Tensor) -> torch.Tensor:
    """int4 in groups of 128 inputs along each row, the last group shorter where 128 does not divide K (as GPTQ's
    g_idx = k // 128 groups them): quantize_int4 of the row padded with zeros to a multiple of 128 (its range
    already holds 0, so the padding changes no group's scale or zero), dequantized, the padding cut off."""
    from loraplex.models.quant import dequantize, quantize_int4

    k = w.shape[1]
    padded = torch.nn.functional.pad(w.float(), (0, -k % 128))
    return dequantize(quantize_int4(padded, group_size=128))[:, :k]


def formats() -> dict[str, Format]:
    from loraplex.models.quant import dequantize, quantize_fp8, quantize_int4, quantize_int8

    def of(quantize):
        return lambda w: dequantize(quantize(w))

    return {f.name: f for f in (
        Format("fp32", "the checkpoint's weights", None),
        Format("int8", "int8 per channel, projections + lm_head", of(quantize_int8), lm_head=True),
        Format("fp8-channel", "e4m3 per channel, projections", of(quantize_fp8)),
        Format("fp8-tensor", "e4m3 per tensor, projections", of(quantize_fp8_tensor)),
        Format("int4-g128", "int4 asym. groups of 128, projections", dequantized_int4_g128),
        Format("int4-load", "int4 asym. as quantization int4 groups them, projections", of(quantize_int4)),
    )}


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n tokens: position t is scored when its token is
    predicted, from the tokens before it in the window; every position 1..n-1 once."""
    out, scored = [], 1
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        if end > scored:
            out.append((begin, end, scored))
            scored = end
        if end == n:
            break
    return out


class Scores:
    """Per scored position, in order: the target's log-probability, the argmax and, against a reference's
    log-probabilities (ref [positions, V]), KL(reference || this); keep: hold every row's log-probabilities (the
    fp32 oracle's, the others' reference)."""

    def __init__(self, ref: torch.Tensor | None = None, keep: bool = False):
        self.ref, self.keep = ref, keep
        self.logp, self.top, self.kl, self.rows = [], [], [], []
        self.at = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        self.logp.append(logp.gather(1, targets[:, None])[:, 0])
        self.top.append(logits.argmax(dim=-1))
        if self.ref is not None:
            ref = self.ref[self.at:self.at + len(targets)]
            self.kl.append((ref.exp() * (ref - logp)).sum(dim=-1))
        if self.keep:
            self.rows.append(logp)
        self.at += len(targets)

    def done(self) -> dict:
        """{"logp", "top", "kl" (None without a reference), "full" (None unless kept)} as tensors."""
        return {"logp": torch.cat(self.logp), "top": torch.cat(self.top),
                "kl": torch.cat(self.kl) if self.kl else None, "full": torch.cat(self.rows) if self.keep else None}


# ---- transformers (the oracle) ---------------------------------------------------------------------------

class Oracle:
    """transformers' model of the checkpoint, its projections (and lm_head) swapped for a format's dequantized
    weights."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        from loraplex.models.quant.weights import PROJECTION

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.projections = {name: m for name, m in self.model.named_modules() if PROJECTION.match(name + ".weight")}
        self.originals = {name: m.weight.detach().clone() for name, m in self.projections.items()}
        self.embed = self.model.get_input_embeddings().weight
        self.lm_head = self.model.get_output_embeddings().weight
        self.tied = self.lm_head is self.embed

    def use(self, fmt: Format) -> None:
        for name, module in self.projections.items():
            w = self.originals[name]
            module.weight.data = w.clone() if fmt.weights is None else fmt.weights(w)
        head = self.model.get_output_embeddings()
        original = self.embed if self.tied else self.lm_head
        if fmt.lm_head:  # its own weight: a tied embedding's lookups keep the full-precision rows
            head.weight = torch.nn.Parameter(fmt.weights(original.detach()), requires_grad=False)
        else:
            head.weight = original

    @torch.no_grad()
    def teacher_forced(self, ids: torch.Tensor, spans: list[tuple[int, int, int]], scores: Scores) -> dict:
        """scores of positions 1..n-1, each window's forward in chunks over one KV cache."""
        from transformers import DynamicCache

        for begin, end, first in spans:
            cache = DynamicCache()
            for a in range(begin, end, CHUNK):
                b = min(a + CHUNK, end)
                logits = self.model(input_ids=ids[None, a:b], cache=cache, use_cache=True).logits[0]
                lo, hi = max(a, first - 1), min(b, end - 1, len(ids) - 1)  # rows predicting positions lo+1..hi
                if hi > lo:
                    scores.add(logits[lo - a:hi - a], ids[lo + 1:hi + 1])
        return scores.done()

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, steps: int) -> list[list[int]]:
        """Greedy continuations of the equal-length prompts [P, L], EOS ignored."""
        out = self.model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                  max_new_tokens=steps, min_new_tokens=0, eos_token_id=None,
                                  pad_token_id=self.model.config.pad_token_id or 0)
        return out[:, prompts.shape[1]:].tolist()


# ---- our engine ------------------------------------------------------------------------------------------

def make_engine(model_dir: str, quantization: str, knobs: dict):
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    quant = {} if quantization == "fp32" else {"quantization": quantization}
    return LLMEngine(EngineConfig.from_dict({"model_dir": model_dir, **knobs, **quant}))


def _attention(positions: torch.Tensor, context: int, blocks: int, decode: bool):
    from loraplex.models.llama import AttentionBatch

    return AttentionBatch(positions=positions, slot_mapping=positions.clone(),
                          block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                          context_lens=torch.tensor([context], dtype=torch.int32),
                          cu_query_lens=torch.tensor([0, len(positions)], dtype=torch.int32), is_decode=decode)


def _forward(model, ids: torch.Tensor, positions: torch.Tensor, context: int, kv, blocks: int, decode: bool):
    """Logits [T, V] of one sequence's tokens at positions (its KV slots = its positions)."""
    attn = _attention(positions, context, blocks, decode)
    if not decode and hasattr(attn, "prompt_rows"):  # as the runner marks them (a chunk of one prompt: every row)
        attn.prompt_rows = torch.ones(len(positions), dtype=torch.bool)
    return model.logits(model.forward(ids, attn, kv, None))


@torch.no_grad()
def engine_teacher_forced(engine, ids: torch.Tensor, spans, decode_tokens: int, ref: torch.Tensor):
    """Scores (against ref, the fp32 oracle's log-probabilities) of positions 1..n-1 through the engine's model
    (prompt forwards in chunks), and of the last decode_tokens positions through decode steps, one token each."""
    model, bs = engine.model, engine.config.block_size
    longest = max(end - begin for begin, end, _ in spans)
    blocks = -(-longest // bs)
    kv = model.allocate_kv_cache(blocks, bs)
    prompt, decode = Scores(ref), Scores(ref[-decode_tokens:])
    for begin, end, first in spans:
        for a in range(begin, end, CHUNK):
            b = min(a + CHUNK, end)
            pos = torch.arange(a - begin, b - begin)
            logits = _forward(model, ids[a:b], pos, b - begin, kv, blocks, decode=False)
            lo, hi = max(a, first - 1), min(b, end - 1, len(ids) - 1)
            if hi > lo:
                prompt.add(logits[lo - a:hi - a], ids[lo + 1:hi + 1])
    # decode path: the last window's prompt up to n - 1 - decode_tokens, then one token a step
    begin, end, _ = spans[-1]
    start = end - 1 - decode_tokens
    kv.zero_()
    for a in range(begin, start, CHUNK):
        b = min(a + CHUNK, start)
        _forward(model, ids[a:b], torch.arange(a - begin, b - begin), b - begin, kv, blocks, decode=False)
    for t in range(start, end - 1):
        logits = _forward(model, ids[t:t + 1], torch.tensor([t - begin]), t - begin + 1, kv, blocks, decode=True)
        decode.add(logits, ids[t + 1:t + 2])
    return prompt.done(), decode.done()


def engine_greedy(engine, prompts: torch.Tensor, steps: int) -> list[list[int]]:
    """Greedy continuations through the engine's requests (one batch, EOS ignored)."""
    from loraplex.engine.request import SamplingParams

    requests = []
    for i, row in enumerate(prompts.tolist()):
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        request = engine.make_request(f"greedy-{i}", engine.tokenizer.decode(row), params)
        request.prompt_token_ids = row  # the excerpt's own ids, as the oracle reads them
        requests.append(request)
    outputs = engine.generate(requests)
    return [[t for out in outputs[r.request_id] for t in out.token_ids] for r in requests]


# ---- figures ---------------------------------------------------------------------------------------------

def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where the continuations differ (their length where none does)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def row_figures(scores: dict, greedy: list[list[int]], ref: dict) -> dict:
    """Perplexity, KL divergence from fp32 and agreement with the fp32 oracle's (ref) figures."""
    nll = -scores["logp"].double().mean().item()
    kl = scores["kl"].double()
    div = [first_divergence(g, r) for g, r in zip(greedy, ref["greedy"])]
    return {"ppl": math.exp(nll), "nll": nll, "ppl_ratio": math.exp(nll - ref["nll"]),
            "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "top1_agree": (scores["top"] == ref["top"]).double().mean().item(),
            "greedy_identical": sum(d == len(g) for d, g in zip(div, greedy)), "first_divergence": div}


def table(rows: list[dict], prompts: int, steps: int) -> str:
    lines = ["| model | weights | perplexity | vs fp32 | KL from fp32, mean / p99 | top-1 = fp32 | greedy identical | "
             "first divergence (min / median) | goal | met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = GOALS.get(r["format"])
        met = "-" if goal is None or r["format"] == "fp32" else ("**yes**" if r["ppl_ratio"] <= goal else "no")
        lines.append(f"| {r['model']} | {r['what']} | {r['ppl']:.3f} | {100 * (r['ppl_ratio'] - 1):+.2f}% | "
                     f"{r['kl_mean']:.4f} / {r['kl_p99']:.3f} | "
                     f"{100 * r['top1_agree']:.2f}% | {r['greedy_identical']}/{prompts} | "
                     f"{min(r['first_divergence'])} / {statistics.median(r['first_divergence']):g} of {steps} | "
                     f"{'-' if goal is None else f'<= +{100 * (goal - 1):g}%'} | {met} |")
    return "\n".join(lines)


def exactness_table(rows: list[dict]) -> str:
    lines = ["| engine | oracle | max abs logprob diff (prompt path) | top-1 = oracle | decode path: max abs "
             "logprob diff | top-1 = oracle | greedy identical to the oracle's |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        x = r["vs_oracle"]
        lines.append(f"| {r['model']} | transformers, {r['format']} | {x['max_logprob_diff']:.2e} | "
                     f"{100 * x['top1_agree']:.2f}% | {x['decode_max_logprob_diff']:.2e} | "
                     f"{100 * x['decode_top1_agree']:.2f}% | {x['greedy_identical']}/{len(r['first_divergence'])} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="checkpoint (default: SmolLM2's, .cache/smollm2/model)")
    ap.add_argument("--text", type=Path, default=TEXT, help="the text (default: %(default)s)")
    ap.add_argument("--formats", default="fp32,int8,fp8-channel,fp8-tensor,int4-g128,int4-load",
                    help="transformers rows, fp32 first (default: %(default)s)")
    ap.add_argument("--engine", default="fp32,int8",
                    help="our engine's rows: fp32 (the control) and quantization knobs served on the CPU "
                         "(default: %(default)s; empty: none)")
    ap.add_argument("--engine-config", default="{}", help="engine knobs (JSON) of every engine row (default: %(default)s)")
    ap.add_argument("--window", type=int, default=0, help="tokens a window (default 0: the model's context)")
    ap.add_argument("--stride", type=int, default=0, help="tokens between windows (default 0: half the window)")
    ap.add_argument("--decode-tokens", type=int, default=64,
                    help="the text's last tokens teacher-forced through the engine's decode path (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=8, help="greedy continuations (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="tokens of each excerpt (default: %(default)s)")
    ap.add_argument("--greedy-tokens", type=int, default=128, help="tokens each continues (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the demo model, a short text, few tokens (a smoke run)")
    ap.add_argument("--json", default=None, help="write every figure here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from loraplex.launch.serve import builtin_model

    if args.quick:
        args.prompts, args.prompt_tokens, args.greedy_tokens, args.decode_tokens = 2, 16, 8, 8
    model_dir = args.model_dir or str(builtin_model("tiny" if args.quick else "smollm2")[0])
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tokenizer(args.text.read_text()).input_ids)
    if args.quick:
        ids = ids[:256]
    window = args.window or config.max_position_embeddings
    stride = args.stride or max(1, window // 2)
    spans = windows(len(ids), window, stride)
    offsets = [i * (len(ids) - args.prompt_tokens) // args.prompts for i in range(args.prompts)]
    prompts = torch.stack([ids[o:o + args.prompt_tokens] for o in offsets])
    fmts = formats()
    names = [n for n in args.formats.split(",") if n]
    engine_rows = [n for n in args.engine.split(",") if n]
    if names[:1] != ["fp32"]:
        raise SystemExit("quantized_quality.py: --formats must start with fp32 (the reference)")
    print(f"[quality] {model_dir}: {len(ids)} tokens of {args.text.name}, window {window} "
          f"({'the model context' if not args.window else 'set'}), stride {stride}: {len(spans)} window(s); "
          f"{args.prompts} greedy prompts of {args.prompt_tokens} tokens x {args.greedy_tokens}; "
          f"{torch.get_num_threads()} torch threads", flush=True)
    started = time.monotonic()
    oracle, rows, oracle_of, full, engines = Oracle(model_dir), [], {}, None, []

    def save(wall: float | None = None) -> None:
        """The figures so far into --json (after every row: a failure later keeps them; wall None: unfinished)."""
        if args.json:
            text = args.text.relative_to(ROOT) if args.text.is_relative_to(ROOT) else args.text
            Path(args.json).write_text(json.dumps({
                "model_dir": model_dir, "text": str(text), "tokens": len(ids), "window": window, "stride": stride,
                "windows": len(spans), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                "greedy_tokens": args.greedy_tokens, "decode_tokens": args.decode_tokens, "goals": GOALS,
                "rows": rows, "engine_rows": engines, "torch_threads": torch.get_num_threads(), "wall_s": wall,
                "quick": args.quick}, indent=1) + "\n")

    for name in dict.fromkeys(names + [n for n in engine_rows if n in fmts]):
        t0 = time.monotonic()
        oracle.use(fmts[name])
        scores = oracle.teacher_forced(ids, spans, Scores(full, keep=full is None))  # fp32 first: the reference
        if full is None:
            full = scores["full"]
            scores["kl"] = torch.zeros(len(full))
        greedy = oracle.greedy(prompts, args.greedy_tokens)
        oracle_of[name] = {"logp": scores["logp"], "top": scores["top"], "greedy": greedy,
                           "nll": -scores["logp"].double().mean().item()}
        if name in names:
            rows.append({"model": "transformers", "format": name, "what": fmts[name].what,
                         **row_figures(scores, greedy, oracle_of["fp32"])})
            print(f"[quality] transformers {name}: perplexity {rows[-1]['ppl']:.4f} "
                  f"({100 * (rows[-1]['ppl_ratio'] - 1):+.2f}%), KL {rows[-1]['kl_mean']:.4f} in {time.monotonic() - t0:.0f} s", flush=True)
            save()
    del oracle
    for name in engine_rows:
        t0 = time.monotonic()
        engine = make_engine(model_dir, name, json.loads(args.engine_config))
        prompt, decode = engine_teacher_forced(engine, ids, spans, args.decode_tokens, full)
        greedy = engine_greedy(engine, prompts, args.greedy_tokens)
        label = getattr(getattr(engine.model, "quant", None), "label", name)
        del engine
        mine = oracle_of.get(name)
        row = {"model": f"ours ({label})", "format": name, "what": fmts[name].what if name in fmts else name,
               **row_figures(prompt, greedy, oracle_of["fp32"]),
               "decode_path": {"tokens": len(decode["logp"]), "kl_mean": decode["kl"].double().mean().item()}}
        if mine is not None:
            n = len(decode["logp"])
            row["vs_oracle"] = {
                "max_logprob_diff": (prompt["logp"] - mine["logp"]).abs().max().item(),
                "top1_agree": (prompt["top"] == mine["top"]).double().mean().item(),
                "decode_max_logprob_diff": (decode["logp"] - mine["logp"][-n:]).abs().max().item(),
                "decode_top1_agree": (decode["top"] == mine["top"][-n:]).double().mean().item(),
                "greedy_identical": sum(first_divergence(g, r) == len(g) for g, r in zip(greedy, mine["greedy"])),
                "decode_tokens": n}
        engines.append(row)
        save()
        print(f"[quality] engine {name}: perplexity {row['ppl']:.4f} ({100 * (row['ppl_ratio'] - 1):+.2f}%), "
              f"KL {row['kl_mean']:.4f} in {time.monotonic() - t0:.0f} s", flush=True)
    wall = time.monotonic() - started
    print(f"\n{Path(model_dir).name}: {len(ids)} tokens of {args.text.name}, window {window}, stride {stride}; "
          f"greedy: {args.prompts} excerpts of {args.prompt_tokens} tokens, {args.greedy_tokens} tokens each\n")
    print(table(rows + engines, args.prompts, args.greedy_tokens))
    checked = [r for r in engines if "vs_oracle" in r]
    if checked:
        print("\nOur engine against transformers on the same (dequantized) weights:\n")
        print(exactness_table(checked))
    print(f"\nwall time {wall:.0f} s")
    save(wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
