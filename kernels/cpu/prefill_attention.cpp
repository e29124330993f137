// Prefill attention for the CPU: one sequence's chunk of queries over its keys, causal, optionally within a
// sliding window; every query head of a KV head's group in one work item, so each key block is read and
// transposed once for the group. Flash-style: keys in blocks with a running max and sum per query row, so a
// work item's memory is a block's worth whatever the length. The products are register-blocked tiles (four
// query rows at a time) over a transposed key block and the value rows: torch's SDPA reached 33-54 GFLOPS
// on one Zen 4 core at head_dim 32-128 (docs/benchmarks.md). float32 math for float32, bfloat16 and float16.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include "vector_exp.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
#else
constexpr int64_t kWidth = 4;
#endif
typedef float Vec __attribute__((vector_size(kWidth * sizeof(float))));

constexpr int64_t kRows = 4;  // query rows of a tile: their products share each load
#if defined(__AVX512F__)
constexpr int kKeyVecs = 4;  // key vectors of a scores tile: 4 x 4 accumulators fit AVX-512's 32 registers
#else
constexpr int kKeyVecs = 2;  // AVX2's 16 registers hold 4 x 2
#endif
constexpr int64_t kKeyChunk = kKeyVecs * kWidth;  // keys of one scores tile
constexpr int64_t kKeyBlock = 128;                // keys a work item scores at a time
constexpr int64_t kTileRows = 64;                 // query rows (positions x the group's heads) of a work item
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

inline Vec splat(float x) { return Vec{} + x; }

// a * b + c in one instruction (ISO C++ builds do not contract a * b + c on their own)
inline Vec fmadd(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline Vec vexp(Vec x) {
#if defined(__AVX512F__)
  return (Vec)exp16((__m512)x);
#elif defined(__AVX2__) && defined(__FMA__)
  return (Vec)exp8((__m256)x);
#else
  Vec r;
  for (int64_t i = 0; i < kWidth; ++i) r[i] = std::exp(x[i]);
  return r;
#endif
}

// s[r][c .. c + kKeyChunk) = q[r] . keys c.. for R rows; kt: [head_dim][key_stride] (the keys transposed)
template <int R>
inline void scores_tile(const float* q, int64_t head_dim, const float* kt, int64_t key_stride, float* s,
                        int64_t s_stride, int64_t c) {
  Vec acc[R][kKeyVecs] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec kd[kKeyVecs];
    for (int i = 0; i < kKeyVecs; ++i) kd[i] = load(kt + d * key_stride + c + i * kWidth);
    for (int r = 0; r < R; ++r) {
      const Vec qd = splat(q[r * head_dim + d]);
      for (int i = 0; i < kKeyVecs; ++i) acc[r][i] = fmadd(qd, kd[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kKeyVecs; ++i) store(s + r * s_stride + c + i * kWidth, acc[r][i]);
}

// o[r][col .. col + N * kWidth) += sum over keys j < n of p[r][j] * v[j][col ..] for R rows
template <int R, int N>
inline void values_tile(const float* p, int64_t key_stride, const float* v, int64_t v_row, int64_t head_dim,
                        int64_t n, float* o, int64_t col) {
  Vec acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = load(o + r * head_dim + col + i * kWidth);
  for (int64_t j = 0; j < n; ++j) {
    Vec vj[N];
    for (int i = 0; i < N; ++i) vj[i] = load(v + j * v_row + col + i * kWidth);
    for (int r = 0; r < R; ++r) {
      const Vec pj = splat(p[r * key_stride + j]);
      for (int i = 0; i < N; ++i) acc[r][i] = fmadd(pj, vj[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) store(o + r * head_dim + col + i * kWidth, acc[r][i]);
}

template <int R>
void values_rows(const float* p, int64_t key_stride, const float* v, int64_t v_row, int64_t head_dim, int64_t n,
                 float* o) {
  for (int64_t col = 0; col < head_dim; col += 4 * kWidth) {
    switch (std::min<int64_t>(4, (head_dim - col) / kWidth)) {
      case 4: values_tile<R, 4>(p, key_stride, v, v_row, head_dim, n, o, col); break;
      case 3: values_tile<R, 3>(p, key_stride, v, v_row, head_dim, n, o, col); break;
      case 2: values_tile<R, 2>(p, key_stride, v, v_row, head_dim, n, o, col); break;
      default: values_tile<R, 1>(p, key_stride, v, v_row, head_dim, n, o, col); break;
    }
  }
}

template <int R>
void scores_rows(const float* q, int64_t head_dim, const float* kt, int64_t key_stride, float* s, int64_t s_stride,
                 int64_t n) {
  for (int64_t c = 0; c < n; c += kKeyChunk) scores_tile<R>(q, head_dim, kt, key_stride, s, s_stride, c);
}

// One row's scores of a key block, s[0, width), into probabilities: the keys outside [lo, hi) are masked to 0, the
// block is folded into the row's running max and sum, and the row's output so far rescaled to the new max.
void softmax_step(float* s, int64_t width, int64_t lo, int64_t hi, float& max, float& sum, float* o,
                  int64_t head_dim) {
  if (lo >= hi) {  // no key of this block is visible to the row
    std::fill(s, s + width, 0.f);
    return;
  }
  std::fill(s, s + lo, kMinusInf);
  std::fill(s + hi, s + width, kMinusInf);
  Vec peaks = splat(kMinusInf);
  for (int64_t j = 0; j < width; j += kWidth) {
    const Vec x = load(s + j);
    peaks = x > peaks ? x : peaks;
  }
  float peak = kMinusInf;
  for (int64_t i = 0; i < kWidth; ++i) peak = std::max(peak, peaks[i]);
  const float new_max = std::max(max, peak);
  const float rescale = max == kMinusInf ? 0.f : std::exp(max - new_max);
  Vec total = {};
  const Vec shift = splat(new_max), masked = splat(kMinusInf), zero = {};
  for (int64_t j = 0; j < width; j += kWidth) {
    const Vec x = load(s + j);
    const Vec e = x == masked ? zero : vexp(x - shift);  // the vector exp stops short of 0 at about -100
    store(s + j, e);
    total += e;
  }
  float block_sum = 0.f;
  for (int64_t i = 0; i < kWidth; ++i) block_sum += total[i];
  sum = sum * rescale + block_sum;
  max = new_max;
  if (rescale != 1.f)
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= rescale;
}

struct Shapes {
  int64_t len_q, len_k, num_heads, num_kv_heads, head_dim, window;
  int64_t q_row, q_head, o_row, o_head;  // strides in elements
};

// Query rows of one KV head's group: positions first .. first + count - 1, each with the group's heads (row r is
// position first + r / group, head kv_head * group + r % group). kt: the KV head's keys in blocks of kKeyBlock, each
// transposed ([head_dim][kKeyBlock]); v: its value rows [len_k][head_dim].
template <typename T>
void attend_rows(const Shapes& x, const T* q, const float* kt, const float* v, T* out, float scale, int64_t kv_head,
                 int64_t first, int64_t count) {
  const int64_t group = x.num_heads / x.num_kv_heads, head_dim = x.head_dim, rows = count * group;
  const int64_t offset = x.len_k - x.len_q;  // query i is key offset + i
  std::vector<float> qf(rows * head_dim), o(rows * head_dim, 0.f), s(kRows * kKeyBlock), max(rows, kMinusInf),
      sum(rows, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (first + r / group) * x.q_row + (kv_head * group + r % group) * x.q_head;
    for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = static_cast<float>(src[d]) * scale;
  }
  // the keys any row sees: from the first row's window start to the last row's own key
  const int64_t keys_end = offset + first + count;
  const int64_t keys_begin = x.window > 0 ? std::max<int64_t>(0, offset + first - x.window + 1) : 0;
  for (int64_t b0 = keys_begin - keys_begin % kKeyBlock; b0 < keys_end; b0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, keys_end - b0);
    const int64_t width = (n + kKeyChunk - 1) / kKeyChunk * kKeyChunk;  // the transposed keys are padded to it
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t tile = std::min(kRows, rows - r0);
      const float* qt = qf.data() + r0 * head_dim;
      const float* kb = kt + b0 * head_dim;  // the block's transposed keys
      switch (tile) {
        case 4: scores_rows<4>(qt, head_dim, kb, kKeyBlock, s.data(), kKeyBlock, n); break;
        case 3: scores_rows<3>(qt, head_dim, kb, kKeyBlock, s.data(), kKeyBlock, n); break;
        case 2: scores_rows<2>(qt, head_dim, kb, kKeyBlock, s.data(), kKeyBlock, n); break;
        default: scores_rows<1>(qt, head_dim, kb, kKeyBlock, s.data(), kKeyBlock, n); break;
      }
      int64_t visible = 0;  // the tile's keys up to its last row's own: later ones are 0 for every row
      for (int64_t r = r0; r < r0 + tile; ++r) {
        const int64_t own = offset + first + r / group;
        const int64_t lo = x.window > 0 ? std::clamp<int64_t>(own - x.window + 1 - b0, 0, n) : 0;
        const int64_t hi = std::clamp<int64_t>(own + 1 - b0, 0, n);
        softmax_step(s.data() + (r - r0) * kKeyBlock, width, lo, hi, max[r], sum[r], o.data() + r * head_dim,
                     head_dim);
        visible = std::max(visible, hi);
      }
      float* ot = o.data() + r0 * head_dim;
      const float* vb = v + b0 * head_dim;
      switch (tile) {
        case 4: values_rows<4>(s.data(), kKeyBlock, vb, head_dim, head_dim, visible, ot); break;
        case 3: values_rows<3>(s.data(), kKeyBlock, vb, head_dim, head_dim, visible, ot); break;
        case 2: values_rows<2>(s.data(), kKeyBlock, vb, head_dim, head_dim, visible, ot); break;
        default: values_rows<1>(s.data(), kKeyBlock, vb, head_dim, head_dim, visible, ot); break;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (first + r / group) * x.o_row + (kv_head * group + r % group) * x.o_head;
    const float inv = 1.f / sum[r];  // every row sees at least its own key
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(o[r * head_dim + d] * inv);
  }
}

// A call's buffer: the calling thread's kept one while it needs at most kScratchKeepBytes (allocated afresh, its
// pages were faulted in on every call: 2048 keys of 8 KV heads of 128 are 16 MB of them), else its own for the call.
constexpr size_t kScratchKeepBytes = size_t(64) << 20;

class Scratch {
 public:
  Scratch(int which, size_t count) {
    thread_local std::vector<float> kept[2];  // 0: transposed keys, 1: values
    std::vector<float>& buffer = count * sizeof(float) <= kScratchKeepBytes ? kept[which] : own_;
    if (buffer.size() < count) buffer.resize(count);
    data_ = buffer.data();
  }
  float* data() const { return data_; }

 private:
  std::vector<float> own_;
  float* data_;
};

void check_rows_of_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1, name,
              " must be a CPU tensor [tokens, heads, head_dim] with head_dim contiguous");
}

// out[i, h] = softmax(scale * q[i, h] . k[j, h / group]) v[j, h / group] over the keys j query i sees: q holds
// the last len_q of the len_k positions k and v hold, so query i is key len_k - len_q + i, and it sees keys up
// to its own (and only the last `window` of them when window > 0).
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       int64_t window) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &q, &k, &v}) check_rows_of_heads(*t, "q, k, v and out");
  const int64_t len_q = q.size(0), len_k = k.size(0), num_heads = q.size(1), num_kv_heads = k.size(1),
                head_dim = q.size(2);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == head_dim && out.sizes() == q.sizes(),
              "k and v must be [len_k, num_kv_heads, head_dim] of q's head_dim, out q's shape");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "the query heads must be a multiple of the KV heads");
  TORCH_CHECK(len_k >= len_q, "there must be a key for every query (len_k >= len_q)");
  TORCH_CHECK(head_dim % kWidth == 0, "head_dim must be a multiple of ", kWidth, " (this build's vector width)");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == out.scalar_type(), "q, k, v and out must share one dtype");
  const Shapes x{len_q, len_k, num_heads, num_kv_heads, head_dim, window, q.stride(0), q.stride(1), out.stride(0),
                 out.stride(1)};
  const int64_t group = num_heads / num_kv_heads;
  const int64_t positions = std::max<int64_t>(1, kTileRows / group);  // positions per work item
  const int64_t tiles = (len_q + positions - 1) / positions, items = tiles * num_kv_heads;
  // each KV head's keys transposed once for all its work items, a block of kKeyBlock keys at a time ([head_dim]
  // [kKeyBlock] each: a block's rows lie together, not a whole sequence apart), zero past len_k
  const int64_t padded_keys = (len_k + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const Scratch keys(0, num_kv_heads * head_dim * padded_keys);
  float* kt = keys.data();
  for (int64_t h = 0; h < num_kv_heads && len_k < padded_keys; ++h)  // the last block's columns past len_k: 0
    for (int64_t d = 0; d < head_dim; ++d) {
      float* row = kt + (h * padded_keys + padded_keys - kKeyBlock) * head_dim + d * kKeyBlock;
      std::fill(row + len_k % kKeyBlock, row + kKeyBlock, 0.f);
    }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "prefill_attention", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    for (int64_t j = 0; j < len_k; ++j)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const scalar_t* row = kp + j * k.stride(0) + h * k.stride(1);
        float* col = kt + (h * padded_keys + j - j % kKeyBlock) * head_dim + j % kKeyBlock;
        for (int64_t d = 0; d < head_dim; ++d) col[d * kKeyBlock] = static_cast<float>(row[d]);
      }
    // and its values in float32, one KV head's rows together (in place they lie num_kv_heads * head_dim apart,
    // 4 KB on a typical model: a block's rows would share a few cache sets)
    const Scratch values(1, num_kv_heads * len_k * head_dim);
    float* vf = values.data();
    const scalar_t* vsrc = v.data_ptr<scalar_t>();
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t j = 0; j < len_k; ++j) {
        const scalar_t* row = vsrc + j * v.stride(0) + h * v.stride(1);
        float* dst = vf + (h * len_k + j) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(row[d]);
      }
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    auto run = [&](int64_t item) {
      const int64_t first = (item / num_kv_heads) * positions, kv_head = item % num_kv_heads;
      attend_rows<scalar_t>(x, qp, kt + kv_head * padded_keys * head_dim, vf + kv_head * len_k * head_dim,
                            op, static_cast<float>(scale), kv_head, first, std::min(positions, len_q - first));
    };
    // causal tiles grow with their position: each thread takes every n-th item, not a contiguous run of them
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t item = t; item < items; item += threads) run(item);
    });
  });
}

}  // namespace

TORCH_LIBRARY(tpengine_prefill, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(tpengine_prefill, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
