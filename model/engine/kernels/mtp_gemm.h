// Part of mtp_kernels.cpp, included once into that one translation unit: the projections' micro-kernels and their dispatch (AVX2, AVX512F, AVX512-BF16).
// ------------------------------------------------------------------------------------------------ GEMM
// out[t, n] = sum_k x[t, k] w[n, k] for rows t < T, columns of blocks [b0, b1) of 16; out has row stride ldo
// (>= 16 * nb). Every element: one accumulator, k in increasing order (pairs of k for vdpbf16ps).

// Each micro-kernel streams V column panels for its rows and meanwhile asks for the same lines of the next V
// panels into L2 (prefetcht1), so the next column group's weights arrive while this one computes: memory and
// arithmetic overlap (SmolLM2 bf16, one thread: 5% faster at 1 row, 10% at 4, 15-30% at 8-16; a prefetch into
// L1, or a fixed distance ahead in the same panel, was slower). Prefetches past the weight are harmless.
static inline void prefetch_next(const void* w, int elem_bytes, int64_t at) {
  _mm_prefetch((const char*)w + at * elem_bytes, _MM_HINT_T1);
}

// AVX2, weights LAYOUT_F32 or LAYOUT_BF16, x float32 [T, ldx]. V blocks of 16 columns, R rows.
template <int R, int V, bool BF16>
TGT2 static void mk_avx2(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 acc[R][V][2];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v][0] = acc[r][v][1] = _mm256_setzero_ps();
  const int64_t panel = k * 16;
  for (int64_t j = 0; j < k; j++) {
    __m256 wl[V], wh[V];
    for (int v = 0; v < V; v++) {
      prefetch_next(w, BF16 ? 2 : 4, (V + v) * panel + j * 16);
      if (BF16) {  // columns 0-7 in the low halves of the 32-bit slots, 8-15 in the high halves
        const __m256i p = _mm256_loadu_si256((const __m256i*)((const uint16_t*)w + v * panel + j * 16));
        wl[v] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
        wh[v] = _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32((int)0xffff0000u)));
      } else {
        const float* p = (const float*)w + v * panel + j * 16;
        wl[v] = _mm256_loadu_ps(p);
        wh[v] = _mm256_loadu_ps(p + 8);
      }
    }
    for (int r = 0; r < R; r++) {
      __m256 xb = _mm256_broadcast_ss(x + r * ldx + j);
      for (int v = 0; v < V; v++) {
        acc[r][v][0] = _mm256_fmadd_ps(xb, wl[v], acc[r][v][0]);
        acc[r][v][1] = _mm256_fmadd_ps(xb, wh[v], acc[r][v][1]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) {
      _mm256_storeu_ps(out + r * ldo + v * 16, acc[r][v][0]);
      _mm256_storeu_ps(out + r * ldo + v * 16 + 8, acc[r][v][1]);
    }
}

// AVX512F, weights LAYOUT_F32, x float32.
template <int R, int V>
TGT512 static void mk_512_f32(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m512 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
  const int64_t panel = k * 16;
  for (int64_t j = 0; j < k; j++) {
    __m512 wv[V];
    for (int v = 0; v < V; v++) {
      prefetch_next(w, 4, (V + v) * panel + j * 16);
      wv[v] = _mm512_loadu_ps((const float*)w + v * panel + j * 16);
    }
    for (int r = 0; r < R; r++) {
      __m512 xb = _mm512_set1_ps(x[r * ldx + j]);
      for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm512_storeu_ps(out + r * ldo + v * 16, acc[r][v]);
}

// AVX512-BF16, weights LAYOUT_BF16_PAIRS, x bf16 pairs [T, ldx] (uint32 = two bf16). V (1 or 2) blocks of one
// pair (pair_block: block v's step j at w + j * js + v * 32). PF: also ask for lines into L2 (prefetcht1):
// PF_NEXT_PAIR the next pair's, PF_NEXT_STEP the next step's of this stream (pair_blocks says when each pays).
enum { PF_NONE = 0, PF_NEXT_PAIR = 1, PF_NEXT_STEP = 2 };
template <int R, int V, int PF>
TGT512 static void mk_512_bf16(const uint16_t* w, int64_t js, int64_t k2, const uint32_t* x, int64_t ldx, float* out,
                               int64_t ldo) {
  __m512 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
  const int64_t next = PF == PF_NEXT_STEP ? js : k2 * js;
  for (int64_t j = 0; j < k2; j++) {
    __m512i wv[V];
    for (int v = 0; v < V; v++) {
      if (PF != PF_NONE) prefetch_next(w, 2, next + j * js + v * 32);
      wv[v] = _mm512_loadu_si512((const void*)(w + j * js + v * 32));
    }
    for (int r = 0; r < R; r++) {
      __m512i xb = _mm512_set1_epi32((int)x[r * ldx + j]);
      for (int v = 0; v < V; v++)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)xb, (__m512bh)wv[v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm512_storeu_ps(out + r * ldo + v * 16, acc[r][v]);
}

// mk_512_bf16 for R (1-8) rows and V (1-2) blocks.
template <int PF>
TGT512 static void mk_512_pairs(int R, int V, const uint16_t* w, int64_t js, int64_t k2, const uint32_t* x,
                                int64_t ldx, float* out, int64_t ldo) {
#define MTP_PAIRS_CASE(RR)                                                              \
  case RR * 8 + 1: mk_512_bf16<RR, 1, PF>(w, js, k2, x, ldx, out, ldo); break;          \
  case RR * 8 + 2: mk_512_bf16<RR, 2, PF>(w, js, k2, x, ldx, out, ldo); break;
  switch (R * 8 + V) {
    MTP_PAIRS_CASE(1) MTP_PAIRS_CASE(2) MTP_PAIRS_CASE(3) MTP_PAIRS_CASE(4)
    MTP_PAIRS_CASE(5) MTP_PAIRS_CASE(6) MTP_PAIRS_CASE(7) MTP_PAIRS_CASE(8)
    default: break;
  }
#undef MTP_PAIRS_CASE
}

// AVX512F, weights LAYOUT_BF16 (the AVX2 packing: a step's 16 bf16 hold columns 0-7 in the low halves of eight
// 32-bit slots and 8-15 in the high halves), x float32. The adapter's B on the AVX512 and AMX paths (u stays
// float32). A step widens into one zmm whose lanes hold columns 0, 8, 1, 9, ..., 7, 15 (zero-extend, shift); the
// fused multiply-adds are mk_avx2's, in its order, so every element's bits are that kernel's; the lanes go back
// to column order at the store. Up to 8 rows and 4 column blocks per call, where the AVX2 kernel has registers
// for one block of up to 6 rows.
template <int R, int V>
TGT512 static void mk_512_bf16w(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m512 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
  const int64_t panel = k * 16;
  const uint16_t* wp = (const uint16_t*)w;
  for (int64_t j = 0; j < k; j++) {
    __m512 wv[V];
    for (int v = 0; v < V; v++) {
      prefetch_next(w, 2, (V + v) * panel + j * 16);
      const __m256i p = _mm256_loadu_si256((const __m256i*)(wp + v * panel + j * 16));
      wv[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(p), 16));
    }
    for (int r = 0; r < R; r++) {
      __m512 xb = _mm512_set1_ps(x[r * ldx + j]);
      for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm512_storeu_ps(out + r * ldo + v * 16, _mm512_permutexvar_ps(order, acc[r][v]));
}

// One (row group, column group) tile through the micro-kernel that fits; R, V only change which registers
// hold which accumulators, never an element's order.
#define DISPATCH_RV(FN, RMAX, ...)                                                    \
  switch (R * 8 + V) {                                                                \
    case 1 * 8 + 1: FN<1, 1>(__VA_ARGS__); break;                                     \
    case 1 * 8 + 2: FN<1, 2>(__VA_ARGS__); break;                                     \
    case 1 * 8 + 3: FN<1, 3>(__VA_ARGS__); break;                                     \
    case 1 * 8 + 4: FN<1, 4>(__VA_ARGS__); break;                                     \
    case 2 * 8 + 1: FN<2, 1>(__VA_ARGS__); break;                                     \
    case 2 * 8 + 2: FN<2, 2>(__VA_ARGS__); break;                                     \
    case 2 * 8 + 3: FN<2, 3>(__VA_ARGS__); break;                                     \
    case 2 * 8 + 4: FN<2, 4>(__VA_ARGS__); break;                                     \
    case 3 * 8 + 1: FN<3, 1>(__VA_ARGS__); break;                                     \
    case 3 * 8 + 2: FN<3, 2>(__VA_ARGS__); break;                                     \
    case 3 * 8 + 3: FN<3, 3>(__VA_ARGS__); break;                                     \
    case 3 * 8 + 4: FN<3, 4>(__VA_ARGS__); break;                                     \
    case 4 * 8 + 1: FN<4, 1>(__VA_ARGS__); break;                                     \
    case 4 * 8 + 2: FN<4, 2>(__VA_ARGS__); break;                                     \
    case 4 * 8 + 3: FN<4, 3>(__VA_ARGS__); break;                                     \
    case 4 * 8 + 4: FN<4, 4>(__VA_ARGS__); break;                                     \
    default: break;                                                                   \
  }

// The zmm micro-kernels (32 registers) also take row groups of 5-8: R x V accumulators + V weight registers + one
// broadcast fit in 32 for V = 4 up to R = 6 and V = 3 up to R = 8. A pass of 5-8 rows (an MTP decode pass: the
// kept tokens plus k_max - 1 masks) then sweeps each weight panel once instead of twice.
#define DISPATCH_RV8(FN, ...)                                                         \
  switch (R * 8 + V) {                                                                \
    case 5 * 8 + 1: FN<5, 1>(__VA_ARGS__); break;                                     \
    case 5 * 8 + 2: FN<5, 2>(__VA_ARGS__); break;                                     \
    case 5 * 8 + 3: FN<5, 3>(__VA_ARGS__); break;                                     \
    case 5 * 8 + 4: FN<5, 4>(__VA_ARGS__); break;                                     \
    case 6 * 8 + 1: FN<6, 1>(__VA_ARGS__); break;                                     \
    case 6 * 8 + 2: FN<6, 2>(__VA_ARGS__); break;                                     \
    case 6 * 8 + 3: FN<6, 3>(__VA_ARGS__); break;                                     \
    case 6 * 8 + 4: FN<6, 4>(__VA_ARGS__); break;                                     \
    case 7 * 8 + 1: FN<7, 1>(__VA_ARGS__); break;                                     \
    case 7 * 8 + 2: FN<7, 2>(__VA_ARGS__); break;                                     \
    case 7 * 8 + 3: FN<7, 3>(__VA_ARGS__); break;                                     \
    case 8 * 8 + 1: FN<8, 1>(__VA_ARGS__); break;                                     \
    case 8 * 8 + 2: FN<8, 2>(__VA_ARGS__); break;                                     \
    case 8 * 8 + 3: FN<8, 3>(__VA_ARGS__); break;                                     \
    default: DISPATCH_RV(FN, 4, __VA_ARGS__)                                          \
  }

// AVX2 row groups of 5-6 (one column block, mk_avx2_v1), else DISPATCH_RV's.
#define DISPATCH_AVX2(FN, ...)                                                        \
  switch (R * 8 + V) {                                                                \
    case 5 * 8 + 1: FN<5, 1>(__VA_ARGS__); break;                                     \
    case 6 * 8 + 1: FN<6, 1>(__VA_ARGS__); break;                                     \
    default: DISPATCH_RV(FN, 4, __VA_ARGS__)                                          \
  }

// AVX2, one block of 16 columns for R (1-6) rows: mk_avx2<R, 1>'s arithmetic in named accumulators. GCC kept
// mk_avx2's accumulator arrays in registers but also stored them to the stack on every step for R >= 3 (a
// 4-row product took twice a 2-row one); named variables stay in registers. Six rows: 12 accumulators, two
// weight halves and a broadcast, 15 of the 16 ymm registers.
template <int R, bool BF16>
TGT2 static void mk_avx2_v1(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0, h4 = l0,
         l5 = l0, h5 = l0;
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  for (int64_t j = 0; j < k; j++) {
    __m256 wl, wh;
    prefetch_next(w, BF16 ? 2 : 4, k * 16 + j * 16);
    if (BF16) {
      const __m256i p = _mm256_loadu_si256((const __m256i*)((const uint16_t*)w + j * 16));
      wl = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
      wh = _mm256_castsi256_ps(_mm256_and_si256(p, high));
    } else {
      wl = _mm256_loadu_ps((const float*)w + j * 16);
      wh = _mm256_loadu_ps((const float*)w + j * 16 + 8);
    }
    __m256 xb = _mm256_set1_ps(x[j]);
    l0 = _mm256_fmadd_ps(xb, wl, l0);
    h0 = _mm256_fmadd_ps(xb, wh, h0);
    if (R > 1) {
      xb = _mm256_set1_ps(x[ldx + j]);
      l1 = _mm256_fmadd_ps(xb, wl, l1);
      h1 = _mm256_fmadd_ps(xb, wh, h1);
    }
    if (R > 2) {
      xb = _mm256_set1_ps(x[2 * ldx + j]);
      l2 = _mm256_fmadd_ps(xb, wl, l2);
      h2 = _mm256_fmadd_ps(xb, wh, h2);
    }
    if (R > 3) {
      xb = _mm256_set1_ps(x[3 * ldx + j]);
      l3 = _mm256_fmadd_ps(xb, wl, l3);
      h3 = _mm256_fmadd_ps(xb, wh, h3);
    }
    if (R > 4) {
      xb = _mm256_set1_ps(x[4 * ldx + j]);
      l4 = _mm256_fmadd_ps(xb, wl, l4);
      h4 = _mm256_fmadd_ps(xb, wh, h4);
    }
    if (R > 5) {
      xb = _mm256_set1_ps(x[5 * ldx + j]);
      l5 = _mm256_fmadd_ps(xb, wl, l5);
      h5 = _mm256_fmadd_ps(xb, wh, h5);
    }
  }
  _mm256_storeu_ps(out, l0);
  _mm256_storeu_ps(out + 8, h0);
  if (R > 1) { _mm256_storeu_ps(out + ldo, l1); _mm256_storeu_ps(out + ldo + 8, h1); }
  if (R > 2) { _mm256_storeu_ps(out + 2 * ldo, l2); _mm256_storeu_ps(out + 2 * ldo + 8, h2); }
  if (R > 3) { _mm256_storeu_ps(out + 3 * ldo, l3); _mm256_storeu_ps(out + 3 * ldo + 8, h3); }
  if (R > 4) { _mm256_storeu_ps(out + 4 * ldo, l4); _mm256_storeu_ps(out + 4 * ldo + 8, h4); }
  if (R > 5) { _mm256_storeu_ps(out + 5 * ldo, l5); _mm256_storeu_ps(out + 5 * ldo + 8, h5); }
}

// Half h (0: columns 0-7, 1: 8-15) of block v's step j as 8 floats (bf16 widened: the packing's low or high halves).
template <bool BF16>
TGT2 static inline __m256 avx2_half(const void* w, int64_t at, int h) {
  if (!BF16) return _mm256_loadu_ps((const float*)w + at + 8 * h);
  const __m256i p = _mm256_loadu_si256((const __m256i*)((const uint16_t*)w + at));
  return _mm256_castsi256_ps(h ? _mm256_and_si256(p, _mm256_set1_epi32((int)0xffff0000u)) : _mm256_slli_epi32(p, 16));
}

// AVX2, two blocks of 16 columns for R (1-3) rows: mk_avx2<R, 2>'s arithmetic (so the same bits) in named
// accumulators. Each accumulator gets one multiply-add a step, so a kernel with C accumulators runs at most C
// multiply-adds per FMA latency (4 cycles on Zen 3): mk_avx2_v1's 2 or 3 rows (4 or 6 chains) waited on that
// latency, at half the rate two blocks give. One weight register (each half loaded, widened and used in turn) and
// x broadcast for every use: 12 accumulators, a weight and a broadcast fit 16 ymm registers without a spill.
// SmolLM2-sized bf16 panels, one thread, a 2-core AMD EPYC (Zen 3, AVX2) VM, read from memory: 2 rows 16.4 -> 18.2
// GB/s, 3 rows 16.8 -> 19.6, against one row's 20.0 (from L2: 20.6 -> 26.6 and 19.9 -> 23.2).
template <int R, bool BF16>
TGT2 static void mk_avx2_v2(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, c0 = a0, c1 = a0,
         c2 = a0, c3 = a0;
  const int64_t panel = k * 16;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx;
  for (int64_t j = 0; j < k; j++) {
    prefetch_next(w, BF16 ? 2 : 4, 2 * panel + j * 16);
    prefetch_next(w, BF16 ? 2 : 4, 3 * panel + j * 16);
#define MTP_V2_HALF(AT, H, A, B, C)                                                   \
    {                                                                                 \
      const __m256 wv = avx2_half<BF16>(w, AT, H);                                    \
      A = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + j), wv, A);                        \
      if (R > 1) B = _mm256_fmadd_ps(_mm256_broadcast_ss(x1 + j), wv, B);             \
      if (R > 2) C = _mm256_fmadd_ps(_mm256_broadcast_ss(x2 + j), wv, C);             \
    }
    MTP_V2_HALF(j * 16, 0, a0, b0, c0)
    MTP_V2_HALF(j * 16, 1, a1, b1, c1)
    MTP_V2_HALF(panel + j * 16, 0, a2, b2, c2)
    MTP_V2_HALF(panel + j * 16, 1, a3, b3, c3)
#undef MTP_V2_HALF
  }
  __m256 acc[3][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {c0, c1, c2, c3}};
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + r * ldo + c * 8, acc[r][c]);
}

// The AVX2 kernel for R rows and V blocks: every choice does mk_avx2's multiply-adds in its order.
template <int R, int V, bool BF16>
TGT2 static void mk_avx2_pick(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  if (V == 1) mk_avx2_v1<R, BF16>(w, k, x, ldx, out, ldo);
  else if (V == 2 && R <= 3) mk_avx2_v2<R, BF16>(w, k, x, ldx, out, ldo);
  else mk_avx2<R, V, BF16>(w, k, x, ldx, out, ldo);
}
template <int R, int V>
TGT2 static void mk_avx2_bf16(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  mk_avx2_pick<R, V, true>(w, k, x, ldx, out, ldo);
}
template <int R, int V>
TGT2 static void mk_avx2_f32(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  mk_avx2_pick<R, V, false>(w, k, x, ldx, out, ldo);
}
