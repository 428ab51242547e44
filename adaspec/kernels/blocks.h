/* Weights read at their stored bits: GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K) and
 * 2-byte floats (F16, BF16), widened in registers to exactly the fp32 values of their
 * expansion. Included by blas_route.c once per instruction set, after small_m.h's fp32 kernel
 * (whose vector macros W, VEC, ... are still defined); QFN names this set's functions.
 *
 * A value is the expansion's when every rounding step is the expansion's: each type is the
 * gguf package's numpy dequantization (the converter's) step by step, one IEEE operation per
 * numpy operation. A multiply followed by an add or subtract must round twice, as numpy does,
 * so the product passes through ROUNDED (an empty asm the compiler cannot fuse across).
 *
 * Up to MR rows of A, the values are widened in registers and multiplied at once (the fused
 * tile); more rows share NR rows of B widened into a scratch tile that the fp32 kernel's tile
 * reads (tile_any). Both keep the fp32 kernel's sums in its order (lane l adds k = l mod W in
 * increasing k, then VHSUM), so a token row's result equals the fp32 kernel's on the expansion
 * bit for bit and does not depend on the number of rows. Every type's row length is a multiple
 * of 32 elements and W (8 or 16) divides 32, so a vector never straddles two blocks and K has
 * no tail. */

#define ROUNDED(v) VKEEP(v)
#define NV (32 / W) /* vectors per 32 elements */
#ifndef PF_L1
#define PF_L1 4096 /* a fused tile's next tile goes into L1 up to this many bytes, else L2 */
#endif
/* B rows per fused tile: one or two rows of A leave registers for more rows of B, and each
 * row of B is its own chain of dependent FMAs (its sums' order is fixed), so more rows in
 * flight hide the FMA latency (one core, Q4_K, M = 1, in cache: 4 rows 31.5, 8 rows 36.8 G
 * weights/s) */
#ifndef NR1
#define NR1 NR
#endif
#ifndef NR2
#define NR2 NR
#endif
#define NRF (NR1 > NR2 ? (NR1 > NR ? NR1 : NR) : (NR2 > NR ? NR2 : NR))
/* rows of A a fused tile takes at most (FMR) and its rows of B above MR rows of A (FNR): 7 x 3
 * accumulators of 16 lanes leave registers for a row of B's values (AVX2's 16 registers
 * do not hold more than MR x NR) */
#if W == 16
#define FMR 7
#define FNR 3
#else
#define FMR MR
#define FNR NR
#endif
/* B rows per fused tile of three rows of A: 18 accumulators hide more of the decode (AVX-512,
 * whole forwards, 3 rows: Qwen2.5-Coder-1.5B 42.4 -> 39.1 ms, SmolLM2 6.65 -> 6.05 ms; 5 or 6
 * rows of B for four rows of A measured level) */
#ifndef NR3
#define NR3 (W == 16 ? 6 : NR)
#endif
#define NR_OF(r) ((r) == 1 ? NR1 : (r) == 2 ? NR2 : (r) == 3 ? NR3 : (r) <= MR ? NR : FNR)
#ifndef PF_AHEAD
#define PF_AHEAD 1 /* tiles of B rows ahead that a scratch tile prefetches */
#endif

/* the scale at p (an IEEE half) in every lane: F16C widens it exactly, as numpy does */
static inline VEC QFN(half)(const unsigned char *p) {
  unsigned short h;
  __builtin_memcpy(&h, p, 2);
  return VSET1(_cvtsh_ss(h));
}

/* 32 4-bit values from 16 bytes: vector v holds elements v*W.. (low nibbles, then high) */
static inline VI QFN(nibble)(const unsigned char *qs, int v) {
  int o = v * W;
  VI q = VLOAD_U8(qs + (o & 15));
  return o < 16 ? VAND(q, 15) : VSRL(q, 4);
}

/* Each decoder widens the 32 values of a row from element e (a multiple of 32) on into NV
 * vectors; a block's scales are read once for its 32 values. */
#define DECODER(name) static inline __attribute__((always_inline)) void QFN(dec_##name)(   \
    const unsigned char *row, int e, VEC *out, __attribute__((unused)) const QFN(scales_t) *sc)
/* A K-quant's scales, widened once per super-block of 256 values (PREP) for its decoder */
typedef struct {
  float mul[16], sub[16];
} QFN(scales_t);
#define PREP(name) static inline __attribute__((always_inline)) void QFN(prep_##name)(      \
    const unsigned char *row, int e, QFN(scales_t) *sc)
#define NO_PREP(name) PREP(name) { (void)row, (void)e, (void)sc; }

/* Q4_K: d * the 8 6-bit scales and dmin * the 8 6-bit mins of super-block e / 256 (the
 * packing of q4_k_scale), unpacked as 16 bytes at once: scale j < 4 is the low 6 bits of byte
 * 4 + j, scale j >= 4 the low nibble of byte 8 + j with the top 2 bits of byte j as bits 4-5;
 * the mins likewise from bytes 8 + j, the high nibbles of 8 + j and the top bits of 4 + j
 * (one core, Q4_K in cache, M = 1: 40 -> 46 G weights/s against the scalar unpacking) */
static inline __attribute__((always_inline)) void QFN(k4_scales)(const unsigned char *b,
                                                                  QFN(scales_t) *sc) {
  __m128i q = _mm_loadu_si128((const __m128i *)b);
  __m128i a = _mm_shuffle_epi8(q, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12,
                                                13, 14, 15));
  __m128i h = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8,
                                                9, 10, 11));
  __m128i lo = _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63,
                                              0, 0, 0, 0));
  __m128i nib = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f));
  __m128i top = _mm_and_si128(_mm_srli_epi16(h, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  __m128i six = _mm_or_si128(_mm_or_si128(lo, nib), top); /* 8 scales, then 8 mins */
  int dd;
  __builtin_memcpy(&dd, b, 4);
  __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(dd)); /* d, dmin */
  __m256 lo8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six));
  __m256 hi8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(six, 8)));
  _mm256_storeu_ps(sc->mul, _mm256_mul_ps(_mm256_broadcastss_ps(d2), lo8));
  _mm256_storeu_ps(sc->sub, _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(d2),
                                                                   _mm256_set1_epi32(1)),
                                          hi8));
}
PREP(q4_k) { QFN(k4_scales)(row + (long)(e >> 8) * 144, sc); }
/* Q5_K: the same packing of scales and mins, from byte 4 of its 176-byte super-block */
PREP(q5_k) { QFN(k4_scales)(row + (long)(e >> 8) * 176, sc); }

/* Q2_K: d * the low and dmin * the high nibble of each of the 16 scale bytes */
PREP(q2_k) {
  const unsigned char *b = row + (long)(e >> 8) * 84;
  __m256 d = _mm256_set1_ps(_cvtsh_ss((unsigned short)(b[80] | b[81] << 8)));
  __m256 dmin = _mm256_set1_ps(_cvtsh_ss((unsigned short)(b[82] | b[83] << 8)));
  for (int h = 0; h < 2; h++) {
    __m256i s8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * h)));
    __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(s8, _mm256_set1_epi32(15)));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(s8, 4));
    _mm256_storeu_ps(sc->mul + 8 * h, _mm256_mul_ps(d, lo));
    _mm256_storeu_ps(sc->sub + 8 * h, _mm256_mul_ps(dmin, hi));
  }
}

/* Q3_K: d * the 16 signed 6-bit scales (q3_k_scale) */
PREP(q3_k) {
  const unsigned char *b = row + (long)(e >> 8) * 110;
  float d = _cvtsh_ss((unsigned short)(b[108] | b[109] << 8));
  for (int i = 0; i < 16; i++) sc->mul[i] = d * (float)q3_k_scale(b + 96, i);
}

/* Q6_K: d * the 16 signed 8-bit scales of super-block e / 256 */
PREP(q6_k) {
  const unsigned char *b = row + (long)(e >> 8) * 210;
  __m256 d = _mm256_set1_ps(_cvtsh_ss((unsigned short)(b[208] | b[209] << 8)));
  for (int h = 0; h < 2; h++) {
    __m256i s8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h)));
    _mm256_storeu_ps(sc->mul + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s8)));
  }
}
NO_PREP(q8_0)
NO_PREP(q4_0)
NO_PREP(q4_1)
NO_PREP(q5_0)
NO_PREP(q5_1)
NO_PREP(f16)
NO_PREP(bf16)

DECODER(q8_0) {
  const unsigned char *b = row + (long)(e >> 5) * 34;
  VEC d = QFN(half)(b);
  for (int v = 0; v < NV; v++) out[v] = VMUL(VCVT(VLOAD_I8(b + 2 + v * W)), d);
}

#if W == 16
/* 16 lanes: a 4-bit type's block has 16 possible values, computed once into a vector (the
 * same operations on the same operands as per element) and looked up by each element's
 * nibble (vpermps reads an index's low 4 bits only, so a low nibble needs no mask) */
static inline VEC QFN(lookup)(const unsigned char *qs, int v, VEC table) {
  VI q = VLOAD_U8(qs + (v * W & 15));
  return _mm512_permutexvar_ps(v * W < 16 ? q : VSRL(q, 4), table);
}

DECODER(q4_0) {
  const unsigned char *b = row + (long)(e >> 5) * 18;
  VEC table = VMUL(VCVT(VSUB_I(VLANES(), 8)), QFN(half)(b));
  for (int v = 0; v < NV; v++) out[v] = QFN(lookup)(b + 2, v, table);
}

DECODER(q4_1) {
  const unsigned char *b = row + (long)(e >> 5) * 20;
  VEC t = VMUL(VCVT(VLANES()), QFN(half)(b));
  ROUNDED(t);
  VEC table = VADD(t, QFN(half)(b + 2));
  for (int v = 0; v < NV; v++) out[v] = QFN(lookup)(b + 4, v, table);
}

DECODER(q4_k) {
  const unsigned char *b = row + (long)(e >> 8) * 144;
  int s = (e & 255) >> 5;
  VEC t = VMUL(VCVT(VLANES()), VSET1(sc->mul[s]));
  ROUNDED(t);
  VEC table = VSUB(t, VSET1(sc->sub[s]));
  const unsigned char *qs = b + 16 + (s >> 1) * 32;
  for (int v = 0; v < NV; v++) {
    VI q = VLOAD_U8(qs + v * W);
    out[v] = _mm512_permutexvar_ps(s & 1 ? VSRL(q, 4) : q, table);
  }
}

/* 64 values, sub-blocks s and s + 1 (the low and high nibbles of the same 32 bytes): each
 * byte is widened once for both (one core, Qwen2.5-1.5B's shapes in cache: 23.6 -> 32 G
 * weights/s) */
static inline __attribute__((always_inline)) void QFN(dec64_q4_k)(const unsigned char *row,
                                                                   int e, VEC *out,
                                                                   const QFN(scales_t) *sc) {
  const unsigned char *b = row + (long)(e >> 8) * 144;
  int s = (e & 255) >> 5;
  VEC t0 = VMUL(VCVT(VLANES()), VSET1(sc->mul[s]));
  VEC t1 = VMUL(VCVT(VLANES()), VSET1(sc->mul[s + 1]));
  ROUNDED(t0);
  ROUNDED(t1);
  VEC lo = VSUB(t0, VSET1(sc->sub[s])), hi = VSUB(t1, VSET1(sc->sub[s + 1]));
  const unsigned char *qs = b + 16 + (s >> 1) * 32;
  VI x0 = VLOAD_U8(qs), x1 = VLOAD_U8(qs + 16);
  out[0] = _mm512_permutexvar_ps(x0, lo);
  out[1] = _mm512_permutexvar_ps(x1, lo);
  out[2] = _mm512_permutexvar_ps(VSRL(x0, 4), hi);
  out[3] = _mm512_permutexvar_ps(VSRL(x1, 4), hi);
}

/* 64 values: blocks e / 32 and e / 32 + 1, their four scales widened in one conversion (one
 * core, Q4_1 in cache, M = 1: 32 -> 36 G weights/s) */
static inline __attribute__((always_inline)) void QFN(dec64_q4_1)(const unsigned char *row,
                                                                   int e, VEC *out,
                                                                   const QFN(scales_t) *sc) {
  (void)sc;
  const unsigned char *b = row + (long)(e >> 5) * 20;
  int h0, h1;
  __builtin_memcpy(&h0, b, 4);
  __builtin_memcpy(&h1, b + 20, 4);
  /* d, m of each block, each in every lane */
  VEC dm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1)));
#define LANE(i) _mm512_permutexvar_ps(_mm512_set1_epi32(i), dm)
  VEC t0 = VMUL(VCVT(VLANES()), LANE(0)), t1 = VMUL(VCVT(VLANES()), LANE(2));
  ROUNDED(t0);
  ROUNDED(t1);
  VEC lo = VADD(t0, LANE(1)), hi = VADD(t1, LANE(3));
#undef LANE
  VI x0 = VLOAD_U8(b + 4), x1 = VLOAD_U8(b + 24);
  out[0] = _mm512_permutexvar_ps(x0, lo);
  out[1] = _mm512_permutexvar_ps(VSRL(x0, 4), lo);
  out[2] = _mm512_permutexvar_ps(x1, hi);
  out[3] = _mm512_permutexvar_ps(VSRL(x1, 4), hi);
}
#else
DECODER(q4_0) {
  const unsigned char *b = row + (long)(e >> 5) * 18;
  VEC d = QFN(half)(b);
  for (int v = 0; v < NV; v++) out[v] = VMUL(VCVT(VSUB_I(QFN(nibble)(b + 2, v), 8)), d);
}

DECODER(q4_1) {
  const unsigned char *b = row + (long)(e >> 5) * 20;
  VEC d = QFN(half)(b), m = QFN(half)(b + 2);
  for (int v = 0; v < NV; v++) {
    VEC t = VMUL(VCVT(QFN(nibble)(b + 4, v)), d);
    ROUNDED(t);
    out[v] = VADD(t, m);
  }
}

DECODER(q4_k) {
  const unsigned char *b = row + (long)(e >> 8) * 144;
  int s = (e & 255) >> 5;
  VEC ds = VSET1(sc->mul[s]), dm = VSET1(sc->sub[s]);
  const unsigned char *qs = b + 16 + (s >> 1) * 32;
  for (int v = 0; v < NV; v++) {
    VI q = VLOAD_U8(qs + v * W);
    VEC t = VMUL(VCVT(s & 1 ? VSRL(q, 4) : VAND(q, 15)), ds);
    ROUNDED(t);
    out[v] = VSUB(t, dm);
  }
}

#endif

DECODER(q5_0) {
  const unsigned char *b = row + (long)(e >> 5) * 22;
  VEC d = QFN(half)(b);
  unsigned qh;
  __builtin_memcpy(&qh, b + 2, 4);
  VI bits = VSET1_I((int)qh);
  for (int v = 0; v < NV; v++) {
    VI hi = VAND(VSRLV(bits, VADD_I(VLANES(), v * W)), 1);
    out[v] = VMUL(VCVT(VSUB_I(VOR(QFN(nibble)(b + 6, v), VSLL(hi, 4)), 16)), d);
  }
}

DECODER(q5_1) {
  const unsigned char *b = row + (long)(e >> 5) * 24;
  VEC d = QFN(half)(b), m = QFN(half)(b + 2);
  unsigned qh;
  __builtin_memcpy(&qh, b + 4, 4);
  VI bits = VSET1_I((int)qh);
  for (int v = 0; v < NV; v++) {
    VI hi = VAND(VSRLV(bits, VADD_I(VLANES(), v * W)), 1);
    VEC t = VMUL(VCVT(VOR(QFN(nibble)(b + 8, v), VSLL(hi, 4))), d);
    ROUNDED(t);
    out[v] = VADD(t, m);
  }
}

/* The 2-bit fields of the K-quants: element r of a super-block (r a multiple of 32 here) is
 * bits 2 * (r / 32 % 4) of byte r / 128 * 32 + r % 32 */
static inline VI QFN(crumbs)(const unsigned char *qs, int r, int v) {
  return VAND(VSRL(VLOAD_U8(qs + (r >> 7) * 32 + v * W), 2 * ((r >> 5) & 3)), 3);
}

DECODER(q2_k) {
  const unsigned char *b = row + (long)(e >> 8) * 84;
  int r = e & 255;
  for (int v = 0; v < NV; v++) {
    int s = (r + v * W) >> 4;
    VEC t = VMUL(VCVT(QFN(crumbs)(b + 16, r, v)), VSET1(sc->mul[s]));
    ROUNDED(t);
    out[v] = VSUB(t, VSET1(sc->sub[s]));
  }
}

DECODER(q3_k) {
  const unsigned char *b = row + (long)(e >> 8) * 110;
  int r = e & 255;
  for (int v = 0; v < NV; v++) {
    VI hb = VAND(VSRL(VLOAD_U8(b + v * W), r >> 5), 1); /* hmask bit r / 32 */
    VI q = VSUB_I(VOR(QFN(crumbs)(b + 32, r, v), VSLL(hb, 2)), 4);
    out[v] = VMUL(VCVT(q), VSET1(sc->mul[(r + v * W) >> 4]));
  }
}

DECODER(q5_k) {
  const unsigned char *b = row + (long)(e >> 8) * 176;
  int r = e & 255, s = r >> 5;
  VEC ds = VSET1(sc->mul[s]), dm = VSET1(sc->sub[s]);
  for (int v = 0; v < NV; v++) {
    VI ql = VLOAD_U8(b + 48 + (r >> 6) * 32 + v * W);
    ql = s & 1 ? VSRL(ql, 4) : VAND(ql, 15);
    VI hb = VAND(VSRL(VLOAD_U8(b + 16 + v * W), s), 1);
    VEC t = VMUL(VCVT(VOR(ql, VSLL(hb, 4))), ds);
    ROUNDED(t);
    out[v] = VSUB(t, dm);
  }
}

#if W == 16
/* 32 values at once in bytes: 6-bit q = low or high nibble | 2 bits of qh << 4, minus 32,
 * sign-extended to two vectors of 16 (a scale each) */
DECODER(q6_k) {
  const unsigned char *b = row + (long)(e >> 8) * 210;
  int r = e & 255, h = r >> 7, r2 = r & 127, s = (r2 >> 5) * 2;
  __m256i lo = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (r2 & 63)));
  lo = _mm256_and_si256(r2 & 64 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
  __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
  /* bits s, s+1 of each byte to bits 4, 5 (16-bit shifts: what crosses bytes is masked) */
  hi = s <= 4 ? _mm256_sll_epi16(hi, _mm_cvtsi32_si128(4 - s)) : _mm256_srli_epi16(hi, 2);
  hi = _mm256_and_si256(hi, _mm256_set1_epi8(0x30));
  __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  out[0] = VMUL(VCVT(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), VSET1(sc->mul[r >> 4]));
  out[1] = VMUL(VCVT(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                VSET1(sc->mul[(r >> 4) + 1]));
}

/* 64 values (e a multiple of 64) in one vector of bytes: the 64 nibbles of ql at once, the
 * 2 high bits of each from qh (the same 32 bytes serve elements r2 and r2 + 32: bits 0-1 and
 * 2-3, or 4-5 and 6-7 in the upper half of 128), moved to bits 4-5 by one 16-bit shift per
 * half; each 16 bytes are then placed into lanes by one byte permutation (one core, Q6_K in
 * cache, M = 1: 27 -> 29 G weights/s) */
static inline __attribute__((always_inline)) void QFN(dec64_q6_k)(const unsigned char *row,
                                                                   int e, VEC *out,
                                                                   const QFN(scales_t) *sc) {
  const unsigned char *b = row + (long)(e >> 8) * 210;
  int r = e & 255, h = r >> 7, r2 = r & 127;
  __m512i ql = _mm512_loadu_si512((const void *)(b + h * 64));
  ql = _mm512_srl_epi16(ql, _mm_cvtsi32_si128(r2 >> 4)); /* the high nibbles from 64 on */
  /* bits p, p + 1 of each byte to bits 4, 5: a dword rotation by 4 - p (mod 32) keeps them
   * in their byte; p is 0, 2 (r2 = 0) or 4, 6 (r2 = 64) for the two halves of 32 */
  static const int rot[2][16] __attribute__((aligned(64))) = {
      {4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2},
      {0, 0, 0, 0, 0, 0, 0, 0, 30, 30, 30, 30, 30, 30, 30, 30}};
  __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + h * 32)));
  qh = _mm512_rolv_epi32(qh, _mm512_load_si512((const void *)rot[r2 >> 6]));
  /* (ql & 0x0f) | (qh & 0x30): bit by bit, qh where the mask byte 0x30 has a one, else ql */
  __m512i q = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x30), qh, ql, 0xCA);
  q = _mm512_and_si512(q, _mm512_set1_epi8(0x3f));
#ifdef __AVX512VBMI__
  /* q - 32 exactly as float: byte 4i of lane i is q, the rest of the lane the bits of 2^23
   * (2^23 + q is exact), minus 2^23 + 32; then the scale */
  const __m512 bias = VSET1(8388640.0f);
  const __m512i two23 = _mm512_set1_epi32(0x4B000000);
  for (int v = 0; v < 4; v++) {
    __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                     13, 14, 15), _mm512_set1_epi32(16 * v));
    __m512i x = _mm512_mask_permutexvar_epi8(two23, 0x1111111111111111ull, idx, q);
    out[v] = VMUL(VSUB(_mm512_castsi512_ps(x), bias), VSET1(sc->mul[(r >> 4) + v]));
  }
#else /* signed q - 32, widened a quarter at a time */
  q = _mm512_sub_epi8(q, _mm512_set1_epi8(32));
  __m128i quarter[4] = {_mm512_castsi512_si128(q), _mm512_extracti32x4_epi32(q, 1),
                        _mm512_extracti32x4_epi32(q, 2), _mm512_extracti32x4_epi32(q, 3)};
  for (int v = 0; v < 4; v++)
    out[v] = VMUL(VCVT(_mm512_cvtepi8_epi32(quarter[v])), VSET1(sc->mul[(r >> 4) + v]));
#endif
}
#else
DECODER(q6_k) {
  const unsigned char *b = row + (long)(e >> 8) * 210;
  for (int v = 0; v < NV; v++) {
    int r = (e & 255) + v * W, h = r >> 7, r2 = r & 127;
    VI lo = VLOAD_U8(b + h * 64 + (r2 & 63));
    lo = r2 & 64 ? VSRL(lo, 4) : VAND(lo, 15);
    VI hi = VAND(VSRL(VLOAD_U8(b + 128 + h * 32 + (r2 & 31)), (r2 >> 5) * 2), 3);
    VEC ds = VSET1(sc->mul[r >> 4]);
    out[v] = VMUL(VCVT(VSUB_I(VOR(lo, VSLL(hi, 4)), 32)), ds);
  }
}

#endif

DECODER(f16) {
  for (int v = 0; v < NV; v++) out[v] = VLOAD_F16(row + 2L * (e + v * W));
}

DECODER(bf16) {
  for (int v = 0; v < NV; v++) out[v] = VLOADB_BF16((const unsigned short *)(row + 2L * (e + v * W)));
}

/* 64 values: two 32-value units, unless the type has a decoder of its own (dec64_name) */
#if W == 16
#define IF_DEC64_q4_k(own, two) own
#else
#define IF_DEC64_q4_k(own, two) two
#endif
#define IF_DEC64_q8_0(own, two) two
#define IF_DEC64_q4_0(own, two) two
#if W == 16
#define IF_DEC64_q4_1(own, two) own
#else
#define IF_DEC64_q4_1(own, two) two
#endif
#define IF_DEC64_q5_0(own, two) two
#if W == 16
#define IF_DEC64_q6_k(own, two) own
#else
#define IF_DEC64_q6_k(own, two) two
#endif
#define IF_DEC64_q5_1(own, two) two
#define IF_DEC64_q2_k(own, two) two
#define IF_DEC64_q3_k(own, two) two
#define IF_DEC64_q5_k(own, two) two
#define IF_DEC64_f16(own, two) two
#define IF_DEC64_bf16(own, two) two
#define DEC64(name)                                                                         \
  static inline __attribute__((always_inline)) void QFN(dec64_any_##name)(                  \
      const unsigned char *row, int e, VEC *out, const QFN(scales_t) *sc) {                 \
    IF_DEC64_##name(QFN(dec64_##name)(row, e, out, sc), (QFN(dec_##name)(row, e, out, sc),   \
                                      QFN(dec_##name)(row, e + 32, out + NV, sc)));         \
  }

/* One unit (U values from element e, NU vectors, decoded by DEC) of the fused tile: rows
 * [0, mr) of A against rows [0, nr) of B. A row of B is decoded at a time and multiplied with
 * every row of A; up to two rows of A stay in registers for the whole unit. The loop over B's
 * rows is unrolled whatever its body's size, so the accumulators stay in registers (rolled,
 * they went through memory: one core, SmolLM2's Q4_1 in cache, M = 1: 30 -> 32.5 G weights/s;
 * whole forwards, 1 / 3 / 4 rows: 3.78 / 5.30 / 7.06 -> 3.63 / 4.85 / 6.45 ms). */
#define FUSED_UNIT(PREP, DEC, NU)                                                               \
  {                                                                                         \
    VEC ar[2][NU];                                                                          \
    if (mr <= 2)                                                                            \
      for (int i = 0; i < mr; i++)                                                          \
        for (int v = 0; v < NU; v++) ar[i][v] = VLOAD(A + i * lda + e + v * W);             \
    if (!(e & 255))                                                                         \
      for (int j = 0; j < nr; j++) PREP(B + j * rb, e, &sc[j]);                             \
    /* a large next tile comes into L2 a share per step (into L1 it evicted this one) */   \
    for (long left = per32 * (NU * W / 32); left > 0 && pf < pf_end; left -= 64, pf += 64) \
      __builtin_prefetch(pf, 0, 2);                                                         \
    _Pragma("GCC unroll 16") for (int j = 0; j < nr; j++) {                                 \
      VEC b[NU];                                                                            \
      DEC(B + j * rb, e, b, &sc[j]);                                                        \
      for (int i = 0; i < mr; i++)                                                          \
        for (int v = 0; v < NU; v++)                                                        \
          acc[i][j] = VFMA(mr <= 2 ? ar[i][v] : VLOAD(A + i * lda + e + v * W), b[v],       \
                           acc[i][j]);                                                      \
    }                                                                                       \
  }

/* For each type: its row (all K values into `out`) and its fused tile: rows [0, mr) of A
 * against rows [0, nr) of B, the values widened in registers and multiplied at once, with
 * the fp32 tile's sums (lane l adds k = l mod W in increasing k from zero, then VHSUM). A
 * type with a 64-value decoder of its own takes one or two rows of A 64 values at a time
 * (Q4_K, one core, its Qwen2.5-1.5B shapes in cache, M = 2: 17 -> 28 G weights/s); more rows
 * go 32 at a time, for the registers (two 32-value units measured slower: Q6_K 24 -> 19). */
#define STORED_TYPE(name)                                                                    \
  DEC64(name)                                                                               \
  static void QFN(row_##name)(const unsigned char *row, float *out, int K) {                \
    QFN(scales_t) sc;                                                                       \
    int e = 0;                                                                              \
    for (; IF_DEC64_##name(1, 0) && e + 64 <= K; e += 64) {                               \
      VEC v[64 / W];                                                                        \
      if (!(e & 255)) QFN(prep_##name)(row, e, &sc);                                        \
      QFN(dec64_any_##name)(row, e, v, &sc);                                                \
      for (int i = 0; i < 64 / W; i++) VSTORE(out + e + i * W, v[i]);                       \
    }                                                                                       \
    for (; e < K; e += 32) {                                                                \
      VEC v[NV];                                                                            \
      if (!(e & 255)) QFN(prep_##name)(row, e, &sc);                                        \
      QFN(dec_##name)(row, e, v, &sc);                                                      \
      for (int i = 0; i < NV; i++) VSTORE(out + e + i * W, v[i]);                           \
    }                                                                                       \
  }                                                                                         \
  static inline __attribute__((always_inline)) void QFN(fused_##name)(                      \
      int mr, int nr, int K, const float *A, long lda, const unsigned char *B, long rb,     \
      const unsigned char *lim, float al, float be, float *C, long ldc) {                   \
    VEC acc[FMR][NRF];                                                                      \
    for (int i = 0; i < mr; i++)                                                            \
      for (int j = 0; j < nr; j++) acc[i][j] = VZERO();                                     \
    QFN(scales_t) sc[NRF];                                                                  \
    /* the next tile (ns rows after this one, if the part has them) is fetched meanwhile */ \
    const int ns = NR_OF(mr);                                                               \
    const unsigned char *pf = B + ns * rb, *pf_end = B + 2 * ns * rb <= lim ? pf + ns * rb : pf; \
    long per32 = (ns * rb * 32 + K - 1) / K;                                                \
    if (ns * rb <= PF_L1) /* a small one into L1 at once */                                 \
      for (; pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, 3);                           \
    int e = 0;                                                                              \
    if (IF_DEC64_##name(1, 0) && mr <= 2)                                                   \
      for (; e + 64 <= K; e += 64) FUSED_UNIT(QFN(prep_##name), QFN(dec64_any_##name), 64 / W)                \
    for (; e < K; e += 32) FUSED_UNIT(QFN(prep_##name), QFN(dec_##name), NV)                                \
    for (int i = 0; i < mr; i++)                                                            \
      for (int j = 0; j < nr; j++) put(C + i * ldc + j, VHSUM(acc[i][j]), al, be);          \
  }                                                                                         \
  static void QFN(fused_any_##name)(int mr, int nr, int K, const float *A, long lda,        \
                                    const unsigned char *B, long rb,                        \
                                    const unsigned char *lim, float al, float be, float *C, \
                                    long ldc) {                                             \
    switch (mr * 16 + nr) {                                                                 \
      FUSED_CASES(name)                                                                     \
    }                                                                                       \
  }
#define FUSED_CASE(name, r, c)                                                              \
  case (r) * 16 + (c):                                                                      \
    if ((r) <= FMR && (c) <= NR_OF(r))                                                      \
      QFN(fused_##name)(r, c, K, A, lda, B, rb, lim, al, be, C, ldc);                       \
    break;
#define FUSED_ROW(name, r)                                                                  \
  FUSED_CASE(name, r, 1) FUSED_CASE(name, r, 2) FUSED_CASE(name, r, 3) FUSED_CASE(name, r, 4)
#define FUSED_WIDE(name, r)                                                                 \
  FUSED_ROW(name, r) FUSED_CASE(name, r, 5) FUSED_CASE(name, r, 6) FUSED_CASE(name, r, 7)   \
  FUSED_CASE(name, r, 8)
#define FUSED_ROWS3(name, r) FUSED_CASE(name, r, 1) FUSED_CASE(name, r, 2) FUSED_CASE(name, r, 3)
#define FUSED_CASES(name)                                                                   \
  FUSED_WIDE(name, 1) FUSED_WIDE(name, 2) FUSED_WIDE(name, 3) FUSED_ROW(name, 4)              \
  FUSED_ROWS3(name, 5) FUSED_ROWS3(name, 6) FUSED_ROWS3(name, 7)

STORED_TYPE(q8_0)
STORED_TYPE(q4_0)
STORED_TYPE(q4_1)
STORED_TYPE(q5_0)
STORED_TYPE(q4_k)
STORED_TYPE(q6_k)
STORED_TYPE(q5_1)
STORED_TYPE(q2_k)
STORED_TYPE(q3_k)
STORED_TYPE(q5_k)
STORED_TYPE(f16)
STORED_TYPE(bf16)

#define EACH_TYPE(X)                                                                        \
  X(T_Q8_0, q8_0) X(T_Q4_0, q4_0) X(T_Q4_1, q4_1) X(T_Q5_0, q5_0) X(T_Q5_1, q5_1)            \
  X(T_Q2_K, q2_k) X(T_Q3_K, q3_k) X(T_Q4_K, q4_k) X(T_Q5_K, q5_k) X(T_Q6_K, q6_k) X(T_F16, f16) \
  X(T_BF16, bf16)

/* the fp32 values of elements [0, K) of a row of `type` */
static void QFN(dequant_row)(int type, const unsigned char *row, float *out, int K) {
#define ROW_CASE(code, name) case code: QFN(row_##name)(row, out, K); break;
  switch (type) { EACH_TYPE(ROW_CASE) }
#undef ROW_CASE
}

/* rows [0, mr) of A (mr <= FMR) against rows [0, nr) of stored B, widened in registers */
static void QFN(fused_tile)(int type, int mr, int nr, int K, const float *A, long lda,
                            const unsigned char *B, long rb, const unsigned char *lim,
                            float al, float be, float *C, long ldc) {
#define FUSED_TYPE(code, name) \
  case code: QFN(fused_any_##name)(mr, nr, K, A, lda, B, rb, lim, al, be, C, ldc); break;
  switch (type) { EACH_TYPE(FUSED_TYPE) }
#undef FUSED_TYPE
}

/* Rows of A above MR that a K-quant (256-value super-blocks) still widens in registers, in one
 * tile of up to FMR rows (FNR rows of B), else MR rows at a time on the same tile of B, rather
 * than through a scratch tile: the scratch tile (NR rows of K floats) and MR rows of A
 * overflow L1 from K = 1536 on, and widening a K-quant again costs less than that
 * (Qwen2.5-Coder-1.5B, Q4_K and Q6_K, whole forwards against the scratch tile: 5 rows 92 ->
 * 58 ms, 6 rows 96 -> 69, 8 rows 111 -> 95 (twice 4 rows: one tile of 8 rows measured 101),
 * 12 rows 149 -> 140; 16 rows level, 32 slower). SmolLM2's Q4_1 (K = 576, 1536) measured
 * level or slower widened again (8 rows 11.5 -> 14.2 ms). */
#define FUSED_MAX_M 12

/* one thread's share: all M rows of A against rows [0, N) of B stored as `type`. Up to MR
 * rows of A (a decode step, a short verify; a K-quant up to FUSED_MAX_M) the
 * values are widened in registers (the fused tile); more rows share one widening of NR rows
 * of B into a scratch tile that the fp32 kernel's tile reads for every group of A's rows. */
static void QFN(part_blocks)(int M, int N, int K, float al, const float *A, int lda,
                             const unsigned char *B, int type, long row_bytes, float be,
                             float *C, int ldc) {
  int fused = M <= MR || (M <= FUSED_MAX_M && block_elems(type) == 256);
  float *s = !fused ? scratch_tile(NR * (long)K) : 0;
  if (!fused && !s) abort(); /* out of memory for a few rows of floats */
  FP32FN(ahead_t) none = {0, 0, K, 0, 0};
  const int g = M <= FMR ? M : MR; /* rows of A per fused tile */
  const int ns = fused ? NR_OF(g) : NR;
  for (int n = 0; n < N; n += ns) {
    int nr = N - n < ns ? N - n : ns;
    const unsigned char *rows = B + (long)n * row_bytes;
    if (fused) { /* the tile streams its own rows and the next tile's (FUSED_UNIT) */
      for (int m = 0; m < M; m += g)
        QFN(fused_tile)(type, M - m < g ? M - m : g, nr, K, A + (long)m * lda, lda, rows,
                        row_bytes, B + N * row_bytes, al, be, C + (long)m * ldc + n, ldc);
      continue;
    }
    /* the next tile's bytes into L1 while this one is widened and multiplied */
    if (n + PF_AHEAD * NR < N)
      for (long o = 0; o < NR * row_bytes; o += 64)
        __builtin_prefetch(rows + PF_AHEAD * NR * row_bytes + o, 0, 3);
    for (int j = 0; j < nr; j++) QFN(dequant_row)(type, rows + j * row_bytes, s + (long)j * K, K);
    for (int m = 0; m < M; m += MR)
      FP32FN(tile_any)(M - m < MR ? M - m : MR, nr, K, A + (long)m * lda, lda, s, K, al, be,
                       C + (long)m * ldc + n, ldc, none, M > KEEP_M);
  }
}

#undef ROUNDED
#undef NV
#undef NR1
#undef NR2
#undef NRF
#undef NR_OF
#undef NR3
#undef FMR
#undef FNR
#undef FUSED_MAX_M
#undef IF_DEC64_q8_0
#undef IF_DEC64_q4_0
#undef IF_DEC64_q4_1
#undef IF_DEC64_q5_0
#undef IF_DEC64_q4_k
#undef IF_DEC64_q6_k
#undef IF_DEC64_q5_1
#undef IF_DEC64_q2_k
#undef IF_DEC64_q3_k
#undef IF_DEC64_q5_k
#undef IF_DEC64_f16
#undef IF_DEC64_bf16
#undef DEC64
#undef FUSED_UNIT
#undef QFN
#undef FP32FN
