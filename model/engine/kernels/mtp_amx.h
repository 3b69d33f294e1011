// Part of mtp_kernels.cpp, included once into that one translation unit: the AMX tile path (and its software emulation).
// ------------------------------------------------------------------------------------------------ AMX
// LAYOUT_BF16_TILES is the layout of AMX B tiles: a block of 16 columns holds, for pair j, the 16 columns'
// pairs in 64 bytes ([j][c][2]), its steps one after another, so 16 consecutive pairs are one 16 x 64-byte tile
// at stride 64 (1 KB in a row). mk_amx also reads LAYOUT_BF16_PAIRS (stride 128), which the self-check runs. The
// activations as bf16 pairs ([T][k2] uint32) are A tiles: up to 16 rows x 16 pairs at stride ldxp * 4.
// tdpbf16ps adds, for each element, its pairs in order: C[m][n] += a[2p] b[2p] then += a[2p+1] b[2p+1], each
// accumulation rounded to nearest even, denormals flushed (Intel SDM). So an element's sum depends on its own
// row and column only, never on how many rows the tile holds: rows stay exact at every width.
// Tiles: 0-3 the accumulators of 4 column blocks (M rows), 4 the activations (M rows), 5 and 6 weights.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

#if defined(MTP_AMX_EMULATE)
// The tile instructions in plain C++, with the checks the hardware makes (a shape it would fault on aborts
// with a message). Same data movement and the same per-element order and rounding as the SDM describes.
struct EmuTile { int rows, colsb; uint8_t b[16][64]; };
static thread_local EmuTile emu_tile[8];
static thread_local bool emu_on = false;
static void emu_fail(const char* what) {
  fprintf(stderr, "mtp kernels: AMX emulation: %s\n", what);
  abort();
}
TGT512 static inline float emu_flush(float f) {  // denormals to zero, as tdpbf16ps treats inputs and results
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  memcpy(&f, &u, 4);
  return f;
}
static void emu_config(const TileConfig* c) {
  if (c->palette != 1) emu_fail("palette must be 1");
  for (int i = 0; i < 8; i++) {
    if (c->rows[i] > 16 || c->colsb[i] > 64 || (c->colsb[i] & 3)) emu_fail("tile shape out of range");
    emu_tile[i].rows = c->rows[i];
    emu_tile[i].colsb = c->colsb[i];
    memset(emu_tile[i].b, 0, sizeof emu_tile[i].b);
  }
  emu_on = true;
}
static EmuTile& emu_get(int t) {
  if (!emu_on) emu_fail("tile used without a configuration");
  if (emu_tile[t].rows == 0) emu_fail("tile not configured");
  return emu_tile[t];
}
static void emu_load(int t, const void* p, int64_t stride) {
  EmuTile& e = emu_get(t);
  for (int r = 0; r < e.rows; r++) memcpy(e.b[r], (const uint8_t*)p + r * stride, e.colsb);
}
static void emu_store(int t, void* p, int64_t stride) {
  EmuTile& e = emu_get(t);
  for (int r = 0; r < e.rows; r++) memcpy((uint8_t*)p + r * stride, e.b[r], e.colsb);
}
static void emu_zero(int t) { memset(emu_get(t).b, 0, sizeof emu_tile[t].b); }
TGT512 static void emu_dpbf16ps(int tc, int ta, int tb) {
  EmuTile &c = emu_get(tc), &a = emu_get(ta), &b = emu_get(tb);
  if (c.rows != a.rows || a.colsb / 4 != b.rows || c.colsb != b.colsb) emu_fail("tdpbf16ps: tile shapes disagree");
  for (int m = 0; m < c.rows; m++)
    for (int k = 0; k < a.colsb / 4; k++)
      for (int n = 0; n < c.colsb / 4; n++) {
        float acc;
        memcpy(&acc, c.b[m] + 4 * n, 4);
        uint16_t av[2], bv[2];
        memcpy(av, a.b[m] + 4 * k, 4);
        memcpy(bv, b.b[k] + 4 * n, 4);
        for (int e = 0; e < 2; e++) acc = emu_flush(acc + emu_flush(bf16_to_f32(av[e])) * emu_flush(bf16_to_f32(bv[e])));
        memcpy(c.b[m] + 4 * n, &acc, 4);
      }
}
#define AMX_CONFIG(c) emu_config(c)
#define AMX_RELEASE() (emu_on = false)
#define AMX_ZERO(t) emu_zero(t)
#define AMX_LOAD(t, p, s) emu_load(t, p, s)
#define AMX_STORE(t, p, s) emu_store(t, p, s)
#define AMX_DP(c, a, b) emu_dpbf16ps(c, a, b)
#define MTP_AMX_BUILT 1
#elif (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
// GCC's tileloadd is an asm statement that does not tell the compiler it reads memory: a compiler barrier first.
// GCC's _tile_loadconfig (12.2) tells it that ldtilecfg reads 8 of the configuration's 64 bytes, so it may drop
// the stores of the rows and column widths: a variant of amx_configure that set them conditionally ran into
// tilezero unconfigured (SIGILL). Our ldtilecfg names the whole structure as its operand.
#define AMX_CONFIG(c) __asm__ volatile("ldtilecfg %0" ::"m"(*(const TileConfig*)(c)))
#define AMX_RELEASE() _tile_release()
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, s)                \
  do {                                   \
    __asm__ volatile("" ::: "memory");   \
    _tile_loadd(t, p, s);                \
  } while (0)
#define AMX_STORE(t, p, s) _tile_stored(t, p, s)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define MTP_AMX_BUILT 1
#else
#define MTP_AMX_BUILT 0
#endif

// 1: this library has the AMX path (real or emulated), 2: emulated, 0: the compiler could not build it.
extern "C" int32_t mtp_amx_built(void) {
#if defined(MTP_AMX_EMULATE)
  return 2;
#else
  return MTP_AMX_BUILT;
#endif
}

// Ask Linux for the AMX tile state (once per process, every thread); 0 on success, else errno.
extern "C" int32_t mtp_amx_init(void) {
#if defined(MTP_AMX_EMULATE)
  return 0;
#elif MTP_AMX_BUILT && defined(SYS_arch_prctl)
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return errno ? errno : -1;
  return 0;
#else
  return ENOSYS;
#endif
}

// Column blocks of the packed weight: its n columns, and the adapter's A after them when packed inside it.
static inline int64_t packed_blocks(const mtp_linear* L) {
  return cdiv(L->n, 16) + (L->lora_a_in_w ? cdiv(L->rank, 16) : 0);
}

// Continue the sums of V column blocks for M rows over pairs [j0, k2) with vdpbf16ps (pair tails of k2 that
// is not a multiple of 16): each element's order stays pair by pair. Block v's step j at w[v] + j * js[v].
TGT512 static void amx_tail(const uint16_t* const* w, const int64_t* js, int64_t k2, int64_t j0, const uint32_t* x,
                            int64_t ldx, int M, int V, float* out, int64_t ldo) {
  for (int r = 0; r < M; r++)
    for (int v = 0; v < V; v++) {
      __m512 acc = _mm512_loadu_ps(out + r * ldo + v * 16);
      for (int64_t j = j0; j < k2; j++) {
        const __m512i wv = _mm512_loadu_si512((const void*)(w[v] + j * js[v]));
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x[r * ldx + j]), (__m512bh)wv);
      }
      _mm512_storeu_ps(out + r * ldo + v * 16, acc);
    }
}

// A bf16 model's logits straight out of the tiles (the head's epilogue, run in amx_blocks): column c of row t
// becomes yb[t, c] = (sum (+ bias[c])) rounded to bf16, element-wise, so the bits of rounding a stored float32 sum
// afterwards, without writing and reading back 4 bytes per logit (49,152 a row). Only the head does this: the
// layers' projections, rounded this way as each tile came out, measured 2-3% slower at 4-16 rows (a tile's
// stores read back at once) than rounded by columns after the sweep (mtp_threads.h, linear).
struct Epilogue {
  uint16_t* yb;
  int64_t ldy, n;  // n columns
  const float* bias;
};

// The M x 16 sums of column block b at src (row stride lds) through the epilogue (16 lanes, the last block's
// columns beyond n masked off).
TGT512 static void amx_epilogue(const Epilogue* ep, int M, int64_t row0, int64_t b, const float* src, int64_t lds) {
  const int64_t c0 = b * 16, cols = ep->n - c0 < 16 ? ep->n - c0 : 16;
  const __mmask16 k = (__mmask16)((1u << cols) - 1);
  const __m512 bias = ep->bias ? _mm512_maskz_loadu_ps(k, ep->bias + c0) : _mm512_setzero_ps();
  for (int r = 0; r < M; r++) {
    __m512 v = _mm512_loadu_ps(src + r * lds);
    if (ep->bias) v = _mm512_add_ps(v, bias);
    _mm256_mask_storeu_epi16(ep->yb + (row0 + r) * ep->ldy + c0, k,
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits16(v), 16)));
  }
}

#if MTP_AMX_BUILT
// Tile shapes for M rows: accumulators and activations M x 64 bytes, weights 16 x 64 bytes.
TGTAMX static void amx_configure(int M) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 5; i++) { c.rows[i] = (uint8_t)M; c.colsb[i] = 64; }
  for (int i = 5; i < 7; i++) { c.rows[i] = 16; c.colsb[i] = 64; }
  AMX_CONFIG(&c);
}

// V (1-4) column blocks for the configured M rows: out[m, v * 16 + c] = sum over pairs of x[m] . w[v][c]. Block
// v's step j at w[v] + j * js[v] (pair_block): a weight tile's 16 rows are 16 steps, js[v] * 2 bytes apart.
template <int V>
TGTAMX static void mk_amx(const uint16_t* const* w, const int64_t* js, int64_t k2, const uint32_t* x, int64_t ldx,
                          float* out, int64_t ldo) {
  const int64_t kfull = k2 / 16 * 16;
  AMX_ZERO(0);
  if (V > 1) AMX_ZERO(1);
  if (V > 2) AMX_ZERO(2);
  if (V > 3) AMX_ZERO(3);
  for (int64_t j = 0; j < kfull; j += 16) {
    AMX_LOAD(4, x + j, ldx * 4);
    AMX_LOAD(5, w[0] + j * js[0], js[0] * 2);
    if (V > 1) AMX_LOAD(6, w[1] + j * js[1], js[1] * 2);
    AMX_DP(0, 4, 5);
    if (V > 2) AMX_LOAD(5, w[2] + j * js[2], js[2] * 2);
    if (V > 1) AMX_DP(1, 4, 6);
    if (V > 3) AMX_LOAD(6, w[3] + j * js[3], js[3] * 2);
    if (V > 2) AMX_DP(2, 4, 5);
    if (V > 3) AMX_DP(3, 4, 6);
  }
  AMX_STORE(0, out, ldo * 4);
  if (V > 1) AMX_STORE(1, out + 16, ldo * 4);
  if (V > 2) AMX_STORE(2, out + 32, ldo * 4);
  if (V > 3) AMX_STORE(3, out + 48, ldo * 4);
}

// Column blocks [b0, b1) of a LAYOUT_BF16_TILES weight for T rows: full groups of 16 rows first (one tile
// configuration; each column group of AMX_GROUP blocks goes through all of them while its weights are in cache),
// then the remaining rows. Two blocks a group (two streams of 1 KB tiles) read SmolLM2 faster than four: a pass
// of 1 real + 3 masks 23.9 against 24.5 ms, one token 20.5 against 21.4 (one thread, Intel Xeon with AMX).
static const int AMX_GROUP = 2;  // 1 or 2: a shorter last group is one block
// With an epilogue (ep), each group's sums go through a small buffer of its own into ep's output (out unused).
TGTAMX static void amx_blocks(const mtp_linear* L, int T, const uint32_t* xp, int64_t ldxp, float* out, int64_t ldo,
                              int64_t b0, int64_t b1, const Epilogue* ep) {
  alignas(64) float sums[16 * 16 * AMX_GROUP];
  const int64_t k2 = cdiv(L->k, 2), kfull = k2 / 16 * 16, nbp = packed_blocks(L);
  const int full = T / 16, rest = T % 16;
  for (int pass = 0; pass < 2; pass++) {
    const int M = pass == 0 ? 16 : rest, g0 = pass == 0 ? 0 : full, g1 = pass == 0 ? full : full + 1;
    if (M == 0 || g0 == g1) continue;
    amx_configure(M);
    for (int64_t b = b0; b < b1; b += AMX_GROUP) {
      const int V = (int)((b1 - b) < AMX_GROUP ? (b1 - b) : AMX_GROUP);
      const uint16_t* w[AMX_GROUP];
      int64_t js[AMX_GROUP];
      for (int v = 0; v < V; v++) w[v] = pair_block(L->w, L->layout, k2, nbp, b + v, &js[v]);
      for (int g = g0; g < g1; g++) {
        const uint32_t* x = xp + (int64_t)g * 16 * ldxp;
        float* o = ep ? sums : out + (int64_t)g * 16 * ldo + b * 16;
        const int64_t lo = ep ? 16 * AMX_GROUP : ldo;
        if (V == AMX_GROUP) mk_amx<AMX_GROUP>(w, js, k2, x, ldxp, o, lo);
        else mk_amx<1>(w, js, k2, x, ldxp, o, lo);  // the last block of an odd count
        if (kfull < k2) amx_tail(w, js, k2, kfull, x, ldxp, M, V, o, lo);
        if (ep)
          for (int v = 0; v < V; v++) amx_epilogue(ep, M, (int64_t)g * 16, b + v, sums + v * 16, lo);
      }
    }
  }
  AMX_RELEASE();
}
#else
static void amx_blocks(const mtp_linear*, int, const uint32_t*, int64_t, float*, int64_t, int64_t, int64_t,
                       const Epilogue*) {
  abort();
}
#endif

// LAYOUT_BF16_PAIRS on the zmm path: each pair of blocks (pair_block) swept once per group of up to 8 rows
// (groups split evenly: 16 rows are 8 + 8, 7 rows one group). Prefetches (prefetcht1), by rows a group:
// - 1 row: none; the hardware prefetcher alone keeps the one stream fed.
// - 2-5 rows: the next step's lines of the same stream, so that the step's arithmetic does not hold back the
//   stream's reads (1 + 3 masks 1.30-1.33x -> 1.21-1.23x a one-token pass at one thread on a Zen 4, builds
//   alternated three times; at two threads 1.15-1.18x either way). The next pair's lines instead made 1-4 rows
//   1.1-1.2x slower.
// - 6-8 rows: the next pair's lines, on one thread, and with two threads only when the pair is swept by two
//   row groups: the arithmetic per step is long enough for them (docs/DESIGN.md).
TGT512 static void pair_blocks(const mtp_linear* L, int T, const uint32_t* xp, int64_t ldxp, float* out, int64_t ldo,
                               int64_t b0, int64_t b1, int nt) {
  const int64_t k2 = cdiv(L->k, 2), nbp = packed_blocks(L);
  const int groups = (T + 7) / 8;
  const bool prefetch_next_pair = (T + groups - 1) / groups >= 6 && (nt == 1 || groups > 1);
  for (int64_t b = b0; b < b1;) {
    int64_t js;
    const uint16_t* w = pair_block(L->w, L->layout, k2, nbp, b, &js);
    const int V = (b % 2 == 0 && b + 1 < b1 && js == 64) ? 2 : 1;
    for (int g = 0, t = 0, R = 0; g < groups; g++, t += R) {
      R = (T - t + (groups - g) - 1) / (groups - g);
      const uint32_t* xg = xp + t * ldxp;
      float* og = out + t * ldo + b * 16;
      if (prefetch_next_pair) mk_512_pairs<PF_NEXT_PAIR>(R, V, w, js, k2, xg, ldxp, og, ldo);
      else if (R >= 2 && R <= 5) mk_512_pairs<PF_NEXT_STEP>(R, V, w, js, k2, xg, ldxp, og, ldo);
      else mk_512_pairs<PF_NONE>(R, V, w, js, k2, xg, ldxp, og, ldo);
    }
    b += V;
  }
}

// Column blocks [b0, b1) for all T rows, on the calling thread (one of nt threads sharing the sweep). With ep
// (the AMX path only: gemm_has_epilogue), the columns go through it instead of into out.
static inline bool gemm_has_epilogue(const mtp_linear* L, int isa) { return isa == ISA_AMX && is_pair_layout(L->layout); }
static void gemm_blocks(const mtp_linear* L, int isa, int T, const float* x, int64_t ldx, const uint32_t* xp,
                        int64_t ldxp, float* out, int64_t ldo, int64_t b0, int64_t b1, int nt,
                        const Epilogue* ep = nullptr) {
  const int64_t k = L->k;
  int vmax, rmax;
  if (is_pair_layout(L->layout)) {
    if (isa == ISA_AMX) amx_blocks(L, T, xp, ldxp, out, ldo, b0, b1, ep);
    else pair_blocks(L, T, xp, ldxp, out, ldo, b0, b1, nt);
    return;
  }
  const bool zmm = isa >= ISA_AVX512BF16;  // else AVX2
  // Float32 weights on the zmm path (32 registers, DISPATCH_RV8): a decode pass of 2-8 rows streams one column
  // panel at a time (V = 1: one sequential read of the weight, R accumulator chains), where four panels side by
  // side are four interleaved streams (measured on bf16 panels before the pair layout: a 4-row pass of SmolLM2's
  // layers 1.05-1.11x a one-row pass that way, 0.99-1.03x this way, one thread, Zen 4). One row keeps four
  // panels (its single chain would wait on the multiply-add's latency); a wider pass is bound by arithmetic and
  // keeps the registers' reuse. The adapter's B (LAYOUT_BF16, a few hundred KB read from cache) keeps its
  // blocking.
  if (zmm && T >= 2 && T <= 8 && L->layout != LAYOUT_BF16) { rmax = 8; vmax = 1; }
  else if (zmm) { rmax = T <= 6 ? 6 : 8; vmax = rmax <= 6 ? 4 : 3; }
  else if (T <= 1) { vmax = 3; rmax = 1; }  // AVX2: 16 ymm registers (DISPATCH_AVX2)
  else if (T <= 3) { vmax = 2; rmax = 3; }  // mk_avx2_v2: 2 blocks, twice the chains of one
  else { vmax = 1; rmax = 6; }  // 8-12 chains keep the FMA units busy with one block
  // Rows in as few groups as rmax allows, split evenly (7 rows: 4 + 3, not 6 + 1): a small group's few
  // accumulator chains wait on the multiply-add's latency, so a trailing 1-row group cost nearly a whole sweep.
  const int groups = (T + rmax - 1) / rmax;
  for (int64_t b = b0; b < b1; b += vmax) {
    int V = (int)((b1 - b) < vmax ? (b1 - b) : vmax);
    for (int g = 0, t = 0, R = 0; g < groups; g++, t += R) {
      R = (T - t + (groups - g) - 1) / (groups - g);
      float* o = out + t * ldo + b * 16;
      if (isa >= ISA_AVX512BF16 && L->layout == LAYOUT_F32) {
        const void* w = (const float*)L->w + b * k * 16;
        DISPATCH_RV8(mk_512_f32, w, k, x + t * ldx, ldx, o, ldo)
      } else if (zmm) {  // LAYOUT_BF16 on an AVX512 CPU: the adapter's B
        const void* w = (const uint16_t*)L->w + b * k * 16;
        DISPATCH_RV8(mk_512_bf16w, w, k, x + t * ldx, ldx, o, ldo)
      } else if (L->layout == LAYOUT_F32) {
        const void* w = (const float*)L->w + b * k * 16;
        DISPATCH_AVX2(mk_avx2_f32, w, k, x + t * ldx, ldx, o, ldo)
      } else {
        const void* w = (const uint16_t*)L->w + b * k * 16;
        DISPATCH_AVX2(mk_avx2_bf16, w, k, x + t * ldx, ldx, o, ldo)
      }
    }
  }
}
