"""Detokenization, stop strings and output deltas, off the engine loop (vLLM v1's output processor).

The loop hands over each step's events: a token delta per sequence that got a token or
ended, ``(seq, token | None, finish reason | None, cumulative logprob, top logprobs | None)``,
and an ``ErrorEvent`` per request that failed. This turns them into ``RequestOutput``s.
In a served engine it runs on its own thread, so the loop's next step starts while the
last one's text is still being made; ``LLMEngine.step`` runs it inline instead.

The text side of each request is this processor's own state (``_RequestText``, one ``_SampleText``
per sample), made at a request's first event and dropped with its final output; the loop's
records carry none of it. The one thing the loop reads back is ``Request.final_reason``, the
finish reason the final output carried.

A stop string ends its sample here, at once: the final output goes out with the text cut
before the stop, and the loop is told to end the sequence (``stop_sequence``). The loop
may have computed a token or two more by then; they are dropped, as in vLLM v1. A sample
whose detokenization raises fails its request through the loop (``fail_request``), which
sends the one error output. Whatever arrives for a sample or request after its final
output is dropped, so each request still ends exactly once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.request import FinishReason, Request, RequestOutput, Sequence

log = logging.getLogger("loraplex.outputs")

STOP = FinishReason.STOP.value
CHUNK = 16  # events processed between GIL hand-backs: small, so the loop never waits long for the GIL
MAX_DEFER_SECONDS = 0.005  # the longest a chunk waits for the loop to be quiet


# A token event: (seq, token | None, finish reason | None, cumulative logprob, top logprobs | None). One is
# made per running sequence a step, so it stays a plain tuple, the cheapest object Python builds
# (decision 047); a failed request's event is an ErrorEvent instead.
TokenEvent = tuple


@dataclass(slots=True)
class _SampleText:
    """What one sample has streamed: its detokenizer, the tokens and characters sent, whether it ended."""

    detok: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_chars: int = 0
    done: bool = False


@dataclass(slots=True)
class _RequestText:
    """A request's samples (by index, None before their first event), how many have no final output yet,
    and whether its output failed (the loop then sends its one error output; deltas are dropped)."""

    samples: list
    open_samples: int
    failing: bool = False


@dataclass(slots=True)
class ErrorEvent:
    """A request's one error output, and the request (to drop anything that follows it)."""

    request: Request
    output: RequestOutput


class OutputProcessor:
    """Turns the loop's events into outputs; ``process`` inline, or ``submit`` to its own thread."""

    def __init__(self, tokenizer, stop_sequence: Callable[[Sequence], None],
                 fail_request: Callable[[Request, Exception], None], final_made: Callable[[Request], None]):
        self.tokenizer = tokenizer
        self.stop_sequence = stop_sequence
        self.fail_request = fail_request
        self.final_made = final_made  # told of each final output of a request with stop strings
        self.deliver: Callable[[list[RequestOutput]], None] | None = None  # the thread's consumer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Set while the loop needs no GIL (in the forward, whose torch ops release it, or idle).
        # Python threads share one GIL: a chunk run while the loop does its own Python would
        # delay the loop by as much, so chunks wait for quiet (at most MAX_DEFER_SECONDS), and
        # events submitted while the loop works are handed over when it goes quiet: waking the
        # thread then would make it take the GIL in the middle of the loop's host work.
        self._held: list = []  # events submitted while the loop was not quiet (the loop thread's)
        self.loop_quiet = _Quiet(self._hand_over_held)
        self.loop_quiet.set()
        self._open: dict[str, _RequestText] = {}  # request id -> its text state, until its final output

    # ---- thread ------------------------------------------------------------------------
    def start(self, deliver: Callable[[list[RequestOutput]], None] | None) -> None:
        """Process submitted events on a thread, handing each batch of outputs to deliver."""
        self.deliver = deliver
        self._thread = threading.Thread(target=self._run, name="loraplex-outputs", daemon=True)
        self._thread.start()

    def submit(self, events: list) -> None:
        """From the loop thread: never blocks. Without a thread, processed here."""
        if not events:
            return
        if self._thread is None:
            self._hand_over(self.process(events))
        elif self.loop_quiet.is_set():
            self._queue.put(events)
        else:
            self._held.append(events)

    def _hand_over_held(self) -> None:
        """The loop went quiet: the thread may take what it submitted meanwhile."""
        if self._held:
            held, self._held = self._held, []
            self._queue.put([event for events in held for event in events])

    def stop(self, timeout: float = 5.0) -> None:
        """Process what was submitted, then stop the thread."""
        if self._thread is not None:
            self._hand_over_held()
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            events = self._queue.get()
            while events is not None:  # take everything pending: one hand-over for all of it
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                events = events + more
            if events is None:
                return
            try:
                outputs = []
                for i in range(0, len(events), CHUNK):
                    if i:
                        time.sleep(0)  # hand the GIL back: the loop thread waits for it after each torch op
                    self.loop_quiet.wait(MAX_DEFER_SECONDS)
                    outputs += self.process(events[i:i + CHUNK])
                self._hand_over(outputs)
            except Exception:  # the output thread must never die
                log.exception("output processing failed")

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        if outputs and self.deliver is not None:
            self.deliver(outputs)

    # ---- processing ----------------------------------------------------------------------
    def process(self, events: list) -> list[RequestOutput]:
        """The outputs of a list of events, in order."""
        outputs: list[RequestOutput] = []
        for event in events:
            if type(event) is ErrorEvent:
                self._error(outputs, event)
            else:
                self._delta(outputs, *event)
        return outputs

    def _error(self, outputs: list[RequestOutput], event: ErrorEvent) -> None:
        request = event.request
        if request.output_ended:
            return  # it already had its final output
        self._ended(request, event.output.finish_reason)
        outputs.append(event.output)

    def _delta(self, outputs: list[RequestOutput], seq: Sequence, token: int | None, reason: FinishReason | None,
               cumulative: float, logprobs: list | None) -> None:
        request = seq.request
        if request.output_ended:
            return  # its final output (or error) was made
        state = self._open.get(request.request_id)
        if state is None:
            n = request.params.n
            state = self._open[request.request_id] = _RequestText([None] * n, n)
        sample = state.samples[seq.index]
        if state.failing or (sample is not None and sample.done):
            return  # failing (the loop sends its error), or the sample ended here already (a stop string)
        try:
            if sample is None:
                sample = state.samples[seq.index] = _SampleText(IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, request.params.stop, request.params.skip_special_tokens))
            output = self._output(seq, sample, token, reason, cumulative, logprobs)
        except Exception as exc:  # noqa: BLE001 - e.g. detokenizing raised: this request fails, not the batch
            log.warning("output of request %s failed: %r", request.request_id, exc)
            state.failing = True
            self.fail_request(request, exc)
            return
        if output.finished:
            sample.done = True
            state.open_samples -= 1
            if state.open_samples <= 0:
                self._ended(request, output.finish_reason)
        outputs.append(output)

    def _ended(self, request: Request, finish_reason: str) -> None:
        """The request's final output is made: its text state goes. A stop string can turn the loop's length
        end into a stop, so the loop counts such a request's end by this reason (``final_made``)."""
        self._open.pop(request.request_id, None)
        request.final_reason = finish_reason  # request.output_ended from now on
        if request.params.stop:
            self.final_made(request)

    def _output(self, seq: Sequence, sample: _SampleText, token: int | None, reason: FinishReason | None,
                cumulative: float, logprobs: list | None) -> RequestOutput:
        request = seq.request
        params = request.params
        detok = sample.detok
        finish_reason = reason.value if reason is not None else None
        if token is not None:
            sample.sent_tokens += 1
            stop = detok.push(token, match_stops=sample.sent_tokens >= params.min_tokens)
            if stop is not None:
                if reason is None:
                    self.stop_sequence(seq)
                finish_reason = STOP
        finished = finish_reason is not None
        if finished:
            detok.finish()
        end = detok.stable_length(finished)
        text = detok.text[sample.sent_chars:end]
        sample.sent_chars = max(end, sample.sent_chars)
        return RequestOutput(
            request_id=request.request_id,
            index=seq.index,
            text=text,
            token_ids=[token] if token is not None else [],
            finished=finished,
            finish_reason=finish_reason,
            cumulative_logprob=cumulative,
            logprobs=logprobs if params.logprobs is not None else None,
            num_input_tokens=seq.num_prompt_tokens,
        )


class _Quiet(threading.Event):
    """The loop's quiet flag; setting it also hands over the events it held meanwhile."""

    def __init__(self, on_set: Callable[[], None]):
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        super().set()
        self._on_set()
