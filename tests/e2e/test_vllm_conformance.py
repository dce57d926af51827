"""What Triton vllm_backend's own CI clients rely on, checked against lora_llm (our tests, their contract).

The contract comes from vllm_backend's `ci/L0_additional_outputs_vllm/additional_outputs_test.py`,
`ci/L0_backend_vllm/enabled_stream/enabled_stream_test.py`, `vllm_backend/vllm_backend_test.py`
and `L0_multi_gpu_vllm/multi_lora/multi_lora_test.py`: the same requests, the same
assertions on outputs, and their error texts word for word. Model-quality checks
(their output "is a sentence") do not apply to the random demo model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException
from tritonserver_fixture import make_triton_server_fixture

# Metrics off in the server, as many deployments run it: the model must serve just the same
# (vllm_backend's CI runs its models so too); every test of this module shows it does.
triton_server = make_triton_server_fixture(extra_args=["--allow-metrics=false"])

SAMPLING = {"temperature": "0", "top_p": "1"}  # as their clients send it: values as strings
PROMPT = "In this example,"
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
         "return_num_output_tokens")
STREAM_ECHO_ERROR = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


def vllm_inputs(module, prompt, stream, sampling=None, exclude_input_in_output=None, **flags):
    """The tensors vllm_backend's test_util.create_vllm_request and additional_outputs_test build."""
    def tensor(name, value, dtype):
        t = module.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
        return t

    inputs = [tensor("text_input", prompt.encode("utf-8"), "BYTES"), tensor("stream", stream, "BOOL")]
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", json.dumps(sampling).encode("utf-8"), "BYTES"))
    if exclude_input_in_output is not None:
        inputs.append(tensor("exclude_input_in_output", exclude_input_in_output, "BOOL"))
    for name, value in flags.items():
        if value is not None:
            inputs.append(tensor(name, value, "BOOL"))
    return inputs


def infer(server, inputs, parameters) -> list:
    """One request over a gRPC stream, as their _llm_infer: every (result, error) until stop_stream."""
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(lambda result, error: responses.put((result, error)))
        client.async_stream_infer("lora_llm", inputs=inputs, parameters=parameters)
        client.stop_stream()  # waits for the request to complete
    return list(responses.queue)


FLAG_CASES = [dict.fromkeys(FLAGS), dict.fromkeys(FLAGS, True), dict.fromkeys(FLAGS, False)] + [
    {**dict.fromkeys(FLAGS), flag: True} for flag in FLAGS]


@pytest.mark.parametrize("stream, logprobs, flags", [
    (stream, logprobs, flags) for stream, logprobs, flags in itertools.product((True, False), (None, 0, 2), FLAG_CASES)
])
def test_additional_outputs(triton_server, tokenizer, stream, logprobs, flags):
    sampling = {**SAMPLING, **({} if logprobs is None else {"logprobs": logprobs})}
    responses = infer(triton_server, vllm_inputs(grpcclient, PROMPT, stream, sampling, **flags), sampling)
    assert responses and all(error is None for _, error in responses)
    results = [result for result, _ in responses]
    if not stream:
        assert len(results) == 1
    texts = [r.as_numpy("text_output")[0].decode("utf-8") for r in results]
    for i, r in enumerate(results):  # each optional output only when its flag is true
        for flag in FLAGS:
            assert (r.as_numpy(flag[len("return_"):]) is not None) == bool(flags[flag]), flag
        if flags["return_finish_reason"]:
            assert r.as_numpy("finish_reason")[0].decode() == ("length" if i == len(results) - 1 else "None")
        if flags["return_num_input_tokens"]:
            assert int(r.as_numpy("num_input_tokens")[0]) == len(tokenizer(PROMPT).input_ids)
        if flags["return_num_output_tokens"]:
            assert int(r.as_numpy("num_output_tokens")[0]) > 0
    if flags["return_cumulative_logprob"]:
        cumulative = [float(r.as_numpy("cumulative_logprob")[0]) for r in results]
        assert all(a != b for a, b in zip([0.0] + cumulative, cumulative))  # changes with every response
    if flags["return_logprobs"]:
        chosen = []
        for r in results:
            entries = json.loads(r.as_numpy("logprobs")[0].decode("utf-8"))
            if logprobs is None:
                assert entries is None
                continue
            assert isinstance(entries, list) and entries
            if flags["return_num_output_tokens"]:
                assert len(entries) == int(r.as_numpy("num_output_tokens")[0])
            for entry in entries:
                assert 1 <= len(entry) <= logprobs + 1
                ranks = [d["rank"] for d in entry.values()]
                assert ranks.count(1) == 1
                for token_id, d in entry.items():
                    assert isinstance(token_id, str) and set(d) == {"logprob", "rank", "decoded_token"}
                    assert isinstance(d["logprob"], float) and isinstance(d["rank"], int)
                    assert d["decoded_token"] == tokenizer.decode([int(token_id)])
                chosen.append(int(next(t for t, d in entry.items() if d["rank"] == 1)))
        if logprobs is not None:  # the rank-1 tokens are the output (+ the prompt when not streaming)
            assert ("" if stream else PROMPT) + tokenizer.decode(chosen) == "".join(texts)
    if not stream:
        assert texts[0].startswith(PROMPT)


def run_async(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


async def aio_stream(server, prompts, exclude_input_in_output=None) -> list:
    """enabled_stream_test: several prompts on one async stream; every (result, error)."""
    async with aioclient.InferenceServerClient(url=server.grpc_url) as client:
        async def requests():
            for i, prompt in enumerate(prompts):
                yield {"model_name": "lora_llm", "inputs": vllm_inputs(aioclient, prompt, True, SAMPLING,
                                                                       exclude_input_in_output),
                       "request_id": str(i), "parameters": SAMPLING}

        return [item async for item in client.stream_infer(inputs_iterator=requests())]


def test_enabled_stream_with_two_prompts_streams_deltas(triton_server):
    prompts = ["The most dangerous animal is", "The future of AI is"]
    responses = run_async(aio_stream(triton_server, prompts))
    assert responses and all(error is None for _, error in responses)
    per_request: dict[str, str] = {}
    for result, _ in responses:
        request_id = result.get_response().id
        per_request[request_id] = per_request.get(request_id, "") + result.as_numpy("text_output")[0].decode()
    assert sorted(per_request) == ["0", "1"]
    for i, prompt in enumerate(prompts):  # deltas: no prompt echo, and they add up to the non-streamed text
        whole = infer(triton_server, vllm_inputs(grpcclient, prompt, False, SAMPLING, True), SAMPLING)
        assert per_request[str(i)] == whole[0][0].as_numpy("text_output")[0].decode()


def test_streaming_with_exclude_input_false_is_their_exact_error(triton_server):
    responses = run_async(aio_stream(triton_server, ["The most dangerous animal is"], exclude_input_in_output=False))
    (result, error), = responses
    assert result is None and isinstance(error, InferenceServerException)
    assert error.message() == STREAM_ECHO_ERROR


def test_unknown_lora_is_their_exact_error(triton_server):
    sampling = {**SAMPLING, "lora_name": "bogus"}
    (result, error), = infer(triton_server, vllm_inputs(grpcclient, PROMPT, False, sampling), SAMPLING)
    assert str(error.message()) == "LoRA bogus is not supported, we currently support ['demo-a', 'demo-b']"


def test_parameters_as_request_parameters_and_echo_rules(triton_server):
    """vllm_backend_test: sampling keys only as request parameters; echo unless exclude_input_in_output."""
    plain = infer(triton_server, vllm_inputs(grpcclient, "The capital of France is", False), SAMPLING)
    excluded = infer(triton_server, vllm_inputs(grpcclient, "The capital of France is", False,
                                                exclude_input_in_output=True), SAMPLING)
    text = plain[0][0].as_numpy("text_output")[0].decode()
    diff = excluded[0][0].as_numpy("text_output")[0].decode()
    assert text == "The capital of France is" + diff and diff


def test_the_server_serves_no_metrics_and_the_model_still_generates(triton_server):
    import requests

    with pytest.raises(requests.ConnectionError):
        requests.get(triton_server.metrics_url, timeout=5)
    responses = infer(triton_server, vllm_inputs(grpcclient, PROMPT, False, SAMPLING), SAMPLING)
    assert len(responses) == 1 and responses[0][1] is None and responses[0][0].as_numpy("text_output")[0]


STRUCTURED_PROMPTS = ["Classify intent of the sentence: Harry Potter is underrated. ",
                      "Classify intent of the sentence: Pizza is the best food. "]


def test_structured_outputs_as_their_accuracy_test_sends_them(triton_server):
    # ci/L0_backend_vllm/accuracy_test: SAMPLING_PARAMETERS plus structured_outputs as a JSON string of a
    # choice, in the sampling_parameters tensor and the request parameters alike, not streamed
    sampling = {**SAMPLING, "structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})}
    for prompt in STRUCTURED_PROMPTS:
        responses = infer(triton_server, vllm_inputs(grpcclient, prompt, False, sampling), sampling)
        assert [error for _, error in responses] == [None]
        text = responses[0][0].as_numpy("text_output")[0].decode()
        assert text in (prompt + "Positive", prompt + "Negative")  # echoed prompt, then one of the choices


@pytest.mark.parametrize("constraint, named", [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}, "json"),
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"structured_outputs": {"choice": []}}, "choice"),
])
def test_a_bad_constraint_is_invalid_arg_naming_it(triton_server, constraint, named):
    sampling = {**SAMPLING, **constraint}
    responses = infer(triton_server, vllm_inputs(grpcclient, PROMPT, False, sampling), {})
    ((_, error),) = responses
    assert isinstance(error, InferenceServerException)  # a stream's error carries its text, not a status
    assert error.message().startswith("structured_outputs") and named in error.message()
