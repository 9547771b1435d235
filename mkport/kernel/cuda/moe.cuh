// Mixture of experts (qwen3_moe, qwen2_moe, olmoe, mixtral), batch 1: a sparse layer's MLP in three phases between
// grid barriers. router: the MLP norm, the router's logits, and qwen2_moe's shared expert's gate/up rows and its gate's
// logit (none depends on the routing). gate/up: every block routes by itself from the same logits, in the same order,
// to the same experts (route), then the grid computes the chosen experts' gate and up rows. down: each output row sums
// the chosen experts' down rows in ascending expert index, each applied to its act(gate) * up already scaled by its
// weight, then the shared expert's scaled by sigmoid of its gate, in a fixed order: the same inputs give the same bits.
//
// A batch (BATCH > 1) reads the union of its sequences' experts once. Every block routes every sequence (the same
// logits, the same order), then builds the union in ascending expert index with a prefix sum over the warps' counts,
// and for each expert of the union a mask of the sequences that chose it. gate/up: the union's experts' gate and up rows
// on tensor cores (mma_tile), each tile applied to every sequence's normed input; a sequence that chose the expert keeps
// weight * act(gate) * up in its slot of act (its experts in ascending index, as batch 1), the others' columns are
// dropped. down: each warp takes a tile of 16 output rows and a fixed share of every expert's k steps (step j of expert
// e goes to slice (e * steps + j) % slices, whatever the union), walks the union in ascending index with the inputs of
// the sequences that did not choose an expert zero (their products add exact zeros), then the shared expert; the
// slices' partial tiles are added in slice order. A sequence's sums therefore hold the same terms in the same order
// whichever experts the other sequences chose: its bits do not depend on them (batch_down's comment says the one
// assumption).
#pragma once

#if HAS_MOE
static_assert(EXPERTS <= THREADS && TOP_K <= 32 && TOP_K <= EXPERTS, "a thread an expert; a lane a choice");
static_assert(EXPERT_I % 8 == 0 && SHARED_I % 8 == 0, "rows are read in 16-byte pieces");
static_assert(PRE_NORMS && !POST_NORMS, "the router reads the MLP norm's output; down adds to the residual stream");
// a batch's expert tiles take k in steps of MMA_K (32); other widths read past each row (launch_plan.moe_batch_problem
// refuses them before rendering)
static_assert(BATCH == 1 || (EXPERT_I % MMA_K == 0 && SHARED_I % MMA_K == 0 && H % MMA_K == 0),
              "batched experts: expert widths and hidden size must be multiples of 32");
static_assert(BATCH <= 32, "a sequence a bit of the union's masks");

__device__ __forceinline__ bool sparse_layer(int layer) { return SPARSE_LAYER[layer]; }

// One lane's part of a dot product over CHUNKS 16-byte pieces of weights, piece c at at(c), with x[8c, 8c + 8); four
// loads in flight (8 and 12 were slower on Qwen3-30B-A3B and OLMoE: docs/benchmarks.md).
template <int CHUNKS, typename At>
__device__ __forceinline__ float lane_dot(At at, const float* x, int lane) {
  float acc = 0.f;
#pragma unroll 4
  for (int c = lane; c < CHUNKS; c += 32) acc += dot8(load_weights16(at(c)), x + c * 8);
  return acc;
}

// Where a sparse layer's act buffer (MOE_ACT floats a sequence) holds the shared expert's gate rows, up rows, then its
// gate's logit: batch 1 after the chosen experts' gate and up rows; a batch after the down's input (launch_plan.moe_act_floats).
constexpr int SHARED_AT = BATCH == 1 ? 2 * TOP_K * EXPERT_I : TOP_K * EXPERT_I + SHARED_I;

// The routing in shared memory (MOE_SM, after the vectors): router logits, each expert's rank, then the experts applied
// (ascending) and their weights, kept from the gate/up phase to down.
__device__ __forceinline__ float* route_logits(float* smem) { return smem + MOE_SM; }
__device__ __forceinline__ int* route_ranks(float* smem) { return reinterpret_cast<int*>(smem + MOE_SM + EXPERTS); }
__device__ __forceinline__ int* route_experts(float* smem) { return route_ranks(smem) + EXPERTS; }
__device__ __forceinline__ float* route_weights(float* smem) { return smem + MOE_SM + 2 * EXPERTS + TOP_K; }

__device__ void router_phase(const Params& p, int layer, float* smem, float* scratch) {
  const LayerWeights& lw = p.layers[layer];
  rmsnorm_to_smem<H>(p.x, lw.mlp_norm, smem, scratch);  // kept in shared memory for the gate/up phase
  STAMP(p, layer, MLP_INPUT);
  constexpr int ROWS = EXPERTS + (SHARED_I > 0 ? 2 * SHARED_I + 1 : 0);
  grid_matvec<H, ROWS>(
      [&](int r) {
        const int s = r - EXPERTS;  // the shared expert's gate rows, up rows, then its gate
        return r < EXPERTS ? lw.router + (size_t)r * H
               : s < SHARED_I ? lw.w_gate + (size_t)s * H
               : s < 2 * SHARED_I ? lw.w_up + (size_t)(s - SHARED_I) * H
                                  : lw.shared_gate;
      },
      smem, [&](int r, int b, float d) {
        if (r < EXPERTS) p.router_logits[b * EXPERTS + r] = d;
        else p.act[b * MOE_ACT + SHARED_AT + r - EXPERTS] = d;
      });
}

// The family's routing, as transformers does it: softmax over every expert in fp32, the TOP_K largest (a logit's
// rank: the experts above it, ties to the lower index), in ascending index, weighted by their probabilities,
// renormalised to sum 1 with NORM_TOPK. Trace builds given forced_experts apply those instead (weighted by their own
// probabilities) and still trace their own choice.
__device__ void route(const Params& p, int layer, float* smem) {
  float* logit = route_logits(smem);
  int* rank = route_ranks(smem);
  int* expert = route_experts(smem);
  const int e = threadIdx.x;
  float l = 0.f;
  if (e < EXPERTS) logit[e] = l = load_state_now(p.router_logits + e);
  block_sync();
  if (e < EXPERTS) {
    int above = 0;
    for (int f = 0; f < EXPERTS; ++f) above += logit[f] > l || (logit[f] == l && f < e);
    rank[e] = above;
  }
  block_sync();
#if MK_TRACE
  const bool forced = p.forced_experts != nullptr;
  float* trace = layer_trace(p, layer);
  if (blockIdx.x == 0 && e < EXPERTS) trace[TRACE_ROUTER_LOGITS + e] = l;
#else
  constexpr bool forced = false;
#endif
  if (e < EXPERTS && rank[e] < TOP_K) {
    int slot = 0;  // the chosen experts below this one
    for (int f = 0; f < e; ++f) slot += rank[f] < TOP_K;
    if (!forced) expert[slot] = e;
#if MK_TRACE
    if (blockIdx.x == 0) trace[TRACE_EXPERTS + slot] = (float)e;
#endif
  }
#if MK_TRACE
  if (forced && e < TOP_K) expert[e] = p.forced_experts[layer * TOP_K + e];
#endif
  block_sync();
  if (threadIdx.x < 32) {  // warp 0: the softmax's max and sum, then the applied experts' weights, a lane each
    const int lane = threadIdx.x;
    float m = -INFINITY, sum = 0.f;
    for (int f = lane; f < EXPERTS; f += 32) m = fmaxf(m, logit[f]);
    m = warp_max(m);
    for (int f = lane; f < EXPERTS; f += 32) sum += expf(logit[f] - m);
    sum = warp_sum(sum);
    float w = lane < TOP_K ? expf(logit[expert[lane]] - m) / sum : 0.f;
    if constexpr (NORM_TOPK) w /= warp_sum(w);
    if (lane < TOP_K) {
      route_weights(smem)[lane] = w;
#if MK_TRACE
      if (blockIdx.x == 0) trace[TRACE_EXPERT_WEIGHTS + lane] = w;
#endif
    }
  }
  block_sync();
}

#include "moe_batch.cuh"  // a batch's routing, union and expert tiles

__device__ void expert_gate_up_phase(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  if constexpr (BATCH > 1) {
    batch_gate_up(p, layer, smem);
    return;
  }
  route(p, layer, smem);
  const int* expert = route_experts(smem);
  // slot j's gate rows, then its up rows; the normed input is the router phase's, still in shared memory
  grid_matvec<H, 2 * TOP_K * EXPERT_I>(
      [&](int r) {
        const int slot = r / (2 * EXPERT_I), q = r % (2 * EXPERT_I);
        const bf16* w = q < EXPERT_I ? lw.expert_gate : lw.expert_up;
        return w + ((size_t)expert[slot] * EXPERT_I + q % EXPERT_I) * H;
      },
      smem, [&](int r, int, float d) { p.act[r] = d; });
}

__device__ void expert_down_phase(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  const int* expert = route_experts(smem);
  const float* weight = route_weights(smem);
  if constexpr (BATCH == 1) {
    gated_to_smem<TOP_K * EXPERT_I>(
        p.act, [](int i) { return i / EXPERT_I * 2 * EXPERT_I + i % EXPERT_I; }, EXPERT_I,
        [&](int i) { return weight[i / EXPERT_I]; }, smem);
    if constexpr (SHARED_I > 0) {
      const float gate = sigmoid(load_shared_state(p.act + SHARED_AT + 2 * SHARED_I));
      gated_to_smem<SHARED_I>(
          p.act, [](int i) { return SHARED_AT + i; }, SHARED_I, [&](int) { return gate; }, smem + TOP_K * EXPERT_I);
    }
    block_sync();
  }
  STAMP(p, layer, DOWN_INPUT);  // a batch's inputs are read from global memory as its tiles go (batch_down)
  if constexpr (BATCH > 1) {
    batch_down(p, layer, smem);
    return;
  }
  constexpr int CHUNKS = EXPERT_I / 8;
  const int lane = threadIdx.x & 31;
  for (int r = grid_warp(); r < H; r += GRID_WARPS) {
    const float before = lane == 0 ? load_state_now(p.x + r) : 0.f;
    // the chosen experts' rows r, one after another, as one row of TOP_K * EXPERT_I
    float acc = lane_dot<TOP_K * CHUNKS>(
        [&](int c) { return lw.expert_down + ((size_t)expert[c / CHUNKS] * H + r) * EXPERT_I + (c % CHUNKS) * 8; },
        smem, lane);
    if constexpr (SHARED_I > 0)
      acc += lane_dot<SHARED_I / 8>([&](int c) { return lw.w_down + (size_t)r * SHARED_I + c * 8; },
                                    smem + TOP_K * EXPERT_I, lane);
    const float d = warp_sum(acc);
    if (lane == 0) {
      const float v = before + sublayer(d);
      p.x[r] = v;
#if MK_TRACE
      float* trace = layer_trace(p, layer);
      trace[TRACE_MOE + r] = d;
      trace[TRACE_MLP_RESIDUAL + r] = v;
#endif
    }
  }
}

// The three phases of a sparse layer's MLP, with the grid barriers between them (decode_step.cu has the last).
__device__ void sparse_mlp_phases(const Params& p, int layer, float* smem, float* scratch, cg::grid_group& grid, int& mark) {
  router_phase(p, layer, smem, scratch);
  grid_barrier(grid, p.profile, mark);
  expert_gate_up_phase(p, layer, smem);
  STAMP(p, layer, GATE_UP_END);
  grid_barrier(grid, p.profile, mark);
  expert_down_phase(p, layer, smem);
}
#else
__device__ __forceinline__ bool sparse_layer(int) { return false; }
__device__ __forceinline__ void sparse_mlp_phases(const Params&, int, float*, float*, cg::grid_group&, int&) {}
#endif
