// Values as the kernels read them, one at a time and a vector at a time: the
// vector type (Vec, kLanes wide), bfloat16 to and from float32, and the
// quantized cache's elements (int8, float8_e4m3fn, float8_e5m2) widened to
// float32 lanes and dequantized. Included by kernel_math.h.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention.h"

#ifndef ATTN_ISA
#define ATTN_ISA isa_baseline
#endif
// The vector width in bytes: 32 (8 floats, one AVX register) for x86-64-v3, 16
// (4 floats, one SSE register) for the baseline: a vector wider than the
// target's registers is kept in memory by the compiler (30x slower, measured).
#ifndef ATTN_VEC_BYTES
#define ATTN_VEC_BYTES 16
#endif

namespace attn_native_cpu {
namespace ATTN_ISA {
namespace {

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

// Reads n values of dtype at src into float32 dst.
inline void LoadRow(DType dtype, const void* src, int64_t offset, int64_t n, float* dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(s[i]);
  }
}

inline void StoreRow(DType dtype, void* dst, int64_t offset, int64_t n, const float* src,
                     float factor) {
  if (dtype == DType::kF32) {
    float* d = static_cast<float*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = src[i] * factor;
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = F32ToBf16(src[i] * factor);
  }
}

typedef float Vec __attribute__((vector_size(ATTN_VEC_BYTES)));
constexpr int kLanes = ATTN_VEC_BYTES / 4;

// kLanes values from p as float32: float32 read as they are, bfloat16 (its
// bits, uint16_t) widened on the way, so the decode path reads bfloat16 keys
// and values in place, with no widened copy (measured: plugin README).
inline Vec LoadVec(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

typedef uint16_t VecH __attribute__((vector_size(ATTN_VEC_BYTES / 2)));
typedef uint32_t VecU __attribute__((vector_size(ATTN_VEC_BYTES)));

inline Vec LoadVec(const uint16_t* p) {
#if defined(__AVX2__) && ATTN_VEC_BYTES == 32
  // One vpmovzxwd from memory and a shift: GCC 12 compiles the generic
  // conversion below into six instructions, more than the products they
  // feed on a bfloat16 decode step (7-8% of its time, plugin README).
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm256_slli_epi32(wide, 16);
#else
  VecH h;
  std::memcpy(&h, p, sizeof h);
  return (Vec)(__builtin_convertvector(h, VecU) << 16);
#endif
}

inline float ToF32(float x) { return x; }
inline float ToF32(uint16_t x) { return Bf16ToF32(x); }

// A quantized cache's elements (CacheType): int8 as int8_t, and the two
// float8 formats as one-byte types of their own, so each has its own
// overloads of ToF32 and LoadVec and a tile reads it where it lies, widening
// in registers. Values only: the scale is applied by the caller.
struct E4M3 {
  uint8_t bits;
};
struct E5M2 {
  uint8_t bits;
};

inline float BitsToF32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float ToF32(int8_t x) { return static_cast<float>(x); }

// A float8 format's fields: kMant mantissa bits, exponent bias kBias; kIeee:
// the top exponent holds infinity (mantissa 0) and NaN (float8_e5m2), else
// only magnitude 0x7f is NaN and there is no infinity (float8_e4m3fn). Normal
// numbers move their fields into float32's; subnormals are mantissa *
// 2^(1 - kBias - kMant), computed as such (no float32 subnormal, which a
// thread with denormals flushed would read as 0).
template <int kMant, int kBias>
constexpr float kFp8Subnormal = 1.0f / static_cast<float>(1u << (kBias + kMant - 1));
template <int kMant>
constexpr uint32_t kFp8Top = 0x7fu >> kMant << kMant;  // the top exponent's first magnitude

template <int kMant, int kBias, bool kIeee>
inline float Fp8ToF32(uint8_t byte) {
  const uint32_t mag = byte & 0x7fu, sign = static_cast<uint32_t>(byte & 0x80u) << 24;
  uint32_t bits;
  if (kIeee ? mag > kFp8Top<kMant> : mag == 0x7fu) {
    bits = 0x7fc00000u;
  } else if (kIeee && mag == kFp8Top<kMant>) {
    bits = 0x7f800000u;
  } else if ((mag >> kMant) == 0) {
    const float f = static_cast<float>(mag) * kFp8Subnormal<kMant, kBias>;
    std::memcpy(&bits, &f, sizeof bits);
  } else {
    bits = (mag << (23 - kMant)) + ((127u - kBias) << 23);
  }
  return BitsToF32(bits | sign);
}

inline float ToF32(E4M3 x) { return Fp8ToF32<3, 7, false>(x.bits); }
inline float ToF32(E5M2 x) { return Fp8ToF32<2, 15, true>(x.bits); }

inline void StoreVec(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// kLanes one-byte values from p, widened to 32-bit lanes.
typedef uint8_t VecB __attribute__((vector_size(ATTN_VEC_BYTES / 4)));
typedef int8_t VecSB __attribute__((vector_size(ATTN_VEC_BYTES / 4)));

#if defined(__AVX2__) && ATTN_VEC_BYTES == 32
// One vpmovsxbd / vpmovzxbd from memory: GCC compiles the generic conversion
// below lane by lane.
inline Vec LoadVec(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

inline VecU WidenBytes(const void* p) {
  return (VecU)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#else
inline Vec LoadVec(const int8_t* p) {
  VecSB b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, Vec);
}

inline VecU WidenBytes(const void* p) {
  VecB b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, VecU);
}
#endif

inline VecU SplatU(uint32_t x) { return VecU{} + x; }

// The float8 formats as Fp8ToF32 reads them, a vector at a time (no table, no
// branch): the fields moved into float32's, subnormals by a product, NaN and
// infinity blended in.
template <int kMant, int kBias, bool kIeee>
inline Vec LoadFp8(const void* p) {
  const VecU w = WidenBytes(p), mag = w & SplatU(0x7fu), sign = (w & SplatU(0x80u)) << 24;
  const VecU normal = (mag << (23 - kMant)) + SplatU((127u - kBias) << 23);
  const Vec sub = __builtin_convertvector(mag, Vec) * kFp8Subnormal<kMant, kBias>;
  VecU bits = (mag >> kMant) == SplatU(0) ? (VecU)sub : normal;
  if (kIeee) {
    bits = mag == SplatU(kFp8Top<kMant>) ? SplatU(0x7f800000u) : bits;
    bits = mag > SplatU(kFp8Top<kMant>) ? SplatU(0x7fc00000u) : bits;
  } else {
    bits = mag == SplatU(0x7fu) ? SplatU(0x7fc00000u) : bits;
  }
  return (Vec)(bits | sign);
}

inline Vec LoadVec(const E4M3* p) { return LoadFp8<3, 7, false>(p); }
inline Vec LoadVec(const E5M2* p) { return LoadFp8<2, 15, true>(p); }

// n values of a quantized cache (cache, element type by CacheType) at src +
// offset, times scale, into float32 dst.
template <class T>
inline void DequantizeAs(const void* src, int64_t offset, int64_t n, float scale, float* dst) {
  const T* s = static_cast<const T*>(src) + offset;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) StoreVec(dst + i, LoadVec(s + i) * scale);
  for (; i < n; ++i) dst[i] = ToF32(s[i]) * scale;
}

inline void DequantizeRow(CacheType cache, const void* src, int64_t offset, int64_t n,
                          float scale, float* dst) {
  switch (cache) {
    case CacheType::kInt8: return DequantizeAs<int8_t>(src, offset, n, scale, dst);
    case CacheType::kE4M3: return DequantizeAs<E4M3>(src, offset, n, scale, dst);
    case CacheType::kE5M2: return DequantizeAs<E5M2>(src, offset, n, scale, dst);
    case CacheType::kSame: break;
  }
}

inline Vec Splat(float f) { return Vec{} + f; }

}  // namespace
}  // namespace ATTN_ISA
}  // namespace attn_native_cpu
