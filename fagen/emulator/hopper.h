// ---------------------------------------------------------------------------
// fagen CPU emulator: Hopper's asynchronous machinery (the FAGEN_EMULATOR half
// of templates/wgmma/hopper.cuh). Pasted after shim.h in every emulator
// translation unit. docs/emulator.md ("Hopper primitives") states each
// primitive's semantics with its PTX ISA section; in short:
//
// * warpgroup collectives (wgmma.mma_async, setmaxnreg): the 128 threads of a
//   warpgroup (threads 128w..128w+127 of the block) meet like a warp
//   collective; the last to arrive does the work for all of them.
// * wgmma: operands are read through the matrix descriptors with the swizzle
//   applied to absolute shared addresses (offsets into the 1024-byte aligned
//   dynamic window); D = A B (+ D when scale-d) is computed at issue, in
//   double, rounded to float once, but the destination registers hold NaN
//   poison until the issuing thread's wgmma.wait_group retires the group. A
//   write to those registers or to the shared operands in between is a
//   reported kernel error (checked when the group retires). Consecutive
//   wgmmas into the same registers chain as the ISA allows.
// * mbarrier: phase, pending arrivals and tx-count as the ISA defines them;
//   a TMA load decrements the tx-count of its mbarrier at issue but its data
//   lands (until then: poison) only when that phase completes; a wait that can
//   never complete is a deadlock naming the barrier and the waiting line.
// * TMA: the box is read from / written to global memory inside the tensor's
//   bounds only; out-of-bounds elements of a load are zero (or NaN when the
//   map asks); the smem image is the box, dense, innermost dimension first,
//   swizzled like wgmma's descriptors expect. Non-tensor bulk copies follow
//   the same completion rules.
// * stmatrix (a warp collective), named barriers (bar.sync / bar.arrive with a
//   thread count), setmaxnreg (checked, no effect), elect.sync (lane 31).
//
// Racecheck (racecheck.h, docs/emulator.md "Racecheck"): every entry point runs
// its own bookkeeping quietly (race::quiet: not the kernel's loads and stores)
// and reports the accesses and synchronisation the PTX ISA attributes to it
// through the hook_* functions below (no-ops outside the racecheck build):
// TMA / bulk loads are written by the mbarrier's agent slot and reach threads
// through its phase completion, wgmma / TMA-store operands are read by an
// agent slot that sees generic writes only up to each issuer's
// fence.proxy.async, mbarrier arrive = release, wait = acquire, named
// barriers join their participants.
// ---------------------------------------------------------------------------
#include <string>
#include <vector>
FAGEN_EMU_FAST_BEGIN  // the rest of the file (runtime.h)

// CUtensorMap stand-in of the emulator: the logical fields of a tiled tensor
// map, as fagen/tma.py packs them (128 bytes, like CUtensorMap).
struct alignas(64) FaTensorMap {
    unsigned magic;              // kTensorMapMagic: packed by fagen.tma for the emulator
    unsigned rank;               // 1..5
    unsigned elem_bytes;         // 1, 2, 4 or 8
    unsigned swizzle;            // 0, 32, 64, 128 (bytes)
    unsigned oob_nan;            // out-of-bounds fill: 0 zeros, 1 NaN (floating point only)
    unsigned dtype;              // CUtensorMapDataType numbering (6 f16, 7 f32, 9 bf16, ...)
    unsigned long long global_address;
    unsigned dims[5];            // elements per dimension, innermost first
    unsigned box[5];             // box extent (elements) per dimension
    unsigned elem_strides[5];    // traversal strides (elements)
    unsigned reserved;
    unsigned long long strides[4];  // byte strides of dimensions 1..rank-1
};
static_assert(sizeof(FaTensorMap) == 128, "FaTensorMap must be 128 bytes like CUtensorMap");

namespace fagen_emu {
namespace hopper {

constexpr unsigned kTensorMapMagic = 0x6d744146u;  // "FAtm"
// A fiber parked on a warpgroup collective or an mbarrier (not a Wait the
// runtime's own diagnostics know; describe() below reports it).
constexpr Wait kAtAsync = static_cast<Wait>(16);
constexpr unsigned kPoison32 = 0x7fff7fffu;  // NaN as float; 0x7fff is NaN as fp16 and bf16

// ------------------------------------------------------ racecheck slots
// Agent slots (race::agent(k)): the wgmma unit of warpgroup w is slot w (w < 8),
// TMA / bulk stores and reduces slot 8, the TMA / bulk loads completing on the
// i-th mbarrier initialised in the block slot 9 + i % 15.
constexpr unsigned kWgmmaAgents = 8, kBulkAgent = 8, kBarAgent0 = 9, kBarAgents = 15;

// The running thread's bookkeeping is not kernel code (racecheck build: not tracked).
struct Quiet {
#if defined(FAGEN_EMU_RACECHECK)
    FAGEN_EMU_NO_TSAN Quiet() { race::quiet(+1); }
    FAGEN_EMU_NO_TSAN ~Quiet() { race::quiet(-1); }
#endif
};

// ---------------------------------------------------------------- state
enum ParkKind : uint8_t { kParkWarpgroup, kParkMbarrier, kParkNamedBarrier };

struct Park {  // what a parked fiber waits for (deadlock reports)
    ParkKind kind;
    const char* name;
    const char* file;
    int line;
    const void* mbar;  // nullptr: a warpgroup collective
    unsigned parity;
};

struct PendingLoad {
    unsigned char* dst;
    std::vector<unsigned char> data;
};

struct Mbar {
    const void* addr;
    unsigned expected, pending, phase;  // phase: completed phases so far (parity = phase & 1)
    long tx;
    const char* file;  // where it was initialised
    int line;
    std::vector<unsigned> waiters;
    std::vector<PendingLoad> loads;
    unsigned agent;                 // racecheck: the agent slot of its loads
    std::vector<uint32_t> released;  // racecheck: releases into the current phase
    std::vector<uint32_t> done;     // racecheck: releases of the completed phases
};

struct Snap {  // one shared element an async operation read, with its value then
    const unsigned char* p;
    uint16_t v;
};

struct WgmmaOp {
    int n;
    float* d[128];
    unsigned* a[128];          // register A (rs): each thread's fragment registers; nullptr for ss
    unsigned a_saved[128][4];  // their values at issue (the registers hold poison until the wait)
    std::vector<float> res;  // [128][n/2]
    std::vector<Snap> snaps;
    bool checked;
    int refs;
    const char* file;
    int line;
    uint32_t epoch;  // racecheck: the agent's epoch of its operand reads
};

struct PendingWgmma {
    WgmmaOp* op;
    unsigned group;
    bool land;  // false: a later wgmma into the same registers superseded it
};

struct BulkOp {
    unsigned group;
    const unsigned char* src;
    std::vector<unsigned char> bytes;
    const char* file;
    int line;
    uint32_t epoch;  // racecheck: the bulk agent's epoch of its source read
};

struct ThreadState {
    std::vector<PendingWgmma> wgmma;
    unsigned wgmma_commits;
    bool fenced;
    std::vector<BulkOp> bulk;
    unsigned bulk_commits;
};

typedef void (*WgFn)(void* const* payloads);

struct WgCollective {
    unsigned arrived;
    void* payloads[128];
    WgFn fn;
    uint64_t sig;
    const char* name;
    const char* file;
    int line;
    char what[96];
};

struct NamedBarrier {
    unsigned count, arrived;  // count 0: no phase open
    const char* file;         // where the open phase's first thread arrived
    int line;
    std::vector<unsigned> waiters;
    std::vector<uint32_t> obj;  // racecheck: the arrivals of the open phase (joined)
};

struct Hopper {
    uint64_t block = ~uint64_t(0);
    NamedBarrier named[16];
    std::vector<Mbar> bars;
    std::vector<ThreadState> threads;
    std::vector<WgCollective> wgs;
    std::vector<Park> park;
};
#if FAGEN_EMU_RUNTIME_DEFS  // defined in the runtime object (runtime.h)
Hopper H;
#else
extern Hopper H;
#endif


// ------------------------------------------------------------------- wgmma
struct WgmmaLane {
    bool bf16;
    int n, ta, tb;
    float* d;
    const unsigned* a;  // nullptr: A from shared memory (ss)
    unsigned long long da, db;
    int scale_d;
    const char* file;
    int line;
};

// Shared byte address of element (mn, k) of a 16-bit operand (A: MN = M, B:
// MN = N; K = 16) given by `desc` (PTX ISA 9.7.15.5.1: canonical layouts).
//   K-major, no swizzle: 8x8 core matrices of 16-byte rows: the 8 rows of a
//     core matrix 16 B apart, core matrices SBO apart along MN, LBO along K.
//   K-major, swizzle S (32/64/128 B): rows of S bytes (all 16 K elements of a
//     row in one S-byte line), groups of 8 rows SBO apart.
//   MN-major, no swizzle: core matrices of 8 K rows of 8 MN elements (16 B);
//     SBO apart along MN, LBO apart along K.
//   MN-major, swizzle S: lines of S bytes along MN, the 8 K rows of an atom
//     S bytes apart, atoms LBO apart along MN and SBO apart along K.
// The swizzle then acts on the absolute address.
struct Desc {
    unsigned start, lbo, sbo, span;
};

constexpr long kMaxTx = (1l << 20) - 1;  // PTX ISA: tx-count range [-(2^20-1), 2^20-1]

// --------------------------------------------------------------------- TMA
enum TmaKind { kTmaLoad, kTmaStore, kTmaReduceAdd };

inline unsigned shared_addr(const void* p, const char* what, const char* file, int line) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    if (g.smem == nullptr || c < g.smem || c >= g.smem + g.smem_bytes)
        fail("%s at %s:%d: %p is not in the dynamic shared memory window (the emulator's shared addresses are "
             "offsets into fa_smem(), %zu bytes)",
             what, file, line, p, g.smem_bytes);
    return unsigned(c - g.smem);
}

// The pointer of a shared address (an offset into fa_smem(), as shared_addr gives): the
// emulator's side of a primitive that takes the address itself, as PTX's [%r] operand does.
inline unsigned char* shared_ptr(unsigned addr, const char* what, const char* file, int line) {
    if (g.smem == nullptr || addr >= g.smem_bytes)
        fail("%s at %s:%d: shared address %u is not in the dynamic shared memory window (%zu bytes)", what, file,
             line, addr, g.smem_bytes);
    return g.smem + addr;
}

// Swizzle of an absolute shared byte address (PTX ISA 9.7.15.5.1, "Shared
// Memory Matrix Layout"): the 16-byte chunk index (bits 4..6) is XORed with the
// 128-byte row index (bits 7..9) modulo 2, 4 or 8 for 32B / 64B / 128B.
inline unsigned swizzle(unsigned addr, unsigned span) {
    const unsigned bits = span == 128 ? 7u : span == 64 ? 3u : span == 32 ? 1u : 0u;
    return addr ^ (((addr >> 7) & bits) << 4);
}

inline float elem_value(uint16_t h, bool bf16) { return bf16 ? bf16_bits_to_float(h) : f16_bits_to_float(h); }

inline void fence_barrier_init() {}

// ------------------------------------------------------- global semaphores
// ld.acquire.gpu / red.release.gpu on an int in global memory: one fiber runs at a time and never
// switches inside these, so they are atomic, and memory is sequentially consistent (the orderings
// need nothing).
inline int sem_load(const int* p) {
    Quiet quiet;
    return *const_cast<const volatile int*>(p);
}
inline void sem_add(int* p, int v) {
    Quiet quiet;
    *p = int(unsigned(*p) + unsigned(v));
}

// The out-of-line half: compiled once into the runtime object (FAGEN_EMU_RUNTIME_DEFS, runtime.h) and
// only declared in a kernel unit, which then does not compile it again (it was about half of a Hopper
// module's code). A unit that pastes the prelude (no runtime object) defines it itself.
Hopper& state();
void park_self(ParkKind kind, const char* name, const char* file, int line, const void* mbar,
               unsigned parity);
void wake(unsigned i);
void warpgroup_collective(void* payload, WgFn fn, uint64_t sig, const char* name, const char* what,
                          const char* file, int line);
Desc decode_desc(unsigned long long desc, const char* what, const char* file, int line);
unsigned operand_addr(const Desc& d, bool mn_major, unsigned mn, unsigned k);
void read_operand(double* out, unsigned rows, unsigned long long desc, bool mn_major, bool bf16, WgmmaOp* op,
                  const char* what, const char* file, int line);
void wgmma_complete(void* const* payloads);
void wgmma(bool bf16, int n, int ta, int tb, float* d, const unsigned* a, unsigned long long da,
           unsigned long long db, int scale_d, const char* file, int line);
void wgmma_fence(const char*, int);
void wgmma_commit(const char*, int);
void wgmma_wait(unsigned pending, const char* file, int line);
void check_registers_free(const void* r, size_t bytes, const char* name, const char* file, int line);
std::string bar_name(const void* bar);
Mbar* find_bar(const void* bar);
Mbar& get_bar(const void* bar, const char* what, const char* file, int line);
void mbar_init(unsigned long long* bar, unsigned count, const char* file, int line);
void hook_mbar_access(const void* bar, const char* file, int line, const char* what);
void mbar_check(Mbar& b);
void mbar_tx(Mbar& b, long delta, const char* what, const char* file, int line);
unsigned long long mbar_arrive(unsigned long long* bar, unsigned tx_bytes, bool arrive, const char* what,
                               const char* file, int line);
bool mbar_wait(unsigned long long* bar, unsigned parity, const char* file, int line);
void fence_proxy_async(const char* file, int line);
void hook_load_issue(Mbar& b, const void* dst, size_t bytes, const char* what, const char* file, int line);
uint32_t hook_store_issue(const void* src, size_t bytes, const char* what, const char* file, int line);
void reduce_add(unsigned char* gp, const unsigned char* sp, unsigned dtype);
void tma(TmaKind kind, unsigned rank, void* smem, const FaTensorMap* m, unsigned long long* bar,
         const int* c, const char* file, int line);
void bulk(TmaKind kind, void* smem, void* gmem, unsigned bytes, unsigned long long* bar, const char* what,
          const char* file, int line);
void bulk_commit();
void bulk_wait(unsigned pending, const char* file, int line);
void sem_wait_eq(const int* sems, unsigned index, int value, const char* file, int line);
#if FAGEN_EMU_RUNTIME_DEFS
Hopper& state() {
    if (H.block != g.block_serial) {  // a new block: nothing of the last one survives
        for (ThreadState& t : H.threads)
            for (PendingWgmma& p : t.wgmma)
                if (--p.op->refs == 0) delete p.op;
        H.bars.clear();
        for (NamedBarrier& b : H.named) b = NamedBarrier{0, 0, nullptr, 0, {}};
        H.threads.assign(g.nthreads, ThreadState{});
        H.wgs.assign((g.nthreads + 127) / 128, WgCollective{});
        H.park.assign(g.nthreads, Park{});
        H.block = g.block_serial;
    }
    return H;
}

void park_self(ParkKind kind, const char* name, const char* file, int line, const void* mbar,
               unsigned parity) {
    Fiber* self = g.cur;
    H.park[self->index] = Park{kind, name, file, line, mbar, parity};
    self->wait = kAtAsync;
}

void wake(unsigned i) {
    g.fibers[i].wait = kRunnable;
    push(i);
}

// --------------------------------------------------- warpgroup collectives
void warpgroup_collective(void* payload, WgFn fn, uint64_t sig, const char* name, const char* what,
                          const char* file, int line) {
    Quiet quiet;
    Hopper& h = state();
    Fiber* self = g.cur;
    const unsigned wg = self->index / 128, t = self->index % 128;
    if ((wg + 1) * 128 > g.nthreads)
        fail("%s at %s:%d needs all 128 threads of warpgroup %u, but the block has only %u threads", name, file, line,
             wg, g.nthreads);
    WgCollective& c = h.wgs[wg];
    if (c.arrived == 0) {
        c.fn = fn;
        c.sig = sig;
        c.name = name;
        c.file = file;
        c.line = line;
        snprintf(c.what, sizeof c.what, "%s", what);
    } else if (c.fn != fn || c.sig != sig) {
        begin_message("divergent warpgroup collective");
        append_thread(self);
        appendf(" called %s at %s:%d while %u thread(s) of warpgroup %u wait at %s at %s:%d", what, file, line,
                c.arrived, wg, c.what, c.file, c.line);
        abort_block(FAGEN_EMU_DEADLOCK);
    }
    c.payloads[t] = payload;
    park_self(kParkWarpgroup, name, file, line, nullptr, 0);
    if (++c.arrived == 128) {
        c.arrived = 0;
        fn(c.payloads);
        for (unsigned k = 0; k < 128; ++k) wake(wg * 128 + FAGEN_EMU_ORDER(k, 128u));
    }
    schedule(false);
}

Desc decode_desc(unsigned long long desc, const char* what, const char* file, int line) {
    const unsigned mode = unsigned(desc >> 62), base = unsigned(desc >> 49) & 7u;
    if (base != 0)
        fail("%s at %s:%d: descriptor 0x%016llx has base offset %u; the emulator supports 0 only (keep swizzled "
             "tiles 1024-byte aligned)",
             what, file, line, desc, base);
    static const unsigned spans[4] = {0, 128, 64, 32};
    return Desc{unsigned(desc & 0x3fffu) << 4, unsigned(desc >> 16 & 0x3fffu) << 4, unsigned(desc >> 32 & 0x3fffu) << 4,
                spans[mode]};
}

unsigned operand_addr(const Desc& d, bool mn_major, unsigned mn, unsigned k) {
    unsigned a;
    if (!mn_major) {
        if (d.span == 0) a = d.start + (mn / 8) * d.sbo + (mn % 8) * 16 + (k / 8) * d.lbo + (k % 8) * 2;
        else a = d.start + (mn / 8) * d.sbo + (mn % 8) * d.span + k * 2;
    } else {
        if (d.span == 0) a = d.start + (mn / 8) * d.sbo + (mn % 8) * 2 + (k / 8) * d.lbo + (k % 8) * 16;
        else {
            const unsigned w = d.span / 2;  // elements per line
            a = d.start + (mn / w) * d.lbo + (mn % w) * 2 + (k / 8) * d.sbo + (k % 8) * d.span;
        }
    }
    return swizzle(a, d.span);
}

void read_operand(double* out, unsigned rows, unsigned long long desc, bool mn_major, bool bf16, WgmmaOp* op,
                  const char* what, const char* file, int line) {
    const Desc d = decode_desc(desc, what, file, line);
    for (unsigned mn = 0; mn < rows; ++mn)
        for (unsigned k = 0; k < 16; ++k) {
            const unsigned a = operand_addr(d, mn_major, mn, k);
            if (a + 2 > g.smem_bytes)
                fail("%s at %s:%d: operand element (%u, %u) at shared offset 0x%x is past the %zu-byte dynamic window",
                     what, file, line, mn, k, a, g.smem_bytes);
            if (a & 1u) fail("%s at %s:%d: operand element at odd shared offset 0x%x", what, file, line, a);
            uint16_t v;
            memcpy(&v, g.smem + a, 2);
            out[mn * 16 + k] = elem_value(v, bf16);
            op->snaps.push_back(Snap{g.smem + a, v});
        }
}

void wgmma_complete(void* const* payloads) {
    Hopper& h = state();
    const WgmmaLane& p0 = *static_cast<const WgmmaLane*>(payloads[0]);
    const char* what = p0.a ? "fa_wgmma_m64nNk16_rs" : "fa_wgmma_m64nNk16_ss";
    const unsigned base = (g.cur->index / 128) * 128;
    for (unsigned t = 0; t < 128; ++t) {
        const WgmmaLane& p = *static_cast<const WgmmaLane*>(payloads[t]);
        if (p.da != p0.da || p.db != p0.db || p.scale_d != p0.scale_d)
            fail("%s at %s:%d: descriptors and scale-d must be the same in the whole warpgroup (thread %u has "
                 "0x%llx, 0x%llx, %d; thread %u has 0x%llx, 0x%llx, %d)",
                 what, p.file, p.line, base + t, p.da, p.db, p.scale_d, base, p0.da, p0.db, p0.scale_d);
        if (!h.threads[base + t].fenced)
            fail("%s at %s:%d: thread %u issues a wgmma without fa_wgmma_fence() since its last "
                 "fa_wgmma_wait_group (PTX ISA 9.7.15.7.1: wgmma.fence orders register accesses before wgmma)",
                 what, p.file, p.line, base + t);
    }
    const unsigned n = unsigned(p0.n);
    WgmmaOp* op = new WgmmaOp();
    op->n = p0.n;
    op->res.assign(128 * (n / 2), 0.f);
    op->checked = false;
    op->refs = 0;
    op->file = p0.file;
    op->line = p0.line;
    std::vector<double> A(64 * 16), B(size_t(n) * 16);  // A[m][k], B[n][k]
    if (p0.a == nullptr) {
        read_operand(A.data(), 64, p0.da, p0.ta != 0, p0.bf16, op, what, p0.file, p0.line);
    } else {
        // Register A: warp w's registers hold rows 16w..16w+15 in mma.m16n8k16's A layout.
        for (unsigned t = 0; t < 128; ++t) {
            const unsigned* a = static_cast<const WgmmaLane*>(payloads[t])->a;
            for (const PendingWgmma& pw : h.threads[base + t].wgmma)  // A of a wgmma still in flight: its values
                if (pw.op->a[t] == a) a = pw.op->a_saved[t];
            memcpy(op->a_saved[t], a, sizeof op->a_saved[t]);
            const unsigned w = t / 32, gq = (t % 32) >> 2, tq = t & 3u;
            for (unsigned r = 0; r < 4; ++r) {
                const unsigned row = 16 * w + gq + 8 * (r & 1u), col = 2 * tq + 8 * (r >> 1);
                A[row * 16 + col] = elem_value(uint16_t(a[r] & 0xffffu), p0.bf16);
                A[row * 16 + col + 1] = elem_value(uint16_t(a[r] >> 16), p0.bf16);
            }
        }
    }
    read_operand(B.data(), n, p0.db, p0.tb != 0, p0.bf16, op, what, p0.file, p0.line);
    for (unsigned t = 0; t < 128; ++t) {
        const WgmmaLane& p = *static_cast<const WgmmaLane*>(payloads[t]);
        ThreadState& ts = h.threads[base + t];
        // C: the pending result of an earlier wgmma into the same registers, else the registers.
        const float* c = p.d;
        for (auto it = ts.wgmma.rbegin(); it != ts.wgmma.rend(); ++it)
            if (it->land && it->op->d[t] == p.d && it->op->n == p0.n) {
                c = &it->op->res[t * (n / 2)];
                it->land = false;
                break;
            }
        const unsigned w = t / 32, gq = (t % 32) >> 2, tq = t & 3u;
        float* out = &op->res[t * (n / 2)];
        for (unsigned i = 0; i < n / 2; ++i) {
            const unsigned row = 16 * w + gq + 8 * ((i >> 1) & 1u), col = 8 * (i / 4) + 2 * tq + (i & 1u);
            double acc = p0.scale_d ? double(c[i]) : 0.0;
            for (unsigned k = 0; k < 16; ++k) acc += A[row * 16 + k] * B[col * 16 + k];
            out[i] = float(acc);
        }
        for (unsigned i = 0; i < n / 2; ++i) memcpy(&p.d[i], &kPoison32, 4);
        op->d[t] = p.d;
        // Register A, like the accumulator (PTX ISA 9.7.15.7.3: accessing the registers of A before the
        // wait_group that retires the wgmma is undefined): poison until the wait, which restores them.
        op->a[t] = const_cast<unsigned*>(p.a);
        if (p.a)
            for (unsigned r = 0; r < 4; ++r) memcpy(op->a[t] + r, &kPoison32, 4);
        ++op->refs;
        ts.wgmma.push_back(PendingWgmma{op, ts.wgmma_commits, true});
    }
#if defined(FAGEN_EMU_RACECHECK)
    // The warpgroup's wgmma unit reads the operands (async proxy) when issued: ordered after what
    // the issuers synchronised with, their own generic writes only up to their fence.proxy.async.
    const unsigned wg = base / 128;
    if (wg < kWgmmaAgents) {
        char name[64];
        snprintf(name, sizeof name, "wgmma of warpgroup %u", wg);
        race::name_agent(wg, name);
        const uint32_t where = race::site(p0.file, p0.line, "wgmma.mma_async");
        op->epoch = race::agent_issue(race::agent(wg), base, 128, true, where);
        for (const Snap& s : op->snaps) race::access(race::agent(wg), s.p, 2, race::kRead, where);
    }
#endif
}

void wgmma(bool bf16, int n, int ta, int tb, float* d, const unsigned* a, unsigned long long da,
           unsigned long long db, int scale_d, const char* file, int line) {
    WgmmaLane lane{bf16, n, ta, tb, d, a, da, db, scale_d != 0, file, line};
    char what[96];
    snprintf(what, sizeof what, "%s<%s, %d, %d, %d>", a ? "fa_wgmma_m64nNk16_rs" : "fa_wgmma_m64nNk16_ss",
             bf16 ? "__nv_bfloat16" : "__half", n, ta, tb);
    const uint64_t sig = uint64_t(bf16) | uint64_t(n) << 1 | uint64_t(ta) << 10 | uint64_t(tb) << 11 |
                         uint64_t(a != nullptr) << 12;
    warpgroup_collective(&lane, &wgmma_complete, sig, a ? "fa_wgmma_m64nNk16_rs" : "fa_wgmma_m64nNk16_ss", what,
                         file, line);
}

void wgmma_fence(const char*, int) {
    Quiet quiet;
    state().threads[g.cur->index].fenced = true;
}
void wgmma_commit(const char*, int) {
    Quiet quiet;
    ++state().threads[g.cur->index].wgmma_commits;
}

// Retires every wgmma of this thread in a group older than the `pending` most
// recent committed groups: checks the operands and registers were left alone,
// then writes the results into the registers.
void wgmma_wait(unsigned pending, const char* file, int line) {
    Quiet quiet;
    Hopper& h = state();
    const unsigned self = g.cur->index, t = self % 128;
    ThreadState& ts = h.threads[self];
    ts.fenced = false;
    if (ts.wgmma_commits <= pending) return;
    const unsigned done = ts.wgmma_commits - pending;
    size_t keep = 0;
    std::vector<WgmmaOp*> retired;
    for (size_t k = 0; k < ts.wgmma.size(); ++k) {
        PendingWgmma pw = ts.wgmma[k];
        if (pw.group >= done) {
            ts.wgmma[keep++] = pw;
            continue;
        }
        WgmmaOp* op = pw.op;
        if (!op->checked) {
            op->checked = true;
            for (const Snap& s : op->snaps) {
                uint16_t now;
                memcpy(&now, s.p, 2);
                if (now != s.v)
                    fail("shared memory at offset 0x%x, an operand of the wgmma issued at %s:%d, was written "
                         "before fa_wgmma_wait_group at %s:%d retired it",
                         unsigned(s.p - g.smem), op->file, op->line, file, line);
            }
        }
        if (pw.land) {
            float* d = op->d[t];
            for (int i = 0; i < op->n / 2; ++i) {
                unsigned bits;
                memcpy(&bits, &d[i], 4);
                if (bits != kPoison32)
                    fail("accumulator register d[%d] of the wgmma issued at %s:%d was written before "
                         "fa_wgmma_wait_group at %s:%d retired it",
                         i, op->file, op->line, file, line);
            }
            memcpy(d, &op->res[t * (op->n / 2)], sizeof(float) * size_t(op->n / 2));
        }
#if defined(FAGEN_EMU_RACECHECK)
        if (self / 128 < kWgmmaAgents)  // retired: the operand reads happen before what follows
            race::agent_retired(self, race::agent(self / 128), op->epoch, race::site(file, line, "wgmma.wait_group"));
#endif
        retired.push_back(op);
    }
    ts.wgmma.resize(keep);
    // Register A of the retired wgmmas: untouched since the issue (still poison), then the thread's
    // again -- unless a wgmma still in flight reads the same registers (it restores them at its wait).
    for (size_t k = 0; k < retired.size(); ++k) {
        unsigned* a = retired[k]->a[t];
        bool busy = a == nullptr;
        for (size_t j = 0; j < k && !busy; ++j) busy = retired[j]->a[t] == a;
        for (size_t j = 0; j < keep && !busy; ++j) busy = ts.wgmma[j].op->a[t] == a;
        if (busy) continue;
        for (int r = 0; r < 4; ++r)
            if (memcmp(a + r, &kPoison32, 4) != 0)
                fail("register A fragment a[%d] of the wgmma issued at %s:%d was written before "
                     "fa_wgmma_wait_group at %s:%d retired it",
                     r, retired[k]->file, retired[k]->line, file, line);
        memcpy(a, retired[k]->a_saved[t], sizeof retired[k]->a_saved[t]);
    }
    for (WgmmaOp* op : retired)
        if (--op->refs == 0) delete op;
}

// A primitive reading `bytes` of this thread's registers at `r` (stmatrix): none may be the
// accumulator or the register A of a wgmma the thread has not yet retired with wait_group (PTX ISA
// 9.7.15.7.3: undefined; the emulator's poison would otherwise be stored as data).
void check_registers_free(const void* r, size_t bytes, const char* name, const char* file, int line) {
    Hopper& h = state();
    const unsigned self = g.cur->index, t = self % 128;
    const char* lo = static_cast<const char*>(r);
    for (const PendingWgmma& pw : h.threads[self].wgmma) {
        const WgmmaOp* op = pw.op;
        const char* d = reinterpret_cast<const char*>(op->d[t]);
        const char* a = reinterpret_cast<const char*>(op->a[t]);
        const bool in_d = lo < d + sizeof(float) * size_t(op->n / 2) && d < lo + bytes;
        const bool in_a = a && lo < a + sizeof op->a_saved[t] && a < lo + bytes;
        if (in_d || in_a)
            fail("%s at %s:%d reads register(s) of %s of the wgmma issued at %s:%d before fa_wgmma_wait_group "
                 "retired it (PTX ISA 9.7.15.7.3: undefined)",
                 name, file, line, in_a ? "the A fragment" : "the accumulator", op->file, op->line);
    }
}

// ---------------------------------------------------------------- mbarrier
std::string bar_name(const void* bar) {
    char buf[64];
    const unsigned char* c = static_cast<const unsigned char*>(bar);
    if (g.smem && c >= g.smem && c < g.smem + g.smem_bytes) snprintf(buf, sizeof buf, "smem+0x%x", unsigned(c - g.smem));
    else snprintf(buf, sizeof buf, "%p", bar);
    return buf;
}

Mbar* find_bar(const void* bar) {
    for (Mbar& b : H.bars)
        if (b.addr == bar) return &b;
    return nullptr;
}

Mbar& get_bar(const void* bar, const char* what, const char* file, int line) {
    state();
    Mbar* b = find_bar(bar);
    if (b == nullptr)
        fail("%s at %s:%d: mbarrier %s was not initialised (fa_mbarrier_init) in this block", what, file, line,
             bar_name(bar).c_str());
    return *b;
}

void mbar_init(unsigned long long* bar, unsigned count, const char* file, int line) {
    Quiet quiet;
    state();
    if (reinterpret_cast<uintptr_t>(bar) & 7u)
        fail("fa_mbarrier_init at %s:%d: mbarrier %p is not 8-byte aligned", file, line, static_cast<void*>(bar));
    if (count < 1 || count > unsigned(kMaxTx))
        fail("fa_mbarrier_init at %s:%d: count %u is outside [1, 2^20 - 1]", file, line, count);
    Mbar* b = find_bar(bar);
    if (b && !b->waiters.empty())
        fail("fa_mbarrier_init at %s:%d: mbarrier %s is re-initialised while threads wait on it", file, line,
             bar_name(bar).c_str());
    if (!b) {
        H.bars.push_back(Mbar{});
        b = &H.bars.back();
    }
    b->addr = bar;
    b->expected = b->pending = count;
    b->phase = 0;
    b->tx = 0;
    b->file = file;
    b->line = line;
    b->waiters.clear();
    b->loads.clear();
    *bar = 0;  // the object's bits mean nothing to the emulator; the record above is the state
#if defined(FAGEN_EMU_RACECHECK)
    // The init is a plain write of the object; every later mbarrier operation an atomic access.
    b->agent = kBarAgent0 + unsigned(b - H.bars.data()) % kBarAgents;
    b->released.assign(race::dim(), 0u);
    b->done.assign(race::dim(), 0u);
    char name[64];
    snprintf(name, sizeof name, "TMA / bulk loads completing on mbarrier %s", bar_name(bar).c_str());
    race::name_agent(b->agent, name);
    race::access(g.cur->index, bar, 8, race::kWrite, race::site(file, line, "mbarrier.init"));
#endif
}

// An mbarrier operation of the running thread: an atomic access of the object.
void hook_mbar_access(const void* bar, const char* file, int line, const char* what) {
#if defined(FAGEN_EMU_RACECHECK)
    race::access(g.cur->index, bar, 8, race::kAtomic, race::site(file, line, what));
#else
    (void)bar, (void)file, (void)line, (void)what;
#endif
}

// The current phase completes when no arrival is pending and the tx-count is 0.
void mbar_check(Mbar& b) {
    if (b.pending != 0 || b.tx != 0) return;
#if defined(FAGEN_EMU_RACECHECK)
    const unsigned a = race::agent(b.agent);
    if (!b.loads.empty()) race::tick(a, race::site(b.file, b.line, "mbarrier phase complete (TMA data landed)"));
#endif
    for (PendingLoad& l : b.loads) {
        memcpy(l.dst, l.data.data(), l.data.size());
#if defined(FAGEN_EMU_RACECHECK)
        race::async_write_land(a, l.dst, l.data.size());
#endif
    }
#if defined(FAGEN_EMU_RACECHECK)
    // The phase releases its arrivals and (complete_tx) its loads' landing to every waiter.
    if (!b.loads.empty()) b.released[a] = std::max(b.released[a], race::epoch_of(a));
    for (size_t u = 0; u < b.done.size(); ++u) b.done[u] = std::max(b.done[u], b.released[u]), b.released[u] = 0;
#endif
    b.loads.clear();
    ++b.phase;
    b.pending = b.expected;
    std::vector<unsigned> w;
    w.swap(b.waiters);
    for (unsigned k = 0; k < w.size(); ++k) wake(w[FAGEN_EMU_ORDER(k, unsigned(w.size()))]);
}

void mbar_tx(Mbar& b, long delta, const char* what, const char* file, int line) {
    const long tx = b.tx + delta;
    if (tx > kMaxTx || tx < -kMaxTx)
        fail("%s at %s:%d: tx-count of mbarrier %s would be %ld, outside [-(2^20 - 1), 2^20 - 1]", what, file, line,
             bar_name(b.addr).c_str(), tx);
    b.tx = tx;
}

unsigned long long mbar_arrive(unsigned long long* bar, unsigned tx_bytes, bool arrive, const char* what,
                               const char* file, int line) {
    Quiet quiet;
    Mbar& b = get_bar(bar, what, file, line);
    hook_mbar_access(bar, file, line, what);
    mbar_tx(b, long(tx_bytes), what, file, line);
    const unsigned long long token = (unsigned long long)(b.phase & 1u) << 63 | b.phase;
    if (arrive) {
        if (b.pending == 0)
            fail("%s at %s:%d: mbarrier %s gets more arrivals than its count %u in phase %u", what, file, line,
                 bar_name(bar).c_str(), b.expected, b.phase);
        --b.pending;
#if defined(FAGEN_EMU_RACECHECK)
        race::release(b.released.data(), g.cur->index, race::site(file, line, what));  // arrive: release
#endif
    }
    mbar_check(b);
    return token;
}

// mbarrier.try_wait.parity: true once the phase of parity `parity` has
// completed, i.e. the current phase has the other parity. Right after init
// (phase 0 current) parity 1 counts as the completed preceding phase. The
// emulator's try_wait never times out: it blocks until the phase completes.
bool mbar_wait(unsigned long long* bar, unsigned parity, const char* file, int line) {
    Quiet quiet;
    Mbar& b = get_bar(bar, "fa_mbarrier_try_wait_parity", file, line);
    hook_mbar_access(bar, file, line, "mbarrier.try_wait.parity");
    if ((b.phase & 1u) == (parity & 1u)) {
        b.waiters.push_back(g.cur->index);
        park_self(kParkMbarrier, "fa_mbarrier_try_wait_parity", file, line, bar, parity & 1u);
        schedule(false);
    }
#if defined(FAGEN_EMU_RACECHECK)
    // The completed phase's releases (arrivals, landed loads) happen before what follows.
    if (Mbar* now = find_bar(bar)) race::acquire(now->done.data(), g.cur->index,
                                                 race::site(file, line, "mbarrier.try_wait.parity"));
#endif
    return true;
}
// fence.proxy.async: the thread's generic-proxy accesses so far are ordered before the async
// proxy's later accesses (wgmma operand reads, TMA / bulk store sources).
void fence_proxy_async(const char* file, int line) {
#if defined(FAGEN_EMU_RACECHECK)
    race::proxy_fence(g.cur->index, race::site(file, line, "fence.proxy.async"));
#else
    (void)file, (void)line;
#endif
}

// A TMA / bulk load into dst completing on b, issued by the running thread: the barrier's agent
// writes dst (after what the issuer synchronised with), in flight until the phase completes.
void hook_load_issue(Mbar& b, const void* dst, size_t bytes, const char* what, const char* file, int line) {
#if defined(FAGEN_EMU_RACECHECK)
    hook_mbar_access(b.addr, file, line, what);  // complete_tx on the object
    const unsigned a = race::agent(b.agent);
    const uint32_t where = race::site(file, line, what);
    race::agent_issue(a, g.cur->index, 1, false, where);
    race::async_write_issue(a, dst, bytes, where);
#else
    (void)b, (void)dst, (void)bytes, (void)what, (void)file, (void)line;
#endif
}

// A TMA / bulk store or reduce of the running thread reads its shared source through the async
// proxy now; returns the read's epoch (retired by the thread's bulk wait).
uint32_t hook_store_issue(const void* src, size_t bytes, const char* what, const char* file, int line) {
#if defined(FAGEN_EMU_RACECHECK)
    const unsigned a = race::agent(kBulkAgent);
    race::name_agent(kBulkAgent, "TMA / bulk stores and reduces");
    const uint32_t where = race::site(file, line, what);
    const uint32_t e = race::agent_issue(a, g.cur->index, 1, true, where);
    race::access(a, src, bytes, race::kRead, where);
    return e;
#else
    (void)src, (void)bytes, (void)what, (void)file, (void)line;
    return 0;
#endif
}

void reduce_add(unsigned char* gp, const unsigned char* sp, unsigned dtype) {
    switch (dtype) {
        case 6: {  // f16
            uint16_t x, y;
            memcpy(&x, gp, 2), memcpy(&y, sp, 2);
            const __half r = __float2half_rn(f16_bits_to_float(x) + f16_bits_to_float(y));
            memcpy(gp, &r, 2);
            break;
        }
        case 9: {  // bf16
            uint16_t x, y;
            memcpy(&x, gp, 2), memcpy(&y, sp, 2);
            const __nv_bfloat16 r = __float2bfloat16_rn(bf16_bits_to_float(x) + bf16_bits_to_float(y));
            memcpy(gp, &r, 2);
            break;
        }
        case 7: case 10: {  // f32
            float x, y;
            memcpy(&x, gp, 4), memcpy(&y, sp, 4);
            x += y;
            memcpy(gp, &x, 4);
            break;
        }
        case 2: case 3: {  // u32 / s32 (two's complement: the same addition)
            unsigned x, y;
            memcpy(&x, gp, 4), memcpy(&y, sp, 4);
            x += y;
            memcpy(gp, &x, 4);
            break;
        }
        default: fail("fa_tma_reduce_add: the tensor map's data type %u has no emulated add", dtype);
    }
}

void tma(TmaKind kind, unsigned rank, void* smem, const FaTensorMap* m, unsigned long long* bar,
         const int* c, const char* file, int line) {
    static const char* const names[3][6] = {
        {"", "", "fa_tma_load_2d", "fa_tma_load_3d", "fa_tma_load_4d", "fa_tma_load_5d"},
        {"", "", "fa_tma_store_2d", "fa_tma_store_3d", "fa_tma_store_4d", "fa_tma_store_5d"},
        {"", "", "fa_tma_reduce_add_2d", "fa_tma_reduce_add_3d", "fa_tma_reduce_add_4d", "fa_tma_reduce_add_5d"}};
    const char* what = names[kind][rank];
    Quiet quiet;
    Hopper& h = state();
    if (m->magic != kTensorMapMagic)
        fail("%s at %s:%d: the tensor map is not an emulator map (pack it with fagen.tma for the CPU)", what, file,
             line);
    if (m->rank != rank)
        fail("%s at %s:%d: the tensor map has rank %u, the instruction %u", what, file, line, m->rank, rank);
    const unsigned s_addr = shared_addr(smem, what, file, line);
    if (s_addr & 127u)
        fail("%s at %s:%d: shared address 0x%x is not 128-byte aligned", what, file, line, s_addr);
    unsigned ext[5] = {1, 1, 1, 1, 1};
    size_t count = 1;
    for (unsigned i = 0; i < rank; ++i) {
        ext[i] = (m->box[i] + m->elem_strides[i] - 1) / m->elem_strides[i];
        count *= ext[i];
        if (kind != kTmaLoad && c[i] < 0)
            fail("%s at %s:%d: coordinate %u is %d; a store / reduce box must not start below 0", what, file, line, i,
                 c[i]);
    }
    const unsigned eb = m->elem_bytes;
    if (m->swizzle && ext[0] * eb != m->swizzle)
        fail("%s at %s:%d: the box's inner extent is %u bytes; with a %u-byte swizzle the emulator needs exactly %u",
             what, file, line, ext[0] * eb, m->swizzle, m->swizzle);
    const size_t bytes = count * eb;
    if (s_addr + bytes > g.smem_bytes)
        fail("%s at %s:%d: the %zu-byte box at shared offset 0x%x is past the %zu-byte dynamic window", what, file,
             line, bytes, s_addr, g.smem_bytes);
    std::vector<unsigned char> data;
    if (kind == kTmaLoad) data.assign(bytes, 0);
    if (kind == kTmaLoad && m->oob_nan) {  // all-ones: NaN in every floating-point width
        data.assign(bytes, 0xff);
    }
    unsigned char* gbase = reinterpret_cast<unsigned char*>(uintptr_t(m->global_address));
    unsigned j[5] = {0, 0, 0, 0, 0};
    for (size_t lin = 0; lin < count; ++lin) {
        bool inside = true;
        size_t goff = 0;
        for (unsigned i = 0; i < rank; ++i) {
            const long x = long(c[i]) + long(j[i]) * long(m->elem_strides[i]);
            if (x < 0 || x >= long(m->dims[i])) inside = false;
            goff += size_t(x) * (i == 0 ? eb : m->strides[i - 1]);
        }
        const unsigned s = swizzle(s_addr + unsigned(lin * eb), m->swizzle) - s_addr;
        if (inside) {
            if (kind == kTmaLoad) memcpy(&data[s], gbase + goff, eb);
            else if (kind == kTmaStore) {
                memcpy(gbase + goff, g.smem + s_addr + s, eb);
#if defined(FAGEN_EMU_RACECHECK)
                race::global_store(reinterpret_cast<uintptr_t>(gbase + goff), eb, race::site(file, line, what));
#endif
            }
            else reduce_add(gbase + goff, g.smem + s_addr + s, m->dtype);
        }
        for (unsigned i = 0; i < rank && ++j[i] == ext[i]; ++i) j[i] = 0;
    }
    if (kind == kTmaLoad) {
        Mbar& b = get_bar(bar, what, file, line);
        for (size_t k = 0; k < bytes; k += 2) memcpy(g.smem + s_addr + k, &kPoison32, bytes - k >= 2 ? 2 : 1);
        hook_load_issue(b, g.smem + s_addr, bytes, what, file, line);
        b.loads.push_back(PendingLoad{g.smem + s_addr, std::move(data)});
        mbar_tx(b, -long(bytes), what, file, line);  // the whole box, out-of-bounds elements included
        mbar_check(b);
    } else {
        ThreadState& ts = h.threads[g.cur->index];
        const unsigned char* src = g.smem + s_addr;
        ts.bulk.push_back(BulkOp{ts.bulk_commits, src, std::vector<unsigned char>(src, src + bytes), file, line,
                                 hook_store_issue(src, bytes, what, file, line)});
    }
}

// cp.async.bulk (non-tensor, PTX ISA 9.7.9.24) and cp.reduce.async.bulk .add.f32: `bytes`
// contiguous bytes between shared and global memory; a load completes like a TMA load (tx bytes
// on its mbarrier, data poison until the phase completes), a store / reduce happens at issue
// and its source is checked at the bulk wait.
void bulk(TmaKind kind, void* smem, void* gmem, unsigned bytes, unsigned long long* bar, const char* what,
          const char* file, int line) {
    Quiet quiet;
    Hopper& h = state();
    const unsigned s_addr = shared_addr(smem, what, file, line);
    if (bytes == 0 || bytes % 16 || s_addr % 16 || reinterpret_cast<uintptr_t>(gmem) % 16)
        fail("%s at %s:%d: %u bytes between shared offset 0x%x and %p: size and both addresses must be multiples "
             "of 16",
             what, file, line, bytes, s_addr, gmem);
    if (s_addr + size_t(bytes) > g.smem_bytes)
        fail("%s at %s:%d: %u bytes at shared offset 0x%x are past the %zu-byte dynamic window", what, file, line,
             bytes, s_addr, g.smem_bytes);
    unsigned char* sp = g.smem + s_addr;
    unsigned char* gp = static_cast<unsigned char*>(gmem);
    if (kind == kTmaLoad) {
        Mbar& b = get_bar(bar, what, file, line);
        std::vector<unsigned char> data(gp, gp + bytes);
        for (unsigned k = 0; k < bytes; k += 2) memcpy(sp + k, &kPoison32, 2);
        hook_load_issue(b, sp, bytes, what, file, line);
        b.loads.push_back(PendingLoad{sp, std::move(data)});
        mbar_tx(b, -long(bytes), what, file, line);
        mbar_check(b);
        return;
    }
    if (kind == kTmaStore) {
        memcpy(gp, sp, bytes);
#if defined(FAGEN_EMU_RACECHECK)
        race::global_store(reinterpret_cast<uintptr_t>(gp), bytes, race::site(file, line, what));
#endif
    } else
        for (unsigned k = 0; k < bytes; k += 4) reduce_add(gp + k, sp + k, 7);
    ThreadState& ts = h.threads[g.cur->index];
    ts.bulk.push_back(BulkOp{ts.bulk_commits, sp, std::vector<unsigned char>(sp, sp + bytes), file, line,
                             hook_store_issue(sp, bytes, what, file, line)});
}

void bulk_commit() {
    Quiet quiet;
    ++state().threads[g.cur->index].bulk_commits;
}

// cp.async.bulk.wait_group[.read] N: the shared sources of this thread's bulk
// stores / reduces older than its N most recent groups must not have changed.
void bulk_wait(unsigned pending, const char* file, int line) {
    Quiet quiet;
    ThreadState& ts = state().threads[g.cur->index];
    if (ts.bulk_commits <= pending) return;
    const unsigned done = ts.bulk_commits - pending;
    size_t keep = 0;
    for (size_t k = 0; k < ts.bulk.size(); ++k) {
        BulkOp& b = ts.bulk[k];
        if (b.group >= done) {
            if (keep != k) ts.bulk[keep] = std::move(b);
            ++keep;
            continue;
        }
        if (memcmp(b.src, b.bytes.data(), b.bytes.size()) != 0)
            fail("the shared source (offset 0x%x) of the bulk store / reduce issued at %s:%d was written before "
                 "fa_bulk_wait_group at %s:%d",
                 unsigned(b.src - g.smem), b.file, b.line, file, line);
#if defined(FAGEN_EMU_RACECHECK)  // retired: the source read happens before what follows
        race::agent_retired(g.cur->index, race::agent(kBulkAgent), b.epoch,
                            race::site(file, line, "cp.async.bulk.wait_group"));
#endif
    }
    ts.bulk.resize(keep);
}
// A spin until sems[index] == value (ld.acquire.gpu in a loop on a GPU). Blocks run here one at a
// time, in a fixed order: while this block runs no other block can change the semaphore (and no
// kernel of fagen's changes one from the block that waits on it), so a value other than the awaited
// one now is a wait that can never complete -- an ordering bug, or a schedule that runs a later turn
// first (FAGEN_EMU_REVERSE_SCHEDULE). It is reported as a deadlock naming the semaphore and both values.
void sem_wait_eq(const int* sems, unsigned index, int value, const char* file, int line) {
    Quiet quiet;
    const int now = *const_cast<const volatile int*>(sems + index);
    if (now == value) return;
    begin_message("semaphore wait that can never complete");
    append_thread(g.cur);
    appendf(" waits at %s:%d for semaphore [%u] (at %p) to hold %d; it holds %d, and no other block runs while "
            "this one waits (blocks run one at a time, %s): a turn taken out of order", file, line, index,
            static_cast<const void*>(sems + index), value, now,
#if defined(FAGEN_EMU_REVERSE_SCHEDULE)
            "in descending order (FAGEN_EMU_REVERSE_SCHEDULE)"
#else
            "in ascending order"
#endif
    );
    abort_block(FAGEN_EMU_DEADLOCK);
}

#endif  // FAGEN_EMU_RUNTIME_DEFS

// ---------------------------------------------------------------- stmatrix
struct StmatrixLane {
    const unsigned* r;
    unsigned char* row;
    const char* name;
    const char* file;
    int line;
};

// stmatrix.sync.aligned.m8n8.x{NUM}[.trans].shared.b16 (PTX ISA 9.7.14.5.16):
// the inverse of ldmatrix's fragment layout.
template <int NUM, bool TRANS>
void stmatrix_complete(void* const* payloads, unsigned arrived) {
    const StmatrixLane& p0 = *static_cast<const StmatrixLane*>(payloads[0] ? payloads[0] : payloads[31]);
    if (arrived != 0xffffffffu) need_full_warp(p0.name, arrived);
    unsigned char* rows[32];
    for (unsigned l = 0; l < 8u * NUM; ++l) {
        rows[l] = static_cast<const StmatrixLane*>(payloads[l])->row;
        if (reinterpret_cast<uintptr_t>(rows[l]) & 15u)
            fail("%s: lane %u's row address %p is not 16-byte aligned", p0.name, l, static_cast<void*>(rows[l]));
    }
    for (unsigned lane = 0; lane < 32; ++lane) {
        const unsigned* r = static_cast<const StmatrixLane*>(payloads[lane])->r;
        const unsigned gq = lane >> 2, tq = lane & 3u;
        for (unsigned i = 0; i < unsigned(NUM); ++i) {
            const uint16_t lo = uint16_t(r[i] & 0xffffu), hi = uint16_t(r[i] >> 16);
            unsigned char* plo = !TRANS ? rows[8 * i + gq] + 2 * (2 * tq) : rows[8 * i + 2 * tq] + 2 * gq;
            unsigned char* phi = !TRANS ? rows[8 * i + gq] + 2 * (2 * tq + 1) : rows[8 * i + 2 * tq + 1] + 2 * gq;
            memcpy(plo, &lo, 2);
            memcpy(phi, &hi, 2);
#if defined(FAGEN_EMU_RACECHECK)
            // The PTX memory model sees each lane write the elements it supplies.
            const unsigned me = (g.cur->index & ~31u) + lane;
            const uint32_t where = race::site(p0.file, p0.line, p0.name);
            race::access(me, plo, 2, race::kWrite, where);
            race::access(me, phi, 2, race::kWrite, where);
#endif
        }
    }
}

template <int NUM, bool TRANS>
inline void stmatrix(void* row, const unsigned* r, const char* name, const char* file, int line) {
    Quiet quiet;
    check_registers_free(r, sizeof(unsigned) * NUM, name, file, line);
    StmatrixLane lane{r, static_cast<unsigned char*>(row), name, file, line};
    warp_exchange(0xffffffffu, &lane, &stmatrix_complete<NUM, TRANS>, name, file, line);
}
FAGEN_EMU_INSTANTIATE void stmatrix_complete<1, false>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void stmatrix_complete<2, false>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void stmatrix_complete<4, false>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void stmatrix_complete<1, true>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void stmatrix_complete<2, true>(void* const*, unsigned);
FAGEN_EMU_INSTANTIATE void stmatrix_complete<4, true>(void* const*, unsigned);

// ------------------------------------------------- setmaxnreg, elect.sync
inline void setmaxnreg_complete(void* const*) {}
void setmaxnreg(int n, bool inc, const char* file, int line);
bool elect_one(const char* file, int line);
void prefetch_tensormap(const FaTensorMap* m, const char* file, int line);
void named_barrier(unsigned id, unsigned count, bool wait, const char* file, int line);
void describe_named();
void check_exit();
void describe();
#if FAGEN_EMU_RUNTIME_DEFS

// setmaxnreg.{inc,dec}.sync.aligned.u32 N (PTX ISA 9.7.17.x): a warpgroup
// collective; N (a multiple of 8 in [24, 256], checked at compile time) and
// the direction must be the same in the whole warpgroup. No other effect.
void setmaxnreg(int n, bool inc, const char* file, int line) {
    if (n % 8 != 0 || n < 24 || n > 256)
        fail("setmaxnreg at %s:%d: %d is not a multiple of 8 in [24, 256]", file, line, n);
    char what[64];
    snprintf(what, sizeof what, "fa_setmaxnreg_%s<%d>", inc ? "inc" : "dec", n);
    warpgroup_collective(nullptr, &setmaxnreg_complete, uint64_t(n) << 1 | uint64_t(inc),
                         inc ? "fa_setmaxnreg_inc" : "fa_setmaxnreg_dec", what, file, line);
}

// elect.sync _|p, 0xffffffff (PTX ISA 9.7.13.x): one lane of the warp is
// elected; the ISA leaves which one open. The emulator elects the highest
// lane (31 in a full warp), so a kernel that assumes lane 0 fails here.
bool elect_one(const char* file, int line) {
    Quiet quiet;
    const unsigned ballot = __ballot_sync(0xffffffffu, 1, file, line);
    const unsigned lane = g.cur->index & 31u;
    return lane == 31u - unsigned(__builtin_clz(ballot));
}

// ------------------------------------------------------ tensor-map prefetch
// prefetch.tensormap [a] (PTX ISA 9.7.9.15 "prefetch, prefetchu"): a hint that brings the tensor map
// at generic address a (a __grid_constant__ kernel parameter) into the cache. Nothing to emulate
// beyond a being a tensor map.
void prefetch_tensormap(const FaTensorMap* m, const char* file, int line) {
    if (m == nullptr || m->magic != kTensorMapMagic)
        fail("fa_prefetch_tensormap at %s:%d: the address is not a tensor map (pack it with fagen.tma for the CPU)",
             file, line);
}

// ------------------------------------------------------ named barriers
// bar.sync / bar.arrive id, count (PTX ISA 9.7.12.1 "bar, barrier"): `count` threads (a
// multiple of 32) meet at barrier `id`; sync waits for the count, arrive does not. The
// emulator counts threads (every lane of a participating warp must execute it) and keeps
// barrier 0 for __syncthreads: ids are 1..15.
void named_barrier(unsigned id, unsigned count, bool wait, const char* file, int line) {
    Quiet quiet;
    Hopper& h = state();
    const char* what = wait ? "fa_named_barrier_sync" : "fa_named_barrier_arrive";
    if (id < 1 || id > 15) fail("%s at %s:%d: barrier id %u is not in 1..15 (0 is __syncthreads')", what, file, line, id);
    if (count == 0 || count % 32 || count > g.nthreads)
        fail("%s at %s:%d: thread count %u is not a positive multiple of 32 up to the block's %u threads", what, file,
             line, count, g.nthreads);
    NamedBarrier& b = h.named[id];
    if (b.arrived == 0) {
        b.count = count;
        b.file = file;
        b.line = line;
    } else if (b.count != count) {
        fail("%s at %s:%d: barrier %u is used with %u threads while its open phase (first arrival at %s:%d) counts "
             "%u",
             what, file, line, id, count, b.file, b.line, b.count);
    }
    if (wait) {
        b.waiters.push_back(g.cur->index);
        park_self(kParkNamedBarrier, what, file, line, nullptr, id);
    }
#if defined(FAGEN_EMU_RACECHECK)
    // Every arrival (bar.sync or bar.arrive) releases into the phase; the bar.sync threads
    // acquire all of them when it completes.
    if (b.obj.size() != race::dim()) b.obj.assign(race::dim(), 0u);
    race::release(b.obj.data(), g.cur->index, race::site(file, line, wait ? "bar.sync" : "bar.arrive"));
#endif
    if (++b.arrived == b.count) {
        b.arrived = 0;
#if defined(FAGEN_EMU_RACECHECK)
        for (unsigned k : b.waiters) race::acquire(b.obj.data(), k, race::site(file, line, "named barrier complete"));
        std::fill(b.obj.begin(), b.obj.end(), 0u);
#endif
        std::vector<unsigned> w;
        w.swap(b.waiters);
        for (unsigned k = 0; k < w.size(); ++k) wake(w[FAGEN_EMU_ORDER(k, unsigned(w.size()))]);
    }
    if (wait) schedule(false);
}

// ------------------------------------------------------ deadlock reports
void describe_named() {
    for (unsigned id = 1; id < 16; ++id) {
        const NamedBarrier& b = H.named[id];
        if (b.arrived == 0) continue;
        appendf("named barrier %u: %u of %u thread(s) arrived (first at %s:%d), threads ", id, b.arrived, b.count,
                b.file, b.line);
        append_ranges(g.nthreads, [&](unsigned i) {
            return g.fibers[i].wait == kAtAsync && H.park[i].kind == kParkNamedBarrier && H.park[i].parity == id;
        });
        appendf(" wait there; ");
    }
}

// A thread that returns with a bulk store / reduce it has not waited for: the CTA's shared
// memory may be reused before the copy has read its source (CUDA C++ Programming Guide, TMA: wait
// for the bulk async-group to finish reading shared memory before the thread exits).
// The block's last thread: a named barrier with an open phase (arrivals that no sync / arrive completed)
// ends with the block; a kernel's arrivals are to be matched (e.g. the ping-pong's hand-overs,
// templates/wgmma/pingpong.cuh), so one left over is an arrive without its sync (or a sync's partner missing).
void check_exit() {
    Quiet quiet;
    if (H.block != g.block_serial) return;
    const ThreadState& ts = H.threads[g.cur->index];
    if (!ts.bulk.empty())
        fail("the thread exits with the bulk store / reduce issued at %s:%d not waited for "
             "(fa_bulk_wait_group[_read]): its shared source may be reused before the copy reads it",
             ts.bulk[0].file, ts.bulk[0].line);
    if (g.live == 1)
        for (unsigned id = 1; id < 16; ++id)
            if (H.named[id].arrived != 0)
                fail("the block ends with named barrier %u's phase open: %u of %u thread(s) arrived (first at %s:%d), "
                     "an arrive without its matching sync", id, H.named[id].arrived, H.named[id].count,
                     H.named[id].file, H.named[id].line);
}

inline int register_check_exit = (thread_exit_extra = &check_exit, 0);  // registered once, by the runtime object

void describe() {
    Quiet quiet;
    if (H.block != g.block_serial) return;
    for (unsigned wg = 0; wg < H.wgs.size(); ++wg) {
        const WgCollective& c = H.wgs[wg];
        if (c.arrived == 0) continue;
        appendf("warpgroup %u: threads ", wg);
        append_ranges(g.nthreads, [&](unsigned i) {
            return i / 128 == wg && g.fibers[i].wait == kAtAsync && H.park[i].kind == kParkWarpgroup;
        });
        appendf(" wait at %s at %s:%d, threads ", c.what, c.file, c.line);
        append_ranges(g.nthreads, [&](unsigned i) {
            return i / 128 == wg && !(g.fibers[i].wait == kAtAsync && H.park[i].kind == kParkWarpgroup);
        });
        appendf(" never arrive; ");
    }
    describe_named();
    for (const Mbar& b : H.bars) {
        if (b.waiters.empty()) continue;
        const Park& p = H.park[b.waiters[0]];
        appendf("threads ");
        append_ranges(g.nthreads, [&](unsigned i) {
            return g.fibers[i].wait == kAtAsync && H.park[i].kind == kParkMbarrier && H.park[i].mbar == b.addr;
        });
        appendf(" wait at %s(parity %u) at %s:%d on mbarrier %s (initialised at %s:%d), whose phase %u never "
                "completes: %u of %u arrival(s) pending, tx-count %ld; ",
                p.name, p.parity, p.file, p.line, bar_name(b.addr).c_str(), b.file, b.line, b.phase, b.pending,
                b.expected, b.tx);
    }
}

inline int register_describe = (describe_deadlock_extra = &describe, 0);  // registered once, by the runtime object

#endif  // FAGEN_EMU_RUNTIME_DEFS

}  // namespace hopper
}  // namespace fagen_emu
FAGEN_EMU_FAST_END
