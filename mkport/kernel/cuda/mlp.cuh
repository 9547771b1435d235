// Gated MLP (SwiGLU, or GeGLU): its RMSNorm (none in olmo2/3); gate and up rows as one matvec of 2 * I rows (a
// better balance over the grid's warps than pairs of rows, and measured faster: v17 in docs/benchmarks.md);
// act(gate) * up as the down projection reads it. A batch (tensor-core tiles) pairs each tile's 8 gate rows with the
// matching 8 up rows and stores act itself, I floats of the 2 * I of each sequence: down then reads half as much.
#pragma once

// SwiGLU: silu(gate) * up. GeGLU (Gemma): GELU's tanh form times up, as torch's gelu(approximate="tanh") computes it.
__device__ __forceinline__ float act_times(float g, float u) {
  if constexpr (GEGLU) {
    const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    return 0.5f * g * (1.f + tanhf(inner)) * u;
  } else {
    return silu(g) * u;
  }
}

// N values of act(gate) * up into shared memory, value i from gate(i) and gate(i) + up_offset, times scale(i) (the
// dense down's input, and a sparse layer's experts' weighted, moe.cuh). A group's loads in flight at once (a loop
// storing each into shared memory kept them one at a time: the store might alias act); groups of 4 pairs (8 made some
// configs spill).
template <int N, typename GateAt, typename ScaleFn>
__device__ __forceinline__ void gated_to_smem(const float* act, GateAt gate_at, int up_offset, ScaleFn scale, float* dst) {
  constexpr int PER_THREAD = (N + THREADS - 1) / THREADS, GROUP = PER_THREAD < 4 ? PER_THREAD : 4;
  for (int k0 = 0; k0 < PER_THREAD; k0 += GROUP) {
    float g[GROUP], u[GROUP];
#pragma unroll
    for (int k = 0; k < GROUP; ++k) {
      const int i = threadIdx.x + (k0 + k) * THREADS;
      if (i < N) {
        g[k] = load_state_now(act + gate_at(i));
        u[k] = load_state_now(act + gate_at(i) + up_offset);
      }
    }
#pragma unroll
    for (int k = 0; k < GROUP; ++k) {
      const int i = threadIdx.x + (k0 + k) * THREADS;
      if (i < N) dst[i] = scale(i) * act_times(g[k], u[k]);
    }
  }
}

// A plan variant (LaunchPlan.vector_act, MK_VECTOR_ACT), batch 1: gated_to_smem's values for the dense down (gate
// at i, up at N + i) with 16-byte loads. Up to 4 pairs of float4 in flight a thread (32 floats: phi-3.5-mini's
// I = 8192 in one group where scalar loads took four), in groups of equal size (5 pairs as 4 + 1 made gemma-2-2b's
// kernel spill; as 3 + 2 it does not). The same values in the same places as gated_to_smem's. The experts' inputs
// (moe.cuh) stay scalar: 2 pairs in flight made Qwen3-30B-A3B's kernel spill.
template <int N>
__device__ __forceinline__ void gated_to_smem_vec(const float* act, float* dst) {
  static_assert(N % 4 == 0, "16-byte loads of gate and up");
  constexpr int VECS = N / 4, PER_THREAD = (VECS + THREADS - 1) / THREADS, GROUPS = (PER_THREAD + 3) / 4;
  constexpr int GROUP = (PER_THREAD + GROUPS - 1) / GROUPS;
  for (int k0 = 0; k0 < PER_THREAD; k0 += GROUP) {
    float4 g[GROUP], u[GROUP];
#pragma unroll
    for (int k = 0; k < GROUP; ++k) {
      const int j = threadIdx.x + (k0 + k) * THREADS;
      if (j < VECS) {
        g[k] = load_state4_now(act + 4 * j);
        u[k] = load_state4_now(act + N + 4 * j);
      }
    }
#pragma unroll
    for (int k = 0; k < GROUP; ++k) {
      const int j = threadIdx.x + (k0 + k) * THREADS;
      if (j < VECS)
        reinterpret_cast<float4*>(dst)[j] = make_float4(act_times(g[k].x, u[k].x), act_times(g[k].y, u[k].y),
                                                        act_times(g[k].z, u[k].z), act_times(g[k].w, u[k].w));
    }
  }
}

#ifdef MK_VECTOR_ACT
constexpr bool VECTOR_ACT = true;
#else
constexpr bool VECTOR_ACT = false;
#endif

__device__ void gate_up_phase(const Params& p, int layer, float* smem, float* scratch) {
  const LayerWeights& lw = p.layers[layer];
  if constexpr (POST_NORMS)  // the attention's post-norm made here, from x into x_alt (post_norm.cuh)
    folded_post_norm_to_smem<PRE_NORMS>(p, p.x, p.x_alt, lw.post_attn_norm, lw.mlp_norm, layer, TRACE_ATTN_RESIDUAL, smem, scratch);
  else sublayer_input_to_smem<PRE_NORMS>(p.x, lw.mlp_norm, smem, scratch);  // olmo2/3: no pre-FFN norm, x itself
  STAMP(p, layer, MLP_INPUT);
  if constexpr (BATCH == 1) {
    grid_matvec<H, 2 * I>([&](int r) { return r < I ? lw.w_gate + (size_t)r * H : lw.w_up + (size_t)(r - I) * H; },
                          smem, [&](int r, int, float d) { p.act[r] = d; });
  } else {
    static_assert(I % 8 == 0, "a tile pairs 8 gate rows with 8 up rows");
    const auto row = [&](int r) {  // tile t: gate rows 8t .. 8t + 7, then the same up rows
      return (r % 16 < 8 ? lw.w_gate : lw.w_up) + (size_t)(r / 16 * 8 + r % 8) * H;
    };
    mma_matvec<H, 2 * I, true>(row, smem, [&](int j, int b, float g, float u) { p.act[b * 2 * I + j] = act_times(g, u); });
  }
}

__device__ void down_phase(const Params& p, int layer, float* smem) {
  const LayerWeights& lw = p.layers[layer];
  float* trace = layer_trace(p, layer);
  if constexpr (BATCH > 1) {  // act straight from global memory: I floats of each sequence's 2 * I
    residual_matvec<I, H, 1, 2 * I>(lw.w_down, p.act, sublayer_dst(p), trace + TRACE_MLP_RESIDUAL);
  } else {
    if constexpr (VECTOR_ACT && I % 4 == 0) gated_to_smem_vec<I>(p.act, smem);
    else gated_to_smem<I>(p.act, [](int i) { return i; }, I, [](int) { return 1.f; }, smem);
    block_sync();
    STAMP(p, layer, DOWN_INPUT);
    residual_matvec<I, H, SPLIT_K_DOWN, I>(lw.w_down, smem, sublayer_dst(p), trace + TRACE_MLP_RESIDUAL);
  }
}
