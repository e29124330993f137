// One token per row of float32 logits on the CPU: argmax for temperature 0, else an inverse-CDF draw
// from softmax(logits / temperature) with a uniform the host drew. One pass for the row's maximum, one
// that exponentiates and sums in blocks, and a pick that walks the block sums and then one block: the
// full-vocabulary float64 cumulative sum the torch path builds (0.7 ms a step on one core at
// 64 x 16,384) is never written out.
//
// Every number of the draw comes from block_exps on one block of kBlock entries, in a fixed order, so
// the pick sees exactly the sums the total was made of: a row's token depends only on its own logits,
// temperature and uniform, never on its batch or on how rows are split over threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>
#define SAMPLING_ISA "avx512"
#else
#define SAMPLING_ISA "scalar"
#endif

namespace {

constexpr int64_t kBlock = 256;  // entries per block sum: the pick recomputes at most one block
constexpr int64_t kParallelElements = 1 << 15;  // a thread gets rows of at least this many logits

struct RowMax {
  float value;
  bool has_nan;
};

RowMax row_max(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vbest = _mm512_set1_ps(best);
  __mmask16 nan_lanes = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vbest = _mm512_max_ps(vbest, v);
  }
  best = _mm512_reduce_max_ps(vbest);
  has_nan = nan_lanes != 0;
#endif
  for (; i < n; ++i) {
    has_nan |= std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  return {best, has_nan};
}

// out[i] = exp((x[i] - max) / temperature) for i < n <= kBlock
void block_exps(const float* x, int64_t n, float max, float temperature, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max), vt = _mm512_set1_ps(temperature);
  for (; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(vmax, lanes, x + i);  // lanes past n give exp(0), not stored
    _mm512_mask_storeu_ps(out + i, lanes, Sleef_expf16_u10(_mm512_div_ps(_mm512_sub_ps(v, vmax), vt)));
  }
#else
  for (; i < n; ++i) out[i] = std::exp((x[i] - max) / temperature);
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

int64_t first_index_of(const float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == value) return i;
  return -1;
}

// The first entry whose cumulative mass exceeds uniform * total, as torch.searchsorted(right=True) over
// the cumulative sum: an entry of probability 0 (an empty slice) is never picked.
int64_t draw(const float* x, int64_t n, float max, float temperature, double uniform, std::vector<double>& sums) {
  float e[kBlock];
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  sums.resize(blocks);
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t len = std::min(kBlock, n - b * kBlock);
    block_exps(x + b * kBlock, len, max, temperature, e);
    sums[b] = block_sum(e, len);
    total += sums[b];
  }
  const double target = uniform * total;
  double before = 0;
  int64_t b = 0;
  for (; b < blocks && before + sums[b] <= target; ++b) before += sums[b];
  const bool past_the_end = b == blocks;  // uniform * total rounded up to the total
  if (past_the_end)
    for (b = blocks - 1; b > 0 && sums[b] <= 0; --b) {}  // the last block with any mass
  const int64_t len = std::min(kBlock, n - b * kBlock);
  block_exps(x + b * kBlock, len, max, temperature, e);
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

// out[r] = the token of row r of logits: its argmax (the first of equal maxima) where temperatures[r] is
// 0, else a draw with uniforms[r]; -1 where the row has no distribution (a NaN, or no finite maximum)
void sample_rows(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms,
                 at::Tensor out) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous() &&
                  temperatures.numel() == rows, "temperatures must be float32 [rows]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == rows,
              "uniforms must be float64 [rows]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == rows, "out must be int64 [rows]");
  TORCH_CHECK(vocab > 0, "logits must have at least one column");
  const float* data = logits.data_ptr<float>();
  const float* temperature = temperatures.data_ptr<float>();
  const double* uniform = uniforms.data_ptr<double>();
  int64_t* token = out.data_ptr<int64_t>();
  const int64_t row_stride = logits.stride(0);
  const int64_t grain = std::max<int64_t>(1, kParallelElements / vocab);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> sums;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = data + r * row_stride;
      const RowMax m = row_max(x, vocab);
      if (m.has_nan || !std::isfinite(m.value)) {
        token[r] = -1;
      } else if (temperature[r] == 0.f) {
        token[r] = first_index_of(x, vocab, m.value);
      } else {
        token[r] = draw(x, vocab, m.value, temperature[r], uniform[r], sums);
      }
    }
  });
}

std::string isa() { return SAMPLING_ISA; }

}  // namespace

TORCH_LIBRARY(tpengine_sampling, m) {
  m.def("sample_rows(Tensor logits, Tensor temperatures, Tensor uniforms, Tensor(a!) out) -> ()");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(tpengine_sampling, CPU, m) { m.impl("sample_rows", &sample_rows); }
