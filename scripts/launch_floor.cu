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
// Build here: nvcc -O3 -arch=sm_90 -o build/launch_floor scripts/launch_floor.cu
// Run there:  build/launch_floor > $OUT/launch_floor.jsonl
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                               \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      return 1;                                                                \
    }                                                                          \
  } while (0)

constexpr int kThreads = 256, kKernels = 270, kRead = 1024;

__global__ void __launch_bounds__(kThreads) step(const float* __restrict__ in,
                                                 float* __restrict__ out, int launch_dependents,
                                                 const uint4* __restrict__ w, long long w_vecs) {
  // this block's share of the weights: the first 4 vectors a thread before the wait
  const long long per_block = w_vecs / gridDim.x, base = blockIdx.x * per_block;
  unsigned bits = 0;
  uint4 early[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const long long i = threadIdx.x + (long long)j * kThreads;
    early[j] = i < per_block ? w[base + i] : make_uint4(0, 0, 0, 0);
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (launch_dependents) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  for (long long i = threadIdx.x + 4LL * kThreads; i < per_block; i += kThreads) {
    const uint4 v = w[base + i];
    bits ^= v.x ^ v.y ^ v.z ^ v.w;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) bits ^= early[j].x ^ early[j].y ^ early[j].z ^ early[j].w;
  float acc = bits == 0x9e3779b9u ? 1.f : 0.f;  // (keeps the loads; the weights are zero)
  for (int i = threadIdx.x; i < kRead; i += kThreads) acc += in[i];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  out[blockIdx.x * kThreads + threadIdx.x] = total * 1e-3f + 1.f;
}

static int measure(int blocks, int mode, float* a, float* b, const uint4* w, long long w_vecs,
                   cudaStream_t s) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
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
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(exec, s));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<float> per_kernel;
  for (int rep = 0; rep < 20; ++rep) {
    CHECK(cudaEventRecord(t0, s));
    for (int i = 0; i < 10; ++i) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(t1, s));
    CHECK(cudaEventSynchronize(t1));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    per_kernel.push_back(ms * 1e3f / (10.f * kKernels));
  }
  std::sort(per_kernel.begin(), per_kernel.end());
  const char* names[] = {"graph", "graph+pdl", "graph+pdl+launch_dependents"};
  printf("{\"blocks\": %d, \"threads\": %d, \"kernels\": %d, \"read_bytes\": %d, "
         "\"weight_bytes\": %lld, \"mode\": \"%s\", \"us_per_kernel_median\": %.3f, "
         "\"us_per_kernel_min\": %.3f}\n",
         blocks, kThreads, kKernels, kRead * 4, w_vecs * 16, names[mode],
         per_kernel[per_kernel.size() / 2], per_kernel[0]);
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return 0;
}

int main() {
  float *a, *b;
  const size_t n = 1024 * kThreads;
  CHECK(cudaMalloc(&a, n * sizeof(float)));
  CHECK(cudaMalloc(&b, n * sizeof(float)));
  CHECK(cudaMemset(a, 0, n * sizeof(float)));
  CHECK(cudaMemset(b, 0, n * sizeof(float)));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("{\"gpu\": \"%s\", \"sms\": %d}\n", prop.name, prop.multiProcessorCount);
  const long long max_vecs = 5632LL * 1024 / 16 * 264 / 264;  // 5.5 MB a kernel
  uint4* w;
  CHECK(cudaMalloc(&w, kKernels * max_vecs * sizeof(uint4)));
  CHECK(cudaMemset(w, 0, kKernels * max_vecs * sizeof(uint4)));
  for (int blocks : {1, 16, 132, 264, 528})
    for (int mode = 0; mode < 3; ++mode)
      if (measure(blocks, mode, a, b, w, 0, s)) return 1;
  for (long long kb : {512LL, 2048LL, 5632LL})
    for (int mode = 0; mode < 3; ++mode)
      if (measure(264, mode, a, b, w, kb * 1024 / 16, s)) return 1;
  return 0;
}
