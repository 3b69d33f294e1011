// The CPU forward pass of a Llama-family decoder, one call per pass (see kernels/__init__.py and
// docs/DESIGN.md, "Kernels").
//
// What it guarantees: every output element is computed by one thread in one fixed order that depends on
// nothing but that element's own inputs. A row of a T-row pass therefore has the same bits as a one-row pass
// of the same token after the same KV cache, whatever T, whichever other rows share the pass and however
// many threads run (threads split output columns and (row, head) pairs, never a reduction).
//
// Threads: our own pool (parallel(), below), not OpenMP. libgomp keeps a team per calling thread and, once it
// manages more threads than there are CPUs (a second calling thread, such as a web server's worker, makes a second
// team), stops spinning between regions and sleeps in the kernel after 1000 spins: on 2 cores a pass from a
// worker thread cost twice the same pass from the main thread. One pool serves every calling thread.
//
// Paths (picked by the caller, one per process):
//   ISA_AVX2       : AVX2 + FMA. bf16 weights are widened to float32 in registers (a shift and a mask, no
//                    shuffle: the packing interleaves two 8-column halves); fp32 FMA.
//   ISA_AVX512BF16 : AVX512F/BW/VL + AVX512-BF16. bf16 weights and activations meet in vdpbf16ps (pairs of
//                    products summed into float32); float32 weights use AVX512F FMA.
//   ISA_AMX        : AVX512-BF16 + AMX-BF16. The bf16 projections run on AMX tiles (tdpbf16ps: up to 16 rows x
//                    16 columns x 16 pairs per instruction, each element summed in pair order like vdpbf16ps);
//                    the rest as ISA_AVX512BF16. Built with -DMTP_AMX_EMULATE, the tile instructions are replaced
//                    by plain C++ with the same semantics and checks (for testing this path on a CPU without AMX).
// Attention, norms and element-wise work use AVX2 code on every path.
//
// Numerics follow transformers' eager bf16 / float32 computation step by step (the same roundings to the
// model's dtype after each op that transformers stores in that dtype); the sums inside an op run in our own
// fixed order, so logits differ from transformers' by rounding (docs/DESIGN.md gives the figures).
//
// Built with g++ -O3 -pthread -ffp-contract=off (no fast-math: the compiler may not reorder a sum).

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sys/mman.h>
#include <errno.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <atomic>
#include <mutex>
#include <thread>

#define TGT2 __attribute__((target("avx2,fma,f16c")))
#define TGT512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

#define TGTAMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

enum { ISA_AVX2 = 1, ISA_AVX512BF16 = 2, ISA_AMX = 3 };
enum { LAYOUT_F32 = 0, LAYOUT_BF16 = 1, LAYOUT_BF16_PAIRS = 2 };
enum { DT_F32 = 0, DT_BF16 = 1 };

extern "C" {

// ------------------------------------------------------------------------------------------------ structs
// Mirrored by ctypes in kernels/__init__.py: keep the field order.
typedef struct {
  const void* w;        // packed weight (mtp_pack_weight)
  int32_t n, k;         // output features, input features
  int32_t layout;       // LAYOUT_*
  const float* bias;    // [n] or NULL
  // adapter (LoRA / aLoRA): delta = (x A^T) B^T on the adapter rows, per member without the zero blocks
  int32_t rank;         // sum of the members' ranks (0: no adapter)
  const void* lora_a;   // A of all members stacked, [rank, k] packed as lora_layout
  int32_t members;      // at most 4
  int32_t m_out0[4], m_out1[4], m_r0[4], m_r1[4];  // member j: output columns [out0, out1), ranks [r0, r1)
  const void* m_b[4];   // member j: B * scaling, [out1 - out0, r1 - r0] packed as lora_layout
  int32_t lora_layout;  // LAYOUT_F32, or LAYOUT_BF16 (factors stored in bf16, products in float32)
} mtp_linear;

typedef struct {
  mtp_linear qkv, o, gate_up, down;
  const float* ln1;     // [hidden]
  const float* ln2;     // [hidden]
  const float* q_norm;  // [head_dim] or NULL (Qwen3)
  const float* k_norm;
} mtp_layer;

typedef struct {
  int32_t hidden, heads, kv_heads, head_dim, inter, layers;
  int32_t dtype;        // DT_F32 or DT_BF16: the model's dtype (activations rounded to it as transformers does)
  int32_t isa;          // ISA_*
  float eps, scaling;
  const mtp_layer* layer;
  const float* norm;    // [hidden]
  mtp_linear head;      // lm_head
  mtp_linear head_override;  // peft's trained output rows (n = count, 0: none)
  const int64_t* override_idx;
} mtp_model;

// The sequences of one pass: rows [row0[s], row0[s + 1]) belong to sequence s, which has its own KV cache
// (per layer kcache[s * layers + l]), its own cached length pos[s] and its own visibility among its rows.
typedef struct {
  int32_t nseq;
  const int32_t* row0;             // [nseq + 1]
  void* const* kcache;             // [nseq * layers], each [kv_heads, cap[s], hd] in the dtype
  void* const* vcache;
  const int64_t* cap;              // [nseq]
  const int64_t* pos;              // [nseq]
  const uint8_t* const* visible;   // [nseq]: [T_s, T_s] or NULL (causal)
  const uint8_t* adapter;          // [T]: 1 where the row gets the adapter's delta, or NULL (none)
  const int32_t* keep;             // [nkeep] rows whose logits are returned, in that order
  int32_t nkeep;
} mtp_batch;

}  // extern "C"

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
TGT2 static void bias_round_row(const float* out, const float* bias, float* y, int64_t n, int dtype) {
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
TGT2 static void add_round_row(float* x, const float* o, int64_t n, int dtype) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(x + j, to_dtype8(_mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(o + j)), dtype));
  for (; j < n; j++) x[j] = dtype == DT_BF16 ? round_bf16(x[j] + o[j]) : x[j] + o[j];
}
// d[j] = x[j] as bf16 (round to nearest even).
TGT2 static void to_bf16_row(const float* x, uint16_t* d, int64_t k) {
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m256i a = _mm256_srli_epi32(round_bf16_bits8(_mm256_loadu_ps(x + j)), 16);
    const __m256i b = _mm256_srli_epi32(round_bf16_bits8(_mm256_loadu_ps(x + j + 8)), 16);
    _mm256_storeu_si256((__m256i*)(d + j), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
  }
  for (; j < k; j++) d[j] = f32_to_bf16(x[j]);
}

// ------------------------------------------------------------------------------------------------ memory
extern "C" void* mtp_alloc(int64_t bytes) {
  // 2 MB aligned, asked for huge pages: a pass streams every weight once and 4 KB pages cost ~30% of the
  // read bandwidth here (TLB misses).
  void* p = NULL;
  const int64_t huge = 2 << 20;
  int64_t size = (bytes + huge - 1) / huge * huge;
  if (size == 0) size = huge;
  if (posix_memalign(&p, huge, size) != 0) return NULL;
#ifdef MADV_HUGEPAGE
  madvise(p, size, MADV_HUGEPAGE);
#endif
  memset(p, 0, size);
  return p;
}
extern "C" void mtp_free(void* p) { free(p); }

// ------------------------------------------------------------------------------------------------ packing
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

extern "C" int64_t mtp_packed_bytes(int32_t n, int32_t k, int32_t layout) {
  int64_t nb = cdiv(n, 16);
  if (layout == LAYOUT_F32) return nb * k * 16 * 4;
  if (layout == LAYOUT_BF16) return nb * k * 16 * 2;
  return nb * cdiv(k, 2) * 32 * 2;  // pairs: [nb][k/2][16][2]
}

// src: [n, k] row-major in float32 (src_dtype 0) or bf16 (1). dst: mtp_packed_bytes, zeroed (padding).
extern "C" void mtp_pack_weight(const void* src, int32_t src_dtype, int32_t n, int32_t k, int32_t layout, void* dst) {
  auto get = [&](int64_t i, int64_t j) -> float {
    if (src_dtype == DT_BF16) return bf16_to_f32(((const uint16_t*)src)[i * k + j]);
    return ((const float*)src)[i * k + j];
  };
  auto getraw16 = [&](int64_t i, int64_t j) -> uint16_t {
    if (src_dtype == DT_BF16) return ((const uint16_t*)src)[i * k + j];
    return f32_to_bf16(((const float*)src)[i * k + j]);
  };
  int64_t nb = cdiv(n, 16);
  for (int64_t b = 0; b < nb; b++)
    for (int64_t c = 0; c < 16; c++) {
      int64_t i = b * 16 + c;
      if (i >= n) continue;
      if (layout == LAYOUT_F32) {
        float* d = (float*)dst + b * (int64_t)k * 16;
        for (int64_t j = 0; j < k; j++) d[j * 16 + c] = get(i, j);
      } else if (layout == LAYOUT_BF16) {
        uint16_t* d = (uint16_t*)dst + b * (int64_t)k * 16;  // slot 2c (c < 8) or 2(c - 8) + 1
        const int64_t slot = c < 8 ? 2 * c : 2 * (c - 8) + 1;
        for (int64_t j = 0; j < k; j++) d[j * 16 + slot] = getraw16(i, j);
      } else {
        int64_t k2 = cdiv(k, 2);
        uint16_t* d = (uint16_t*)dst + b * k2 * 32;
        for (int64_t j = 0; j < k; j++) d[(j / 2) * 32 + c * 2 + (j & 1)] = getraw16(i, j);
      }
    }
}

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

// AVX512-BF16, weights LAYOUT_BF16_PAIRS, x bf16 pairs [T, ldx] (uint32 = two bf16).
template <int R, int V>
TGT512 static void mk_512_bf16(const void* w, int64_t k2, const uint32_t* x, int64_t ldx, float* out, int64_t ldo) {
  __m512 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
  const int64_t panel = k2 * 32;
  const uint16_t* wp = (const uint16_t*)w;
  for (int64_t j = 0; j < k2; j++) {
    __m512i wv[V];
    for (int v = 0; v < V; v++) {
      prefetch_next(w, 2, (V + v) * panel + j * 32);
      wv[v] = _mm512_loadu_si512((const void*)(wp + v * panel + j * 32));
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

// AVX2, one block of 16 columns for R (1-4) rows: mk_avx2<R, 1>'s arithmetic in named accumulators. GCC kept
// mk_avx2's accumulator arrays in registers but also stored them to the stack on every step for R >= 3 (a
// 4-row product took twice a 2-row one); named variables stay in registers.
template <int R, bool BF16>
TGT2 static void mk_avx2_v1(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;
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
  }
  _mm256_storeu_ps(out, l0);
  _mm256_storeu_ps(out + 8, h0);
  if (R > 1) { _mm256_storeu_ps(out + ldo, l1); _mm256_storeu_ps(out + ldo + 8, h1); }
  if (R > 2) { _mm256_storeu_ps(out + 2 * ldo, l2); _mm256_storeu_ps(out + 2 * ldo + 8, h2); }
  if (R > 3) { _mm256_storeu_ps(out + 3 * ldo, l3); _mm256_storeu_ps(out + 3 * ldo + 8, h3); }
}

template <int R, int V>
TGT2 static void mk_avx2_bf16(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  if (V == 1) mk_avx2_v1<R, true>(w, k, x, ldx, out, ldo);
  else mk_avx2<R, V, true>(w, k, x, ldx, out, ldo);
}
template <int R, int V>
TGT2 static void mk_avx2_f32(const void* w, int64_t k, const float* x, int64_t ldx, float* out, int64_t ldo) {
  if (V == 1) mk_avx2_v1<R, false>(w, k, x, ldx, out, ldo);
  else mk_avx2<R, V, false>(w, k, x, ldx, out, ldo);
}

// ------------------------------------------------------------------------------------------------ AMX
// LAYOUT_BF16_PAIRS is already the layout of an AMX B tile: a block of 16 columns holds, for pair j, the 16
// columns' pairs in 64 bytes ([j][c][2]), so 16 consecutive pairs are one 16 x 64-byte tile at stride 64. The
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
#define AMX_CONFIG(c) _tile_loadconfig(c)
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

// Continue the sums of V column blocks for M rows over pairs [j0, k2) with vdpbf16ps (pair tails of a k2 that
// is not a multiple of 16): each element's order stays pair by pair.
TGT512 static void amx_tail(const uint16_t* w, int64_t k2, int64_t j0, const uint32_t* x, int64_t ldx, int M, int V,
                            float* out, int64_t ldo) {
  for (int r = 0; r < M; r++)
    for (int v = 0; v < V; v++) {
      __m512 acc = _mm512_loadu_ps(out + r * ldo + v * 16);
      for (int64_t j = j0; j < k2; j++) {
        const __m512i wv = _mm512_loadu_si512((const void*)(w + v * k2 * 32 + j * 32));
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x[r * ldx + j]), (__m512bh)wv);
      }
      _mm512_storeu_ps(out + r * ldo + v * 16, acc);
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

// V (1-4) column blocks for the configured M rows: out[m, v * 16 + c] = sum over pairs of x[m] . w[v][c].
template <int V>
TGTAMX static void mk_amx(const uint16_t* w, int64_t k2, const uint32_t* x, int64_t ldx, float* out, int64_t ldo) {
  const int64_t panel = k2 * 32, kfull = k2 / 16 * 16;
  AMX_ZERO(0);
  if (V > 1) AMX_ZERO(1);
  if (V > 2) AMX_ZERO(2);
  if (V > 3) AMX_ZERO(3);
  for (int64_t j = 0; j < kfull; j += 16) {
    AMX_LOAD(4, x + j, ldx * 4);
    AMX_LOAD(5, w + j * 32, 64);
    if (V > 1) AMX_LOAD(6, w + panel + j * 32, 64);
    AMX_DP(0, 4, 5);
    if (V > 2) AMX_LOAD(5, w + 2 * panel + j * 32, 64);
    if (V > 1) AMX_DP(1, 4, 6);
    if (V > 3) AMX_LOAD(6, w + 3 * panel + j * 32, 64);
    if (V > 2) AMX_DP(2, 4, 5);
    if (V > 3) AMX_DP(3, 4, 6);
  }
  AMX_STORE(0, out, ldo * 4);
  if (V > 1) AMX_STORE(1, out + 16, ldo * 4);
  if (V > 2) AMX_STORE(2, out + 32, ldo * 4);
  if (V > 3) AMX_STORE(3, out + 48, ldo * 4);
}

// Column blocks [b0, b1) of a LAYOUT_BF16_PAIRS weight for T rows: full groups of 16 rows first (one tile
// configuration; each 4-block column group goes through all of them while its weights are in cache), then the
// remaining rows.
TGTAMX static void amx_blocks(const mtp_linear* L, int T, const uint32_t* xp, int64_t ldxp, float* out, int64_t ldo,
                              int64_t b0, int64_t b1) {
  const int64_t k2 = cdiv(L->k, 2), kfull = k2 / 16 * 16;
  const uint16_t* w0 = (const uint16_t*)L->w;
  const int full = T / 16, rest = T % 16;
  for (int pass = 0; pass < 2; pass++) {
    const int M = pass == 0 ? 16 : rest, g0 = pass == 0 ? 0 : full, g1 = pass == 0 ? full : full + 1;
    if (M == 0 || g0 == g1) continue;
    amx_configure(M);
    for (int64_t b = b0; b < b1; b += 4) {
      const int V = (int)((b1 - b) < 4 ? (b1 - b) : 4);
      const uint16_t* w = w0 + b * k2 * 32;
      for (int g = g0; g < g1; g++) {
        const uint32_t* x = xp + (int64_t)g * 16 * ldxp;
        float* o = out + (int64_t)g * 16 * ldo + b * 16;
        switch (V) {
          case 1: mk_amx<1>(w, k2, x, ldxp, o, ldo); break;
          case 2: mk_amx<2>(w, k2, x, ldxp, o, ldo); break;
          case 3: mk_amx<3>(w, k2, x, ldxp, o, ldo); break;
          default: mk_amx<4>(w, k2, x, ldxp, o, ldo); break;
        }
        if (kfull < k2) amx_tail(w, k2, kfull, x, ldxp, M, V, o, ldo);
      }
    }
  }
  AMX_RELEASE();
}
#else
static void amx_blocks(const mtp_linear*, int, const uint32_t*, int64_t, float*, int64_t, int64_t, int64_t) { abort(); }
#endif

// Column blocks [b0, b1) for all T rows, on the calling thread.
static void gemm_blocks(const mtp_linear* L, int isa, int T, const float* x, int64_t ldx, const uint32_t* xp,
                        int64_t ldxp, float* out, int64_t ldo, int64_t b0, int64_t b1) {
  const int64_t k = L->k;
  int vmax, rmax;
  if (isa == ISA_AMX && L->layout == LAYOUT_BF16_PAIRS) {
    amx_blocks(L, T, xp, ldxp, out, ldo, b0, b1);
    return;
  }
  const bool zmm = L->layout == LAYOUT_BF16_PAIRS || (isa >= ISA_AVX512BF16 && L->layout == LAYOUT_F32);
  if (zmm) { vmax = 4; rmax = 4; }  // 32 zmm registers
  else { vmax = T <= 1 ? 3 : 1; rmax = T <= 1 ? 1 : 4; }  // AVX2: 16 ymm registers
  for (int64_t b = b0; b < b1; b += vmax) {
    int V = (int)((b1 - b) < vmax ? (b1 - b) : vmax);
    for (int t = 0; t < T; t += rmax) {
      int R = (T - t) < rmax ? (T - t) : rmax;
      float* o = out + t * ldo + b * 16;
      if (L->layout == LAYOUT_BF16_PAIRS) {
        const void* w = (const uint16_t*)L->w + b * cdiv(k, 2) * 32;
        DISPATCH_RV(mk_512_bf16, 4, w, cdiv(k, 2), xp + t * ldxp, ldxp, o, ldo)
      } else if (isa >= ISA_AVX512BF16 && L->layout == LAYOUT_F32) {
        const void* w = (const float*)L->w + b * k * 16;
        DISPATCH_RV(mk_512_f32, 4, w, k, x + t * ldx, ldx, o, ldo)
      } else if (L->layout == LAYOUT_F32) {
        const void* w = (const float*)L->w + b * k * 16;
        DISPATCH_RV(mk_avx2_f32, 4, w, k, x + t * ldx, ldx, o, ldo)
      } else {
        const void* w = (const uint16_t*)L->w + b * k * 16;
        DISPATCH_RV(mk_avx2_bf16, 4, w, k, x + t * ldx, ldx, o, ldo)
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ threads
// One pool for the process: parallel(nt, f) runs f(tid, nt) for tid = 0 .. nt - 1, tid 0 on the calling thread
// and the others on the pool's workers (created on first need, kept for the life of the process). Regions from
// several calling threads take turns (a mutex). A worker spins for SPIN_NS after its last task, then sleeps on
// a futex: the regions of one pass follow each other within microseconds and find the workers awake; between
// passes they sleep and leave the cores to other work. The partition (share(), tid) alone decides who computes
// what, so results do not depend on the pool.
static const int64_t SPIN_NS = 200000;
static inline int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
struct Pool {
  std::mutex run_lock;                 // one region at a time
  std::atomic<uint32_t> gen{0};        // bumped for each region (the futex word)
  std::atomic<int> pending{0};         // workers still busy with the current region
  std::atomic<int> sleepers{0};
  int workers = 0;
  void (*fn)(void*, int, int) = nullptr;
  void* ctx = nullptr;
  int nt = 1;
};
static Pool* pool() {
  static Pool* p = new Pool();  // never destroyed: the workers outlive static destructors at exit
  return p;
}
static void futex_wait(std::atomic<uint32_t>* a, uint32_t v) {
  syscall(SYS_futex, (uint32_t*)a, FUTEX_WAIT_PRIVATE, v, nullptr, nullptr, 0);
}
static void futex_wake(std::atomic<uint32_t>* a) {
  syscall(SYS_futex, (uint32_t*)a, FUTEX_WAKE_PRIVATE, 0x7fffffff, nullptr, nullptr, 0);
}
static void worker_main(int tid, uint32_t seen) {
  Pool* P = pool();
  for (;;) {
    uint32_t g;
    int64_t t0 = now_ns();
    int spins = 0;
    while ((g = P->gen.load(std::memory_order_acquire)) == seen) {
      if (++spins < 64) { _mm_pause(); continue; }
      spins = 0;
      if (now_ns() - t0 < SPIN_NS) continue;
      P->sleepers.fetch_add(1);
      futex_wait(&P->gen, seen);
      P->sleepers.fetch_sub(1);
      t0 = now_ns();
    }
    seen = g;
    if (tid < P->nt) P->fn(P->ctx, tid, P->nt);
    P->pending.fetch_sub(1, std::memory_order_release);
  }
}
template <class F> static void parallel(int nt, F&& f) {
  if (nt <= 1) {
    f(0, 1);
    return;
  }
  Pool* P = pool();
  std::lock_guard<std::mutex> lock(P->run_lock);
  while (P->workers < nt - 1) {  // a new worker starts at the current generation: it waits for the next region
    std::thread(worker_main, ++P->workers, P->gen.load()).detach();
  }
  typedef typename std::remove_reference<F>::type Fn;
  P->fn = [](void* c, int tid, int n) { (*(Fn*)c)(tid, n); };
  P->ctx = (void*)&f;
  P->nt = nt;
  P->pending.store(P->workers, std::memory_order_relaxed);
  P->gen.fetch_add(1);  // publishes fn, ctx, nt (sequentially consistent, as the sleepers count)
  if (P->sleepers.load() > 0) futex_wake(&P->gen);
  f(0, nt);
  int64_t t0 = now_ns();
  for (int spins = 0; P->pending.load(std::memory_order_acquire) != 0;) {
    _mm_pause();
    if (++spins >= 64) {
      spins = 0;
      if (now_ns() - t0 > SPIN_NS) sched_yield();  // a worker lost its core: let it have ours
    }
  }
}


// Thread tid's share of nb column blocks (contiguous, in multiples of 4 blocks).
static inline void share(int64_t nb, int tid, int nt, int64_t* b0, int64_t* b1) {
  int64_t units = cdiv(nb, 4);
  int64_t per = units / nt, extra = units % nt;
  int64_t u0 = tid * per + (tid < extra ? tid : extra);
  int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
  *b0 = u0 * 4 < nb ? u0 * 4 : nb;
  *b1 = u1 * 4 < nb ? u1 * 4 : nb;
}

// A thread's scratch buffer (grown as needed). A thread's buffers are freed at the end of a pass when together they
// hold more than SCRATCH_KEEP_FLOATS (trim_scratch): a long prefill or scoring pass (T in the thousands, logits
// kept for hundreds of rows) needs ~100-300 MB, which every thread that ever ran one would otherwise keep for
// its life (a web server's worker threads: defect 6). Decoding passes (tens of rows, logits of as many) stay
// under it and keep theirs.
static const int64_t SCRATCH_KEEP_FLOATS = 8 << 20;  // 32 MB per thread
struct Scratch;
static thread_local Scratch* t_scratch = nullptr;  // the calling thread's buffers, a list
struct Scratch {
  float* p = nullptr;
  int64_t n = 0;
  Scratch* next;
  Scratch() : next(t_scratch) { t_scratch = this; }
  float* get(int64_t want) {
    if (want > n) {
      free(p);
      n = want + want / 2 + 64;
      if (posix_memalign((void**)&p, 64, n * sizeof(float)) != 0) p = nullptr;
    }
    return p;
  }
  ~Scratch() { free(p); }
};
static void trim_scratch() {
  int64_t held = 0;
  for (Scratch* s = t_scratch; s; s = s->next) held += s->n;
  if (held <= SCRATCH_KEEP_FLOATS) return;
  for (Scratch* s = t_scratch; s; s = s->next) {
    free(s->p);
    s->p = nullptr;
    s->n = 0;
  }
}

// y[T, n] (row stride ldy) = x[T, k] W^T (+ bias), rounded to the dtype; then the rows where amask is 1 get
// the adapter's delta (peft's order: base result in the dtype + float32 delta, rounded again).
static void linear(const mtp_model* M, const mtp_linear* L, int T, const float* x, int64_t ldx, float* y,
                   int64_t ldy, const uint8_t* amask, int nt) {
  const int64_t n = L->n, k = L->k, nb = cdiv(n, 16), ldo = nb * 16;
  static thread_local Scratch s_out, s_xp, s_u;
  float* out = (ldy == ldo) ? y : s_out.get((int64_t)T * ldo);
  uint32_t* xp = nullptr;
  int64_t ldxp = cdiv(k, 2);
  if (L->layout == LAYOUT_BF16_PAIRS) {  // activations as bf16 pairs (exact: they hold bf16 values)
    xp = (uint32_t*)s_xp.get((int64_t)T * ldxp);
    for (int t = 0; t < T; t++) {
      uint16_t* d = (uint16_t*)(xp + t * ldxp);
      to_bf16_row(x + t * ldx, d, k);
      if (k & 1) d[k] = 0;
    }
  }
  parallel(nt, [&](int tid, int n_threads) {
    int64_t b0, b1;
    share(nb, tid, n_threads, &b0, &b1);
    if (b0 < b1) gemm_blocks(L, M->isa, T, x, ldx, xp, ldxp, out, ldo, b0, b1);
  });
  for (int t = 0; t < T; t++) bias_round_row(out + t * ldo, L->bias, y + t * ldy, n, M->dtype);
  if (!amask || L->rank == 0) return;
  static thread_local Scratch s_rows;
  int arows = 0;
  for (int t = 0; t < T; t++) arows += amask[t] ? 1 : 0;
  if (arows == 0) return;
  // the adapter rows gathered (a copy: the same bits as computing them in place)
  float* xa = s_rows.get((int64_t)arows * k + 1);
  int* rows = (int*)malloc(sizeof(int) * arows);
  for (int t = 0, i = 0; t < T; t++)
    if (amask[t]) { rows[i] = t; memcpy(xa + (int64_t)i * k, x + (int64_t)t * ldx, sizeof(float) * k); i++; }
  // u = x A^T for the adapter rows (float32 u): the same column kernel on A
  mtp_linear A;
  memset(&A, 0, sizeof A);
  A.w = L->lora_a; A.n = L->rank; A.k = L->k; A.layout = L->lora_layout;
  const int64_t nbu = cdiv(L->rank, 16), ldu = nbu * 16;
  float* u = s_u.get((int64_t)arows * ldu);
  parallel(nt, [&](int tid, int n_threads) {
    int64_t b0, b1;
    share(nbu, tid, n_threads, &b0, &b1);
    if (b0 < b1) gemm_blocks(&A, M->isa, arows, xa, k, nullptr, 0, u, ldu, b0, b1);
  });
  // delta[t, j] = sum_r u[t, r] B[j, r] over the member's ranks only (no zero blocks), r in order: the same
  // column kernel on B (packed [out_m, r_m])
  static thread_local Scratch s_d;
  for (int m = 0; m < L->members; m++) {
    const int o0 = L->m_out0[m], om = L->m_out1[m] - o0, r0 = L->m_r0[m], rr = L->m_r1[m] - r0;
    mtp_linear Bm;
    memset(&Bm, 0, sizeof Bm);
    Bm.w = L->m_b[m]; Bm.n = om; Bm.k = rr; Bm.layout = L->lora_layout;
    const int64_t nbm = cdiv(om, 16), ldd = nbm * 16;
    float* d = s_d.get((int64_t)arows * ldd);
    parallel(nt, [&](int tid, int n_threads) {
      int64_t b0, b1;
      share(nbm, tid, n_threads, &b0, &b1);
      if (b0 < b1) gemm_blocks(&Bm, M->isa, arows, u + r0, ldu, nullptr, 0, d, ldd, b0, b1);
    });
    for (int t = 0; t < arows; t++) add_round_row(y + (int64_t)rows[t] * ldy + o0, d + t * ldd, om, M->dtype);
  }
  free(rows);
}

// ------------------------------------------------------------------------------------------------ AVX2 math
// exp on 8 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial); |error| ~1 ulp, lane-wise.
TGT2 static inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504019f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// exp of n floats in place, 8 at a time (a tail is padded: every element goes through the same lanes' code)
TGT2 static void exp_inplace(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
  if (i < n) {
    float tmp[8] = {0};
    for (int64_t j = i; j < n; j++) tmp[j - i] = v[j];
    _mm256_storeu_ps(tmp, exp8(_mm256_loadu_ps(tmp)));
    for (int64_t j = i; j < n; j++) v[j] = tmp[j - i];
  }
}

// Sum of n floats: 8 lanes over the vector body (tail padded with zeros), then the lanes in a fixed order.
TGT2 static float sum_lanes(const float* v, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(v + i));
  float tmp[8] = {0};
  for (int64_t j = i; j < n; j++) tmp[j - i] = v[j];
  acc = _mm256_add_ps(acc, _mm256_loadu_ps(tmp));
  _mm256_storeu_ps(tmp, acc);
  return ((tmp[0] + tmp[1]) + (tmp[2] + tmp[3])) + ((tmp[4] + tmp[5]) + (tmp[6] + tmp[7]));
}

// Dot product of n floats, same shape of sum as sum_lanes.
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

// Scores of q with 8 cached keys at once (offsets off[0..7]), for head_dim a multiple of 8: each key's lanes
// and sums exactly as dot_kv's (its zero tail included), so each score has dot_kv's bits; the 8 horizontal sums
// run as one transpose (hadd pairs lanes as dot_kv's ((0+1)+(2+3))+((4+5)+(6+7)) does).
TGT2 static void dot_kv8(const float* q, const void* kc, int dtype, const int64_t* off, int hd, float* out) {
  __m256 a[8];
  for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
  for (int d = 0; d < hd; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, key8(kc, dtype, off[j] + d), a[j]);
  }
  const __m256 z = _mm256_setzero_ps();
  for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(z, z, a[j]);  // dot_kv's padded tail step
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31)));
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

// o[d] = (sum_i p[i] v_i[d]) * inv rounded to the dtype, for head_dim a multiple of 64: axpy_kv's fused
// multiply-adds in value order, with 64 lanes of the sum held in registers across the values.
TGT2 static void weighted_values(const float* p, int64_t n, const void* vc, int dtype, const int64_t* off, int hd,
                                 float inv, float* o) {
  const __m256 iv = _mm256_set1_ps(inv);
  for (int d0 = 0; d0 < hd; d0 += 64) {
    constexpr int w = 8;
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
      const __m256 pv = _mm256_set1_ps(p[i]);
      for (int c = 0; c < w; c++) acc[c] = _mm256_fmadd_ps(pv, key8(vc, dtype, off[i] + d0 + 8 * c), acc[c]);
    }
    for (int c = 0; c < w; c++) _mm256_storeu_ps(o + d0 + 8 * c, to_dtype8(_mm256_mul_ps(acc[c], iv), dtype));
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

// ------------------------------------------------------------------------------------------------ the pass
static inline void kv_put(void* base, int dtype, int64_t i, float v) {
  if (dtype == DT_BF16) ((uint16_t*)base)[i] = f32_to_bf16(v);
  else ((float*)base)[i] = v;
}

// Attention of query rows [T, heads * hd], each over its own sequence's cache (mtp_batch): row t of sequence
// s (local index u0) sees every entry below pos[s] and entry pos[s] + u where visible[s][u0 * T_s + u] (NULL:
// u <= u0). Each (row, head) is one task: its keys in cache order, its softmax and its weighted sum in a fixed
// order; the result rounded to the dtype.
TGT2 static void attention(const mtp_model* M, int T, const float* q, int64_t ldq, const mtp_batch* B, int layer,
                           const int* row_seq, float* out, int64_t ldout, int nt) {
  const int H = M->heads, hd = M->head_dim, groups = M->heads / M->kv_heads, dtype = M->dtype;
  int64_t L = 0;
  for (int s = 0; s < B->nseq; s++) {
    const int64_t ls = B->pos[s] + B->row0[s + 1] - B->row0[s];
    L = ls > L ? ls : L;
  }
  const int tasks = T * H;
  parallel(nt, [&](int tid, int n_threads) {
    static thread_local Scratch s_sc, s_acc, s_idx;
    float* sc = s_sc.get(L + 8);
    float* acc = s_acc.get(hd + 8);
    int64_t* idx = (int64_t*)s_idx.get(2 * (L + 1));
    const int per = tasks / n_threads, extra = tasks % n_threads;  // static schedule: contiguous tasks
    const int task0 = tid * per + (tid < extra ? tid : extra), task1 = task0 + per + (tid < extra ? 1 : 0);
    for (int task = task0; task < task1; task++) {
      const int t = task / H, h = task % H, g = h / groups, sq = row_seq[t];
      const int r0 = B->row0[sq], Ts = B->row0[sq + 1] - r0, t0 = t - r0;
      const int64_t pos = B->pos[sq], cap = B->cap[sq];
      const uint8_t* visible = B->visible[sq];
      const void* kc = B->kcache[(int64_t)sq * M->layers + layer];
      const void* vc = B->vcache[(int64_t)sq * M->layers + layer];
      const float* qt = q + t * ldq + h * hd;
      int64_t n = 0;
      for (int64_t j = 0; j < pos; j++) idx[n++] = j;
      for (int u = 0; u < Ts; u++)
        if (visible ? visible[t0 * Ts + u] : (u <= t0)) idx[n++] = pos + u;
      const int64_t kbase = (int64_t)g * cap * hd;
      for (int64_t i = 0; i < n; i++) idx[i] = kbase + idx[i] * hd;  // element offsets of the keys / values
      int64_t i8 = 0;
      if (hd % 8 == 0)
        for (; i8 + 8 <= n; i8 += 8) dot_kv8(qt, kc, dtype, idx + i8, hd, sc + i8);
      for (int64_t i = i8; i < n; i++) sc[i] = dot_kv(qt, kc, dtype, idx[i], hd);
      for (int64_t i = 0; i < n; i++) sc[i] *= M->scaling;
      float m = -INFINITY;
      for (int64_t i = 0; i < n; i++) m = sc[i] > m ? sc[i] : m;
      for (int64_t i = 0; i < n; i++) sc[i] -= m;
      exp_inplace(sc, n);
      const float inv = 1.0f / sum_lanes(sc, n);
      float* o = out + t * ldout + h * hd;
      if (hd % 64 == 0) {
        weighted_values(sc, n, vc, dtype, idx, hd, inv, o);
        continue;
      }
      for (int d = 0; d < hd; d++) acc[d] = 0.f;
      for (int64_t i = 0; i < n; i++) axpy_kv(acc, sc[i], vc, dtype, idx[i], hd);
      for (int d = 0; d < hd; d++) o[d] = dtype == DT_BF16 ? round_bf16(acc[d] * inv) : acc[d] * inv;
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

// SiLU(gate) * up, rounded as transformers does in bf16 (silu rounded, then the product).
TGT2 static void silu_mul(const float* gu, int64_t ld, int T, int inter, float* act, int dtype) {
  static thread_local Scratch s;
  float* e = s.get(inter + 8);
  for (int t = 0; t < T; t++) {
    const float* g = gu + t * ld;
    const float* u = g + inter;
    for (int i = 0; i < inter; i++) e[i] = -g[i];
    exp_inplace(e, inter);
    int i0 = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i0 + 8 <= inter; i0 += 8) {
      const __m256 s1 = to_dtype8(_mm256_div_ps(_mm256_loadu_ps(g + i0), _mm256_add_ps(one, _mm256_loadu_ps(e + i0))),
                                  dtype);
      _mm256_storeu_ps(act + t * inter + i0, to_dtype8(_mm256_mul_ps(s1, _mm256_loadu_ps(u + i0)), dtype));
    }
    for (int i = i0; i < inter; i++) {
      float s1 = g[i] / (1.0f + e[i]);
      if (dtype == DT_BF16) s1 = round_bf16(s1);
      float v = s1 * u[i];
      act[t * inter + i] = dtype == DT_BF16 ? round_bf16(v) : v;
    }
  }
}

static int forward_batch(const mtp_model* M, float* x, int32_t T, const mtp_batch* B, const float* cos,
                         const float* sin_f, float* logits, int32_t nt);

extern "C" int mtp_forward_batch(const mtp_model* M, float* x, int32_t T, const mtp_batch* B, const float* cos,
                                 const float* sin_f, float* logits, int32_t nt) {
  const int rc = forward_batch(M, x, T, B, cos, sin_f, logits, nt);
  trim_scratch();
  return rc;
}

static int forward_batch(const mtp_model* M, float* x, int32_t T, const mtp_batch* B, const float* cos,
                         const float* sin_f, float* logits, int32_t nt) {
  // x: [T, hidden] the embeddings of every sequence's rows (float32 holding dtype values), updated in place.
  // cos / sin_f: [T, hd] (each row's rotary table row, sin's first half negated).
  // logits: [B->nkeep, head.n] float32 (rounded to the dtype) of the rows B->keep.
  if (nt < 1) nt = 1;
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
      for (int g = 0; g < KV; g++)
        for (int d = 0; d < hd; d++) {
          const int64_t at = ((int64_t)g * B->cap[sq] + at0) * hd + d;
          kv_put(kc, dt, at, row[(H + g) * hd + d]);
          kv_put(vc, dt, at, row[(H + KV + g) * hd + d]);
        }
    }
    attention(M, T, qkv, qkv_n, B, li, row_seq, a, (int64_t)H * hd, nt);
    linear(M, &Ly->o, T, a, (int64_t)H * hd, o, Hd, am, nt);
    add_round_row(x, o, (int64_t)T * Hd, dt);
    for (int t = 0; t < T; t++) rms_norm_row(x + t * Hd, Ly->ln2, h + t * Hd, Hd, M->eps, dt);
    linear(M, &Ly->gate_up, T, h, Hd, gu, 2 * I, am, nt);
    silu_mul(gu, 2 * I, T, I, act, dt);
    linear(M, &Ly->down, T, act, I, o, Hd, am, nt);
    add_round_row(x, o, (int64_t)T * Hd, dt);
  }
  const int keep = B->nkeep;
  static thread_local Scratch s_km;
  uint8_t* kmask = (uint8_t*)s_km.get(keep / 4 + 2);
  for (int i = 0; i < keep; i++) {
    const int t = B->keep[i];
    if (t < 0 || t >= T) return 2;
    rms_norm_row(x + t * Hd, M->norm, h + i * Hd, Hd, M->eps, dt);
    kmask[i] = am ? am[t] : 0;
  }
  const int64_t V = M->head.n;
  linear(M, &M->head, keep, h, Hd, logits, V, nullptr, nt);
  if (M->head_override.n > 0 && am) {  // peft's trained output rows, on the adapter rows only
    const int n = M->head_override.n;
    for (int i = 0; i < keep; i++) {
      if (!kmask[i]) continue;
      float* ov = s_o.get(n + 16);
      linear(M, &M->head_override, 1, h + (int64_t)i * Hd, Hd, ov, n, nullptr, nt);
      for (int j = 0; j < n; j++) logits[(int64_t)i * V + M->override_idx[j]] = ov[j];
    }
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------ self-check
// The projection kernel of path isa on a fixed bf16 weight [72, 72] (five column blocks, the last partial; 36
// pairs: two full AMX tiles and a tail of 4) for T = 1..20 rows (a full tile group and a partial one), on 1 and
// 2 threads. Returns 0 when every row has the bits of its one-row result, 2 threads the bits of 1, and each
// element is within 1e-5 (relative to its sum of |products|) of a float64 reference; else 1, 2 or 3 (the check
// that failed), 4 when the weight could not be allocated. kernels/__init__.py runs it once per loaded path.
extern "C" int32_t mtp_selftest(int32_t isa) {
  const int n = 72, k = 72, TMAX = 20;
  uint32_t seed = 12345u;
  auto next_bf16 = [&]() {
    seed = seed * 1664525u + 1013904223u;
    return round_bf16(((float)(seed >> 8) / (float)(1u << 24)) * 2.0f - 1.0f);
  };
  float w[72 * 72], x[20 * 72], y[20 * 72], y1[72], y2[20 * 72];  // 38 KB of stack
  uint16_t w16[72 * 72];
  for (int i = 0; i < n * k; i++) { w[i] = next_bf16(); w16[i] = f32_to_bf16(w[i]); }
  for (int i = 0; i < TMAX * k; i++) x[i] = next_bf16();
  const int layout = isa == ISA_AVX2 ? LAYOUT_BF16 : LAYOUT_BF16_PAIRS;
  void* packed = mtp_alloc(mtp_packed_bytes(n, k, layout));
  if (!packed) return 4;
  mtp_pack_weight(w16, DT_BF16, n, k, layout, packed);
  mtp_model M;
  memset(&M, 0, sizeof M);
  M.dtype = DT_F32;
  M.isa = isa;
  mtp_linear L;
  memset(&L, 0, sizeof L);
  L.w = packed; L.n = n; L.k = k; L.layout = layout;
  int rc = 0;
  for (int T = 1; T <= TMAX && rc == 0; T++) {
    linear(&M, &L, T, x, k, y, n, nullptr, 1);
    linear(&M, &L, T, x, k, y2, n, nullptr, 2);
    if (memcmp(y, y2, sizeof(float) * T * n) != 0) rc = 2;
    for (int t = 0; t < T && rc == 0; t++) {
      linear(&M, &L, 1, x + t * k, k, y1, n, nullptr, 1);
      if (memcmp(y1, y + t * n, sizeof(float) * n) != 0) rc = 1;
      for (int j = 0; j < n && rc == 0; j++) {
        double ref = 0, mag = 0;
        for (int i = 0; i < k; i++) {
          ref += (double)x[t * k + i] * w[j * k + i];
          mag += fabs((double)x[t * k + i] * w[j * k + i]);
        }
        if (fabs(y[t * n + j] - ref) > 1e-5 * mag + 1e-30) rc = 3;
      }
    }
  }
  mtp_free(packed);
  trim_scratch();
  return rc;
}

extern "C" int32_t mtp_abi_version(void) { return 5; }
