// Matrix-vector products: one warp per output row, 16-byte weight loads, fp32 accumulation; a batch's on tensor
// cores (mma_matvec.cuh).
#pragma once
#include "mma_matvec.cuh"

__device__ __forceinline__ float dot8(uint4 w, const float* __restrict__ x) {
  const float4 a = *reinterpret_cast<const float4*>(x);
  const float4 b = *reinterpret_cast<const float4*>(x + 4);
  const float2 w0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
  const float2 w1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
  const float2 w2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.z));
  const float2 w3 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.w));
  float s = w0.x * a.x;
  s = fmaf(w0.y, a.y, s);
  s = fmaf(w1.x, a.z, s);
  s = fmaf(w1.y, a.w, s);
  s = fmaf(w2.x, b.x, s);
  s = fmaf(w2.y, b.y, s);
  s = fmaf(w3.x, b.z, s);
  s = fmaf(w3.y, b.w, s);
  return s;
}

// dot(row[0:K], x[0:K]) over one warp; x lives in shared memory. Every lane gets the result.
template <int K>
__device__ __forceinline__ float row_dot(const bf16* __restrict__ row, const float* __restrict__ x, int lane) {
  static_assert(K % 8 == 0, "rows are read in 16-byte pieces");
  constexpr int CHUNKS = K / 8;
  float acc = 0.f;
#pragma unroll 4
  for (int c = lane; c < CHUNKS; c += 32) acc += dot8(load_weights16(row + (size_t)c * 8), x + c * 8);
  return warp_sum(acc);
}

// Rows [0, ROWS) of a matvec for every sequence of the batch: xs holds the sequences' vectors (BATCH of K floats),
// row(r) gives row r's weights, and store(r, seq, dot) is called once per row and sequence. One sequence: rows
// strided over every warp of the grid, lane 0 storing; a batch: on tensor cores (mma_matvec).
template <int K, int ROWS, typename RowFn, typename StoreFn>
__device__ __forceinline__ void grid_matvec(RowFn row, const float* xs, StoreFn store) {
  if constexpr (BATCH > 1) {
    mma_matvec<K, ROWS>(row, xs, store);
  } else {
    const int lane = threadIdx.x & 31;
    for (int r = grid_warp(); r < ROWS; r += GRID_WARPS) {
      const float d = row_dot<K>(row(r), xs, lane);
      if (lane == 0) store(r, 0, d);
    }
  }
}

// Copy BATCH fp32 activation vectors of N floats, written by other blocks, into shared memory.
template <int N>
__device__ __forceinline__ void vector_to_smem(const float* src, float* dst) {
  // a group's loads in flight at once (a loop storing each into shared memory kept them one at a time: the store
  // might alias src); groups of 4 (8 made some configs spill)
  constexpr int PER_THREAD = (BATCH * N + THREADS - 1) / THREADS, GROUP = PER_THREAD < 4 ? PER_THREAD : 4;
  for (int k0 = 0; k0 < PER_THREAD; k0 += GROUP) {
    float v[GROUP];
#pragma unroll
    for (int k = 0; k < GROUP; ++k)
      if (threadIdx.x + (k0 + k) * THREADS < BATCH * N) v[k] = load_state_now(src + threadIdx.x + (k0 + k) * THREADS);
#pragma unroll
    for (int k = 0; k < GROUP; ++k)
      if (threadIdx.x + (k0 + k) * THREADS < BATCH * N) dst[threadIdx.x + (k0 + k) * THREADS] = v[k];
  }
  block_sync();
}

// A sublayer's input in shared memory: x RMSNormed with w (NORMED), or x itself (olmo2/3's layers have no input norms).
template <bool NORMED>
__device__ __forceinline__ void sublayer_input_to_smem(const float* x, const bf16* w, float* out, float* scratch) {
  if constexpr (NORMED) rmsnorm_to_smem<H>(x, w, out, scratch);
  else vector_to_smem<H>(x, out);
}

// What a sublayer's output adds to the residual stream: granite scales it by residual_multiplier.
__device__ __forceinline__ float sublayer(float d) {
  if constexpr (HAS_RESIDUAL_MULTIPLIER) return d * RESIDUAL_MULTIPLIER;
  else return d;
}

// Post-norm layers: a sublayer's matvec leaves its output alone in p.sub, which the next phase normalises and adds
// to the residual stream after a grid barrier (the norm needs the whole output).
__device__ __forceinline__ float* sublayer_dst(const Params& p) {
  if constexpr (POST_NORMS) return p.sub;
  else return p.x;
}
// What residual_matvec stores for a row: the residual before plus the sublayer's product, or the product alone.
__device__ __forceinline__ float residual_plus(float before, float d) { return POST_NORMS ? d : before + sublayer(d); }

// A one-sequence matvec by blocks (LaunchPlan.block_rows: where rows strided over the grid's warps would leave some
// warps a row more than others, or idle): block b takes rows [b * ROWS / GRID, (b + 1) * ROWS / GRID), an even share
// of the bytes on every SM. Its warps are SLICES k slices times GROUPS row groups; a warp reads UNROLL of its rows at
// once (up to 4 loads in flight a lane, as row_dot: 8 spilled gemma-3-1b's build), and each row's slices are added in
// slice order by one thread (the same bits run after run). The partial sums go to shared memory at byte
// BLOCK_ROWS_AT (after the staged norm weights).
template <int K, int ROWS>
struct BlockRows {
  static constexpr int CHUNKS = K / 8;  // 16-byte pieces of a row; a slice has at least one a lane
  static constexpr int slices() {
    for (int s = 16; s > 1; s /= 2)
      if (CHUNKS >= 32 * s && CHUNKS % s == 0 && WARPS % s == 0) return s;
    return 1;
  }
  static constexpr int SLICES = slices();  // launch_plan.block_rows_layout
  static constexpr int GROUPS = WARPS / SLICES;
  static constexpr int SLICE_CHUNKS = CHUNKS / SLICES;
  static constexpr int LOADS = (SLICE_CHUNKS + 31) / 32;  // a lane's loads of one row
  static constexpr int UNROLL = LOADS >= 4 ? 1 : 4 / LOADS;
  static constexpr int MAX_ROWS = (ROWS + GRID - 1) / GRID;  // a block's rows
  static_assert(CHUNKS % SLICES == 0 && WARPS % SLICES == 0, "whole slices");
  static_assert(MAX_ROWS <= THREADS, "a thread adds a row's slices");
  __device__ static int first() { return blockIdx.x * ROWS / GRID; }  // this block's first row
  __device__ static int count() { return (blockIdx.x + 1) * ROWS / GRID - first(); }  // and its rows
};

__device__ __forceinline__ float* block_rows_partials() {
  extern __shared__ __align__(16) float smem_base[];
  return reinterpret_cast<float*>(reinterpret_cast<char*>(smem_base) + BLOCK_ROWS_AT);
}

// store(r, sum) once for each of the block's rows r.
template <int K, int ROWS, typename StoreFn>
__device__ __forceinline__ void block_rows_matvec(const bf16* __restrict__ w, const float* __restrict__ xs,
                                                  StoreFn store) {
  using BR = BlockRows<K, ROWS>;
  static_assert(BLOCK_ROWS_AT > 0 && BLOCK_ROWS_AT + 4 * BR::SLICES * BR::MAX_ROWS <= SMEM_BYTES,
                "launch_plan.with_block_rows places the partial sums (its block_rows_layout is BlockRows')");
  float* part = block_rows_partials();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp / BR::SLICES, slice = warp % BR::SLICES;
  const int first = BR::first(), rows = BR::count();
  const int c0 = slice * BR::SLICE_CHUNKS;
  for (int i0 = group; i0 < rows; i0 += BR::GROUPS * BR::UNROLL) {
    uint4 wv[BR::UNROLL][BR::LOADS];
#pragma unroll
    for (int u = 0; u < BR::UNROLL; ++u) {
      const int i = i0 + u * BR::GROUPS;
#pragma unroll
      for (int l = 0; l < BR::LOADS; ++l)
        if (i < rows && lane + 32 * l < BR::SLICE_CHUNKS)
          wv[u][l] = load_weights16(w + (size_t)(first + i) * K + (c0 + lane + 32 * l) * 8);
    }
#pragma unroll
    for (int u = 0; u < BR::UNROLL; ++u) {
      const int i = i0 + u * BR::GROUPS;
      float acc = 0.f;
#pragma unroll
      for (int l = 0; l < BR::LOADS; ++l)
        if (i < rows && lane + 32 * l < BR::SLICE_CHUNKS) acc += dot8(wv[u][l], xs + (c0 + lane + 32 * l) * 8);
      acc = warp_sum(acc);
      if (lane == 0 && i < rows) part[slice * BR::MAX_ROWS + i] = acc;
    }
  }
  block_sync();
  if (threadIdx.x < rows) {
    float sum = part[threadIdx.x];
#pragma unroll
    for (int s = 1; s < BR::SLICES; ++s) sum += part[s * BR::MAX_ROWS + threadIdx.x];
    store(first + threadIdx.x, sum);
  }
}

// x[r] += W[r] . xs for every row r, for each sequence (x and the trace hold the sequences H and TRACE_TOTAL
// floats apart); x is sublayer_dst: post-norm layers store x[r] = W[r] . xs there and trace nothing. One sequence: xs in shared memory, and x[r] read before the row's weights (read after its
// sum, it was one more memory round trip before the next grid barrier); with SPLIT > 1 (fewer rows than warps)
// SPLIT warps of one block share a row, each taking K / SPLIT, and the first adds the parts in a fixed order: no
// atomics, so the result is the same on every run. A batch: xs are the sequences' vectors in global memory,
// XSTRIDE floats apart, read by the tensor-core matvec as it goes (a block would otherwise copy B * K floats
// before its first weight load, as many bytes as its weight tile at batch 8); it splits k its own way. GLOBAL_X false:
// a batch's xs are in shared memory (a block's own, as a linear layer's gated norm leaves them).
// BY_BLOCKS (batch 1): block_rows_matvec, the residual read by the thread that adds the row.
template <int K, int ROWS, int SPLIT, int XSTRIDE, bool GLOBAL_X = true, bool BY_BLOCKS = false>
__device__ void residual_matvec(const bf16* __restrict__ w, const float* xs, float* x, float* trace_dst) {
  const auto store = [&](int r, int b, float v) {  // v: residual_plus(the residual before, the product)
    x[b * H + r] = v;
#if MK_TRACE
    if constexpr (!POST_NORMS) trace_dst[(size_t)b * TRACE_TOTAL + r] = v;  // the next phase traces the residual (post_norm.cuh)
#endif
  };
  const int lane = threadIdx.x & 31;
  if constexpr (BATCH > 1) {
    mma_matvec<K, ROWS, false, XSTRIDE, GLOBAL_X>([&](int r) { return w + (size_t)r * K; }, xs,
                                              [&](int r, int b, float d) { store(r, b, residual_plus(POST_NORMS ? 0.f : load_shared_state(x + b * H + r), d)); });
  } else if constexpr (BY_BLOCKS) {
    const int first = BlockRows<K, ROWS>::first(), rows = BlockRows<K, ROWS>::count();
    // the residual before, loaded now: after the sums it would be one more round trip before the grid barrier
    const float before = threadIdx.x < rows && !POST_NORMS ? load_state_now(x + first + threadIdx.x) : 0.f;
    block_rows_matvec<K, ROWS>(w, xs, [&](int r, float d) { store(r, 0, residual_plus(before, d)); });
  } else if constexpr (SPLIT == 1) {
    for (int r = grid_warp(); r < ROWS; r += GRID_WARPS) {
      const float before = lane == 0 && !POST_NORMS ? load_state_now(x + r) : 0.f;
      const float d = row_dot<K>(w + (size_t)r * K, xs, lane);
      if (lane == 0) store(r, 0, residual_plus(before, d));
    }
  } else {
    static_assert(ROWS * SPLIT <= GRID_WARPS && WARPS % SPLIT == 0 && (K / SPLIT) % 8 == 0, "split-K layout");
    constexpr int KP = K / SPLIT;
    __shared__ float part[WARPS];
    const int warp = threadIdx.x >> 5, item = grid_warp(), r = item / SPLIT, s = item % SPLIT;
    const bool adds = r < ROWS && s == 0 && lane == 0;
    const float before = adds && !POST_NORMS ? load_state_now(x + r) : 0.f;
    float d = 0.f;
    if (r < ROWS) d = row_dot<KP>(w + (size_t)r * K + s * KP, xs + s * KP, lane);
    if (lane == 0) part[warp] = d;
    block_sync();
    if (adds) {
      float sum = part[warp];
#pragma unroll
      for (int t = 1; t < SPLIT; ++t) sum += part[warp + t];
      store(r, 0, residual_plus(before, sum));
    }
  }
}
