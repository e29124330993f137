"""tools/profile_decode.py --quick runs end to end on CPU (host clock): the CUDA run uses the same code."""
from tests.tools import run_tool


def test_profile_reports_step_times_replays_and_bandwidths_on_cpu(quick_model):
    out = run_tool("profile_decode.py", "--quick", "--device", "cpu", "--model", quick_model, "--steps", "3",
                     "--warm-up-steps", "1", "--copy-mib", "4").stdout
    assert "3 decode steps measured after 1 warm-up steps" in out
    assert "CUDA-graph replays: 0 in 4 decode steps (graphs off)" in out  # the first token comes from prefill
    for row in ("| host: llm.step() wall time |", "| CPU: decode forward (host clock) |",
                "| device-to-device copy, 4 MiB", "| decode attention, one layer:", "| decode forward:"):
        assert row in out, out
