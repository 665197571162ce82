"""TFJob manifests: their shape, the TFJob CRD's schema, argument checks, submit."""

import copy
import os
import pathlib
import re
import subprocess
import sys

import jsonschema
import kubernetes
import pytest
import yaml
from kubeflow.training import TrainingClient, models
from kubeflow.training.utils import utils as training_utils

from helpers import run_tfdist
from tfdist.cluster.release_memory import RELEASE_MEMORY_ENV
from tfdist.cluster.tfjob import TFJobManifest, submit, tfjob
from tfdist.config import ParallelConfig

CRD = pathlib.Path(__file__).parents[1] / "data" / "kubeflow.org_tfjobs.yaml"
IMAGE = "tensorflow/tensorflow:2.20.0"
COMMAND = ["python", "train.py"]
DIGEST = "sha256:" + "0123456789abcdef" * 4


def json_schema(node):
    """A CRD's OpenAPI v3 schema as JSON Schema, strict about unknown fields.

    Drops the `x-kubernetes-*` keys, admits an integer or a string where
    `x-kubernetes-int-or-string` is set, and forbids fields a schema does not
    list (as kubectl's strict field validation does) unless it preserves them.
    """
    schema = {
        key: value for key, value in node.items() if not key.startswith("x-kubernetes-")
    }
    if node.get("x-kubernetes-int-or-string"):
        schema.pop("anyOf", None)
        schema["type"] = ["integer", "string"]
    if "properties" in schema:
        schema["properties"] = {
            name: json_schema(sub) for name, sub in schema["properties"].items()
        }
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = json_schema(schema["additionalProperties"])
    if "items" in schema:
        schema["items"] = json_schema(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [json_schema(sub) for sub in schema[key]]
    if "not" in schema:
        schema["not"] = json_schema(schema["not"])
    return schema


@pytest.fixture(scope="module")
def validator():
    crd = yaml.safe_load(CRD.read_text())
    schema = json_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def replica_specs(manifest):
    return manifest.to_dict()["spec"]["tfReplicaSpecs"]


def container(manifest, replica_type):
    (only,) = replica_specs(manifest)[replica_type]["template"]["spec"]["containers"]
    return only


def env(manifest, replica_type):
    variables = container(manifest, replica_type)["env"]
    return {variable["name"]: variable["value"] for variable in variables}


SHAPES = {
    "single worker": dict(),
    "chief and 2 workers": dict(chief=True, workers=2),
    "chief, workers, ps, evaluator": dict(chief=True, workers=3, ps=2, evaluator=True),
    "gpus": dict(chief=True, workers=2, gpus_per_worker=4),
    "everything": dict(
        namespace="team-a", chief=True, workers=2, ps=1, evaluator=True,
        gpus_per_worker=1, cpu="500m", memory="4Gi",
        config=ParallelConfig(data=2, microbatches=4, precision="mixed_bfloat16"),
        logdir="gs://bucket/logs", profiler_port=6009, restart_policy="ExitCode",
        backoff_limit=3, clean_pod_policy="All", port=3333,
        env={"MALLOC_ARENA_MAX": "2", "TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1"},
    ),
}


@pytest.mark.parametrize("kwargs", SHAPES.values(), ids=SHAPES.keys())
def test_manifest_matches_the_tfjob_crd(validator, kwargs):
    manifest = tfjob("mnist", IMAGE, COMMAND, **kwargs)
    validator.validate(manifest.to_dict())
    assert yaml.safe_load(manifest.to_yaml()) == manifest.to_dict()


def test_validator_rejects_unknown_fields_and_wrong_types(validator):
    good = tfjob("mnist", IMAGE, COMMAND).to_dict()
    validator.validate(good)

    unknown = copy.deepcopy(good)
    unknown["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "imagePullPolicyy"] = "Always"
    with pytest.raises(jsonschema.ValidationError, match="imagePullPolicyy"):
        validator.validate(unknown)

    unknown_top = copy.deepcopy(good)
    unknown_top["spec"]["workers"] = 2
    with pytest.raises(jsonschema.ValidationError, match="workers"):
        validator.validate(unknown_top)

    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type"):
        validator.validate(wrong_type)


def test_single_worker_shape():
    manifest = tfjob("mnist", IMAGE, COMMAND)
    assert isinstance(manifest, TFJobManifest)
    assert isinstance(manifest.job, models.KubeflowOrgV1TFJob)
    data = manifest.to_dict()
    assert data["apiVersion"] == "kubeflow.org/v1"
    assert data["kind"] == "TFJob"
    assert data["metadata"] == {
        "labels": {"app.kubernetes.io/managed-by": "tfdist"},
        "name": "mnist",
        "namespace": "default",
    }
    assert data["spec"]["runPolicy"] == {"cleanPodPolicy": "Running"}
    assert list(data["spec"]["tfReplicaSpecs"]) == ["Worker"]
    worker = data["spec"]["tfReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 1
    assert worker["restartPolicy"] == "OnFailure"
    assert worker["template"]["spec"]["containers"] == [{
        "command": COMMAND,
        "image": IMAGE,
        "name": "tensorflow",
        "ports": [{"containerPort": 2222, "name": "tfjob-port"}],
        "resources": {},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }]
    assert manifest.to_yaml().startswith("apiVersion: kubeflow.org/v1\nkind: TFJob\n")


def test_the_command_reaches_the_pod_as_typed():
    # Kubernetes expands $(VAR) in a container's command from its environment,
    # and reads $$ as $: every $ is doubled so the pod runs what was typed.
    typed = ["python", "train.py", "--name=$(HOSTNAME)", "--price=$5", "--odd=$$(X)"]
    container = tfjob("mnist", IMAGE, typed).to_dict()[
        "spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == [
        "python", "train.py", "--name=$$(HOSTNAME)", "--price=$$5", "--odd=$$$$(X)"]


def test_replica_types_and_counts():
    manifest = tfjob(
        "mnist", IMAGE, COMMAND, chief=True, workers=3, ps=2, evaluator=True
    )
    specs = replica_specs(manifest)
    assert {kind: spec["replicas"] for kind, spec in specs.items()} == {
        "Chief": 1, "Worker": 3, "PS": 2, "Evaluator": 1,
    }


def test_everything_reaches_every_replica():
    manifest = tfjob("mnist", IMAGE, COMMAND, **SHAPES["everything"])
    specs = replica_specs(manifest)
    assert manifest.to_dict()["spec"]["runPolicy"] == {
        "backoffLimit": 3, "cleanPodPolicy": "All",
    }
    assert manifest.to_dict()["metadata"]["namespace"] == "team-a"
    for kind, spec in specs.items():
        assert spec["restartPolicy"] == "ExitCode"
        variables = env(manifest, kind)
        assert (ParallelConfig.from_json(variables["TFDIST_CONFIG"])
                == SHAPES["everything"]["config"])
        assert variables["TFDIST_LOGDIR"] == "gs://bucket/logs"
        assert variables["TFDIST_PROFILER_PORT"] == "6009"
        assert variables["MALLOC_ARENA_MAX"] == "2"
        assert variables["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] == "1"
        assert container(manifest, kind)["ports"] == [
            {"containerPort": 3333, "name": "tfjob-port"},
            {"containerPort": 6009, "name": "tfdist-profiler"},
        ]
        assert container(manifest, kind)["resources"]["requests"] == {
            "cpu": "500m", "memory": "4Gi",
        }


def test_config_dict_becomes_a_parallel_config(monkeypatch):
    manifest = tfjob("mnist", IMAGE, COMMAND, config={"data": 4, "microbatches": 2})
    monkeypatch.setenv("TFDIST_CONFIG", env(manifest, "Worker")["TFDIST_CONFIG"])
    assert ParallelConfig.from_env() == ParallelConfig(data=4, microbatches=2)


def test_gpus_only_on_chief_and_workers():
    manifest = tfjob(
        "mnist", IMAGE, COMMAND, chief=True, workers=2, ps=1, evaluator=True,
        gpus_per_worker=2, cpu="2",
    )
    for kind in ("Chief", "Worker"):
        assert container(manifest, kind)["resources"] == {
            "limits": {"cpu": "2", "nvidia.com/gpu": "2"},
            "requests": {"cpu": "2"},
        }
    for kind in ("PS", "Evaluator"):
        assert container(manifest, kind)["resources"] == {
            "limits": {"cpu": "2"}, "requests": {"cpu": "2"},
        }


def test_replicas_do_not_share_model_objects():
    manifest = tfjob("mnist", IMAGE, COMMAND, chief=True, config=ParallelConfig())
    chief, worker = (
        spec.template.spec.containers[0]
        for spec in manifest.job.spec.tf_replica_specs.values()
    )
    chief.env.clear()
    assert env(manifest, "Worker")


@pytest.mark.parametrize("image", [
    IMAGE,
    "localhost:5000/img:1",
    "registry.example.com:443/team/train@" + DIGEST,
    "gcr.io/project/train:v1.2-gpu@" + DIGEST,
    "train_image:latest",
])
def test_pinned_images_are_accepted(image):
    assert container(tfjob("mnist", image, COMMAND), "Worker")["image"] == image


def test_longest_name_that_fits(validator):
    # '-evaluator-0' is the longest suffix of this job: 12 characters.
    manifest = tfjob("a" * 51, IMAGE, COMMAND, chief=True, evaluator=True)
    validator.validate(manifest.to_dict())
    # A one-worker job's longest suffix is '-worker-0': 9 characters.
    tfjob("a" * 54, IMAGE, COMMAND)


BAD_IMAGE = "`image` must be a container image reference"
BAD_NAME = "`name` must be an RFC 1035 label"
BAD_NAMESPACE = "`namespace` must be an RFC 1123 label"
BAD_QUANTITY = "must be a positive Kubernetes quantity"
BAD_INPUTS = [
    # (arguments, error, message: a regular expression)
    (dict(workers=0), ValueError, "`workers` must be an int >= 1, got 0."),
    (dict(workers=1.5), TypeError, "`workers` must be an int, got 1.5 of type float."),
    (dict(workers=True), TypeError, "`workers` must be an int, got True of type bool."),
    (dict(ps=-1), ValueError, "`ps` must be an int >= 0, got -1."),
    (dict(gpus_per_worker=-2), ValueError,
     "`gpus_per_worker` must be an int >= 0, got -2."),
    (dict(chief="yes"), TypeError, "`chief` must be a bool, got 'yes'"),
    (dict(evaluator=1), TypeError, "`evaluator` must be a bool, got 1"),
    (dict(image="tensorflow/tensorflow"), ValueError,
     "`image` 'tensorflow/tensorflow' has no tag or digest: add ':<tag>'"),
    (dict(image="localhost:5000/img"), ValueError,
     "`image` 'localhost:5000/img' has no tag or digest"),
    (dict(image="Tensorflow/tensorflow:2.20.0"), ValueError,
     BAD_IMAGE + " \\(\\[registry/\\]path, the path in lower case"),
    (dict(image="tensorflow:2.20 gpu"), ValueError, BAD_IMAGE),
    (dict(image=""), ValueError, BAD_IMAGE),
    (dict(image="img@sha256:short"), ValueError, BAD_IMAGE),
    (dict(name="My-Job"), ValueError, BAD_NAME + ".* got 'My-Job'"),
    (dict(name="1job"), ValueError, BAD_NAME + ".*starting with a letter"),
    (dict(name="job-"), ValueError, BAD_NAME + ".* got 'job-'"),
    (dict(name="my_job"), ValueError,
     "because the training operator names the job's pods and services after it"),
    (dict(name="my.job"), ValueError, BAD_NAME),
    (dict(name=""), ValueError, BAD_NAME),
    (dict(name="a" * 52, evaluator=True), ValueError,
     "`name` 'a{52}' is too long for this job: .*'<name>-<replica type>-<index>'.* "
     "at most 63 characters, and 'a{52}-evaluator-0' has 64; use a name of at most "
     "51 characters."),
    (dict(name="a" * 55), ValueError,
     "'a{55}-worker-0' has 64; use a name of at most 54"),
    (dict(name="a" * 54, workers=11), ValueError,
     "'a{54}-worker-10' has 64; use a name of at most 53"),
    (dict(namespace="Team-A"), ValueError, BAD_NAMESPACE + ".* got 'Team-A'"),
    (dict(namespace="-team"), ValueError, BAD_NAMESPACE),
    (dict(namespace="team.a"), ValueError, BAD_NAMESPACE),
    (dict(namespace="a" * 64), ValueError, BAD_NAMESPACE + " \\(at most 63"),
    (dict(command=[]), ValueError, "`command` must not be empty"),
    (dict(command="python train.py"), TypeError,
     "`command` must be a list of strings .* got 'python train.py'"),
    (dict(command=["python", 1]), TypeError, "`command` must be a list of strings"),
    (dict(port=0), ValueError, "`port` must be an int in 1..65535, got 0."),
    (dict(port=65536), ValueError, "`port` must be an int in 1..65535, got 65536."),
    (dict(port="2222"), TypeError, "`port` must be an int, got '2222' of type str."),
    (dict(profiler_port=70000), ValueError,
     "`profiler_port` must be an int in 1..65535, got 70000."),
    (dict(profiler_port=2222), ValueError,
     "`profiler_port` must differ from `port`: both are 2222."),
    (dict(restart_policy="onFailure"), ValueError,
     "`restart_policy` must be one of \\('OnFailure', 'Never', 'Always', "
     "'ExitCode'\\), got 'onFailure'."),
    (dict(clean_pod_policy="none"), ValueError,
     "`clean_pod_policy` must be one of \\('None', 'Running', 'All'\\), got 'none'."),
    (dict(clean_pod_policy=None), ValueError, "`clean_pod_policy` must be one of"),
    (dict(backoff_limit=-1), ValueError,
     "`backoff_limit` must be an int >= 0, got -1."),
    (dict(cpu="2 cores"), ValueError,
     "`cpu` must be a positive Kubernetes quantity such as '2', '500m' or '4Gi', "
     "got '2 cores'."),
    (dict(cpu="-1"), ValueError, "`cpu` " + BAD_QUANTITY),
    (dict(cpu="0"), ValueError, "`cpu` " + BAD_QUANTITY),
    (dict(cpu=0.5), ValueError, "`cpu` " + BAD_QUANTITY + ".* got 0.5"),
    (dict(memory="4GB"), ValueError, "`memory` " + BAD_QUANTITY),
    (dict(memory="4ki"), ValueError, "`memory` " + BAD_QUANTITY),
    (dict(memory="1_000"), ValueError, "`memory` " + BAD_QUANTITY),
    (dict(config=5), TypeError, "`config` must be a ParallelConfig or a dict"),
    (dict(config={"data": 0}), ValueError, "`data` must be an int >= 1, got 0."),
    (dict(config={"dta": 2}), ValueError, "Unknown ParallelConfig field"),
    (dict(logdir=""), ValueError, "`logdir` must be a non-empty string, got ''."),
    (dict(env=["A=1"]), TypeError, "`env` must be a dict of strings to strings"),
    (dict(env={"A": 1}), TypeError, "`env` must be a dict of strings to strings"),
    (dict(env={"1A": "x"}), ValueError, "`env` has '1A', not an environment variable name"),
    (dict(env={"TF_CONFIG": "{}"}), ValueError,
     "`env` has 'TF_CONFIG', which the job sets itself: the training operator writes it."),
    (dict(env={"TFDIST_CONFIG": "{}"}), ValueError, "which the job sets itself: pass `config`"),
    (dict(release_memory="yes"), ValueError, "`release_memory` must be True or False"),
]


@pytest.mark.parametrize(
    "kwargs, error, message", BAD_INPUTS,
    ids=[repr(case[0])[:60] for case in BAD_INPUTS],
)
def test_bad_input_is_refused_with_a_clear_message(kwargs, error, message):
    arguments = dict(name="mnist", image=IMAGE, command=COMMAND) | kwargs
    name, image, command = (arguments.pop(key) for key in ("name", "image", "command"))
    with pytest.raises(error, match=message):
        tfjob(name, image, command, **arguments)


def test_quantities_accept_ints_and_kubernetes_suffixes():
    manifest = tfjob("mnist", IMAGE, COMMAND, cpu=4, memory="1.5Gi")
    assert container(manifest, "Worker")["resources"]["limits"] == {
        "cpu": "4", "memory": "1.5Gi",
    }


class RecordingClient:
    def __init__(self):
        self.calls = []

    def create_job(self, **kwargs):
        self.calls.append(kwargs)


def test_submit_passes_the_sdk_model_and_namespace():
    manifest = tfjob("mnist", IMAGE, COMMAND, namespace="team-a", workers=2)
    client = RecordingClient()
    assert submit(manifest, training_client=client) is manifest.job
    assert client.calls == [{"job": manifest.job, "namespace": "team-a"}]
    assert isinstance(client.calls[0]["job"], models.KubeflowOrgV1TFJob)


def test_submit_through_the_sdk_training_client():
    """The SDK's own create_job accepts the job and posts it as a TFJob."""
    posted = []

    class CustomObjectsApi:
        def create_namespaced_custom_object(self, *args):
            posted.append(args)

    training_client = TrainingClient(
        client_configuration=kubernetes.client.Configuration(), job_kind="TFJob"
    )
    training_client.custom_api = CustomObjectsApi()
    manifest = tfjob("mnist", IMAGE, COMMAND, namespace="team-a")
    submit(manifest, training_client=training_client)
    assert posted == [("kubeflow.org", "v1", "team-a", "tfjobs", manifest.job)]


def test_submit_without_kubeconfig_names_it(monkeypatch, tmp_path):
    monkeypatch.setattr(
        kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
        str(tmp_path / "missing-kubeconfig"),
    )
    monkeypatch.setattr(training_utils, "is_running_in_k8s", lambda: False)
    manifest = tfjob("mnist", IMAGE, COMMAND)
    with pytest.raises(RuntimeError, match=re.escape(
        "Cannot submit TFJob 'mnist': no Kubernetes credentials (Invalid kube-config "
        "file. No configuration found.). Point $KUBECONFIG"
    )):
        submit(manifest)


def test_submit_refuses_other_objects():
    with pytest.raises(TypeError, match="`manifest` must be a TFJobManifest"):
        submit(
            tfjob("mnist", IMAGE, COMMAND).to_dict(), training_client=RecordingClient()
        )


# The `tfdist tfjob` command and the example manifests.

EXAMPLES = pathlib.Path(__file__).parents[2] / "keras_examples" / "tfjob"


def test_cli_prints_a_manifest_that_matches_the_crd(validator):
    done = run_tfdist("tfjob", "--name=digits", f"--image={IMAGE}", "--chief",
                      "--workers=2", "--ps=1", "--evaluator", "--gpus-per-worker=1",
                      "--profiler-port=6009", "--microbatches=2",
                      "--env=MALLOC_ARENA_MAX=2,TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1", "--", *COMMAND)
    assert done.returncode == 0, done.stderr
    manifest = yaml.safe_load(done.stdout)
    validator.validate(manifest)
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert list(specs) == ["Chief", "Worker", "PS", "Evaluator"]
    (worker,) = specs["Worker"]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert {"name": "tfdist-profiler", "containerPort": 6009} in worker["ports"]
    assert worker["env"][-2:] == [{"name": "MALLOC_ARENA_MAX", "value": "2"},
                                  {"name": "TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "value": "1"}]


def test_release_memory_adds_the_allocator_settings_and_env_wins():
    manifest = tfjob("mnist", IMAGE, COMMAND, workers=2, release_memory=True,
                     env={"MALLOC_ARENA_MAX": "4"})
    assert env(manifest, "Worker") == {**RELEASE_MEMORY_ENV, "MALLOC_ARENA_MAX": "4"}
    assert not container(tfjob("mnist", IMAGE, COMMAND), "Worker").get("env")
    done = run_tfdist("tfjob", "--name=digits", f"--image={IMAGE}", "--release_memory",
                      "--", *COMMAND)
    assert done.returncode == 0, done.stderr
    (worker,) = yaml.safe_load(done.stdout)["spec"]["tfReplicaSpecs"]["Worker"]["template"][
        "spec"]["containers"]
    assert {v["name"]: v["value"] for v in worker["env"]} == RELEASE_MEMORY_ENV


@pytest.mark.parametrize("args, message", [
    (["--name=digits", "--image=tensorflow/tensorflow"], "has no tag or digest"),
    (["--name=Digits_1", f"--image={IMAGE}"], "`name` must be an RFC 1035 label"),
    (["--name=digits", f"--image={IMAGE}", "--workers=0"], "`workers` must be an int >= 1"),
    (["--name=digits", f"--image={IMAGE}", "--env=MALLOC_ARENA_MAX"],
     "`tfdist tfjob --env` takes NAME=VALUE items, got 'MALLOC_ARENA_MAX'."),
])
def test_cli_bad_input(args, message):
    done = run_tfdist("tfjob", *args, "--", *COMMAND)
    assert done.returncode == 2 and message in done.stderr
    assert done.stdout == ""


def test_cli_submit_without_a_cluster_says_so(tmp_path):
    env = dict(os.environ, KUBECONFIG=str(tmp_path / "missing"), HOME=str(tmp_path))
    done = run_tfdist("tfjob", "--name=digits", f"--image={IMAGE}", "--submit", "--",
                      *COMMAND, env=env)
    assert done.returncode == 1
    assert "Cannot submit TFJob 'digits': no Kubernetes credentials" in done.stderr


def test_example_manifests_are_up_to_date(validator):
    done = subprocess.run([sys.executable, str(EXAMPLES / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in EXAMPLES.glob("*.yaml"):
        validator.validate(yaml.safe_load(path.read_text()))


def test_importing_the_cluster_tools_leaves_the_kubernetes_sdks_unloaded():
    # Every task of a job imports tfdist.cluster (TF_CONFIG, rendezvous): the
    # Kubernetes and Kubeflow SDKs, half a second, load with a manifest only.
    code = ("import sys, tfdist.cluster\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'kubernetes', 'kubeflow'}))\n"
            "tfdist.cluster.tfjob('demo', 'image:1.0', ['python'])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'kubernetes', 'kubeflow'}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.splitlines() == ["[]", "['kubeflow', 'kubernetes']"]
