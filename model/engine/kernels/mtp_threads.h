// Part of mtp_kernels.cpp, included once into that one translation unit: our thread pool, per-thread scratch and the projection with its adapter (linear).
// ------------------------------------------------------------------------------------------------ threads
// One pool for the process: parallel(nt, f) runs f(tid, nt) for tid = 0 .. nt - 1, tid 0 on the calling thread
// and the others on the pool's workers (created on first need, kept for the life of the process). Regions from
// several calling threads take turns (a mutex). A worker spins for SPIN_NS after its last task, then sleeps on
// a futex: the regions of one pass follow each other within microseconds and find the workers awake; between
// passes they sleep and leave the cores to other work. The partition (share(), tid) alone decides who computes
// what, so results do not depend on the pool, nor on which thread runs a share.
//
// A share is claimed, not assigned: worker w runs f(w, nt) only if it claims share w first, and the calling
// thread, once its own share is done, runs every share no worker has claimed yet. A worker that lost its core
// to another program (a browser on the same machine, a neighbour on a shared host) before its share costs the
// region nothing; one that loses it mid-share stalls the region, and a pass with stalls leaves the next
// passes a thread fewer for a while (pass_threads, below).
static const int64_t SPIN_NS = 200000;
static const int POOL_MAX = 256;  // threads a region can use (more are capped: no result depends on the count)
static inline int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
// Share w of region g: (g << 2) | state. The caller sets the region's shares to FREE before it publishes region
// g, and every share leaves a region DONE or CALLER: a worker the region does not use finds no FREE share.
enum { SHARE_FREE = 0, SHARE_WORKER = 1, SHARE_DONE = 2, SHARE_CALLER = 3 };
struct alignas(64) ShareSlot {
  std::atomic<uint64_t> s{SHARE_DONE};
};
static inline uint64_t slot_word(uint32_t g, int state) { return ((uint64_t)g << 2) | (uint64_t)state; }
// Regions in which the calling thread waited for a worker longer than its own work took (and over
// STALL_MIN_NS): the worker lost its core mid-share. The shares' usual imbalance is a few percent.
static const int64_t STALL_MIN_NS = 200000;
static thread_local int64_t t_stalls = 0;
// Test hook: a worker sleeps this long after claiming a share (a core lost mid-share). 0 in use.
extern "C" { volatile int64_t mtp_debug_share_delay_ns = 0; }  // volatile: read afresh for each share
struct Pool {
  std::mutex run_lock;                 // one region at a time
  std::atomic<uint32_t> gen{0};        // bumped for each region (the futex word)
  std::atomic<int> sleepers{0};
  int workers = 0;
  void (*fn)(void*, int, int) = nullptr;
  void* ctx = nullptr;
  int nt = 1;
  ShareSlot slot[POOL_MAX];
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
    // Claim share tid of region g. It fails when the region does not use this worker, when the caller has run
    // the share itself, or when region g is over (the slot then holds a later region's number): in each case
    // fn and ctx may already belong to another region and are not read.
    uint64_t expect = slot_word(g, SHARE_FREE);
    if (!P->slot[tid].s.compare_exchange_strong(expect, slot_word(g, SHARE_WORKER), std::memory_order_acq_rel))
      continue;
    if (mtp_debug_share_delay_ns > 0) {
      const struct timespec d = {0, (long)(mtp_debug_share_delay_ns % 1000000000)};
      nanosleep(&d, nullptr);
    }
    P->fn(P->ctx, tid, P->nt);
    P->slot[tid].s.store(slot_word(g, SHARE_DONE), std::memory_order_release);
  }
}
template <class F> static void parallel(int nt, F&& f) {
  if (nt > POOL_MAX) nt = POOL_MAX;
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
  const uint32_t g = P->gen.load(std::memory_order_relaxed) + 1;
  for (int w = 1; w < nt; w++) P->slot[w].s.store(slot_word(g, SHARE_FREE), std::memory_order_relaxed);
  P->fn = [](void* c, int tid, int n) { (*(Fn*)c)(tid, n); };
  P->ctx = (void*)&f;
  P->nt = nt;
  P->gen.store(g);  // publishes the slots, fn, ctx, nt (sequentially consistent, as the sleepers count)
  if (P->sleepers.load() > 0) futex_wake(&P->gen);
  const int64_t t_own = now_ns();
  f(0, nt);
  for (int w = 1; w < nt; w++) {  // the shares no worker has started: here, now
    uint64_t expect = slot_word(g, SHARE_FREE);
    if (P->slot[w].s.compare_exchange_strong(expect, slot_word(g, SHARE_CALLER), std::memory_order_acq_rel))
      f(w, nt);
  }
  const int64_t t0 = now_ns();
  for (int w = 1, spins = 0; w < nt;) {  // then the shares workers run
    const uint64_t s = P->slot[w].s.load(std::memory_order_acquire);
    if (s == slot_word(g, SHARE_DONE) || s == slot_word(g, SHARE_CALLER)) {
      w++;
      continue;
    }
    _mm_pause();
    if (++spins >= 64) {
      spins = 0;
      if (now_ns() - t0 > SPIN_NS) sched_yield();  // a worker lost its core mid-share: let it have ours
    }
  }
  const int64_t waited = now_ns() - t0;
  if (waited > STALL_MIN_NS && waited > t0 - t_own) t_stalls++;
}

// Passes that give up a worker for a while. A pass at nt > 1 threads with FEWER_STALLS stalled regions had a
// worker lose its core mid-share: another program wants that core. The passes of the next FEWER_NS then run on
// one thread fewer (so do their proposals; each further stalled pass takes one more away, down to the calling
// thread alone), and the first pass after them tries every thread again. Results never depend on the thread
// count. A 2-core Zen 4 VM, SmolLM2 bf16, one-token passes at two threads with one core kept busy by another
// process: 13.8-19.2 ms before, 10.2-10.4 ms after (one thread: 10.5-11.1); quiet, as before within the
// noise, with about one pass in six on one thread (the VM's own stalls).
static const int64_t FEWER_NS = 500000000, FEWER_STALLS = 2;
static std::atomic<int64_t> g_cap_until{0}, g_reduced_passes{0};
static std::atomic<int> g_cap{0};  // the threads a pass may use until g_cap_until
extern "C" int64_t mtp_reduced_passes(void) { return g_reduced_passes.load(); }  // passes run on fewer threads
extern "C" void mtp_reduced_reset(void) { g_cap_until.store(0); }
// The threads a region may use now, of the nt asked for.
static inline int thread_cap(int nt) {
  if (nt <= 1 || now_ns() >= g_cap_until.load(std::memory_order_relaxed)) return nt;
  const int cap = g_cap.load(std::memory_order_relaxed);
  return cap >= 1 && cap < nt ? cap : nt;
}
static int pass_threads(int nt) {
  const int n = thread_cap(nt);
  if (n < nt) g_reduced_passes.fetch_add(1, std::memory_order_relaxed);
  return n;
}
// After a pass that ran on nt threads, with stalls0 = t_stalls at its start.
static void pass_done(int nt, int64_t stalls0) {
  if (nt <= 1 || t_stalls - stalls0 < FEWER_STALLS) return;
  g_cap.store(nt - 1, std::memory_order_relaxed);
  g_cap_until.store(now_ns() + FEWER_NS, std::memory_order_relaxed);
}


// Thread tid's share of nb column blocks (contiguous, in multiples of SHARE_UNIT blocks). Two blocks, not a
// micro-kernel's four: SmolLM2's o and down projections have 36 blocks, which fours split 20 / 16 between two
// threads (the second thread then waits ~10% of those products for the first) and twos split 18 / 18.
static const int64_t SHARE_UNIT = 2;
static inline void share(int64_t nb, int tid, int nt, int64_t* b0, int64_t* b1) {
  int64_t units = cdiv(nb, SHARE_UNIT);
  int64_t per = units / nt, extra = units % nt;
  int64_t u0 = tid * per + (tid < extra ? tid : extra);
  int64_t u1 = u0 + per + (tid < extra ? 1 : 0);
  *b0 = u0 * SHARE_UNIT < nb ? u0 * SHARE_UNIT : nb;
  *b1 = u1 * SHARE_UNIT < nb ? u1 * SHARE_UNIT : nb;
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

// The adapter rows' delta u B^T added to y (rows[i]: the row of y of adapter row i; u: [arows, ldu] float32).
// delta[t, j] = sum_r u[t, r] B[j, r] over the member's ranks only (no zero blocks), r in order: the same
// column kernel on B (packed [out_m, r_m]). Every member in one region: a thread takes its share of each
// member's column blocks and adds those delta columns to y itself (element-wise).
static void add_b_delta(const mtp_model* M, const mtp_linear* L, int arows, const int* rows, const float* u,
                        int64_t ldu, float* y, int64_t ldy, int nt) {
  static thread_local Scratch s_d;
  int64_t doff[4], dtotal = 0;
  for (int m = 0; m < L->members; m++) {
    doff[m] = dtotal;
    dtotal += (int64_t)arows * cdiv(L->m_out1[m] - L->m_out0[m], 16) * 16;
  }
  float* d = s_d.get(dtotal);
  parallel(nt, [&](int tid, int n_threads) {
    for (int m = 0; m < L->members; m++) {
      const int o0 = L->m_out0[m], om = L->m_out1[m] - o0, r0 = L->m_r0[m], rr = L->m_r1[m] - r0;
      const int64_t nbm = cdiv(om, 16), ldd = nbm * 16;
      int64_t b0, b1;
      share(nbm, tid, n_threads, &b0, &b1);
      if (b0 >= b1) continue;
      mtp_linear Bm;
      memset(&Bm, 0, sizeof Bm);
      Bm.w = L->m_b[m]; Bm.n = om; Bm.k = rr; Bm.layout = L->lora_layout;
      float* dm = d + doff[m];
      gemm_blocks(&Bm, M->isa, arows, u + r0, ldu, nullptr, 0, dm, ldd, b0, b1, n_threads);
      const int64_t c0 = b0 * 16, c1 = b1 * 16 < om ? b1 * 16 : om;
      for (int t = 0; t < arows; t++)
        add_round_row(M->isa, y + (int64_t)rows[t] * ldy + o0 + c0, dm + t * ldd + c0, c1 - c0, M->dtype);
    }
  });
}

// y[T, n] (row stride ldy) = x[T, k] W^T (+ bias), rounded to the dtype; then the rows where amask is 1 get
// the adapter's delta (peft's order: base result in the dtype + float32 delta, rounded again).
// yb (only where gemm_has_epilogue, with no adapter rows): the columns rounded to bf16 and stored there as bf16
// as they leave the tiles (Epilogue), y unused.
static void linear(const mtp_model* M, const mtp_linear* L, int T, const float* x, int64_t ldx, float* y,
                   int64_t ldy, const uint8_t* amask, int nt, uint16_t* yb = nullptr) {
  int arows = 0;
  if (amask && L->rank > 0)
    for (int t = 0; t < T; t++) arows += amask[t] ? 1 : 0;
  // With A inside w (lora_a_in_w), a pass with adapter rows sweeps A's column blocks with the weight's: u = x A^T
  // comes out of the same sweep, in the weight's kernel (AMX tiles, vdpbf16ps), for every row (each row's columns
  // depend on that row alone, so the bits do not depend on which other rows the pass has).
  const int64_t n = L->n, k = L->k, nb = cdiv(n, 16), nbu = cdiv(L->rank, 16);
  const bool fused = arows > 0 && L->lora_a_in_w;
  const int64_t nbt = nb + (fused ? nbu : 0), ldo = nbt * 16;
  static thread_local Scratch s_out, s_xp, s_u;
  if (yb && (arows > 0 || !gemm_has_epilogue(L, M->isa))) abort();  // a caller's error
  float* out = (ldy == ldo && !fused) || yb ? y : s_out.get((int64_t)T * ldo);
  uint32_t* xp = nullptr;
  int64_t ldxp = cdiv(k, 2);
  if (is_pair_layout(L->layout)) {  // activations as bf16 pairs (exact: they hold bf16 values)
    xp = (uint32_t*)s_xp.get((int64_t)T * ldxp);
    for (int t = 0; t < T; t++) {
      uint16_t* d = (uint16_t*)(xp + t * ldxp);
      to_bf16_row(M->isa, x + t * ldx, d, k);
      if (k & 1) d[k] = 0;
    }
  }
  // Each thread rounds (and biases) the columns it computed, while they are in its cache: element-wise, so
  // the bits do not depend on who does it.
  const Epilogue ep = {yb, ldy, n, L->bias};
  parallel(nt, [&](int tid, int n_threads) {
    int64_t b0, b1;
    share(nbt, tid, n_threads, &b0, &b1);
    if (b0 >= b1) return;
    gemm_blocks(L, M->isa, T, x, ldx, xp, ldxp, out, ldo, b0, b1, n_threads, yb ? &ep : nullptr);
    if (yb) return;
    const int64_t c0 = b0 * 16, c1 = b1 * 16 < n ? b1 * 16 : n;  // c0 >= c1: a share of A's columns only
    if (c0 < c1)
      for (int t = 0; t < T; t++)
        bias_round_row(M->isa, out + t * ldo + c0, L->bias ? L->bias + c0 : nullptr, y + t * ldy + c0, c1 - c0, M->dtype);
  });
  if (arows == 0) return;
  static thread_local Scratch s_rows;  // ints in a float buffer (the same size)
  int* rows = (int*)s_rows.get(arows);
  for (int t = 0, i = 0; t < T; t++)
    if (amask[t]) rows[i++] = t;
  const int64_t ldu = nbu * 16;
  float* u = s_u.get((int64_t)arows * ldu);
  if (fused) {  // u: the adapter rows' A columns of the sweep (float32, unrounded)
    for (int i = 0; i < arows; i++) memcpy(u + i * ldu, out + (int64_t)rows[i] * ldo + nb * 16, sizeof(float) * ldu);
  } else {  // u = x A^T for the adapter rows gathered (a copy: the same bits as computing them in place)
    static thread_local Scratch s_xa;
    float* xa = s_xa.get((int64_t)arows * k + 1);
    for (int i = 0; i < arows; i++) memcpy(xa + (int64_t)i * k, x + (int64_t)rows[i] * ldx, sizeof(float) * k);
    mtp_linear A;
    memset(&A, 0, sizeof A);
    A.w = L->lora_a; A.n = L->rank; A.k = L->k; A.layout = L->lora_layout;
    parallel(nt, [&](int tid, int n_threads) {
      int64_t b0, b1;
      share(nbu, tid, n_threads, &b0, &b1);
      if (b0 < b1) gemm_blocks(&A, M->isa, arows, xa, k, nullptr, 0, u, ldu, b0, b1, n_threads);
    });
  }
  add_b_delta(M, L, arows, rows, u, ldu, y, ldy, nt);
}
