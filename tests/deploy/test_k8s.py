"""deploy/k8s: schema-valid Kubernetes objects that fit together and fit the code they run.

Built-in kinds are validated by kubernetes-validate (strict: unknown fields are errors) against one
pinned Kubernetes version. kubernetes-validate has no schema for CRDs and kustomize files
(ServiceMonitor, Kustomization), and no Envoy binary is here to run `envoy --mode validate`: those get
structural checks below. Cross-object checks: Services select pods and name real container ports,
volumes name objects that exist, the HPA's metric is one the model exports and the Prometheus
adapter serves, Envoy's clusters point at the headless Service with a consistent-hash policy on the
tenant's header, and the containers' command lines parse with the real argument parsers.
"""

from __future__ import annotations

import copy
import functools
import json
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from loraplex.engine import metrics
from loraplex.config import EngineConfig
from loraplex.openai import cli as openai_cli
from loraplex.openai.cli import GRACEFUL_SHUTDOWN_SECONDS
from loraplex.launch.serve import build_parser as serve_parser
from loraplex.tenancy.tenants import parse_tenants
from loraplex.launch.tritonserver import TritonServer

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ENVOY_CONFIG = K8S / "envoy" / "envoy.yaml"
ADAPTER_CONFIG = K8S / "monitoring" / "prometheus-adapter-config.yaml"
K8S_VERSION = "1.32.0"  # the oldest minor still supported by the big managed offerings at the time of writing
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
# Created by the operator, not by these manifests (re-applying them must not reset the tenants);
# docs/deployment.md says how, from deploy/k8s/tenants.example.json.
EXTERNAL_SECRETS = {"loraplex-tenants", "loraplex-admin"}
TENANTS_EXAMPLE = K8S / "tenants.example.json"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
TENANT_HEADERS = ["x-api-key", "x-tenant-id"]


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@functools.cache
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@functools.cache
def objects() -> list[dict]:
    """Every object `kubectl apply -k deploy/k8s` creates, the generated Envoy ConfigMap included
    (parsed once; tests that change one deep-copy it first)."""
    kust = kustomization()
    out = []
    for name in kust["resources"]:
        for obj in load_all(K8S / name):
            if obj["kind"] != "Namespace":
                obj["metadata"].setdefault("namespace", kust["namespace"])
            out.append(obj)
    for gen in kust["configMapGenerator"]:
        data = {Path(f).name: (K8S / f).read_text() for f in gen["files"]}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return out


def find(kind: str, name: str) -> dict:
    matches = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(deployment: str, name: str) -> dict:
    return next(c for c in find("Deployment", deployment)["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def expand(args: list[str], c: dict) -> list[str]:
    """The container's args with $(VAR) replaced the way the kubelet does, from its env and ConfigMaps."""
    values = {}
    for env in c.get("env", []):
        if "value" in env:
            values[env["name"]] = env["value"]
        elif "secretKeyRef" in env["valueFrom"]:
            assert env["valueFrom"]["secretKeyRef"]["name"] in EXTERNAL_SECRETS
        else:
            ref = env["valueFrom"]["configMapKeyRef"]
            values[env["name"]] = find("ConfigMap", ref["name"])["data"][ref["key"]]
    out = []
    for arg in args:
        for key, value in values.items():
            arg = arg.replace(f"$({key})", value)
        assert "$(" not in arg, f"unresolved variable in {arg!r}"
        out.append(arg)
    return out


# ---- schemas -----------------------------------------------------------------------------------

def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_builtin_object_validates_strictly():
    validated = 0
    for obj in objects() + load_all(ADAPTER_CONFIG):
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        validate(obj)
        validated += 1
    assert validated >= 13


def test_validation_is_strict_and_can_fail():
    triton = copy.deepcopy(find("Deployment", "loraplex-triton"))
    triton["spec"]["template"]["spec"]["containers"][0]["readinessProb"] = {}  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(triton)
    hpa = copy.deepcopy(find("HorizontalPodAutoscaler", "loraplex-triton"))
    hpa["spec"]["metrics"][0]["pods"]["target"]["type"] = 16  # wrong type
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(hpa)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # why CRDs get structural checks instead
        validate(find("ServiceMonitor", "loraplex-triton"))


def test_every_manifest_is_in_the_kustomization():
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ServiceMonitor", "PersistentVolumeClaim",
            "ConfigMap", "PodDisruptionBudget", "Namespace"} <= {o["kind"] for o in objects()}


def test_images_are_the_kustomized_one_or_pinned():
    kust_images = {i["name"] for i in kustomization()["images"]}
    for obj in objects():
        if obj["kind"] != "Deployment":
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            name, _, tag = c["image"].partition(":")
            assert tag and tag != "latest", c["image"]
            assert name in kust_images or "/" in name, c["image"]


# ---- structural checks for the CRD ------------------------------------------------------------

def test_service_monitor_scrapes_the_triton_metrics_port():
    sm = find("ServiceMonitor", "loraplex-triton")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and set(sm) == {"apiVersion", "kind", "metadata", "spec"}
    spec = sm["spec"]
    svc = find("Service", "loraplex-triton")
    assert spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert spec["namespaceSelector"]["matchNames"] == [kustomization()["namespace"]]
    # The job label (the Service's label named by jobLabel) is the job the alert rules and dashboard use.
    assert svc["metadata"]["labels"][spec["jobLabel"]] == "loraplex-triton"
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert endpoint["interval"].endswith("s") and endpoint["scrapeTimeout"].endswith("s")


# ---- objects fit together --------------------------------------------------------------------

def test_services_select_pods_and_name_their_ports():
    deployments = [o for o in objects() if o["kind"] == "Deployment"]
    for svc in (o for o in objects() if o["kind"] == "Service"):
        pods = [d for d in deployments
                if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, svc["metadata"]["name"]
        named = {p["name"]: p["containerPort"] for c in pods[0]["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, (svc["metadata"]["name"], port)
            assert named[port["targetPort"]] == port["port"], "same number outside and inside, as the docs say"
    for d in deployments:
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_volumes_name_existing_objects():
    for d in (o for o in objects() if o["kind"] == "Deployment"):
        spec = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes
                assert "subPath" not in mount  # subPath mounts never see Secret / ConfigMap updates
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                find("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
            if "configMap" in v:
                find("ConfigMap", v["configMap"]["name"])
            if "secret" in v and v["secret"]["secretName"] not in EXTERNAL_SECRETS:
                find("Secret", v["secret"]["secretName"])


def test_triton_replicas():
    deployment = find("Deployment", "loraplex-triton")
    spec = deployment["spec"]["template"]["spec"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    c = container("loraplex-triton", "triton")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live"),
                        ("startupProbe", "/v2/health/ready")):
        assert c[probe]["httpGet"]["path"] == path and ports[c[probe]["httpGet"]["port"]] == 8000, probe
    # The adapter store is shared by every replica: ReadWriteMany, mounted where the args say.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    claim = volumes[mounts["/adapters"]["name"]]["persistentVolumeClaim"]["claimName"]
    assert find("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert mounts["/dev/shm"] and volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001


def test_triton_args_parse_with_loraplex_serve():
    c = container("loraplex-triton", "triton")
    args = expand(c["args"], c)
    assert args[0] == "loraplex-serve"
    parsed = serve_parser().parse_args(args[1:])
    assert parsed.adapter_store == "/adapters" and parsed.openai_port == 0  # the gateway runs on its own
    assert parsed.address == "0.0.0.0", "the listen address is explicit"
    admin = next(e for e in c["env"] if e["name"] == "LORAPLEX_ADMIN_KEY")["valueFrom"]["secretKeyRef"]
    assert admin["optional"] is True and admin["name"] in EXTERNAL_SECRETS  # absent: a random key, APIs closed
    EngineConfig.from_dict(json.loads(parsed.engine_config))  # the knobs exist and validate
    model_dir = Path(parsed.model_dir)
    models_mount = next(m for m in c["volumeMounts"] if m["name"] == "models")
    assert model_dir.is_relative_to(models_mount["mountPath"]) and models_mount["readOnly"]
    tenants_mount = next(m for m in c["volumeMounts"] if m["name"] == "tenants")
    tenants_file = Path(parsed.tenants_file)
    assert tenants_file.parent == Path(tenants_mount["mountPath"])
    secret = next(v["secret"] for v in find("Deployment", "loraplex-triton")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "tenants")
    assert secret["secretName"] in EXTERNAL_SECRETS and secret.get("optional") is False
    assert not [o for o in objects() if o["kind"] == "Secret"], "no Secret in the manifests: apply must not reset it"
    assert parse_tenants(json.loads(TENANTS_EXAMPLE.read_text())) == {}  # valid, and no key works yet
    create = f"kubectl -n loraplex create secret generic {secret['secretName']} --from-file={tenants_file.name}="
    assert create + "deploy/k8s/tenants.example.json" in DEPLOYMENT_DOC.read_text()


def test_termination_grace_matches_the_launchers_stop():
    # backend/launch/serve.py stops tritonserver with SIGINT and waits exit-timeout + 5 s (its guard's bound),
    # then kills the group and reaps it for up to 10 s. The pod must outlive that after its preStop.
    spec = find("Deployment", "loraplex-triton")["spec"]["template"]["spec"]
    c = container("loraplex-triton", "triton")
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    exit_timeout = TritonServer.__dataclass_fields__["exit_timeout_secs"].default
    assert spec["terminationGracePeriodSeconds"] == int(pre_stop[1]) + (exit_timeout + 5) + 10
    gateway = find("Deployment", "loraplex-openai")["spec"]["template"]["spec"]
    gateway_pre_stop = int(container("loraplex-openai", "gateway")["lifecycle"]["preStop"]["exec"]["command"][1])
    assert gateway["terminationGracePeriodSeconds"] == gateway_pre_stop + GRACEFUL_SHUTDOWN_SECONDS + 5


def test_gateway_points_at_envoy_and_its_args_parse():
    c = container("loraplex-openai", "gateway")
    args = expand(c["args"], c)
    assert args[0] == "loraplex-openai"
    parsed = openai_cli.build_parser().parse_args(args[1:])
    host, _, port = parsed.triton_url.partition(":")
    envoy = find("Service", host)
    assert int(port) in [p["port"] for p in envoy["spec"]["ports"] if p["name"] == "grpc"]
    assert parsed.port == next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    triton_args = serve_parser().parse_args(expand(container("loraplex-triton", "triton")["args"],
                                                   container("loraplex-triton", "triton"))[1:])
    assert parsed.model_dir == triton_args.model_dir, "the gateway's tokenizer is the served model's"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in c["livenessProbe"], "liveness must not depend on Triton being ready"


def test_hpa_scales_triton_on_an_exported_metric_the_adapter_serves():
    hpa = find("HorizontalPodAutoscaler", "loraplex-triton")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "loraplex-triton"}
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    assert name == "loraplex_requests_waiting" and name in metrics.EXPORTED_METRICS
    (adapter_cm,) = load_all(ADAPTER_CONFIG)
    rules = yaml.safe_load(adapter_cm["data"]["config.yaml"])["rules"]
    served = {}
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0].strip("'\" ")
        assert series in metrics.EXPORTED_METRICS, series
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        served[rule["name"]["as"]] = series
    assert served.get(name) == name


# ---- Envoy ------------------------------------------------------------------------------------

def envoy_config() -> dict:
    return yaml.safe_load(ENVOY_CONFIG.read_text())


def check_envoy(config: dict) -> None:
    """Envoy routes Triton's ports with a consistent hash on the tenant's header to the headless Service."""
    kust = kustomization()
    triton_svc = find("Service", "loraplex-triton")
    assert triton_svc["spec"]["clusterIP"] == "None" and triton_svc["spec"]["publishNotReadyAddresses"] is False
    fqdn = f"loraplex-triton.{kust['namespace']}.svc.cluster.local"
    triton_ports = {p["port"] for p in triton_svc["spec"]["ports"]}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    routed = set()
    for listener in config["static_resources"]["listeners"]:
        (chain,) = listener["filter_chains"]
        (hcm,) = chain["filters"]
        routes = [r for vh in hcm["typed_config"]["route_config"]["virtual_hosts"] for r in vh["routes"]]
        for route in routes:
            if "route" not in route or not route["route"]["cluster"].startswith("triton_"):
                continue
            action = route["route"]
            cluster = clusters[action["cluster"]]
            routed.add(action["cluster"])
            headers = [h["header"]["header_name"] for h in action["hash_policy"]]
            assert headers == TENANT_HEADERS, headers
            assert action["hash_policy"][0].get("terminal") is True
            assert action["timeout"] == "0s"  # streams have no deadline
            assert cluster["lb_policy"] in ("RING_HASH", "MAGLEV"), cluster["lb_policy"]
            assert cluster["type"] == "STRICT_DNS"
            factor = cluster.get("common_lb_config", {}).get("consistent_hashing_lb_config", {}).get("hash_balance_factor")
            assert factor is None or factor >= 100
            (locality,) = cluster["load_assignment"]["endpoints"]
            (lb_endpoint,) = locality["lb_endpoints"]
            address = lb_endpoint["endpoint"]["address"]["socket_address"]
            assert address["address"] == fqdn and address["port_value"] in triton_ports
            listen = listener["address"]["socket_address"]["port_value"]
            assert listen == address["port_value"], "Envoy serves each Triton port on the same number"
            (check,) = cluster["health_checks"]
            assert check["http_health_check"]["path"] == "/v2/health/ready"
    assert routed == {"triton_grpc", "triton_http"}
    grpc = clusters["triton_grpc"]["typed_extension_protocol_options"]
    assert "http2_protocol_options" in grpc["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_envoy_routes_tenants_by_consistent_hash():
    check_envoy(envoy_config())


def routed_to(config: dict, port: int, path: str) -> str | None:
    """The cluster Envoy's listener on ``port`` sends ``path`` to (None: answered by Envoy itself),
    matching routes in order as Envoy does (a safe_regex matches the whole path)."""
    import re

    listener = next(x for x in config["static_resources"]["listeners"]
                    if x["address"]["socket_address"]["port_value"] == port)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for vh in hcm["route_config"]["virtual_hosts"]:
        for route in vh["routes"]:
            match = route["match"]
            hit = (path.startswith(match["prefix"]) if "prefix" in match
                   else re.fullmatch(match["safe_regex"]["regex"], path) is not None)
            if hit:
                return route["route"]["cluster"] if "route" in route else None
    return None


TRITON_ADMIN_PATHS = [  # Triton's own APIs (README: Triton's admin APIs) and models other than ours
    "/v2/repository/index", "/v2/repository/models/lora_llm/load", "/v2/repository/models/lora_llm/unload",
    "/v2/models/lora_llm/config", "/v2/models/lora_llm/stats", "/v2/models/stats", "/v2/systemsharedmemory/status",
    "/v2/systemsharedmemory/region/x/register", "/v2/cudasharedmemory/status", "/v2/logging", "/v2/trace/setting",
    "/v2/models/lora_llm/trace/setting", "/v2/models/other/infer", "/v2/models/lora_llm/infer/../config", "/v2",
    "/metrics", "/health",
]


def test_envoy_routes_only_the_tenant_surface():
    config = envoy_config()
    for path in ("/v2/models/lora_llm/generate", "/v2/models/lora_llm/generate_stream", "/v2/models/lora_llm/infer",
                 "/v2/models/lora_adapters/infer", "/v2/models/lora_llm/versions/1/generate_stream",
                 "/v2/health/ready", "/v2/health/live", "/v2/models/lora_llm/ready"):
        assert routed_to(config, 8000, path) == "triton_http", path
    assert routed_to(config, 8000, "/v1/chat/completions") == "openai_gateway"
    assert routed_to(config, 8000, "/v1/models") == "openai_gateway"
    for path in TRITON_ADMIN_PATHS:
        assert routed_to(config, 8000, path) is None, path
    service = "/inference.GRPCInferenceService/"
    for method in ("ModelInfer", "ModelStreamInfer", "ServerReady", "ServerLive", "ModelReady"):
        assert routed_to(config, 8001, service + method) == "triton_grpc", method
    for method in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "ModelConfig", "ModelStatistics",
                   "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                   "CudaSharedMemoryRegister", "LogSettings", "TraceSetting"):
        assert routed_to(config, 8001, service + method) is None, method
    gateway = {c["name"]: c for c in config["static_resources"]["clusters"]}["openai_gateway"]
    address = gateway["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    service_port = next(p["port"] for p in find("Service", "loraplex-openai")["spec"]["ports"] if p["name"] == "http")
    assert address == {"address": f"loraplex-openai.{kustomization()['namespace']}.svc.cluster.local",
                       "port_value": service_port}


def test_network_policy_lets_only_envoy_and_prometheus_reach_the_replicas():
    policy = find("NetworkPolicy", "loraplex-triton")["spec"]
    triton_pod = find("Deployment", "loraplex-triton")["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"].items() <= triton_pod.items()
    ports = {p["name"]: p["containerPort"] for p in container("loraplex-triton", "triton")["ports"]}
    allowed = {}
    for rule in policy["ingress"]:
        (peer,) = rule["from"]
        who = peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        assert all(p["port"] in ports for p in rule["ports"]), rule["ports"]
        allowed[who] = sorted(p["port"] for p in rule["ports"])
    assert allowed == {"loraplex-envoy": ["grpc", "http"], "prometheus": ["metrics"]}
    envoy_pod = find("Deployment", "loraplex-envoy")["spec"]["template"]["metadata"]["labels"]
    assert envoy_pod["app.kubernetes.io/name"] == "loraplex-envoy"


def test_envoy_route_check_can_fail():
    config = envoy_config()
    routes = config["static_resources"]["listeners"][1]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(0, {"match": {"prefix": "/v2/"}, "route": {"cluster": "triton_http"}})
    assert routed_to(config, 8000, "/v2/repository/index") == "triton_http"


@pytest.mark.parametrize("mutate", [
    lambda c: c["static_resources"]["clusters"][0].update(lb_policy="ROUND_ROBIN"),
    lambda c: c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
              ["route_config"]["virtual_hosts"][0]["routes"][0]["route"].pop("hash_policy"),
    lambda c: c["static_resources"]["clusters"][1]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
              ["endpoint"]["address"]["socket_address"].update(address="loraplex-triton"),
], ids=["round-robin", "no-hash-policy", "short-dns-name"])
def test_envoy_check_can_fail(mutate):
    config = envoy_config()
    mutate(config)
    with pytest.raises((AssertionError, KeyError)):
        check_envoy(config)


def test_envoy_pods_serve_its_listeners():
    c = container("loraplex-envoy", "envoy")
    args = c["command"] + c["args"]
    config_path = Path(args[args.index("--config-path") + 1])
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in find("Deployment", "loraplex-envoy")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    generated = find("ConfigMap", volume["configMap"]["name"])
    assert yaml.safe_load(generated["data"][config_path.name]) == envoy_config()
    listen = {x["address"]["socket_address"]["port_value"] for x in envoy_config()["static_resources"]["listeners"]}
    assert {p["containerPort"] for p in c["ports"]} == listen
    health = next(p for p in c["ports"] if p["name"] == "health")["containerPort"]
    assert c["readinessProbe"]["httpGet"]["port"] == "health" and health in listen
    drain = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "drain_listeners?graceful" in drain and "/dev/tcp/127.0.0.1/9901" in drain
    drain_time = int(args[args.index("--drain-time-s") + 1])
    sleep = int(shlex.split(drain.split("sleep")[-1])[0])
    assert sleep == drain_time and find("Deployment", "loraplex-envoy")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] > drain_time


def test_envoy_bounds_http_bodies_before_tritonserver_reads_them():
    """tritonserver reads an HTTP body of any size before the key in it is checked: Envoy's buffer filter bounds
    it first (16 MiB; an adapter upload 260 MiB; the gateway's own routes bound their bodies themselves)."""
    config = envoy_config()
    listener = next(x for x in config["static_resources"]["listeners"] if x["name"] == "triton_http")
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.buffer", "envoy.filters.http.router"]
    assert hcm["http_filters"][0]["typed_config"]["max_request_bytes"] == 16 << 20
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]

    def per_route(path: str) -> dict:
        import re

        route = next(r for r in routes if ("prefix" in r["match"] and path.startswith(r["match"]["prefix"]))
                     or ("safe_regex" in r["match"] and re.fullmatch(r["match"]["safe_regex"]["regex"], path)))
        return route.get("typed_per_filter_config", {}).get("envoy.filters.http.buffer", {})

    assert per_route("/v2/models/lora_llm/generate") == {}  # the listener's 16 MiB
    assert per_route("/v2/models/lora_adapters/infer")["buffer"]["max_request_bytes"] == 260 << 20
    assert per_route("/v1/lora_adapters")["disabled"] is True
