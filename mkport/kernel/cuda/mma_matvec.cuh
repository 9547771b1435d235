// Matrix-vector products of a batch (BATCH > 1) on tensor cores: a warp applies a tile of 16 weight rows to every
// sequence's vector with mma.sync m16n8k16 (bf16 inputs, fp32 accumulation), so a weight is read once and costs a
// fraction of an instruction whatever the batch. Each fp32 input is split into two bf16 (hi + lo, ~16 bits of
// mantissa): a product moves by ~1e-5 relative against the fp32 CUDA-core path that batch 1 takes.
#pragma once

constexpr int MMA_ROWS = 16;                   // weight rows a warp's tile covers
constexpr int MMA_K = 32;                      // k a step: two m16n8k16 products
constexpr int MMA_NTILES = (BATCH + 7) / 8;    // n8 tiles: sequences 8j .. 8j + 7
constexpr int MMA_PART_COLS = MMA_PART_FLOATS / MMA_ROWS;  // a partial tile's row: a column a sequence (16, 24 or 32)
constexpr int MMA_STORERS = THREADS - THREADS % BATCH;  // threads that store a matvec's outputs, BATCH's multiple
static_assert(MMA_PART_COLS >= 8 * MMA_NTILES, "launch_plan.mma_part_floats sizes the partial tiles");

// K slices of a row tile, each taken by one warp of the same block: doubled while the tiles still fit the grid's
// warps, so that small matrices keep every warp streaming.
__host__ __device__ constexpr int mma_slices(int rows, int k) {
  int s = 1;
  while (s * 2 <= WARPS && ((rows + MMA_ROWS - 1) / MMA_ROWS) * s * 2 <= GRID_WARPS && k % (s * 2 * MMA_K) == 0) s *= 2;
  return s;
}

__device__ __forceinline__ unsigned bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<unsigned*>(&v); }

// (a, b) as hi + lo pairs of bf16, the lower k in the low half, as mma's fragments hold them.
__device__ __forceinline__ void split_bf16x2(float a, float b, unsigned& hi, unsigned& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float2 hf = __bfloat1622float2(h);
  hi = bf16x2_bits(h);
  lo = bf16x2_bits(__floats2bfloat162_rn(a - hf.x, b - hf.y));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint4& w_top, const uint4& w_bottom, bool second,
                                         unsigned b0, unsigned b1) {
  const unsigned a0 = second ? w_top.z : w_top.x, a1 = second ? w_bottom.z : w_bottom.x;
  const unsigned a2 = second ? w_top.w : w_top.y, a3 = second ? w_bottom.w : w_bottom.y;
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide k step of a 16-row tile with one n8 tile's input: this lane's 8 inputs (x0, x1) split into hi + lo bf16,
// each half through the tensor cores against the rows' weights (w_top, w_bottom: this lane's 16 bytes of each).
__device__ __forceinline__ void mma_k32(float (&acc)[4], const uint4& wt, const uint4& wb, const float4& x0,
                                        const float4& x1) {
  unsigned h0, l0, h1, l1, h2, l2, h3, l3;
  split_bf16x2(x0.x, x0.y, h0, l0);
  split_bf16x2(x0.z, x0.w, h1, l1);
  split_bf16x2(x1.x, x1.y, h2, l2);
  split_bf16x2(x1.z, x1.w, h3, l3);
  mma_bf16(acc, wt, wb, false, h0, h1);
  mma_bf16(acc, wt, wb, false, l0, l1);
  mma_bf16(acc, wt, wb, true, h2, h3);
  mma_bf16(acc, wt, wb, true, l2, l3);
}

// Four floats of an input vector: from shared memory, or (GLOBAL_X) from global memory written by other blocks
// before the last grid barrier, through L2 (load_shared_state's reason).
template <bool GLOBAL_X>
__device__ __forceinline__ float4 load_x4(const float* x) {
  if constexpr (GLOBAL_X) return __ldcg(reinterpret_cast<const float4*>(x));
  else return *reinterpret_cast<const float4*>(x);
}

// Partial dot products of rows r0 .. r0 + 15 over k in [k0, k1) with the BATCH vectors of xs (XSTRIDE floats apart).
// k is permuted inside each 32-wide step, the same way for weights and vectors, so that lane (g, t) reads 16
// contiguous bytes of rows r0 + g and r0 + g + 8: logical k 8t .. 8t + 3 go to the first product's slots of
// thread t, 8t + 4 .. 8t + 7 to the second's. acc[j] ends as the m16n8 tile of sequences 8j .. 8j + 7.
template <int K, int ROWS, int XSTRIDE, bool GLOBAL_X, typename RowFn>
__device__ __forceinline__ void mma_tile(RowFn row, int r0, int k0, int k1, const float* xs, float (&acc)[MMA_NTILES][4]) {
  const int lane = thread_index() & 31, g = lane >> 2, t = lane & 3;
  const bool top = r0 + g < ROWS, bottom = r0 + g + 8 < ROWS;
  const bf16* w_top = row(top ? r0 + g : 0) + 8 * t;
  const bf16* w_bottom = row(bottom ? r0 + g + 8 : 0) + 8 * t;
#pragma unroll
  for (int j = 0; j < MMA_NTILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll (GLOBAL_X ? 2 : 4)
  for (int kb = k0; kb < k1; kb += MMA_K) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const uint4 wt = top ? load_weights16(w_top + kb) : zero, wb = bottom ? load_weights16(w_bottom + kb) : zero;
#pragma unroll
    for (int j = 0; j < MMA_NTILES; ++j) {
      const int seq = 8 * j + g;
      float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
      if (seq < BATCH) {
        x0 = load_x4<GLOBAL_X>(xs + (size_t)seq * XSTRIDE + kb + 8 * t);
        x1 = load_x4<GLOBAL_X>(xs + (size_t)seq * XSTRIDE + kb + 8 * t + 4);
      }
      mma_k32(acc[j], wt, wb, x0, x1);
    }
  }
}

// A warp's partial tile into shared memory ([16 rows][MMA_PART_COLS], a column a sequence).
__device__ __forceinline__ void store_part(float* mine, const float (&acc)[MMA_NTILES][4], int g, int t) {
#pragma unroll
  for (int j = 0; j < MMA_NTILES; ++j) {
    mine[g * MMA_PART_COLS + 8 * j + 2 * t] = acc[j][0];
    mine[g * MMA_PART_COLS + 8 * j + 2 * t + 1] = acc[j][1];
    mine[(g + 8) * MMA_PART_COLS + 8 * j + 2 * t] = acc[j][2];
    mine[(g + 8) * MMA_PART_COLS + 8 * j + 2 * t + 1] = acc[j][3];
  }
}

// Rows [0, ROWS) for every sequence: tiles of 16 rows, each split over mma_slices warps of one block by k; the
// slices' partial tiles meet in shared memory (at MMA_PART_AT, after the BATCH vectors) and are added in slice
// order, so the result is the same on every run. store(r, seq, value) is called once per row and sequence, by a
// thread whose index is seq modulo BATCH among the first MMA_STORERS (all unless BATCH does not divide THREADS: 24),
// so that a thread keeps one sequence's outputs. With PAIRS, a tile's rows 8..15 pair with its rows 0..7 (row(r)
// lays them out so): store(pair, seq, top, bottom) is called once per pair, tile t holding pairs 8t .. 8t + 7.
// xs: the vectors in shared memory (K floats apart), or with GLOBAL_X in global memory, XSTRIDE floats apart:
// each warp then reads its own k slice as it goes, with no block-wide copy before the first weight load.
template <int K, int ROWS, bool PAIRS = false, int XSTRIDE = K, bool GLOBAL_X = false, typename RowFn, typename StoreFn>
__device__ void mma_matvec(RowFn row, const float* xs, StoreFn store) {
  static_assert(K % MMA_K == 0, "the batched matvec takes k in steps of 32");
  static_assert(!PAIRS || ROWS % MMA_ROWS == 0, "pairs fill whole tiles");
  constexpr int S = mma_slices(ROWS, K), TILES_A_BLOCK = WARPS / S, KS = K / S;
  constexpr int TILES = (ROWS + MMA_ROWS - 1) / MMA_ROWS;
  constexpr int OUTS = PAIRS ? MMA_ROWS / 2 : MMA_ROWS;  // outputs a tile: its rows, or its pairs of rows
  extern __shared__ __align__(16) float smem_base[];
  float* part = smem_base + MMA_PART_AT;
  const int warp = thread_index() >> 5, lane = thread_index() & 31, g = lane >> 2, t = lane & 3;
  for (int first = blockIdx.x * TILES_A_BLOCK; first < TILES; first += GRID * TILES_A_BLOCK) {  // the same rounds in every warp
    const int tile = first + warp / S, slice = warp % S;
    float acc[MMA_NTILES][4];
    if (tile < TILES) {
      mma_tile<K, ROWS, XSTRIDE, GLOBAL_X>(row, tile * MMA_ROWS, slice * KS, (slice + 1) * KS, xs, acc);
      store_part(part + warp * MMA_PART_FLOATS, acc, g, t);
    }
    block_sync();
    const bool stores = MMA_STORERS == THREADS || thread_index() < MMA_STORERS;
    for (int o = thread_index(); stores && o < TILES_A_BLOCK * OUTS * BATCH; o += MMA_STORERS) {
      const int seq = o % BATCH, out = (o / BATCH) % OUTS, tile_in = o / (BATCH * OUTS);
      const float* tile_part = part + tile_in * S * MMA_PART_FLOATS;
      const auto row_sum = [&](int r_in) {
        float v = 0.f;
#pragma unroll
        for (int s = 0; s < S; ++s) v += tile_part[s * MMA_PART_FLOATS + r_in * MMA_PART_COLS + seq];
        return v;
      };
      if (first + tile_in >= TILES) continue;
      if constexpr (PAIRS) {
        store((first + tile_in) * OUTS + out, seq, row_sum(out), row_sum(out + OUTS));
      } else {
        const int r = (first + tile_in) * MMA_ROWS + out;
        if (r < ROWS) store(r, seq, row_sum(out));
      }
    }
    block_sync();
  }
}
