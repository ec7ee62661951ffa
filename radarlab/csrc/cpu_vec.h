// A float vector for the C++ operators: AVX-512 (16 lanes) or AVX2 (8 lanes), whichever the compiler
// was told the CPU has (-march=native), or plain loops over 8 lanes on any other CPU. One source is
// right on each; tests build all three (tests/attention/test_cpu_decode.py, tests/test_cpu_ops.py).
//
// Loads widen fp32, bf16 and fp16 to fp32; stores round to the destination dtype to nearest even, as
// torch rounds every op's result, so a fused operator can give the bits of torch's unfused ops.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace radarlab::vec {

#if defined(__AVX512F__)
constexpr int N = 16;
using fvec = __m512;
inline fvec set(float x) { return _mm512_set1_ps(x); }
inline fvec load(const float* p) { return _mm512_loadu_ps(p); }
inline fvec load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32: widening is a shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline fvec load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void store(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, fvec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
inline void store(c10::Half* p, fvec v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline fvec add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec div(fvec a, fvec b) { return _mm512_div_ps(a, b); }
inline fvec fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec max(fvec a, fvec b) { return _mm512_max_ps(a, b); }
inline fvec min(fvec a, fvec b) { return _mm512_min_ps(a, b); }
inline float sum(fvec v) { return _mm512_reduce_add_ps(v); }
inline float hmax(fvec v) { return _mm512_reduce_max_ps(v); }
inline fvec rint(fvec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec pow2(fvec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline fvec where_gt(fvec x, float t, fvec a, fvec b) { return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, set(t), _CMP_GT_OQ), a); }
inline fvec where_lt(fvec x, float t, fvec a, fvec b) { return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, set(t), _CMP_LT_OQ), a); }
inline fvec where_nan(fvec x, fvec a, fvec b) { return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), a); }
inline fvec where_greater(fvec x, fvec y, fvec a, fvec b) { return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, y, _CMP_GT_OQ), a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int N = 8;
using fvec = __m256;
inline fvec set(float x) { return _mm256_set1_ps(x); }
inline fvec load(const float* p) { return _mm256_loadu_ps(p); }
inline fvec load(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline fvec load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void store(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, fvec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  r = _mm256_srli_epi32(r, 16);
  // packus works within 128-bit lanes: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather the two halves' first quads
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b11011000);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
inline void store(c10::Half* p, fvec v) {
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline fvec add(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec div(fvec a, fvec b) { return _mm256_div_ps(a, b); }
inline fvec fma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec max(fvec a, fvec b) { return _mm256_max_ps(a, b); }
inline fvec min(fvec a, fvec b) { return _mm256_min_ps(a, b); }
inline float sum(fvec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax(fvec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline fvec rint(fvec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec pow2(fvec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline fvec where_gt(fvec x, float t, fvec a, fvec b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, set(t), _CMP_GT_OQ)); }
inline fvec where_lt(fvec x, float t, fvec a, fvec b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, set(t), _CMP_LT_OQ)); }
inline fvec where_nan(fvec x, fvec a, fvec b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
inline fvec where_greater(fvec x, fvec y, fvec a, fvec b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, y, _CMP_GT_OQ)); }
#else  // any other CPU: plain loops over 8 lanes, which the compiler vectorizes as it can
constexpr int N = 8;
struct fvec { float x[N]; };
#define RADARLAB_LANES(expr) fvec r; for (int i = 0; i < N; ++i) r.x[i] = (expr); return r
inline fvec set(float a) { RADARLAB_LANES(a); }
template <typename T> inline fvec load(const T* p) { RADARLAB_LANES(static_cast<float>(p[i])); }
template <typename T> inline void store(T* p, fvec v) { for (int i = 0; i < N; ++i) p[i] = static_cast<T>(v.x[i]); }
inline fvec add(fvec a, fvec b) { RADARLAB_LANES(a.x[i] + b.x[i]); }
inline fvec mul(fvec a, fvec b) { RADARLAB_LANES(a.x[i] * b.x[i]); }
inline fvec div(fvec a, fvec b) { RADARLAB_LANES(a.x[i] / b.x[i]); }
inline fvec fma(fvec a, fvec b, fvec c) { RADARLAB_LANES(std::fma(a.x[i], b.x[i], c.x[i])); }
inline fvec max(fvec a, fvec b) { RADARLAB_LANES(a.x[i] > b.x[i] ? a.x[i] : b.x[i]); }
inline fvec min(fvec a, fvec b) { RADARLAB_LANES(a.x[i] < b.x[i] ? a.x[i] : b.x[i]); }
inline float sum(fvec v) { float s = 0.f; for (int i = 0; i < N; ++i) s += v.x[i]; return s; }
inline float hmax(fvec v) { float m = v.x[0]; for (int i = 1; i < N; ++i) m = v.x[i] > m ? v.x[i] : m; return m; }
inline fvec rint(fvec v) { RADARLAB_LANES(std::nearbyint(v.x[i])); }
inline fvec pow2(fvec n) { RADARLAB_LANES(std::ldexp(1.f, int(n.x[i]))); }
inline fvec where_gt(fvec x, float t, fvec a, fvec b) { RADARLAB_LANES(x.x[i] > t ? a.x[i] : b.x[i]); }
inline fvec where_lt(fvec x, float t, fvec a, fvec b) { RADARLAB_LANES(x.x[i] < t ? a.x[i] : b.x[i]); }
inline fvec where_nan(fvec x, fvec a, fvec b) { RADARLAB_LANES(std::isnan(x.x[i]) ? a.x[i] : b.x[i]); }
inline fvec where_greater(fvec x, fvec y, fvec a, fvec b) { RADARLAB_LANES(x.x[i] > y.x[i] ? a.x[i] : b.x[i]); }
#undef RADARLAB_LANES
#endif

inline fvec zero() { return set(0.f); }

// v rounded to T and widened back: where torch would store an intermediate result in T.
template <typename T> inline fvec round_to(fvec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[N];
    store(tmp, v);
    return load(tmp);
  }
}

// e^x, within 2 ulp of std::exp for |x| < 88: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial, times 2^n.
// Overflow gives inf and NaN gives NaN, as std::exp; results below 2^-126 flush to zero.
inline fvec exp(fvec x) {
  const fvec xc = min(max(x, set(-87.33654f)), set(88.02969f));
  const fvec n = rint(mul(xc, set(1.44269504088896341f)));
  fvec r = fma(n, set(-0.693359375f), xc);
  r = fma(n, set(2.12194440e-4f), r);
  fvec p = set(1.9875691500e-4f);
  p = fma(p, r, set(1.3981999507e-3f));
  p = fma(p, r, set(8.3334519073e-3f));
  p = fma(p, r, set(4.1665795894e-2f));
  p = fma(p, r, set(1.6666665459e-1f));
  p = fma(p, r, set(5.0000001201e-1f));
  fvec y = add(fma(p, mul(r, r), r), set(1.f));
  y = mul(y, pow2(n));
  y = where_gt(x, 88.72283f, set(std::numeric_limits<float>::infinity()), y);
  y = where_lt(x, -87.33654f, zero(), y);
  return where_nan(x, x, y);
}

}  // namespace radarlab::vec
