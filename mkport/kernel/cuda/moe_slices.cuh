// Mixture of experts at batch 1, a plan variant (LaunchPlan.expert_slice, MK_EXPERT_SLICES): a sparse layer's gate/up
// and down in one phase, with no grid barrier and no act read back from global memory between them. The chosen
// experts' intermediate columns, then the shared expert's, are cut into slices of EXPERT_SLICE; block b takes slice b:
// the slice's gate and up rows against the normed input (the router phase's, still in shared memory), its
// weight * act(gate) * up kept in shared memory, then the slice's columns of every down row, a partial H-vector stored
// in the slice's own place (after moe.cuh's act layout). A shared expert's slices take its gate and up rows from the
// router phase. After a grid barrier each output row adds its slices' partials in slice order to the residual: the
// same inputs give the same bits (moe.cuh's down adds the same terms in another order: float32 rounding apart).
#pragma once

#ifdef MK_EXPERT_SLICES
constexpr int EXPERT_PARTS = (EXPERT_I + EXPERT_SLICE - 1) / EXPERT_SLICE;  // slices a chosen expert
constexpr int SHARED_PARTS = (SHARED_I + EXPERT_SLICE - 1) / EXPERT_SLICE;  // the shared expert's (0: none)
constexpr int EXPERT_SLICES = TOP_K * EXPERT_PARTS + SHARED_PARTS;
constexpr int PARTIALS_AT = SHARED_AT + (SHARED_I > 0 ? 2 * SHARED_I + 1 : 0);  // in act (launch_plan.moe_act_floats)
constexpr int SLICE_PIECES = EXPERT_SLICE / 8;  // 16-byte pieces of a down row's slice, a lane each
constexpr int ROW_LANES = SLICE_PIECES <= 4 ? 4 : SLICE_PIECES <= 8 ? 8 : SLICE_PIECES <= 16 ? 16 : 32;
constexpr int ROWS_AT_ONCE = THREADS / ROW_LANES;  // down rows a block reads at once
static_assert(BATCH == 1, "a batch reads the union of its experts (moe_batch.cuh)");
static_assert(EXPERT_SLICE % 8 == 0 && SLICE_PIECES <= 32, "a down row's slice: whole 16-byte pieces, a lane each");
static_assert(EXPERT_SLICES <= GRID, "a block a slice");
static_assert(H + 3 * EXPERT_SLICE <= MOE_SM, "the normed input, the slice's gate and up values, then its act");
static_assert(H % ROWS_AT_ONCE == 0, "every lane of a warp takes every round of down rows (their sums shuffle)");
static_assert(MOE_ACT >= PARTIALS_AT + EXPERT_SLICES * H, "each slice's partial down rows after the act layout");

#ifdef MK_EXPERT_RING
// A plan variant on top (LaunchPlan.expert_ring_at, MK_EXPERT_RING): a slice's gate rows, then its up rows, come in
// chunks of whole rows by bulk copies (the copy engine: thread 0 issues one instruction a chunk) into a ring of
// EXPERT_RING_STAGES chunks, each completing on its own mbarrier, so that a block keeps up to the ring's bytes in flight
// instead of its warps' four loads a lane. Each warp takes 1024 weights of a chunk (a row's span), the spans of a row
// are added in order after the last chunk.
constexpr int CHUNK_ROWS = EXPERT_RING_CHUNK / 2 / H;
constexpr int WARPS_A_ROW = WARPS / CHUNK_ROWS;
static_assert(CHUNK_ROWS * H * 2 == EXPERT_RING_CHUNK && WARPS % CHUNK_ROWS == 0 && H / WARPS_A_ROW == 1024,
              "a chunk: whole rows, 1024 weights a warp");
static_assert(H + 3 * EXPERT_SLICE + 2 * EXPERT_SLICE * WARPS_A_ROW <= MOE_SM, "the rows' spans after the act");
static_assert(EXPERT_RING_AT % 128 == 0 && EXPERT_RING_AT + EXPERT_RING_STAGES * (EXPERT_RING_CHUNK + 8) <= SMEM_BYTES,
              "the ring and its mbarriers inside the block's dynamic shared memory");

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

// The slice's gate values then up values (gate_up[0, 2 * width)) of `expert` from its rows col0 .. col0 + width.
__device__ void slice_rows_from_ring(const LayerWeights& lw, size_t expert, int col0, int width, float* smem,
                                     float* gate_up) {
  unsigned char* ring = reinterpret_cast<unsigned char*>(smem) + EXPERT_RING_AT;
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring + EXPERT_RING_STAGES * EXPERT_RING_CHUNK);
  float* spans = gate_up + 3 * EXPERT_SLICE;  // a row's spans, WARPS_A_ROW a row, after act
  const int per_matrix = (width + CHUNK_ROWS - 1) / CHUNK_ROWS, chunks = 2 * per_matrix;
  const auto rows_of = [&](int c) { return min(CHUNK_ROWS, width - (c % per_matrix) * CHUNK_ROWS); };
  const auto source = [&](int c) {
    return (c < per_matrix ? lw.expert_gate : lw.expert_up) +
           (expert * EXPERT_I + col0 + (c % per_matrix) * CHUNK_ROWS) * H;
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < EXPERT_RING_STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(bars + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int c = 0; c < chunks && c < EXPERT_RING_STAGES; ++c)
      bulk_rows(ring + c * EXPERT_RING_CHUNK, source(c), rows_of(c), bars + c);
  }
  block_sync();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_in_chunk = warp / WARPS_A_ROW, span = warp % WARPS_A_ROW;
  for (int c = 0; c < chunks; ++c) {
    const int stage = c % EXPERT_RING_STAGES;
    wait_chunk(bars + stage, (c / EXPERT_RING_STAGES) & 1);
    if (row_in_chunk < rows_of(c)) {
      const bf16* w = reinterpret_cast<const bf16*>(ring + stage * EXPERT_RING_CHUNK) + row_in_chunk * H + span * 1024;
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
    if (threadIdx.x == 0 && c + EXPERT_RING_STAGES < chunks)
      bulk_rows(ring + stage * EXPERT_RING_CHUNK, source(c + EXPERT_RING_STAGES), rows_of(c + EXPERT_RING_STAGES),
                bars + stage);
  }
  if (threadIdx.x == 0)
    for (int s = 0; s < EXPERT_RING_STAGES; ++s)
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_address(bars + s)) : "memory");
  for (int i = threadIdx.x; i < 2 * width; i += THREADS) {
    float d = 0.f;
    for (int s = 0; s < WARPS_A_ROW; ++s) d += spans[i * WARPS_A_ROW + s];
    gate_up[i] = d;
  }
}
#endif

__device__ void expert_slices_phase(const Params& p, int layer, float* smem) {
  const int slice = blockIdx.x;
  if (slice >= EXPERT_SLICES) return;  // a block without a slice routes nothing either (block 0 traces the routing)
  const LayerWeights& lw = p.layers[layer];
  route(p, layer, smem);
  const bool shared = slice >= TOP_K * EXPERT_PARTS;
  const int part = shared ? slice - TOP_K * EXPERT_PARTS : slice % EXPERT_PARTS;
  const int col0 = part * EXPERT_SLICE;
  const int width = min(EXPERT_SLICE, (shared ? SHARED_I : EXPERT_I) - col0);
  float* gate_up = smem + H;  // the slice's gate rows' values, then its up rows'
  float* act = gate_up + 2 * EXPERT_SLICE;
  const int lane = threadIdx.x & 31;
  const bf16* down;  // the slice's first column of down's row 0
  int row_stride;
  if (!shared) {
    const int slot = slice / EXPERT_PARTS;
    const size_t expert = route_experts(smem)[slot];
#ifdef MK_EXPERT_RING
    slice_rows_from_ring(lw, expert, col0, width, smem, gate_up);
#else
    for (int i = threadIdx.x >> 5; i < 2 * width; i += WARPS) {
      const bf16* w = (i < width ? lw.expert_gate : lw.expert_up) + (expert * EXPERT_I + col0 + i % width) * H;
      const float d = row_dot<H>(w, smem, lane);
      if (lane == 0) gate_up[i] = d;
    }
#endif
    block_sync();
    const float weight = route_weights(smem)[slot];
    for (int j = threadIdx.x; j < width; j += THREADS) act[j] = weight * act_times(gate_up[j], gate_up[width + j]);
    down = lw.expert_down + expert * H * EXPERT_I + col0;
    row_stride = EXPERT_I;
  } else {
    const float gate = sigmoid(load_shared_state(p.act + SHARED_AT + 2 * SHARED_I));
    for (int j = threadIdx.x; j < width; j += THREADS)
      act[j] = gate * act_times(load_shared_state(p.act + SHARED_AT + col0 + j),
                                load_shared_state(p.act + SHARED_AT + SHARED_I + col0 + j));
    down = lw.w_down + col0;
    row_stride = SHARED_I;
  }
  block_sync();
  // ROW_LANES lanes a down row, a 16-byte piece each (the slice's columns of a row are contiguous), their products
  // added by a shuffle tree within the row's lanes
  const int piece = lane % ROW_LANES;
  const bool reads = piece * 8 < width;
  float* out = p.act + PARTIALS_AT + (size_t)slice * H;
#pragma unroll 4
  for (int r = threadIdx.x / ROW_LANES; r < H; r += ROWS_AT_ONCE) {
    float d = reads ? dot8(load_weights16(down + (size_t)r * row_stride + piece * 8), act + piece * 8) : 0.f;
#pragma unroll
    for (int o = ROW_LANES / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (piece == 0) out[r] = d;
  }
}

// After the grid barrier: each residual row adds its slices' partials, each lane its slices in order, then the warp's
// tree, the same order every step.
__device__ void expert_slices_reduce_phase(const Params& p, int layer) {
  constexpr int PER_LANE = (EXPERT_SLICES + 31) / 32;
  const int lane = threadIdx.x & 31;
  for (int r = grid_warp(); r < H; r += GRID_WARPS) {
    const float before = lane == 0 ? load_state_now(p.x + r) : 0.f;
    float part[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      const int s = lane + 32 * k;
      part[k] = s < EXPERT_SLICES ? load_state_now(p.act + PARTIALS_AT + (size_t)s * H + r) : 0.f;
    }
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) acc += part[k];
    const float d = warp_sum(acc);
    if (lane == 0) add_experts_output(p, layer, r, before, d);
  }
}
#endif
