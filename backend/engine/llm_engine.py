"""LLMEngine: add_request / abort / step, and the loop thread that runs steps."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

import torch

from loraplex import kernels
from loraplex.config import EngineConfig, native_cpu_threads
from loraplex.worker.decode_graphs import build_decode_graphs
from loraplex.engine.stats import EngineStats
from loraplex.kv_cache.hashing import namespace_key
from loraplex.kv_cache.manager import KVCacheManager
from loraplex.kv_cache.window import common_window
from loraplex.exceptions import AdapterError, AdapterNotFound, EngineShuttingDown, InvalidRequest, RequestCancelled
from loraplex.lora.catalog import AdapterCatalog, AdapterVersions
from loraplex.lora.expert_rank import expert_stack_bytes, resolve_expert_rank
from loraplex.lora.experts import expert_layout
from loraplex.lora.manager import AdapterManager
from loraplex.lora.preloader import AdapterPreloader
from loraplex.lora.shapes import module_shapes
from loraplex.lora.slots import LoraSlots
from loraplex.lora.store import AdapterStore
from loraplex.engine.constraints import ConstraintCompiler, new_matcher
from loraplex.engine.inbox import Abort, Add, FinalMade, Message, OutputFailed, StopSample
from loraplex.engine.metrics import TenantLabels, Values, kv_values, lora_info, model_info, per_label
from loraplex.worker.grammar_budget import GrammarBudget, RowMatcher
from loraplex.worker.model_runner import ModelRunner
from loraplex.models.llama import LlamaModel
from loraplex.models.family import default_max_len
from loraplex.models.loader import load_hf_config
from loraplex.engine.output_processor import ErrorEvent, OutputProcessor
from loraplex.engine.request import FinishReason, Request, RequestOutput, SamplingParams, Sequence, SeqStatus
from loraplex.engine.prompt_bound import check_prompt_bytes, longest_token_bytes
from loraplex.sched.static_batch import make_scheduler
from loraplex.tenancy.quotas import TenantQuotas
from loraplex.worker.sampler import make_generator
from loraplex.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from loraplex.tenancy.tenants import Tenant

log = logging.getLogger("loraplex.engine.llm_engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def resolve_lora_dtype(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The adapters' weights' dtype: the model's, or fp16 (``lora_dtype``) on an fp32 CPU engine."""
    if config.lora_dtype == "auto":
        return dtype
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError("lora_dtype float16 is a CPU option with dtype float32; on CUDA adapters take dtype")
    return torch.float16


class LLMEngine:
    """One base model, many adapters, one continuous batch."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[list[RequestOutput]], None] | None = None):
        from transformers import AutoTokenizer

        self.config = config
        if config.cpu_threads > 0:
            torch.set_num_threads(config.cpu_threads)  # before the loop thread's first op: it inherits this
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible per server start
        hf_config = load_hf_config(config.model_dir)
        self.device, self.dtype = resolve_device_dtype(config, getattr(hf_config, "dtype", None))
        if self.device.type == "cpu":
            kernels.set_native_threads(native_cpu_threads(config.native_threads))
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
        max_len = min(config.max_model_len or default_max_len(hf_config), hf_config.max_position_embeddings)
        self.model = LlamaModel(config.model_dir, self.dtype, self.device, max_len, hf_config,
                                fp16_weights=config.weight_dtype == "float16", quantization=config.quantization,
                                quantization_fallback=config.quantization_fallback)
        if self.device.type == "cpu" and self.model.quant.served == "int8":  # one CPU left to the serving threads
            kernels.set_native_threads(native_cpu_threads(config.native_threads, int8=True))
        self.model.set_prefill_dtype(config.prefill_dtype)  # bf16 copies for the CPU prefill (decision 074)
        self.max_model_len = max_len
        self.max_prompt_bytes = config.max_prompt_bytes or max_len * longest_token_bytes(self.tokenizer)
        lora_dtype = resolve_lora_dtype(config, self.device, self.dtype)
        experts = expert_layout(self.model.config)  # MoE: expert LoRA stacks (decisions 066, 070)
        expert_rank = resolve_expert_rank(config.max_expert_lora_rank, experts, config.max_loras, config.max_lora_rank)
        self.expert_lora_bytes = expert_stack_bytes(experts, self.model.num_layers, config.max_loras, expert_rank,
                                                    lora_dtype.itemsize)  # on CUDA taken from the KV budget
        num_blocks = self._num_kv_blocks()
        # every layer's attention slides over one window shorter than max_model_len: blocks behind it are freed
        self.kv_window = common_window(self.model.family.layer_windows)  # decision 065
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_window)
        kv_cache = self.model.allocate_kv_cache(num_blocks, config.block_size)
        shapes = module_shapes(self.model.config)
        self.lora_slots = LoraSlots(
            self.model.num_layers, shapes, config.max_loras, config.max_lora_rank, lora_dtype, self.device,
            experts=experts, expert_rank=expert_rank,
        )
        self.lora_slots.base_weight = self.model.base_weight  # DoRA's norms at adapter load (decision 052)
        self.adapters = AdapterManager(
            self.lora_slots, self.model.config, config.max_lora_rank, config.max_cpu_loras, lora_dtype
        )
        store = AdapterStore(config.adapter_store) if config.adapter_store else None
        self.catalog = AdapterCatalog(store, config.multi_lora)  # the store's adapters: looked up per request
        for name, path in self.catalog.shared.items():
            self.adapters.register(name, path)
        self.versions = AdapterVersions(self.adapters, max_idle=config.max_cpu_loras)
        self.preloader = AdapterPreloader(self.adapters.read, self._preloaded)
        self._loading: dict[str, Request] = {}  # request id -> request whose adapter the preloader reads
        self._rereading: set[str] = set()  # adapters read again for waiting requests (evicted from host meanwhile)
        self._reread_failed: set[str] = set()  # their read failed: acquire reads on the loop, failing the request
        self._reread: deque = deque()  # (name, preloaded or None) delivered by the preloader's worker
        self._cancelled_loading: set[str] = set()  # aborted while their adapter was being read
        self.quotas = TenantQuotas(config.max_waiting_requests, config.tenant_queue_share)
        self.tenant_labels = TenantLabels.from_config(config)
        self.num_host_blocks = self._num_host_blocks()
        self.eos_token_ids = self._eos_ids(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.constraints = ConstraintCompiler(self.tokenizer, hf_config.vocab_size, self.eos_token_ids)
        self.scheduler = self._new_scheduler()
        self.runner = ModelRunner(self.model, kv_cache, config.block_size, self.lora_slots, self.num_host_blocks,
                                  self.eos_token_ids)
        self.runner.grammar_budget = GrammarBudget(config.grammar_token_budget_ms, config.grammar_mean_budget_ms)
        # a MoE block reads its experts' row counts on the host (models/moe.py): no graph can capture it
        if self.device.type == "cuda" and not config.enforce_eager and not self.model.family.moe:
            with torch.inference_mode():
                self.runner.graphs = build_decode_graphs(self.model, kv_cache, config.max_num_seqs, max_len,
                                                         config.block_size, self.runner.lora)
        self.on_outputs = on_outputs
        self.processor = OutputProcessor(self.tokenizer, self._stop_sequence, self._output_failed, self._final_made)
        self.runner.computing = self.processor.loop_quiet  # the output thread's turn for the GIL: the forward
        self.on_step: Callable[["LLMEngine"], None] | None = None  # e.g. metrics, after every step
        self._inbox: deque[Message] = deque()
        self._wake = threading.Event()
        self._seq_ids = itertools.count()
        self._requests: dict[str, list[Sequence]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # shut down: add_request refuses
        self._accept_lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self._num_accepted = 0  # requests add_request accepted (any thread, under the lock)
        self._num_drained = 0  # of those, taken from the inbox by the loop thread
        self.num_steps = 0
        self.generated_tokens: dict[str, int] = {}  # per tenant label (metrics)
        self.finished_requests: dict[tuple[str, str], int] = {}  # per (tenant label, finish reason)
        self.stats = EngineStats()  # request and step metrics (counters, latency observations)
        self.adapters.observe = self.stats.adapter_load
        self._step_time = 0.0  # monotonic time of the current step's tokens
        self.num_recoveries = 0  # times the loop thread failed outside a step and reset the engine's state
        log.info("engine ready: %s on %s/%s%s%s, %d KV blocks of %d tokens, max_model_len %d, %d host swap blocks, "
                 "%d torch CPU threads, %s native%s", config.model_dir, self.device, self.dtype,
                 " (fp16 weights)" if self.model.fp16_weights else "",
                 f", quantization {self.model.quant.label}" if self.model.quant.source else "", num_blocks, config.block_size,
                 max_len, self.num_host_blocks, torch.get_num_threads(),
                 kernels.native_threads() if self.device.type == "cpu" else "no",
                 f", expert LoRA stacks at rank {expert_rank} (max_expert_lora_rank {config.max_expert_lora_rank}):"
                 f" {self.expert_lora_bytes / 2**20:.1f} MiB" if experts is not None else "")

    def _new_scheduler(self) -> Scheduler:
        scheduler = make_scheduler(self.config, self.kv_manager, self.adapters, self.eos_token_ids,
                                   self.max_model_len, num_host_blocks=self.num_host_blocks)
        scheduler.read_adapter = self._read_for_admission
        return scheduler

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks > 0:
            return self.config.num_kv_blocks
        per_block = self.model.kv_bytes_per_block(self.config.block_size)
        budget = self.config.kv_cache_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - self.config.gpu_memory_utilization)) - self.expert_lora_bytes
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(f"KV cache budget {budget} bytes holds fewer than 2 blocks of {per_block} bytes"
                             + (f" (after {self.expert_lora_bytes} bytes of expert LoRA stacks: lower "
                                f"max_expert_lora_rank or max_loras, decision 070)" if self.expert_lora_bytes else ""))
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

    def snapshot(self) -> Values:
        """The engine's snapshot for metrics: its loop-owned gauges and counters, read on the loop thread
        (plain reads and dict copies, no IPC)."""
        kv, sched, adapters, stats = self.kv_manager, self.scheduler, self.adapters, self.stats
        usage = kv.usage()
        values: Values = {("kv_cache_blocks", (state,)): n for state, n in usage.items()}
        values.update({
            ("num_sequences", ("running",)): len(sched.running),
            ("num_sequences", ("waiting",)): len(sched.waiting),
            ("num_sequences", ("swapped",)): len(sched.swapped),
            ("admission_cap", ()): min(sched.cap.value, self.config.max_num_seqs),
            ("adapter_pins", ()): adapters.total_pins(),
            ("adapters_resident", ("device",)): len(adapters.resident_names()),
            ("adapters_resident", ("host",)): len(adapters.host_names()),
            ("adapters_resident", ("disk",)): adapters.num_registered(),
            ("adapters_loading", ("host",)): self.preloader.loading(),
            ("adapter_loads_total", ("host",)): adapters.loads_from_disk,
            ("adapter_loads_total", ("device",)): adapters.device_loads,
            ("adapter_evictions_total", ("device",)): adapters.evictions,
            ("adapter_evictions_total", ("host",)): adapters.host_evictions,
            ("preemptions_total", ()): sched.num_preemptions,
        })
        for name, counts in (
            ("prefix_cache_query_tokens_total", sched.prefix_query_tokens),
            ("prefix_cache_hit_tokens_total", sched.prefix_hit_tokens),
            ("generation_tokens_total", self.generated_tokens),
            ("request_finished_total", self.finished_requests),
            ("prompt_tokens_total", stats.prompt_tokens),
            ("request_success_total", stats.succeeded),
            ("grammar_match_seconds_total", self.runner.grammar_seconds),
        ):
            per_label(values, name, dict(counts))
        waiting = [seq.request for seq in sched.waiting.sequences()]
        values.update(self._adapters_waiting(waiting))
        values.update(kv_values(usage, kv.num_usable_blocks, self.config.block_size))
        values.update(model_info(self.model.quant))
        queued = waiting + [seq.request for seq in sched.swapped] + list(self._loading.values()) \
            + [message.request for message in list(self._inbox) if isinstance(message, Add)]
        values.update(lora_info([seq.request for seq in sched.running], queued, self.config.max_loras,
                                self.tenant_labels))
        return values

    def _adapters_waiting(self, waiting: list[Request]) -> Values:
        """Distinct adapters that waiting sequences need and no current slot holds, by the tier they are in."""
        adapters = self.adapters
        wanted = {request.adapter_key for request in waiting if request.adapter_key}
        on_host = set(adapters.host_names())
        cold = [name for name in wanted if not adapters.is_resident(name)]
        host = sum(1 for name in cold if name in on_host)
        return {("adapters_waiting", ("host",)): host, ("adapters_waiting", ("disk",)): len(cold) - host}

    # ---- called from any thread ------------------------------------------------------
    def make_request(self, request_id: str, prompt: str, params: SamplingParams, tenant: str = "default",
                     limits: "Tenant | None" = None, cancelled: Callable[[], bool] | None = None) -> Request:
        """Tokenize, validate and resolve the adapter within the tenant; raises InvalidRequest or AdapterNotFound.

        `limits` is the tenant's weight and quotas (None: weight 1, no quotas). Nothing is queued. `cancelled`
        is asked while a constraint waits to compile (engine/constraints.py).
        """
        if not prompt:
            raise InvalidRequest("text_input is empty")
        check_prompt_bytes(prompt, self.max_prompt_bytes)
        ids = self.tokenizer(prompt).input_ids
        if not ids:
            raise InvalidRequest("text_input tokenizes to no tokens")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{len(ids) + params.max_tokens} exceeds the model's max length {self.max_model_len}"
            )
        self._check_limits(params, limits)
        bs, usable = self.config.block_size, self.kv_manager.num_usable_blocks - self.scheduler.watermark_blocks
        need = self.kv_manager.max_blocks_held(len(ids) + params.max_tokens, self.config.max_num_batched_tokens)
        if need > usable:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: a sequence may need {need} KV "
                f"blocks of {bs} tokens, but the KV cache has {usable} for sequences"
            )
        request = Request(request_id, prompt, ids, params, tenant, limits=limits)
        if params.structured_outputs is not None:  # compiled here, on the caller's thread, within its bound
            request.grammar = self.constraints.compile(params.structured_outputs, tenant, cancelled)
        if params.lora_name:
            request.adapter_key, path, uploaded = self.catalog.resolve(tenant, params.lora_name)
            request.adapter_path = path if uploaded else None
        authenticated = limits is not None and limits.authenticated
        request.metric_label = self.tenant_labels.label(tenant, authenticated)
        return request

    def _check_limits(self, params: SamplingParams, limits: "Tenant | None" = None) -> None:
        """Bounds that depend on the engine or the tenant: n, logprobs, stop token ids."""
        config = self.config
        concurrent = limits.max_concurrent_requests if limits is not None else 0
        checks = [
            (not concurrent or params.n <= concurrent,
             f"n is {params.n} but the tenant's max_concurrent_requests is {concurrent} (sequences)"),
            (params.n <= config.max_n, f"n is {params.n} but at most {config.max_n} is allowed (max_n)"),
            (params.n <= config.max_num_seqs, f"n is {params.n} but max_num_seqs is {config.max_num_seqs}"),
            (params.logprobs is None or params.logprobs <= config.max_logprobs,
             f"logprobs is {params.logprobs} but at most {config.max_logprobs} is allowed (max_logprobs)"),
            (all(t < self.vocab_size for t in params.stop_token_ids),
             f"stop_token_ids must be below the vocabulary size {self.vocab_size}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)

    def add_request(self, request: Request) -> None:
        """Queue a validated request; raises EngineOverloaded when the waiting queue has no place for its tenant
        (backend/tenancy/queue_share.py), or QuotaExceeded over the tenant's max_queued_requests or tokens_per_minute."""
        with self._accept_lock:
            if self._closed:
                raise EngineShuttingDown("the model is shutting down; retry on another replica")
            self.quotas.accept(request)
            self._num_accepted += 1
            self.stats.accept(request)
            folder = self._cold_adapter(request)
            if folder is None:
                self._inbox.append(Add(request))
            else:
                self._loading[request.request_id] = request
        if folder is not None:
            self.preloader.submit(request, request.adapter_key, folder)  # the loop steps on meanwhile
        self._wake.set()

    def _cold_adapter(self, request: Request) -> str | None:
        """The folder to read off the loop thread for the request's adapter (None: none, already in memory,
        or no loop thread: a caller that steps the engine itself reads at admission, step counts stay exact)."""
        if not request.adapter_key or self._thread is None:
            return None
        return self.adapters.needs_read(request.adapter_key, request.adapter_path)

    def _read_for_admission(self, request: Request) -> bool:
        """The scheduler met a waiting request whose adapter left host memory: read it again off the loop thread
        (True: the request waits meanwhile), or False where acquire() reads it (no loop thread; the read failed)."""
        name = request.adapter_key
        if self._thread is None or name in self._reread_failed:
            self._reread_failed.discard(name)
            return False
        if name not in self._rereading:
            folder = self.adapters.needs_read(name)
            if folder is None:
                return False
            self._rereading.add(name)
            self.preloader.submit(_Reread(name), name, folder)
        return True

    def _adopt_rereads(self) -> None:
        """Adopt the adapters read again for waiting requests into the host tier (loop thread)."""
        while self._reread:
            name, preloaded = self._reread.popleft()
            self._rereading.discard(name)
            if preloaded is None:
                self._reread_failed.add(name)
            else:
                self.adapters.adopt(name, preloaded)  # unless unregistered or changed meanwhile

    def _preloaded(self, request: Request, preloaded) -> None:
        """The preloader's worker read the request's adapter (None: the read failed): queue the request."""
        if isinstance(request, _Reread):
            self._reread.append((request.name, preloaded))
            self._wake.set()
            return
        request.preloaded = preloaded
        with self._accept_lock:
            if self._loading.pop(request.request_id, None) is None:
                return  # shut down meanwhile: it has had its final output
            self._inbox.append(Add(request))
        self._wake.set()

    def num_waiting_requests(self) -> int:
        """Requests accepted but not started yet (in the inbox or never scheduled)."""
        return self._num_accepted - self._num_drained + self.scheduler.num_new_waiting

    def abort(self, request_id: str) -> None:
        """Cancel a request; it ends with a CANCELLED final output and frees its blocks next step."""
        with self._accept_lock:
            if request_id in self._loading:  # its add is not in the inbox yet: the abort would overtake it
                self._cancelled_loading.add(request_id)
                return
            self._inbox.append(Abort(request_id))
        self._wake.set()

    def _stop_sequence(self, seq: Sequence) -> None:
        """The output processor matched a stop string: end the sample (its final output is sent)."""
        self._inbox.append(StopSample(seq))
        self._wake.set()

    def _final_made(self, request: Request) -> None:
        """The output processor made the final output of a request with stop strings (request.final_reason)."""
        self._inbox.append(FinalMade(request))
        self._wake.set()

    def _output_failed(self, request: Request, exc: Exception) -> None:
        """The output processor could not make a request's output: fail it with its one error output."""
        self._inbox.append(OutputFailed(request, exc))
        self._wake.set()

    # ---- loop thread -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration (``step_events``) and its outputs, detokenized on the calling thread."""
        return self.processor.process(self.step_events())

    def step_events(self) -> list:
        """Admit and abort, run one iteration of the batch, return its events for the output processor.

        A failure belongs to the requests it came from: a newcomer that breaks the forward
        pass is retried alone and then failed; a batch whose forward fails without
        newcomers fails its own requests; a row the sampler cannot use fails its request.
        """
        start = time.perf_counter()
        loads = self.adapters.device_loads
        loading = self.preloader.loading() > 0
        if self._reread:
            self._adopt_rereads()
        outputs = self._drain_inbox()
        batch = self.scheduler.schedule()
        self._step_time = now = time.monotonic()
        for seq in batch.admitted:
            self.quotas.started(seq.request)
            if seq.request.scheduled_time is None:
                self.stats.start(seq.request, now)
        if batch.finished:
            self._events(batch.finished, outputs, new_tokens=False)
        if batch.empty:
            if self._rereading and self._thread is not None:  # waiting only for reads: sleep, do not spin
                self._wake.wait(0.05)
                self._wake.clear()
            return outputs
        forward_start = time.perf_counter()
        try:
            result = self._forward(batch, outputs)
        except Exception as exc:  # no newcomer to blame: the batch's own requests fail
            log.exception("forward pass failed; failing the %d requests of its batch", len(batch.seqs))
            for seq in batch.seqs:
                outputs += self._fail_request(seq.request, exc)
            return outputs
        if result is None:
            return outputs
        forward_end = time.perf_counter()
        self._step_time = time.monotonic()
        for row, exc in result.errors.items():
            seq = batch.seqs[row] if row < len(batch.seqs) else batch.forks[row - len(batch.seqs)][1]
            if seq.status is not SeqStatus.FINISHED:  # a static batch's padding row ended its request already
                outputs += self._fail_request(seq.request, exc)
        changed = self.scheduler.update(batch, result)
        self.num_steps += 1
        self._events(changed, outputs, new_tokens=True)
        end = time.perf_counter()
        self.stats.step(len(batch.seqs), sum(batch.num_new_tokens), end - start - (forward_end - forward_start))
        self.stats.step_time(end - start, loading or self.adapters.device_loads != loads or self.preloader.loading() > 0)
        return outputs

    def _forward(self, batch, outputs: list):
        """Run the batch; if it raises, retry it without this step's newcomers (None: nothing left to run)."""
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            newcomers = list(batch.admitted)
            if not newcomers:
                raise
            log.exception("forward pass failed; retrying without its %d newcomers", len(newcomers))
            convicted = [s for s in newcomers if s.suspect]  # already admitted alone once, and failed again
            self.scheduler.withdraw(batch, newcomers)
            for seq in convicted:
                outputs += self._fail_request(seq.request, exc)
            if not batch.seqs:
                return None
            result = self.runner.execute(batch, copies=False)
        for seq in batch.admitted:
            seq.suspect = False
        return result

    def has_work(self) -> bool:
        """Anything queued, waiting or running, or a request waiting for its adapter to be read."""
        return self._runnable() or bool(self._loading)

    def _runnable(self) -> bool:
        """Anything a step can do now."""
        return bool(self._inbox) or bool(self._reread) or self.scheduler.has_work()

    def _drain_inbox(self) -> list:
        outputs = []
        while self._inbox:
            match self._inbox.popleft():
                case Add(request):
                    try:
                        outputs += self._admit_request(request)
                    finally:
                        self._num_drained += 1  # after the scheduler counts it: a racing reader over-counts, never under
                case StopSample(seq):
                    self._stop_sample(seq)
                case FinalMade(request):
                    self._count_pending_end(request)
                case OutputFailed(request, error):
                    outputs += self._fail_output(request, error)
                case Abort(request_id):
                    outputs += self._abort_request(request_id)
        return outputs

    def _stop_sample(self, seq: Sequence) -> None:
        """End a sample the output processor stopped (a stop string); it sent the final output."""
        if seq.status is SeqStatus.FINISHED:
            return  # ended meanwhile (its length, its request failed): that output was dropped
        self.scheduler.remove(seq, FinishReason.STOP)
        if self._all_finished(seq):
            self._requests.pop(seq.request.request_id, None)
            self._ended(seq.request, FinishReason.STOP.value)

    def _fail_output(self, request: Request, exc: Exception) -> list:
        """A request whose output failed: its error output (the processor dropped its deltas since)."""
        if request.request_id in self._requests:
            return self._fail_request(request, exc)
        return [ErrorEvent(request, RequestOutput(request.request_id, 0, "", [], True, "error", error=exc))]

    def _admit_request(self, request: Request) -> list:
        if request.request_id in self._cancelled_loading:
            self._cancelled_loading.discard(request.request_id)
            return [self._error_event(request, RequestCancelled("Request was cancelled"), "abort")]
        try:
            seqs = self._new_sequences(request)
        except Exception as exc:  # e.g. its adapter broke on disk since validation
            if not isinstance(exc, (AdapterError, AdapterNotFound, InvalidRequest)):
                log.exception("request %s failed at admission", request.request_id)
            return [self._error_event(request, exc)]
        self.scheduler.add(seqs[0])
        self._requests[request.request_id] = seqs
        return []

    def _new_sequences(self, request: Request) -> list[Sequence]:
        """The request's n samples, ready to queue (sample 0 carries the others as forks)."""
        params = request.params
        if request.adapter_path is not None:
            self.versions.use(request)  # an uploaded version: registered while requests use it
            request.holds_version = True
        if request.preloaded is not None:
            preloaded, request.preloaded = request.preloaded, None
            self.adapters.adopt(request.adapter_key, preloaded)
        if request.adapter_key:
            self.adapters.refresh(request.adapter_key)  # changed or deleted on disk: new requests see it
            request.adapter_digest = self.adapters.digest(request.adapter_key)
        tenant = request.tenant if self.config.prefix_cache_scope == "tenant" else None
        namespace = namespace_key(tenant, request.adapter_digest)
        seqs = []
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request, index, list(request.prompt_token_ids), len(request.prompt_token_ids))
            seq.namespace = namespace
            seq.generator = make_generator(params, index, self.device)
            if request.grammar is not None:
                seq.matcher = RowMatcher(new_matcher(request.grammar), request.metric_label)
            seqs.append(seq)
        seqs[0].forks = seqs[1:]  # n > 1: forked from sample 0 after its prefill (copy-on-write)
        return seqs

    def _abort_request(self, request_id: str) -> list:
        seqs = self._requests.get(request_id)
        if seqs is None:
            return []
        return self._fail_request(seqs[0].request, RequestCancelled("Request was cancelled"), "abort")

    def _events(self, seqs: list[Sequence], events: list, new_tokens: bool) -> None:
        """A token delta per changed sequence (its newest token if new_tokens, counted), or its request's error once.

        A sequence that finished ends its request when it was the last sample; the text,
        stop strings and RequestOutputs are the output processor's.
        """
        now = self._step_time
        generated, served, failed = self.generated_tokens, self.quotas.served, set()
        for seq in seqs:
            request = seq.request
            if failed and request.request_id in failed:
                continue
            if seq.error is not None:
                failed.add(request.request_id)
                events += self._fail_request(request, seq.error)
                continue
            finished = seq.status is SeqStatus.FINISHED
            token = None
            if new_tokens:
                token = seq.token_ids[-1]
                label = request.metric_label
                generated[label] = generated.get(label, 0) + 1
                if request.last_token_time != now:  # once per step per request (n > 1)
                    if request.first_token_time is None:
                        self.stats.first_token(request, now)
                    request.last_token_time = now
                    request.token_steps += 1
                if request.limits is not None and request.limits.tokens_per_minute:
                    served(request, 1)
            logprobs = None
            if request.params.logprobs is not None:
                logprobs, seq.pending_logprobs = seq.pending_logprobs, []
            events.append((seq, token, seq.finish_reason if finished else None, seq.cumulative_logprob, logprobs))
            if finished and self._all_finished(seq):
                self._requests.pop(request.request_id, None)
                self._ended(request, seq.finish_reason.value)

    def _fail_request(self, request: Request, exc: Exception, reason: str = "error") -> list:
        """End a request the engine holds with one error event, freeing its blocks and pins ([] if it ended)."""
        seqs = self._requests.pop(request.request_id, None)
        if seqs is None:
            return []
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.remove(seq, FinishReason.ABORT)
        return [self._error_event(request, exc, reason)]

    def _fail_held(self, exc: Exception) -> list[ErrorEvent]:
        """One error event for every request the engine holds, without touching the scheduler."""
        held, self._requests = self._requests, {}
        return [self._error_event(seqs[0].request, exc) for seqs in held.values()]

    def _error_output(self, request: Request, exc: Exception, reason: str = "error") -> RequestOutput:
        """The one final output of a request that ends in an error."""
        self._ended(request, reason, exc)
        return RequestOutput(request.request_id, 0, "", [], True, finish_reason=reason, error=exc)

    def _error_event(self, request: Request, exc: Exception, reason: str = "error") -> ErrorEvent:
        """_error_output for the output processor."""
        return ErrorEvent(request, self._error_output(request, exc, reason))

    def _ended(self, request: Request, reason: str, exc: Exception | None = None) -> None:
        """Once per request, however it ended: count it, return its quota and adapter-version uses.

        A request with stop strings that reached its length may have ended on a stop string in the
        output processor, which runs behind the loop: it is counted by the reason its final output
        carried, once that output is made.
        """
        counted = reason
        if reason == FinishReason.LENGTH.value and request.params.stop:  # a stop string may have ended it
            counted = request.final_reason
            request.count_pending = counted is None  # not made yet: counted by _count_pending_end
        if not request.count_pending:
            self._count_end(request, counted)
        self.stats.end(request, reason, exc, time.monotonic())
        self.quotas.ended(request)  # its queue place if it never started; the tokens it reserved and did not use
        if request.holds_version:
            request.holds_version = False
            self.versions.done(request)

    def _count_end(self, request: Request, reason: str) -> None:
        key = (request.metric_label, reason)
        self.finished_requests[key] = self.finished_requests.get(key, 0) + 1

    def _count_pending_end(self, request: Request) -> None:
        """A final output was made (the processor's "final" message): count the end _ended left pending."""
        if request.count_pending:
            request.count_pending = False
            self._count_end(request, request.final_reason)

    def _all_finished(self, seq: Sequence) -> bool:
        """Whether the request is still held and every sample of it has finished (False once it has ended)."""
        seqs = self._requests.get(seq.request.request_id)
        return seqs is not None and all(s.status is SeqStatus.FINISHED for s in seqs)

    def run_loop(self) -> None:
        """The loop thread, supervised: if serving raises, fail what it held, reset, serve on."""
        while not self._stopping:
            try:
                self._serve()
            except BaseException as exc:  # the loop thread must never die
                log.exception("engine loop failed; failing every request it held and resetting its state")
                try:
                    self.processor.submit(self._recover(exc))
                except BaseException:
                    log.exception("engine recovery failed; retrying")
                time.sleep(0.05)  # never spin if the failure repeats

    @torch.inference_mode()
    def _serve(self) -> None:
        """Step while there is work, sleep on an event otherwise (in inference mode: the runner need not enter it
        each step)."""
        while not self._stopping:
            if not self._runnable():
                self.processor.loop_quiet.set()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.processor.loop_quiet.clear()
            self.processor.submit(self.step_events())
            if self.on_step is not None:
                try:
                    self.on_step(self)
                except Exception:  # metrics must never stop serving
                    log.exception("on_step hook failed")

    def _recover(self, exc: BaseException) -> list[ErrorEvent]:
        """Fail every request the engine holds without trusting its state, then start from a clean one."""
        error = exc if isinstance(exc, Exception) else RuntimeError(f"engine loop failed: {exc!r}")
        outputs = self._fail_held(error)
        old = self.scheduler
        self.kv_manager = KVCacheManager(self.kv_manager.num_blocks, self.config.block_size,
                                         self.config.enable_prefix_caching, self.kv_window)
        self.adapters.reset_pins()
        self.scheduler = self._new_scheduler()
        self.scheduler.carry_counters(old)
        self.num_recoveries += 1
        return outputs

    def shutdown(self) -> list[RequestOutput]:
        """Stop the loop thread and end every request held or queued with one error; refuse new ones."""
        with self._accept_lock:
            self._closed = True
        with self._shutdown_lock:  # the unload watch and finalize() may both call it
            self.stop(timeout=30.0)
            self.preloader.close()  # reads in flight deliver their requests to the inbox, drained below
            self.constraints.close()
            error = EngineShuttingDown("the model is shutting down; the request did not finish")
            outputs = [e.output for e in self._fail_held(error) if not e.request.output_ended]  # not a 2nd final
            with self._accept_lock:  # with the preloader's hand-over: each request is ended here once
                queued = [message.request for message in self._inbox if isinstance(message, Add)]
                self._inbox.clear()
                queued += self._loading.values()  # reads that outlived close()
                self._loading, self._cancelled_loading = {}, set()
            return outputs + [self._error_output(request, error) for request in queued]

    def start(self) -> None:
        """Start the loop thread and the output processor's; outputs go to on_outputs."""
        self.processor.start(self._deliver)
        self._thread = threading.Thread(target=self.run_loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.on_outputs is not None:
            self.on_outputs(outputs)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop thread, then the output processor's once it has delivered what the loop handed it."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.processor.stop(timeout)

    def generate(self, requests: list[Request], max_steps: int = 100_000) -> dict[str, list[RequestOutput]]:
        """Run requests to completion on the calling thread (tests, benchmarks); outputs per request id."""
        for r in requests:
            self.add_request(r)
        collected: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        for _ in range(max_steps):
            if not self.has_work():
                break
            if not self._runnable():  # only adapter reads pending
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for out in self.step():
                collected.setdefault(out.request_id, []).append(out)
        return collected


class _Reread:
    """What the preloader hands back for an adapter read again for waiting requests (not a request)."""

    __slots__ = ("name", "request_id")

    def __init__(self, name: str) -> None:
        self.name, self.request_id = name, f"(adapter {name!r} read again)"
