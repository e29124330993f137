"""Each device's platform module provides everything the seam lists, and a layer keeps the ops of the
platform of the device it was built on."""
import pytest
import torch

from tpengine.layers.embed_head import ParallelLMHead
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.linear import ColumnParallelLinear
from tpengine.platforms import Platform, cpu, cuda, platform_for

MEMBERS = sorted(set(Platform.__annotations__)
                 | {name for name, value in vars(Platform).items() if callable(value) and not name.startswith("_")})


@pytest.mark.parametrize("platform", [cpu, cuda], ids=["cpu", "cuda"])
def test_every_platform_provides_every_member_of_the_seam(platform):
    assert [name for name in MEMBERS if not hasattr(platform, name)] == []


def test_the_device_names_its_platform_and_an_unknown_device_is_refused():
    assert platform_for(torch.device("cpu")) is cpu and platform_for(torch.device("cuda", 1)) is cuda
    with pytest.raises(ValueError, match="cpu or cuda devices, not meta"):
        platform_for(torch.device("meta"))


def test_layers_built_on_the_cpu_keep_the_cpu_platforms_ops():
    with torch.device("cpu"):
        norm, linear, head = RMSNorm(8), ColumnParallelLinear(8, 4), ParallelLMHead(16, 8)
    assert norm.rms_norm is cpu.rms_norm and norm.add_rms_norm is cpu.add_rms_norm
    assert linear.linear is cpu.linear and head.pack_linear_weight is cpu.pack_linear_weight
