"""scripts/bench_low_batch.py --quick runs end to end: floor, decode batches, batched-bench shape, the batch-1
breakdown and the fused-op table."""
from tests.scripts import run_script


def test_low_batch_bench_reports_the_floor_decode_batches_breakdown_and_ops(quick_model):
    out = run_script("bench_low_batch.py", "--quick", "--model", quick_model, "--batch-sizes", "1", "3",
                     "--context-len", "20", "--batched-bench", "2", "--breakdown", "--ops").stdout
    for row in ("| weight-read floor: sum over the", "| decode step, batch 1, context 20 |",
                "| decode step, batch 3, context 20 |", "| batched-bench shape, batch 2 (prompt 20, 56 decode steps)",
                "| linears (q/k/v, o, gate/up, down) |", "| decode attention |", "| sampler |",
                "| **whole step (mean, timers on)** |", "| q/k norm + rotary | 2048 |"):
        assert row in out, out
