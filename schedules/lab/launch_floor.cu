// The floor of a chain of dependent kernels in one CUDA graph, the shape of a decode step.
//
// A batch-1 decode step of V2-Lite is 279 dependent kernels (docs/benchmarks.md): each reads
// what the previous one wrote (a few KB, from L2) and writes its own output. This measures what
// such a chain costs when the kernels do (almost) nothing: 270 kernels of `blocks` x 256
// threads, each waiting on its predecessor (`griddepcontrol.wait`), reading 4 KB of the
// predecessor's output, reducing it per block and writing 256 floats per block; captured into a
// graph three ways: plain launches, programmatic launches (PDL: the `--pdl` builds' edges), and
// PDL with `griddepcontrol.launch_dependents` right after the wait. With `weight_mb` > 0 each
// kernel also streams its own `weight_mb` of "weights" from HBM (a different region per kernel,
// 270 of them: no L2 reuse), the first 4 x 16 bytes a thread before the wait, as the hand GEMVs
// do; 5.5 MB is a V2-Lite decode step's 1.49 GB over its kernels. Prints one JSON line per
// configuration with the microseconds per kernel (median of 20 timed groups of 10 replays).
//
// The same chain as one persistent kernel (`phases`, `phases_tma` below): `blocks` co-resident
// blocks run the 270 steps as phases separated by a grid barrier (one add per block on a counter
// in global memory, `__threadfence` + `atomicAdd` or `red.release`, then thread 0 spins on it
// with acquire loads), the shape a per-layer or per-step megakernel would have. With
// `smem_stages` 0 a phase loads its first 4 x 16 bytes a thread before its barrier (as the PDL
// chain does before its wait), the rest after; with `smem_stages` S >= 2 the block's share of
// phase k + S - 1's weights is issued into a ring of S shared-memory slots at the start of
// phase k (`cp.async`, or one `cp.async.bulk` on an mbarrier for `tma_stages`), so the weights
// of a phase never wait for its barrier; barrier "none" (no synchronisation at all, not a
// correct chain) is the weights' stream rate alone. One JSON line per configuration with the
// microseconds per phase (median of 20 timed launches).
//
// Build here: nvcc -O3 -arch=sm_90 -o build/launch_floor schedules/lab/launch_floor.cu
// Run there:  build/launch_floor > $OUT/launch_floor.jsonl
#include "floor_common.cuh"

constexpr int kThreads = 256, kKernels = 270, kRead = 1024;

__global__ void __launch_bounds__(kThreads) step(const float* __restrict__ in,
                                                 float* __restrict__ out, int launch_dependents,
                                                 const uint4* __restrict__ w, long long w_vecs) {
  // this block's share of the weights: the first 4 vectors a thread before the wait
  const long long per_block = w_vecs / gridDim.x, base = blockIdx.x * per_block;
  uint4 early[4];
  chain_step_first<kThreads>(w, base, per_block, early);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (launch_dependents) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  chain_step_rest<kThreads, kRead>(in, out, w, base, per_block, early);
}

// A grid barrier: every block arrives once on a 64-bit counter (zeroed before the launch) and
// waits for `target` arrivals. kRed: a `red.release` add with no fence; else the cooperative
// groups recipe (__threadfence + atomicAdd). kNone (a reference for the weights' stream rate, not
// a correct chain): no barrier at all.
enum Barrier { kFence = 0, kRed = 1, kNone = 2 };

template <int kBarrier>
__device__ __forceinline__ void grid_barrier(unsigned long long* counter,
                                             unsigned long long target) {
  if (kBarrier == kNone) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (kBarrier == kRed) {
      asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
    } else {
      __threadfence();
      atomicAdd(counter, 1ULL);
    }
    unsigned long long seen;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}

// The end of a persistent phase: the previous phase's output (4 KB, from L2: written by other
// blocks) reduced per block and this phase's written, as the `step` kernel does.
__device__ __forceinline__ void end_phase(const float* in, float* out, unsigned bits,
                                          float* warp_sums) {
  float acc = bits == 0x9e3779b9u ? 1.f : 0.f;
  for (int i = threadIdx.x; i < kRead; i += kThreads) acc += __ldcg(in + i);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  float total = 0.f;
  for (int j = 0; j < kThreads / 32; ++j) total += warp_sums[j];
  __syncthreads();  // warp_sums is reused by the next phase
  out[blockIdx.x * kThreads + threadIdx.x] = total * 1e-3f + 1.f;
}

// kStages == 0: a phase loads its first 4 x 16 bytes a thread before its barrier, the rest after;
// kStages >= 2: a ring of kStages shared-memory slots, phase k + kStages - 1's share issued with
// cp.async at the start of phase k (so kStages - 1 phases of weights are in flight).
template <int kStages, int kBarrier, bool kWarp0Copies = true>
__global__ void __launch_bounds__(kThreads) phases(float* a, float* b, const uint4* __restrict__ w,
                                                   long long w_vecs,
                                                   unsigned long long* counter) {
  extern __shared__ uint4 ring[];  // [kStages][per_block]
  constexpr int kSlots = kStages > 0 ? kStages : 1;
  __shared__ float warp_sums[kThreads / 32];
  const long long per_block = w_vecs / gridDim.x;
  unsigned bits = 0;
  auto issue = [&](int k) {  // phase k's share into slot k % kStages (none past the last phase)
    if (k < kKernels) {
      const uint4* src = w + k * w_vecs + blockIdx.x * per_block;
      uint4* dst = ring + (k % kSlots) * per_block;
      // kWarp0Copies false: warp 0 (whose thread 0 arrives at the barrier) issues none
      constexpr int kFirst = kWarp0Copies ? 0 : 32;
      for (long long i = (long long)threadIdx.x - kFirst; i < per_block; i += kThreads - kFirst)
        if (i >= 0) cp_async16(dst + i, src + i);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  if (kStages > 0)
    for (int k = 0; k + 1 < kStages; ++k) issue(k);
  for (int k = 0; k < kKernels; ++k) {
    const uint4* wk = w + k * w_vecs + blockIdx.x * per_block;
    uint4 early[4];
    if (kStages == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long long i = threadIdx.x + (long long)j * kThreads;
        early[j] = i < per_block ? wk[i] : make_uint4(0, 0, 0, 0);
      }
    } else {
      issue(k + kStages - 1);
    }
    if (k > 0) grid_barrier<kBarrier>(counter, (unsigned long long)k * gridDim.x);
    if (kStages > 0) {
      asm volatile("cp.async.wait_group %0;" ::"n"(kSlots - 1) : "memory");
      __syncthreads();
      const uint4* mine = ring + (k % kSlots) * per_block;
      for (long long i = threadIdx.x; i < per_block; i += kThreads) {
        const uint4 v = mine[i];
        bits ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    } else {
      for (long long i = threadIdx.x + 4LL * kThreads; i < per_block; i += kThreads) {
        const uint4 v = wk[i];
        bits ^= v.x ^ v.y ^ v.z ^ v.w;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) bits ^= early[j].x ^ early[j].y ^ early[j].z ^ early[j].w;
    }
    end_phase(k % 2 ? b : a, k % 2 ? a : b, bits, warp_sums);
  }
}

// As phases<kStages, kRed>, the weights copied by the TMA unit: thread 32 (warp 1, not the
// barrier's thread) issues one cp.async.bulk of the block's whole share per phase into slot
// k % kStages, completing on that slot's mbarrier; every thread waits on the mbarrier's parity.
template <int kStages>
__global__ void __launch_bounds__(kThreads) phases_tma(float* a, float* b,
                                                       const uint4* __restrict__ w,
                                                       long long w_vecs,
                                                       unsigned long long* counter) {
  extern __shared__ uint4 ring[];  // [kStages][per_block]
  __shared__ __align__(8) unsigned long long bars[kStages];
  __shared__ float warp_sums[kThreads / 32];
  const long long per_block = w_vecs / gridDim.x;
  const unsigned bytes = static_cast<unsigned>(per_block * sizeof(uint4));
  auto smem = [](const void* ptr) {
    return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
  };
  auto issue = [&](int k) {
    if (threadIdx.x == 32 && k < kKernels) {
      unsigned long long* bar = bars + k % kStages;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                   ::"r"(smem(bar)), "r"(bytes) : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(smem(ring + (k % kStages) * per_block)),
          "l"(w + k * w_vecs + blockIdx.x * per_block), "r"(bytes), "r"(smem(bar))
          : "memory");
    }
  };
  if (threadIdx.x < kStages)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(bars + threadIdx.x))
                 : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  for (int k = 0; k + 1 < kStages; ++k) issue(k);
  unsigned bits = 0;
  for (int k = 0; k < kKernels; ++k) {
    issue(k + kStages - 1);
    if (k > 0) grid_barrier<kRed>(counter, (unsigned long long)k * gridDim.x);
    unsigned done = 0;
    const unsigned parity = (k / kStages) & 1;
    while (!done)
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done) : "r"(smem(bars + k % kStages)), "r"(parity) : "memory");
    const uint4* mine = ring + (k % kStages) * per_block;
    for (long long i = threadIdx.x; i < per_block; i += kThreads) {
      const uint4 v = mine[i];
      bits ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    end_phase(k % 2 ? b : a, k % 2 ? a : b, bits, warp_sums);  // (then the slot is free)
  }
}

// Times `kernel` (a persistent chain of kKernels phases, `smem` bytes of dynamic shared memory)
// on `blocks` blocks: one JSON line with `label` (its configuration) and us per phase.
template <class Kernel>
static int time_persistent(Kernel kernel, const char* label, int blocks, int smem, float* a,
                           float* b, const uint4* w, long long w_vecs,
                           unsigned long long* counter, cudaStream_t s) {
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0, sms = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (per_sm * sms < blocks) {
    printf("{\"blocks\": %d, %s, \"mode\": \"skipped: not co-resident\"}\n", blocks, label);
    return 0;
  }
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<float> per_phase;
  for (int rep = 0; rep < 25; ++rep) {
    CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned long long), s));
    CHECK(cudaEventRecord(t0, s));
    kernel<<<blocks, kThreads, smem, s>>>(a, b, w, w_vecs, counter);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(t1, s));
    CHECK(cudaEventSynchronize(t1));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (rep >= 5) per_phase.push_back(ms * 1e3f / kKernels);
  }
  std::sort(per_phase.begin(), per_phase.end());
  printf("{\"blocks\": %d, \"threads\": %d, \"kernels\": 1, \"phases\": %d, \"read_bytes\": %d, "
         "\"weight_bytes\": %lld, \"mode\": \"persistent\", %s, \"us_per_phase_median\": %.3f, "
         "\"us_per_phase_min\": %.3f}\n",
         blocks, kThreads, kKernels, kRead * 4, w_vecs * 16, label,
         per_phase[per_phase.size() / 2], per_phase[0]);
  return 0;
}

template <int kStages>
static int measure_tma(int blocks, float* a, float* b, const uint4* w, long long w_vecs,
                       unsigned long long* counter, cudaStream_t s) {
  char label[96];
  snprintf(label, sizeof label, "\"barrier\": \"red.release\", \"tma_stages\": %d", kStages);
  const int smem = kStages * (int)(w_vecs / blocks) * (int)sizeof(uint4);
  return time_persistent(phases_tma<kStages>, label, blocks, smem, a, b, w, w_vecs, counter, s);
}

template <int kStages, int kBarrier, bool kWarp0Copies = true>
static int measure_persistent(int blocks, float* a, float* b, const uint4* w, long long w_vecs,
                              unsigned long long* counter, cudaStream_t s) {
  char label[128];
  snprintf(label, sizeof label, "\"barrier\": \"%s\", \"smem_stages\": %d, \"warp0_copies\": %d",
           kBarrier == kRed     ? "red.release"
           : kBarrier == kFence ? "threadfence+atomicAdd"
                                : "none",
           kStages, kWarp0Copies ? 1 : 0);
  const int smem = kStages * (int)(w_vecs / blocks) * (int)sizeof(uint4);
  return time_persistent(phases<kStages, kBarrier, kWarp0Copies>, label, blocks, smem, a, b, w,
                         w_vecs, counter, s);
}

static int measure(int blocks, int mode, float* a, float* b, const uint4* w, long long w_vecs,
                   cudaStream_t s) {
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < kKernels; ++k) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = s;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = mode > 0 ? 1 : 0;
    const float* in = k % 2 ? b : a;
    float* out = k % 2 ? a : b;
    CHECK(cudaLaunchKernelEx(&cfg, step, in, out, mode == 2 ? 1 : 0, w + k * w_vecs, w_vecs));
  }
  CHECK(cudaStreamEndCapture(s, &graph));
  float median = 0.f, fastest = 0.f;
  if (time_graph(graph, s, kKernels, &median, &fastest)) return 1;
  const char* names[] = {"graph", "graph+pdl", "graph+pdl+launch_dependents"};
  printf("{\"blocks\": %d, \"threads\": %d, \"kernels\": %d, \"read_bytes\": %d, "
         "\"weight_bytes\": %lld, \"mode\": \"%s\", \"us_per_kernel_median\": %.3f, "
         "\"us_per_kernel_min\": %.3f}\n",
         blocks, kThreads, kKernels, kRead * 4, w_vecs * 16, names[mode], median, fastest);
  return 0;
}

int main() {
  float *a, *b;
  uint4* w;
  cudaStream_t s;
  if (chain_setup(kThreads, kKernels, 5632LL * 1024 / 16, &a, &b, &w, &s)) return 1;  // 5.5 MB
  for (int blocks : {1, 16, 132, 264, 528})
    for (int mode = 0; mode < 3; ++mode)
      if (measure(blocks, mode, a, b, w, 0, s)) return 1;
  for (long long kb : {512LL, 2048LL, 5632LL})
    for (int mode = 0; mode < 3; ++mode)
      if (measure(264, mode, a, b, w, kb * 1024 / 16, s)) return 1;
  unsigned long long* counter;
  CHECK(cudaMalloc(&counter, sizeof(unsigned long long)));
  for (int blocks : {132, 264}) {
    for (long long kb : {0LL, 512LL, 5632LL}) {
      const long long v = kb * 1024 / 16;
      if (measure_persistent<0, kFence>(blocks, a, b, w, v, counter, s)) return 1;
      if (measure_persistent<0, kRed>(blocks, a, b, w, v, counter, s)) return 1;
    }
    const long long v = 5632LL * 1024 / 16;
    if (measure_persistent<2, kRed>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_persistent<3, kRed>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_persistent<4, kRed>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_persistent<3, kRed, false>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_persistent<3, kFence, false>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_persistent<0, kNone>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_persistent<3, kNone>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_tma<2>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_tma<3>(blocks, a, b, w, v, counter, s)) return 1;
    if (measure_tma<4>(blocks, a, b, w, v, counter, s)) return 1;
  }
  return 0;
}
