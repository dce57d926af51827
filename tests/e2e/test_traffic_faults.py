"""Faults under traffic through a real tritonserver: cancels and disconnects, KV exhaustion, adapters broken on disk.

`traffic_server` (the module's: max_loras 4, max_cpu_loras 2, a temporary store of adapter
copies) serves the cancel and adapter tests; `tiny_kv_server` (32 KV blocks of 16 tokens,
started for its one test only) serves the preemption test.
"""

from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path

import pytest
import requests
import helpers
from helpers import scrape, wait_for_metric
from peft_reference import greedy_tokens
from tritonserver_fixture import make_triton_server_fixture, seed_demo_adapters

from loraplex.clients.load import StreamJob, StreamOutcome, run_streams, stream_problem
from loraplex.models.builtin.demo import build_peft_adapter

VICTIMS = ("victim-garbled", "victim-deleted", "resident-garbled", "resident-deleted")
FILLERS = tuple(f"filler-{i}" for i in range(4))
TINY_BLOCKS = 32


def fault_store(store: Path, demo) -> Path:
    """Copies of the demo adapters, four adapters of our own to break, and four fillers to evict with."""
    from transformers import AutoModelForCausalLM

    seed_demo_adapters(store, demo)
    model = AutoModelForCausalLM.from_pretrained(demo["model"]).float()
    for i, name in enumerate(VICTIMS):
        build_peft_adapter(demo["model"], store / name, r=8, alpha=16, target_modules=("q_proj", "v_proj", "o_proj"),
                           seed=50 + i, model=model)
    for i, name in enumerate(FILLERS):
        shutil.copytree(store / ("demo-a", "demo-b")[i % 2], store / name)
    return store


traffic_server = make_triton_server_fixture(adapter_store=fault_store,
                                            engine_config={"max_loras": 4, "max_cpu_loras": 2})
tiny_kv_server = make_triton_server_fixture(engine_config={"num_kv_blocks": TINY_BLOCKS, "max_num_seqs": 16},
                                            scope="function")


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


def greedy(max_tokens: int, lora: str | None = None) -> dict:
    """Sampling parameters of a greedy request that must produce exactly max_tokens tokens."""
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            **({"lora_name": lora} if lora else {})}


def reference(server, demo, tokenizer, prompt: str, lora: str | None, max_tokens: int) -> list[int]:
    """transformers + peft greedy ids for the prompt on the store's copy of the adapter."""
    adapter = f"{server.env['LORAPLEX_ADAPTER_STORE']}/{lora}" if lora else None
    return greedy_tokens(str(demo["model"]), adapter, tokenizer(prompt).input_ids, max_tokens, ignore_eos=True)


def assert_idle(server, num_blocks: int | None = None) -> None:
    """No KV block used, no adapter pin, no running, waiting or swapped sequence, in one scrape."""
    helpers.assert_idle(server, num_blocks, pins=True)


def run_in_background(url: str, jobs: list[StreamJob]) -> tuple[threading.Thread, list]:
    """run_streams on a thread; the list receives the outcomes when it ends."""
    box: list = []
    thread = threading.Thread(target=lambda: box.extend(run_streams(url, jobs, timeout=600)))
    thread.start()
    return thread, box


# ---- 1. cancels and disconnects ------------------------------------------------------------

CANCEL_TENANT = "cancel-faults"
PROMPTS = ("Hello there", "The quick brown fox", "Many tenants share one base model.", "LoRA", "zz top", "def f(x):")
LORAS = (None, "demo-a", "demo-b")
LONG = 960  # the cancelled requests cannot finish before their cancel lands: the demo model allows ~985 (1024 less a prompt)


def close_http_stream_after(server, prompt: str, params: dict, events: int, seen: list) -> None:
    """A generate_stream request whose connection is closed after `events` server-sent events (seen: how many came)."""
    body = {"text_input": prompt, "stream": True, "parameters": {**params, "tenant": CANCEL_TENANT}}
    with requests.post(f"{server.http_url}/v2/models/lora_llm/generate_stream", json=body, stream=True,
                       timeout=120) as r:
        lines = (line for line in r.iter_lines() if line.startswith(b"data: "))
        seen.append((events, sum(1 for _ in zip(range(events), lines))))


def test_cancels_and_disconnects_leave_the_others_exact(traffic_server, demo, tokenizer):
    assert_idle(traffic_server)
    rng = random.Random(8)
    cancelled = set(rng.sample(range(200), 67))
    grpc_jobs, expected, http_closes = [], {}, []
    for i in range(200):
        prompt, lora = rng.choice(PROMPTS), rng.choice(LORAS)
        if i not in cancelled:
            max_tokens = rng.randint(1, 48)
            expected[len(grpc_jobs)] = (prompt, lora, max_tokens)
            grpc_jobs.append(StreamJob(prompt, greedy(max_tokens, lora), CANCEL_TENANT))
        elif rng.random() < 0.5:
            grpc_jobs.append(StreamJob(prompt, greedy(LONG, lora), CANCEL_TENANT, cancel_after=rng.randint(0, 6)))
        else:
            http_closes.append((prompt, greedy(LONG, lora), rng.randint(0, 6)))
    refs = {(p, lora): reference(traffic_server, demo, tokenizer, p, lora, 48) for p in PROMPTS for lora in LORAS}

    seen: list[tuple[int, int]] = []
    threads = [threading.Thread(target=close_http_stream_after, args=(traffic_server, *job, seen))
               for job in http_closes]
    for t in threads:
        t.start()
    outcomes = run_streams(traffic_server.grpc_url, grpc_jobs, timeout=600)
    for t in threads:
        t.join(120)

    for i, (prompt, lora, max_tokens) in expected.items():
        problem = stream_problem(outcomes[i], max_tokens, tokenizer, refs[prompt, lora][:max_tokens])
        assert problem is None, (i, prompt, lora, problem)
    cancels = [(job, out) for job, out in zip(grpc_jobs, outcomes) if job.cancel_after is not None]
    # a cancel that reaches the server after its request ended leaves it ended once, whole: a client starved of CPU
    # reads its first responses late (a loaded 2-core run: 8 of 34). At most half may race; with cancellation
    # broken every one would
    raced = [job for job, out in cancels if out.final_count == 1]
    for job, out in cancels:
        assert out.cancelled and out.error is None
        if out.final_count:
            assert out.num_output_tokens == LONG, out
        else:
            assert out.responses >= job.cancel_after and out.num_output_tokens < LONG
    assert len(raced) <= len(cancels) // 2, f"{len(raced)} of {len(cancels)} cancels landed after their request ended"
    assert len(seen) == len(http_closes) and all(want == got for want, got in seen)
    assert_idle(traffic_server)
    # every request the model saw ended once: completed ones with `length`, cancelled ones with `abort`;
    # a cancel before the first response may reach Triton before the model does (then the model never sees it).
    # An HTTP close can race like a gRPC cancel (its request ended whole first), but its client cannot tell:
    # the `length` count says how many did, and at most half may
    finished = len(expected) + len(raced)
    length = scrape(traffic_server, "loraplex_request_finished_total", tenant=CANCEL_TENANT, finish_reason="length")
    http_raced = length - finished
    assert 0 <= http_raced <= len(http_closes) // 2, f"{http_raced} of {len(http_closes)} HTTP closes raced"
    started = (sum(1 for job, _ in cancels if job.cancel_after) - sum(1 for job in raced if job.cancel_after)
               + sum(1 for _, _, e in http_closes if e) - http_raced)
    aborted = scrape(traffic_server, "loraplex_request_finished_total", tenant=CANCEL_TENANT, finish_reason="abort")
    assert started <= aborted <= len(cancelled) - http_raced
    errors = scrape(traffic_server, "loraplex_request_finished_total", tenant=CANCEL_TENANT, finish_reason="error")
    assert errors is None


# ---- 2. KV exhaustion ------------------------------------------------------------------------

def test_kv_exhaustion_preempts_without_losing_or_repeating_tokens(tiny_kv_server, tokenizer):
    # byte-level prompts of 15-45 tokens and 160-248 new tokens: each sequence needs 11-19 of the 32 blocks, so
    # any three running at once overflow the pool, however far apart the streams start (on a fast machine the
    # old 40-84 tokens ended before the next streams began, and nothing was preempted)
    jobs = [(f"Preempt me {i}: " + "abcdefghij" * (1 + i % 3), LORAS[i % 3], 160 + 8 * i) for i in range(12)]
    assert_idle(tiny_kv_server, TINY_BLOCKS)
    crowd = run_streams(tiny_kv_server.grpc_url, [StreamJob(p, greedy(n, lora), "crowd") for p, lora, n in jobs])
    assert_idle(tiny_kv_server, TINY_BLOCKS)  # first: the metrics published after the last step
    preempted = scrape(tiny_kv_server, "loraplex_preemptions_total")
    assert preempted > 0
    for (prompt, lora, max_tokens), out in zip(jobs, crowd):  # another tenant: no prefix-cache sharing with the crowd
        alone = run_streams(tiny_kv_server.grpc_url, [StreamJob(prompt, greedy(max_tokens, lora), "alone")])[0]
        assert stream_problem(alone, max_tokens, tokenizer) is None
        assert stream_problem(out, max_tokens, tokenizer, alone.token_ids) is None, (prompt, lora)
        assert out.text == alone.text
    assert scrape(tiny_kv_server, "loraplex_preemptions_total") == preempted  # the references ran alone
    assert_idle(tiny_kv_server, TINY_BLOCKS)


# ---- 3. adapters broken on disk ----------------------------------------------------------------

def garble(folder: Path) -> None:
    """Overwrite the adapter's weights with half of them behind a garbage header."""
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 8 + data[8 : len(data) // 2])


def break_adapters(store: Path, garbled: str, deleted: str) -> None:
    """Garble one adapter's weights file and delete another adapter's folder."""
    garble(store / garbled)
    shutil.rmtree(store / deleted)


def wait_until_pinned(server, pins: int) -> None:
    """Until `pins` adapter pins are held: every adapter stream runs with its weights in a slot."""
    assert wait_for_metric(server, "loraplex_adapter_pins", float(pins), timeout=120) == pins


def assert_adapter_error(out: StreamOutcome, name: str, reason: str) -> None:
    """The stream ended with one error that names the adapter and why it cannot be used."""
    assert out.error is not None and out.final_count == 0, out
    assert f"adapter '{name}'" in out.error and reason in out.error, out.error


GARBLED_REASON = "adapter_model.safetensors is not a valid safetensors file"
DELETED_REASON = "directory does not exist"


def assert_deleted_is_unknown(out: StreamOutcome, name: str) -> None:
    """A request arriving after a shared adapter's folder was deleted: the store no longer has the name
    (lookups go to the store, decision 053), so vllm_backend's not-supported error, one final, no tokens."""
    assert out.error is not None and out.final_count == 0 and not out.token_ids, out
    assert f"LoRA {name} is not supported" in out.error, out.error


def test_adapter_broken_on_disk_fails_only_the_requests_that_load_it(traffic_server, demo, tokenizer):
    assert_idle(traffic_server)
    store = Path(traffic_server.env["LORAPLEX_ADAPTER_STORE"])
    garbled, deleted = VICTIMS[:2]
    # 600 tokens and more: every stream still runs when the last victim's cold read is in, so the 6 pins are seen
    # at once (with 120-180-token bystanders a fast machine could end demo-a's before the victims were pinned)
    running = [(f"victim {i}", name, 600) for i, name in enumerate((garbled, garbled, deleted, deleted))]
    bystanders = [(f"bystander {i}", lora, 600 + 20 * i) for i, lora in enumerate((None, "demo-a", "demo-b", None))]
    refs = {job: reference(traffic_server, demo, tokenizer, *job) for job in running + bystanders}
    thread, first = run_in_background(traffic_server.grpc_url, [StreamJob(p, greedy(n, lora), "broken")
                                                                 for p, lora, n in running + bystanders])
    wait_until_pinned(traffic_server, 6)  # 4 victims + 2 bystanders on adapters: 4 slots, all in use
    break_adapters(store, garbled, deleted)
    thread.join(600)
    for job, out in zip(running, first):  # weights already in a slot: they finish (or fail with a clear error)
        if out.error is None:
            assert stream_problem(out, job[2], tokenizer, refs[job]) is None, job
        else:
            assert_adapter_error(out, job[1], GARBLED_REASON if job[1] == garbled else DELETED_REASON)
    for job, out in zip(bystanders, first[len(running):]):
        assert stream_problem(out, job[2], tokenizer, refs[job]) is None, job

    # four fillers take every device slot and the two host slots: the broken adapters must be read from disk again
    evict = run_streams(traffic_server.grpc_url, [StreamJob("evict", greedy(2, f)) for f in FILLERS])
    assert all(stream_problem(out, 2) is None for out in evict)
    again = run_streams(traffic_server.grpc_url, [StreamJob("victim 0", greedy(8, garbled)),
                                                  StreamJob("victim 2", greedy(8, deleted)),
                                                  *(StreamJob(p, greedy(n, lora)) for p, lora, n in bystanders)])
    assert_adapter_error(again[0], garbled, GARBLED_REASON)
    assert_deleted_is_unknown(again[1], deleted)
    for job, out in zip(bystanders, again[2:]):
        assert stream_problem(out, job[2], tokenizer, refs[job]) is None, job
    assert_idle(traffic_server)


def test_new_requests_for_an_adapter_broken_while_resident_get_an_error(traffic_server, tokenizer):
    assert_idle(traffic_server)
    store = Path(traffic_server.env["LORAPLEX_ADAPTER_STORE"])
    garbled, deleted = VICTIMS[2:]
    # 900 tokens: both streams still run when the second one's adapter is in (at 300 the first ended before the
    # second's cold read finished on a loaded CI machine, so two pins were never seen at once)
    thread, first = run_in_background(traffic_server.grpc_url, [
        StreamJob("in use", greedy(900, name), "resident") for name in (garbled, deleted)])
    wait_until_pinned(traffic_server, 2)
    break_adapters(store, garbled, deleted)
    new = run_streams(traffic_server.grpc_url, [StreamJob("new", greedy(8, name), "resident")
                                                for name in (garbled, deleted)])
    thread.join(600)
    assert all(out.error is None or "adapter '" in out.error for out in first)
    assert [out.error is not None for out in new] == [True, True], new
    assert_adapter_error(new[0], garbled, GARBLED_REASON)
    assert_deleted_is_unknown(new[1], deleted)
