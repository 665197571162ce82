"""Tasks whose data differ in length are told so, instead of a raw collective error."""

import sys

import pytest

from helpers import TINY_TASK, output_tail, run_tfdist

pytestmark = pytest.mark.multiprocess

# worker:1 has 64 more examples (2 more steps per epoch) than worker:0.
FIT = TINY_TASK + """
n = 320 + 64 * index
model.fit(np.ones((n, 4)), np.ones((n, 2)), batch_size=32, epochs=3, verbose=0)
print("trained")
"""


def test_tasks_with_data_of_different_lengths_are_told_so():
    done = run_tfdist("launch", "--workers=2", "--timeout=150", "--",
                      sys.executable, "-c", FIT, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "the tasks of the job issued different collectives" in output \
        or "a task with fewer batches than the others" in output, output_tail(output)
    assert "every task must run the same number of steps" in output
