"""LLMEngine: add_request / abort / step, and the loop thread that runs steps."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache.hashing import namespace_key
from .kv_cache.manager import KVCacheManager
from .lora.manager import AdapterManager, AdapterNotFound
from .lora.shapes import module_shapes
from .lora.slots import LoraSlots
from .model_runner import ModelRunner
from .models.llama import LlamaModel
from .models.loader import load_hf_config
from .request import (
    EngineOverloaded, FinishReason, InvalidRequest, Request, RequestCancelled, RequestOutput, SamplingParams,
    Sequence, SeqStatus,
)
from .sampler import make_generator
from .scheduler import Scheduler

log = logging.getLogger("loraplex.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def store_adapters(store: str) -> dict[str, str]:
    """PEFT folders directly under the adapter store: name -> path."""
    root = Path(store) if store else None
    if root is None or not root.is_dir():
        return {}
    return {p.name: str(p) for p in sorted(root.iterdir()) if (p / "adapter_config.json").is_file()}


def resolve_device_dtype(config: EngineConfig, checkpoint_dtype) -> tuple[torch.device, torch.dtype]:
    """Pick the compute device and dtype from the config ("auto" = CUDA if present)."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if config.dtype != "auto":
        return torch.device(device), _DTYPES[config.dtype]
    if device == "cpu":
        return torch.device(device), torch.float32
    ckpt = checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else _DTYPES.get(str(checkpoint_dtype))
    return torch.device(device), ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


class LLMEngine:
    """One base model, many adapters, one continuous batch."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[list[RequestOutput]], None] | None = None):
        from transformers import AutoTokenizer

        self.config = config
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible per server start
        hf_config = load_hf_config(config.model_dir)
        self.device, self.dtype = resolve_device_dtype(config, getattr(hf_config, "dtype", None))
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
        max_len = min(config.max_model_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        self.model = LlamaModel(config.model_dir, self.dtype, self.device, max_len, hf_config)
        self.max_model_len = max_len
        num_blocks = self._num_kv_blocks()
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        kv_cache = self.model.allocate_kv_cache(num_blocks, config.block_size)
        shapes = module_shapes(self.model.config)
        self.lora_slots = LoraSlots(
            self.model.num_layers, shapes, config.max_loras, config.max_lora_rank, self.dtype, self.device
        )
        self.adapters = AdapterManager(
            self.lora_slots, self.model.config, config.max_lora_rank, config.max_cpu_loras, self.dtype
        )
        for name, path in {**store_adapters(config.adapter_store), **config.multi_lora}.items():
            self.adapters.register(name, path)
        self.num_host_blocks = self._num_host_blocks()
        self.scheduler = Scheduler(config, self.kv_manager, self.adapters, self._eos_ids(hf_config), max_len,
                                   num_host_blocks=self.num_host_blocks)
        self.runner = ModelRunner(self.model, kv_cache, config.block_size, self.lora_slots, self.num_host_blocks)
        self.on_outputs = on_outputs
        self.on_step: Callable[["LLMEngine"], None] | None = None  # e.g. metrics, after every step
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._seq_ids = itertools.count()
        self._requests: dict[str, list[Sequence]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accept_lock = threading.Lock()
        self._num_accepted = 0  # requests add_request accepted (any thread, under the lock)
        self._num_drained = 0  # of those, taken from the inbox by the loop thread
        self.num_steps = 0
        self.generated_tokens: dict[str, int] = {}  # per tenant (metrics)
        self.finished_requests: dict[tuple[str, str], int] = {}  # per (tenant, finish reason)
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d, %d host swap blocks",
                 config.model_dir, self.device, self.dtype, num_blocks, config.block_size, max_len,
                 self.num_host_blocks)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks > 0:
            return self.config.num_kv_blocks
        per_block = self.model.kv_bytes_per_block(self.config.block_size)
        budget = self.config.kv_cache_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - self.config.gpu_memory_utilization))
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(f"KV cache budget {budget} bytes holds fewer than 2 blocks of {per_block} bytes")
        return int(blocks)

    def _num_host_blocks(self) -> int:
        if self.config.preemption_mode != "swap":
            return 0
        return self.config.swap_space_bytes // self.model.kv_bytes_per_block(self.config.block_size)

    def _eos_ids(self, hf_config) -> set[int]:
        ids = {self.tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)}
        flat = set()
        for i in ids:
            flat.update(i if isinstance(i, (list, tuple)) else [i])
        return {i for i in flat if i is not None}

    # ---- called from any thread ------------------------------------------------------
    def make_request(self, request_id: str, prompt: str, params: SamplingParams, tenant: str = "default") -> Request:
        """Tokenize and validate; raises InvalidRequest or AdapterNotFound (nothing is queued)."""
        if not prompt:
            raise InvalidRequest("text_input is empty")
        ids = self.tokenizer(prompt).input_ids
        if not ids:
            raise InvalidRequest("text_input tokenizes to no tokens")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{len(ids) + params.max_tokens} exceeds the model's max length {self.max_model_len}"
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequest(f"n is {params.n} but max_num_seqs is {self.config.max_num_seqs}")
        bs, usable = self.config.block_size, self.kv_manager.num_blocks - self.scheduler.watermark_blocks
        need = -(-(len(ids) + params.max_tokens) // bs)
        if need > usable:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: a sequence may need {need} KV "
                f"blocks of {bs} tokens, but the KV cache has {usable} for sequences"
            )
        if params.lora_name and params.lora_name not in self.adapters.names():
            raise AdapterNotFound(f"LoRA adapter '{params.lora_name}' not found; available: {sorted(self.adapters.names())}")
        return Request(request_id, prompt, ids, params, tenant)

    def add_request(self, request: Request) -> None:
        """Queue a validated request; raises EngineOverloaded when max_waiting_requests are already waiting."""
        with self._accept_lock:
            waiting = self.num_waiting_requests()
            if waiting >= self.config.max_waiting_requests:
                raise EngineOverloaded(
                    f"server overloaded: {waiting} requests are waiting "
                    f"(max_waiting_requests={self.config.max_waiting_requests}); retry later"
                )
            self._num_accepted += 1
            self._inbox.append(("add", request))
        self._wake.set()

    def num_waiting_requests(self) -> int:
        """Requests accepted but not started yet (in the inbox or never scheduled)."""
        return self._num_accepted - self._num_drained + self.scheduler.num_new_waiting

    def abort(self, request_id: str) -> None:
        """Cancel a request; it ends with a CANCELLED final output and frees its blocks next step."""
        self._inbox.append(("abort", request_id))
        self._wake.set()

    # ---- loop thread -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit and abort, run one iteration of the batch, return the outputs it produced."""
        outputs = self._drain_inbox()
        batch = self.scheduler.schedule()
        if batch.finished:
            outputs += self._finished_while_scheduling(batch.finished)
        if batch.empty:
            return outputs
        result = self.runner.execute(batch)
        changed = self.scheduler.update(batch, result)
        self.num_steps += 1
        outputs += [self._make_output(seq) for seq in changed]
        return outputs

    def has_work(self) -> bool:
        """Anything queued, waiting or running."""
        return bool(self._inbox) or self.scheduler.has_work()

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                outputs += self._admit_request(item)
                self._num_drained += 1  # after the scheduler counts it: a racing reader over-counts, never under
            else:
                outputs += self._abort_request(item)
        return outputs

    def _admit_request(self, request: Request) -> list[RequestOutput]:
        params = request.params
        try:
            if params.lora_name:
                request.adapter_digest = self.adapters.digest(params.lora_name)
        except Exception as exc:  # adapter vanished or broke on disk since validation
            return [self._error_output(request, exc)]
        tenant = request.tenant if self.config.prefix_cache_scope == "tenant" else None
        namespace = namespace_key(tenant, request.adapter_digest)
        seqs = []
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request, index, list(request.prompt_token_ids), len(request.prompt_token_ids))
            seq.namespace = namespace
            seq.generator = make_generator(params, index, self.device)
            seq.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens)
            seqs.append(seq)
        seqs[0].forks = seqs[1:]  # n > 1: forked from sample 0 after its prefill (copy-on-write)
        self.scheduler.add(seqs[0])
        self._requests[request.request_id] = seqs
        return []

    def _abort_request(self, request_id: str) -> list[RequestOutput]:
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return []
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.remove(seq, FinishReason.ABORT)
        return [self._error_output(seqs[0].request, RequestCancelled("request cancelled"), "abort")]

    def _make_output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status is SeqStatus.FINISHED
        if finished:
            seq.detok.flush(seq.token_ids)
        end = seq.detok.stable_length(finished)
        text = seq.detok.text[seq.num_sent_chars : end]
        seq.num_sent_chars = max(end, seq.num_sent_chars)
        new_ids = seq.output_token_ids[seq.num_sent_tokens :]
        seq.num_sent_tokens = seq.num_output_tokens
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        tenant = seq.request.tenant
        self.generated_tokens[tenant] = self.generated_tokens.get(tenant, 0) + len(new_ids)
        if finished and self._all_finished(seq):
            self._requests.pop(seq.request.request_id, None)
            self._count_finished(seq.request, seq.finish_reason.value)
        return RequestOutput(
            request_id=seq.request.request_id,
            index=seq.index,
            text=text,
            token_ids=new_ids,
            finished=finished,
            finish_reason=seq.finish_reason.value if finished else None,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs if seq.request.params.logprobs is not None else None,
            num_input_tokens=seq.num_prompt_tokens,
        )

    def _finished_while_scheduling(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Outputs of sequences the scheduler ended: timeouts end normally; a failed request gets one error."""
        outputs, failed = [], set()
        for seq in seqs:
            request_id = seq.request.request_id
            if seq.error is not None:
                failed.add(request_id)
                self._requests.pop(request_id, None)
                outputs.append(self._error_output(seq.request, seq.error))
            elif request_id not in failed:
                outputs.append(self._make_output(seq))
        return outputs

    def _error_output(self, request: Request, exc: Exception, reason: str = "error") -> RequestOutput:
        """The one final output of a request that ends in an error."""
        self._count_finished(request, reason)
        return RequestOutput(request.request_id, 0, "", [], True, finish_reason=reason, error=exc)

    def _count_finished(self, request: Request, reason: str) -> None:
        key = (request.tenant, reason)
        self.finished_requests[key] = self.finished_requests.get(key, 0) + 1

    def _all_finished(self, seq: Sequence) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self._requests.get(seq.request.request_id, []))

    def run_loop(self) -> None:
        """The loop thread: step while there is work, sleep on an event otherwise."""
        while not self._stopping:
            if not self.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.step()
            except Exception as exc:  # never let one bad step kill the server
                log.exception("engine step failed; failing the running requests")
                outputs = self._fail_all(exc)
            if outputs and self.on_outputs is not None:
                self.on_outputs(outputs)
            if self.on_step is not None:
                self.on_step(self)

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self._requests):
            seqs = self._requests.pop(request_id)
            for seq in seqs:
                if seq.status is not SeqStatus.FINISHED:
                    try:
                        self.scheduler.remove(seq, FinishReason.ABORT)
                    except Exception:  # noqa: BLE001 - never let cleanup kill the loop thread
                        log.exception("could not remove sequence %s of request %s", seq.seq_id, request_id)
            outputs.append(self._error_output(seqs[0].request, exc))
        return outputs

    def start(self) -> None:
        """Start the loop thread."""
        self._thread = threading.Thread(target=self.run_loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def generate(self, requests: list[Request], max_steps: int = 100_000) -> dict[str, list[RequestOutput]]:
        """Run requests to completion on the calling thread (tests, benchmarks); outputs per request id."""
        for r in requests:
            self.add_request(r)
        collected: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        for _ in range(max_steps):
            if not self.has_work():
                break
            for out in self.step():
                collected.setdefault(out.request_id, []).append(out)
        return collected
