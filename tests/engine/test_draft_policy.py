"""The draft policy on made-up step times: steps take drafts where steps with drafts have been faster, per
class of batch sizes, and still try the other way now and then; vLLM's disable_by_batch_size is a hard cut."""
from tpengine.engine.draft_policy import EXPLORE_EVERY, DraftPolicy


def simulate(policy: DraftPolicy, num_rows: int, rate_with: float, rate_without: float, steps: int) -> int:
    """Run steps of num_rows rows whose tokens per second per row are fixed per way; returns how many drafted."""
    drafted = 0
    for _ in range(steps):
        with_drafts = policy.drafts_pay(num_rows)
        drafted += with_drafts
        rate = rate_with if with_drafts else rate_without
        policy.observe(num_rows, with_drafts, num_rows, num_rows / (rate * num_rows))
    return drafted


def test_drafts_where_they_are_faster_and_not_where_they_are_slower_per_batch_class():
    policy = DraftPolicy()
    steps = 20 * EXPLORE_EVERY  # far apart: the slower way runs one step in 4 * EXPLORE_EVERY
    assert simulate(policy, 1, rate_with=60.0, rate_without=30.0, steps=steps) >= steps - steps // EXPLORE_EVERY // 4 - 1
    assert simulate(policy, 16, rate_with=10.0, rate_without=14.0, steps=steps) <= steps // EXPLORE_EVERY // 4 + 1
    # close: one step in EXPLORE_EVERY
    assert simulate(policy, 64, rate_with=10.0, rate_without=10.5, steps=steps) == steps // EXPLORE_EVERY + 1
    # batch class 1 kept its own figures
    assert sum(policy.drafts_pay(1) for _ in range(4 * EXPLORE_EVERY)) == 4 * EXPLORE_EVERY - 1


def test_the_policy_follows_a_workload_whose_drafts_stop_paying():
    policy = DraftPolicy()
    simulate(policy, 4, rate_with=40.0, rate_without=20.0, steps=10 * EXPLORE_EVERY)
    late = 20 * EXPLORE_EVERY
    assert simulate(policy, 4, rate_with=10.0, rate_without=20.0, steps=late) < late // 4


def test_without_measurements_or_adaptivity_every_step_drafts_and_disable_by_batch_size_cuts():
    fixed = DraftPolicy(adaptive=False)
    assert all(fixed.drafts_pay(n) for n in (1, 8, 512))
    cut = DraftPolicy(disable_by_batch_size=8, adaptive=False)
    assert cut.drafts_pay(7) and not cut.drafts_pay(8) and not cut.drafts_pay(100)
    fresh = DraftPolicy()
    assert not fresh.drafts_pay(3)  # a step without drafts first, then measures one with
    fresh.observe(3, False, 3, 0.1)
    assert fresh.drafts_pay(3)
