// Paged decode attention for the CPU: one query token per sequence over its cached K/V, read in
// place through the block table, row by row (all KV heads of a token lie together), each row once per
// step: every query head reads its KV head's slice of it. A work item is a sequence, or a run of its keys
// when there are fewer sequences than threads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include "vector_exp.h"
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

// s[0..n) = exp(s - peak), returning their sum
inline float exp_and_sum(float* s, int64_t n, float peak) {
  const __m512 shift = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < n) {
    const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), shift));
    _mm512_mask_storeu_ps(s + t, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  return _mm512_reduce_add_ps(sum);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

// float32 K/V 8 at a time, two sums in flight (an FMA waits on the last about 4 cycles): the compiler's
// vectorised loop keeps one and a scalar prologue, for a head_dim it does not know
template <>
inline float dot(const float* q, const float* k, int64_t head_dim) {
  if (head_dim % 16 != 0) {
    float sum = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * k[d];
    return sum;
  }
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), odd);
  }
  return sum8(_mm256_add_ps(even, odd));
}

template <>
inline void add_scaled(float* acc, const float* v, float p, int64_t head_dim) {
  if (head_dim % 8 != 0) {
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * v[d];
    return;
  }
  const __m256 scale = _mm256_set1_ps(p);
  for (int64_t d = 0; d < head_dim; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(scale, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
}

inline float exp_and_sum(float* s, int64_t n, float peak) {
  const __m256 shift = _mm256_set1_ps(peak);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = sum8(sum);
  for (; t < n; ++t) total += (s[t] = std::exp(s[t] - peak));
  return total;
}
#else
inline float exp_and_sum(float* s, int64_t n, float peak) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - peak));
  return sum;
}
#endif

// scores[h * n_keys + t] = q_h . K[first + t] for every query head h and the keys first..last - 1, read row
// by row (a row holds the token's K of every KV head; query head h reads KV head h / group's slice)
template <typename scalar_t>
void run_scores(float* scores, const float* query, int64_t num_heads, int64_t group, const scalar_t* k_ptr,
                const int32_t* table, int64_t k_block, int64_t k_row, int64_t k_head, int64_t block_size,
                int64_t first, int64_t last, int64_t head_dim) {
  const int64_t n_keys = last - first;
  for (int64_t start = first - first % block_size; start < last; start += block_size) {
    const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(block_size, last - start);
    const scalar_t* keys = k_ptr + table[start / block_size] * k_block;
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t h = 0; h < num_heads; ++h)
        scores[h * n_keys + start + t - first] = dot(query + h * head_dim, keys + t * k_row + (h / group) * k_head,
                                                     head_dim);
  }
}

// acc[h * v_dim + d] = sum over the keys first..last - 1 of probs[h * n_keys + t] * V[first + t][d], row by row
// (here head_dim is the values' width)
template <typename scalar_t>
void run_values(float* acc, const float* probs, int64_t num_heads, int64_t group, const scalar_t* v_ptr,
                const int32_t* table, int64_t v_block, int64_t v_row, int64_t v_head, int64_t block_size,
                int64_t first, int64_t last, int64_t head_dim) {
  const int64_t n_keys = last - first;
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t start = first - first % block_size; start < last; start += block_size) {
    const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(block_size, last - start);
    const scalar_t* values = v_ptr + table[start / block_size] * v_block;
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t h = 0; h < num_heads; ++h)
        add_scaled(acc + h * head_dim, values + t * v_row + (h / group) * v_head, probs[h * n_keys + start + t - first],
                   head_dim);
  }
}

constexpr int64_t kMinRunKeys = 64;

template <typename scalar_t>
void decode_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, int64_t window,
                   float softcap, const float* sink_ptr, int64_t max_splits) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t v_dim = v_cache.size(3);  // the values' width: head_dim, or fewer (a latent cache's first columns)
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

  // One work item per sequence, or, with fewer sequences than threads, per run of its keys (flash-decoding's
  // split): every item reads whole K/V rows front to back, the way the memory streams fastest. Splitting the
  // KV heads instead made each thread read every other piece of each row, which was slower inside a step,
  // where the cache is cold (docs/benchmarks.md). The runs' partial softmaxes are combined afterwards.
  const int64_t num_threads = at::get_num_threads();
  const int64_t longest = batch ? *std::max_element(lens, lens + batch) : 0;
  // runs of at least kMinRunKeys: a shorter one costs more in starting threads than it saves
  // max_splits 1: each sequence one run, whatever the batch (batch-invariant results)
  const int64_t most_splits = max_splits > 0 ? max_splits : (num_threads + batch - 1) / batch;
  const int64_t num_splits = batch >= num_threads ? 1 : std::clamp<int64_t>(longest / kMinRunKeys, 1, most_splits);
  std::vector<float> part_max, part_sum, part_acc;  // per (sequence, run): each head's max, sum and sums of V
  if (num_splits > 1) {
    part_max.resize(batch * num_splits * num_heads);
    part_sum.resize(batch * num_splits * num_heads);
    part_acc.resize(batch * num_splits * num_heads * v_dim);
  }
  at::parallel_for(0, batch * num_splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(num_heads * head_dim), acc(num_heads * v_dim), scores, inv(num_heads);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_splits, split = item % num_splits;
      const int64_t context_len = lens[seq];
      scalar_t* o_seq_ptr = o_ptr + seq * o_seq;
      if (context_len == 0) {  // a padding row: nothing to attend to
        if (split == 0)
          for (int64_t h = 0; h < num_heads; ++h)
            std::fill(o_seq_ptr + h * o_head, o_seq_ptr + h * o_head + v_dim, scalar_t(0));
        continue;
      }
      // the keys this query sees: the last `window` of its context (blocks before them are never read); this
      // item's run of them, in whole 16s
      const int64_t first = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
      const int64_t run = ((context_len - first + num_splits - 1) / num_splits + 15) / 16 * 16;
      const int64_t lo = std::min(context_len, first + split * run), hi = std::min(context_len, lo + run);
      const int64_t n_keys = hi - lo;
      const int64_t part = (seq * num_splits + split) * num_heads;
      if (n_keys == 0) {  // a short context's last runs: nothing to add
        std::fill(part_sum.begin() + part, part_sum.begin() + part + num_heads, 0.f);
        std::fill(part_max.begin() + part, part_max.begin() + part + num_heads,
                  -std::numeric_limits<float>::infinity());
        continue;
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* src = q_ptr + seq * q_seq + h * q_head;
        for (int64_t d = 0; d < head_dim; ++d) query[h * head_dim + d] = static_cast<float>(src[d]) * scale;
      }
      scores.resize(num_heads * n_keys);
      const int32_t* table = tables + seq * max_blocks;
      run_scores(scores.data(), query.data(), num_heads, group, k_ptr, table, k_block, k_row, k_head, block_size, lo,
                 hi, head_dim);
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = &scores[h * n_keys];
        if (softcap > 0.f)
          for (int64_t t = 0; t < n_keys; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
        float peak = *std::max_element(s, s + n_keys);
        if (num_splits > 1) {  // the sink joins when the runs are combined
          part_max[part + h] = peak;
          part_sum[part + h] = exp_and_sum(s, n_keys, peak);
          continue;
        }
        // a sink is one more logit in the softmax, with no value row
        if (sink_ptr) peak = std::max(peak, sink_ptr[h]);
        inv[h] = 1.f / (exp_and_sum(s, n_keys, peak) + (sink_ptr ? std::exp(sink_ptr[h] - peak) : 0.f));
      }
      float* sums = num_splits > 1 ? &part_acc[part * v_dim] : acc.data();
      run_values(sums, scores.data(), num_heads, group, v_ptr, table, v_block, v_row, v_head, block_size, lo, hi,
                 v_dim);
      if (num_splits == 1)
        for (int64_t h = 0; h < num_heads; ++h) {
          scalar_t* o = o_seq_ptr + h * o_head;
          for (int64_t d = 0; d < v_dim; ++d) o[d] = static_cast<scalar_t>(acc[h * v_dim + d] * inv[h]);
        }
    }
  });
  if (num_splits == 1) return;
  // each head's runs as one softmax: every run's sums rescaled to the largest maximum
  std::vector<float> out_row(v_dim);
  for (int64_t seq = 0; seq < batch; ++seq) {
    if (lens[seq] == 0) continue;
    for (int64_t h = 0; h < num_heads; ++h) {
      float peak = sink_ptr ? sink_ptr[h] : -std::numeric_limits<float>::infinity();
      for (int64_t split = 0; split < num_splits; ++split)
        peak = std::max(peak, part_max[(seq * num_splits + split) * num_heads + h]);
      float total = sink_ptr ? std::exp(sink_ptr[h] - peak) : 0.f;
      std::fill(out_row.begin(), out_row.end(), 0.f);
      for (int64_t split = 0; split < num_splits; ++split) {
        const int64_t part = (seq * num_splits + split) * num_heads + h;
        if (part_sum[part] == 0.f) continue;  // an empty run
        const float weight = std::exp(part_max[part] - peak);
        total += weight * part_sum[part];
        const float* sums = &part_acc[part * v_dim];
        for (int64_t d = 0; d < v_dim; ++d) out_row[d] += weight * sums[d];
      }
      scalar_t* o = o_ptr + seq * o_seq + h * o_head;
      for (int64_t d = 0; d < v_dim; ++d) o[d] = static_cast<scalar_t>(out_row[d] / total);
    }
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                            const c10::optional<at::Tensor>& sinks, int64_t max_splits) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3) &&
                  v_cache.size(3) <= k_cache.size(3),
              "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] (v_cache's head_dim may "
              "be fewer: a latent cache's values are its keys' first columns)");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1) &&
                  out.size(2) == v_cache.size(3),
              "q must be [batch, num_heads, head_dim] and out [batch, num_heads, v_cache's head_dim]");
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
  TORCH_CHECK(max_splits >= 0, "max_splits must be >= 0 (0: as many runs as help)");
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "sinks must be a contiguous float32 tensor of one logit per query head");
    sink_ptr = sinks->data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, static_cast<float>(scale),
                            window, static_cast<float>(softcap), sink_ptr, max_splits);
  });
}

}  // namespace

TORCH_LIBRARY(tpengine_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int window, float softcap, Tensor? sinks, "
        "int max_splits=0) -> ()");
}

TORCH_LIBRARY_IMPL(tpengine_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
