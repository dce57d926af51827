"""Multi-LoRA batching in the engine, checked token for token against HF transformers + peft.

Six adapters (ranks 4..64; attention-only, MLP-only, all seven projections, one with
layers_to_transform, one rsLoRA, one with rank_pattern / alpha_pattern) and base-model
requests share one continuous batch with staggered arrivals, while only three adapters fit
in device slots (max_loras=3) and two in host memory (max_cpu_loras=2), so adapters wait,
get evicted and are read from disk again. Runs on three architectures: LLaMA with GQA,
Qwen2 (q/k/v bias) and Mistral with MHA (the ``lora_arch`` fixture, tests/engine/conftest.py).

Numerics: fp32 on CPU. Greedy outputs must equal peft's ``generate(do_sample=False)``
exactly; logits of the prefill step (SGMV) and of the next decode step (BGMV) must match
peft's within LOGIT_ATOL.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import peft_reference as ref
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.lora.backends import KernelLoraBackend, LoraPlan, NativeRows, TorchLoraBackend, TorchPlan
from loraplex.lora.backends.tiles import SlotTiles
from loraplex.models.llama import AttentionBatch
from loraplex.engine.request import RequestOutput, SamplingParams, SeqStatus

LOGIT_ATOL = 1e-4  # fp32; the observed maximum is below 2e-5 (logits are O(10))
MAX_LORAS = 3
MAX_CPU_LORAS = 2
BLOCK_SIZE = 8
NUM_KV_BLOCKS = 256
MAX_BATCHED_TOKENS = 48  # below the longest prompt: its prefill is chunked next to decodes

SHARED = "The quick brown fox jumps over the lazy dog"  # one prompt under several adapters
LONG = "Once upon a time, in a land far away, there lived a tenant who served many adapters at once."

# (request id, adapter or None for the base model, prompt, max_tokens, tenant), in arrival waves.
WAVES: list[list[tuple[str, str | None, str, int, str]]] = [
    [
        ("w1-attn", "attn-r4", SHARED, 10, "t1"),
        ("w1-mlp", "mlp-r8", "Hello world", 12, "t2"),
        ("w1-base", None, SHARED, 9, "t1"),
        ("w1-all16", "all-r16", "1, 2, 3,", 11, "t3"),
        ("w1-r64", "all-r64", SHARED, 8, "t1"),  # 4th and 5th adapter: wait for a slot
        ("w1-layers", "layers-r24", LONG, 10, "t2"),
    ],
    [
        ("w2-rslora", "rslora-r32", "def main():", 12, "t3"),
        ("w2-attn", "attn-r4", SHARED, 7, "t2"),  # same adapter + prompt, other tenant
        ("w2-base", None, LONG, 6, "t2"),
        ("w2-mlp", "mlp-r8", "Triton serves many tenants", 9, "t1"),
        ("w2-r64", "all-r64", "What is LoRA? It is a low-rank adapter.", 10, "t4"),
    ],
    [
        ("w3-layers", "layers-r24", "abc", 12, "t1"),
        ("w3-all16", "all-r16", SHARED, 10, "t1"),
        ("w3-base", None, "x", 8, "t3"),
        ("w3-rslora", "rslora-r32", LONG, 9, "t4"),
        ("w3-mlp", "mlp-r8", SHARED, 11, "t2"),
    ],
]
STEPS_BETWEEN_WAVES = [3, 2]


def make_engine(family, **overrides) -> LLMEngine:
    """An fp32 CPU engine over the family's model with all six adapters registered."""
    config = dict(
        model_dir=family.model_dir, device="cpu", dtype="float32", multi_lora=dict(family.adapters),
        max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS, max_lora_rank=64, num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED_TOKENS,
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def greedy(max_tokens: int, lora: str | None) -> SamplingParams:
    values = {"temperature": 0, "max_tokens": max_tokens}
    if lora:
        values["lora_name"] = lora
    return SamplingParams.from_dict(values)


def check_step_invariants(engine: LLMEngine) -> bool:
    """Slot and pin bookkeeping after a step; returns whether a sequence is waiting for a slot."""
    mgr, sched = engine.adapters, engine.scheduler
    running = [s for s in sched.running]
    users: dict[str, int] = {}
    for seq in running:
        assert seq.status is SeqStatus.RUNNING
        name = seq.request.params.lora_name
        if name is None:
            assert seq.adapter_slot == -1
            continue
        users[name] = users.get(name, 0) + 1
        assert seq.adapter_slot == mgr.slot_of(name), (name, seq.adapter_slot, mgr.slot_of(name))
    assert len(users) <= MAX_LORAS
    for name in mgr.names():
        assert mgr.pins(name) == users.get(name, 0), (name, mgr.pins(name), users.get(name, 0))
    slots = [mgr.slot_of(n) for n in users]
    assert len(set(slots)) == len(slots)  # two adapters never share a slot
    engine.kv_manager.check_invariants()
    return mgr.pinned_count() == MAX_LORAS and any(
        s.request.params.lora_name and not mgr.is_resident(s.request.params.lora_name) for s in sched.waiting
    )


def collect(outputs: list[RequestOutput], into: dict[str, list[RequestOutput]]) -> None:
    for out in outputs:
        into.setdefault(out.request_id, []).append(out)


def test_staggered_multi_lora_batch_matches_peft(lora_family, lora_arch):
    family = lora_family(lora_arch)
    engine = make_engine(family)
    requests = {}
    outputs: dict[str, list[RequestOutput]] = {}
    saw_wait_for_slot = False
    for w, wave in enumerate(WAVES):
        for rid, lora, prompt, max_tokens, tenant in wave:
            req = engine.make_request(rid, prompt, greedy(max_tokens, lora), tenant)
            requests[rid] = req
            engine.add_request(req)
        steps = STEPS_BETWEEN_WAVES[w] if w < len(STEPS_BETWEEN_WAVES) else 10_000
        for _ in range(steps):
            if not engine.has_work():
                break
            collect(engine.step(), outputs)
            saw_wait_for_slot |= check_step_invariants(engine)
    assert not engine.has_work()

    # Every request, adapter or base, equals peft's greedy generate token for token.
    assert set(outputs) == set(requests)
    mismatches = {}
    for rid, req in requests.items():
        outs = outputs[rid]
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        got = [t for o in outs for t in o.token_ids]
        lora = req.params.lora_name
        want = ref.greedy_tokens(family.model_dir, family.adapters[lora] if lora else None,
                                 req.prompt_token_ids, req.params.max_tokens)
        if got != want:
            mismatches[rid] = (lora, got, want)
        assert outs[-1].finish_reason == ("length" if len(want) == req.params.max_tokens and want[-1] != 2 else "stop")
    assert not mismatches, mismatches

    # The adapters really change the output (otherwise equality above proves nothing).
    base_shared = ref.greedy_tokens(family.model_dir, None, requests["w1-base"].prompt_token_ids, 8)
    for rid in ("w1-attn", "w1-r64", "w3-all16", "w3-mlp"):
        assert [t for o in outputs[rid] for t in o.token_ids][:8] != base_shared, rid

    # Six adapters through three device slots and a two-entry host tier.
    mgr = engine.adapters
    used = {r.params.lora_name for r in requests.values() if r.params.lora_name}
    assert len(used) == len(family.adapters) == 6
    assert saw_wait_for_slot, "no request ever waited for a device slot"
    assert mgr.evictions >= len(used) - MAX_LORAS
    assert mgr.host_evictions >= len(used) - MAX_CPU_LORAS
    assert mgr.loads_from_disk == mgr.host_evictions + len(mgr.host_names())
    # Some adapter was read from disk twice: the engine validates each wave's adapters at
    # admission (host tier of two), so the first wave's earliest adapters leave host memory
    # before the scheduler first asks for their slots.
    assert mgr.loads_from_disk > len(used)
    assert mgr.pinned_count() == 0 and all(mgr.pins(n) == 0 for n in mgr.names())
    assert len(mgr.resident_names()) == MAX_LORAS
    assert engine.kv_manager.num_free_blocks == NUM_KV_BLOCKS
    engine.kv_manager.check_invariants()
    print(f"{lora_arch}: {engine.num_steps} steps; evictions {mgr.evictions}, loads_from_disk "
          f"{mgr.loads_from_disk}, host_evictions {mgr.host_evictions}")


# ---- first-step logits -------------------------------------------------------------------


def engine_logits(engine: LLMEngine, rows: list[tuple[list[int], str | None]], path: str = "kernels"):
    """Logits of one prefill step over all rows (SGMV) and of the decode step after it (BGMV).

    ``path`` is how the LoRA batch is handed to the model: "kernels" (SGMV, then BGMV: the
    kernels or the reference), "dense" (each row's run of tokens by two matmuls,
    ``TorchPlan.dense_runs``, as the torch path does for one-adapter batches and prefill chunks) or
    "tiles" (dense prefill, then every decode row in slot tiles, ``TorchPlan.tiles``, as the torch
    path does for decode over many adapters).

    Drives ``engine.model.forward`` directly, with tensors built as ModelRunner.execute
    builds them, on a private KV cache. Each row is (prompt ids, adapter name or None);
    rows are one batch, so their adapters must fit the device slots together. Returns
    (prefill logits [B, V], greedy next tokens [B], decode logits [B, V]).
    """
    model, bs = engine.model, BLOCK_SIZE
    names = [name for _, name in rows]
    slots = [engine.adapters.acquire(n) if n else -1 for n in names]
    try:
        assert None not in slots
        lens = [len(ids) for ids, _ in rows]
        per_seq = [(n + 1 + bs - 1) // bs for n in lens]  # room for the decode token
        tables, nxt = [], 1  # leave block 0 unused so a zero table entry would be caught
        for n in per_seq:
            tables.append(list(range(nxt, nxt + n)))
            nxt += n
        kv = model.allocate_kv_cache(nxt, bs)
        width = max(per_seq)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

        def flat(table, p):
            return table[p // bs] * bs + p % bs

        ids, positions, mapping, token_slots, cu = [], [], [], [], [0]
        for (prompt, _), table, slot in zip(rows, tables, slots):
            ids += prompt
            positions += range(len(prompt))
            mapping += [flat(table, p) for p in range(len(prompt))]
            token_slots += [slot] * len(prompt)
            cu.append(cu[-1] + len(prompt))
        i32 = dict(dtype=torch.int32)
        attn = AttentionBatch(
            positions=torch.tensor(positions), slot_mapping=torch.tensor(mapping), block_tables=padded,
            context_lens=torch.tensor(lens, **i32), cu_query_lens=torch.tensor(cu, **i32), is_decode=False,
        )
        lora = handed(engine, path, token_slots, cu, slots, is_decode=False)
        with torch.inference_mode():
            hidden = model.forward(torch.tensor(ids), attn, kv, lora)
            prefill = model.logits(hidden[torch.tensor(cu[1:]) - 1])
            nxt_tokens = prefill.argmax(-1).tolist()
            rows_cu = torch.arange(len(rows) + 1, dtype=torch.int32)  # one new token per row
            attn = AttentionBatch(
                positions=torch.tensor(lens), slot_mapping=torch.tensor([flat(t, n) for t, n in zip(tables, lens)]),
                block_tables=padded, context_lens=torch.tensor([n + 1 for n in lens], **i32),
                cu_query_lens=rows_cu, is_decode=True,
            )
            lora = handed(engine, path, slots, list(range(len(rows) + 1)), slots, is_decode=True)
            decode = model.logits(model.forward(torch.tensor(nxt_tokens), attn, kv, lora))
        return prefill, nxt_tokens, decode
    finally:
        for n, s in zip(names, slots):
            if n and s is not None:
                engine.adapters.release(n, slot=s)


def handed(engine, path: str, token_slots: list[int], cu: list[int], slots: list[int], is_decode: bool) -> LoraPlan:
    """The LoRA plan of one step (rows cu[i]:cu[i+1] on slots[i]) for the given path (engine_logits)."""
    if path == "kernels":
        backend = KernelLoraBackend(engine.lora_slots, torch.from_numpy)
        return backend.plan(np.array(slots, np.int32), np.array(cu), is_decode)
    backend = TorchLoraBackend(engine.lora_slots, torch.from_numpy)
    if path == "dense" or not is_decode:
        return TorchPlan(backend, [(cu[i], cu[i + 1], slot) for i, slot in enumerate(slots) if slot >= 0])
    per_row = np.array(token_slots)
    rows = np.flatnonzero(per_row >= 0)
    tiles = SlotTiles.plan(rows, per_row[rows], engine.lora_slots.slot_ranks, torch.from_numpy)
    assert tiles is not None
    return TorchPlan(backend, [], tiles)


# Two batches of three adapters each plus base rows; one adapter appears twice, apart, so
# its rows are separate segments (SGMV) and interleaved rows (BGMV).
LOGIT_BATCHES = [
    [("Hello world", "attn-r4"), (SHARED, None), ("1, 2, 3, 4, 5, 6, 7, 8", "mlp-r8"),
     (LONG, "all-r16"), (SHARED, "attn-r4")],
    [(SHARED, "layers-r24"), ("def main():", "rslora-r32"), ("abc", None), (LONG, "all-r64"),
     ("Hello world", "rslora-r32")],
]


def logits_match_peft(engine: LLMEngine, family, model_dir: str) -> list[tuple[list[int], str | None, torch.Tensor, float]]:
    """Assert every LOGIT_BATCHES row's prefill and decode logits equal peft's on model_dir (within
    LOGIT_ATOL); returns per row (prompt ids, adapter name, peft's prefill logits, the larger difference)."""
    checked = []
    for batch in LOGIT_BATCHES:
        rows = [(engine.tokenizer(p).input_ids, name) for p, name in batch]
        prefill, nxt, decode = engine_logits(engine, rows)
        for i, (ids, name) in enumerate(rows):
            adapter_dir = family.adapters[name] if name else None
            want = ref.first_logits(model_dir, adapter_dir, ids)
            want_next = ref.first_logits(model_dir, adapter_dir, ids + [nxt[i]])
            for step, got, expected in (("prefill", prefill[i], want), ("decode", decode[i], want_next)):
                torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0,
                                           msg=lambda m, step=step: f"{name} row {i} {step}: {m}")
            error = max(float((prefill[i] - want).abs().max()), float((decode[i] - want_next).abs().max()))
            checked.append((ids, name, want, error))
    return checked


def test_first_step_logits_match_peft(lora_family, lora_arch, kernel_mode):
    family = lora_family(lora_arch)
    engine = make_engine(family)
    assert (engine.model.ops.__name__ == "loraplex.kernels.cpu_native") == (kernel_mode == "auto")  # else kernels
    worst = 0.0
    for ids, name, want, error in logits_match_peft(engine, family, family.model_dir):
        worst = max(worst, error)
        if name:  # the adapter moves the logits far beyond the tolerance
            base = ref.first_logits(family.model_dir, None, ids)
            assert float((want - base).abs().max()) > 1000 * LOGIT_ATOL, name
    assert engine.adapters.pinned_count() == 0
    assert engine.adapters.evictions == 3  # the second batch displaced the first one's three adapters
    assert engine.adapters.loads_from_disk == 6
    print(f"{lora_arch}: max |engine - peft| logit difference {worst:.2e}")


@pytest.mark.parametrize("rows_form", [True, False])
@pytest.mark.parametrize("budget", [1024, 16])  # one step for the batch; or each prompt in chunks of 16 tokens
def test_a_prefill_step_in_either_form_matches_peft(lora_family, kernel_mode, monkeypatch, rows_form, budget):
    # through the runner: a step with prefill runs in the one-call decode forward, a row per token, while its
    # prompt rows attend to at most ROWS_FORM_MAX_MEAN_CONTEXT keys each on average (chunks after the first read
    # the cached ones),
    # else by the prefill path; peft's logits either way
    from loraplex.worker import model_runner

    if kernel_mode != "auto":
        pytest.skip("the decode form is the native forward's")
    if not rows_form:
        monkeypatch.setattr(model_runner, "ROWS_FORM_MAX_MEAN_CONTEXT", 0)
    family = lora_family("llama-gqa")
    engine = make_engine(family, max_num_batched_tokens=budget)
    rows_seen, logits = [], []
    native, head = engine.model.native_decode, engine.model.logits
    engine.model.native_decode = lambda h, *args: rows_seen.append(h.shape[0]) or native(h, *args)
    engine.model.logits = lambda h, *out: logits.append(head(h, *out).clone()) or logits[-1]  # out: reused
    batch = [("Hello world", "attn-r4"), (SHARED, None), (LONG, "all-r16")]
    prompts = [engine.tokenizer(p).input_ids for p, _ in batch]
    if budget >= sum(map(len, prompts)):
        engine.generate([engine.make_request(f"r{i}", p, greedy(1, name)) for i, (p, name) in enumerate(batch)])
        got = logits[0]
        assert rows_seen == ([sum(map(len, prompts))] if rows_form else [])
    else:
        got = []
        for i, (p, name) in enumerate(batch):
            engine.generate([engine.make_request(f"c{i}", p, greedy(1, name))])
            got.append(logits[-1][0])
        assert max(rows_seen, default=0) <= budget and (len(rows_seen) > len(batch)) == rows_form
    for i, (ids, (_, name)) in enumerate(zip(prompts, batch)):
        want = ref.first_logits(family.model_dir, family.adapters[name] if name else None, ids)
        torch.testing.assert_close(got[i], want, atol=LOGIT_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("path", ["dense", "tiles"])
def test_torch_path_matches_peft(lora_family, lora_arch, path):
    # each row's adapter added by two matmuls over its run of rows, or by slot tiles read in place from the
    # stacks at the step's largest rank (ranks 4..64 side by side), instead of the reference's gathers
    family = lora_family(lora_arch)
    engine = make_engine(family)
    for batch in LOGIT_BATCHES:
        rows = [(engine.tokenizer(p).input_ids, name) for p, name in batch]
        prefill, nxt, decode = engine_logits(engine, rows, path)
        tiles = engine_logits(engine, rows)
        for i, (ids, name) in enumerate(rows):
            adapter = family.adapters[name] if name else None
            want = ref.first_logits(family.model_dir, adapter, ids)
            want_next = ref.first_logits(family.model_dir, adapter, ids + [nxt[i]])
            torch.testing.assert_close(prefill[i], want, atol=LOGIT_ATOL, rtol=0, msg=lambda m: f"{name} prefill: {m}")
            torch.testing.assert_close(decode[i], want_next, atol=LOGIT_ATOL, rtol=0, msg=lambda m: f"{name} decode: {m}")
        assert nxt == tiles[1]


def test_the_runner_hands_dense_runs_where_they_pay(lora_family, kernel_mode):
    # the torch path plans dense runs and tiles; with the native one-call forward every step hands per-row slots,
    # a prefill's too (it runs in the decode form: model_runner.ROWS_FORM_MAX_MEAN_CONTEXT)
    family = lora_family("llama-gqa")
    engine = make_engine(family)
    native = engine.model.native_decode is not None
    assert native == (kernel_mode == "auto")
    seen = []  # (is_decode, plan) of each step
    build = engine.runner._lora_batch
    engine.runner._lora_batch = lambda *args: seen.append((args[2], build(*args))) or seen[-1][1]
    name, other = sorted(family.adapters)[:2]
    for k, loras in enumerate(([name, name], [name, other], [name, None])):
        seen.clear()
        prompts = [f"{k}{i} Hello world" for i in range(len(loras))]  # no prefix-cache hits
        engine.generate([engine.make_request(p, p, greedy(3, lora)) for p, lora in zip(prompts, loras)])
        decodes = [plan for is_decode, plan in seen if is_decode]
        one_adapter = loras == [name, name]  # two rows on one adapter: a dense run; else slot tiles
        assert decodes
        prompt_rows = [len(engine.tokenizer(p).input_ids) for p in prompts]
        if native:  # each row's slot, -1 for the base model's; the prefill first, a row per prompt token
            prefill = seen[0][1]  # in the decode form
            on_adapter = sorted(lora is not None for lora in loras)
            assert all(isinstance(plan, NativeRows) for _, plan in seen)
            assert prefill.token_slots.tolist() == [s for n, s in zip(prompt_rows, decodes[0].token_slots.tolist())
                                                    for _ in range(n)]
            assert all(sorted(s >= 0 for s in batch.token_slots.tolist()) == on_adapter for batch in decodes)
            continue
        assert all(bool(batch.dense_runs) == one_adapter for batch in decodes)
        assert all((batch.tiles is not None) != one_adapter and batch.token_slots is None for batch in decodes)
        prefill = next(plan for is_decode, plan in seen if not is_decode)  # long runs: dense, base rows in none
        covered = sum(end - start for start, end, _ in prefill.dense_runs)
        assert covered == sum(n for n, lora in zip(prompt_rows, loras) if lora)


def test_the_torch_path_plan_covers_each_adapter_row_once(lora_family):
    # prefill chunks by dense runs; the short runs by slot tiles, or by per-row slots (dense rows -1)
    # when the slots in use are too sparse for one range
    runner = make_engine(lora_family("llama-gqa"), max_loras=6).runner
    plan = TorchLoraBackend(runner.lora_slots, torch.from_numpy).plan
    decode = plan(np.array([0, 1, 0, -1], np.int32), np.arange(5), True)
    assert decode.dense_runs == [] and decode.token_slots is None
    assert (decode.tiles.lo, decode.tiles.hi, decode.tiles.dest.tolist()) == (0, 2, [0, 2, 1])
    mixed = plan(np.array([2, 0, 1], np.int32), np.array([0, 20, 21, 22]), False)
    assert mixed.dense_runs == [(0, 20, 2)] and mixed.tiles.dest.tolist() == [20, 21]
    sparse = plan(np.array([0, 5, 3], np.int32), np.array([0, 1, 2, 30]), False)
    assert sparse.dense_runs == [(2, 30, 3)] and sparse.tiles is None
    assert sparse.token_slots.tolist() == [0, 5] + [-1] * 28
    sparse_decode = plan(np.array([5, 0], np.int32), np.arange(3), True)
    assert sparse_decode.tiles is None and sparse_decode.token_slots.tolist() == [5, 0]


def test_adapter_specs_are_what_the_tests_claim(lora_family):
    """The six adapters cover ranks 4..64 and the target-module mixes the scenario needs."""
    family = lora_family("llama-gqa")
    cfgs = {name: family.adapter_config(name) for name in family.adapters}
    assert sorted(c["r"] for c in cfgs.values()) == [4, 8, 16, 24, 32, 64]
    assert set(cfgs["attn-r4"]["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(cfgs["mlp-r8"]["target_modules"]) == {"gate_proj", "up_proj", "down_proj"}
    assert len(cfgs["all-r64"]["target_modules"]) == 7
    assert cfgs["layers-r24"]["layers_to_transform"] == [1, 3]
    assert cfgs["rslora-r32"]["use_rslora"] is True
    assert cfgs["all-r16"]["rank_pattern"] == {"k_proj": 4}
    # The engine's view agrees: layers 0 and 2 untouched, k_proj at rank 4.
    engine = make_engine(family)
    slot = engine.adapters.acquire("layers-r24")
    ranks = engine.lora_slots.ranks
    assert [int(ranks[layer]["q_proj"][slot]) for layer in range(4)] == [0, 24, 0, 24]
    assert [int(ranks[1][m][slot]) for m in ("k_proj", "gate_proj", "down_proj")] == [0, 0, 24]
    slot16 = engine.adapters.acquire("all-r16")
    assert [int(ranks[0][m][slot16]) for m in ("q_proj", "k_proj")] == [16, 4]
    assert float(engine.lora_slots.scales[0]["down_proj"][slot16]) == pytest.approx(8 / 16)


@pytest.mark.parametrize("max_loras", [1, 2])
def test_reregistered_adapter_serves_old_and_new_versions(lora_family, max_loras):
    """Re-registering a name while a request uses it: that request finishes on the old weights,
    later ones get the new weights (and never the old version's prefix-cache blocks)."""
    family = lora_family("llama-gqa")
    old, new = family.adapters["attn-r4"], family.adapters["all-r16"]
    engine = make_engine(family, multi_lora={"hot": old}, max_loras=max_loras)
    outputs: dict[str, list[RequestOutput]] = {}
    r1 = engine.make_request("r1", SHARED, greedy(10, "hot"), "t1")
    engine.add_request(r1)
    for _ in range(2):
        collect(engine.step(), outputs)
    engine.adapters.register("hot", new)
    r2 = engine.make_request("r2", SHARED, greedy(10, "hot"), "t1")  # same tenant and prompt as r1
    engine.add_request(r2)
    collect(engine.step(), outputs)
    assert engine.adapters.pinned_count() == (1 if max_loras == 1 else 2)  # old version still pinned by r1
    while engine.has_work():
        collect(engine.step(), outputs)
    got = {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
    assert got["r1"] == ref.greedy_tokens(family.model_dir, old, r1.prompt_token_ids, 10)
    assert got["r2"] == ref.greedy_tokens(family.model_dir, new, r2.prompt_token_ids, 10)
    assert got["r1"] != got["r2"]
    mgr = engine.adapters
    assert mgr.pinned_count() == 0 and mgr.resident_names() == ["hot"]
    assert engine.kv_manager.num_free_blocks == NUM_KV_BLOCKS


def test_waiting_for_a_slot_does_not_reread_the_adapter_every_step(lora_family):
    """A request waiting for a device slot must not cost a disk read per step.

    One slot, one host-memory entry: r1 (x) holds the slot for 20 steps while r2 (y) and
    r3 (z) wait. Each adapter needs at most two reads from disk: validation at admission and
    the load into a slot once one is free (the host tier of one may have dropped it between).
    """
    family = lora_family("llama-gqa")
    adapters = {"x": family.adapters["attn-r4"], "y": family.adapters["mlp-r8"], "z": family.adapters["all-r16"]}
    engine = make_engine(family, multi_lora=adapters, max_loras=1, max_cpu_loras=1)
    reqs = [engine.make_request(rid, "Hello world", greedy(n, lora))
            for rid, lora, n in [("r1", "x", 20), ("r2", "y", 2), ("r3", "z", 2)]]
    outputs = engine.generate(reqs)
    for req in reqs:
        lora = req.params.lora_name
        want = ref.greedy_tokens(family.model_dir, adapters[lora], req.prompt_token_ids, req.params.max_tokens)
        assert [t for o in outputs[req.request_id] for t in o.token_ids] == want
    mgr = engine.adapters
    assert mgr.evictions == 2
    assert mgr.loads_from_disk <= 2 * len(adapters), (
        f"{mgr.loads_from_disk} adapter reads from disk in {engine.num_steps} steps: a waiting request's "
        f"adapter is re-read (and re-validated) at every step although no slot is free"
    )
