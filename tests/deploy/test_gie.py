"""deploy/k8s/gie: the inference gateway's objects are schema-valid and fit together, the endpoint picker reads our metrics.

Nothing here runs a cluster, a Gateway implementation or the picker. What is checked offline:
- built-in kinds (Deployments, Services, RBAC, NetworkPolicies, ConfigMaps) with kubernetes-validate, strictly,
  as tests/deploy/test_k8s.py does;
- the CRD objects (InferencePool, InferenceObjective, Gateway, HTTPRoute) against the OpenAPI v3 schemas of the
  CRDs of the releases named in docs/deployment.md, kept in tests/deploy/data/ (README there), with jsonschema,
  strictly: an object schema's unknown field is an error, as `kubectl apply`'s strict field validation makes it.
  Not checked: the CRDs' CEL rules (x-kubernetes-validations) and defaulting;
- the picker's flags and EndpointPickerConfig against what llm-d-router v0.10.0 defines (data/epp-v0.10.0.json,
  taken from its source), and its metric names against the families the model exports;
- that the objects point at each other (pool -> pods and picker Service, route -> gateway and pool, ...).

The overlay is built the way kustomize builds it, for the features it uses (a base directory, local files,
a ConfigMap generator, RFC 6902 `add` patches); a test makes sure it uses no other.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from loraplex.config import EngineConfig
from loraplex.engine import metrics
from loraplex.launch.serve import build_parser as serve_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
GIE = K8S / "gie"
DATA = Path(__file__).resolve().parent / "data"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
K8S_VERSION = "1.32.0"  # as test_k8s.py
SCHEMAS = {  # (apiVersion, kind) -> the CRD schema kept as test data
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools_v1.json",
    ("llm-d.ai/v1alpha2", "InferenceObjective"): "llm-d.ai_inferenceobjectives_v1alpha2.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.networking.k8s.io_gateways_v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes_v1.json",
}
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "patches", "labels", "images"}


# ---- building the overlay as kustomize does ------------------------------------------------------

def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def build(folder: Path) -> list[dict]:
    """The objects `kubectl apply -k folder` creates, for the kustomize features these manifests use."""
    kust = kustomization(folder)
    assert set(kust) <= KUSTOMIZE_FIELDS, set(kust) - KUSTOMIZE_FIELDS
    out: list[dict] = []
    for entry in kust["resources"]:
        path = (folder / entry).resolve()
        out += build(path) if path.is_dir() else load_all(path)
    for gen in kust.get("configMapGenerator", []):
        assert set(gen) == {"name", "files"}, gen
        data = {Path(f).name: (folder / f).read_text() for f in gen["files"]}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for patch in kust.get("patches", []):
        assert set(patch) == {"path", "target"}, patch
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        assert isinstance(ops, list), "only RFC 6902 patches are built here"
        target = patch["target"]
        (obj,) = [o for o in out if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
                  and o["apiVersion"] == f"{target['group']}/{target['version']}"]
        for op in ops:
            json_patch_add(obj, op)
    images = {i["name"]: i for i in kust.get("images", [])}
    for obj in out:
        if "namespace" in kust and obj["kind"] != "Namespace":
            obj["metadata"]["namespace"] = kust["namespace"]
        for group in kust.get("labels", []):
            assert set(group) == {"pairs"}, "labels on metadata only (no selectors, no templates)"
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
        for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            name = c["image"].split(":")[0]
            if name in images:
                c["image"] = f"{images[name].get('newName', name)}:{images[name]['newTag']}"
    return out


def json_patch_add(obj: dict, op: dict) -> None:
    """RFC 6902 `add` (the only op the patches use): the parent must exist; `-` appends to a list."""
    assert op["op"] == "add" and set(op) == {"op", "path", "value"}, op
    keys = [k.replace("~1", "/").replace("~0", "~") for k in op["path"].split("/")[1:]]
    parent = obj
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    if isinstance(parent, list):
        parent.append(op["value"]) if last == "-" else parent.insert(int(last), op["value"])
    else:
        parent[last] = op["value"]


@functools.cache
def _objects() -> tuple:
    return tuple(build(GIE))


def objects() -> list[dict]:
    return copy.deepcopy(list(_objects()))


def find(kind: str, name: str, objs: list[dict] | None = None) -> dict:
    matches = [o for o in (objs or objects()) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(objs: list[dict], deployment: str, name: str) -> dict:
    pod = find("Deployment", deployment, objs)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def expand(args: list[str], c: dict, objs: list[dict]) -> list[str]:
    """$(VAR) in args as the kubelet expands them, from the container's env (ConfigMap keys and literals)."""
    values = {}
    for env in c.get("env", []):
        if "value" in env:
            values[env["name"]] = env["value"]
        elif "configMapKeyRef" in env.get("valueFrom", {}):
            ref = env["valueFrom"]["configMapKeyRef"]
            values[env["name"]] = find("ConfigMap", ref["name"], objs)["data"][ref["key"]]
    out = []
    for arg in args:
        for key, value in values.items():
            arg = arg.replace(f"$({key})", value)
        assert "$(" not in arg, f"unresolved variable in {arg!r}"
        out.append(arg)
    return out


# ---- schemas ---------------------------------------------------------------------------------

def strict(schema):
    """The schema with unknown fields refused wherever it lists an object's properties (kubectl's strict field
    validation; the API server would drop them silently otherwise)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(api_version: str, kind: str) -> tuple[dict, dict]:
    data = json.loads((DATA / SCHEMAS[(api_version, kind)]).read_text())
    assert f"{data['group']}/{data['version']}" == api_version and data["kind"] == kind
    return strict(data["openAPIV3Schema"]), data["source"]


def validate(obj: dict) -> None:
    """Strict validation: kubernetes-validate for built-in kinds, the CRD's schema (and ObjectMeta) for the others."""
    key = (obj["apiVersion"], obj["kind"])
    if key not in SCHEMAS:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return
    schema, _ = crd_schema(*key)
    jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
                                 K8S_VERSION, strict=True)


def own_objects() -> list[dict]:
    """The objects the overlay adds or changes (the base's are test_k8s.py's)."""
    names = {(o["kind"], o["metadata"]["name"]) for f in GIE.glob("*.yaml") if f.name != "kustomization.yaml"
             and not f.name.endswith(".patch.yaml") for o in load_all(f)}
    names |= {("ConfigMap", g["name"]) for g in kustomization(GIE)["configMapGenerator"]}
    names.add(("Deployment", "loraplex-triton"))  # patched
    return [o for o in objects() if (o["kind"], o["metadata"]["name"]) in names]


def test_every_object_validates_strictly():
    kinds = set()
    for obj in own_objects():
        validate(obj)
        kinds.add(obj["kind"])
    assert {"InferencePool", "InferenceObjective", "Gateway", "HTTPRoute", "Deployment", "Service", "Role",
            "RoleBinding", "ServiceAccount", "NetworkPolicy", "ConfigMap"} <= kinds


@pytest.mark.parametrize("kind,name,mutate", [
    ("InferencePool", "loraplex-triton", lambda o: o["spec"].update(targetPort=o["spec"].pop("targetPorts"))),
    ("InferencePool", "loraplex-triton", lambda o: o["spec"]["targetPorts"][0].update(number="9000")),
    ("InferencePool", "loraplex-triton", lambda o: o["spec"]["endpointPickerRef"].update(failureMode="Open")),
    ("InferencePool", "loraplex-triton", lambda o: o["spec"].pop("selector")),
    ("InferenceObjective", "batch", lambda o: o["spec"].update(priority="low")),
    ("InferenceObjective", "batch", lambda o: o["spec"].update(poolref=o["spec"].pop("poolRef"))),
    ("HTTPRoute", "loraplex-openai", lambda o: o["spec"]["rules"][0].update(backendRef=o["spec"]["rules"][0]
                                                                            .pop("backendRefs"))),
    ("HTTPRoute", "loraplex-openai", lambda o: o["spec"]["rules"][0]["timeouts"].update(request="forever")),
    ("Gateway", "loraplex", lambda o: o["spec"]["listeners"][0].update(port="80")),
    ("Gateway", "loraplex", lambda o: o["metadata"].update(labes=o["metadata"].pop("labels"))),
    ("Deployment", "loraplex-epp", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=1)),
], ids=["misspelled-field", "port-as-string", "enum", "required-field", "priority-as-string", "field-case",
        "route-misspelled-field", "duration-pattern", "listener-port-type", "metadata-label", "builtin-kind"])
def test_validation_fails_on_a_broken_object(kind, name, mutate):
    obj = find(kind, name)
    validate(obj)
    mutate(obj)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(obj)


def test_schemas_are_the_releases_the_docs_install():
    doc = DEPLOYMENT_DOC.read_text()
    urls = {
        "kubernetes-sigs/gateway-api": "https://github.com/kubernetes-sigs/gateway-api/releases/download/{tag}/"
                                       "standard-install.yaml",
        "kubernetes-sigs/gateway-api-inference-extension": "https://github.com/kubernetes-sigs/"
                                                           "gateway-api-inference-extension/releases/download/{tag}/"
                                                           "v1-manifests.yaml",
        "llm-d/llm-d-router": "https://github.com/llm-d/llm-d-router/releases/download/{tag}/manifests.yaml",
    }
    for key in SCHEMAS:
        _, source = crd_schema(*key)
        assert urls[source["repository"]].format(tag=source["tag"]) in doc, source
        assert source["tag"] in (DATA / "README.md").read_text()
    assert "not run on a cluster" in doc


# ---- the objects fit together ------------------------------------------------------------------

def test_every_manifest_is_in_the_kustomization():
    listed = set(kustomization(GIE)["resources"])
    on_disk = {p.name for p in GIE.glob("*.yaml")} - {"kustomization.yaml"}
    patches = {p["path"] for p in kustomization(GIE)["patches"]}
    assert listed - {"../"} == on_disk - patches and "../" in listed
    assert {p.name for p in (GIE / "epp").iterdir()} == {Path(f).name for g in kustomization(GIE)["configMapGenerator"]
                                                          for f in g["files"]}


def test_the_base_is_built_unchanged_but_for_the_triton_patch():
    base = {(o["kind"], o["metadata"]["name"]): o for o in build(K8S)}
    gie = {(o["kind"], o["metadata"]["name"]): o for o in objects()}
    assert base.keys() <= gie.keys()
    changed = {k for k in base if base[k] != gie[k]}
    assert changed == {("Deployment", "loraplex-triton")}


def test_the_pool_selects_the_triton_replicas_on_their_openai_port():
    objs = objects()
    pool = find("InferencePool", "loraplex-triton", objs)["spec"]
    triton = find("Deployment", "loraplex-triton", objs)
    labels = triton["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert triton["spec"]["selector"]["matchLabels"] == find("Deployment", "loraplex-triton", build(K8S))["spec"][
        "selector"]["matchLabels"], "the patch must not change the selector (immutable on a live Deployment)"
    c = container(objs, "loraplex-triton", "triton")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    parsed = serve_parser().parse_args(expand(c["args"], c, objs)[1:])
    assert [p["number"] for p in pool["targetPorts"]] == [parsed.openai_port] == [ports["openai"]]
    config_map = find("ConfigMap", "loraplex", objs)["data"]
    assert parsed.served_model_name == config_map["SERVED_MODEL_NAME"]
    EngineConfig.from_dict(json.loads(parsed.engine_config))
    assert pool["appProtocol"] == "http"


def test_the_pool_names_the_picker_service_and_its_grpc_port():
    objs = objects()
    ref = find("InferencePool", "loraplex-triton", objs)["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] == "FailOpen"
    svc = find("Service", ref["name"], objs)
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = find("Deployment", "loraplex-epp", objs)
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    c = container(objs, "loraplex-epp", "epp")
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named[port["targetPort"]] == port["port"] == int(flag(c, "grpc-port"))
    assert port["appProtocol"] == "kubernetes.io/h2c"


def flag(c: dict, name: str) -> str | None:
    """The value of --name in a container's args (--name value or --name=value)."""
    args = c["args"]
    for i, arg in enumerate(args):
        if arg == f"--{name}":
            return args[i + 1]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


@functools.cache
def epp_release() -> dict:
    return json.loads((DATA / "epp-v0.10.0.json").read_text())


def test_the_picker_runs_the_release_with_flags_it_has():
    objs = objects()
    epp = find("Deployment", "loraplex-epp", objs)
    c = container(objs, "loraplex-epp", "epp")
    release = epp_release()
    assert c["image"] == f"ghcr.io/llm-d/llm-d-router-endpoint-picker:{release['source']['tag']}"
    known = set(release["flags"]) | set(release["zap_flags"])
    for arg in c["args"]:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            assert name in known, f"--{name} is not a flag of the picker {release['source']['tag']}"
            assert name not in release["deprecated_flags"], f"--{name} is deprecated: engineConfigs instead"
    pool = find("InferencePool", "loraplex-triton", objs)
    assert flag(c, "pool-name") == pool["metadata"]["name"]
    assert flag(c, "pool-group") == pool["apiVersion"].split("/")[0]
    assert flag(c, "tracing") == "false"
    env = {e["name"]: e for e in c["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # the config file is the generated ConfigMap's
    config_path = Path(flag(c, "config-file"))
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert config_path.name in find("ConfigMap", volume["configMap"]["name"], objs)["data"]
    health = int(flag(c, "grpc-health-port"))
    assert c["readinessProbe"]["grpc"]["port"] == health == c["livenessProbe"]["grpc"]["port"]
    assert epp["spec"]["replicas"] == 1 and epp["spec"]["strategy"]["type"] == "Recreate"
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == "loraplex-epp"


def epp_config(objs: list[dict]) -> dict:
    return yaml.safe_load(find("ConfigMap", "loraplex-epp", objs)["data"]["config.yaml"])


def check_epp_config(config: dict, objs: list[dict]) -> None:
    """The EndpointPickerConfig has only fields and plugins the release has, and reads the model's metric families."""
    release = epp_release()
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    assert set(config) - {"apiVersion", "kind"} <= set(release["config_keys"])
    plugins = {}
    for spec in config["plugins"]:
        assert set(spec) <= set(release["plugin_spec_keys"]) and spec["type"] in release["plugin_types"], spec
        plugins[spec.get("name", spec["type"])] = spec
    (profile,) = config["schedulingProfiles"]
    assert set(profile) <= set(release["scheduling_profile_keys"])
    weights = {}
    for ref in profile["plugins"]:
        assert set(ref) <= set(release["scheduling_plugin_keys"]) and ref["pluginRef"] in plugins, ref
        weights[plugins[ref["pluginRef"]]["type"]] = ref.get("weight", 1.0)
    # the picker's default profile (queue 2, KV 2, prefix 3) and the LoRA-affinity scorer at its default weight
    assert weights == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3,
                       "lora-affinity-scorer": 1}
    assert set(config["dataLayer"]) <= set(release["data_layer_keys"])
    (source,) = config["dataLayer"]["sources"]
    assert set(source) <= set(release["data_layer_source_keys"])
    assert plugins[source["pluginRef"]]["type"] == "metrics-data-source"
    (extractor,) = source["extractors"]
    assert set(extractor) <= set(release["data_layer_extractor_keys"])
    assert plugins[extractor["pluginRef"]]["type"] == "core-metrics-extractor"
    # scraped on Triton's metrics port, not the pool's target port
    scrape = plugins[source["pluginRef"]]["parameters"]
    assert set(scrape) <= set(release["metrics_data_source_parameters"])
    triton = container(objs, "loraplex-triton", "triton")
    assert scrape["port"] == {p["name"]: p["containerPort"] for p in triton["ports"]}["metrics"]
    assert scrape["path"] == "/metrics" and scrape["scheme"] == "http"
    params = plugins[extractor["pluginRef"]]["parameters"]
    assert set(params) <= set(release["core_metrics_extractor_parameters"])
    (engine,) = params["engineConfigs"]
    assert set(engine) <= set(release["engine_config_keys"])
    pod_labels = find("Deployment", "loraplex-triton", objs)["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[params["engineLabelKey"]] == engine["name"] == params["defaultEngine"]
    families = {metrics.PREFIX + f.name: f for f in metrics.FAMILIES}
    wanted = {"queuedRequestsSpec": (metrics.GAUGE, ()), "runningRequestsSpec": (metrics.GAUGE, ()),
              "kvUsageSpec": (metrics.GAUGE, ()),
              "loraSpec": (metrics.INFO, ("max_lora", "running_lora_adapters", "waiting_lora_adapters")),
              "cacheInfoSpec": (metrics.GAUGE, ("block_size", "num_gpu_blocks"))}
    for key, (kind, labels) in wanted.items():
        name = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?", engine[key]).group(1)
        assert name in families, f"{key}: {name} is not a family the model exports"
        assert families[name].kind == kind and set(labels) <= set(families[name].labels), (key, families[name])


def test_the_picker_reads_our_metric_names():
    objs = objects()
    check_epp_config(epp_config(objs), objs)


@pytest.mark.parametrize("mutate", [
    lambda c: c["plugins"][-1]["parameters"]["engineConfigs"][0].update(queuedRequestsSpec="vllm:num_requests_waiting"),
    lambda c: c["plugins"][-1]["parameters"]["engineConfigs"][0].update(loraSpec="loraplex_requests_waiting"),
    lambda c: c["plugins"][-2]["parameters"].update(port=8000),
    lambda c: c["plugins"].append({"type": "lora-affinity-scorrer"}),
    lambda c: c["schedulingProfiles"][0]["plugins"][-1].update(weight=5),
    lambda c: c.update(scheduling=c.pop("schedulingProfiles")),
], ids=["vllm-name", "wrong-family", "api-port", "plugin-typo", "weight", "field-typo"])
def test_the_picker_config_check_can_fail(mutate):
    objs = objects()
    config = epp_config(objs)
    mutate(config)
    with pytest.raises((AssertionError, KeyError, ValueError)):
        check_epp_config(config, objs)


def test_the_route_sends_the_openai_api_through_the_gateway_to_the_pool():
    objs = objects()
    route = find("HTTPRoute", "loraplex-openai", objs)["spec"]
    (parent,) = route["parentRefs"]
    gateway = find(parent["kind"], parent["name"], objs)
    assert gateway["apiVersion"].startswith(parent["group"] + "/")
    assert any(lst["protocol"] in ("HTTP", "HTTPS") for lst in gateway["spec"]["listeners"])
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    pool = find(backend["kind"], backend["name"], objs)
    assert pool["apiVersion"].split("/")[0] == backend["group"] and "port" not in backend
    assert [m["path"] for m in rule["matches"]] == [{"type": "PathPrefix", "value": "/v1/"}]
    assert rule["timeouts"]["request"] == "0s", "streams have no deadline, as with the ring-hash Envoy"


def test_the_objectives_name_the_pool():
    objs = objects()
    objectives = [o for o in objs if o["kind"] == "InferenceObjective"]
    assert {o["metadata"]["name"]: o["spec"]["priority"] for o in objectives} == {"interactive": 0, "batch": -1}
    for o in objectives:
        ref = o["spec"]["poolRef"]
        pool = find(ref.get("kind", "InferencePool"), ref["name"], objs)
        assert pool["apiVersion"].split("/")[0] == ref["group"]


def test_the_picker_may_read_what_it_watches():
    objs = objects()
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "loraplex-epp"]
    (subject,) = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "loraplex-epp"}
    find("ServiceAccount", subject["name"], objs)
    role = find(binding["roleRef"]["kind"], binding["roleRef"]["name"], objs)
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               if {"get", "watch", "list"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
            ("llm-d.ai", "inferenceobjectives")} <= granted
    assert all(set(rule["verbs"]) <= {"get", "watch", "list"} for rule in role["rules"]), "read only"


def test_network_policies_let_the_gateway_and_the_picker_in_on_their_ports_only():
    objs = objects()
    policy = find("NetworkPolicy", "loraplex-triton-gateway", objs)["spec"]
    triton = find("Deployment", "loraplex-triton", objs)["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= triton.items()
    ports = {p["name"] for p in container(objs, "loraplex-triton", "triton")["ports"]}
    allowed = {}
    for rule in policy["ingress"]:
        assert all(p["port"] in ports for p in rule["ports"])
        for peer in rule["from"]:
            allowed.setdefault(tuple(sorted(peer["podSelector"]["matchLabels"].items())), set()).update(
                p["port"] for p in rule["ports"])
    epp_labels = find("Deployment", "loraplex-epp", objs)["spec"]["template"]["metadata"]["labels"]
    assert allowed[(("app.kubernetes.io/name", epp_labels["app.kubernetes.io/name"]),)] == {"metrics"}
    gateway = find("Gateway", "loraplex", objs)["metadata"]["name"]
    for label in ("gateway.networking.k8s.io/gateway-name", "gateway.envoyproxy.io/owning-gateway-name"):
        assert allowed[((label, gateway),)] == {"openai"}
    epp_policy = find("NetworkPolicy", "loraplex-epp", objs)["spec"]
    assert epp_policy["podSelector"]["matchLabels"].items() <= epp_labels.items()
    epp_ports = {p["name"] for p in container(objs, "loraplex-epp", "epp")["ports"]}
    assert {p["port"] for rule in epp_policy["ingress"] for p in rule["ports"]} <= epp_ports
