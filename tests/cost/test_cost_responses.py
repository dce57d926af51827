"""Cost of what lora_llm's response thread does per request: a non-streamed request's text gathered from its
deltas (one per token), at n and 2n tokens. The thread serves every tenant, so its per-token work is constant."""

from cost_harness import assert_linear
from fake_pb_utils import FakePb


class _Sender:
    def send(self, response, flags=0):
        self.text = response.tensors["text_output"][0]

    def is_cancelled(self):
        return False


def long_non_streamed_output(n: int):
    """n × 4096 deltas of 64 characters, four samples, for one non-streamed request."""
    from loraplex.engine.request import RequestOutput
    from loraplex.triton.parsing import RETURN_FLAGS
    from loraplex.triton.responder import Responder

    steps, samples, piece = n * 4096, 4, "x" * 64
    outputs = [[RequestOutput("r", i, piece, [s], s == steps - 1, "length" if s == steps - 1 else None)
                for i in range(samples)] for s in range(steps)]

    def run():
        responder = Responder(FakePb, abort=lambda _: None, decode_token=str)
        sender = _Sender()
        responder.register("r", sender, False, "prompt", True, dict.fromkeys(RETURN_FLAGS, False), samples)
        for step in outputs:
            responder.push(step)
            responder._serve_once()
        assert len(sender.text) == steps * 64

    return run


def test_a_long_non_streamed_output_is_gathered_in_linear_time():
    assert_linear(long_non_streamed_output, 2, max_seconds=2.0)
