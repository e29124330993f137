// All-reduce (sum) and gather to rank 0 for tensor-parallel ranks on one host, through one
// shared-memory segment that every rank maps (tpengine/distributed/shm_all_reduce.py creates it and
// drives these ops).
//
// Each rank owns two slots; chunk number s (counted from 1 over the segment's life, the same on
// every rank, all-reduces and gathers alike) goes to slot s % 2. A rank copies its piece into its
// slot, publishes s in its ready word, waits until every rank has published s, then reads the
// slots: every rank sums them in rank order into its tensor (all-reduce), or rank 0 copies them out
// (gather). Two slots are enough: a rank that publishes s has finished chunk s - 1, so every rank it
// waited for there had published s - 1 and so had finished reading chunk s - 2, the slot's last use.
// The ready word is stored with release and read with acquire, so the slot's bytes are visible
// before it on any CPU.
//
// A wait spins for spin_s seconds (pausing the core, or yielding it when there are more ranks than
// cores), then sleeps on a futex in the segment until a peer publishes or wait_s has passed; the op
// then returns the chunk it waits for, and the caller, which also checks that the peers are alive,
// calls again to resume. A publisher makes the futex call only when some rank sleeps.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <climits>
#include <cstring>
#include <ctime>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// Words of line 0 and of a rank's control line (the same layout as shm_all_reduce.py).
constexpr int64_t kWakeWord = 3;     // line 0: bumped before waking sleepers (its low 32 bits are the futex)
constexpr int64_t kSleepersWord = 4;  // line 0: ranks inside a futex wait, or about to enter one
constexpr int64_t kReadySeq = 0;
constexpr int64_t kChunkBytes = 1;  // + seq % 2: a rank already publishing seq + 1 leaves seq's alone
constexpr int64_t kParallelGrainBytes = 256 << 10;  // below this one thread copies and sums faster
constexpr int64_t kBlockElements = 2048;            // summed rank after rank within an L1-sized block

using Clock = std::chrono::steady_clock;

inline std::atomic_ref<uint64_t> word(int64_t* line, int64_t index) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(line + index));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One rank's view of the segment.
struct Segment {
  int64_t* control;
  uint8_t* slots;
  int64_t world_size, slot_bytes, rank;

  Segment(const at::Tensor& control_tensor, const at::Tensor& slots_tensor, int64_t rank_) : rank(rank_) {
    TORCH_CHECK(control_tensor.scalar_type() == at::kLong && slots_tensor.scalar_type() == at::kByte &&
                slots_tensor.dim() == 3 && slots_tensor.size(1) == 2);
    world_size = slots_tensor.size(0);
    slot_bytes = slots_tensor.size(2);
    TORCH_CHECK(world_size >= 2 && control_tensor.numel() >= 8 * (1 + world_size) && 0 <= rank && rank < world_size);
    control = control_tensor.data_ptr<int64_t>();
    slots = slots_tensor.data_ptr<uint8_t>();
  }

  int64_t* line(int64_t r) const { return control + 8 * (1 + r); }
  uint8_t* slot(int64_t r, uint64_t seq) const { return slots + (2 * r + seq % 2) * slot_bytes; }
  uint32_t* futex_word() const {  // the low half of the wake word on either byte order
    return reinterpret_cast<uint32_t*>(control + kWakeWord) + (std::endian::native == std::endian::big);
  }

  bool all_published(uint64_t seq) const {
    for (int64_t r = 0; r < world_size; ++r)
      if (word(line(r), kReadySeq).load(std::memory_order_seq_cst) < seq) return false;
    return true;
  }

  // Last: the slot's bytes (and the chunk size) happen before the ready word on every CPU.
  void publish(uint64_t seq, int64_t bytes) const {
    word(line(rank), kChunkBytes + seq % 2).store(bytes, std::memory_order_relaxed);
    word(line(rank), kReadySeq).store(seq, std::memory_order_seq_cst);
    // seq_cst store, then load: either a sleeper sees seq before it sleeps, or it is counted here
    if (word(control, kSleepersWord).load(std::memory_order_seq_cst) != 0) {
      std::atomic_ref<uint32_t>(*futex_word()).fetch_add(1, std::memory_order_seq_cst);
      syscall(SYS_futex, futex_word(), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    }
  }

  // True once every rank has published seq; false when wait_s has passed without it.
  bool wait_published(uint64_t seq, double spin_s, double wait_s, bool yield) const {
    const auto started = Clock::now();
    const auto spin_until = started + std::chrono::duration<double>(spin_s);
    for (int64_t i = 0;; ++i) {
      if (all_published(seq)) return true;
      if (i % 64 == 63 && Clock::now() >= spin_until) break;
      if (yield) {
        sched_yield();  // more ranks than cores: let the rank that has work run
      } else {
        cpu_relax();
      }
    }
    const auto until = started + std::chrono::duration<double>(wait_s);
    auto sleepers = word(control, kSleepersWord);
    std::atomic_ref<uint32_t> wake(*futex_word());
    for (;;) {
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seen = wake.load(std::memory_order_seq_cst);
      const bool done = all_published(seq);
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(until - Clock::now()).count();
      if (!done && left > 0) {
        // returns at once if a publisher bumped the word since `seen`: nothing is missed
        timespec timeout{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
        syscall(SYS_futex, futex_word(), FUTEX_WAIT, seen, &timeout, nullptr, 0);
      }
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (done) return true;
      if (left <= 0) return all_published(seq);
    }
  }
};

// out = ((slot_0 + slot_1) + slot_2) + ..., rounded to scalar_t after every addition: exactly what
// torch computes for t_0 + t_1 + t_2 + ..., on every rank alike.
template <typename scalar_t>
void sum_in_rank_order(scalar_t* out, const Segment& s, uint64_t seq, int64_t numel) {
  const int64_t grain = std::max<int64_t>(kParallelGrainBytes / sizeof(scalar_t), kBlockElements);
  at::parallel_for(0, numel, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block += kBlockElements) {
      const int64_t n = std::min(kBlockElements, end - block);
      const auto* first = reinterpret_cast<const scalar_t*>(s.slot(0, seq)) + block;
      const auto* second = reinterpret_cast<const scalar_t*>(s.slot(1, seq)) + block;
      scalar_t* o = out + block;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = first[i] + second[i];
      for (int64_t r = 2; r < s.world_size; ++r) {
        const auto* next = reinterpret_cast<const scalar_t*>(s.slot(r, seq)) + block;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = o[i] + next[i];
      }
    }
  });
}

void copy_bytes(uint8_t* to, const uint8_t* from, int64_t bytes) {
  at::parallel_for(0, bytes, kParallelGrainBytes, [&](int64_t begin, int64_t end) {
    std::memcpy(to + begin, from + begin, end - begin);
  });
}

void check_sizes(const Segment& s, uint64_t seq, int64_t bytes, const char* what) {
  for (int64_t r = 0; r < s.world_size; ++r)
    TORCH_CHECK(word(s.line(r), kChunkBytes + seq % 2).load(std::memory_order_relaxed) == static_cast<uint64_t>(bytes),
                "shm ", what, ": rank ", r, " passes a tensor of another size than rank ", s.rank);
}

// Reduces data (contiguous) in place, chunks start_chunk onwards; chunk c has sequence number
// first_seq + c + 1. start_published: this rank already published start_chunk before an earlier
// call returned. Returns the number of chunks done: below the total when a wait ran out of wait_s.
int64_t all_reduce(at::Tensor data, at::Tensor control, at::Tensor slots, int64_t rank, int64_t first_seq,
                   int64_t start_chunk, bool start_published, double spin_s, double wait_s, bool yield) {
  TORCH_CHECK(data.is_contiguous() && data.device().is_cpu(), "shm all_reduce needs a contiguous CPU tensor");
  const Segment s(control, slots, rank);
  const int64_t element_bytes = data.element_size();
  const int64_t chunk_elements = s.slot_bytes / element_bytes;
  const int64_t numel = data.numel();
  const int64_t num_chunks = (numel + chunk_elements - 1) / chunk_elements;
  auto* bytes = static_cast<uint8_t*>(data.data_ptr());

  for (int64_t c = start_chunk; c < num_chunks; ++c) {
    const uint64_t seq = first_seq + c + 1;
    const int64_t begin = c * chunk_elements, n = std::min(chunk_elements, numel - begin);
    if (!(c == start_chunk && start_published)) {
      copy_bytes(s.slot(rank, seq), bytes + begin * element_bytes, n * element_bytes);
      s.publish(seq, n * element_bytes);
    }
    if (!s.wait_published(seq, spin_s, wait_s, yield)) return c;
    check_sizes(s, seq, n * element_bytes, "all_reduce");  // every rank reduces the same sequence of tensors
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, data.scalar_type(), "shm_all_reduce", [&] {
      sum_in_rank_order(reinterpret_cast<scalar_t*>(bytes) + begin, s, seq, n);
    });
  }
  return num_chunks;
}

// Bytes [begin, begin + n) of rank r's data, rows of row_bytes, from src into out, whose rows hold every
// rank's row side by side in rank order (the concatenation along the last dimension).
void copy_into_rows(uint8_t* out, const uint8_t* src, int64_t begin, int64_t n, int64_t row_bytes,
                    int64_t world_size, int64_t r) {
  while (n > 0) {
    const int64_t row = begin / row_bytes, column = begin % row_bytes, len = std::min(n, row_bytes - column);
    copy_bytes(out + (row * world_size + r) * row_bytes + column, src, len);
    src += len;
    begin += len;
    n -= len;
  }
}

// Rank 0 gets every rank's data (contiguous, rows of row_bytes) concatenated row by row in out (uint8,
// world_size x the input's bytes): no second pass joins the pieces. out is unused on the other ranks.
// Chunks, first_seq, start_published and the result as in all_reduce; an empty tensor is one chunk of
// no bytes, so every rank still counts it.
int64_t gather(at::Tensor data, at::Tensor out, at::Tensor control, at::Tensor slots, int64_t rank,
               int64_t first_seq, int64_t start_chunk, bool start_published, double spin_s, double wait_s,
               bool yield, int64_t row_bytes) {
  TORCH_CHECK(data.is_contiguous() && data.device().is_cpu(), "shm gather needs a contiguous CPU tensor");
  const Segment s(control, slots, rank);
  const int64_t total = data.numel() * data.element_size();
  TORCH_CHECK(row_bytes > 0 && total % row_bytes == 0, "shm gather: rows of ", row_bytes, " bytes must tile the ",
              total, " bytes of the input");
  const int64_t num_chunks = std::max<int64_t>(1, (total + s.slot_bytes - 1) / s.slot_bytes);
  const auto* bytes = static_cast<const uint8_t*>(data.data_ptr());
  uint8_t* gathered = nullptr;
  if (rank == 0) {
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kByte && out.numel() == s.world_size * total,
                "shm gather: rank 0's output must be a contiguous uint8 tensor of world_size x the input's bytes");
    gathered = out.data_ptr<uint8_t>();
  }
  for (int64_t c = start_chunk; c < num_chunks; ++c) {
    const uint64_t seq = first_seq + c + 1;
    const int64_t begin = c * s.slot_bytes, n = std::min(s.slot_bytes, total - begin);
    if (!(c == start_chunk && start_published)) {
      if (rank == 0) {  // its own piece goes straight to the output
        copy_into_rows(gathered, bytes + begin, begin, n, row_bytes, s.world_size, 0);
      } else {
        copy_bytes(s.slot(rank, seq), bytes + begin, n);
      }
      s.publish(seq, n);
    }
    if (!s.wait_published(seq, spin_s, wait_s, yield)) return c;
    if (rank == 0) {
      check_sizes(s, seq, n, "gather");
      for (int64_t r = 1; r < s.world_size; ++r)
        copy_into_rows(gathered, s.slot(r, seq), begin, n, row_bytes, s.world_size, r);
    }
  }
  return num_chunks;
}

}  // namespace

TORCH_LIBRARY(tpengine_shm, m) {
  m.def("all_reduce(Tensor(a!) data, Tensor(b!) control, Tensor(c!) slots, int rank, int first_seq, "
        "int start_chunk, bool start_published, float spin_s, float wait_s, bool yield_cpu) -> int");
  m.def("gather(Tensor data, Tensor(a!) out, Tensor(b!) control, Tensor(c!) slots, int rank, int first_seq, "
        "int start_chunk, bool start_published, float spin_s, float wait_s, bool yield_cpu, int row_bytes) -> int");
}

TORCH_LIBRARY_IMPL(tpengine_shm, CPU, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("gather", &gather);
}
