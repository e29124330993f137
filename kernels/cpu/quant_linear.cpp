// y = x W^T (+ b) on an int8 or int4 weight w[o, i] = scale[o, g] * (q[o, i] - zero[o, g]), packed once at load
// (quant_linear.py's pack) in blocks of 8 output features:
//   weight [blocks][in_padded / 4][8][4] bytes: a 32-byte "step" holds 4 consecutive inputs of each of the 8
//     outputs, the layout of x86's 4-way byte dot products (AVX2 maddubs+madd, AVX512-VNNI vpdpbusd): one step
//     against 4 bytes of x broadcast gives the 8 outputs' partial sums in 8 int32 lanes, with no horizontal sums.
//     int8: q as is. int4: u = q + 8 in [0, 15], two steps per 32 bytes (the first in the low nibbles).
//   scales [blocks][groups][8] float32; zeros [blocks][groups][8] int8, zero + 8 for int4 (u's offset) and
//     zero for int8: what the integer sums subtract per group.
// Two ways to treat x:
//   int8: each row quantized on the fly, sx = max|x| / 127, xq = round_half_even(x / sx) in [-127, 127]; per group
//     the integer sum d = sum(q or u * xq) - zero * sum(xq) is exact in int32, then in float32, each product and
//     each sum rounded (no FMA: built with -ffp-contract=off):
//       total = 0; for g in order: total = total + scale[o, g] * float(d_g);  y = total * sx (+ b)
//     quant_linear.py's reference computes exactly this, so the results are bit-identical.
//   float: the weights are dequantized to float32 (exactly as QuantizedWeight.dequantize), in registers as they are
//     multiplied for up to 8 rows, into tiles that every row reuses for more, and each output is one FMA chain over
//     the inputs in order.
// Either way a row's output is computed alike whatever the other rows or the number of threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/to.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TPENGINE_QUANT_AVX2 1
#else
#define TPENGINE_QUANT_AVX2 0
#endif
// AVX512-VNNI's vpdpbusd on 256-bit vectors does maddubs + madd + add in one instruction, with the same result
// here (maddubs never saturates in our ranges). Not run on the AVX2-only machine this was written on.
#if TPENGINE_QUANT_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TPENGINE_QUANT_VNNI 1
#else
#define TPENGINE_QUANT_VNNI 0
#endif

namespace {

constexpr int64_t BLOCK_OUT = 8;     // output features per packed block: one int32 or float lane each
constexpr int64_t STEP_INPUTS = 4;   // inputs per output in one 32-byte step
constexpr int64_t STEP_BYTES = 32;
constexpr int64_t MAX_ROWS = 4;      // rows of x per pass over a block (int8 activations)
constexpr int64_t MAX_FLOAT_ROWS = 6;
constexpr int64_t SINGLE_ROW_FLOAT_BLOCKS = 8;  // blocks per pass of a lone row (float activations)
constexpr int64_t MAX_ROWS_IN_REGISTERS = 8;  // up to this many rows dequantize in registers (float activations)
constexpr int64_t ROW_TILE = 64;     // rows of x kept in cache while a chunk of weight blocks is reused
// The integer sums ask for the weight bytes this far ahead of the step they are at. The hardware prefetcher alone
// left them waiting on memory: on a 2-core AVX2 EPYC, 28 layers' linears at batch 1 took 1.25x (int4) and 1.07x
// (int8) longer without it, at batch 4 1.08x and 1.26x (against the build without, in one process). An earlier
// trial on an AVX-512 Zen 4 measured 1.04x, within its noise.
constexpr int64_t PREFETCH_BYTES = 4096;

struct Layout {
  int64_t out_features, in_features, in_padded, bits, group_columns, num_groups, num_blocks, block_bytes;
};

// One packed weight value as stored (int8 signed; int4 unsigned, zero + 8): output o's input j of a step
inline int32_t packed_value(const uint8_t* w, int64_t bits, int64_t step, int64_t o, int64_t j) {
  if (bits == 8) return static_cast<int8_t>(w[step * STEP_BYTES + o * STEP_INPUTS + j]);
  const uint8_t byte = w[step / 2 * STEP_BYTES + o * STEP_INPUTS + j];
  return step % 2 ? byte >> 4 : byte & 0x0F;
}

// ---------------------------------------------------------------- int8 activations: integer sums per group

struct IntRows {  // R rows of quantized x: xq [rows][in_padded], xsum [rows][groups], sx [rows]
  const int8_t* xq;
  const int32_t* xsum;
  const float* sx;
  int64_t in_padded, num_groups;
};

// out[m][0:num_out] for R rows against NB consecutive blocks (num_out <= 8 * NB); CORRECT: subtract zero * sum(xq)
// per group (int4 always)
template <int64_t R, bool CORRECT, typename OutT, int64_t NB = 1, int64_t CHAINS = (R * NB >= 4 ? 1 : 4 / (R * NB))>
void int_block_rows(const Layout& L, const uint8_t* w, const float* scales, const int8_t* zeros, IntRows x,
                    const float* bias, OutT* out, int64_t num_out) {
  const int64_t steps_per_group = L.group_columns / STEP_INPUTS, group_stride = L.num_groups * BLOCK_OUT;
  float result[R][NB * BLOCK_OUT];
#if TPENGINE_QUANT_AVX2
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  __m256 total[R][NB];
  for (int64_t m = 0; m < R; ++m)
    for (int64_t n = 0; n < NB; ++n) total[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < L.num_groups; ++g) {
    // CHAINS independent sums per row and block: one dot product waits on the last (about 5 cycles), so with few
    // rows a single chain leaves the core idle; integer sums are exact in any order
    __m256i acc[R][NB][CHAINS];
    for (int64_t m = 0; m < R; ++m)
      for (int64_t n = 0; n < NB; ++n)
        for (int64_t c = 0; c < CHAINS; ++c) acc[m][n][c] = _mm256_setzero_si256();
    const int64_t first = g * steps_per_group, last = first + steps_per_group;
    if (L.bits == 8) {
      // step s of each block into its chain c of row m
      auto int8_step = [&](int64_t s, int64_t c) {
        __m256i x4[R];  // the step's 4 inputs of each row, broadcast once for every block
        for (int64_t m = 0; m < R; ++m) {
          int32_t four;
          std::memcpy(&four, x.xq + m * x.in_padded + s * STEP_INPUTS, 4);
          x4[m] = _mm256_set1_epi32(four);
        }
        for (int64_t n = 0; n < NB; ++n) {
          const uint8_t* wn = w + n * L.block_bytes + s * STEP_BYTES;
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn));
          _mm_prefetch(reinterpret_cast<const char*>(wn + PREFETCH_BYTES), _MM_HINT_T0);
          const __m256i q_abs = _mm256_abs_epi8(q);  // -128 becomes byte 0x80: 128 read unsigned
          for (int64_t m = 0; m < R; ++m) {
            // |q| * (x * sign(q)) = q * x; a pair sums to at most 2 * 128 * 127 < 2^15: maddubs cannot saturate
            const __m256i x_signed = _mm256_sign_epi8(x4[m], q);
#if TPENGINE_QUANT_VNNI
            acc[m][n][c] = _mm256_dpbusd_epi32(acc[m][n][c], q_abs, x_signed);
#else
            acc[m][n][c] = _mm256_add_epi32(acc[m][n][c],
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(q_abs, x_signed), ones16));
#endif
          }
        }
      };
      int64_t s = first;
      for (; s + CHAINS <= last; s += CHAINS)
        for (int64_t c = 0; c < CHAINS; ++c) int8_step(s + c, c);
      for (; s < last; ++s) int8_step(s, 0);
    } else {
      // steps s and s + 1 of each block (one 32-byte load: low and high nibbles) into its chain c of row m. Without
      // VNNI they add up in int16 first: two steps' pair sums are at most 4 * 15 * 127 = 7,620, so four calls' sum
      // fits before it widens to int32, one madd for every four (madds and maddubs share one pipe on Zen 2)
#if !TPENGINE_QUANT_VNNI
      __m256i acc16[R][NB][CHAINS];
      auto widen = [&]() {
        for (int64_t m = 0; m < R; ++m)
          for (int64_t n = 0; n < NB; ++n)
            for (int64_t c = 0; c < CHAINS; ++c) {
              acc[m][n][c] = _mm256_add_epi32(acc[m][n][c], _mm256_madd_epi16(acc16[m][n][c], ones16));
              acc16[m][n][c] = _mm256_setzero_si256();
            }
      };
      for (int64_t m = 0; m < R; ++m)
        for (int64_t n = 0; n < NB; ++n)
          for (int64_t c = 0; c < CHAINS; ++c) acc16[m][n][c] = _mm256_setzero_si256();
#endif
      auto int4_steps = [&](int64_t s, int64_t c) {
        __m256i x_low[R], x_high[R];  // the two steps' inputs of each row, broadcast once for every block
        for (int64_t m = 0; m < R; ++m) {
          int32_t low, high;
          std::memcpy(&low, x.xq + m * x.in_padded + s * STEP_INPUTS, 4);
          std::memcpy(&high, x.xq + m * x.in_padded + (s + 1) * STEP_INPUTS, 4);
          x_low[m] = _mm256_set1_epi32(low);
          x_high[m] = _mm256_set1_epi32(high);
        }
        for (int64_t n = 0; n < NB; ++n) {
          const uint8_t* wn = w + n * L.block_bytes + s / 2 * STEP_BYTES;
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn));
          _mm_prefetch(reinterpret_cast<const char*>(wn + PREFETCH_BYTES), _MM_HINT_T0);
          const __m256i u_low = _mm256_and_si256(packed, low_nibbles);
          const __m256i u_high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
          for (int64_t m = 0; m < R; ++m) {
#if TPENGINE_QUANT_VNNI
            acc[m][n][c] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc[m][n][c], u_low, x_low[m]), u_high, x_high[m]);
#else
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u_low, x_low[m]),
                                                   _mm256_maddubs_epi16(u_high, x_high[m]));
            acc16[m][n][c] = _mm256_add_epi16(acc16[m][n][c], pairs);
#endif
          }
        }
      };
      int64_t s = first;
      for (int64_t calls = 1; s + 2 * CHAINS <= last; s += 2 * CHAINS, ++calls) {
        for (int64_t c = 0; c < CHAINS; ++c) int4_steps(s + 2 * c, c);
#if !TPENGINE_QUANT_VNNI
        if (calls % 4 == 0) widen();
#endif
      }
#if !TPENGINE_QUANT_VNNI
      widen();
#endif
      for (; s < last; s += 2) {
        int4_steps(s, 0);
#if !TPENGINE_QUANT_VNNI
        widen();
#endif
      }
    }
    for (int64_t n = 0; n < NB; ++n) {
      const __m256 scale = _mm256_loadu_ps(scales + n * group_stride + g * BLOCK_OUT);
      __m256i zero;
      if (CORRECT)
        zero = _mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + n * group_stride + g * BLOCK_OUT)));
      for (int64_t m = 0; m < R; ++m) {
        __m256i d = acc[m][n][0];
        for (int64_t c = 1; c < CHAINS; ++c) d = _mm256_add_epi32(d, acc[m][n][c]);
        if (CORRECT)
          d = _mm256_sub_epi32(d, _mm256_mullo_epi32(zero, _mm256_set1_epi32(x.xsum[m * x.num_groups + g])));
        total[m][n] = _mm256_add_ps(total[m][n], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(d)));
      }
    }
  }
  for (int64_t m = 0; m < R; ++m)
    for (int64_t n = 0; n < NB; ++n)
      _mm256_storeu_ps(result[m] + n * BLOCK_OUT, _mm256_mul_ps(total[m][n], _mm256_set1_ps(x.sx[m])));
#else
  for (int64_t m = 0; m < R; ++m)
    for (int64_t o = 0; o < NB * BLOCK_OUT; ++o) result[m][o] = 0.0f;
  for (int64_t n = 0; n < NB; ++n) {
    const uint8_t* wn = w + n * L.block_bytes;
    const float* sn = scales + n * group_stride;
    const int8_t* zn = zeros + n * group_stride;
    for (int64_t g = 0; g < L.num_groups; ++g) {
      for (int64_t m = 0; m < R; ++m) {
        int32_t acc[BLOCK_OUT] = {};
        const int8_t* xm = x.xq + m * x.in_padded;
        for (int64_t i = g * L.group_columns; i < (g + 1) * L.group_columns; ++i) {
          const int64_t step = i / STEP_INPUTS, j = i % STEP_INPUTS;
          for (int64_t o = 0; o < BLOCK_OUT; ++o) {
            const int32_t q = packed_value(wn, L.bits, step, o, j);
            acc[o] += q * xm[i];
          }
        }
        float* rm = result[m] + n * BLOCK_OUT;
        for (int64_t o = 0; o < BLOCK_OUT; ++o) {
          int32_t d = acc[o];
          if (CORRECT) d -= static_cast<int32_t>(zn[g * BLOCK_OUT + o]) * x.xsum[m * x.num_groups + g];
          rm[o] = rm[o] + sn[g * BLOCK_OUT + o] * static_cast<float>(d);
        }
      }
    }
  }
  for (int64_t m = 0; m < R; ++m)
    for (int64_t o = 0; o < NB * BLOCK_OUT; ++o) result[m][o] = result[m][o] * x.sx[m];
#endif
  for (int64_t m = 0; m < R; ++m)
    for (int64_t o = 0; o < num_out; ++o)
      out[m * L.out_features + o] = static_cast<OutT>(bias ? result[m][o] + bias[o] : result[m][o]);
}

template <bool CORRECT, typename OutT>
void int_block(const Layout& L, const uint8_t* w, const float* scales, const int8_t* zeros, IntRows x,
               int64_t rows, const float* bias, OutT* out, int64_t num_out) {
  for (int64_t m = 0; m < rows; m += MAX_ROWS) {
    IntRows xm{x.xq + m * x.in_padded, x.xsum + m * x.num_groups, x.sx + m, x.in_padded, x.num_groups};
    OutT* om = out + m * L.out_features;
    switch (std::min(MAX_ROWS, rows - m)) {
      case 1: int_block_rows<1, CORRECT, OutT>(L, w, scales, zeros, xm, bias, om, num_out); break;
      case 2: int_block_rows<2, CORRECT, OutT>(L, w, scales, zeros, xm, bias, om, num_out); break;
      case 3: int_block_rows<3, CORRECT, OutT>(L, w, scales, zeros, xm, bias, om, num_out); break;
      default: int_block_rows<4, CORRECT, OutT>(L, w, scales, zeros, xm, bias, om, num_out); break;
    }
  }
}

// one row: sx = max|x| / 127, xq = round_half_even(x / sx) clamped to [-127, 127] (all 0 for a zero row), padded
// with zeros to in_padded; xsum per group
template <typename InT>
void quantize_row(const Layout& L, const InT* x_in, int8_t* xq, int32_t* xsum, float* sx) {
  // bfloat16 rows widen exactly to float32 first: the same numbers as quantizing x.float()
  const float* x;
  if constexpr (std::is_same_v<InT, float>) {
    x = x_in;
  } else {
    thread_local std::vector<float> widened;
    widened.resize(L.in_features);
    for (int64_t i = 0; i < L.in_features; ++i) widened[i] = static_cast<float>(x_in[i]);
    x = widened.data();
  }
  // Vectorized where the CPU has AVX2, with the scalar loop's results: max ignores NaN as std::max does here (the
  // running max is the operand max_ps returns when unordered), the division is IEEE in both, round_ps rounds half to
  // even as nearbyint does, and a NaN quotient clamps to -127 in both.
  int64_t i = 0;
  float amax = 0.0f;
#if TPENGINE_QUANT_AVX2
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax8 = _mm256_setzero_ps();
  for (; i + 8 <= L.in_features; i += 8) amax8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), amax8);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax8);
  for (float lane : lanes) amax = std::max(amax, lane);
#endif
  for (; i < L.in_features; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f;
  *sx = scale;
  if (amax == 0.0f) {
    std::memset(xq, 0, L.in_padded);
  } else {
    i = 0;
#if TPENGINE_QUANT_AVX2
    const __m256 scale8 = _mm256_set1_ps(scale), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
    auto quantize8 = [&](int64_t at) {
      const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + at), scale8),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, low), high));
    };
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs work within 128-bit lanes
    for (; i + 32 <= L.in_features; i += 32) {
      const __m256i pairs01 = _mm256_packs_epi32(quantize8(i), quantize8(i + 8));
      const __m256i pairs23 = _mm256_packs_epi32(quantize8(i + 16), quantize8(i + 24));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(pairs01, pairs23), in_order));
    }
#endif
    for (; i < L.in_features; ++i)
      xq[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / scale))));
    std::memset(xq + L.in_features, 0, L.in_padded - L.in_features);
  }
  for (int64_t g = 0; g < L.num_groups; ++g) {
    int32_t sum = 0;
    for (int64_t i = g * L.group_columns; i < (g + 1) * L.group_columns; ++i) sum += xq[i];
    xsum[g] = sum;
  }
}

// ---------------------------------------------------------------- float activations: dequantized tiles

#if TPENGINE_QUANT_AVX2
// Step s of a block as stored (int8 signed; int4 u = q + 8): q[j] holds input j of the step for the 8 outputs, as
// int32. Each 32-bit lane of a step is one output's 4 inputs, a byte each, so shifts take them out: no shuffles,
// which bound the dequantization when it used them (the lone-row float path ran 1.85x / 2.1x slower for int8 / int4).
inline void step_values(const uint8_t* w, int64_t bits, int64_t s, __m256i q[STEP_INPUTS]) {
  if (bits == 8) {
    const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * STEP_BYTES));
    q[0] = _mm256_srai_epi32(_mm256_slli_epi32(lanes, 24), 24);
    q[1] = _mm256_srai_epi32(_mm256_slli_epi32(lanes, 16), 24);
    q[2] = _mm256_srai_epi32(_mm256_slli_epi32(lanes, 8), 24);
    q[3] = _mm256_srai_epi32(lanes, 24);
  } else {  // an even step's nibbles are the low ones of its 32 bytes, the next step's the high ones
    __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s / 2 * STEP_BYTES));
    if (s % 2) lanes = _mm256_srli_epi32(lanes, 4);
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_and_si256(lanes, nibble);
    q[1] = _mm256_and_si256(_mm256_srli_epi32(lanes, 8), nibble);
    q[2] = _mm256_and_si256(_mm256_srli_epi32(lanes, 16), nibble);
    q[3] = _mm256_and_si256(_mm256_srli_epi32(lanes, 24), nibble);
  }
}

// one dequantized weight vector: scale * float(q - zero), rounded once, as QuantizedWeight.dequantize
inline __m256 dequantized(__m256i q, __m256i zero, __m256 scale) {
  return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, zero)));
}
#endif

// block b's weights as float32 [in_padded][8], exactly scale * (q - zero) as QuantizedWeight.dequantize
void dequantize_block(const Layout& L, const uint8_t* w, const float* scales, const int8_t* zeros, float* tile) {
  const int64_t steps_per_group = L.group_columns / STEP_INPUTS;
#if TPENGINE_QUANT_AVX2
  for (int64_t g = 0; g < L.num_groups; ++g) {
    const __m256 scale = _mm256_loadu_ps(scales + g * BLOCK_OUT);
    const __m256i zero = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + g * BLOCK_OUT)));
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
      __m256i q[STEP_INPUTS];
      step_values(w, L.bits, s, q);
      float* t = tile + s * STEP_INPUTS * BLOCK_OUT;
      for (int64_t j = 0; j < STEP_INPUTS; ++j) _mm256_storeu_ps(t + j * BLOCK_OUT, dequantized(q[j], zero, scale));
    }
  }
#else
  for (int64_t i = 0; i < L.in_padded; ++i) {
    const int64_t g = i / L.group_columns, step = i / STEP_INPUTS, j = i % STEP_INPUTS;
    for (int64_t o = 0; o < BLOCK_OUT; ++o) {
      const int32_t q = packed_value(w, L.bits, step, o, j);
      tile[i * BLOCK_OUT + o] = scales[g * BLOCK_OUT + o] * static_cast<float>(q - zeros[g * BLOCK_OUT + o]);
    }
  }
#endif
}

// out[m][0:8 * NB] for R rows against NB dequantized blocks (tiles in_padded * 8 floats apart)
template <int64_t R, int64_t NB, typename OutT>
void float_blocks_rows(const Layout& L, const float* tiles, const float* x, int64_t x_stride, const float* bias,
                       OutT* out, int64_t num_out) {
  float result[R][NB * BLOCK_OUT];
  const int64_t tile_stride = L.in_padded * BLOCK_OUT;
#if TPENGINE_QUANT_AVX2
  __m256 acc[R][NB];
  for (int64_t m = 0; m < R; ++m)
    for (int64_t n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < L.in_features; ++i) {
    __m256 w[NB];
    for (int64_t n = 0; n < NB; ++n) w[n] = _mm256_loadu_ps(tiles + n * tile_stride + i * BLOCK_OUT);
    for (int64_t m = 0; m < R; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + i);
      for (int64_t n = 0; n < NB; ++n) acc[m][n] = _mm256_fmadd_ps(w[n], xv, acc[m][n]);
    }
  }
  for (int64_t m = 0; m < R; ++m)
    for (int64_t n = 0; n < NB; ++n) _mm256_storeu_ps(result[m] + n * BLOCK_OUT, acc[m][n]);
#else
  for (int64_t m = 0; m < R; ++m)
    for (int64_t o = 0; o < NB * BLOCK_OUT; ++o) {
      const float* t = tiles + o / BLOCK_OUT * tile_stride + o % BLOCK_OUT;
      float sum = 0.0f;
      for (int64_t i = 0; i < L.in_features; ++i) sum = std::fma(t[i * BLOCK_OUT], x[m * x_stride + i], sum);
      result[m][o] = sum;
    }
#endif
  for (int64_t m = 0; m < R; ++m)
    for (int64_t o = 0; o < num_out; ++o)
      out[m * L.out_features + o] = static_cast<OutT>(bias ? result[m][o] + bias[o] : result[m][o]);
}

template <int64_t NB, typename OutT>
void float_blocks(const Layout& L, const float* tiles, const float* x, int64_t x_stride, int64_t rows,
                  const float* bias, OutT* out, int64_t num_out) {
  for (int64_t m = 0; m < rows; m += MAX_FLOAT_ROWS) {
    const float* xm = x + m * x_stride;
    OutT* om = out + m * L.out_features;
    switch (std::min(MAX_FLOAT_ROWS, rows - m)) {
      case 1: float_blocks_rows<1, NB, OutT>(L, tiles, xm, x_stride, bias, om, num_out); break;
      case 2: float_blocks_rows<2, NB, OutT>(L, tiles, xm, x_stride, bias, om, num_out); break;
      case 3: float_blocks_rows<3, NB, OutT>(L, tiles, xm, x_stride, bias, om, num_out); break;
      case 4: float_blocks_rows<4, NB, OutT>(L, tiles, xm, x_stride, bias, om, num_out); break;
      case 5: float_blocks_rows<5, NB, OutT>(L, tiles, xm, x_stride, bias, om, num_out); break;
      default: float_blocks_rows<6, NB, OutT>(L, tiles, xm, x_stride, bias, om, num_out); break;
    }
  }
}

#if TPENGINE_QUANT_AVX2
// out[m][0:num_out] for R rows against NB consecutive blocks, each weight dequantized in registers as it is
// multiplied: the values dequantize_block writes (scale * float(q - zero), one rounding) and each output one FMA
// chain over the inputs in order, so bit for bit what the tiles give. A few rows reuse a tile too little to pay
// for writing it and reading it back.
template <int64_t R, int64_t NB, typename OutT>
void float_rows_in_registers(const Layout& L, const uint8_t* w, const float* scales, const int8_t* zeros,
                             const float* x, int64_t x_stride, const float* bias, OutT* out, int64_t num_out) {
  const int64_t steps_per_group = L.group_columns / STEP_INPUTS, group_stride = L.num_groups * BLOCK_OUT;
  // the steps whose 4 inputs are all x's; a last step with fewer (in_features % 4) ends the last group
  const int64_t full_steps = L.in_features / STEP_INPUTS, last_inputs = L.in_features % STEP_INPUTS;
  __m256 acc[R][NB];
  for (int64_t m = 0; m < R; ++m)
    for (int64_t n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
  alignas(32) int32_t zero[NB][BLOCK_OUT];  // read as memory operands: registers hold the sums
  // block n's step s into the sums of its first `inputs` inputs. Up to 2 rows broadcast a step's x once for all NB
  // blocks (a broadcast for each product made a lone row 1.5x slower); more rows broadcast for each product: their
  // broadcasts would not fit in the registers beside the sums (kept, they made 4 rows 1.7x slower)
  constexpr bool KEEP_BROADCASTS = R <= 2;
  __m256 xb[R][STEP_INPUTS];
  auto broadcast_step = [&](int64_t s, int64_t inputs) {
    if constexpr (KEEP_BROADCASTS)
      for (int64_t m = 0; m < R; ++m)
        for (int64_t j = 0; j < inputs; ++j) xb[m][j] = _mm256_broadcast_ss(x + m * x_stride + s * STEP_INPUTS + j);
  };
  auto multiply_step = [&](int64_t n, int64_t s, int64_t g, int64_t inputs) {
    const uint8_t* wn = w + n * L.block_bytes;
    if (L.bits == 8 || s % 2 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(wn + s * L.bits / 8 * STEP_BYTES + PREFETCH_BYTES), _MM_HINT_T0);
    __m256i q[STEP_INPUTS];
    step_values(wn, L.bits, s, q);
    const __m256 scale = _mm256_loadu_ps(scales + n * group_stride + g * BLOCK_OUT);
    const __m256i zero_n = _mm256_load_si256(reinterpret_cast<const __m256i*>(zero[n]));
    for (int64_t j = 0; j < inputs; ++j) {
      const __m256 weight = dequantized(q[j], zero_n, scale);
      for (int64_t m = 0; m < R; ++m)
        acc[m][n] = _mm256_fmadd_ps(weight, KEEP_BROADCASTS ? xb[m][j] : _mm256_broadcast_ss(x + m * x_stride +
                                                                                             s * STEP_INPUTS + j),
                                    acc[m][n]);
    }
  };
  for (int64_t g = 0; g < L.num_groups; ++g) {
    for (int64_t n = 0; n < NB; ++n)
      _mm256_store_si256(reinterpret_cast<__m256i*>(zero[n]), _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                             reinterpret_cast<const __m128i*>(zeros + n * group_stride + g * BLOCK_OUT))));
    const int64_t first = g * steps_per_group, last = std::min((g + 1) * steps_per_group, full_steps);
    for (int64_t s = first; s < last; ++s) {
      broadcast_step(s, STEP_INPUTS);
      for (int64_t n = 0; n < NB; ++n) multiply_step(n, s, g, STEP_INPUTS);
    }
    if (g == L.num_groups - 1 && last_inputs) {  // no x past in_features (the packed columns there are zeros)
      broadcast_step(full_steps, last_inputs);
      for (int64_t n = 0; n < NB; ++n) multiply_step(n, full_steps, g, last_inputs);
    }
  }
  for (int64_t m = 0; m < R; ++m) {
    float result[NB * BLOCK_OUT];
    for (int64_t n = 0; n < NB; ++n) _mm256_storeu_ps(result + n * BLOCK_OUT, acc[m][n]);
    for (int64_t o = 0; o < num_out; ++o)
      out[m * L.out_features + o] = static_cast<OutT>(bias ? result[o] + bias[o] : result[o]);
  }
}

// R rows of x against blocks [begin, end), NB blocks a pass where they fill the registers
template <int64_t R, typename OutT>
void float_rows_in_registers(const Layout& L, const uint8_t* w, const float* scales, const int8_t* zeros,
                             const float* x, int64_t x_stride, const float* bias, OutT* out, int64_t begin,
                             int64_t end) {
  constexpr int64_t NB = R == 1 ? 4 : R == 2 ? 2 : 1;  // R * NB sums in registers, with room for the rest
  const int64_t group_stride = L.num_groups * BLOCK_OUT;
  for (int64_t b = begin; b < end;) {
    const int64_t nb = b + NB <= end ? NB : 1;
    const int64_t num_out = std::min(nb * BLOCK_OUT, L.out_features - b * BLOCK_OUT);
    const float* bb = bias ? bias + b * BLOCK_OUT : nullptr;
    if (nb == NB)
      float_rows_in_registers<R, NB, OutT>(L, w + b * L.block_bytes, scales + b * group_stride,
                                           zeros + b * group_stride, x, x_stride, bb, out + b * BLOCK_OUT, num_out);
    else
      float_rows_in_registers<R, 1, OutT>(L, w + b * L.block_bytes, scales + b * group_stride,
                                          zeros + b * group_stride, x, x_stride, bb, out + b * BLOCK_OUT, num_out);
    b += nb;
  }
}

// rows (at most MAX_ROWS_IN_REGISTERS) of x against blocks [begin, end): every pass of up to 4 rows over 4 blocks
// at a time, while those blocks are in cache
template <typename OutT>
void float_rows_in_registers(const Layout& L, const uint8_t* w, const float* scales, const int8_t* zeros,
                             const float* x, int64_t x_stride, int64_t rows, const float* bias, OutT* out,
                             int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; b += 4) {
    const int64_t b_end = std::min(end, b + 4);
    for (int64_t m = 0; m < rows; m += 4) {
      const float* xm = x + m * x_stride;
      OutT* om = out + m * L.out_features;
      switch (std::min<int64_t>(4, rows - m)) {
        case 1: float_rows_in_registers<1, OutT>(L, w, scales, zeros, xm, x_stride, bias, om, b, b_end); break;
        case 2: float_rows_in_registers<2, OutT>(L, w, scales, zeros, xm, x_stride, bias, om, b, b_end); break;
        case 3: float_rows_in_registers<3, OutT>(L, w, scales, zeros, xm, x_stride, bias, om, b, b_end); break;
        default: float_rows_in_registers<4, OutT>(L, w, scales, zeros, xm, x_stride, bias, om, b, b_end); break;
      }
    }
  }
}
#endif

// ---------------------------------------------------------------- the ops

Layout check_packed(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& zeros, int64_t out_features,
                    int64_t in_features, int64_t bits, int64_t group_columns) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "quant_linear: the packed weight must be a contiguous uint8 [blocks, bytes per block]");
  TORCH_CHECK(group_columns > 0 && group_columns % (2 * STEP_INPUTS) == 0,
              "quant_linear: the packed group size must be a multiple of 8, not ", group_columns);
  Layout L;
  L.out_features = out_features;
  L.in_features = in_features;
  L.bits = bits;
  L.group_columns = group_columns;
  L.num_blocks = weight.size(0);
  L.block_bytes = weight.size(1);
  L.in_padded = L.block_bytes * 8 / (BLOCK_OUT * bits);
  L.num_groups = L.in_padded / group_columns;
  TORCH_CHECK(L.num_groups * group_columns == L.in_padded && in_features <= L.in_padded &&
                  in_features > L.in_padded - group_columns,
              "quant_linear: in_features ", in_features, " does not match the packed weight");
  TORCH_CHECK(L.num_blocks * BLOCK_OUT >= out_features && out_features > (L.num_blocks - 1) * BLOCK_OUT,
              "quant_linear: out_features ", out_features, " does not match the packed weight");
  const std::vector<int64_t> group_shape{L.num_blocks, L.num_groups, BLOCK_OUT};
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.sizes() == group_shape,
              "quant_linear: scales must be contiguous float32 [blocks, groups, 8]");
  TORCH_CHECK(zeros.scalar_type() == at::kChar && zeros.is_contiguous() && zeros.sizes() == group_shape,
              "quant_linear: zeros must be contiguous int8 [blocks, groups, 8]");
  return L;
}

// out [rows, out] (T: x's dtype, float32 or bfloat16) = x W^T (+ bias); the float32 result of each output is
// rounded once to T, so a bfloat16 x gives exactly what float32 x.float() would, rounded
template <typename T>
void quant_linear_into(const Layout& L, const at::Tensor& x, const uint8_t* w, const float* s, const int8_t* z,
                       const float* bias_ptr, bool int8_activation, bool correct_zeros, T* out_ptr) {
  const int64_t rows = x.size(0), out_features = L.out_features;
  const int64_t x_stride = x.stride(0);
  const int64_t group_stride = L.num_groups * BLOCK_OUT;

  if (int8_activation) {
    const T* x_ptr = x.data_ptr<T>();
    // the calling thread's buffers, kept between calls: no allocation at decode sizes
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<int32_t> xsum;
    thread_local std::vector<float> sx;
    xq.resize(rows * L.in_padded);
    xsum.resize(rows * L.num_groups);
    sx.resize(rows);
    int8_t* xq_ptr = xq.data();
    int32_t* xsum_ptr = xsum.data();
    float* sx_ptr = sx.data();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        quantize_row(L, x_ptr + m * x_stride, xq_ptr + m * L.in_padded, xsum_ptr + m * L.num_groups, sx_ptr + m);
    });
    // a chunk of blocks (~128 KiB of weight) stays in L2 while every tile of rows passes over it
    const int64_t chunk = std::max<int64_t>(1, (128 << 10) / L.block_bytes);
    at::parallel_for(0, L.num_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; c += chunk) {
        const int64_t c_end = std::min(end, c + chunk);
        for (int64_t m = 0; m < rows; m += ROW_TILE) {
          const int64_t tile_rows = std::min(ROW_TILE, rows - m);
          IntRows xm{xq_ptr + m * L.in_padded, xsum_ptr + m * L.num_groups, sx_ptr + m, L.in_padded, L.num_groups};
          for (int64_t b = c; b < c_end; ++b) {
            const int64_t num_out = std::min(BLOCK_OUT, out_features - b * BLOCK_OUT);
            T* ob = out_ptr + m * out_features + b * BLOCK_OUT;
            const float* bb = bias_ptr ? bias_ptr + b * BLOCK_OUT : nullptr;
            // a lone row streams two blocks at once: twice the weight lines in flight (1 row, 24.8 -> ~26 GB/s)
            if (tile_rows == 1 && b + 1 < c_end) {
              const int64_t pair_out = std::min(2 * BLOCK_OUT, out_features - b * BLOCK_OUT);
              if (correct_zeros)
                int_block_rows<1, true, T, 2>(L, w + b * L.block_bytes, s + b * group_stride, z + b * group_stride,
                                              xm, bb, ob, pair_out);
              else
                int_block_rows<1, false, T, 2>(L, w + b * L.block_bytes, s + b * group_stride, z + b * group_stride,
                                               xm, bb, ob, pair_out);
              ++b;
              continue;
            }
            if (correct_zeros)
              int_block<true>(L, w + b * L.block_bytes, s + b * group_stride, z + b * group_stride, xm, tile_rows,
                              bb, ob, num_out);
            else
              int_block<false>(L, w + b * L.block_bytes, s + b * group_stride, z + b * group_stride, xm, tile_rows,
                               bb, ob, num_out);
          }
        }
      }
    });
    return;
  }

  // float activations (a bfloat16 x widened once): each thread dequantizes a chunk of blocks (~256 KiB of float32)
  // into its own buffer, then every tile of rows passes over it
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const float* x_ptr = xf.data_ptr<float>();
  const int64_t xf_stride = xf.stride(0);
#if TPENGINE_QUANT_AVX2
  if (rows <= MAX_ROWS_IN_REGISTERS) {
    at::parallel_for(0, L.num_blocks, 1, [&](int64_t begin, int64_t end) {
      float_rows_in_registers<T>(L, w, s, z, x_ptr, xf_stride, rows, bias_ptr, out_ptr, begin, end);
    });
    return;
  }
#endif
  const int64_t tile_floats = L.in_padded * BLOCK_OUT;
  // One row's outputs are each one FMA chain waiting on the last: a pass over 8 blocks keeps 8 in flight, where 2
  // left the FMA units idle (results the same: each output is still one chain over its inputs in order)
  const int64_t blocks_at_once = rows == 1 ? SINGLE_ROW_FLOAT_BLOCKS : 2;
  const int64_t chunk = std::max<int64_t>(blocks_at_once, (256 << 10) / (4 * tile_floats));
  at::parallel_for(0, L.num_blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> tiles;
    tiles.resize(chunk * tile_floats);
    for (int64_t c = begin; c < end; c += chunk) {
      const int64_t c_end = std::min(end, c + chunk);
      for (int64_t b = c; b < c_end; ++b)
        dequantize_block(L, w + b * L.block_bytes, s + b * group_stride, z + b * group_stride,
                         tiles.data() + (b - c) * tile_floats);
      for (int64_t m = 0; m < rows; m += ROW_TILE) {
        const int64_t tile_rows = std::min(ROW_TILE, rows - m);
        for (int64_t b = c; b < c_end;) {
          const float* t = tiles.data() + (b - c) * tile_floats;
          T* ob = out_ptr + m * out_features + b * BLOCK_OUT;
          const float* bb = bias_ptr ? bias_ptr + b * BLOCK_OUT : nullptr;
          const int64_t num_out = std::min(2 * BLOCK_OUT, out_features - b * BLOCK_OUT);
          if (tile_rows == 1 && b + SINGLE_ROW_FLOAT_BLOCKS <= c_end) {
            float_blocks_rows<1, SINGLE_ROW_FLOAT_BLOCKS, T>(
                L, t, x_ptr + m * xf_stride, xf_stride, bb, ob,
                std::min(SINGLE_ROW_FLOAT_BLOCKS * BLOCK_OUT, out_features - b * BLOCK_OUT));
            b += SINGLE_ROW_FLOAT_BLOCKS;
          } else if (b + 1 < c_end) {
            float_blocks<2>(L, t, x_ptr + m * xf_stride, xf_stride, tile_rows, bb, ob, num_out);
            b += 2;
          } else {
            float_blocks<1>(L, t, x_ptr + m * xf_stride, xf_stride, tile_rows, bb, ob, std::min(BLOCK_OUT, num_out));
            b += 1;
          }
        }
      }
    }
  });
}

// x: [rows, in] float32 or bfloat16 with unit column stride; returns [rows, out] in x's dtype
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t out_features, int64_t in_features, int64_t bits,
                        int64_t group_columns, bool int8_activation, bool correct_zeros,
                        const c10::optional<at::Tensor>& bias) {
  const Layout L = check_packed(weight, scales, zeros, out_features, in_features, bits, group_columns);
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 &&
                  x.size(1) == in_features && x.stride(1) == 1,
              "quant_linear: x must be float32 or bfloat16 [rows, in_features] with contiguous rows");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features,
                "quant_linear: bias must be a contiguous float32 vector of out_features");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const int8_t* z = zeros.data_ptr<int8_t>();
  if (x.scalar_type() == at::kFloat)
    quant_linear_into<float>(L, x, w, s, z, bias_ptr, int8_activation, correct_zeros, out.data_ptr<float>());
  else
    quant_linear_into<c10::BFloat16>(L, x, w, s, z, bias_ptr, int8_activation, correct_zeros,
                                     out.data_ptr<c10::BFloat16>());
  return out;
}

// the float32 [n, in] weight rows `rows` (output features), exactly as QuantizedWeight.dequantize
at::Tensor quant_dequantize_rows(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& zeros,
                                 int64_t out_features, int64_t in_features, int64_t bits, int64_t group_columns,
                                 const at::Tensor& rows) {
  const Layout L = check_packed(weight, scales, zeros, out_features, in_features, bits, group_columns);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "dequantize_rows: rows must be an int64 vector");
  const at::Tensor ids = rows.contiguous();
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(id[k] >= 0 && id[k] < out_features, "dequantize_rows: row ", id[k], " is not in [0, ", out_features, ")");
  at::Tensor out = at::empty({n, in_features}, scales.options());
  float* out_ptr = out.data_ptr<float>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const int8_t* z = zeros.data_ptr<int8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t b = id[k] / BLOCK_OUT, o = id[k] % BLOCK_OUT;
      const uint8_t* wb = w + b * L.block_bytes;
      const float* sb = s + b * L.num_groups * BLOCK_OUT;
      const int8_t* zb = z + b * L.num_groups * BLOCK_OUT;
      float* row = out_ptr + k * in_features;
      for (int64_t i = 0; i < in_features; ++i) {
        const int64_t g = i / group_columns, step = i / STEP_INPUTS, j = i % STEP_INPUTS;
        int32_t q;
        if (bits == 8) {
          q = static_cast<int8_t>(wb[step * STEP_BYTES + o * STEP_INPUTS + j]);
        } else {
          const uint8_t byte = wb[step / 2 * STEP_BYTES + o * STEP_INPUTS + j];
          q = step % 2 ? byte >> 4 : byte & 0x0F;
        }
        row[i] = sb[g * BLOCK_OUT + o] * static_cast<float>(q - zb[g * BLOCK_OUT + o]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpengine_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor weight, Tensor scales, Tensor zeros, int out_features, int in_features, "
        "int bits, int group_columns, bool int8_activation, bool correct_zeros, Tensor? bias) -> Tensor");
  m.def("quant_dequantize_rows(Tensor weight, Tensor scales, Tensor zeros, int out_features, int in_features, "
        "int bits, int group_columns, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpengine_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize_rows", &quant_dequantize_rows);
}
