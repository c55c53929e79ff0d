// ThreadSanitizer check of the kernels' threading: Forward and Backward over
// every item kind (several query blocks and key blocks, GQA, causal, window,
// kv lengths; float32 and bfloat16) on 2 std::threads claiming items from one
// counter, as ffi.cc's pool does; then the same at 1 thread, bit for bit.
// Both builds of the kernels run (the baseline one, which the suite never
// reaches on an AVX2 machine, and x86-64-v3 where the CPU has it), and must
// agree with each other to float32 rounding.
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

template <class Kernels>
Outputs Run(an::DType dtype, int threads) {
  const int64_t b = 2, t = 300, hq = 4, hkv = 2, d = 16;
  static const std::vector<int32_t> kv_lengths = {300, 170};
  an::Params p;
  p.shape = {b, t, t, hq, hkv, d, d};
  p.scale = 0.25f;
  p.vis.causal = true;
  p.vis.window_left = 200;
  p.vis.kv_lengths = kv_lengths.data();
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::vector<float> q(b * t * hq * d), k(b * t * hkv * d), v(k.size()), dout(q.size());
  for (auto* x : {&q, &k, &v, &dout}) {
    for (auto& e : *x) e = normal(gen);
  }
  // bfloat16 inputs: the float32 values' top halves.
  auto as = [&](std::vector<float>& x) -> void* {
    if (dtype == an::DType::kF32) return x.data();
    auto* bits = reinterpret_cast<uint16_t*>(x.data());
    for (size_t i = 0; i < x.size(); ++i) {
      uint32_t w;
      std::memcpy(&w, &x[i], 4);
      bits[i] = static_cast<uint16_t>(w >> 16);
    }
    return x.data();
  };
  void *qp = as(q), *kp = as(k), *vp = as(v), *dop = as(dout);
  std::vector<float> out(q.size()), lse(b * hq * t), dlse(lse.size(), 0.0f), dq(q.size()),
      dk(k.size()), dv(v.size());
  Kernels::Forward(p, dtype, qp, kp, vp, out.data(), lse.data(), Threads(threads));
  Kernels::Backward(p, dtype, qp, kp, vp, out.data(), lse.data(), dop, dlse.data(), dq.data(),
               dk.data(), dv.data(), Threads(threads));
  auto bits = [](const std::vector<float>& x) {
    std::vector<uint32_t> r(x.size());
    std::memcpy(r.data(), x.data(), x.size() * 4);
    return r;
  };
  return {bits(out), bits(lse), bits(dq), bits(dk), bits(dv)};
}

struct Baseline {
  static constexpr auto Forward = an::isa_baseline::Forward;
  static constexpr auto Backward = an::isa_baseline::Backward;
  static constexpr const char* name = "baseline";
};
struct V3 {
  static constexpr auto Forward = an::isa_v3::Forward;
  static constexpr auto Backward = an::isa_v3::Backward;
  static constexpr const char* name = "x86-64-v3";
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
template <class Kernels>
Outputs SameAtOneAndTwo(an::DType dtype, int* failures) {
  const Outputs one = Run<Kernels>(dtype, 1), two = Run<Kernels>(dtype, 2);
  for (int i = 0; i < 5; ++i) {
    if (*Fields(one)[i] != *Fields(two)[i]) {
      std::printf("%s kernels: %s differs between 1 and 2 threads (%s)\n", Kernels::name,
                  kNames[i], dtype == an::DType::kF32 ? "float32" : "bfloat16");
      ++*failures;
    }
  }
  return two;
}

}  // namespace

int main() {
  int failures = 0;
  const bool v3 = an::KernelIsa() == std::string("x86-64-v3");
  for (an::DType dtype : {an::DType::kF32, an::DType::kBF16}) {
    const Outputs base = SameAtOneAndTwo<Baseline>(dtype, &failures);
    if (!v3) continue;
    const Outputs fast = SameAtOneAndTwo<V3>(dtype, &failures);
    // The builds round differently (FMA); float32 accumulations of O(1) terms
    // over at most 300 keys agree to well within 1e-4 (bfloat16 outputs: 1e-2).
    const float tolerance = dtype == an::DType::kF32 ? 1e-4f : 1e-2f;
    for (int i = 0; i < 5; ++i) {
      const auto &a = *Fields(base)[i], &c = *Fields(fast)[i];
      float worst = 0.0f;
      for (size_t e = 0; e < a.size(); ++e) {
        const float x = AsFloat(a[e]), y = AsFloat(c[e]);
        if (std::isinf(x) && x == y) continue;  // lse of a row that sees no key
        worst = std::max(worst, std::fabs(x - y));
      }
      if (!(worst <= tolerance)) {
        std::printf("%s: baseline and x86-64-v3 kernels differ by %g\n", kNames[i], worst);
        ++failures;
      }
    }
  }
  std::printf("race_check (%s kernels): %s\n", an::KernelIsa(), failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
