// Runs the CUDA sources of csrc/ on host threads, without a GPU, for the C++ tests (test_cuda_kernels.cpp): each
// block of a launch runs as blockDim.x std::threads, the blocks one after another, with __syncthreads, the warp
// operations (__syncwarp, __shfl_down_sync, __ballot_sync) and shared memory emulated:
// - __syncthreads is a barrier of the block's threads; a warp's operations, a barrier of its 32 threads;
// - __shared__ arrays are function statics (one block runs at a time, so its threads share them and nothing else
//   does); the launch's dynamic shared memory is a buffer of the block;
// - the launch macros of cuda_grid.cuh (MJP_LAUNCH, MJP_DYNAMIC_SHARED) are defined here first, so the launchers of
//   the .cu files compile as they are and run their kernels here, with their own choice of grid and variant.
// The threads run truly concurrently, so a missing barrier shows as a wrong result (most of the time), a barrier
// that some threads skip as a hang (ctest's timeout). Block shapes are one-dimensional, as in csrc/.
//
// Include this first, then the .cu file under test. The memory is the host's: "device pointers" are host pointers, and
// the atomics are std::atomic_ref.
#pragma once

#define MJP_CUDA_ON_HOST_THREADS 1

#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

// ---- What cuda_runtime_api.h and vector_types.h would give.
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9 };
using cudaStream_t = void*;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* memory, int value, size_t bytes, cudaStream_t) {
  std::memset(memory, value, bytes);
  return cudaSuccess;
}

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace mjp_emulation {

struct Warp {
  std::barrier<> barrier{32};
  std::array<uint64_t, 32> slots{};
};

struct Block {
  explicit Block(unsigned threads, size_t shared_bytes)
      : barrier(threads), shared((shared_bytes + 15) / 16 + 1) {
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
  std::barrier<> barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<uint4> shared;  // the dynamic shared memory, 16-byte aligned
};

inline thread_local Block* block = nullptr;
inline thread_local dim3 thread_index, block_index;
inline dim3 block_dim, grid_dim;
inline std::atomic<int64_t> blocks_run{0};  // for the tests: how many blocks the launches ran

inline Warp& warp() { return *block->warps[thread_index.x / 32]; }
inline int lane() { return static_cast<int>(thread_index.x % 32); }

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(block->shared.data());
}

// Runs kernel(args...) on grid x block threads.
template <typename... Params, typename... Args>
void run(void (*kernel)(Params...), dim3 grid, dim3 threads, size_t shared_bytes, Args&&... args) {
  grid_dim = grid;
  block_dim = threads;
  for (unsigned b = 0; b < grid.x; ++b) {
    Block state(threads.x, shared_bytes);
    std::vector<std::thread> workers;
    workers.reserve(threads.x);
    for (unsigned t = 0; t < threads.x; ++t) {
      workers.emplace_back([&, b, t] {
        block = &state;
        block_index = dim3(b);
        thread_index = dim3(t);
        kernel(args...);
      });
    }
    for (auto& worker : workers) worker.join();
    ++blocks_run;
  }
}

template <typename... Params>
struct Launch {
  void (*kernel)(Params...);
  dim3 grid, threads;
  size_t shared_bytes;
  template <typename... Args>
  void operator()(Args&&... args) const {
    run(kernel, grid, threads, shared_bytes, static_cast<Params>(args)...);
  }
};

template <typename... Params>
Launch<Params...> launch(dim3 grid, dim3 threads, size_t shared_bytes, void (*kernel)(Params...)) {
  return Launch<Params...>{kernel, grid, threads, shared_bytes};
}

template <typename T>
uint64_t to_slot(T value) {
  static_assert(sizeof(T) <= 8);
  uint64_t slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  return slot;
}

template <typename T>
T from_slot(uint64_t slot) {
  T value;
  std::memcpy(&value, &slot, sizeof(T));
  return value;
}

}  // namespace mjp_emulation

#define MJP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::mjp_emulation::launch(dim3(grid), dim3(block), shared_bytes, __VA_ARGS__)
#define MJP_DYNAMIC_SHARED(type, name) type* name = ::mjp_emulation::dynamic_shared<type>()

#define threadIdx (::mjp_emulation::thread_index)
#define blockIdx (::mjp_emulation::block_index)
#define blockDim (::mjp_emulation::block_dim)
#define gridDim (::mjp_emulation::grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

inline void __syncthreads() { mjp_emulation::block->barrier.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { mjp_emulation::warp().barrier.arrive_and_wait(); }

template <typename T>
T __shfl_down_sync(unsigned, T value, int offset) {
  auto& w = mjp_emulation::warp();
  const int lane = mjp_emulation::lane();
  w.slots[lane] = mjp_emulation::to_slot(value);
  w.barrier.arrive_and_wait();
  const T result = lane + offset < 32 ? mjp_emulation::from_slot<T>(w.slots[lane + offset]) : value;
  w.barrier.arrive_and_wait();  // every lane has read before the slots are reused
  return result;
}

inline unsigned __ballot_sync(unsigned, bool predicate) {
  auto& w = mjp_emulation::warp();
  const int lane = mjp_emulation::lane();
  w.slots[lane] = predicate ? 1 : 0;
  w.barrier.arrive_and_wait();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(w.slots[l] != 0) << l;
  w.barrier.arrive_and_wait();
  return bits;
}

inline int __popc(unsigned word) { return __builtin_popcount(word); }

template <typename T>
T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;  // the old value, as CUDA's: compare_exchange_strong leaves it in `compare`
}

template <typename T>
T atomicExch(T* address, T value) {
  return std::atomic_ref<T>(*address).exchange(value);
}

template <typename T>
T __ldg(const T* address) {
  return *address;
}
