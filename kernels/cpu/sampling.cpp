// One token per row of float32 logits on the CPU: argmax for temperature 0, else an inverse-CDF draw
// from softmax(logits / temperature) with a uniform the host drew. The full-vocabulary float64
// cumulative sum the torch path builds (0.7 ms a step on one core at 64 x 16,384) is never written out:
// one pass finds the row's maximum, one exponentiates and sums in blocks, and the pick walks the block
// sums and then one block.
//
// The vocabulary may come in slices: tensor-parallel ranks each hold one, and sample their own slice
// (slice_stats), share those few numbers per row, and the rank whose slice holds the draw finds the token
// (slice_tokens), so no rank gathers every logit. Rank 0 sampling gathered logits cuts them into the same
// slices and runs the same two steps, so a row's token depends only on its own logits, temperature and
// uniform: never on its batch, the path its step took, or how rows are split over threads.
//
// Structured outputs: a row may come with its grammar's token mask (xgrammar's bitmask: token j allowed when
// bit j % 32 of word j / 32 is set). Every pass reads a masked-out logit as -inf, so the row samples exactly
// what it would after the mask was written into the logits, without that pass over the row, and its exps
// are skipped 16 masked tokens at a time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>
#endif

namespace {

constexpr int64_t kBlock = 256;  // entries per block sum: the pick recomputes at most one block
constexpr int64_t kParallelElements = 1 << 15;  // a thread gets rows of at least this many logits

// A row's token mask over one slice of the vocabulary: the slice's entry i is token offset + i. bits null: every
// token allowed. The passes below take it as a template switch (Masked), so an unmasked row runs the code it ran
// before masks existed, at its speed.
struct RowMask {
  const uint32_t* bits = nullptr;
  int64_t offset = 0, words = 0;

  bool allows(int64_t i) const {
    const int64_t j = offset + i;
    return !bits || (bits[j >> 5] >> (j & 31)) & 1u;
  }
  // entries i..i+15 as 16 lanes (lane k: entry i + k); entries past the bitmask's words read as masked
  uint32_t lanes16(int64_t i) const {
    if (!bits) return 0xFFFFu;
    const int64_t j = offset + i, w = j >> 5, b = j & 31;
    uint64_t two = w < words ? bits[w] : 0u;
    if (b > 16 && w + 1 < words) two |= static_cast<uint64_t>(bits[w + 1]) << 32;
    return static_cast<uint32_t>(two >> b) & 0xFFFFu;
  }
  // the mask of the entries from `start` on
  RowMask from(int64_t start) const { return {bits, offset + start, words}; }
};

struct RowMax {
  float value;
  bool has_nan;
};

template <bool Masked>
RowMax row_max(const float* x, int64_t n, const RowMask& mask) {
  float best = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vbest = _mm512_set1_ps(best);
  __mmask16 nan_lanes = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = Masked ? _mm512_mask_loadu_ps(_mm512_set1_ps(best), __mmask16(mask.lanes16(i)), x + i)
                            : _mm512_loadu_ps(x + i);
    nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vbest = _mm512_max_ps(vbest, v);
  }
  best = _mm512_reduce_max_ps(vbest);
  has_nan = nan_lanes != 0;
#endif
  for (; i < n; ++i) {
    if (Masked && !mask.allows(i)) continue;
    has_nan |= std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  return {best, has_nan};
}

// out[i] = exp((x[i] - max) / temperature) for i < n <= kBlock, 0 (exp(-inf)) where the mask has x[i] out;
// x and the mask start at the same entry
template <bool Masked>
void block_exps(const float* x, int64_t n, float max, float temperature, const RowMask& mask, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max), vt = _mm512_set1_ps(temperature);
  for (; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    if constexpr (!Masked) {
      const __m512 v = _mm512_mask_loadu_ps(vmax, lanes, x + i);  // lanes past n give exp(0), not stored
      _mm512_mask_storeu_ps(out + i, lanes, Sleef_expf16_u10(_mm512_div_ps(_mm512_sub_ps(v, vmax), vt)));
    } else {
      const __mmask16 allowed = lanes & __mmask16(mask.lanes16(i));
      if (!allowed) {  // 16 masked tokens: no exp to compute
        _mm512_mask_storeu_ps(out + i, lanes, _mm512_setzero_ps());
        continue;
      }
      const __m512 v = _mm512_mask_loadu_ps(vmax, allowed, x + i);  // other lanes: exp(0), zeroed or not stored
      const __m512 e = Sleef_expf16_u10(_mm512_div_ps(_mm512_sub_ps(v, vmax), vt));
      _mm512_mask_storeu_ps(out + i, lanes, _mm512_maskz_mov_ps(allowed, e));
    }
  }
#else
  for (; i < n; ++i) out[i] = !Masked || mask.allows(i) ? std::exp((x[i] - max) / temperature) : 0.f;
#endif
}

// sum of e[0..n) in float64, eight running sums in a fixed order (vectorizable without reassociation)
double block_sum(const float* e, int64_t n) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += e[i + j];
  for (; i < n; ++i) lanes[i & 7] += e[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

template <bool Masked>
int64_t first_index_of(const float* x, int64_t n, float value, const RowMask& mask) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == value && (!Masked || mask.allows(i))) return i;
  return -1;
}

// sums[b] = the block sums of exp((x - max) / temperature) over x[0..n); returns their total, summed in
// block order
template <bool Masked>
double block_sums(const float* x, int64_t n, float max, float temperature, const RowMask& mask, double* sums) {
  float e[kBlock];
  double total = 0;
  for (int64_t b = 0; b * kBlock < n; ++b) {
    const int64_t len = std::min(kBlock, n - b * kBlock);
    block_exps<Masked>(x + b * kBlock, len, max, temperature, mask.from(b * kBlock), e);
    sums[b] = block_sum(e, len);
    total += sums[b];
  }
  return total;
}

// The first entry whose cumulative mass (in block_sums' units) exceeds target, as
// torch.searchsorted(right=True) over the cumulative sum: an entry of probability 0 is never picked.
// Past the total (rounding), the last entry with any mass.
template <bool Masked>
int64_t walk(const float* x, int64_t n, float max, float temperature, const RowMask& mask, const double* sums,
             double target) {
  float e[kBlock];
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double before = 0;
  int64_t b = 0;
  for (; b < blocks && before + sums[b] <= target; ++b) before += sums[b];
  const bool past_the_end = b == blocks;
  if (past_the_end)
    for (b = blocks - 1; b > 0 && sums[b] <= 0; --b) {}  // the last block with any mass
  const int64_t len = std::min(kBlock, n - b * kBlock);
  block_exps<Masked>(x + b * kBlock, len, max, temperature, mask.from(b * kBlock), e);
  int64_t last_positive = 0;
  for (int64_t i = 0; i < len; ++i) {
    if (e[i] <= 0) continue;
    before += e[i];
    if (before > target && !past_the_end) return b * kBlock + i;
    last_positive = i;
  }
  // past the end, or the block's own order summed a hair short of its block sum: its last likely entry
  return b * kBlock + last_positive;
}

void check_rows(const at::Tensor& logits, const at::Tensor& temperatures) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && (logits.stride(1) == 1 || logits.size(1) <= 1),
              "logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous() &&
                  temperatures.numel() == logits.size(0), "temperatures must be float32 [rows]");
}

int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// The rows' token masks, if any: int32 [rows, words] whose words cover the slice's tokens offset..offset + n
struct Masks {
  const uint32_t* bits = nullptr;
  int64_t words = 0, offset = 0;

  Masks(const c10::optional<at::Tensor>& bitmask, int64_t rows, int64_t offset, int64_t n) : offset(offset) {
    if (!bitmask.has_value() || !bitmask->defined()) return;
    TORCH_CHECK(bitmask->scalar_type() == at::kInt && bitmask->is_contiguous() && bitmask->dim() == 2 &&
                    bitmask->size(0) == rows, "bitmask must be contiguous int32 [rows, words]");
    words = bitmask->size(1);
    TORCH_CHECK(offset >= 0 && words * 32 >= offset + n, "the bitmask's ", words, " words do not cover tokens ",
                offset, "..", offset + n);
    bits = reinterpret_cast<const uint32_t*>(bitmask->data_ptr<int32_t>());
  }
  RowMask row(int64_t r) const { return bits ? RowMask{bits + r * words, offset, words} : RowMask{}; }
};

// Per row of one slice of the vocabulary: stats[r] = {the maximum (NaN where the row has a NaN), the sum
// of exp((x - max) / temperature) (0 where the temperature is 0), the first index of the maximum (where
// the temperature is 0, else -1)}, and block_sums[r] the sum's blocks, which slice_tokens walks.
void slice_stats(const at::Tensor& logits, const at::Tensor& temperatures, at::Tensor stats, at::Tensor sums,
                 const c10::optional<at::Tensor>& bitmask, int64_t offset) {
  check_rows(logits, temperatures);
  const int64_t rows = logits.size(0), n = logits.size(1), blocks = num_blocks(n);
  const Masks masks(bitmask, rows, offset, n);
  TORCH_CHECK(stats.scalar_type() == at::kDouble && stats.is_contiguous() && stats.numel() == rows * 3,
              "stats must be float64 [rows, 3]");
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.is_contiguous() && sums.numel() == rows * blocks,
              "block sums must be float64 [rows, ceil(vocab / ", kBlock, ")]");
  const float* data = logits.data_ptr<float>();
  const float* temperature = temperatures.data_ptr<float>();
  double* out = stats.data_ptr<double>();
  double* block = sums.data_ptr<double>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, n)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = data + r * row_stride;
      const RowMask mask = masks.row(r);
      const bool masked = mask.bits != nullptr;
      const RowMax m = masked ? row_max<true>(x, n, mask) : row_max<false>(x, n, mask);
      double* row = out + 3 * r;
      row[0] = m.has_nan ? std::numeric_limits<double>::quiet_NaN() : m.value;
      row[1] = 0;
      row[2] = -1;
      if (m.has_nan || !std::isfinite(m.value)) continue;
      if (temperature[r] == 0.f) {
        row[2] = static_cast<double>(masked ? first_index_of<true>(x, n, m.value, mask)
                                            : first_index_of<false>(x, n, m.value, mask));
      } else {
        double* row_sums = block + r * blocks;
        row[1] = masked ? block_sums<true>(x, n, m.value, temperature[r], mask, row_sums)
                        : block_sums<false>(x, n, m.value, temperature[r], mask, row_sums);
      }
    }
  });
}

// Every slice's stats of a row decide which slice holds its token: the one with the first maximum
// (temperature 0), else the one whose share of the cumulative mass, in slice order, holds
// uniform * total. Where that is slice `slice` (this one), out[r] = offset + the token's index in it;
// rows without a distribution (a NaN, no finite maximum) get -1 from slice 0; other rows are left alone.
// all_stats is [slices, rows, 3] from slice_stats, the same on every caller, so callers agree.
void slice_tokens(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms,
                  const at::Tensor& all_stats, const at::Tensor& sums, int64_t slice, int64_t offset, at::Tensor out,
                  const c10::optional<at::Tensor>& bitmask) {
  check_rows(logits, temperatures);
  const int64_t rows = logits.size(0), n = logits.size(1), blocks = num_blocks(n);
  const Masks masks(bitmask, rows, offset, n);
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == rows,
              "uniforms must be float64 [rows]");
  TORCH_CHECK(all_stats.scalar_type() == at::kDouble && all_stats.is_contiguous() && all_stats.dim() == 3 &&
                  all_stats.size(1) == rows && all_stats.size(2) == 3, "all_stats must be float64 [slices, rows, 3]");
  const int64_t slices = all_stats.size(0);
  TORCH_CHECK(slice >= 0 && slice < slices, "slice ", slice, " is not one of the ", slices, " slices");
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.is_contiguous() && sums.numel() == rows * blocks,
              "block sums must be float64 [rows, ceil(vocab / ", kBlock, ")]");
  TORCH_CHECK(out.scalar_type() == at::kDouble && out.is_contiguous() && out.numel() == rows, "out must be float64 [rows]");
  const float* data = logits.data_ptr<float>();
  const float* temperature = temperatures.data_ptr<float>();
  const double* uniform = uniforms.data_ptr<double>();
  const double* stats = all_stats.data_ptr<double>();
  const double* block = sums.data_ptr<double>();
  double* token = out.data_ptr<double>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, n)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      auto stat = [&](int64_t s, int k) { return stats[(s * rows + r) * 3 + k]; };
      double max = -std::numeric_limits<double>::infinity();
      bool has_nan = false;
      for (int64_t s = 0; s < slices; ++s) {
        has_nan |= std::isnan(stat(s, 0));
        max = stat(s, 0) > max ? stat(s, 0) : max;
      }
      if (has_nan || !std::isfinite(max)) {
        if (slice == 0) token[r] = -1;
        continue;
      }
      const double t = temperature[r];
      if (t == 0) {  // the first slice holding the maximum, at its first index of it
        int64_t owner = 0;
        while (stat(owner, 0) != max) ++owner;
        if (owner == slice) token[r] = static_cast<double>(offset) + stat(owner, 2);
        continue;
      }
      // slice s's mass in units of the global maximum: its sum scaled by exp((its max - max) / t)
      double total = 0;
      for (int64_t s = 0; s < slices; ++s) total += stat(s, 1) * std::exp((stat(s, 0) - max) / t);
      const double target = uniform[r] * total;
      double before = 0;
      int64_t owner = -1;
      for (int64_t s = 0; s < slices; ++s) {
        const double mass = stat(s, 1) * std::exp((stat(s, 0) - max) / t);
        if (before + mass > target) {
          owner = s;
          break;
        }
        before += mass;
      }
      double local_target;
      if (owner < 0) {  // uniform * total rounded up to the total: the last slice with any mass, past its end
        for (owner = slices - 1; owner > 0 && !(stat(owner, 1) > 0); --owner) {}
        local_target = std::numeric_limits<double>::infinity();
      } else {
        local_target = (target - before) / std::exp((stat(owner, 0) - max) / t);
      }
      if (owner != slice) continue;
      const float* x = data + r * row_stride;
      const RowMask mask = masks.row(r);
      const float max_x = static_cast<float>(stat(owner, 0));
      token[r] = static_cast<double>(offset + (mask.bits ? walk<true>(x, n, max_x, temperature[r], mask,
                                                                      block + r * blocks, local_target)
                                                         : walk<false>(x, n, max_x, temperature[r], mask,
                                                                       block + r * blocks, local_target)));
    }
  });
}

}  // namespace

TORCH_LIBRARY(tpengine_sampling, m) {
  m.def("slice_stats(Tensor logits, Tensor temperatures, Tensor(a!) stats, Tensor(b!) block_sums, "
        "Tensor? bitmask=None, int offset=0) -> ()");
  m.def("slice_tokens(Tensor logits, Tensor temperatures, Tensor uniforms, Tensor all_stats, Tensor block_sums, "
        "int slice, int offset, Tensor(a!) out, Tensor? bitmask=None) -> ()");
}

TORCH_LIBRARY_IMPL(tpengine_sampling, CPU, m) {
  m.impl("slice_stats", &slice_stats);
  m.impl("slice_tokens", &slice_tokens);
}
