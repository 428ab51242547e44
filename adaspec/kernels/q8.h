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
#define Q8_ROWS 8 /* token rows multiplied per pass over a unit's decoded weights */
#endif
#ifndef Q8_DUAL
#define Q8_DUAL 4 /* up to this many rows a pass, two dependency chains a row */
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

/* whether the vector kernel runs: this CPU has VNNI and the AVX-512 kernels are chosen */
static int q8_vector(void) {
  static int has = -1;
  if (has < 0) {
    __builtin_cpu_init();
    has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  }
  return has && isa == ISA_AVX512;
}

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
  int vector = q8_vector();
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
    for (int j = 0; j < a.nsub; j++) {
      int s = 0;
      for (int e = j * f.s; e < (j + 1) * f.s; e++) s += qa[e];
      bsum[j] = s, obs[j] = -f.off * s, ((short *)(obs + a.nsub))[j] = (short)s;
    }
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

/* ---- the vector kernel: AVX-512 VNNI, one group of 16 outputs at a time ---------------- */

#define Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define Q8_INLINE static inline __attribute__((always_inline)) Q8_TARGET

/* a thread's accumulators: 16 floats for each of m rows, 64-byte aligned */
static float *q8_scratch(int m) {
  static __thread float *buf;
  static __thread int have;
  if (m > have) {
    free(buf);
    buf = aligned_alloc(64, sizeof(float) * Q8_LANES * m);
    if (!buf) abort();
    have = m;
  }
  return buf;
}

/* sub-block j's codes of a unit's 16 lanes: w[t] holds quad t (4 consecutive k) per lane */
Q8_INLINE void q8_weights(const int S, const int BITS, const int HB, const unsigned char *p,
                          __m512i *w) {
  const int T = S / 4, half = T / 2;
#if Q8_PF
  for (int i = 0; i < (BITS == 8 ? T : half + (HB > 0)); i++)
    _mm_prefetch((const char *)p + Q8_PF + 64 * i, _MM_HINT_T0);
#endif
  if (BITS == 8) {
    for (int t = 0; t < T; t++) w[t] = _mm512_loadu_si512(p + 64 * t);
    return;
  }
  const __m512i low = _mm512_set1_epi8(15);
  for (int pr = 0; pr < half; pr++) {
    __m512i v = _mm512_loadu_si512(p + 64 * pr);
    w[pr] = _mm512_and_si512(v, low);
    w[pr + half] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if (!HB) return;
  const __m512i H = _mm512_loadu_si512(p + 64 * half);
  const __m512i mask = _mm512_set1_epi8((char)(((1 << HB) - 1) << 4));
  for (int t = 0; t < T; t++) {
    int s = 4 - t * HB; /* the high bits of quad t to bits 4.. of each byte */
    __m512i hv = s >= 0 ? _mm512_slli_epi16(H, s) : _mm512_srli_epi16(H, -s);
    w[t] = _mm512_or_si512(w[t], _mm512_and_si512(hv, mask));
  }
}


/* acc + the 4-byte dot products of w's unsigned bytes with the signed bytes at p, broadcast
 * (a memory operand: the compiler would spend a broadcast instruction on each) */
Q8_INLINE __m512i q8_dot(__m512i acc, __m512i w, const signed char *p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int *)p));
  return acc;
}

/* acc + w's pairs of signed 16-bit halves times the pair at p, broadcast */
Q8_INLINE __m512i q8_pairs(__m512i acc, __m512i w, const short *p) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int *)p));
  return acc;
}

/* R token rows from r0 against one unit u (super-block sb of a group): acc (16 floats a row,
 * in memory between super-blocks) += the unit's share of the 16 outputs */
Q8_INLINE void q8_unit(const int R, const int SB, const int S, const int BITS, const int HB,
                       const int OFF, const int SC, const int MN, const unsigned char *u,
                       q8layout_t o, int sb, const q8act_t *a, int r0, float *acc) {
  const int NSUB = SB / S, T = S / 4, DUAL = R <= Q8_DUAL; /* 8 chains hide the latency */
  __m512i isum[Q8_ROWS];
  for (int j = 0; j < NSUB; j++) {
    __m512i w[8], d0[Q8_ROWS], d1[Q8_ROWS];
    q8_weights(S, BITS, HB, u + o.planes + j * o.sub_bytes, w);
    int at = sb * SB + j * S, sub = sb * NSUB + j;
    for (int r = 0; r < R; r++) {
      d0[r] = OFF ? _mm512_set1_epi32(q8_obs(a, r0 + r)[sub]) : _mm512_setzero_si512();
      d1[r] = _mm512_setzero_si512();
    }
    for (int t = 0; t < T; t += 2)
      for (int r = 0; r < R; r++) {
        const signed char *qa = q8_codes(a, r0 + r) + at + 4 * t;
        d0[r] = q8_dot(d0[r], w[t], qa);
        if (DUAL)
          d1[r] = q8_dot(d1[r], w[t + 1], qa + 4);
        else
          d0[r] = q8_dot(d0[r], w[t + 1], qa + 4);
      }
    __m512i scv = SC ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(u + o.sc + 16 * j)))
                     : _mm512_setzero_si512();
    for (int r = 0; r < R; r++) {
      __m512i dot = DUAL ? _mm512_add_epi32(d0[r], d1[r]) : d0[r];
      isum[r] = !SC ? dot : j ? _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot, scv))
                              : _mm512_mullo_epi32(dot, scv);
    }
  }
  __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)u));
  __m512 dmv = MN ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + o.dmin)))
                  : _mm512_setzero_ps();
  __m512i mnp[8]; /* sub-mins j and j + 1 of each lane as two 16-bit halves */
  for (int i = 0; MN == 2 && i < NSUB / 2; i++) {
    const __m128i *p = (const __m128i *)(u + o.mn + 32 * i);
    mnp[i] = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128(p)),
                             _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(p + 1)), 16));
  }
  for (int r = 0; r < R; r++) {
    __m512 da = _mm512_set1_ps(q8_da(a, r0 + r)[sb]);
    __m512 v = _mm512_load_ps(acc + 16 * r);
    v = _mm512_fmadd_ps(_mm512_mul_ps(dv, da), _mm512_cvtepi32_ps(isum[r]), v);
    if (MN) {
      __m512i imin = _mm512_set1_epi32(q8_bsum(a, r0 + r)[sb * NSUB]);
      if (MN == 2) {
        const short *bs = q8_bsum16(a, r0 + r) + sb * NSUB;
        imin = _mm512_setzero_si512();
        for (int i = 0; i < NSUB / 2; i++) imin = q8_pairs(imin, mnp[i], bs + 2 * i);
      }
      v = _mm512_fnmadd_ps(_mm512_mul_ps(dmv, da), _mm512_cvtepi32_ps(imin), v);
    }
    _mm512_store_ps(acc + 16 * r, v);
  }
}

#define Q8_TILE 16384 /* bytes of activation codes a pass over the groups reads (in L1) */

/* all M rows against the groups of N outputs packed at data, in tiles of super-blocks whose
 * activation codes stay in L1: per tile, per group, per super-block, Q8_ROWS rows at a time
 * (the unit stays in L1 while every row passes over it). Each output still adds its
 * super-blocks in increasing order. */
Q8_INLINE void q8_groups(const int SB, const int S, const int BITS, const int HB, const int OFF,
                         const int SC, const int MN, int M, int N, const unsigned char *data,
                         long group_bytes, const q8act_t *a, float al, float be, float *C,
                         int ldc) {
  q8layout_t o = q8_layout((q8fmt_t){SB, S, BITS, HB, OFF, SC, MN});
  int nsb = a->k / SB, groups = (N + Q8_LANES - 1) / Q8_LANES;
  int tile = Q8_TILE / (M * SB) > 0 ? Q8_TILE / (M * SB) : 1;
  if (tile >= nsb) tile = nsb;
  int span = tile < nsb ? groups : 1; /* groups whose accumulators live at once */
  const int rows = S == 32 ? Q8_ROWS / 2 : Q8_ROWS; /* 8 weight vectors a sub-block: fewer rows */
  float *acc = q8_scratch(M * span);
  for (int g0 = 0; g0 < groups; g0 += span) {
    __builtin_memset(acc, 0, sizeof(float) * Q8_LANES * M * span);
    for (int s0 = 0; s0 < nsb; s0 += tile)
      for (int g = g0; g < g0 + span; g++) {
        float *ag = acc + (long)Q8_LANES * M * (g - g0);
        for (int sb = s0; sb < s0 + tile && sb < nsb; sb++) {
          const unsigned char *u = data + (long)g * group_bytes + (long)sb * o.unit;
          for (int r0 = 0; r0 < M; r0 += rows) {
            float *ar = ag + Q8_LANES * r0;
            switch (M - r0 < rows ? M - r0 : rows) {
#define Q8_R(n) case n: q8_unit(n, SB, S, BITS, HB, OFF, SC, MN, u, o, sb, a, r0, ar); break;
              Q8_R(1) Q8_R(2) Q8_R(3) Q8_R(4) Q8_R(5) Q8_R(6) Q8_R(7) Q8_R(8)
#undef Q8_R
            }
          }
        }
      }
    for (int g = g0; g < g0 + span; g++) {
      int lanes = N - g * Q8_LANES < Q8_LANES ? N - g * Q8_LANES : Q8_LANES;
      const float *ag = acc + (long)Q8_LANES * M * (g - g0);
      for (int r = 0; r < M; r++)
        for (int l = 0; l < lanes; l++)
          put(C + (long)r * ldc + g * Q8_LANES + l, ag[Q8_LANES * r + l], al, be);
    }
  }
}

#define Q8_PART(name, ...)                                                                    \
  static Q8_TARGET void q8_part_##name(int M, int N, const unsigned char *data, long gb,       \
                                       const q8act_t *a, float al, float be, float *C,         \
                                       int ldc) {                                              \
    q8_groups(__VA_ARGS__, M, N, data, gb, a, al, be, C, ldc);                                 \
  }
Q8_PART(q4_0, 32, 32, 4, 0, 8, 0, 0)
Q8_PART(q4_1, 32, 32, 4, 0, 0, 0, 1)
Q8_PART(q5_0, 32, 32, 4, 1, 16, 0, 0)
Q8_PART(q5_1, 32, 32, 4, 1, 0, 0, 1)
Q8_PART(q8_0, 32, 32, 8, 0, 128, 0, 0)
Q8_PART(q2_k, 256, 16, 4, 0, 0, 1, 2)
Q8_PART(q3_k, 256, 16, 4, 0, 4, 1, 0)
Q8_PART(q4_k, 256, 32, 4, 0, 0, 1, 2)
Q8_PART(q5_k, 256, 32, 4, 1, 0, 1, 2)
Q8_PART(q6_k, 256, 16, 4, 2, 32, 1, 0)

/* M rows (a block) against N outputs of a packed `type` from data on */
static void q8_part_rows(int type, int M, int N, const unsigned char *data, long group_bytes,
                         const q8act_t *a, float al, float be, float *C, int ldc) {
  switch (type) {
    case T_Q4_0: q8_part_q4_0(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q4_1: q8_part_q4_1(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q5_0: q8_part_q5_0(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q5_1: q8_part_q5_1(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q2_K: q8_part_q2_k(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q3_K: q8_part_q3_k(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q4_K: q8_part_q4_k(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q5_K: q8_part_q5_k(M, N, data, group_bytes, a, al, be, C, ldc); return;
    case T_Q6_K: q8_part_q6_k(M, N, data, group_bytes, a, al, be, C, ldc); return;
    default: q8_part_q8_0(M, N, data, group_bytes, a, al, be, C, ldc); return;
  }
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
