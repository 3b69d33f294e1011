// Part of mtp_kernels.cpp, included once into that one translation unit: bf16 rounding and the element-wise steps
// around the products (rounding, bias, residual adds, bf16 narrowing) on 8 and 16 lanes.
// ------------------------------------------------------------------------------------------------ bf16
static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch (NaN stays NaN)
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// round_bf16 on 8 lanes, the scalar's bits (nearest even; a NaN stays NaN with its quiet bit set).
TGT2 static inline __m256i round_bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v), hi = _mm256_set1_epi32((int)0xffff0000u);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), hi);
  const __m256i nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), hi);
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, nan, is_nan);
}
TGT2 static inline __m256 round_bf16_8(__m256 v) { return _mm256_castsi256_ps(round_bf16_bits8(v)); }
// v rounded to the dtype (8 lanes)
TGT2 static inline __m256 to_dtype8(__m256 v, int dtype) { return dtype == DT_BF16 ? round_bf16_8(v) : v; }

// Element-wise steps of a pass on 8 lanes (the scalar tail does the same operations, so every element has the
// bits of the scalar code whatever its place).
// y[j] = (out[j] (+ bias[j])) rounded to the dtype; y may be out.
TGT2 static void bias_round_row8(const float* out, const float* bias, float* y, int64_t n, int dtype) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(out + j);
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
    _mm256_storeu_ps(y + j, to_dtype8(v, dtype));
  }
  for (; j < n; j++) {
    float v = out[j];
    if (bias) v += bias[j];
    y[j] = dtype == DT_BF16 ? round_bf16(v) : v;
  }
}
// x[j] = (x[j] + o[j]) rounded to the dtype (a residual add, or the adapter's delta added to a projection).
TGT2 static void add_round_row8(float* x, const float* o, int64_t n, int dtype) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(x + j, to_dtype8(_mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(o + j)), dtype));
  for (; j < n; j++) x[j] = dtype == DT_BF16 ? round_bf16(x[j] + o[j]) : x[j] + o[j];
}
// d[j] = x[j] as bf16 (round to nearest even).
TGT2 static void to_bf16_row8(const float* x, uint16_t* d, int64_t k) {
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m256i a = _mm256_srli_epi32(round_bf16_bits8(_mm256_loadu_ps(x + j)), 16);
    const __m256i b = _mm256_srli_epi32(round_bf16_bits8(_mm256_loadu_ps(x + j + 8)), 16);
    _mm256_storeu_si256((__m256i*)(d + j), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
  }
  for (; j < k; j++) d[j] = f32_to_bf16(x[j]);
}

// The same steps on 16 lanes (the AVX512 and AMX paths): every lane does the 8-lane code's integer and float
// operations, so the bits are the same; the rest of a row (under 16 elements) goes through the 8-lane code.
TGT512 static inline __m512i round_bf16_bits16(__m512 v) {  // round_bf16_bits8's operations
  const __m512i u = _mm512_castps_si512(v), hi = _mm512_set1_epi32((int)0xffff0000u);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), hi);
  const __m512i nan = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), hi);
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                    _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(is_nan, r, nan);
}
TGT512 static inline __m512 to_dtype16(__m512 v, int dtype) {
  return dtype == DT_BF16 ? _mm512_castsi512_ps(round_bf16_bits16(v)) : v;
}
TGT512 static void bias_round_row16(const float* out, const float* bias, float* y, int64_t n, int dtype) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(out + j);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    _mm512_storeu_ps(y + j, to_dtype16(v, dtype));
  }
  if (j < n) bias_round_row8(out + j, bias ? bias + j : nullptr, y + j, n - j, dtype);
}
TGT512 static void add_round_row16(float* x, const float* o, int64_t n, int dtype) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(x + j, to_dtype16(_mm512_add_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(o + j)), dtype));
  if (j < n) add_round_row8(x + j, o + j, n - j, dtype);
}
TGT512 static void to_bf16_row16(const float* x, uint16_t* d, int64_t k) {
  int64_t j = 0;
  for (; j + 16 <= k; j += 16)  // the rounded value's top half, narrowed (exact: it fits 16 bits)
    _mm256_storeu_si256((__m256i*)(d + j),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits16(_mm512_loadu_ps(x + j)), 16)));
  if (j < k) to_bf16_row8(x + j, d + j, k - j);
}
// The element-wise steps for a path: 16 lanes where it has AVX512, else 8.
static inline void bias_round_row(int isa, const float* out, const float* bias, float* y, int64_t n, int dtype) {
  if (isa >= ISA_AVX512BF16) bias_round_row16(out, bias, y, n, dtype);
  else bias_round_row8(out, bias, y, n, dtype);
}
static inline void add_round_row(int isa, float* x, const float* o, int64_t n, int dtype) {
  if (isa >= ISA_AVX512BF16) add_round_row16(x, o, n, dtype);
  else add_round_row8(x, o, n, dtype);
}
static inline void to_bf16_row(int isa, const float* x, uint16_t* d, int64_t k) {
  if (isa >= ISA_AVX512BF16) to_bf16_row16(x, d, k);
  else to_bf16_row8(x, d, k);
}

