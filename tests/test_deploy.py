"""Cluster deployment files: `ray up` configs, the Serve config, and the Helm chart's KubeRay RayService.

Nothing here starts Ray or needs a cluster, a cloud account or the helm binary:

- cluster.yaml / cluster.local.yaml go through what `ray up` does with a config before it touches a machine
  (ray.autoscaler._private.commands._bootstrap_config): `prepare_config` (merges the provider's defaults.yaml,
  folds setup_commands into head/worker_setup_commands, fills node types' worker bounds; for provider `local` it
  builds the single node type from head_ip/worker_ips and rejects available_node_types) and `validate_config`
  (Ray's ray-schema.json, which rejects unknown keys, plus the node-type checks). Both are offline. The two steps
  `ray up` runs after them talk to the cloud and are left out: the provider's fillout_available_node_types_resources
  (AWS: an EC2 DescribeInstanceTypes call, for node types without `resources`; every node type here gives its
  resources, which the test asserts, so the call would change nothing) and bootstrap_config (AWS: IAM role,
  security group, subnets, AMI look-ups). For `local`, bootstrap_config is offline and is run.
- deploy/serve.yaml and every rendered serveConfigV2 go through ray.serve.schema.ServeDeploySchema (which imports
  the request router class, as the head node does when `serve deploy` / KubeRay submits the config), their args
  through folio.serve.config.ServeConfig, and their per-deployment overrides are compared with what
  folio.serve.app.build_app derives from the same args.
- The chart is linted and rendered (`helm install --dry-run=client`) by Helm's own Go SDK through helm-python-sdk;
  the RayService is validated against KubeRay v1.7.0's CRD schema (../shared/schemas), made strict: unknown fields
  are rejected wherever the CRD does not preserve them (the API server would silently prune them). The CRD's CEL
  rules (x-kubernetes-validations) are not evaluated: they concern fields the chart does not set (managedBy,
  gcsFaultToleranceOptions).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "folio"
AUTOSCALING_VALUES = CHART / "ci" / "autoscaling-values.yaml"
SERVE_CONFIG = ROOT / "deploy" / "serve.yaml"
PREFIX_ROUTER = "folio.router.ray_router:PrefixAwareRequestRouter"
RAYSERVICE_CRD = ROOT.parent / "shared" / "schemas" / "ray.io_rayservices.v1.7.0.crd.yaml"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# --- `ray up` cluster configs ---------------------------------------------------------------------------------------

def prepared_cluster_config(name: str) -> dict[str, Any]:
    """The config as `ray up` has it right before the cloud calls (see the module docstring)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(load_yaml(ROOT / name))
    validate_config(config)
    return config


def test_cluster_yaml_passes_ray_validation():
    raw = load_yaml(ROOT / "cluster.yaml")
    config = prepared_cluster_config("cluster.yaml")
    assert config["provider"]["type"] == "aws"
    node_types = config["available_node_types"]
    # Given resources: `ray up` needs no EC2 look-up, and what the autoscaler plans with is what is written here.
    assert all(raw["available_node_types"][name].get("resources") for name in node_types)
    head = node_types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0} and head["max_workers"] == 0  # no replica is ever placed on the head
    gpu_types = {name: t for name, t in node_types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types and all(t["max_workers"] > t["min_workers"] >= 0 for t in gpu_types.values())  # autoscaling
    # Ray's AWS defaults install boto3 for the head's autoscaler; our lists replace them, so they must too.
    assert any("boto3" in command for command in config["head_setup_commands"])

    # The GPU workers can hold the Serve config's largest generator fleet.
    generator = serve_deployment(load_yaml(SERVE_CONFIG), "Generator")
    gpus_needed = generator["autoscaling_config"]["max_replicas"] * generator["ray_actor_options"]["num_gpus"]
    gpus_available = sum(t["max_workers"] * t["resources"]["GPU"] for t in gpu_types.values())
    assert gpus_available >= gpus_needed


def test_cluster_local_yaml_passes_ray_validation():
    from ray.autoscaler._private.local.config import bootstrap_local

    raw = load_yaml(ROOT / "cluster.local.yaml")
    assert "available_node_types" not in raw  # provider local builds its own node type
    config = bootstrap_local(prepared_cluster_config("cluster.local.yaml"))
    assert config["provider"]["type"] == "local"
    (node_type,) = config["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(raw["provider"]["worker_ips"])
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--num-cpus=0" in head_start and "--num-gpus=0" in head_start


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.local.yaml"])
def test_cluster_configs_install_folio_and_deploy_the_serve_config(name):
    config = load_yaml(ROOT / name)
    # The Serve config travels from ./deploy to ~/folio-deploy on every node; the head deploys it after `ray start`.
    assert config["file_mounts"]["~/folio-deploy"] == "./deploy" and SERVE_CONFIG.is_file()
    assert any("serve deploy ~/folio-deploy/serve.yaml" in c for c in config["head_start_ray_commands"])
    assert config["docker"]["image"] == load_yaml(ROOT / "cluster.yaml")["docker"]["image"]
    # A folio install pins the node's torch to its exact build and builds the native library against it.
    install = next(c for c in config["setup_commands"] if "pip install" in c)
    assert "--no-build-isolation" in install and "-c /tmp/folio-torch-pin.txt" in install
    assert "torch.__version__" in install and "FOLIO_PIP_SPEC=" in install
    # The node fails its setup if what Serve imports there is missing.
    assert any("import folio.serve.app, folio.router.ray_router" in c for c in config["setup_commands"])
    # Every node's Serve runs the ingress mode the application is configured for (folio.serve.ingress_mode).
    from folio.serve.ingress_mode import cluster_env

    mode = load_yaml(SERVE_CONFIG)["applications"][0]["args"]["ingress_mode"]
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key]
              if "ray start" in c]
    assert len(starts) == 2 and all(f"{k}={v} " in c.split("ray start")[0]
                                    for c in starts for k, v in cluster_env(mode).items())


def test_ray_validation_rejects_broken_cluster_configs():
    """The validation above has teeth: the same calls reject these."""
    import click
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    def check(config):
        validate_config(prepare_config(config))

    aws = load_yaml(ROOT / "cluster.yaml")
    with pytest.raises(jsonschema.ValidationError):
        check({**aws, "head_start_commands": ["ray start --head"]})  # a misspelt key
    fractional = copy.deepcopy(aws)
    fractional["available_node_types"]["gpu_worker"]["resources"]["GPU"] = 0.5  # resources are integers
    with pytest.raises(jsonschema.ValidationError):
        check(fractional)
    local = load_yaml(ROOT / "cluster.local.yaml")
    with pytest.raises(click.ClickException, match="available_node_types"):
        check({**local, "available_node_types": aws["available_node_types"], "head_node_type": "head"})


# --- the Serve config -----------------------------------------------------------------------------------------------

def serve_deployment(serve_config: dict[str, Any], name: str) -> dict[str, Any]:
    (app,) = serve_config["applications"]
    return next(d for d in app.get("deployments", []) if d["name"] == name)


def built_deployments(args: dict[str, Any]) -> dict[str, Any]:
    """The deployments folio.serve.app.build_app makes of `args` (no Ray started): {name: Deployment}."""
    from folio.serve.app import build_app

    ingress = build_app(args)._bound_deployment
    generator = ingress.init_args[0]._bound_deployment
    return {d.name: d for d in (ingress, generator)}


def check_serve_config(serve_config: dict[str, Any]) -> None:
    """What `serve deploy` / KubeRay would accept and deploy as intended."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.schema import ServeDeploySchema

    from folio.serve.app import SERVICER_FUNCTION
    from folio.serve.config import ServeConfig

    ServeDeploySchema.model_validate(serve_config)  # imports the router classes named in it
    assert serve_config["grpc_options"]["grpc_servicer_functions"] == [SERVICER_FUNCTION]
    assert serve_config["http_options"]["host"] == "0.0.0.0"  # health checks reach the proxy from outside the pod
    (app,) = serve_config["applications"]
    assert app["import_path"] == "folio.serve.app:build_app"
    args = app["args"]
    config = ServeConfig.from_dict(args)  # the builder's own validation of its args
    assert app["name"] == config.app_name and app["route_prefix"] == f"/{config.app_name}"
    assert serve_config["grpc_options"]["port"] == config.grpc_port
    assert serve_config["http_options"]["port"] == config.http_port
    assert config.resolved_device == "cuda"

    # Overrides name deployments that exist, and repeat what the code derives from the same args.
    built = built_deployments(args)
    overrides = {d["name"]: d for d in app["deployments"]}
    assert set(overrides) <= set(built)
    generator, built_generator = overrides["Generator"], built["Generator"]
    assert generator["max_ongoing_requests"] == built_generator.max_ongoing_requests == config.max_ongoing_requests
    assert generator["ray_actor_options"] == {"num_gpus": config.num_gpus, "num_cpus": config.num_cpus}
    router_config = RequestRouterConfig(**generator["request_router_config"])
    assert router_config == built_generator._deployment_config.request_router_config
    if router_config.request_router_class == PREFIX_ROUTER:
        from folio.router.policy import PolicyConfig

        PolicyConfig(**router_config.request_router_kwargs)  # what the router's initialize_state does with them

    # The ingress admits what the generators can take at most: with autoscaling, max_replicas of them.
    autoscaling = generator.get("autoscaling_config")
    if autoscaling:
        assert generator["num_replicas"] == "auto"
        assert 0 <= autoscaling["min_replicas"] <= autoscaling["max_replicas"]
        assert autoscaling["target_ongoing_requests"] <= config.max_ongoing_requests
        largest_count = autoscaling["max_replicas"]
    else:
        assert generator["num_replicas"] == config.num_replicas
        largest_count = config.num_replicas
    # No override of the ingress: its admission limit and Serve options follow from the args (admission_limit).
    assert "Ingress" not in overrides
    assert config.resolved_admission_limit == largest_count * config.max_ongoing_requests


def test_serve_config_is_valid_and_matches_the_application():
    serve_config = load_yaml(SERVE_CONFIG)
    check_serve_config(serve_config)
    generator = serve_deployment(serve_config, "Generator")
    assert generator["request_router_config"]["request_router_class"] == PREFIX_ROUTER
    assert generator["ray_actor_options"]["num_gpus"] == 1


def test_serve_config_validation_imports_the_router_class():
    """A router the head cannot import fails validation (and so `serve deploy`), not the replicas later."""
    from ray.serve.schema import ServeDeploySchema

    serve_config = load_yaml(SERVE_CONFIG)
    serve_deployment(serve_config, "Generator")["request_router_config"]["request_router_class"] = \
        "folio.router.ray_router:NoSuchRouter"
    with pytest.raises(AttributeError, match="NoSuchRouter"):
        ServeDeploySchema.model_validate(serve_config)


# --- the Helm chart -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm():
    helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk (the test extra) renders the chart")
    helm_python.disable_logging()  # `fail` messages during lint are logged, not raised
    return helm_python


def render(helm, values: dict[str, Any], release: str = "folio") -> tuple[dict[str, Any], str]:
    """`helm install --dry-run=client`: the chart's one manifest (the RayService) and its NOTES."""
    release_info = helm.Config().install(CHART, release, values, dry_run="client", namespace="serving")
    documents = [d for d in yaml.safe_load_all(release_info["manifest"]) if d]
    assert len(documents) == 1
    return documents[0], release_info["notes"]


@pytest.fixture(scope="module")
def crd_validator():
    if not RAYSERVICE_CRD.is_file():
        pytest.skip(f"KubeRay's RayService CRD is not at {RAYSERVICE_CRD} (the shared folder beside the repository)")
    import jsonschema

    crd = yaml.load(RAYSERVICE_CRD.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(version["schema"]["openAPIV3Schema"])
    # The root metadata is an ObjectMeta the CRD leaves to the API server: check what the chart sets.
    label_value = {"type": "string", "maxLength": 63, "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
    schema["properties"]["metadata"] = {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {
            "name": {"type": "string", "maxLength": 63, "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": label_value},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    # OpenAPI v3.0 semantics (exclusiveMinimum is a boolean there), as Kubernetes applies them.
    return jsonschema.Draft4Validator(schema)


def strict_schema(schema: Any) -> Any:
    """A CRD's structural schema as a JSON schema that rejects what the API server would prune: objects without
    x-kubernetes-preserve-unknown-fields or additionalProperties get additionalProperties false;
    x-kubernetes-int-or-string becomes string-or-integer; nullable adds null."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) if k in ("items", "additionalProperties", "allOf", "anyOf", "oneOf", "not") else v
           for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if "properties" in schema:
        out["properties"] = {name: strict_schema(s) for name, s in schema["properties"].items()}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "string"}, {"type": "integer"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (schema.get("type") == "object" and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def check_rayservice(rayservice: dict[str, Any], crd_validator, release: str, grpc_port: int) -> dict[str, Any]:
    """Valid for KubeRay and Serve; returns the parsed serveConfigV2."""
    errors = sorted(crd_validator.iter_errors(rayservice), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    assert rayservice["kind"] == "RayService" and rayservice["metadata"]["name"] == release

    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in head_container["ports"]}
    assert ports["serve-grpc"] == grpc_port and "serve" in ports  # what <release>-serve-svc exposes
    assert cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    (worker_container,) = workers["template"]["spec"]["containers"]
    gpus_per_worker = worker_container["resources"]["limits"]["nvidia.com/gpu"]
    assert isinstance(gpus_per_worker, int) and gpus_per_worker >= 1

    assert isinstance(rayservice["spec"]["serveConfigV2"], str)  # a multi-line string holding the Serve YAML
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    check_serve_config(serve_config)
    # The worker pods can hold the generator fleet at its largest.
    generator = serve_deployment(serve_config, "Generator")
    autoscaling = generator.get("autoscaling_config")
    max_replicas = autoscaling["max_replicas"] if autoscaling else generator["num_replicas"]
    replicas_per_worker = gpus_per_worker // generator["ray_actor_options"]["num_gpus"]
    assert max_replicas <= workers["maxReplicas"] * replicas_per_worker
    return serve_config


def test_chart_lints_without_errors_or_warnings(helm):
    for values in ({}, load_yaml(AUTOSCALING_VALUES)):
        report = helm.lint(CHART, values, strict=True)
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error; 1 info is fine
        assert not report["errors"] and not problems, report


def test_chart_default_values_render_a_valid_rayservice(helm, crd_validator):
    rayservice, notes = render(helm, {}, release="folio")
    serve_config = check_rayservice(rayservice, crd_validator, "folio", grpc_port=50051)
    generator = serve_deployment(serve_config, "Generator")
    assert generator["num_replicas"] == 1 and "autoscaling_config" not in generator
    assert generator["request_router_config"]["request_router_class"] == PREFIX_ROUTER
    # The same application as deploy/serve.yaml, with a fixed fleet.
    reference = load_yaml(SERVE_CONFIG)
    assert serve_config["grpc_options"] == reference["grpc_options"]
    assert serve_config["applications"][0]["import_path"] == reference["applications"][0]["import_path"]
    # NOTES say where the gRPC endpoint is.
    assert "folio-serve-svc" in notes and "50051" in notes and "port-forward" in notes


def test_chart_tensor_parallel_replicas_take_a_gpu_a_rank(helm, crd_validator):
    values = {"generator": {"tensorParallelSize": 2, "gpusPerReplica": 2}, "workers": {"gpusPerWorker": 2}}
    rayservice, _ = render(helm, values)
    serve_config = check_rayservice(rayservice, crd_validator, "folio", grpc_port=50051)
    args = serve_config["applications"][0]["args"]
    assert args["tensor_parallel_size"] == 2 and args["num_gpus"] == 2
    assert serve_deployment(serve_config, "Generator")["ray_actor_options"]["num_gpus"] == 2
    # (check_rayservice validated args through ServeConfig.from_dict: the engine's own checks accept them)


def test_chart_worker_readiness_is_the_grpc_health_of_generation(helm, crd_validator):
    """Worker pods are ready while Serve's gRPC port answers grpc.health.v1.Health SERVING for folio.v1.Generation
    (Kubernetes' native gRPC probe); liveness and the head pod's probes stay KubeRay's."""
    def containers(values):
        rayservice, _ = render(helm, values)
        check_rayservice(rayservice, crd_validator, "folio", grpc_port=values.get("ports", {}).get("grpc", 50051))
        cluster = rayservice["spec"]["rayClusterConfig"]
        (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
        (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
        return head, worker

    head, worker = containers({"ports": {"grpc": 50071}})
    probe = worker["readinessProbe"]
    assert probe["grpc"] == {"port": 50071, "service": "folio.v1.Generation"}
    assert probe["timeoutSeconds"] >= 3  # a health check may wait up to 2 s for the generator replicas
    assert "livenessProbe" not in worker and "readinessProbe" not in head and "livenessProbe" not in head
    _, worker = containers({"grpcReadinessProbe": {"enabled": False, "periodSeconds": 5, "timeoutSeconds": 5,
                                                   "failureThreshold": 3}})
    assert "readinessProbe" not in worker  # KubeRay's default then


def test_chart_autoscaling_example_renders_a_valid_rayservice(helm, crd_validator):
    values = load_yaml(AUTOSCALING_VALUES)
    rayservice, notes = render(helm, values, release="llm")
    serve_config = check_rayservice(rayservice, crd_validator, "llm",
                                    grpc_port=values.get("ports", {}).get("grpc", 50051))
    app = serve_config["applications"][0]
    generator = serve_deployment(serve_config, "Generator")
    bounds = values["generator"]["autoscaling"]
    assert generator["autoscaling_config"]["min_replicas"] == bounds["minReplicas"]
    assert generator["autoscaling_config"]["max_replicas"] == bounds["maxReplicas"] > 1
    assert app["args"]["cache_tokens"] == values["cache"]["tokens"] and "cache_memory_fraction" not in app["args"]
    assert generator["request_router_config"]["request_router_kwargs"]["shortlist_size"] == 16
    (workers,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert workers["maxReplicas"] == values["workers"]["maxReplicas"]
    (container,) = workers["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert "llm-serve-svc" in notes and "application: llama" in notes


@pytest.mark.parametrize("drafter", [{"ngram": True}, {"draftPath": "/models/draft", "numDraftTokens": 6}])
def test_chart_passes_the_drafter_to_the_application(helm, crd_validator, drafter):
    rayservice, _ = render(helm, {"model": drafter})
    args = check_rayservice(rayservice, crd_validator, "folio", grpc_port=50051)["applications"][0]["args"]
    assert args.get("ngram", False) == drafter.get("ngram", False)
    assert args.get("draft_model_path") == drafter.get("draftPath")
    assert args["num_draft_tokens"] == drafter.get("numDraftTokens", 4)


def test_chart_passes_lora_adapters_to_the_application(helm, crd_validator):
    adapters = {"support": "/models/lora/support", "sql-v2": "/models/lora/sql"}
    rayservice, _ = render(helm, {"model": {"loraAdapters": adapters, "loraAdmin": True, "maxLoras": 4}})
    args = check_rayservice(rayservice, crd_validator, "folio", grpc_port=50051)["applications"][0]["args"]
    assert args["lora_adapters"] == adapters and args["lora_admin"] is True and args["max_loras"] == 4
    default_args = check_rayservice(render(helm, {})[0], crd_validator, "folio", grpc_port=50051)[
        "applications"][0]["args"]
    assert "lora_adapters" not in default_args and "lora_admin" not in default_args  # admin RPCs stay off


def test_chart_passes_memory_formats_to_the_application(helm, crd_validator):
    """model.weightFormat, cache.kvFormat and cache.hostCacheGiB become ServeConfig's weight_format, kv_format and
    host_cache_bytes (check_rayservice validates the args with ServeConfig.from_dict)."""
    def args_of(values):
        rayservice, _ = render(helm, values)
        return check_rayservice(rayservice, crd_validator, "folio", grpc_port=50051)["applications"][0]["args"]

    args = args_of({"model": {"weightFormat": "fp8"}, "cache": {"kvFormat": "q8", "hostCacheGiB": 0.5}})
    assert (args["weight_format"], args["kv_format"], args["host_cache_bytes"]) == ("fp8", "q8", 1 << 29)
    default = args_of({})
    assert "weight_format" not in default and "kv_format" not in default  # the checkpoint's, the model's dtype
    assert default["host_cache_bytes"] == 8 << 30 and isinstance(default["host_cache_bytes"], int)
    assert args_of({"cache": {"hostCacheGiB": 0}})["host_cache_bytes"] == 0  # off
    assert "host_cache_bytes" not in args_of({"cache": {"hostCacheGiB": None}})  # the engine's default
    assert "host_write_through" not in default  # copies as evicted
    assert "tensor_parallel_all_reduce" not in default  # auto
    tp = {"generator": {"tensorParallelSize": 2, "gpusPerReplica": 2, "tensorParallelAllReduce": "nccl"},
          "workers": {"gpusPerWorker": 2}}
    assert args_of(tp)["tensor_parallel_all_reduce"] == "nccl"
    assert args_of({"cache": {"hostWriteThrough": True}})["host_write_through"] is True
    # replicas per pod x hostCacheGiB + shmSize just fits the pod's limit: 8 x 5 + 8 = 48 GiB
    fits = args_of({"generator": {"replicas": 8}, "workers": {"gpusPerWorker": 8, "shmSize": "8Gi"},
                    "cache": {"hostCacheGiB": 5}})
    assert fits["host_cache_bytes"] == 5 << 30


@pytest.mark.parametrize("mode", ["direct", "proxy"])
def test_chart_gives_every_ray_pod_the_environment_of_its_ingress_mode(helm, crd_validator, mode):
    """Serve reads the ingress mode from each process's environment (folio.serve.ingress_mode): the head and the
    workers get the same variables, and the application the same mode."""
    from folio.serve.ingress_mode import cluster_env

    values = {} if mode == "direct" else {"serve": {"ingressMode": "proxy"}}
    rayservice, _ = render(helm, values)
    args = check_rayservice(rayservice, crd_validator, "folio", grpc_port=50051)["applications"][0]["args"]
    assert args["ingress_mode"] == mode
    cluster = rayservice["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        assert {e["name"]: e["value"] for e in container.get("env", [])} == cluster_env(mode)


@pytest.mark.parametrize("router", ["pow2", "ray_prefix"])
def test_chart_renders_each_router(helm, crd_validator, router):
    """The chart's router table and kwargs equal folio.serve.app's (check_serve_config compares them)."""
    rayservice, _ = render(helm, {"router": {"name": router}})
    check_rayservice(rayservice, crd_validator, "folio", grpc_port=50051)


def test_strict_crd_validation_rejects_unknown_and_mistyped_fields(helm, crd_validator):
    rayservice, _ = render(helm, {})
    unknown = copy.deepcopy(rayservice)
    unknown["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    assert not crd_validator.is_valid(unknown)
    mistyped = copy.deepcopy(rayservice)
    mistyped["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "4"
    assert not crd_validator.is_valid(mistyped)
    quantity = copy.deepcopy(rayservice)  # int-or-string: both forms are fine
    quantity["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
        "resources"]["limits"]["cpu"] = 8
    assert crd_validator.is_valid(quantity)


SCHEMA_VIOLATIONS = {
    "wrong type": {"generator": {"replicas": "two"}},
    "negative replicas": {"generator": {"replicas": -1}},
    "negative autoscaling bound": {"generator": {"autoscaling": {"maxReplicas": -4}}},
    "zero GPUs per worker": {"workers": {"gpusPerWorker": 0}},
    "unknown top-level key": {"replica": 2},
    "unknown nested key": {"cache": {"pagesize": 128}},
    "page size not a power of two": {"cache": {"pageSize": 100}},
    "cache fraction above 1": {"cache": {"memoryFraction": 1.5}},
    "port out of range": {"ports": {"grpc": 70000}},
    "unknown router": {"router": {"name": "round_robin"}},
    "unknown dtype": {"model": {"dtype": "int8"}},
    "GPUs given as a resource": {"workers": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
    "unknown auth mode": {"rayAuthMode": "basic"},
    "no draft tokens": {"model": {"numDraftTokens": 0}},
    "adapter name with a space": {"model": {"loraAdapters": {"my adapter": "/models/a"}}},
    "unknown weight format": {"model": {"weightFormat": "int8"}},
    "unknown KV format": {"cache": {"kvFormat": "q3"}},
    "q4h has no CUDA kernel": {"cache": {"kvFormat": "q4h"}},
    "negative host tier": {"cache": {"hostCacheGiB": -1}},
}


@pytest.mark.parametrize("values", SCHEMA_VIOLATIONS.values(), ids=SCHEMA_VIOLATIONS.keys())
def test_values_violating_the_schema_are_rejected(helm, values):
    with pytest.raises(helm.HelmError, match="values don't meet the specifications of the schema"):
        render(helm, values)
    assert helm.lint(CHART, values)["errors"]


CROSS_VALUE_VIOLATIONS = {
    "autoscaling min above max": ({"generator": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
                                   "workers": {"maxReplicas": 8}}, "minReplicas (5) exceeds maxReplicas (2)"),
    "workers too few for the generators": ({"generator": {"replicas": 3}}, "cannot hold 3 generator replicas"),
    "fractional GPUs above 1": ({"generator": {"gpusPerReplica": 1.5}, "workers": {"gpusPerWorker": 2}},
                                "must be a whole number"),
    "cache tokens not whole pages": ({"cache": {"tokens": 1000}}, "multiple of cache.pageSize"),
    "ports clash": ({"ports": {"http": 50051}}, "ports: must all differ"),
    "two drafters": ({"model": {"ngram": True, "draftPath": "/models/d"}}, "exclude each other"),
    "tensor parallel without a GPU a rank": ({"generator": {"tensorParallelSize": 2}}, "takes one GPU a rank"),
    "host tier beyond the pod's memory": ({"generator": {"replicas": 8}, "workers": {"gpusPerWorker": 8,
                                                                                      "shmSize": "8Gi"},
                                           "cache": {"hostCacheGiB": 6}},
                                          "8 generator replicas per worker pod x 6 GiB of pinned host memory plus "
                                          "workers.shmSize (8Gi) exceed workers.resources.limits.memory (48Gi)"),
}


@pytest.mark.parametrize("values, message", CROSS_VALUE_VIOLATIONS.values(), ids=CROSS_VALUE_VIOLATIONS.keys())
def test_values_inconsistent_with_each_other_are_rejected(helm, values, message):
    """Checks values.schema.json cannot express (templates/_helpers.tpl's folio.validate): install fails."""
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(helm, values)
