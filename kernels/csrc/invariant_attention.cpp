// Batch-invariant attention on AVX-512 CPUs: out[b, i, h] = softmax(scale * q K^T over the keys
// row b's mask shows query i) V, float32 arithmetic on float32 or bfloat16 storage.
//
// Each query's result is a fixed function of its own query vector and the keys and values it
// sees, in key order: one FMA chain per score over head_dim, a max, an exp per score, a sum and
// one FMA chain per output lane over the visible keys in order. Hidden keys are skipped, not
// added as zeros. So a query gives the same bits whether it is one token of a decode step, one
// row of a verify block of 16, a node of a tree (its ancestors are its visible keys, in the order
// a decode along that path sees them) or one row of a batched step; the thread that runs it and
// the other queries of the call do not matter.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int QB = 8;        // queries of one (row, head) that share each key's loads
constexpr int MAXV = 16;     // head_dim up to 256 (16 vectors of 16 floats)

inline __mmask16 lanes(int64_t d, int c) {
  const int64_t left = d - 16 * c;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  // bfloat16 is the high half of a float32: widen and shift (exact)
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int l = 0; l < 16; ++l)
    if (m >> l & 1) p[l] = c10::BFloat16(f[l]);     // round to nearest even, as torch's .to()
}

// exp(x) for x <= 0 (a score minus its row's max): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// a degree-6 polynomial (Cephes' expf coefficients); below -87 it is 0. Elementwise: a lane's
// result depends on its own input only.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}

template <typename T>
void run(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t B, int64_t H,
         int64_t Q, int64_t L, int64_t D, int64_t groups, float scale,
         const int64_t* sq, const int64_t* sk, const int64_t* sv, const int64_t* sm,
         const int64_t* so) {
  const int nv = static_cast<int>((D + 15) / 16);
  const int64_t qblocks = (Q + QB - 1) / QB;
  const int64_t tasks = B * H * qblocks;
  const int threads = omp_in_parallel() ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), tasks));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s(static_cast<size_t>(QB) * std::max<int64_t>(L, 1));
    std::vector<__m512> acc(static_cast<size_t>(QB) * nv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = t / (H * qblocks), h = t / qblocks % H, i0 = t % qblocks * QB;
      const int rows = static_cast<int>(std::min<int64_t>(QB, Q - i0));
      const int64_t kh = h / groups;
      const T* kb = k + b * sk[0] + kh * sk[1];
      const T* vb = v + b * sv[0] + kh * sv[1];
      const bool* mb = mask ? mask + b * sm[0] + h * sm[1] : nullptr;
      __m512 qv[QB][MAXV];
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < nv; ++c)
          qv[r][c] = load16(q + b * sq[0] + h * sq[1] + (i0 + r) * sq[2] + 16 * c, lanes(D, c));
      int64_t cnt[QB] = {0};
      // scores of the visible keys, in key order
      for (int64_t j = 0; j < L; ++j) {
        __m512 kj[MAXV];
        bool any = false;
        for (int r = 0; r < rows && !any; ++r) any = !mb || mb[(i0 + r) * sm[2] + j * sm[3]];
        if (!any) continue;
        for (int c = 0; c < nv; ++c) kj[c] = load16(kb + j * sk[2] + 16 * c, lanes(D, c));
        for (int r = 0; r < rows; ++r) {
          if (mb && !mb[(i0 + r) * sm[2] + j * sm[3]]) continue;
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < nv; ++c) a = _mm512_fmadd_ps(qv[r][c], kj[c], a);
          s[r * L + cnt[r]++] = _mm512_reduce_add_ps(a) * scale;
        }
      }
      // softmax weights: exp(s - max) and their sum, both in the scores' order
      float inv[QB];
      for (int r = 0; r < rows; ++r) {
        float* sr = s.data() + r * L;
        const int64_t n = cnt[r];
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = std::max(m, sr[j]);
        __m512 sum = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(m);
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 use = n - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (n - j)) - 1);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(use, sr + j), mv));
          _mm512_mask_storeu_ps(sr + j, use, e);
          sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(use, e));
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[r] = n ? 1.0f / total : 0.0f;
        for (int c = 0; c < nv; ++c) acc[r * nv + c] = _mm512_setzero_ps();
        cnt[r] = 0;
      }
      // weighted values of the visible keys, in key order
      for (int64_t j = 0; j < L; ++j) {
        __m512 vj[MAXV];
        bool loaded = false;
        for (int r = 0; r < rows; ++r) {
          if (mb && !mb[(i0 + r) * sm[2] + j * sm[3]]) continue;
          if (!loaded) {
            for (int c = 0; c < nv; ++c) vj[c] = load16(vb + j * sv[2] + 16 * c, lanes(D, c));
            loaded = true;
          }
          const __m512 p = _mm512_set1_ps(s[r * L + cnt[r]++]);
          for (int c = 0; c < nv; ++c) acc[r * nv + c] = _mm512_fmadd_ps(p, vj[c], acc[r * nv + c]);
        }
      }
      for (int r = 0; r < rows; ++r) {
        T* o = out + b * so[0] + (i0 + r) * so[1] + h * so[2];
        const __m512 w = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < nv; ++c) store16(o + 16 * c, _mm512_mul_ps(acc[r * nv + c], w), lanes(D, c));
      }
    }
  }
}

// query [B, H, Q, D]; key, value [B, KVH, L, D] (last dim contiguous, any other strides);
// mask bool [B, 1 or H, Q, >= L] (true = attend) or an undefined tensor (every key visible).
// Returns [B, Q, H, D] in the query's dtype (float32 or bfloat16, all three alike).
torch::Tensor invariant_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                  c10::optional<torch::Tensor> mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "invariant_attention: 4-d q, k, v");
  const auto dt = query.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && key.scalar_type() == dt &&
              value.scalar_type() == dt, "invariant_attention: float32 or bfloat16, all alike");
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t KVH = key.size(1), L = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B && value.size(1) == KVH && value.size(2) == L &&
              key.size(3) == D && value.size(3) == D && KVH > 0 && H % KVH == 0,
              "invariant_attention: shapes");
  TORCH_CHECK(D <= 16 * MAXV, "invariant_attention: head_dim above 256");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "invariant_attention: unit stride along head_dim");
  const bool* mp = nullptr;
  int64_t sm[4] = {0, 0, 0, 0};
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == torch::kBool && m.dim() == 4 && m.size(0) == B &&
                (m.size(1) == 1 || m.size(1) == H) && m.size(2) == Q && m.size(3) >= L,
                "invariant_attention: mask bool [B, 1 or H, Q, >= L]");
    mp = m.data_ptr<bool>();
    for (int d = 0; d < 4; ++d) sm[d] = m.stride(d);
    if (m.size(1) == 1) sm[1] = 0;
  }
  auto out = torch::empty({B, Q, H, D}, query.options());
  const int64_t sq[3] = {query.stride(0), query.stride(1), query.stride(2)};
  const int64_t sk[3] = {key.stride(0), key.stride(1), key.stride(2)};
  const int64_t sv[3] = {value.stride(0), value.stride(1), value.stride(2)};
  const int64_t so[3] = {out.stride(0), out.stride(1), out.stride(2)};
  if (B * H * Q == 0) return out;
  const float sc = static_cast<float>(scale);
  if (dt == torch::kFloat32) {
    run<float>(query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(), mp,
               out.data_ptr<float>(), B, H, Q, L, D, H / KVH, sc, sq, sk, sv, sm, so);
  } else {
    run<c10::BFloat16>(query.data_ptr<c10::BFloat16>(), key.data_ptr<c10::BFloat16>(),
                       value.data_ptr<c10::BFloat16>(), mp, out.data_ptr<c10::BFloat16>(), B, H,
                       Q, L, D, H / KVH, sc, sq, sk, sv, sm, so);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("invariant_attention", &invariant_attention,
        "softmax(scale q K^T) V per query over its visible keys in order (batch-invariant)",
        py::call_guard<py::gil_scoped_release>());
}
