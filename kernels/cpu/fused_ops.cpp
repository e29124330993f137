// Fused elementwise ops of the CPU decoder: RMSNorm (with the residual add), q/k RMSNorm + rotary
// embedding, SiLU-and-mul, and the KV-cache store. Each replaces several small torch ops (each its own
// dispatch, allocation and pass over memory) with one pass; at decode batch sizes those ops cost more
// than their arithmetic. float32, bfloat16 and float16 in, float32 math inside, rounded back to the
// input dtype wherever transformers rounds (so float32 follows transformers' op order exactly).
// Built with -ffp-contract=off (kernels/cpu/fused_ops.py): no FMA may merge a product into a sum
// that transformers rounds separately.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>  // torch's own exp: SiLU here computes what torch's vectorized SiLU does
#define FUSED_EXP_ISA "avx512"
#elif defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#define FUSED_EXP_ISA "avx2"
#else
#define FUSED_EXP_ISA "scalar"
#endif

namespace {

// rows of at least this many elements in all are worth more than one thread
constexpr int64_t kParallelElements = 1 << 15;

int64_t grain_for(int64_t row_elements) { return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, row_elements)); }

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// 1 / sqrt(mean(x^2) + eps) over n values already in float32, as transformers' Qwen3RMSNorm computes it
inline float inverse_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = weight * (x * inv).to(T), the product rounded to T: transformers' cast back, then the weight
template <typename T>
inline void scale_by_weight(T* out, const float* x, float inv, const T* weight, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = round_to<T>(static_cast<float>(round_to<T>(x[i] * inv)) * static_cast<float>(weight[i]));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with hidden contiguous");
}

// --- RMSNorm ---------------------------------------------------------------------------------------

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "out must be x's shape and weight [hidden]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, out and weight must share one dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      std::vector<float> row(n);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* src = x_ptr + r * x.stride(0);
        for (int64_t i = 0; i < n; ++i) row[i] = static_cast<float>(src[i]);
        scale_by_weight(o_ptr + r * out.stride(0), row.data(), inverse_rms(row.data(), n, eps), w, n);
      }
    });
  });
}

template <typename T>
void add_rms_norm_kernel(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* x_ptr = x.data_ptr<T>();
  T* res_ptr = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x_ptr + r * x.stride(0);
      T* res = res_ptr + r * residual.stride(0);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const T sum = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(res[i]));
        res[i] = sum;
        row[i] = static_cast<float>(sum);
      }
      scale_by_weight(xr, row.data(), inverse_rms(row.data(), n, eps), w, n);
    }
  });
}

// residual = x + residual (rounded to the dtype, as torch's add), then x = rms_norm(residual): both in place
void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous(), "residual must be x's shape and weight [hidden]");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, residual and weight must share one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "add_rms_norm_",
                                  [&] { add_rms_norm_kernel<scalar_t>(x, residual, weight, eps); });
}

// --- q/k RMSNorm + rotary embedding ----------------------------------------------------------------

// One head's vector, RMS-normed over head_dim first when weight is given (rounded to T, as the norm's
// output is), then rotated neox style: [x1 cos - x2 sin, x2 cos + x1 sin], each product rounded.
template <typename T>
inline void norm_and_rotate(T* x, const T* weight, float eps, const float* cos, const float* sin, int64_t head_dim,
                            float* row) {
  for (int64_t i = 0; i < head_dim; ++i) row[i] = static_cast<float>(x[i]);
  if (weight != nullptr) {
    const float inv = inverse_rms(row, head_dim, eps);
#pragma omp simd
    for (int64_t i = 0; i < head_dim; ++i)
      row[i] = static_cast<float>(round_to<T>(static_cast<float>(round_to<T>(row[i] * inv)) * static_cast<float>(weight[i])));
  }
  const int64_t half = head_dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = row[i], x2 = row[i + half];
    const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
    x[i] = round_to<T>(a - b);
    x[i + half] = round_to<T>(c + d);
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [tokens, heads, head_dim] with head_dim contiguous");
}

void qk_norm_rotary_(at::Tensor q, at::Tensor k, const std::optional<at::Tensor>& q_weight,
                     const std::optional<at::Tensor>& k_weight, double eps, const at::Tensor& positions,
                     const at::Tensor& cos_sin_cache) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == head_dim && head_dim % 2 == 0, "q and k must share tokens and an even head_dim");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k must share one dtype");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "q_weight and k_weight come together");
  for (const auto* w : {&q_weight, &k_weight})
    if (w->has_value())
      TORCH_CHECK((*w)->dim() == 1 && (*w)->size(0) == head_dim && (*w)->is_contiguous() &&
                      (*w)->scalar_type() == q.scalar_type(), "the norm weights must be [head_dim] in q's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == tokens &&
                  positions.is_contiguous(), "positions must be [tokens] int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) == head_dim && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be [max_position, head_dim] float32 (cos half, then sin half)");
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " is outside the rotary cache's 0..",
                max_position - 1);
  const float* cs = cos_sin_cache.data_ptr<float>();
  const int64_t num_q = q.size(1), num_k = k.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "qk_norm_rotary_", [&] {
    scalar_t* q_ptr = q.data_ptr<scalar_t>();
    scalar_t* k_ptr = k.data_ptr<scalar_t>();
    const scalar_t* qw = q_weight.has_value() ? q_weight->data_ptr<scalar_t>() : nullptr;
    const scalar_t* kw = k_weight.has_value() ? k_weight->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, tokens, grain_for((num_q + num_k) * head_dim), [&](int64_t begin, int64_t end) {
      std::vector<float> row(head_dim);
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cs + pos[t] * head_dim;
        const float* sin = cos + head_dim / 2;
        for (int64_t h = 0; h < num_q; ++h)
          norm_and_rotate(q_ptr + t * q.stride(0) + h * q.stride(1), qw, eps, cos, sin, head_dim, row.data());
        for (int64_t h = 0; h < num_k; ++h)
          norm_and_rotate(k_ptr + t * k.stride(0) + h * k.stride(1), kw, eps, cos, sin, head_dim, row.data());
      }
    });
  });
}

// --- SiLU and mul ----------------------------------------------------------------------------------

// x[i] = x[i] / (1 + exp(-x[i])): torch's SiLU, vectorized the way its kernel is (two vectors a step,
// the tail scalar), so float32 gets torch's bits wherever this build's vector width is torch's
void silu_in_place(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f), neg_zero = _mm512_set1_ps(-0.f);
  for (; i + 32 <= n; i += 32)
    for (int64_t j = i; j < i + 32; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      _mm512_storeu_ps(x + j, _mm512_div_ps(v, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(neg_zero, v)))));
    }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f), neg_zero = _mm256_set1_ps(-0.f);
  for (; i + 16 <= n; i += 16)
    for (int64_t j = i; j < i + 16; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      _mm256_storeu_ps(x + j, _mm256_div_ps(v, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(neg_zero, v)))));
    }
#endif
  for (; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

template <typename T>
void silu_and_mul_kernel(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* x_ptr = x.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_for(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x_ptr + r * x.stride(0);
      const T* up = g + d;
      T* o = o_ptr + r * out.stride(0);
      for (int64_t i = 0; i < d; ++i) gate[i] = static_cast<float>(g[i]);
      silu_in_place(gate.data(), d);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = round_to<T>(static_cast<float>(round_to<T>(gate[i])) * static_cast<float>(up[i]));
    }
  });
}

// out = silu(gate) * up, x = [gate | up] along the last dimension; silu's output rounded to the dtype
// before the product, as torch's silu then mul_ do
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), d = out.size(1);
  TORCH_CHECK(out.size(0) == rows && x.size(1) == 2 * d, "x must be [rows, 2 * d] and out [rows, d]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "x and out must share one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_kernel<scalar_t>(out, x); });
}

std::string exp_isa() { return FUSED_EXP_ISA; }

// --- KV-cache store --------------------------------------------------------------------------------

// Each token's K and V rows into its cache slot; slot -1 (padding) is skipped. No mask tensor, no host
// sync: the slots are read here.
void store_kvcache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping) {
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "the caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) && v.sizes() == k.sizes(),
              "k and v must be [tokens, num_kv_heads, head_dim] of the cache's heads and head_dim");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(), "k, v and the caches must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0), "slot_mapping must be [tokens] int64");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), slot_elems = heads * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot ", slots[t], " of token ", t,
                " is outside the cache's ", num_slots, " slots (-1 marks padding)");
  const int64_t bytes = head_dim * k.element_size();
  auto* k_src = static_cast<const char*>(k.data_ptr());
  auto* v_src = static_cast<const char*>(v.data_ptr());
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t elem = k.element_size();
  at::parallel_for(0, tokens, grain_for(2 * slot_elems), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (slots[t] * slot_elems + h * head_dim) * elem;
        std::memcpy(k_dst + dst, k_src + (t * k.stride(0) + h * k.stride(1)) * elem, bytes);
        std::memcpy(v_dst + dst, v_src + (t * v.stride(0) + h * v.stride(1)) * elem, bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(tpengine_fused, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("qk_norm_rotary_(Tensor(a!) q, Tensor(b!) k, Tensor? q_weight, Tensor? k_weight, float eps, "
        "Tensor positions, Tensor cos_sin_cache) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("exp_isa() -> str", &exp_isa);
}

TORCH_LIBRARY_IMPL(tpengine_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("qk_norm_rotary_", &qk_norm_rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("store_kvcache", &store_kvcache);
}
