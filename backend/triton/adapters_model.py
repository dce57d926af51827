"""TritonPythonModel for `lora_adapters`: upload, list, inspect and delete the caller's own adapters.

Not decoupled: one request, one response holding `result` (a JSON object) or an error.
The tenant is resolved exactly as `lora_llm` does it; the adapter store is
``LORAPLEX_ADAPTER_STORE``. initialize() stays light (every server loads this model):
torch, transformers and the base model's config are loaded by the first request that
needs them. Every server also collects retired adapter versions of every tenant on a
timer (the store's Collector, started by the first request or after its first interval).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from loraplex.engine.metrics import UPLOADS, TenantLabels
from loraplex.exceptions import InvalidRequest
from loraplex.tenancy.tenants import TenantResolver
from loraplex.triton.metrics_publisher import make_metrics
from loraplex.triton.model_config import engine_config_from_model_config, generate_model_multi_lora

log = logging.getLogger("loraplex.triton.adapters")

ACTIONS = {  # action -> (required inputs, optional inputs)
    "upload": (("adapter_name", "adapter_config", "adapter_weights"), ()),
    "list": ((), ()),
    "info": (("adapter_name",), ()),
    "delete": (("adapter_name",), ()),
}
INPUT_NAMES = ("action", "adapter_name", "adapter_config", "adapter_weights")
COLLECTOR_START_SECONDS = 60.0  # the collection timer starts by then without any request (torch loads then)
NO_STORE = "adapter uploads are not enabled on this server: no adapter store is configured (LORAPLEX_ADAPTER_STORE)"


class NoAdapterStore(RuntimeError):
    """The server has no adapter store (UNSUPPORTED)."""


def _start_collector(model: "TritonPythonModel", delay: float, stopped: threading.Event) -> None:
    """After ``delay`` seconds (torch loads then, not at model load), start the store's collection timer."""
    if stopped.wait(delay):
        return
    try:
        model._store_now()
    except Exception:  # no timer rather than a failed server
        log.exception("the adapter store's collection timer did not start")


def _scalar(name: str, array) -> bytes:
    """The one element of a STRING/BYTES [1] input, as bytes."""
    values = np.asarray(array, dtype=object).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"{name} must hold exactly 1 element, got {values.size}")
    value = values[0]
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidRequest(f"{name} must be a string")
    return bytes(value)


def _text(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None


def parse_adapter_request(inputs: dict[str, bytes]) -> tuple[str, dict]:
    """(action, its arguments) from the request's raw inputs; InvalidRequest when they do not fit the action."""
    if "action" not in inputs:
        raise InvalidRequest(f"missing input 'action' (one of {', '.join(ACTIONS)})")
    action = _text("action", inputs["action"]).strip()
    if action not in ACTIONS:
        raise InvalidRequest(f"unknown action {action[:40]!r}: use one of {', '.join(ACTIONS)}")
    required, optional = ACTIONS[action]
    missing = [n for n in required if n not in inputs]
    if missing:
        raise InvalidRequest(f"{action} needs the input(s) {', '.join(missing)}")
    extra = [n for n in inputs if n != "action" and n not in required + optional]
    if extra:
        raise InvalidRequest(f"{action} takes no input(s) {', '.join(extra)}")
    args = {}
    if "adapter_name" in inputs:
        args["name"] = _text("adapter_name", inputs["adapter_name"])
    if "adapter_config" in inputs:
        args["config_text"] = _text("adapter_config", inputs["adapter_config"])
    if "adapter_weights" in inputs:
        args["weights"] = inputs["adapter_weights"]
    return action, args


class TritonPythonModel:
    """Triton entry point: each request is one store operation for the caller's tenant."""

    def initialize(self, args):
        logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO"))
        model_config = json.loads(args["model_config"])
        self.config = engine_config_from_model_config(model_config, Path(args["model_repository"]))
        self.multi_lora = {**generate_model_multi_lora(model_config, Path(args["model_repository"]), self.config),
                           **self.config.multi_lora}  # the shared adapters lora_llm serves besides the store's
        self.tenants = TenantResolver.from_env()
        self._store = None
        self._store_lock = threading.Lock()
        self._collector = None
        self._stopped = threading.Event()
        self._hf_config = None
        self.tenant_labels = TenantLabels.from_config(self.config)
        self.metrics = make_metrics(pb_utils, model_config, args["model_name"], args["model_version"], (UPLOADS,))
        log.info("lora_adapters ready: adapter store %s", self.config.adapter_store or "(none: uploads disabled)")
        if self.config.adapter_store:
            threading.Thread(target=_start_collector, args=(self, COLLECTOR_START_SECONDS, self._stopped),
                             name="adapter-store-collector-start", daemon=True).start()

    def _store_now(self):
        if not self.config.adapter_store:
            raise NoAdapterStore(NO_STORE)
        with self._store_lock:
            if self._store is None:
                from loraplex.lora.store import AdapterStore, Collector  # imports torch: not at load time

                self._store = AdapterStore(self.config.adapter_store, max_bytes=self.config.adapter_store_max_bytes)
                if not self._stopped.is_set():
                    self._collector = Collector(self._store).start()
        return self._store

    def _base_config(self):
        if self._hf_config is None:
            from loraplex.models.loader import load_hf_config

            self._hf_config = load_hf_config(self.config.model_dir)
        return self._hf_config

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                result = self._handle(request)
                out = pb_utils.Tensor("result", np.array([json.dumps(result).encode("utf-8")], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            except Exception as exc:  # noqa: BLE001 - every request gets exactly one response
                code = self._error_code(exc)
                message = self._internal(exc) if code == pb_utils.TritonError.INTERNAL else self._message(exc)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)))
        return responses

    def _handle(self, request) -> dict:
        tenant = self.tenants.resolve_tenant(json.loads(request.parameters() or "{}"))  # before any other work
        inputs = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = _scalar(name, tensor.as_numpy())
        action, args = parse_adapter_request(inputs)
        if action == "list":
            return self._list(tenant.name)
        store = self._store_now()
        if action == "info":
            return store.info(tenant.name, args["name"]).to_json()
        if action == "delete":
            return store.delete(tenant.name, args["name"]).to_json()
        from loraplex.lora.store import check_name

        check_name(args["name"])  # before loading the base model's config
        result = store.upload(tenant, args["name"], args["config_text"], args["weights"], self._base_config(),
                              self.config.max_lora_rank).to_json()
        self._count_upload(tenant)
        return result

    def _list(self, tenant: str) -> dict:
        """The tenant's uploads, and the names of the shared adapters every tenant may use (no store: none of
        the first, the multi_lora.json ones of the second)."""
        if not self.config.adapter_store:
            return {"adapters": [], "shared": sorted(self.multi_lora)}
        store = self._store_now()
        return {"adapters": [a.to_json() for a in store.list(tenant)],
                "shared": sorted(set(store.shared()) | set(self.multi_lora))}

    def _count_upload(self, tenant) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.increment(UPLOADS.name, (self.tenant_labels.label(tenant.name, tenant.authenticated),))
        except Exception:  # the upload succeeded; a metric must not fail it
            log.exception("counting an upload failed")

    def finalize(self):
        """Stop the collection timer; drop the metrics before their families."""
        self._stopped.set()
        if self._collector is not None:
            self._collector.stop()
        if self.metrics is not None:
            self.metrics.close()

    @staticmethod
    def _message(exc: Exception) -> str:
        if isinstance(exc, (InvalidRequest, NoAdapterStore)):  # no torch import for a refused key
            return str(exc)[:2000].encode("utf-8", "backslashreplace").decode("utf-8")
        from loraplex.triton.errors import error_message  # imports torch (through loraplex.lora)

        return error_message(exc)

    @staticmethod
    def _internal(exc: Exception) -> str:
        from loraplex.triton.errors import client_error  # logs the details under the reference the message names

        return client_error(pb_utils, exc)[0]

    @staticmethod
    def _error_code(exc: Exception):
        codes = pb_utils.TritonError
        if isinstance(exc, NoAdapterStore):
            return codes.UNSUPPORTED
        if isinstance(exc, InvalidRequest):  # a bad or missing API key included
            return codes.INVALID_ARG
        from loraplex.triton.errors import error_code

        return error_code(pb_utils, exc)
