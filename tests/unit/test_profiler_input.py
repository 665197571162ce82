"""tfdist.callbacks.Profiler refuses bad step ranges, tasks and log directories."""

import pytest

import tfdist


@pytest.mark.parametrize("kwargs, error, message", [
    ({"steps": (5, 5)}, ValueError, r"0 <= start < stop, got start=5, stop=5"),
    ({"steps": (5, 2)}, ValueError, r"got start=5, stop=2"),
    ({"steps": (-1, 3)}, ValueError, r"got start=-1"),
    ({"steps": ("1", 3)}, TypeError, r"`steps` must be a pair of ints"),
    ({"steps": (1, 2, 3)}, TypeError, r"`steps` must be a pair of ints"),
    ({"steps": (1, 3), "tasks": "workers"}, ValueError,
     r"`tasks` must be one of \('chief', 'all'\)"),
])
def test_bad_arguments(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        tfdist.callbacks.Profiler(tmp_path, **kwargs)


def test_unwritable_logdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"`logdir` .*file/logs' is not a writable directory"):
        tfdist.callbacks.Profiler(blocker / "logs", steps=(1, 2))
