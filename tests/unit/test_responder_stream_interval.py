"""The response thread's `stream_interval`: a stream's responses carry at least that many new tokens,
except its first and its final one; every token still arrives once, in order (no server: fake senders)."""

import pytest
from fake_pb_utils import FINAL, FakePb

from loraplex.config import EngineConfig
from loraplex.engine.request import RequestOutput
from loraplex.triton.parsing import RETURN_FLAGS
from loraplex.triton.responder import Responder

class Sender:
    """Records each response as (text, output token count, final)."""

    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        text = response.tensors["text_output"][0].decode()
        self.sent.append((text, int(response.tensors["num_output_tokens"][0]), flags == FINAL))

    def is_cancelled(self):
        return False


def stream(interval: int, steps: int, stream: bool = True) -> list:
    """One request of `steps` one-token deltas, each step handed to the responder on its own."""
    responder = Responder(FakePb, abort=lambda _: None, decode_token=str, stream_interval=interval)
    sender = Sender()
    returns = dict.fromkeys(RETURN_FLAGS, False) | {"return_num_output_tokens": True}
    responder.register("r", sender, stream, "prompt", True, returns, 1)
    for i in range(steps):
        last = i == steps - 1
        responder.push([RequestOutput("r", 0, f"t{i} ", [i], last, "length" if last else None)])
        responder._serve_once()
    assert not responder.pending  # the final response ended it
    return sender.sent


@pytest.mark.parametrize("interval", [1, 2, 4, 7])
def test_a_stream_sends_every_interval_tokens_after_the_first(interval):
    sent = stream(interval, steps=12)
    counts = [n for _, n, _ in sent]
    assert counts[0] == 1  # the first token at once (time to first token)
    assert all(n == interval for n in counts[1:-1])
    assert 1 <= counts[-1] <= interval and sent[-1][2] and not any(final for *_, final in sent[:-1])
    assert "".join(text for text, _, _ in sent) == "".join(f"t{i} " for i in range(12))
    assert sum(counts) == 12


def test_a_request_that_does_not_stream_gets_one_final_response_whatever_the_interval():
    assert stream(4, steps=5, stream=False) == [("".join(f"t{i} " for i in range(5)), 5, True)]


def test_the_interval_is_a_checked_engine_knob():
    assert EngineConfig().stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        EngineConfig(stream_interval=0)
