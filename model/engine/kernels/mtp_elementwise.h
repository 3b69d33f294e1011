// Part of mtp_kernels.cpp, included once into that one translation unit: the work around the products: exp, softmax, attention's dot products and weighted values, norms (8 lanes, 16 where the path has AVX512).
// ------------------------------------------------------------------------------------------------ AVX2 math
// Cephes' expf, the constants of exp8 and exp16 (one table: the two must do the same operations on the same
// numbers to give the same bits): clamp, log2(e) and the rounding half, ln 2 in two parts, the degree-5 polynomial.
enum { EXP_HI, EXP_LO, EXP_LOG2E, EXP_HALF, EXP_LN2_HI, EXP_LN2_LO, EXP_P0 };
static constexpr float EXP_K[EXP_P0 + 6] = {88.3762626647949f, -87.3365447504019f, 1.44269504088896341f, 0.5f,
                                           0.693359375f, -2.12194440e-4f, 1.9875691500E-4f, 1.3981999507E-3f,
                                           8.3334519073E-3f, 4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

// exp on 8 lanes (range reduction by ln 2, degree-5 polynomial); |error| ~1 ulp, lane-wise.
TGT2 static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_K[EXP_LO])), _mm256_set1_ps(EXP_K[EXP_HI]));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(EXP_K[EXP_LOG2E]), _mm256_set1_ps(EXP_K[EXP_HALF])));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_K[EXP_LN2_HI]), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_K[EXP_LN2_LO]), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(EXP_K[EXP_P0]);
  for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_K[EXP_P0 + i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// exp8 on 16 lanes: each lane the same operations on the same constants, so the same bits.
TGT512 static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_K[EXP_LO])), _mm512_set1_ps(EXP_K[EXP_HI]));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(EXP_K[EXP_LOG2E]), _mm512_set1_ps(EXP_K[EXP_HALF]));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_K[EXP_LN2_HI]), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_K[EXP_LN2_LO]), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(EXP_K[EXP_P0]);
  for (int i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_K[EXP_P0 + i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Attention's softmax numerator in place: s[i] = exp(s[i] * scale - m), m the largest scaled score; returns the sum.
// Every element through exp8's lanes (a tail padded with zeros); the max exact in any order (a NaN score skipped);
// the sum on 8 lanes in element order, the padded lanes adding zero, then ((0+1)+(2+3))+((4+5)+(6+7)). So a score
// row's bits depend on its own scores only, never on where its elements fall in the vectors.
TGT2 static float softmax_unnormalised(float* s, int64_t n, float scale) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + i), sv);
    _mm256_storeu_ps(s + i, v);
    mv = _mm256_max_ps(v, mv);  // mv where v is NaN
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  float m = -INFINITY;
  for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
  for (; i < n; i++) {
    s[i] *= scale;
    m = s[i] > m ? s[i] : m;
  }
  const __m256 m8 = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m8));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float tmp[8] = {0};
  for (int64_t j = i; j < n; j++) tmp[j - i] = s[j] - m;
  __m256 e = exp8(_mm256_loadu_ps(tmp));
  _mm256_storeu_ps(tmp, e);
  for (int j = (int)(n - i); j < 8; j++) tmp[j] = 0.f;  // padded lanes add nothing
  for (int64_t j = i; j < n; j++) s[j] = tmp[j - i];
  acc = _mm256_add_ps(acc, _mm256_loadu_ps(tmp));
  _mm256_storeu_ps(tmp, acc);
  return ((tmp[0] + tmp[1]) + (tmp[2] + tmp[3])) + ((tmp[4] + tmp[5]) + (tmp[6] + tmp[7]));
}

// Dot product of n floats: 8 lanes of fused multiply-adds (a tail padded with zeros), then
// ((0+1)+(2+3))+((4+5)+(6+7)).
TGT2 static float dot_lanes(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float ta[8] = {0}, tb[8] = {0};
  for (int64_t j = i; j < n; j++) { ta[j - i] = a[j]; tb[j - i] = b[j]; }
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(ta), _mm256_loadu_ps(tb), acc);
  _mm256_storeu_ps(ta, acc);
  return ((ta[0] + ta[1]) + (ta[2] + ta[3])) + ((ta[4] + ta[5]) + (ta[6] + ta[7]));
}

// The dot product of q with one cached key (bf16 or float32 entries): the lanes and order of dot_lanes.
TGT2 static float dot_kv(const float* q, const void* kc, int dtype, int64_t off, int hd) {
  if (dtype != DT_BF16) return dot_lanes(q, (const float*)kc + off, hd);
  const uint16_t* k = (const uint16_t*)kc + off;
  __m256 acc = _mm256_setzero_ps();
  int d = 0;
  for (; d + 8 <= hd; d += 8) {
    __m256 kf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(k + d))), 16));
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kf, acc);
  }
  float ta[8] = {0}, tb[8] = {0};
  for (int j = d; j < hd; j++) { ta[j - d] = q[j]; tb[j - d] = bf16_to_f32(k[j]); }
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(ta), _mm256_loadu_ps(tb), acc);
  _mm256_storeu_ps(ta, acc);
  return ((ta[0] + ta[1]) + (ta[2] + ta[3])) + ((ta[4] + ta[5]) + (ta[6] + ta[7]));
}

// A cached key's 8 lanes at d (bf16 widened, or float32).
TGT2 static inline __m256 key8(const void* kc, int dtype, int64_t off) {
  if (dtype != DT_BF16) return _mm256_loadu_ps((const float*)kc + off);
  const uint16_t* k = (const uint16_t*)kc + off;
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)k)), 16));
}

// The sums of 16 vectors' lanes at once (a[j]: key j's 16 partial sums), in key order, each in the order
// _mm512_reduce_add_ps sums one vector (GCC's: lane i + lane i + 8, then i + 4 of those, then i + 2, then the two
// left), so every score has the bits of the one-key code: 15 shuffle pairs and adds and one permute for 16 keys
// where each key alone took ~7 instructions.
TGT512 static inline __m512 reduce_add16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int p = 0; p < 8; p++)  // lanes 0-7: key 2p's lane i + lane i + 8; lanes 8-15: key 2p + 1's
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int p = 0; p < 4; p++)  // quarter r: key 4p + r's i + (i + 4)
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; p++) {  // quarter r: key 8p + r's two sums i + (i + 2), then key 8p + 4 + r's
    const __m512d x = _mm512_castps_pd(c[2 * p]), y = _mm512_castps_pd(c[2 * p + 1]);
    d[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // quarter r: the scores of keys r, 4 + r, 8 + r, 12 + r; back to key order
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

// Scores of the G queries q[0..G-1] (heads sharing one KV head) with 4 cached keys (offsets off[0..3]), for
// head_dim a multiple of 8: each key is widened once for the G heads, and each score has dot_kv's bits (its lanes
// and order, its zero tail step; the 4 horizontal sums run as one transpose: hadd pairs lanes as dot_kv's
// ((0+1)+(2+3))+((4+5)+(6+7)) does, then the two 128-bit halves are added).
template <int G>
TGT2 static void dot_kv4_heads(const float* const* q, const void* kc, int dtype, const int64_t* off, int hd,
                               float* const* out) {
  __m256 a[G][4];
  for (int g = 0; g < G; g++)
    for (int j = 0; j < 4; j++) a[g][j] = _mm256_setzero_ps();
  for (int d = 0; d < hd; d += 8)
    for (int j = 0; j < 4; j++) {
      const __m256 kv = key8(kc, dtype, off[j] + d);
      for (int g = 0; g < G; g++) a[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), kv, a[g][j]);
    }
  const __m256 z = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    for (int j = 0; j < 4; j++) a[g][j] = _mm256_fmadd_ps(z, z, a[g][j]);  // dot_kv's padded tail step
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
    _mm_storeu_ps(out[g], _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
}

// scores_bf16's 16-key step: each head's scores against 16 keys, key j's half at d read at key(j, d), one
// transposed reduction a head (reduce_add16).
template <int G, class KeyAt>
TGT512 static inline void scores16(const uint32_t (*q2)[256], int hd, KeyAt key, float* const* out, int64_t i) {
  for (int g = 0; g < G; g++) {
    __m512 a[16];
    for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void*)(q2[g] + d / 2));
      for (int j = 0; j < 16; j++)
        a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_loadu_si512((const void*)key(j, d)));
    }
    _mm512_storeu_ps(out[g] + i, reduce_add16(a));
  }
}

// Scores of the G queries q[0..G-1] (float32 holding bf16 values: a bf16 model's q is rounded after rotary) with
// the n cached bf16 keys at element offsets off, head_dim a multiple of 32, into out[g][0..n): AVX512-BF16, the
// 16 pairs of a zmm multiplied exactly and summed into float32 per lane (vdpbf16ps), then the 16 lanes
// (_mm512_reduce_add_ps, or reduce_add16 in its order). Every score has one order whatever the key's place (16,
// 4 keys at a time or one), so a row's scores do not depend on its pass; not dot_kv's bits (a path's own order,
// as its projections are).
template <int G>
TGT512 static void scores_bf16(const float* const* q, const void* kc, const int64_t* off, int64_t n, int hd,
                               float* const* out) {
  uint32_t q2[G][256];
  for (int g = 0; g < G; g++) to_bf16_row16(q[g], (uint16_t*)q2[g], hd);
  const uint16_t* k = (const uint16_t*)kc;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const uint16_t* k0 = k + off[i];
    if (hd == 64 && off[i + 15] - off[i] == 15 * 64)  // 16 keys one after another (the cache before this pass):
      scores16<G>(q2, 64, [k0](int j, int d) { return k0 + j * 64 + d; }, out, i);  // addressed from one pointer
    else
      scores16<G>(q2, hd, [k, o = off + i](int j, int d) { return k + o[j] + d; }, out, i);
  }
  for (; i + 4 <= n; i += 4) {
    __m512 a[G][4];
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 32)
      for (int j = 0; j < 4; j++) {
        const __m512i kv = _mm512_loadu_si512((const void*)(k + off[i + j] + d));
        for (int g = 0; g < G; g++)
          a[g][j] = _mm512_dpbf16_ps(a[g][j], (__m512bh)_mm512_loadu_si512((const void*)(q2[g] + d / 2)), (__m512bh)kv);
      }
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) out[g][i + j] = _mm512_reduce_add_ps(a[g][j]);
  }
  for (; i < n; i++)
    for (int g = 0; g < G; g++) {
      __m512 a = _mm512_setzero_ps();
      for (int d = 0; d < hd; d += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void*)(q2[g] + d / 2)),
                             (__m512bh)_mm512_loadu_si512((const void*)(k + off[i] + d)));
      out[g][i] = _mm512_reduce_add_ps(a);
    }
}

// o[g][d] = (sum_i p[g][i] v_i[d]) * inv[g] rounded to the dtype for the G heads sharing one KV head, head_dim a
// multiple of 32: each value widened once for the G heads; per head and lane axpy_kv's fused multiply-adds in
// value order (32 lanes of each head's sum held in registers across the values), so the same bits.
template <int G>
TGT2 static void weighted_values_heads(const float* const* p, int64_t n, const void* vc, int dtype, const int64_t* off,
                                       int hd, const float* inv, float* const* o) {
  for (int d0 = 0; d0 < hd; d0 += 32) {
    __m256 acc[G][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) acc[g][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++)
      for (int c = 0; c < 4; c++) {
        const __m256 vv = key8(vc, dtype, off[i] + d0 + 8 * c);
        for (int g = 0; g < G; g++) acc[g][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[g] + i), vv, acc[g][c]);
      }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++)
        _mm256_storeu_ps(o[g] + d0 + 8 * c, to_dtype8(_mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])), dtype));
  }
}

// weighted_values_heads on 16 lanes (head_dim a multiple of 64): per head and lane the same fused multiply-adds in
// value order, so the same bits; each value's 64 elements widened once for the G heads (4 zmm accumulators a head).
template <int G>
TGT512 static void weighted_values_heads512(const float* const* p, int64_t n, const void* vc, int dtype,
                                            const int64_t* off, int hd, const float* inv, float* const* o) {
  for (int d0 = 0; d0 < hd; d0 += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
      __m512 vv[4];
      for (int c = 0; c < 4; c++) {
        const int64_t at = off[i] + d0 + 16 * c;
        vv[c] = dtype == DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)vc + at))), 16))
                                 : _mm512_loadu_ps((const float*)vc + at);
      }
      for (int g = 0; g < G; g++) {
        const __m512 pg = _mm512_set1_ps(p[g][i]);
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) {
        const __m512 r = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g]));
        float* dst = o[g] + d0 + 16 * c;
        _mm256_storeu_ps(dst, to_dtype8(_mm512_castps512_ps256(r), dtype));
        _mm256_storeu_ps(dst + 8, to_dtype8(_mm512_extractf32x8_ps(r, 1), dtype));
      }
  }
}

// weighted values of a bf16 model on the zmm paths (head_dim a multiple of 64): o[g][d] = (sum_i p[g][i] v_i[d]) *
// inv[g], rounded to bf16, with the probabilities rounded to bf16 first, as transformers rounds them before its
// product with the values. Values 2j and 2j + 1 of the list (a last odd one paired with zeros) go through one
// vdpbf16ps: each value row is interleaved with the next once for the G heads, and the multiply-adds are half
// those of the float32 sum. A row's bits depend on its list of values only (the pairs follow the list).
template <int G>
TGT512 static void weighted_values_bf16(const float* const* p, int64_t n, const void* vc, const int64_t* off, int hd,
                                        const float* inv, float* const* o) {
  static thread_local Scratch s_p16;
  const int64_t np = (n + 1) / 2, ld = 2 * np + 32;
  uint16_t* p16 = (uint16_t*)s_p16.get(G * ld / 2 + 16);
  for (int g = 0; g < G; g++) {
    to_bf16_row16(p[g], p16 + g * ld, n);
    p16[g * ld + n] = 0;  // the odd last value's partner
  }
  const uint32_t* p2 = (const uint32_t*)p16;
  const uint16_t* v = (const uint16_t*)vc;
  const __m512i zero = _mm512_setzero_si512();
  for (int d0 = 0; d0 < hd; d0 += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < np; j++) {
      const uint16_t* a = v + off[2 * j] + d0;
      const bool two = 2 * j + 1 < n;
      const uint16_t* b = two ? v + off[2 * j + 1] + d0 : a;
      const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
      const __m512i b0 = two ? _mm512_loadu_si512(b) : zero, b1 = two ? _mm512_loadu_si512(b + 32) : zero;
      // 32-bit slot l of each: (value 2j, value 2j + 1) at element 8 (l / 4) + l % 4 (+ 4 for hi, + 32 for a1)
      const __m512i w[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0),
                            _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)};
      for (int g = 0; g < G; g++) {
        const __m512bh pg = (__m512bh)_mm512_set1_epi32((int)p2[g * (ld / 2) + j]);
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pg, (__m512bh)w[c]);
      }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < G; g++)
      for (int h = 0; h < 2; h++) {  // elements d0 + 32 h + 0..15 and + 16..31, back in order
        const __m512 lo = acc[g][2 * h], hi = acc[g][2 * h + 1], sc = _mm512_set1_ps(inv[g]);
        float* dst = o[g] + d0 + 32 * h;
        _mm512_storeu_ps(dst, to_dtype16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), sc), DT_BF16));
        _mm512_storeu_ps(dst + 16, to_dtype16(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), sc), DT_BF16));
      }
  }
}

// acc[d] = fma(p, v[d], acc[d]) for one cached value (every lane one fused multiply-add, vector or tail).
TGT2 static void axpy_kv(float* acc, float p, const void* vc, int dtype, int64_t off, int hd) {
  const __m256 pv = _mm256_set1_ps(p);
  int d = 0;
  if (dtype == DT_BF16) {
    const uint16_t* v = (const uint16_t*)vc + off;
    for (; d + 8 <= hd; d += 8) {
      __m256 vf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(v + d))), 16));
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, vf, _mm256_loadu_ps(acc + d)));
    }
    for (; d < hd; d++) acc[d] = fmaf(p, bf16_to_f32(v[d]), acc[d]);
  } else {
    const float* v = (const float*)vc + off;
    for (; d + 8 <= hd; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
    for (; d < hd; d++) acc[d] = fmaf(p, v[d], acc[d]);
  }
}

// transformers' RMSNorm: float32 statistics, x * rsqrt(mean(x^2) + eps) rounded to the dtype, times the
// weight (rounded again in bf16).
TGT2 static void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps, int dtype) {
  float ss = dot_lanes(x, x, n);
  float r = 1.0f / sqrtf(ss / (float)n + eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, to_dtype8(_mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                    to_dtype8(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), dtype)), dtype));
  for (; i < n; i++) {
    float h = x[i] * r;
    if (dtype == DT_BF16) h = round_bf16(h);
    float v = w[i] * h;
    y[i] = dtype == DT_BF16 ? round_bf16(v) : v;
  }
}
