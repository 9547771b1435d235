// The step's input into the residual stream: a token's row of an embedding table, or an input embedding
// from a device buffer, for each sequence of the batch, projected from IN_DIM to H where the spec has an input
// projection, times embedding_multiplier where it has one.
#pragma once

__device__ __forceinline__ float embedding_scaled(float v) {
  if constexpr (HAS_EMBEDDING_MULTIPLIER) return v * EMBEDDING_MULTIPLIER;
  else return v;
}

__device__ void input_phase(const Params& p, float* smem) {
  for (int j = threadIdx.x; j < BATCH * IN_DIM; j += THREADS) {
    const int b = j / IN_DIM, i = j % IN_DIM;
    if (p.input_kind[b] == 0) {
      smem[j] = bf2f(token_row(p, b)[i]);
    } else {
      smem[j] = p.input_embed[j];
    }
  }
  __syncthreads();
  if constexpr (HAS_INPUT_PROJECTION) {
    grid_matvec<IN_DIM, H>([&](int r) { return p.in_proj_w + (size_t)r * IN_DIM; }, smem, [&](int r, int b, float d) {
      const float v = embedding_scaled(d + bf2f(p.in_proj_b[r]));
      p.x[b * H + r] = v;
#if MK_TRACE
      seq_trace(p, b)[TRACE_EMBED + r] = v;
#endif
    });
  } else {
    for (int j = blockIdx.x * THREADS + threadIdx.x; j < BATCH * H; j += GRID * THREADS) {
      const float v = embedding_scaled(smem[j]);
      p.x[j] = v;
#if MK_TRACE
      seq_trace(p, j / H)[TRACE_EMBED + j % H] = v;
#endif
    }
  }
}
