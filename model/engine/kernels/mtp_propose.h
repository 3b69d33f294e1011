// Part of mtp_kernels.cpp, included once into that one translation unit: the proposals of a pass's logits rows.
// ------------------------------------------------------------------------------------------------ propose
// Per row (paper 3.4, ConfAdapt): the greedy token, the first index of the row's largest logit with the mask
// token left out, and its confidence, that token's probability under the softmax over the vocabulary without
// the mask token: exp(0) / sum_i exp(l_i - max) = 1 / sum_i exp(l_i - max). Torch took ~90 us a row for the
// same (a softmax, then a maximum with its index: neither vectorised for 49,152 columns); this reads the row
// twice, 8 lanes at a time. A -inf logit adds exactly 0. A NaN or +inf logit makes the confidence NaN (the
// caller says where); so does a row that is -inf everywhere.

// Row r's logit i as float32 (bf16 widened exactly); the mask token reads -inf.
TGT2 static inline __m256 logits8(const void* row, int dtype, int64_t i) {
  if (dtype == DT_BF16) {
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps((const float*)row + i);
}

TGT2 static void propose_row(const void* row, int dtype, int64_t V, int64_t mask_id, float* wide, int64_t* token,
                             float* conf) {
  // wide: the row as float32, padded to a multiple of 8 with -inf (adds 0 to the sum, never the maximum)
  const int64_t Vp = (V + 7) / 8 * 8;
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(wide + i, logits8(row, dtype, i));
  for (; i < Vp; i++)
    wide[i] = i >= V ? -INFINITY : dtype == DT_BF16 ? bf16_to_f32(((const uint16_t*)row)[i]) : ((const float*)row)[i];
  if (mask_id >= 0 && mask_id < V) wide[mask_id] = -INFINITY;
  const __m256 pinf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
  __m256 mx = ninf, bad = _mm256_setzero_ps();
  for (i = 0; i < Vp; i += 8) {
    const __m256 v = _mm256_loadu_ps(wide + i);
    mx = _mm256_max_ps(mx, v);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(v, pinf, _CMP_EQ_OQ)));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mx);
  float m = lanes[0];
  for (int l = 1; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
  int64_t first = 0;
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i < Vp; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(wide + i), mv, _CMP_EQ_OQ));
    if (hit) { first = i + __builtin_ctz(hit); break; }
  }
  // four accumulators of 8 lanes (element i into accumulator (i / 8) % 4): 32 partial sums of ~1,500 terms
  // each for 49,152 columns, a tenth of one accumulator's rounding error
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (i = 0; i < Vp; i += 8) {
    const __m256 v = _mm256_loadu_ps(wide + i);
    const __m256 e = exp8(_mm256_sub_ps(v, mv));
    __m256& a = acc[(i / 8) & 3];
    a = _mm256_add_ps(a, _mm256_and_ps(e, _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ)));  // -inf: exactly 0
  }
  _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  const float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  *token = first;
  *conf = (_mm256_movemask_ps(bad) || m == -INFINITY) ? NAN : 1.0f / sum;
}

// rows: T rows of V logits (dtype DT_F32 or DT_BF16), row r at logits + r * ld elements. tokens[T], conf[T] out.
// Rows are split between nt threads; each row is computed by one thread in the order above, so the results do
// not depend on nt. Returns 0, or 1 for a bad shape.
extern "C" int32_t mtp_propose(const void* logits, int32_t dtype, int32_t T, int64_t V, int64_t ld, int64_t mask_id,
                               int64_t* tokens, float* conf, int32_t nt) {
  if (T < 0 || V < 1 || ld < V || (dtype != DT_F32 && dtype != DT_BF16)) return 1;
  if (nt < 1) nt = 1;
  if (nt > T) nt = T > 0 ? T : 1;
  nt = thread_cap(nt);  // as many threads as the passes may use now (mtp_threads.h, pass_threads)
  const int64_t esize = dtype == DT_BF16 ? 2 : 4;
  parallel(nt, [&](int tid, int n_threads) {
    static thread_local Scratch s_wide;
    float* wide = s_wide.get(V + 8);
    int64_t r0, r1;
    share(T, tid, n_threads, &r0, &r1);
    for (int64_t r = r0; r < r1; r++)
      propose_row((const uint8_t*)logits + r * ld * esize, dtype, V, mask_id, wide, tokens + r, conf + r);
  });
  return 0;
}
