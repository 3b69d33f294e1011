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
// Attention, norms and element-wise work: AVX2 code on every path, the busiest steps (rounding, residual adds,
// bf16 narrowing, SiLU, attention's weighted values) on 16 lanes on the AVX512 and AMX paths: each lane the same
// operations as on 8, so the same bits on every path. On AMX a bf16 model's logits leave the tiles as bf16
// (mtp_amx.h, Epilogue).
//
// Numerics follow transformers' eager bf16 / float32 computation step by step (the same roundings to the
// model's dtype after each op that transformers stores in that dtype); the sums inside an op run in our own
// fixed order, so logits differ from transformers' by rounding (docs/DESIGN.md gives the figures).
//
// Built with g++ -O3 -pthread -ffp-contract=off (no fast-math: the compiler may not reorder a sum).

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <stddef.h>
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
enum { LAYOUT_F32 = 0, LAYOUT_BF16 = 1, LAYOUT_BF16_PAIRS = 2, LAYOUT_BF16_TILES = 3 };
enum { DT_F32 = 0, DT_BF16 = 1 };

extern "C" {

// ------------------------------------------------------------------------------------------------ structs
// Mirrored by ctypes in kernels/abi.py, which checks its mirror against mtp_fields (below) when the library loads.
typedef struct {
  const void* w;        // packed weight (mtp_pack_weight)
  int32_t n, k;         // output features, input features
  int32_t layout;       // LAYOUT_*
  const float* bias;    // [n] or NULL
  // adapter (LoRA / aLoRA): delta = (x A^T) B^T on the adapter rows, per member without the zero blocks
  int32_t rank;         // sum of the members' ranks (0: no adapter)
  const void* lora_a;   // A of all members stacked, [rank, k] packed as lora_layout (NULL when lora_a_in_w)
  int32_t lora_a_in_w;  // 1: A is packed inside w instead, its rank columns in the blocks after the n columns
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

#include "mtp_bf16.h"

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
// The bf16-pair layouts (x as bf16 pairs, pair_block) and the one path isa's weights are packed in.
static inline bool is_pair_layout(int layout) { return layout == LAYOUT_BF16_PAIRS || layout == LAYOUT_BF16_TILES; }
static inline int pair_layout(int isa) { return isa == ISA_AMX ? LAYOUT_BF16_TILES : LAYOUT_BF16_PAIRS; }

extern "C" int64_t mtp_packed_bytes(int32_t n, int32_t k, int32_t layout) {
  int64_t nb = cdiv(n, 16);
  if (layout == LAYOUT_F32) return nb * k * 16 * 4;
  if (layout == LAYOUT_BF16) return nb * k * 16 * 2;
  return nb * cdiv(k, 2) * 32 * 2;  // pairs [nb / 2][k/2][2][16][2] or tiles [nb][k/2][16][2] (pair_block)
}

// LAYOUT_BF16_PAIRS stores its column blocks two by two, step by step: for the blocks 2g and 2g + 1, step j of
// block 2g, then step j of block 2g + 1, then step j + 1 of each, ... (a last odd block alone). A sweep of
// one pair of blocks is then one sequential stream of 128 bytes a step with two accumulator chains per row.
// With the blocks one after another (four blocks read side by side: four streams), one row took 1.2x this
// layout's time and four rows about the same (SmolLM2's layer projections, one thread, Zen 4); docs/DESIGN.md
// gives the figures. LAYOUT_BF16_TILES, the AMX path's, keeps each block's steps one after another (64 bytes a
// step): a weight tile is then 1 KB in a row, where the pairs' 128-byte stride made AMX read SmolLM2's gate/up at
// 12.9 GB/s against 14.4 this way (one thread, Intel Xeon with AMX). Either layout holds pair j of block b's 16
// columns as [c][2]. Block b's step j is at pair_block(w, layout, k2, nb, b, &js) + j * js elements.
static inline const uint16_t* pair_block(const void* w, int layout, int64_t k2, int64_t nb, int64_t b, int64_t* js) {
  if (layout == LAYOUT_BF16_TILES) {
    *js = 32;
    return (const uint16_t*)w + b * k2 * 32;
  }
  const int64_t g = b / 2;
  *js = (2 * g + 2 <= nb ? 2 : 1) * 32;
  return (const uint16_t*)w + g * 2 * k2 * 32 + (b % 2) * 32;
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
        int64_t k2 = cdiv(k, 2), js;
        uint16_t* d = (uint16_t*)pair_block(dst, layout, k2, nb, b, &js);
        for (int64_t j = 0; j < k; j++) d[(j / 2) * js + c * 2 + (j & 1)] = getraw16(i, j);
      }
    }
}

// The rest of the pass, in order (each file is part of this one translation unit, not a header of its own):
#include "mtp_gemm.h"
#include "mtp_amx.h"
#include "mtp_threads.h"
#include "mtp_elementwise.h"
#include "mtp_pass.h"
#include "mtp_propose.h"

// ------------------------------------------------------------------------------------------------ self-check
// The self-checks' inputs: a fixed sequence of values in [-1, 1) (a linear congruential generator).
static float selftest_uniform(uint32_t* seed) {
  *seed = *seed * 1664525u + 1013904223u;
  return ((float)(*seed >> 8) / (float)(1u << 24)) * 2.0f - 1.0f;
}

// The projection kernels of path isa on a fixed bf16 weight [72, 72] (five column blocks, the last partial; 36
// pairs: two full AMX tiles and a tail of 4) for T = 1..20 rows (a full tile group and a partial one), on 1 and
// 2 threads, in each layout the path multiplies: its weights' (AMX: bf16 tiles, AVX512: bf16 pairs, AVX2: bf16),
// on the AVX512 and AMX paths the other pair layout as well, and the adapter's B (bf16 widened to float32,
// mk_512_bf16w). Returns 0 when every row has the bits of its
// one-row result, 2 threads the bits of 1, and each element is within 1e-5 (relative to its sum of |products|) of
// a float64 reference; else 1, 2 or 3 (the check that failed), 4 when the weight could not be allocated, 5 when
// the zmm kernel for B differs from the AVX2 kernel it stands in for, 6 when an attention score of a block of keys
// differs from the key's score alone (selftest_scores), 7 when a bf16 model's weighted values are off
// (selftest_values). kernels/__init__.py runs it once per path.
static int32_t selftest_layout(int32_t isa, int layout) {
  const int n = 72, k = 72, TMAX = 20;
  uint32_t seed = 12345u;
  auto next_bf16 = [&]() { return round_bf16(selftest_uniform(&seed)); };
  float w[72 * 72], x[20 * 72], y[20 * 72], y1[72], y2[20 * 72];  // 38 KB of stack
  uint16_t w16[72 * 72];
  for (int i = 0; i < n * k; i++) { w[i] = next_bf16(); w16[i] = f32_to_bf16(w[i]); }
  for (int i = 0; i < TMAX * k; i++) x[i] = next_bf16();
  void* packed = mtp_alloc(mtp_packed_bytes(n, k, layout));
  if (!packed) return 4;
  mtp_pack_weight(w16, DT_BF16, n, k, layout, packed);
  mtp_model M, M_avx2;  // M_avx2: the same on the AVX2 kernels, what mk_512_bf16w stands in for
  memset(&M, 0, sizeof M);
  M.dtype = DT_F32;
  M.isa = isa;
  M_avx2 = M;
  M_avx2.isa = ISA_AVX2;
  mtp_linear L;
  memset(&L, 0, sizeof L);
  L.w = packed; L.n = n; L.k = k; L.layout = layout;
  int rc = 0;
  for (int T = 1; T <= TMAX && rc == 0; T++) {
    linear(&M, &L, T, x, k, y, n, nullptr, 1);
    linear(&M, &L, T, x, k, y2, n, nullptr, 2);
    if (memcmp(y, y2, sizeof(float) * T * n) != 0) rc = 2;
    if (rc == 0 && layout == LAYOUT_BF16 && isa != ISA_AVX2) {
      linear(&M_avx2, &L, T, x, k, y2, n, nullptr, 1);
      if (memcmp(y, y2, sizeof(float) * T * n) != 0) rc = 5;
    }
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

// Attention scores on the zmm paths (scores_bf16): 3 heads against 37 bf16 keys, out of cache order and in it (two
// blocks of 16, consecutive ones addressed from one pointer, one of 4, one alone) have, key by key, the bits of each
// key scored alone. 0, else 6.
static int32_t selftest_scores() {
  const int hd = 64, n = 37, G = 3;
  uint32_t seed = 4242u;
  float q[G * 64], all[G * 40], one[G];
  uint16_t keys[n * 64];
  for (int i = 0; i < G * hd; i++) q[i] = round_bf16(selftest_uniform(&seed));
  for (int i = 0; i < n * hd; i++) keys[i] = f32_to_bf16(selftest_uniform(&seed));
  int64_t off[n];
  const float* qs[G] = {q, q + hd, q + 2 * hd};
  float* outs[G] = {all, all + 40, all + 80};
  for (int stride : {7, 1}) {  // keys out of cache order, as a tree skips; then in order (one pointer for 16 keys)
    for (int i = 0; i < n; i++) off[i] = (int64_t)((i * stride) % n) * hd;
    scores_bf16<G>(qs, keys, off, n, hd, outs);
    for (int i = 0; i < n; i++) {
      float* o1[G] = {one, one + 1, one + 2};
      scores_bf16<G>(qs, keys, off + i, 1, hd, o1);
      for (int g = 0; g < G; g++)
        if (memcmp(&one[g], &outs[g][i], sizeof(float)) != 0) return 6;
    }
  }
  return 0;
}

// A bf16 model's weighted values on the zmm paths (weighted_values_bf16): 3 heads over 37 values (an odd count)
// out of cache order, against a float64 sum of the bf16-rounded probabilities times the values: each element within
// 2^-7 of the sum of |products| (the output is rounded to bf16). 0, else 7.
static int32_t selftest_values() {
  const int hd = 64, n = 37, G = 3;
  uint32_t seed = 777u;
  float p[G * n], o[G * hd], inv[G] = {0.5f, 1.0f, 2.0f};
  uint16_t vals[n * 64];
  for (int i = 0; i < G * n; i++) p[i] = 0.5f + 0.5f * selftest_uniform(&seed);
  for (int i = 0; i < n * hd; i++) vals[i] = f32_to_bf16(selftest_uniform(&seed));
  int64_t off[n];
  for (int i = 0; i < n; i++) off[i] = (int64_t)((i * 7) % n) * hd;
  const float* ps[G] = {p, p + n, p + 2 * n};
  float* os[G] = {o, o + hd, o + 2 * hd};
  weighted_values_bf16<G>(ps, n, vals, off, hd, inv, os);
  for (int g = 0; g < G; g++)
    for (int d = 0; d < hd; d++) {
      double ref = 0, mag = 0;
      for (int i = 0; i < n; i++) {
        const double t = (double)round_bf16(p[g * n + i]) * bf16_to_f32(vals[off[i] + d]) * inv[g];
        ref += t;
        mag += fabs(t);
      }
      if (fabs(o[g * hd + d] - ref) > mag / 128) return 7;
    }
  return 0;
}

extern "C" int32_t mtp_selftest(int32_t isa) {
  if (isa == ISA_AVX2) return selftest_layout(isa, LAYOUT_BF16);
  if (const int32_t rc = selftest_scores()) return rc;
  if (const int32_t rc = selftest_values()) return rc;
  const int own = pair_layout(isa), other = own == LAYOUT_BF16_TILES ? LAYOUT_BF16_PAIRS : LAYOUT_BF16_TILES;
  const int layouts[] = {own, other, LAYOUT_BF16};
  for (int layout : layouts)
    if (const int32_t rc = selftest_layout(isa, layout)) return rc;
  return 0;
}

// ------------------------------------------------------------------------------------------------ layout
// Every field of the structs above with its offset and size, and each struct's size (offset -1): kernels/abi.py
// checks its ctypes mirror against this list when it loads the library.
typedef struct {
  const char* name;
  int64_t offset, size;
} mtp_field;
#define MTP_SIZE(S) {#S, -1, (int64_t)sizeof(S)}
#define MTP_FIELD(S, f) {#S "." #f, (int64_t)offsetof(S, f), (int64_t)sizeof(((S*)0)->f)}
static const mtp_field FIELDS[] = {
    MTP_SIZE(mtp_linear), MTP_FIELD(mtp_linear, w), MTP_FIELD(mtp_linear, n), MTP_FIELD(mtp_linear, k),
    MTP_FIELD(mtp_linear, layout), MTP_FIELD(mtp_linear, bias), MTP_FIELD(mtp_linear, rank),
    MTP_FIELD(mtp_linear, lora_a), MTP_FIELD(mtp_linear, lora_a_in_w), MTP_FIELD(mtp_linear, members),
    MTP_FIELD(mtp_linear, m_out0), MTP_FIELD(mtp_linear, m_out1), MTP_FIELD(mtp_linear, m_r0),
    MTP_FIELD(mtp_linear, m_r1), MTP_FIELD(mtp_linear, m_b), MTP_FIELD(mtp_linear, lora_layout),
    MTP_SIZE(mtp_layer), MTP_FIELD(mtp_layer, qkv), MTP_FIELD(mtp_layer, o), MTP_FIELD(mtp_layer, gate_up),
    MTP_FIELD(mtp_layer, down), MTP_FIELD(mtp_layer, ln1), MTP_FIELD(mtp_layer, ln2), MTP_FIELD(mtp_layer, q_norm),
    MTP_FIELD(mtp_layer, k_norm),
    MTP_SIZE(mtp_model), MTP_FIELD(mtp_model, hidden), MTP_FIELD(mtp_model, heads), MTP_FIELD(mtp_model, kv_heads),
    MTP_FIELD(mtp_model, head_dim), MTP_FIELD(mtp_model, inter), MTP_FIELD(mtp_model, layers),
    MTP_FIELD(mtp_model, dtype), MTP_FIELD(mtp_model, isa), MTP_FIELD(mtp_model, eps), MTP_FIELD(mtp_model, scaling),
    MTP_FIELD(mtp_model, layer), MTP_FIELD(mtp_model, norm), MTP_FIELD(mtp_model, head),
    MTP_FIELD(mtp_model, head_override), MTP_FIELD(mtp_model, override_idx),
    MTP_SIZE(mtp_batch), MTP_FIELD(mtp_batch, nseq), MTP_FIELD(mtp_batch, row0), MTP_FIELD(mtp_batch, kcache),
    MTP_FIELD(mtp_batch, vcache), MTP_FIELD(mtp_batch, cap), MTP_FIELD(mtp_batch, pos),
    MTP_FIELD(mtp_batch, visible), MTP_FIELD(mtp_batch, adapter), MTP_FIELD(mtp_batch, keep),
    MTP_FIELD(mtp_batch, nkeep),
};
extern "C" int32_t mtp_field_count(void) { return (int32_t)(sizeof FIELDS / sizeof FIELDS[0]); }
extern "C" const mtp_field* mtp_fields(void) { return FIELDS; }
