// One decode step, every layer, in one persistent cooperative launch. The model and the plan are constants.cuh's
// (rendered by mkport); each phase is an op of its own file.
#include "common.cuh"
#include "grid_sync.cuh"
#include "rmsnorm.cuh"
#include "matvec.cuh"
#include "post_norm.cuh"  // before the phases that make the post-norms
#include "rope.cuh"
#include "embed.cuh"
#include "qkv.cuh"
#include "attention.cuh"
#include "linear_attention.cuh"
#include "mlp.cuh"
#include "prefill.cuh"  // after mlp.cuh: the prefill's MLP takes its act_times
#include "gated_delta_net_prefill.cuh"
#include "delta_rule_prefill.cuh"
#include "moe.cuh"
#include "lm_head.cuh"
#include "sample.cuh"

extern "C" __global__ void __launch_bounds__(THREADS, 1) decode_step_kernel(const __grid_constant__ Params p) {
  cg::grid_group grid = cg::this_grid();
  extern __shared__ __align__(16) float smem[];
  __shared__ float scratch[WARPS * BATCH];
  int mark = 1;  // profile slot 0 is the kernel's start
#if MK_PROFILE
  if (blockIdx.x == 0 && threadIdx.x == 0) p.profile[0] = clock64();
#endif

  // Every phase starts by reading its layer's weight pointers: the whole table into this SM's L1 now, so that a
  // layer's first phase does not wait a memory round trip for them.
  for (int i = threadIdx.x * 128; i < (int)(L * sizeof(LayerWeights)); i += THREADS * 128)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(reinterpret_cast<const char*>(p.layers) + i));
  input_phase(p, smem);
  // the next norm's weights, staged before each grid barrier; without input norms (olmo2/3) only the final norm's
  if constexpr (PRE_NORMS) stage_norm_weights(p.layers[0].attn_norm);
  grid_barrier(grid, p.profile, mark);
#if MK_PROFILE
  if (threadIdx.x == 0) p.timeline[(size_t)L * GRID * TL_EVENTS + blockIdx.x] = clock64();
#endif
  for (int layer = 0; layer < L; ++layer) {
    // a hybrid's Gated DeltaNet layer (linear_attention.cuh) in place of the attention's three phases
    STAMP(p, layer, QKV_START);
    if (linear_layer(layer)) linear_in_phase(p, layer, smem, scratch);
    else qkv_phase(p, layer, smem, scratch);
    STAMP(p, layer, QKV_END);
    grid_barrier(grid, p.profile, mark);
    STAMP(p, layer, ATTENTION_START);
    if (linear_layer(layer)) delta_rule_phase(p, layer, smem);
    else attention_phase(p, layer, smem);
    STAMP(p, layer, ATTENTION_END);
    grid_barrier(grid, p.profile, mark);
    STAMP(p, layer, O_PROJ_START);
    if (linear_layer(layer)) linear_out_phase(p, layer, smem);
    else o_proj_phase(p, layer, smem);
    if constexpr (PRE_NORMS) stage_norm_weights(p.layers[layer].mlp_norm);
    STAMP(p, layer, O_PROJ_END);
    grid_barrier(grid, p.profile, mark);
    STAMP(p, layer, MLP_START);
    if (sparse_layer(layer)) {  // mixture of experts: router, gate/up, down (moe.cuh)
      sparse_mlp_phases(p, layer, smem, scratch, grid, mark);
    } else {
      gate_up_phase(p, layer, smem, scratch);
      STAMP(p, layer, GATE_UP_END);
      grid_barrier(grid, p.profile, mark);
      down_phase(p, layer, smem);
    }
    if constexpr (PRE_NORMS) stage_norm_weights(layer + 1 < L ? p.layers[layer + 1].attn_norm : p.final_norm);
    else if (layer + 1 == L) stage_norm_weights(p.final_norm);
    STAMP(p, layer, DOWN_END);
    grid_barrier(grid, p.profile, mark);
  }
  residual_input_to_smem<true>(p, L, p.final_norm, smem, scratch);  // and the last MLP post-norm
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < BATCH * H; i += THREADS) {
      p.hidden_out[i] = smem[i];
#if MK_TRACE
      seq_trace(p, i / H)[TRACE_FINAL_NORM + i % H] = smem[i];
#endif
    }
  }
  if constexpr (LOGITS_OUTPUT) {
    lm_head_phase(p, smem);
    grid_barrier(grid, p.profile, mark);
    if (blockIdx.x < BATCH) sample_phase(p, smem, blockIdx.x);
  }
#if MK_PROFILE
  if (blockIdx.x == 0 && threadIdx.x == 0) p.profile[mark] = clock64();
#endif
}

static cudaError_t allow_dynamic_smem() {
  return cudaFuncSetAttribute((const void*)decode_step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
}

// How many blocks of this kernel fit on one SM; the host refuses to launch unless GRID fit at once.
extern "C" int mk_blocks_per_sm(int* blocks) {
  cudaError_t e = allow_dynamic_smem();
  if (e != cudaSuccess) return (int)e;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, (const void*)decode_step_kernel, THREADS, SMEM_BYTES);
}

extern "C" int mk_launch(const Params* params, cudaStream_t stream) {
  cudaError_t e = allow_dynamic_smem();
  if (e != cudaSuccess) return (int)e;
  void* args[] = {(void*)params};
  e = cudaLaunchCooperativeKernel((const void*)decode_step_kernel, dim3(GRID), dim3(THREADS), args, SMEM_BYTES, stream);
  return (int)e;
}

extern "C" const char* mk_error_string(int error) { return cudaGetErrorString((cudaError_t)error); }
extern "C" int mk_params_bytes() { return (int)sizeof(Params); }
