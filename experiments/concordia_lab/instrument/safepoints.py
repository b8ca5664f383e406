"""PTX safe points: block-entry pause/resume probes, exit probes and restartable barrier probes.

``rewrite_ptx(ptx)`` takes a module as Triton/Inductor wrote it and returns it with, per kernel that can be
paused safely (DESIGN.md beside this file has the protocol).

Protocol 5 (the default, "record on pause"): a module global ``cft_ctl_<kernel>`` (0 = disarmed) pointing at
the kernel's per-block records in an arena whose header (pause, mode) every kernel of a call shares; the block
leader reads the header as one 64-bit load at the vote site and, only when a pause or a resume is on, reads
and rewrites its block's record (``v5_decide``); no exit probes, no barrier probes. Protocol 4
(``SafepointOptions(protocol=4)``), described below, marks blocks done at their exit:

- a module global ``cft_ctl_<kernel>`` (u64, zero = disarmed: the kernel then behaves as before, at the cost
  of one cached load and a branch per thread);
- an **entry probe**: the block's leader (thread 0,0,0) reads the control block's pause word and mode; the
  block then either runs, or records itself in the control block's bitmap and leaves (first launch, paused),
  or leaves at once because it already ran (resume launch, bit clear). One ``barrier.red.or`` hands the
  leader's decision to the whole block, so the exit is block-uniform;
- **exit probes** before every ``ret``/``exit`` (their guard predicate kept): the leader counts the block done;
- **barrier probes** (opt-in, ``SafepointOptions(barrier_probes=True)``) at ``bar.sync 0`` sites that no global write, atomic or call can precede on any path:
  the barrier becomes a ``bar.red.or`` carrying the leader's pause read, and a paused block records itself
  and leaves; it reruns from its start on resume, which is exact because it had changed nothing outside
  itself. Never placed in kernels with atomics or asynchronous copies/MMAs in flight.

Kernels that cannot be paused by blocks without breaking exactly-once are refused with a name from
``REFUSALS`` and left byte-for-byte unchanged. Pure text work: no torch, no cuda imports.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import InstrumentError, PtxParseError, UnsafeKernelError
from .ptx import (
    REG_RE,
    BasicBlock,
    Kernel,
    PtxModule,
    Statement,
    build_cfg,
    header_text,
    loop_blocks,
    parse_module,
    strip_comment,
)

# ---- the control block (device memory, one per armed launch; DESIGN.md) ------------------------------
CTL_PAUSE = 0  # u32, host sets 1 to pause (a stream write from another stream), 0 to run
CTL_BITMAP = 16  # u32 words after a 16-byte header: bit b of word w = block 32*w+b ran to completion
SYMBOL_PREFIX = "cft_ctl_"
PROTOCOL_VERSION = 5  # bump when the probes' code or the control block changes (it salts compile caches)
PROTO_PREFIX = "cft_proto_"  # v5 kernels: a u32 module global holding the protocol (absent: version 4)
# v5 kernels built with ``header_arg``: a u32 module global whose presence says the header's address comes in the
# kernel's trailing pointer parameter (Triton's profile-scratch pointer), filled per launch (instrument/header_arg.py)
HARG_PREFIX = "cft_harg_"

# ---- protocol 5, "record on pause" (DESIGN.md §1): one arena per armed call -------------------------------
# The arena starts with a 64-byte header shared by every kernel of the call: u32 pause word, u32 mode word
# (0 run, 1 resume), read by each block's leader as one 64-bit load. Each kernel K has a region of records,
# one 8-byte record per block b: {u32 s: launches of K that b skipped (the pending suffix), u32 rem: resume
# countdown}. The module global cft_ctl_K holds region | A, where the arena is aligned to 2**A bytes (A >= 6,
# regions 64-byte aligned): the probe finds the header as global & ~(2**A - 1), its records at global & ~63.
HDR_PAUSE = 0
HDR_MODE = 4
HDR_BYTES = 64
REC_BYTES = 8
MODE_RUN = 0
MODE_RESUME = 1

REFUSALS: dict[str, str] = {
    "cluster": "uses thread-block clusters (a skipped CTA breaks its cluster's co-residency and barriers)",
    "pdl": "uses programmatic dependent launch (griddepcontrol): an early-exiting block never signals dependents",
    "spin_wait": "a loop polls global memory or an atomic (grid barrier / semaphore): a skipped block deadlocks "
                 "the blocks that wait for it",
    "atomic_control": "branches on an atomic's result (ticket, last-block-reduces, semaphore): blocks of one "
                      "launch depend on each other",
    "cross_block_flag": "branches on a volatile/acquire load of global memory other blocks may write",
    "persistent_grid": "a loop is bounded by %nctaid (persistent grid / grid-stride): one program runs many "
                       "tiles, so a block is not a unit of work",
    "cooperative": "launched as a cooperative grid (all blocks must be co-resident)",
    "indirect_control": "indirect branches (brx.idx): control flow cannot be followed",
    "unsafe_call": "calls a .func that uses clusters, PDL or spin loops",
    "no_header_param": "SafepointOptions(header_arg=True) needs a trailing 64-bit pointer parameter (Triton 3.6's "
                       "profile-scratch pointer) to carry the header's address, and this kernel has none",
}

_CLUSTER_RE = re.compile(r"%cluster|%is_explicit_cluster|barrier\.cluster|\bmapa\b|shared::cluster|"
                         r"\.reqnctapercluster|\.explicitcluster|\.maxclusterrank")
_ASYNC_RE = re.compile(r"^(cp\.async|wgmma|mbarrier|tcgen05|st\.async|red\.async|cp\.reduce\.async|"
                       r"setmaxnreg|elect|stmatrix)")
# for the vote placement of protocol 5: stmatrix is a synchronous warp store to shared memory (block-private),
# nothing stays in flight after it, so a block may still leave at a barrier after it (protocol 4 keeps treating
# it as asynchronous, so its code and numbers stay what they were)
_ASYNC_NO_STMATRIX_RE = re.compile(r"^(cp\.async|wgmma|mbarrier|tcgen05|st\.async|red\.async|cp\.reduce\.async|"
                                   r"setmaxnreg|elect)")
_BARRIER_OPS = ("bar.sync", "barrier.sync", "barrier.sync.aligned", "bar.cta.sync", "barrier.cta.sync",
                "barrier.cta.sync.aligned")
_LOCAL_SPACES = (".shared", ".local", ".param")


@dataclass(frozen=True)
class SafepointOptions:
    # Off by default: measured on the H200 (experiments/results/pause-h200.json) they cost 4% (layernorm) to
    # 48% (softmax: short blocks, barriers close together) armed, and shorten pauses only for long blocks.
    barrier_probes: bool = False
    strict: bool = False  # raise UnsafeKernelError instead of leaving a refused kernel unchanged
    # The entry decision's vote at the kernel's first barrier instead of at entry, where that barrier lies in
    # straight-line code from entry with no global side effect before it: the leader's two L2 reads overlap
    # the kernel's own first loads instead of holding every thread at entry (DESIGN.md §1, "deferred vote").
    deferred_vote: bool = True
    # Where no such barrier comes first, vote at a reducing barrier inserted right before the kernel's first
    # global write, if straight-line code from entry reaches that write (Inductor's pointwise and per-row
    # kernels: loads, math, stores, no branch): the leader's reads then overlap the block's own loads, as
    # with the deferred vote, instead of holding every thread at entry (DESIGN.md §1, version 4).
    vote_before_write: bool = True
    # With a deferred vote: only the block's leader waits at entry for the control pointer (to issue its two
    # reads); every other thread issues the pointer's load and first uses it at the vote, so no warp but the
    # leader's waits at entry, and a disarmed launch skips an inserted vote barrier (DESIGN.md §1).
    lazy_entry: bool = False  # measured (DESIGN.md §6): no better than the plain deferred entry
    # With a deferred vote: entry only issues the control pointer's load; the leader's two reads and the vote
    # happen at the vote site, skipped as a whole (a block-uniform branch on the pointer) by a disarmed launch.
    # Nothing waits for the probe at entry; an armed block waits one L2 round trip at the vote instead. On by
    # default: cheapest disarmed on the H200 (decode kernels: ~0.1 us left of ~0.3 us), armed ~2 points dearer
    # than without it on the 8x512 layer (DESIGN.md §6); takes precedence over lazy_entry.
    late_reads: bool = True
    # 5: "record on pause" (the default): no done bits, no exit probes, no per-call memset;
    # the leader reads one 64-bit header word (pause, mode) at the vote and a paused block records itself.
    # 4: done bits set at every block's exit (kept for comparison). Barrier probes need protocol 4.
    protocol: int = 5
    # Protocol 5: the leader issues its header load right after the kernel's last global load before the vote
    # site (straight-line code), so that it is in flight during the kernel's math instead of starting at the
    # vote; only the leader's warp waits for the control pointer there (DESIGN.md §1.0).
    early_header: bool = False
    # Protocol 5: treat stmatrix (a synchronous warp store to shared memory) as what it is when placing the vote,
    # so kernels that use it before their first barrier (Inductor's RMSNorm+rope kernels at 8x512) vote at that
    # barrier instead of at entry. Protocol 4 always treats it as asynchronous (its code unchanged). On by
    # default (with const_ctl and entry_header: armed +1.5% on the 8x512 layer, DESIGN.md §6; it costs +9
    # registers on the RMSNorm+rope kernels).
    stmatrix_sync: bool = True
    # Protocol 5: the control pointer lives in the module's constant bank (`.const`, written by the host with a
    # plain copy when arming, as cudaMemcpyToSymbol does) instead of global memory, so every thread's load of
    # it is a constant-cache hit that the kernel's own streaming loads cannot evict from L1 (DESIGN.md §1.0).
    # Protocol 4 writes its pointers from the stream per launch (cuStreamWriteValue64): global memory only, so
    # protocol 4 ignores it (and entry_header, early_header, stmatrix_sync). On by default.
    const_ctl: bool = True
    # Protocol 5: the leader issues its header load at block entry, right after the control pointer's load, so
    # the one L2 round trip of an armed block overlaps all of the kernel's work before the vote (with
    # ``const_ctl`` the pointer itself is a constant-cache hit, so only the leader's warp waits for it, briefly).
    # Takes precedence over ``early_header``. On by default.
    entry_header: bool = True
    # Protocol 5: the leader's rare path (a pause or a resume: reading and rewriting its block's record) is placed
    # after the kernel's last instruction and reached by a branch, so the normal path between the header test and
    # the kernel's own next instruction is a few instructions long instead of ~20 (the instruction stream a
    # small decode-shape kernel fetches cold on every launch). Same decision (the CPU interpreter test runs it).
    cold_path: bool = False
    # Protocol 5, kernels whose vote is a barrier inserted before their first global write and that have no
    # barrier of their own (Inductor's pointwise kernels, a 1-D ``.reqntid`` of whole warps): decide per warp
    # instead. Every thread reads the header after the kernel's last load before the site; a warp where no lane
    # saw a pause or a resume records "ran" in shared memory, arrives at a named barrier without waiting and
    # goes on; only a warp that saw one waits there for every warp's decision. If any warp ran, the block runs
    # whole (unrecorded, as a block that passed the vote does); if none did, the leader decides for the block
    # (``v5_decide``) as before. So in the normal path no warp waits for another (the inserted barrier made
    # every warp of silu*mul wait for the slowest one's loads: +2.7 us of 17.3, DESIGN.md §6), and the block's
    # outcome and its record are what the block vote gives. Off: measured slower on the H200 (silu*mul armed
    # 24.7 us vs 20.0 with the block vote; every warp reads the one header line, so its L2 slice queues the
    # requests; DESIGN.md §6).
    warp_vote: bool = False
    # Protocol 5: the header's address (0: disarmed) comes in the kernel's last parameter, the pointer Triton 3.6
    # passes every kernel for profile scratch memory and fills per launch from its profile allocator
    # (instrument/header_arg.py routes each kernel to the call that armed it), instead of through the
    # constant-bank control pointer. Every thread's read of it is a parameter-bank hit, so a disarmed launch
    # reads no memory at all, and an armed block's one dependent load is the leader's header read, issued at
    # entry. The kernel's records stay behind ``cft_ctl_<kernel>``, which only the rare path (a pause, a resume)
    # loads, checking that it names the same header (else the block runs: the kernel is not part of the call
    # whose header it got). A CUDA graph freezes the parameter at capture: an arena captured that way is kept for
    # the process's life. ``triton_hook`` applies it where Triton passes that parameter and no profiler uses it,
    # and turns Inductor's static launcher off (it passes no such parameter). The records' pointer is then a
    # ``.global``: a module ``.const`` costs every launch +0.10 us on the H200 even unread (DESIGN.md §6). Off
    # here (the rewriter knows nothing of the launcher); ``triton_hook.install()`` turns it on by default:
    # CUDA-graph replays of the compiled Qwen3 layer armed +0.2-1.8% at every shape, against +1.7-4.3% with the
    # constant-bank pointer. Each eager launch goes through Triton's Python launcher and our allocator
    # (host-bound: slower than the constant-bank pointer in 8 of 10 comparisons, by 2-15 points), and a CUDA
    # graph captured disarmed stays plain (DESIGN.md §6).
    header_arg: bool = False
    # Protocol 5: the header read (pause, mode) as a relaxed load at GPU scope (``ld.relaxed.gpu``, SASS
    # ``LDG.E.64.STRONG.GPU``) instead of a volatile one (system scope, ``STRONG.SYS``). Every pause and resume
    # writer is on the GPU (a kernel, a stream memory operation, a copy into device memory), so GPU scope sees
    # them. Off: under measurement.
    header_gpu_scope: bool = False

    def __post_init__(self) -> None:
        if self.protocol not in (4, 5):
            raise InstrumentError(f"SafepointOptions(protocol={self.protocol}): protocols 4 and 5 exist")
        if self.protocol == 5 and self.barrier_probes:
            raise InstrumentError("barrier probes exist in protocol 4 only (a block leaving at a barrier would "
                                  "have to record itself after passing the vote): SafepointOptions(protocol=4, "
                                  "barrier_probes=True)")
        if self.header_arg and (self.protocol != 5 or self.warp_vote):
            raise InstrumentError("header_arg is protocol 5's block vote (SafepointOptions(protocol=5, "
                                  "warp_vote=False)): protocol 4 writes its pointers from the stream per launch, "
                                  "and the per-warp vote was not built with it")


@dataclass(frozen=True)
class KernelReport:
    """What the rewriter did to one kernel, and why."""

    name: str
    refused: str | None = None  # a REFUSALS name, or None when instrumented
    detail: str = ""
    entry_only: str | None = None  # why barrier probes were not placed at all (atomics, async ops, option)
    entry_probes: int = 0
    exit_probes: int = 0
    barrier_probes: int = 0
    barriers: int = 0  # bar.sync sites in the kernel
    deferred_vote: bool = False  # the entry decision is voted after entry (SafepointOptions)
    vote_site: str = "entry"  # "entry", "barrier" (the first bar.sync) or "before_write" (an inserted barrier)
    warp_vote: bool = False  # the before_write vote is decided per warp (SafepointOptions.warp_vote)

    @property
    def instrumented(self) -> bool:
        return self.refused is None

    @property
    def ctl_symbol(self) -> str:
        return SYMBOL_PREFIX + self.name


@dataclass(frozen=True)
class RewriteResult:
    ptx: str
    kernels: tuple[KernelReport, ...]

    def kernel(self, name: str) -> KernelReport:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(f"no kernel {name!r} in this module (kernels: {[k.name for k in self.kernels]})")

    @property
    def changed(self) -> bool:
        return any(k.instrumented for k in self.kernels)


def ctl_bytes(nblocks: int) -> int:
    """Bytes of the control block of a launch of ``nblocks`` blocks."""
    return CTL_BITMAP + 4 * ((nblocks + 31) // 32)


def grid_blocks(grid: tuple[int, int, int]) -> int:
    return grid[0] * grid[1] * grid[2]


def block_index(x: int, y: int, z: int, grid: tuple[int, int, int]) -> int:
    """The bitmap index the probes use for block (x, y, z): ``(z * ny + y) * nx + x``."""
    return (z * grid[1] + y) * grid[0] + x


def pending_blocks(done_words: Iterable[int], nblocks: int) -> list[int]:
    """Block indexes whose done bit is clear: the blocks that still have to run."""
    done = set(decode_bitmap(done_words, nblocks))
    return [b for b in range(nblocks) if b not in done]


def decode_bitmap(words: Iterable[int], nblocks: int) -> list[int]:
    """Block indexes whose bit is set (the blocks still to run)."""
    out: list[int] = []
    for w, word in enumerate(words):
        word = int(word) & 0xFFFFFFFF
        while word:
            low = word & -word
            b = 32 * w + low.bit_length() - 1
            if b < nblocks:
                out.append(b)
            word ^= low
    return out


def v5_region_bytes(nblocks: int) -> int:
    """Bytes of one kernel's record region (64-byte aligned) in a protocol-5 arena."""
    return -(-REC_BYTES * nblocks // 64) * 64


def v5_align_log2(arena_bytes: int) -> int:
    """A: the arena is aligned to 2**A >= its size (so that every address in it maps to its header)."""
    a = 6
    while (1 << a) < arena_bytes:
        a += 1
    if a > 47:
        raise ValueError(f"an arena of {arena_bytes} bytes is too large")
    return a


def v5_ctl_value(region_addr: int, align_log2: int) -> int:
    """The value of a kernel's ``cft_ctl_`` global that points at its records in an arena aligned to 2**A."""
    if region_addr % 64 or region_addr & ((1 << align_log2) - 1) < HDR_BYTES:
        raise ValueError(f"region 0x{region_addr:x} is not a 64-byte aligned region behind an arena header")
    return region_addr | align_log2


def v5_decide(mode: int, pause: int, s: int, rem: int) -> tuple[bool, int, int]:
    """What a protocol-5 block leader does at the vote (the PTX of ``_v5_leader`` implements exactly this):
    ``(runs, s', rem')`` from the header's mode and pause words and the block's record ``(s, rem)``.

    Run mode: not paused -> run, the record untouched (nothing is read or written); paused -> leave, one more
    launch skipped. Resume mode: ``r = rem`` is this launch's place counted from the end of the block's
    launches of this kernel; ``rem' = r - 1``; it runs iff ``r <= s`` (it skipped this launch) and no pause is
    set, and then ``s' = r - 1``; else it leaves (done already, or pending still)."""
    m32 = 0xFFFFFFFF
    if mode == MODE_RUN:
        if pause == 0:
            return True, s, rem
        return False, (s + 1) & m32, rem
    r = rem & m32
    runs = r <= s and pause == 0
    return runs, ((r - 1) & m32) if runs else s, (r - 1) & m32


def v5_totals(grids: Sequence[int], nmax: int) -> list[int]:
    """Per block b < nmax: how many of a kernel's launches (block counts ``grids``, in call order) have block
    b: the resume countdown each block starts from."""
    import bisect

    srt = sorted(grids)
    return [len(srt) - bisect.bisect_right(srt, b) for b in range(nmax)]


def v5_pending(grids: Sequence[int], skipped: Sequence[int]) -> list[list[int]]:
    """Per launch of one kernel (block counts ``grids`` in call order), the blocks still to run, given each
    block's skip count ``skipped[b]`` (the records' ``s``): block b of launch i is pending iff its place
    counted from the end among the launches that have block b is <= s[b]."""
    import bisect

    out: list[list[int]] = []
    for i, g in enumerate(grids):
        later = sorted(grids[i:])
        n = len(later)
        out.append([b for b in range(g) if b < len(skipped) and int(skipped[b]) > 0
                    and n - bisect.bisect_right(later, b) <= int(skipped[b])])
    return out


# ---- analysis --------------------------------------------------------------------------------------------

def _space_of(st: Statement) -> str:
    for s in (".global", ".shared", ".local", ".param", ".const"):
        if s in st.opcode:
            return s
    return ""  # generic addressing: may be global


def is_global_effect(st: Statement) -> bool:
    """True when the statement may change memory other blocks (or later launches) can see."""
    op = st.opcode
    head = op.split(".")[0]
    if head in ("st", "atom", "red", "sust", "sured", "multimem") or op.startswith("st.async"):
        return _space_of(st) not in _LOCAL_SPACES
    if op.startswith(("cp.async.bulk", "cp.reduce.async")):
        return ".global" in op.split(".shared")[0] or op.startswith("cp.reduce")
    return head == "call"


def is_atomic(st: Statement) -> bool:
    head = st.opcode.split(".")[0]
    return head in ("atom", "red", "sured") or st.opcode.startswith(("cp.reduce.async", "red.async"))


def _is_poll_load(st: Statement) -> bool:
    op = st.opcode
    return op.startswith("ld.") and any(t in op for t in (".volatile", ".acquire", ".relaxed")) \
        and _space_of(st) in (".global", "")


def _dest(st: Statement) -> str | None:
    regs = st.registers()
    if not regs:
        return None
    first = st.operands.split(",")[0]
    if first.strip().startswith("{"):  # vector destination: taint the first member (enough for scalar polls)
        return regs[0]
    return regs[0] if regs[0] in first else None


def _space_key(st: Statement) -> str:
    return _space_of(st) or ".generic"


def _taint(statements: list[Statement], seeds: set[str]) -> set[str]:
    """Registers whose value may depend on a seed register (flow-insensitive fixpoint). Values stored to a
    state space taint every later load from that space: Triton broadcasts a leader's atomic result through
    shared memory before the block branches on it."""
    tainted = set(seeds)
    spaces: set[str] = set()
    changed = True
    while changed:
        changed = False
        for st in statements:
            head = st.op_parts[0]
            if head in ("st", "atom", "red") and "]" in st.operands:
                values = REG_RE.findall(st.operands.split("]", 1)[1])
                key = _space_key(st)
                if key not in spaces and any(r in tainted for r in values):
                    spaces.add(key)
                    changed = True
            d = _dest(st)
            if d is None or d in tainted:
                continue
            loads_tainted = head == "ld" and (_space_key(st) in spaces or ".generic" in spaces)
            if loads_tainted or any(r in tainted for r in st.registers()[1:]):
                tainted.add(d)
                changed = True
    return tainted


def _guard_reg(st: Statement) -> str:
    return st.guard.lstrip("!")


def _refusal(module: PtxModule, kernel: Kernel, blocks: list[BasicBlock] | None) -> tuple[str, str] | None:
    code = _strip_comments("".join(module.lines[kernel.header_start:kernel.body_close + 1]))
    m = _CLUSTER_RE.search(code)
    if m:
        return "cluster", f"found {m.group(0)!r}"
    if "griddepcontrol" in code:
        return "pdl", "found 'griddepcontrol'"
    if any(st.opcode.startswith("call") for st in kernel.statements) and module.func_ranges:
        funcs = _strip_comments(module.func_text())
        if _CLUSTER_RE.search(funcs) or "griddepcontrol" in funcs or \
                (re.search(r"\batom\.|ld\.(volatile|acquire)", funcs) and re.search(r"\bbra", funcs)):
            return "unsafe_call", "a called .func has clusters, PDL or a possible spin loop"
    if blocks is None:
        return "indirect_control", "brx.idx present"
    sts = kernel.statements
    in_loop = loop_blocks(blocks)
    block_of = {st.index: bi for bi, b in enumerate(blocks) for st in b.statements}
    atom_dst = {d for st in sts if is_atomic(st) and (d := _dest(st)) is not None}
    poll_dst = {d for st in sts if _is_poll_load(st) and (d := _dest(st)) is not None}
    poll_in_loop = any((is_atomic(st) or _is_poll_load(st)) and block_of.get(st.index) in in_loop for st in sts)
    from_atom = _taint(sts, atom_dst)
    from_poll = _taint(sts, poll_dst)
    nctaid = {d for st in sts if "%nctaid" in st.operands and (d := _dest(st)) is not None}
    from_nctaid = _taint(sts, nctaid)
    for st in sts:
        if not st.opcode.startswith("bra") or not st.guard:
            continue
        g = _guard_reg(st)
        looped = block_of.get(st.index) in in_loop
        if g in from_atom or g in from_poll:
            if looped and poll_in_loop:
                return "spin_wait", f"loop branch '{st.text}' depends on a polled/atomic value"
            if g in from_atom:
                return "atomic_control", f"branch '{st.text}' depends on an atomic's result"
            return "cross_block_flag", f"branch '{st.text}' depends on a volatile/acquire load"
        target = st.operands.strip()
        tline = kernel.labels.get(target, kernel.body_close)
        if g in from_nctaid and looped and tline <= st.index:
            return "persistent_grid", f"loop back edge '{st.text}' depends on %nctaid"
    return None


def _dirty_before(blocks: list[BasicBlock]) -> set[int]:
    """Statement line indexes reached after a possible global side effect on some path from entry."""
    n = len(blocks)
    preds: list[list[int]] = [[] for _ in range(n)]
    for bi, b in enumerate(blocks):
        for s in b.succs:
            preds[s].append(bi)
    has_effect = [any(is_global_effect(st) for st in b.statements) for b in blocks]
    dirty_in = [False] * n
    changed = True
    while changed:
        changed = False
        for bi in range(n):
            new = any(dirty_in[p] or has_effect[p] for p in preds[bi])
            if new and not dirty_in[bi]:
                dirty_in[bi] = True
                changed = True
    dirty: set[int] = set()
    for bi, b in enumerate(blocks):
        d = dirty_in[bi]
        for st in b.statements:
            if d:
                dirty.add(st.index)
            if is_global_effect(st):
                d = True
    return dirty


def _is_cta_barrier(st: Statement) -> bool:
    return st.opcode in _BARRIER_OPS and st.operands.strip() == "0"


@dataclass
class _Plan:
    report: KernelReport
    barrier_lines: list[int] = field(default_factory=list)
    exit_lines: list[int] = field(default_factory=list)
    entry_line: int = -1
    vote_line: int = -1  # the barrier that carries the entry decision (-1: voted at entry)
    vote_inserted: bool = False  # the vote is a barrier inserted before vote_line (the first global write)
    warp_threads: int = 0  # > 0: the inserted vote is decided per warp; the block's (.reqntid) thread count
    header_param: str = ""  # header_arg: the parameter that carries the header's address


_PARAM_RE = re.compile(r"\.param\b([^,)]*)")


def trailing_pointer_param(module: PtxModule, kernel: Kernel) -> str | None:
    """The name of the kernel's last parameter if it is a 64-bit scalar (Triton 3.6 passes the profile-scratch
    pointer there), else None."""
    decls = _PARAM_RE.findall(_strip_comments(header_text(module, kernel)))
    if not decls:
        return None
    toks = decls[-1].split()
    if not toks or toks[0] not in (".u64", ".b64", ".s64") or any("[" in t for t in toks):
        return None
    return str(toks[-1])


def _strip_comments(text: str) -> str:
    return "\n".join(strip_comment(ln) for ln in text.splitlines())


def _first_vote_site(kernel: Kernel, entry_line: int, before_write: bool,
                     stmatrix_ok: bool = False) -> tuple[int, bool]:
    """Where the entry decision can be voted after entry: ``(line, inserted)``, or ``(-1, False)``.

    The first ``bar.sync 0`` reached from entry in straight-line code (no branch target, branch, call, return
    before it), with no global side effect and no asynchronous copy/MMA before it: that barrier carries the vote
    (``inserted`` False). With ``before_write``, where the same straight-line walk meets a global write
    (store, atomic, reduction) before any barrier, a reducing barrier inserted just before that write carries it
    (``inserted`` True). Every thread passes the site exactly once before anything it does can be seen outside
    the block, so a block may still leave there as if it had left at entry."""
    targets = {st.operands.strip().rstrip(";").split(",")[0].strip() for st in kernel.statements
               if st.op_parts[0] in ("bra", "brx")}
    labels = {ln for name, ln in kernel.labels.items() if name in targets}  # join points (debug labels are not)
    for st in kernel.statements:
        if st.index < entry_line:
            continue
        if any(entry_line <= ln <= st.index for ln in labels):
            return -1, False
        if _is_cta_barrier(st):
            return (st.index, False) if not st.guard else (-1, False)
        head = st.op_parts[0]
        if before_write and is_global_effect(st) and head != "call":
            return st.index, True
        asynchronous = (_ASYNC_NO_STMATRIX_RE if stmatrix_ok else _ASYNC_RE).match(st.opcode)
        if head in ("bra", "brx", "call", "ret", "exit", "trap") or is_global_effect(st) or asynchronous or \
                st.opcode.startswith(("bar.", "barrier.")):
            return -1, False
    return -1, False


def _plan(module: PtxModule, kernel: Kernel, opts: SafepointOptions,
          launch_refusal: tuple[str, str] | None) -> _Plan:
    blocks = build_cfg(kernel)
    barriers = [st for st in kernel.statements if _is_cta_barrier(st)]
    refusal = launch_refusal or _refusal(module, kernel, blocks)
    hparam = ""
    if refusal is None and opts.header_arg:
        hparam = trailing_pointer_param(module, kernel) or ""
        if not hparam:
            refusal = ("no_header_param", "its last parameter is not a 64-bit pointer")
    if refusal is not None:
        return _Plan(KernelReport(kernel.name, refused=refusal[0], detail=refusal[1], barriers=len(barriers)))
    assert blocks is not None
    entry_only: str | None = None
    if not opts.barrier_probes:
        entry_only = "barrier probes off"
    elif any(is_atomic(st) for st in kernel.statements):
        entry_only = "atomics: only entry-skip keeps them exactly-once"
    elif any(_ASYNC_RE.match(st.opcode) for st in kernel.statements):
        entry_only = "asynchronous copies/MMAs may be in flight at barriers"
    safe: list[int] = []
    if entry_only is None:
        dirty = _dirty_before(blocks)
        safe = [st.index for st in barriers if st.index not in dirty]
    exits = [st.index for st in kernel.statements if st.op_parts[0] in ("ret", "exit")]
    if opts.protocol == 5:  # record on pause: no exit probes (nothing to mark), no barrier probes
        exits, safe, entry_only = [], [], "protocol 5: a block that passed the vote runs to completion"
    if entry_only is None and any(st.guard for st in kernel.statements if st.index in exits):
        entry_only, safe = "a guarded ret may take the block leader out before a barrier", []
    first = min([kernel.body_close] + [ln for ln in kernel.labels.values()] + [st.index for st in kernel.statements])
    vote, inserted = _first_vote_site(kernel, first, opts.vote_before_write,
                                      opts.protocol == 5 and opts.stmatrix_sync) \
        if opts.deferred_vote else (-1, False)
    if not inserted:
        safe = [ln for ln in safe if ln != vote]  # that barrier carries the entry vote instead
    rep = KernelReport(kernel.name, entry_only=entry_only, entry_probes=1, exit_probes=len(exits),
                       barrier_probes=len(safe), barriers=len(barriers), deferred_vote=vote >= 0,
                       vote_site="entry" if vote < 0 else ("before_write" if inserted else "barrier"),
                       detail=f"{len(safe)} of {len(barriers)} barriers are restartable safe points"
                              + ("" if vote < 0 else "; entry vote before the first global write" if inserted
                                 else "; entry vote at the first barrier"))
    warp_threads = 0
    if opts.protocol == 5 and opts.warp_vote and inserted:
        warp_threads = _warp_vote_threads(module, kernel)
        if warp_threads:
            rep = dataclasses.replace(rep, warp_vote=True, detail=rep.detail + " (decided per warp)")
    return _Plan(rep, safe, exits, first, vote, inserted, warp_threads, hparam)


_REQNTID_RE = re.compile(r"\.reqntid\s+(\d+)\s*(?:,\s*(\d+)\s*)?(?:,\s*(\d+)\s*)?")


def _warp_vote_threads(module: PtxModule, kernel: Kernel) -> int:
    """The block's thread count where a per-warp vote is safe (0: it is not): no barrier anywhere in the kernel
    (named barrier 1 is the vote's own, and no shared memory is handed between warps), and a 1-D ``.reqntid``
    of whole warps (every lane of every warp reaches the vote: the full-mask ``vote.sync``)."""
    if any(st.opcode.startswith(("bar", "barrier")) for st in kernel.statements):
        return 0
    m = _REQNTID_RE.search(header_text(module, kernel))
    if m is None or any(g not in (None, "1") for g in m.groups()[1:]):
        return 0
    n = int(m.group(1))
    return n if 32 <= n <= 1024 and n % 32 == 0 else 0


def plan_safepoints(ptx: str, *, options: SafepointOptions | None = None,
                    launch_refusals: dict[str, tuple[str, str]] | None = None) -> tuple[KernelReport, ...]:
    """What ``rewrite_ptx`` would do, per kernel, without rewriting."""
    module = parse_module(ptx)
    opts = options or SafepointOptions()
    lr = launch_refusals or {}
    return tuple(_plan(module, k, opts, lr.get(k.name)).report for k in module.kernels)


# ---- rewriting -------------------------------------------------------------------------------------------

def _negate(guard: str) -> str:
    return guard[1:] if guard.startswith("!") else "!" + guard


def _entry_probe(sym: str, lab: str) -> list[str]:
    """Every thread: armed? The leader: paused, or done already (a resume launch)? Then the whole block
    leaves, decided once by the leader and handed to all threads by one reducing barrier."""
    return [
        "\t// concordia-ft safe point: block entry (pause / resume check)",
        "\tmov.u32 \t%cft_r16, 0;",  # the pause word as last read, for the barrier probes
        f"\tld.global.u64 \t%cft_rd0, [{sym}];",
        "\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;",  # armed? uniform: a module global the host sets between launches
        f"\t@!%cft_p1 bra \t{lab}_run;",
        *_leader(),
        "\tsetp.ne.u32 \t%cft_p2, %cft_r0, %cft_r0;",  # p2: leave (false)
        f"\t@!%cft_p0 bra \t{lab}_vote;",
        *_block_bit(),
        f"\tld.volatile.global.u32 \t%cft_r12, [%cft_rd0+{CTL_PAUSE}];",
        "\tld.volatile.global.u32 \t%cft_r14, [%cft_rd1];",
        "\tand.b32 \t%cft_r14, %cft_r14, %cft_r10;",
        "\tsetp.ne.u32 \t%cft_p2, %cft_r14, 0;",  # done already: this is a resume launch
        "\tsetp.ne.or.u32 \t%cft_p2, %cft_r12, 0, %cft_p2;",  # or paused
        f"{lab}_vote:",
        "\tbarrier.red.or.pred \t%cft_p2, 0, %cft_p2;",
        "\t@%cft_p2 ret;",
        f"{lab}_run:",
    ]


def _deferred_entry_probe(sym: str, lab: str) -> list[str]:
    """Entry with the vote deferred to the first barrier: the leader of an armed launch only issues its two
    reads here; nothing waits for them until ``_deferred_vote``. Non-leaders and disarmed launches carry
    zeros, so the vote's arithmetic needs no predicate."""
    return [
        "\t// concordia-ft safe point: block entry (reads issued here, voted at the first barrier)",
        "\tmov.u32 \t%cft_r16, 0;", "\tmov.u32 \t%cft_r12, 0;", "\tmov.u32 \t%cft_r14, 0;",
        "\tmov.u32 \t%cft_r10, 0;",
        f"\tld.global.u64 \t%cft_rd0, [{sym}];",
        "\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;",
        f"\t@!%cft_p1 bra \t{lab}_run;",
        *_leader(),
        f"\t@!%cft_p0 bra \t{lab}_run;",
        *_block_bit(),
        f"\tld.volatile.global.u32 \t%cft_r12, [%cft_rd0+{CTL_PAUSE}];",
        "\tld.volatile.global.u32 \t%cft_r14, [%cft_rd1];",
        f"{lab}_run:",
    ]


def _late_entry_probe(sym: str) -> list[str]:
    """Entry of ``late_reads``: the control pointer's load issued, nothing waits for it here."""
    return ["\t// concordia-ft safe point: block entry (the control pointer's load issued, used at the vote)",
            "\tmov.u32 \t%cft_r16, 0;", f"\tld.global.u64 \t%cft_rd0, [{sym}];"]


def _late_reads(lab: str) -> list[str]:
    """The leader's two reads, at the vote site (``late_reads``; armed launches only)."""
    return ["\tmov.u32 \t%cft_r12, 0;", "\tmov.u32 \t%cft_r14, 0;", "\tmov.u32 \t%cft_r10, 0;", *_leader(),
            f"\t@!%cft_p0 bra \t{lab}_lread;", *_block_bit(),
            f"\tld.volatile.global.u32 \t%cft_r12, [%cft_rd0+{CTL_PAUSE}];",
            "\tld.volatile.global.u32 \t%cft_r14, [%cft_rd1];", f"{lab}_lread:"]


def _late_vote(lab: str, st: Statement | None, original: str) -> list[str]:
    """The vote of ``late_reads``: a disarmed launch branches past it (block-uniform: every thread read the
    same pointer), keeping the kernel's own barrier (``original``) where the vote sits at one."""
    if st is None:
        return ["\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;", f"\t@!%cft_p1 bra \t{lab}_novote;", *_late_reads(lab),
                *_deferred_vote(None), f"{lab}_novote:"]
    return ["\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;", f"\t@%cft_p1 bra \t{lab}_avote;", original,
            f"\tbra.uni \t{lab}_vdone;", f"{lab}_avote:", *_late_reads(lab), *_deferred_vote(st), f"{lab}_vdone:"]


def _lazy_entry_probe(sym: str, lab: str) -> list[str]:
    """``_deferred_entry_probe`` where only the leader waits for the control pointer: every thread issues its
    load (used again at the vote), the others branch past at once."""
    return [
        "\t// concordia-ft safe point: block entry (the leader's reads issued here, voted later)",
        "\tmov.u32 \t%cft_r16, 0;", "\tmov.u32 \t%cft_r12, 0;", "\tmov.u32 \t%cft_r14, 0;",
        "\tmov.u32 \t%cft_r10, 0;",
        f"\tld.global.u64 \t%cft_rd0, [{sym}];",
        *_leader(),
        f"\t@!%cft_p0 bra \t{lab}_run;",
        "\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;",
        f"\t@!%cft_p1 bra \t{lab}_run;",
        *_block_bit(),
        f"\tld.volatile.global.u32 \t%cft_r12, [%cft_rd0+{CTL_PAUSE}];",
        "\tld.volatile.global.u32 \t%cft_r14, [%cft_rd1];",
        f"{lab}_run:",
    ]


def _lazy_inserted_vote(lab: str) -> list[str]:
    """The inserted vote of ``lazy_entry``: skipped as a whole by a disarmed launch (the pointer is the same
    for every thread of the launch, so the branch is block-uniform)."""
    return ["\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;", f"\t@!%cft_p1 bra \t{lab}_novote;",
            *_deferred_vote(None), f"{lab}_novote:"]


def _deferred_vote(st: Statement | None) -> list[str]:
    """The kernel's first barrier (``st``), as a reducing barrier carrying the leader's entry decision; or,
    with ``st`` None, a reducing barrier of its own, inserted before the kernel's first global write (not
    aligned: the leader's branch at entry reconverged before it, but ptxas need not know that)."""
    aligned = st is not None and (st.opcode.startswith("bar.") or st.opcode.endswith(".aligned"))
    red = "bar.red.or.pred" if aligned else "barrier.red.or.pred"
    where = "first barrier" if st is not None else "first global write"
    return [
        f"\t// concordia-ft: the entry decision, voted before the kernel's {where} (nothing global written yet)",
        "\tand.b32 \t%cft_r14, %cft_r14, %cft_r10;",
        "\tor.b32 \t%cft_r14, %cft_r14, %cft_r12;",  # done already (resume launch) or paused
        "\tsetp.ne.u32 \t%cft_p2, %cft_r14, 0;",
        f"\t{red} \t%cft_p2, 0, %cft_p2;",
        "\t@%cft_p2 ret;",
        "\tmov.u32 \t%cft_r16, %cft_r12;",  # the pause word as last read, for the barrier probes
    ]


@dataclass(frozen=True)
class _HeaderRead:
    """How a protocol-5 probe reaches its call's header. ``records`` None: ``%cft_rd0`` is the control pointer
    (``region | A``) and the header is found by masking it; ``(symbol, state space)`` (header_arg): ``%cft_rd0``
    is the header's address itself (the kernel parameter), and the rare path loads the records' pointer from that
    global. ``op``: the load instruction of the header read."""

    records: tuple[str, str] | None = None
    op: str = "ld.volatile.global.v2.u32"


_HDR = _HeaderRead()


def _arena_header(dst: str, ctl: str) -> list[str]:
    """``dst`` := the header of the arena a control pointer ``ctl`` (``region | A``) points into: ctl & ~(2**A - 1)."""
    return ["\tcvt.u32.u64 \t%cft_r3, " + ctl + ";", "\tand.b32 \t%cft_r3, %cft_r3, 63;",  # A: arena alignment
            "\tmov.u64 \t" + dst + ", -1;", "\tshl.b64 \t" + dst + ", " + dst + ", %cft_r3;",
            "\tand.b64 \t" + dst + ", " + dst + ", " + ctl + ";"]


def _v5_header_load(guard: str = "", hdr: _HeaderRead = _HDR) -> list[str]:
    """The leader's one read of the normal path: the call's header (pause, mode) as one 64-bit load (``guard``:
    a predicate the load itself is issued under, e.g. ``@%cft_p3 ``)."""
    if hdr.records is not None:
        return [f"\t{guard}{hdr.op} \t{{%cft_r12, %cft_r13}}, [%cft_rd0+{HDR_PAUSE}];"]
    return [*_arena_header("%cft_rd2", "%cft_rd0"),
            f"\t{guard}{hdr.op} \t{{%cft_r12, %cft_r13}}, [%cft_rd2+{HDR_PAUSE}];"]  # pause, mode


def _v5_early_header(lab: str, hdr: _HeaderRead = _HDR) -> list[str]:
    """``early_header``: the leader of an armed launch issues the header load here (after the kernel's last
    global load before the vote); everyone else, and a disarmed launch, carries zeros to the vote."""
    return ["\t// concordia-ft (protocol 5): the leader's header read, issued early", *_leader(),
            f"\t@!%cft_p0 bra \t{lab}_early;", "\tsetp.eq.u64 \t%cft_p3, %cft_rd0, 0;",
            f"\t@%cft_p3 bra \t{lab}_early;", *_v5_header_load(hdr=hdr), f"{lab}_early:"]


def _v5_leader(lab: str, early: bool = False, cold: list[str] | None = None,
               hdr: _HeaderRead = _HDR) -> list[str]:
    """Protocol 5, the leader's decision (``v5_decide``) into ``%cft_r14`` (1: leave), everyone else 0.

    Normal path: one 64-bit load of the header word pair (pause, mode); both zero -> run, nothing else read
    or written. Otherwise (a pause or a resume: rare) the leader reads and rewrites its block's record. With
    ``early`` the header was loaded before (``_v5_early_header``). With ``cold`` (a list), the rare path is
    appended to it instead (``cold_path``: placed after the kernel's last instruction by the caller) and
    reached by a branch that returns to ``{lab}_lread``. ``hdr``: how the header is reached (``_HeaderRead``)."""
    head = [
        "\tmov.u32 \t%cft_r14, 0;", *_leader(),
        f"\t@!%cft_p0 bra \t{lab}_lread;",
        *([] if early else _v5_header_load(hdr=hdr)),
        "\tor.b32 \t%cft_r11, %cft_r12, %cft_r13;",
        "\tsetp.eq.u32 \t%cft_p3, %cft_r11, 0;",
    ]
    rare = _v5_rare(lab, hdr.records)
    if cold is None:
        return [*head, f"\t@%cft_p3 bra \t{lab}_lread;", *rare, f"{lab}_lread:"]  # run mode, not paused: run
    cold.extend([f"{lab}_rare:", *rare, f"\tbra.uni \t{lab}_lread;"])
    return [*head, f"\t@!%cft_p3 bra \t{lab}_rare;", f"{lab}_lread:"]


def _v5_rare(lab: str, records: tuple[str, str] | None = None) -> list[str]:
    """The leader's rare path (paused, or resuming): its block's record read and rewritten, ``%cft_r14`` set;
    its end falls through (inline) or the caller branches back (``cold_path``) to where the normal path rejoins;
    the pause case branches to ``{lab}_lread`` itself. ``records`` (header_arg): the records' pointer is loaded
    from that ``(symbol, space)`` global first, and unless it names the header in ``%cft_rd0`` (its arena's
    start) the block runs (``%cft_r14`` stays 0): the kernel is not part of the call whose header it read."""
    find = ["\tand.b64 \t%cft_rd1, %cft_rd0, -64;"]  # this kernel's records
    if records is not None:
        sym, space = records
        find = [
            f"\tld{space}.u64 \t%cft_rd1, [{sym}];",
            *_arena_header("%cft_rd2", "%cft_rd1"),  # its arena's header
            "\tsetp.ne.u64 \t%cft_p4, %cft_rd2, %cft_rd0;",
            f"\t@%cft_p4 bra \t{lab}_lread;",  # not this call's kernel (or disarmed: 0): run
            "\tand.b64 \t%cft_rd1, %cft_rd1, -64;",
        ]
    return [
        *find,
        "\tmov.u32 \t%cft_r3, %ctaid.x;", "\tmov.u32 \t%cft_r4, %ctaid.y;", "\tmov.u32 \t%cft_r5, %ctaid.z;",
        "\tmov.u32 \t%cft_r6, %nctaid.x;", "\tmov.u32 \t%cft_r7, %nctaid.y;",
        "\tmad.lo.u32 \t%cft_r8, %cft_r5, %cft_r7, %cft_r4;",
        "\tmad.lo.u32 \t%cft_r8, %cft_r8, %cft_r6, %cft_r3;",  # r8: block index
        f"\tmul.wide.u32 \t%cft_rd2, %cft_r8, {REC_BYTES};", "\tadd.s64 \t%cft_rd1, %cft_rd1, %cft_rd2;",
        "\tld.volatile.global.v2.u32 \t{%cft_r9, %cft_r10}, [%cft_rd1];",  # s, rem
        "\tmov.u32 \t%cft_r14, 1;",
        "\tsetp.ne.u32 \t%cft_p3, %cft_r13, 0;",
        f"\t@%cft_p3 bra \t{lab}_resume;",
        "\tadd.u32 \t%cft_r9, %cft_r9, 1;",  # run mode, paused: one more launch of this kernel skipped
        "\tst.volatile.global.u32 \t[%cft_rd1], %cft_r9;",
        f"\tbra.uni \t{lab}_lread;",
        f"{lab}_resume:",  # r = rem: this launch's place from the end of the block's launches of the kernel
        "\tadd.u32 \t%cft_r11, %cft_r10, -1;",
        "\tsetp.le.u32 \t%cft_p4, %cft_r10, %cft_r9;",  # it skipped this launch
        "\tsetp.eq.and.u32 \t%cft_p4, %cft_r12, 0, %cft_p4;",  # and no pause now: it runs
        "\tselp.b32 \t%cft_r9, %cft_r11, %cft_r9, %cft_p4;",
        "\tselp.b32 \t%cft_r14, 0, 1, %cft_p4;",
        "\tst.volatile.global.v2.u32 \t[%cft_rd1], {%cft_r9, %cft_r11};",
    ]


def _v5_decision_vote(st: Statement | None) -> list[str]:
    aligned = st is not None and (st.opcode.startswith("bar.") or st.opcode.endswith(".aligned"))
    red = "bar.red.or.pred" if aligned else "barrier.red.or.pred"
    return ["\tsetp.ne.u32 \t%cft_p2, %cft_r14, 0;", f"\t{red} \t%cft_p2, 0, %cft_p2;", "\t@%cft_p2 ret;"]


def _v5_entry_probe(sym: str, early: bool = False, space: str = ".global", param: str = "") -> list[str]:
    """``param`` (header_arg): the header's address is read from that kernel parameter instead."""
    load = f"\tld.param.u64 \t%cft_rd0, [{param}];" if param else f"\tld{space}.u64 \t%cft_rd0, [{sym}];"
    return ["\t// concordia-ft safe point (protocol 5): the control pointer's load issued, used at the vote",
            *(["\tmov.u32 \t%cft_r12, 0;", "\tmov.u32 \t%cft_r13, 0;"] if early else []), load]


def _v5_vote(lab: str, st: Statement | None, original: str, early: bool = False,
             cold: list[str] | None = None, hdr: _HeaderRead = _HDR) -> list[str]:
    """Protocol 5's vote at its site: a disarmed launch branches past (block-uniform: every thread read the
    same pointer), keeping the kernel's own barrier (``original``) where the vote sits at one."""
    head = "\t// concordia-ft: the entry decision (protocol 5), nothing global written yet"
    if st is None:
        return [head, "\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;", f"\t@!%cft_p1 bra \t{lab}_novote;",
                *_v5_leader(lab, early, cold, hdr), *_v5_decision_vote(None), f"{lab}_novote:"]
    return [head, "\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;", f"\t@%cft_p1 bra \t{lab}_avote;", original,
            f"\tbra.uni \t{lab}_vdone;", f"{lab}_avote:", *_v5_leader(lab, early, cold, hdr), *_v5_decision_vote(st),
            f"{lab}_vdone:"]


def _v5_entry_vote(sym: str, lab: str, space: str = ".global", cold: list[str] | None = None,
                   param: str = "", hdr: _HeaderRead = _HDR) -> list[str]:
    """Protocol 5 where no later vote site exists: load, decide and vote at entry."""
    return [*_v5_entry_probe(sym, space=space, param=param), *_v5_vote(lab, None, "", cold=cold, hdr=hdr)]


WARP_SMEM_PREFIX = "cft_warps_"  # per-warp vote: one u32 per warp ("ran"), then the leader's decision


def _v5_warp_header(hdr: _HeaderRead = _HDR) -> list[str]:
    """Per-warp vote: every thread of an armed launch reads the header (one request per warp: the same address),
    issued after the kernel's last load before the site; a disarmed launch keeps the zeros set at entry."""
    return ["\t// concordia-ft (protocol 5): every thread's header read, for the per-warp vote",
            "\tsetp.ne.u64 \t%cft_p3, %cft_rd0, 0;", *_v5_header_load("@%cft_p3 ", hdr)]


def _v5_warp_vote(lab: str, smem: str, nthreads: int) -> list[str]:
    """Protocol 5's decision per warp, at the inserted site (``SafepointOptions.warp_vote``). The block's outcome
    is still one: a warp that saw neither a pause nor a resume (the normal path) marks its slot 1, arrives at
    barrier 1 without waiting and runs; a warp that saw one marks 0 and waits at barrier 1 until every warp has
    marked. Then, if any slot is 1, it runs too (the block passed the vote: unrecorded); if none is, every warp
    is waiting here, the leader decides for the block (``_v5_rare``: its record read and rewritten) and a second
    barrier hands its decision to all."""
    nwarps = nthreads // 32
    return [
        "\t// concordia-ft: the entry decision (protocol 5), per warp: in the normal path no warp waits for another",
        "\tsetp.ne.u64 \t%cft_p1, %cft_rd0, 0;", f"\t@!%cft_p1 bra \t{lab}_novote;",
        "\tor.b32 \t%cft_r11, %cft_r12, %cft_r13;",
        "\tsetp.ne.u32 \t%cft_p2, %cft_r11, 0;",
        "\tvote.sync.any.pred \t%cft_p2, %cft_p2, -1;",  # the warp's view: a pause or resume seen by any lane
        "\tmov.u32 \t%cft_r0, %tid.x;", "\tshr.u32 \t%cft_r1, %cft_r0, 5;", "\tand.b32 \t%cft_r2, %cft_r0, 31;",
        f"\tmov.u32 \t%cft_r3, {smem};",
        "\tshl.b32 \t%cft_r4, %cft_r1, 2;", "\tadd.u32 \t%cft_r4, %cft_r4, %cft_r3;",
        "\tselp.u32 \t%cft_r5, 0, 1, %cft_p2;",
        "\tsetp.eq.u32 \t%cft_p0, %cft_r2, 0;",
        "\t@%cft_p0 st.shared.u32 \t[%cft_r4], %cft_r5;",
        f"\t@%cft_p2 bra \t{lab}_wrare;",
        f"\tbarrier.arrive \t1, {nthreads};",
        f"\tbra.uni \t{lab}_novote;",
        f"{lab}_wrare:",
        f"\tbarrier.sync \t1, {nthreads};",
        f"\tsetp.lt.u32 \t%cft_p1, %cft_r2, {nwarps};",
        "\tmov.u32 \t%cft_r5, 0;",
        "\tshl.b32 \t%cft_r4, %cft_r2, 2;", "\tadd.u32 \t%cft_r4, %cft_r4, %cft_r3;",
        "\t@%cft_p1 ld.shared.u32 \t%cft_r5, [%cft_r4];",
        "\tsetp.ne.u32 \t%cft_p1, %cft_r5, 0;",
        "\tvote.sync.any.pred \t%cft_p1, %cft_p1, -1;",
        f"\t@%cft_p1 bra \t{lab}_novote;",  # another warp passed the vote: the block runs whole, unrecorded
        "\tmov.u32 \t%cft_r15, %cft_r3;",  # the slots' address, kept across the leader's rare path
        "\tmov.u32 \t%cft_r14, 0;", *_leader(),
        f"\t@!%cft_p0 bra \t{lab}_lread;",
        *_v5_rare(lab),
        f"{lab}_lread:",
        "\t@%cft_p0 st.shared.u32 \t[%cft_r15+128], %cft_r14;",
        f"\tbarrier.sync \t1, {nthreads};",
        "\tld.shared.u32 \t%cft_r14, [%cft_r15+128];",
        "\tsetp.ne.u32 \t%cft_p2, %cft_r14, 0;",
        "\t@%cft_p2 ret;",
        f"{lab}_novote:",
    ]


def _leader() -> list[str]:
    """``%cft_p0`` := this thread leads its block (thread 0,0,0); ``%cft_r0`` := tid.x | tid.y | tid.z."""
    return [
        "\tmov.u32 \t%cft_r0, %tid.x;", "\tmov.u32 \t%cft_r1, %tid.y;", "\tmov.u32 \t%cft_r2, %tid.z;",
        "\tor.b32 \t%cft_r0, %cft_r0, %cft_r1;", "\tor.b32 \t%cft_r0, %cft_r0, %cft_r2;",
        "\tsetp.eq.u32 \t%cft_p0, %cft_r0, 0;",
    ]


def _leader_and_ctl(sym: str, pred: str) -> list[str]:
    """``pred`` := this thread leads its block and the kernel is armed; ``%cft_rd0`` := the control block.
    Recomputed at each probe so that nothing of the probes but one word stays live across the kernel."""
    return [
        *_leader(),
        f"\tld.global.u64 \t%cft_rd0, [{sym}];",
        f"\tsetp.ne.and.u64 \t{pred}, %cft_rd0, 0, %cft_p0;",
    ]


def _exit_probe(guard: str, sym: str) -> list[str]:
    """The leader marks its block done: the bit a resume launch skips on."""
    out = ["\t// concordia-ft: block exit (the block ran to completion)", *_leader_and_ctl(sym, "%cft_p6")]
    if guard.startswith("!"):
        out += [f"\tnot.pred \t%cft_p7, {guard[1:]};", "\tand.pred \t%cft_p6, %cft_p6, %cft_p7;"]
    elif guard:
        out += [f"\tand.pred \t%cft_p6, %cft_p6, {guard};"]
    out += ["\t@!%cft_p6 bra \t$__cft_x{n};", *_block_bit(), "\tred.global.or.b32 \t[%cft_rd1], %cft_r10;",
            "$__cft_x{n}:"]
    return out


def _barrier_probe(st: Statement, lab: str, sym: str) -> list[str]:
    """The barrier becomes a reducing barrier carrying the pause word the leader read at the previous safe
    point; the next read is issued right after it, so its latency hides behind the kernel's own code."""
    aligned = st.opcode.startswith("bar.") or st.opcode.endswith(".aligned")
    red = "bar.red.or.pred" if aligned else "barrier.red.or.pred"
    g = f"@{st.guard} " if st.guard else ""
    out = [
        "\t// concordia-ft safe point: barrier (no global effect yet: the block may leave and rerun)",
        *_leader_and_ctl(sym, "%cft_p8"),
        "\tsetp.ne.u32 \t%cft_p9, %cft_r0, %cft_r0;",
        "\t@%cft_p8 setp.ne.u32 \t%cft_p9, %cft_r16, 0;",
        f"\t{g}{red} \t%cft_p9, 0, %cft_p9;",
    ]
    if st.guard:  # a skipped barrier must not let the leader leave alone
        out.append(f"\t@{_negate(st.guard)} setp.ne.u32 \t%cft_p9, %cft_r0, %cft_r0;")
    out += [f"\t@%cft_p9 bra \t{lab}_bpause;",
            f"\t@%cft_p8 ld.volatile.global.u32 \t%cft_r16, [%cft_rd0+{CTL_PAUSE}];"]
    return out


def _pause_tail(lab: str) -> list[str]:
    return [f"{lab}_bpause:", "\tret;\t// concordia-ft: left at a barrier, not done: it reruns on resume"]


def _block_bit() -> list[str]:
    """``%cft_rd1`` := this block's bitmap word, ``%cft_r10`` := its bit (needs ``%cft_rd0``)."""
    return [
        "\tmov.u32 \t%cft_r3, %ctaid.x;", "\tmov.u32 \t%cft_r4, %ctaid.y;", "\tmov.u32 \t%cft_r5, %ctaid.z;",
        "\tmov.u32 \t%cft_r6, %nctaid.x;", "\tmov.u32 \t%cft_r7, %nctaid.y;",
        "\tmad.lo.u32 \t%cft_r8, %cft_r5, %cft_r7, %cft_r4;",
        "\tmad.lo.u32 \t%cft_r8, %cft_r8, %cft_r6, %cft_r3;",  # r8: block index
        "\tshr.u32 \t%cft_r9, %cft_r8, 5;", "\tand.b32 \t%cft_r11, %cft_r8, 31;",
        "\tmov.u32 \t%cft_r10, 1;", "\tshl.b32 \t%cft_r10, %cft_r10, %cft_r11;",
        "\tmul.wide.u32 \t%cft_rd1, %cft_r9, 4;", "\tadd.s64 \t%cft_rd1, %cft_rd1, %cft_rd0;",
        f"\tadd.s64 \t%cft_rd1, %cft_rd1, {CTL_BITMAP};",
    ]


_DECLS = ["\t.reg .pred \t%cft_p<10>;", "\t.reg .b32 \t%cft_r<17>;", "\t.reg .b64 \t%cft_rd<2>;"]
_DECLS5 = ["\t.reg .pred \t%cft_p<5>;", "\t.reg .b32 \t%cft_r<15>;", "\t.reg .b64 \t%cft_rd<3>;"]
_DECLS5W = ["\t.reg .pred \t%cft_p<5>;", "\t.reg .b32 \t%cft_r<16>;", "\t.reg .b64 \t%cft_rd<3>;"]


def _check_fresh(ptx: str) -> None:
    for marker in ("%cft_", SYMBOL_PREFIX, "$__cft"):
        if marker in ptx:
            raise PtxParseError("<module>", 1, f"already instrumented (found {marker!r}); rewrite the original PTX")


def _last_global_load(k: Kernel, p: _Plan) -> int:
    """The line of the kernel's last global load between entry and the vote site (straight-line code), or -1."""
    loads = [st.index for st in k.statements if p.entry_line <= st.index < p.vote_line
             and st.op_parts[0] == "ld" and _space_of(st) in (".global", "")]
    return max(loads) if loads else -1


def rewrite_ptx(ptx: str, options: SafepointOptions | dict[str, object] | None = None, *,
                launch_refusals: dict[str, tuple[str, str]] | None = None) -> RewriteResult:
    """Add safe points to every kernel of ``ptx`` that can take them; refused kernels stay unchanged.

    ``launch_refusals`` names kernels refused for reasons the PTX does not show (a cooperative launch, from the
    compiler's metadata), as ``{kernel: (reason, detail)}``."""
    opts = options if isinstance(options, SafepointOptions) else SafepointOptions(**(options or {}))  # type: ignore[arg-type]
    _check_fresh(ptx)
    module = parse_module(ptx)
    lr = launch_refusals or {}
    plans = [_plan(module, k, opts, lr.get(k.name)) for k in module.kernels]
    for p in plans:
        if p.report.refused is not None and opts.strict:
            raise UnsafeKernelError(p.report.name, p.report.refused, p.report.detail)
    before: dict[int, list[str]] = {}  # module line index -> lines to insert before it
    replace: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    for ki, (k, p) in enumerate(zip(module.kernels, plans, strict=True)):
        if p.report.refused is not None:
            continue
        lab = f"$__cft{ki}"
        sym = SYMBOL_PREFIX + k.name
        hp = p.header_param  # header_arg: the parameter carrying the header's address
        # Protocol 4 writes the pointer from the stream (global memory only). With header_arg the pointer is read
        # on the rare path alone, and a module with a .const variable pays at every launch of its kernels even
        # where no instruction reads it (+0.10 us per launch on the H200, DESIGN.md §6):
        # only const_ctl's entry read is worth that.
        space = ".const" if opts.const_ctl and opts.protocol == 5 and not hp else ".global"
        before.setdefault(k.header_start, []).extend(
            [f"// concordia-ft control block pointer of {k.name} (0: disarmed)",
             f".visible {space} .align 8 .u64 {sym};", ""])
        hdr = _HeaderRead((sym, space) if hp else None,
                          "ld.relaxed.gpu.global.v2.u32" if opts.header_gpu_scope else _HDR.op)
        after.setdefault(k.body_open, []).extend(
            (_DECLS5W if p.warp_threads else _DECLS5) if opts.protocol == 5 else _DECLS)
        by_index = {st.index: st for st in k.statements}
        if opts.protocol == 5:
            before[k.header_start].extend([f".visible .global .align 4 .u32 {PROTO_PREFIX}{k.name} = 5;", ""])
            if hp:
                before[k.header_start].extend([f"// concordia-ft: the header's address comes in {hp}",
                                               f".visible .global .align 4 .u32 {HARG_PREFIX}{k.name} = 1;", ""])
            early = (opts.early_header or opts.entry_header) and p.vote_line >= 0
            cold: list[str] | None = [] if opts.cold_path else None  # the rare path, after the last instruction
            if p.warp_threads:  # per-warp vote: every thread's header read after the kernel's last load
                smem = WARP_SMEM_PREFIX + k.name
                before[k.header_start].extend([f".shared .align 4 .b32 {smem}[33];", ""])
                before.setdefault(p.entry_line, []).extend(_v5_entry_probe(sym, True, space))
                at = _last_global_load(k, p)
                (after.setdefault(at, []) if at >= 0 else before[p.entry_line]).extend(_v5_warp_header(hdr))
                before.setdefault(p.vote_line, []).extend(_v5_warp_vote(lab, smem, p.warp_threads))
                continue
            if p.vote_line < 0:
                before.setdefault(p.entry_line, []).extend(_v5_entry_vote(sym, lab, space, cold, hp, hdr))
            elif p.vote_inserted:
                before.setdefault(p.entry_line, []).extend(_v5_entry_probe(sym, early, space, hp))
                before.setdefault(p.vote_line, []).extend(_v5_vote(lab, None, "", early, cold, hdr))
            else:
                before.setdefault(p.entry_line, []).extend(_v5_entry_probe(sym, early, space, hp))
                replace[p.vote_line] = _v5_vote(lab, by_index[p.vote_line], module.lines[p.vote_line].rstrip("\n"),
                                                early, cold, hdr)
            if cold:
                before.setdefault(k.body_close, []).extend(
                    ["\t// concordia-ft (protocol 5): the leader's rare path (pause, resume), out of line", *cold])
            if early and opts.entry_header:  # at entry, right after the pointer's load
                before[p.entry_line].extend(_v5_early_header(lab, hdr))
            elif early:  # after the kernel's last global load before the vote (straight-line code: no join)
                at = _last_global_load(k, p)
                if at >= 0:
                    after.setdefault(at, []).extend(_v5_early_header(lab, hdr))
                else:
                    before[p.entry_line].extend(_v5_early_header(lab, hdr))
            continue  # no exit probes, no barrier probes: a block that passed the vote runs unrecorded
        if p.vote_line >= 0 and opts.late_reads:
            before.setdefault(p.entry_line, []).extend(_late_entry_probe(sym))
            if p.vote_inserted:
                before.setdefault(p.vote_line, []).extend(_late_vote(lab, None, ""))
            else:
                replace[p.vote_line] = _late_vote(lab, by_index[p.vote_line],
                                                  module.lines[p.vote_line].rstrip("\n"))
        elif p.vote_line >= 0:
            entry = _lazy_entry_probe(sym, lab) if opts.lazy_entry else _deferred_entry_probe(sym, lab)
            before.setdefault(p.entry_line, []).extend(entry)
            if p.vote_inserted:
                before.setdefault(p.vote_line, []).extend(_lazy_inserted_vote(lab) if opts.lazy_entry
                                                          else _deferred_vote(None))
            else:
                replace[p.vote_line] = _deferred_vote(by_index[p.vote_line])
        else:
            before.setdefault(p.entry_line, []).extend(_entry_probe(sym, lab))
        for n, ln in enumerate(p.exit_lines):
            lines = _exit_probe(by_index[ln].guard, sym)
            before.setdefault(ln, []).extend(x.replace("{n}", f"{ki}_{n}") for x in lines)
        for ln in p.barrier_lines:
            replace[ln] = _barrier_probe(by_index[ln], lab, sym)
        if p.barrier_lines:
            before.setdefault(k.body_close, []).extend(_pause_tail(lab))
    out: list[str] = []
    for i, line in enumerate(module.lines):
        out.extend(s + "\n" for s in before.get(i, []))
        if i in replace:
            out.extend(s + "\n" for s in replace[i])
        else:
            out.append(line)
        out.extend(s + "\n" for s in after.get(i, []))
    return RewriteResult("".join(out), tuple(p.report for p in plans))
