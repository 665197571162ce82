"""Kubeflow TFJob manifests: run a tfdist training script on Kubernetes.

The Kubeflow training operator turns a TFJob into one pod and one service per
replica and gives every pod its `TF_CONFIG`, which `tfdist.MultiWorkerStrategy`
reads. `tfjob()` builds the manifest from the Kubeflow and Kubernetes SDK models,
after checking every argument, so a mistake is reported here rather than by the
cluster; `submit()` creates the job with the Kubeflow training SDK.

Example:

```python
from tfdist import ParallelConfig
from tfdist.cluster import submit, tfjob

manifest = tfjob(
    "mnist", "registry.example.com/mnist:1.0", ["python", "train.py"],
    workers=4, gpus_per_worker=1, config=ParallelConfig(microbatches=2),
)
print(manifest.to_yaml())   # for `kubectl apply -f -`
submit(manifest)            # or create it with the current kubeconfig
```
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import yaml

from tfdist.cluster.release_memory import release_memory_env
from tfdist.cluster.tf_config import TF_CONFIG_ENV, check_task_counts
from tfdist.config import CONFIG_ENV, LOGDIR_ENV, PROFILER_PORT_ENV, ParallelConfig

if TYPE_CHECKING:
    from kubeflow.training import models
# The Kubernetes and Kubeflow SDKs load when a manifest is made or submitted:
# importing them takes half a second, which every process that imports
# `tfdist.cluster` (each task of a job) would otherwise pay.

API_VERSION = "kubeflow.org/v1"
KIND = "TFJob"
# The operator finds the TensorFlow container, and the port it writes into
# TF_CONFIG, by these names.
CONTAINER_NAME = "tensorflow"
PORT_NAME = "tfjob-port"
PROFILER_PORT_NAME = "tfdist-profiler"
MANAGED_BY_LABEL = {"app.kubernetes.io/managed-by": "tfdist"}

RESTART_POLICIES = ("OnFailure", "Never", "Always", "ExitCode")
CLEAN_POD_POLICIES = ("None", "Running", "All")
# Replica types that train, and so get the GPUs.
GPU_REPLICA_TYPES = ("Chief", "Worker")

# Kubernetes' name grammars (k8s.io/apimachinery/pkg/util/validation).
_RFC1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_MAX_LABEL_LENGTH = 63
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables a replica gets from the operator or from tfjob's own arguments.
_SET_ENV = {TF_CONFIG_ENV: "the training operator writes it",
            CONFIG_ENV: "pass `config`", LOGDIR_ENV: "pass `logdir`",
            PROFILER_PORT_ENV: "pass `profiler_port`"}
_QUANTITY = re.compile(
    r"[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?(\d+(\.\d*)?|\.\d+))?"
)
# A container image reference ([registry/]path[:tag][@digest]), as Docker parses
# it: the first component is a registry only if it has a '.' or a port, or is
# 'localhost'.
_IMAGE = re.compile(
    r"""
    (?:(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+(?::\d+)?|[A-Za-z0-9-]+:\d+|localhost)/)?
    [a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*
    (?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*
    (?::(?P<tag>\w[\w.-]{0,127}))?
    (?:@(?P<digest>
        [A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}
    ))?
    """,
    re.VERBOSE,
)


class TFJobManifest:
    """A TFJob, as the Kubeflow SDK model `job`, ready to write out or submit.

    Example:

    >>> manifest = tfjob("demo", "tensorflow/tensorflow:2.20.0", ["python", "train.py"])
    >>> manifest.to_dict()["kind"]
    'TFJob'
    >>> print(manifest.to_yaml().splitlines()[0])
    apiVersion: kubeflow.org/v1
    """

    def __init__(self, job: models.KubeflowOrgV1TFJob):
        self.job = job

    def to_dict(self) -> dict:
        """The manifest as plain JSON-compatible data, in Kubernetes' field names.

        Example:

        >>> tfjob("demo", "tensorflow/tensorflow:2.20.0", ["python"]).to_dict()[
        ...     "spec"]["tfReplicaSpecs"]["Worker"]["replicas"]
        1
        """
        import kubernetes

        with kubernetes.client.ApiClient() as api_client:
            return api_client.sanitize_for_serialization(self.job)

    def to_yaml(self) -> str:
        """The manifest as YAML, for `kubectl apply -f`.

        Example:

        >>> manifest = tfjob("demo", "tensorflow/tensorflow:2.20.0", ["python"])
        >>> "kind: TFJob" in manifest.to_yaml()
        True
        """
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def tfjob(
    name: str,
    image: str,
    command: list[str],
    *,
    namespace: str = "default",
    chief: bool = False,
    workers: int = 1,
    ps: int = 0,
    evaluator: bool = False,
    gpus_per_worker: int = 0,
    cpu: str | int | None = None,
    memory: str | int | None = None,
    config: ParallelConfig | dict | None = None,
    logdir: str | None = None,
    profiler_port: int | None = None,
    restart_policy: str = "OnFailure",
    backoff_limit: int | None = None,
    clean_pod_policy: str = "Running",
    port: int = 2222,
    env: dict[str, str] | None = None,
    release_memory: bool = False,
) -> TFJobManifest:
    """Builds a Kubeflow TFJob that runs `command` in `image` on every replica.

    Every argument is checked first; a bad one raises `TypeError` or
    `ValueError` naming it, the value and what would be valid.

    Every replica runs one container named `tensorflow` listening on `port`
    (named `tfjob-port`, which the operator writes into `TF_CONFIG`), with an
    unprivileged security context: the image must run as a non-root user.

    Args:
        name: the job's name, an RFC 1035 label short enough for the operator's
            pod and service names `<name>-<replica type>-<index>` (63 chars).
        image: the container image, pinned with a tag or a digest.
        command: the container's command, a list such as `["python", "train.py"]`.
        namespace: the Kubernetes namespace of the job.
        chief: add one `Chief` replica (task type "chief" in `TF_CONFIG`).
        workers: number of `Worker` replicas, >= 1.
        ps: number of `PS` (parameter server) replicas.
        evaluator: add one `Evaluator` replica.
        gpus_per_worker: `nvidia.com/gpu` limit of each Chief and Worker replica.
        cpu: CPU request and limit of every replica, e.g. `"2"` or `"500m"`.
        memory: memory request and limit of every replica, e.g. `"4Gi"`.
        config: a `ParallelConfig` (or its dict), passed to every replica as
            JSON in `$TFDIST_CONFIG` (read it with `ParallelConfig.from_env()`).
        logdir: passed to every replica in `$TFDIST_LOGDIR`.
        profiler_port: passed in `$TFDIST_PROFILER_PORT` and exposed as the
            container port `tfdist-profiler`.
        restart_policy: what the operator does when a replica fails: one of
            "OnFailure", "Never", "Always", "ExitCode".
        backoff_limit: retries before the job is marked failed.
        clean_pod_policy: which pods are deleted when the job ends: one of
            "None", "Running", "All".
        port: the port TensorFlow's servers listen on.
        env: more environment variables of every replica's container
            ({name: value}), e.g. an allocator's settings; not `TF_CONFIG`
            (the operator's) nor the variables the arguments above set.
        release_memory: add the allocator settings under which every replica
            gives freed memory back to the system
            (`tfdist.cluster.release_memory`): a lower peak per worker, slower
            steps. A variable also in `env` takes `env`'s value.

    Returns:
        A `TFJobManifest`.

    Example:

    >>> manifest = tfjob(
    ...     "mnist", "tensorflow/tensorflow:2.20.0", ["python", "train.py"],
    ...     chief=True, workers=2, config={"microbatches": 2})
    >>> list(manifest.to_dict()["spec"]["tfReplicaSpecs"])
    ['Chief', 'Worker']
    >>> manifest = tfjob("mnist", "tensorflow/tensorflow:2.20.0", ["python", "train.py"],
    ...                  env={"MALLOC_ARENA_MAX": "2"})
    >>> manifest.to_dict()["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"][
    ...     "containers"][0]["env"]
    [{'name': 'MALLOC_ARENA_MAX', 'value': '2'}]
    """
    check_task_counts(chief=chief, workers=workers, ps=ps, evaluator=evaluator)
    replicas = {"Chief": int(chief), "Worker": workers, "PS": ps,
                "Evaluator": int(evaluator)}
    replicas = {kind: count for kind, count in replicas.items() if count}
    _check_name(name, replicas)
    _check_namespace(namespace)
    _check_image(image)
    _check_command(command)
    _check_int("gpus_per_worker", gpus_per_worker, minimum=0)
    quantities = {
        resource: _check_quantity(resource, value)
        for resource, value in (("cpu", cpu), ("memory", memory))
        if value is not None
    }
    config = _check_config(config)
    if logdir is not None and (not isinstance(logdir, str) or not logdir):
        raise ValueError(f"`logdir` must be a non-empty string, got {logdir!r}.")
    _check_int("port", port, minimum=1, maximum=65535)
    if profiler_port is not None:
        _check_int("profiler_port", profiler_port, minimum=1, maximum=65535)
        if profiler_port == port:
            raise ValueError(
                f"`profiler_port` must differ from `port`: both are {port}."
            )
    _check_choice("restart_policy", restart_policy, RESTART_POLICIES)
    _check_choice("clean_pod_policy", clean_pod_policy, CLEAN_POD_POLICIES)
    if backoff_limit is not None:
        _check_int("backoff_limit", backoff_limit, minimum=0)
    env = _check_env(env)
    if not isinstance(release_memory, bool):
        raise ValueError(f"`release_memory` must be True or False, got {release_memory!r}.")
    if release_memory:
        env = {**env, **release_memory_env(env)}

    import kubernetes
    from kubeflow.training import models

    client = kubernetes.client

    def replica_spec(kind, count):
        variables = []
        if config is not None:
            variables.append(client.V1EnvVar(name=CONFIG_ENV, value=config.to_json()))
        if logdir is not None:
            variables.append(client.V1EnvVar(name=LOGDIR_ENV, value=logdir))
        ports = [client.V1ContainerPort(name=PORT_NAME, container_port=port)]
        if profiler_port is not None:
            variables.append(
                client.V1EnvVar(name=PROFILER_PORT_ENV, value=str(profiler_port))
            )
            ports.append(client.V1ContainerPort(
                name=PROFILER_PORT_NAME, container_port=profiler_port
            ))
        variables += [client.V1EnvVar(name=k, value=v) for k, v in env.items()]
        limits = dict(quantities)
        if gpus_per_worker and kind in GPU_REPLICA_TYPES:
            limits["nvidia.com/gpu"] = str(gpus_per_worker)
        container = client.V1Container(
            name=CONTAINER_NAME,
            image=image,
            # Kubernetes expands `$(VAR)` in a command with the container's
            # environment; `$$` is its escape for `$`: the pod runs what was typed.
            command=[part.replace("$", "$$") for part in command],
            env=variables or None,
            ports=ports,
            resources=client.V1ResourceRequirements(
                requests=dict(quantities) or None, limits=limits or None
            ),
            security_context=client.V1SecurityContext(
                allow_privilege_escalation=False,
                run_as_non_root=True,
                capabilities=client.V1Capabilities(drop=["ALL"]),
                seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"),
            ),
        )
        return models.KubeflowOrgV1ReplicaSpec(
            replicas=count,
            restart_policy=restart_policy,
            template=client.V1PodTemplateSpec(
                spec=client.V1PodSpec(containers=[container])
            ),
        )

    job = models.KubeflowOrgV1TFJob(
        api_version=API_VERSION,
        kind=KIND,
        metadata=client.V1ObjectMeta(
            name=name, namespace=namespace, labels=dict(MANAGED_BY_LABEL)
        ),
        spec=models.KubeflowOrgV1TFJobSpec(
            tf_replica_specs={
                kind: replica_spec(kind, count) for kind, count in replicas.items()
            },
            run_policy=models.KubeflowOrgV1RunPolicy(
                clean_pod_policy=clean_pod_policy, backoff_limit=backoff_limit
            ),
        ),
    )
    return TFJobManifest(job)


def submit(
    manifest: TFJobManifest, *, training_client=None
) -> models.KubeflowOrgV1TFJob:
    """Creates the TFJob on the cluster of the current kubeconfig context.

    Uses the Kubeflow training SDK's `TrainingClient.create_job`, in the
    manifest's namespace. `training_client` replaces the `TrainingClient` built
    from the kubeconfig (another context, or a test double).

    Returns:
        The submitted job (`manifest.job`): `create_job` returns nothing; read
        the job's status back with `TrainingClient().get_job(...)`.

    Raises:
        RuntimeError: no kubeconfig (or in-cluster credentials) to reach a
            cluster, or the cluster refused the job.

    Example:

    ```python
    manifest = tfjob("mnist", "registry.example.com/mnist:1.0", ["python", "train.py"])
    submit(manifest)
    ```
    """
    if not isinstance(manifest, TFJobManifest):
        raise TypeError(
            f"`manifest` must be a TFJobManifest (from `tfjob()`), got "
            f"{type(manifest).__name__}."
        )
    if training_client is None:
        import kubernetes
        from kubeflow.training import TrainingClient

        try:
            training_client = TrainingClient(job_kind=KIND)
        except (kubernetes.config.ConfigException, yaml.YAMLError) as error:
            reason = (f"the kubeconfig is not valid YAML ({str(error).splitlines()[0]})"
                      if isinstance(error, yaml.YAMLError) else
                      f"no Kubernetes credentials ({error})")
            raise RuntimeError(
                f"Cannot submit TFJob {manifest.job.metadata.name!r}: {reason}. Point "
                f"$KUBECONFIG (default ~/.kube/config) at a kubeconfig for the "
                f"cluster, or write the manifest with `to_yaml()` and "
                f"`kubectl apply -f` it."
            ) from error
    training_client.create_job(
        job=manifest.job, namespace=manifest.job.metadata.namespace
    )
    return manifest.job


def _check_int(arg, value, *, minimum, maximum=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"`{arg}` must be an int, got {value!r} of type {type(value).__name__}."
        )
    if value < minimum or (maximum is not None and value > maximum):
        valid = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"`{arg}` must be an int {valid}, got {value!r}.")
    return value


def _check_choice(arg, value, choices):
    if value not in choices:
        raise ValueError(f"`{arg}` must be one of {choices}, got {value!r}.")


def _check_name(name, replicas):
    """An RFC 1035 label that keeps the operator's pod/service names valid."""
    if not isinstance(name, str) or not _RFC1035_LABEL.fullmatch(name):
        raise ValueError(
            f"`name` must be an RFC 1035 label (lower-case letters, digits and "
            f"'-', starting with a letter and ending with a letter or digit), "
            f"because the training operator names the job's pods and services "
            f"after it; got {name!r}."
        )
    longest = max(
        (f"{name}-{kind.lower()}-{count - 1}" for kind, count in replicas.items()),
        key=len,
    )
    if len(longest) > _MAX_LABEL_LENGTH:
        suffix = len(longest) - len(name)
        raise ValueError(
            f"`name` {name!r} is too long for this job: the training operator "
            f"names each replica's pod and service '<name>-<replica type>-<index>', "
            f"a service name is an RFC 1035 label of at most {_MAX_LABEL_LENGTH} "
            f"characters, and {longest!r} has {len(longest)}; use a name of at "
            f"most {_MAX_LABEL_LENGTH - suffix} characters."
        )


def _check_namespace(namespace):
    if (
        not isinstance(namespace, str)
        or len(namespace) > _MAX_LABEL_LENGTH
        or not _RFC1123_LABEL.fullmatch(namespace)
    ):
        raise ValueError(
            f"`namespace` must be an RFC 1123 label (at most {_MAX_LABEL_LENGTH} "
            f"lower-case letters, digits and '-', starting and ending with a "
            f"letter or digit), got {namespace!r}."
        )


def _check_image(image):
    match = _IMAGE.fullmatch(image) if isinstance(image, str) else None
    if match is None:
        raise ValueError(
            f"`image` must be a container image reference ([registry/]path, the "
            f"path in lower case, then ':tag' and/or '@digest') such as "
            f"'tensorflow/tensorflow:2.20.0' or "
            f"'registry.example.com/team/train@sha256:<digest>', got {image!r}."
        )
    if match["tag"] is None and match["digest"] is None:
        raise ValueError(
            f"`image` {image!r} has no tag or digest: add ':<tag>' (e.g. "
            f"{image + ':1.0'!r}) or '@sha256:<digest>'. Without one each node "
            f"pulls whatever ':latest' is when its pod starts, so replicas could "
            f"run different code."
        )


def _check_command(command):
    if (
        not isinstance(command, (list, tuple))
        or not all(isinstance(part, str) for part in command)
    ):
        raise TypeError(
            f"`command` must be a list of strings such as ['python', 'train.py'], "
            f"got {command!r}."
        )
    if not command:
        raise ValueError(
            "`command` must not be empty: give the program to run, e.g. "
            "['python', 'train.py']."
        )


def _check_env(env):
    """`env` as a dict of environment variable names to string values."""
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError(f"`env` must be a dict of strings to strings such as "
                        f"{{'MALLOC_ARENA_MAX': '2'}}, got {env!r}.")
    for name in env:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(
                f"`env` has {name!r}, not an environment variable name: letters, "
                f"digits and '_', not starting with a digit.")
        if name in _SET_ENV:
            raise ValueError(
                f"`env` has {name!r}, which the job sets itself: "
                f"{_SET_ENV[name]}.")
    return env


def _check_quantity(arg, value):
    """A positive Kubernetes quantity ("2", "500m", "4Gi"), as a string."""
    import kubernetes

    valid_type = isinstance(value, (str, int)) and not isinstance(value, bool)
    text = str(value) if valid_type else ""
    if not _QUANTITY.fullmatch(text) or kubernetes.utils.parse_quantity(text) <= 0:
        raise ValueError(
            f"`{arg}` must be a positive Kubernetes quantity such as '2', "
            f"'500m' or '4Gi', got {value!r}."
        )
    return text


def _check_config(config):
    if config is None or isinstance(config, ParallelConfig):
        return config
    if isinstance(config, dict):
        return ParallelConfig.from_dict(config)
    raise TypeError(
        f"`config` must be a ParallelConfig or a dict of its fields, got "
        f"{type(config).__name__}."
    )
