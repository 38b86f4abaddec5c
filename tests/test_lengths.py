"""FastServe's learned output-length law (sched/lengths.py): E[remaining | attained] follows the data."""
import pytest

from orca_mq.sched.lengths import PRIOR_MEAN, OutputLengths


def learned(lengths: list[int], in_pool: list[int] = (), ended: bool = True, max_len: int = 512) -> OutputLengths:
    law = OutputLengths(max_len, window=1000, prior_jobs=1.0)
    for n in lengths:
        law.observe(n, ended)
    law.refresh(in_pool)
    return law


def test_before_anything_is_known_attained_service_says_nothing():
    law = OutputLengths(4096, window=1000, prior_jobs=8.0)
    assert law.expected_remaining(0) == pytest.approx(PRIOR_MEAN, rel=0.05)
    assert law.expected_remaining(50) == pytest.approx(law.expected_remaining(0), rel=0.05)


def test_uniform_lengths_a_started_job_has_less_left():
    law = learned([n for n in range(1, 201)] * 5)
    rem = [law.expected_remaining(a) for a in (0, 50, 100, 150)]
    assert rem == sorted(rem, reverse=True) and rem[0] == pytest.approx(100, rel=0.1) and rem[3] < 30


def test_heavy_tail_a_started_job_has_more_left():
    law = learned([1] * 90 + [400] * 10)
    assert law.expected_remaining(0) < 50 and law.expected_remaining(2) > 300


def test_jobs_still_running_count_as_lower_bounds():
    """Short jobs finish first under a queue: without the pool's attained tokens the law looks short."""
    finished = [5] * 50
    blind, seen = learned(finished), learned(finished, in_pool=[300] * 20)
    assert seen.expected_remaining(0) > 3 * blind.expected_remaining(0)
    aborted = learned([300] * 20, ended=False)   # aborts: censored, not ended at 300
    assert aborted.expected_remaining(299) > 1


def test_window_forgets_and_refresh_is_asked_for():
    law = OutputLengths(512, window=10, prior_jobs=1.0)
    asks = []
    for _ in range(40):
        asks.append(law.observe(400, True))
        if asks[-1]:
            law.refresh([])
    assert any(asks) and not all(asks)   # often at first, then every few leavers
    for _ in range(10):
        law.observe(4, True)
    law.refresh([])
    assert law.expected_remaining(0) < 20   # the 400s left the window
    with pytest.raises(ValueError):
        OutputLengths(0, 10, 1.0)
