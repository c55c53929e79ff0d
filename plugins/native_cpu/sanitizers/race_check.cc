// ThreadSanitizer check of the kernels' threading: Forward and Backward over
// every item kind (several query blocks and key blocks, GQA, causal, window,
// kv lengths; float32 and bfloat16), a decode step (its items split the keys,
// then merge) and a ragged paged batch (prefill tiles beside decode splits)
// on 2 std::threads claiming items from one counter, as ffi.cc's pool does;
// then the same at 1 thread, bit for bit.
// Every build of the kernels the CPU runs (the baseline one, which the suite
// never reaches on an AVX2 machine; x86-64-v3; the bfloat16 products of
// avx512-bf16), each against the baseline to float32 (bfloat16) rounding.
// Built and run by sanitizers/run.sh thread (CMake target
// attn_native_cpu_race_check). Python under TSan is not an option: TSan must
// own the process's memory map from its first instruction, which an
// LD_PRELOAD into CPython with jaxlib does not give it.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../csrc/attention.h"

namespace an = attn_native_cpu;

namespace {

an::ParallelFor Threads(int count) {
  return [count](int64_t n, const std::function<void(int64_t)>& body) {
    std::atomic<int64_t> next{0};
    auto drain = [&] {
      for (int64_t i; (i = next.fetch_add(1)) < n;) body(i);
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < count; ++t) pool.emplace_back(drain);
    drain();
    for (auto& t : pool) t.join();
  };
}

struct Outputs {
  std::vector<uint32_t> out, lse, dq, dk, dv;  // float32 storage, compared as bits
};

std::vector<float> Normal(size_t n, std::mt19937* gen) {
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& e : x) e = normal(*gen);
  return x;
}

// bfloat16 inputs: the float32 values' top halves, in place.
void* As(an::DType dtype, std::vector<float>& x) {
  if (dtype == an::DType::kF32) return x.data();
  auto* bits = reinterpret_cast<uint16_t*>(x.data());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t w;
    std::memcpy(&w, &x[i], 4);
    bits[i] = static_cast<uint16_t>(w >> 16);
  }
  return x.data();
}

std::vector<uint32_t> Bits(const std::vector<float>& x) {
  std::vector<uint32_t> r(x.size());
  std::memcpy(r.data(), x.data(), x.size() * 4);
  return r;
}

// One dense case: Tq query rows against Tk keys, Hq query heads over 2 kv heads.
struct Case {
  int64_t t_q, t_k, hq;
  std::vector<int32_t> kv_lengths;  // [2]
  int64_t window_left;
};

// Tiles of query blocks and key blocks (GQA 2); a decode step (one row per
// query head of a group of 4, three splits of keys).
const Case kCases[] = {{300, 300, 4, {300, 170}, 200}, {1, 1300, 8, {1300, 700}, 1000}};

template <class Kernels>
Outputs Run(const Case& c, an::DType dtype, int threads) {
  const int64_t b = 2, hkv = 2, d = 16, hq = c.hq;
  an::Params p;
  p.shape = {b, c.t_q, c.t_k, hq, hkv, d, d};
  p.scale = 0.25f;
  p.vis.causal = true;
  p.vis.window_left = c.window_left;
  p.vis.kv_lengths = c.kv_lengths.data();
  std::mt19937 gen(0);
  auto q = Normal(b * c.t_q * hq * d, &gen), k = Normal(b * c.t_k * hkv * d, &gen),
       v = Normal(k.size(), &gen), dout = Normal(q.size(), &gen);
  void *qp = As(dtype, q), *kp = As(dtype, k), *vp = As(dtype, v), *dop = As(dtype, dout);
  std::vector<float> out(q.size()), lse(b * hq * c.t_q), dlse(lse.size(), 0.0f), dq(q.size()),
      dk(k.size()), dv(v.size());
  Kernels::Forward(p, dtype, qp, kp, vp, out.data(), lse.data(), Threads(threads));
  Kernels::Backward(p, dtype, qp, kp, vp, out.data(), lse.data(), dop, dlse.data(), dq.data(),
               dk.data(), dv.data(), Threads(threads));
  return {Bits(out), Bits(lse), Bits(dq), Bits(dk), Bits(dv)};
}

// A ragged paged batch: a prefill chunk of 40 rows (tiles), decode steps of 1
// and 2 rows (split items), keys over several splits through a shuffled page
// table, a page index outside the pool; only out is filled.
// The same batch over a quantized cache (cache: int8 or float8_e4m3fn bytes,
// finite values; a float32 scale per position and kv head).
template <class Kernels>
Outputs RunPaged(an::DType dtype, int threads, an::CacheType cache = an::CacheType::kSame) {
  const int64_t hq = 8, hkv = 2, d = 16, page_size = 16, width = 100, pages = 200;
  const std::vector<int32_t> cu_q_lens = {0, 40, 41, 43}, kv_lens = {1100, 600, 1500};
  std::vector<int32_t> table(3 * width);
  std::mt19937 gen(1);
  for (auto& e : table) e = static_cast<int32_t>(gen() % pages);
  table[5] = 1000;  // outside the pool: clamped
  an::Params p;
  p.shape = {1, cu_q_lens.back(), 0, hq, hkv, d, d};
  p.scale = 0.25f;
  auto q = Normal(cu_q_lens.back() * hq * d, &gen), k = Normal(pages * page_size * hkv * d, &gen),
       v = Normal(k.size(), &gen);
  void *qp = As(dtype, q), *kp = As(dtype, k), *vp = As(dtype, v);
  // Quantized: bytes of finite values (float8_e4m3fn below 0x78 in magnitude).
  std::vector<uint8_t> k8(k.size()), v8(k.size());
  std::vector<float> k_scales(pages * page_size * hkv), v_scales(k_scales.size());
  if (cache != an::CacheType::kSame) {
    for (auto* bytes : {&k8, &v8}) {
      for (auto& b : *bytes) b = static_cast<uint8_t>((gen() % 0x78) | (gen() % 2 ? 0x80 : 0));
    }
    for (auto* scales : {&k_scales, &v_scales}) {
      for (auto& x : *scales) x = 0.01f + 0.01f * static_cast<float>(gen() % 100) / 100.0f;
    }
    kp = k8.data();
    vp = v8.data();
  }
  const an::PagedArgs a{cu_q_lens.data(), kv_lens.data(), table.data(), 3, 3, width,
                        page_size, pages, 700, cache, k_scales.data(), v_scales.data()};
  std::vector<float> out(q.size(), 0.0f);
  Kernels::PagedForward(p, a, dtype, qp, kp, vp, out.data(), Threads(threads));
  return {Bits(out), {}, {}, {}, {}};
}

struct Baseline {
  static constexpr auto Forward = an::isa_baseline::Forward;
  static constexpr auto Backward = an::isa_baseline::Backward;
  static constexpr auto PagedForward = an::isa_baseline::PagedForward;
  static constexpr const char* name = "baseline";
};
struct V3 {
  static constexpr auto Forward = an::isa_v3::Forward;
  static constexpr auto Backward = an::isa_v3::Backward;
  static constexpr auto PagedForward = an::isa_v3::PagedForward;
  static constexpr const char* name = "x86-64-v3";
};
// The paged forward whose decode tiles over a quantized cache take bfloat16
// products, where the CPU has AVX512_VBMI too (as dispatch.cc picks it).
void Avx512PagedForward(const an::Params& p, const an::PagedArgs& a, an::DType dtype,
                        const void* q, const void* k, const void* v, void* out,
                        const an::ParallelFor& parallel_for) {
  if (an::Avx512PagedSupported()) {
    return an::isa_avx512_bf16::PagedForward(p, a, dtype, q, k, v, out, parallel_for);
  }
  an::isa_v3::PagedForward(p, a, dtype, q, k, v, out, parallel_for);
}

// The dense bfloat16 forward and the quantized decode tiles by bfloat16
// products; x86-64-v3's everything else.
struct Avx512Bf16 {
  static constexpr auto Forward = an::isa_avx512_bf16::Forward;
  static constexpr auto Backward = an::isa_v3::Backward;
  static constexpr auto PagedForward = Avx512PagedForward;
  static constexpr const char* name = "avx512-bf16";
};

const char* kNames[] = {"out", "lse", "dq", "dk", "dv"};

std::vector<const std::vector<uint32_t>*> Fields(const Outputs& o) {
  return {&o.out, &o.lse, &o.dq, &o.dk, &o.dv};
}

float AsFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Same bits at 1 and 2 threads; returns the 2-thread outputs.
template <class Kernels, class Runner>
Outputs SameAtOneAndTwo(const Runner& run, const char* what, an::DType dtype, int* failures) {
  const Outputs one = run(dtype, 1), two = run(dtype, 2);
  for (int i = 0; i < 5; ++i) {
    if (*Fields(one)[i] != *Fields(two)[i]) {
      std::printf("%s kernels, %s: %s differs between 1 and 2 threads (%s)\n", Kernels::name,
                  what, kNames[i], dtype == an::DType::kF32 ? "float32" : "bfloat16");
      ++*failures;
    }
  }
  return two;
}

// The outputs of two builds agree: they round differently (FMA; bfloat16
// weights), and float32 accumulations of O(1) terms over at most 1500 keys
// agree to well within 1e-4 (bfloat16 outputs: 1e-2).
void Agree(const Outputs& a_out, const Outputs& c_out, const char* what, const char* name,
           an::DType dtype, int* failures) {
  const float tolerance = dtype == an::DType::kF32 ? 1e-4f : 1e-2f;
  for (int i = 0; i < 5; ++i) {
    const auto &a = *Fields(a_out)[i], &c = *Fields(c_out)[i];
    float worst = 0.0f;
    for (size_t e = 0; e < a.size(); ++e) {
      const float x = AsFloat(a[e]), y = AsFloat(c[e]);
      if (std::isinf(x) && x == y) continue;  // lse of a row that sees no key
      worst = std::max(worst, std::fabs(x - y));
    }
    if (!(worst <= tolerance)) {
      std::printf("%s: %s: baseline and %s kernels differ by %g\n", what, kNames[i], name, worst);
      ++*failures;
    }
  }
}

// Every case at 1 and 2 threads with every build of the kernels this CPU
// runs, and each against the baseline.
template <class Runner>
void Check(const Runner& run, const char* what, int* failures) {
  const std::string isa = an::KernelIsa();
  for (an::DType dtype : {an::DType::kF32, an::DType::kBF16}) {
    const Outputs base = SameAtOneAndTwo<Baseline>(
        [&](an::DType t, int n) { return run(Baseline{}, t, n); }, what, dtype, failures);
    if (isa == "baseline") continue;
    const Outputs fast = SameAtOneAndTwo<V3>(
        [&](an::DType t, int n) { return run(V3{}, t, n); }, what, dtype, failures);
    Agree(base, fast, what, V3::name, dtype, failures);
    if (isa != Avx512Bf16::name) continue;
    const Outputs products = SameAtOneAndTwo<Avx512Bf16>(
        [&](an::DType t, int n) { return run(Avx512Bf16{}, t, n); }, what, dtype, failures);
    Agree(base, products, what, Avx512Bf16::name, dtype, failures);
  }
}

}  // namespace

int main() {
  int failures = 0;
  for (const Case& c : kCases) {
    const std::string what = c.t_q == 1 ? "decode" : "tiles";
    Check([&](auto kernels, an::DType t, int n) { return Run<decltype(kernels)>(c, t, n); },
          what.c_str(), &failures);
  }
  Check([&](auto kernels, an::DType t, int n) {
          return RunPaged<decltype(kernels)>(t, n);
        },
        "paged", &failures);
  for (an::CacheType cache : {an::CacheType::kInt8, an::CacheType::kE4M3}) {
    Check([&](auto kernels, an::DType t, int n) {
            return RunPaged<decltype(kernels)>(t, n, cache);
          },
          cache == an::CacheType::kInt8 ? "paged int8" : "paged float8_e4m3fn", &failures);
  }
  std::printf("race_check (%s kernels): %s\n", an::KernelIsa(), failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
