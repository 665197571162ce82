"""The `tfdist launch` command refuses bad flags before starting anything."""

import pytest

from helpers import PRINT_TF_CONFIG, run_tfdist


@pytest.mark.parametrize("args, message", [
    (["--workers=0"], "`workers` must be an int >= 1, got 0"),
    (["--ps=-1"], "`ps` must be an int >= 0, got -1"),
    (["--restart-on-failure=-2"], "`restart_on_failure` must be an int >= 0, got -2"),
    (["--timeout=0"], "`timeout` must be a number of seconds > 0, got 0.0"),
    (["--microbatches=0"], "`microbatches` must be an int >= 1, got 0"),
])
def test_bad_launch_input(args, message):
    done = run_tfdist("launch", *args, "--", *PRINT_TF_CONFIG)
    assert done.returncode == 2
    assert message in done.stderr
    assert "[launch] started" not in done.stdout


def test_unknown_and_stray_flags_and_missing_command():
    unknown = run_tfdist("launch", "--workerz=2", "--", "true")
    assert unknown.returncode != 0 and "Unknown command line flag 'workerz'" in unknown.stderr
    stray = run_tfdist("launch", "--image=tf:2", "--", "true")
    assert stray.returncode != 0 and "`tfdist launch` does not take --image" in stray.stderr
    missing = run_tfdist("launch", "--workers=2")
    assert missing.returncode != 0 and "needs a command" in missing.stderr
