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
// rounded), this is the IEEE instruction. tests/optim/test_kernel_adamw.py checks all of it.
// `w` returns sqrt(v), which lean state keeps (quantized) instead of v.
template <class V>
__attribute__((always_inline)) inline void adamw_math_w(typename V::F& p, typename V::F g, typename V::F& m,
                                                        typename V::F& v, typename V::F& w, const Consts<V>& k) {
  g = g * k.grad_scale;                                       // clip coefficient folded in
  p = p * k.decay;                                            // decoupled weight decay
  m = V::fma(k.lerp_w, g - m, k.lerp_from_m ? m : g);         // m.lerp_(g, 1 - beta1)
  v = V::fma(k.one_minus_beta2 * g, g, v * k.beta2);          // v.mul_(b2).addcmul_(g, g, 1 - b2)
  w = V::sqrt(v);
  const typename V::F denom = w / k.bc2_sqrt + k.eps;
  p = p + k.neg_step * m / denom;                             // p.addcdiv_(m, denom, -lr / bc1)
}

template <class V>
__attribute__((always_inline)) inline void adamw_math(typename V::F& p, typename V::F g, typename V::F& m,
                                                      typename V::F& v, const Consts<V>& k) {
  typename V::F w;
  adamw_math_w<V>(p, g, m, v, w, k);
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

// ---- lean state (optim/lean.py) ----------------------------------------------------------------
// Per block of kLeanBlock elements: decode the master (hi, lo8) and the moments (8-bit codes times
// the block's fp32 scale), run the AdamW update above on the vector type, then re-encode. The
// decode and encode loops are plain integer and IEEE code over a block held in L1; the compiler
// vectorizes them under each ISA's target, and their results cannot depend on how it does.

// magnitude code -> value: code 0 is 0, else the fp32 with exponent/mantissa bits (c + (E0 << M)) << (23 - M)
template <int M>
static inline float lean_decode(uint32_t c) {
  const uint32_t u = (c + (kLeanE0 << M)) << (23 - M);
  float x;
  std::memcpy(&x, &u, sizeof x);
  return c == 0 ? 0.0f : x;
}

// x >= +0 -> min(x, 1) -> its nearest code (ties away from zero); below the smallest binade: 0 or
// the smallest code, whichever is nearer (keep_nonzero: the smallest code for any x > 0). Every
// comparison is on the bit pattern (non-negative floats order as integers; NaN counts as > 1):
// integer selects vectorize, float compares (which may trap) are not if-converted.
template <int M, bool keep_nonzero>
static inline uint32_t lean_encode(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = u > 0x3F800000u ? 0x3F800000u : u;  // min(x, 1.0)
  const int32_t c = static_cast<int32_t>((u + (1u << (22 - M))) >> (23 - M)) - static_cast<int32_t>(kLeanE0 << M);
  const uint32_t half_smallest = ((1u + (kLeanE0 << M)) << (23 - M)) - (1u << 23);  // value of code 1, halved
  const bool nonzero = keep_nonzero ? u != 0 : u >= half_smallest;
  return c < 1 ? static_cast<uint32_t>(nonzero) : static_cast<uint32_t>(c);
}

// lowbias32 (optim/lean.py hash32): the stochastic rounding's dither
static inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

static inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

static inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// hi: (n,) bf16 bits, lo8: (n,) int8, g: fp32 or bf16 bits, qm, qw: (n,) codes, sm, sw: (n / block,)
// fp32 scales; n a multiple of kLeanBlock. key: the hashed rounding seed; base: the unit offset of
// element 0, so each element's dither is hash32((base + i) ^ key) >> 24 however the unit is sliced.
template <class Vec, class G>
static void lean_range(uint16_t* __restrict hi, int8_t* __restrict lo8, const G* __restrict g,
                       uint8_t* __restrict qm, uint8_t* __restrict qw, float* __restrict sm, float* __restrict sw,
                       int64_t n, const Coeffs& c, uint32_t key, int64_t base) {
  const Consts<Vec> kv(c);
  alignas(64) float p[kLeanBlock], m[kLeanBlock], w[kLeanBlock];
  for (int64_t b = 0; b < n / kLeanBlock; ++b) {
    const int64_t o = b * kLeanBlock;
    const float smb = sm[b], swb = sw[b];
    for (int i = 0; i < kLeanBlock; ++i) {
      p[i] = float_of((static_cast<uint32_t>(hi[o + i]) << 16) +
                      (static_cast<uint32_t>(static_cast<int32_t>(lo8[o + i])) << 8));
      const uint32_t cm = qm[o + i];
      const float mag = lean_decode<kLeanMMant>(cm & 0x7Fu) * smb;
      m[i] = (cm & 0x80u) ? -mag : mag;
      w[i] = lean_decode<kLeanWMant>(qw[o + i]) * swb;
    }
    for (int i = 0; i < kLeanBlock; i += Vec::W) {
      typename Vec::F pv = Vec::load(p + i), mv = Vec::load(m + i), wv = Vec::load(w + i);
      typename Vec::F vv = wv * wv;
      adamw_math_w<Vec>(pv, load_grad<Vec>(g + o + i), mv, vv, wv, kv);
      Vec::store(p + i, pv), Vec::store(m + i, mv), Vec::store(w + i, wv);
    }
    uint32_t am = 0, aw = 0;  // block maxima: non-negative floats order as their bit patterns
    for (int i = 0; i < kLeanBlock; ++i) {
      am = std::max(am, bits_of(m[i]) & 0x7FFFFFFFu);
      aw = std::max(aw, bits_of(w[i]));
    }
    const float amax = float_of(am), wmax = float_of(aw);
    const float im = amax > 0.0f ? 1.0f / amax : 0.0f, iw = wmax > 0.0f ? 1.0f / wmax : 0.0f;
    alignas(64) uint32_t r[kLeanBlock], cm[kLeanBlock], cw[kLeanBlock];
    for (int i = 0; i < kLeanBlock; ++i) {  // codes into registers first: a loop that vectorizes
      const uint32_t dith = hash32(static_cast<uint32_t>(base + o + i) ^ key) >> 24;
      r[i] = (bits_of(p[i]) + dith) & 0xFFFFFF00u;  // the master to 16 significant bits
      const uint32_t mb = bits_of(m[i]);
      const float xm = float_of(mb & 0x7FFFFFFFu) * im, xw = w[i] * iw;
      const uint32_t c = lean_encode<kLeanMMant, false>(xm);
      cm[i] = c | ((static_cast<uint32_t>(c != 0) & (mb >> 31)) << 7);  // the sign, unless 0
      cw[i] = lean_encode<kLeanWMant, true>(xw);
    }
    for (int i = 0; i < kLeanBlock; ++i) {
      hi[o + i] = static_cast<uint16_t>((r[i] + 0x8000u) >> 16);
      lo8[o + i] = static_cast<int8_t>(static_cast<uint8_t>(r[i] >> 8));
      qm[o + i] = static_cast<uint8_t>(cm[i]);
      qw[o + i] = static_cast<uint8_t>(cw[i]);
    }
    sm[b] = amax, sw[b] = wmax;
  }
}
