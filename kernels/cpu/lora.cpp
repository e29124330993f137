// The LoRA add of a batch whose rows each name an adapter slot (or -1, none): for each row t of slot s,
// y[t] += scales[s] * (x[t] @ lora_a[s]) @ lora_b[s], in place, float32 math for every input dtype.
// SGMV grouping: consecutive rows of one slot form a segment (a prefill chunk's rows share one). A segment of
// at least mm_min_rows rows runs as two matmuls (at::mm, addmm_) on its slices; shorter ones (decode rows,
// scattered slots) run in hand loops over all their rows at once: a matmul per row costs more in dispatch and
// float copies of the adapter than its arithmetic (kernels/cpu/lora.py has the timings).
#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kBlockN = 256;             // output columns a task of the expand owns
constexpr int64_t kParallelWork = 1 << 14;   // multiply-adds worth a thread of their own

struct Segment {
  int64_t begin, end, slot;
};

void check_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& scales, const at::Tensor& slots) {
  for (const at::Tensor* t : {&y, &x, &lora_a, &lora_b, &scales, &slots})
    TORCH_CHECK(t->device().is_cpu(), "lora_add takes CPU tensors");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1,
              "y [T, N] and x [T, K] must have contiguous rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_a [S, K, R] and lora_b [S, R, N] must be contiguous");
  const auto dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "lora_add takes float32, bfloat16 or float16, not ", dtype);
  TORCH_CHECK(x.scalar_type() == dtype && lora_a.scalar_type() == dtype && lora_b.scalar_type() == dtype,
              "y, x, lora_a and lora_b must share one dtype");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong && scales.is_contiguous() &&
                  slots.is_contiguous(), "scales must be float32 [S] and slots int64 [T]");
  const int64_t S = lora_a.size(0);
  TORCH_CHECK(x.size(0) == y.size(0) && slots.dim() == 1 && slots.size(0) == y.size(0), "x, y and slots need T rows");
  TORCH_CHECK(lora_a.size(1) == x.size(1) && lora_b.size(0) == S && lora_b.size(1) == lora_a.size(2) &&
                  lora_b.size(2) == y.size(1) && scales.dim() == 1 && scales.size(0) == S,
              "lora_a must be [S, K, R], lora_b [S, R, N], scales [S]");
}

// Runs of consecutive rows of one slot, -1 runs left out; a slot outside [-1, S) is refused.
std::vector<Segment> segments_of(const at::Tensor& slots, int64_t num_slots) {
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t rows = slots.size(0);
  std::vector<Segment> segments;
  for (int64_t begin = 0, end; begin < rows; begin = end) {
    TORCH_CHECK(slot[begin] >= -1 && slot[begin] < num_slots, "slot ", slot[begin], " of row ", begin,
                " is outside [-1, ", num_slots, ")");
    for (end = begin + 1; end < rows && slot[end] == slot[begin];) ++end;
    if (slot[begin] >= 0) segments.push_back({begin, end, slot[begin]});
  }
  return segments;
}

// y[segment] += scale * (x[segment] @ A) @ B as two matmuls, in float32 copies for the half dtypes.
void add_segment_by_matmul(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                           float scale, const Segment& seg) {
  const int64_t len = seg.end - seg.begin;
  at::Tensor ys = y.narrow(0, seg.begin, len), xs = x.narrow(0, seg.begin, len);
  if (y.scalar_type() == at::kFloat) {
    ys.addmm_(at::mm(xs, lora_a[seg.slot]), lora_b[seg.slot], 1.0, scale);
    return;
  }
  at::Tensor shrunk = at::mm(xs.to(at::kFloat), lora_a[seg.slot].to(at::kFloat));
  at::Tensor sum = ys.to(at::kFloat);
  sum.addmm_(shrunk, lora_b[seg.slot].to(at::kFloat), 1.0, scale);
  ys.copy_(sum);  // rounded to y's dtype once
}

// out[0..R) = x @ a for one row, a [K, R]: R in chunks of 16 columns (one AVX-512 register of float32), K
// unrolled by 4 into separate sums so that the multiply-adds do not wait on each other.
template <typename T>
void shrink_row(const T* x, const T* a, int64_t K, int64_t R, float* out) {
  constexpr int64_t kW = 16, kU = 4;
  for (int64_t r0 = 0; r0 < R; r0 += kW) {
    const int64_t w = std::min(kW, R - r0);
    float acc[kU][kW] = {};
    int64_t k = 0;
    for (; w == kW && k + kU <= K; k += kU) {
      for (int64_t u = 0; u < kU; ++u) {
        const float xv = static_cast<float>(x[k + u]);
        const T* ar = a + (k + u) * R + r0;
#pragma omp simd
        for (int64_t j = 0; j < kW; ++j) acc[u][j] += xv * static_cast<float>(ar[j]);
      }
    }
    for (; k < K; ++k) {
      const float xv = static_cast<float>(x[k]);
      for (int64_t j = 0; j < w; ++j) acc[0][j] += xv * static_cast<float>(a[k * R + r0 + j]);
    }
    for (int64_t j = 0; j < w; ++j) out[r0 + j] = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
  }
}

// y[0..width) = round(y + scale * (shrunk @ b)) for one row, b [R, N] from this block's first column: 64 columns
// (four registers) at a time, summed over R in registers.
template <typename T>
void expand_row(const float* shrunk, const T* b, int64_t N, int64_t R, int64_t width, float scale, T* y) {
  constexpr int64_t kW = 64;
  int64_t n = 0;
  for (; n + kW <= width; n += kW) {
    float acc[kW] = {};
    for (int64_t r = 0; r < R; ++r) {
      const float sr = shrunk[r];
      const T* br = b + r * N + n;
#pragma omp simd
      for (int64_t j = 0; j < kW; ++j) acc[j] += sr * static_cast<float>(br[j]);
    }
#pragma omp simd
    for (int64_t j = 0; j < kW; ++j) y[n + j] = static_cast<T>(static_cast<float>(y[n + j]) + scale * acc[j]);
  }
  for (; n < width; ++n) {  // the last columns of a width not a multiple of kW
    float acc = 0.f;
    for (int64_t r = 0; r < R; ++r) acc += shrunk[r] * static_cast<float>(b[r * N + n]);
    y[n] = static_cast<T>(static_cast<float>(y[n]) + scale * acc);
  }
}

// For each listed row t: y[t] += scales[slot[t]] * (x[t] @ A[slot]) @ B[slot], shrink first (all rows), then
// the expand split over rows and blocks of kBlockN columns.
template <typename T>
void add_rows_by_loops(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                       const at::Tensor& scales, const at::Tensor& slots, const std::vector<int64_t>& rows) {
  const int64_t K = x.size(1), N = y.size(1), R = lora_a.size(2), num_rows = rows.size();
  const T* x_ptr = x.data_ptr<T>();
  const T* a_ptr = lora_a.data_ptr<T>();
  const T* b_ptr = lora_b.data_ptr<T>();
  T* y_ptr = y.data_ptr<T>();
  const float* scale = scales.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  std::vector<float> shrunk(num_rows * R);  // x[t] @ A[slot], kept in float32
  at::parallel_for(0, num_rows, std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, K * R)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      shrink_row(x_ptr + rows[i] * x_stride, a_ptr + slot[rows[i]] * K * R, K, R, shrunk.data() + i * R);
  });
  const int64_t blocks = (N + kBlockN - 1) / kBlockN;
  at::parallel_for(0, num_rows * blocks, std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, R * kBlockN)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / blocks, n0 = (task % blocks) * kBlockN, t = rows[i];
      expand_row(shrunk.data() + i * R, b_ptr + slot[t] * R * N + n0, N, R, std::min(kBlockN, N - n0),
                 scale[slot[t]], y_ptr + t * y_stride + n0);
    }
  });
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& scales, const at::Tensor& slots, int64_t mm_min_rows) {
  check_args(y, x, lora_a, lora_b, scales, slots);
  const float* scale = scales.data_ptr<float>();
  std::vector<int64_t> loop_rows;  // rows of segments too short for a matmul
  for (const Segment& seg : segments_of(slots, lora_a.size(0))) {
    if (seg.end - seg.begin >= mm_min_rows) {
      add_segment_by_matmul(y, x, lora_a, lora_b, scale[seg.slot], seg);
    } else {
      for (int64_t t = seg.begin; t < seg.end; ++t) loop_rows.push_back(t);
    }
  }
  if (loop_rows.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "lora_add", [&] {
    add_rows_by_loops<scalar_t>(y, x, lora_a, lora_b, scales, slots, loop_rows);
  });
}

}  // namespace

TORCH_LIBRARY(tpengine_lora, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scales, Tensor slots, "
        "int mm_min_rows) -> ()");
}

TORCH_LIBRARY_IMPL(tpengine_lora, CPU, m) { m.impl("lora_add", &lora_add); }
