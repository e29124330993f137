"""Weight-only int4/int8 GEMM for the GPU: y = x @ W^T (+ bias) with W stored quantized and unpacked in
registers, for decode (a few rows, split along K so enough programs stream the weight) and prefill.

The weight is a QuantizedWeight's (tpengine/quantization/weights.py) with groups in runs: w[n, k] =
scales[n, g] * (q[n, k] - zeros[n, g]), g = k // group_size. Each program multiplies x's K block by the
whole numbers q - zeros (exact in x's dtype: |q - zeros| <= 255) on the tensor cores into float32, then
scales that block's product by its group's scales, so W is never rounded to x's dtype. A K block lies in
one group: BLOCK_K divides group_size, or there is one group per output channel.

With int8 activations (W8A8 checkpoints) x comes quantized per token and the sums are integers, exact; each
group's folds into float32 in order, rounded as the CPU kernel's reference (quant_linear_reference) rounds.

Resident bytes per parameter (bfloat16 is 2): int4 0.5 + 4 / group (+ 4 / group with zero points),
int8 1 + 4 / group; per output channel int4 0.5 (0.25x), int8 1.0 (0.5x).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tpengine.kernels.triton.paged_attention_tile import _dot

INT4_OFFSET = 8  # int4 values are stored unsigned, q + 8 in 0..15; their zero point moves with them
_INT4_OFFSET = tl.constexpr(INT4_OFFSET)
MIN_BLOCK_K = 16  # tl.dot's smallest K: a group must be a multiple of it
NUM_SMS = 132  # H100/H200; decode splits K until about two programs per SM stream the weight
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_INT8_X_GROUP, MAX_INT8_X_GROUP = 32, 256  # int8 x: a group is one K block; int8 tl.dot needs K >= 32
MAX_INT8_X_COLUMNS = 65536  # int8 x: a group's int32 sum of 255 * 127 a column stays under 2^31


class QuantMatmulWeight(NamedTuple):
    """A quantized weight in the kernel's layout: rows are output features, packed along K, so a program's
    [BLOCK_N, BLOCK_K] tile is BLOCK_N runs of contiguous bytes."""
    qweight: torch.Tensor  # int4: uint8 [N, K / 2], column 2j in byte j's low nibble (q + 8); int8: int8 [N, K]
    scales: torch.Tensor  # float32 [N, groups]
    zeros: torch.Tensor | None  # float32 [N, groups] on the stored values' scale (zeros + 8 for int4); None: 0
    input_order: torch.Tensor | None  # int64 [K] act order: the input column each packed column multiplies
    bits: int
    activation: str  # "float": x as it is; "int8": x's int8 values, quantized per token (W8A8 checkpoints)
    in_features: int  # x's columns (act order: K may exceed them, by columns that weigh zero)
    group_size: int  # columns per group; K for one group per output channel

    @property
    def out_features(self) -> int:
        return self.qweight.size(0)

    @property
    def packed_columns(self) -> int:
        """K: the columns the kernel walks."""
        return self.qweight.size(1) * (2 if self.bits == 4 else 1)

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros, self.input_order)
                   if t is not None)


class BlockConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # programs along K, each summing whole K blocks; their float32 partials are added after
    num_warps: int
    num_stages: int


def block_config(m: int, n: int, k: int, group_size: int, int8_x: bool = False) -> BlockConfig:
    """The tiles for an [m, k] @ [k, n] product, read by the launcher and by COMPILE_CASES alike."""
    largest_k = 128 if m <= 16 else 64
    if group_size < k:  # several groups: a K block must not cross a group's end
        largest_k = group_size if int8_x else min(largest_k, group_size & -group_size)
    if m <= 16:  # decode: one M tile, memory bound
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = triton.next_power_of_2(m), 64, 4, 4
    else:
        block_m, block_n, warps, stages = 64, 128, 4, 3
    split_k = 1
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # a few rows and few programs: split K while each split keeps at least four K blocks (int8 x: never, its
    # groups fold into float32 in order)
    while (not int8_x and m <= 64 and programs * split_k < 2 * NUM_SMS and 4 * split_k * largest_k <= k
           and split_k < 8):
        split_k *= 2
    return BlockConfig(block_m, block_n, largest_k, split_k, warps, stages)


@triton.jit
def _stored_weight_tile(w_rows, k0, offs_k, n_mask, k_mask, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] of the weight as stored: int4 values + 8 (uint8), or int8."""
    if BITS == 4:
        offs_byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_rows + offs_byte[None, :], mask=n_mask[:, None] & (offs_byte[None, :] < K // 2), other=0)
        return tl.interleave(packed & 0xF, packed >> 4)  # low nibble first
    return tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)


@triton.jit
def _scaled_block_product(a, q, scales, zeros, group_offsets, n_mask, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Float a [BLOCK_M, BLOCK_K] times the stored tile q [BLOCK_N, BLOCK_K] (as _stored_weight_tile gives it)
    transposed, float32, scaled by the K block's group: scales/zeros + group_offsets, each row's [BLOCK_N]."""
    scale = tl.load(scales + group_offsets, mask=n_mask, other=0.0)
    w = q.to(tl.float32)
    if HAS_ZEROS:
        w -= tl.load(zeros + group_offsets, mask=n_mask, other=0.0)[:, None]
    elif BITS == 4:
        w -= _INT4_OFFSET
    # q - zeros is a whole number, exact in a's dtype: only the float32 product is scaled
    return _dot(a, tl.trans(w.to(a.dtype))) * scale[None, :]


@triton.jit
def _quant_matmul_kernel(
    x,            # [M, K] (row stride stride_xm): floats, or int8 values with INT8_X
    x_scales,     # float32 [M]: each int8 row's scale (read with INT8_X)
    qweight,      # QuantMatmulWeight.qweight
    scales,       # float32 [N, groups]
    zeros,        # float32 [N, groups] (read with HAS_ZEROS)
    bias,         # [N] (read with HAS_BIAS)
    input_order,  # int64 [K] (read with HAS_ORDER)
    out,          # [M, N] in x's dtype, or float32 [SPLIT_K, M, N] partials
    M, N, K, group_size,
    stride_xm, stride_qn, stride_sn, stride_om, stride_osplit,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ORDER: tl.constexpr,
    INT8_X: tl.constexpr,  # x quantized per token: integer sums, exact, folded into float32 group by group
    ONE_GROUP: tl.constexpr,  # with INT8_X: one group per output channel, its sum folded once at the end
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = qweight + offs_n.to(tl.int64)[:, None] * stride_qn
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_end = tl.minimum(K, (split + 1) * k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    int_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)  # INT8_X and ONE_GROUP: the whole row's sum
    for k0 in range(split * k_per_split, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if HAS_ORDER:
            columns = tl.load(input_order + offs_k, mask=k_mask, other=0)
        else:
            columns = offs_k
        a = tl.load(x_rows + columns[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q = _stored_weight_tile(w_rows, k0, offs_k, n_mask, k_mask, K, BITS, BLOCK_K)
        group_offsets = offs_n * stride_sn + k0 // group_size
        if INT8_X:  # a K block is one group, or ONE_GROUP: quant_linear_reference's sums and roundings
            scale = tl.load(scales + group_offsets, mask=n_mask, other=0.0)
            if BITS == 4:
                q = (q.to(tl.int32) - _INT4_OFFSET).to(tl.int8)
            block_sum = tl.dot(a, tl.trans(q), out_dtype=tl.int32)
            if HAS_ZEROS:  # sum(x * (q - zero)) = sum(x * q) - zero * sum(x), q - zero may not fit int8
                zero = tl.load(zeros + group_offsets, mask=n_mask, other=0.0).to(tl.int32)
                if BITS == 4:
                    zero -= _INT4_OFFSET
                block_sum -= tl.sum(a.to(tl.int32), axis=1)[:, None] * zero[None, :]
            if ONE_GROUP:
                int_acc += block_sum
            else:
                acc = acc + scale[None, :] * block_sum.to(tl.float32)
        else:
            acc += _scaled_block_product(a, q, scales, zeros, group_offsets, n_mask, BITS, HAS_ZEROS)
    if INT8_X:
        if ONE_GROUP:
            acc = tl.load(scales + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :] * int_acc.to(tl.float32)
        acc = acc * tl.load(x_scales + offs_m, mask=m_mask, other=0.0)[:, None]
    if HAS_BIAS:
        if split == 0:  # the bias once, whatever the split
            acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + split * stride_osplit + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def pack_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group_size: int, input_order: torch.Tensor | None = None, in_features: int | None = None,
                activation: str = "float") -> QuantMatmulWeight:
    """A QuantizedWeight's tensors (groups in runs: with_contiguous_groups' weight and column order) in the
    kernel's layout, once at load; in_features: x's columns, which act order's input_order picks from (None:
    qweight's). ValueError naming what the kernel cannot take."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if activation not in ("float", "int8"):
        raise ValueError(f"activation must be 'float' or 'int8', not {activation!r}")
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be int8 [out, in], not {qweight.dtype} {tuple(qweight.shape)}")
    columns = qweight.size(1)
    num_groups = scales.size(1)
    if num_groups == 1:
        group_size = columns
    elif group_size * num_groups != columns or group_size % MIN_BLOCK_K:
        raise ValueError(f"{num_groups} groups of {group_size} columns: the kernel takes groups that are a "
                         f"multiple of {MIN_BLOCK_K} columns and cover the weight's {columns}")
    if activation == "int8" and num_groups > 1 and (group_size & (group_size - 1)
                                                    or not MIN_INT8_X_GROUP <= group_size <= MAX_INT8_X_GROUP):
        raise ValueError(f"with int8 activations a group is one K block: group_size {group_size} must be a power "
                         f"of two from {MIN_INT8_X_GROUP} to {MAX_INT8_X_GROUP}")
    if activation == "int8" and group_size > MAX_INT8_X_COLUMNS:
        raise ValueError(f"a group of {group_size} columns is over the {MAX_INT8_X_COLUMNS} whose int8 sums fit int32")
    if bits == 4 and columns % 2:
        raise ValueError(f"int4 weights pack two columns a byte: in_features {columns} must be even")
    if bits == 4 and qweight.numel() and not (-8 <= int(qweight.min()) and int(qweight.max()) <= 7):
        raise ValueError("int4 qweight values must lie in [-8, 7]")
    assert input_order is not None or in_features in (None, columns), "only act order reorders columns"
    if zeros is not None and zeros.numel() and not (bool((zeros == zeros.round()).all())
                                                    and -128 <= float(zeros.min()) and float(zeros.max()) <= 127):
        raise ValueError("zeros must be whole numbers in [-128, 127]: q - zeros must be exact in 16-bit floats")
    if bits == 4:
        stored = (qweight.to(torch.int16) + INT4_OFFSET).to(torch.uint8)
        qweight = (stored[:, 0::2] | (stored[:, 1::2] << 4)).contiguous()
        zeros = None if zeros is None else zeros + INT4_OFFSET
    return QuantMatmulWeight(qweight.contiguous(), scales.float().contiguous(),
                             None if zeros is None else zeros.float().contiguous(),
                             input_order, bits, activation, columns if in_features is None else in_features,
                             group_size)


def quant_matmul(x: torch.Tensor, weight: QuantMatmulWeight, bias: torch.Tensor | None = None,
                 config: BlockConfig | None = None, x_scales: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N], accumulated in float32. A weight with activation "float" takes x
    in float16, bfloat16 or float32 and gives x's dtype; one with "int8" takes a per-token quantization's int8
    values and float32 x_scales [..., 1] and gives out_dtype, exactly quant_linear_reference's numbers (before
    that rounding). config: the tiles, block_config's unless given."""
    int8_x = weight.activation == "int8"
    if int8_x:
        assert x.dtype == torch.int8 and x_scales is not None and out_dtype is not None, "int8 x comes with scales"
    elif x.dtype not in X_DTYPES:
        raise ValueError(f"quant_matmul takes x in {X_DTYPES}, not {x.dtype}")
    if x.size(-1) != weight.in_features:
        raise ValueError(f"x has {x.size(-1)} features, the weight takes {weight.in_features}")
    out_dtype = out_dtype or x.dtype
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n, k = rows.size(0), weight.out_features, weight.packed_columns
    config = config or block_config(m, n, k, weight.group_size, int8_x)
    assert weight.group_size == k or weight.group_size % config.block_k == 0, "a K block crosses a group"
    assert not int8_x or (config.split_k == 1 and weight.group_size in (k, config.block_k)), "int8 x folds in order"
    if config.split_k == 1:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    else:
        out = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
        # tensors never read (their flag off) are passed as stand-ins: one signature per flag set
        _quant_matmul_kernel[grid](
            rows, weight.scales if x_scales is None else x_scales.reshape(-1).float().contiguous(), weight.qweight,
            weight.scales, weight.scales if weight.zeros is None else weight.zeros,
            out if bias is None else bias, weight.scales if weight.input_order is None else weight.input_order,
            out, m, n, k, weight.group_size,
            rows.stride(0), weight.qweight.stride(0), weight.scales.stride(0), out.stride(-2),
            out.stride(0) if config.split_k > 1 else 0,
            BITS=weight.bits, HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None,
            HAS_ORDER=weight.input_order is not None, INT8_X=int8_x, ONE_GROUP=int8_x and weight.group_size == k,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
            enable_fp_fusion=not int8_x)  # int8 x: each product and sum rounded, as the reference's
    if config.split_k > 1:
        out = out.sum(dim=0).to(out_dtype)
    return out.view(*x.shape[:-1], n)


def dequantize_rows(weight: QuantMatmulWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), K]: the weight's rows (output features) `rows`, exactly as QuantizedWeight.dequantize
    gives them (a quantized embedding table gathered by token ids), in torch."""
    assert weight.input_order is None, "an embedding table has no act order"
    packed = weight.qweight[rows]
    if weight.bits == 4:
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
    else:
        q = packed.float()
    groups = torch.arange(weight.packed_columns, device=rows.device) // weight.group_size
    zeros = weight.zeros[rows][:, groups] if weight.zeros is not None else INT4_OFFSET if weight.bits == 4 else 0
    return (q - zeros) * weight.scales[rows][:, groups]


# --- what the AOT check compiles: the kernel as the launcher runs it for practical weights --------------

_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_case(dtype: torch.dtype, bits: int, group_size: int | None, has_zeros: bool, has_order: bool,
                 has_bias: bool, m: int, int8_x: bool = False, n: int = 4096, k: int = 4096) -> dict:
    """The launch quant_matmul makes for an [m, k] x on an [n, k] weight (group_size None: per channel), the
    model running in dtype."""
    config = block_config(m, n, k, group_size or k, int8_x)
    model_type = "*" + _TRITON_TYPES[dtype]
    out_type = model_type if config.split_k == 1 else "*fp32"
    signature = {
        "x": "*i8" if int8_x else model_type, "x_scales": "*fp32", "qweight": "*u8" if bits == 4 else "*i8",
        "scales": "*fp32", "zeros": "*fp32", "bias": model_type if has_bias else out_type,
        "input_order": "*i64" if has_order else "*fp32", "out": out_type,
        **dict.fromkeys(["M", "N", "K", "group_size", "stride_xm", "stride_qn", "stride_sn", "stride_om",
                         "stride_osplit"], "i32"),
    }
    constexprs = dict(BITS=bits, HAS_ZEROS=has_zeros, HAS_BIAS=has_bias, HAS_ORDER=has_order, INT8_X=int8_x,
                      ONE_GROUP=int8_x and group_size is None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                      BLOCK_K=config.block_k, SPLIT_K=config.split_k)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    groups = f"g{group_size}" if group_size else "per-channel"
    flags = "".join(f"+{flag}" for flag, on in (("zeros", has_zeros), ("act-order", has_order), ("bias", has_bias),
                                                ("int8-x", int8_x)) if on)
    return {"kernel": _quant_matmul_kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": config.num_warps, "num_stages": config.num_stages,
            "name": f"quant_matmul int{bits} {groups}{flags} {_TRITON_TYPES[dtype]} m={m}"}


# AWQ / GPTQ with zero points, GPTQ act order (symmetric), W8A16 per channel with a bias (Qwen2's q/k/v),
# W8A8 per channel; each for decode (split K), batched decode and prefill in bfloat16, and float16 once (the same
# code with another element type: each case costs the test suite seconds)
COMPILE_CASES = [
    compile_case(torch.bfloat16, bits, group_size, has_zeros, has_order, has_bias, m, int8_x)
    for bits, group_size, has_zeros, has_order, has_bias, int8_x in (
        (4, 128, True, False, False, False), (4, 128, False, True, False, False), (8, None, False, False, True, False),
        (8, None, False, False, False, True))
    for m in (16, 64, 512)
] + [compile_case(torch.float16, 4, 128, True, False, False, 16, False)]
