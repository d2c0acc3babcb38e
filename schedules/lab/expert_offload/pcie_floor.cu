// How fast the GPU reaches routed-expert weights that live in host memory (Engine(experts="host")).
//
// DeepSeek-V2-Lite at q4f16_g128: one routed expert is 4,460,544 bytes (gate_up 2816 x 2048 and
// down 2048 x 1408 INT4 codes, one fp16 scale per 128 inputs); a decode token reads 6 experts in
// each of 26 MoE layers, 156 experts, 0.696 GB. This measures:
//
// * `memcpy`: pinned host -> device `cudaMemcpyAsync` of one expert (4.46 MB), of one layer's 6
//   (back to back on one stream), of a token's 156, and of 1 GB (copy-then-compute's floor);
// * `zero_copy`: a kernel reading pinned, mapped host memory (cudaHostAllocMapped) with 16-byte
//   loads, xor-reducing them: a token's 156 experts scattered over a 7.4 GB buffer (26 layers x
//   64 experts, 6 picked at random per layer, new picks each repetition), either as one launch
//   (`token`) or as 26 launches of 6 experts each (`per_layer`, as decode reads them), for a
//   sweep of blocks per expert;
// * `hbm_reference`: the same kernel over device memory (what the all-resident run reads at).
//
// Every time is the median of the repetitions (CUDA events); GB/s is 1e9 bytes per second. One
// JSON object on stdout.
// Build here: nvcc -O3 -arch=sm_90 -o build/expert_offload/pcie_floor
//               schedules/lab/expert_offload/pcie_floor.cu  (one line)
// Run there:  build/expert_offload/pcie_floor > $OUT/pcie_floor.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));   \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

constexpr long long kExpertBytes = 2816LL * 2048 / 2 + 2816LL * 16 * 2  // gate_up codes, scales
                                   + 2048LL * 1408 / 2 + 2048LL * 11 * 2;  // down codes, scales
constexpr int kLayers = 26, kExperts = 64, kTopK = 6, kThreads = 256, kPicks = 8;
constexpr long long kExpertVecs = kExpertBytes / 16;
static_assert(kExpertBytes % 16 == 0, "an expert is a whole number of 16-byte vectors");

// Block (x, y) reads its share of region y (regions[y] is its first vector): 4 independent loads
// a thread in flight, xor-reduced; a result that cannot happen is written (keeps the loads).
__global__ void __launch_bounds__(kThreads)
    read_regions(const uint4* __restrict__ base, const long long* __restrict__ regions,
                 long long vecs, unsigned* __restrict__ out) {
  const uint4* r = base + regions[blockIdx.y];
  const long long stride = (long long)gridDim.x * kThreads;
  unsigned bits = 0;
  long long i = (long long)blockIdx.x * kThreads + threadIdx.x;
  for (; i + 3 * stride < vecs; i += 4 * stride) {
    uint4 a = r[i], b = r[i + stride], c = r[i + 2 * stride], d = r[i + 3 * stride];
    bits ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
            d.z ^ d.w;
  }
  for (; i < vecs; i += stride) {
    uint4 a = r[i];
    bits ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (bits == 0x9e3779b9u) out[blockIdx.y] = bits;
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
  }
  void start(cudaStream_t s) { CHECK(cudaEventRecord(a, s)); }
  float stop_ms(cudaStream_t s) {
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

static std::string row(const char* name, long long bytes, float ms) {
  char buf[256];
  snprintf(buf, sizeof buf, "{\"case\": \"%s\", \"bytes\": %lld, \"us\": %.1f, \"GBps\": %.2f}",
           name, bytes, ms * 1e3, bytes / (ms * 1e-3) / 1e9);
  return buf;
}

// The first vector of each of a token's 156 experts: 6 distinct of 64 per layer, at random.
static std::vector<long long> pick(std::mt19937& rng) {
  std::vector<long long> out;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<int> e(kExperts);
    for (int i = 0; i < kExperts; ++i) e[i] = i;
    std::shuffle(e.begin(), e.end(), rng);
    for (int k = 0; k < kTopK; ++k) out.push_back(((long long)l * kExperts + e[k]) * kExpertVecs);
  }
  return out;
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Timer t;
  std::vector<std::string> rows;
  const long long token = kExpertBytes * kLayers * kTopK, gig = 1LL << 30;

  // -- memcpy: pinned host -> device --------------------------------------------------------
  char *host = nullptr, *dev = nullptr;
  CHECK(cudaHostAlloc(&host, gig, cudaHostAllocDefault));
  CHECK(cudaMalloc(&dev, gig));
  memset(host, 1, gig);
  auto copies = [&](int n, long long bytes, int reps) {
    std::vector<float> ms;
    for (int r = 0; r < reps + 2; ++r) {
      t.start(s);
      for (int i = 0; i < n; ++i) {
        const long long at = bytes < gig ? (i * bytes) % (gig - bytes) : 0;
        CHECK(cudaMemcpyAsync(dev + at, host + at, bytes, cudaMemcpyHostToDevice, s));
      }
      float v = t.stop_ms(s);
      if (r >= 2) ms.push_back(v);
    }
    return median(ms);
  };
  rows.push_back(row("memcpy_h2d_expert", kExpertBytes, copies(1, kExpertBytes, 50)));
  rows.push_back(row("memcpy_h2d_layer_6_experts", 6 * kExpertBytes, copies(6, kExpertBytes, 30)));
  rows.push_back(row("memcpy_h2d_token_156_experts", token, copies(156, kExpertBytes, 10)));
  rows.push_back(row("memcpy_h2d_1GiB", gig, copies(1, gig, 5)));
  CHECK(cudaFreeHost(host));

  // -- zero-copy: kernels reading mapped pinned host memory ----------------------------------
  const long long all = kExpertBytes * kLayers * kExperts;
  char* mapped = nullptr;
  CHECK(cudaHostAlloc(&mapped, all, cudaHostAllocMapped | cudaHostAllocPortable));
  memset(mapped, 0, all);
  uint4* mapped_dev = nullptr;
  CHECK(cudaHostGetDevicePointer((void**)&mapped_dev, mapped, 0));
  unsigned* out = nullptr;
  CHECK(cudaMalloc(&out, 4096));
  std::mt19937 rng(1234);
  long long* regions = nullptr;  // kPicks tokens' picks, 156 regions each
  CHECK(cudaMalloc(&regions, sizeof(long long) * kPicks * kLayers * kTopK));
  for (int p = 0; p < kPicks; ++p) {
    auto r = pick(rng);
    CHECK(cudaMemcpy(regions + p * r.size(), r.data(), sizeof(long long) * r.size(),
                     cudaMemcpyHostToDevice));
  }
  auto token_read = [&](const uint4* base, int bpr, bool per_layer, int reps) {
    std::vector<float> ms;
    for (int r = 0; r < reps + 2; ++r) {
      const long long* picks = regions + (r % kPicks) * kLayers * kTopK;
      t.start(s);
      if (per_layer) {
        for (int l = 0; l < kLayers; ++l)
          read_regions<<<dim3(bpr, kTopK), kThreads, 0, s>>>(base, picks + l * kTopK,
                                                             kExpertVecs, out);
      } else {
        read_regions<<<dim3(bpr, kLayers * kTopK), kThreads, 0, s>>>(base, picks, kExpertVecs,
                                                                     out);
      }
      CHECK(cudaGetLastError());
      float v = t.stop_ms(s);
      if (r >= 2) ms.push_back(v);
    }
    return median(ms);
  };
  const int sms = prop.multiProcessorCount;
  std::vector<std::string> zero;
  for (int bpr : {2, 4, 8, 16, 22, 44}) {  // blocks per expert (22 x 6 = 132 = H200's SMs)
    for (bool per_layer : {false, true}) {
      std::string name = std::string(per_layer ? "per_layer" : "token") + "_bpr" +
                         std::to_string(bpr);
      zero.push_back(row(name.c_str(), token, token_read(mapped_dev, bpr, per_layer, 8)));
    }
  }
  CHECK(cudaFreeHost(mapped));

  // -- the same reads from device memory (HBM) ---------------------------------------------
  // dev (1 GiB) holds 240 experts: a token's 156 picks map into it modulo its size
  std::vector<long long> dev_picks;
  {
    auto r = pick(rng);
    for (long long v : r) dev_picks.push_back((v / kExpertVecs) % 240 * kExpertVecs);
  }
  CHECK(cudaMemcpy(regions, dev_picks.data(), sizeof(long long) * dev_picks.size(),
                   cudaMemcpyHostToDevice));
  std::vector<std::string> hbm;
  for (int bpr : {4, 22}) {
    for (bool per_layer : {false, true}) {
      std::vector<float> ms;
      for (int r = 0; r < 12; ++r) {
        t.start(s);
        if (per_layer) {
          for (int l = 0; l < kLayers; ++l)
            read_regions<<<dim3(bpr, kTopK), kThreads, 0, s>>>((const uint4*)dev,
                                                               regions + l * kTopK, kExpertVecs,
                                                               out);
        } else {
          read_regions<<<dim3(bpr, kLayers * kTopK), kThreads, 0, s>>>((const uint4*)dev, regions,
                                                                       kExpertVecs, out);
        }
        float v = t.stop_ms(s);
        if (r >= 2) ms.push_back(v);
      }
      std::string name = std::string(per_layer ? "per_layer" : "token") + "_bpr" +
                         std::to_string(bpr);
      hbm.push_back(row(name.c_str(), token, median(ms)));
    }
  }
  CHECK(cudaFree(dev));

  auto join = [](const std::vector<std::string>& v) {
    std::string o;
    for (size_t i = 0; i < v.size(); ++i) o += (i ? ",\n    " : "") + v[i];
    return o;
  };
  printf("{\"gpu\": \"%s\", \"sms\": %d, \"expert_bytes\": %lld, \"token_bytes\": %lld,\n",
         prop.name, sms, kExpertBytes, token);
  printf(" \"memcpy\": [\n    %s],\n", join(rows).c_str());
  printf(" \"zero_copy\": [\n    %s],\n", join(zero).c_str());
  printf(" \"hbm_reference\": [\n    %s]}\n", join(hbm).c_str());
  return 0;
}
