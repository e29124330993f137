"""Which GPU a rank uses, and the group a model is built for."""
import threading

import pytest
import torch

from tpengine.distributed.parallel_state import (ONE_GPU_TEST_MODE_ENV, SINGLE_RANK, TensorParallelGroup,
                                                 building_model_for, get_tp_group, local_device_index,
                                                 resolve_device)


def test_under_torchrun_local_rank_names_the_gpu_not_the_global_rank():
    # node 2 of 2 with 4 GPUs each: global rank 5 is the node's second process
    assert local_device_index(5, launched_by_torchrun=True, environ={"LOCAL_RANK": "1"}) == 1


def test_spawned_ranks_use_the_gpu_of_their_rank_whatever_local_rank_the_parent_had():
    assert local_device_index(3, launched_by_torchrun=False, environ={"LOCAL_RANK": "0"}) == 3
    assert local_device_index(2, launched_by_torchrun=True, environ={}) == 2  # torchrun always sets it; be safe


def test_the_one_gpu_test_mode_puts_every_rank_on_gpu_0(monkeypatch):
    monkeypatch.setenv(ONE_GPU_TEST_MODE_ENV, "1")
    assert local_device_index(1, launched_by_torchrun=False) == 0
    assert local_device_index(3, launched_by_torchrun=True, environ={"LOCAL_RANK": "3"}) == 0


def test_a_gpu_index_past_the_visible_gpus_is_a_value_error_naming_both():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' was asked for, but torch sees no CUDA device"):
            resolve_device("cuda", 0)
        return
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"would use GPU {count}, but {count} GPU"):
        resolve_device("cuda", count)


def test_layers_see_the_group_they_are_built_for_only_in_that_thread():
    group = TensorParallelGroup(rank=1, size=2, process_group=object())
    seen = {}
    with building_model_for(group):
        other = threading.Thread(target=lambda: seen.setdefault("other thread", get_tp_group()))
        other.start()
        other.join()
        seen["inside"] = get_tp_group()
    assert seen == {"inside": group, "other thread": SINGLE_RANK}
    assert get_tp_group() is SINGLE_RANK
