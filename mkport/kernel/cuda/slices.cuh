// What batch 1's slices share (moe_slices.cuh's experts, mlp_slices.cuh's dense MLP: an MLP's intermediate columns cut
// into slices, a block a slice, gate/up and down in one phase): a slice's partial down rows, their sum after the grid
// barrier, and a plan variant on top (LaunchPlan.slice_ring_at, MK_SLICE_RING): a slice's gate rows, then its up
// rows, come in chunks of whole rows by bulk copies (the copy engine: thread 0 issues one instruction a chunk) into a
// ring of SLICE_RING_STAGES chunks, each completing on its own mbarrier, so that a block keeps up to the ring's bytes
// in flight instead of its warps' four loads a lane. Each warp takes 1024 weights of a chunk (a row's span), the spans
// of a row are added in order after the last chunk.
#pragma once

// A slice's partial down rows: its `width` columns (SLICE at most) of each of down's H rows (`down`: the slice's first
// column of row 0, rows `row_stride` apart) against its act in shared memory, stored in `out` (H floats). ROW_LANES
// lanes a row, a 16-byte piece each (the slice's columns of a row are contiguous), added by a shuffle tree among them.
template <int SLICE>
__device__ __forceinline__ void slice_down_partials(const bf16* down, int row_stride, int width, const float* act, float* out) {
  constexpr int PIECES = SLICE / 8;
  constexpr int ROW_LANES = PIECES <= 4 ? 4 : PIECES <= 8 ? 8 : PIECES <= 16 ? 16 : 32;
  constexpr int ROWS_AT_ONCE = THREADS / ROW_LANES;  // down rows a block reads at once
  static_assert(SLICE % 8 == 0 && PIECES <= 32, "a down row's slice: whole 16-byte pieces, a lane each");
  static_assert(H % ROWS_AT_ONCE == 0, "every lane of a warp takes every round of down rows (their sums shuffle)");
  const int piece = (threadIdx.x & 31) % ROW_LANES;
  const bool reads = piece * 8 < width;
#pragma unroll 4
  for (int r = threadIdx.x / ROW_LANES; r < H; r += ROWS_AT_ONCE) {
    float d = reads ? dot8(load_weights16(down + (size_t)r * row_stride + piece * 8), act + piece * 8) : 0.f;
#pragma unroll
    for (int o = ROW_LANES / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (piece == 0) out[r] = d;
  }
}

// Row r's sum of SLICES partials (`partials`: slice 0's H floats, then slice 1's, ...) over a warp: each lane its
// slices in order, then the warp's tree, the same order every step. Every lane gets the sum.
template <int SLICES>
__device__ __forceinline__ float slices_sum(const float* partials, int r, int lane) {
  constexpr int PER_LANE = (SLICES + 31) / 32;
  float part[PER_LANE];
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const int s = lane + 32 * k;
    part[k] = s < SLICES ? load_state_now(partials + (size_t)s * H + r) : 0.f;
  }
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) acc += part[k];
  return warp_sum(acc);
}

#ifdef MK_SLICE_RING
constexpr int CHUNK_ROWS = SLICE_RING_CHUNK / 2 / H;
constexpr int WARPS_A_ROW = WARPS / CHUNK_ROWS;
static_assert(BATCH == 1, "a slice's rows against one normed input");
static_assert(CHUNK_ROWS * H * 2 == SLICE_RING_CHUNK && WARPS % CHUNK_ROWS == 0 && H / WARPS_A_ROW == 1024,
              "a chunk: whole rows, 1024 weights a warp");
constexpr int SLICE_RING_END = SLICE_RING_AT + SLICE_RING_STAGES * (SLICE_RING_CHUNK + 8);  // the chunks, their mbarriers
static_assert(SLICE_RING_AT % 128 == 0 && SLICE_RING_END <= SMEM_BYTES,
              "the ring and its mbarriers inside the block's dynamic shared memory");
static_assert(SLICE_RING_AT >= 4 * SLICE_PHASE_FLOATS &&
                  (SLICE_RING_END <= NORM_WEIGHTS_AT || SLICE_RING_AT >= NORM_WEIGHTS_AT + 2 * H),
              "the ring clear of what the MLP phase keeps and of the next norm's staged weights");

// Shared memory a slice of `slice` columns takes from the block's vectors: the normed input, its gate and up values,
// its act, then its rows' spans
constexpr int slice_ring_floats(int slice) { return H + 3 * slice + 2 * slice * WARPS_A_ROW; }

__device__ __forceinline__ unsigned smem_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// One chunk of `rows` rows from `src` into `dst`, completing on `bar` (which expects its bytes).
__device__ __forceinline__ void bulk_rows(void* dst, const bf16* src, int rows, uint64_t* bar) {
  const unsigned bytes = rows * H * 2;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the generic reads of this stage came first
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar)) : "memory");
}

// Waits for `bar`'s phase `parity` to complete; a copy that never lands stops the kernel (a trap) instead of hanging it.
__device__ __forceinline__ void wait_chunk(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  for (long spins = 0; !done; ++spins) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_address(bar)), "r"(parity) : "memory");
    if (spins > (1l << 24)) __trap();
  }
}

// A slice's gate values then up values (gate_up[0, 2 * width)) against the normed input at smem[0, H): `width` rows
// of H from `gate`, then as many from `up`. The spans go after the slice's act (`slice` columns wide, its widest).
__device__ void slice_rows_from_ring(const bf16* gate, const bf16* up, int width, int slice, float* smem, float* gate_up) {
  unsigned char* ring = reinterpret_cast<unsigned char*>(smem) + SLICE_RING_AT;
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring + SLICE_RING_STAGES * SLICE_RING_CHUNK);
  float* spans = gate_up + 3 * slice;  // a row's spans, WARPS_A_ROW a row
  const int per_matrix = (width + CHUNK_ROWS - 1) / CHUNK_ROWS, chunks = 2 * per_matrix;
  const auto rows_of = [&](int c) { return min(CHUNK_ROWS, width - (c % per_matrix) * CHUNK_ROWS); };
  const auto source = [&](int c) { return (c < per_matrix ? gate : up) + (size_t)(c % per_matrix) * CHUNK_ROWS * H; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < SLICE_RING_STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(bars + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int c = 0; c < chunks && c < SLICE_RING_STAGES; ++c)
      bulk_rows(ring + c * SLICE_RING_CHUNK, source(c), rows_of(c), bars + c);
  }
  block_sync();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_in_chunk = warp / WARPS_A_ROW, span = warp % WARPS_A_ROW;
  for (int c = 0; c < chunks; ++c) {
    const int stage = c % SLICE_RING_STAGES;
    wait_chunk(bars + stage, (c / SLICE_RING_STAGES) & 1);
    if (row_in_chunk < rows_of(c)) {
      const bf16* w = reinterpret_cast<const bf16*>(ring + stage * SLICE_RING_CHUNK) + row_in_chunk * H + span * 1024;
      const float* x = smem + span * 1024;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int at = (lane + 32 * k) * 8;
        acc += dot8(*reinterpret_cast<const uint4*>(w + at), x + at);
      }
      acc = warp_sum(acc);
      const int row = (c / per_matrix) * width + (c % per_matrix) * CHUNK_ROWS + row_in_chunk;  // gate, then up
      if (lane == 0) spans[row * WARPS_A_ROW + span] = acc;
    }
    block_sync();  // every warp is done with this stage: it takes the chunk STAGES on
    if (threadIdx.x == 0 && c + SLICE_RING_STAGES < chunks)
      bulk_rows(ring + stage * SLICE_RING_CHUNK, source(c + SLICE_RING_STAGES), rows_of(c + SLICE_RING_STAGES),
                bars + stage);
  }
  if (threadIdx.x == 0)
    for (int s = 0; s < SLICE_RING_STAGES; ++s)
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_address(bars + s)) : "memory");
  for (int i = threadIdx.x; i < 2 * width; i += THREADS) {
    float d = 0.f;
    for (int s = 0; s < WARPS_A_ROW; ++s) d += spans[i * WARPS_A_ROW + s];
    gate_up[i] = d;
  }
}
#endif

// A slice's gate values then up values (gate_up[0, 2 * width)) against the normed input at smem[0, H): `width` rows
// of H from `gate`, then as many from `up`; by the ring where the plan has one, else a row a warp. `slice`: the
// widest slice's columns (the ring's spans go after its act).
__device__ __forceinline__ void slice_rows(const bf16* gate, const bf16* up, int width, int slice, float* smem, float* gate_up) {
#ifdef MK_SLICE_RING
  slice_rows_from_ring(gate, up, width, slice, smem, gate_up);
#else
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < 2 * width; i += WARPS) {
    const float d = row_dot<H>((i < width ? gate : up) + (size_t)(i % width) * H, smem, lane);
    if (lane == 0) gate_up[i] = d;
  }
#endif
}
