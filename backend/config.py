"""EngineConfig: every engine knob in one dataclass, with defaults and validation."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field


STOP_FILE_ENV = "LORAPLEX_STOP_FILE"  # a file the launcher creates when it stops the server (TritonServer.stop_file)


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; see docs/configuration.md for what each knob does."""

    model_dir: str = ""
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on cpu, checkpoint dtype on cuda) | float32 | float16 | bfloat16
    weight_dtype: str = "auto"  # auto (= dtype) | float16: CPU only, fp16 weights of the linear layers, fp32 compute
    lora_dtype: str = "auto"  # auto (= dtype) | float16: CPU only, adapter weights held in fp16, fp32 compute
    prefill_dtype: str = "float32"  # float32 | bf16x3 | bfloat16: a CPU step's prompt rows on AMX tiles, decision 074
    quantization: str = "auto"  # auto (the checkpoint's format) | none | int8 (CPU) | fp8 | int4 (GPU): decision 072
    quantization_fallback: str = "off"  # off | reference: a format the device has no kernel for runs the torch reference
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20  # CPU pool size; on CUDA see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int = 0  # if > 0, overrides the byte budget
    max_model_len: int = 0  # 0 = the checkpoint's max_position_embeddings (longrope: its pretraining length)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_n: int = 16  # largest `n` (samples per request) accepted; also bounded by max_num_seqs
    max_logprobs: int = 20  # largest `logprobs` (top candidates per token) accepted, as vLLM's default
    max_waiting_requests: int = 4096  # requests accepted but not yet started; beyond it: UNAVAILABLE at once
    tenant_queue_share: float = 0.5  # with a tenants file: part of max_waiting_requests kept for the tenants, by weight
    max_prompt_bytes: int = 0  # text_input over this many UTF-8 bytes: INVALID_ARG before tokenizing; 0 = derived
    admission_workers: int = 2  # threads that tokenize and queue requests (a tenant uses at most all but one)
    batching: str = "continuous"  # continuous | static (a batch keeps its shape until it ends) | static-shrink; for benchmarks
    admission_policy: str = "fcfs"  # fcfs | priority (lower `priority` first) | sjf (fewest max_tokens first, aged)
    sjf_aging_rate: float = 32.0  # sjf: max_tokens credited per second a request waits (0 = pure SJF)
    default_timeout: float = 0.0  # seconds from arrival when a request has no `timeout`; 0 = none
    preemption_mode: str = "recompute"  # recompute (drop KV, re-prefill) | swap (KV to host memory)
    victim_policy: str = "most_preempted_last"  # longest_first | most_preempted_last | lowest_priority
    swap_space_bytes: int = 1 << 30  # host memory for swapped-out KV (swap mode only); full -> recompute
    preemption_window_steps: int = 32  # steps over which preemptions are counted for the admission cap
    preemption_threshold: int = 8  # more preemptions than this within the window halves the admission cap
    kv_watermark: float = 0.01  # fraction of KV blocks (at least 1) kept free at admission for running seqs
    fair_share: str = "vtc"  # vtc: admit the backlogged tenant with the least weighted served tokens first | off
    max_metric_tenants: int = 100  # development mode: distinct tenant labels in metrics; the rest count as "other"
    metric_tenant_label: str = "name"  # "name", or "hash": a stable hash of the name (metrics.hashed_tenant) instead
    metric_tenant_salt: str = ""  # mixed into "hash" labels: the same on every replica keeps them comparable
    max_adapter_wait_steps: int = 32  # a request skipped this many steps for want of an adapter slot blocks later ones
    adapter_admission: str = "policy"  # policy order | resident_first: pass over requests that would evict an adapter
    max_adapter_wait_seconds: float = 2.0  # resident_first: no request is passed over later than this after arrival
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "tenant"  # tenant | global
    max_loras: int = 8
    max_cpu_loras: int = 32
    max_lora_rank: int = 64
    max_expert_lora_rank: int | str = "auto"  # MoE: rank of the expert LoRA stacks, 0 = none; auto: decision 070
    multi_lora: dict[str, str] = field(default_factory=dict)  # name -> PEFT dir, for every tenant
    adapter_store: str = ""  # folder of PEFT adapter folders (<store>/<name>), served to every tenant
    adapter_store_max_bytes: int = 16 << 30  # every tenant's uploaded versions on disk together; 0 = no cap
    seed: int = 0  # seeds the global RNG used by requests without their own `seed`
    cpu_threads: int = 0  # torch CPU threads; 0 = auto (a server: CPUs - 1, unless OMP_NUM_THREADS is set)
    native_threads: int = 0  # threads of the native CPU GEMM and decode attention; 0 = auto (native_cpu_threads)
    enforce_eager: bool = False  # CUDA: decode steps launch their kernels one by one instead of replaying CUDA graphs
    stream_interval: int = 1  # served streams: a response carries at least this many new tokens (the first and last: any)
    grammar_token_budget_ms: float = 5.0  # a constrained sample whose matching takes longer for one token fails; 0 = off
    grammar_mean_budget_ms: float = 1.0  # ... or longer per token on average, after a burst of 10 tokens' budget; 0 = off

    def __post_init__(self) -> None:
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "device must be auto, cpu or cuda"),
            (self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype must be auto, float32, float16 or bfloat16"),
            (self.weight_dtype in ("auto", "float16"), "weight_dtype must be auto or float16"),
            (self.lora_dtype in ("auto", "float16"), "lora_dtype must be auto or float16"),
            (self.prefill_dtype in ("float32", "bf16x3", "bfloat16"), "prefill_dtype must be float32, bf16x3 or bfloat16"),
            (self.quantization in ("auto", "none", "int8", "fp8", "int4"),
             "quantization must be auto, none, int8, fp8 or int4"),
            (self.quantization_fallback in ("off", "reference"), "quantization_fallback must be off or reference"),
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size must be a power of two"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.prefix_cache_scope in ("tenant", "global"), "prefix_cache_scope must be tenant or global"),
            (self.max_loras >= 1 and self.max_cpu_loras >= 1, "max_loras and max_cpu_loras must be >= 1"),
            (self.max_lora_rank >= 1, "max_lora_rank must be >= 1"),
            (self.max_expert_lora_rank == "auto" or (
                type(self.max_expert_lora_rank) is int and 0 <= self.max_expert_lora_rank <= self.max_lora_rank),
             "max_expert_lora_rank must be auto or an integer from 0 (no expert LoRA) to max_lora_rank"),
            (self.adapter_store_max_bytes >= 0, "adapter_store_max_bytes must be >= 0 (0 = no cap)"),
            (self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"),
            (0 <= self.tenant_queue_share < 1, "tenant_queue_share must be in [0, 1)"),
            (self.max_prompt_bytes >= 0, "max_prompt_bytes must be >= 0 (0 = derived from max_model_len)"),
            (self.admission_workers >= 1, "admission_workers must be >= 1"),
            (self.max_n >= 1, "max_n must be >= 1"),
            (self.max_logprobs >= 0, "max_logprobs must be >= 0"),
            (self.batching in ("continuous", "static", "static-shrink"),
             "batching must be continuous, static or static-shrink"),
            (self.admission_policy in ("fcfs", "priority", "sjf"), "admission_policy must be fcfs, priority or sjf"),
            (self.sjf_aging_rate >= 0, "sjf_aging_rate must be >= 0"),
            (self.default_timeout >= 0, "default_timeout must be >= 0 (0 = none)"),
            (self.preemption_mode in ("recompute", "swap"), "preemption_mode must be recompute or swap"),
            (
                self.victim_policy in ("longest_first", "most_preempted_last", "lowest_priority"),
                "victim_policy must be longest_first, most_preempted_last or lowest_priority",
            ),
            (self.swap_space_bytes >= 0, "swap_space_bytes must be >= 0"),
            (self.preemption_window_steps >= 1, "preemption_window_steps must be >= 1"),
            (self.preemption_threshold >= 0, "preemption_threshold must be >= 0"),
            (0 <= self.kv_watermark < 1, "kv_watermark must be in [0, 1)"),
            (self.max_adapter_wait_steps >= 0, "max_adapter_wait_steps must be >= 0"),
            (self.adapter_admission in ("resident_first", "policy"), "adapter_admission must be resident_first or policy"),
            (self.max_adapter_wait_seconds >= 0, "max_adapter_wait_seconds must be >= 0"),
            (self.fair_share in ("vtc", "off"), "fair_share must be vtc or off"),
            (self.max_metric_tenants >= 1, "max_metric_tenants must be >= 1"),
            (self.metric_tenant_label in ("name", "hash"), "metric_tenant_label must be 'name' or 'hash'"),
            (self.cpu_threads >= 0, "cpu_threads must be >= 0 (0 = auto)"),
            (self.native_threads >= 0, "native_threads must be >= 0 (0 = auto)"),
            (self.stream_interval >= 1, "stream_interval must be >= 1"),
            (self.grammar_token_budget_ms >= 0 and self.grammar_mean_budget_ms >= 0,
             "grammar_token_budget_ms and grammar_mean_budget_ms must be >= 0 (0 = off)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"EngineConfig: {message}")

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        """Build from a dict, rejecting unknown keys with the list of known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"EngineConfig: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    def with_env_overrides(self) -> "EngineConfig":
        """Apply LORAPLEX_ENGINE_CONFIG (a JSON object), LORAPLEX_MODEL_DIR and LORAPLEX_ADAPTER_STORE."""
        values = dataclasses.asdict(self)
        if os.environ.get("LORAPLEX_ENGINE_CONFIG"):
            values.update(json.loads(os.environ["LORAPLEX_ENGINE_CONFIG"]))
        if os.environ.get("LORAPLEX_MODEL_DIR"):
            values["model_dir"] = os.environ["LORAPLEX_MODEL_DIR"]
        if os.environ.get("LORAPLEX_ADAPTER_STORE"):
            values["adapter_store"] = os.environ["LORAPLEX_ADAPTER_STORE"]
        return EngineConfig.from_dict(values)


def native_cpu_threads(configured: int = 0, environ=os.environ, int8: bool = False) -> int:
    """Threads of the native CPU ops' parallel loops (the fp16/int8 GEMM, decode attention): configured if > 0;
    else OMP_NUM_THREADS when set (the operator's choice); else every CPU this process may use, but one
    for an int8 base (at least 1). Unlike torch's static splits, those loops hand out their work a panel
    or a sequence at a time, so a thread that loses its core to Triton's threads delays only what it holds
    (decision 034). An int8 step is short and bound by weight bytes: a thread on every CPU gains it
    nothing and loses more to the serving threads taking its core (decision 079).
    environ: the environment the engine runs in (a benchmark asks for a server's)."""
    if configured > 0:
        return configured
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    from loraplex.launch.cpus import usable_cpus  # affinity capped by the cgroup quota (decision 056)
    return max(1, usable_cpus() - int8)


def serving_cpu_threads(environ=os.environ) -> int:
    """torch CPU threads for a server: every CPU this process may use but one, which Triton's
    frontends and the response thread need (at least 1). A torch pool as large as the machine
    stalls at its barriers whenever another thread takes one of its cores, so the whole op waits for
    that thread's time slice (decision 034).
    0 (keep torch's own setting) when OMP_NUM_THREADS is set in environ: that choice is the operator's."""
    if environ.get("OMP_NUM_THREADS"):
        return 0
    from loraplex.launch.cpus import usable_cpus  # affinity capped by the cgroup quota (decision 056)
    return max(1, usable_cpus() - 1)
