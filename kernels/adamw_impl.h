// One ISA's AdamW loops. Included by adamw.cpp once per instruction set, each time inside its
// own namespace and `#pragma GCC target` region; the region then instantiates the loops with its
// vector type V, which provides:
//
//   using F; static constexpr int W;            register type, lanes
//   F set1(float); F load(const float*); void store(float*, F);
//   F fma(F a, F b, F c);  F sqrt(F);           a*b+c rounded once; IEEE sqrt
//   F join(const uint16_t* hi, const int16_t* lo); void split(F, uint16_t* hi, int16_t* lo);
//   F load_bf16(const uint16_t*);               bf16 bits -> fp32 (exact: a 16-bit shift)
//
// The update itself (`adamw_math`) is written once, with operators, and instantiated for V and
// for the scalar tail. No include guard on purpose: each inclusion is a separate instantiation.

// The scalar instance: the tail of every vector loop, and the whole loop on the scalar path.
// Compiled under the enclosing target, so `fma` is one instruction where the ISA has it.
struct Scalar {
  using F = float;
  static constexpr int W = 1;
  static inline F set1(float x) { return x; }
  static inline F load(const float* p) { return *p; }
  static inline void store(float* p, F x) { *p = x; }
  static inline F fma(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static inline F sqrt(F x) { return __builtin_sqrtf(x); }
  static inline F join(const uint16_t* hi, const int16_t* lo) { return join_bits(*hi, *lo); }
  static inline F load_bf16(const uint16_t* p) { return join_bits(*p, 0); }
  static inline void split(F x, uint16_t* hi, int16_t* lo) { split_bits(x, hi, lo); }
};

// Coeffs broadcast once per call into registers.
template <class V>
struct Consts {
  typename V::F grad_scale, decay, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
  bool lerp_from_m;
  explicit Consts(const Coeffs& c)
      : grad_scale(V::set1(c.grad_scale)), decay(V::set1(c.decay)), lerp_w(V::set1(c.lerp_w)),
        beta2(V::set1(c.beta2)), one_minus_beta2(V::set1(c.one_minus_beta2)),
        bc2_sqrt(V::set1(c.bc2_sqrt)), eps(V::set1(c.eps)), neg_step(V::set1(c.neg_step)),
        lerp_from_m(c.lerp_from_m) {}
};

// The whole update for W elements, in the order and rounding of the torch reference
// (optim/adamw.py). Each operator rounds to fp32 (the build passes -ffp-contract=off so the
// compiler never fuses a*b+c on its own); the two fused multiply-adds are where torch's CPU kernels
// fuse: Vectorized lerp is fma(coeff, end - start, base), and addcmul's `self + value * t1 * t2`
// is compiled to fma(value * t1, t2, self) in the torch 2.13 wheels. So m and v are bitwise the
// reference's. p is too, but for sqrt: torch's CPU sqrt is MKL VML (within 1 ulp, not correctly
// rounded), this is the IEEE instruction. tests/test_kernel_adamw.py checks all of it.
template <class V>
__attribute__((always_inline)) inline void adamw_math(typename V::F& p, typename V::F g, typename V::F& m,
                                                      typename V::F& v, const Consts<V>& k) {
  g = g * k.grad_scale;                                       // clip coefficient folded in
  p = p * k.decay;                                            // decoupled weight decay
  m = V::fma(k.lerp_w, g - m, k.lerp_from_m ? m : g);         // m.lerp_(g, 1 - beta1)
  v = V::fma(k.one_minus_beta2 * g, g, v * k.beta2);          // v.mul_(b2).addcmul_(g, g, 1 - b2)
  const typename V::F denom = V::sqrt(v) / k.bc2_sqrt + k.eps;
  p = p + k.neg_step * m / denom;                             // p.addcdiv_(m, denom, -lr / bc1)
}

// Gradients arrive in fp32, or in bf16 (engine.grad_dtype: half the device -> host traffic).
template <class V>
static inline typename V::F load_grad(const float* g) { return V::load(g); }
template <class V>
static inline typename V::F load_grad(const uint16_t* g) { return V::load_bf16(g); }

// p, m, v: (n,) fp32; g: (n,) fp32 or bf16 bits.
template <class Vec, class G>
static void fp32_range(float* p, const G* g, float* m, float* v, int64_t n, const Coeffs& c) {
  const Consts<Vec> kv(c);
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) {
    typename Vec::F pv = Vec::load(p + i), mv = Vec::load(m + i), vv = Vec::load(v + i);
    adamw_math<Vec>(pv, load_grad<Vec>(g + i), mv, vv, kv);
    Vec::store(p + i, pv), Vec::store(m + i, mv), Vec::store(v + i, vv);
  }
  const Consts<Scalar> ks(c);
  for (; i < n; ++i) adamw_math<Scalar>(p[i], load_grad<Scalar>(g + i), m[i], v[i], ks);
}

// hi: (n,) bf16 bits, lo: (n,) int16, m, v: (n,) fp32, g: fp32 or bf16 bits. The master is rebuilt
// in registers and written back as (hi, lo), so the bf16 streaming copy is refreshed in the same pass.
template <class Vec, class G>
static void split_range(uint16_t* hi, int16_t* lo, const G* g, float* m, float* v, int64_t n,
                        const Coeffs& c) {
  const Consts<Vec> kv(c);
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) {
    typename Vec::F pv = Vec::join(hi + i, lo + i), mv = Vec::load(m + i), vv = Vec::load(v + i);
    adamw_math<Vec>(pv, load_grad<Vec>(g + i), mv, vv, kv);
    Vec::split(pv, hi + i, lo + i), Vec::store(m + i, mv), Vec::store(v + i, vv);
  }
  const Consts<Scalar> ks(c);
  for (; i < n; ++i) {
    float p = Scalar::join(hi + i, lo + i);
    adamw_math<Scalar>(p, load_grad<Scalar>(g + i), m[i], v[i], ks);
    Scalar::split(p, hi + i, lo + i);
  }
}
