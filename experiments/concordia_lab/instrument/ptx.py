"""Reading PTX: split a module into its kernels and each kernel body into statements and basic blocks.

Pure text work (no torch, no cuda imports), aimed at what LLVM's NVPTX back end emits for Triton and
Inductor: one statement per line, labels on their own line, inline-asm scopes as ``{`` ... ``}`` lines. The
parser keeps every original line, so a rewrite that inserts nothing gives back the input byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import PtxParseError

_ENTRY_RE = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$][\w$]*)\s*\(")
_FUNC_RE = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)?\.func\b")
_LABEL_RE = re.compile(r"^\s*([A-Za-z_$%][\w$]*)\s*:\s*(//.*)?$")
_GUARD_RE = re.compile(r"^@(!?)(%[\w$]+)\s+")
REG_RE = re.compile(r"%[A-Za-z_$][\w$]*")


def strip_comment(line: str) -> str:
    """The statement part of a line (PTX comments are ``//`` to end of line; no strings in bodies)."""
    i = line.find("//")
    return (line if i < 0 else line[:i]).strip()


@dataclass(frozen=True)
class Statement:
    """One instruction of a kernel body: its line index in the body, guard, opcode and operands."""

    index: int
    text: str  # without comment, without trailing ';'
    guard: str = ""  # "%p3" or "!%p3" or ""
    opcode: str = ""  # "bar.sync", "st.global.b32", ...
    operands: str = ""

    @property
    def op_parts(self) -> list[str]:
        return self.opcode.split(".")

    def registers(self) -> list[str]:
        return REG_RE.findall(self.operands)


def parse_statement(index: int, code: str) -> Statement | None:
    """A Statement for one comment-free line, or None for labels, directives, braces and blank lines."""
    code = code.rstrip(";").strip()
    if not code or code in ("{", "}") or code.startswith(".") or code.endswith(":"):
        return None
    guard = ""
    m = _GUARD_RE.match(code)
    if m:
        guard = m.group(1) + m.group(2)
        code = code[m.end():]
    parts = code.split(None, 1)
    return Statement(index, code, guard, parts[0], parts[1] if len(parts) > 1 else "")


@dataclass
class Kernel:
    """One ``.entry``: its name and where its body lies in the module's lines (``{`` and ``}`` included)."""

    name: str
    header_start: int  # line index of the ``.entry`` line
    body_open: int  # line index of the ``{`` that opens the body
    body_close: int  # line index of the matching ``}``
    statements: list[Statement] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)  # label -> line index (module lines)


@dataclass
class PtxModule:
    lines: list[str]
    kernels: list[Kernel]
    func_ranges: list[tuple[int, int]]  # (start, end) line indexes of .func definitions

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def func_text(self) -> str:
        return "".join("".join(self.lines[a:b + 1]) for a, b in self.func_ranges)


def _match_body(lines: list[str], start: int, what: str) -> tuple[int, int]:
    """(open, close) line indexes of the brace-delimited body that follows line ``start``."""
    depth = 0
    opened = -1
    for i in range(start, len(lines)):
        code = strip_comment(lines[i])
        for ch in code:
            if ch == "{":
                depth += 1
                if opened < 0:
                    opened = i
            elif ch == "}":
                depth -= 1
                if depth < 0:
                    raise PtxParseError(what, i + 1, "unbalanced '}'")
                if depth == 0 and opened >= 0:
                    return opened, i
        if opened < 0 and code.endswith(";"):  # a declaration (.extern .func ...;) has no body
            return -1, i
    raise PtxParseError(what, start + 1, "body never closed")


def parse_module(text: str) -> PtxModule:
    """Split PTX text into kernels (with statements and labels) and .func ranges."""
    if ".version" not in text or ".target" not in text:
        raise PtxParseError("<module>", 1, "not PTX: no .version/.target directive")
    lines = text.splitlines(keepends=True)
    kernels: list[Kernel] = []
    funcs: list[tuple[int, int]] = []
    i = 0
    while i < len(lines):
        code = strip_comment(lines[i])
        m = _ENTRY_RE.match(code)
        if m:
            open_i, close_i = _match_body(lines, i, m.group(1))
            if open_i < 0:
                raise PtxParseError(m.group(1), i + 1, ".entry without a body")
            kernels.append(_parse_kernel(lines, m.group(1), i, open_i, close_i))
            i = close_i + 1
            continue
        if _FUNC_RE.match(code):
            open_i, close_i = _match_body(lines, i, "func")
            if open_i >= 0:
                funcs.append((i, close_i))
            i = close_i + 1
            continue
        i += 1
    if not kernels:
        raise PtxParseError("<module>", 1, "no .entry kernel in this PTX")
    return PtxModule(lines, kernels, funcs)


def _parse_kernel(lines: list[str], name: str, start: int, open_i: int, close_i: int) -> Kernel:
    k = Kernel(name, start, open_i, close_i)
    for i in range(open_i + 1, close_i):
        code = strip_comment(lines[i])
        lm = _LABEL_RE.match(code)
        if lm:
            k.labels[lm.group(1)] = i
            continue
        st = parse_statement(i, code)
        if st is not None:
            k.statements.append(st)
    return k


def header_text(module: PtxModule, kernel: Kernel) -> str:
    """The .entry line through the body's opening brace (params and performance directives)."""
    return "".join(module.lines[kernel.header_start:kernel.body_open + 1])


# ---- control flow ----------------------------------------------------------------------------------------

_TERMINATORS = ("ret", "exit", "trap")


@dataclass
class BasicBlock:
    first: int  # module line index of its first line
    statements: list[Statement]
    succs: list[int] = field(default_factory=list)  # indexes into the block list


def branch_target(st: Statement) -> str | None:
    if st.op_parts[0] == "bra":
        return st.operands.strip().rstrip(";").strip()
    return None


def build_cfg(kernel: Kernel) -> list[BasicBlock] | None:
    """Basic blocks of a kernel with successor edges; None when control flow is indirect (brx.idx, call
    targets in tables) and so cannot be followed."""
    starts = sorted(set(kernel.labels.values()))
    by_line: dict[int, list[Statement]] = {}
    cuts = [kernel.body_open + 1]
    for st in kernel.statements:
        if st.op_parts[0] == "brx":
            return None
    # a block begins at every label and after every branch or terminator
    for st in kernel.statements:
        if st.op_parts[0] in ("bra",) + _TERMINATORS:
            cuts.append(st.index + 1)
    cuts.extend(starts)
    cuts = sorted(set(c for c in cuts if c < kernel.body_close))
    blocks: list[BasicBlock] = []
    line_to_block: dict[int, int] = {}
    for bi, first in enumerate(cuts):
        last = cuts[bi + 1] if bi + 1 < len(cuts) else kernel.body_close
        line_to_block.update({ln: bi for ln in range(first, last)})
        blocks.append(BasicBlock(first, []))
    for st in kernel.statements:
        blocks[line_to_block[st.index]].statements.append(st)
        by_line.setdefault(st.index, []).append(st)
    label_block = {lab: line_to_block[ln] for lab, ln in kernel.labels.items() if ln in line_to_block}
    for bi, b in enumerate(blocks):
        last_st = b.statements[-1] if b.statements else None
        falls = True
        if last_st is not None:
            tgt = branch_target(last_st)
            if tgt is not None:
                if tgt not in label_block:
                    return None
                b.succs.append(label_block[tgt])
                falls = bool(last_st.guard)
            elif last_st.op_parts[0] in _TERMINATORS:
                falls = bool(last_st.guard)
        if falls and bi + 1 < len(blocks):
            b.succs.append(bi + 1)
    return blocks


def back_edges(blocks: list[BasicBlock]) -> list[tuple[int, int]]:
    """(from, to) edges that jump to a block at or before the source in text order: the loops of
    structured LLVM output."""
    return [(bi, s) for bi, b in enumerate(blocks) for s in b.succs if s <= bi]


def loop_blocks(blocks: list[BasicBlock]) -> set[int]:
    """Blocks inside some loop (between a back edge's target and its source in text order)."""
    inside: set[int] = set()
    for src, dst in back_edges(blocks):
        inside.update(range(dst, src + 1))
    return inside
