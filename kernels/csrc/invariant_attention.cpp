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

constexpr int QB = 4;        // query rows per task (times the heads of a key head's group)
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

// Sum of each of 16 vectors' lanes, as lane i of the result: per vector the tree of
// _mm512_reduce_add_ps (lanes l + l+8, then l + l+4, l + l+2, l + l+1), so a key's score is
// the same bits whether it is reduced alone or in a group, in any position of the group.
inline __m512 reduce16(__m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)       // 8 lanes per vector, two vectors per register
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)       // 4 lanes per vector, four per register
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)       // 2 lanes per vector
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane order after the three levels: vector k's sum lands in lane perm(k); undo it below
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Which input vector's sum reduce16 leaves in each output lane (found once, at load).
struct Lanes {
  int of[16];
  Lanes() {
    alignas(64) float probe[16][16] = {};
    __m512 v[16];
    for (int k = 0; k < 16; ++k) {
      probe[k][k] = static_cast<float>(k + 1);     // vector k sums to k + 1
      v[k] = _mm512_load_ps(probe[k]);
    }
    alignas(64) float out[16];
    _mm512_store_ps(out, reduce16(v));
    for (int l = 0; l < 16; ++l) of[l] = static_cast<int>(out[l]) - 1;
  }
};

inline __mmask16 visible16(const bool* row, int64_t stride, int64_t j0, int64_t n) {
  // bit t: key j0 + t is visible to this query (keys past n are never)
  const __mmask16 in = n - j0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                                    : static_cast<__mmask16>((1u << (n - j0)) - 1);
  if (!row) return in;
  if (stride == 1)
    return _mm_mask_cmpneq_epi8_mask(in, _mm_maskz_loadu_epi8(in, row + j0), _mm_setzero_si128());
  __mmask16 m = 0;
  for (int t = 0; t < 16 && j0 + t < n; ++t) m |= static_cast<__mmask16>(row[(j0 + t) * stride] ? 1u << t : 0u);
  return m;
}

// One task: the queries of row b, key head kh, query rows i0..i0+rows-1 and every query head
// of kh's group, sharing each group of 16 keys (and then values) while it sits in L1.
template <typename T, int NV>
void task(const T* q, const T* kb, const T* vb, const bool* mask, T* out, int64_t b, int64_t kh,
          int64_t i0, int rows, int64_t L, int64_t D, int64_t groups, float scale,
          const int64_t* sq, const int64_t* sk, const int64_t* sv, const int64_t* sm,
          const int64_t* so, const __m512i& unperm, float* s, int32_t* idx, int64_t* cnt,
          __m512* o, float* inv) {
  const int nq = rows * static_cast<int>(groups);
  const int64_t stride = L + 16;
  // query u: head kh * groups + u % groups, row i0 + u / groups
  auto head = [&](int u) { return kh * groups + u % groups; };
  auto qrow = [&](int u) { return i0 + u / groups; };
  auto vis_row = [&](int u) -> const bool* {
    return mask ? mask + b * sm[0] + head(u) * sm[1] + qrow(u) * sm[2] : nullptr;
  };
  for (int u = 0; u < nq; ++u) cnt[u] = 0;
  // scores of the visible keys, in key order: each key's dot is one FMA chain over head_dim,
  // its lanes summed by reduce16's tree
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    for (int u = 0; u < nq; ++u) {
      const __mmask16 vis = visible16(vis_row(u), sm[3], j0, L);
      if (!vis) continue;
      __m512 qv[NV];
      const T* qp = q + b * sq[0] + head(u) * sq[1] + qrow(u) * sq[2];
      for (int c = 0; c < NV; ++c) qv[c] = load16(qp + 16 * c, lanes(D, c));
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        __m512 a = _mm512_setzero_ps();
        if (j0 + t < L)
          for (int c = 0; c < NV; ++c)
            a = _mm512_fmadd_ps(qv[c], load16(kb + (j0 + t) * sk[2] + 16 * c, lanes(D, c)), a);
        acc[t] = a;
      }
      const __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(unperm, reduce16(acc)),
                                      _mm512_set1_ps(scale));
      _mm512_mask_compressstoreu_ps(s + u * stride + cnt[u], vis, sc);
      _mm512_mask_compressstoreu_epi32(idx + u * stride + cnt[u], vis, _mm512_add_epi32(
          _mm512_set1_epi32(static_cast<int32_t>(j0)),
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
      cnt[u] += __builtin_popcount(static_cast<unsigned>(vis));
    }
  }
  for (int u = 0; u < nq; ++u) idx[u * stride + cnt[u]] = INT32_MAX;    // each list's end
  // softmax weights: exp(s - max), and their sum in 16 lanes by position, in order
  for (int u = 0; u < nq; ++u) {
    float* su = s + u * stride;
    const int64_t n = cnt[u];
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, su[j]);
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 use = n - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                        : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(use, su + j), mv));
      _mm512_mask_storeu_ps(su + j, use, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(use, e));
    }
    inv[u] = n ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
    for (int c = 0; c < NV; ++c) o[u * NV + c] = _mm512_setzero_ps();
    cnt[u] = 0;                     // now: how many of its weights are consumed
  }
  // weighted values of the visible keys, in key order, one group of 16 values at a time
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    for (int u = 0; u < nq; ++u) {
      const float* su = s + u * stride;
      const int32_t* iu = idx + u * stride;
      int64_t j = cnt[u];
      if (iu[j] >= j0 + 16) continue;
      __m512 acc[NV];
      for (int c = 0; c < NV; ++c) acc[c] = o[u * NV + c];
      for (; iu[j] < j0 + 16; ++j) {
        const __m512 p = _mm512_set1_ps(su[j]);
        const T* vj = vb + iu[j] * sv[2];
        for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(p, load16(vj + 16 * c, lanes(D, c)), acc[c]);
      }
      for (int c = 0; c < NV; ++c) o[u * NV + c] = acc[c];
      cnt[u] = j;
    }
  }
  for (int u = 0; u < nq; ++u) {
    T* dst = out + b * so[0] + qrow(u) * so[1] + head(u) * so[2];
    const __m512 w = _mm512_set1_ps(inv[u]);
    for (int c = 0; c < NV; ++c) store16(dst + 16 * c, _mm512_mul_ps(o[u * NV + c], w), lanes(D, c));
  }
}

template <typename T, int NV>
void run(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t B, int64_t H,
         int64_t Q, int64_t L, int64_t D, int64_t groups, float scale,
         const int64_t* sq, const int64_t* sk, const int64_t* sv, const int64_t* sm,
         const int64_t* so) {
  static const Lanes perm;
  alignas(64) int32_t un[16];
  for (int l = 0; l < 16; ++l) un[perm.of[l]] = l;     // output lane i takes reduce16's lane un[i]
  const __m512i unperm = _mm512_load_si512(un);
  const int64_t KVH = H / groups;
  const int rb = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(QB, 64 / groups)));
  const int64_t qblocks = (Q + rb - 1) / rb;
  const int64_t tasks = B * KVH * qblocks;
  const int threads = omp_in_parallel() ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), tasks));
#pragma omp parallel num_threads(threads)
  {
    const size_t nq = static_cast<size_t>(rb * groups);
    std::vector<float> s(nq * (L + 16));
    std::vector<int32_t> idx(nq * (L + 16));
    std::vector<int64_t> cnt(nq);
    std::vector<__m512> o(nq * NV);
    std::vector<float> inv(nq);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = t / (KVH * qblocks), kh = t / qblocks % KVH, i0 = t % qblocks * rb;
      const int rows = static_cast<int>(std::min<int64_t>(rb, Q - i0));
      task<T, NV>(q, k + b * sk[0] + kh * sk[1], v + b * sv[0] + kh * sv[1], mask, out, b, kh, i0,
                  rows, L, D, groups, scale, sq, sk, sv, sm, so, unperm, s.data(), idx.data(),
                  cnt.data(), o.data(), inv.data());
    }
  }
}

template <typename T>
void dispatch(int nv, const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t B,
              int64_t H, int64_t Q, int64_t L, int64_t D, int64_t groups, float scale,
              const int64_t* sq, const int64_t* sk, const int64_t* sv, const int64_t* sm,
              const int64_t* so) {
#define DFLASH_NV(N) case N: return run<T, N>(q, k, v, mask, out, B, H, Q, L, D, groups, scale, sq, sk, sv, sm, so);
  switch (nv) {
    DFLASH_NV(1) DFLASH_NV(2) DFLASH_NV(3) DFLASH_NV(4) DFLASH_NV(5) DFLASH_NV(6) DFLASH_NV(7)
    DFLASH_NV(8) DFLASH_NV(9) DFLASH_NV(10) DFLASH_NV(11) DFLASH_NV(12) DFLASH_NV(13)
    DFLASH_NV(14) DFLASH_NV(15) DFLASH_NV(16)
    default: TORCH_CHECK(false, "invariant_attention: head_dim above 256");
  }
#undef DFLASH_NV
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
    dispatch<float>(static_cast<int>((D + 15) / 16), query.data_ptr<float>(), key.data_ptr<float>(),
                    value.data_ptr<float>(), mp, out.data_ptr<float>(), B, H, Q, L, D, H / KVH, sc,
                    sq, sk, sv, sm, so);
  } else {
    dispatch<c10::BFloat16>(static_cast<int>((D + 15) / 16), query.data_ptr<c10::BFloat16>(),
                            key.data_ptr<c10::BFloat16>(), value.data_ptr<c10::BFloat16>(), mp,
                            out.data_ptr<c10::BFloat16>(), B, H, Q, L, D, H / KVH, sc, sq, sk, sv,
                            sm, so);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("invariant_attention", &invariant_attention,
        "softmax(scale q K^T) V per query over its visible keys in order (batch-invariant)",
        py::call_guard<py::gil_scoped_release>());
}
