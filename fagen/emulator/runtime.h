// ---------------------------------------------------------------------------
// fagen CPU emulator runtime: fibers, block/warp barriers, the launch driver.
//
// Pasted (not #included) at the top of every emulator translation unit, ahead
// of shim.h, the kernel source and the generated launch wrappers; all symbols
// are hidden, so each module .so carries its own private copy.
//
// Execution model. Blocks run one after another (x fastest, then y, then z).
// The threads of a block are fibers on the calling OS thread, scheduled
// cooperatively from a FIFO run queue: a fiber runs until it reaches a barrier
// (__syncthreads or a warp collective) or exits, then the queue's head runs.
// A barrier that completes pushes its waiters onto the queue in thread order,
// so the interleaving (and every float rounding) is the same on every run.
// An empty queue while some fiber is still alive is a deadlock.
// ---------------------------------------------------------------------------
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sys/mman.h>
#include <unistd.h>
#include <vector_types.h>

#if defined(__SANITIZE_ADDRESS__)
#define FAGEN_EMU_ASAN 1
#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FAGEN_EMU_NO_ASAN __attribute__((no_sanitize_address))
#else
#define FAGEN_EMU_NO_ASAN
#endif

// The racecheck build (-DFAGEN_EMU_RACECHECK) instruments the kernel with
// -fsanitize=thread; the runtime and the shim's primitives are left out of the
// instrumentation and report their accesses to racecheck.h themselves.
#if defined(FAGEN_EMU_RACECHECK)
#include <algorithm>
#define FAGEN_EMU_NO_TSAN __attribute__((no_sanitize_thread))
#else
#define FAGEN_EMU_NO_TSAN
#endif

// The runtime (this file, hopper.h) and the shim's warp collectives are compiled at -O2 whatever
// the build's level (GCC's optimize pragma): a build below O2 (FAGEN_EMU_OPT=Og / O1) is then
// faster to make and only its kernel code runs slower (the suite's builds, at Og: about a fifth
// less run time for one more tenth of build time). Not at -O0 (the debug build, for gdb).
#if defined(__OPTIMIZE__) && defined(__GNUC__) && !defined(__clang__)
#define FAGEN_EMU_FAST_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"O2\")")
#define FAGEN_EMU_FAST_END _Pragma("GCC pop_options")
#else
#define FAGEN_EMU_FAST_BEGIN
#define FAGEN_EMU_FAST_END
#endif
FAGEN_EMU_FAST_BEGIN

#if !defined(__x86_64__) && !defined(FAGEN_EMU_UCONTEXT)
#define FAGEN_EMU_UCONTEXT 1
#endif
#if defined(FAGEN_EMU_UCONTEXT)
#include <ucontext.h>
#endif

#define FAGEN_EMU_HIDDEN __attribute__((visibility("hidden")))

// Usable stack per fiber (a PROT_NONE guard page sits below each one).
// Schedule order: blocks, threads (and warp lanes) are run in ascending index order, or
// descending with -DFAGEN_EMU_REVERSE_SCHEDULE. A race between two threads inside
// one barrier interval (one reads what another writes, or both write) is usually
// resolved differently by the two orders, so comparing their results finds it; a
// reduction whose result depends on the order blocks reach it (fp32 atomics from
// several blocks) rounds differently.
#if defined(FAGEN_EMU_REVERSE_SCHEDULE)
#define FAGEN_EMU_ORDER(i, n) ((n) - 1u - (i))
#else
#define FAGEN_EMU_ORDER(i, n) (i)
#endif

#ifndef FAGEN_EMU_STACK_BYTES
#define FAGEN_EMU_STACK_BYTES (256u * 1024u)
#endif

// Status codes shared with fagen/emulator/module.py.
#define FAGEN_EMU_OK 0
#define FAGEN_EMU_DEADLOCK 1
#define FAGEN_EMU_KERNEL_ERROR 2
#define FAGEN_EMU_BAD_LAUNCH 3
#define FAGEN_EMU_RACE 4

// A module's kernel unit is compiled against its runtime object (fagen/emulator/builder.py): the
// runtime's out-of-line functions and globals are defined once, in that object (this prelude
// compiled on its own, FAGEN_EMU_RUNTIME_DEFS=1), and only declared in the kernel unit
// (FAGEN_EMU_RUNTIME_DEFS=0), so no module build compiles them again. A unit that pastes the
// prelude (no runtime object) defines them itself.
#ifndef FAGEN_EMU_RUNTIME_DEFS
#define FAGEN_EMU_RUNTIME_DEFS 1
#endif

namespace fagen_emu {

// ----------------------------------------------------------------- contexts
#if !defined(FAGEN_EMU_UCONTEXT)
// x86-64 System V: save the callee-saved registers and rsp, load the other
// side's. The floating-point control words are not switched: every fiber and
// the scheduler share the process's rounding mode, and nothing changes it.
extern "C" FAGEN_EMU_HIDDEN void fagen_emu_switch(void** save_sp, void* load_sp);
extern "C" FAGEN_EMU_HIDDEN void fagen_emu_fiber_entry();
#if FAGEN_EMU_RUNTIME_DEFS
asm(R"(
    .text
    .p2align 4
    .globl  fagen_emu_switch
    .hidden fagen_emu_switch
    .type   fagen_emu_switch, @function
fagen_emu_switch:
    .cfi_startproc
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq  %rsp, (%rdi)
    movq  %rsi, %rsp
    popq  %r15
    popq  %r14
    popq  %r13
    popq  %r12
    popq  %rbx
    popq  %rbp
    ret
    .cfi_endproc
    .size fagen_emu_switch, .-fagen_emu_switch

    .p2align 4
    .globl  fagen_emu_fiber_entry
    .hidden fagen_emu_fiber_entry
    .type   fagen_emu_fiber_entry, @function
fagen_emu_fiber_entry:
    .cfi_startproc
    .cfi_undefined rip
    movq  %r12, %rdi
    callq *%r13
    ud2
    .cfi_endproc
    .size fagen_emu_fiber_entry, .-fagen_emu_fiber_entry
)");
#endif

struct Context {
    void* sp = nullptr;
};

FAGEN_EMU_NO_TSAN inline void context_init(Context* c, char* stack, size_t size, void (*fn)(void*), void* arg) {
    // Initial frame popped by fagen_emu_switch: r15 r14 r13 r12 rbx rbp, then
    // `ret` lands in fagen_emu_fiber_entry with rsp 16-byte aligned, which
    // calls fn(arg) (r13, r12) as an ordinary function.
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top - 72);
    sp[0] = nullptr;                                    // r15
    sp[1] = nullptr;                                    // r14
    sp[2] = reinterpret_cast<void*>(fn);                // r13
    sp[3] = arg;                                        // r12
    sp[4] = nullptr;                                    // rbx
    sp[5] = nullptr;                                    // rbp
    sp[6] = reinterpret_cast<void*>(&fagen_emu_fiber_entry);  // return address
    c->sp = sp;
}

FAGEN_EMU_NO_TSAN inline void context_switch(Context* from, Context* to) { fagen_emu_switch(&from->sp, to->sp); }
#else
// Portable fallback. glibc's swapcontext also saves the signal mask, which is
// a syscall per switch, so this is several times slower than the asm path.
struct Context {
    ucontext_t uc;
};

FAGEN_EMU_NO_TSAN inline void context_trampoline(unsigned lo, unsigned hi, unsigned flo, unsigned fhi) {
    auto fn = reinterpret_cast<void (*)(void*)>((uintptr_t(fhi) << 32) | flo);
    fn(reinterpret_cast<void*>((uintptr_t(hi) << 32) | lo));
    abort();
}

FAGEN_EMU_NO_TSAN inline void context_init(Context* c, char* stack, size_t size, void (*fn)(void*), void* arg) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    const uintptr_t a = reinterpret_cast<uintptr_t>(arg), f = reinterpret_cast<uintptr_t>(fn);
    makecontext(&c->uc, reinterpret_cast<void (*)()>(&context_trampoline), 4, unsigned(a),
                unsigned(a >> 32), unsigned(f), unsigned(f >> 32));
}

FAGEN_EMU_NO_TSAN inline void context_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
#endif

// ------------------------------------------------------------------- state
enum Wait : uint8_t { kRunnable, kAtBlockBarrier, kAtWarpCollective, kExited };

enum Collective : uint8_t {
    kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncwarp,
    kExchange  // general per-lane payload exchange (warp_exchange)
};

FAGEN_EMU_NO_TSAN inline const char* collective_name(Collective k) {
    switch (k) {
        case kShflIdx: return "__shfl_sync";
        case kShflUp: return "__shfl_up_sync";
        case kShflDown: return "__shfl_down_sync";
        case kShflXor: return "__shfl_xor_sync";
        case kBallot: return "__ballot_sync";
        case kAny: return "__any_sync";
        case kAll: return "__all_sync";
        case kSyncwarp: return "__syncwarp";
        case kExchange: return "warp exchange";
    }
    return "?";
}

// The completing lane of a warp_exchange runs this over every lane's payload:
// payloads[l] is what lane l passed (nullptr for a lane not in `arrived`).
typedef void (*ExchangeFn)(void* const* payloads, unsigned arrived);

struct Fiber {
    Context ctx;
    uint3 tid;
    unsigned index;      // linear thread index within the block
    Wait wait;
    uint64_t value;      // collective input (shuffle payload / predicate)
    int arg;             // shuffle lane, delta or xor mask
    uint64_t result;     // collective output
    void* payload;       // warp_exchange: this lane's in/out payload
    char* stack;
};

struct Warp {
    unsigned exists;     // lanes present in the block (a last warp may be partial)
    unsigned arrived;    // lanes waiting at the pending collective
    Collective kind;
    unsigned mask;
    int width;
    const char* file;
    int line;
    const char* name;    // what the diagnostics call the pending collective
    ExchangeFn fn;       // kExchange: the operation (lanes must agree on it)
};

struct State {
    Fiber* cur;                    // the running fiber (threadIdx comes from it)
    uint3 block_idx;
    uint64_t block_serial;         // counts blocks run, so per-thread state can tell a new block
    dim3 block_dim, grid_dim;
    unsigned char* smem;
    size_t smem_bytes;

    Fiber* fibers;
    Warp* warps;
    unsigned nthreads, nwarps, live;
    unsigned* queue;               // ring buffer of runnable fiber indices
    unsigned q_head, q_size;
    unsigned bar_arrived;          // threads waiting at __syncthreads
    unsigned bar_or;               // __syncthreads_or: the OR of the predicates of the threads waiting
    const char* bar_file;
    int bar_line;

    Context sched;                 // the launching OS thread's context
    const char* kernel;
    void (*body)(void*);           // unpacks the kernel arguments and calls it
    void* body_arg;
    int status;
    char msg[4096];

    // Fiber stacks and block arrays, kept between launches.
    char* stack_base;
    size_t stack_count, stack_stride;
    bool stacks_dirty;             // an aborted block left poisoned frames (ASan)
    size_t capacity;
#if defined(FAGEN_EMU_ASAN)
    const void* main_stack_bottom;
    size_t main_stack_size;
#endif
};

}  // namespace fagen_emu

// External linkage (hidden): the compiler must assume the context switch can
// modify it, so no field is cached in a register across a barrier.
extern "C" FAGEN_EMU_HIDDEN fagen_emu::State fagen_emu_state;
#if FAGEN_EMU_RUNTIME_DEFS
fagen_emu::State fagen_emu_state;
FAGEN_EMU_HIDDEN std::mutex fagen_emu_mutex;
#else
extern FAGEN_EMU_HIDDEN std::mutex fagen_emu_mutex;
#endif

namespace fagen_emu {

static State& g = fagen_emu_state;

// ------------------------------------------------------------------ helpers
inline void appendf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
FAGEN_EMU_NO_TSAN inline void appendf(const char* fmt, ...) {
    const size_t n = strlen(g.msg);
    if (n + 1 >= sizeof g.msg) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.msg + n, sizeof g.msg - n, fmt, ap);
    va_end(ap);
}

// Appends "0-4,7,9-12" for the indices in [0, n) where pred(i) holds.
template <typename Pred>
FAGEN_EMU_NO_TSAN inline void append_ranges(unsigned n, Pred pred) {
    bool first = true;
    for (unsigned i = 0; i < n;) {
        if (!pred(i)) { ++i; continue; }
        unsigned j = i;
        while (j + 1 < n && pred(j + 1)) ++j;
        appendf(first ? "%u" : ",%u", i);
        if (j > i) appendf("-%u", j);
        first = false;
        i = j + 1;
    }
}

FAGEN_EMU_NO_TSAN inline void begin_message(const char* what) {
    g.msg[0] = '\0';
    appendf("%s in kernel '%s' block (%u,%u,%u) [blockDim (%u,%u,%u)]: ", what, g.kernel,
            g.block_idx.x, g.block_idx.y, g.block_idx.z, g.block_dim.x, g.block_dim.y, g.block_dim.z);
}

FAGEN_EMU_NO_TSAN inline void append_thread(const Fiber* f) {
    appendf("thread (%u,%u,%u)", f->tid.x, f->tid.y, f->tid.z);
}

// ---------------------------------------------------------------- switching
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN inline void jump(Context* from, Context* to, const void* to_bottom, size_t to_size,
                                   bool exiting) {
#if defined(FAGEN_EMU_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, to_bottom, to_size);
    context_switch(from, to);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)to_bottom, (void)to_size, (void)exiting;
    context_switch(from, to);
#endif
}

FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN inline void jump_to_fiber(Context* from, Fiber* to, bool exiting) {
    g.cur = to;
    jump(from, &to->ctx, to->stack, FAGEN_EMU_STACK_BYTES, exiting);
}

FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN inline void jump_to_scheduler(Context* from, bool exiting) {
    g.cur = nullptr;
#if defined(FAGEN_EMU_ASAN)
    jump(from, &g.sched, g.main_stack_bottom, g.main_stack_size, exiting);
#else
    jump(from, &g.sched, nullptr, 0, exiting);
#endif
}

FAGEN_EMU_NO_TSAN inline void push(unsigned i) {
    g.queue[(g.q_head + g.q_size) % g.nthreads] = i;
    ++g.q_size;
}

FAGEN_EMU_NO_TSAN inline Fiber* pop() {
    Fiber* f = &g.fibers[g.queue[g.q_head]];
    g.q_head = (g.q_head + 1) % g.nthreads;
    --g.q_size;
    return f;
}

// ---- Hopper support (fagen/emulator/hopper.h): hopper.h sets this to append
// its parked threads (warpgroup collectives, mbarrier waits) to deadlock reports.
inline void (*describe_deadlock_extra)() = nullptr;
// ... and this to check, when a thread's kernel body returns, what it must not leave in flight.
inline void (*thread_exit_extra)() = nullptr;
// ---- end of Hopper support

void describe_deadlock();

// Racecheck events (racecheck.h; no-ops without -DFAGEN_EMU_RACECHECK).
namespace race {
#if defined(FAGEN_EMU_RACECHECK)
inline void launch_begin(unsigned nthreads, size_t smem_bytes);
inline void block_begin(unsigned char* smem, size_t smem_bytes);
inline void block_end();
inline void on_block_barrier(const char* file, int line);
inline void on_syncwarp(unsigned base, unsigned arrived, const char* file, int line);
#else
inline void launch_begin(unsigned, size_t) {}
inline void block_begin(unsigned char*, size_t) {}
inline void block_end() {}
inline void on_block_barrier(const char*, int) {}
inline void on_syncwarp(unsigned, unsigned, const char*, int) {}
#endif
}  // namespace race

// Aborts the block: the remaining fibers are abandoned, never resumed.
[[noreturn]] FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN inline void abort_block(int status) {
    g.status = status;
    Context dead;
    jump_to_scheduler(&dead, false);
    __builtin_unreachable();
}

// The running fiber blocked (or exited): run the next runnable one.
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN inline void schedule(bool exiting) {
    Fiber* self = g.cur;
    if (g.q_size == 0) {
        if (g.live == 0) {
            jump_to_scheduler(&self->ctx, exiting);  // the block is finished
            __builtin_unreachable();
        }
        describe_deadlock();
        abort_block(FAGEN_EMU_DEADLOCK);
    }
    Fiber* next = pop();
    if (next != self) jump_to_fiber(&self->ctx, next, exiting);
}

// ----------------------------------------------------------------- barriers
// __syncthreads (and __syncthreads_or: the OR of every thread's predicate, returned to each)
#if FAGEN_EMU_RUNTIME_DEFS
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN __attribute__((noinline)) int block_barrier_or(int pred, const char* file,
                                                                                    int line) {
    Fiber* self = g.cur;
    if (g.bar_arrived == 0) {
        g.bar_file = file;
        g.bar_line = line;
        g.bar_or = 0;
    } else if (line != g.bar_line || (file != g.bar_file && strcmp(file, g.bar_file) != 0)) {
        begin_message("divergent __syncthreads");
        append_thread(self);
        appendf(" reached __syncthreads at %s:%d while %u thread(s) wait at __syncthreads at %s:%d",
                file, line, g.bar_arrived, g.bar_file, g.bar_line);
        appendf(" (the emulator requires every thread of a block to reach the same barrier call)");
        abort_block(FAGEN_EMU_DEADLOCK);
    }
    self->wait = kAtBlockBarrier;
    g.bar_or |= pred != 0 ? 1u : 0u;
    if (++g.bar_arrived == g.nthreads) {
        g.bar_arrived = 0;
        race::on_block_barrier(file, line);
        for (unsigned k = 0; k < g.nthreads; ++k) {
            const unsigned i = FAGEN_EMU_ORDER(k, g.nthreads);
            g.fibers[i].wait = kRunnable;
            g.fibers[i].result = g.bar_or;  // read back by each thread when it resumes
            push(i);
        }
    }
    schedule(false);
    return int(self->result);
}
#else
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN __attribute__((noinline)) int block_barrier_or(int pred, const char* file, int line);
#endif
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN inline void block_barrier(const char* file, int line) {
    block_barrier_or(0, file, line);
}

// Source lane of `lane` for a shuffle, following the PTX shfl.sync definition
// with CUDA's c operand ((32 - width) << 8, | 0x1f except for .up).
FAGEN_EMU_NO_TSAN inline unsigned shuffle_source(Collective kind, unsigned lane, int b, int width) {
    const int segmask = (32 - width) & 0x1f;
    const int cval = kind == kShflUp ? 0 : 0x1f;
    const int l = int(lane), bval = b & 0x1f;
    const int max_lane = (l & segmask) | (cval & ~segmask);
    const int min_lane = l & segmask;
    int j = l;
    bool in_range = false;
    switch (kind) {
        case kShflUp: j = l - bval; in_range = j >= max_lane; break;
        case kShflDown: j = l + bval; in_range = j <= max_lane; break;
        case kShflXor: j = l ^ bval; in_range = j <= max_lane; break;
        default: j = min_lane | (bval & ~segmask); in_range = j <= max_lane; break;
    }
    return in_range ? unsigned(j) : lane;
}

// Records the running lane's arrival at a warp collective after checking it
// agrees with the lanes already waiting (kind, mask, width, exchange
// operation); returns true when it is the last lane the collective waits for.
FAGEN_EMU_NO_TSAN inline bool arrive(Warp& w, Collective kind, unsigned mask, int width, ExchangeFn fn, const char* name,
                   const char* file, int line) {
    Fiber* self = g.cur;
    const unsigned lane = self->index & 31u;
    if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
        begin_message("invalid warp collective");
        append_thread(self);
        appendf(" called %s at %s:%d with width %d (must be a power of two <= 32)", name, file, line, width);
        abort_block(FAGEN_EMU_KERNEL_ERROR);
    }
    if (!(mask >> lane & 1u)) {
        begin_message("invalid warp collective");
        append_thread(self);
        appendf(" (lane %u) called %s at %s:%d with mask 0x%08x, which does not name its own lane", lane, name,
                file, line, mask);
        abort_block(FAGEN_EMU_KERNEL_ERROR);
    }
    if (w.arrived == 0) {
        w.kind = kind;
        w.mask = mask;
        w.width = width;
        w.file = file;
        w.line = line;
        w.name = name;
        w.fn = fn;
    } else if (kind != w.kind || mask != w.mask || width != w.width || fn != w.fn) {
        begin_message("divergent warp collective");
        append_thread(self);
        appendf(" (lane %u) called %s (mask 0x%08x) at %s:%d while lanes ", lane, name, mask, file, line);
        append_ranges(32, [&](unsigned l) { return (w.arrived >> l & 1u) != 0; });
        appendf(" of warp %u wait at %s (mask 0x%08x) at %s:%d", self->index >> 5, w.name, w.mask, w.file,
                w.line);
        abort_block(FAGEN_EMU_DEADLOCK);
    }
    self->wait = kAtWarpCollective;
    w.arrived |= 1u << lane;
    return w.arrived == (w.mask & w.exists);
}

// Makes the lanes of a completed collective runnable again (in schedule order).
FAGEN_EMU_NO_TSAN inline void release_lanes(Warp& w, Fiber* lanes) {
    const unsigned arrived = w.arrived;
    w.arrived = 0;
    for (unsigned k = 0; k < 32; ++k) {
        const unsigned l = FAGEN_EMU_ORDER(k, 32u);
        if (!(arrived >> l & 1u)) continue;
        lanes[l].wait = kRunnable;
        push(lanes[l].index);
    }
}

FAGEN_EMU_NO_TSAN inline void complete_collective(Warp& w, Fiber* lanes) {
    const unsigned arrived = w.arrived;
    unsigned ballot = 0;
    for (unsigned l = 0; l < 32; ++l)
        if ((arrived >> l & 1u) && lanes[l].value != 0) ballot |= 1u << l;
    for (unsigned l = 0; l < 32; ++l) {
        if (!(arrived >> l & 1u)) continue;
        Fiber& f = lanes[l];
        switch (w.kind) {
            case kBallot: f.result = ballot; break;
            case kAny: f.result = ballot != 0; break;
            case kAll: f.result = ballot == arrived; break;
            case kSyncwarp: f.result = 0; break;
            default: {
                const unsigned src = shuffle_source(w.kind, l, f.arg, w.width);
                // A lane outside the collective has no value: hand back NaN bits.
                f.result = (arrived >> src & 1u) ? lanes[src].value : ~uint64_t(0);
            }
        }
    }
    release_lanes(w, lanes);
}

#if FAGEN_EMU_RUNTIME_DEFS
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN __attribute__((noinline)) uint64_t warp_collective(Collective kind, unsigned mask,
                                                                    uint64_t value, int arg, int width,
                                                                    const char* file, int line) {
    Fiber* self = g.cur;
    const unsigned lane = self->index & 31u;
    Warp& w = g.warps[self->index >> 5];
    self->value = value;
    self->arg = arg;
    if (arrive(w, kind, mask, width, nullptr, collective_name(kind), file, line)) {
        if (kind == kSyncwarp) race::on_syncwarp(self->index - lane, w.arrived, file, line);
        complete_collective(w, self - lane);
    }
    schedule(false);
    return self->result;
}
#else
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN __attribute__((noinline)) uint64_t warp_collective(Collective kind, unsigned mask,
    uint64_t value, int arg, int width, const char* file, int line);
#endif

// General warp collective: every lane in `mask` passes a pointer to its own
// in/out payload; the last lane to arrive runs fn over all 32 lanes' payloads
// (nullptr for lanes outside the collective), then every lane resumes. The
// payloads live on the lanes' own stacks, which stay valid while they wait.
// `name` (e.g. "fa_mma_m16n8k16") is what divergence / deadlock reports say.
#if FAGEN_EMU_RUNTIME_DEFS
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN __attribute__((noinline)) void warp_exchange(unsigned mask, void* payload, ExchangeFn fn,
                                                              const char* name, const char* file, int line) {
    Fiber* self = g.cur;
    const unsigned lane = self->index & 31u;
    Warp& w = g.warps[self->index >> 5];
    self->payload = payload;
    if (arrive(w, kExchange, mask, 32, fn, name, file, line)) {
        Fiber* lanes = self - lane;
        void* payloads[32];
        for (unsigned l = 0; l < 32; ++l) payloads[l] = (w.arrived >> l & 1u) ? lanes[l].payload : nullptr;
        fn(payloads, w.arrived);
        release_lanes(w, lanes);
    }
    schedule(false);
}
#else
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN __attribute__((noinline)) void warp_exchange(unsigned mask, void* payload, ExchangeFn fn,
    const char* name, const char* file, int line);
#endif

[[noreturn]] FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN inline void thread_exit() {
    g.cur->wait = kExited;
    --g.live;
    schedule(true);
    __builtin_unreachable();
}

#if FAGEN_EMU_RUNTIME_DEFS
FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN void fiber_main(void* arg) {
#if defined(FAGEN_EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    (void)arg;
    g.body(g.body_arg);
    if (thread_exit_extra) thread_exit_extra();
    thread_exit();
}
#endif

[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#if FAGEN_EMU_RUNTIME_DEFS
[[noreturn]] FAGEN_EMU_NO_TSAN void fail(const char* fmt, ...) {
    begin_message("kernel error");
    append_thread(g.cur);
    appendf(": ");
    const size_t n = strlen(g.msg);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.msg + n, sizeof g.msg - n, fmt, ap);
    va_end(ap);
    abort_block(FAGEN_EMU_KERNEL_ERROR);
}
#endif

#if FAGEN_EMU_RUNTIME_DEFS
FAGEN_EMU_NO_TSAN void describe_deadlock() {
    begin_message("deadlock");
    unsigned exited = 0;
    for (unsigned i = 0; i < g.nthreads; ++i) exited += g.fibers[i].wait == kExited;
    if (g.bar_arrived != 0) {
        appendf("%u of %u thread(s) wait at __syncthreads at %s:%d [threads ", g.bar_arrived, g.nthreads,
                g.bar_file, g.bar_line);
        append_ranges(g.nthreads, [](unsigned i) { return g.fibers[i].wait == kAtBlockBarrier; });
        appendf("]; ");
    }
    for (unsigned wi = 0; wi < g.nwarps; ++wi) {
        const Warp& w = g.warps[wi];
        if (w.arrived == 0) continue;
        appendf("warp %u: lanes ", wi);
        append_ranges(32, [&](unsigned l) { return (w.arrived >> l & 1u) != 0; });
        appendf(" wait at %s (mask 0x%08x) at %s:%d, lanes ", w.name, w.mask, w.file, w.line);
        const unsigned missing = w.mask & w.exists & ~w.arrived;
        append_ranges(32, [&](unsigned l) { return (missing >> l & 1u) != 0; });
        appendf(" never arrive; ");
    }
    if (describe_deadlock_extra) describe_deadlock_extra();  // Hopper support (hopper.h)
    appendf("%u thread(s) exited [threads ", exited);
    append_ranges(g.nthreads, [](unsigned i) { return g.fibers[i].wait == kExited; });
    appendf("]");
}
#endif

// ------------------------------------------------------------ fiber stacks
// A fiber stack is FAGEN_EMU_STACK_BYTES above a PROT_NONE guard page: two
// memory mappings per thread. Modules loaded into one process never unload, so
// they do not keep stacks of their own: the Python side lends every launch the
// stacks of a process-wide pool (fagen/emulator/stacks.py) through
// fagen_emu_use_stacks, and the mapping count stays bounded whatever the
// number of modules. A module launched without lent stacks (the sanitizer's
// child process) maps and keeps its own.
struct Stacks {
    char* base;
    size_t count;
};
inline Stacks own_stacks{nullptr, 0};   // mapped by this module (nothing lent)
inline Stacks lent_stacks{nullptr, 0};  // fagen_emu_use_stacks; valid for the next launch

FAGEN_EMU_NO_TSAN inline size_t stack_stride() {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    return ((FAGEN_EMU_STACK_BYTES + page - 1) / page) * page + page;
}

// `count` stacks, each with its guard page at the low end (an overflow faults).
FAGEN_EMU_NO_TSAN inline char* map_stacks(size_t count) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE)), stride = stack_stride();
    void* p = mmap(nullptr, stride * count, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return nullptr;
    char* base = static_cast<char*>(p);
    for (size_t i = 0; i < count; ++i) mprotect(base + i * stride, page, PROT_NONE);
    return base;
}

#if FAGEN_EMU_RUNTIME_DEFS
extern "C" __attribute__((visibility("default"))) FAGEN_EMU_NO_TSAN size_t fagen_emu_stack_stride() { return stack_stride(); }
extern "C" __attribute__((visibility("default"))) FAGEN_EMU_NO_TSAN char* fagen_emu_map_stacks(size_t count) {
    return map_stacks(count);
}
extern "C" __attribute__((visibility("default"))) FAGEN_EMU_NO_TSAN void fagen_emu_unmap_stacks(char* base, size_t count) {
    munmap(base, count * stack_stride());
}
// Lends `count` stacks (from fagen_emu_map_stacks of a module with the same
// stride) to the following launches; (nullptr, 0) takes them back.
extern "C" __attribute__((visibility("default"))) FAGEN_EMU_NO_TSAN void fagen_emu_use_stacks(char* base, size_t count) {
    lent_stacks = Stacks{base, count};
}
#endif

// ------------------------------------------------------------------ driver
// The driver is the runtime object's (one copy, not one per module build), declared below for a unit without it.
#if FAGEN_EMU_RUNTIME_DEFS
FAGEN_EMU_NO_TSAN inline bool ensure_capacity(unsigned nthreads) {
    Stacks use = lent_stacks;
    if (use.base == nullptr) {
        if (own_stacks.count < nthreads) {
            if (own_stacks.base) munmap(own_stacks.base, own_stacks.count * stack_stride());
            char* base = map_stacks(nthreads);
            own_stacks = Stacks{base, base ? size_t(nthreads) : 0};
        }
        use = own_stacks;
    }
    if (use.base == nullptr || use.count < nthreads) return false;
    // Other memory than last launch: make sure ASan's shadow says "unpoisoned".
    if (use.base != g.stack_base) g.stacks_dirty = true;
    g.stack_base = use.base;
    g.stack_stride = stack_stride();
    g.stack_count = use.count;
    if (g.capacity < nthreads) {
        free(g.fibers);
        free(g.warps);
        free(g.queue);
        g.fibers = static_cast<Fiber*>(calloc(nthreads, sizeof(Fiber)));
        g.warps = static_cast<Warp*>(calloc((nthreads + 31) / 32, sizeof(Warp)));
        g.queue = static_cast<unsigned*>(calloc(nthreads, sizeof(unsigned)));
        g.capacity = g.fibers && g.warps && g.queue ? nthreads : 0;
    }
    return g.capacity >= nthreads;
}

FAGEN_EMU_NO_TSAN FAGEN_EMU_NO_ASAN int run_block() {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    for (unsigned i = 0; i < g.nthreads; ++i) {
        Fiber& f = g.fibers[i];
        f.index = i;
        f.tid.x = i % g.block_dim.x;
        f.tid.y = (i / g.block_dim.x) % g.block_dim.y;
        f.tid.z = i / (g.block_dim.x * g.block_dim.y);
        f.wait = kRunnable;
        f.stack = g.stack_base + i * g.stack_stride + page;
#if defined(FAGEN_EMU_ASAN)
        if (g.stacks_dirty) __asan_unpoison_memory_region(f.stack, FAGEN_EMU_STACK_BYTES);
#endif
        // Stagger the stack tops by a cache line per fiber so the hot top
        // frames of 256 fibers do not all map to the same L1 sets.
        const size_t color = (i % 64) * 64;
        context_init(&f.ctx, f.stack, FAGEN_EMU_STACK_BYTES - color, &fiber_main, &f);
        g.queue[i] = FAGEN_EMU_ORDER(i, g.nthreads);
    }
    g.stacks_dirty = false;
    ++g.block_serial;
    for (unsigned w = 0; w < g.nwarps; ++w) {
        const unsigned n = g.nthreads - w * 32;
        g.warps[w] = Warp{n >= 32 ? ~0u : (1u << n) - 1u, 0, kSyncwarp, 0, 32, nullptr, 0};
    }
    g.q_head = 0;
    g.q_size = g.nthreads;
    g.live = g.nthreads;
    g.bar_arrived = 0;
    g.status = FAGEN_EMU_OK;
    // Uninitialised shared memory reads as NaN / 0xff.. so its use shows.
    if (g.smem_bytes) memset(g.smem, 0xff, g.smem_bytes);
    race::block_begin(g.smem, g.smem_bytes);
    Fiber* first = pop();
    jump_to_fiber(&g.sched, first, false);
    race::block_end();
    if (g.status != FAGEN_EMU_OK) g.stacks_dirty = true;
    return g.status;
}

FAGEN_EMU_NO_TSAN int launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, size_t smem, void (*body)(void*), void* body_arg, char* errbuf,
                             size_t errlen) {
    std::lock_guard<std::mutex> lock(fagen_emu_mutex);
    g.kernel = kernel;
    g.msg[0] = '\0';
    const unsigned long long nthreads = 1ull * bx * by * bz;
    int status = FAGEN_EMU_OK;
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 || gx > 0x7fffffffu) {
        snprintf(g.msg, sizeof g.msg, "kernel '%s': invalid grid (%u,%u,%u)", kernel, gx, gy, gz);
        status = FAGEN_EMU_BAD_LAUNCH;
    } else if (nthreads == 0 || nthreads > 1024 || bx > 1024 || by > 1024 || bz > 64) {
        snprintf(g.msg, sizeof g.msg, "kernel '%s': invalid block (%u,%u,%u)", kernel, bx, by, bz);
        status = FAGEN_EMU_BAD_LAUNCH;
    } else if (!ensure_capacity(unsigned(nthreads))) {
        snprintf(g.msg, sizeof g.msg, "kernel '%s': cannot allocate fiber stacks", kernel);
        status = FAGEN_EMU_BAD_LAUNCH;
    }
    void* smem_buf = nullptr;  // 1024-byte aligned: Hopper support (128B swizzles act on absolute addresses)
    if (status == FAGEN_EMU_OK && posix_memalign(&smem_buf, 1024, smem) != 0) {
        snprintf(g.msg, sizeof g.msg, "kernel '%s': cannot allocate %zu bytes of shared memory", kernel, smem);
        status = FAGEN_EMU_BAD_LAUNCH;
    }
    if (status == FAGEN_EMU_OK) {
#if defined(FAGEN_EMU_ASAN)
        pthread_attr_t attr;
        void* addr = nullptr;
        size_t size = 0;
        if (pthread_getattr_np(pthread_self(), &attr) == 0) {
            pthread_attr_getstack(&attr, &addr, &size);
            pthread_attr_destroy(&attr);
        }
        g.main_stack_bottom = addr;
        g.main_stack_size = size;
#endif
        g.smem = static_cast<unsigned char*>(smem_buf);
        g.smem_bytes = smem;
        g.body = body;
        g.body_arg = body_arg;
        g.grid_dim = dim3(gx, gy, gz);
        g.block_dim = dim3(bx, by, bz);
        g.nthreads = unsigned(nthreads);
        g.nwarps = (g.nthreads + 31) / 32;
        race::launch_begin(g.nthreads, smem);
        for (unsigned z = 0; z < gz && status == FAGEN_EMU_OK; ++z)
            for (unsigned y = 0; y < gy && status == FAGEN_EMU_OK; ++y)
                for (unsigned x = 0; x < gx && status == FAGEN_EMU_OK; ++x) {
                    g.block_idx = uint3{FAGEN_EMU_ORDER(x, gx), FAGEN_EMU_ORDER(y, gy), FAGEN_EMU_ORDER(z, gz)};
                    status = run_block();
                }
        g.smem = nullptr;
        free(smem_buf);
    }
    fflush(stdout);  // kernel printf output appears before Python's next print
    if (errbuf && errlen) snprintf(errbuf, errlen, "%s", g.msg);
    return status;
}
#else
FAGEN_EMU_NO_TSAN int launch(const char* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, size_t smem, void (*body)(void*), void* body_arg, char* errbuf,
                             size_t errlen);
#endif

}  // namespace fagen_emu

// Block index of the last failed launch (for the Python exception).
#if FAGEN_EMU_RUNTIME_DEFS
extern "C" __attribute__((visibility("default"))) FAGEN_EMU_NO_TSAN void fagen_emu_last_block(unsigned* out) {
    out[0] = fagen_emu_state.block_idx.x;
    out[1] = fagen_emu_state.block_idx.y;
    out[2] = fagen_emu_state.block_idx.z;
}
#endif
FAGEN_EMU_FAST_END
