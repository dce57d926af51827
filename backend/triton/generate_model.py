"""TritonPythonModel for `lora_llm`: decoupled generation with per-request LoRA adapters."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from loraplex.config import STOP_FILE_ENV, serving_cpu_threads
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.metrics import OTHER_TENANTS
from loraplex.engine.prompt_bound import check_prompt_bytes
from loraplex.tenancy.tenants import TenantResolver
from loraplex.triton.admission import DEVELOPMENT_BACKLOG_CHARS, AdmissionPool, Job
from loraplex.triton.metrics_publisher import start_publisher
from loraplex.triton.model_config import engine_config_from_model_config, multi_lora_for
from loraplex.triton.parsing import loggable_id, parse_generate_input, request_parameters
from loraplex.triton.responder import Responder

log = logging.getLogger("loraplex.triton")

UNLOAD_POLL_SECONDS = 1.0  # how often the model asks Triton whether it is still ready (one IPC round trip)
STOP_FILE_POLL_SECONDS = 0.1  # how often it looks for the launcher's stop file (one stat)

INPUT_NAMES = (
    "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
    "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens", "return_num_output_tokens",
)


class TritonPythonModel:
    """Triton entry point: execute() parses and hands each request to the admission pool; threads do the rest."""

    def initialize(self, args):
        logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO"))
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("lora_llm must be decoupled (model_transaction_policy { decoupled: true })")
        model_dir = Path(args["model_repository"])
        config = engine_config_from_model_config(model_config, model_dir)
        if config.cpu_threads == 0:
            config.cpu_threads = serving_cpu_threads()
        multi_lora = multi_lora_for(model_config, model_dir, args["model_version"], config)
        config.multi_lora = {**multi_lora, **config.multi_lora}
        self.ids = itertools.count()
        self.tenants = TenantResolver.from_env()
        self.engine = LLMEngine(config)
        self.responder = Responder(pb_utils, self.engine.abort, self._decode_token, config.stream_interval)
        self.engine.on_outputs = self.responder.push
        self.metrics = start_publisher(pb_utils, model_config, args["model_name"], args["model_version"], self.engine)
        if self.tenants.file is not None:
            self.tenants.file.on_failure = self._tenants_file_failed
        self.admission = AdmissionPool(config.admission_workers,
                                       None if self.tenants.authenticated else DEVELOPMENT_BACKLOG_CHARS)
        self.responder.start()
        self.engine.start()
        self._finalizing = threading.Event()
        self._served = threading.Event()  # set by the first execute(): from then on Triton serves, so it is ready
        self._unload_watch = threading.Thread(target=self._watch_unloading, name="loraplex-unload-watch",
                                              args=(args["model_name"], args["model_version"]), daemon=True)
        self._unload_watch.start()

    def _watch_unloading(self, name: str, version: str) -> None:
        """End every request the model holds once Triton starts unloading it (server stopping, explicit unload).

        With a decoupled stream open, Triton does not call finalize() until its exit timeout
        has expired and then exits without it; polling readiness lets the streams end cleanly.
        """
        was_ready = False
        stop_file = os.environ.get(STOP_FILE_ENV)  # set by a launcher (loraplex-serve, the test fixtures)
        asked = 0.0  # when Triton was last asked
        while not self._finalizing.wait(0.05 if self._served.is_set() and not was_ready else STOP_FILE_POLL_SECONDS):
            if stop_file and os.path.exists(stop_file):
                log.info("the server is being stopped (%s): ending the requests model %s holds", stop_file, name)
                break
            self.tenants.refresh()  # a broken or vanished tenants file is reported even without traffic
            # Triton is asked only once the model has served: before, no stream is open (an unload calls finalize()),
            # and while the server still loads other models it answers "Server not ready", a call the Python
            # backend's stub can die of (its shared-memory allocator faults)
            if not self._served.is_set() or was_ready and time.monotonic() - asked < UNLOAD_POLL_SECONDS:
                continue
            asked = time.monotonic()
            try:
                ready = pb_utils.is_model_ready(name, version)
            except Exception as exc:  # noqa: BLE001 - a stopping server answers "Server not ready"
                ready = False if "not ready" in str(exc).lower() else None
                if ready is None:
                    log.warning("is_model_ready(%s) failed: %s", name, exc)
            if ready:
                was_ready = True
            elif ready is False and was_ready:
                log.info("model %s is being unloaded: ending the requests it holds", name)
                break
        else:
            return  # finalize() ends them
        self.admission.close()
        self.responder.push(self.engine.shutdown())

    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _tenants_file_failed(self) -> None:
        """A check found the tenants file unloadable: count it in the metrics."""
        self.engine.stats.tenants_file_reload_failures = self.tenants.file.reload_failures
        if self.metrics is not None:
            self.metrics.wake()

    def execute(self, requests):
        self._served.set()
        for request in requests:
            sender = request.get_response_sender()
            label = OTHER_TENANTS  # no tenant yet: refused before its key was checked
            try:
                parameters = request_parameters(request.parameters())
                tenant = self.tenants.resolve_tenant(parameters)  # a missing or wrong key: refused before any work
                label = self.engine.tenant_labels.label(tenant.name, tenant.authenticated)
                self.admission.submit(self._job(request, sender, parameters, tenant, label))
            except Exception as exc:  # noqa: BLE001 - every request ends with exactly one final response
                self._refuse(sender, label, exc)
        return None

    def _refuse(self, sender, label: str, exc: Exception) -> None:
        """The one final response of a request refused before the engine held it, counted."""
        self.engine.stats.refuse(label, exc)
        if self.metrics is not None:
            self.metrics.wake()
        self.responder.send_exception(sender, exc)  # an INTERNAL one is logged there, with its reference

    def _job(self, request, sender, parameters: dict, tenant, label: str) -> Job:
        """Parse and bound a request on execute()'s thread (cheap); its tokenizing and queueing, for a worker."""
        inputs = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        parsed = parse_generate_input(inputs, parameters, tenant.name)
        check_prompt_bytes(parsed.prompt, self.engine.max_prompt_bytes)
        request_id = f"{next(self.ids)}:{loggable_id(request.request_id())}"

        def run() -> None:
            try:
                self._admit(request_id, sender, parsed, tenant)
            except Exception as exc:  # noqa: BLE001 - answered here, as execute() would have
                self._refuse(sender, label, exc)

        return Job(tenant.name, len(parsed.prompt), run, lambda exc: self._refuse(sender, label, exc))

    def _admit(self, request_id: str, sender, parsed, tenant) -> None:
        """On an admission worker: tokenize, validate, register with the responder and queue in the engine."""
        engine_request = self.engine.make_request(request_id, parsed.prompt, parsed.params, tenant.name, tenant,
                                                  cancelled=sender.is_cancelled)
        engine_request.wants_logprobs = parsed.returns["return_cumulative_logprob"] or parsed.params.logprobs is not None
        self.responder.register(
            request_id, sender, parsed.stream, parsed.prompt, parsed.exclude_input, parsed.returns, parsed.params.n
        )
        try:
            self.engine.add_request(engine_request)
        except Exception:  # over a quota or the queue share, or shutting down: answered by the caller
            self.responder.unregister(request_id)
            raise

    def finalize(self):
        """Unloading: every request still held ends with UNAVAILABLE, then the threads stop."""
        self._finalizing.set()
        self.admission.close()
        self.responder.push(self.engine.shutdown())
        self.responder.stop()
        if self.metrics is not None:
            self.metrics.stop(self.engine)
