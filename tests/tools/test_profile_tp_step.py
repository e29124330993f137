"""tools/profile_tp_step.py --quick: bench.py --quick's run at tp=1 and tp=2, every rank's phases recorded."""
from tests.tools import run_tool


def test_profile_tp_step_quick_reports_every_rank_and_the_collective_waits(quick_model):
    out = run_tool("profile_tp_step.py", "--quick", "--model", quick_model, "--tp", "2").stdout
    for line in ("## tp=1: ", "## tp=2: ", "- rank 0 (", "- rank 1 (", "collectives per step",
                 "- rank 1 waits for the others in collectives:", "- all-reduce: from the last rank's arrival"):
        assert line in out, out
