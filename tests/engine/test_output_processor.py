"""The output processor: detokenization and stop strings off the loop thread, each request ending once.

A served engine detokenizes on its own thread; a stop string ends the sample there and
tells the loop, which may have computed a token or two more by then: those must never
reach the client. Inline (``LLMEngine.step``) and threaded engines must give the same
outputs, and afterwards every block and pin is back.
"""

from __future__ import annotations

import queue
import time

import pytest
from test_containment import GOOD, MAX_TOKENS, assert_idle, collect, engine_factory, reference, request, run  # noqa: F401


def full_text(engine, prompt: str, lora: str | None) -> tuple[str, list[int]]:
    """The request's whole greedy text and tokens, without stop strings (inline)."""
    engine.add_request(request(engine, "whole", prompt, lora))
    outs = run(engine, {})["whole"]
    return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids]


def served(engine, requests: list, num_finals: int) -> dict:
    """Run requests on the loop thread (outputs from the output processor's thread), until idle."""
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    engine.on_outputs = lambda outs: [delivered.put(o) for o in outs]
    engine.start()
    try:
        for r in requests:
            engine.add_request(r)
        outputs = collect(delivered, num_finals)
        deadline = time.monotonic() + 30
        while engine.has_work() and time.monotonic() < deadline:  # the loop ends stopped samples next step
            time.sleep(0.01)
    finally:
        engine.stop()  # joins the loop, then the output thread once it delivered all the loop handed it
    while not delivered.empty():  # nothing may follow a request's final output
        out = delivered.get()
        outputs.setdefault(out.request_id, []).append(out)
    return outputs


def stop_in(text: str) -> tuple[str, int]:
    """A stop string from the middle of text that does not occur earlier, and where it starts."""
    for start in range(len(text) // 3, len(text) - 3):
        stop = text[start:start + 3]
        if text.find(stop) == start and stop.strip():
            return stop, start
    pytest.skip("no usable stop string in the greedy text")


@pytest.mark.parametrize("threaded", [False, True])
def test_a_stop_string_ends_its_sample_once_with_the_text_cut_before_it(engine_factory, threaded):
    engine = engine_factory()
    prompt, lora = GOOD[1]
    text, tokens = full_text(engine, prompt, lora)
    stop, at = stop_in(text)
    requests = [request(engine, "stopped", prompt, lora, stop=[stop])]
    others = [request(engine, f"g{i}", p, a) for i, (p, a) in enumerate(GOOD)]
    if threaded:
        outputs = served(engine, requests + others, 1 + len(others))
    else:
        for r in requests + others:
            engine.add_request(r)
        outputs = run(engine, {})
    outs = outputs["stopped"]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True] and outs[-1].error is None
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == text[:at]
    sent = [t for o in outs for t in o.token_ids]
    assert sent == tokens[:len(sent)] and len(sent) < len(tokens)  # the tokens computed after the stop are dropped
    assert engine.tokenizer.decode(sent).find(stop) != -1  # ...and the last one sent completed the stop string
    for i, _ in enumerate(GOOD):
        assert "".join(o.text for o in outputs[f"g{i}"]) or outputs[f"g{i}"][-1].finished
        assert [o.finished for o in outputs[f"g{i}"]].count(True) == 1
    assert_idle(engine)
    assert engine.finished_requests.get(("default", "stop")) == 1


def test_a_stop_string_on_the_last_token_counts_its_request_as_a_stop(engine_factory):
    # the loop ends the request by its length; the same token completes the stop string, so the final output
    # says "stop", and request_finished_total must say so too
    engine = engine_factory()
    prompt, lora = GOOD[1]
    text, _ = full_text(engine, prompt, lora)
    stop = next(text[-k:] for k in range(3, len(text)) if text.find(text[-k:]) == len(text) - k and text[-k:].strip())
    engine.add_request(request(engine, "last", prompt, lora, stop=[stop]))  # as many tokens as the whole text
    outs = run(engine, {})["last"]
    assert outs[-1].finish_reason == "stop" and [o.finished for o in outs].count(True) == 1
    assert engine.finished_requests == {("default", "length"): 1, ("default", "stop"): 1}  # "whole", then "last"
    assert_idle(engine)


def test_a_stop_string_the_output_thread_finds_after_the_loop_ended_the_request_counts_as_a_stop(engine_factory):
    # the loop runs ahead of the output processor: it ends the request by its length a step before the
    # processor reaches the token that completes the stop string
    engine = engine_factory()
    prompt, lora = GOOD[1]
    text, _ = full_text(engine, prompt, lora)
    stop, _ = stop_in(text)
    engine.add_request(request(engine, "probe", prompt, lora, stop=[stop]))
    probe = run(engine, {})["probe"]
    assert probe[-1].finish_reason == "stop"
    stops_after = sum(len(o.token_ids) for o in probe)  # tokens until the stop string is complete
    engine.add_request(request(engine, "late", prompt, lora, stop=[stop], max_tokens=stops_after + 1))
    pending, outs = [], []
    while engine.has_work():
        pending.append(engine.step_events())
        if len(pending) > 1:  # the processor one step behind
            outs += engine.processor.process(pending.pop(0))
    outs += [o for events in pending for o in engine.processor.process(events)]
    run(engine, {})  # the loop takes the processor's messages
    assert outs[-1].finish_reason == "stop" and [o.finished for o in outs].count(True) == 1
    assert engine.finished_requests == {("default", "length"): 1, ("default", "stop"): 2}  # whole; probe, late
    assert_idle(engine)


def test_a_stop_string_before_min_tokens_is_not_matched(engine_factory):
    engine = engine_factory()
    prompt, lora = GOOD[2]
    text, _ = full_text(engine, prompt, lora)
    stop = text[:2] if text[:2].strip() else text[1:3]
    engine.add_request(request(engine, "early", prompt, lora, stop=[stop], min_tokens=MAX_TOKENS))
    outs = run(engine, {})["early"]
    assert outs[-1].finish_reason == "length" and "".join(o.text for o in outs) == text
    assert_idle(engine)


def test_every_sample_of_n_stops_and_the_request_ends_once(engine_factory):
    engine = engine_factory()
    prompt, lora = GOOD[3]
    text, _ = full_text(engine, prompt, lora)
    stop, at = stop_in(text)
    outputs = served(engine, [request(engine, "n2", prompt, lora, stop=[stop], n=2)], 2)
    outs = outputs["n2"]
    for index in (0, 1):  # greedy: both samples are the same text, each stopped once
        mine = [o for o in outs if o.index == index]
        assert [o.finished for o in mine].count(True) == 1 and mine[-1].finished
        assert "".join(o.text for o in mine) == text[:at] and mine[-1].finish_reason == "stop"
    assert_idle(engine)


def test_a_detokenizer_failure_on_the_output_thread_fails_only_its_request(engine_factory, reference):
    engine = engine_factory()
    real = engine.processor._output

    def planted(seq, sample, token, *args):
        if seq.request.request_id == "broken" and sample.sent_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted output failure")
        return real(seq, sample, token, *args)

    engine.processor._output = planted
    requests = [request(engine, "broken", "detokenizer breaks", "demo-a")]
    requests += [request(engine, f"g{i}", p, a) for i, (p, a) in enumerate(GOOD)]
    outputs = served(engine, requests, len(requests))
    outs = outputs["broken"]
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert "planted output failure" in str(outs[-1].error) and all(o.error is None for o in outs[:-1])
    for i, (p, a) in enumerate(GOOD):
        assert [t for o in outputs[f"g{i}"] for t in o.token_ids] == reference(engine, p, a)
    assert_idle(engine)
