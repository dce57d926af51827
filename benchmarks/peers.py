"""In-process peers the benchmarks measure Loraplex against: HF transformers and peft on the same requests.

Each peer gets a list of `Job`s (a prompt's token ids, its max_tokens, its adapter or None)
and generates exactly max_tokens tokens for each, greedy, with EOS not ending a sequence
(vLLM's ignore_eos): the models' `generation_config.eos_token_id` is cleared
(`without_eos`), since an `eos_token_id=None` passed to `generate` is refilled from it.

* `run_static`: static batches, each one `generate` call of up to `batch_size` left-padded
  prompts that runs until the batch's longest max_tokens (a row's extra tokens are
  dropped: the waste of static batching). `batches_by_adapter` plans peft one adapter at a
  time (`set_adapter` per batch), `batches_in_arrival_order` plans mixed-adapter batches
  (peft's per-row `adapter_names=`) or the base model without adapters.
* `run_continuous_batching`: transformers' continuous batching (the manager behind
  `generate_batch`, fed per-request max_new_tokens) on the base model.

Also here: the random LLaMA and random PEFT adapters the benchmarks build
(`build_model_and_adapters`), and the models loaded the way the peers need them
(`load_peer_models`).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
PEFT_BASE_ROW = "__base__"  # peft's adapter_names entry for a row without an adapter


@dataclass(frozen=True)
class Job:
    """One request: its prompt's token ids (BOS included), exactly how many tokens to generate, its adapter."""

    prompt_ids: list[int]
    max_tokens: int
    adapter: str | None = None


@dataclass
class PeerRun:
    """What one peer produced for a list of jobs, and how long it took."""

    tokens: list[list[int]]  # per job, its max_tokens generated ids
    seconds: float  # wall time of the whole run, prefill included
    decode_seconds: float = 0.0  # from each batch's first generated token to its end
    decode_tokens: int = 0  # useful tokens generated after each row's first

    @property
    def useful_tokens(self) -> int:
        """Tokens generated for the jobs, each cut to its max_tokens (a static batch's extra ones do not count)."""
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """Useful output tokens per second of wall time."""
        return self.useful_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Useful tokens after the first of each row per second of decode time (nan if none)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else float("nan")


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def quiet_transformers() -> None:
    """No progress bars or info logs from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def target_modules(targets: str) -> list[str]:
    """The LoRA target modules "all" (the 7 projections) or "attn" (q, k, v, o) name."""
    from loraplex.lora.shapes import MODULES

    return list(MODULES) if targets == "all" else ATTENTION_PROJECTIONS


def build_model_and_adapters(work: Path, num_adapters: int, rank: int, targets: str, *, model_dir: str | None = None,
                             **model_config) -> tuple[str, dict[str, str]]:
    """A random LLaMA (byte tokenizer, widened to a vocab_size given in ``model_config``, which overrides the demo's
    config) unless ``model_dir`` is given, and
    ``num_adapters`` random PEFT adapters lora00, lora01, ... (rank ``rank``, alpha 2*rank, on ``targets``: all or
    attn) under ``work``; returns (model_dir, adapter name -> folder)."""
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex.models.builtin.demo import build_peft_adapter, build_tiny_llama

    quiet_transformers()
    if model_dir is None:
        model_dir = str(build_tiny_llama(work / "model", initializer_range=0.02, lm_head_scale=1.0, **model_config))
        if "vocab_size" in model_config:
            widen_byte_vocab(model_dir, model_config["vocab_size"])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapters = {}
    for i in range(num_adapters):
        name = f"lora{i:02d}"
        adapters[name] = str(build_peft_adapter(model_dir, work / "adapters" / name, rank, 2 * rank,
                                                target_modules(targets), 1000 + i, model=base, b_scale=0.1))
    return model_dir, adapters


def widen_byte_vocab(model_dir: Path, vocab_size: int) -> None:
    """Give the byte tokenizer of ``model_dir`` ids up to ``vocab_size``: id i past the bytes is the text " <i>".

    Without merges BPE never produces them from text, so prompts stay one token a byte;
    they only give a larger vocabulary's generated ids text to stream (unknown ids would
    decode to nothing, which AIPerf counts as a failed request).
    """
    path = Path(model_dir) / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab.update({f"\u0120<{i}>": i for i in range(len(vocab), vocab_size)})  # \u0120: the byte-level space
    path.write_text(json.dumps(data, ensure_ascii=False))


def without_eos(model):
    """``model`` with EOS no longer ending a sequence (its generation_config's eos_token_id cleared)."""
    model.generation_config.eos_token_id = None
    return model


def load_peer_models(model_dir: str, adapter_dirs: dict[str, str], dtype: str = "float32", device: str = "cpu"):
    """(plain HF model, PeftModel holding every adapter of ``adapter_dirs``), both in eval mode, EOS cleared.

    Two copies of the base weights: peft rewrites the model it wraps.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        return without_eos(model.to(device).eval())

    hf = load()
    names = sorted(adapter_dirs)
    if not names:
        return hf, None
    peft_model = PeftModel.from_pretrained(load(), adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(adapter_dirs[name], adapter_name=name)
    return hf, peft_model.eval()


class FirstTokenClock:
    """A generate() streamer that timestamps the first generated token (its 2nd put call)."""

    def __init__(self, device):
        self.device, self.calls, self.first = device, 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            sync(self.device)
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def left_padded(rows: list[list[int]], pad_id: int, device):
    """(input_ids, attention_mask) of ``rows`` padded on the left to the longest."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def generate_exactly(model, rows: list[list[int]], max_tokens: int, pad_id: int, streamer=None, **kwargs):
    """Greedy, exactly ``max_tokens`` new tokens for each of the left-padded ``rows``; EOS may be generated and
    does not stop (vLLM's ignore_eos).

    min_new_tokens would instead forbid EOS (other tokens than the engine's), and an
    eos_token_id=None passed here is refilled from model.generation_config, hence
    `without_eos`. Returns the new ids, one list per row. ``kwargs`` go to generate (e.g.
    peft's adapter_names).
    """
    import torch

    config = copy.deepcopy(model.generation_config)
    assert config.eos_token_id is None, "clear the model's generation_config.eos_token_id (without_eos)"
    config.do_sample, config.max_new_tokens, config.max_length, config.pad_token_id = False, max_tokens, None, pad_id
    ids, mask = left_padded(rows, pad_id, model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=streamer, **kwargs)
    return out[:, ids.shape[1]:].tolist()


def batches_by_adapter(jobs: list[Job], batch_size: int) -> list[list[int]]:
    """Job indices in batches of one adapter each: adapters in order of first use, each's jobs in order."""
    groups: dict[str | None, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.adapter, []).append(i)
    return [rows[k:k + batch_size] for rows in groups.values() for k in range(0, len(rows), batch_size)]


def batches_in_arrival_order(jobs: list[Job], batch_size: int) -> list[list[int]]:
    """Job indices in consecutive batches of up to ``batch_size``, whatever their adapters."""
    return [list(range(k, min(k + batch_size, len(jobs)))) for k in range(0, len(jobs), batch_size)]


def run_static(model, jobs: list[Job], batches: list[list[int]], pad_id: int, *, adapters: str = "none") -> PeerRun:
    """One generate call per batch, each until its longest max_tokens; each job keeps its own max_tokens tokens.

    ``adapters``: "none" (every job on the model as it is: the plain HF model), "set" (a
    PeftModel, ``set_adapter`` to the batch's one adapter) or "per-row" (a PeftModel, peft's
    ``adapter_names=`` with each row's adapter).
    """
    tokens: list[list[int] | None] = [None] * len(jobs)
    run = PeerRun(tokens=tokens, seconds=0.0)
    sync(model.device)
    started = time.perf_counter()
    for rows in batches:
        kwargs = {}
        if adapters == "set":
            names = {jobs[i].adapter for i in rows}
            if len(names) != 1 or None in names:
                raise ValueError(f"adapters='set' needs one adapter per batch, got {sorted(map(str, names))}")
            model.set_adapter(names.pop())
        elif adapters == "per-row":
            kwargs["adapter_names"] = [jobs[i].adapter or PEFT_BASE_ROW for i in rows]
        longest = max(jobs[i].max_tokens for i in rows)
        clock = FirstTokenClock(model.device)
        out = generate_exactly(model, [jobs[i].prompt_ids for i in rows], longest, pad_id, clock, **kwargs)
        sync(model.device)
        if longest > 1:
            run.decode_seconds += time.perf_counter() - clock.first
            run.decode_tokens += sum(jobs[i].max_tokens - 1 for i in rows)
        for k, i in enumerate(rows):
            tokens[i] = out[k][:jobs[i].max_tokens]
    run.seconds = time.perf_counter() - started
    return run


def continuous_batching_missing() -> str | None:
    """Why transformers' continuous batching (`generate_batch`) cannot run here, or None if it can."""
    import transformers
    from transformers import GenerationMixin

    if not hasattr(GenerationMixin, "init_continuous_batching"):
        return f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
    return None


def run_continuous_batching(model, jobs: list[Job], max_batch_tokens: int = 2048, page_size: int = 16) -> PeerRun:
    """transformers' continuous batching on the plain HF model: every job added at once with its own max_new_tokens.

    generate_batch itself takes one max_new_tokens for all requests, so this drives the same
    manager (`continuous_batching_context_manager`) directly; eos_token_id -1 = none.
    Adapters are ignored (base model). Its KV cache holds every job at once (pages of
    ``page_size`` tokens); a step takes at most ``max_batch_tokens`` tokens. Left to
    itself, transformers sizes both from free memory, which on CPU is the machine's RAM:
    tens of GB of cache and attention masks, 25 s for a few tokens. Timed from the first
    request added to the last result (the manager's start and stop, like a server's, are not).
    """
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(j.max_tokens for j in jobs), eos_token_id=-1)
    pages = sum(-(-(len(job.prompt_ids) + job.max_tokens) // page_size) for job in jobs)
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=pages + len(jobs),
                                         max_batch_tokens=max_batch_tokens)
    tokens: dict[str, list[int]] = {}
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, block=True, warmup=False) as manager:
        sync(model.device)
        started = time.perf_counter()
        ids = [manager.add_request(job.prompt_ids, request_id=f"job-{i}", max_new_tokens=job.max_tokens,
                                   eos_token_id=-1) for i, job in enumerate(jobs)]
        while len(tokens) < len(jobs):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers' continuous batching: {result.request_id}: {result.error}")
                tokens[result.request_id] = list(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError(f"transformers' continuous batching stopped with {len(tokens)}/{len(jobs)} done")
        sync(model.device)
        seconds = time.perf_counter() - started
    return PeerRun(tokens=[tokens[i] for i in ids], seconds=seconds)
