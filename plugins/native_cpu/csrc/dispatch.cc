// Picks the kernels for this CPU once: the dense bfloat16 forward and the
// decode tiles over a quantized cache by bfloat16 products where the library
// has them (ATTN_NATIVE_CPU_HAVE_AVX512_BF16) and the CPU has AVX512_BF16 (the
// decode tiles AVX512_VBMI too); x86-64-v3 (AVX2 + FMA) where built
// (ATTN_NATIVE_CPU_HAVE_V3) and the CPU has them; else the baseline build. All
// compute the same contract; their roundings differ (FMA; bfloat16 weights),
// so the choice is made once per process: a call's answer never depends on
// which call came first. (The paged forward's choice can be below the dense
// one's: on a CPU with AVX512_BF16 but no AVX512_VBMI, Cooper Lake, it keeps
// x86-64-v3's.) ATTN_NATIVE_CPU_ISA caps the choice
// (its values are checked where the library loads, _library.py).
#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "attention.h"

namespace attn_native_cpu {
namespace {

enum class Isa { kBaseline, kV3, kAvx512Bf16 };
constexpr const char* kIsaNames[] = {"baseline", "x86-64-v3", "avx512-bf16"};

Isa Best() {
  Isa best = Isa::kBaseline;
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kV3;
#endif
#if defined(ATTN_NATIVE_CPU_HAVE_AVX512_BF16)
  if (best == Isa::kV3 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16")) {
    best = Isa::kAvx512Bf16;
  }
#endif
  return best;
}

Isa Chosen() {
  static const Isa isa = [] {
    Isa isa = Best();
    if (const char* cap = std::getenv("ATTN_NATIVE_CPU_ISA")) {
      for (int i = 0; i < 3; ++i) {
        if (std::strcmp(cap, kIsaNames[i]) == 0) isa = std::min(isa, static_cast<Isa>(i));
      }
    }
    return isa;
  }();
  return isa;
}

// OpenBLAS runs each block's GEMM on the thread that calls it: the work items
// are the parallelism (on XLA's pool), and its own threads would contend with
// them. Set once, before the first kernel runs.
void OneBlasThread() {
  static const bool once = [] {
    scipy_openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

}  // namespace

const char* KernelIsa() { return kIsaNames[static_cast<int>(Chosen())]; }

bool Avx512PagedSupported() {
  // Its decode tiles widen bytes by AVX512_VBMI's permutes (CMakeLists.txt).
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi;
}

void Forward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
             void* out, float* lse, const ParallelFor& parallel_for) {
  OneBlasThread();
#if defined(ATTN_NATIVE_CPU_HAVE_AVX512_BF16)
  if (Chosen() == Isa::kAvx512Bf16) {
    return isa_avx512_bf16::Forward(p, dtype, q, k, v, out, lse, parallel_for);
  }
#endif
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  if (Chosen() >= Isa::kV3) return isa_v3::Forward(p, dtype, q, k, v, out, lse, parallel_for);
#endif
  isa_baseline::Forward(p, dtype, q, k, v, out, lse, parallel_for);
}

void Backward(const Params& p, DType dtype, const void* q, const void* k, const void* v,
              const void* out, const float* lse, const void* dout, const float* dlse,
              void* dq, void* dk, void* dv, const ParallelFor& parallel_for) {
  OneBlasThread();
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  if (Chosen() >= Isa::kV3) {
    return isa_v3::Backward(p, dtype, q, k, v, out, lse, dout, dlse, dq, dk, dv, parallel_for);
  }
#endif
  isa_baseline::Backward(p, dtype, q, k, v, out, lse, dout, dlse, dq, dk, dv, parallel_for);
}

void PagedForward(const Params& p, const PagedArgs& a, DType dtype, const void* q,
                  const void* k, const void* v, void* out, const ParallelFor& parallel_for) {
  OneBlasThread();
#if defined(ATTN_NATIVE_CPU_HAVE_AVX512_BF16)
  if (Chosen() == Isa::kAvx512Bf16 && Avx512PagedSupported()) {
    return isa_avx512_bf16::PagedForward(p, a, dtype, q, k, v, out, parallel_for);
  }
#endif
#if defined(ATTN_NATIVE_CPU_HAVE_V3)
  if (Chosen() >= Isa::kV3) return isa_v3::PagedForward(p, a, dtype, q, k, v, out, parallel_for);
#endif
  isa_baseline::PagedForward(p, a, dtype, q, k, v, out, parallel_for);
}

}  // namespace attn_native_cpu
