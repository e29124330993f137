"""The torch code of the ops each platform runs its own way, in transformers' op order: CUDA compiles it
(cuda.py), the CPU falls back to it where its C++ op does not take a tensor (cpu.py), and the tests
measure both against it. Any device runs it as written."""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tpengine.quantization.weights import quantize_per_token


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.float()  # variance in float32, as transformers computes it
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    # transformers' weight * x, in place on the fresh product: the same values, and on the CPU
    # several times faster than broadcasting the weight as the first operand into a new tensor
    return x.to(orig_dtype).mul_(weight)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual normed, x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with gate and up packed in the last dimension."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate).mul_(up)  # in place on silu's fresh output: one large allocation fewer


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at limit and up to [-limit, limit],
    with gate and up packed in the last dimension (transformers' GptOssExperts, op for op)."""
    gate, up = x.chunk(2, -1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# --- rotary embedding: two forms of the same values ------------------------------------------------

def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [tokens, 1, head_dim / 2] each: broadcast over heads
    return cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)


def _rotate_into_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    # [x1 cos - x2 sin, x2 cos + x1 sin], transformers' op order
    out = torch.empty(x.shape, dtype=x1.dtype, device=x.device)
    low, high = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=low).sub_(x2 * sin)
    torch.mul(x2, cos, out=high).add_(x1 * sin)
    return out.to(x.dtype)


def _rotate_pointwise(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    halves = x.float().unflatten(-1, (2, -1))                     # [..., 2, head_dim / 2]: x1, x2
    # [[-1], [1]]: x1 cos - x2 sin, x2 cos + x1 sin; made on the device (no host copy: CUDA-graph safe)
    sign = torch.arange(-1, 2, 2, dtype=torch.float32, device=x.device).unsqueeze(-1)
    rotated = halves * cos.unsqueeze(-2) + halves.flip(-2) * (sign * sin.unsqueeze(-2))
    return rotated.flatten(-2).to(x.dtype)


def apply_rotary_in_halves(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] rotated by each token's position (neox
    style), each half written in place into one output: the CPU's eager form, faster there."""
    cos, sin = _cos_sin(positions, cos_sin_cache)
    return _rotate_into_halves(q, cos, sin), _rotate_into_halves(k, cos, sin)


def apply_rotary_pointwise(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values in broadcast elementwise ops alone (no out= into strided views, which torch.compile
    cannot trace, and no cat): CUDA's form, compiled as one graph, one kernel each for q and k (the gather of
    cos/sin fused into both)."""
    cos, sin = _cos_sin(positions, cos_sin_cache)
    return _rotate_pointwise(q, cos, sin), _rotate_pointwise(k, cos, sin)


# --- KV-cache store and mixture-of-experts ---------------------------------------------------------

def store_kvcache_masked(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Each token's K/V into its cache slot, skipping slot -1 (padding); the mask costs a host sync."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid])


def grouped_experts(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    act_and_mul=silu_and_mul, linear=F.linear, w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's chosen experts of weight * down(act_and_mul(gate_up(x))), act_and_mul being
    silu(gate) * up unless given; x [tokens, hidden], w13 [experts, 2 * intermediate, hidden] (gate then up), w2
    [experts, hidden, intermediate]: the arguments of Triton's fused_experts. Biases (gpt-oss's: w13_bias
    [experts, 2 * intermediate], w2_bias [experts, hidden]) are added after each matmul, as transformers adds them.

    Tokens are grouped by expert: each chosen expert runs its two matmuls once over its tokens, in
    ascending expert order (the order transformers adds them in); unchosen experts cost nothing. Quantized
    experts come as lists of packed weights, with the linear that multiplies them.
    """
    top_k = topk_ids.size(1)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)                 # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=len(w13)).tolist()
    flat_weights = topk_weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        h = linear(x[tokens], w13[expert])
        if w13_bias is not None:
            h = h + w13_bias[expert]
        h = linear(act_and_mul(h), w2[expert])
        if w2_bias is not None:
            h = h + w2_bias[expert]
        h = h * flat_weights[pairs, None]
        out[tokens] += h  # a token picks an expert once, so rows never collide (index_add_ is far slower on CPU)
    return out


# --- quantized weights without a kernel ------------------------------------------------------------

class DequantizedWeight(NamedTuple):
    """A quantized weight on a platform with no kernel for it: its float value, multiplied as any float weight
    (an "int8" activation linear quantizes its input per token first). The same numbers, no memory saved."""
    weight: torch.Tensor  # [out, in], in the input's column order
    activation: str

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.activation == "int8":
            values, scales = quantize_per_token(x)
            x = (values.float() * scales).to(x.dtype)
        return F.linear(x, self.weight, bias)

    def rows(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(token_ids, self.weight).to(dtype)


def dequantized_weight(quantized, dtype: torch.dtype) -> DequantizedWeight:
    return DequantizedWeight(quantized.dequantize(dtype), quantized.activation)


# --- LoRA ------------------------------------------------------------------------------------------

def lora_add_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   scales: torch.Tensor, slots: torch.Tensor) -> None:
    """y[t] += scales[s] * (x[t] @ lora_a[s]) @ lora_b[s] for each row t of slot s = slots[t] >= 0, in place, in
    float32 and rounded to y's dtype once; rows of slot -1 are left as they are. y [T, N], x [T, K], lora_a
    [S, K, R], lora_b [S, R, N], scales float32 [S], slots int64 [T].

    Every slot's product is taken for every row and the other slots' masked off (0/1 products, exact): ops whose
    shapes never depend on the slots' values, so a CPU decode step that calls this can be recorded and replayed
    (runner/cpu_replay.py's RECORDABLE_ATEN, which has no arange: the one-hot is S comparisons). The unused
    slots' weights must be finite (zeros): 0 * inf would leak into other rows."""
    num_slots, in_features, rank = lora_a.shape
    one_hot = torch.stack([slots == s for s in range(num_slots)], dim=1).float()  # [T, S], a -1 row all zeros
    shrunk = x.float() @ lora_a.float().permute(1, 0, 2).reshape(in_features, num_slots * rank)
    masked = (shrunk.view(-1, num_slots, rank) * one_hot.unsqueeze(2)).view(-1, num_slots * rank)
    expanded = masked @ lora_b.float().reshape(num_slots * rank, -1)
    row_scale = one_hot @ scales.unsqueeze(1)  # [T, 1]: the row's slot's scale, 0 for -1
    updated = (y.float() + expanded * row_scale).to(y.dtype)
    y.copy_(torch.where((slots >= 0).unsqueeze(1), updated, y))
