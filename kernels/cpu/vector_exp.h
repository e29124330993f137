// Vector expf for the CPU kernels of this folder (paged_decode_attention.cpp, prefill_attention.cpp): Cephes'
// polynomial, within 2 ulp of std::exp, several times cheaper than a correctly rounded one. exp16 (AVX-512) and
// exp8 (AVX2 + FMA) where the build's CPU has them; include after <immintrin.h>.
#pragma once

#include <initializer_list>

// Cephes' expf for either vector width: e^r for r = x - n ln 2 (n = round(x / ln 2)) by its polynomial; the caller
// scales it by 2^n (within 2 ulp of std::exp). Simd holds the width's ops (TPENGINE_SIMD_OPS).
template <typename Simd>
inline typename Simd::V exp_reduced(typename Simd::V x, typename Simd::V n) {
  using V = typename Simd::V;
  V r = Simd::fnmadd(n, Simd::set1(0.693359375f), x);
  r = Simd::fnmadd(n, Simd::set1(-2.12194440e-4f), r);
  V p = Simd::set1(1.9875691500E-4f);
  for (const float c : {1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f})
    p = Simd::fmadd(p, r, Simd::set1(c));
  return Simd::fmadd(Simd::mul(p, r), r, Simd::add(r, Simd::set1(1.f)));
}

#define TPENGINE_SIMD_OPS(Name, Vec, prefix)                                         \
  struct Name {                                                                      \
    using V = Vec;                                                                   \
    static V set1(float a) { return prefix##_set1_ps(a); }                           \
    static V fmadd(V a, V b, V c) { return prefix##_fmadd_ps(a, b, c); }            \
    static V fnmadd(V a, V b, V c) { return prefix##_fnmadd_ps(a, b, c); }          \
    static V mul(V a, V b) { return prefix##_mul_ps(a, b); }                         \
    static V add(V a, V b) { return prefix##_add_ps(a, b); }                         \
  };

#if defined(__AVX512F__)
TPENGINE_SIMD_OPS(Avx512Ops, __m512, _mm512)

// exp of 16 floats: exp_reduced scaled by 2^n (0 below about -103, where a softmax term no longer counts)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp_reduced<Avx512Ops>(x, n), n);
}
#elif defined(__AVX2__) && defined(__FMA__)
TPENGINE_SIMD_OPS(Avx2Ops, __m256, _mm256)

// exp of 8 floats: exp_reduced scaled by 2^n made in the exponent bits, so x stops at -87 (n >= -126), where a
// softmax term is about 1e-38 and no longer counts beside the peak's 1
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp_reduced<Avx2Ops>(x, n), _mm256_castsi256_ps(two_n));
}
#endif
