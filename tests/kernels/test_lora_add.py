"""The LoRA add on every platform: the C++ op (kernels/cpu/lora.cpp, both its matmul and its loop path), the Triton
kernel (kernels/triton/lora.py, in the interpreter without a GPU) and the torch code (torch_ops.lora_add_torch)
against a per-row loop in float64 and against each other: slots mixed with -1, runs of one slot, ranks padded with
zeros, sizes no power of two, no rows at all. The shrink stays float32 and the sum is rounded once, on each."""
import pytest
import torch

from tpengine.kernels.cpu import lora as lora_kernel
from tpengine.kernels.cpu.build import has_compiler
from tpengine.kernels.triton import lora as triton_lora
from tpengine.kernels.triton.lora import lora_add as triton_lora_add
from tpengine.platforms import cpu
from tpengine.platforms.torch_ops import lora_add_torch
from tpengine.runner.cpu_replay import _Recorder, recordable

needs_compiler = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler here")

# a prefill chunk of slot 1, then decode rows of scattered slots and rows without an adapter
MIXED_SLOTS = [1] * 12 + [-1, 0, 2, 0, -1, 2, 2, 1, -1]
SLOT_RANKS = [8, 3, 5]  # R = 8: slots 1 and 2 zero-padded
# float32 sums in another order than float64's; the half dtypes within one rounding of their own
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
       torch.float16: dict(rtol=1e-3, atol=1e-3)}


def lora_case(slots: list[int], in_features=40, out_features=300, dtype=torch.float32, device="cpu"):
    """(y, x, lora_a, lora_b, scales, slots) with random values, each slot's rank past SLOT_RANKS zero."""
    gen = torch.Generator().manual_seed(0)
    rank, num_rows = max(SLOT_RANKS), len(slots)
    lora_a = torch.randn(len(SLOT_RANKS), in_features, rank, generator=gen) * 0.3
    lora_b = torch.randn(len(SLOT_RANKS), rank, out_features, generator=gen) * 0.3
    for s, r in enumerate(SLOT_RANKS):
        lora_a[s, :, r:] = 0
        lora_b[s, r:] = 0
    tensors = (torch.randn(num_rows, out_features, generator=gen), torch.randn(num_rows, in_features, generator=gen),
               lora_a, lora_b)
    scales = torch.tensor([0.5, 2.0, 1.25])
    return (*(t.to(device, dtype) for t in tensors), scales.to(device),
            torch.tensor(slots, dtype=torch.int64, device=device))


def per_row_float64(y, x, lora_a, lora_b, scales, slots) -> torch.Tensor:
    out = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += scales[s].double() * (x[t].double() @ lora_a[s].double()) @ lora_b[s].double()
    return out


def check_against_float64(lora_add, slots: list[int], dtype, device="cpu", **sizes):
    y, *inputs = lora_case(slots, dtype=dtype, device=device, **sizes)
    expected, before = per_row_float64(y, *inputs), y.clone()
    lora_add(y, *inputs)
    torch.testing.assert_close(y.double(), expected, **TOL[dtype])
    untouched = inputs[-1] < 0
    assert torch.equal(y[untouched], before[untouched])
    return y


def rounding_case(dtype, device="cpu"):
    """One row whose float32 shrink is [1 + 2^-10, 1] (bfloat16 would round it to [1, 1]) and expand 2^-10, scaled
    to 2^-8 + 2^-16 onto y = 1: rounded once, the sum is 1 + 2^-7; a bfloat16 shrink leaves 1, and so does the
    delta rounded to bfloat16 first (2^-8, a tie, to even)."""
    x = torch.tensor([[1.0, 2.0**-10]])
    lora_a = torch.tensor([[[1.0, 1.0], [1.0, 0.0]]])
    lora_b = torch.tensor([[[1.0], [-1.0]]])
    tensors = (torch.ones(1, 1), x, lora_a, lora_b)
    return (*(t.to(device, dtype) for t in tensors), torch.tensor([4.0 + 2.0**-6], device=device),
            torch.zeros(1, dtype=torch.int64, device=device))


def cpp_lora_add(mm_min_rows: int):
    def run(*args):
        assert lora_kernel.available()
        lora_kernel.lora_add(*args, mm_min_rows=mm_min_rows)
    return run


# mm_min_rows 1: every segment by matmuls; 4: the 12-row chunk by matmuls, decode rows in loops; huge: all in loops
CPP_PATHS = {"matmuls": 1, "mixed": 4, "loops": 1 << 30}


# --- the torch code ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_code_matches_a_per_row_loop_in_float64(dtype):
    check_against_float64(lora_add_torch, MIXED_SLOTS, dtype)


def test_torch_code_keeps_the_shrink_in_float32_and_rounds_once():
    y, *inputs = rounding_case(torch.bfloat16)
    lora_add_torch(y, *inputs)
    assert y.item() == 1 + 2.0**-7


def test_torch_code_dispatches_only_ops_a_cpu_decode_replay_records():
    y, *inputs = lora_case(MIXED_SLOTS, dtype=torch.bfloat16)
    recorder = _Recorder()
    with recorder:
        lora_add_torch(y, *inputs)
    assert recorder.calls and [str(op) for op, *_ in recorder.calls if not recordable(op)] == []


# --- the C++ op ----------------------------------------------------------------------------------------

@needs_compiler
@pytest.mark.parametrize("path", CPP_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_op_matches_a_per_row_loop_in_float64_and_the_torch_code(path, dtype):
    out = check_against_float64(cpp_lora_add(CPP_PATHS[path]), MIXED_SLOTS, dtype)
    y, *inputs = lora_case(MIXED_SLOTS, dtype=dtype)
    lora_add_torch(y, *inputs)
    torch.testing.assert_close(out, y, **TOL[dtype])


@needs_compiler
@pytest.mark.parametrize("path", CPP_PATHS)
def test_cpp_op_keeps_the_shrink_in_float32_and_rounds_once(path):
    y, *inputs = rounding_case(torch.bfloat16)
    cpp_lora_add(CPP_PATHS[path])(y, *inputs)
    assert y.item() == 1 + 2.0**-7


@needs_compiler
def test_cpp_op_takes_no_rows_and_refuses_a_slot_past_the_last():
    y, *inputs = lora_case([], dtype=torch.bfloat16)
    cpp_lora_add(1)(y, *inputs)
    y, *inputs, slots = lora_case([0, 3])
    with pytest.raises(RuntimeError, match=r"slot 3 of row 1 is outside \[-1, 3\)"):
        cpp_lora_add(1)(y, *inputs, slots)


@needs_compiler
def test_cpu_platform_runs_the_cpp_op_which_a_decode_replay_records():
    y, *inputs = lora_case(MIXED_SLOTS)
    expected = per_row_float64(y, *inputs)
    recorder = _Recorder()
    with recorder:
        cpu.lora_add(y, *inputs)
    assert [str(op) for op, *_ in recorder.calls] == ["tpengine_lora.lora_add.default"]
    assert recordable(recorder.calls[0][0])
    torch.testing.assert_close(y.double(), expected, **TOL[torch.float32])


# --- the Triton kernel ---------------------------------------------------------------------------------

on_triton_device = pytest.mark.usefixtures("triton_device")


@on_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features, out_features", [(40, 300), (200, 72)])  # BLOCK_N 256: two blocks; K: two
# the columns of a row split over programs (a decode batch), or all in one program (a prefill)
@pytest.mark.parametrize("target_programs", [1024, 1], ids=["split", "whole"])
def test_triton_kernel_matches_a_per_row_loop_in_float64_and_the_torch_code(dtype, in_features, out_features,
                                                                            target_programs, monkeypatch):
    monkeypatch.setattr(triton_lora, "TARGET_PROGRAMS", target_programs)
    sizes = dict(in_features=in_features, out_features=out_features)
    out = check_against_float64(triton_lora_add, MIXED_SLOTS, dtype, device=torch.get_default_device(), **sizes)
    y, *inputs = lora_case(MIXED_SLOTS, dtype=dtype, device=torch.get_default_device(), **sizes)
    lora_add_torch(y, *inputs)
    torch.testing.assert_close(out, y, **TOL[dtype])


@on_triton_device
def test_triton_kernel_keeps_the_shrink_in_float32_rounds_once_and_takes_no_rows():
    y, *inputs = rounding_case(torch.bfloat16, torch.get_default_device())
    triton_lora_add(y, *inputs)
    assert y.item() == 1 + 2.0**-7
    y, *inputs = lora_case([], dtype=torch.bfloat16, device=torch.get_default_device())
    triton_lora_add(y, *inputs)
