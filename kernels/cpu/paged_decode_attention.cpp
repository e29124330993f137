// Paged decode attention for the CPU: one query token per sequence over its cached K/V, read in
// place through the block table. One work item is one (sequence, KV head) pair: its group of query
// heads shares every K/V row it loads, so each row is read once per step.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t head_dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename scalar_t>
inline void add_scaled(float* acc, const scalar_t* v, float p, int64_t head_dim) {
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

#if defined(__AVX512F__)
// bfloat16 K/V widened 16 at a time (a bfloat16 is a float's top half): the compiler does not
// vectorise c10::BFloat16's conversion, which made bfloat16 attention slower than float32's
inline __m512 widen(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <>
inline float dot(const float* q, const c10::BFloat16* k, int64_t head_dim) {
  if (head_dim % 16 != 0) {
    float sum = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * static_cast<float>(k[d]);
    return sum;
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), widen(k + d), sum);
  return _mm512_reduce_add_ps(sum);
}

template <>
inline void add_scaled(float* acc, const c10::BFloat16* v, float p, int64_t head_dim) {
  if (head_dim % 16 != 0) {
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * static_cast<float>(v[d]);
    return;
  }
  const __m512 scale = _mm512_set1_ps(p);
  for (int64_t d = 0; d < head_dim; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(scale, widen(v + d), _mm512_loadu_ps(acc + d)));
}
#endif

template <typename scalar_t>
void decode_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, int64_t window,
                   float softcap, const float* sink_ptr) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t max_blocks = block_tables.size(1);
  // strides in elements; the innermost (head_dim) stride is 1, checked by the caller
  const int64_t k_block = k_cache.stride(0), k_row = k_cache.stride(1), k_head = k_cache.stride(2);
  const int64_t v_block = v_cache.stride(0), v_row = v_cache.stride(1), v_head = v_cache.stride(2);
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();

  // what the loop below reads through the tables stays inside the cache
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t seq = 0; seq < batch; ++seq) {
    TORCH_CHECK(lens[seq] >= 0 && lens[seq] <= max_blocks * block_size, "context length ", lens[seq],
                " of sequence ", seq, " is outside 0..", max_blocks * block_size, " (its block table's capacity)");
    const int64_t first_block = window > 0 ? std::max<int64_t>(0, lens[seq] - window) / block_size : 0;
    for (int64_t i = first_block; i < (lens[seq] + block_size - 1) / block_size; ++i) {
      const int32_t block = tables[seq * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " in sequence ", seq,
                  "'s table is outside the cache's ", num_blocks, " blocks");
    }
  }

  // One work item per sequence: a token's K (and V) rows of all KV heads lie next to each other, so
  // each block is read front to back once per step. Splitting a sequence's heads over the threads was
  // faster alone but about 2x slower inside the engine's batch-1 step (docs/benchmarks.md).
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(num_heads * head_dim), acc(num_heads * head_dim), scores, inv_sum(num_heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t context_len = lens[seq];
      scalar_t* o_seq_ptr = o_ptr + seq * o_seq;
      if (context_len == 0) {  // a padding row: nothing to attend to
        for (int64_t h = 0; h < num_heads; ++h) std::fill(o_seq_ptr + h * o_head, o_seq_ptr + h * o_head + head_dim, scalar_t(0));
        continue;
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* src = q_ptr + seq * q_seq + h * q_head;
        for (int64_t d = 0; d < head_dim; ++d) query[h * head_dim + d] = static_cast<float>(src[d]) * scale;
      }
      // the keys this query sees: the last `window` of its context (blocks before them are never read)
      const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
      const int64_t n_keys = context_len - first;
      // scores[h * n_keys + t]: query head h against key first + t; query head h reads KV head h / group
      scores.resize(num_heads * n_keys);
      const int32_t* table = tables + seq * max_blocks;
      for (int64_t start = first - first % block_size; start < context_len; start += block_size) {
        const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(block_size, context_len - start);
        const scalar_t* keys = k_ptr + table[start / block_size] * k_block;
        for (int64_t t = lo; t < hi; ++t)
          for (int64_t h = 0; h < num_heads; ++h)
            scores[h * n_keys + start + t - first] =
                dot(&query[h * head_dim], keys + t * k_row + (h / group) * k_head, head_dim);
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = &scores[h * n_keys];
        if (softcap > 0.f)
          for (int64_t t = 0; t < n_keys; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
        // a sink is one more logit in the softmax, with no value row
        float peak = *std::max_element(s, s + n_keys);
        if (sink_ptr) peak = std::max(peak, sink_ptr[h]);
        float sum = sink_ptr ? std::exp(sink_ptr[h] - peak) : 0.f;
        for (int64_t t = 0; t < n_keys; ++t) sum += (s[t] = std::exp(s[t] - peak));
        inv_sum[h] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = first - first % block_size; start < context_len; start += block_size) {
        const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(block_size, context_len - start);
        const scalar_t* values = v_ptr + table[start / block_size] * v_block;
        for (int64_t t = lo; t < hi; ++t)
          for (int64_t h = 0; h < num_heads; ++h)
            add_scaled(&acc[h * head_dim], values + t * v_row + (h / group) * v_head,
                       scores[h * n_keys + start + t - first], head_dim);
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* o = o_seq_ptr + h * o_head;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv_sum[h]);
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                            const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [batch, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim of q and the cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, out and the caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "block tables must be contiguous");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "one block table and context length per sequence");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "sinks must be a contiguous float32 tensor of one logit per query head");
    sink_ptr = sinks->data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, static_cast<float>(scale),
                            window, static_cast<float>(softcap), sink_ptr);
  });
}

}  // namespace

TORCH_LIBRARY(tpengine_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int window, float softcap, Tensor? sinks) -> ()");
}

TORCH_LIBRARY_IMPL(tpengine_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
