"""Tasks that would resume from different backups are refused before training."""

import json
import sys

import pytest

from helpers import TINY_TASK, run_tfdist

pytestmark = pytest.mark.multiprocess

# Each task keeps its backup in a directory of its own (as on two hosts without
# a shared volume): BACKUP_ROOT/worker<index>.
FIT = TINY_TASK + """
backup = tfdist.callbacks.BackupAndRestore(os.path.join(sys.argv[1], f"worker{index}"))
model.fit(np.ones((32, 4)), np.ones((32, 2)), batch_size=8, epochs=6, verbose=0,
          callbacks=[backup])
print("trained")
"""


def test_tasks_resuming_from_different_backups_are_refused(tmp_path):
    # worker:0 finds a backup of epoch 4 (0-based 3); worker:1 none. Before,
    # worker:0 resumed at epoch 4 and worker:1 at epoch 1, on different
    # weights, and the job succeeded.
    (tmp_path / "worker0").mkdir()
    (tmp_path / "worker0" / "training_metadata.json").write_text(
        json.dumps({"epoch": 3, "batch": -1}))
    done = run_tfdist("launch", "--workers=2", "--timeout=120", "--",
                      sys.executable, "-c", FIT, str(tmp_path), timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "trained" not in output
    assert ("would resume from different backups in `backup_dir`" in output
            and "worker:0: resumes at epoch 4" in output
            and "worker:1: no backup, starts at epoch 1" in output), output[-3000:]


def test_tasks_sharing_one_backup_directory_train(tmp_path):
    done = run_tfdist("launch", "--workers=2", "--timeout=120", "--",
                      sys.executable, "-c", FIT.replace('f"worker{index}"', '"shared"'),
                      str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("trained") == 2
