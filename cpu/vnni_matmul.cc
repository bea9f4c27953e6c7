// Design. A pass takes kRows weight rows against one 16-row group of packed
// activations at a time (the group's quants are AmxQ8_0Acts' VNNI layout:
// per 32-element block, 8 vectors of 64 bytes, vector k holding elements 4k
// .. 4k + 3 of each of the 16 rows). Per block a pass loads those 8 vectors
// once, flips their sign bits, and meets each weight row's 8 dwords by
// embedded broadcast, one vpdpbusd each; a row's block sum starts at -128
// times its weights' sum, so the int32 it ends with is the contract's isum.
// The f32 epilogue is AMX's fold, lane for lane: scale = f16(w.d) * a.d, one
// fma a block in block order.
//
// q4_K's weights are expanded once per pass into bytes in element order (0..
// 15, valid signed bytes for the broadcast), with per sub-block the 6-bit
// scale and the correction; a sub-block's 32 elements are 8 vpdpbusd, then
// one vpmulld by the row's scale folds it into the super-block's isum (the
// tiles fold the scale into the weight bytes instead; here that would take two
// broadcasts where one does). The min term is AMX's: mins and bsums as int16
// pairs, a vpmaddwd and 3 vpdpwssd a row.
//
// Measured on one Sapphire Rapids thread (tools/bench/bench_amx.cc), see
// docs/BENCHMARKS.md.
#include "cpu/vnni_matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "loader/check.h"
#include "loader/quant.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moegraph {
namespace {

std::atomic<uint64_t> vnni_calls{0};

constexpr int kLanes = 16;                 // activation rows a group (a vector's int32 lanes)
constexpr int kGroupBlockBytes = 8 * 64;   // one 32-element block of a group
constexpr int kSubBlocks = QK_K / 32;      // q4_K sub-blocks a super-block
constexpr int kRows = kVnniPassRows;       // weight rows a pass

template <typename Block>
const Block* Row(const uint8_t* base, size_t row_bytes, int64_t i) {
  return reinterpret_cast<const Block*>(base + static_cast<size_t>(i) * row_bytes);
}

int64_t Groups(int64_t n_act) { return (n_act + kLanes - 1) / kLanes; }

// The kernels that pack first: m.act packed into this thread's Acts, then kernel.
template <typename Acts>
void PackAndRun(const MatMulArgs& m, void (*pack)(const uint8_t*, size_t, int64_t, int64_t, Acts*),
                void (*kernel)(const MatMulArgs&, const Acts&)) {
  thread_local Acts acts;
  pack(m.act, m.act_row_bytes, m.n_act, m.cols, &acts);
  kernel(m, acts);
}

}  // namespace

#if defined(__x86_64__)

bool AvxVnniAvailable() {
  // GCC's checks include the OS's support for the vector state (XCR0).
  static const bool available = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vnni");
  return available;
}

namespace {

#define MOEGRAPH_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

// The group's block of 16 activation rows, sign bits flipped (a + 128 as u8);
// unaligned loads: the packed vectors are std::vector storage.
MOEGRAPH_VNNI_TARGET inline void LoadBiasedBlock(const uint8_t* block, __m512i (&a)[8]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int k = 0; k < 8; ++k) {
    a[k] = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * k), flip);
  }
}

// sum + the 32 products of the weights at w (signed bytes) with the biased
// block a, lane by lane.
MOEGRAPH_VNNI_TARGET inline __m512i DotBlock(__m512i sum, const __m512i (&a)[8], const int8_t* w) {
  for (int k = 0; k < 8; ++k) {
    int32_t dword;
    std::memcpy(&dword, w + 4 * k, 4);
    sum = _mm512_dpbusd_epi32(sum, a[k], _mm512_set1_epi32(dword));
  }
  return sum;
}

// acc[i] lane n into m.out for row r0 + i and activation row t0 + n, those
// that exist.
template <int R>
MOEGRAPH_VNNI_TARGET void StoreLanes(const MatMulArgs& m, int64_t r0, int64_t t0,
                                     const __m512 (&acc)[R]) {
  alignas(64) float lanes[R][kLanes];
  for (int i = 0; i < R; ++i) _mm512_store_ps(lanes[i], acc[i]);
  const int64_t n = std::min<int64_t>(kLanes, m.n_act - t0);
  for (int64_t t = 0; t < n; ++t) {
    float* out = m.out + (t0 + t) * m.out_stride + r0;
    for (int i = 0; i < R; ++i) out[i] = lanes[i][t];
  }
}

// A pass's weight rows, read once per pass: q8_0's scales as f32 and
// corrections (-128 times each block's quant sum), [row][block].
struct Q8_0Rows {
  std::vector<float> d;
  std::vector<int32_t> correction;
};

MOEGRAPH_VNNI_TARGET void PrepareQ8_0Rows(const MatMulArgs& m, int64_t r0, int R, int64_t nb,
                                          Q8_0Rows& s) {
  s.d.resize(static_cast<size_t>(R * nb));
  s.correction.resize(static_cast<size_t>(R * nb));
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int i = 0; i < R; ++i) {
    const auto* w = Row<block_q8_0>(m.w, m.w_row_bytes, r0 + i);
    for (int64_t b = 0; b < nb; ++b) {
      // Sum of the biased bytes (w + 128) by vpsadbw, less 32 * 128.
      const __m256i q = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs)), flip);
      const __m256i sad = _mm256_sad_epu8(q, _mm256_setzero_si256());
      const int64_t sum = _mm256_extract_epi64(sad, 0) + _mm256_extract_epi64(sad, 1) +
                          _mm256_extract_epi64(sad, 2) + _mm256_extract_epi64(sad, 3) -
                          QK8_0 * 128;
      s.d[i * nb + b] = _cvtsh_ss(w[b].d);
      s.correction[i * nb + b] = static_cast<int32_t>(-128 * sum);
    }
  }
}

template <int R>
MOEGRAPH_VNNI_TARGET void Q8_0Pass(const MatMulArgs& m, const AmxQ8_0Acts& acts, int64_t r0,
                                   const Q8_0Rows& s) {
  const int64_t nb = acts.nb;
  const block_q8_0* w[R];
  for (int i = 0; i < R; ++i) w[i] = Row<block_q8_0>(m.w, m.w_row_bytes, r0 + i);
  for (int64_t g = 0; g < Groups(m.n_act); ++g) {
    const uint8_t* quants = acts.vnni.data() + g * nb * kGroupBlockBytes;
    const float* scales = acts.scale.data() + g * nb * kLanes;
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i a[8];
      LoadBiasedBlock(quants + b * kGroupBlockBytes, a);
      const __m512 ad = _mm512_loadu_ps(scales + b * kLanes);
      for (int i = 0; i < R; ++i) {
        const __m512i isum = DotBlock(_mm512_set1_epi32(s.correction[i * nb + b]), a, w[i][b].qs);
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(s.d[i * nb + b]), ad);
        // maskz: GCC 12 warns on _mm512_cvtepi32_ps's undefined pass-through.
        acc[i] = _mm512_fmadd_ps(scale, _mm512_maskz_cvtepi32_ps(0xffff, isum), acc[i]);
      }
    }
    StoreLanes<R>(m, r0, g * kLanes, acc);
  }
}

// A pass's q4_K rows: the quants as bytes in element order [row][super-block]
// [256], and per [row][super-block] the sub-blocks' scales, the mins as int16
// pairs, d, dmin, and the correction -128 * sum_j sc[j] * (sub-block j's
// quant sum).
struct Q4_KRows {
  std::vector<int8_t> quants;
  std::vector<int32_t> sc;
  std::vector<uint32_t> mins;
  std::vector<float> d, dmin;
  std::vector<int32_t> correction;
};

MOEGRAPH_VNNI_TARGET void PrepareQ4_KRows(const MatMulArgs& m, int64_t r0, int R, int64_t nb,
                                          Q4_KRows& s) {
  const size_t n = static_cast<size_t>(R * nb);
  s.quants.resize(n * QK_K);
  s.sc.resize(n * kSubBlocks);
  s.mins.resize(n * kSubBlocks / 2);
  s.d.resize(n);
  s.dmin.resize(n);
  s.correction.resize(n);
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int i = 0; i < R; ++i) {
    const auto* w = Row<block_q4_K>(m.w, m.w_row_bytes, r0 + i);
    for (int64_t b = 0; b < nb; ++b) {
      const size_t at = static_cast<size_t>(i * nb + b);
      uint8_t sc[kSubBlocks], mn[kSubBlocks];
      for (int j = 0; j < kSubBlocks; ++j) get_scale_min_k4(j, w[b].scales, &sc[j], &mn[j]);
      int32_t correction = 0;
      for (int c = 0; c < kSubBlocks / 2; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs + 32 * c));
        const __m256i halves[2] = {_mm256_and_si256(q, low),
                                   _mm256_and_si256(_mm256_srli_epi16(q, 4), low)};
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.quants.data() + at * QK_K + 32 * j),
                              halves[h]);
          const __m256i sad = _mm256_sad_epu8(halves[h], _mm256_setzero_si256());
          const int64_t sum = _mm256_extract_epi64(sad, 0) + _mm256_extract_epi64(sad, 1) +
                              _mm256_extract_epi64(sad, 2) + _mm256_extract_epi64(sad, 3);
          correction -= 128 * sc[j] * static_cast<int32_t>(sum);
          s.sc[at * kSubBlocks + j] = sc[j];
        }
      }
      for (int k = 0; k < kSubBlocks / 2; ++k) {
        s.mins[at * kSubBlocks / 2 + k] =
            static_cast<uint32_t>(mn[2 * k]) | static_cast<uint32_t>(mn[2 * k + 1]) << 16;
      }
      s.d[at] = _cvtsh_ss(w[b].d);
      s.dmin[at] = _cvtsh_ss(w[b].dmin);
      s.correction[at] = correction;
    }
  }
}

template <int R>
MOEGRAPH_VNNI_TARGET void Q4_KPass(const MatMulArgs& m, const AmxQ8_KActs& acts, int64_t r0,
                                   const Q4_KRows& s) {
  const int64_t nb = acts.nb, n_sub = nb * kSubBlocks;
  for (int64_t g = 0; g < Groups(m.n_act); ++g) {
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i isum[R];
      for (int i = 0; i < R; ++i) isum[i] = _mm512_set1_epi32(s.correction[i * nb + b]);
      for (int j = 0; j < kSubBlocks; ++j) {
        __m512i a[8];
        LoadBiasedBlock(acts.vnni.data() + (g * n_sub + b * kSubBlocks + j) * kGroupBlockBytes, a);
        for (int i = 0; i < R; ++i) {
          const size_t at = static_cast<size_t>(i * nb + b);
          const int8_t* quants = s.quants.data() + at * QK_K + 32 * j;
          const __m512i sub = DotBlock(_mm512_setzero_si512(), a, quants);
          isum[i] = _mm512_add_epi32(
              isum[i], _mm512_mullo_epi32(sub, _mm512_set1_epi32(s.sc[at * kSubBlocks + j])));
        }
      }
      const int64_t at_act = (g * nb + b) * kLanes;
      const __m512 ad = _mm512_loadu_ps(acts.scale.data() + at_act);
      __m512i bsums[kSubBlocks / 2];
      for (int k = 0; k < kSubBlocks / 2; ++k) {
        bsums[k] = _mm512_loadu_si512(acts.bsums.data() + (at_act * kSubBlocks / 2) + k * kLanes);
      }
      for (int i = 0; i < R; ++i) {
        const size_t at = static_cast<size_t>(i * nb + b);
        const uint32_t* mins = s.mins.data() + at * kSubBlocks / 2;
        __m512i msum = _mm512_madd_epi16(_mm512_set1_epi32(mins[0]), bsums[0]);
        for (int k = 1; k < kSubBlocks / 2; ++k) {
          msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(mins[k]), bsums[k]);
        }
        // maskz: GCC 12 warns on _mm512_cvtepi32_ps's undefined pass-through.
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(s.d[at]), ad),
                                 _mm512_maskz_cvtepi32_ps(0xffff, isum[i]), acc[i]);
        // fnmadd: -(x * y) + acc, the contract's fmaf(-x, y, acc) exactly.
        acc[i] = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(s.dmin[at]), ad),
                                  _mm512_maskz_cvtepi32_ps(0xffff, msum), acc[i]);
      }
    }
    StoreLanes<R>(m, r0, g * kLanes, acc);
  }
}

// Both kernels: the checks and the count, then the row range in passes of
// kRows rows (the last of one row at a time), each prepared once and run
// against every group.
template <typename Rows, typename Acts>
void RunPasses(const MatMulArgs& m, const Acts& acts, GgmlType type, int64_t block,
               void (*prepare)(const MatMulArgs&, int64_t, int, int64_t, Rows&),
               void (*pass_of_rows)(const MatMulArgs&, const Acts&, int64_t, const Rows&),
               void (*pass_of_one)(const MatMulArgs&, const Acts&, int64_t, const Rows&)) {
  MG_CHECK(m.type == type, "the VNNI matmul was given weights of another type");
  MG_CHECK(m.cols % block == 0, "cols must be a multiple of the weight type's block");
  const int64_t nb = m.cols / block;
  MG_CHECK(acts.n_act == m.n_act && acts.nb == nb, "the packed activations are another matrix's");
  if (m.row_end <= m.row_begin || m.n_act <= 0) return;
  vnni_calls.fetch_add(1, std::memory_order_relaxed);
  thread_local Rows rows;
  int64_t r = m.row_begin;
  for (; r + kRows <= m.row_end; r += kRows) {
    prepare(m, r, kRows, nb, rows);
    pass_of_rows(m, acts, r, rows);
  }
  for (; r < m.row_end; ++r) {
    prepare(m, r, 1, nb, rows);
    pass_of_one(m, acts, r, rows);
  }
}

}  // namespace

void VnniMatMulQ8_0(const MatMulArgs& m, const AmxQ8_0Acts& acts) {
  RunPasses<Q8_0Rows>(m, acts, GgmlType::kQ8_0, QK8_0, &PrepareQ8_0Rows, &Q8_0Pass<kRows>,
                      &Q8_0Pass<1>);
}

void VnniMatMulQ4_K(const MatMulArgs& m, const AmxQ8_KActs& acts) {
  RunPasses<Q4_KRows>(m, acts, GgmlType::kQ4_K, QK_K, &PrepareQ4_KRows, &Q4_KPass<kRows>,
                      &Q4_KPass<1>);
}

#else

bool AvxVnniAvailable() { return false; }
void VnniMatMulQ8_0(const MatMulArgs&, const AmxQ8_0Acts&) {
  MG_CHECK(false, "AVX-512 VNNI needs x86-64");
}
void VnniMatMulQ4_K(const MatMulArgs&, const AmxQ8_KActs&) {
  MG_CHECK(false, "AVX-512 VNNI needs x86-64");
}

#endif

void VnniMatMulQ8_0(const MatMulArgs& m) {
  PackAndRun<AmxQ8_0Acts>(m, &PackAmxQ8_0Acts, &VnniMatMulQ8_0);
}

void VnniMatMulQ4_K(const MatMulArgs& m) {
  PackAndRun<AmxQ8_KActs>(m, &PackAmxQ8_KActs, &VnniMatMulQ4_K);
}

uint64_t VnniMatMulCalls() { return vnni_calls.load(std::memory_order_relaxed); }

}  // namespace moegraph
