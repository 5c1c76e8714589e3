"""Run a shared kernel body on the CPU: the EMU dialect (C++20, one fiber per GPU thread).

MLX's CPU build cannot run custom kernels, so CI would otherwise never execute the bodies the
GPU runs. Here the body of `KernelSource` is compiled with g++ against the EMU prelude and run
with numpy buffers: blocks one after another, the block's threads as fibers of one OS thread that
switch at barriers (BARRIER(), and a per-warp buffer and barrier for warp_sum), `SHARED` arrays
shared by the block's threads. It checks the body's arithmetic, indexing and barrier discipline:
the fibers run between barriers in a fixed scrambled order, so a read that a barrier should have
ordered after another thread's write reads the stale value in every run, and a thread that skips
a barrier leaves the others waiting, which `run` reports as a deadlock. It does not model the
GPU's memory ordering between blocks (blocks never communicate in strata's kernels).

Inputs are used in place (an input a kernel writes, like a KV cache, is written here too);
outputs are poisoned (NaN / 0xA5 bytes) before the run, so an unwritten element shows.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import KernelSource, full_source

RUNTIME = r"""
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700  // ucontext on macOS
#define _DARWIN_C_SOURCE   // MAP_ANON beside it
#endif
#include <sys/mman.h>
#include <ucontext.h>  // where the assembly switch below is not built
#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstring>
// No other standard header: parsing <functional>, <memory> and <vector> took half of each kernel's
// ~1 s compile, and a fresh machine compiles a few hundred kernels in one test run.

namespace strata_emu {

struct half {  // IEEE binary16 storage with float conversion (what the kernels use)
  uint16_t bits;
  static half from_float(float x) {  // to nearest even, as __float2half_rn and Metal's half(x)
    uint32_t f; std::memcpy(&f, &x, 4);
    const uint32_t s = (f >> 16) & 0x8000u, a = f & 0x7fffffffu;
    half h;
    if (a >= 0x7f800000u) { h.bits = (uint16_t)(s | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u)); return h; }
    if (a >= 0x477ff000u) { h.bits = (uint16_t)(s | 0x7c00u); return h; }  // rounds past 65504: inf
    if (a < 0x38800000u) {  // below 2^-14: a subnormal half, q = a / 2^-24 rounded to nearest even
      const uint32_t e = a >> 23, m = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
      const int shift = 126 - (int)e;  // m * 2^(e - 150) / 2^-24 = m >> (126 - e)
      if (shift > 24) { h.bits = (uint16_t)s; return h; }
      const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
      h.bits = (uint16_t)(s | (q + (rem > halfway || (rem == halfway && (q & 1u)))));
      return h;
    }
    const uint32_t r = a - 0x38000000u;  // rebias 127 -> 15 (exponent field moves by 112)
    const uint32_t q = r >> 13, rem = r & 0x1fffu;
    h.bits = (uint16_t)(s | (q + (rem > 0x1000u || (rem == 0x1000u && (q & 1u)))));
    return h;
  }
  operator float() const {
    const uint32_t s = (bits & 0x8000u) << 16, e = (bits >> 10) & 0x1fu, m = bits & 0x3ffu;
    uint32_t f;
    if (e == 0) {
      if (m == 0) { f = s; }
      else { int ee = -1; uint32_t mm = m; do { ee++; mm <<= 1; } while (!(mm & 0x400u));
             f = s | ((uint32_t)(127 - 15 - ee) << 23) | ((mm & 0x3ffu) << 13); }
    } else if (e == 31) { f = s | 0x7f800000u | (m << 13); }
    else { f = s | ((e + 112u) << 23) | (m << 13); }
    float out; std::memcpy(&out, &f, 4); return out;
  }
};

// A block's GPU threads are fibers on the launching OS thread, switched at barriers: a barrier
// costs one context switch per thread. With one OS thread per GPU thread it cost an OS wake-up
// per thread, most of a launch's time on two shared cores. A 3-token forward of a small model
// (tests/mlx_backend/test_mlx_compiled.py SMALL, 2 layers, ~40 launches) took 13-15 s of CPU that way, 1.1 s
// with ucontext's swapcontext (a system call per switch: it saves the signal mask), 0.13 s with
// strata_emu_switch below (x86-64 Linux: push the callee-saved registers, swap stacks); other
// machines use swapcontext.
// The fibers run in a scrambled order (a stride permutation of the thread ids, thread 0 neither
// first nor last), so a missing barrier shows as a wrong read in the same run, every run: the
// broadcast (thread 0 writes, the rest read) and the reduction (all write, thread 0 reads) alike.
constexpr size_t STACK_BYTES = 256 * 1024;  // kernels keep a few small arrays each (GPU registers)

struct Scheduler;
thread_local Scheduler* sched = nullptr;

struct Barrier {  // std::barrier's arrive_and_wait, for fibers
  int n = 32, arrived = 0;
  uint64_t generation = 0;
  void arrive_and_wait();
};

struct Block {
  explicit Block(int nt) : warps(new Barrier[nt / 32]), warp_bars(new Barrier*[nt / 32]), buf(new float[nt]()) {
    bar.n = nt;
    for (int w = 0; w < nt / 32; ++w) warp_bars[w] = &warps[w];
  }
  ~Block() { delete[] warps; delete[] warp_bars; delete[] buf; }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  Barrier bar;
  Barrier* warps;
  Barrier** warp_bars;  // warp_bars[w]->arrive_and_wait(), as std::barrier was used
  float* buf;
};

struct Ctx {
  uint32_t tid, bx, by, bz;
  Block* blk;
  void barrier() { blk->bar.arrive_and_wait(); }
  float warp_reduce(float x, bool is_max) {
    const uint32_t w = tid >> 5, base = w * 32;
    blk->buf[tid] = x;
    blk->warp_bars[w]->arrive_and_wait();
    float r = blk->buf[base];
    for (int i = 1; i < 32; ++i) r = is_max ? std::fmax(r, blk->buf[base + i]) : r + blk->buf[base + i];
    blk->warp_bars[w]->arrive_and_wait();
    return r;
  }
  float warp_sum(float x) { return warp_reduce(x, false); }
  float warp_max(float x) { return warp_reduce(x, true); }
};

thread_local Ctx* ctx = nullptr;

#if defined(__x86_64__) && defined(__linux__)
extern "C" void strata_emu_switch(void** save_sp, void* load_sp);
// Push the System V callee-saved registers, store the stack pointer, load the other's, pop its.
asm(R"(
.pushsection .text
.globl strata_emu_switch
.hidden strata_emu_switch
.type strata_emu_switch,@function
strata_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size strata_emu_switch, .-strata_emu_switch
.popsection
)");

struct Context {
  void* sp = nullptr;
  void start(char* stack, size_t size, void (*entry)(), Context*) {  // entry never returns
    auto* top = (uintptr_t*)(((uintptr_t)(stack + size)) & ~(uintptr_t)15);
    top[-1] = 0;                   // entry's return address: none (keeps its stack ABI-aligned)
    top[-2] = (uintptr_t)entry;    // strata_emu_switch's `ret` goes there
    for (int r = 3; r <= 8; ++r) top[-r] = 0;  // the six registers it pops
    sp = top - 8;
  }
};
inline void switch_to(Context& save, Context& load) { strata_emu_switch(&save.sp, load.sp); }
#else
struct Context {
  ucontext_t uc;
  void start(char* stack, size_t size, void (*entry)(), Context* link) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = stack;
    uc.uc_stack.ss_size = size;
    uc.uc_link = &link->uc;
    makecontext(&uc, entry, 0);
  }
};
inline void switch_to(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
#endif

struct Fiber {
  Context context;
  char* stack = nullptr;  // mmap'd: STACK_BYTES under one guard page
  Ctx c;
  bool done = false;
};

struct Scheduler {
  Context main;
  Fiber* running = nullptr;
  uint64_t progress = 0;  // arrivals and finished fibers: none in a whole round is a deadlock
  int gx = 0, gy = 0, gz = 0;
  void (*call)(const void*) = nullptr;  // runs the kernel body once for the running fiber
  const void* body = nullptr;
  void yield() { switch_to(running->context, main); }
  int failed = 0;  // set by a body (sched_fail): run_grid's code
};

inline void sched_fail(int code) { sched->failed = code; }

inline void Barrier::arrive_and_wait() {
  ++sched->progress;
  if (++arrived == n) { arrived = 0; ++generation; return; }
  const uint64_t g = generation;
  while (generation == g) sched->yield();
}

inline void fiber_main() {
  Scheduler* s = sched;
  Fiber* f = s->running;
  for (int z = 0; z < s->gz; ++z)
    for (int y = 0; y < s->gy; ++y)
      for (int x = 0; x < s->gx; ++x) {
        f->c.bx = x; f->c.by = y; f->c.bz = z;
        s->call(s->body);
        f->c.blk->bar.arrive_and_wait();  // the block's SHARED arrays are reused by the next block
      }
  f->done = true;
  ++s->progress;
  switch_to(f->context, s->main);  // never resumed
}

inline int fiber_at(int i, int nt) {  // the i-th fiber to run: a stride permutation of 0..nt-1
  int stride = 13;
  for (;;) {
    int a = stride, b = nt;
    while (b) { const int r = a % b; a = b; b = r; }
    if (a == 1) break;
    stride += 2;
  }
  return (int)(((int64_t)i * stride + nt / 2 + 1) % nt);
}

// 0: done; 1: a bad block size; 2: deadlock (a thread skipped a barrier); 3: out of memory.
template <class Body>
int run_grid(int gx, int gy, int gz, int nt, const Body& body) {
  if (nt <= 0 || nt % 32) return 1;
  Block blk(nt);
  Scheduler s;
  s.gx = gx; s.gy = gy; s.gz = gz;
  s.call = [](const void* b) { (*static_cast<const Body*>(b))(); };
  s.body = &body;
  Fiber* fibers = new Fiber[nt];
  int* order = new int[nt];
  for (int i = 0; i < nt; ++i) order[i] = fiber_at(i, nt);
  const long page = sysconf(_SC_PAGESIZE);
  int rc = 0;
  for (int t = 0; t < nt && !rc; ++t) {
    Fiber& f = fibers[t];
    void* m = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0);
    if (m == MAP_FAILED) { rc = 3; break; }
    f.stack = (char*)m;
    mprotect(f.stack, page, PROT_NONE);  // an overflow faults instead of writing another's stack
    f.c = Ctx{(uint32_t)t, 0, 0, 0, &blk};
    f.context.start(f.stack + page, STACK_BYTES, fiber_main, &s.main);
  }
  Scheduler* outer = sched;
  sched = &s;
  for (int live = nt; live && !rc;) {
    const uint64_t before = s.progress;
    live = 0;
    for (int i = 0; i < nt; ++i) {
      Fiber& f = fibers[order[i]];
      if (f.done) continue;
      s.running = &f;
      ctx = &f.c;
      switch_to(s.main, f.context);
      live += !f.done;
    }
    if (live && s.progress == before) rc = 2;
  }
  if (!rc && s.failed) rc = s.failed;
  sched = outer;
  ctx = nullptr;
  for (int t = 0; t < nt; ++t)
    if (fibers[t].stack) munmap(fibers[t].stack, STACK_BYTES + page);
  delete[] fibers;
  delete[] order;
  return rc;
}

}  // namespace strata_emu
"""

TIMEOUT_S = 120.0  # a body that never finishes (a loop that never ends) is an error, not a hang
_DEADLOCK, _NO_MEMORY, _UNMET_WAIT = 2, 3, 4  # run_grid's codes
_POISON_BYTE = 0xA5
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}


def available() -> bool:
    """True where a C++20 compiler is on PATH (the emulator's only need)."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _cache_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"strata-emu-{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _compile(code: str) -> ctypes.CDLL:
    key = hashlib.sha256(code.encode()).hexdigest()[:24]
    with _lock:
        if key in _libs:
            return _libs[key]
        so = _cache_dir() / f"k_{key}.so"
        if not so.exists():
            # Processes share the directory (pytest-xdist's workers, other users of the machine):
            # each writes and compiles its own files and renames them into place, so no compiler
            # reads a source another process is rewriting and no one loads a half-written library.
            src = so.with_suffix(f".{os.getpid()}.cpp")
            src.write_text(code)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            cmd = [os.environ.get("CXX", "g++"), "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread",
                   "-Wno-unused-variable", "-o", str(tmp), str(src)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                src.unlink()
                raise RuntimeError(f"emulator build failed:\n{proc.stderr[-4000:]}")
            os.replace(src, so.with_suffix(".cpp"))  # kept beside the library, to read
            os.replace(tmp, so)
        lib = ctypes.CDLL(str(so))
        lib.strata_launch.restype = ctypes.c_int
        lib.strata_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_int] * 4
        _libs[key] = lib
        return lib


def translation_unit(src: KernelSource, in_types, out_types, template) -> str:
    return RUNTIME + full_source(src, Dialect.EMU, tuple(in_types), tuple(out_types), tuple(template))


def run(src: KernelSource, inputs: list[np.ndarray], output_shapes: list[tuple[int, ...]],
        output_dtypes: list, grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
        template: tuple[tuple[str, int], ...]) -> list[np.ndarray]:
    """Run `src` like MLX would on a GPU. Inputs must be C-contiguous numpy arrays (written in
    place if the kernel writes them); returns the outputs."""
    for a in inputs:
        if not a.flags.c_contiguous:
            raise ValueError("emulator inputs must be C-contiguous")
    outs = []
    for shape, dt in zip(output_shapes, output_dtypes):
        o = np.empty(shape, dtype=np.dtype(dt))
        o.view(np.uint8).fill(_POISON_BYTE) if o.dtype.kind in "iub" else o.fill(np.nan)
        outs.append(o)
    in_types = [a.dtype.name for a in inputs]
    out_types = [o.dtype.name for o in outs]
    lib = _compile(translation_unit(src, in_types, out_types, template))
    ptrs = (ctypes.c_void_p * (len(inputs) + len(outs)))(*[a.ctypes.data for a in inputs + outs])
    nt = threadgroup[0]
    if threadgroup[1:] != (1, 1) or grid[0] % nt:
        raise ValueError(f"emulator: grid {grid} must be whole blocks of ({nt}, 1, 1)")
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(lib.strata_launch(ptrs, grid[0] // nt, grid[1], grid[2], nt)),
                          daemon=True)
    th.start()
    th.join(TIMEOUT_S)
    if th.is_alive():
        raise RuntimeError(f"kernel {src.name} did not finish in {TIMEOUT_S:.0f} s on the emulator")
    if result == [_DEADLOCK]:
        raise RuntimeError(f"kernel {src.name}: a thread skipped a barrier (deadlock) on the emulator")
    if result == [_NO_MEMORY]:
        raise MemoryError(f"kernel {src.name}: no memory for the emulator's {nt} thread stacks")
    if result == [_UNMET_WAIT]:
        raise RuntimeError(f"kernel {src.name}: a block waited for blocks that had not run (phases out of order)")
    if result != [0]:
        raise RuntimeError(f"kernel {src.name}: emulator launch failed ({result})")
    return outs
