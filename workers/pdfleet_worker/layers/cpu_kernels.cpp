// CPU kernels of the engine, built on first use by cpu_kernels.py (g++ -O3 -march=native) and
// registered as torch ops under pdfleet::. Plain C++ in GCC's generic vectors that the compiler lowers to the
// machine's width; intrinsics only for what they cannot say (AVX512-BF16's conversions and dot products).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <sched.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// One register of floats, in GCC's generic vectors: L = 16 lanes where the target has AVX-512, else 8.
// NOTE: a vector wider than the target's registers is legal but is lowered badly: 16-lane code built
// for an AVX2-only EPYC spilled every accumulator through the stack in 16-byte pieces and read the
// decode kernel's KV at 9-11 GB/s where the same machine reads ~23 GB/s (measured). Every loop below is
// written in L, so a build takes the width its machine has.
#if defined(__AVX512F__)
constexpr int64_t L = 16;
#else
constexpr int64_t L = 8;
#endif
typedef float vf __attribute__((vector_size(L * 4)));
// Vector registers a kernel keeps accumulators in: of AVX-512's 32, AVX2's 16, the rest for operands.
constexpr int64_t V_REGS = L == 16 ? 24 : 12;
typedef uint32_t vu __attribute__((vector_size(L * 4)));
typedef int32_t vi __attribute__((vector_size(L * 4)));
typedef uint16_t vh __attribute__((vector_size(L * 2)));
typedef int8_t vb __attribute__((vector_size(L)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#if defined(__AVX512BF16__)
inline vf loadv(const c10::BFloat16* p) {  // bf16 is the top half of an fp32: one widening load, one shift
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}
#else
inline vf loadv(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
#endif
inline vf loadv(const int8_t* p) {
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vf);
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(vf v) {  // a tree, not L dependent adds
  typedef float v4f __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  typedef float v8f __attribute__((vector_size(32)));
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vf a = v;
#endif
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at every block
// boundary: while one block is read, the same row of the next one is requested.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(KV)); off += 64) __builtin_prefetch(p + off, 0, 3);
}

// exp(x) = 2^n * poly(x - n ln 2) for the n = floor(x / ln 2 + 1/2) the caller rounded: Cephes expf's range
// reduction (ln 2 in two parts) and degree-5 polynomial, for a float or L lanes alike.
template <typename V>
inline V exp_reduced(V x, V n) {
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial,
// about 1 ulp); written so that the loop calling it vectorizes.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float p = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp_nonpositive on L lanes at once, in generic vectors (GCC left the scalar one unvectorized
// in the prefill kernel's loops: 55% of its time, measured).
inline vf expv_nonpositive(vf x) {
  x = x < -87.0f ? vf{} - 87.0f : x;
  const vf fx = x * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);  // truncated toward zero
  n = n > fx ? n - 1.0f : n;                                                  // floor
  const vf p = exp_reduced(x, n);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// L vectors in, one out: lane i is the sum of a[i]'s lanes. log2(L) levels of pairwise shuffles and
// adds (L - 1 pairs) where L separate hsums take L trees; the lanes never mix, so a[i] past the rows in
// use only has to be defined.
#if defined(__AVX512F__)
inline vf hsum_rows(const vf* a) {
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline vf hsum_rows(const vf* a) {
  vf c[4], d[2];
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// One (sequence, KV head): the G query heads of the group against the sequence's context, read
// once through its block table. Two passes over the context: scores (K), then values (V). The
// scores are made L keys at a time, across block edges: each key's G partial-product vectors
// are kept and one hsum_rows per query head reduces the L (bf16 keys are half the bytes of fp32
// ones, so a horizontal sum per key and head, not the memory, bounded the bf16 pass).
// q: [G, DV] vectors, already scaled; acc: [G, DV] vectors; part: [G, L] vectors of scratch.
// DV = D / L (NDV > 0: known at compile time).
template <int NDV, typename KV>
void decode_one(const vf* q, int64_t G, int64_t DV_rt, const KV* k_head, const KV* v_head, const float* k_scale,
                const float* v_scale, const int64_t* table, int64_t ctx, int64_t block_size, float* scores, vf* acc,
                vf* part) {
  const int64_t DV = NDV > 0 ? NDV : DV_rt;
  const int64_t D = DV * L;
  const int64_t block_elems = block_size * D;
  const int64_t nblocks = (ctx + block_size - 1) / block_size;
  int64_t j = 0, o = 0;  // block index and row in it of key t0 + r, kept without a division per key
  float row_scale[L];
  for (int64_t t0 = 0; t0 < ctx; t0 += L) {
    const int64_t m = std::min(L, ctx - t0);
    for (int64_t r = 0; r < m; ++r) {
      const KV* row = k_head + table[j] * block_elems + o * D;
      if (j + 1 < nblocks) prefetch_row(k_head + table[j + 1] * block_elems + o * D, D);
      row_scale[r] = k_scale ? k_scale[table[j]] : 1.0f;
      if (NDV > 0 && NDV <= V_REGS - 4) {  // the row in registers, read once for the G heads
        vf kr[NDV > 0 ? NDV : 1];
        for (int64_t c = 0; c < DV; ++c) kr[c] = loadv(row + c * L);
        for (int64_t g = 0; g < G; ++g) {
          vf s = q[g * DV] * kr[0];
          for (int64_t c = 1; c < DV; ++c) s += q[g * DV + c] * kr[c];
          part[g * L + r] = s;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          vf s = q[g * DV] * loadv(row);
          for (int64_t c = 1; c < DV; ++c) s += q[g * DV + c] * loadv(row + c * L);
          part[g * L + r] = s;
        }
      }
      if (++o == block_size) o = 0, ++j;
    }
    for (int64_t r = m; r < L; ++r) {
      row_scale[r] = 0.0f;
      for (int64_t g = 0; g < G; ++g) part[g * L + r] = vf{};
    }
    const vf rs = loadv(row_scale);
    for (int64_t g = 0; g < G; ++g) {
      const vf sums = hsum_rows(part + g * L) * rs;
      if (m == L) {
        std::memcpy(scores + g * ctx + t0, &sums, sizeof sums);
      } else {
        for (int64_t r = 0; r < m; ++r) scores[g * ctx + t0 + r] = sums[r];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * ctx;
    const int64_t nv = ctx / L * L;
    vf vmx = vf{} - INFINITY;
    for (int64_t t = 0; t < nv; t += L) {
      const vf x = loadv(s + t);
      vmx = x > vmx ? x : vmx;
    }
    float m = -INFINITY;
    for (int64_t c = 0; c < L; ++c) m = std::max(m, vmx[c]);
    for (int64_t t = nv; t < ctx; ++t) m = std::max(m, s[t]);
    vf vsum = vf{};
    for (int64_t t = 0; t < nv; t += L) {
      const vf e = expv_nonpositive(loadv(s + t) - m);
      vsum += e;
      storev(s + t, e);
    }
    float sum = hsum(vsum);
    for (int64_t t = nv; t < ctx; ++t) {
      s[t] = exp_nonpositive(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < nv; t += L) storev(s + t, loadv(s + t) * inv);
    for (int64_t t = nv; t < ctx; ++t) s[t] *= inv;
  }
  // Values. With head_dim known at compile time the accumulators of GB query heads (CH vectors
  // each) stay in registers over the whole context and acc is written once at the end: kept in
  // memory, every key cost G * DV loads and stores of it (half the kernel's time on an AVX2 EPYC,
  // measured). Each V row is read once per (group, chunk), from L1 after the first.
  if (NDV <= 0) {
    for (int64_t i = 0; i < G * DV; ++i) acc[i] = vf{};
    for (int64_t t0 = 0, j = 0; t0 < ctx; t0 += block_size, ++j) {
      const int64_t n = std::min(block_size, ctx - t0);
      const int64_t blk = table[j];
      const KV* v = v_head + blk * block_elems;
      const KV* next = t0 + block_size < ctx ? v_head + table[j + 1] * block_elems : v;
      const float vs = v_scale ? v_scale[blk] : 1.0f;
      for (int64_t t = 0; t < n; ++t) {
        const KV* row = v + t * D;
        prefetch_row(next + t * D, D);
        for (int64_t c = 0; c < DV; ++c) {
          const vf vr = loadv(row + c * L);
          for (int64_t g = 0; g < G; ++g) acc[g * DV + c] += (scores[g * ctx + t0 + t] * vs) * vr;
        }
      }
    }
    return;
  }
  constexpr int64_t CH = NDV <= V_REGS ? NDV : 8;  // vectors of a row per pass
  static_assert(NDV <= 0 || NDV % CH == 0, "a row splits into whole chunks");
  constexpr int64_t GB = NDV <= 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(4, V_REGS / CH));
  constexpr int64_t NA = NDV > 0 ? CH : 1;
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t gn = std::min(GB, G - g0);
    for (int64_t c0 = 0; c0 < DV; c0 += NA) {
      vf a[GB][NA];
      for (int64_t gg = 0; gg < GB; ++gg)
        for (int64_t c = 0; c < NA; ++c) a[gg][c] = vf{};
      for (int64_t t0 = 0, j = 0; t0 < ctx; t0 += block_size, ++j) {
        const int64_t n = std::min(block_size, ctx - t0);
        const int64_t blk = table[j];
        const KV* v = v_head + blk * block_elems + c0 * L;
        const KV* next = t0 + block_size < ctx ? v_head + table[j + 1] * block_elems : v;
        const float vs = v_scale ? v_scale[blk] : 1.0f;
        for (int64_t t = 0; t < n; ++t) {
          const KV* row = v + t * D;
          if (g0 == 0 && c0 == 0) prefetch_row(next + t * D, D);
          for (int64_t gg = 0; gg < GB; ++gg) {
            if (gg < gn) {
              const float w = scores[(g0 + gg) * ctx + t0 + t] * vs;
              for (int64_t c = 0; c < NA; ++c) a[gg][c] += w * loadv(row + c * L);
            }
          }
        }
      }
      for (int64_t gg = 0; gg < gn; ++gg)
        for (int64_t c = 0; c < NA; ++c) acc[(g0 + gg) * DV + c0 + c] = a[gg][c];
    }
  }
}

template <typename Out>
inline float scalar(Out x) { return static_cast<float>(x); }

template <typename KV, typename Out>
void decode_all(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const c10::optional<at::Tensor>& scale,
                const at::Tensor& tables, const at::Tensor& lens, double softmax_scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = kv.size(1), NB = kv.size(2), BS = kv.size(3), W = tables.size(1);
  const int64_t G = Hq / Hkv, DV = D / L;
  const KV* kv_ptr = kv.data_ptr<KV>();
  const float* scale_ptr = scale ? scale->data_ptr<float>() : nullptr;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  Out* out_ptr = out.data_ptr<Out>();
  const Out* q_ptr = q.data_ptr<Out>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(softmax_scale);
  // A small step (a lone decode over a short context) stays on the calling thread: an OpenMP
  // region costs more than it saves there, and far more when another process holds a core.
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += len_ptr[b];
  const int64_t grain = work * Hkv < 8192 ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<vf> qv(G * DV), acc(G * DV), part(G * L);
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      float* qf = reinterpret_cast<float*>(qv.data());
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = scalar(q_ptr[b * qs0 + (h * G + g) * qs1 + d]) * fscale;
      const KV* k_head = kv_ptr + (0 * Hkv + h) * NB * BS * D;
      const KV* v_head = kv_ptr + (1 * Hkv + h) * NB * BS * D;
      const float* ks = scale_ptr ? scale_ptr + (0 * Hkv + h) * NB : nullptr;
      const float* vs = scale_ptr ? scale_ptr + (1 * Hkv + h) * NB : nullptr;
      const int64_t ctx = len_ptr[b];
      scores.resize(G * ctx);
      const int64_t* table = table_ptr + b * W;
      if (DV == 4)
        decode_one<4, KV>(qv.data(), G, DV, k_head, v_head, ks, vs, table, ctx, BS, scores.data(), acc.data(),
                                part.data());
      else if (DV == 8)
        decode_one<8, KV>(qv.data(), G, DV, k_head, v_head, ks, vs, table, ctx, BS, scores.data(), acc.data(),
                                part.data());
      else if (DV == 16)
        decode_one<16, KV>(qv.data(), G, DV, k_head, v_head, ks, vs, table, ctx, BS, scores.data(), acc.data(),
                                 part.data());
      else
        decode_one<0, KV>(qv.data(), G, DV, k_head, v_head, ks, vs, table, ctx, BS, scores.data(), acc.data(),
                                part.data());
      const float* a = reinterpret_cast<const float*>(acc.data());
      Out* o = out_ptr + b * os0 + h * G * os1;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * os1 + d] = static_cast<Out>(a[g * D + d]);
    }
  });
}

// out[b, hq, :] = softmax(q[b, hq] . K[ctx_b]^T * scale) V[ctx_b], reading the pool through the
// block table. q, out: [B, Hq, D] (last dim contiguous); kv: [2, Hkv, NB, BS, D] contiguous (float,
// bf16 or int8 with scale [2, Hkv, NB]); tables: [B, W] int64; lens: [B] int64, 1 <= lens[b] <= W * BS.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv,
                            const c10::optional<at::Tensor>& scale, const at::Tensor& tables,
                            const at::Tensor& lens, double softmax_scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, Hq, D] of the same shape");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dimension");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(4) == q.size(2) && kv.is_contiguous(),
              "kv must be a contiguous [2, Hkv, NB, BS, D] pool");
  TORCH_CHECK(q.size(1) % kv.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && tables.is_contiguous() &&
                  lens.is_contiguous() && tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "tables [B, W] and lens [B] must be contiguous int64");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q must share a dtype");
  const bool quantized = kv.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == scale.has_value(), "an int8 pool needs its scales, a float pool none");
  TORCH_CHECK(!quantized || (scale->scalar_type() == at::kFloat && scale->is_contiguous()), "scale must be float32");
  TORCH_CHECK(quantized || kv.scalar_type() == q.scalar_type(), "a float pool must have q's dtype");
  const int64_t cap = tables.size(1) * kv.size(3);
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.size(0); ++b)
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= cap, "context length ", len_ptr[b], " outside [1, ", cap, "]");
  if (q.scalar_type() == at::kFloat) {
    if (quantized) decode_all<int8_t, float>(out, q, kv, scale, tables, lens, softmax_scale);
    else decode_all<float, float>(out, q, kv, scale, tables, lens, softmax_scale);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
    if (quantized) decode_all<int8_t, c10::BFloat16>(out, q, kv, scale, tables, lens, softmax_scale);
    else decode_all<c10::BFloat16, c10::BFloat16>(out, q, kv, scale, tables, lens, softmax_scale);
  }
}

// -- prefill attention ----------------------------------------------------------------------
// A prefill chunk of n queries at positions past..past+n-1 against keys 0..past+n-1, causal.
// NOTE: ATen's CPU flash attention splits keys into blocks of 512, so below 512 keys it computes
// the whole score matrix, the masked half included; its products go through MKL's sgemm, which
// takes its AVX2 path on AMD CPUs (82 GFLOP/s a core on a 2-core EPYC, measured, against 200-226
// for oneDNN's brgemm on the same tiles); and its bf16 path runs no faster than fp32. At 512
// tokens of the small preset that was 6.3 ms a layer, 24-39% of the prefill. Here each task is
// one KV head's query group over a tile of rows, against the key blocks its last row sees: fp32
// brgemm products over blocks of fixed shape (one JIT-compiled kernel per row count, cached by
// ATen) and an fp32 softmax in between. Whether it beats SDPA on a machine is measured at
// start-up (attention.choose_prefill), not assumed.
constexpr int64_t PREFILL_TILE = 64;  // query rows per task
constexpr int64_t KEY_BLOCK = 64;     // keys per product

// Tile p of nt in an order whose two halves carry equal work (tiles grow with their index), so a
// static split over threads stays balanced with any number of KV heads.
inline int64_t zigzag(int64_t p, int64_t nt) { return p % 2 == 0 ? p / 2 : nt - 1 - p / 2; }

// The causal softmax of a tile's scores in place: scores [blocks, M, KEY_BLOCK], row g * m + r is query
// r0 + r (of m) with past + r0 + r + 1 keys in sight; the keys past them and the blocks past its last
// one come out 0.
// NOTE: the keys past a query's position are masked in registers. Setting them to -inf in memory and
// taking their exp back out of the sum lane by lane (as this did) stalled on store forwarding once a
// key, up to 63 times a row: 30% of the bf16 kernel's time at 512 tokens (perf, 2-core Zen 5).
inline void softmax_tile(float* scores_ptr, int64_t M, int64_t m, int64_t blocks, int64_t past, int64_t r0) {
  vi lane;
  for (int64_t i = 0; i < L; ++i) lane[i] = static_cast<int32_t>(i);
  for (int64_t row = 0; row < M; ++row) {
    const int64_t seen = past + r0 + row % m + 1;  // keys this query sees
    const int64_t full = seen / KEY_BLOCK, tail = seen % KEY_BLOCK, used = full + (tail > 0);
    const auto block = [&](int64_t j) { return scores_ptr + (j * M + row) * KEY_BLOCK; };
    // lanes of key block j from column c that this query sees (all but in the tail block)
    const auto seen_lanes = [&](int64_t j, int64_t c) { return j < full ? vi{} - 1 : lane + static_cast<int32_t>(c) < static_cast<int32_t>(tail); };
    vf vmx = vf{} - INFINITY;
    for (int64_t j = 0; j < used; ++j)
      for (int64_t c = 0; c < KEY_BLOCK; c += L) {
        const vf x = seen_lanes(j, c) ? loadv(block(j) + c) : vf{} - INFINITY;
        vmx = x > vmx ? x : vmx;
      }
    float mx = vmx[0];
    for (int64_t c = 1; c < L; ++c) mx = std::max(mx, vmx[c]);
    vf vsum = vf{};
    for (int64_t j = 0; j < used; ++j)
      for (int64_t c = 0; c < KEY_BLOCK; c += L) {
        const vf e16 = seen_lanes(j, c) ? expv_nonpositive(loadv(block(j) + c) - mx) : vf{};
        vsum += e16;
        std::memcpy(block(j) + c, &e16, sizeof e16);
      }
    const float inv = 1.0f / hsum(vsum);
    for (int64_t j = 0; j < used; ++j)
      for (int64_t c = 0; c < KEY_BLOCK; c += L) {
        const vf x = loadv(block(j) + c) * inv;
        std::memcpy(block(j) + c, &x, sizeof x);
      }
    for (int64_t j = used; j < blocks; ++j) std::memset(block(j), 0, KEY_BLOCK * sizeof(float));
  }
}

template <typename Out>
void prefill_rows(at::Tensor& out, const at::Tensor& q, const at::Tensor& kt, const at::Tensor& vb, int64_t past,
                  double softmax_scale) {
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kt.size(0), nkb = kt.size(1);
  const int64_t G = Hq / Hkv, nt = (n + PREFILL_TILE - 1) / PREFILL_TILE;
  const float fscale = static_cast<float>(softmax_scale);
  const Out* q_ptr = q.data_ptr<Out>();
  Out* o_ptr = out.data_ptr<Out>();
  const float* kt_ptr = kt.data_ptr<float>();  // [Hkv, nkb, D, KEY_BLOCK]
  const float* vb_ptr = vb.data_ptr<float>();  // [Hkv, nkb, KEY_BLOCK, D]
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t block_elems = D * KEY_BLOCK;
  at::parallel_for(0, Hkv * nt, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qg(G * PREFILL_TILE * D), acc(G * PREFILL_TILE * D), scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nt, tile = zigzag(i % nt, nt);
      const int64_t r0 = tile * PREFILL_TILE, m = std::min(PREFILL_TILE, n - r0), M = G * m;
      const int64_t e = past + r0 + m, blocks = (e + KEY_BLOCK - 1) / KEY_BLOCK;
      for (int64_t g = 0; g < G; ++g)  // row g * m + r: query r0 + r of head h * G + g, scaled
        for (int64_t r = 0; r < m; ++r) {
          const Out* src = q_ptr + (r0 + r) * qs0 + (h * G + g) * qs1;
          float* dst = qg.data() + (g * m + r) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
        }
      scores.resize(blocks * M * KEY_BLOCK);  // [blocks, M, KEY_BLOCK]
      const float* kh = kt_ptr + h * nkb * block_elems;
      for (int64_t j = 0; j < blocks; ++j)
        at::native::cpublas::brgemm(M, KEY_BLOCK, D, D, KEY_BLOCK, KEY_BLOCK, false, qg.data(), kh + j * block_elems,
                                    scores.data() + j * M * KEY_BLOCK, false);
      softmax_tile(scores.data(), M, m, blocks, past, r0);
      const float* vh = vb_ptr + h * nkb * block_elems;
      for (int64_t j = 0; j < blocks; ++j)
        at::native::cpublas::brgemm(M, D, KEY_BLOCK, KEY_BLOCK, D, D, j > 0, scores.data() + j * M * KEY_BLOCK,
                                    vh + j * block_elems, acc.data(), false);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 0; r < m; ++r) {
          const float* src = acc.data() + (g * m + r) * D;
          Out* dst = o_ptr + (r0 + r) * os0 + (h * G + g) * os1;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Out>(src[d]);
        }
    }
  });
}

// f(std::integral_constant<int, R>{}, row) for the rows of a tile in groups of MAX_R (the register-blocked
// kernels take their row count as a template argument), the last group R = what is left.
template <int MAX_R, typename F>
inline void by_row_groups(int64_t M, F&& f) {
  static_assert(MAX_R == 2 || MAX_R == 4, "groups of 2 or 4 rows");
  for (int64_t row = 0; row < M; row += MAX_R) {
    const int64_t R = std::min<int64_t>(MAX_R, M - row);
    if (R == MAX_R) {
      f(std::integral_constant<int, MAX_R>{}, row);
    } else if constexpr (MAX_R == 4) {
      if (R == 3) f(std::integral_constant<int, 3>{}, row);
      else if (R == 2) f(std::integral_constant<int, 2>{}, row);
      else f(std::integral_constant<int, 1>{}, row);
    } else {
      f(std::integral_constant<int, 1>{}, row);
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 on a CPU with AVX512-BF16 (vdpbf16ps: pairs of bf16 products summed into fp32 lanes, twice the
// fp32 FMA rate). The products of the fp32 path above are the step's second-largest cost after the
// linears (22 of ~195 ms of a 512-token bf16 step of the small preset on a 2-core Zen 5, measured), and
// oneDNN's bf16 brgemm that ATen wraps needs AMX. Keys and values are laid out once per call in bf16
// pairs: K as [Hkv, blocks, D/2, KEY_BLOCK, 2] (a vector holds 16 keys x 2 dims), V as
// [Hkv, blocks, KEY_BLOCK/2, D, 2] (16 dims x 2 keys). The scores and the softmax stay fp32; the
// probabilities are rounded to bf16 for the product with V (as an eager bf16 model's softmax output is),
// the sums are fp32 and the output is rounded once.
constexpr int QK_ROWS = 4;  // query rows per pass of the score kernel: 16 accumulators of 64 keys

// scores[row, 0:KEY_BLOCK] = scale * q[row] . K_block^T for R rows (R <= QK_ROWS); qrow[i] points at
// row i's D bf16 values, kb at the block's [D/2, KEY_BLOCK] pairs.
template <int R>
inline void qk_rows(const uint32_t* const* qrow, const uint32_t* kb, int64_t pairs, float scale, float* const* srow) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* k = kb + p * KEY_BLOCK;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k), b1 = (__m512bh)_mm512_loadu_si512(k + 16),
                   b2 = (__m512bh)_mm512_loadu_si512(k + 32), b3 = (__m512bh)_mm512_loadu_si512(k + 48);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(srow[r] + 16 * v, _mm512_mul_ps(acc[r][v], sc));
}

// out[row, 0:16 NV] = P[row, :keys] V for R rows: prow[i] points at row i's bf16 probabilities (pairs,
// zero past its keys), vb at V's [blocks * KEY_BLOCK / 2, D] pairs, orow[i] at the output row.
template <int R, int NV>
inline void pv_rows(const uint32_t* const* prow, const uint32_t* vb, int64_t key_pairs, int64_t D, c10::BFloat16* const* orow) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < key_pairs; ++p) {
    const uint32_t* vp = vb + p * D;
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(vp + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(prow[r][p]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow[r] + 16 * v), (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
}

template <int NV>  // D = 16 NV: the output vectors of a row
void prefill_rows_bf16dp(at::Tensor& out, const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, int64_t past,
                         double softmax_scale) {
  constexpr int PV_ROWS = NV <= 4 ? 4 : 2;  // accumulators: PV_ROWS * NV = 16
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kp.size(0), nkb = kp.size(1);
  const int64_t G = Hq / Hkv, nt = (n + PREFILL_TILE - 1) / PREFILL_TILE, pairs = D / 2;
  const float fscale = static_cast<float>(softmax_scale);
  const auto* q_ptr = q.data_ptr<c10::BFloat16>();
  auto* o_ptr = out.data_ptr<c10::BFloat16>();
  const auto* kp_ptr = reinterpret_cast<const uint32_t*>(kp.data_ptr<c10::BFloat16>());
  const auto* vp_ptr = reinterpret_cast<const uint32_t*>(vp.data_ptr<c10::BFloat16>());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t block_pairs = pairs * KEY_BLOCK;  // uint32 per key block, for K and for V
  at::parallel_for(0, Hkv * nt, 1, [&](int64_t begin, int64_t end) {
    // at their largest once (a resize per tile zero-filled bf16 element by element: 6% of the kernel)
    std::vector<float> scores(nkb * G * PREFILL_TILE * KEY_BLOCK);
    std::vector<uint16_t> probs_bits(G * PREFILL_TILE * nkb * KEY_BLOCK);
    auto* probs = reinterpret_cast<c10::BFloat16*>(probs_bits.data());
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nt, tile = zigzag(i % nt, nt);
      const int64_t r0 = tile * PREFILL_TILE, m = std::min(PREFILL_TILE, n - r0), M = G * m;
      const int64_t e = past + r0 + m, blocks = (e + KEY_BLOCK - 1) / KEY_BLOCK;
      const auto qrow = [&](int64_t row) {  // row g * m + r: query r0 + r of head h * G + g
        return reinterpret_cast<const uint32_t*>(q_ptr + (r0 + row % m) * qs0 + (h * G + row / m) * qs1);
      };
      // scores: [blocks, M, KEY_BLOCK]
      const uint32_t* kh = kp_ptr + h * nkb * block_pairs;
      for (int64_t j = 0; j < blocks; ++j)
        by_row_groups<QK_ROWS>(M, [&](auto rows, int64_t row) {
          constexpr int R = decltype(rows)::value;
          const uint32_t* qr[R];
          float* sr[R];
          for (int r = 0; r < R; ++r) {
            qr[r] = qrow(row + r);
            sr[r] = scores.data() + (j * M + row + r) * KEY_BLOCK;
          }
          qk_rows<R>(qr, kh + j * block_pairs, pairs, fscale, sr);
        });
      softmax_tile(scores.data(), M, m, blocks, past, r0);
      // probs: [M, blocks * KEY_BLOCK], rounded to bf16
      for (int64_t row = 0; row < M; ++row)
        for (int64_t j = 0; j < blocks; ++j) {
          const float* src = scores.data() + (j * M + row) * KEY_BLOCK;
          c10::BFloat16* dst = probs + (row * blocks + j) * KEY_BLOCK;
          for (int64_t c = 0; c < KEY_BLOCK; c += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + c)));
        }
      const uint32_t* vh = vp_ptr + h * nkb * block_pairs;
      by_row_groups<PV_ROWS>(M, [&](auto rows, int64_t row) {
        constexpr int R = decltype(rows)::value;
        const uint32_t* pr[R];
        c10::BFloat16* orow[R];
        for (int r = 0; r < R; ++r) {
          pr[r] = reinterpret_cast<const uint32_t*>(probs + (row + r) * blocks * KEY_BLOCK);
          orow[r] = o_ptr + (r0 + (row + r) % m) * os0 + (h * G + (row + r) / m) * os1;
        }
        pv_rows<R, NV>(pr, vh, blocks * KEY_BLOCK / 2, D, orow);
      });
    }
  });
}
#endif

#if defined(__AVX512F__)
// fp32 on AVX-512 with 64- or 128-dim heads: the products in registers instead of through brgemm calls on
// 192 x 64 x 64 tiles, and the blocked layout in one pass instead of four ATen ops (to, permute, pad,
// contiguous). Before: 21 of the ~300 ms of a mixed fp32 step of the small preset (14 decodes and two
// 249-token chunks; 2-core Zen 5, torch.profiler), 665 us a chunk; after: 460 us (0.37 ms alone).
// The layout is written in one pass (K^T as [Hkv, blocks, D, KEY_BLOCK], V as [Hkv, blocks, KEY_BLOCK, D],
// zero-padded) and every product is register-blocked: R query rows x NV vectors of 16 lanes.
constexpr int KB_V = KEY_BLOCK / 16;  // vectors of a key block

// x in every lane: one broadcast (vf{} + x adds +0.0 first, which the compiler must keep for x = -0.0)
inline vf splat(float x) { return x - vf{}; }
// v held in a register: keeps the compiler from folding a load reused by every row into each FMA
// (16 loads where 4 do, which made the loads, not the FMAs, the limit)
inline vf in_register(vf v) {
  asm("" : "+v"(v));
  return v;
}

// scores[row, 0:KEY_BLOCK] = scale * q[row] . K_block^T for R rows; kb is the block's [D, KEY_BLOCK].
template <int R>
inline void qk_rows_f32(const float* const* qrow, const float* kb, int64_t D, float scale, float* const* srow) {
  vf acc[R][KB_V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < KB_V; ++v) acc[r][v] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf b[KB_V];
    for (int v = 0; v < KB_V; ++v) b[v] = in_register(loadv(kb + d * KEY_BLOCK + 16 * v));
    for (int r = 0; r < R; ++r) {
      const vf a = splat(qrow[r][d]);
      for (int v = 0; v < KB_V; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < KB_V; ++v) storev(srow[r] + 16 * v, acc[r][v] * scale);
}

// out[row, 0:16 NV] = P[row] V for R rows of the tile starting at `row`: P in scores' [blocks, M, KEY_BLOCK]
// layout (zero past each row's keys), vb the head's [blocks, KEY_BLOCK, D].
template <int R, int NV>
inline void pv_rows_f32(const float* scores, int64_t M, int64_t row, int64_t blocks, const float* vb, int64_t D,
                        float* const* orow) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t j = 0; j < blocks; ++j) {
    const float* pj = scores + (j * M + row) * KEY_BLOCK;
    const float* vj = vb + j * KEY_BLOCK * D;
    for (int64_t c = 0; c < KEY_BLOCK; ++c) {
      vf b[NV];
      for (int v = 0; v < NV; ++v) b[v] = in_register(loadv(vj + c * D + 16 * v));
      for (int r = 0; r < R; ++r) {
        const vf a = splat(pj[r * KEY_BLOCK + c]);
        for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) storev(orow[r] + 16 * v, acc[r][v]);
}

template <int NV>  // D = 16 NV
void prefill_rows_f32(at::Tensor& out, const at::Tensor& q, const at::Tensor& kt, const at::Tensor& vb, int64_t past,
                      double softmax_scale) {
  constexpr int QK_R = 4, PV_R = NV <= 4 ? 4 : 2;  // accumulators: 16 either way
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kt.size(0), nkb = kt.size(1);
  const int64_t G = Hq / Hkv, nt = (n + PREFILL_TILE - 1) / PREFILL_TILE, block_elems = D * KEY_BLOCK;
  const float fscale = static_cast<float>(softmax_scale);
  const float* q_ptr = q.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const float* kt_ptr = kt.data_ptr<float>();
  const float* vb_ptr = vb.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  at::parallel_for(0, Hkv * nt, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(nkb * G * PREFILL_TILE * KEY_BLOCK);  // at its largest once
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / nt, tile = zigzag(i % nt, nt);
      const int64_t r0 = tile * PREFILL_TILE, m = std::min(PREFILL_TILE, n - r0), M = G * m;
      const int64_t e = past + r0 + m, blocks = (e + KEY_BLOCK - 1) / KEY_BLOCK;
      // row g * m + r: query r0 + r of head h * G + g
      const auto qrow = [&](int64_t row) { return q_ptr + (r0 + row % m) * qs0 + (h * G + row / m) * qs1; };
      const auto orow = [&](int64_t row) { return o_ptr + (r0 + row % m) * os0 + (h * G + row / m) * os1; };
      const float* kh = kt_ptr + h * nkb * block_elems;
      for (int64_t j = 0; j < blocks; ++j)
        by_row_groups<QK_R>(M, [&](auto rows, int64_t row) {
          constexpr int R = decltype(rows)::value;
          const float* qr[R];
          float* sr[R];
          for (int r = 0; r < R; ++r) {
            qr[r] = qrow(row + r);
            sr[r] = scores.data() + (j * M + row + r) * KEY_BLOCK;
          }
          qk_rows_f32<R>(qr, kh + j * block_elems, D, fscale, sr);
        });
      softmax_tile(scores.data(), M, m, blocks, past, r0);
      const float* vh = vb_ptr + h * nkb * block_elems;
      by_row_groups<PV_R>(M, [&](auto rows, int64_t row) {
        constexpr int R = decltype(rows)::value;
        float* orows[R];
        for (int r = 0; r < R; ++r) orows[r] = orow(row + r);
        pv_rows_f32<R, NV>(scores.data(), M, row, blocks, vh, D, orows);
      });
    }
  });
}
#endif

// out[i, hq] = softmax(q[i, hq] . k[:past + i + 1, hq / G]^T * scale) v[:past + i + 1, hq / G], past = Lk - n.
// q, out: [n, Hq, D]; k, v: [Lk, Hkv, D], Lk >= n; q's and out's last dim contiguous, other strides
// free. float32 or bfloat16; the products and the softmax run in fp32 (keys and values are laid
// out once per call in fp32 key blocks: K^T as [Hkv, blocks, D, 64], V as [Hkv, blocks, 64, D],
// zero-padded, so every product has a fixed shape).
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double softmax_scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [n, Hq, D] of the same shape");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(2) == q.size(2), "k and v must be [Lk, Hkv, D]");
  TORCH_CHECK(k.size(0) >= q.size(0), "fewer keys than queries");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dimension");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(), "q, k, v and out must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  const int64_t n = q.size(0), Lk = k.size(0), Hkv = k.size(1), D = k.size(2);
  if (n == 0) return;
  const int64_t nkb = (Lk + KEY_BLOCK - 1) / KEY_BLOCK, pad = nkb * KEY_BLOCK - Lk;
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && (D == 64 || D == 128)) {
    // K as [Hkv, nkb, D/2, KEY_BLOCK] pairs of dims, V as [Hkv, nkb, KEY_BLOCK/2, D] pairs of keys, zero-padded;
    // written here in one pass (permute + pad + contiguous took 2-3x as long: strided 2-byte copies)
    const at::Tensor kc = k.stride(2) == 1 ? k : k.contiguous(), vc = v.stride(2) == 1 ? v : v.contiguous();
    const at::Tensor kp = at::empty({Hkv, nkb, D / 2, KEY_BLOCK, 2}, q.options());
    const at::Tensor vp = at::empty({Hkv, nkb, KEY_BLOCK / 2, D, 2}, q.options());
    const auto* k16 = reinterpret_cast<const uint16_t*>(kc.data_ptr<c10::BFloat16>());
    const auto* v16 = reinterpret_cast<const uint16_t*>(vc.data_ptr<c10::BFloat16>());
    auto* kp32 = reinterpret_cast<uint32_t*>(kp.data_ptr<c10::BFloat16>());
    auto* vp32 = reinterpret_cast<uint32_t*>(vp.data_ptr<c10::BFloat16>());
    const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), vs0 = vc.stride(0), vs1 = vc.stride(1), half = D / 2;
    at::parallel_for(0, Hkv * nkb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t hb = begin; hb < end; ++hb) {
        const int64_t h = hb / nkb, j = hb % nkb;
        uint32_t* kd = kp32 + hb * half * KEY_BLOCK;
        uint32_t* vd = vp32 + hb * (KEY_BLOCK / 2) * D;
        for (int64_t c = 0; c < KEY_BLOCK; ++c) {
          const int64_t key = j * KEY_BLOCK + c;
          const uint16_t* kr = k16 + key * ks0 + h * ks1;
          for (int64_t p = 0; p < half; ++p)
            kd[p * KEY_BLOCK + c] = key < Lk ? static_cast<uint32_t>(kr[2 * p]) | static_cast<uint32_t>(kr[2 * p + 1]) << 16 : 0u;
        }
        for (int64_t p = 0; p < KEY_BLOCK / 2; ++p) {
          const int64_t key = j * KEY_BLOCK + 2 * p;
          const uint16_t* v0 = v16 + key * vs0 + h * vs1;
          const uint16_t* v1 = v0 + vs0;
          for (int64_t d = 0; d < D; ++d)
            vd[p * D + d] = (key < Lk ? static_cast<uint32_t>(v0[d]) : 0u) | (key + 1 < Lk ? static_cast<uint32_t>(v1[d]) << 16 : 0u);
        }
      }
    });
    if (D == 64) prefill_rows_bf16dp<4>(out, q, kp, vp, Lk - n, softmax_scale);
    else prefill_rows_bf16dp<8>(out, q, kp, vp, Lk - n, softmax_scale);
    return;
  }
#endif
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat && (D == 64 || D == 128)) {
    const at::Tensor kt = at::empty({Hkv, nkb, D, KEY_BLOCK}, q.options());
    const at::Tensor vb = at::empty({Hkv, nkb, KEY_BLOCK, D}, q.options());
    const float* kf = k.data_ptr<float>();
    const float* vf_ = v.data_ptr<float>();
    float* kt_ptr = kt.data_ptr<float>();
    float* vb_ptr = vb.data_ptr<float>();
    const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2), vs0 = v.stride(0), vs1 = v.stride(1),
                  vs2 = v.stride(2);
    at::parallel_for(0, Hkv * nkb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t hb = begin; hb < end; ++hb) {
        const int64_t h = hb / nkb, j = hb % nkb;
        float* kd = kt_ptr + hb * D * KEY_BLOCK;
        float* vd = vb_ptr + hb * KEY_BLOCK * D;
        for (int64_t c = 0; c < KEY_BLOCK; ++c) {
          const int64_t key = j * KEY_BLOCK + c;
          if (key >= Lk) {
            for (int64_t d = 0; d < D; ++d) kd[d * KEY_BLOCK + c] = 0.0f;
            std::memset(vd + c * D, 0, D * sizeof(float));
            continue;
          }
          const float* kr = kf + key * ks0 + h * ks1;
          const float* vr = vf_ + key * vs0 + h * vs1;
          for (int64_t d = 0; d < D; ++d) kd[d * KEY_BLOCK + c] = kr[d * ks2];
          for (int64_t d = 0; d < D; ++d) vd[c * D + d] = vr[d * vs2];
        }
      }
    });
    if (D == 64) prefill_rows_f32<4>(out, q, kt, vb, Lk - n, softmax_scale);
    else prefill_rows_f32<8>(out, q, kt, vb, Lk - n, softmax_scale);
    return;
  }
#endif
  const auto blocked = [&](const at::Tensor& x) {  // [Lk, Hkv, D] -> [Hkv, nkb, KEY_BLOCK, D] fp32, zero-padded
    at::Tensor f = x.to(at::kFloat).permute({1, 0, 2});
    if (pad) f = at::constant_pad_nd(f, {0, 0, 0, pad});
    return f.reshape({Hkv, nkb, KEY_BLOCK, D});
  };
  const at::Tensor kt = blocked(k).transpose(2, 3).contiguous();  // [Hkv, nkb, D, KEY_BLOCK]
  const at::Tensor vb = blocked(v).contiguous();
  if (q.scalar_type() == at::kFloat) prefill_rows<float>(out, q, kt, vb, Lk - n, softmax_scale);
  else prefill_rows<c10::BFloat16>(out, q, kt, vb, Lk - n, softmax_scale);
}

// Bind compute thread i (ATen's OpenMP pool) to cores[i % len], or with exclusive=false every
// thread to all of cores (undoing a binding). Returns how many threads took the new affinity.
int64_t pin_threads(const std::vector<int64_t>& cores, bool exclusive) {
  TORCH_CHECK(!cores.empty(), "no cores to pin to");
  const int64_t n = at::get_num_threads();
  std::vector<int> ok(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tid = at::get_thread_num();
      cpu_set_t set;
      CPU_ZERO(&set);
      if (exclusive) {
        CPU_SET(static_cast<int>(cores[tid % cores.size()]), &set);
      } else {
        for (int64_t c : cores) CPU_SET(static_cast<int>(c), &set);
      }
      ok[tid] = sched_setaffinity(0, sizeof set, &set) == 0;
    }
  });
  int64_t pinned = 0;
  for (int v : ok) pinned += v;
  return pinned;
}


// -- small fused ops of a decode step ---------------------------------------------------------
// At batch 1 a decode step is bandwidth-bound on the weights and every extra kernel costs several
// microseconds; these replace 2-4 PyTorch kernels each. Rows run in parallel only when there are
// enough of them (a lone decode's row runs on the calling thread, with no OpenMP barrier).
constexpr int64_t ROWS_PER_TASK = 8;

template <typename T>
inline float ld(const T* p) { return static_cast<float>(*p); }

// Rounding to T and back, and storing L lanes as T: identity for fp32; for bf16, round to
// nearest even with NaN kept quiet, as c10::BFloat16's conversion does (bit for bit).
inline vu bf16_bits(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? vu{} + 0x7FC0u : r;
}
inline vf round_as(vf v, const float*) { return v; }
#if defined(__AVX512BF16__)
// vcvtneps2bf16 rounds to nearest even as above; a NaN stays a NaN (quieted, its sign kept).
inline vf round_as(vf v, const c10::BFloat16*) {
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)v)), 16);
}
inline void storev(c10::BFloat16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
}
#else
inline vf round_as(vf v, const c10::BFloat16*) {
  const vu u = bf16_bits(v) << 16;
  vf out;
  std::memcpy(&out, &u, sizeof out);
  return out;
}
inline void storev(c10::BFloat16* p, vf v) {
  const vh h = __builtin_convertvector(bf16_bits(v), vh);
  std::memcpy(p, &h, sizeof h);
}
#endif

// y = weight * norm(x + delta) with h = x + delta stored back into x (the residual stream), as
// Hugging Face computes it: the sum in the stream's dtype, the norm in fp32, cast back, then weight.
// L lanes at a time (the scalar loop was 0.9 ns an element: 6% of a bf16 prefill), a scalar
// tail for a width that is no multiple of L.
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* w, T* y, int64_t rows, int64_t n, int64_t sx, int64_t sd,
                       int64_t sy, float eps) {
  const int64_t nv = n / L * L;
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * sx;
      const T* dr = delta ? delta + r * sd : nullptr;
      vf vss = vf{};
      for (int64_t i = 0; i < nv; i += L) {
        vf v = loadv(xr + i);
        if (dr) {
          v = round_as(v + loadv(dr + i), xr);  // rounded to the stream's dtype
          storev(xr + i, v);
        }
        std::memcpy(buf.data() + i, &v, sizeof v);
        vss += v * v;
      }
      float ss = hsum(vss);
      for (int64_t i = nv; i < n; ++i) {
        float v = ld(xr + i);
        if (dr) {
          const T h = static_cast<T>(v + ld(dr + i));
          xr[i] = h;
          v = static_cast<float>(h);
        }
        buf[i] = v;
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* yr = y + r * sy;
      for (int64_t i = 0; i < nv; i += L) storev(yr + i, loadv(w + i) * round_as(loadv(buf.data() + i) * inv, yr));
      for (int64_t i = nv; i < n; ++i) yr[i] = static_cast<T>(ld(w + i) * static_cast<float>(static_cast<T>(buf[i] * inv)));
    }
  });
}

// Returns norm(x) (delta undefined) or norm(x + delta) after x += delta in place. x, delta: [T, N]
// rows with a contiguous last dim; weight: [N].
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "x must be [T, N] with a contiguous last dim and weight [N]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  if (delta) TORCH_CHECK(delta->sizes() == x.sizes() && delta->stride(1) == 1 && delta->scalar_type() == x.scalar_type(),
                         "delta must be like x");
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = x.size(0), n = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                             y.data_ptr<float>(), rows, n, x.stride(0), delta ? delta->stride(0) : 0, y.stride(0),
                             static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    using B = c10::BFloat16;
    add_rms_norm_rows<B>(x.data_ptr<B>(), delta ? delta->data_ptr<B>() : nullptr, weight.data_ptr<B>(), y.data_ptr<B>(),
                         rows, n, x.stride(0), delta ? delta->stride(0) : 0, y.stride(0), static_cast<float>(eps));
  }
  return y;
}

// Rotate heads[:, :n] in place: x * cos + roll(x, D/2) * signed_sin, the product in fp32 and
// rounded once, as torch.addcmul does. heads: [T, H, D] (head and last dims contiguous within a
// row); cos, sin: [T, D] contiguous.
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t d, int64_t sx) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = x + r * sx + h * d;
        for (int64_t i = 0; i < half; ++i)  // roll(x, D/2): the two halves swap
          tmp[i] = static_cast<float>(static_cast<T>(ld(xr + i) * ld(c + i))) + ld(xr + i + half) * ld(s + i);
        for (int64_t i = half; i < d; ++i)
          tmp[i] = static_cast<float>(static_cast<T>(ld(xr + i) * ld(c + i))) + ld(xr + i - half) * ld(s + i);
        for (int64_t i = 0; i < d; ++i) xr[i] = static_cast<T>(tmp[i]);
      }
    }
  });
}

void rope_(at::Tensor heads, int64_t n, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(heads.dim() == 3 && heads.stride(2) == 1 && heads.stride(1) == heads.size(2), "heads must be [T, H, D], rows of whole heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == heads.size(0) &&
                  cos.size(1) == heads.size(2) && sin.sizes() == cos.sizes(), "cos and sin must be contiguous [T, D]");
  TORCH_CHECK(n >= 0 && n <= heads.size(1) && heads.size(2) % 2 == 0, "bad head count or odd head_dim");
  TORCH_CHECK(cos.scalar_type() == heads.scalar_type() && sin.scalar_type() == heads.scalar_type(), "dtypes differ");
  if (heads.scalar_type() == at::kFloat) {
    rope_rows<float>(heads.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), heads.size(0), n,
                     heads.size(2), heads.stride(0));
  } else {
    TORCH_CHECK(heads.scalar_type() == at::kBFloat16, "heads must be float32 or bfloat16");
    using B = c10::BFloat16;
    rope_rows<B>(heads.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(), heads.size(0), n, heads.size(2),
                 heads.stride(0));
  }
}

// y = silu(x[:, :I]) * x[:, I:] for x [T, 2I] (a fused gate_up projection's output), as Hugging Face
// computes it: silu in fp32 rounded to the dtype, then the product rounded. sigmoid from exp(-|g|)
// (expv_nonpositive, vectorized: GCC had left a plain exp scalar here, 10x slower than PyTorch's).
// NOTE: PyTorch's silu and mul were 5% of a 512-token bf16 step of the small preset (2-core Zen 5):
// two passes over [T, I] and one intermediate tensor.
template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t I, int64_t sx, int64_t sy) {
  const int64_t nv = I / L * L;
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * sx;
      const T* u = g + I;
      T* yr = y + r * sy;
      for (int64_t i = 0; i < nv; i += L) {
        const vf gv = loadv(g + i);
        const vf e = expv_nonpositive(gv < 0.0f ? gv : -gv);  // exp(-|g|), in (0, 1]
        const vf sig = (gv < 0.0f ? e : vf{} + 1.0f) / (1.0f + e);  // one division
        storev(yr + i, round_as(gv * sig, yr) * loadv(u + i));
      }
      for (int64_t i = nv; i < I; ++i) {
        const float gi = ld(g + i);
        yr[i] = static_cast<T>(static_cast<float>(static_cast<T>(gi / (1.0f + std::exp(-gi)))) * ld(u + i));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [T, 2I] with a contiguous last dim");
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({rows, I}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(x.data_ptr<float>(), y.data_ptr<float>(), rows, I, x.stride(0), y.stride(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    using B = c10::BFloat16;
    silu_mul_rows<B>(x.data_ptr<B>(), y.data_ptr<B>(), rows, I, x.stride(0), y.stride(0));
  }
  return y;
}

// -- a linear on the plain weight -------------------------------------------------------------
// y = x W^T + b with W as nn.Linear holds it ([N, K], row-major), fp32 or bf16. At a few rows a decode
// step only streams the weights, and oneDNN's prepacked call read them at 15-25 GB/s on a 2-core AVX2
// EPYC where these dot products read 28-36 GB/s (the 1 GiB sum() reads ~32). From 5 rows the weight
// is the A operand of brgemm products against x^T (y^T = W x^T) over blocks of weight rows, x^T in
// chunks of 32 columns: 0.8-0.95x oneDNN's time at 8-32 rows there. From 64 rows (prefill chunks,
// and the steps that mix one with decodes) each task packs 32 weight rows as W^T ([K, 32], 8x8
// transposes) and runs brgemm with x as A, as oneDNN does with a weight it packed ahead: 0.83-0.97x
// oneDNN's time at 64-512 rows there, where the weight as A ran up to 1.19x (its block of weight rows
// and x^T's chunks outgrew the L2 at K = 2048) and ATen's linear up to 1.24x. Packing reads each weight
// once per call (~0.3 ms for 1 M weights), which 64 rows of products hide. Which kernel a shape gets
// at 1, 8, 32 and 128 rows is measured at start-up (packed_linear.choose); the thresholds between
// the paths here are what that machine measured (bench/HISTORY.md, 2026-12-03/04).
// bf16 weights are widened to fp32 where they are read (in registers for the dot products, into the
// packed panel or a block of 16 weight rows for brgemm) and the products run in fp32, rounded to bf16
// once at the end: a CPU without native bf16 (AVX2) reads half of fp32's bytes at fp32's arithmetic,
// where oneDNN refuses bf16 there and ATen's bf16 linear ran ~5x slower than its fp32 one.
constexpr int64_t GEMV_MAX_ROWS = 4;
constexpr int64_t PACK_FROM_ROWS = 64;
constexpr int64_t X_CHUNK = 32;  // columns of x^T per product
constexpr int64_t PACK_COLS = 32;  // weight rows packed per task: brgemm's N (4 AVX2 or 2 AVX-512 vectors)
constexpr int64_t PACK_K = 2048;   // depth per product, so the packed panel stays in L2 for a large K
constexpr int64_t PACK_M = 128;    // rows of x per product
constexpr int64_t WIDEN_ROWS = 16;  // bf16 weight rows widened per product on the weight-as-A path

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8f load8(const c10::BFloat16* p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// dst[i] = src[i] as fp32, n elements.
void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + L <= n; i += L) storev(dst + i, loadv(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// An 8x8 tile: out[k * ld + j] = w[j * K + k] for j, k < 8, in three rounds of shuffles.
template <typename T>
inline void transpose8(const T* w, int64_t K, float* out, int64_t ld) {
  v8f r[8], t[8], u[8];
  for (int j = 0; j < 8; ++j) r[j] = load8(w + j * K);
  const v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
  const v8i even = {0, 1, 8, 9, 4, 5, 12, 13}, odd = {2, 3, 10, 11, 6, 7, 14, 15};
  const v8i first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
  for (int j = 0; j < 4; ++j) {  // t: rows 2j and 2j+1 interleaved
    t[2 * j] = __builtin_shuffle(r[2 * j], r[2 * j + 1], lo);
    t[2 * j + 1] = __builtin_shuffle(r[2 * j], r[2 * j + 1], hi);
  }
  for (int h = 0; h < 2; ++h) {  // u: four rows' elements k and k+4 for each k < 4
    u[4 * h] = __builtin_shuffle(t[4 * h], t[4 * h + 2], even);
    u[4 * h + 1] = __builtin_shuffle(t[4 * h], t[4 * h + 2], odd);
    u[4 * h + 2] = __builtin_shuffle(t[4 * h + 1], t[4 * h + 3], even);
    u[4 * h + 3] = __builtin_shuffle(t[4 * h + 1], t[4 * h + 3], odd);
  }
  for (int k = 0; k < 4; ++k) {
    const v8f a = __builtin_shuffle(u[k], u[4 + k], first), b = __builtin_shuffle(u[k], u[4 + k], second);
    std::memcpy(out + k * ld, &a, sizeof a);
    std::memcpy(out + (k + 4) * ld, &b, sizeof b);
  }
}

// panel[k * PACK_COLS + j] = w[j * K + k] as fp32 for the first `rows` weight rows (brgemm reads no further).
template <typename T>
void pack_panel(const T* w, int64_t K, int64_t rows, float* panel) {
  int64_t j = 0;
  for (; j + 8 <= rows; j += 8) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) transpose8(w + j * K + k, K, panel + k * PACK_COLS + j, PACK_COLS);
    for (; k < K; ++k)
      for (int64_t i = 0; i < 8; ++i) panel[k * PACK_COLS + j + i] = static_cast<float>(w[(j + i) * K + k]);
  }
  for (; j < rows; ++j)
    for (int64_t k = 0; k < K; ++k) panel[k * PACK_COLS + j] = static_cast<float>(w[j * K + k]);
}

// y = x W^T from 64 rows: a task packs PACK_COLS weight rows, then multiplies every row of x by them.
template <typename T>
void packed_products(const float* x, const T* w, float* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + PACK_COLS - 1) / PACK_COLS, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> panel(K * PACK_COLS);
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t n0 = i * PACK_COLS, cols = std::min(PACK_COLS, N - n0);
      pack_panel(w + n0 * K, K, cols, panel.data());
      for (int64_t m0 = 0; m0 < M; m0 += PACK_M)
        for (int64_t k0 = 0; k0 < K; k0 += PACK_K)
          at::native::cpublas::brgemm(std::min(PACK_M, M - m0), cols, std::min(PACK_K, K - k0), K, PACK_COLS, N,
                                      k0 > 0, x + m0 * K + k0, panel.data() + k0 * PACK_COLS, y + m0 * N + n0, false);
    }
    at::native::cpublas::brgemm_release();
  });
}

// y^T = W x^T from 5 to 63 rows: x^T as [chunks, K, C] (fp32), y^T as [chunks, N, C]; a task is a block
// of weight rows (64 while the products stream the weights, 128 when each block is reused from cache
// across chunks) against every chunk. bf16 weight rows are widened WIDEN_ROWS at a time first.
template <typename T>
void weight_products(const T* w, const float* xt, float* yt, int64_t M, int64_t K, int64_t N, int64_t C,
                     int64_t chunks) {
  const int64_t block = chunks == 1 ? 64 : 128;
  at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> wide(std::is_same<T, float>::value ? 0 : WIDEN_ROWS * K);
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t n0 = i * block, rows = std::min(block, N - n0);
      const int64_t step = std::is_same<T, float>::value ? rows : WIDEN_ROWS;
      for (int64_t r0 = 0; r0 < rows; r0 += step) {
        const int64_t nr = std::min(step, rows - r0);
        const float* a;
        if constexpr (std::is_same<T, float>::value) {
          a = w + (n0 + r0) * K;
        } else {
          widen(w + (n0 + r0) * K, wide.data(), nr * K);
          a = wide.data();
        }
        for (int64_t c = 0; c < chunks; ++c)
          at::native::cpublas::brgemm(nr, std::min(C, M - c * C), K, K, C, C, false, a, xt + c * K * C,
                                      yt + (c * N + n0 + r0) * C, false);
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

// The R * NB dot products of R rows of x and NB weight rows, in fp32: x and w as T.
template <int R, int NB, typename T>
inline void dots(const T* x, int64_t sx, const T* wn, int64_t K, float (&s)[R][NB]) {
  vf acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = vf{};
  int64_t k = 0;
  if constexpr (std::is_same<T, float>::value) {
    for (; k + L <= K; k += L) {
      vf wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = loadv(wn + j * K + k);
      for (int r = 0; r < R; ++r) {
        const vf xv = loadv(x + r * sx + k);
        for (int j = 0; j < NB; ++j) acc[r][j] += xv * wv[j];
      }
    }
  } else {
    // NOTE: 2L bf16 values as L pairs: the even ones shifted up and the odd ones masked are each an fp32
    // vector (one instruction apiece, where widening in order takes two), and a dot product does not mind
    // the order as long as x's pairs are split the same way.
    const vu high = vu{} + 0xFFFF0000u;
    auto halves = [&](const T* p, vf& even, vf& odd) {
      vu u;
      std::memcpy(&u, p, sizeof u);
      const vu e = u << 16, o = u & high;
      std::memcpy(&even, &e, sizeof even);
      std::memcpy(&odd, &o, sizeof odd);
    };
    for (; k + 2 * L <= K; k += 2 * L) {
      vf we[NB], wo[NB];
      for (int j = 0; j < NB; ++j) halves(wn + j * K + k, we[j], wo[j]);
      for (int r = 0; r < R; ++r) {
        vf xe, xo;
        halves(x + r * sx + k, xe, xo);
        for (int j = 0; j < NB; ++j) acc[r][j] += xe * we[j] + xo * wo[j];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      float t = hsum(acc[r][j]);
      for (int64_t i = k; i < K; ++i) t += static_cast<float>(x[r * sx + i]) * static_cast<float>(wn[j * K + i]);
      s[r][j] = t;
    }
}

// R rows of x against weight rows n0..n1-1, NB weight rows at a time (R * NB accumulators: NB = 8
// for a lone row keeps eight streams in flight; the others stay within AVX2's 16 registers).
template <int R, int NB, typename T>
void gemv_rows(const T* x, int64_t sx, const T* w, int64_t K, const T* b, T* y, int64_t sy, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    float s[R][NB];
    dots<R, NB>(x, sx, w + n * K, K, s);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j)
        y[r * sy + n + j] = static_cast<T>(s[r][j] + (b ? static_cast<float>(b[n + j]) : 0.0f));
  }
  for (; n < n1; ++n)  // the last n1 - n0 mod NB weight rows, one at a time
    gemv_rows<R, 1>(x, sx, w, K, b, y, sy, n, n + 1);
}

template <typename T>
at::Tensor plain_linear_as(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xc = x.contiguous();
  const T* wp = w.data_ptr<T>();
  if (M <= GEMV_MAX_ROWS) {
    const T* xp = xc.data_ptr<T>();
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    at::Tensor y = at::empty({M, N}, x.options());
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      switch (M) {
        case 1: gemv_rows<1, 8>(xp, K, wp, K, bp, yp, N, n0, n1); break;
        case 2: gemv_rows<2, 2>(xp, K, wp, K, bp, yp, N, n0, n1); break;
        case 3: gemv_rows<3, 1>(xp, K, wp, K, bp, yp, N, n0, n1); break;
        case 4: gemv_rows<4, 1>(xp, K, wp, K, bp, yp, N, n0, n1); break;
        default: break;  // M = 0: nothing to compute
      }
    });
    return y;
  }
  // The products run in fp32 into an fp32 y; a bf16 call rounds y (with the bias added) once at the end.
  const at::Tensor xf = xc.to(at::kFloat);
  at::Tensor y;
  if (M >= PACK_FROM_ROWS) {
    y = at::empty({M, N}, x.options().dtype(at::kFloat));
    packed_products(xf.data_ptr<float>(), wp, y.data_ptr<float>(), M, K, N);
  } else {
    // x^T in chunks of C columns (C = M up to 32 rows: one chunk; else two of 32, the second zero-padded
    // but multiplied at its own width).
    const int64_t C = std::min(M, X_CHUNK), chunks = (M + C - 1) / C;
    const at::Tensor xt =
        at::constant_pad_nd(xf, {0, 0, 0, chunks * C - M}).view({chunks, C, K}).transpose(1, 2).contiguous();
    at::Tensor yt = at::empty({chunks, N, C}, xf.options());
    weight_products(wp, xt.data_ptr<float>(), yt.data_ptr<float>(), M, K, N, C, chunks);
    y = yt.transpose(1, 2).reshape({chunks * C, N}).narrow(0, 0, M).contiguous();
  }
  if (bias) y.add_(*bias);
  return std::is_same<T, float>::value ? y : y.to(x.scalar_type());
}

at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x must be [M, K] and w [N, K]");
  const auto dtype = w.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "plain_linear runs float32 or bfloat16, x and w alike");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == w.size(0)),
              "bias must be contiguous [N] in w's dtype");
  if (x.size(1) == 0) return at::linear(x, w, bias);  // no products: the bias alone (brgemm leaves y unwritten)
  return dtype == at::kFloat ? plain_linear_as<float>(x, w, bias) : plain_linear_as<c10::BFloat16>(x, w, bias);
}

// mkldnn::_linear_pointwise(x, packed, bias) with no post-op, under a name torch.compile treats as
// an opaque call (its own lowering of that op accepts only weights it packed itself).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<c10::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<c10::Scalar>>(), "");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdfleet, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv, Tensor? scale, Tensor tables, Tensor lens, "
        "float softmax_scale) -> ()");
  m.def("pin_threads(int[] cores, bool exclusive=True) -> int", &pin_threads);
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("plain_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) heads, int n, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float softmax_scale) -> ()");
}

TORCH_LIBRARY_IMPL(pdfleet, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("onednn_linear", &onednn_linear);
  m.impl("plain_linear", &plain_linear);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("prefill_attention", &prefill_attention);
}

// The packed weight is an MKLDNN tensor, which dispatches on its own key.
TORCH_LIBRARY_IMPL(pdfleet, MkldnnCPU, m) { m.impl("onednn_linear", &onednn_linear); }
