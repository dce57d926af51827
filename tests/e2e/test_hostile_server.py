"""Hostile input through a real tritonserver (gRPC streaming, HTTP generate and generate_stream).

Hypothesis draws batches of hostile requests (tests/support/hostile.py). They are fired at once
while good greedy streams run. Invariants: every hostile request ends with exactly one
final response (a result or a clear error) within a bound and nothing after it; the
good streams equal transformers + peft token for token; afterwards the KV pool, the
waiting queue and the running batch are back to idle.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import TRITON_RESERVED_REQUEST_PARAMS
from helpers import assert_idle, sse_events, token_ids_of
from hostile import MEGABYTE_PROMPT, PROMPTS, sampling_parameters
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from peft_reference import greedy_tokens
from tritonserver_fixture import make_triton_server_fixture

from loraplex.clients.generate import stream_generate

BOUND_S = 90.0  # every request ends within this (generous: 2 shared cores)
GOOD = [("Good streams stay exact", None), ("Another tenant's stream", "demo-a")]
GOOD_TOKENS = 100  # of max_model_len 128 (24-token prompts): the good streams outlast the hostile batch's sending

triton_server = make_triton_server_fixture(engine_config={"max_model_len": 128, "max_n": 4})
# No shrinking: each example is a batch against a live server (minutes to shrink); the report shows the batch.
FUZZ = settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                phases=(Phase.generate,))


@pytest.fixture(scope="module")
def references(demo, triton_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo["model"])
    return {(p, lora): greedy_tokens(str(demo["model"]), str(demo[lora]) if lora else None, tok(p).input_ids,
                                     GOOD_TOKENS, ignore_eos=True) for p, lora in GOOD}


class GoodStreams:
    """Greedy streams started before a hostile batch and checked against peft after it."""

    def __init__(self, server, references):
        self.server, self.references, self.results = server, references, {}
        self.threads = [threading.Thread(target=self._run, args=job) for job in GOOD]
        self.first_token = {job: threading.Event() for job in GOOD}
        self.ended = {job: threading.Event() for job in GOOD}

    def _run(self, prompt, lora):
        params = {"max_tokens": GOOD_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                  **({"lora_name": lora} if lora else {})}
        try:
            self.results[prompt, lora] = stream_generate(
                self.server.grpc_url, prompt, params, return_logprobs=True, headers={"x-tenant-id": "good"},
                on_response=lambda _: self.first_token[prompt, lora].set())
        finally:
            self.ended[prompt, lora].set()

    def running(self) -> bool:
        """Wait until every good stream has its first token; then whether one of them is still unfinished."""
        deadline = time.monotonic() + BOUND_S
        started = all(e.wait(max(deadline - time.monotonic(), 0)) for e in self.first_token.values())
        return started and not all(e.is_set() for e in self.ended.values())

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        for t in self.threads:
            t.join(BOUND_S)
        if exc[0] is None:
            for key, result in self.results.items():
                assert result.error is None and result.final_count == 1, (key, result.error)
                assert token_ids_of(result) == self.references[key], key
            assert len(self.results) == len(GOOD)


def grpc_parameter(value):
    """What tritonclient can carry as a request parameter (bool, int64, UTF-8 str); anything else as JSON text."""
    if isinstance(value, str):
        return value if value.encode("utf-8", "surrogatepass").decode("utf-8", "ignore") == value else json.dumps(value)
    if isinstance(value, bool) or (isinstance(value, int) and -(2**63) <= value < 2**63):
        return value
    return json.dumps(value)


def grpc_events(url: str, prompt: bytes, sampling, parameters: dict, stream: bool) -> list:
    """Send one request on its own stream; return every event it got: ("data"|"final"|"error", ...)."""
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([stream]))
    if sampling is not None:
        inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    seen = []
    try:
        client.async_stream_infer("lora_llm", inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True,
                                  parameters={k: grpc_parameter(v) for k, v in parameters.items()
                                              if k not in TRITON_RESERVED_REQUEST_PARAMS})  # the client refuses those
        deadline = time.monotonic() + BOUND_S
        while not seen or seen[-1][0] == "data":
            result, error = events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if error is not None:
                seen.append(("error", error.message()))
            elif result.get_response().parameters["triton_final_response"].bool_param:
                seen.append(("final", None))
            else:
                seen.append(("data", None))
    finally:
        client.stop_stream()  # returns once the server ended the stream: whatever followed the final has arrived
        client.close()
    while not events.empty():
        seen.append(("extra", events.get()))
    return seen


def fire(jobs, send) -> list:
    """Run send(*job) for every job at once; their results in order."""
    results = [None] * len(jobs)

    def run(i, job):
        try:
            results[i] = send(*job)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S + 30)
    return results


HOSTILE_BATCH = st.lists(st.tuples(PROMPTS, st.none() | sampling_parameters(), sampling_parameters(), st.booleans()),
                         min_size=4, max_size=16)


@FUZZ
@given(batch=HOSTILE_BATCH)
def test_hostile_grpc_requests_end_once_and_disturb_nothing(triton_server, references, batch):
    with GoodStreams(triton_server, references) as good:
        assert good.running()  # the good streams are running when the hostile batch lands
        results = fire(batch, lambda *job: grpc_events(triton_server.grpc_url, *job))
    for job, seen in zip(batch, results):
        assert isinstance(seen, list), (job, seen)
        assert [kind for kind, _ in seen].count("data") == len(seen) - 1, (job, seen)  # one terminal event, last
        if seen[-1][0] == "error":
            assert seen[-1][1] and "Traceback" not in seen[-1][1], (job, seen)
    assert_idle(triton_server)


def http_call(server, prompt: bytes, sampling, parameters: dict, stream: bool):
    """POST a hostile body to generate or generate_stream; (status, parsed events or body)."""
    body = {"text_input": prompt.decode("utf-8", "surrogateescape"), "parameters": parameters}
    if sampling is not None:
        body["sampling_parameters"] = json.dumps(sampling)
    if stream:
        body["stream"] = True
    endpoint = "generate_stream" if stream else "generate"
    r = requests.post(f"{server.http_url}/v2/models/lora_llm/{endpoint}", data=json.dumps(body).encode(),
                      timeout=BOUND_S)
    events = r.headers.get("content-type", "").startswith("text/event-stream")  # generate_stream, even on 400
    return r.status_code, sse_events(r) if events else r.json()


@FUZZ
@given(batch=HOSTILE_BATCH)
def test_hostile_http_requests_end_once_and_disturb_nothing(triton_server, references, batch):
    with GoodStreams(triton_server, references) as good:
        assert good.running()
        results = fire(batch, lambda *job: http_call(triton_server, *job))
    for job, result in zip(batch, results):
        assert isinstance(result, tuple), (job, result)
        status, answer = result
        if isinstance(answer, dict):  # generate, or a refused generate_stream
            assert ("error" in answer) == (status != 200) and ("text_output" in answer or "error" in answer), (job, result)
        else:  # server-sent events: data, then at most one error, last
            errors = [i for i, e in enumerate(answer) if "error" in e]
            assert answer and errors in ([], [len(answer) - 1]) and (status != 200) == (errors == [0]), (job, result)
    assert_idle(triton_server)


def test_a_megabyte_prompt_is_refused_over_grpc_and_http(triton_server):
    seen = grpc_events(triton_server.grpc_url, MEGABYTE_PROMPT, {"max_tokens": 4}, {}, True)
    refused = "text_input is 1048576 bytes; at most 640 are accepted (max_prompt_bytes)"  # 128 tokens x 5 bytes
    assert seen == [("error", refused)] or (len(seen) == 1 and refused in seen[0][1]), seen
    status, answer = http_call(triton_server, MEGABYTE_PROMPT, None, {"max_tokens": 4}, False)
    assert status == 400 and refused in answer["error"]
    assert_idle(triton_server)


def test_request_parameters_over_their_bound_are_refused_unparsed_and_the_server_serves_on(triton_server):
    from loraplex.triton.parsing import MAX_REQUEST_PARAMETERS_CHARS

    body = {"text_input": "hi", "junk": "x" * (MAX_REQUEST_PARAMETERS_CHARS + 1)}  # generate: other keys are parameters
    answer = requests.post(f"{triton_server.http_url}/v2/models/lora_llm/generate", json=body, timeout=BOUND_S)
    assert answer.status_code == 400
    assert answer.json()["error"] == f"the request's parameters are over {MAX_REQUEST_PARAMETERS_CHARS} characters"
    result = stream_generate(triton_server.grpc_url, "still here", {"max_tokens": 2, "ignore_eos": True})
    assert result.error is None and result.final_count == 1
    assert_idle(triton_server)
