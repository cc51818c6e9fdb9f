// Fused CPU AdamW for horizon's optimize stage: one pass over one contiguous unit (a decoder
// layer's flat buffer), OpenMP-parallel over chunks. Reference and semantics:
// horizon_cli/optim/adamw.py (adamw_fp32_, adamw_split_) and optim/split.py; loaded by
// horizon_cli/optim/native.py.
//
//   adamw_fp32 (p f32, g f32, m f32, v f32, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
//   adamw_split(hi bf16, lo i16, g f32, m f32, v f32, ...same scalars)
//
// Per element this reads 16 bytes and writes 12 in both variants (the split master is 2+2 bytes
// instead of 4), so on large buffers the kernel runs at memory bandwidth; the point of fusing is
// one pass instead of the reference's ~8 and no temporaries.
//
// Paths: AVX-512 and AVX2+FMA (compiled with per-region target pragmas, so no -march flag is
// needed) and a scalar fallback, picked at run time with __builtin_cpu_supports or forced by name
// for tests. All three give bitwise identical results (same IEEE operations in the same order).
//
// Numerics: torch's fp32 operations in torch's order, so m and v are bitwise those of the
// reference and of torch.optim.AdamW; p differs from them only through sqrt, which here is
// correctly rounded and in torch is MKL's (see adamw_impl.h).
//
// Build flags that matter: -ffp-contract=off (no silent a*b+c fusion: the rounding must follow
// torch's), -fopenmp.

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

// Per-call scalars, each rounded from double to float exactly where torch rounds its Python
// float arguments, so the per-element math sees the same constants as the reference.
struct Coeffs {
  float grad_scale, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  bool lerp_from_m;  // torch's lerp takes start + w*(end - start) when |w| < 0.5, else end + (w-1)*(end - start)
};

Coeffs make_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                   double grad_scale) {
  // The same double expressions as optim/adamw.py (Python floats are doubles, ** is pow()).
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step)));
  const float w = static_cast<float>(1.0 - beta1);
  Coeffs c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.lerp_from_m = std::fabs(w) < 0.5f;
  c.lerp_w = c.lerp_from_m ? w : w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(bc2_sqrt);
  c.eps = static_cast<float>(eps);
  c.neg_step = static_cast<float>(-lr / bc1);
  return c;
}

// optim/split.py on one element: master bits u = (hi << 16) + sign-extended lo (mod 2^32).
inline float join_bits(uint16_t hi, int16_t lo) {
  const uint32_t u = (static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo));
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// hi = (u + 0x8000) >> 16 (round to nearest, ties away from zero); lo = u - (hi << 16), whose 16
// low bits are just u's. Unsigned arithmetic: same bits as split.py's int32 ops, no signed overflow.
inline void split_bits(float x, uint16_t* hi, int16_t* lo) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  *hi = static_cast<uint16_t>((u + 0x8000u) >> 16);
  *lo = static_cast<int16_t>(static_cast<uint16_t>(u));
}

// Lean state (optim/lean.py): blocks of 64 elements (the store's tensor alignment), codes over the
// binades 2^-15 .. 1 (E0 = 112 is 2^-15's biased exponent), 3 mantissa bits for m, 4 for sqrt(v).
constexpr int kLeanBlock = 64;
constexpr uint32_t kLeanE0 = 112;
constexpr int kLeanMMant = 3, kLeanWMant = 4;

namespace scalar {
#include "adamw_impl.h"
using V = Scalar;
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct V {
  using F = __m256;
  static constexpr int W = 8;
  static inline F set1(float x) { return _mm256_set1_ps(x); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F sqrt(F x) { return _mm256_sqrt_ps(x); }
  static inline F join(const uint16_t* hi, const int16_t* lo) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
    const __m256i l = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(h, 16), l));
  }
  static inline F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  // 8 x u32 in [0, 65535] -> 8 x u16. AVX2 has no vpmovdw: pack within lanes, then gather the
  // two useful quadwords.
  static inline __m128i narrow(__m256i x) {
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x08));
  }
  static inline void split(F x, uint16_t* hi, int16_t* lo) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), 16);
    const __m256i l = _mm256_and_si256(u, _mm256_set1_epi32(0xFFFF));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), narrow(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), narrow(l));
  }
};
#include "adamw_impl.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
struct V {
  using F = __m512;
  static constexpr int W = 16;
  static inline F set1(float x) { return _mm512_set1_ps(x); }
  static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F sqrt(F x) { return _mm512_sqrt_ps(x); }
  static inline F join(const uint16_t* hi, const int16_t* lo) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)));
    const __m512i l = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 16), l));
  }
  static inline F load_bf16(const uint16_t* p) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  static inline void split(F x, uint16_t* hi, int16_t* lo) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)), 16);
    // vpmovdw truncates to the low 16 bits: exactly hi, and lo's bits.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(u));
  }
};
#include "adamw_impl.h"
}  // namespace avx512
#pragma GCC pop_options

// ---- dispatch ------------------------------------------------------------------------------

template <class G>
using Fp32Fn = void (*)(float*, const G*, float*, float*, int64_t, const Coeffs&);
template <class G>
using SplitFn = void (*)(uint16_t*, int16_t*, const G*, float*, float*, int64_t, const Coeffs&);
template <class G>
using LeanFn = void (*)(uint16_t*, int8_t*, const G*, uint8_t*, uint8_t*, float*, float*, int64_t, const Coeffs&,
                        uint32_t, int64_t);

struct Isa {
  const char* name;
  bool (*supported)();
  Fp32Fn<float> fp32;
  SplitFn<float> split;
  Fp32Fn<uint16_t> fp32_bf16g;  // the same updates, bf16 gradients
  SplitFn<uint16_t> split_bf16g;
  LeanFn<float> lean;
  LeanFn<uint16_t> lean_bf16g;
};

#define HORIZON_ISA_FNS(ns)                                                               \
  ns::fp32_range<ns::V, float>, ns::split_range<ns::V, float>, ns::fp32_range<ns::V, uint16_t>, \
      ns::split_range<ns::V, uint16_t>, ns::lean_range<ns::V, float>, ns::lean_range<ns::V, uint16_t>

// Best first. __builtin_cpu_supports also checks that the OS saves the wide registers.
const Isa kIsas[] = {
    {"avx512", [] { return __builtin_cpu_supports("avx512f") != 0; }, HORIZON_ISA_FNS(avx512)},
    {"avx2", [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); },
     HORIZON_ISA_FNS(avx2)},
    {"scalar", [] { return true; }, HORIZON_ISA_FNS(scalar)},
};

const Isa& pick(const std::string& name) {
  for (const Isa& isa : kIsas) {
    if (name == "auto" ? isa.supported() : name == isa.name) {
      TORCH_CHECK(isa.supported(), "adamw: this CPU does not support the ", name, " path");
      return isa;
    }
  }
  TORCH_CHECK(false, "adamw: unknown isa '", name, "' (expected auto, avx512, avx2 or scalar)");
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const Isa& isa : kIsas)
    if (isa.supported()) out.emplace_back(isa.name);
  return out;
}

// Runs fn(begin, len) over [0, n) in chunks; schedule(static) gives each thread one contiguous
// run of chunks, the friendliest pattern for the hardware prefetchers. 16K elements: a multiple of
// every vector width, and large enough that a unit below two chunks is not worth waking threads.
template <class Fn>
void parallel_chunks(int64_t n, const Fn& fn) {
  constexpr int64_t kChunk = int64_t{1} << 14;
  if (n <= 0) return;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  // at::get_num_threads follows torch.set_num_threads, so the kernel uses what torch uses.
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), chunks));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    fn(begin, std::min(kChunk, n - begin));
  }
}

void check(const at::Tensor& t, const char* fn, const char* what, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, fn, ": ", what, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, fn, ": ", what, " has ", t.numel(), " elements, expected ", numel);
}

// g may be fp32 or bf16; returns whether it is bf16.
bool check_grad(const at::Tensor& g, const char* fn, int64_t numel) {
  const bool bf16 = g.scalar_type() == at::kBFloat16;
  check(g, fn, "g", bf16 ? at::kBFloat16 : at::kFloat, numel);
  return bf16;
}

void check_scalars(const char* fn, int64_t step, double beta1, double beta2) {
  TORCH_CHECK(step >= 1, fn, ": step is 1-based, got ", step);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, fn,
              ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
}

void adamw_fp32(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step, double grad_scale,
                const std::string& isa) {
  const int64_t n = p.numel();
  check(p, "adamw_fp32", "p", at::kFloat, n);
  const bool bf16g = check_grad(g, "adamw_fp32", n);
  check(m, "adamw_fp32", "m", at::kFloat, n);
  check(v, "adamw_fp32", "v", at::kFloat, n);
  check_scalars("adamw_fp32", step, beta1, beta2);
  const Isa& chosen = pick(isa);
  const Coeffs c = make_coeffs(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  float* pp = p.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  if (bf16g) {
    const auto* gp = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
    parallel_chunks(n, [&](int64_t b, int64_t len) { chosen.fp32_bf16g(pp + b, gp + b, mp + b, vp + b, len, c); });
  } else {
    const float* gp = g.data_ptr<float>();
    parallel_chunks(n, [&](int64_t b, int64_t len) { chosen.fp32(pp + b, gp + b, mp + b, vp + b, len, c); });
  }
}

void adamw_split(at::Tensor& hi, at::Tensor& lo, const at::Tensor& g, at::Tensor& m, at::Tensor& v, double lr,
                 double beta1, double beta2, double eps, double weight_decay, int64_t step, double grad_scale,
                 const std::string& isa) {
  const int64_t n = hi.numel();
  check(hi, "adamw_split", "hi", at::kBFloat16, n);
  check(lo, "adamw_split", "lo", at::kShort, n);
  const bool bf16g = check_grad(g, "adamw_split", n);
  check(m, "adamw_split", "m", at::kFloat, n);
  check(v, "adamw_split", "v", at::kFloat, n);
  check_scalars("adamw_split", step, beta1, beta2);
  const Isa& chosen = pick(isa);
  const Coeffs c = make_coeffs(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  auto* hp = reinterpret_cast<uint16_t*>(hi.data_ptr<at::BFloat16>());
  int16_t* lp = lo.data_ptr<int16_t>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  if (bf16g) {
    const auto* gp = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
    parallel_chunks(n, [&](int64_t b, int64_t len) { chosen.split_bf16g(hp + b, lp + b, gp + b, mp + b, vp + b, len, c); });
  } else {
    const float* gp = g.data_ptr<float>();
    parallel_chunks(n, [&](int64_t b, int64_t len) { chosen.split(hp + b, lp + b, gp + b, mp + b, vp + b, len, c); });
  }
}

void adamw_lean(at::Tensor& hi, at::Tensor& lo8, const at::Tensor& g, at::Tensor& qm, at::Tensor& qw, at::Tensor& sm,
                at::Tensor& sw, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                double grad_scale, int64_t seed, int64_t base, const std::string& isa) {
  const int64_t n = hi.numel();
  TORCH_CHECK(n % kLeanBlock == 0, "adamw_lean: ", n, " elements is not a multiple of the block (", kLeanBlock, ")");
  check(hi, "adamw_lean", "hi", at::kBFloat16, n);
  check(lo8, "adamw_lean", "lo8", at::kChar, n);
  const bool bf16g = check_grad(g, "adamw_lean", n);
  check(qm, "adamw_lean", "qm", at::kByte, n);
  check(qw, "adamw_lean", "qw", at::kByte, n);
  check(sm, "adamw_lean", "sm", at::kFloat, n / kLeanBlock);
  check(sw, "adamw_lean", "sw", at::kFloat, n / kLeanBlock);
  check_scalars("adamw_lean", step, beta1, beta2);
  const Isa& chosen = pick(isa);
  const Coeffs c = make_coeffs(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  auto* hp = reinterpret_cast<uint16_t*>(hi.data_ptr<at::BFloat16>());
  int8_t* lp = lo8.data_ptr<int8_t>();
  uint8_t* mp = qm.data_ptr<uint8_t>();
  uint8_t* wp = qw.data_ptr<uint8_t>();
  float* smp = sm.data_ptr<float>();
  float* swp = sw.data_ptr<float>();
  const uint32_t key = scalar::hash32(static_cast<uint32_t>(seed));
  // chunks are multiples of the block, so each block's scales belong to one chunk
  if (bf16g) {
    const auto* gp = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
    parallel_chunks(n, [&](int64_t b, int64_t len) {
      chosen.lean_bf16g(hp + b, lp + b, gp + b, mp + b, wp + b, smp + b / kLeanBlock, swp + b / kLeanBlock, len, c, key, base + b);
    });
  } else {
    const float* gp = g.data_ptr<float>();
    parallel_chunks(n, [&](int64_t b, int64_t len) {
      chosen.lean(hp + b, lp + b, gp + b, mp + b, wp + b, smp + b / kLeanBlock, swp + b / kLeanBlock, len, c, key,
                  base + b);
    });
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  namespace py = pybind11;
  mod.doc() = "Fused CPU AdamW over flat buffers (horizon kernels/adamw.cpp).";
  // The GIL is released: the engine runs the optimizer on a host thread while Python keeps
  // driving device work.
  mod.def("adamw_fp32", &adamw_fp32, "In-place AdamW on fp32 p, m, v from fp32 or bf16 g.", py::arg("p"), py::arg("g"),
          py::arg("m"), py::arg("v"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale") = 1.0, py::arg("isa") = "auto",
          py::call_guard<py::gil_scoped_release>());
  mod.def("adamw_split", &adamw_split, "In-place AdamW on the (bf16 hi, int16 lo) master and fp32 m, v.",
          py::arg("hi"), py::arg("lo"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("lr"),
          py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
          py::arg("grad_scale") = 1.0, py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>());
  mod.def("adamw_lean", &adamw_lean,
          "In-place AdamW on lean state: bf16 hi + int8 lo8 master, 8-bit m and sqrt(v) codes with fp32 block scales.",
          py::arg("hi"), py::arg("lo8"), py::arg("g"), py::arg("qm"), py::arg("qw"), py::arg("sm"), py::arg("sw"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
          py::arg("grad_scale") = 1.0, py::arg("seed") = 0, py::arg("base") = 0, py::arg("isa") = "auto",
          py::call_guard<py::gil_scoped_release>());
  mod.def("isas", &supported_isas, "Paths this CPU supports, best first ('auto' picks the first).");
}
