// ---------------------------------------------------------------------------
// fagen CPU emulator, PTX level: memory counters (fagen/emulator/ptx/counters.py).
// Compiled into a PTX-level module only when counters are asked for
// (build_ptx(..., counters=True)): the translator then calls note() before every
// memory instruction of the PTX, with the instruction's site (an index into the
// module's site table), the lane's dynamic execution count of that site and the
// lane's address(es). The lanes of a warp do not run in lockstep on the fibers:
// an access joins the group (warp, site, k-th execution by the lane); a group is
// one warp-level request, closed when every lane of the warp has issued the
// instruction (active or predicated off) or when the block ends, and counted
// then (docs/emulator.md, "Memory counters"):
//   shared memory: 32 banks of 4 bytes; a request is processed in phases (4-byte
//   and narrower accesses: one phase of 32 lanes; 8-byte: 2 phases of 16 lanes;
//   16-byte: 4 phases of 8 lanes; ldmatrix / stmatrix: one phase per 8x16-byte
//   matrix, its 8 row addresses); a phase with an active lane takes
//   max over banks of the distinct 4-byte words it touches in that bank
//   wavefronts (the same word twice is a broadcast); ideal: ceil(distinct words / 32);
//   global memory: sectors = distinct 32-byte segments touched by the active lanes;
//   ideal sectors: ceil(distinct bytes / 32);
//   TMA and bulk copies (cp.async.bulk[.tensor], cp.reduce.async.bulk[.tensor]): one copy per
//   active lane, its bytes (the box of the tensor map, or the size operand); no wavefront or
//   sector model (they do not go through the LSU).
// ---------------------------------------------------------------------------
#include <algorithm>
#include <unordered_map>
#include <vector>

namespace fagen_emu {
namespace pxc {

enum Kind { kShared = 0, kGlobal = 1, kGeneric = 2, kMatrix = 3, kCpAsync = 4, kBulk = 5 };

// Per site: shared requests, wavefronts, ideal wavefronts, shared bytes; global requests,
// sectors, ideal sectors, global bytes; TMA / bulk copies and their bytes.
struct Stat {
    uint64_t sreq, wav, iwav, sbytes, greq, sec, isec, gbytes, breq, bbytes;
};

// The bytes a tensor copy moves: the box of its tensor map (traversal strides applied).
inline uint64_t tma_bytes(const void* map) {
    const FaTensorMap* m = static_cast<const FaTensorMap*>(map);
    if (!m || m->rank < 1 || m->rank > 5) return 0;
    uint64_t n = m->elem_bytes;
    for (unsigned i = 0; i < m->rank; ++i)
        n *= (m->box[i] + (m->elem_strides[i] ? m->elem_strides[i] : 1u) - 1u) / (m->elem_strides[i] ? m->elem_strides[i] : 1u);
    return n;
}

struct Group {
    uint64_t a0[32], a1[32];
    uint32_t issued, active, shared;  // lanes that issued / were active / addressed shared memory
    unsigned site;
    int kind, size, num;
};

inline std::vector<Stat> stats;
inline std::unordered_map<uint64_t, Group> pending;
inline uint64_t serial = ~0ull;

// Wavefronts of one phase: the lanes of `lanes` (active), each touching `size` bytes at a[l].
inline void phase(const uint64_t* a, uint32_t lanes, int size, uint64_t& wav, uint64_t& iwav) {
    if (!lanes) return;
    uint64_t words[32 * 4];
    int n = 0;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(lanes >> l & 1u)) continue;
        const uint64_t first = a[l] >> 2, last = (a[l] + uint64_t(size > 0 ? size : 1) - 1) >> 2;
        for (uint64_t w = first; w <= last && n < 128; ++w) words[n++] = w;
    }
    std::sort(words, words + n);
    n = int(std::unique(words, words + n) - words);
    unsigned per_bank[32] = {0};
    unsigned worst = 0;
    for (int i = 0; i < n; ++i) worst = std::max(worst, ++per_bank[words[i] & 31u]);
    wav += worst;
    iwav += (unsigned(n) + 31u) / 32u;
}

inline void shared_request(Stat& s, const uint64_t* a, uint32_t lanes, int size) {
    if (!lanes) return;
    s.sreq += 1;
    s.sbytes += uint64_t(__builtin_popcount(lanes)) * uint64_t(size);
    const int lanes_per_phase = size <= 4 ? 32 : (size == 8 ? 16 : 8);
    for (int p = 0; p < 32; p += lanes_per_phase) {
        const uint32_t m = lanes_per_phase == 32 ? ~0u : (((1u << lanes_per_phase) - 1u) << p);
        phase(a, lanes & m, size, s.wav, s.iwav);
    }
}

inline void global_request(Stat& s, const uint64_t* a, uint32_t lanes, int size) {
    if (!lanes) return;
    s.greq += 1;
    s.gbytes += uint64_t(__builtin_popcount(lanes)) * uint64_t(size);
    uint64_t segs[32 * 2];
    std::pair<uint64_t, uint64_t> iv[32];
    int n = 0, m = 0;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(lanes >> l & 1u)) continue;
        const uint64_t lo = a[l], hi = a[l] + uint64_t(size);
        for (uint64_t sg = lo >> 5; sg <= (hi - 1) >> 5 && n < 64; ++sg) segs[n++] = sg;
        iv[m++] = {lo, hi};
    }
    std::sort(segs, segs + n);
    s.sec += uint64_t(std::unique(segs, segs + n) - segs);
    std::sort(iv, iv + m);
    uint64_t bytes = 0, end = 0;
    for (int i = 0; i < m; ++i) {
        const uint64_t lo = std::max(iv[i].first, end);
        if (iv[i].second > lo) bytes += iv[i].second - lo;
        end = std::max(end, iv[i].second);
    }
    s.isec += (bytes + 31u) / 32u;
}

inline void close(const Group& gr) {
    if (gr.site >= stats.size()) stats.resize(gr.site + 1, Stat{});
    Stat& s = stats[gr.site];
    switch (gr.kind) {
        case kShared: shared_request(s, gr.a0, gr.active, gr.size); break;
        case kGlobal: global_request(s, gr.a0, gr.active, gr.size); break;
        case kGeneric:
            shared_request(s, gr.a0, gr.active & gr.shared, gr.size);
            global_request(s, gr.a0, gr.active & ~gr.shared, gr.size);
            break;
        case kMatrix:  // ldmatrix / stmatrix .xN: lanes 8p..8p+7 give matrix p's row addresses
            if (!gr.active) break;
            s.sreq += 1;
            for (int p = 0; p < gr.num; ++p) {
                const uint32_t m = (0xffu << (8 * p)) & gr.active;
                s.sbytes += uint64_t(__builtin_popcount(m)) * 16u;
                phase(gr.a0, m, 16, s.wav, s.iwav);
            }
            break;
        case kBulk:  // one copy per active lane, a0 its bytes
            for (unsigned l = 0; l < 32; ++l)
                if (gr.active >> l & 1u) s.breq += 1, s.bbytes += gr.a0[l];
            break;
        default:  // kCpAsync: a0 the shared destination, a1 the global source, `size` bytes each
            shared_request(s, gr.a0, gr.active, gr.size);
            global_request(s, gr.a1, gr.active, gr.size);
            break;
    }
}

inline void flush() {
    for (auto& kv : pending) close(kv.second);
    pending.clear();
}

// One lane's issue of the memory instruction at `site` (its k-th), active or predicated off.
inline void note(unsigned site, int kind, int size, int num, uint32_t k, bool active, uint64_t a0, uint64_t a1) {
    if (g.block_serial != serial) {
        flush();
        serial = g.block_serial;
    }
    const unsigned idx = g.cur->index, w = idx >> 5, lane = idx & 31u;
    const uint64_t key = uint64_t(w) << 52 | uint64_t(site) << 32 | k;
    auto it = pending.find(key);
    if (it == pending.end()) {
        Group fresh;
        fresh.issued = fresh.active = fresh.shared = 0;
        fresh.site = site, fresh.kind = kind, fresh.size = size, fresh.num = num;
        it = pending.emplace(key, fresh).first;
    }
    Group& gr = it->second;
    gr.issued |= 1u << lane;
    if (active) {
        gr.active |= 1u << lane;
        if (kind == kGeneric) {
            const uint64_t base = uint64_t(reinterpret_cast<uintptr_t>(g.smem));
            if (g.smem && a0 >= base && a0 < base + g.smem_bytes) {
                gr.shared |= 1u << lane;
                a0 -= base;
            }
        }
        gr.a0[lane] = a0;
        gr.a1[lane] = a1;
    }
    if (gr.issued == g.warps[w].exists) {
        close(gr);
        pending.erase(it);
    }
}

}  // namespace pxc
}  // namespace fagen_emu

extern "C" __attribute__((visibility("default"))) void fagen_pxc_reset() {
    fagen_emu::pxc::pending.clear();
    fagen_emu::pxc::stats.assign(fagen_emu::pxc::stats.size(), fagen_emu::pxc::Stat{});
}
// Closes the pending groups, then copies 10 counters per site for sites [0, n) into out.
extern "C" __attribute__((visibility("default"))) void fagen_pxc_read(uint64_t* out, unsigned n) {
    fagen_emu::pxc::flush();
    for (unsigned i = 0; i < n; ++i) {
        const fagen_emu::pxc::Stat s = i < fagen_emu::pxc::stats.size() ? fagen_emu::pxc::stats[i] : fagen_emu::pxc::Stat{};
        const uint64_t v[10] = {s.sreq, s.wav, s.iwav, s.sbytes, s.greq, s.sec, s.isec, s.gbytes, s.breq, s.bbytes};
        for (int j = 0; j < 10; ++j) out[10 * i + j] = v[j];
    }
}
