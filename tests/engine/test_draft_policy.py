"""The draft policy on made-up step times: steps take drafts where steps with drafts have been faster, per
class of batch sizes, and still try the other way now and then, less often while it keeps losing; vLLM's
disable_by_batch_size is a hard cut."""
from tpengine.engine.draft_policy import EXPLORE_EVERY, MAX_EXPLORE_EVERY, DraftPolicy


def simulate(policy: DraftPolicy, num_rows: int, rate_with: float, rate_without: float, steps: int) -> list[int]:
    """Run steps of num_rows rows whose tokens per second per row are fixed per way; returns the steps (from 1)
    that drafted."""
    drafted = []
    for step in range(1, steps + 1):
        with_drafts = policy.drafts_pay(num_rows)
        if with_drafts:
            drafted.append(step)
        rate = rate_with if with_drafts else rate_without
        policy.observe(num_rows, with_drafts, 1.0, 1.0 / rate)
    return drafted


def test_drafts_where_they_are_faster_and_not_where_they_are_slower_per_batch_class():
    policy = DraftPolicy()
    steps = 20 * EXPLORE_EVERY
    # far apart: the first step measures the way without drafts, then exploring steps at EXPLORE_EVERY, then
    # 4x further each time
    assert set(range(1, steps + 1)) - set(simulate(policy, 1, rate_with=60.0, rate_without=30.0, steps=steps)) \
        == {1, EXPLORE_EVERY, 5 * EXPLORE_EVERY}
    assert simulate(policy, 16, rate_with=10.0, rate_without=14.0, steps=steps) == [2, EXPLORE_EVERY,
                                                                                    5 * EXPLORE_EVERY]
    # close: 2x further each time
    assert simulate(policy, 64, rate_with=10.0, rate_without=10.5, steps=steps) == [2, EXPLORE_EVERY,
                                                                                    3 * EXPLORE_EVERY,
                                                                                    7 * EXPLORE_EVERY,
                                                                                    15 * EXPLORE_EVERY]
    # batch class 1 kept its own figures: its next exploring step falls among these, at 21 * EXPLORE_EVERY
    assert sum(policy.drafts_pay(1) for _ in range(4 * EXPLORE_EVERY)) == 4 * EXPLORE_EVERY - 1


def test_exploring_backs_off_to_at_most_its_ceiling():
    policy = DraftPolicy()
    steps = 20 * MAX_EXPLORE_EVERY
    drafted = simulate(policy, 16, rate_with=10.0, rate_without=14.0, steps=steps)
    gaps = [later - earlier for earlier, later in zip(drafted, drafted[1:])]
    assert gaps[-1] == MAX_EXPLORE_EVERY and max(gaps) == MAX_EXPLORE_EVERY
    assert len(drafted) <= steps // MAX_EXPLORE_EVERY + 6


def test_the_policy_follows_a_workload_whose_drafts_stop_and_start_paying():
    policy = DraftPolicy()
    simulate(policy, 4, rate_with=40.0, rate_without=20.0, steps=10 * EXPLORE_EVERY)
    late = 20 * EXPLORE_EVERY
    drafted = simulate(policy, 4, rate_with=10.0, rate_without=20.0, steps=late)
    assert len(drafted) < 8  # the way it took measures at once: a few steps move its average past the other
    # drafts that pay again are found by the next exploring step, and the interval starts over
    simulate(policy, 4, rate_with=10.0, rate_without=20.0, steps=4 * MAX_EXPLORE_EVERY)
    drafted = simulate(policy, 4, rate_with=40.0, rate_without=20.0, steps=2 * MAX_EXPLORE_EVERY)
    assert drafted[0] <= MAX_EXPLORE_EVERY and len(drafted) >= 2 * MAX_EXPLORE_EVERY - drafted[0] - 8


def test_an_exploring_step_that_is_not_measured_does_not_stop_exploring():
    policy = DraftPolicy()
    simulate(policy, 8, rate_with=10.0, rate_without=14.0, steps=EXPLORE_EVERY - 1)
    assert policy.drafts_pay(8)  # explores, but the step had a prompt chunk: never observed
    drafted = simulate(policy, 8, rate_with=10.0, rate_without=14.0, steps=2 * EXPLORE_EVERY)
    assert drafted == [EXPLORE_EVERY]


def test_without_measurements_or_adaptivity_every_step_drafts_and_disable_by_batch_size_cuts():
    fixed = DraftPolicy(adaptive=False)
    assert all(fixed.drafts_pay(n) for n in (1, 8, 512))
    cut = DraftPolicy(disable_by_batch_size=8, adaptive=False)
    assert cut.drafts_pay(7) and not cut.drafts_pay(8) and not cut.drafts_pay(100)
    fresh = DraftPolicy()
    assert not fresh.drafts_pay(3)  # a step without drafts first, then measures one with
    fresh.observe(3, False, 1.0, 0.1)
    assert fresh.drafts_pay(3)
