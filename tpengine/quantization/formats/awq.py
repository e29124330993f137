"""AWQ checkpoints (AutoAWQ's "gemm" version): 4 bits with zero points, int32 words packing 8 output columns in
AWQ's interleaved order."""
import math

import torch

from tpengine.quantization.config import Layout, LinearScheme, QuantizationConfig, register_format, register_layout
from tpengine.quantization.readers import Tensors, unpack_int32
from tpengine.quantization.weights import QuantizedWeight

_AWQ_SUFFIXES = frozenset({"qweight", "qzeros", "scales"})
# AWQ's gemm packing puts output column order[i] of each run of 8 in nibble i
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@register_format("awq")
def _awq_config(d: dict) -> QuantizationConfig:
    version = str(d.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {d.get('version')!r} is not supported; tpengine reads 'gemm'")
    bits = d.get("bits", d.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ bits {bits} is not supported; tpengine reads 4 bits")
    if not d.get("zero_point", True):
        raise ValueError("AWQ zero_point false is not supported; tpengine reads AWQ with zero points")
    group_size = d.get("group_size", d.get("q_group_size", 128))
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"AWQ group_size {group_size!r} is not supported; use a positive size or -1")
    scheme = LinearScheme(layout="awq", bits=4, group_size=None if group_size == -1 else group_size,
                          symmetric=False, activation="float", strategy="channel" if group_size == -1 else "group")
    return QuantizationConfig(method="awq", schemes=((("Linear",), scheme),),
                              not_converted=tuple(d.get("modules_to_not_convert") or ()))


def _read_awq(tensors: Tensors, scheme: LinearScheme) -> QuantizedWeight:
    qweight = tensors.get("qweight", (torch.int32,))
    if qweight.dim() != 2:
        raise tensors.error("qweight", f"shape {list(qweight.shape)}, expected [in, out / 8]")
    in_features, out_features = qweight.size(0), qweight.size(1) * 8
    group_size = scheme.group_size or in_features
    num_groups = math.ceil(in_features / group_size)
    scales = tensors.scale("scales", (num_groups, out_features))
    qzeros = tensors.get("qzeros", (torch.int32,), (num_groups, out_features // 8))
    # nibble i of each word holds output column _AWQ_ORDER[i] of its run of 8
    columns = torch.arange(out_features).view(-1, 8)[:, torch.argsort(torch.tensor(_AWQ_ORDER))].flatten()
    values = unpack_int32(qweight, 4, 1)[:, columns].t()
    zeros = unpack_int32(qzeros, 4, 1)[:, columns].t().float()
    return QuantizedWeight(bits=4, qweight=(values - 8).to(torch.int8).contiguous(), scales=scales.t().contiguous(),
                           zeros=(zeros - 8).contiguous(), group_size=group_size)


register_layout("awq", Layout(_AWQ_SUFFIXES, "qweight", _read_awq))
