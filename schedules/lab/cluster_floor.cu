// What a dependency local to a thread-block cluster costs, against a kernel boundary (sm_90).
//
// `launch_floor.cu` measured that a decode step pays ~1.3-1.8 us of synchronisation per
// dependent step whether a kernel boundary (PDL) or a grid-wide barrier carries it, plus its
// bytes at ~3.1 TB/s. Some of a layer's dependencies are not grid-wide: the MLA prologue needs
// only its head's 192 rows of `qkv_a`, the latent norm only the 576 `kv_a` rows, an expert's
// down projection only that expert's gate/up rows. Hopper's clusters (up to 8 blocks portably,
// 16 with the non-portable opt-in) synchronise with a hardware barrier (`barrier.cluster`) and
// read each other's shared memory (DSMEM), so such a dependency need not leave the SMs. This
// measures the same chain of 270 dependent steps as `launch_floor.cu` (each step reads 4 KB of
// the previous step's output and writes its own, optionally streaming its own weights, the first
// 4 x 16 bytes a thread before its synchronisation), with the steps as:
//
// * `kernels`: one kernel a step, graph + PDL + `griddepcontrol.launch_dependents` right after
//   the wait (the model's chain), launched as clusters of `cluster` blocks (1: no cluster
//   attribute), so a cluster launch's own cost shows;
// * `cluster_phases`: kernels of `phases` steps each, the steps inside a kernel separated by a
//   cluster barrier (`cluster.sync()`, release / acquire) with the 4 KB read from the cluster's
//   shared memory (DSMEM) instead of L2; the kernels chained as above. `phases` 1 is `kernels`.
//
// One JSON line per configuration with the microseconds per step (median of 20 timed groups of
// 10 graph replays). Build here: nvcc -O3 -arch=sm_90 -o build/cluster_floor
// schedules/lab/cluster_floor.cu; run there: build/cluster_floor > $OUT/cluster_floor.jsonl
#include <cooperative_groups.h>

#include "floor_common.cuh"

namespace cg = cooperative_groups;

constexpr int kThreads = 256, kSteps = 270, kRead = 1024;

// The block's share of a step's weights: the first 4 vectors a thread (loaded before the step's
// synchronisation), then the rest (after it); returns their xor (the weights are zero).
struct Share {
  const uint4* base;
  long long n;
  uint4 early[4];
  __device__ __forceinline__ void first() {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long i = threadIdx.x + (long long)j * kThreads;
      early[j] = i < n ? base[i] : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ unsigned rest() const {
    unsigned bits = 0;
    for (long long i = threadIdx.x + 4LL * kThreads; i < n; i += kThreads) {
      const uint4 v = base[i];
      bits ^= v.x ^ v.y ^ v.z ^ v.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) bits ^= early[j].x ^ early[j].y ^ early[j].z ^ early[j].w;
    return bits;
  }
};

__device__ __forceinline__ float block_sum(float acc, float* warp_sums) {
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  float total = 0.f;
  for (int j = 0; j < kThreads / 32; ++j) total += warp_sums[j];
  __syncthreads();  // warp_sums is reused
  return total;
}

// `phases` dependent steps of a chain in one kernel. Step p of the kernel streams its weights
// (`w + p * w_vecs`, the block's share), then reads 4 KB of the previous step's output: for the
// kernel's first step from global memory after the PDL wait (the previous kernel wrote it), for
// the others from the cluster's shared memory after a cluster barrier (each block's 256 floats
// of the previous step, the 4 KB spread over the cluster's blocks); the last step writes global
// memory for the next kernel.
__global__ void __launch_bounds__(kThreads) chain(const float* __restrict__ in,
                                                  float* __restrict__ out,
                                                  const uint4* __restrict__ w, long long w_vecs,
                                                  int phases) {
  __shared__ float mine[2][kThreads];
  __shared__ float warp_sums[kThreads / 32];
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned csize = cluster.num_blocks(), rank = cluster.block_rank();
  const long long per_block = w_vecs / gridDim.x;
  float value = 0.f;
  for (int p = 0; p < phases; ++p) {
    Share share{w + p * w_vecs + blockIdx.x * per_block, per_block, {}};
    share.first();
    float acc;
    if (p == 0) {
      asm volatile("griddepcontrol.wait;" ::: "memory");
      asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
      acc = share.rest() == 0x9e3779b9u ? 1.f : 0.f;
      for (int i = threadIdx.x; i < kRead; i += kThreads) acc += in[i];
    } else {
      cluster.sync();  // the peers' step p - 1 values are in their shared memory
      acc = share.rest() == 0x9e3779b9u ? 1.f : 0.f;
      for (int i = threadIdx.x; i < kRead; i += kThreads) {
        const unsigned peer = (rank + i / kThreads) % csize;
        acc += cluster.map_shared_rank(mine[(p - 1) % 2], peer)[i % kThreads];
      }
    }
    value = block_sum(acc, warp_sums) * 1e-3f + 1.f;
    mine[p % 2][threadIdx.x] = value;
  }
  out[blockIdx.x * kThreads + threadIdx.x] = value;
  cluster.sync();  // no block exits while a peer may still read its shared memory
}

static int measure(int blocks, int cluster, int phases, float* a, float* b, const uint4* w,
                   long long w_vecs, cudaStream_t s) {
  if (cluster > 8)
    CHECK(cudaFuncSetAttribute(chain, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaGraph_t graph;
  const int kernels = kSteps / phases;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < kernels; ++k) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = s;
    cudaLaunchAttribute attrs[2] = {};
    attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[0].val.programmaticStreamSerializationAllowed = 1;
    attrs[1].id = cudaLaunchAttributeClusterDimension;
    attrs[1].val.clusterDim.x = cluster;
    attrs[1].val.clusterDim.y = 1;
    attrs[1].val.clusterDim.z = 1;
    cfg.attrs = attrs;
    cfg.numAttrs = cluster > 1 ? 2 : 1;
    const float* in = k % 2 ? b : a;
    float* out = k % 2 ? a : b;
    CHECK(cudaLaunchKernelEx(&cfg, chain, in, out, w + (long long)k * phases * w_vecs, w_vecs,
                             phases));
  }
  CHECK(cudaStreamEndCapture(s, &graph));
  float median = 0.f, fastest = 0.f;
  if (time_graph(graph, s, kernels * phases, &median, &fastest)) return 1;
  printf("{\"blocks\": %d, \"cluster\": %d, \"phases\": %d, \"steps\": %d, "
         "\"weight_bytes\": %lld, \"us_per_step_median\": %.3f, \"us_per_step_min\": %.3f}\n",
         blocks, cluster, phases, kernels * phases, w_vecs * 16, median, fastest);
  fflush(stdout);
  return 0;
}

int main() {
  float *a, *b;
  uint4* w;
  cudaStream_t s;
  if (chain_setup(kThreads, kSteps, 5632LL * 1024 / 16, &a, &b, &w, &s)) return 1;  // 5.5 MB
  for (long long kb : {0LL, 5632LL}) {
    const long long v = kb * 1024 / 16;
    for (int blocks : {128, 256})
      for (int cluster : {1, 2, 8, 16})
        for (int phases : {1, 2, 3, 6})
          if ((cluster > 1 || phases == 1) && measure(blocks, cluster, phases, a, b, w, v, s))
            return 1;
  }
  return 0;
}
