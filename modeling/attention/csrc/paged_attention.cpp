// CPU paged attention for decode and speculative verification (few query tokens per sequence).
//
// Built on first use by modeling/attention/cpu_kernel.py (torch.utils.cpp_extension.load, -O3
// -march=native). The pure-torch backend (torch_backend.py) is the oracle; the visibility rule is the
// one of modeling/attention/metadata.py:
//
//   query token i of sequence b sits at position p = seq_lens[b] - q_len(b) + i and sees cached token
//   j iff j <= p and (j < sink_len or j >= window_starts[b]) and (sliding_window == 0 or
//   j > p - sliding_window).
//
// A full view is window_starts[b] == 0 (what AttentionMetadata.tensors() gives when there is no window).
// sliding_window is the layer's window (0: full attention): query p sees keys p - W + 1 .. p, as
// transformers' sliding-window mask.
// The new tokens' keys/values are already in the cache, so everything is read from the cache.
//
// Shapes:
//   q            [T, Hq, D]                         float32 | bfloat16 | float16
//   k/v_cache    [num_blocks, block_size, Hkv, D]   same dtype as q, innermost dim contiguous
//   block_tables int32 [B, max_blocks]; seq_lens int32 [B]; query_start int32 [B + 1];
//   window_starts int32 [B]
//   out          [T, Hq, D]                         dtype of q
//
// Algorithm. Each sequence's visible keys form at most two position ranges (the sink [s0, sink_end) and
// the window [win, seq_len)); concatenated they are the sequence's "visible key list". A sliding window
// W drops the keys no query row sees (below ctx - W + 1, rounded down to a multiple of the 16-key tile
// so that tiles stay aligned to absolute positions) and masks the rest per row. The list is cut
// into chunks (multiples of a 16-key tile) and each (sequence, chunk) is one work item, which handles
// all KV heads: for every tile of 16 keys and every KV head h, the key rows are loaded once and dotted
// with all R = G * Q query rows of that head (G query heads per KV head, Q query tokens), followed by
// an online-softmax update and the P @ V accumulation. Processing all heads of a token together makes
// the item read each paged block as one contiguous stream. Scores live in the log2 domain (q is
// scaled by scale * log2(e)) so the exponentials are exp2. Items are pulled dynamically from an atomic
// counter by at::parallel_for workers (longest first; the build needs -fopenmp for them to run in parallel); a final pass merges each sequence's chunks by
// their running (max, sum) -- the log-sum-exp merge -- and writes the output in q's dtype.
//
// Inner loops (AVX-512F, D % 16 == 0): QK^T computes 16 partial-dot vectors per row (one per key) and
// reduces them with one transposing tree (reduce16); the softmax uses lazy rescaling (the running max
// only moves when a score exceeds it by > 2^8) and per-lane row sums; P @ V keeps up to 4 rows' outputs
// in registers per pass over the tile's V rows. With AVX512-BF16 (bf16 caches), QK^T transposes each
// head's 16 keys once into bf16 pairs (one vector per pair of dimensions, lanes = keys) and accumulates
// every row's 16 scores lane-wise with VDPBF16PS against the row's broadcast query pairs, 8 rows per
// pass: no horizontal reduction, and the transpose is shared by all G * Q rows -- this is what makes a
// verification's extra rows cheap (1.2x faster at Q = 3-6, 32 x 8K, than per-row dot products plus
// reduce16; benchmarks/results/FINDINGS.md);
// P @ V rounds P to bf16 (as GPU flash attention does) to use VDPBF16PS on pairs of keys.
// Each tile's cache lines are software-prefetched just before the tile is computed (MS_PREFETCH_TILES
// = 0): issuing all of them at once keeps many misses in flight. On the 2-core AMD EPYC (Zen) this was
// tuned on (contiguous block tables, 32 x 8K), one tile ahead was as fast, and 2 or 8 tiles ahead made
// steps 1.1-1.3x / 1.2-1.5x slower (benchmarks/results/FINDINGS.md).
//
// Every query row is computed on its own -- the same operations in the same order whatever the number of
// rows beside it -- so a verification row equals the decode step at that position bit for bit when the
// chunking agrees (always on one thread). With a sliding window this holds too: a row's tiles are the same
// 16-aligned position groups either way, and a tile that holds none of a row's keys leaves the row as is.
// Without AVX-512 or for other D, a portable scalar path with the same structure runs.
// Accumulation is always fp32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MS_HAVE_AVX512 1
#else
#define MS_HAVE_AVX512 0
#endif

namespace {

constexpr int kTile = 16;          // keys per tile (one zmm of scores)
constexpr int kMinChunk = 512;     // never split a sequence into chunks shorter than this
// Build-time switches (pass -D... in extra_cflags to experiment):
#ifndef MS_PREFETCH_TILES  // software prefetch distance in tiles (0 = the tile about to be computed)
#define MS_PREFETCH_TILES 0
#endif
#ifndef MS_BF16_PV  // bf16 P @ V with bf16 dot products (1) or in fp32 FMAs (0)
#define MS_BF16_PV 1
#endif
constexpr int kPrefetchTiles = MS_PREFETCH_TILES;  // tiles resolved and prefetched ahead of the one being computed
constexpr float kLazyRescale = 8.f;  // log2 units: probabilities may reach 2^8 before m is moved
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

// ---------------------------------------------------------------------------------------------------
// Problem description shared by all work items.

struct Seq {
  int64_t tok0;   // first query row of this sequence in q / out
  int q_len;      // Q: new tokens (query rows per query head)
  int ctx;        // seq_len - q_len: position of the first new token
  int floor0;     // row qi sees only positions > floor0 + qi (ctx - sliding_window; very negative without one)
  int s0;         // visible range 0 = positions [s0, s0 + n0) (the sink, from the tile where the window
  int n0;         //   starts when the window reaches into it)
  int s1;         // visible range 1 = positions [s1, s1 + n_vis - n0) (the window)
  int n_vis;      // visible keys in total
  int first_item; // this sequence's chunks are items [first_item, first_item + n_items)
  int n_items;
  const int32_t* table;  // block table row
};

struct Item {
  int seq;
  int kb, ke;       // [kb, ke): indices into the sequence's visible key list
  int64_t row_off;  // scratch rows of this item: Hkv * G * Q rows of (acc[D], m, l)
};

template <typename T>
struct Problem {
  const T* q;  int64_t q_s0, q_s1;                       // q strides (token, head); dim 2 contiguous
  const T* k;  int64_t k_s0, k_s1, k_s2;                 // k_cache strides (block, slot, head)
  const T* v;  int64_t v_s0, v_s1, v_s2;
  int Hkv, G, D, block_size;
  float qscale;                                          // softmax scale * log2(e)
  std::vector<Seq> seqs;
  std::vector<Item> items;
  float* acc;  // [rows, D] unnormalised outputs, row = item.row_off + h * R + g * Q + qi
  float* m;    // [rows] running max (log2 domain)
  float* l;    // [rows] running sum of exp2(score - m)
};

// Per-thread scratch, reused across items.
struct Workspace {
  std::vector<float> qbuf;    // [Hkv][R][D] query rows (float, pre-scaled)
  std::vector<uint16_t> qraw; // [Hkv][R][D] raw bf16 query rows (AVX512-BF16 path, unscaled)
  std::vector<float> probs;   // [R][kTile] scores, then probabilities of the current tile
  std::vector<uint8_t> live;  // [R] row sees at least one key of the current tile
  std::vector<uint16_t> pbf;  // [R][kTile] probabilities as bf16 (bf16 P @ V path)
  std::vector<float> lsum;    // [Hkv][R][kTile] per-lane partial row sums (AVX-512 path)
  alignas(64) uint32_t kt[128 * kTile];  // one head's key tile as bf16 pairs [D / 2][kTile] (D <= 256)
};

// Position of visible-list index idx.
inline int position_of(const Seq& s, int idx) { return idx < s.n0 ? s.s0 + idx : s.s1 + (idx - s.n0); }

// ---------------------------------------------------------------------------------------------------
// AVX-512 helpers.

#if MS_HAVE_AVX512
template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  // bf16 -> fp32 is a 16-bit left shift of the bit pattern.
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <> inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[j] = horizontal sum of v[j], for j < 16 (a transposing reduction tree: 45 instructions).
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  // level 1: per 128-bit lane, t[i] = [a0+a2, b0+b2, a1+a3, b1+b3] with a = v[2i], b = v[2i+1]
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // level 2: per 128-bit lane, u[i] = lane sums of v[4i .. 4i+3]
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // level 3: w0 = [X0+X1, X2+X3, Y0+Y1, Y2+Y3] (X = u[0], Y = u[1], digits = 128-bit lanes)
  __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // level 4: lanes = full sums of keys 0-3, 4-7, 8-11, 12-15
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 2^x for x <= 127 (x -> -inf gives ~0; callers zero masked lanes anyway). Degree-7 Taylor of 2^f on
// f in [-0.5, 0.5] (relative error ~1e-8), then scaled by 2^round(x).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252734e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// acc[rb][:] += sum_j probs[rb][j] * V[j][:], for RB rows at once (accumulators stay in registers,
// each V row is converted once per RB rows).
template <typename T, int NC, int RB>
inline void pv_rows(float* const* acc, const float* const* probs, const T* const* vrow, int n) {
  __m512 a[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc[r] + 16 * c);
  for (int j = 0; j < n; ++j) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16<T>(vrow[j] + 16 * c);
    for (int r = 0; r < RB; ++r) {
      __m512 p = _mm512_set1_ps(probs[r][j]);
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_fmadd_ps(p, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a[r][c]);
}
#if defined(__AVX512BF16__)
// bf16 variant: acc[rb] += sum_j p[rb][j] * V[j] with VDPBF16PS over key pairs (j, j+1).
// pbf[rb][j / 2] holds the bf16 pair (p_j, p_j+1). unpacklo/hi_epi16 of rows j, j+1 interleave them per
// 128-bit lane, so accumulator vector 2c (lo) / 2c+1 (hi) lane i holds output dim
// 32c + 8 * (i / 4) + i % 4 (+ 4 for hi); unpermute_bf16_pv_row restores the natural order.
template <int NC, int RB>
inline void pv_rows_bf16(float* const* acc, const uint32_t* const* pbf, const c10::BFloat16* const* vrow, int n) {
  __m512 a[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc[r] + 16 * c);
  for (int j = 0; j < n; j += 2) {
    __m512i lo[NC / 2], hi[NC / 2];
    for (int c = 0; c < NC / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(vrow[j] + 32 * c);
      const __m512i y = j + 1 < n ? _mm512_loadu_si512(vrow[j + 1] + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(x, y);
      hi[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pbf[r][j / 2]));
      for (int c = 0; c < NC / 2; ++c) {
        a[r][2 * c] = _mm512_dpbf16_ps(a[r][2 * c], (__m512bh)lo[c], pp);
        a[r][2 * c + 1] = _mm512_dpbf16_ps(a[r][2 * c + 1], (__m512bh)hi[c], pp);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a[r][c]);
}

// In-place transpose of a 16 x 16 matrix of 32-bit elements held as 16 row vectors: r[j][i] <- r[i][j].
inline void transpose16x16_epi32(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: [r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1]] / +2
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c], lane L = column 4L + c of rows 4i .. 4i + 3
    b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // 4 x 4 transpose of 128-bit lanes across b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512i u0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), u1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), u3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
}

// One KV head's 16 key rows (bf16, D = 16 * NC) as pairs: kt[p * 16 + j] = elements (2p, 2p + 1) of key j.
template <int NC>
inline void transpose_keys_bf16(const c10::BFloat16* const* kptr, int64_t koff, uint32_t* kt) {
  for (int blk = 0; blk < NC / 2; ++blk) {  // 16 pairs (64 bytes) of every key per block
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(kptr[j] + koff + 32 * blk);
    transpose16x16_epi32(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + (16 * blk + p) * 16, r[p]);
  }
}

// Scores of RB query rows against one transposed key tile: out[rb][j] = q_rb . k_j (fp32 accumulation
// of bf16 pair products, pair by pair in dimension order -- the same order for every row, whatever RB,
// so a row's scores do not depend on how many rows are computed with it).
template <int NC, int RB>
inline void qk_rows_bf16(const uint32_t* kt, const uint32_t* const* qpair, __m512* out) {
  __m512 a[RB];
  for (int rb = 0; rb < RB; ++rb) a[rb] = _mm512_setzero_ps();
  for (int p = 0; p < 8 * NC; ++p) {
    const __m512bh kv = (__m512bh)_mm512_load_si512(kt + 16 * p);
    for (int rb = 0; rb < RB; ++rb)
      a[rb] = _mm512_dpbf16_ps(a[rb], kv, (__m512bh)_mm512_set1_epi32(static_cast<int>(qpair[rb][p])));
  }
  for (int rb = 0; rb < RB; ++rb) out[rb] = a[rb];
}
#endif
#endif  // MS_HAVE_AVX512

// Inverse of pv_rows_bf16's lane order for one accumulator row of D (a multiple of 32) floats.
inline void unpermute_bf16_pv_row(float* row, int D) {
  float tmp[32];
  for (int c = 0; c < D; c += 32) {
    for (int i = 0; i < 16; ++i) {
      tmp[8 * (i / 4) + i % 4] = row[c + i];
      tmp[8 * (i / 4) + 4 + i % 4] = row[c + 16 + i];
    }
    std::memcpy(row + c, tmp, sizeof(tmp));
  }
}

// The cache rows of one tile of (up to kTile) keys, for KV head 0.
template <typename T>
struct TileRef {
  const T* k[kTile];
  const T* v[kTile];
  alignas(64) int32_t pos[kTile];  // key positions; INT_MAX on padding lanes (always masked)
  int n = 0;
};

// Resolve visible-list indices [t0, t0 + n) of sequence s (consecutive positions walk the block table).
template <typename T>
inline void resolve_tile(const Problem<T>& P, const Seq& s, int t0, int n, TileRef<T>& tr) {
  const int bs = P.block_size;
  int blk_idx = 0, off = 0, prev = -2;
  for (int j = 0; j < n; ++j) {
    const int p = position_of(s, t0 + j);
    if (p == prev + 1 && off + 1 < bs) {
      ++off;
    } else {
      blk_idx = p / bs;
      off = p % bs;
    }
    prev = p;
    const int64_t blk = s.table[blk_idx];
    tr.k[j] = P.k + blk * P.k_s0 + off * P.k_s1;
    tr.v[j] = P.v + blk * P.v_s0 + off * P.v_s1;
    tr.pos[j] = p;
  }
  for (int j = n; j < kTile; ++j) {  // padding lanes: valid memory, always masked
    tr.k[j] = tr.k[0];
    tr.v[j] = tr.v[0];
    tr.pos[j] = INT_MAX;
  }
  tr.n = n;
}

// Prefetch the cache lines of [p, p + count) into L1.
template <typename T>
inline void prefetch_span(const T* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  const char* end = reinterpret_cast<const char*>(p + count);
  for (; c < end; c += 64) __builtin_prefetch(c, 0, 3);
}

// ---------------------------------------------------------------------------------------------------
// One work item: a chunk of one sequence's visible keys, all KV heads, all query rows.
// NC = D / 16 on the AVX-512 path; NC == 0 selects the portable scalar path (any D).

template <typename T, int NC>
void run_item(const Problem<T>& P, const Item& it, Workspace& ws) {
  const Seq& s = P.seqs[it.seq];
  const int D = NC > 0 ? NC * 16 : P.D;
  const int H = P.Hkv, G = P.G, Q = s.q_len, R = G * Q;
  constexpr bool kUseDpbf16 =
#if MS_HAVE_AVX512 && defined(__AVX512BF16__)
      NC > 0 && NC % 2 == 0 && std::is_same<T, c10::BFloat16>::value;  // 32 bf16 per dot product
#else
      false;
#endif
  // bf16 P @ V with AVX512-BF16 dot products (P rounded to bf16 as GPU flash attention does); the
  // accumulator rows are then kept in the lane order of pv_rows_bf16 and put back in order at the end.
  constexpr bool kBf16PV = kUseDpbf16 && MS_BF16_PV;

  // Query rows of this sequence, laid out [h][r = g * Q + qi][D].
  ws.qbuf.resize(static_cast<size_t>(H) * R * D);
  if (kUseDpbf16) ws.qraw.resize(static_cast<size_t>(H) * R * D);
  ws.probs.resize(static_cast<size_t>(R) * kTile);
  ws.live.resize(R);
  if (kBf16PV) ws.pbf.resize(static_cast<size_t>(R) * kTile);
#if MS_HAVE_AVX512
  ws.lsum.assign(static_cast<size_t>(H) * R * kTile, 0.f);
#endif
  for (int h = 0; h < H; ++h)
    for (int g = 0; g < G; ++g)
      for (int qi = 0; qi < Q; ++qi) {
        const T* src = P.q + (s.tok0 + qi) * P.q_s0 + (h * G + g) * P.q_s1;
        const size_t row = (static_cast<size_t>(h) * R + g * Q + qi) * D;
        for (int d = 0; d < D; ++d) ws.qbuf[row + d] = to_f32(src[d]) * P.qscale;
        if (kUseDpbf16) std::memcpy(&ws.qraw[row], src, D * sizeof(uint16_t));
      }

  float* acc = P.acc + it.row_off * D;  // [H][R][D]
  float* mrow = P.m + it.row_off;       // [H][R]
  float* lrow = P.l + it.row_off;
  std::fill(acc, acc + static_cast<size_t>(H) * R * D, 0.f);
  std::fill(mrow, mrow + H * R, kNegInf);
  std::fill(lrow, lrow + H * R, 0.f);

  // Tiles are resolved (positions -> cache rows) kPrefetchTiles ahead of use and their rows prefetched:
  // the block table scatters blocks, so the hardware prefetcher cannot follow the stream by itself.
  TileRef<T> ring[kPrefetchTiles + 1];
  const int64_t k_span = (H - 1) * P.k_s2 + D, v_span = (H - 1) * P.v_s2 + D;  // elements per token, all heads
  auto prepare = [&](int t0, TileRef<T>& tr) {
    resolve_tile(P, s, t0, std::min(kTile, it.ke - t0), tr);
    for (int j = 0; j < tr.n; ++j) {
      prefetch_span(tr.k[j], k_span);
      prefetch_span(tr.v[j], v_span);
    }
  };
  for (int i = 0; i < kPrefetchTiles; ++i)
    if (it.kb + i * kTile < it.ke) prepare(it.kb + i * kTile, ring[i]);

  for (int t0 = it.kb, ti = 0; t0 < it.ke; t0 += kTile, ++ti) {
    const int ahead = t0 + kPrefetchTiles * kTile;
    if (ahead < it.ke) prepare(ahead, ring[(ti + kPrefetchTiles) % (kPrefetchTiles + 1)]);
    const TileRef<T>& tr = ring[ti % (kPrefetchTiles + 1)];
    const int n = tr.n;
    const T* const* kptr = tr.k;
    const T* const* vptr = tr.v;
    const int32_t* pos = tr.pos;

    for (int h = 0; h < H; ++h) {
      const int64_t koff = h * P.k_s2, voff = h * P.v_s2;
      float* probs = ws.probs.data();

      // ---- scores: probs[r][j] = (q_r . k_j) * scale * log2(e), -inf where invisible
#if MS_HAVE_AVX512
      if constexpr (NC > 0) {
        const __m512i posv = _mm512_load_si512(pos);
        if constexpr (kUseDpbf16) {
#if defined(__AVX512BF16__)
          // Transposed tile: each key pair row is one vector over the 16 keys, so a row's 16 scores
          // accumulate lane-wise with no horizontal reduction; blocks of 8 rows share each load.
          transpose_keys_bf16<NC>(kptr, koff, ws.kt);
          const uint32_t* qh = reinterpret_cast<const uint32_t*>(ws.qraw.data()) + static_cast<size_t>(h) * R * (D / 2);
          for (int r0 = 0; r0 < R; r0 += 8) {
            const int rb = std::min(8, R - r0);
            const uint32_t* qp[8];
            for (int i = 0; i < rb; ++i) qp[i] = qh + static_cast<size_t>(r0 + i) * (D / 2);
            __m512 sc[8];
            switch (rb) {
              case 1: qk_rows_bf16<NC, 1>(ws.kt, qp, sc); break;
              case 2: qk_rows_bf16<NC, 2>(ws.kt, qp, sc); break;
              case 3: qk_rows_bf16<NC, 3>(ws.kt, qp, sc); break;
              case 4: qk_rows_bf16<NC, 4>(ws.kt, qp, sc); break;
              case 5: qk_rows_bf16<NC, 5>(ws.kt, qp, sc); break;
              case 6: qk_rows_bf16<NC, 6>(ws.kt, qp, sc); break;
              case 7: qk_rows_bf16<NC, 7>(ws.kt, qp, sc); break;
              default: qk_rows_bf16<NC, 8>(ws.kt, qp, sc); break;
            }
            for (int i = 0; i < rb; ++i) {
              const int r = r0 + i, qi = r % Q;
              const __mmask16 vis = _mm512_cmple_epi32_mask(posv, _mm512_set1_epi32(s.ctx + qi)) &
                                    _mm512_cmpgt_epi32_mask(posv, _mm512_set1_epi32(s.floor0 + qi));
              const __m512 v = _mm512_mul_ps(sc[i], _mm512_set1_ps(P.qscale));
              _mm512_storeu_ps(probs + r * kTile, _mm512_mask_blend_ps(vis, _mm512_set1_ps(kNegInf), v));
            }
          }
#endif
        } else {
          for (int r = 0; r < R; ++r) {
            __m512 part[kTile];
            const float* qr = ws.qbuf.data() + (static_cast<size_t>(h) * R + r) * D;
            __m512 qv[NC];
            for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(qr + 16 * c);
            for (int j = 0; j < kTile; ++j) {
              const T* kr = kptr[j] + koff;
              __m512 a = _mm512_mul_ps(qv[0], load16<T>(kr));
              for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[c], load16<T>(kr + 16 * c), a);
              part[j] = a;
            }
            const __m512 sc = reduce16(part);
            const __mmask16 vis = _mm512_cmple_epi32_mask(posv, _mm512_set1_epi32(s.ctx + r % Q)) &
                                  _mm512_cmpgt_epi32_mask(posv, _mm512_set1_epi32(s.floor0 + r % Q));
            _mm512_storeu_ps(probs + r * kTile, _mm512_mask_blend_ps(vis, _mm512_set1_ps(kNegInf), sc));
          }
        }
      } else
#endif
      {
        for (int r = 0; r < R; ++r) {
          const float* qr = ws.qbuf.data() + (static_cast<size_t>(h) * R + r) * D;
          const int limit = s.ctx + r % Q, floor = s.floor0 + r % Q;
          for (int j = 0; j < kTile; ++j) {
            float sc = kNegInf;
            if (pos[j] <= limit && pos[j] > floor) {
              const T* kr = kptr[j] + koff;
              float a = 0.f;
              for (int d = 0; d < D; ++d) a += qr[d] * to_f32(kr[d]);
              sc = a;
            }
            probs[r * kTile + j] = sc;
          }
        }
      }

      // ---- online softmax: probs <- exp2(scores - m); l, m updated; acc rescaled when m moves
      float* m = mrow + h * R;
      float* a_h = acc + static_cast<size_t>(h) * R * D;
      for (int r = 0; r < R; ++r) {
        float* pr = probs + r * kTile;
#if MS_HAVE_AVX512
        // Lazy rescaling: m only moves when a score exceeds it by more than kLazyRescale (so
        // probabilities stay <= 2^kLazyRescale); the row sum is kept per lane in lsum and reduced once
        // at the end of the item. Both save horizontal reductions in the common case.
        const __m512 sv = _mm512_loadu_ps(pr);
        float* lv = ws.lsum.data() + (static_cast<size_t>(h) * R + r) * kTile;
        if (_mm512_cmp_ps_mask(sv, _mm512_set1_ps(m[r] + kLazyRescale), _CMP_GT_OQ)) {
          const float m_new = _mm512_reduce_max_ps(sv);     // > m[r] + kLazyRescale, finite
          const float alpha = std::exp2(m[r] - m_new);      // 0 when m[r] == -inf
          _mm512_storeu_ps(lv, _mm512_mul_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(alpha)));
          float* ar = a_h + static_cast<size_t>(r) * D;
          for (int d = 0; d < D; ++d) ar[d] *= alpha;
          m[r] = m_new;
        }
        const __mmask16 vis = _mm512_cmp_ps_mask(sv, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
        ws.live[r] = vis != 0;
        if (!vis) continue;  // this row sees none of the tile's keys
        const __m512 p = _mm512_maskz_mov_ps(vis, exp2_ps(_mm512_sub_ps(sv, _mm512_set1_ps(m[r]))));
        _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), p));
        if constexpr (kBf16PV) {
#if defined(__AVX512BF16__)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ws.pbf.data() + r * kTile), (__m256i)_mm512_cvtneps_pbh(p));
#endif
        } else {
          _mm512_storeu_ps(pr, p);
        }
#else
        float tile_max = kNegInf;
        for (int j = 0; j < kTile; ++j) tile_max = std::max(tile_max, pr[j]);
        ws.live[r] = tile_max != kNegInf;
        if (!ws.live[r]) continue;  // this row sees none of the tile's keys
        const float m_new = std::max(m[r], tile_max);
        const float alpha = m_new == m[r] ? 1.f : std::exp2(m[r] - m_new);  // 0 when m[r] == -inf
        float psum = 0.f;
        for (int j = 0; j < kTile; ++j) {
          pr[j] = pr[j] == kNegInf ? 0.f : std::exp2(pr[j] - m_new);
          psum += pr[j];
        }
        float* l = lrow + h * R;
        l[r] = l[r] * alpha + psum;
        m[r] = m_new;
        if (alpha != 1.f) {
          float* ar = a_h + static_cast<size_t>(r) * D;
          for (int d = 0; d < D; ++d) ar[d] *= alpha;
        }
#endif
      }

      // ---- acc[r] += sum_j probs[r][j] * v_j
#if MS_HAVE_AVX512
      if constexpr (kBf16PV) {
#if defined(__AVX512BF16__)
        const T* vrow[kTile];
        for (int j = 0; j < n; ++j) vrow[j] = vptr[j] + voff;
        float* grp_acc[4];
        const uint32_t* grp_p[4];
        int cnt = 0;
        auto flush = [&]() {
          switch (cnt) {
            case 1: pv_rows_bf16<NC, 1>(grp_acc, grp_p, vrow, n); break;
            case 2: pv_rows_bf16<NC, 2>(grp_acc, grp_p, vrow, n); break;
            case 3: pv_rows_bf16<NC, 3>(grp_acc, grp_p, vrow, n); break;
            case 4: pv_rows_bf16<NC, 4>(grp_acc, grp_p, vrow, n); break;
            default: break;
          }
          cnt = 0;
        };
        for (int r = 0; r < R; ++r) {
          if (!ws.live[r]) continue;
          grp_acc[cnt] = a_h + static_cast<size_t>(r) * D;
          grp_p[cnt] = reinterpret_cast<const uint32_t*>(ws.pbf.data() + r * kTile);
          if (++cnt == 4) flush();
        }
        flush();
#endif
      } else if constexpr (NC > 0) {
        const T* vrow[kTile];
        for (int j = 0; j < n; ++j) vrow[j] = vptr[j] + voff;
        // live rows in groups of up to 4 (accumulators held in registers)
        float* grp_acc[4];
        const float* grp_p[4];
        int cnt = 0;
        auto flush = [&]() {
          switch (cnt) {
            case 1: pv_rows<T, NC, 1>(grp_acc, grp_p, vrow, n); break;
            case 2: pv_rows<T, NC, 2>(grp_acc, grp_p, vrow, n); break;
            case 3: pv_rows<T, NC, 3>(grp_acc, grp_p, vrow, n); break;
            case 4: pv_rows<T, NC, 4>(grp_acc, grp_p, vrow, n); break;
            default: break;
          }
          cnt = 0;
        };
        for (int r = 0; r < R; ++r) {
          if (!ws.live[r]) continue;
          grp_acc[cnt] = a_h + static_cast<size_t>(r) * D;
          grp_p[cnt] = probs + r * kTile;
          if (++cnt == 4) flush();
        }
        flush();
      } else
#endif
      {
        for (int r = 0; r < R; ++r) {
          if (!ws.live[r]) continue;
          float* ar = a_h + static_cast<size_t>(r) * D;
          const float* pr = probs + r * kTile;
          for (int j = 0; j < n; ++j) {
            const T* vr = vptr[j] + voff;
            const float pj = pr[j];
            for (int d = 0; d < D; ++d) ar[d] += pj * to_f32(vr[d]);
          }
        }
      }
    }
  }
#if MS_HAVE_AVX512
  for (int r = 0; r < H * R; ++r) lrow[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(ws.lsum.data() + r * kTile));
#endif
  if constexpr (kBf16PV) {
    for (int r = 0; r < H * R; ++r) unpermute_bf16_pv_row(acc + static_cast<size_t>(r) * D, D);
  }
}

// Merge the chunks of sequence b and write its output rows (dtype T).
template <typename T>
void merge_sequence(const Problem<T>& P, const Seq& s, T* out, int64_t o_s0, int64_t o_s1) {
  const int H = P.Hkv, G = P.G, Q = s.q_len, R = G * Q, D = P.D;
  std::vector<float> tmp(D);
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) {
      const int g = r / Q, qi = r % Q;
      float m_max = kNegInf;
      for (int c = 0; c < s.n_items; ++c) m_max = std::max(m_max, P.m[P.items[s.first_item + c].row_off + h * R + r]);
      std::fill(tmp.begin(), tmp.end(), 0.f);
      float l_tot = 0.f;
      if (m_max != kNegInf) {
        for (int c = 0; c < s.n_items; ++c) {
          const int64_t row = P.items[s.first_item + c].row_off + h * R + r;
          if (P.m[row] == kNegInf) continue;  // this chunk saw nothing for this row
          const float w = std::exp2(P.m[row] - m_max);
          l_tot += w * P.l[row];
          const float* a = P.acc + row * D;
          for (int d = 0; d < D; ++d) tmp[d] += w * a[d];
        }
      }
      // Every row sees at least its own token, so l_tot > 0; guard anyway (empty -> zeros).
      const float inv = l_tot > 0.f ? 1.f / l_tot : 0.f;
      T* dst = out + (s.tok0 + qi) * o_s0 + (h * G + g) * o_s1;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(tmp[d] * inv);
    }
}

template <typename T>
void run(Problem<T>& P, T* out, int64_t o_s0, int64_t o_s1) {
  const int n_items = static_cast<int>(P.items.size());
  // Longest items first, handed out dynamically (robust to uneven items and to busy cores).
  std::vector<int> order(n_items);
  for (int i = 0; i < n_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Item &x = P.items[a], &y = P.items[b];
    const int64_t wx = int64_t(x.ke - x.kb) * (4 + P.seqs[x.seq].q_len);
    const int64_t wy = int64_t(y.ke - y.kb) * (4 + P.seqs[y.seq].q_len);
    return wx > wy;
  });
  std::atomic<int> next{0};
  const int workers = std::max(1, std::min<int>(at::get_num_threads(), n_items));
  auto work = [&](int64_t, int64_t) {
    Workspace ws;
    for (int i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = P.items[order[i]];
      switch (P.D % 16 == 0 ? P.D / 16 : 0) {
#if MS_HAVE_AVX512
        case 4: run_item<T, 4>(P, it, ws); break;
        case 8: run_item<T, 8>(P, it, ws); break;
        case 2: run_item<T, 2>(P, it, ws); break;
        case 16: run_item<T, 16>(P, it, ws); break;
#endif
        default: run_item<T, 0>(P, it, ws); break;
      }
    }
  };
  at::parallel_for(0, workers, 1, work);
  const int B = static_cast<int>(P.seqs.size());
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      if (P.seqs[b].q_len > 0) merge_sequence(P, P.seqs[b], out, o_s0, o_s1);  // no items: zeros
  });
}


}  // namespace

// Entry point (see the header comment for shapes). scale: softmax scale (usually 1 / sqrt(D)).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start, int64_t sink_len, const at::Tensor& window_starts,
                           double scale, int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention: q [T, Hq, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: k_cache and v_cache shapes differ");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and caches must share a dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_attention: cache head_dim must be contiguous");
  const int64_t D = q.size(2), Hq = q.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "paged_attention: head_dim mismatch");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "paged_attention: Hq must be a multiple of Hkv");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start, &window_starts})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(), "paged_attention: metadata must be int32 CPU tensors");
  TORCH_CHECK(block_tables.dim() == 2, "paged_attention: block_tables [B, max_blocks]");
  const int64_t B = seq_lens.numel();
  TORCH_CHECK(block_tables.size(0) == B && query_start.numel() == B + 1 && window_starts.numel() == B,
              "paged_attention: metadata sizes disagree with B = seq_lens.numel()");

  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens_t = seq_lens.contiguous(), qs_t = query_start.contiguous(), ws_t = window_starts.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* qs = qs_t.data_ptr<int32_t>();
  const int32_t* wins = ws_t.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), max_blocks = tables.size(1);
  TORCH_CHECK(qs[0] == 0 && qs[B] == q.size(0), "paged_attention: query_start must run from 0 to T");
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT_MAX / 2, "paged_attention: sliding_window out of range");
  const int W = static_cast<int>(sliding_window);

  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t G = Hq / Hkv;

  // Sequences, visible ranges and chunking.
  std::vector<Seq> seqs(B);
  int64_t total_keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    Seq& s = seqs[b];
    const int q_len = qs[b + 1] - qs[b];
    const int n = lens[b];
    TORCH_CHECK(q_len >= 0 && n >= q_len, "paged_attention: seq_lens[b] must be >= q_len(b)");
    TORCH_CHECK((n + block_size - 1) / block_size <= max_blocks, "paged_attention: block table too short");
    s.table = tables.data_ptr<int32_t>() + b * max_blocks;
    for (int64_t i = 0; i < (n + block_size - 1) / block_size; ++i)
      TORCH_CHECK(s.table[i] >= 0 && s.table[i] < num_blocks, "paged_attention: block id out of range");
    s.tok0 = qs[b];
    s.q_len = q_len;
    s.ctx = n - q_len;
    s.floor0 = W > 0 ? s.ctx - W : INT_MIN / 2;
    // first position any row sees under the sliding window, rounded down to a tile (see the header)
    const int lo = W > 0 ? std::max(s.ctx - W + 1, 0) / kTile * kTile : 0;
    const int sink_end = static_cast<int>(std::min<int64_t>(std::max<int64_t>(sink_len, 0), n));
    const int win = std::max(std::max(std::max(wins[b], 0), sink_end), lo);
    s.s0 = std::min(lo, sink_end);
    s.n0 = sink_end - s.s0;
    s.s1 = win;
    s.n_vis = q_len > 0 ? s.n0 + (n - win) : 0;
    total_keys += s.n_vis;
  }
  const int threads = at::get_num_threads();
  int64_t chunk = std::numeric_limits<int>::max();
  if (threads > 1) {  // ~8 items per thread so the dynamic schedule can balance; never tiny chunks
    chunk = std::max<int64_t>(kMinChunk, (total_keys + 8 * threads - 1) / (8 * threads));
    chunk = (chunk + kTile - 1) / kTile * kTile;
  }
  std::vector<Item> items;
  int64_t rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    Seq& s = seqs[b];
    s.first_item = static_cast<int>(items.size());
    s.n_items = 0;
    for (int64_t kb = 0; kb < s.n_vis; kb += chunk) {
      items.push_back({static_cast<int>(b), static_cast<int>(kb), static_cast<int>(std::min<int64_t>(s.n_vis, kb + chunk)), rows});
      rows += Hkv * G * s.q_len;
      ++s.n_items;
    }
  }
  at::Tensor scratch = at::empty({rows * (D + 2)}, q.options().dtype(at::kFloat));

  auto launch = [&](auto tag) {
    using scalar_t = decltype(tag);
    Problem<scalar_t> P;
    P.q = qc.data_ptr<scalar_t>();
    P.q_s0 = qc.stride(0);
    P.q_s1 = qc.stride(1);
    P.k = k_cache.data_ptr<scalar_t>();
    P.k_s0 = k_cache.stride(0); P.k_s1 = k_cache.stride(1); P.k_s2 = k_cache.stride(2);
    P.v = v_cache.data_ptr<scalar_t>();
    P.v_s0 = v_cache.stride(0); P.v_s1 = v_cache.stride(1); P.v_s2 = v_cache.stride(2);
    P.Hkv = static_cast<int>(Hkv);
    P.G = static_cast<int>(G);
    P.D = static_cast<int>(D);
    P.block_size = static_cast<int>(block_size);
    P.qscale = static_cast<float>(scale) * kLog2e;
    P.seqs = std::move(seqs);
    P.items = std::move(items);
    P.acc = scratch.data_ptr<float>();
    P.m = P.acc + rows * D;
    P.l = P.m + rows;
    run(P, out.data_ptr<scalar_t>(), out.stride(0), out.stride(1));
  };
  switch (q.scalar_type()) {
    case at::kFloat: launch(float{}); break;
    case at::kBFloat16: launch(c10::BFloat16{}); break;
    case at::kHalf: launch(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return out;
}

// Which fast path this build uses (for logs and benchmarks).
std::string build_info() {
  std::string s = MS_HAVE_AVX512 ? "avx512" : "scalar";
#if defined(__AVX512BF16__)
  s += "+bf16dot";
#endif
#if defined(_OPENMP)
  s += "+openmp";  // at::parallel_for spreads the work items over torch's threads
#endif
  return s;
}

// skinny_linear.cpp
bool skinny_linear_supported();
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over the KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start"), py::arg("sink_len"), py::arg("window_starts"), py::arg("scale"),
        py::arg("sliding_window") = 0);
  m.def("build_info", &build_info);
  m.def("skinny_linear", &skinny_linear, "bf16 y = x @ w^T (+ bias) for few rows (CPU, AVX512-BF16)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("skinny_linear_supported", &skinny_linear_supported);
}
