// Grid-wide barrier. The kernel is launched cooperatively, so the launch fails rather than hangs when
// the grid cannot be co-resident, and the barrier's state belongs to the launch, not to this program.
#pragma once

// With -DMK_PROFILE=1, block 0 records the SM clock after each barrier: the differences are the phases' times.
__device__ __forceinline__ void grid_barrier(cg::grid_group& grid, long long* profile, int& mark) {
  grid.sync();
#if MK_PROFILE
  if (blockIdx.x == 0 && threadIdx.x == 0) profile[mark] = clock64();
#endif
  ++mark;
}
