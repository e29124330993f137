// All-reduce (sum) for tensor-parallel ranks on one host, through one shared-memory segment that
// every rank maps (tpengine/distributed/shm_all_reduce.py creates it and drives this op).
//
// Each rank owns two slots; chunk number s (counted from 1 over the segment's life, the same on
// every rank) goes to slot s % 2. A rank copies its piece into its slot, publishes s in its ready
// word, waits until every rank has published s, then sums all ranks' slots in rank order into its
// tensor. Two slots are enough: a rank that publishes s has finished chunk s - 1, so every rank it
// waited for there had published s - 1 and so had finished reading chunk s - 2, the slot's last use.
//
// The wait spins (yielding the CPU) for at most spin_s seconds; the op then returns the chunk it
// waits for, and the caller, which also checks that the peers are alive, calls again to resume.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

namespace {

// Words of a rank's control line (the same layout as shm_all_reduce.py).
constexpr int64_t kReadySeq = 0;
constexpr int64_t kChunkBytes = 1;  // + seq % 2: a rank already publishing seq + 1 leaves seq's alone
constexpr int64_t kParallelGrainBytes = 256 << 10;  // below this one thread copies and sums faster
constexpr int64_t kBlockElements = 2048;            // summed rank after rank within an L1-sized block

inline std::atomic_ref<uint64_t> word(int64_t* line, int64_t index) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(line + index));
}

bool all_published(int64_t* control, int64_t world_size, uint64_t seq) {
  for (int64_t r = 0; r < world_size; ++r)
    if (word(control + 8 * (1 + r), kReadySeq).load(std::memory_order_acquire) < seq) return false;
  return true;
}

bool wait_published(int64_t* control, int64_t world_size, uint64_t seq, double spin_s) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(spin_s);
  for (int64_t i = 0;; ++i) {
    if (all_published(control, world_size, seq)) return true;
    if (i % 16 == 15 && std::chrono::steady_clock::now() >= until) return false;
    sched_yield();  // more ranks than free cores: let the rank that has work run
  }
}

// out = ((slot_0 + slot_1) + slot_2) + ..., rounded to scalar_t after every addition: exactly what
// torch computes for t_0 + t_1 + t_2 + ..., on every rank alike.
template <typename scalar_t>
void sum_in_rank_order(scalar_t* out, const uint8_t* slots, int64_t slot_stride, int64_t world_size,
                       int64_t numel) {
  const int64_t grain = std::max<int64_t>(kParallelGrainBytes / sizeof(scalar_t), kBlockElements);
  at::parallel_for(0, numel, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block += kBlockElements) {
      const int64_t n = std::min(kBlockElements, end - block);
      const auto* first = reinterpret_cast<const scalar_t*>(slots) + block;
      const auto* second = reinterpret_cast<const scalar_t*>(slots + slot_stride) + block;
      scalar_t* o = out + block;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = first[i] + second[i];
      for (int64_t r = 2; r < world_size; ++r) {
        const auto* next = reinterpret_cast<const scalar_t*>(slots + r * slot_stride) + block;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = o[i] + next[i];
      }
    }
  });
}

void copy_in(uint8_t* slot, const uint8_t* data, int64_t bytes) {
  at::parallel_for(0, bytes, kParallelGrainBytes, [&](int64_t begin, int64_t end) {
    std::memcpy(slot + begin, data + begin, end - begin);
  });
}

// Reduces data (contiguous) in place, chunks start_chunk onwards; chunk c has sequence number
// first_seq + c + 1. start_published: this rank already published start_chunk before an earlier
// call returned. Returns the number of chunks done: below the total when a wait ran out of spin_s.
int64_t all_reduce(at::Tensor data, at::Tensor control_tensor, at::Tensor slots_tensor, int64_t rank,
                   int64_t first_seq, int64_t start_chunk, bool start_published, double spin_s) {
  TORCH_CHECK(data.is_contiguous() && data.device().is_cpu(), "shm all_reduce needs a contiguous CPU tensor");
  TORCH_CHECK(control_tensor.scalar_type() == at::kLong && slots_tensor.scalar_type() == at::kByte &&
              slots_tensor.dim() == 3 && slots_tensor.size(1) == 2);
  const int64_t world_size = slots_tensor.size(0), slot_bytes = slots_tensor.size(2);
  TORCH_CHECK(world_size >= 2 && control_tensor.numel() >= 8 * (1 + world_size) && 0 <= rank && rank < world_size);
  int64_t* control = control_tensor.data_ptr<int64_t>();
  uint8_t* slots = slots_tensor.data_ptr<uint8_t>();
  int64_t* own_line = control + 8 * (1 + rank);
  const int64_t element_bytes = data.element_size();
  const int64_t chunk_elements = slot_bytes / element_bytes;
  const int64_t numel = data.numel();
  const int64_t num_chunks = (numel + chunk_elements - 1) / chunk_elements;
  auto* bytes = static_cast<uint8_t*>(data.data_ptr());

  for (int64_t c = start_chunk; c < num_chunks; ++c) {
    const uint64_t seq = first_seq + c + 1;
    const int64_t begin = c * chunk_elements, n = std::min(chunk_elements, numel - begin);
    uint8_t* first_slot = slots + (seq % 2) * slot_bytes;  // rank 0's slot; rank r's is r slot pairs on
    if (!(c == start_chunk && start_published)) {
      copy_in(first_slot + rank * 2 * slot_bytes, bytes + begin * element_bytes, n * element_bytes);
      word(own_line, kChunkBytes + seq % 2).store(n * element_bytes, std::memory_order_relaxed);
      word(own_line, kReadySeq).store(seq, std::memory_order_release);  // last: the slot is complete
    }
    if (!wait_published(control, world_size, seq, spin_s)) return c;
    for (int64_t r = 0; r < world_size; ++r)  // every rank reduces the same sequence of tensors
      TORCH_CHECK(word(control + 8 * (1 + r), kChunkBytes + seq % 2).load(std::memory_order_relaxed) ==
                      static_cast<uint64_t>(n * element_bytes),
                  "shm all_reduce: rank ", r, " reduces a tensor of another size than rank ", rank);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, data.scalar_type(), "shm_all_reduce", [&] {
      sum_in_rank_order(reinterpret_cast<scalar_t*>(bytes) + begin, first_slot, 2 * slot_bytes, world_size, n);
    });
  }
  return num_chunks;
}

}  // namespace

TORCH_LIBRARY(tpengine_shm, m) {
  m.def("all_reduce(Tensor(a!) data, Tensor(b!) control, Tensor(c!) slots, int rank, int first_seq, "
        "int start_chunk, bool start_published, float spin_s) -> int");
}

TORCH_LIBRARY_IMPL(tpengine_shm, CPU, m) { m.impl("all_reduce", &all_reduce); }
