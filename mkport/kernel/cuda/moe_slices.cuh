// Mixture of experts at batch 1, a plan variant (LaunchPlan.expert_slice, MK_EXPERT_SLICES): a sparse layer's gate/up
// and down in one phase, with no grid barrier and no act read back from global memory between them. The chosen
// experts' intermediate columns, then the shared expert's, are cut into slices of EXPERT_SLICE; block b takes slice b:
// the slice's gate and up rows against the normed input (the router phase's, still in shared memory), its
// weight * act(gate) * up kept in shared memory, then the slice's columns of every down row, a partial H-vector stored
// in the slice's own place (after moe.cuh's act layout). A shared expert's slices take its gate and up rows from the
// router phase. After a grid barrier each output row adds its slices' partials in slice order to the residual: the
// same inputs give the same bits (moe.cuh's down adds the same terms in another order: float32 rounding apart).
#pragma once
#include "slices.cuh"

#ifdef MK_EXPERT_SLICES
constexpr int EXPERT_PARTS = (EXPERT_I + EXPERT_SLICE - 1) / EXPERT_SLICE;  // slices a chosen expert
constexpr int SHARED_PARTS = (SHARED_I + EXPERT_SLICE - 1) / EXPERT_SLICE;  // the shared expert's (0: none)
constexpr int EXPERT_SLICES = TOP_K * EXPERT_PARTS + SHARED_PARTS;
constexpr int PARTIALS_AT = SHARED_AT + (SHARED_I > 0 ? 2 * SHARED_I + 1 : 0);  // in act (launch_plan.moe_act_floats)
static_assert(BATCH == 1, "a batch reads the union of its experts (moe_batch.cuh)");
static_assert(EXPERT_SLICES <= GRID, "a block a slice");
static_assert(H + 3 * EXPERT_SLICE <= MOE_SM, "the normed input, the slice's gate and up values, then its act");
static_assert(MOE_ACT >= PARTIALS_AT + EXPERT_SLICES * H, "each slice's partial down rows after the act layout");
#ifdef MK_SLICE_RING
static_assert(slice_ring_floats(EXPERT_SLICE) <= MOE_SM, "the rows' spans after the act");
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
  const bf16* down;  // the slice's first column of down's row 0
  int row_stride;
  if (!shared) {
    const int slot = slice / EXPERT_PARTS;
    const size_t expert = route_experts(smem)[slot];
    const size_t first = (expert * EXPERT_I + col0) * H;
    slice_rows(lw.expert_gate + first, lw.expert_up + first, width, EXPERT_SLICE, smem, gate_up);
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
  slice_down_partials<EXPERT_SLICE>(down, row_stride, width, act, p.act + PARTIALS_AT + (size_t)slice * H);
}

// After the grid barrier: each residual row adds its slices' partials (slices_sum: the same order every step).
__device__ void expert_slices_reduce_phase(const Params& p, int layer) {
  const int lane = threadIdx.x & 31;
  for (int r = grid_warp(); r < H; r += GRID_WARPS) {
    const float before = lane == 0 ? load_state_now(p.x + r) : 0.f;
    const float d = slices_sum<EXPERT_SLICES>(p.act + PARTIALS_AT, r, lane);
    if (lane == 0) add_experts_output(p, layer, r, before, d);
  }
}
#endif
