// y = x W^T (+ b) in bfloat16 on AVX512-BF16's pair dot products (vdpbf16ps), on a weight packed once at
// load as [out / 64][in / 2][64][2]: a block of 64 output features streams front to back over the whole
// input, two input features at a time, against every row of x while it is in cache. At decode batch
// sizes a linear reads its weight once and does little else, so what counts is streaming the weight at
// the memory's speed with no per-call set-up (oneDNN's dispatch costs ~10 us a call).
// Products accumulate in float32 and round to bfloat16 once, as oneDNN's and transformers' linears do.
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

// x: [..., in] bfloat16 (in even); packed: [ceil(out / 64), in / 2, 64, 2] bfloat16; bias: [out] bfloat16 or
// undefined; returns [..., out]
at::Tensor bf16_linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(TPENGINE_HAS_BF16_DOT, "bf16_linear was built for a CPU without AVX512-BF16");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_linear takes bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == BLOCK_OUT && packed.size(3) == 2 && packed.is_contiguous(),
              "the weight must be packed as [out / 64, in / 2, 64, 2]");
  const int64_t in_features = 2 * packed.size(1);
  TORCH_CHECK(packed.size(0) * BLOCK_OUT >= out_features && out_features > (packed.size(0) - 1) * BLOCK_OUT,
              "out_features does not match the packed weight");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == in_features, "x's last dimension must be the weight's in-features");
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpengine_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpengine_cpu, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
