"""The TFJob example's training script, run under `tfdist launch` as its pods would run it."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import TFDIST, output_tail

EXAMPLES = pathlib.Path(__file__).parents[2] / "keras_examples" / "tfjob"


@pytest.mark.multiprocess
def test_example_training_script_runs_under_tfdist_launch(tmp_path):
    env = dict(os.environ, TFDIST_LOGDIR=str(tmp_path))
    done = subprocess.run(
        [*TFDIST, "launch", "--workers=2", "--microbatches=2", "--timeout=240", "--",
         sys.executable, str(EXAMPLES / "train.py"), "--epochs=2"],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, output_tail(done.stdout)
    for task in ("worker:0", "worker:1"):
        assert re.search(rf"\[{task}\] {task}: 2 replicas, .*\"microbatches\": 2", done.stdout)
    assert (tmp_path / "digits.keras").exists()
