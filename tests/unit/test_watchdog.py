"""The step watchdog: one thread, deadlines that expire once, clear errors.

Here a deadline's expiry releases the watched block (a real job's expiry
aborts the process's collectives, which would end collective communication
for the rest of this test process; tests/cluster/test_soak.py does that).
"""

import threading
import time

import pytest

from tfdist.cluster.watchdog import StepTimeoutError, Watchdog


class Released(Exception):
    pass


def _waiting_block(released, seconds=30):
    if released.wait(seconds):
        raise Released()


def test_a_block_that_outlives_its_deadline_is_expired_once_and_says_why():
    messages, released = [], threading.Event()

    def expire(message):
        messages.append(message)
        released.set()

    watchdog = Watchdog(expire)
    started = time.monotonic()
    with pytest.raises(StepTimeoutError, match="a step of fit did not finish within 0.2 s") \
            as raised:
        with watchdog.deadline(0.2, "a step of fit"):
            _waiting_block(released)
    assert time.monotonic() - started < 10
    assert isinstance(raised.value.__cause__, Released)
    assert len(messages) == 1 and "timeout_seconds" in messages[0]
    assert watchdog.watching == 0


def test_blocks_that_end_in_time_expire_nothing_and_share_one_thread():
    messages = []
    watchdog = Watchdog(messages.append)
    before = threading.active_count()
    for _ in range(2000):
        with watchdog.deadline(60, "a step of fit"):
            pass
    assert threading.active_count() <= before + 1
    assert messages == [] and watchdog.watching == 0


def test_an_error_of_the_block_itself_passes_unchanged():
    watchdog = Watchdog(lambda message: None)
    with pytest.raises(ValueError, match="the block's own"):
        with watchdog.deadline(60, "a step of fit"):
            raise ValueError("the block's own")


def test_of_concurrent_blocks_only_the_one_past_its_deadline_expires():
    messages, short_released, long_released = [], threading.Event(), threading.Event()
    watchdog = Watchdog(lambda message: (messages.append(message), short_released.set()))
    outcome = {}

    def long_block():
        with watchdog.deadline(60, "a step of evaluate"):
            long_released.wait(30)
        outcome["long"] = "finished"

    thread = threading.Thread(target=long_block)
    thread.start()
    with pytest.raises(StepTimeoutError, match="a step of fit"):
        with watchdog.deadline(0.2, "a step of fit"):
            _waiting_block(short_released)
    long_released.set()
    thread.join(30)
    assert outcome == {"long": "finished"}
    assert len(messages) == 1 and messages[0].startswith("a step of fit")
