// What every op uses: the constants (constants.cuh, rendered), the step's trace and profile stamps, loads, warp and
// block reductions, Philox.
#pragma once
#include "constants.cuh"

namespace cg = cooperative_groups;

#if MK_PROFILE
#define STAMP(p, layer, event)                                                                                     \
  do {                                                                                                             \
    if (threadIdx.x == 0) p.timeline[((size_t)(layer) * GRID + blockIdx.x) * TL_EVENTS + TL_##event] = clock64(); \
  } while (0)
#else
#define STAMP(p, layer, event) \
  do {                         \
  } while (0)
#endif

// Sequence seq's trace buffer, and this layer's slice of it (unused unless built with -DMK_TRACE=1).
__device__ __forceinline__ float* seq_trace(const Params& p, int seq) { return p.trace + (size_t)seq * TRACE_TOTAL; }
__device__ __forceinline__ float* layer_trace(const Params& p, int layer, int seq = 0) {
  return seq_trace(p, seq) + TRACE_LAYER0 + layer * TRACE_LAYER_STRIDE;
}

__device__ __forceinline__ float bf2f(bf16 v) { return __bfloat162float(v); }

// The embedding row of sequence seq's input token (in table p.table[seq]).
__device__ __forceinline__ const bf16* token_row(const Params& p, int seq) {
  return p.embed + ((size_t)p.table[seq] * V + p.token_in[seq]) * IN_DIM;
}

// Global warp index: output rows are strided over every warp of the grid.
__device__ __forceinline__ int grid_warp() { return blockIdx.x * WARPS + (threadIdx.x >> 5); }

// 16-byte weight load that skips L1: weights are read once a step.
__device__ __forceinline__ uint4 load_weights16(const bf16* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The barrier of the threads that compute.
__device__ __forceinline__ void block_sync() {
  __syncthreads();
}

// Sum over the block; `scratch` holds WARPS floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  block_sync();
  if (lane == 0) scratch[warp] = v;
  block_sync();
  float t = lane < WARPS ? scratch[lane] : 0.f;
  return warp_sum(t);
}

// The thread's index. A hybrid's batch build reads it where it is used (volatile): indices derived from threadIdx.x were
// hoisted out of the layer loop and held across it, and Qwen3.5-0.8B's batch builds spilled. Every other build keeps
// threadIdx.x, its code as it was measured.
__device__ __forceinline__ unsigned thread_index() {  // unsigned, as threadIdx.x: the arithmetic on it is the same
  if constexpr (BATCH == 1 || !(HAS_LINEAR_ATTENTION || HAS_MOE)) {
    return threadIdx.x;
  } else {
    unsigned t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
  }
}

// Sums over the block of B values at once, with one pair of barriers for all; `scratch` holds WARPS * B
// floats. Every thread gets every sum; each is added in the order block_sum adds it.
template <int B>
__device__ __forceinline__ void block_sums(float (&v)[B], float* scratch) {
  const int lane = thread_index() & 31, warp = thread_index() >> 5;
#pragma unroll
  for (int b = 0; b < B; ++b) v[b] = warp_sum(v[b]);
  block_sync();
  if (lane == 0)
#pragma unroll
    for (int b = 0; b < B; ++b) scratch[b * WARPS + warp] = v[b];
  block_sync();
#pragma unroll
  for (int b = 0; b < B; ++b) v[b] = warp_sum(lane < WARPS ? scratch[b * WARPS + lane] : 0.f);
}

// Asynchronous 16-byte global -> shared copy (sm_80+): many in flight, waited for with cp_async_wait_all.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// The copies issued since the last commit become a group; wait_group<N> waits until at most the N latest are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Activations written by other blocks are read past L1 (it is not coherent across SMs).
__device__ __forceinline__ float load_shared_state(const float* p) { return __ldcg(p); }

// Loads issued where they stand, for values needed only later: the compiler would otherwise move them next to
// their use, after the barriers or reductions in between, adding a memory round trip to the chain.
__device__ __forceinline__ float load_state_now(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float4 load_state4_now(const float* p) {  // 16-byte aligned
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float load_weight_now(const bf16* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return bf2f(__ushort_as_bfloat16(v));
}

// Philox-4x32-10 (Salmon et al., SC'11), counter-based: uniform in (0, 1) from (seed, step, index) alone,
// so sampling is reproducible and needs no generator state. Written here because the CUDA toolkits this
// must compile with do not all ship cuRAND's headers.
__device__ __forceinline__ float philox_uniform(unsigned long long seed, unsigned long long step, unsigned index) {
  unsigned c0 = index, c1 = 0u, c2 = (unsigned)step, c3 = (unsigned)(step >> 32);
  unsigned k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return ((c0 >> 8) + 0.5f) * (1.0f / 16777216.0f);  // 24 random bits, centred: never 0 or 1
}
