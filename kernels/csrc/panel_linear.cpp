// y = x @ W.T in float32 for the few rows of a decode or verify step, on a weight packed once into
// column panels: panel p holds W's rows 32p..32p+31 transposed, [K][32], so each k reads one
// 128-byte line pair. A micro-kernel keeps an 8-row x 32-column tile in 16 AVX-512 registers;
// blocks of up to 8 rows take turns on each 64-deep slice of a panel while it is in L1, and
// the first block prefetches its panel 8 KB ahead and the same slice of the thread's next
// panel (the weights stream from memory once per call, whatever the row count). Prefetches
// past the last panel are hints only: they never fault.
//
// Every output is one FMA chain over k = 0..K-1 in order, whatever the row count, the row's
// place in its block or the thread that ran it: a row's result does not depend on how many
// rows share the call.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t NR = 32;   // columns per panel (two 16-float registers)
constexpr int MR = 8;        // rows per register tile
constexpr int64_t KC = 64;   // k-slice shared by a panel's row blocks
constexpr int64_t PD = 64;   // k-steps (8 KB) the first row block prefetches ahead in its panel

// One k-step's 32 weights as two float32 registers: float32 panels load them, bfloat16 panels
// widen them (exact: a bfloat16 is the high half of a float32).
inline void weights(const float* w, __m512& w0, __m512& w1) {
  w0 = _mm512_loadu_ps(w);
  w1 = _mm512_loadu_ps(w + 16);
}

inline void weights(const c10::BFloat16* w, __m512& w0, __m512& w1) {
  const __m512i h = _mm512_loadu_si512(w);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
}

template <int R, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, const W* prefetch, int64_t k0,
                 int64_t k1, float* acc) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm512_loadu_ps(acc + r * NR);
    hi[r] = _mm512_loadu_ps(acc + r * NR + 16);
  }
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch) {
      // this panel PD steps ahead into L1, the next panel's same slice into L2: more lines in
      // flight than the hardware prefetcher keeps for one stream (docs/kernels.md)
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + PD) * NR), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + PD) * NR + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * NR), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * NR + 16), _MM_HINT_T1);
    }
    __m512 w0, w1;
    weights(w + k * NR, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
      lo[r] = _mm512_fmadd_ps(xr, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xr, w1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * NR, lo[r]);
    _mm512_storeu_ps(acc + r * NR + 16, hi[r]);
  }
}

template <typename W>
void tile_rows(int64_t rows, const float* x, int64_t ldx, const W* w, const W* prefetch,
               int64_t k0, int64_t k1, float* acc) {
  switch (rows) {
    case 1: return tile<1, W>(x, ldx, w, prefetch, k0, k1, acc);
    case 2: return tile<2, W>(x, ldx, w, prefetch, k0, k1, acc);
    case 3: return tile<3, W>(x, ldx, w, prefetch, k0, k1, acc);
    case 4: return tile<4, W>(x, ldx, w, prefetch, k0, k1, acc);
    case 5: return tile<5, W>(x, ldx, w, prefetch, k0, k1, acc);
    case 6: return tile<6, W>(x, ldx, w, prefetch, k0, k1, acc);
    case 7: return tile<7, W>(x, ldx, w, prefetch, k0, k1, acc);
    default: return tile<8, W>(x, ldx, w, prefetch, k0, k1, acc);
  }
}

template <typename W>
void panel_rows(const float* xp, const W* wp, float* yp, int64_t M, int64_t K, int64_t P,
                int64_t n_out) {
  const int64_t blocks = (M + MR - 1) / MR;
  // OpenMP directly, on the calling thread's own thread count: ATen's parallel_for, inlined
  // here, would run its lazy per-thread init from this library's copy of its flag and reset a
  // thread that claimed N threads (dflash.serving.threads.claim) to the process default.
  const int threads = omp_in_parallel() ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), P));
#pragma omp parallel num_threads(threads)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p0 = P * t / n, p1 = P * (t + 1) / n;
    std::vector<float> acc(blocks * MR * NR);
    for (int64_t p = p0; p < p1; ++p) {
      const W* w = wp + p * K * NR;
      const W* next = p + 1 < p1 ? w + K * NR : nullptr;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        for (int64_t b = 0; b < blocks; ++b)
          tile_rows<W>(std::min<int64_t>(MR, M - b * MR), xp + b * MR * K, K, w,
                       b == 0 ? next : nullptr, k0, k1, acc.data() + b * MR * NR);
      }
      const int64_t cols = std::min(NR, n_out - p * NR);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(yp + m * n_out + p * NR, acc.data() + m * NR, cols * sizeof(float));
    }
  }
}

// x: float32 [M, K] contiguous; panels: float32 or bfloat16 [P, K, 32] contiguous; returns
// float32 [M, n_out].
torch::Tensor panel_mm(torch::Tensor x, torch::Tensor panels, int64_t n_out) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 &&
              (panels.scalar_type() == torch::kFloat32 || panels.scalar_type() == torch::kBFloat16),
              "panel_mm: float32 rows, float32 or bfloat16 panels");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == NR, "panel_mm: shapes");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous(), "panel_mm: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(P > 0 && panels.size(1) == K && n_out > (P - 1) * NR && n_out <= P * NR,
              "panel_mm: sizes");
  auto y = torch::empty({M, n_out}, x.options());
  if (M == 0) return y;
  if (panels.scalar_type() == torch::kFloat32)
    panel_rows<float>(x.data_ptr<float>(), panels.data_ptr<float>(), y.data_ptr<float>(), M, K,
                      P, n_out);
  else
    panel_rows<c10::BFloat16>(x.data_ptr<float>(), panels.data_ptr<c10::BFloat16>(),
                              y.data_ptr<float>(), M, K, P, n_out);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // no Python object is touched inside: other Python threads (gRPC handlers, a drafter's
  // context thread) run while the product does, as they do beside F.linear
  m.def("panel_mm", &panel_mm, "x [M, K] @ W.T from W's [P, K, 32] column panels (float32 or bfloat16 weights)",
        py::call_guard<py::gil_scoped_release>());
}
