"""scripts/bench_outputs.py --quick runs end to end and reports every case against its baseline."""
from tests.scripts import run_script


def test_bench_outputs_reports_every_case_on_a_tiny_workload():
    out = run_script("bench_outputs.py", "--quick").stdout
    for case in ("| neither (generate()) |", "| streamed |", "| stop strings |", "| streamed + stop strings |",
                 "| streamed, delta outputs (the server's) |", "| streamed + stop strings, delta outputs |"):
        assert case in out, out
