"""The hang watchdog's limits, read off a fake clock: faults.first_step_timeout from the start of
training until the first optimizer step finishes, faults.hang_timeout before and after it."""

from __future__ import annotations

from phalanx.faults.watchdog import IO_TIMEOUT_S, Watchdog


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(clock: Clock, first_step_timeout: float = 60.0) -> Watchdog:
    dog = Watchdog(5.0, 0, None, first_step_timeout=first_step_timeout, exit=lambda code: None, clock=clock)
    dog.close()  # its thread stops before the first beat: the test asks overdue() itself
    return dog


def test_the_first_step_gets_its_own_limit_and_hang_timeout_holds_after_it():
    clock = Clock()
    dog = watchdog(clock)
    assert dog.overdue() is None  # not armed before the first beat
    dog.beat()
    clock.now += 6
    assert "(faults.hang_timeout is 5 s)" in dog.overdue()  # before training: the usual limit

    dog.expect_first_step()  # session.epochs(), a training loader's first pass or accumulate()
    dog.beat()
    assert dog.limit() == 60
    clock.now += 59  # a first step that compiles
    assert dog.overdue() is None
    clock.now += 2
    assert dog.overdue() == (
        "rank 0: no progress for 61.0 s before the first optimizer step finished (faults.first_step_timeout is 60 s)"
    )

    dog.stepped()  # the end of the first optimizer step, which beats
    assert dog.overdue() is None and dog.limit() == 5
    clock.now += 6
    assert dog.overdue() == "rank 0: no progress for 6.0 s (faults.hang_timeout is 5 s)"
    dog.expect_first_step()  # a later epoch starting: the first step is behind
    assert dog.limit() == 5


def test_zero_means_no_limit_before_the_first_step_and_io_still_gets_its_allowance():
    clock = Clock()
    dog = watchdog(clock, first_step_timeout=0)
    dog.expect_first_step()
    dog.beat()
    clock.now += 10 * IO_TIMEOUT_S
    assert dog.limit() is None and dog.overdue() is None
    dog.stepped()
    with dog.paused():
        assert dog.limit() == IO_TIMEOUT_S
    assert dog.limit() == 5


def test_a_first_step_limit_below_hang_timeout_is_raised_to_it():
    dog = watchdog(Clock(), first_step_timeout=1)
    dog.expect_first_step()
    assert dog.limit() == 5
