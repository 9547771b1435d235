// A dense MLP at batch 1, a plan variant (LaunchPlan.mlp_slice, MK_MLP_SLICES): gate/up and down in one phase, as
// moe_slices.cuh does an expert's, with no grid barrier and no act read back from global memory between them. The
// intermediate columns are cut into slices of MLP_SLICE; block b norms the residual (as gate_up_phase), then takes
// slice b: its gate and up rows (slices.cuh's slice_rows: a row a warp, or by the ring), act(gate) * up in shared
// memory, then the slice's columns of every down row, a partial H-vector stored after act's 2 * I floats
// (launch_plan.mlp_act_floats). After a grid barrier each residual row adds its slices' partials in slice order: the
// same inputs give the same bits (down_phase adds the same terms in another order: float32 rounding apart).
#pragma once
#include "slices.cuh"

#ifdef MK_MLP_SLICES
constexpr int MLP_SLICES = (I + MLP_SLICE - 1) / MLP_SLICE;
constexpr int MLP_PARTIALS_AT = 2 * I;  // in act, after the gate and up rows of the two-phase MLP's layout
static_assert(BATCH == 1, "a batch's gate/up and down run on tensor cores (mlp.cuh)");
static_assert(!POST_NORMS, "a post-norm needs the whole MLP output before the residual add (post_norm.cuh)");
static_assert(MLP_SLICES <= GRID, "a block a slice");
static_assert(H + 3 * MLP_SLICE <= SLICE_VECTORS, "the normed input, the slice's gate and up values, then its act");
#ifdef MK_SLICE_RING
static_assert(slice_ring_floats(MLP_SLICE) <= SLICE_VECTORS, "the rows' spans after the act");
#endif

__device__ void mlp_slices_phase(const Params& p, int layer, float* smem, float* scratch) {
  const LayerWeights& lw = p.layers[layer];
  // every block, a slice or not: the norm waits for the weights the phase before staged for it (rmsnorm.cuh)
  sublayer_input_to_smem<PRE_NORMS>(p.x, lw.mlp_norm, smem, scratch);
  STAMP(p, layer, MLP_INPUT);
  const int slice = blockIdx.x;
  if (slice >= MLP_SLICES) return;
  const int col0 = slice * MLP_SLICE, width = min(MLP_SLICE, I - col0);
  float* gate_up = smem + H;  // the slice's gate rows' values, then its up rows'
  float* act = gate_up + 2 * MLP_SLICE;
  slice_rows(lw.w_gate + (size_t)col0 * H, lw.w_up + (size_t)col0 * H, width, MLP_SLICE, smem, gate_up);
  block_sync();
  for (int j = threadIdx.x; j < width; j += THREADS) act[j] = act_times(gate_up[j], gate_up[width + j]);
  block_sync();
  slice_down_partials<MLP_SLICE>(lw.w_down + col0, I, width, act, p.act + MLP_PARTIALS_AT + (size_t)slice * H);
}

// After the grid barrier: each residual row adds its slices' partials (slices_sum: the same order every step).
__device__ void mlp_slices_reduce_phase(const Params& p, int layer) {
  float* trace = layer_trace(p, layer);
  const int lane = threadIdx.x & 31;
  for (int r = grid_warp(); r < H; r += GRID_WARPS) {
    const float before = lane == 0 ? load_state_now(p.x + r) : 0.f;
    const float d = slices_sum<MLP_SLICES>(p.act + MLP_PARTIALS_AT, r, lane);
    if (lane == 0) {
      const float v = residual_plus(before, d);
      p.x[r] = v;
#if MK_TRACE
      trace[TRACE_MLP_RESIDUAL + r] = v;
#endif
    }
  }
}

// The two phases with the grid barrier between them (decode_step.cu has the one after).
__device__ __forceinline__ void mlp_slices_phases(const Params& p, int layer, float* smem, float* scratch, cg::grid_group& grid,
                                                  int& mark) {
  mlp_slices_phase(p, layer, smem, scratch);
  STAMP(p, layer, GATE_UP_END);
  grid_barrier(grid, p.profile, mark);
  STAMP(p, layer, DOWN_INPUT);
  mlp_slices_reduce_phase(p, layer);
}
#endif
