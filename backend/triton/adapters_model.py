"""TritonPythonModel for `lora_adapters`: upload, list, inspect and delete the caller's own adapters; the
operator's shared adapters loaded and unloaded at run time (``load_shared``/``unload_shared``, admin key only).

Not decoupled: one request, one response holding `result` (a JSON object) or an error.
The tenant is resolved exactly as `lora_llm` does it; the adapter store is
``LORAPLEX_ADAPTER_STORE``. initialize() stays light (every server loads this model):
torch, transformers and the base model's config are loaded by the first request that
needs them. Every server also collects retired adapter versions of every tenant on a
timer (the store's Collector, started by the first request or after its first interval).

``list`` is paginated: at most ``limit`` names (default and bound MAX_PAGE) after ``cursor``, and the
``next`` cursor (null on the last page); with ``adapter_name`` it answers for that one name (O(1)).
The admin actions need the request parameter ``loraplex_admin_key`` equal to ``$LORAPLEX_ADMIN_KEY``
(loraplex-serve passes its admin key to tritonserver so): without that variable they are refused.
"""

from __future__ import annotations

import hmac
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
from loraplex.triton.parsing import request_parameters

log = logging.getLogger("loraplex.triton.adapters")

ACTIONS = {  # action -> (required inputs, optional inputs)
    "upload": (("adapter_name", "adapter_config", "adapter_weights"), ()),
    "list": ((), ("cursor", "limit", "adapter_name")),
    "info": (("adapter_name",), ()),
    "delete": (("adapter_name",), ()),
    "load_shared": (("adapter_name", "adapter_config", "adapter_weights"), ("load_inplace",)),
    "unload_shared": (("adapter_name",), ()),
}
ADMIN_ACTIONS = ("load_shared", "unload_shared")
INPUT_NAMES = ("action", "adapter_name", "adapter_config", "adapter_weights", "cursor", "limit", "load_inplace")
ADMIN_KEY_ENV = "LORAPLEX_ADMIN_KEY"
ADMIN_PARAMETER = "loraplex_admin_key"  # a request parameter (Triton forwards no admin header to models)
ADMIN_REFUSED = "missing or invalid admin key"
MAX_PAGE = 1000  # loraplex.lora.store.MAX_PAGE (not imported here: that imports torch)
COLLECTOR_START_SECONDS = 60.0  # the collection timer starts by then without any request (torch loads then)
NO_STORE = "adapter uploads are not enabled on this server: no adapter store is configured (LORAPLEX_ADAPTER_STORE)"


class NoAdapterStore(RuntimeError):
    """The server has no adapter store, or no admin key for the admin actions (UNSUPPORTED)."""


class AdminRefused(InvalidRequest):
    """An admin action without the admin key (INVALID_ARG; the gateway answers 401)."""


def check_admin(parameters: dict, expected: str | None) -> None:
    """Refuse an admin action unless ``parameters`` carry the admin key (compared in constant time)."""
    if not expected:
        raise NoAdapterStore(f"loading shared adapters at run time is not enabled on this server: no admin key "
                             f"is configured (${ADMIN_KEY_ENV}, loraplex-serve --admin-key)")
    given = parameters.get(ADMIN_PARAMETER)
    if not isinstance(given, str) or not hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                             expected.encode("utf-8", "surrogatepass")):
        raise AdminRefused(ADMIN_REFUSED)


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
    if "cursor" in inputs:
        args["cursor"] = _text("cursor", inputs["cursor"])[:200]
    if "limit" in inputs:
        raw = _text("limit", inputs["limit"]).strip()
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
            raise InvalidRequest(f"limit must be a whole number from 1 to {MAX_PAGE}, got {raw[:20]!r}")
        args["limit"] = int(raw)
    if "load_inplace" in inputs:
        raw = _text("load_inplace", inputs["load_inplace"]).strip().lower()
        if raw not in ("true", "false", "1", "0"):
            raise InvalidRequest(f"load_inplace must be true or false, got {raw[:20]!r}")
        args["replace"] = raw in ("true", "1")
    return action, args


class TritonPythonModel:
    """Triton entry point: each request is one store operation for the caller's tenant."""

    def initialize(self, args):
        logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO"))
        model_config = json.loads(args["model_config"])
        self.config = engine_config_from_model_config(model_config, Path(args["model_repository"]))
        self._model_config, self._repository = model_config, Path(args["model_repository"])
        self._multi_lora = None
        self.tenants = TenantResolver.from_env()
        self.admin_key = os.environ.get(ADMIN_KEY_ENV) or None
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

    @property
    def multi_lora(self) -> dict[str, str]:
        """The shared adapters lora_llm serves besides the store's (multi_lora.json's that fit the base model);
        read on first use: the shape check imports torch, which initialize() must not."""
        if self._multi_lora is None:
            self._multi_lora = {**generate_model_multi_lora(self._model_config, self._repository, self.config),
                                **self.config.multi_lora}
        return self._multi_lora

    def _base_config(self):
        if self._hf_config is None:
            from loraplex.models.loader import load_hf_config

            self._hf_config = load_hf_config(self.config.model_dir)
        return self._hf_config

    def _expert_rank(self) -> int:
        """The rank of the generation model's MoE expert stacks, as it resolves it from the same config (decision
        070): uploads are checked against what will serve them."""
        from loraplex.lora.expert_rank import resolve_expert_rank
        from loraplex.lora.moe_layout import expert_layout

        config = self.config
        return resolve_expert_rank(config.max_expert_lora_rank, expert_layout(self._base_config()), config.max_loras,
                                   config.max_lora_rank)

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
        parameters = request_parameters(request.parameters())
        inputs = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = _scalar(name, tensor.as_numpy())
        action = _text("action", inputs["action"]).strip() if "action" in inputs else None
        if action in ADMIN_ACTIONS:  # the operator's: the admin key, not a tenant's
            check_admin(parameters, self.admin_key)
            return self._admin(*parse_adapter_request(inputs))
        tenant = self.tenants.resolve_tenant(parameters)  # before any other work
        action, args = parse_adapter_request(inputs)
        if action == "list":
            return self._list(tenant.name, args.get("cursor", ""), args.get("limit", MAX_PAGE), args.get("name"))
        store = self._store_now()
        if action == "info":
            return store.info(tenant.name, args["name"]).to_json()
        if action == "delete":
            return store.delete(tenant.name, args["name"]).to_json()
        from loraplex.lora.store import check_name

        check_name(args["name"])  # before loading the base model's config
        result = store.upload(tenant, args["name"], args["config_text"], args["weights"], self._base_config(),
                              self.config.max_lora_rank, self._expert_rank()).to_json()
        self._count_upload(tenant)
        return result

    def _admin(self, action: str, args: dict) -> dict:
        """load_shared / unload_shared: the operator's shared adapters, validated exactly as uploads."""
        store = self._store_now()
        from loraplex.lora.store import check_name

        name = check_name(args["name"])
        if action == "unload_shared":
            if name in self.multi_lora and store.lookup_shared(name) is None:
                raise InvalidRequest(f"the shared adapter '{name}' comes from multi_lora.json, not from a run-time "
                                     f"load: remove it there")
            return store.unload_shared(name).to_json()
        replace = args.get("replace", False)
        if name in self.multi_lora and not replace:
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                 f"adapter in place, set 'load_inplace' to True.")
        return store.load_shared(name, args["config_text"], args["weights"], self._base_config(),
                                 self.config.max_lora_rank, replace=replace,
                                 max_expert_rank=self._expert_rank()).to_json()

    def _list(self, tenant: str, cursor: str = "", limit: int = MAX_PAGE, name: str | None = None) -> dict:
        """One page of the tenant's uploads and of the shared names every tenant may use, and the next cursor
        (no store: no uploads, the multi_lora.json names); with ``name``, only that name if the tenant may use it."""
        if not self.config.adapter_store:
            names = sorted(n for n in self.multi_lora if (n == name if name is not None else n > cursor))
            return {"adapters": [], "shared": names[:limit], "next": names[limit - 1] if len(names) > limit else None}
        store = self._store_now()
        if name is not None:
            own = store.lookup(tenant, name)
            shared = name in self.multi_lora or store.lookup_shared(name) or store.shared_folder(name)
            return {"adapters": [own.to_json()] if own else [], "shared": [name] if shared else [], "next": None}
        page = store.page(tenant, cursor, limit, self.multi_lora)
        return {"adapters": [a.to_json() for a in page.own], "shared": page.shared, "next": page.next}

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
