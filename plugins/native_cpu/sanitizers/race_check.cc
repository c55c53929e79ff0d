// ThreadSanitizer check of the kernels' threading: Forward and Backward over
// every item kind (several query blocks and key blocks, GQA, causal, window,
// kv lengths; float32 and bfloat16) on 2 std::threads claiming items from one
// counter, as ffi.cc's pool does; then the same at 1 thread, bit for bit.
// Built and run by sanitizers/run.sh thread (CMake target
// attn_native_cpu_race_check). Python under TSan is not an option: TSan must
// own the process's memory map from its first instruction, which an
// LD_PRELOAD into CPython with jaxlib does not give it.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>
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
  an::Forward(p, dtype, qp, kp, vp, out.data(), lse.data(), Threads(threads));
  an::Backward(p, dtype, qp, kp, vp, out.data(), lse.data(), dop, dlse.data(), dq.data(),
               dk.data(), dv.data(), Threads(threads));
  auto bits = [](const std::vector<float>& x) {
    std::vector<uint32_t> r(x.size());
    std::memcpy(r.data(), x.data(), x.size() * 4);
    return r;
  };
  return {bits(out), bits(lse), bits(dq), bits(dk), bits(dv)};
}

}  // namespace

int main() {
  int failures = 0;
  for (an::DType dtype : {an::DType::kF32, an::DType::kBF16}) {
    const Outputs one = Run(dtype, 1), two = Run(dtype, 2);
    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    const std::vector<uint32_t>* a[] = {&one.out, &one.lse, &one.dq, &one.dk, &one.dv};
    const std::vector<uint32_t>* c[] = {&two.out, &two.lse, &two.dq, &two.dk, &two.dv};
    for (int i = 0; i < 5; ++i) {
      if (*a[i] != *c[i]) {
        std::printf("%s differs between 1 and 2 threads (%s)\n", names[i],
                    dtype == an::DType::kF32 ? "float32" : "bfloat16");
        ++failures;
      }
    }
  }
  std::printf("race_check (%s kernels): %s\n", an::KernelIsa(), failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
