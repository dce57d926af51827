"""Builds one step's tensors from the scheduler's decisions, runs the model, samples."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.exceptions import NonFiniteLogits
from loraplex import kernels
from loraplex.lora.backends import LoraPlan, lora_backend
from loraplex.models.llama import AttentionBatch, LlamaModel
from loraplex.worker import grammar_mask
from loraplex.worker.grammar_budget import GrammarBudget
from loraplex.worker.sampler import sample_tokens, token_logprobs
from loraplex.worker.step_arrays import RepeatedDecode


# A step with prefill runs in the model's one-call decode forward, every token a query row of its own against
# its sequence's context (the rows write their K/V before any row attends), while its prompt rows attend to at
# most this many keys each on average: each row re-reads its sequence's keys, which costs little next to its
# GEMMs up to a few thousand (decision 039); longer contexts keep the prefill path.
ROWS_FORM_MAX_MEAN_CONTEXT = 4096
_NO_FILLING = contextlib.nullcontext()  # a step without constrained rows


@dataclass(slots=True)
class RunnerOutput:
    """Per scheduled sequence, then per fork child: sampled token (None mid-prefill), its logprob, top candidates."""

    token_ids: list[int | None]
    logprobs: list[float | None] | None  # None: no row asked for logprobs this step (none computed)
    top_logprobs: list | None
    errors: dict[int, Exception] = field(default_factory=dict)  # row -> why that row could not be sampled


class ModelRunner:
    """Owns the model, the KV tensor, the host swap tensor and the LoRA stacks; never decides policy. Each step's
    LoRA plan comes from the stacks' backend (loraplex.lora.backends), which alone decides how deltas are computed."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, lora_slots,
                 num_host_blocks: int = 0, eos_token_ids=()):
        self.model, self.kv_cache, self.block_size, self.lora_slots = model, kv_cache, block_size, lora_slots
        self.eos_token_ids = sorted(eos_token_ids)  # held back, with stop_token_ids, until a row's min_tokens
        self.device = model.device
        self._on_cpu = torch.device(self.device).type == "cpu"  # then a step array is used in place, not copied
        # on a GPU, rows with NaN or infinite logits are found without a sync of their own (_zero_non_finite)
        self._finite_on_device = not self._on_cpu
        # CPU: logits written into one buffer step after step; a fresh one over glibc's largest mmap threshold
        # (32 MB) is mapped and page-faulted anew each step, so the buffer is reused (figures: docs/benchmarks.md)
        self._logits_buffer = torch.empty(0, model.vocab_size)
        self._grammar = None  # GrammarMask, made at the first constrained row
        self.grammar_budget = GrammarBudget()  # each constrained row's matching budget (the engine sets its knobs)
        self.grammar_seconds: dict[str, float] = {}  # matching CPU seconds per tenant label (metrics)
        self.lora = None if lora_slots is None else lora_backend(model, lora_slots, self._tensor)
        # adapters on embed_tokens / lm_head (lora/vocab.py): checked against and added to this model's
        self.vocab = getattr(lora_slots, "vocab", None)
        if self.vocab is not None:
            self.vocab.bind(model)
        # a step with prefill may run in the one-call decode forward when that call adds its LoRA deltas too
        self._rows_form = model.native_decode is not None and (self.lora is None or self.lora.one_call)
        self.host_cache = allocate_host_cache(kv_cache, num_host_blocks)
        self._inputs = RepeatedDecode(block_size)  # a decode batch that repeats: its inputs and plans kept
        self.graphs = None  # DecodeGraphs (CUDA): decode steps replayed from captured graphs
        # Set while the model computes (its torch ops release the GIL): the engine's output thread runs then.
        self.computing: threading.Event | None = None

    def execute(self, batch, copies: bool = True) -> RunnerOutput:
        """Run one step for a SchedulerOutput: block copies (swap out, copy-on-write, swap in), then the model.

        ``copies=False`` skips the copies (a retry of a step whose copies already ran).
        """
        if copies:
            self.copy_blocks(batch)
        if not batch.seqs:
            return RunnerOutput([], [], [])
        step, plans = self._inputs.build(batch)
        vocab = plans[2] if plans else self._vocab_plan(batch, step)
        # a captured graph's embedding lookup would not see adapters on embed_tokens (their logits come after it)
        graphed = (self.graphs is not None and self.graphs.serves(step) and not (self.lora and self.lora.slots.dora_slots)
                   and not (vocab is not None and vocab.embeds))
        rows_form = not step.is_decode and self._rows_form and _prompt_rows_fit(step)
        if graphed:  # the graph reads its own static inputs; its LoRA plan is each row's adapter slot
            attn = None
            lora, sampling = plans[:2] if plans else (_adapter_slots(batch.seqs), None)
        else:
            attn = self._rows_attention(step) if rows_form else AttentionBatch(
                positions=self._tensor(step.positions),
                slot_mapping=self._tensor(step.slot_mapping),
                block_tables=self._tensor(step.block_tables),
                context_lens=self._tensor(step.context_lens),
                cu_query_lens=self._tensor(step.cu),
                is_decode=step.is_decode,
            )
            if not step.is_decode and self.model.prefill_parts:  # prompt rows on AMX tiles (decision 074)
                counts = np.diff(step.cu)
                attn.prompt_rows = self._tensor(np.repeat(counts > 1, counts))
            if not attn.is_decode and not self._on_cpu:  # prefill attention needs the lengths on the host
                kernels.remember_host_lengths(attn.cu_query_lens, attn.context_lens, step.cu.tolist(),
                                              step.context_lens.tolist())
            lora, sampling = plans[:2] if plans else (self._lora_batch(batch, step.cu, step.is_decode, rows_form), None)
        num = len(batch.seqs)
        sample_seqs = step.sample_seqs.tolist()
        every_seq = len(sample_seqs) == num  # then sample j is batch row j (forks follow)
        seqs, sample_rows = batch.seqs, step.sample_rows
        if not every_seq or batch.forks:
            seqs, sample_rows = [batch.seqs[i] for i in sample_seqs], sample_rows.tolist()
            for j, (i, child) in enumerate(batch.forks):  # n > 1: the other samples share the parent's last row
                sample_rows.append(int(step.cu[i + 1]) - 1)
                sample_seqs.append(num + j)
                seqs.append(child)
        rows = num + len(batch.forks)
        errors: dict[int, Exception] = {}
        sampling = sampling or _sampling_rows(seqs)
        # the masks fill on their threads while the model runs
        with _inference_mode(), self._filling(sampling[5]) as filling:
            with _while_set(self.computing):  # the output thread's turn: the model's ops, not the sampling's Python
                if graphed:
                    hidden = self.graphs.run(step, lora)
                else:
                    hidden = self.model.forward(self._tensor(step.input_ids), attn, self.kv_cache, lora, vocab)
                if not sample_seqs:
                    return RunnerOutput([None] * rows, [None] * rows, [None] * rows, errors)
                if seqs is batch.seqs and step.is_decode and hidden.is_contiguous():
                    picked = hidden  # every row sampled once, in order: the index would copy it unchanged
                else:
                    picked = hidden[self._tensor(sample_rows)]
                logits = self.model.logits(picked, self._logits_out(len(picked)), vocab)
            if self._finite_on_device:  # no sync before the sampled ids: see _zero_non_finite
                logits, row_finite = _zero_non_finite(logits)
                greedy = logits.argmax(dim=-1)  # not argmax_rows: its finite check reads a value back
            else:
                greedy, finite = kernels.argmax_rows(logits)  # one pass: the greedy tokens, and a NaN or inf anywhere
                if not finite:
                    logits = self._contain_non_finite(logits, torch.isfinite(logits).all(dim=-1), sample_seqs, errors)
                    greedy = None  # the rows zeroed: their argmax again
            params, generators, random_rows, wants_logprobs, min_rows, grammar_rows = sampling
            if self._restrict(logits, min_rows, grammar_rows, filling):
                greedy = None  # a restricted row's argmax again
            tokens = sample_tokens(logits, params, generators, random_rows, greedy)
            if wants_logprobs:
                chosen, tops = token_logprobs(logits, tokens, [p.logprobs for p in params])
            else:  # nobody reads them: skip a logsumexp over the vocabulary per row
                chosen = tops = None
            if self._finite_on_device:  # the step's one sync: the ids and each row's finite flag in one copy
                fetched = torch.cat([tokens, row_finite.to(tokens.dtype)]).cpu().numpy()
                token_array = fetched[: len(tokens)]
                _fail_non_finite(np.flatnonzero(fetched[len(tokens):] == 0).tolist(), sample_seqs, errors)
            else:
                token_array = (tokens if self._on_cpu else tokens.cpu()).numpy()
            tokens = token_array.tolist()
            if grammar_rows:
                self._grammar.advance(grammar_rows, tokens, sample_seqs, errors)
        if not errors:
            self._inputs.sampled(token_array, (lora, sampling, vocab))
        if every_seq:  # sample j is row j
            return RunnerOutput(tokens, chosen, tops, errors)
        wanted = chosen is not None
        out = RunnerOutput([None] * rows, [None] * rows if wanted else None, [None] * rows if wanted else None, errors)
        for j, i in enumerate(sample_seqs):
            out.token_ids[i] = tokens[j]
            if wanted:
                out.logprobs[i], out.top_logprobs[i] = chosen[j], tops[j]
        return out

    def _filling(self, grammar_rows: list):
        """A context of the constrained rows' bitmasks, filling from now on (None without any rows)."""
        return self._filled(grammar_rows) if grammar_rows else _NO_FILLING

    @contextlib.contextmanager
    def _filled(self, grammar_rows: list):
        """The rows' Filling; on leaving, every fill has ended (a failed step leaves none running)."""
        if self._grammar is None:
            self._grammar = grammar_mask.GrammarMask(self.model.vocab_size, self.device, seconds=self.grammar_seconds)
        self._grammar.budget = self.grammar_budget
        filling = self._grammar.fill(grammar_rows)
        try:
            yield filling
        finally:
            filling.settle()

    def _restrict(self, logits: torch.Tensor, min_rows: list, grammar_rows: list, filling=None) -> bool:
        """-inf where a row may not sample: its stop tokens below its min_tokens, the tokens its grammar refuses
        next (``filling``: their bitmasks). True if any row was restricted."""
        held = bool(min_rows) and _hold_stops(logits, min_rows, self.eos_token_ids)
        if grammar_rows:
            self._grammar.apply(logits, grammar_rows, filling)
        return held or bool(grammar_rows)

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        """The first rows of the reused logits buffer (grown as needed) on the CPU; None elsewhere."""
        if not self._on_cpu:
            return None
        if len(self._logits_buffer) < rows:
            self._logits_buffer = torch.empty(rows, self._logits_buffer.shape[1])
        return self._logits_buffer[:rows]

    def copy_blocks(self, batch) -> None:
        """The step's block copies, in order: swap out, copy-on-write, swap in."""
        if batch.swap_out:
            self.swap_out(batch.swap_out)
        if batch.copy_pairs:
            src, dst = zip(*batch.copy_pairs)
            kernels.copy_blocks(self.kv_cache, self._tensor(src), self._tensor(dst))
        if batch.swap_in:
            self.swap_in(batch.swap_in)

    @staticmethod
    def _contain_non_finite(logits: torch.Tensor, finite: torch.Tensor, sample_seqs: list[int],
                            errors: dict[int, Exception]) -> torch.Tensor:
        """Record an error for each row with NaN/inf logits and zero those rows so the others still sample."""
        bad = (~finite).nonzero().flatten().tolist()
        _fail_non_finite(bad, sample_seqs, errors)
        logits = logits.clone()
        logits[bad] = 0.0
        return logits

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device KV blocks to host blocks: (device, host) pairs."""
        dev, host = zip(*pairs)
        data = self.kv_cache.index_select(2, self._tensor(dev))
        self.host_cache.index_copy_(2, torch.tensor(host, dtype=torch.int64), data.to(self.host_cache.device))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host KV blocks back to device blocks: (host, device) pairs."""
        host, dev = zip(*pairs)
        data = self.host_cache.index_select(2, torch.tensor(host, dtype=torch.int64))
        self.kv_cache.index_copy_(2, self._tensor(dev), data.to(self.device, non_blocking=True))

    def _rows_attention(self, step) -> AttentionBatch:
        """A step with prefill in the decode form: each token a row with its own context length (its position
        + 1) and its sequence's block table."""
        owner = np.repeat(np.arange(len(step.context_lens)), np.diff(step.cu))
        return AttentionBatch(
            positions=self._tensor(step.positions),
            slot_mapping=self._tensor(step.slot_mapping),
            block_tables=self._tensor(step.block_tables[owner]),
            context_lens=self._tensor((step.positions + 1).astype(np.int32)),
            cu_query_lens=self._tensor(np.arange(len(owner) + 1, dtype=np.int32)),
            is_decode=True,
        )

    def _lora_batch(self, batch, cu: np.ndarray, is_decode: bool, rows_form: bool = False) -> LoraPlan | None:
        """The step's LoRA plan from its backend; None when no sequence has an adapter."""
        slots = None if self.lora is None else _adapter_slots(batch.seqs)
        return None if slots is None else self.lora.plan(slots, cu, is_decode, rows_form)

    def _vocab_plan(self, batch, step):
        """The step's VocabPlan (lora/vocab.py): the rows whose adapters change embed_tokens or lm_head, by slot;
        None when none does."""
        if self.vocab is None or not self.vocab.loaded:
            return None
        seq_slots = _adapter_slots(batch.seqs)
        if seq_slots is None:
            return None
        sample_slots = seq_slots[step.sample_seqs]  # the logits' rows: each sampled sequence, then the forks
        if batch.forks:
            sample_slots = np.concatenate([sample_slots, [child.adapter_slot for _, child in batch.forks]])
        return self.vocab.plan(seq_slots, step.cu, sample_slots, self._tensor)

    def _tensor(self, values) -> torch.Tensor:
        """A step array (numpy) or an id list (int64) as a tensor on the model's device."""
        array = values if isinstance(values, np.ndarray) else np.asarray(values, np.int64)
        tensor = torch.from_numpy(array)
        return tensor if self._on_cpu else tensor.to(self.device, non_blocking=True)  # no wait for the device


def _adapter_slots(seqs) -> np.ndarray | None:
    """Each sequence's adapter slot (int32; -1: the base model), or None when none has an adapter."""
    slot_list = [seq.adapter_slot for seq in seqs]
    if max(slot_list) < 0:
        return None
    return np.fromiter(slot_list, np.int32, len(slot_list))


def _fail_non_finite(bad_rows: list[int], sample_seqs: list[int], errors: dict[int, Exception]) -> None:
    """An error for the sequence of each sampled row whose logits were not finite."""
    for j in bad_rows:
        errors[sample_seqs[j]] = NonFiniteLogits("the model produced NaN or infinite logits for this request")


def _zero_non_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with every row holding a NaN or infinity zeroed, each row's finite flag), without reading anything
    back: the flags travel with the sampled ids (one pass more over the logits, cheap on a GPU)."""
    row_finite = torch.isfinite(logits).all(dim=-1)
    return torch.where(row_finite.unsqueeze(1), logits, 0.0), row_finite


def _prompt_rows_fit(step) -> bool:
    """Whether the step's prompt rows (those of sequences with more than one new token) attend to at most
    ROWS_FORM_MAX_MEAN_CONTEXT keys each on average (a row at position p attends to p + 1)."""
    counts = np.diff(step.cu)
    prompt_rows = np.repeat(counts > 1, counts)
    rows = int(np.count_nonzero(prompt_rows))
    return int(step.positions[prompt_rows].sum()) + rows <= ROWS_FORM_MAX_MEAN_CONTEXT * rows


def _sampling_rows(seqs) -> tuple[list, list, list[int], bool, list, list]:
    """In one pass: each row's params and generator, the rows not sampled greedily, whether any reads logprobs,
    the (row, seq) of requests with a min_tokens (their stop tokens may be held back) and the (row, matcher) of
    constrained samples."""
    params, generators, random_rows, wants_logprobs, min_rows, grammar_rows = [], [], [], False, [], []
    add_params, add_generator = params.append, generators.append
    for row, seq in enumerate(seqs):
        request = seq.request
        p = request.params
        add_params(p)
        add_generator(seq.generator)
        if not p.greedy:
            random_rows.append(row)
        if request.wants_logprobs:
            wants_logprobs = True
        if p.min_tokens:
            min_rows.append((row, seq))
        if seq.matcher is not None:
            grammar_rows.append((row, seq.matcher))
    return params, generators, random_rows, wants_logprobs, min_rows, grammar_rows


def _hold_stops(logits: torch.Tensor, min_rows: list, eos_token_ids: list[int]) -> bool:
    """A row below its min_tokens may not sample EOS (unless ignore_eos) nor a stop token id: their logits
    become -inf, after the finiteness checks (as vLLM's min-tokens processor and HF's min_new_tokens do).
    True if any row was held back."""
    held = False
    for row, seq in min_rows:
        p = seq.request.params
        if seq.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids) if p.ignore_eos else [*p.stop_token_ids, *eos_token_ids]
            if ids:
                logits[row, ids] = float("-inf")
                held = True
    return held


def _inference_mode():
    """torch's inference mode, unless the thread is in it already (the engine's loop thread enters it once)."""
    return contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()


@contextlib.contextmanager
def _while_set(event: threading.Event | None):
    """event set for the duration of the block (nothing when None)."""
    if event is None:
        yield
        return
    event.set()
    try:
        yield
    finally:
        event.clear()


def allocate_host_cache(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
    """Host swap tensor shaped like the device cache with num_blocks blocks (pinned on CUDA); None if 0."""
    if num_blocks <= 0:
        return None
    shape = list(kv_cache.shape)
    shape[2] = num_blocks
    return torch.zeros(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=kv_cache.is_cuda)
