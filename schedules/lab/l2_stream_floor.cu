// Whether streaming weights into L2 ahead of a chain of dependent kernels makes the chain cheaper.
//
// `launch_floor.cu` measured the decode step's shape: 270 dependent kernels (PDL, each releasing
// its dependent after its wait), each streaming its own 5.5 MB of weights from HBM, cost ~3.1 us a
// kernel, of which ~1.3 us is the boundary and the rest the weights (a kernel's bytes are too few
// to reach the HBM's rate). Most of a decode step's weights are known before the kernel that reads
// them starts (all but the routed experts, which the router picks a kernel earlier), so a second
// branch of the graph could pull them into L2 a few kernels ahead, over the boundaries, and the
// chain would read them from L2. This measures that on the chain (264 blocks of 256 threads, 4 KB
// read from the predecessor's output, graph + PDL + `launch_dependents`), for two layouts of
// the weights: `uniform` (270 kernels of 5.5 MB, all or 44 % of each prefetchable) and
// `v2_lite_layers` (26 MoE layers of 10 kernels with V2-Lite's bytes at 4K context, 1.25 GB, the
// 44 % known ahead: attention weights, latent pages, shared experts, router):
//
// * `chain`: no prefetch (the model today);
// * `l2_resident`: every kernel reads the same 5.5 MB (the floor of a chain whose weights are
//   all in L2);
// * `prefetcher`: one persistent kernel of `pblocks` x `pthreads` beside the chain; kernel k
//   publishes its start (block 0, after its wait) on a counter, and the prefetcher touches kernel
//   j's prefetchable bytes once kernel j - `ahead` has started;
// * `side_nodes`: after kernel k completes, a prefetch kernel on a second stream (a branch of the
//   graph) touches kernel k + `ahead`'s bytes.
//
// How bytes are touched (`method`): `bulk` (`cp.async.bulk.prefetch.L2`, 32 KB an instruction),
// `loads` (16-byte loads, L2 evict-last with `evict_last`), `lines` (`prefetch.global.L2`, a
// 128-byte line an instruction). `lag`: how many kernels ahead the prefetcher was when each
// kernel started (last replay). `hit_test`: a 5.5 MB read after a prefetch of it, against a cold
// and a warm read (event-timed, launch included). One JSON line per configuration with the
// microseconds per kernel (median of 20 timed groups of 10 graph replays).
// Build here: nvcc -O3 -arch=sm_90 -o build/l2_stream_floor schedules/lab/l2_stream_floor.cu
// Run there:  build/l2_stream_floor > $OUT/l2_stream_floor.jsonl
#include <chrono>
#include <thread>

#include "floor_common.cuh"

constexpr int kThreads = 256, kKernels = 270, kRead = 1024, kBlocks = 264;
constexpr long long kChunk = 32 * 1024;  // bytes a prefetch instruction

__global__ void __launch_bounds__(kThreads) step(const float* __restrict__ in,
                                                 float* __restrict__ out,
                                                 const uint4* __restrict__ w, long long w_vecs,
                                                 unsigned* progress, unsigned k,
                                                 const unsigned* pf_done, int* lag) {
  const long long per_block = w_vecs / gridDim.x, base = blockIdx.x * per_block;
  uint4 early[4];
  chain_step_first<kThreads>(w, base, per_block, early);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (progress != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(progress), "r"(k + 1) : "memory");
  if (lag != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned done;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(pf_done) : "memory");
    lag[k] = (int)done - (int)k;  // kernels prefetched ahead of this one (negative: behind)
  }
  chain_step_rest<kThreads, kRead>(in, out, w, base, per_block, early);
}

enum Method { kBulk = 0, kLoads = 1, kLines = 2 };

// [region, region + bytes) into L2 by this grid's threads: plain 16-byte loads (L2 evict-last with
// `evict_last`), or one `prefetch.global.L2` a 128-byte line; returns the loads' xor.
__device__ __forceinline__ unsigned touch_region(const char* region, long long bytes, int method,
                                                 bool evict_last) {
  unsigned bits = 0;
  const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const long long nthreads = (long long)gridDim.x * blockDim.x;
  if (method == kLoads) {
    unsigned long long policy = 0;
    if (evict_last)
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    const uint4* v = reinterpret_cast<const uint4*>(region);
    const long long n = bytes / 16;
    for (long long i = tid; i < n; i += 4 * nthreads) {
      uint4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const long long e = i + u * nthreads;
        if (e < n) {
          if (evict_last)
            asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                         : "=r"(x[u].x), "=r"(x[u].y), "=r"(x[u].z), "=r"(x[u].w)
                         : "l"(v + e), "l"(policy));
          else
            x[u] = __ldcg(v + e);
        } else {
          x[u] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) bits ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
  } else {
    for (long long off = tid * 128; off < bytes; off += nthreads * 128) {
      if (evict_last)
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(region + off) : "memory");
      else
        asm volatile("prefetch.global.L2 [%0];" ::"l"(region + off) : "memory");
    }
  }
  return bits;
}

// This block's chunks of [region, region + bytes) into L2, one bulk prefetch a lane.
__device__ __forceinline__ void prefetch_region(const char* region, long long bytes,
                                                bool evict_last) {
  const long long chunks = (bytes + kChunk - 1) / kChunk;
  unsigned long long policy = 0;
  if (evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  for (long long c = blockIdx.x * blockDim.x + threadIdx.x; c < chunks;
       c += (long long)gridDim.x * blockDim.x) {
    const long long off = c * kChunk;
    const unsigned n = static_cast<unsigned>(bytes - off < kChunk ? bytes - off : kChunk);
    if (evict_last)
      asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                   ::"l"(region + off), "r"(n), "l"(policy) : "memory");
    else
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(region + off), "r"(n)
                   : "memory");
  }
}

__global__ void prefetch_kernel(const char* region, long long bytes, int evict_last,
                                int method, unsigned* sink) {
  if (method == kBulk) {
    prefetch_region(region, bytes, evict_last != 0);
  } else {
    const unsigned bits = touch_region(region, bytes, method, evict_last != 0);
    if (bits == 0x9e3779b9u) *sink = bits;
  }
}

// Reads [region, region + bytes) (the chain kernel's loads without its chain): how fast a
// prefetched region reads against a cold and a warm one.
__global__ void read_kernel(const uint4* __restrict__ w, long long n, unsigned* sink) {
  unsigned bits = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = w[i];
    bits ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (bits == 0x9e3779b9u) *sink = bits;
}

// Kernel j's prefetchable bytes ([offsets[j], offsets[j] + bytes[j]) of `w`) once kernel
// j - ahead has started; publishes (block 0) the kernels it has issued.
__global__ void prefetcher(const char* w, const long long* offsets, const long long* bytes,
                           int kernels, int ahead, const unsigned* progress, int evict_last,
                           int method, unsigned* pf_done) {
  unsigned bits = 0;
  for (int j = 0; j < kernels; ++j) {
    if (threadIdx.x == 0 && j - ahead >= 0) {
      unsigned seen;
      do {
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(progress)
                     : "memory");
      } while ((int)seen < j - ahead + 1);
    }
    __syncthreads();
    if (bytes[j] > 0) {
      if (method == kBulk)
        prefetch_region(w + offsets[j], bytes[j], evict_last != 0);
      else
        bits ^= touch_region(w + offsets[j], bytes[j], method, evict_last != 0);
    }
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0)  // (block 0's share only: a lower bound of the rest)
      asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(pf_done), "r"(j + 1) : "memory");
  }
  if (bits == 0x9e3779b9u) pf_done[1] = bits;
}

enum Mode { kChain = 0, kResident = 1, kSideNodes = 2, kPrefetcher = 3 };

// The chain's kernels: kernel k reads `vecs[k]` 16-byte vectors from `offsets[k]` bytes into the
// weights, of which the first `pf_bytes[k]` may be prefetched.
struct Layout {
  const char* name;
  std::vector<long long> offsets, vecs, pf_bytes;
  long long* d_offsets;
  long long* d_pf;
};

// `kernels` kernels of `mb` MB each, the first `fraction` of each prefetchable.
static Layout uniform(int kernels, double mb, double fraction) {
  Layout l = {"uniform", {}, {}, {}, nullptr, nullptr};
  const long long v = (long long)(mb * 1024 * 1024) / 16;
  for (int k = 0; k < kernels; ++k) {
    l.offsets.push_back(k * v * 16);
    l.vecs.push_back(v);
    l.pf_bytes.push_back((long long)(v * fraction) * 16);
  }
  return l;
}

// 26 V2-Lite MoE layers at 4K context, 10 kernels each (MB read, MB known before the kernel):
// add+norm+qkv_a, MLA prologue (W_UK), KV append, attention split (the layer's latent pages),
// merge (partials, L2: none), W_UV, o_proj, add+norm+router, gate/up (shared + 6 routed
// experts), down (shared + routed). The routed experts' rows are not known ahead.
static Layout v2_lite_layers() {
  const double mb[10][2] = {{3.9, 3.9}, {0.56, 0.56}, {0, 0},     {4.7, 4.7},   {0, 0},
                            {0.56, 0.56}, {2.2, 2.2}, {0.27, 0.27}, {23.9, 6.0}, {11.9, 3.0}};
  Layout l = {"v2_lite_layers", {}, {}, {}, nullptr, nullptr};
  long long off = 0;
  for (int layer = 0; layer < 26; ++layer)
    for (auto& k : mb) {
      const long long v = (long long)(k[0] * 1024 * 1024) / 16;
      l.offsets.push_back(off);
      l.vecs.push_back(v);
      l.pf_bytes.push_back((long long)(k[1] * 1024 * 1024) / 16 * 16);
      off += v * 16;
    }
  return l;
}

struct Config {
  int mode, pblocks, pthreads, ahead, evict_last, method;
};

struct Buffers {
  float *a, *b;
  const char* w;
  unsigned *progress, *pf_done;
  int* lag;
  cudaStream_t s, s2;
};

static int upload(Layout* l) {
  const size_t n = l->offsets.size() * sizeof(long long);
  CHECK(cudaMalloc(&l->d_offsets, n));
  CHECK(cudaMalloc(&l->d_pf, n));
  CHECK(cudaMemcpy(l->d_offsets, l->offsets.data(), n, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(l->d_pf, l->pf_bytes.data(), n, cudaMemcpyHostToDevice));
  return 0;
}

static int measure(const Layout& l, const Config& c, const Buffers& m) {
  const int kernels = (int)l.offsets.size();
  std::vector<cudaEvent_t> events;
  auto fork = [&](cudaStream_t from, cudaStream_t to) -> int {
    cudaEvent_t ev;
    CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    events.push_back(ev);
    CHECK(cudaEventRecord(ev, from));
    CHECK(cudaStreamWaitEvent(to, ev, 0));
    return 0;
  };
  auto side_node = [&](int j) -> int {
    if (l.pf_bytes[j] == 0) return 0;
    prefetch_kernel<<<c.pblocks, c.pthreads, 0, m.s2>>>(m.w + l.offsets[j], l.pf_bytes[j],
                                                        c.evict_last, c.method, m.pf_done + 1);
    CHECK(cudaGetLastError());
    return 0;
  };
  const bool side = c.mode == kSideNodes || c.mode == kPrefetcher;
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(m.s, cudaStreamCaptureModeGlobal));
  CHECK(cudaMemsetAsync(m.progress, 0, sizeof(unsigned), m.s));
  CHECK(cudaMemsetAsync(m.pf_done, 0, 2 * sizeof(unsigned), m.s));
  if (side) {
    if (fork(m.s, m.s2)) return 1;
    if (c.mode == kPrefetcher) {
      prefetcher<<<c.pblocks, c.pthreads, 0, m.s2>>>(m.w, l.d_offsets, l.d_pf, kernels, c.ahead,
                                                     m.progress, c.evict_last, c.method,
                                                     m.pf_done);
      CHECK(cudaGetLastError());
    } else {
      for (int j = 0; j < c.ahead && j < kernels; ++j)
        if (side_node(j)) return 1;
    }
  }
  for (int k = 0; k < kernels; ++k) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kBlocks);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = m.s;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    const float* in = k % 2 ? m.b : m.a;
    float* out = k % 2 ? m.a : m.b;
    const uint4* wk = reinterpret_cast<const uint4*>(m.w + (c.mode == kResident ? 0 : l.offsets[k]));
    const bool pf = c.mode == kPrefetcher;
    CHECK(cudaLaunchKernelEx(&cfg, step, in, out, wk, l.vecs[k], pf ? m.progress : nullptr,
                             (unsigned)k, (const unsigned*)m.pf_done, pf ? m.lag : nullptr));
    if (c.mode == kSideNodes && k + c.ahead < kernels) {
      if (fork(m.s, m.s2) || side_node(k + c.ahead)) return 1;
    }
  }
  if (side && fork(m.s2, m.s)) return 1;
  CHECK(cudaStreamEndCapture(m.s, &graph));
  for (cudaEvent_t ev : events) CHECK(cudaEventDestroy(ev));
  float median = 0.f, fastest = 0.f;
  if (time_graph(graph, m.s, kernels, &median, &fastest)) return 1;
  double lag_mean = 0.0;
  int lag_min = 0;
  if (c.mode == kPrefetcher) {  // the last replay's lags
    std::vector<int> lag(kernels);
    CHECK(cudaMemcpy(lag.data(), m.lag, kernels * sizeof(int), cudaMemcpyDeviceToHost));
    lag_min = lag[0];
    for (int x : lag) lag_mean += x / (double)kernels, lag_min = std::min(lag_min, x);
  }
  long long total = 0, pf_total = 0;
  for (int k = 0; k < kernels; ++k) total += l.vecs[k] * 16, pf_total += l.pf_bytes[k];
  const char* names[] = {"chain", "l2_resident", "side_nodes", "prefetcher"};
  const char* methods[] = {"bulk", "loads", "lines"};
  printf("{\"layout\": \"%s\", \"kernels\": %d, \"mode\": \"%s\", \"blocks\": %d, "
         "\"weight_bytes\": %lld, \"prefetchable_bytes\": %lld, \"pblocks\": %d, "
         "\"pthreads\": %d, \"method\": \"%s\", \"ahead\": %d, \"evict_last\": %d, "
         "\"us_per_kernel_median\": %.3f, \"us_per_kernel_min\": %.3f, \"us_per_chain\": %.1f, "
         "\"lag_mean\": %.2f, \"lag_min\": %d}\n",
         l.name, kernels, names[c.mode], kBlocks, total, pf_total, c.pblocks, c.pthreads,
         methods[c.method], c.ahead, c.evict_last, median, fastest, median * kernels, lag_mean,
         lag_min);
  fflush(stdout);
  return 0;
}

// Reads of a 5.5 MB region after a prefetch of it (and a pause), against a cold and a warm read:
// whether each method's prefetched bytes are L2 hits. Microseconds of the read kernel alone.
static int hit_test(const Buffers& m, long long region_vecs, int method, int evict_last) {
  const long long bytes = region_vecs * 16;
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  auto timed_read = [&](const uint4* r, float* us) -> int {
    CHECK(cudaEventRecord(t0, m.s));
    read_kernel<<<kBlocks, kThreads, 0, m.s>>>(r, region_vecs, m.pf_done + 1);
    CHECK(cudaEventRecord(t1, m.s));
    CHECK(cudaEventSynchronize(t1));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    *us = ms * 1e3f;
    return 0;
  };
  std::vector<float> cold, warm, hit;
  for (int rep = 0; rep < 11; ++rep) {
    // regions far apart in the chain's weights, a fresh one each time (the chain's 1.5 GB)
    const uint4* w = reinterpret_cast<const uint4*>(m.w);
    const uint4* x = w + (long long)(rep * 24 + 1) * region_vecs;
    const uint4* y = w + (long long)(rep * 24 + 13) * region_vecs;
    float us = 0.f;
    if (timed_read(y, &us)) return 1;
    cold.push_back(us);
    if (timed_read(y, &us)) return 1;
    warm.push_back(us);
    prefetch_kernel<<<132, 128, 0, m.s>>>(reinterpret_cast<const char*>(x), bytes, evict_last,
                                         method, m.pf_done + 1);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(m.s));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (timed_read(x, &us)) return 1;
    hit.push_back(us);
  }
  for (auto* v : {&cold, &warm, &hit}) std::sort(v->begin(), v->end());
  const char* methods[] = {"bulk", "loads", "lines"};
  printf("{\"hit_test\": \"%s\", \"evict_last\": %d, \"region_bytes\": %lld, \"cold_us\": %.2f, "
         "\"warm_us\": %.2f, \"prefetched_us\": %.2f}\n",
         methods[method], evict_last, bytes, cold[5], warm[5], hit[5]);
  fflush(stdout);
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  return 0;
}

int main() {
  Buffers m = {};
  uint4* w;
  Layout layouts[] = {uniform(kKernels, 5.5, 1.0), uniform(kKernels, 5.5, 0.44), v2_lite_layers()};
  long long total = 0;
  for (auto& l : layouts) total = std::max(total, l.offsets.back() + l.vecs.back() * 16);
  if (chain_setup(kThreads, 1, total / 16, &m.a, &m.b, &w, &m.s)) return 1;
  m.w = reinterpret_cast<const char*>(w);
  for (auto& l : layouts)
    if (upload(&l)) return 1;
  CHECK(cudaStreamCreateWithFlags(&m.s2, cudaStreamNonBlocking));
  CHECK(cudaMalloc(&m.progress, sizeof(unsigned)));
  CHECK(cudaMalloc(&m.pf_done, 2 * sizeof(unsigned)));
  CHECK(cudaMalloc(&m.lag, kKernels * sizeof(int)));
  const long long v = 5632LL * 1024 / 16;
  for (int method : {kBulk, kLoads, kLines})
    if (hit_test(m, v, method, 1)) return 1;
  for (int rep = 0; rep < 2; ++rep)
    for (auto& l : layouts) {
      if (measure(l, {kChain, 0, 0, 0, 0, 0}, m)) return 1;
      if (&l == &layouts[0] && measure(l, {kResident, 0, 0, 0, 0, 0}, m)) return 1;
      for (int ahead : {1, 2, 3, 5, 10})
        for (int pblocks : {66, 132})
          if (measure(l, {kPrefetcher, pblocks, 128, ahead, 1, kLines}, m)) return 1;
      for (int ahead : {1, 2, 3})
        if (measure(l, {kPrefetcher, 132, 128, ahead, 0, kLines}, m)) return 1;
      for (int ahead : {1, 2, 3, 5})
        if (measure(l, {kSideNodes, 132, 128, ahead, 1, kLines}, m)) return 1;
      if (measure(l, {kPrefetcher, 132, 256, 2, 1, kLoads}, m)) return 1;
    }
  return 0;
}
