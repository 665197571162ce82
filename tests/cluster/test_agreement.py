"""Tasks started with different configs are refused at strategy creation, naming the field."""

import sys

import pytest

from helpers import run_tfdist

pytestmark = pytest.mark.multiprocess

# worker:0 asks for FIELD=FIRST, worker:1 for FIELD=SECOND; both print after the constructor.
CREATE_STRATEGY = """
import json, os, sys
import tfdist
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
field, first, second = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
tfdist.MultiWorkerStrategy(timeout_seconds=60, **{field: first if index == 0 else second})
print("created")
"""


@pytest.mark.parametrize("field, first, second, said", [
    # a raw collective error, before: the zero levels issue different collectives
    ("zero", "1", "0", "`zero` is 1 on worker:0 but 0 on worker:1"),
    # trained to the end without a word, before
    ("precision", '"mixed_bfloat16"', '"float32"',
     "`precision` is 'mixed_bfloat16' on worker:0 but 'float32' on worker:1"),
])
def test_tasks_with_different_configs_are_refused_naming_the_field(field, first, second, said):
    done = run_tfdist("launch", "--workers=2", "--timeout=120", "--",
                      sys.executable, "-c", CREATE_STRATEGY, field, first, second,
                      timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "created" not in output
    assert f"ValueError: The tasks of this job do not run the same configuration: " \
           f"{said}" in output, output[-3000:]


def test_tasks_with_the_same_config_are_created():
    done = run_tfdist("launch", "--workers=2", "--timeout=120", "--zero=1", "--",
                      sys.executable, "-c", CREATE_STRATEGY.replace(
                          "**{field: first if index == 0 else second}",
                          "config=tfdist.ParallelConfig.from_env()"), "zero", "0", "0",
                      timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("created") == 2
