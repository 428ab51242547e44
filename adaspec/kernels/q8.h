/* The opt-in 8-bit arithmetic (ADASPEC_ARITHMETIC=q8): integer dot products of 8-bit
 * activations with the stored weights, combined in one fixed order per output, so a token
 * row's result never depends on how many rows share the GEMM or where the row sits.
 *
 * Every weight type is read as integers q (unsigned) with, per sub-block j of S elements, an
 * integer scale sc_j and min mn_j, and per super-block of SB elements two floats d, dmin:
 *     w = d * sc_j * (q - off) - dmin * mn_j
 * (Q4_0: SB = S = 32, sc = 1, no min; Q4_1: the min is -m with mn = 1; K-quants: their own
 * sub-scales; F16 / BF16 / F32 matrices are quantized to Q8_0's form when packed). An
 * activation row is quantized per super-block: qa = nearest(a * 127 / amax), da = amax / 127,
 * and each sub-block's sum of qa is kept. Then, per output, per super-block:
 *     isum = sum_j sc_j * (dot(q_j, qa_j) - off * sum(qa_j))     (exact integers)
 *     imin = sum_j mn_j * sum(qa_j)
 *     acc  = fma(d * da, isum, acc);  acc = fma(-(dmin * da), imin, acc)
 * in super-block order. The integer part is exact whatever the order of its additions, and
 * the float steps are the same per output for every number of rows, so the vector kernel,
 * the scalar reference and every batch give the same bits.
 *
 * The vector kernel (AVX-512 VNNI) reads a packed copy made at load: 16 output rows
 * interleaved, lane l of a 64-byte vector holding 4 consecutive k of row l (what vpdpbusd
 * multiplies with 4 broadcast activation bytes), 4-bit codes two to a byte, a high plane for
 * 5 and 6-bit codes, scales and mins per lane. The copy takes about the stored bytes.
 * Included by blas_route.c after its stored-type helpers. */

enum { T_Q8P = 63 }; /* a source_t type: the packed copy */
#define Q8_LANES 16
#ifndef Q8_ROWS
#define Q8_ROWS 8 /* most token rows multiplied per pass over a unit's decoded weights */
#endif
#ifndef Q8_PF
#define Q8_PF 4096 /* bytes ahead of the weights being decoded that are prefetched (0: none) */
#endif

typedef struct {
  int sb, s;  /* elements per super-block, per sub-block */
  int bits;   /* 4: a nibble plane (+ hbits high bits); 8: a byte plane */
  int hbits;  /* 0, 1 or 2 bits above the nibble */
  int off;    /* q - off is the signed code */
  int has_sc; /* per-lane signed 8-bit sub-scales */
  int mn;     /* 0: no min; 1: min = dmin * (sum of the block); 2: per-lane 8-bit sub-mins */
} q8fmt_t;

/* whether this CPU has AVX-512 VNNI (and BW) */
static int q8_cpu512(void) {
  static int has = -1;
  if (has < 0) {
    __builtin_cpu_init();
    has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  }
  return has;
}

/* whether a vector kernel runs q8 GEMMs: AVX-512 VNNI, or AVX2 (which the routed kernel needs) */
static int q8_vector(void) { return 1; }

static const q8fmt_t Q8_AS_Q8_0 = {32, 32, 8, 0, 128, 0, 0};

/* the packed form of a type (sb 0: none) */
static q8fmt_t q8_fmt(int type) {
  switch (type) {
    case T_Q4_0: return (q8fmt_t){32, 32, 4, 0, 8, 0, 0};
    case T_Q4_1: return (q8fmt_t){32, 32, 4, 0, 0, 0, 1};
    case T_Q5_0: return (q8fmt_t){32, 32, 4, 1, 16, 0, 0};
    case T_Q5_1: return (q8fmt_t){32, 32, 4, 1, 0, 0, 1};
    case T_Q8_0: case T_F16: case T_BF16: case T_F32: return Q8_AS_Q8_0;
    case T_Q2_K: return (q8fmt_t){256, 16, 4, 0, 0, 1, 2};
    case T_Q3_K: return (q8fmt_t){256, 16, 4, 0, 4, 1, 0};
    case T_Q4_K: return (q8fmt_t){256, 32, 4, 0, 0, 1, 2};
    case T_Q5_K: return (q8fmt_t){256, 32, 4, 1, 0, 1, 2};
    case T_Q6_K: return (q8fmt_t){256, 16, 4, 2, 32, 1, 0};
  }
  return (q8fmt_t){0, 0, 0, 0, 0, 0, 0};
}

/* byte offsets inside one unit (16 lanes x one super-block) */
typedef struct {
  int dmin, sc, mn, planes, sub_bytes, unit;
} q8layout_t;

static q8layout_t q8_layout(q8fmt_t f) {
  q8layout_t o;
  int nsub = f.sb / f.s;
  o.dmin = 32;
  o.sc = o.dmin + (f.mn ? 32 : 0);
  o.mn = o.sc + (f.has_sc ? nsub * Q8_LANES : 0);
  o.planes = o.mn + (f.mn == 2 ? nsub * Q8_LANES : 0);
  o.sub_bytes = f.bits == 8 ? f.s / 4 * 64 : f.s / 8 * 64 + (f.hbits ? 64 : 0);
  o.unit = o.planes + nsub * o.sub_bytes;
  return o;
}

static unsigned short q8_half(float x) { /* float -> IEEE half, nearest even */
  return _cvtss_sh(x, 0);
}

/* Q8_0's form of 32 floats: d as a half, q = nearest(w / d) + 128 */
static void q8_of_floats(const float *w, int *q, float *d) {
  float amax = 0.f;
  for (int e = 0; e < 32; e++) amax = fmaxf(amax, fabsf(w[e]));
  *d = half_to_float(q8_half(amax / 127.f));
  float inv = *d > 0.f ? 1.f / *d : 0.f;
  for (int e = 0; e < 32; e++) {
    float v = nearbyintf(w[e] * inv);
    q[e] = (int)fminf(fmaxf(v, -128.f), 127.f) + 128;
  }
}

/* super-block `sb` of one row of `type` as codes q[SB], sub-scales sc, sub-mins mn, d, dmin
 * (what the formula above reads). A T_F32 row is floats. */
static void q8_decode(int type, const unsigned char *row, int sb, int *q, int *sc, int *mn,
                      float *d, float *dmin) {
  const unsigned char *b;
  *dmin = 0.f;
  switch (type) {
    case T_F32: case T_F16: case T_BF16: {
      float w[32];
      for (int e = 0; e < 32; e++)
        w[e] = type == T_F32 ? ((const float *)row)[sb * 32 + e] : stored_value(type, row, sb * 32 + e);
      q8_of_floats(w, q, d);
      return;
    }
    case T_Q8_0:
      b = row + sb * 34, *d = f16(b);
      for (int o = 0; o < 32; o++) q[o] = (signed char)b[2 + o] + 128;
      return;
    case T_Q4_0: case T_Q4_1: {
      int at = type == T_Q4_0 ? 2 : 4;
      b = row + sb * (type == T_Q4_0 ? 18 : 20), *d = f16(b);
      if (type == T_Q4_1) *dmin = -f16(b + 2);
      for (int o = 0; o < 32; o++) q[o] = (o < 16 ? b[at + o] : b[at + o - 16] >> 4) & 15;
      return;
    }
    case T_Q5_0: case T_Q5_1: {
      int at = type == T_Q5_0 ? 2 : 4;
      b = row + sb * (type == T_Q5_0 ? 22 : 24), *d = f16(b);
      if (type == T_Q5_1) *dmin = -f16(b + 2);
      unsigned qh;
      __builtin_memcpy(&qh, b + at, 4);
      for (int o = 0; o < 32; o++)
        q[o] = ((o < 16 ? b[at + 4 + o] : b[at + 4 + o - 16] >> 4) & 15) | (int)((qh >> o) & 1) << 4;
      return;
    }
    case T_Q2_K:
      b = row + sb * 84, *d = f16(b + 80), *dmin = f16(b + 82);
      for (int s = 0; s < 16; s++) sc[s] = b[s] & 15, mn[s] = b[s] >> 4;
      for (int r = 0; r < 256; r++)
        q[r] = (b[16 + (r >> 7) * 32 + (r & 31)] >> (2 * ((r >> 5) & 3))) & 3;
      return;
    case T_Q3_K:
      b = row + sb * 110, *d = f16(b + 108);
      for (int s = 0; s < 16; s++) sc[s] = q3_k_scale(b + 96, s);
      for (int r = 0; r < 256; r++)
        q[r] = ((b[32 + (r >> 7) * 32 + (r & 31)] >> (2 * ((r >> 5) & 3))) & 3) |
               ((b[r & 31] >> (r >> 5)) & 1) << 2;
      return;
    case T_Q4_K: case T_Q5_K: {
      int five = type == T_Q5_K;
      b = row + sb * (five ? 176 : 144), *d = f16(b), *dmin = f16(b + 2);
      for (int s = 0; s < 8; s++) q4_k_scale(b + 4, s, &sc[s], &mn[s]);
      for (int r = 0; r < 256; r++) {
        int s = r >> 5;
        q[r] = five ? ((b[48 + (r >> 6) * 32 + (r & 31)] >> (4 * (s & 1))) & 15) |
                          ((b[16 + (r & 31)] >> s) & 1) << 4
                    : (b[16 + (s >> 1) * 32 + (r & 31)] >> ((s & 1) * 4)) & 15;
      }
      return;
    }
    case T_Q6_K:
      b = row + sb * 210, *d = f16(b + 208);
      for (int s = 0; s < 16; s++) sc[s] = (signed char)b[192 + s];
      for (int r = 0; r < 256; r++) {
        int h = r >> 7, r2 = r & 127;
        q[r] = ((b[h * 64 + (r2 & 63)] >> ((r2 >> 6) * 4)) & 15) |
               ((b[128 + h * 32 + (r2 & 31)] >> ((r2 >> 5) * 2)) & 3) << 4;
      }
      return;
  }
}

/* one row's super-block into lane l of a unit */
static void q8_put_lane(q8fmt_t f, q8layout_t o, unsigned char *u, int l, const int *q,
                        const int *sc, const int *mn, float d, float dmin) {
  unsigned short h = q8_half(d), hm = q8_half(dmin);
  __builtin_memcpy(u + 2 * l, &h, 2);
  if (f.mn) __builtin_memcpy(u + o.dmin + 2 * l, &hm, 2);
  int nsub = f.sb / f.s, quads = f.s / 4;
  for (int j = 0; j < nsub; j++) {
    if (f.has_sc) u[o.sc + j * Q8_LANES + l] = (unsigned char)(signed char)sc[j];
    if (f.mn == 2) u[o.mn + j * Q8_LANES + l] = (unsigned char)mn[j];
    unsigned char *p = u + o.planes + j * o.sub_bytes;
    for (int t = 0; t < quads; t++)
      for (int i = 0; i < 4; i++) {
        int c = q[j * f.s + 4 * t + i];
        if (f.bits == 8) {
          p[t * 64 + 4 * l + i] = (unsigned char)c;
          continue;
        }
        int half = quads / 2, pair = t % half;
        p[pair * 64 + 4 * l + i] |= (unsigned char)((c & 15) << (t < half ? 0 : 4));
        if (f.hbits)
          p[half * 64 + 4 * l + i] |= (unsigned char)((c >> 4) << (t * f.hbits));
      }
  }
}

/* The packed copy of an n x k matrix of `type` (rows row_bytes apart; T_F32: ld floats):
 * ceil(n / 16) groups of k / SB units. *group_bytes gets a group's size; 0 if out of memory. */
static unsigned char *q8_pack(int type, const unsigned char *data, long row_bytes, int n, int k,
                              long *group_bytes) {
  q8fmt_t f = q8_fmt(type);
  q8layout_t o = q8_layout(f);
  int nsb = k / f.sb, groups = (n + Q8_LANES - 1) / Q8_LANES;
  *group_bytes = (long)nsb * o.unit;
  long size = (long)groups * *group_bytes;
  unsigned char *out = aligned_alloc(64, (size + 63) / 64 * 64);
  if (!out) return 0;
  __builtin_memset(out, 0, size);
  int q[256], sc[16], mn[16];
  float d, dmin;
  for (int r = 0; r < n; r++)
    for (int sb = 0; sb < nsb; sb++) {
      q8_decode(type, data + r * row_bytes, sb, q, sc, mn, &d, &dmin);
      unsigned char *u = out + (long)(r / Q8_LANES) * *group_bytes + (long)sb * o.unit;
      q8_put_lane(f, o, u, r % Q8_LANES, q, sc, mn, d, dmin);
    }
  return out;
}

/* ---- activations: per row, codes qa[K], then da per super-block, then per sub-block the
 * sum of its codes and -off times it (where a dot product of the sub-block starts) ------- */

typedef struct {
  const unsigned char *base;
  long stride;
  int k, nsb, nsub; /* nsub: sub-blocks per row */
} q8act_t;

static inline const signed char *q8_codes(const q8act_t *a, int r) {
  return (const signed char *)(a->base + r * a->stride);
}
static inline const float *q8_da(const q8act_t *a, int r) {
  return (const float *)(a->base + r * a->stride + a->k);
}
static inline const int *q8_bsum(const q8act_t *a, int r) {
  return (const int *)(a->base + r * a->stride + a->k + 4L * a->nsb);
}
static inline const int *q8_obs(const q8act_t *a, int r) {
  return q8_bsum(a, r) + a->nsub;
}
static inline const short *q8_bsum16(const q8act_t *a, int r) { /* |bsum| <= 32 * 127 */
  return (const short *)(q8_obs(a, r) + a->nsub);
}

/* n floats (a multiple of 16) to codes: q = nearest(x * 127 / amax), clamped to +-127; returns
 * amax. The vector form rounds as nearbyintf (to nearest, ties to even) and gives a NaN the
 * code fminf(fmaxf(NaN, -127), 127) gives: the same codes. */
static float q8_codes_scalar(const float *x, int n, signed char *q) {
  float amax = 0.f;
  for (int e = 0; e < n; e++) amax = fmaxf(amax, fabsf(x[e]));
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int e = 0; e < n; e++) q[e] = (signed char)fminf(fmaxf(nearbyintf(x[e] * inv), -127.f), 127.f);
  return amax;
}

__attribute__((target("avx512f,avx512bw"))) static float q8_codes_vector(const float *x, int n,
                                                                         signed char *q) {
  __m512 m = _mm512_setzero_ps();
  for (int e = 0; e < n; e += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + e)));
  float amax = _mm512_reduce_max_ps(m);
  if (amax != amax) amax = q8_codes_scalar(x, n, q); /* a NaN: let fmaxf decide, as above */
  __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int e = 0; e < n; e += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + e), inv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    _mm_storeu_si128((__m128i *)(q + e), _mm512_cvtepi32_epi8(v));
  }
  return amax;
}

/* the sums of the sub-blocks of s (16 or 32) codes in the first 64-byte pieces of qa[k] into
 * out: the bytes plus 128 summed 8 at a time (vpsadbw), less 128 each; returns how many
 * sub-blocks it summed (the rest are left to the caller) */
__attribute__((target("avx512f,avx512bw"))) static int q8_sums_vector(const signed char *qa, int k,
                                                                      int s, int *out) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  int e = 0;
  for (; e + 64 <= k; e += 64) {
    __m512i u = _mm512_xor_si512(_mm512_loadu_si512(qa + e), flip);
    long long t[8];
    _mm512_storeu_si512(t, _mm512_sad_epu8(u, _mm512_setzero_si512()));
    for (int q = 0; q < 8; q += s / 8) {
      long long v = 0;
      for (int i = 0; i < s / 8; i++) v += t[q + i];
      out[(e + 8 * q) / s] = (int)v - 128 * s;
    }
  }
  return e / s;
}

/* quantize m rows of A (k floats, lda apart) for weights of format f into a thread's scratch */
static q8act_t q8_quantize(q8fmt_t f, int m, int k, const float *A, int lda) {
  static __thread unsigned char *buf;
  static __thread long have;
  q8act_t a = {0, 0, k, k / f.sb, k / f.s};
  a.stride = ((long)k + 4L * a.nsb + 10L * a.nsub + 63) / 64 * 64;
  if ((long)m * a.stride > have) {
    free(buf);
    have = (long)m * a.stride;
    buf = aligned_alloc(64, have);
    if (!buf) abort();
  }
  a.base = buf;
  int vector = q8_cpu512();
  for (int r = 0; r < m; r++) {
    const float *x = A + (long)r * lda;
    signed char *qa = (signed char *)(buf + r * a.stride);
    float *da = (float *)(buf + r * a.stride + k);
    int *bsum = (int *)(da + a.nsb), *obs = bsum + a.nsub;
    for (int sb = 0; sb < a.nsb; sb++) {
      const float *xs = x + sb * f.sb;
      signed char *qs = qa + sb * f.sb;
      float amax = vector ? q8_codes_vector(xs, f.sb, qs) : q8_codes_scalar(xs, f.sb, qs);
      da[sb] = amax / 127.f;
    }
    for (int j = vector ? q8_sums_vector(qa, k, f.s, bsum) : 0; j < a.nsub; j++) {
      bsum[j] = 0;
      for (int e = j * f.s; e < (j + 1) * f.s; e++) bsum[j] += qa[e];
    }
    for (int j = 0; j < a.nsub; j++)
      obs[j] = -f.off * bsum[j], ((short *)(obs + a.nsub))[j] = (short)bsum[j];
  }
  return a;
}

/* ---- the reference: one output at a time from the stored rows, in scalar C ------------ */

static void q8_reference(int type, const unsigned char *B, long row_bytes, int m, int n,
                         const q8act_t *a, float al, float be, float *C, int ldc) {
  q8fmt_t f = q8_fmt(type);
  int nsb = a->k / f.sb, per = f.sb / f.s, q[256], sc[16], mn[16];
  float d, dmin;
  for (int c = 0; c < n; c++)
    for (int r = 0; r < m; r++) {
      const signed char *qa = q8_codes(a, r);
      float acc = 0.f;
      for (int sb = 0; sb < nsb; sb++) {
        q8_decode(type, B + c * row_bytes, sb, q, sc, mn, &d, &dmin);
        d = half_to_float(q8_half(d)), dmin = half_to_float(q8_half(dmin));
        int isum = 0, imin = 0;
        for (int j = 0; j < per; j++) {
          int dot = 0, at = sb * f.sb + j * f.s, sub = sb * per + j;
          for (int e = 0; e < f.s; e++) dot += q[j * f.s + e] * qa[at + e];
          dot += q8_obs(a, r)[sub];
          isum += f.has_sc ? sc[j] * dot : dot;
          imin += f.mn == 2 ? mn[j] * q8_bsum(a, r)[sub] : q8_bsum(a, r)[sub];
        }
        float da = q8_da(a, r)[sb], t1 = d * da;
        acc = fmaf(t1, (float)isum, acc);
        if (f.mn) {
          float t2 = dmin * da;
          acc = fmaf(-t2, (float)imin, acc);
        }
      }
      put(C + (long)r * ldc + c, acc, al, be);
    }
}

/* ---- the vector kernels (q8_kernel.h): AVX-512 VNNI on 16 lanes, AVX2 on 8 ------------- */

static inline int q8_word(const void *p) {
  int v;
  __builtin_memcpy(&v, p, 4);
  return v;
}


/* AVX-512 VNNI: a 64-byte vector is a whole group's 16 lanes */
#define QN(name) name##_avx512
#include "q8_avx512.h"

/* AVX2: a 64-byte vector is two halves of 8 lanes, done one after the other. The integer
 * dot products are the same integers, the float steps the same per lane: the same bits. */
#define QN(name) name##_avx2
#define QTARGET __attribute__((target("avx2,f16c,fma")))
#define QI __m256i
#define QF __m256
#define QL 8
#define QROWS32 2
#define QROWS16 4
#define QDUAL 2
#define QLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define QAND(a, b) _mm256_and_si256(a, b)
#define QOR(a, b) _mm256_or_si256(a, b)
#define QSRLI16(v, n) _mm256_srli_epi16(v, n)
#define QSLLI16(v, n) _mm256_slli_epi16(v, n)
#define QSLLI32(v, n) _mm256_slli_epi32(v, n)
#define QSET1_8(c) _mm256_set1_epi8(c)
#define QSET1_32(x) _mm256_set1_epi32(x)
#define QZERO() _mm256_setzero_si256()
#define QADD32(a, b) _mm256_add_epi32(a, b)
#define QMUL32(a, b) _mm256_mullo_epi32(a, b)
#define QI8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define QU8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define QHALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define QFLOAD(p) _mm256_load_ps(p)
#define QFSTORE(p, v) _mm256_store_ps(p, v)
#define QFSET1(x) _mm256_set1_ps(x)
#define QFZERO() _mm256_setzero_ps()
#define QFMUL(a, b) _mm256_mul_ps(a, b)
#define QFMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define QFNMADD(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define QCVTF(v) _mm256_cvtepi32_ps(v)
/* vpmaddubsw adds two products in 16 bits: with codes up to 63 they fit; 8-bit codes (q + 128)
 * go in as signed q (magnitude and sign moved to the activation), so the 128 offset is
 * already taken and the dot product starts at 0 (q8_unit: OFF_IN_DOT) */
#define QDOT_DEF                                                                                \
  __m256i a = _mm256_set1_epi32(q8_word(p)), pairs;                                             \
  if (BITS == 8) {                                                                              \
    __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));                              \
    pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(a, q));                   \
  } else {                                                                                      \
    pairs = _mm256_maddubs_epi16(w, a);                                                         \
  }                                                                                             \
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#define QPAIRS_DEF                                                                              \
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(q8_word(p))));
#define QOFF_IN_DOT 1
#include "q8_kernel.h"

/* whether the AVX-512 VNNI kernel runs (else the AVX2 one): the CPU has VNNI and the
 * AVX-512 kernels are chosen (ADASPEC_KERNEL_ISA) */
static int q8_vnni(void) { return q8_cpu512() && isa == ISA_AVX512; }

static void q8_part_rows(int type, int M, int N, const unsigned char *data, long group_bytes,
                         const q8act_t *a, float al, float be, float *C, int ldc) {
  if (q8_vnni())
    q8_part_rows_avx512(type, M, N, data, group_bytes, a, al, be, C, ldc);
  else
    q8_part_rows_avx2(type, M, N, data, group_bytes, a, al, be, C, ldc);
}

#define Q8_BLOCK_ROWS 32 /* a prefill's rows go through in blocks: the accumulators stay small */

/* one thread's share: M rows against N outputs of a packed `type` from data on */
static void q8_part(int type, int M, int N, const unsigned char *data, long group_bytes,
                    const q8act_t *a, float al, float be, float *C, int ldc) {
  for (int r = 0; r < M; r += Q8_BLOCK_ROWS) {
    q8act_t rows = *a;
    rows.base += r * a->stride;
    int m = M - r < Q8_BLOCK_ROWS ? M - r : Q8_BLOCK_ROWS;
    q8_part_rows(type, m, N, data, group_bytes, &rows, al, be, C + (long)r * ldc, ldc);
  }
}
