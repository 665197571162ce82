"""`TF_CONFIG`: read, validate and produce it as the Kubeflow training operator does.

The operator (release 1.9, the last with TFJob) gives every task of a job

    {"cluster": {"chief": ["<job>-chief-0.<ns>.svc:2222"], "worker": [...], "ps": [...]},
     "task": {"type": "worker", "index": 1},
     "environment": "cloud"}

with lower-case task types (chief, master, worker, ps, evaluator). The evaluator is
not part of the training cluster: its own `task` names it, but `cluster` does not
list it. `tfdist launch` produces exactly this shape on 127.0.0.1, so a script that
runs under it runs unchanged in a TFJob.
"""

import dataclasses
import json
import os
import re
import socket

TF_CONFIG_ENV = "TF_CONFIG"
CLUSTER_TASK_TYPES = ("chief", "master", "worker", "ps")
TASK_TYPES = CLUSTER_TASK_TYPES + ("evaluator",)
_ADDRESS = re.compile(r"^[A-Za-z0-9._-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """One task's view of a cluster: what `TF_CONFIG` holds.

    Example:

    >>> config = TFConfig({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "worker", 1)
    >>> TFConfig.from_json(config.to_json()) == config
    True
    >>> config.task
    'worker:1'
    """

    cluster: dict
    task_type: str
    task_index: int
    environment: str = "cloud"

    def __post_init__(self):
        _validate(self)

    @property
    def task(self) -> str:
        """`type:index`, the task's name in logs (`[worker:1]`)."""
        return f"{self.task_type}:{self.task_index}"

    def to_dict(self) -> dict:
        """The dict the operator serialises into `TF_CONFIG`."""
        return {"cluster": {k: list(v) for k, v in self.cluster.items()},
                "task": {"type": self.task_type, "index": self.task_index},
                "environment": self.environment}

    def to_json(self) -> str:
        """The `TF_CONFIG` string."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, value) -> "TFConfig":
        """Parses and validates a `TF_CONFIG` dict; errors name the bad field."""
        if not isinstance(value, dict):
            raise ValueError(f"TF_CONFIG must be a JSON object, got {value!r}.")
        unknown = sorted(set(value) - {"cluster", "task", "environment", "rpc_layer"})
        if unknown:
            raise ValueError(
                f"TF_CONFIG has unknown key(s) {unknown}; valid keys are "
                f"cluster, task, environment, rpc_layer."
            )
        task = value.get("task")
        if not isinstance(task, dict) or "type" not in task or "index" not in task:
            raise ValueError(
                f'TF_CONFIG["task"] must be {{"type": ..., "index": ...}}, got {task!r}.'
            )
        return cls(cluster=value.get("cluster"), task_type=task["type"],
                   task_index=task["index"],
                   environment=value.get("environment", "cloud"))

    @classmethod
    def from_json(cls, text: str) -> "TFConfig":
        """Parses and validates a `TF_CONFIG` string."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"TF_CONFIG is not valid JSON ({error}): {text!r}") from error
        return cls.from_dict(value)


def _validate(config: TFConfig):
    cluster = config.cluster
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(
            f'TF_CONFIG["cluster"] must map task types to address lists, got {cluster!r}.'
        )
    for task_type, addresses in cluster.items():
        if task_type not in CLUSTER_TASK_TYPES:
            raise ValueError(
                f'TF_CONFIG["cluster"] has task type {task_type!r}; valid types are '
                f"{CLUSTER_TASK_TYPES} (lower case; the evaluator is not listed in "
                f"the cluster)."
            )
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(
                f'TF_CONFIG["cluster"][{task_type!r}] must be a non-empty list of '
                f'"host:port" addresses, got {addresses!r}.'
            )
        for address in addresses:
            if not isinstance(address, str) or not _ADDRESS.match(address):
                raise ValueError(
                    f'TF_CONFIG["cluster"][{task_type!r}] has address {address!r}; '
                    f'addresses are "host:port".'
                )
    tasks_at = {}
    for task_type, addresses in cluster.items():
        for index, address in enumerate(addresses):
            tasks_at.setdefault(address, []).append(f"{task_type}:{index}")
    shared = {address: tasks for address, tasks in tasks_at.items() if len(tasks) > 1}
    if shared:
        listed = "; ".join(f"{' and '.join(tasks)} are all at {address}"
                           for address, tasks in shared.items())
        raise ValueError(
            f'TF_CONFIG["cluster"] gives several tasks one address ({listed}): each '
            f"task serves on its own host:port, so give each its own port.")
    if config.task_type not in TASK_TYPES:
        raise ValueError(
            f'TF_CONFIG["task"]["type"] is {config.task_type!r}; valid types are '
            f"{TASK_TYPES}."
        )
    index = config.task_index
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(
            f'TF_CONFIG["task"]["index"] must be an int >= 0, got {index!r}.'
        )
    if config.task_type != "evaluator":
        count = len(cluster.get(config.task_type, []))
        if index >= count:
            raise ValueError(
                f'TF_CONFIG["task"] is {config.task}, but the cluster has {count} '
                f"{config.task_type} task(s)."
            )
    if not isinstance(config.environment, str):
        raise ValueError(
            f'TF_CONFIG["environment"] must be a string, got {config.environment!r}.'
        )


def read_tf_config(environ=None) -> TFConfig | None:
    """This process's `TF_CONFIG`, validated; None when it is not set.

    Example:

    >>> read_tf_config({"TF_CONFIG": '{"cluster": {"worker": ["h:1"]}, '
    ...                '"task": {"type": "worker", "index": 0}}'}).task
    'worker:0'
    """
    text = (os.environ if environ is None else environ).get(TF_CONFIG_ENV)
    return None if text is None else TFConfig.from_json(text)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now.

    Example:

    >>> len(set(free_ports(3)))
    3
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def local_tf_configs(*, chief=False, workers=1, ps=0, evaluator=False,
                     host="127.0.0.1") -> list[TFConfig]:
    """One `TFConfig` per task of a cluster on `host`, on free ports.

    Tasks come in the order chief, workers, ps, evaluator; all share one
    cluster (which, as the operator does it, does not list the evaluator).

    Example:

    >>> [c.task for c in local_tf_configs(chief=True, workers=2, ps=1)]
    ['chief:0', 'worker:0', 'worker:1', 'ps:0']
    """
    check_task_counts(chief=chief, workers=workers, ps=ps, evaluator=evaluator)
    counts = {"chief": int(chief), "worker": workers, "ps": ps}
    ports = iter(free_ports(sum(counts.values()) + int(evaluator), host))
    cluster = {task_type: [f"{host}:{next(ports)}" for _ in range(n)]
               for task_type, n in counts.items() if n}
    configs = [TFConfig(cluster, task_type, index)
               for task_type, n in counts.items() for index in range(n)]
    if evaluator:
        configs.append(TFConfig(cluster, "evaluator", 0))
    return configs


def check_task_counts(*, chief, workers, ps, evaluator):
    """The task counts of a job, checked; errors name the argument.

    Example:

    >>> check_task_counts(chief=False, workers=0, ps=0, evaluator=False)
    Traceback (most recent call last):
    ...
    ValueError: `workers` must be an int >= 1, got 0.
    """
    for name, value in (("chief", chief), ("evaluator", evaluator)):
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` must be a bool, got {value!r}.")
    for name, value, minimum in (("workers", workers, 1), ("ps", ps, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be an int, got {value!r} of type "
                            f"{type(value).__name__}.")
        if value < minimum:
            raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    if ps and not chief:
        raise ValueError(
            f"`ps={ps}` needs `chief=True` (--chief): in a parameter-server job the "
            f"chief runs the training loop, and without it the workers and ps "
            f"tasks would wait forever.")
