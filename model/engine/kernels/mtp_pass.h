// Part of mtp_kernels.cpp, included once into that one translation unit: attention, rotary, SiLU-up and the whole forward pass (mtp_forward_batch).
// ------------------------------------------------------------------------------------------------ the pass
// Scores, softmax and weighted values of the G heads h0.. (all of one KV head) for one query row, over the n
// keys / values at element offsets idx. Per head exactly the one-head order: keys in cache order (4 at a time,
// then one by one), the scale, the max, exp, the sum, values in cache order (a bf16 model's on the zmm paths two at
// a time, weighted_values_bf16).
template <int G>
TGT2 static void attend_heads(const mtp_model* M, const float* qt, const void* kc, const void* vc, const int64_t* idx,
                              int64_t n, int64_t ldsc, float* sc, float* o) {
  const int hd = M->head_dim, dtype = M->dtype;
  const float* qs[G];
  float* scs[G];
  float* os[G];
  float inv[G];
  for (int g = 0; g < G; g++) { qs[g] = qt + g * hd; scs[g] = sc + g * ldsc; os[g] = o + g * hd; }
  int64_t i4 = 0;
  if (dtype == DT_BF16 && M->isa >= ISA_AVX512BF16 && hd % 32 == 0) {  // vdpbf16ps: ~4x fewer instructions
    scores_bf16<G>(qs, kc, idx, n, hd, scs);
    i4 = n;
  } else if (hd % 8 == 0) {
    for (; i4 + 4 <= n; i4 += 4) {
      float* at[G];
      for (int g = 0; g < G; g++) at[g] = scs[g] + i4;
      dot_kv4_heads<G>(qs, kc, dtype, idx + i4, hd, at);
    }
  }
  for (int g = 0; g < G; g++) {
    float* s = scs[g];
    for (int64_t i = i4; i < n; i++) s[i] = dot_kv(qs[g], kc, dtype, idx[i], hd);
    inv[g] = 1.0f / softmax_unnormalised(s, n, M->scaling);
  }
  if (dtype == DT_BF16 && hd % 64 == 0 && M->isa >= ISA_AVX512BF16) {  // two values a vdpbf16ps
    weighted_values_bf16<G>(scs, n, vc, idx, hd, inv, os);
    return;
  }
  if (hd % 64 == 0 && M->isa >= ISA_AVX512BF16) {  // 16 lanes: each lane's multiply-adds as on 8
    weighted_values_heads512<G>(scs, n, vc, dtype, idx, hd, inv, os);
    return;
  }
  if (hd % 32 == 0) {
    weighted_values_heads<G>(scs, n, vc, dtype, idx, hd, inv, os);
    return;
  }
  static thread_local Scratch s_acc;
  float* acc = s_acc.get(hd + 8);
  for (int g = 0; g < G; g++) {
    for (int d = 0; d < hd; d++) acc[d] = 0.f;
    for (int64_t i = 0; i < n; i++) axpy_kv(acc, scs[g][i], vc, dtype, idx[i], hd);
    for (int d = 0; d < hd; d++) os[g][d] = dtype == DT_BF16 ? round_bf16(acc[d] * inv[g]) : acc[d] * inv[g];
  }
}

// Attention of query rows [T, heads * hd], each over its own sequence's cache (mtp_batch): row t of sequence
// s (local index u0) sees every entry below pos[s] and entry pos[s] + u where visible[s][u0 * T_s + u] (NULL:
// u <= u0). A task is one row and up to 3 heads of one KV head (each key and value read once for them); each
// head has its keys in cache order, its softmax and its weighted sum in a fixed order, so its bits do not
// depend on the grouping; the result rounded to the dtype.
TGT2 static void attention(const mtp_model* M, int T, const float* q, int64_t ldq, const mtp_batch* B, int layer,
                           const int* row_seq, float* out, int64_t ldout, int nt) {
  constexpr int GMAX = 3;  // heads per task: 3 x 4 accumulators + a key fill 16 ymm registers
  const int hd = M->head_dim, groups = M->heads / M->kv_heads;
  const int chunks = (groups + GMAX - 1) / GMAX, per_kv = chunks * M->kv_heads;
  int64_t L = 0;
  for (int s = 0; s < B->nseq; s++) {
    const int64_t ls = B->pos[s] + B->row0[s + 1] - B->row0[s];
    L = ls > L ? ls : L;
  }
  const int tasks = T * per_kv;
  parallel(nt, [&](int tid, int n_threads) {
    static thread_local Scratch s_sc, s_idx;
    const int64_t ldsc = L + 8;
    float* sc = s_sc.get(GMAX * ldsc);
    int64_t* idx = (int64_t*)s_idx.get(2 * (L + 1));
    const int per = tasks / n_threads, extra = tasks % n_threads;  // static schedule: contiguous tasks
    const int task0 = tid * per + (tid < extra ? tid : extra), task1 = task0 + per + (tid < extra ? 1 : 0);
    for (int task = task0; task < task1; task++) {
      const int t = task / per_kv, kvh = (task % per_kv) / chunks, c = task % chunks, sq = row_seq[t];
      const int h0 = kvh * groups + c * GMAX, G = (groups - c * GMAX) < GMAX ? groups - c * GMAX : GMAX;
      const int r0 = B->row0[sq], Ts = B->row0[sq + 1] - r0, t0 = t - r0;
      const int64_t pos = B->pos[sq], cap = B->cap[sq];
      const uint8_t* visible = B->visible[sq];
      const void* kc = B->kcache[(int64_t)sq * M->layers + layer];
      const void* vc = B->vcache[(int64_t)sq * M->layers + layer];
      int64_t n = 0;
      for (int64_t j = 0; j < pos; j++) idx[n++] = j;
      for (int u = 0; u < Ts; u++)
        if (visible ? visible[t0 * Ts + u] : (u <= t0)) idx[n++] = pos + u;
      const int64_t kbase = (int64_t)kvh * cap * hd;
      for (int64_t i = 0; i < n; i++) idx[i] = kbase + idx[i] * hd;  // element offsets of the keys / values
      const float* qt = q + t * ldq + h0 * hd;
      float* o = out + t * ldout + h0 * hd;
      if (G == 3) attend_heads<3>(M, qt, kc, vc, idx, n, ldsc, sc, o);
      else if (G == 2) attend_heads<2>(M, qt, kc, vc, idx, n, ldsc, sc, o);
      else attend_heads<1>(M, qt, kc, vc, idx, n, ldsc, sc, o);
    }
  });
}

// Rotary embedding x cos + rotate_half(x) sin with the first half of sin negated (sin_f), as transformers
// rounds it in bf16: each product rounded, then the sum.
TGT2 static void rotate(float* x, const float* cos, const float* sin_f, int hd, int dtype) {
  float tmp[512];
  const int half = hd / 2;
  if (half % 8 == 0) {  // 8 lanes: the same products, roundings and sum as the scalar loop below
    for (int d = 0; d < hd; d += 8) {
      const int r = d < half ? d + half : d - half;
      const __m256 a = to_dtype8(_mm256_mul_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(cos + d)), dtype);
      const __m256 b = to_dtype8(_mm256_mul_ps(_mm256_loadu_ps(x + r), _mm256_loadu_ps(sin_f + d)), dtype);
      _mm256_storeu_ps(tmp + d, to_dtype8(_mm256_add_ps(a, b), dtype));
    }
    memcpy(x, tmp, sizeof(float) * hd);
    return;
  }
  for (int d = 0; d < hd; d++) {
    float a = x[d] * cos[d];
    float b = x[(d + half) % hd] * sin_f[d];
    if (dtype == DT_BF16) { a = round_bf16(a); b = round_bf16(b); }
    float s = a + b;
    tmp[d] = dtype == DT_BF16 ? round_bf16(s) : s;
  }
  memcpy(x, tmp, sizeof(float) * hd);
}

// SiLU(gate) * up, rounded as transformers does in bf16 (silu rounded, then the product), for the columns
// [c0, c1) of each of the T rows (gu: [T, ld] holding gate then up; act: [T, inter]). Element-wise.
TGT2 static inline __m256 silu_mul8(__m256 g, __m256 u, int dtype) {
  const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));  // exp(-g)
  const __m256 s1 = to_dtype8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), dtype);
  return to_dtype8(_mm256_mul_ps(s1, u), dtype);
}
TGT512 static int64_t silu_mul16(const float* g, const float* u, float* a, int64_t n, int dtype) {
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // silu_mul8's operations on 16 lanes
    const __m512 g16 = _mm512_loadu_ps(g + i), e = exp16(_mm512_xor_ps(g16, sign));
    const __m512 s1 = to_dtype16(_mm512_div_ps(g16, _mm512_add_ps(one, e)), dtype);
    _mm512_storeu_ps(a + i, to_dtype16(_mm512_mul_ps(s1, _mm512_loadu_ps(u + i)), dtype));
  }
  return i;
}
TGT2 static void silu_mul(int isa, const float* gu, int64_t ld, int T, int inter, int64_t c0, int64_t c1, float* act,
                          int dtype) {
  const int64_t n = c1 - c0;
  for (int t = 0; t < T; t++) {
    const float* g = gu + t * ld + c0;
    const float* u = gu + t * ld + inter + c0;
    float* a = act + (int64_t)t * inter + c0;
    int64_t i = isa >= ISA_AVX512BF16 ? silu_mul16(g, u, a, n, dtype) : 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), dtype));
    if (i < n) {  // the tail through padded lanes: every element the same lane code
      float gt[8] = {0}, ut[8] = {0}, at[8];
      memcpy(gt, g + i, sizeof(float) * (n - i));
      memcpy(ut, u + i, sizeof(float) * (n - i));
      _mm256_storeu_ps(at, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut), dtype));
      memcpy(a + i, at, sizeof(float) * (n - i));
    }
  }
}

// n values written into a KV cache row at element offset i (bf16: round_bf16's bits; float32: as they are).
static void kv_put_row(int isa, void* base, int dtype, int64_t i, const float* v, int64_t n) {
  if (dtype == DT_BF16) to_bf16_row(isa, v, (uint16_t*)base + i, n);
  else memcpy((float*)base + i, v, sizeof(float) * n);
}

static int forward_layers(const mtp_model* M, float* x, int32_t T, const mtp_batch* B, const float* cos,
                          const float* sin_f, int32_t nt);
static int head_logits(const mtp_model* M, const float* x, int32_t T, const mtp_batch* B, void* logits,
                       int32_t logits_dtype, int32_t nt);

// logits: [B->nkeep, V] in logits_dtype: DT_F32 (float32), or DT_BF16 for a bf16 model (its logits are bf16
// values: stored as they are, with no copy through float32 in the caller).
extern "C" int mtp_forward_batch(const mtp_model* M, float* x, int32_t T, const mtp_batch* B, const float* cos,
                                 const float* sin_f, void* logits, int32_t logits_dtype, int32_t nt) {
  if (logits_dtype != DT_F32 && (logits_dtype != DT_BF16 || M->dtype != DT_BF16)) return 3;
  if (nt < 1) nt = 1;
  for (int i = 0; i < B->nkeep; i++)
    if (B->keep[i] < 0 || B->keep[i] >= T) return 2;
  nt = pass_threads(nt);  // a thread fewer for a while after a pass that waited on a worker without a core
  const int64_t stalls0 = t_stalls;
  int rc = forward_layers(M, x, T, B, cos, sin_f, nt);
  if (rc == 0) rc = head_logits(M, x, T, B, logits, logits_dtype, nt);
  pass_done(nt, stalls0);
  trim_scratch();
  return rc;
}

// The logits of the rows B->keep after the last layer (x: [T, hidden]): the final norm, the head, and peft's trained
// output rows on the adapter rows. bf16 logits come out of the AMX tiles as bf16 (the head's epilogue); on the
// other paths they are rounded into float32 first and narrowed after, each thread its share of the columns.
static int head_logits(const mtp_model* M, const float* x, int32_t T, const mtp_batch* B, void* logits,
                       int32_t logits_dtype, int32_t nt) {
  const int Hd = M->hidden, keep = B->nkeep;
  const int64_t V = M->head.n;
  const bool bf16 = logits_dtype == DT_BF16, direct = bf16 && gemm_has_epilogue(&M->head, M->isa);
  static thread_local Scratch s_h, s_ov, s_logits;
  float* h = s_h.get((int64_t)keep * Hd + 1);
  for (int i = 0; i < keep; i++) rms_norm_row(x + B->keep[i] * Hd, M->norm, h + i * Hd, Hd, M->eps, M->dtype);
  float* lf = bf16 ? (direct ? nullptr : s_logits.get((int64_t)keep * V)) : (float*)logits;
  uint16_t* lb = bf16 ? (uint16_t*)logits : nullptr;
  linear(M, &M->head, keep, h, Hd, lf, V, nullptr, nt, direct ? lb : nullptr);
  const uint8_t* am = B->adapter;
  if (M->head_override.n > 0 && am) {  // peft's trained output rows, on the adapter rows only
    const int n = M->head_override.n;
    float* ov = s_ov.get(n + 16);
    for (int i = 0; i < keep; i++) {
      if (!am[B->keep[i]]) continue;
      linear(M, &M->head_override, 1, h + (int64_t)i * Hd, Hd, ov, n, nullptr, nt);
      for (int j = 0; j < n; j++) {
        const int64_t at = (int64_t)i * V + M->override_idx[j];
        if (direct) lb[at] = f32_to_bf16(ov[j]);
        else lf[at] = ov[j];
      }
    }
  }
  if (bf16 && !direct)
    parallel(nt, [&](int tid, int n_threads) {
      int64_t b0, b1;
      share(cdiv(V, 16), tid, n_threads, &b0, &b1);
      const int64_t c0 = b0 * 16, c1 = b1 * 16 < V ? b1 * 16 : V;
      for (int i = 0; i < keep && c0 < c1; i++) to_bf16_row(M->isa, lf + i * V + c0, lb + i * V + c0, c1 - c0);
    });
  return 0;
}

static int forward_layers(const mtp_model* M, float* x, int32_t T, const mtp_batch* B, const float* cos,
                          const float* sin_f, int32_t nt) {
  // x: [T, hidden] the embeddings of every sequence's rows (float32 holding dtype values), updated in place to
  // the last layer's output. cos / sin_f: [T, hd] (each row's rotary table row, sin's first half negated).
  const int Hd = M->hidden, H = M->heads, KV = M->kv_heads, hd = M->head_dim, I = M->inter, dt = M->dtype;
  if (hd > 512 || B->nseq < 1 || B->row0[B->nseq] != T) return 1;
  const int64_t qkv_n = (int64_t)(H + 2 * KV) * hd;
  static thread_local Scratch s_h, s_qkv, s_a, s_gu, s_act, s_o, s_seq;
  float* h = s_h.get((int64_t)T * Hd);
  float* qkv = s_qkv.get((int64_t)T * qkv_n);
  float* a = s_a.get((int64_t)T * H * hd);
  float* gu = s_gu.get((int64_t)T * 2 * I);
  float* act = s_act.get((int64_t)T * I);
  float* o = s_o.get((int64_t)T * (Hd > I ? Hd : I));
  int* row_seq = (int*)s_seq.get(T + 1);
  for (int sq = 0; sq < B->nseq; sq++)
    for (int t = B->row0[sq]; t < B->row0[sq + 1]; t++) row_seq[t] = sq;
  const uint8_t* am = B->adapter;
  for (int li = 0; li < M->layers; li++) {
    const mtp_layer* Ly = &M->layer[li];
    for (int t = 0; t < T; t++) rms_norm_row(x + t * Hd, Ly->ln1, h + t * Hd, Hd, M->eps, dt);
    linear(M, &Ly->qkv, T, h, Hd, qkv, qkv_n, am, nt);
    for (int t = 0; t < T; t++) {
      float* row = qkv + t * qkv_n;
      for (int hh = 0; hh < H + KV; hh++) {
        float* v = row + hh * hd;
        if (Ly->q_norm) rms_norm_row(v, hh < H ? Ly->q_norm : Ly->k_norm, v, hd, M->eps, dt);
        rotate(v, cos + t * hd, sin_f + t * hd, hd, dt);
      }
      const int sq = row_seq[t];
      void* kc = B->kcache[(int64_t)sq * M->layers + li];
      void* vc = B->vcache[(int64_t)sq * M->layers + li];
      const int64_t at0 = B->pos[sq] + t - B->row0[sq];
      for (int g = 0; g < KV; g++) {
        const int64_t at = ((int64_t)g * B->cap[sq] + at0) * hd;
        kv_put_row(M->isa, kc, dt, at, row + (H + g) * hd, hd);
        kv_put_row(M->isa, vc, dt, at, row + (H + KV + g) * hd, hd);
      }
    }
    attention(M, T, qkv, qkv_n, B, li, row_seq, a, (int64_t)H * hd, nt);
    linear(M, &Ly->o, T, a, (int64_t)H * hd, o, Hd, am, nt);
    add_round_row(M->isa, x, o, (int64_t)T * Hd, dt);
    for (int t = 0; t < T; t++) rms_norm_row(x + t * Hd, Ly->ln2, h + t * Hd, Hd, M->eps, dt);
    linear(M, &Ly->gate_up, T, h, Hd, gu, 2 * I, am, nt);
    parallel(nt, [&](int tid, int n_threads) {  // each thread its share of the columns (multiples of 16)
      int64_t b0, b1;
      share(cdiv(I, 16), tid, n_threads, &b0, &b1);
      const int64_t c1 = b1 * 16 < I ? b1 * 16 : I;
      if (b0 * 16 < c1) silu_mul(M->isa, gu, 2 * I, T, I, b0 * 16, c1, act, dt);
    });
    linear(M, &Ly->down, T, act, I, o, Hd, am, nt);
    add_round_row(M->isa, x, o, (int64_t)T * Hd, dt);
  }
  return 0;
}
