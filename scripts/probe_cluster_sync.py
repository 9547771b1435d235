"""What a dependency costs on this GPU, for the next kernel design (issue 11): a grid-wide barrier against a
thread-block-cluster barrier, the two in one cooperative launch, a sum of partial vectors through distributed
shared memory, and a flag passed between blocks of different clusters (release / acquire):

    python3 scripts/probe_cluster_sync.py [--blocks 128] [--reps 2000] [--json FILE]

Each kernel runs with the megakernel's shape (512 threads, one block an SM held by its shared memory) and repeats
its dependency `reps` times; reported: microseconds per dependency (CUDA events around the launch, minus nothing:
launch cost is amortised over the repetitions). A cluster size the GPU cannot co-schedule, or a cooperative
launch with clusters that the driver refuses, is reported as such, not as a time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
from pathlib import Path

SOURCE = r"""
#include <cooperative_groups.h>
#include <cuda_runtime.h>
namespace cg = cooperative_groups;

constexpr int THREADS = 512;
constexpr int VEC = 1024;  // floats a block contributes to the cluster's sum

__global__ void __launch_bounds__(THREADS, 1) grid_barriers(int reps) {
  cg::grid_group grid = cg::this_grid();
  for (int i = 0; i < reps; ++i) grid.sync();
}

__global__ void __launch_bounds__(THREADS, 1) cluster_barriers(int reps) {
  cg::cluster_group cluster = cg::this_cluster();
  for (int i = 0; i < reps; ++i) cluster.sync();
}

// A cluster barrier and a grid barrier in turn, in one cooperative launch: whether the two can be had together.
__global__ void __launch_bounds__(THREADS, 1) both_barriers(int reps) {
  cg::grid_group grid = cg::this_grid();
  cg::cluster_group cluster = cg::this_cluster();
  for (int i = 0; i < reps; ++i) {
    cluster.sync();
    grid.sync();
  }
}

// Every block of a cluster writes a partial vector into its shared memory; after the cluster barrier each block
// adds up its slice of the vector from every block's shared memory (distributed shared memory), in rank order.
__global__ void __launch_bounds__(THREADS, 1) cluster_sums(int reps, float* out) {
  extern __shared__ float part[];
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = (int)cluster.num_blocks(), me = (int)cluster.block_rank();
  const int slice = VEC / ranks;
  float acc = 0.f;
  for (int i = 0; i < reps; ++i) {
    for (int j = threadIdx.x; j < VEC; j += THREADS) part[j] = (float)(i + j + me);
    cluster.sync();
    for (int j = threadIdx.x; j < slice; j += THREADS) {
      float s = 0.f;
      for (int r = 0; r < ranks; ++r) s += cluster.map_shared_rank(part, r)[me * slice + j];
      acc += s;
    }
    cluster.sync();  // the slices are read before the next round writes
  }
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// Block 0 and block `other` pass a counter back and forth: each waits (acquire) for the other's increment
// (release). Two dependencies a round trip.
__global__ void __launch_bounds__(THREADS, 1) flag_ping_pong(int reps, unsigned* flag, int other) {
  if (threadIdx.x != 0 || (blockIdx.x != 0 && blockIdx.x != other)) return;
  const unsigned mine = blockIdx.x == 0 ? 0u : 1u;
  for (int i = 0; i < reps; ++i) {
    const unsigned want = 2u * i + mine;
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
    } while (seen != want);
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(flag) : "memory");
  }
}

static cudaError_t launch(const void* kernel, int blocks, int cluster, bool cooperative, int smem, void** args,
                          cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  if (cluster > 8) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (cluster > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (cooperative) {
    attrs[n].id = cudaLaunchAttributeCooperative;
    attrs[n].val.cooperative = 1;
    ++n;
  }
  config.attrs = attrs;
  config.numAttrs = n;
  return cudaLaunchKernelExC(&config, kernel, args);
}

// Clusters of `cluster` blocks of this shape that the GPU holds at once (0: none).
extern "C" int probe_max_clusters(int cluster, int smem, int* clusters) {
  cudaError_t e = cudaFuncSetAttribute((const void*)cluster_barriers, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return (int)e;
  if (cluster > 8) {
    e = cudaFuncSetAttribute((const void*)cluster_barriers, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return (int)e;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(cluster);
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  return (int)cudaOccupancyMaxActiveClusters(clusters, (const void*)cluster_barriers, &config);
}

extern "C" int probe_grid_barriers(int blocks, int reps, int smem, cudaStream_t stream) {
  void* args[] = {&reps};
  return (int)launch((const void*)grid_barriers, blocks, 1, true, smem, args, stream);
}

extern "C" int probe_cluster_barriers(int blocks, int cluster, int reps, int smem, cudaStream_t stream) {
  void* args[] = {&reps};
  return (int)launch((const void*)cluster_barriers, blocks, cluster, false, smem, args, stream);
}

extern "C" int probe_both_barriers(int blocks, int cluster, int reps, int smem, cudaStream_t stream) {
  void* args[] = {&reps};
  return (int)launch((const void*)both_barriers, blocks, cluster, true, smem, args, stream);
}

extern "C" int probe_cluster_sums(int blocks, int cluster, int reps, int smem, float* out, cudaStream_t stream) {
  void* args[] = {&reps, &out};
  return (int)launch((const void*)cluster_sums, blocks, cluster, false, smem, args, stream);
}

extern "C" int probe_flag_ping_pong(int blocks, int reps, int smem, unsigned* flag, int other, cudaStream_t stream) {
  void* args[] = {&reps, &flag, &other};
  return (int)launch((const void*)flag_ping_pong, blocks, 1, true, smem, args, stream);
}

extern "C" const char* probe_error(int e) { return cudaGetErrorString((cudaError_t)e); }
"""

SMEM = 160 * 1024  # one block an SM, as the megakernel's shared memory holds it


def build(arch: str, out_dir: Path) -> Path:
    from mkport.kernel.build import nvcc

    out_dir.mkdir(parents=True, exist_ok=True)
    src, lib = out_dir / "probe_cluster_sync.cu", out_dir / f"probe_cluster_sync_{arch}.so"
    src.write_text(SOURCE)
    subprocess.run([nvcc(), "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", str(src), "-o",
                    str(lib)], check=True)
    return lib


def main() -> None:
    import torch

    from mkport.kernel.cache import cache_root

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    lib = ctypes.CDLL(str(build(f"sm_{major}{minor}", cache_root() / "probes")))
    lib.probe_error.restype = ctypes.c_char_p
    # pointers and the stream as 64-bit values (ctypes passes a bare Python int as a 32-bit C int)
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.probe_grid_barriers.argtypes = [i, i, i, p]
    lib.probe_cluster_barriers.argtypes = lib.probe_both_barriers.argtypes = [i, i, i, i, p]
    lib.probe_cluster_sums.argtypes = [i, i, i, i, p, p]
    lib.probe_flag_ping_pong.argtypes = [i, i, i, p, i, p]
    stream = torch.cuda.current_stream().cuda_stream
    out = torch.zeros(args.blocks, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []

    def timed(name: str, per: int, call) -> None:
        times = []
        for _ in range(4):  # the first is a warm-up
            if name.startswith("flag"):
                flag.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            err = call()
            b.record()
            if err:
                rows.append({"probe": name, "error": lib.probe_error(err).decode()})
                print(f"{name:44s} refused: {rows[-1]['error']}")
                return
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / per)
        rows.append({"probe": name, "us": min(times[1:])})
        print(f"{name:44s} {rows[-1]['us']:7.2f} us")

    n, reps = args.blocks, args.reps
    timed(f"grid barrier, {n} blocks", reps, lambda: lib.probe_grid_barriers(n, reps, SMEM, stream))
    for cluster in (2, 4, 8, 16):
        held = ctypes.c_int(0)
        err = lib.probe_max_clusters(cluster, SMEM, ctypes.byref(held))
        fits = not err and held.value * cluster >= n
        print(f"clusters of {cluster}: {held.value} fit at once" + ("" if fits else f" (fewer than {n} blocks)"))
        rows.append({"probe": f"clusters of {cluster} held at once", "clusters": held.value, "error": err or None})
        if not fits:
            continue
        timed(f"cluster barrier, clusters of {cluster}", reps,
              lambda: lib.probe_cluster_barriers(n, cluster, reps, SMEM, stream))
        timed(f"cluster + grid barrier (cooperative), {cluster}", reps,
              lambda: lib.probe_both_barriers(n, cluster, reps, SMEM, stream))
        timed(f"cluster sum of {cluster} x 1024 floats (DSMEM)", reps,
              lambda: lib.probe_cluster_sums(n, cluster, reps, SMEM, out.data_ptr(), stream))
    timed(f"flag between block 0 and block {n // 2}, one way", 2 * reps,
          lambda: lib.probe_flag_ping_pong(n, reps, SMEM, flag.data_ptr(), n // 2, stream))
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "blocks": n, "reps": reps,
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
