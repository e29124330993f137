"""MXFP4 checkpoints (gpt-oss's `quant_method: "mxfp4"`): each expert projection stored as `<name>_blocks` and
`<name>_scales`, dequantized on the CPU as it loads (formats/mxfp4.py reads the checkpoint's config and tensors).

The format, as transformers' integrations/mxfp4.py (convert_moe_packed_tensors) reads it: a projection whose
float form is [experts, in, out] is stored transposed, each [out] row of `in` values cut into groups of 32:
    blocks uint8 [experts, out, in / 32, 16]: two FP4 (e2m1) values a byte, the even index in the low nibble;
    scales uint8 [experts, out, in / 32]: one e8m0 exponent a group, 2^(scale - 127).
An e2m1 nibble is a sign bit over 3 bits indexing FP4_VALUES' magnitudes. Everything else in the checkpoint
(attention, router, embeddings, biases: transformers' modules_to_not_convert) is stored float and loads as is.
"""
import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float [experts, in, out] tensor that blocks [experts, out, in / 32, 16] and scales [experts, out,
    in / 32] stand for (exact in float32: every value is an FP4 value times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.size(-1) != GROUP_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: blocks "
                         f"must be scales' shape + [{GROUP_SIZE // 2}]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    *experts, rows, groups, _ = blocks.shape
    out = torch.empty(*experts, groups * GROUP_SIZE, rows, dtype=dtype, device=blocks.device)
    # one expert at a time: a projection's float32 values exist only one expert's worth at once
    for block, scale, dest in zip(blocks.reshape(-1, rows, groups, GROUP_SIZE // 2), scales.reshape(-1, rows, groups),
                                  out.view(-1, groups * GROUP_SIZE, rows)):
        values = torch.stack([lut[(block & 0x0F).long()], lut[(block >> 4).long()]], dim=-1)  # low nibble first
        values = torch.ldexp(values.flatten(-2), scale.to(torch.int32).unsqueeze(-1) - 127)
        dest.copy_(values.flatten(-2).t())
    return out
