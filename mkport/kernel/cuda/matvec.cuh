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

// A plan variant (LaunchPlan.tail_split, MK_TAIL_SPLIT), batch 1: whole rounds of a row a warp, as strided; then the
// last round's rows, where no more than the grid's warp pairs (the strided path leaves them to one warp each, the rest
// of the grid idle), each split in k over a warp pair of one block and spread over the blocks. STRIDED_ROWS: the rows
// read a row a warp (all of them, where the last round is not split); the last round's row of a pair is
// STRIDED_ROWS + pair * GRID + block.
#ifdef MK_TAIL_SPLIT
constexpr bool TAIL_SPLIT = true;
#else
constexpr bool TAIL_SPLIT = false;
#endif
template <int K, int ROWS>
constexpr bool TAIL_SPLITS = TAIL_SPLIT && BATCH == 1 && ROWS > GRID_WARPS && ROWS % GRID_WARPS != 0 &&
                             ROWS % GRID_WARPS <= GRID * (WARPS / 2) && K % 16 == 0;
template <int K, int ROWS>
constexpr int STRIDED_ROWS = TAIL_SPLITS<K, ROWS> ? ROWS / GRID_WARPS * GRID_WARPS : ROWS;

__device__ __forceinline__ int tail_row(int strided) {
  return strided + ((threadIdx.x >> 5) >> 1) * GRID + blockIdx.x;
}

// The dot product of this pair's row `row` (r < ROWS, else 0): each warp of the pair reads half of k; after one
// block barrier every warp holds the pair's sum, its halves added in a fixed order.
template <int K, int ROWS>
__device__ __forceinline__ float tail_pair_dot(const bf16* __restrict__ row, const float* xs, int r, int lane) {
  __shared__ float half_sum[WARPS];
  const int warp = threadIdx.x >> 5, half = warp & 1;
  const float d = r < ROWS ? row_dot<K / 2>(row + half * (K / 2), xs + half * (K / 2), lane) : 0.f;
  if (lane == 0) half_sum[warp] = d;
  block_sync();
  return half_sum[warp & ~1] + half_sum[warp | 1];
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
    for (int r = grid_warp(); r < STRIDED_ROWS<K, ROWS>; r += GRID_WARPS) {
      const float d = row_dot<K>(row(r), xs, lane);
      if (lane == 0) store(r, 0, d);
    }
    if constexpr (TAIL_SPLITS<K, ROWS>) {
      const int r = tail_row(STRIDED_ROWS<K, ROWS>);
      const float d = tail_pair_dot<K, ROWS>(r < ROWS ? row(r) : nullptr, xs, r, lane);
      if (r < ROWS && (threadIdx.x >> 5) % 2 == 0 && lane == 0) store(r, 0, d);  // rows still in increasing order
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

// x[r] += W[r] . xs for every row r, for each sequence (x and the trace hold the sequences H and TRACE_TOTAL
// floats apart); x is sublayer_dst: post-norm layers store x[r] = W[r] . xs there and trace nothing. One sequence: xs in shared memory, and x[r] read before the row's weights (read after its
// sum, it was one more memory round trip before the next grid barrier); with SPLIT > 1 (fewer rows than warps)
// SPLIT warps of one block share a row, each taking K / SPLIT, and the first adds the parts in a fixed order: no
// atomics, so the result is the same on every run. A batch: xs are the sequences' vectors in global memory,
// XSTRIDE floats apart, read by the tensor-core matvec as it goes (a block would otherwise copy B * K floats
// before its first weight load, as many bytes as its weight tile at batch 8); it splits k its own way. GLOBAL_X false:
// a batch's xs are in shared memory (a block's own, as a linear layer's gated norm leaves them).
template <int K, int ROWS, int SPLIT, int XSTRIDE, bool GLOBAL_X = true>
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
  } else if constexpr (SPLIT == 1) {
    for (int r = grid_warp(); r < STRIDED_ROWS<K, ROWS>; r += GRID_WARPS) {
      const float before = lane == 0 && !POST_NORMS ? load_state_now(x + r) : 0.f;
      const float d = row_dot<K>(w + (size_t)r * K, xs, lane);
      if (lane == 0) store(r, 0, residual_plus(before, d));
    }
    if constexpr (TAIL_SPLITS<K, ROWS>) {  // the last round split over warp pairs (above)
      const int r = tail_row(STRIDED_ROWS<K, ROWS>);
      const bool adds = r < ROWS && (threadIdx.x >> 5) % 2 == 0 && lane == 0;
      const float before = adds && !POST_NORMS ? load_state_now(x + r) : 0.f;
      const float d = tail_pair_dot<K, ROWS>(w + (size_t)r * K, xs, r, lane);
      if (adds) store(r, 0, residual_plus(before, d));
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
