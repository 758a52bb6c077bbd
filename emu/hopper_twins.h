// The CPU build's Hopper primitives of kernels/ptx.cuh (wgmma, mbarrier, TMA); included from
// ptx_twins.h, whose checks and tile products they share. Layouts and semantics are described in
// ptx.cuh. How each twin may differ from the hardware: README.md's emu section.
//
// Asynchrony is emulated as late as the ISA allows, so that a kernel that skips a wait reads what a
// GPU could give it: a wgmma's accumulators reach the registers only at the wgmma_wait that retires
// it (until then the registers hold kWgmmaInFlight and WgmmaAcc's element access fails), and a TMA
// load lands only when a thread waits on its mbarrier for a phase the load must complete (with
// EMU_RANDOM_ORDER, some loads land at issue instead).
#pragma once
#include "poison.h"
#include "tensor_map.h"

#include <deque>
#include <unordered_set>

namespace emu {
// ---- shared-memory addresses of the block's dynamic shared memory ----
// Where the dynamic shared memory starts in the block's shared window. CUDA promises it 16-byte
// alignment only (it follows the kernel's static shared memory); on an H100 a TMA load into the
// dynamic shared memory of a kernel with 8 bytes of static shared memory faulted with "misaligned
// address" (docs/gpu-runs/2026-11-28-h100-80gb-hbm3-73ba680, test_hopper). Emu starts it at the
// least aligned address allowed, so a kernel that takes more alignment for granted (128 bytes for
// TMA, 1024 for a 128-byte swizzle's pattern) fails here as it can there: align from smem_address.
constexpr uint32_t kDynamicSmemBase = 16;
inline uint32_t dynamic_smem_offset(const char* what, const void* p, size_t bytes) {
    const auto* q = static_cast<const unsigned char*>(p);
    const BlockState& b = *t_block;
    if (q < b.dyn_smem || q + bytes > b.dyn_smem + b.dyn_smem_bytes)
        fail_access(what, p, "is not inside the block's dynamic shared memory (emu addresses descriptors and TMA "
                             "destinations there only)");
    return static_cast<uint32_t>(q - b.dyn_smem) + kDynamicSmemBase;
}
inline const unsigned char* dynamic_smem_at(const char* what, uint32_t address, size_t bytes) {
    const BlockState& b = *t_block;
    if (address < kDynamicSmemBase || address - kDynamicSmemBase + bytes > b.dyn_smem_bytes) {
        char msg[240];
        std::snprintf(msg, sizeof msg,
                      "%s: shared address %u lies outside the block's %zu bytes of dynamic shared memory (at %u..%zu)",
                      what, address, b.dyn_smem_bytes, kDynamicSmemBase, kDynamicSmemBase + b.dyn_smem_bytes);
        fail_thread(msg);
    }
    return b.dyn_smem + (address - kDynamicSmemBase);
}

// ---- state kept per block (mbarriers, TMA loads in flight) and per thread (wgmmas in flight) ----
struct TmaLoad {
    unsigned char* dst;
    TensorMapFields map;
    int coords[5];
    uint64_t* bar;
    uint32_t bytes;
};
struct AsyncBlockState {
    uint64_t serial = 0;                      // the block it belongs to (BlockState::serial)
    uint64_t activity = 0;                    // bumped by every mbarrier or TMA operation: waiters recheck
    std::unordered_set<const uint64_t*> barriers;  // initialized mbarriers
    std::vector<TmaLoad> loads;               // issued, not yet landed
};
inline AsyncBlockState& async_block_state() {
    static thread_local AsyncBlockState s;  // a worker runs one block at a time
    if (s.serial != t_block->serial) {
        s = AsyncBlockState{};
        s.serial = t_block->serial;
    }
    return s;
}

constexpr uint32_t kWgmmaInFlight = 0x7fdeadbeu;  // a NaN: an accumulator register whose wgmma is in flight
struct WgmmaInFlight {
    float* acc;         // the registers it will write (WgmmaAcc::r)
    int regs;
    uint64_t group;     // the commit group it belongs to (== committed: not committed yet)
    float value[128];   // its result, computed at issue
};
struct WgmmaThreadState {
    uint64_t serial = 0;
    bool fenced = false;
    uint64_t committed = 0;              // groups committed so far
    std::deque<WgmmaInFlight> in_flight;  // issue order
};
inline WgmmaThreadState& wgmma_state() {
    static thread_local TwinStates<WgmmaThreadState> states;  // per fiber
    WgmmaThreadState& s = twin_state(states, t_thread->wgmma_cache);
    if (s.serial != t_block->serial) {
        s = WgmmaThreadState{};
        s.serial = t_block->serial;
    }
    return s;
}
[[noreturn, gnu::noinline, gnu::cold]] inline void fail_acc_in_flight(int reg) {
    char msg[200];
    std::snprintf(msg, sizeof msg,
                  "wgmma accumulator register %d accessed while its wgmma is in flight (before the wgmma_wait that "
                  "retires it)", reg);
    fail_thread(msg);
}
inline void check_acc_retired(const float* acc, int reg) {
    WgmmaThreadState& s = wgmma_state();
    for (const WgmmaInFlight& w : s.in_flight)
        if (w.acc == acc) fail_acc_in_flight(reg);
}
}  // namespace emu

template <int N>
struct WgmmaAcc {
    static_assert(wgmma_n_supported(N), "wgmma shapes here: m64n64k16, m64n128k16, m64n256k16");
    float r[N / 2];
    float& operator[](int i) {
        emu::check_acc_retired(r, i);
        return r[i];
    }
    const float& operator[](int i) const {
        emu::check_acc_retired(r, i);
        return r[i];
    }
};

__device__ __forceinline__ uint32_t smem_address(const void* p) { return emu::dynamic_smem_offset("smem_address", p, 1); }

namespace emu {
// ---- wgmma.mma_async ----
struct WgmmaIn {
    const float* c;   // the input accumulators: the registers, or the in-flight result they will hold
    float* d;         // where the result goes (the new in-flight entry)
    uint64_t desc_a, desc_b;
    uint32_t a[4];    // A from registers
    int n, warp;      // warp: index within the warpgroup
    bool a_in_regs, scale_d;
};
static_assert(sizeof(WgmmaIn) <= kSlotBytes);

// The shared-memory address of element (r, k) of a K-major operand described by `desc` (ptx.cuh).
struct SmemDesc {
    uint32_t start, lbo, sbo;
    Swizzle swizzle;
};
inline SmemDesc decode_smem_desc(uint64_t desc) {
    const Swizzle modes[4] = {Swizzle::none, Swizzle::b128, Swizzle::b64, Swizzle::b32};
    const SmemDesc d{uint32_t(desc & 0x3fff) << 4, uint32_t((desc >> 16) & 0x3fff) << 4, uint32_t((desc >> 32) & 0x3fff) << 4,
                     modes[desc >> 62]};
    char msg[200];
    if ((desc >> 49) & 7) {
        std::snprintf(msg, sizeof msg, "wgmma descriptor %016llx: base offset %u (emu implements 0 only)",
                      (unsigned long long)desc, unsigned((desc >> 49) & 7));
        fail_thread(msg);
    }
    const uint32_t span = swizzle_bytes(d.swizzle);
    if (d.swizzle != Swizzle::none && (d.start >> 7) & (span / 16 - 1)) {
        std::snprintf(msg, sizeof msg,
                      "wgmma descriptor %016llx: start address %u is not in the first 128 bytes of a %u-byte swizzle "
                      "pattern's repeat (every %u bytes)", (unsigned long long)desc, d.start, span, 8 * span);
        fail_thread(msg);
    }
    return d;
}
// E4m3: the operand holds e4m3 bytes (16 k's per core-matrix row), else bf16 (8).
template <bool E4m3 = false>
inline float smem_desc_element(const SmemDesc& d, int r, int k) {
    constexpr int eb = E4m3 ? 1 : 2, per_row = 16 / eb;
    const uint32_t a = d.swizzle == Swizzle::none
                           ? d.start + (r / 8) * d.sbo + (r % 8) * 16 + (k / per_row) * d.lbo + (k % per_row) * eb
                           : swizzle_address(d.start + (r / 8) * d.sbo + (r % 8) * swizzle_bytes(d.swizzle) + eb * k, d.swizzle);
    if constexpr (E4m3) {
        return e4m3_values()[*dynamic_smem_at("wgmma operand", a, 1)];
    } else {
        uint16_t h;
        std::memcpy(&h, dynamic_smem_at("wgmma operand", a, 2), 2);
        return bf16_bits_value(h);
    }
}

// One wgmma of the warp: bf16 (k16) or, with E4m3, e4m3 (k32, A from shared memory only); the products
// (exact in fp32 for both) are added in k order from the accumulator.
template <int N, bool E4m3 = false>
void wgmma_combine(const unsigned char* in, unsigned char*, unsigned) {
    constexpr int K = E4m3 ? 32 : 16;
    WgmmaIn lane[32];
    for (int l = 0; l < 32; ++l) std::memcpy(&lane[l], in + l * kSlotBytes, sizeof lane[l]);
    const WgmmaIn& l0 = lane[0];
    for (int l = 1; l < 32; ++l)
        if (lane[l].desc_a != l0.desc_a || lane[l].desc_b != l0.desc_b || lane[l].n != N || lane[l].scale_d != l0.scale_d ||
            lane[l].a_in_regs != l0.a_in_regs)
            fail_thread("divergent warpgroup: lanes of a warp issued wgmma with different shapes, descriptors or scale-d");
    float A[1][16][K];
    alignas(32) float B[N / 8][K][8], D[1][N / 8][16][8];
    const int row0 = 16 * l0.warp;
    if constexpr (E4m3) {
        if (l0.a_in_regs) fail_thread("e4m3 wgmma with A from registers: emu implements A from shared memory only");
    }
    if (l0.a_in_regs && !E4m3) {
        for (int l = 0; l < 32; ++l) {
            const int g = l / 4, t = l % 4;
            const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
            for (int i = 0; i < 4; ++i) {
                A[0][rows[i]][cols[i]] = bf16_lo(lane[l].a[i]);
                A[0][rows[i]][cols[i] + 1] = bf16_hi(lane[l].a[i]);
            }
        }
    } else {
        const SmemDesc a = decode_smem_desc(l0.desc_a);
        for (int r = 0; r < 16; ++r)
            for (int k = 0; k < K; ++k) A[0][r][k] = smem_desc_element<E4m3>(a, row0 + r, k);
    }
    const SmemDesc b = decode_smem_desc(l0.desc_b);
    for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) B[n / 8][k][n % 8] = smem_desc_element<E4m3>(b, n, k);
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < N / 8; ++i) {
            const float* c = lane[l].c + 4 * i;
            const bool s = l0.scale_d;
            D[0][i][g][2 * t] = s ? c[0] : 0.0f;
            D[0][i][g][2 * t + 1] = s ? c[1] : 0.0f;
            D[0][i][g + 8][2 * t] = s ? c[2] : 0.0f;
            D[0][i][g + 8][2 * t + 1] = s ? c[3] : 0.0f;
        }
    }
    mma_tiles_accumulate<1, N / 8, K>(D, A, B);  // k ascending from the accumulator; the products are exact
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < N / 8; ++i) {
            float* d = lane[l].d + 4 * i;
            d[0] = D[0][i][g][2 * t];
            d[1] = D[0][i][g][2 * t + 1];
            d[2] = D[0][i][g + 8][2 * t];
            d[3] = D[0][i][g + 8][2 * t + 1];
        }
    }
}

template <int N, bool E4m3 = false>
void wgmma_issue(WgmmaAcc<N>& acc, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool scale_d) {
    WgmmaThreadState& s = wgmma_state();
    if (!s.fenced) fail_thread("wgmma issued without a wgmma_fence since the last wgmma_wait (or the kernel's start)");
    const unsigned warps = (t_block->block_dim.x * t_block->block_dim.y * t_block->block_dim.z + 31) / 32;
    if ((t_thread->warp / 4) * 4 + 4 > warps)
        fail_thread("wgmma issued by a warp whose warpgroup (4 aligned warps of 32 threads) is incomplete");
    const float* c = acc.r;  // chained wgmmas read the newest in-flight result for these registers
    for (const WgmmaInFlight& w : s.in_flight)
        if (w.acc == acc.r) c = w.value;
    WgmmaInFlight& entry = s.in_flight.emplace_back();
    entry.acc = acc.r;
    entry.regs = N / 2;
    entry.group = s.committed;
    WgmmaIn in{c, entry.value, desc_a, desc_b, {}, N, static_cast<int>(t_thread->warp % 4), a != nullptr, scale_d};
    if (a) std::memcpy(in.a, a, sizeof in.a);
    std::memcpy(collective_slot(), &in, sizeof in);
    collective_arrive(E4m3 ? "wgmma.mma_async .e4m3" : a ? "wgmma.mma_async (A from registers)" : "wgmma.mma_async",
                      0xffffffffu, wgmma_combine<N, E4m3>);
    for (float& r : acc.r) std::memcpy(&r, &kWgmmaInFlight, sizeof r);
}

// Retires every wgmma of the groups older than the newest `keep` committed ones: each accumulator gets
// the result of its last retired wgmma, unless a later one on it stays in flight.
inline void wgmma_retire(WgmmaThreadState& s, uint64_t keep) {
    if (s.committed <= keep) return;
    const uint64_t last = s.committed - keep;  // groups [0, last) retire
    size_t retiring = 0;
    while (retiring < s.in_flight.size() && s.in_flight[retiring].group < last) ++retiring;
    for (size_t i = 0; i < retiring; ++i) {
        const WgmmaInFlight& w = s.in_flight[i];
        bool superseded = false;
        for (size_t j = i + 1; j < s.in_flight.size(); ++j) superseded |= s.in_flight[j].acc == w.acc;
        if (superseded) continue;
        for (int r = 0; r < w.regs; ++r) {
            uint32_t bits;
            std::memcpy(&bits, &w.acc[r], sizeof bits);
            if (bits != kWgmmaInFlight) {
                char msg[200];
                std::snprintf(msg, sizeof msg, "wgmma accumulator register %d was written while its wgmma was in flight", r);
                fail_thread(msg);
            }
        }
        std::memcpy(w.acc, w.value, sizeof(float) * w.regs);
    }
    s.in_flight.erase(s.in_flight.begin(), s.in_flight.begin() + static_cast<std::ptrdiff_t>(retiring));
}

// ---- mbarrier: the 64-bit object holds pending arrivals (bits 0-19), expected arrivals (20-39), the
// tx-count (40-61, two's complement) and the phase parity (63) ----
struct Mbarrier {
    uint32_t pending, expected;
    int32_t tx;
    uint32_t phase;
};
inline Mbarrier mbarrier_fields(uint64_t w) {
    const int32_t tx = static_cast<int32_t>(uint32_t(w >> 40) & 0x3fffff);
    return {uint32_t(w & 0xfffff), uint32_t((w >> 20) & 0xfffff), tx >= (1 << 21) ? tx - (1 << 22) : tx, uint32_t(w >> 63)};
}
inline uint64_t mbarrier_word(const Mbarrier& m) {
    return uint64_t(m.pending) | uint64_t(m.expected) << 20 | uint64_t(uint32_t(m.tx) & 0x3fffff) << 40 |
           uint64_t(m.phase) << 63;
}
[[noreturn, gnu::noinline, gnu::cold]] inline void fail_mbarrier(const char* what, const void* bar, const char* why) {
    char msg[240];
    std::snprintf(msg, sizeof msg, "%s: mbarrier at %p %s", what, bar, why);
    fail_thread(msg);
}
inline void check_mbarrier(const char* what, const uint64_t* bar, bool initialized = true) {
    if (reinterpret_cast<uintptr_t>(bar) % 8) fail_mbarrier(what, bar, "is not 8-byte aligned");
    if (!in_block_shared(bar, 8)) fail_mbarrier(what, bar, "is not in the block's shared memory");
    if (initialized && !async_block_state().barriers.count(bar)) fail_mbarrier(what, bar, "was not initialized (mbarrier_init)");
}
// The phase completes once every arrival is in and the transactions are done: the next one starts.
inline void mbarrier_update(const char* what, uint64_t* bar, int arrivals, int64_t tx) {
    Mbarrier m = mbarrier_fields(*bar);
    const int64_t new_tx = m.tx + tx;
    if (new_tx >= (1 << 20) || new_tx <= -(1 << 20)) fail_mbarrier(what, bar, "tx-count leaves the range +-(2^20 - 1)");
    m.tx = static_cast<int32_t>(new_tx);
    m.pending -= static_cast<uint32_t>(arrivals);
    if (m.pending == 0 && m.tx == 0) {
        m.phase ^= 1;
        m.pending = m.expected;
    }
    *bar = mbarrier_word(m);
    ++async_block_state().activity;
}

// ---- TMA ----
inline void tma_perform(const TmaLoad& t) {
    const TensorMapFields& m = t.map;
    const uint32_t dst = dynamic_smem_offset("TMA destination", t.dst, 1);
    const Swizzle sw = m.swizzle_bytes == 128 ? Swizzle::b128 : m.swizzle_bytes == 64 ? Swizzle::b64
                       : m.swizzle_bytes == 32 ? Swizzle::b32 : Swizzle::none;
    uint32_t box[5] = {1, 1, 1, 1, 1};
    for (int d = 0; d < m.rank; ++d) box[d] = m.box[d];
    const uint64_t fill = m.nan_fill ? ~0ull : 0ull;  // all ones is NaN in every floating type
    uint32_t at = 0;                                  // the element's byte offset in the box
    for (uint32_t i4 = 0; i4 < box[4]; ++i4)
        for (uint32_t i3 = 0; i3 < box[3]; ++i3)
            for (uint32_t i2 = 0; i2 < box[2]; ++i2)
                for (uint32_t i1 = 0; i1 < box[1]; ++i1)
                    for (uint32_t i0 = 0; i0 < box[0]; ++i0, at += m.elem_bytes) {
                        const uint32_t idx[5] = {i0, i1, i2, i3, i4};
                        const unsigned char* src = m.base;
                        bool inside = true;
                        for (int d = 0; d < m.rank; ++d) {
                            const int64_t c = int64_t(t.coords[d]) + idx[d];
                            inside &= c >= 0 && uint64_t(c) < m.dims[d];
                            src += c * int64_t(m.strides[d]);
                        }
                        unsigned char* out = const_cast<unsigned char*>(
                            dynamic_smem_at("TMA destination", swizzle_address(dst + at, sw), m.elem_bytes));
                        if (!inside) {
                            std::memcpy(out, &fill, m.elem_bytes);
                            continue;
                        }
                        if (!in_device_allocation(src, m.elem_bytes))
                            fail_access("TMA source", src, "is not inside one device allocation (the tensor map's "
                                                           "dims and strides reach past its buffer)");
                        std::memcpy(out, src, m.elem_bytes);
                    }
    mbarrier_update("TMA complete_tx", t.bar, 0, -int64_t(t.bytes));
}
// Lands the loads in flight that complete on `bar`, in issue order.
inline void tma_land(uint64_t* bar) {
    AsyncBlockState& s = async_block_state();
    std::vector<TmaLoad> landing;
    std::erase_if(s.loads, [&](const TmaLoad& t) {
        if (t.bar != bar) return false;
        landing.push_back(t);
        return true;
    });
    for (const TmaLoad& t : landing) tma_perform(t);
}
template <int R>
void tma_issue(void* smem_dst, const CUtensorMap* map, const int (&coords)[R], uint64_t* bar) {
    TmaLoad t{};
    std::memcpy(&t.map, map, sizeof t.map);
    if (t.map.magic != kTensorMapMagic) fail_access("TMA tensor map", map, "is not a tensor map encoded by cuTensorMapEncodeTiled");
    if (t.map.rank != R) {
        char msg[160];
        std::snprintf(msg, sizeof msg, "TMA %dd load with a tensor map of rank %d", R, t.map.rank);
        fail_thread(msg);
    }
    if (dynamic_smem_offset("TMA destination", smem_dst, 1) % 128)
        fail_access("TMA destination", smem_dst, "is not 128-byte aligned");
    check_mbarrier("TMA load", bar);
    t.dst = static_cast<unsigned char*>(smem_dst);
    for (int d = 0; d < R; ++d) t.coords[d] = coords[d];
    t.bar = bar;
    t.bytes = t.map.elem_bytes;
    for (int d = 0; d < R; ++d) t.bytes *= t.map.box[d];
    dynamic_smem_offset("TMA destination", smem_dst, t.bytes);
    if (cp_async_complete_early()) return tma_perform(t);
    AsyncBlockState& s = async_block_state();
    s.loads.push_back(t);
    ++s.activity;
}
}  // namespace emu

template <int N>
__device__ __forceinline__ void wgmma_ss(WgmmaAcc<N>& d, uint64_t desc_a, uint64_t desc_b, bool scale_d) {
    emu::wgmma_issue<N>(d, nullptr, desc_a, desc_b, scale_d);
}
template <int N>
__device__ __forceinline__ void wgmma_rs(WgmmaAcc<N>& d, const uint32_t (&a)[4], uint64_t desc_b, bool scale_d) {
    emu::wgmma_issue<N>(d, a, 0, desc_b, scale_d);
}
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(WgmmaAcc<N>& d, uint64_t desc_a, uint64_t desc_b, bool scale_d) {
    emu::wgmma_issue<N, true>(d, nullptr, desc_a, desc_b, scale_d);
}
template <class... Acc>
__device__ __forceinline__ void wgmma_fence(Acc&...) {
    emu::wgmma_state().fenced = true;
}
__device__ __forceinline__ void wgmma_commit() { ++emu::wgmma_state().committed; }
template <int Groups, class... Acc>
__device__ __forceinline__ void wgmma_wait(Acc&...) {
    static_assert(Groups >= 0, "wgmma.wait_group takes a non-negative group count");
    emu::WgmmaThreadState& s = emu::wgmma_state();
    emu::wgmma_retire(s, Groups);
    s.fenced = false;
}
__device__ __forceinline__ void fence_proxy_async() {}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(setmaxnreg_supported(Regs), "setmaxnreg takes 24..256 registers, a multiple of 8");
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(setmaxnreg_supported(Regs), "setmaxnreg takes 24..256 registers, a multiple of 8");
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
    emu::check_mbarrier("mbarrier_init", bar, false);
    if (arrivals == 0 || arrivals >= (1u << 20)) emu::fail_mbarrier("mbarrier_init", bar, "given an arrival count outside 1..2^20-1");
    emu::async_block_state().barriers.insert(bar);
    *bar = emu::mbarrier_word({arrivals, arrivals, 0, 0});
    ++emu::async_block_state().activity;
}
__device__ __forceinline__ void fence_mbarrier_init() {}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    emu::check_mbarrier("mbarrier_arrive", bar);
    emu::mbarrier_update("mbarrier_arrive", bar, 1, 0);
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    emu::check_mbarrier("mbarrier_arrive_expect_tx", bar);
    emu::mbarrier_update("mbarrier_arrive_expect_tx", bar, 1, bytes);
}
// A thread whose phase has not completed lands the TMA loads owed to the barrier, then (if still not
// complete) waits for any mbarrier or TMA activity in the block before answering: the hardware's
// try_wait also suspends for a while, and a block whose threads all wait fails as a deadlock.
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
    emu::check_mbarrier("mbarrier_try_wait", bar);
    auto done = [&] { return emu::mbarrier_fields(*bar).phase != (parity & 1); };
    if (done()) return true;
    emu::tma_land(bar);
    if (done()) return true;
    emu::AsyncBlockState& s = emu::async_block_state();
    emu::wait_while_equal(&s.activity, s.activity,
                          "mbarrier_try_wait (a phase that never completes: an arrival or expect_tx bytes are missing)");
    return done();
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
    emu::tma_issue<2>(smem_dst, map, {c0, c1}, bar);
}
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
    emu::tma_issue<3>(smem_dst, map, {c0, c1, c2}, bar);
}
