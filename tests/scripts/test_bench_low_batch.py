"""scripts/bench_low_batch.py runs end to end on a tiny model: floor, decode batches, batched-bench shape,
the batch-1 breakdown and the fused-op table."""
import os
import subprocess
import sys

from tests.scripts.test_profile_decode import SCRIPTS


def test_low_batch_bench_reports_the_floor_decode_batches_breakdown_and_ops(tiny_model):
    command = [sys.executable, os.path.join(SCRIPTS, "bench_low_batch.py"), "--model", tiny_model,
               "--batch-sizes", "1", "3", "--context-len", "20", "--steps", "3", "--warm-up-steps", "1",
               "--batched-bench", "2", "--breakdown", "--ops"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for row in ("| weight-read floor: sum over the", "| decode step, batch 1, context 20 |",
                "| decode step, batch 3, context 20 |", "| batched-bench shape, batch 2 (prompt 20, 56 decode steps)",
                "| linears (q/k/v, o, gate/up, down) |", "| decode attention |", "| sampler |",
                "| **whole step (mean, timers on)** |", "| q/k norm + rotary | 2048 |"):
        assert row in out, out
