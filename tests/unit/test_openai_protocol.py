"""The OpenAI gateway's pure parts: request -> sampling_parameters, error mapping, logprobs, chat rendering."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from loraplex.openai.app import identity_headers
from loraplex.openai.chat import ChatRenderer
from loraplex.openai.errors import OpenAIError, from_triton
from loraplex.openai.protocol import (ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                      completion_logprobs)
from loraplex.openai.responses import Tally
from loraplex.openai.triton_stream import Delta, TritonClient, visible_names
from loraplex.exceptions import AUTH_ERROR
from loraplex.launch.tritonserver import free_ports

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("message, status, code", [
    (AUTH_ERROR, 401, "invalid_api_key"),
    ("LoRA nope is not supported, we currently support ['demo-a']", 404, "model_not_found"),
    ("tenant quota exceeded: tokens_per_minute=40 ...; retry later", 429, "rate_limit_exceeded"),
    ("server overloaded: 9 requests are waiting (max_waiting_requests=8); retry later", 503, "service_unavailable"),
    ("the model is shutting down; retry on another replica", 503, "service_unavailable"),
    ("Stub process 'lora_llm_0_0' is not healthy.", 503, "service_unavailable"),
    ("prompt has 5 tokens and max_tokens is 5000: 5005 exceeds the model's max length 1024", 400, None),
])
def test_triton_messages_map_to_openai_statuses(message, status, code):
    error = from_triton(message)
    assert (error.status, error.code) == (status, code)
    assert error.body() == {"error": {"message": message, "type": error.type, "param": error.param, "code": code}}


def test_visible_adapters_are_the_callers_uploads_and_the_shared_ones_sorted():
    result = {"adapters": [{"name": "own-b", "version": "1"}, {"name": "a", "version": "2"}],
              "shared": ["demo-a", "a"]}
    assert visible_names(result) == ["a", "demo-a", "own-b"]
    assert visible_names({"adapters": []}) == []


@pytest.mark.parametrize("status, seconds", [(429, "2"), (503, "1"), (400, None), (500, None)])
def test_retry_after_on_429_and_503(status, seconds):
    assert OpenAIError(status, "x").headers() == ({"Retry-After": seconds} if seconds else {})


def test_completion_fields_become_sampling_parameters():
    req = CompletionRequest(model="demo-a", prompt="Hi", temperature=0, top_p=0.5, n=2, stop="\n", seed=3,
                            logprobs=2, ignore_eos=True, top_k=5, min_tokens=1, stop_token_ids=[2])
    assert req.sampling_parameters() == {"max_tokens": 16, "temperature": 0, "top_p": 0.5, "seed": 3,
                                         "ignore_eos": True, "top_k": 5, "min_tokens": 1, "stop_token_ids": [2],
                                         "n": 2, "stop": ["\n"], "logprobs": 2}
    assert CompletionRequest(prompt=["a", "b"], max_tokens=4).prompts() == ["a", "b"]
    assert CompletionRequest(prompt="a", max_tokens=4).sampling_parameters() == {"max_tokens": 4}


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"1": 2}}, "logit_bias"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_completion_fields_are_refused_by_name(fields, param):
    with pytest.raises(OpenAIError) as e:
        CompletionRequest(prompt="Hi", **fields).sampling_parameters()
    assert (e.value.status, e.value.param) == (400, param)


def test_token_id_prompts_are_refused():
    with pytest.raises(OpenAIError) as e:
        CompletionRequest(prompt=[1, 2, 3]).prompts()
    assert e.value.param == "prompt" and "text" in e.value.message


def test_chat_fields_become_sampling_parameters():
    req = ChatCompletionRequest(messages=MESSAGES, max_tokens=9, max_completion_tokens=5, logprobs=True,
                                top_logprobs=3, presence_penalty=0)
    assert req.sampling_parameters(None) == {"max_tokens": 5, "logprobs": 3}
    assert ChatCompletionRequest(messages=MESSAGES).sampling_parameters(100) == {"max_tokens": 100}
    for fields, param in (({"tools": [{"type": "function"}]}, "tools"), ({"top_logprobs": 2}, "top_logprobs"),
                          ({"response_format": {"type": "xml"}}, "response_format")):
        with pytest.raises(OpenAIError) as e:
            ChatCompletionRequest(messages=MESSAGES, **fields).sampling_parameters(16)
        assert e.value.param == param


def test_text_parts_are_joined_and_other_parts_refused():
    msg = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}]).messages[0]
    assert msg.as_template_input() == {"role": "user", "content": "ab"}
    image = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]).messages[0]
    with pytest.raises(OpenAIError):
        image.as_template_input()


# lora_llm's per-token logprobs: the chosen token first, then the top candidates by rank.
ENTRIES = [{"10": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
            "11": {"logprob": -2.0, "rank": 2, "decoded_token": "b"}},
           {"12": {"logprob": -3.0, "rank": 3, "decoded_token": "\ufffd"},
            "13": {"logprob": -0.5, "rank": 1, "decoded_token": "\ufffd"},
            "14": {"logprob": -1.0, "rank": 2, "decoded_token": "c"}}]


def test_completion_and_chat_logprobs():
    out = completion_logprobs(ENTRIES, 2, offset=3)
    assert out["tokens"] == ["a", "\ufffd"] and out["token_logprobs"] == [-0.1, -3.0]
    assert out["top_logprobs"] == [{"a": -0.1, "b": -2.0}, {"\ufffd": -0.5, "c": -1.0}]
    assert out["text_offset"] == [3, 4]
    chat = chat_logprobs(ENTRIES, 1)
    assert chat[0] == {"token": "a", "logprob": -0.1, "bytes": [97],
                       "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}
    assert chat[1]["top_logprobs"][0]["logprob"] == -0.5 and chat[1]["bytes"] == [239, 191, 189]


def test_tally_counts_each_choice_and_finishes_once():
    tally = Tally(num_prompts=2, n=2)
    first = tally.add(1, Delta(["x", ""], [1, 0], [None, None], num_input_tokens=4))
    assert [(c.index, c.text) for c in first] == [(2, "x")]
    tally.add(1, Delta(["y", "z"], [1, 1], ["length", "stop"], num_input_tokens=4))
    again = tally.add(1, Delta(["", ""], [0, 0], ["length", "stop"], num_input_tokens=4))
    assert again == [] and tally.texts[2:] == ["xy", "z"] and tally.finish[2:] == ["length", "stop"]
    tally.add(0, Delta(["q", "r"], [1, 1], ["length", "length"], num_input_tokens=2))
    assert tally.usage() == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}


def test_delta_from_outputs_decodes_finish_and_logprobs():
    delta = Delta.from_outputs({"text_output": ["a", "b"], "finish_reason": ["None", "stop"],
                                "num_output_tokens": [1, 2], "num_input_tokens": [7],
                                "logprobs": [json.dumps(ENTRIES[:1]), "null"]})
    assert (delta.finish_reasons, delta.num_input_tokens, delta.num_output_tokens) == ([None, "stop"], 7, [1, 2])
    assert delta.logprobs == [ENTRIES[:1], []]


def _request(headers: dict) -> Request:
    return Request({"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})


def test_bearer_key_and_tenant_header_travel_to_triton():
    assert identity_headers(_request({"authorization": "Bearer sk-1", "x-tenant-id": "acme"})) == {
        "x-api-key": "sk-1", "x-tenant-id": "acme"}
    assert identity_headers(_request({"authorization": "Basic abc"})) == {}
    assert identity_headers(_request({"x-api-key": "k"})) == {"x-api-key": "k"}


def test_chat_template_renders_with_one_bos(demo, tmp_path):
    renderer = ChatRenderer(demo["model"])
    text = renderer.render(MESSAGES)
    assert not text.startswith("<s>") and text.endswith("<|assistant|>\n")
    assert renderer.tokenizer(text).input_ids.count(renderer.tokenizer.bos_token_id) == 1
    from loraplex.models.builtin.demo import build_byte_tokenizer

    build_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(OpenAIError) as e:
        ChatRenderer(tmp_path).render(MESSAGES)
    assert e.value.status == 400 and "no chat template" in e.value.message


def test_an_unreachable_triton_is_503():
    (port,) = free_ports(1)

    async def run():
        client = TritonClient(f"127.0.0.1:{port}")
        try:
            assert not await client.ready()
            async for _ in client.generate("Hi", {"max_tokens": 1}, {}):
                pass
        finally:
            await client.close()

    with pytest.raises(OpenAIError) as e:
        asyncio.run(run())
    assert e.value.status == 503 and "unreachable" in e.value.message
    assert str(port) not in e.value.message and "127.0.0.1" not in e.value.message  # no internal address
