// The routed experts computed on the host's cores instead of read by the GPU over PCIe.
//
// One decode token of DeepSeek-V2-Lite at q4f16_g128 runs, in each of 26 MoE layers, 6 experts:
// gate_up (2816 x 2048) -> SiLU(gate) * up (1408) -> down (2048 x 1408), the 6 outputs weighted
// and summed. The weights are the project's INT4 layout (dsv2_mlc/quant/packing.py): 8 codes a
// uint32 along the input axis, code c of word w is input 8w + c, value (code - 8) x scale, one
// fp16 scale per 128 inputs of a row. This times that with OpenMP over the rows (all threads of
// OMP_NUM_THREADS), on 26 distinct layers' weights (0.70 GB, far past any last-level cache):
//
// * `token_ms`: one token's 26 layers (median of the repetitions), `layer_ms` = token_ms / 26,
//   `GBps`: the weight bytes of the token over token_ms;
// * `hot_layer_ms`: one layer's 6 experts run 26 times over (its 27 MB may sit in the cache);
// * `check_max_rel_err`: layer 0 against a float64 scalar reference (must be ~1e-6).
//
// The dot products (AVX2 + FMA where compiled for x86-64-v3): 8 consecutive words in one
// 256-bit register, the k-th nibble of all 8 extracted by one shift and mask, against the input
// reordered once per layer so that lane w of step k holds input 8w + k; a group's sum is
// scale x (sum code x input - 8 x sum input). One JSON object on stdout.
// Build here: g++ -O3 -march=x86-64-v3 -fopenmp -static -o build/expert_offload/host_gemv
//               schedules/lab/expert_offload/host_gemv.cpp  (one line)
// Run there:  OMP_NUM_THREADS=16 OMP_PROC_BIND=close build/expert_offload/host_gemv
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HOST_GEMV_AVX2 1
#else
#define HOST_GEMV_AVX2 0
#endif

constexpr int kH = 2048, kI = 1408, kGU = 2 * kI, kG = 128, kLayers = 26, kTopK = 6;
constexpr int kBlock = 64;  // inputs a step of the dot product covers (8 words)

struct Matrix {  // rows x cols INT4: codes [rows][cols / 8], fp16 scales [rows][cols / 128]
  int rows = 0, cols = 0;
  std::vector<uint32_t> codes;
  std::vector<uint16_t> scales;
  long long bytes() const { return 4LL * codes.size() + 2LL * scales.size(); }
};

static float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while (!(m & 0x400));
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static uint16_t float_to_half(float f) {  // normal range only (the scales here)
  uint32_t b;
  memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = (int)((b >> 23) & 0xff) - 127 + 15;
  return (uint16_t)(sign | (exp << 10) | ((b >> 13) & 0x3ff));
}

static uint32_t mix(uint64_t x) {  // splitmix64's finaliser, for reproducible weights
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return (uint32_t)(x ^ (x >> 31));
}

static void fill(Matrix& m, int rows, int cols, uint64_t seed) {
  m.rows = rows, m.cols = cols;
  m.codes.resize((size_t)rows * cols / 8);
  m.scales.resize((size_t)rows * cols / kG);
  const float s = 1.0f / std::sqrt((float)cols) / 4.3f;  // ~unit-variance outputs
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; ++r) {
    for (int w = 0; w < cols / 8; ++w) m.codes[(size_t)r * (cols / 8) + w] = mix(seed ^ (r * 7919ull + w));
    for (int g = 0; g < cols / kG; ++g)
      m.scales[(size_t)r * (cols / kG) + g] =
          float_to_half(s * (0.5f + (mix(~seed ^ (r * 31ull + g)) & 0xff) / 256.f));
  }
}

// The input reordered for the dot product (lane w of step k of a 64-input block holds input
// 8w + k) and each 128-group's sum.
static void prepare(const float* x, int n, float* xt, float* gsum) {
  for (int b = 0; b < n / kBlock; ++b)
    for (int k = 0; k < 8; ++k)
      for (int w = 0; w < 8; ++w) xt[b * kBlock + k * 8 + w] = x[b * kBlock + 8 * w + k];
  for (int g = 0; g < n / kG; ++g) {
    float s = 0;
    for (int j = 0; j < kG; ++j) s += x[g * kG + j];
    gsum[g] = s;
  }
}

// Row r of m times the prepared input.
static inline float row_dot(const Matrix& m, int r, const float* xt, const float* gsum) {
  const int words = m.cols / 8, groups = m.cols / kG;
  const uint32_t* c = m.codes.data() + (size_t)r * words;
  const uint16_t* sc = m.scales.data() + (size_t)r * groups;
  float total = 0;
  for (int g = 0; g < groups; ++g) {
#if HOST_GEMV_AVX2
    const __m256i mask = _mm256_set1_epi32(0xf);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int b = 0; b < kG / kBlock; ++b) {
      const int at = g * kG + b * kBlock;
      const __m256i v = _mm256_loadu_si256((const __m256i*)(c + at / 8));
      const float* x = xt + at;
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)),
                             _mm256_loadu_ps(x + 0), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), mask)),
                             _mm256_loadu_ps(x + 8), acc1);
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), mask)),
                             _mm256_loadu_ps(x + 16), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 12), mask)),
                             _mm256_loadu_ps(x + 24), acc1);
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), mask)),
                             _mm256_loadu_ps(x + 32), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 20), mask)),
                             _mm256_loadu_ps(x + 40), acc1);
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 24), mask)),
                             _mm256_loadu_ps(x + 48), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28)), _mm256_loadu_ps(x + 56),
                             acc1);
    }
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    q = _mm_hadd_ps(q, q);
    q = _mm_hadd_ps(q, q);
    const float dot = _mm_cvtss_f32(q);
#else
    float dot = 0;
    for (int b = 0; b < kG / kBlock; ++b) {
      const int at = g * kG + b * kBlock;
      for (int k = 0; k < 8; ++k)
        for (int w = 0; w < 8; ++w)
          dot += (float)((c[at / 8 + w] >> (4 * k)) & 0xf) * xt[at + k * 8 + w];
    }
#endif
    total += half_to_float(sc[g]) * (dot - 8.0f * gsum[g]);
  }
  return total;
}

struct Layer {
  Matrix gate_up[kTopK], down[kTopK];
  long long bytes() const {
    long long b = 0;
    for (int e = 0; e < kTopK; ++e) b += gate_up[e].bytes() + down[e].bytes();
    return b;
  }
};

struct Scratch {
  std::vector<float> xt = std::vector<float>(kH), xsum = std::vector<float>(kH / kG);
  std::vector<float> gu = std::vector<float>(kTopK * kGU), h = std::vector<float>(kTopK * kI);
  std::vector<float> ht = std::vector<float>(kTopK * kI), hsum = std::vector<float>(kTopK * kI / kG);
};

// One MoE layer's routed experts for one token: out = sum_e w[e] x down_e(silu(gate) * up).
static void run_layer(const Layer& L, const float* x, const float* wts, float* out, Scratch& s) {
#pragma omp parallel
  {
#pragma omp single
    prepare(x, kH, s.xt.data(), s.xsum.data());
#pragma omp for schedule(static)
    for (int i = 0; i < kTopK * kGU; ++i)
      s.gu[i] = row_dot(L.gate_up[i / kGU], i % kGU, s.xt.data(), s.xsum.data());
#pragma omp for schedule(static)
    for (int i = 0; i < kTopK * kI; ++i) {
      const int e = i / kI, j = i % kI;
      const float g = s.gu[e * kGU + j], u = s.gu[e * kGU + kI + j];
      s.h[i] = g / (1.0f + std::exp(-g)) * u;
    }
#pragma omp for schedule(static)
    for (int e = 0; e < kTopK; ++e)
      prepare(s.h.data() + e * kI, kI, s.ht.data() + e * kI, s.hsum.data() + e * (kI / kG));
#pragma omp for schedule(static)
    for (int o = 0; o < kH; ++o) {
      float acc = 0;
      for (int e = 0; e < kTopK; ++e)
        acc += wts[e] * row_dot(L.down[e], o, s.ht.data() + e * kI, s.hsum.data() + e * (kI / kG));
      out[o] = acc;
    }
  }
}

static double ref_row(const Matrix& m, int r, const double* x) {
  double acc = 0;
  for (int j = 0; j < m.cols; ++j) {
    const uint32_t code = (m.codes[(size_t)r * (m.cols / 8) + j / 8] >> (4 * (j % 8))) & 0xf;
    acc += ((double)code - 8.0) * half_to_float(m.scales[(size_t)r * (m.cols / kG) + j / kG]) *
           x[j];
  }
  return acc;
}

static double check(const Layer& L, const std::vector<float>& x, const float* wts,
                    const std::vector<float>& out) {
  std::vector<double> xd(x.begin(), x.end()), y(kH, 0.0);
  for (int e = 0; e < kTopK; ++e) {
    std::vector<double> h(kI);
    for (int j = 0; j < kI; ++j) {
      const double g = ref_row(L.gate_up[e], j, xd.data()), u = ref_row(L.gate_up[e], kI + j, xd.data());
      h[j] = g / (1.0 + std::exp(-g)) * u;
    }
    for (int o = 0; o < kH; ++o) y[o] += wts[e] * ref_row(L.down[e], o, h.data());
  }
  double worst = 0, scale = 0;
  for (int o = 0; o < kH; ++o) scale = std::max(scale, std::abs(y[o]));
  for (int o = 0; o < kH; ++o) worst = std::max(worst, std::abs(out[o] - y[o]) / scale);
  return worst;
}

int main() {
  using clock = std::chrono::steady_clock;
  std::vector<Layer> layers(kLayers);
  for (int l = 0; l < kLayers; ++l)
    for (int e = 0; e < kTopK; ++e) {
      fill(layers[l].gate_up[e], kGU, kH, 1000ull * l + 2 * e);
      fill(layers[l].down[e], kH, kI, 1000ull * l + 2 * e + 1);
    }
  std::vector<float> x(kH), out(kH);
  for (int i = 0; i < kH; ++i) x[i] = ((mix(i) & 0xffff) / 32768.f - 1.f) * 1.7f;
  const float wts[kTopK] = {0.3f, 0.2f, 0.15f, 0.14f, 0.11f, 0.1f};
  Scratch s;

  run_layer(layers[0], x.data(), wts, out.data(), s);
  const double err = check(layers[0], x, wts, out);

  auto token = [&](bool hot) {
    std::vector<float> h = x;
    const auto t0 = clock::now();
    for (int l = 0; l < kLayers; ++l) {
      run_layer(layers[hot ? 0 : l], h.data(), wts, out.data(), s);
      for (int i = 0; i < kH; ++i) h[i] = x[i] + 0.01f * out[i];  // the next layer's input
    }
    return std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  };
  std::vector<double> cold, hot;
  for (int r = 0; r < 12; ++r) {
    const double v = token(false);
    if (r >= 2) cold.push_back(v);
  }
  for (int r = 0; r < 7; ++r) {
    const double v = token(true);
    if (r >= 2) hot.push_back(v);
  }
  std::sort(cold.begin(), cold.end());
  std::sort(hot.begin(), hot.end());
  long long bytes = 0;
  for (const Layer& L : layers) bytes += L.bytes();
  const double tok = cold[cold.size() / 2], hot_tok = hot[hot.size() / 2];
  printf("{\"threads\": %d, \"avx2\": %s, \"layers\": %d, \"experts_per_layer\": %d, "
         "\"token_bytes\": %lld, \"token_ms\": %.3f, \"token_ms_min\": %.3f, \"layer_ms\": %.4f, "
         "\"GBps\": %.2f, \"hot_layer_ms\": %.4f, \"check_max_rel_err\": %.2e}\n",
         omp_get_max_threads(), HOST_GEMV_AVX2 ? "true" : "false", kLayers, kTopK, bytes, tok,
         cold.front(), tok / kLayers, bytes / (tok * 1e-3) / 1e9, hot_tok / kLayers, err);
  return 0;
}
