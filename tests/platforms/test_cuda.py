"""The small ops the CUDA platform compiles each trace as one graph: a graph break would split them into
pieces with eager ops between (checked with dynamo alone, so it runs on CPU too)."""
import pytest
import torch

from tpengine.platforms.torch_ops import add_rms_norm, rms_norm, silu_and_mul


@pytest.mark.parametrize("op, args", [
    (rms_norm, (torch.randn(5, 4, 32), torch.ones(32), 1e-6)),  # per head, as q/k norm runs it
    (add_rms_norm, (torch.randn(5, 64), torch.randn(5, 64), torch.ones(64), 1e-6)),
    (silu_and_mul, (torch.randn(5, 128),)),
], ids=["rms_norm", "add_rms_norm", "silu_and_mul"])
def test_compiled_op_traces_as_one_graph_without_a_break(op, args):
    explanation = torch._dynamo.explain(op)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
