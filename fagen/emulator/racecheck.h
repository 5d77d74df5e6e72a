// ---------------------------------------------------------------------------
// fagen CPU emulator racecheck: an exact happens-before tracker for shared
// memory (and plain global stores between blocks).
//
// Pasted into every emulator translation unit after runtime.h; everything but
// the no-op marker below is compiled only with -DFAGEN_EMU_RACECHECK (the
// racecheck build, fagen.emulator.build(..., racecheck=True)). That build
// compiles the kernel with g++ -fsanitize=thread instrumentation but links none
// of libtsan: the __tsan_read*/__tsan_write* entry points the instrumentation
// calls are defined here, and feed every kernel load and store of the block's
// dynamic shared memory (and every plain global store) into the tracker. The
// runtime, the shim's collectives, its atomics and its cp.async queue are not
// instrumented (FAGEN_EMU_NO_TSAN); they report what they do through the event
// API below, with the lanes / threads the PTX ISA attributes the accesses to.
//
// Model (docs/emulator.md, "Racecheck"). Every thread t has a clock c[t] and a
// vector clock V[t] (what t has synchronised with). A shadow cell per 2 bytes
// of shared memory holds the last write (thread, epoch, where) and the reads
// since it (one epoch, or a vector of epochs once several threads read
// concurrently, FastTrack-style). An access a by u at epoch e happens before
// t's current point iff u == t or e <= V[t][u]. Two accesses of one cell race
// unless one happens before the other, or both are atomics.
//   * __syncthreads orders every thread of the block. Instead of joining all
//     vector clocks it starts a new *phase*: a cell last touched in an earlier
//     phase is empty (everything in it happens before everything now), except
//     for writes by asynchronous agents, which no thread barrier orders.
//   * __syncwarp(mask) joins the vector clocks of the lanes in the mask.
//   * Warp collectives (shuffles, ballot, mma, ldmatrix) order nothing.
//   * cp.async: the issue is a write by the issuing thread (checked against
//     earlier readers), the destination is *in flight* until that thread's
//     wait_group / wait_all, where it is written again by the issuing thread;
//     any access to an in-flight destination is a hazard.
//   * Atomics (atomicAdd & co. on shared memory) never race with each other.
//   * Global memory: a plain store to bytes another block of the launch stored
//     to is a hazard (atomics are not tracked).
// Extension points for asynchronous hardware (mbarrier, TMA, wgmma) are the
// functions of namespace fagen_emu::race marked "API".
// ---------------------------------------------------------------------------

namespace fagen_emu {
// A no-op synchronisation *marker*: in a racecheck build it enters the
// calling thread's synchronisation history (race reports say "after marker at
// FILE:LINE") and is counted, but orders nothing. Replacing a barrier with it
// asks whether the barrier is load-bearing: the report of the hazard the
// barrier prevented names the marker. In other builds it does nothing.
FAGEN_EMU_NO_TSAN void race_marker(const char* file, int line);
// A barrier behind a *gate*: ``fagen_emu_race_gate(i) ? barrier : (void)0``.
// The gate numbered fagen_emu_race_gate_select(i) (exported below) skips its
// barrier, a marker in its place; -2 makes every gate a marker that keeps its
// barrier (which gates a run passes); -1 (the default) opens every gate. One
// build then asks of each of its barriers in turn whether it is load-bearing
// (in every build; the markers count in racecheck builds only).
inline int race_gate_selected = -1;
FAGEN_EMU_NO_TSAN inline bool race_gate(int gate, const char* file, int line) {
    if (race_gate_selected == -1 || (race_gate_selected != -2 && gate != race_gate_selected)) return true;
    race_marker(file, line);
    return race_gate_selected == -2;
}
}  // namespace fagen_emu

// Selects the gate that skips its barrier (-1: none; -2: every gate marks, none skips).
#if FAGEN_EMU_RUNTIME_DEFS
extern "C" __attribute__((visibility("default"))) void fagen_emu_race_gate_select(int gate) {
    fagen_emu::race_gate_selected = gate;
}
#endif

#if !defined(FAGEN_EMU_RACECHECK)
#if FAGEN_EMU_RUNTIME_DEFS
namespace fagen_emu {
FAGEN_EMU_NO_TSAN void race_marker(const char*, int) {}
}  // namespace fagen_emu
#endif
#else
#include <dlfcn.h>
#include <link.h>

namespace fagen_emu {
namespace race {

constexpr unsigned kAgents = 24;     // asynchronous agents (TMA / wgmma units), thread slots n..n+23
constexpr unsigned kLog = 64;        // synchronisation events remembered per thread (for reports)
constexpr size_t kPoolLimit = size_t(1) << 30;  // bytes of read vectors per phase at most (the widest
                                                 // tiles, e.g. three Q_i / dO_i stages at d = 192, take over 256 MiB)

enum Op : uint8_t { kRead = 1, kWrite = 2, kAtomic = 3, kStale = 4 };
enum Kind : int { kNone = 0, kRaw = 1, kWar = 2, kWaw = 3 };

// `where` of an access: a code address (offset into the module + 1) or, with
// the top bit set, an index into the site table (file, line, what).
struct Site {
    const char* file;
    int line;
    const char* what;
    unsigned long long marks;  // race_marker passes in this launch (markers only)
};

// A set of accesses since the last plain write (the reads, or the atomics): one epoch while
// each happens before the next, else a vector of epochs per thread in the pool (FastTrack).
struct AccessSet {
    uint32_t epoch;           // exclusive: the access's epoch (0: empty); shared: pool index
    uint32_t where;
    uint16_t tid;
    uint16_t shared;          // 1: `epoch` is a pool index
};

struct Cell {                 // 2 bytes of shared memory
    uint32_t phase;           // the phase the fields below belong to (older: empty)
    uint32_t w_epoch;         // last plain write (0: none in this phase)
    uint32_t w_where;
    uint16_t w_tid;
    uint8_t w_op;             // kWrite; kStale: a thread's write of an earlier phase not proxy-fenced
    uint8_t pad;
    AccessSet reads, atomics;
};

struct InFlight {             // cp.async destination bytes not landed yet
    uint16_t issuer1;         // issuing thread + 1 (0: nothing in flight)
    uint32_t epoch, where;
};

struct LogEntry {
    uint32_t epoch;           // the thread's clock after the event
    uint32_t site;            // site index
};

struct GlobalEntry {          // one 4-byte word of global memory stored to in this launch
    uintptr_t word;           // address >> 2, 0: empty
    uint32_t block;           // linear block index + 1
    uint32_t where;
    uint16_t tid;
    uint8_t mask;             // bytes of the word stored to by that block
};

struct Access {               // one side of a report
    int op;                   // Op
    unsigned tid;             // linear thread index (>= nthreads: agent)
    unsigned block[3];
    uint32_t where, after, before;  // access place; sync sites around it (0: unknown / none)
    uint32_t epoch;
};

struct Report {
    int kind;                 // Kind
    int space;                // 0 shared, 1 global
    uint64_t offset;          // shared: byte offset in dynamic smem; global: address
    unsigned bytes;
    Access first, second;
    char note[256];
};

struct Tracker {
    unsigned n = 0, dim = 0, cap = 0;     // threads, vector clock size (n + agents), allocated for
    uint32_t* clock = nullptr;            // [dim], monotonic over the module's launches
    uint32_t* barrier_clock = nullptr;    // [dim]: clock of each thread at the last __syncthreads
    uint32_t* vc = nullptr;               // [dim][dim]
    LogEntry* log = nullptr;              // [dim][kLog]
    uint32_t phase = 1;
    uint32_t block_phase = 1;             // the phase the current block started with
    Cell* cells = nullptr;
    InFlight* inflight = nullptr;
    size_t ncells = 0, cells_cap = 0;
    unsigned char* smem = nullptr;        // window of the block's dynamic shared memory
    size_t smem_bytes = 0;
    uint32_t* pool = nullptr;             // read vectors: [2 * dim] each (epochs, wheres)
    size_t pool_used = 0, pool_cap = 0;   // in vectors
    unsigned pool_dim = 0;                // the dim the pool's vectors were laid out for
    Site* sites = nullptr;
    unsigned nsites = 0, sites_cap = 0;
    GlobalEntry* globals = nullptr;
    size_t globals_cap = 0, globals_used = 0;
    uintptr_t stacks_lo = 0, stacks_hi = 0, image_lo = 0, image_hi = 0, base = 0;
    unsigned block_linear = 0;
    unsigned long long markers = 0;       // race_marker calls in the current launch
    uint8_t* quiet = nullptr;             // [dim]: > 0 while the thread runs emulator bookkeeping
    uint32_t* fenced = nullptr;           // [dim]: the thread's epoch at its last fence.proxy.async
    uint32_t* free_vecs = nullptr;        // pool vectors released in this phase (reused zeroed)
    size_t free_n = 0, free_cap = 0;
    char agent_names[kAgents][64] = {};   // what each agent slot stands for (reports)
    bool active = false;
    Report report;
};
inline Tracker T;

FAGEN_EMU_NO_TSAN inline void* grow(void* p, size_t bytes) {
    void* q = realloc(p, bytes);
    if (!q) fail("racecheck: out of host memory (%zu bytes)", bytes);
    return q;
}

// ---------------------------------------------------------------- sites
FAGEN_EMU_NO_TSAN inline uint32_t site(const char* file, int line, const char* what) {
    for (unsigned i = T.nsites; i-- > 0;) {  // few distinct sites; recent ones first
        const Site& s = T.sites[i];
        if (s.line == line && s.what == what && (s.file == file || strcmp(s.file, file) == 0))
            return 0x80000000u | i;
    }
    if (T.nsites == T.sites_cap) {
        T.sites_cap = T.sites_cap ? 2 * T.sites_cap : 256;
        T.sites = static_cast<Site*>(grow(T.sites, T.sites_cap * sizeof(Site)));
    }
    T.sites[T.nsites] = Site{file, line, what, 0};
    return 0x80000000u | T.nsites++;
}

FAGEN_EMU_NO_TSAN inline uint32_t code_where(const void* ra) {
    return uint32_t(reinterpret_cast<uintptr_t>(ra) - T.base);  // return address: never 0 past the base
}

// ------------------------------------------------------------ thread clocks
FAGEN_EMU_NO_TSAN inline uint32_t* V(unsigned t) { return T.vc + size_t(t) * T.dim; }

// t's synchronisation event at `site`: its clock ticks (accesses after it get a new epoch).
FAGEN_EMU_NO_TSAN inline void tick(unsigned t, uint32_t site_idx) {
    const uint32_t e = ++T.clock[t];
    V(t)[t] = e;
    T.log[size_t(t) * kLog + e % kLog] = LogEntry{e, site_idx};
}

// The sync site t passed at epoch e (the event that started epoch e), or 0.
FAGEN_EMU_NO_TSAN inline uint32_t event_at(unsigned t, uint32_t e) {
    const LogEntry& l = T.log[size_t(t) * kLog + e % kLog];
    return l.epoch == e ? l.site : 0;
}

FAGEN_EMU_NO_TSAN inline bool ordered(unsigned u, uint32_t e, unsigned t) { return u == t || e <= V(t)[u]; }

// ------------------------------------------------------------------ setup
FAGEN_EMU_NO_TSAN inline int find_image(struct dl_phdr_info* info, size_t, void* data) {
    const uintptr_t probe = reinterpret_cast<uintptr_t>(data);
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD) continue;
        const uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
        if (probe >= lo && probe < hi) {
            uintptr_t a = ~uintptr_t(0), b = 0;
            for (int j = 0; j < info->dlpi_phnum; ++j) {
                const ElfW(Phdr)& q = info->dlpi_phdr[j];
                if (q.p_type != PT_LOAD) continue;
                a = std::min<uintptr_t>(a, info->dlpi_addr + q.p_vaddr);
                b = std::max<uintptr_t>(b, info->dlpi_addr + q.p_vaddr + q.p_memsz);
            }
            T.image_lo = a, T.image_hi = b, T.base = info->dlpi_addr;
            return 1;
        }
    }
    return 0;
}

// Called by the launch driver before the first block of a launch.
FAGEN_EMU_NO_TSAN inline void launch_begin(unsigned nthreads, size_t smem_bytes) {
    if (T.base == 0) dl_iterate_phdr(&find_image, reinterpret_cast<void*>(&T));
    const unsigned dim = nthreads + kAgents;
    if (T.cap < dim) {
        T.clock = static_cast<uint32_t*>(grow(T.clock, dim * sizeof(uint32_t)));
        T.barrier_clock = static_cast<uint32_t*>(grow(T.barrier_clock, dim * sizeof(uint32_t)));
        T.vc = static_cast<uint32_t*>(grow(T.vc, size_t(dim) * dim * sizeof(uint32_t)));
        T.log = static_cast<LogEntry*>(grow(T.log, size_t(dim) * kLog * sizeof(LogEntry)));
        T.quiet = static_cast<uint8_t*>(grow(T.quiet, dim));
        T.fenced = static_cast<uint32_t*>(grow(T.fenced, dim * sizeof(uint32_t)));
        for (unsigned t = 0; t < dim; ++t) T.clock[t] = 1;  // epochs start at 1; 0 means "no access"
        memset(T.log, 0, size_t(dim) * kLog * sizeof(LogEntry));
        free(T.pool);
        T.pool = nullptr, T.pool_cap = 0;
        T.cap = dim;
    }
    // Clocks keep counting from launch to launch, so epochs left in the pool by earlier phases
    // are never above barrier_clock (see set_check); a pool laid out for another block size is
    // dropped (its vectors would be misread).
    if (T.pool_dim != dim) {
        free(T.pool);
        T.pool = nullptr, T.pool_cap = 0;
    }
    T.pool_dim = dim;
    T.n = nthreads, T.dim = dim;
    memset(T.vc, 0, size_t(dim) * dim * sizeof(uint32_t));
    for (unsigned t = 0; t < dim; ++t) V(t)[t] = T.clock[t], T.barrier_clock[t] = T.clock[t];
    const size_t ncells = (smem_bytes + 1) / 2;
    if (T.cells_cap < ncells) {
        T.cells = static_cast<Cell*>(grow(T.cells, ncells * sizeof(Cell)));
        T.inflight = static_cast<InFlight*>(grow(T.inflight, ncells * sizeof(InFlight)));
        T.cells_cap = ncells;
    }
    T.ncells = ncells;
    memset(T.cells, 0, ncells * sizeof(Cell));  // phase 0: older than any phase
    T.phase = 1;
    T.pool_used = 0;
    if (T.globals_used) memset(T.globals, 0, T.globals_cap * sizeof(GlobalEntry));
    T.globals_used = 0;
    T.markers = 0;
    for (unsigned i = 0; i < T.nsites; ++i) T.sites[i].marks = 0;
    T.stacks_lo = reinterpret_cast<uintptr_t>(g.stack_base);
    T.stacks_hi = T.stacks_lo + g.stack_count * g.stack_stride;
    T.report.kind = kNone;
}

// A new block: every thread starts from scratch (a phase of its own); the
// clocks keep counting so nothing of the previous block is "ordered".
FAGEN_EMU_NO_TSAN inline void block_begin(unsigned char* smem, size_t smem_bytes) {
    T.smem = smem;
    T.smem_bytes = smem_bytes;
    T.block_linear = (g.block_idx.z * g.grid_dim.y + g.block_idx.y) * g.grid_dim.x + g.block_idx.x;
    T.block_phase = ++T.phase;
    T.pool_used = 0, T.free_n = 0;
    for (size_t i = 0; i < T.ncells; ++i) T.inflight[i].issuer1 = 0;
    memset(T.quiet, 0, T.dim);
    memset(T.fenced, 0, T.dim * sizeof(uint32_t));
    for (unsigned k = 0; k < kAgents; ++k) T.agent_names[k][0] = 0;
    const uint32_t s = site("<block start>", 0, "block start");
    for (unsigned t = 0; t < T.dim; ++t) T.barrier_clock[t] = T.clock[t], tick(t, s);
    T.active = true;
}

FAGEN_EMU_NO_TSAN inline void block_end() { T.active = false, T.smem_bytes = 0; }

// --------------------------------------------------------------- reporting
void describe();

FAGEN_EMU_NO_TSAN inline void fill(Access& a, int op, unsigned tid, uint32_t epoch, uint32_t where,
                                   const unsigned* block) {
    a.op = op, a.tid = tid, a.epoch = epoch, a.where = where;
    a.block[0] = block ? block[0] : g.block_idx.x;
    a.block[1] = block ? block[1] : g.block_idx.y;
    a.block[2] = block ? block[2] : g.block_idx.z;
    a.after = tid < T.dim ? event_at(tid, epoch) : 0;
    a.before = tid < T.dim && epoch < T.clock[tid] ? event_at(tid, epoch + 1) : 0;
}

[[noreturn]] FAGEN_EMU_NO_TSAN inline void report(int kind, int space, uint64_t offset, unsigned bytes, int op1,
                                                  unsigned t1, uint32_t e1, uint32_t w1, int op2, unsigned t2,
                                                  uint32_t e2, uint32_t w2, const char* note,
                                                  const unsigned* block1 = nullptr) {
    Report& r = T.report;
    r.kind = kind, r.space = space, r.offset = offset, r.bytes = bytes;
    fill(r.first, op1, t1, e1, w1, block1);
    fill(r.second, op2, t2, e2, w2, nullptr);
    snprintf(r.note, sizeof r.note, "%s", note ? note : "");
    describe();
    abort_block(FAGEN_EMU_RACE);
}

// ----------------------------------------------------------- the shadow
FAGEN_EMU_NO_TSAN inline uint32_t pool_alloc() {
    if (T.free_n) {  // a vector a plain write released in this phase: may hold this phase's epochs
        const uint32_t i = T.free_vecs[--T.free_n];
        memset(T.pool + size_t(i) * 2 * T.dim, 0, 2 * T.dim * sizeof(uint32_t));
        return i;
    }
    if (T.pool_used == T.pool_cap) {
        const size_t cap = T.pool_cap ? 2 * T.pool_cap : 64;
        if (cap * 2 * T.dim * sizeof(uint32_t) > kPoolLimit)
            fail("racecheck: more than %zu bytes of read vectors in one barrier phase", kPoolLimit);
        T.pool = static_cast<uint32_t*>(grow(T.pool, cap * 2 * T.dim * sizeof(uint32_t)));
        // Fresh memory holds no epochs (0); reused vectors hold only epochs of earlier phases.
        memset(T.pool + T.pool_cap * 2 * T.dim, 0, (cap - T.pool_cap) * 2 * T.dim * sizeof(uint32_t));
        T.pool_cap = cap;
    }
    // Not cleared: an epoch a thread left there in an earlier phase is <= its barrier_clock, which
    // set_check ignores (the pool is reused from the start at every __syncthreads). Agents are not
    // ordered by barriers, so their slots are cleared.
    uint32_t* p = T.pool + T.pool_used * 2 * T.dim;
    memset(p + T.n, 0, kAgents * sizeof(uint32_t));
    return uint32_t(T.pool_used++);
}
FAGEN_EMU_NO_TSAN inline uint32_t* pool_vec(uint32_t i) { return T.pool + size_t(i) * 2 * T.dim; }
// A shared set's vector is free again (its cell was overwritten in this phase).
FAGEN_EMU_NO_TSAN inline void pool_free(const AccessSet& a) {
    if (!a.shared) return;
    if (T.free_n == T.free_cap) {
        T.free_cap = T.free_cap ? 2 * T.free_cap : 256;
        T.free_vecs = static_cast<uint32_t*>(grow(T.free_vecs, T.free_cap * sizeof(uint32_t)));
    }
    T.free_vecs[T.free_n++] = a.epoch;
}

FAGEN_EMU_NO_TSAN inline Cell& cell(size_t i) {
    Cell& c = T.cells[i];
    if (c.phase != T.phase) {
        // A barrier lies between: everything in the cell happens before now,
        // except an asynchronous agent's write, which no thread barrier orders, and for the
        // async proxy a thread's write its thread has not followed by fence.proxy.async (kept
        // as kStale: ordered for threads, a hazard for agents until the writer fences).
        // (Nothing of an earlier block is kept: its shared memory is another CTA's.)
        const bool mine = c.phase >= T.block_phase;
        const bool agent_w = mine && c.w_epoch != 0 && c.w_tid >= T.n;
        const bool stale = mine && c.w_epoch != 0 && c.w_tid < T.n && c.w_epoch > T.fenced[c.w_tid];
        const bool keep = agent_w || stale;
        const uint32_t e = c.w_epoch, w = c.w_where;
        const uint16_t tid = c.w_tid;
        const uint8_t op = c.w_op;
        memset(&c, 0, sizeof c);
        c.phase = T.phase;
        if (keep) c.w_epoch = e, c.w_where = w, c.w_tid = tid, c.w_op = agent_w ? op : uint8_t(kStale);
    }
    return c;
}

// Adds t's access at epoch e to a set.
FAGEN_EMU_NO_TSAN inline void set_add(AccessSet& a, unsigned t, uint32_t e, uint32_t where) {
    if (!a.shared) {
        if (a.epoch == 0 || a.tid == t || ordered(a.tid, a.epoch, t)) {
            a.tid = uint16_t(t), a.epoch = e, a.where = where;
        } else {
            const uint32_t p = pool_alloc();
            uint32_t* v = pool_vec(p);
            v[a.tid] = a.epoch, v[T.dim + a.tid] = a.where;
            v[t] = e, v[T.dim + t] = where;
            a.shared = 1, a.epoch = p;
        }
    } else {
        uint32_t* v = pool_vec(a.epoch);
        v[t] = e, v[T.dim + t] = where;
    }
}

// Reports the first access of the set that does not happen before t's access (op, where).
FAGEN_EMU_NO_TSAN inline void set_check(const AccessSet& a, int set_op, size_t i, unsigned t, Op op,
                                        uint32_t where) {
    const int kind = set_op == kRead ? kWar : (op == kRead ? kRaw : kWaw);
    if (!a.shared) {
        if (a.epoch && !ordered(a.tid, a.epoch, t))
            report(kind, 0, 2 * i, 2, set_op, a.tid, a.epoch, a.where, op, t, T.clock[t], where, nullptr);
        return;
    }
    const uint32_t* v = pool_vec(a.epoch);
    const uint32_t* mine = V(t);
    for (unsigned u = 0; u < T.dim; ++u)
        if (v[u] > mine[u] && v[u] > T.barrier_clock[u] && u != t)
            report(kind, 0, 2 * i, 2, set_op, u, v[u], v[T.dim + u], op, t, T.clock[t], where, nullptr);
}

// Access of cell i (2 bytes at smem offset 2i) by thread (or agent slot) t. A read must follow
// the last write and the atomics since; an atomic the last write and the reads (not the other
// atomics); a write all of them.
FAGEN_EMU_NO_TSAN inline void access_cell(size_t i, unsigned t, Op op, uint32_t where, bool landing = false) {
    const InFlight& f = T.inflight[i];
    if (f.issuer1 && !landing)
        report(op == kRead ? kRaw : kWaw, 0, 2 * i, 2, kWrite, f.issuer1 - 1u, f.epoch, f.where, op, t,
               T.clock[t], where, f.issuer1 - 1u >= T.n
               ? "the first access is a TMA / bulk load whose destination has not landed: the mbarrier phase "
                 "it completes on has not completed"
               : "the first access is a cp.async whose destination has not landed: its thread has "
                 "not passed the cp.async.wait_group / wait_all that completes it");
    Cell& c = cell(i);
    const uint32_t e = T.clock[t];
    if (c.w_op == kStale) {  // a barrier orders it for threads; agents need the writer's proxy fence
        if (t >= T.n && c.w_epoch > T.fenced[c.w_tid])
            report(op == kRead ? kRaw : kWaw, 0, 2 * i, 2, kWrite, c.w_tid, c.w_epoch, c.w_where, op, t, e, where,
                   "the first access is a generic-proxy write the async proxy does not see: its thread has not "
                   "passed a fence.proxy.async since");
    } else if (c.w_epoch && !ordered(c.w_tid, c.w_epoch, t)) {
        report(op == kRead ? kRaw : kWaw, 0, 2 * i, 2, kWrite, c.w_tid, c.w_epoch, c.w_where, op, t, e, where,
               t >= T.n && c.w_tid < T.n && c.w_epoch > T.fenced[c.w_tid]
               ? "the first access is a generic-proxy write the async proxy does not see: its thread has not "
                 "passed a fence.proxy.async since"
               : nullptr);
    }
    if (op != kAtomic) set_check(c.atomics, kAtomic, i, t, op, where);
    if (op != kRead) set_check(c.reads, kRead, i, t, op, where);
    if (op == kRead) {
        set_add(c.reads, t, e, where);
    } else if (op == kAtomic) {
        set_add(c.atomics, t, e, where);
    } else {
        pool_free(c.reads), pool_free(c.atomics);
        c.reads = AccessSet{0, 0, 0, 0}, c.atomics = AccessSet{0, 0, 0, 0};
        c.w_tid = uint16_t(t), c.w_epoch = e, c.w_where = where, c.w_op = kWrite;
    }
}

// Global memory: a plain store by this block to bytes another block stored to.
FAGEN_EMU_NO_TSAN inline void global_store(uintptr_t addr, unsigned bytes, uint32_t where) {
    const unsigned t = g.cur->index;
    for (uintptr_t a = addr; a < addr + bytes;) {
        const uintptr_t word = a >> 2;
        const unsigned lo = unsigned(a & 3u), hi = unsigned(std::min<uintptr_t>(addr + bytes - (word << 2), 4));
        const uint8_t mask = uint8_t(((1u << hi) - 1u) & ~((1u << lo) - 1u));
        if (2 * (T.globals_used + 1) > T.globals_cap) {
            GlobalEntry* old = T.globals;
            const size_t old_cap = T.globals_cap;
            T.globals_cap = old_cap ? 2 * old_cap : 4096;
            T.globals = static_cast<GlobalEntry*>(calloc(T.globals_cap, sizeof(GlobalEntry)));
            if (!T.globals) fail("racecheck: out of host memory");
            for (size_t k = 0; k < old_cap; ++k) {
                if (!old[k].word) continue;
                size_t h = (old[k].word * 0x9E3779B97F4A7C15ull) >> 7 & (T.globals_cap - 1);
                while (T.globals[h].word) h = (h + 1) & (T.globals_cap - 1);
                T.globals[h] = old[k];
            }
            free(old);
        }
        size_t h = (word * 0x9E3779B97F4A7C15ull) >> 7 & (T.globals_cap - 1);
        while (T.globals[h].word && T.globals[h].word != word) h = (h + 1) & (T.globals_cap - 1);
        GlobalEntry& en = T.globals[h];
        if (!en.word) {
            en = GlobalEntry{word, T.block_linear + 1, where, uint16_t(t), mask};
            ++T.globals_used;
        } else if (en.block != T.block_linear + 1) {
            if (en.mask & mask) {
                const unsigned b = en.block - 1, gx = g.grid_dim.x, gy = g.grid_dim.y;
                const unsigned blk[3] = {b % gx, (b / gx) % gy, b / (gx * gy)};
                report(kWaw, 1, uint64_t(word << 2), 4, kWrite, en.tid, 0, en.where, kWrite, t, T.clock[t], where,
                       "two blocks of one launch store to the same global bytes with plain stores (no atomics)",
                       blk);
            }
            en.block = T.block_linear + 1, en.where = where, en.tid = uint16_t(t), en.mask = mask;
        } else {
            en.mask |= mask, en.where = where, en.tid = uint16_t(t);
        }
        a = (word + 1) << 2;
    }
}

// ------------------------------------------------------------------- API
// Accesses of `bytes` bytes at `p` by thread / agent slot t (no-op outside
// the block's dynamic shared memory). `where` from site() or code_where().
FAGEN_EMU_NO_TSAN inline void access(unsigned t, const void* p, size_t bytes, Op op, uint32_t where) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(T.smem);
    if (!T.active || off >= T.smem_bytes || bytes == 0) return;
    const size_t last = std::min<size_t>((off + bytes - 1) / 2, T.ncells - 1);
    for (size_t i = off / 2; i <= last; ++i) access_cell(i, t, op, where);
}

// The running thread's own load / store of shared memory (kernel code).
FAGEN_EMU_NO_TSAN inline void thread_access(const void* p, size_t bytes, Op op, uint32_t where) {
    access(g.cur->index, p, bytes, op, where);
}

// API: a synchronisation object (an mbarrier phase, a named barrier, ...) is a
// vector clock; `obj` points at dim() uint32_t (zeroed = nothing released).
FAGEN_EMU_NO_TSAN inline unsigned dim() { return T.dim; }
// API: thread/agent t releases into obj (obj joins t's vector clock; t ticks).
FAGEN_EMU_NO_TSAN inline void release(uint32_t* obj, unsigned t, uint32_t site_idx) {
    const uint32_t* v = V(t);
    for (unsigned u = 0; u < T.dim; ++u) obj[u] = std::max(obj[u], v[u]);
    tick(t, site_idx);
}
// API: thread/agent t acquires obj (t's vector clock joins obj).
FAGEN_EMU_NO_TSAN inline void acquire(const uint32_t* obj, unsigned t, uint32_t site_idx) {
    uint32_t* v = V(t);
    for (unsigned u = 0; u < T.dim; ++u) v[u] = std::max(v[u], obj[u]);
    tick(t, site_idx);
}
// API: agent slot of asynchronous unit k (0 <= k < kAgents): its accesses go
// through access(agent(k), ...); a thread hands work to it with
// release(obj, thread) + acquire(obj, agent(k)) (e.g. after fence.proxy.async),
// and its completion reaches threads through release(mbarrier, agent(k)) +
// acquire(mbarrier, thread) at the successful try_wait. Its shared-memory
// writes survive thread barriers (only an acquire orders them).
FAGEN_EMU_NO_TSAN inline unsigned agent(unsigned k) { return T.n + k; }

// API: what agent slot k stands for, for reports ("wgmma of warpgroup 0", ...).
FAGEN_EMU_NO_TSAN inline void name_agent(unsigned k, const char* name) {
    if (T.active && k < kAgents) snprintf(T.agent_names[k], sizeof T.agent_names[k], "%s", name);
}

// API: the running thread enters (+1) / leaves (-1) emulator bookkeeping: its loads and stores
// are not the kernel's (the emulated primitive reports its accesses through this API). Per
// thread, so a thread parked inside a primitive leaves the others instrumented.
FAGEN_EMU_NO_TSAN inline void quiet(int delta) {
    if (T.quiet && g.cur) T.quiet[g.cur->index] = uint8_t(T.quiet[g.cur->index] + delta);
}

// API: fence.proxy.async by thread t: its accesses so far are visible to the async proxy.
FAGEN_EMU_NO_TSAN inline void proxy_fence(unsigned t, uint32_t site_idx) {
    T.fenced[t] = T.clock[t];
    tick(t, site_idx);
}

// API: agent slot a starts an operation issued by threads first..first+count-1: its vector
// clock becomes their join (what they have synchronised with), except that a thread's own
// generic-proxy accesses count only up to its last fence.proxy.async when `proxy_fenced`
// (wgmma operands, TMA / bulk store sources: the async proxy sees a thread's generic writes
// only through that thread's proxy fence). Returns the epoch of the agent's accesses for this operation.
FAGEN_EMU_NO_TSAN inline uint32_t agent_issue(unsigned a, unsigned first, unsigned count, bool proxy_fenced,
                                              uint32_t site_idx) {
    uint32_t* va = V(a);
    const uint32_t own = va[a];
    memset(va, 0, T.dim * sizeof(uint32_t));
    for (unsigned t = first; t < first + count; ++t) {
        const uint32_t* v = V(t);
        for (unsigned u = 0; u < T.dim; ++u) va[u] = std::max(va[u], v[u]);
    }
    if (proxy_fenced)
        for (unsigned t = 0; t < T.n; ++t) va[t] = std::min(va[t], T.fenced[t]);
    va[a] = own;
    tick(a, site_idx);
    return T.clock[a];
}

// API: thread t has seen agent a's accesses up to `epoch` (an operation it waited for retired).
FAGEN_EMU_NO_TSAN inline void agent_retired(unsigned t, unsigned a, uint32_t epoch, uint32_t site_idx) {
    V(t)[a] = std::max(V(t)[a], epoch);
    tick(t, site_idx);
}

// API: agent a starts writing `bytes` at p (checked against earlier accesses now); the bytes are
// in flight -- any access is a hazard -- until async_write_land.
FAGEN_EMU_NO_TSAN inline void async_write_issue(unsigned a, const void* p, size_t bytes, uint32_t where) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(T.smem);
    if (!T.active || off >= T.smem_bytes || bytes == 0) return;
    const size_t last = std::min<size_t>((off + bytes - 1) / 2, T.ncells - 1);
    for (size_t i = off / 2; i <= last; ++i) {
        access_cell(i, a, kWrite, where);
        T.inflight[i] = InFlight{uint16_t(a + 1), T.clock[a], where};
    }
}

// API: agent a's write of `bytes` at p lands (a new epoch of a: tick it first).
FAGEN_EMU_NO_TSAN inline void async_write_land(unsigned a, const void* p, size_t bytes) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(T.smem);
    if (!T.active || off >= T.smem_bytes || bytes == 0) return;
    const size_t last = std::min<size_t>((off + bytes - 1) / 2, T.ncells - 1);
    for (size_t i = off / 2; i <= last; ++i) {
        const uint32_t w = T.inflight[i].where;
        T.inflight[i].issuer1 = 0;
        access_cell(i, a, kWrite, w, true);
    }
}

// API: the clock of slot t (its current epoch).
FAGEN_EMU_NO_TSAN inline uint32_t epoch_of(unsigned t) { return T.clock[t]; }

// Block barrier completed (all threads of the block).
FAGEN_EMU_NO_TSAN inline void on_block_barrier(const char* file, int line) {
    ++T.phase;
    T.pool_used = 0, T.free_n = 0;
    const uint32_t s = site(file, line, "__syncthreads");
    for (unsigned t = 0; t < T.n; ++t) T.barrier_clock[t] = T.clock[t], tick(t, s);
}

// __syncwarp(mask) completed by the lanes in `arrived` of the warp whose lane 0 is thread `base`.
FAGEN_EMU_NO_TSAN inline void on_syncwarp(unsigned base, unsigned arrived, const char* file, int line) {
    uint32_t* j = V(base + unsigned(__builtin_ctz(arrived)));
    static thread_local uint32_t* join = nullptr;
    static thread_local unsigned join_cap = 0;
    if (join_cap < T.dim) {
        join = static_cast<uint32_t*>(grow(join, T.dim * sizeof(uint32_t)));
        join_cap = T.dim;
    }
    memcpy(join, j, T.dim * sizeof(uint32_t));
    for (unsigned l = 0; l < 32; ++l)
        if (arrived >> l & 1u) {
            const uint32_t* v = V(base + l);
            for (unsigned u = 0; u < T.dim; ++u) join[u] = std::max(join[u], v[u]);
        }
    const uint32_t s = site(file, line, "__syncwarp");
    for (unsigned l = 0; l < 32; ++l)
        if (arrived >> l & 1u) {
            memcpy(V(base + l), join, T.dim * sizeof(uint32_t));
            tick(base + l, s);
        }
}

// cp.async issued by the running thread: a write of the 16 destination bytes
// now (ordered after earlier readers?), then in flight until the thread's wait.
FAGEN_EMU_NO_TSAN inline void on_cp_async_issue(void* dst, const char* file, int line) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(T.smem);
    if (!T.active || off >= T.smem_bytes) return;
    const unsigned t = g.cur->index;
    const uint32_t w = site(file, line, "cp.async");
    for (size_t i = off / 2; i < std::min<size_t>(off / 2 + 8, T.ncells); ++i) {
        access_cell(i, t, kWrite, w);
        T.inflight[i] = InFlight{uint16_t(t + 1), T.clock[t], w};
    }
}

// The running thread's wait landed the copy at dst: written by the issuer now.
FAGEN_EMU_NO_TSAN inline void on_cp_async_land(void* dst) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(T.smem);
    if (!T.active || off >= T.smem_bytes) return;
    const unsigned t = g.cur->index;
    for (size_t i = off / 2; i < std::min<size_t>(off / 2 + 8, T.ncells); ++i) {
        const uint32_t w = T.inflight[i].where;
        T.inflight[i].issuer1 = 0;
        access_cell(i, t, kWrite, w, true);
    }
}

FAGEN_EMU_NO_TSAN inline void on_cp_async_wait(const char* file, int line, const char* what) {
    if (T.active) tick(g.cur->index, site(file, line, what));
}

FAGEN_EMU_NO_TSAN inline void load(const void* p, size_t bytes, const void* ra) {
    const uintptr_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(T.smem);
    if (off < T.smem_bytes && T.active && !T.quiet[g.cur->index]) thread_access(p, bytes, kRead, code_where(ra));
}

FAGEN_EMU_NO_TSAN inline void store(const void* p, size_t bytes, const void* ra) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a - reinterpret_cast<uintptr_t>(T.smem) < T.smem_bytes) {
        if (T.active && !T.quiet[g.cur->index]) thread_access(p, bytes, kWrite, code_where(ra));
        return;
    }
    if (!T.active || g.cur == nullptr || T.quiet[g.cur->index]) return;
    if ((a >= T.stacks_lo && a < T.stacks_hi) || (a >= T.image_lo && a < T.image_hi)) return;  // locals, statics
    global_store(a, unsigned(bytes), code_where(ra));
}

// ------------------------------------------------------------- messages
FAGEN_EMU_NO_TSAN inline void append_where(uint32_t w) {
    if (w == 0) {
        appendf("?");
    } else if ((w & 0x80000000u) && (w & 0x7fffffffu) >= T.nsites) {
        appendf("?");
    } else if (w & 0x80000000u) {
        const Site& s = T.sites[w & 0x7fffffffu];
        appendf("%s:%d", s.file, s.line);
    } else {
        appendf("@pc:%x@", unsigned(w));  // a code address; the Python side turns it into FILE:LINE
    }
}
FAGEN_EMU_NO_TSAN inline void append_site(uint32_t w) {
    if ((w & 0x7fffffffu) >= T.nsites) return appendf("?");
    const Site& s = T.sites[w & 0x7fffffffu];
    if (s.line == 0) appendf("%s", s.what);
    else appendf("%s at %s:%d", s.what, s.file, s.line);
}

FAGEN_EMU_NO_TSAN inline void append_access(const Access& a) {
    static const char* const ops[] = {"?", "read", "write", "atomic"};
    appendf("%s by ", ops[a.op & 3]);
    if (a.tid >= T.n) {
        appendf("asynchronous agent %u", a.tid - T.n);
        if (T.agent_names[a.tid - T.n][0]) appendf(" (%s)", T.agent_names[a.tid - T.n]);
    } else {
        const unsigned bx = T.report.space ? a.block[0] : g.block_idx.x;
        const unsigned by = T.report.space ? a.block[1] : g.block_idx.y;
        const unsigned bz = T.report.space ? a.block[2] : g.block_idx.z;
        const unsigned x = a.tid % g.block_dim.x, y = (a.tid / g.block_dim.x) % g.block_dim.y,
                       z = a.tid / (g.block_dim.x * g.block_dim.y);
        appendf("block (%u,%u,%u) thread (%u,%u,%u) (warp %u, lane %u)", bx, by, bz, x, y, z, a.tid >> 5,
                a.tid & 31u);
    }
    appendf(" at ");
    append_where(a.where);
    if (T.report.space == 0 && (a.after || a.before)) {
        appendf(" [");
        if (a.after) appendf("after "), append_site(a.after);
        if (a.after && a.before) appendf("; ");
        if (a.before) appendf("then "), append_site(a.before);
        appendf("]");
    }
}

#if FAGEN_EMU_RUNTIME_DEFS
void describe() {
    static const char* const kinds[] = {"", "read-after-write", "write-after-read", "write-after-write"};
    const Report& r = T.report;
    begin_message("race");
    appendf("%s hazard on ", kinds[r.kind]);
    if (r.space == 0) appendf("@smem:%llu:%u@", (unsigned long long)r.offset, r.bytes);
    else appendf("global memory at %#llx", (unsigned long long)r.offset);
    appendf(": ");
    append_access(r.first);
    appendf(", then ");
    append_access(r.second);
    if (r.note[0]) appendf("; %s", r.note);
    else appendf("; no barrier, __syncwarp or cp.async wait orders them");
}
#endif

}  // namespace race

#if FAGEN_EMU_RUNTIME_DEFS
FAGEN_EMU_NO_TSAN void race_marker(const char* file, int line) {
    if (!race::T.active) return;
    ++race::T.markers;
    const uint32_t s = race::site(file, line, "marker");
    ++race::T.sites[s & 0x7fffffffu].marks;
    race::tick(g.cur->index, s);
}
#endif
}  // namespace fagen_emu

#if FAGEN_EMU_RUNTIME_DEFS
extern "C" __attribute__((visibility("default"))) unsigned long long fagen_emu_race_markers() {
    return fagen_emu::race::T.markers;
}
// The distinct source lines of the markers passed in the last launch (up to cap); returns their number.
extern "C" __attribute__((visibility("default"))) unsigned fagen_emu_race_marker_lines(int* out, unsigned cap) {
    unsigned n = 0;
    for (unsigned i = 0; i < fagen_emu::race::T.nsites; ++i)
        if (fagen_emu::race::T.sites[i].marks) {
            if (n < cap) out[n] = fagen_emu::race::T.sites[i].line;
            ++n;
        }
    return n;
}
// The last report, for the Python exception: kind, space, offset, bytes,
// first tid, first block (3), second tid.
extern "C" __attribute__((visibility("default"))) void fagen_emu_race_report(unsigned long long* out) {
    const fagen_emu::race::Report& r = fagen_emu::race::T.report;
    out[0] = unsigned(r.kind), out[1] = unsigned(r.space), out[2] = r.offset, out[3] = r.bytes;
    out[4] = r.first.tid, out[5] = r.first.block[0], out[6] = r.first.block[1], out[7] = r.first.block[2];
    out[8] = r.second.tid, out[9] = unsigned(r.first.op), out[10] = unsigned(r.second.op);
}

// The entry points -fsanitize=thread instrumentation calls (no libtsan is linked).
#define FAGEN_EMU_TSAN_RW(N)                                                                              \
    extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_read##N(void* p) {                          \
        fagen_emu::race::load(p, N, __builtin_return_address(0));                                          \
    }                                                                                                      \
    extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_write##N(void* p) {                         \
        fagen_emu::race::store(p, N, __builtin_return_address(0));                                         \
    }                                                                                                      \
    extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_unaligned_read##N(void* p) {                \
        fagen_emu::race::load(p, N, __builtin_return_address(0));                                          \
    }                                                                                                      \
    extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_unaligned_write##N(void* p) {               \
        fagen_emu::race::store(p, N, __builtin_return_address(0));                                         \
    }                                                                                                      \
    extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_volatile_read##N(void* p) {                 \
        fagen_emu::race::load(p, N, __builtin_return_address(0));                                          \
    }                                                                                                      \
    extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_volatile_write##N(void* p) {                \
        fagen_emu::race::store(p, N, __builtin_return_address(0));                                         \
    }
FAGEN_EMU_TSAN_RW(1)
FAGEN_EMU_TSAN_RW(2)
FAGEN_EMU_TSAN_RW(4)
FAGEN_EMU_TSAN_RW(8)
FAGEN_EMU_TSAN_RW(16)
#undef FAGEN_EMU_TSAN_RW
extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_read_range(void* p, unsigned long n) {
    fagen_emu::race::load(p, n, __builtin_return_address(0));
}
extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_write_range(void* p, unsigned long n) {
    fagen_emu::race::store(p, n, __builtin_return_address(0));
}
extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_init() {}
extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_func_entry(void*) {}
extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_func_exit() {}
extern "C" FAGEN_EMU_HIDDEN FAGEN_EMU_NO_TSAN void __tsan_vptr_update(void**, void*) {}
#endif  // FAGEN_EMU_RUNTIME_DEFS
#endif
