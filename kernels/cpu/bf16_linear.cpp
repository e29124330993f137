// y = x W^T (+ b) on a bfloat16 weight packed once at load as [out / 64][in / 2][64][2]: a block of 64 output
// features streams front to back over the whole input, two input features at a time, against every row of x
// while it is in cache. At decode batch sizes a linear reads its weight once and does little else, so what
// counts is streaming the weight at the memory's speed with no per-call set-up (oneDNN's dispatch costs ~10 us
// a call). Two kinds of x:
// - bfloat16, on AVX512-BF16's pair dot products (vdpbf16ps): products accumulate in float32 and round to
//   bfloat16 once, as oneDNN's and transformers' linears do;
// - float32, on AVX2 and FMA (a CPU without AVX512-BF16 runs a bfloat16 model's activations in float32): each
//   4-byte pair widens to two float32 weights with a shift and a mask, exactly, so y is the float32 product of
//   x with the bfloat16 weight, half the bytes of a float32 weight read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TPENGINE_HAS_BF16_DOT 1
#else
#define TPENGINE_HAS_BF16_DOT 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TPENGINE_HAS_AVX2_FMA 1
#else
#define TPENGINE_HAS_AVX2_FMA 0
#endif

namespace {

constexpr int64_t BLOCK_OUT = 64;  // output features per packed block: four 16-float accumulators per row of x
constexpr int64_t X_ROWS = 6;      // rows of x per pass over a block: 6 x 4 accumulators of the 32 registers

#if TPENGINE_HAS_BF16_DOT
// out[m][0:64] (+ bias) for ROWS rows of x against one packed block of 64 output features
template <int64_t ROWS>
inline void block_rows(const uint32_t* x_pairs, int64_t x_stride, const __m512bh* w, int64_t num_pairs,
                       const c10::BFloat16* bias, c10::BFloat16* out, int64_t out_stride, int64_t num_out) {
  __m512 acc[ROWS][4];
  for (int64_t m = 0; m < ROWS; ++m)
    for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const __m512bh* wp = w + p * 4;
    for (int64_t m = 0; m < ROWS; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x_pairs[m * x_stride + p]);
      for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wp[j], xv);
    }
  }
  for (int64_t m = 0; m < ROWS; ++m) {
    alignas(64) float values[BLOCK_OUT];
    for (int64_t j = 0; j < 4; ++j) _mm512_store_ps(values + 16 * j, acc[m][j]);
    c10::BFloat16* o = out + m * out_stride;
    if (bias)  // added before the one rounding to bfloat16
      for (int64_t i = 0; i < num_out; ++i) o[i] = c10::BFloat16(values[i] + static_cast<float>(bias[i]));
    else
      for (int64_t i = 0; i < num_out; ++i) o[i] = c10::BFloat16(values[i]);
  }
}
#endif

#if TPENGINE_HAS_AVX2_FMA
// Pairs this far ahead of the one being multiplied are asked for: a pass over part of a block reads part of each
// pair's 256 bytes, so the hardware prefetcher alone would leave the rest for a later pass to wait on.
constexpr int64_t PREFETCH_PAIRS = 16;
constexpr int64_t ROW_CHUNK = 60;  // rows whose x (240 KB at 1,024 inputs) stays in L2 while a block's passes reuse it
constexpr int64_t FLOAT_X_ROWS = 5;  // rows of float32 x per pass: 5 x 2 sums, 4 weights and 2 broadcasts

// out[m][8 * first : 8 * (first + S)] (+ bias) for R rows of float32 x against one packed block: S of its
// eight 8-output groups. w: the block as 4-byte pairs [in / 2][64], the low half input 2p, the high half 2p + 1.
template <int64_t R, int64_t S>
inline void float_block_rows(const float* x, int64_t x_stride, const uint32_t* w, int64_t num_pairs, int64_t first,
                             const float* bias, float* out, int64_t out_stride, int64_t num_out) {
  __m256 acc[R][S];
  for (int64_t m = 0; m < R; ++m)
    for (int64_t s = 0; s < S; ++s) acc[m][s] = _mm256_setzero_ps();
  const __m256i high_halves = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < num_pairs; ++p) {
    const uint32_t* wp = w + p * BLOCK_OUT + 8 * first;
    if constexpr (S < 8)  // the whole pair-row: later passes over this block find it in cache
      for (int64_t line = 0; line < BLOCK_OUT * 4; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + (p + PREFETCH_PAIRS) * BLOCK_OUT) + line, _MM_HINT_T0);
    if constexpr (R <= 2) {  // a row's two broadcasts stay in registers for every group
      __m256 x_even[R], x_odd[R];
      for (int64_t m = 0; m < R; ++m) {
        x_even[m] = _mm256_broadcast_ss(x + m * x_stride + 2 * p);
        x_odd[m] = _mm256_broadcast_ss(x + m * x_stride + 2 * p + 1);
      }
      for (int64_t s = 0; s < S; ++s) {
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 8 * s));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));  // bfloat16 is float32's top half
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, high_halves));
        for (int64_t m = 0; m < R; ++m)
          acc[m][s] = _mm256_fmadd_ps(odd, x_odd[m], _mm256_fmadd_ps(even, x_even[m], acc[m][s]));
      }
    } else {  // the groups' weights stay in registers for every row, whose broadcasts come and go
      __m256 even[S], odd[S];
      for (int64_t s = 0; s < S; ++s) {
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 8 * s));
        even[s] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        odd[s] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high_halves));
      }
      for (int64_t m = 0; m < R; ++m) {
        const __m256 x_even = _mm256_broadcast_ss(x + m * x_stride + 2 * p);
        const __m256 x_odd = _mm256_broadcast_ss(x + m * x_stride + 2 * p + 1);
        for (int64_t s = 0; s < S; ++s)
          acc[m][s] = _mm256_fmadd_ps(odd[s], x_odd, _mm256_fmadd_ps(even[s], x_even, acc[m][s]));
      }
    }
  }
  for (int64_t m = 0; m < R; ++m) {
    float* o = out + m * out_stride;
    const int64_t count = std::min<int64_t>(8 * S, num_out - 8 * first);
    if (count <= 0) continue;
    alignas(32) float values[8 * S];
    for (int64_t s = 0; s < S; ++s) _mm256_store_ps(values + 8 * s, acc[m][s]);
    if (bias)
      for (int64_t i = 0; i < count; ++i) o[8 * first + i] = values[i] + bias[8 * first + i];
    else
      std::copy(values, values + count, o + 8 * first);
  }
}

// all 64 outputs of one block for every row of x: one or two rows in one or two passes (R * S sums in registers);
// more rows in chunks, each chunk in passes of 2 groups over its rows in tiles of 5: a pass's quarter of the block
// (32 KB at 1,024 inputs) stays in the nearest cache while the rows go by
inline void float_block(const float* x, int64_t x_stride, int64_t rows, const uint32_t* w, int64_t num_pairs,
                        const float* bias, float* out, int64_t out_stride, int64_t num_out) {
  if (rows <= 2) {
    constexpr int64_t S1 = 8, S2 = 4;
    if (rows == 1)
      float_block_rows<1, S1>(x, x_stride, w, num_pairs, 0, bias, out, out_stride, num_out);
    else
      for (int64_t first = 0; first < 8 && 8 * first < num_out; first += S2)
        float_block_rows<2, S2>(x, x_stride, w, num_pairs, first, bias, out, out_stride, num_out);
    return;
  }
  constexpr int64_t S = 2;
  for (int64_t chunk = 0; chunk < rows; chunk += ROW_CHUNK) {
    const int64_t chunk_end = std::min(rows, chunk + ROW_CHUNK);
    for (int64_t first = 0; first < 8 && 8 * first < num_out; first += S) {
      for (int64_t m = chunk; m < chunk_end; m += FLOAT_X_ROWS) {
        const float* xm = x + m * x_stride;
        float* om = out + m * out_stride;
        switch (std::min(FLOAT_X_ROWS, chunk_end - m)) {
          case 1: float_block_rows<1, S>(xm, x_stride, w, num_pairs, first, bias, om, out_stride, num_out); break;
          case 2: float_block_rows<2, S>(xm, x_stride, w, num_pairs, first, bias, om, out_stride, num_out); break;
          case 3: float_block_rows<3, S>(xm, x_stride, w, num_pairs, first, bias, om, out_stride, num_out); break;
          case 4: float_block_rows<4, S>(xm, x_stride, w, num_pairs, first, bias, om, out_stride, num_out); break;
          default: float_block_rows<5, S>(xm, x_stride, w, num_pairs, first, bias, om, out_stride, num_out); break;
        }
      }
    }
  }
}
#endif

// x: [..., in] float32 (in even); packed as bf16_linear's; bias: [out] float32 or undefined; returns [..., out]
// float32
at::Tensor float_x_linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(TPENGINE_HAS_AVX2_FMA, "bf16_linear of float32 rows was built for a CPU without AVX2 and FMA");
  const int64_t in_features = 2 * packed.size(1);
  at::Tensor x = input.reshape({-1, in_features});
  if (x.stride(1) != 1) x = x.contiguous();
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features,
                "bias must be a contiguous float32 vector of out_features");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t rows = x.size(0), num_blocks = packed.size(0), num_pairs = packed.size(1);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = out_features;
  at::Tensor out = at::empty(out_shape, input.options());
#if TPENGINE_HAS_AVX2_FMA
  const float* x_ptr = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* wb = w + b * num_pairs * BLOCK_OUT;
      const float* bb = bias_ptr ? bias_ptr + b * BLOCK_OUT : nullptr;
      const int64_t num_out = std::min(BLOCK_OUT, out_features - b * BLOCK_OUT);
      float_block(x_ptr, x_stride, rows, wb, num_pairs, bb, out_ptr + b * BLOCK_OUT, out_features, num_out);
    }
  });
#endif
  return out;
}

// x: [..., in] bfloat16 (in even); packed: [ceil(out / 64), in / 2, 64, 2] bfloat16; bias: [out] bfloat16 or
// undefined; returns [..., out]
at::Tensor bf16_linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == BLOCK_OUT &&
              packed.size(3) == 2 && packed.is_contiguous(),
              "the weight must be bfloat16 packed as [out / 64, in / 2, 64, 2]");
  const int64_t in_features = 2 * packed.size(1);
  TORCH_CHECK(packed.size(0) * BLOCK_OUT >= out_features && out_features > (packed.size(0) - 1) * BLOCK_OUT,
              "out_features does not match the packed weight");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == in_features, "x's last dimension must be the weight's in-features");
  if (input.scalar_type() == at::kFloat) return float_x_linear(input, packed, out_features, bias);
  TORCH_CHECK(TPENGINE_HAS_BF16_DOT, "bf16_linear of bfloat16 rows was built for a CPU without AVX512-BF16");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16, "bf16_linear takes bfloat16 or float32 rows");
  at::Tensor x = input.reshape({-1, in_features});
  // the kernel reads x's rows as 4-byte pairs
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0 || reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 != 0)
    x = x.contiguous();
  const c10::BFloat16* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "bias must be a contiguous bfloat16 vector of out_features");
    bias_ptr = bias->data_ptr<c10::BFloat16>();
  }
  const int64_t rows = x.size(0), num_blocks = packed.size(0), num_pairs = packed.size(1);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = out_features;
  at::Tensor out = at::empty(out_shape, input.options());
#if TPENGINE_HAS_BF16_DOT
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const int64_t x_stride = x.stride(0) / 2;  // in pairs
  const __m512bh* w = reinterpret_cast<const __m512bh*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  // threads split the blocks: each streams its share of the weight once, every row of x against it
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const __m512bh* wb = w + b * num_pairs * 4;
      const c10::BFloat16* bb = bias_ptr ? bias_ptr + b * BLOCK_OUT : nullptr;
      const int64_t num_out = std::min(BLOCK_OUT, out_features - b * BLOCK_OUT);
      for (int64_t m = 0; m < rows; m += X_ROWS) {
        const uint32_t* xm = x_pairs + m * x_stride;
        c10::BFloat16* om = out_ptr + m * out_features + b * BLOCK_OUT;
        switch (std::min(X_ROWS, rows - m)) {
          case 1: block_rows<1>(xm, x_stride, wb, num_pairs, bb, om, out_features, num_out); break;
          case 2: block_rows<2>(xm, x_stride, wb, num_pairs, bb, om, out_features, num_out); break;
          case 3: block_rows<3>(xm, x_stride, wb, num_pairs, bb, om, out_features, num_out); break;
          case 4: block_rows<4>(xm, x_stride, wb, num_pairs, bb, om, out_features, num_out); break;
          case 5: block_rows<5>(xm, x_stride, wb, num_pairs, bb, om, out_features, num_out); break;
          default: block_rows<6>(xm, x_stride, wb, num_pairs, bb, om, out_features, num_out); break;
        }
      }
    }
  });
#endif
  return out;
}

// rows [n] int64 of the [out, in] weight packed as bf16_linear's -> [n, in] float32: an embedding table's lookups,
// widened exactly
at::Tensor bf16_packed_rows(const at::Tensor& packed, const at::Tensor& rows) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == BLOCK_OUT &&
              packed.size(3) == 2 && packed.is_contiguous(),
              "the weight must be bfloat16 packed as [out / 64, in / 2, 64, 2]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be a vector of int64");
  const at::Tensor ids = rows.contiguous();
  const int64_t n = ids.size(0), num_pairs = packed.size(1), num_rows = packed.size(0) * BLOCK_OUT;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_rows, "row ", id[i], " is outside the packed weight's ", num_rows, " rows");
  at::Tensor out = at::empty({n, 2 * num_pairs}, packed.options().dtype(at::kFloat));
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t* pairs = w + id[i] / BLOCK_OUT * num_pairs * BLOCK_OUT + id[i] % BLOCK_OUT;
      uint32_t* row = o + i * 2 * num_pairs;
      for (int64_t p = 0; p < num_pairs; ++p) {  // a pair's low half is input 2p: bfloat16 is float32's top half
        const uint32_t pair = pairs[p * BLOCK_OUT];
        row[2 * p] = pair << 16;
        row[2 * p + 1] = pair & 0xFFFF0000u;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpengine_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("bf16_packed_rows(Tensor packed, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpengine_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_packed_rows", &bf16_packed_rows);
}
