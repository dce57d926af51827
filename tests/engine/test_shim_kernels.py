"""The engine with LORAPLEX_KERNELS=shim: every kernel call runs the .cu sources on the CPU shim.

One batch holds two adapters and the base model; a second request under the first adapter
hits the prefix cache (prefill over a cached prefix, next to decodes); a greedy n=2 request
forks and copies its shared last block on write. Every token must equal peft's greedy
generate, and every call must have gone through the shim (the torch path is forbidden).
"""

from __future__ import annotations

import collections

import pytest

import peft_reference as ref
from tiny_llama import build_model_and_adapters, run_greedy
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.kernels import cpu_runner, dispatch
from loraplex.engine.request import SamplingParams

BLOCK_SIZE = 8
SHARED = "The quick brown fox jumps over"  # 31 tokens with <s>: three full blocks to share
# Head dim 32 (a kernel instantiation), GQA 2:1, two layers: small enough for the shim.
MODEL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
ADAPTERS = {
    "attn": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], seed=21),
    "mlp": dict(r=8, alpha=16, target_modules=["k_proj", "gate_proj", "up_proj", "down_proj"], seed=22),
}
# (request id, adapter, prompt, n); the first three are one batch, the last arrives after it.
FIRST = [("attn", "attn", SHARED, 1), ("mlp", "mlp", "Hello world", 1), ("base", None, "1, 2, 3,", 2)]
HIT = ("attn-hit", "attn", SHARED, 1)
MAX_TOKENS = 6
KERNELS = (
    "shrink_sgmv", "expand_sgmv", "shrink_bgmv", "expand_bgmv", "shrink_bgmv_group", "expand_bgmv_group",
    "write_kv", "copy_blocks", "paged_prefill", "paged_decode",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, adapter name -> PEFT dir) of a tiny LLaMA the shim runs quickly."""
    return build_model_and_adapters(tmp_path_factory.mktemp("shim-model"), MODEL, ADAPTERS)


@pytest.fixture
def shim_launches(monkeypatch):
    """Shim mode for this test only (as LORAPLEX_KERNELS=shim sets it); kernel name -> launches."""
    monkeypatch.setenv(dispatch.ENV, "shim")
    monkeypatch.setattr(dispatch, "MODE", dispatch.read_mode())
    launches = collections.Counter()
    launch, torch_path = cpu_runner.CpuRunner.launch, dispatch.torch_path

    def counting(self, family, name, grid, block, args):
        launches[name.split("<")[0]] += 1
        return launch(self, family, name, grid, block, args)

    def forbidden(name, tensor):
        if name not in dispatch.OP_OF:  # a layer op without a .cu kernel: the reference in every mode
            return torch_path(name, tensor)
        raise AssertionError(f"{name} took the torch path in shim mode")

    monkeypatch.setattr(cpu_runner.CpuRunner, "launch", counting)
    monkeypatch.setattr(dispatch, "torch_path", forbidden)
    return launches


def greedy(lora: str | None, n: int) -> SamplingParams:
    values = {"temperature": 0, "max_tokens": MAX_TOKENS, "n": n}
    return SamplingParams.from_dict(values | ({"lora_name": lora} if lora else {}))


def test_shim_engine_matches_peft(tiny, shim_launches):
    model_dir, adapters = tiny
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32", multi_lora=adapters, max_loras=2, max_lora_rank=8,
        num_kv_blocks=64, block_size=BLOCK_SIZE,
    ))
    assert engine.model.kernel_fallbacks == {}
    requests = {rid: engine.make_request(rid, prompt, greedy(lora, n), "t") for rid, lora, prompt, n in FIRST}
    for req in requests.values():
        engine.add_request(req)
    tokens = collections.defaultdict(list)  # (request id, sample) -> tokens
    for step in range(100):
        if not engine.has_work():
            break
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id, out.index] += out.token_ids
        if step == 0:  # the first batch: both adapters and the base model together
            assert {s.request.params.lora_name for s in engine.scheduler.running} == {"attn", "mlp", None}
            rid, lora, prompt, n = HIT
            requests[rid] = engine.make_request(rid, prompt, greedy(lora, n), "t")
            engine.add_request(requests[rid])
    assert not engine.has_work()

    assert engine.scheduler.prefix_hit_tokens["t"] == 3 * BLOCK_SIZE  # attn-hit reused attn's full blocks
    assert set(shim_launches) == set(KERNELS) and shim_launches["copy_blocks"] >= 1, shim_launches
    for rid, req in requests.items():
        lora = req.params.lora_name
        want = ref.greedy_tokens(model_dir, adapters[lora] if lora else None, req.prompt_token_ids, MAX_TOKENS)
        for index in range(req.params.n):
            assert tokens[rid, index] == want, (rid, index)
    for rid in ("attn", "mlp"):  # each adapter changes the output (else equality proves little)
        assert tokens[rid, 0] != ref.greedy_tokens(model_dir, None, requests[rid].prompt_token_ids, MAX_TOKENS), rid


def test_decode_graph_replays_match_peft(tiny, shim_launches):
    """Decode steps through DecodeGraphs' static buffers (sizes 1, 2, 4, with and without adapters; a stand-in
    capture that reruns the forward on them, as a CUDA graph replays it): steps of 3 sequences pad to 4, steps
    of 5 run eagerly, the base request's last steps replay the graph without LoRA, and every token still
    equals peft's."""
    from loraplex.worker.decode_graphs import DecodeGraphs

    model_dir, adapters = tiny
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32", multi_lora=adapters, max_loras=2, max_lora_rank=8,
        num_kv_blocks=64, block_size=BLOCK_SIZE,
    ))

    def rerun(forward):
        output = forward().clone()  # the graph's static output
        return (lambda: output.copy_(forward())), output

    runner = engine.runner
    runner.graphs = DecodeGraphs(engine.model, runner.kv_cache, [1, 2, 4], engine.max_model_len // BLOCK_SIZE,
                                 runner.lora, capture=rerun)
    replayed = collections.Counter()  # (graph size, with adapters) -> replays
    for key, (replay, output) in list(runner.graphs.graphs.items()):
        runner.graphs.graphs[key] = (lambda key=key, replay=replay: replayed.update([key]) or replay()), output
    sizes = collections.Counter()  # decode steps by sequence count
    execute = runner.execute

    def counting(batch, *args, **kwargs):
        if batch.seqs and all(n == 1 for n in batch.num_new_tokens):
            sizes[len(batch.seqs)] += 1
        return execute(batch, *args, **kwargs)

    runner.execute = counting
    lengths = {"attn": 6, "mlp": 4, "base": 10, "attn-hit": 7}  # 5 sequences, then 4, 3, 2 (base's two samples)
    requests, tokens = run_greedy(engine, [*FIRST, HIT], lengths)

    assert sizes[5] >= 1 and sizes[3] >= 1, sizes  # 5: eager; 3: padded to 4
    assert sum(replayed.values()) == sum(n for size, n in sizes.items() if size <= 4)
    assert replayed[4, True] >= 1 and replayed[2, False] >= 1, replayed
    for rid, req in requests.items():
        lora = req.params.lora_name
        want = ref.greedy_tokens(model_dir, adapters[lora] if lora else None, req.prompt_token_ids, lengths[rid])
        for index in range(req.params.n):
            assert tokens[rid, index] == want, (rid, index)
