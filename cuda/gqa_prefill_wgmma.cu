// GQA prefill on Hopper's warpgroup MMA (wgmma): the contract and the fused append of the
// mma.sync kernel (cuda/gqa_prefill.cu), for bf16/f16 at head dims 64 and 128.
//
// Grid (ceil(T / 128), Hq, B); two warpgroups of 64 query rows each. Q, K and V tiles sit in
// shared memory in the 128-byte swizzled layout wgmma reads directly: S = Q K^T is an
// m64n128k16 product with both operands in shared memory, and O += P V takes P from the S
// accumulators in registers (rounded to T, as FlashAttention does) and V through the
// transposed-B mode, so neither K nor V passes through registers. All 256 threads stream
// K/V blocks through a 2-stage cp.async ring, one block ahead, issuing the next block's copies
// while the tensor cores compute S. The ping-pong shape (not the handler's default yet) lets the
// two warpgroups run out of step instead, so one's softmax runs under the other's products.
// The packed form (q [N, Hq, D], cu_seqlens) runs (ceil(N / 128) + B, Hq): one block per
// (sequence, query tile) that can hold work (PackedBlockOf).
#include <algorithm>
#include <atomic>

#include "cuda/cp_async.cuh"
#include "cuda/device_info.h"
#include "cuda/gqa_prefill_common.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/mbarrier.cuh"
#include "cuda/mma.cuh"
#include "cuda/wgmma.cuh"

namespace jax_kv {
namespace {

// One kernel configuration: WGS warpgroups of 64 query rows per CTA, BLOCK_N keys per block.
// Lockstep (PINGPONG false): one CTA barrier per block, so both warpgroups compute S, then
// softmax while the tensor cores idle, then P V. PINGPONG (FlashAttention-3's schedule, two
// warpgroups): named barriers make the warpgroups take turns issuing S, which leaves them about
// one product apart, so each one's softmax runs under the other's products; the K/V ring then
// synchronizes per stage on mbarriers (full: all copies landed; empty: both warpgroups done)
// instead of a CTA barrier, with 3 stages and copies two blocks ahead, so the warpgroup ahead
// never waits for the one behind to free the stage it refills.
template <int HEAD_DIM, int WGS, int BLOCK_N, bool PINGPONG>
struct WgmmaShape {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "swizzle atoms hold 64-element columns");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "wgmma N of S: 64 or 128");
  static_assert(!PINGPONG || WGS == 2, "ping-pong alternates two warpgroups");
  static constexpr int kBlockM = 64 * WGS;  // query rows per CTA
  static constexpr int kThreads = 128 * WGS;
  static constexpr int kStages = PINGPONG ? 3 : 2;
  static constexpr int kQBytes = kBlockM * HEAD_DIM * 2;
  static constexpr int kTileBytes = BLOCK_N * HEAD_DIM * 2;  // one K or V block
  static constexpr int kRingBytes = 2 * kStages * kTileBytes;
  // + 1 KB: the dynamic window is only 16-byte aligned, the swizzle atoms need 1024; then the
  // full and empty mbarriers of each stage.
  static constexpr int kSmemBytes = kQBytes + kRingBytes + 1024 + (PINGPONG ? 16 * kStages : 0);
  // One warpgroup per CTA asks for two CTAs per SM: their phases interleave on their own.
  static constexpr int kMinCtasPerSm = WGS == 1 ? 2 : 1;
};

// The configuration the handler launches (measured: bench/NOTES.md, "Prefill on wgmma").
constexpr int kDefaultWarpgroups = 2, kDefaultBlockN = 128;
constexpr bool kDefaultPingPong = false;

#if JKV_HAS_WGMMA
constexpr int kRowBytes = 128;  // one swizzle-atom row: 64 b16 elements

// Byte offset of 16-byte chunk c of row r in a [rows, HEAD_DIM] tile stored as HEAD_DIM / 64
// column blocks of [rows, 64], each row 128 bytes with chunk c % 8 at (c % 8) ^ (r % 8). That
// is wgmma's 128-byte swizzle both for a K-major operand (Q, K: rows are M or N) and for an
// MN-major one (V: rows are K), and it spreads cp.async's writes of a column over all banks.
__device__ __forceinline__ uint32_t SwizzledChunk(int rows, int r, int c) {
  return static_cast<uint32_t>(((c >> 3) * rows + r) * kRowBytes + (((c & 7) ^ (r & 7)) << 4));
}
#endif

template <typename T, int HEAD_DIM, int WGS, int BLOCK_N, bool PINGPONG>
__global__ void __launch_bounds__(WgmmaShape<HEAD_DIM, WGS, BLOCK_N, PINGPONG>::kThreads,
                                  WgmmaShape<HEAD_DIM, WGS, BLOCK_N, PINGPONG>::kMinCtasPerSm)
    GqaPrefillWgmmaKernel(const GqaParams<T> p) {
#if JKV_HAS_WGMMA
  using Sh = WgmmaShape<HEAD_DIM, WGS, BLOCK_N, PINGPONG>;
  constexpr int kBlockM = Sh::kBlockM, kBlockN = BLOCK_N, kThreads = Sh::kThreads;
  constexpr int kStages = Sh::kStages;
  constexpr int NV = HEAD_DIM / 8;  // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sq = (SmemAddr(smem_raw) + 1023u) & ~1023u;  // [kBlockM, HEAD_DIM]
  // Stage s: K block at sk(s), V block right after it.
  auto sk = [&](int stage) { return sq + Sh::kQBytes + stage * 2 * Sh::kTileBytes; };

  prefill::PrefillCta cta;
  if (!prefill::BeginPrefillCta<T, HEAD_DIM>(p, kBlockM, cta)) return;
  // Ping-pong: full(s) completes when every thread's copies into stage s landed, empty(s) when
  // every thread is done reading it.
  const uint32_t bars = sq + Sh::kQBytes + Sh::kRingBytes;
  auto full = [&](int stage) { return bars + 8 * stage; };
  auto empty = [&](int stage) { return bars + 8 * (kStages + stage); };
  if constexpr (PINGPONG) {
    if (threadIdx.x == 0) {
      for (int st = 0; st < kStages; ++st) {
        MbarInit(full(st), kThreads);
        MbarInit(empty(st), kThreads);
      }
      MbarInitFence();
    }
    __syncthreads();
  }
  const int b = cta.b, qh = cta.qh, hkv = cta.hkv, L = cta.L, m0 = cta.m0;
  const int live_end = cta.live_end;
  const int64_t q_row0 = cta.q_row0;

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const int gid = lane / 4, tig = lane % 4;
  for (int i = tid; i < kBlockM * NV; i += kThreads) {
    const int r = i / NV, c = i % NV, t = m0 + r;
    const bool pred = t < live_end;
    const T* src = pred ? p.q + ((q_row0 + t) * p.num_q_heads + qh) * HEAD_DIM + c * 8 : p.q;
    CpAsync16(sq + SwizzledChunk(kBlockM, r, c), src, pred);
  }
  const int p_lo = L + m0, p_hi = L + live_end - 1;  // positions of the first / last live row
  const int kv_lo = p.window > 0 ? max(0, p_lo + 1 - p.window) : 0;
  const int kv_hi = p_hi;  // inclusive: keys past the last live row are never needed
  const int nblocks = (kv_hi - kv_lo + kBlockN) / kBlockN;
  // Each thread copies one fixed 16-byte column c of rows r0, r0 + kRowsPerPass, ... of a K/V
  // block: its sources step by one position stride, its swizzled targets by constant offsets
  // (kRowsPerPass is a multiple of 8, so the XOR pattern is the same on every pass).
  constexpr int kRowsPerPass = kThreads / NV;
  const int c = tid % NV, r0 = tid / NV;
  const int64_t cache_off0 = kv_offset(p.cache, b, 0, hkv) + c * 8;  // + pos * cache.s
  const int64_t new_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const int64_t new_off0 = (q_row0 - L) * new_stride + hkv * HEAD_DIM + c * 8;  // + pos * stride
  const uint32_t dst0 = SwizzledChunk(kBlockN, r0, c);
  // Both candidate offsets (cache, new tokens) advance by a constant per pass, so a copy costs
  // two selects and an add instead of a 64-bit multiply under branches (SASS: ~30 -> ~14
  // instructions a pass).
  const int64_t cache_step = kRowsPerPass * p.cache.s, new_step = kRowsPerPass * new_stride;
  auto load_kv = [&](int j, int stage) {
    const uint32_t k_base = sk(stage) + dst0, v_base = k_base + Sh::kTileBytes;
    const int pos0 = kv_lo + j * kBlockN + r0;
    const int blk_lo = kv_lo + j * kBlockN, blk_hi = blk_lo + kBlockN - 1;
    // Most blocks lie wholly in the cache or wholly in k/v, and at or before the last key:
    // one source and no per-copy selects or predicates.
    if (blk_hi <= kv_hi && (blk_hi < L || blk_lo >= L)) {
      const bool cached = blk_hi < L;
      const int64_t step = cached ? cache_step : new_step;
      const int64_t off = cached ? cache_off0 + pos0 * p.cache.s : new_off0 + pos0 * new_stride;
      const T* ks = (cached ? p.k_cache : p.k_new) + off;
      const T* vs = (cached ? p.v_cache : p.v_new) + off;
#pragma unroll
      for (int pass = 0; pass < kBlockN / kRowsPerPass; ++pass) {
        const uint32_t dst = pass * kRowsPerPass * kRowBytes;
        CpAsync16(k_base + dst, ks, true);
        CpAsync16(v_base + dst, vs, true);
        ks += step;
        vs += step;
      }
      return;
    }
    int64_t cache_off = cache_off0 + pos0 * p.cache.s, new_off = new_off0 + pos0 * new_stride;
#pragma unroll
    for (int pass = 0; pass < kBlockN / kRowsPerPass; ++pass) {
      const int pos = pos0 + pass * kRowsPerPass;
      const bool pred = pos <= kv_hi, cached = pos < L;  // keys at >= L come from k/v
      // A copy with pred false reads nothing; its address stays inside the array anyway.
      const int64_t off = pred ? (cached ? cache_off : new_off) : 0;
      const uint32_t dst = pass * kRowsPerPass * kRowBytes;
      CpAsync16(k_base + dst, (cached ? p.k_cache : p.k_new) + off, pred);
      CpAsync16(v_base + dst, (cached ? p.v_cache : p.v_new) + off, pred);
      cache_off += cache_step;
      new_off += new_step;
    }
  };
  const prefill::ScoreScaling sc = prefill::MakeScoreScaling(p.scale, p.softcap);
  const int wg_row0 = m0 + wg * 64;  // this warpgroup's first query row
  const int wg_p_lo = L + wg_row0, wg_p_hi = L + min(wg_row0 + 63, live_end - 1);
  const int row_pos[2] = {wg_p_lo + warp * 16 + gid, wg_p_lo + warp * 16 + gid + 8};
  const uint32_t q_wg = sq + wg * 64 * kRowBytes;
  // S = Q K^T of block `blk` into `acc` (committed, not waited). Every warpgroup computes every
  // block of the CTA's range, even one wholly masked for its rows (at most one past its
  // diagonal or window edge): a wgmma under a warpgroup-dependent branch makes ptxas
  // serialize all of them.
  auto issue_s = [&](float (&acc)[kBlockN / 2], int blk) {
    const uint32_t k_base = sk(blk % kStages);
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      // k-step kk: column block kk / 4, 32 bytes per step inside it (the hardware swizzles).
      const uint32_t col = (kk / 4) * kRowBytes, step = (kk % 4) * 32;
      WgmmaSS<T, kBlockN>(acc, SmemDescSw128(q_wg + col * kBlockM + step, 16, 8 * kRowBytes),
                          SmemDescSw128(k_base + col * kBlockN + step, 16, 8 * kRowBytes), kk > 0);
    }
    WgmmaCommit();
  };
  // Accumulator fragments: element 4n + e is row gid + 8 (e / 2), column 8n + 2 tig + e % 2
  // of the warp's 16 rows (the m16n8 C layout, n-tile after n-tile).
  float o[HEAD_DIM / 2];
#pragma unroll
  for (int i = 0; i < HEAD_DIM / 2; ++i) o[i] = 0.0f;
  float m[2] = {kMaxSentinel, kMaxSentinel}, l[2] = {0.0f, 0.0f};
  float s[kBlockN / 2];

  // Block b sits in stage b % kStages; the copies run kStages - 1 blocks ahead.
  load_kv(0, 0);  // with Q
  if constexpr (PINGPONG) {
    CpAsyncArrive(full(0));
    for (int blk = 1; blk < kStages - 1 && blk < nblocks; ++blk) {
      load_kv(blk, blk);
      CpAsyncArrive(full(blk));
    }
    if (wg == 1) NamedBarrierArrive(1, kThreads);  // warpgroup 0 issues first
  } else {
    CpAsyncCommit();
  }
  for (int j = 0; j < nblocks; ++j) {
    const int stage = j % kStages;
    if constexpr (PINGPONG) {
      MbarWait(full(stage), (j / kStages) & 1);
      // The copies were generic-proxy writes; wgmma reads through the async proxy.
      FenceProxyAsyncShared();
      NamedBarrierSync(1 + wg, kThreads);  // this warpgroup's turn to issue S
    } else {
      CpAsyncWait<0>();  // this iteration's block landed: the only group in flight
      FenceProxyAsyncShared();
      // Every thread's copies landed, and every warpgroup is done with block j - 1, whose stage
      // the copies below overwrite.
      __syncthreads();
    }
    issue_s(s, j);
    if constexpr (PINGPONG) {
      // The other warpgroup's turn. Warpgroup 0 waits once per block: warpgroup 1's arrival
      // before the loop and after each of its blocks but the last pay for exactly those.
      if (wg == 0 || j + 1 < nblocks) NamedBarrierArrive(2 - wg, kThreads);
    } else if (j + 1 < nblocks) {
      // The copies of block j + 1 go out while the tensor cores compute S.
      load_kv(j + 1, (j + 1) % kStages);
      CpAsyncCommit();
    }
    WgmmaWait<0>();
    WgmmaFenceOperands(s);
    const int n0 = kv_lo + j * kBlockN;
    const uint32_t v_base = sk(stage) + Sh::kTileBytes;

    // Mask only the blocks that cross this warpgroup's diagonal, window edge or last key.
    prefill::SoftmaxBlock(s, o, m, l, sc,
                          n0 + kBlockN - 1 > wg_p_lo || (p.window > 0 && n0 <= wg_p_hi - p.window),
                          n0 + tig * 2, row_pos, p.window);
    // O += P V: the accumulators of n-tiles 2kk and 2kk + 1 are exactly the A fragment of
    // k-step kk; V's rows 16kk.. start 16 * 128 bytes further on (two 8-row groups).
    uint32_t pa[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      pa[kk][0] = Pack2<T>(s[8 * kk], s[8 * kk + 1]);
      pa[kk][1] = Pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = Pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = Pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      WgmmaRS<T, HEAD_DIM>(
          o, pa[kk],
          SmemDescSw128(v_base + kk * 16 * kRowBytes, kBlockN * kRowBytes, 8 * kRowBytes), 1);
    }
    WgmmaCommit();
    // Nothing stays in flight across the loop's back edge: its trip count comes from
    // lengths[b], which ptxas cannot prove uniform, and an in-flight wgmma across a branch it
    // cannot prove uniform gets every wgmma serialized.
    WgmmaWait<0>();
    WgmmaFenceOperands(o);
    if constexpr (PINGPONG) {
      MbarArrive(empty(stage));
      // Refill the stage of block j - 1 once both warpgroups are done with it (the one behind
      // finished it about a product ago, so this rarely waits).
      const int next = j + kStages - 1;
      if (next < nblocks) {
        if (next >= kStages) MbarWait(empty(next % kStages), (next / kStages - 1) & 1);
        load_kv(next, next % kStages);
        CpAsyncArrive(full(next % kStages));
      }
    }
  }

  prefill::StoreWarpRows<T, HEAD_DIM>(p, cta, wg_row0 + warp * 16, o, l);
#else
  (void)p;
  __trap();  // compute_90 PTX: the launcher never picks this kernel off sm_90a
#endif
}

}  // namespace

template <typename T, int HEAD_DIM, int WGS, int BLOCK_N, bool PINGPONG>
cudaError_t LaunchGqaPrefillWgmmaConfig(const GqaParams<T>& p, cudaStream_t stream) {
  using Sh = WgmmaShape<HEAD_DIM, WGS, BLOCK_N, PINGPONG>;
  constexpr auto kernel = GqaPrefillWgmmaKernel<T, HEAD_DIM, WGS, BLOCK_N, PINGPONG>;
  static std::atomic<uint64_t> configured{0};
  const cudaError_t allowed =
      AllowDynamicSmem(reinterpret_cast<const void*>(kernel), Sh::kSmemBytes, configured);
  if (allowed != cudaSuccess) return allowed;
  kernel<<<prefill::PrefillGrid(p, Sh::kBlockM), Sh::kThreads, Sh::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaPrefillWgmma(const GqaParams<T>& p, cudaStream_t stream) {
  return LaunchGqaPrefillWgmmaConfig<T, HEAD_DIM, kDefaultWarpgroups, kDefaultBlockN,
                                     kDefaultPingPong>(p, stream);
}

template cudaError_t LaunchGqaPrefillWgmma<bf16_t, 64>(const GqaParams<bf16_t>&, cudaStream_t);
template cudaError_t LaunchGqaPrefillWgmma<bf16_t, 128>(const GqaParams<bf16_t>&, cudaStream_t);
template cudaError_t LaunchGqaPrefillWgmma<f16_t, 64>(const GqaParams<f16_t>&, cudaStream_t);
template cudaError_t LaunchGqaPrefillWgmma<f16_t, 128>(const GqaParams<f16_t>&, cudaStream_t);

#ifdef JKV_PREFILL_ALL_CONFIGS
// The configurations bench/prefill_profile.cu times beside the default (bf16, D=128).
#define JKV_PREFILL_CONFIG(WGS, BN, PINGPONG)                                       \
  template cudaError_t LaunchGqaPrefillWgmmaConfig<bf16_t, 128, WGS, BN, PINGPONG>( \
      const GqaParams<bf16_t>&, cudaStream_t);
JKV_PREFILL_CONFIG(2, 128, true)
JKV_PREFILL_CONFIG(2, 64, true)
JKV_PREFILL_CONFIG(2, 64, false)
JKV_PREFILL_CONFIG(1, 64, false)
JKV_PREFILL_CONFIG(1, 128, false)
#undef JKV_PREFILL_CONFIG
#endif

}  // namespace jax_kv
