"""The launcher's per-task supervisor: its signal handlers."""

import pytest

from tfdist.cluster import supervisor


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(supervisor, "_state", {"stopping": False, "urgent": False})


def test_a_second_signal_while_the_first_unwinds_does_not_raise_again(fresh_state):
    # SIGTERM then SIGUSR1 (Ctrl-C twice) back to back: the second handler runs
    # before cleanup starts, and a second _Stop there would escape main's `try`.
    with pytest.raises(supervisor._Stop):
        supervisor._raise_stop(None, None)
    supervisor._stop_now(None, None)
    assert supervisor._state["urgent"]
