"""benchmarks/bench_control_plane.py --quick: every case through both designs, in process and to a reader process."""
from tests.benchmarks import run_script


def test_bench_control_plane_quick_reports_every_case_in_process_and_end_to_end():
    out = run_script("bench_control_plane.py", "--quick").stdout
    for case in ("decode 64", "decode 256", "decode 512", "prefill 16384", "wake-up floor (1 B, no decode)"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {case} |")]
        # in process (not the floor), worker inputs (decode cases), 1 reader
        assert len(rows) == (1 if case.startswith("wake-up") else 3 if case.startswith("decode") else 2), out
    assert "- end to end, 1 reader(s):" in out
