"""A PTX parser for what NVRTC emits: module-level variables, ``.entry`` functions with their
parameters, register declarations, scoped blocks (inline asm ``{ ... }``), labels and
instructions, each with its PTX line number."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import PtxUnsupportedError


@dataclass
class Stmt:
    kind: str        # "inst", "label", "open", "close", "decl"
    text: str
    line: int
    scope: int = 0   # id of the innermost enclosing scope (0: the function body)


@dataclass
class Inst:
    guard: str | None          # "%p1", "!%p1" or None
    opcode: str                # full dotted opcode, e.g. "ld.global.v2.f32"
    parts: list[str]           # opcode split on "."
    operands: list[str]
    line: int
    text: str
    scope: int = 0


@dataclass
class Param:
    name: str
    ptype: str                 # ".u64", ".b8" ...
    size: int                  # bytes
    align: int


@dataclass
class Entry:
    name: str
    params: list[Param]
    body: list[Stmt]
    line: int
    maxntid: tuple[int, ...] | None = None


@dataclass
class GlobalVar:
    space: str                 # "global", "const", "shared"
    name: str
    vtype: str
    align: int
    count: int | None          # array length (None: scalar; 0: extern / unsized)
    init: list[str] = field(default_factory=list)
    extern: bool = False
    line: int = 0


@dataclass
class Module:
    version: str
    target: str
    address_size: int
    globals: list[GlobalVar]
    entries: list[Entry]
    text: str


_TYPE_SIZE = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
              "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4,
              "b64": 8, "u64": 8, "s64": 8, "f64": 8, "pred": 1, "b128": 16}


def type_size(t: str) -> int:
    return _TYPE_SIZE[t.lstrip(".")]


def strip_comments(text: str) -> str:
    """Removes // and /* */ comments, keeping every newline (line numbers stay)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = text.index('"', i + 1)
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.index("*/", i + 2)
            out.append("\n" * text.count("\n", i, j))
            i = j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


_LABEL = re.compile(r"^[A-Za-z_$%][\w$]*$")


def split_body(text: str, first_line: int) -> list[Stmt]:
    """Statements of a function body (between its outer braces), with scopes."""
    stmts: list[Stmt] = []
    buf: list[str] = []
    line = first_line
    start_line = line
    vec_depth = 0
    scope_stack = [0]
    next_scope = 1

    def flush(kind: str = "inst") -> None:
        nonlocal buf
        s = "".join(buf).strip()
        buf = []
        if s:
            stmts.append(Stmt("decl" if s.startswith(".") else kind, s, start_line, scope_stack[-1]))

    for c in text:
        if not "".join(buf).strip():
            start_line = line
        if c == "\n":
            line += 1
            buf.append(" ")
            continue
        if c == ";" and vec_depth == 0:
            flush()
        elif c == "{":
            if "".join(buf).strip():
                vec_depth += 1
                buf.append(c)
            else:
                stmts.append(Stmt("open", str(next_scope), line, scope_stack[-1]))
                scope_stack.append(next_scope)
                next_scope += 1
        elif c == "}":
            if vec_depth > 0:
                vec_depth -= 1
                buf.append(c)
            else:
                if "".join(buf).strip():
                    raise PtxUnsupportedError("", "missing ';' before '}'", line)
                scope_stack.pop()
                stmts.append(Stmt("close", "}", line, scope_stack[-1]))
        elif c == ":" and vec_depth == 0 and _LABEL.match("".join(buf).strip() or "-"):
            s = "".join(buf).strip()
            buf = []
            stmts.append(Stmt("label", s, start_line, scope_stack[-1]))
        else:
            buf.append(c)
    if "".join(buf).strip():
        raise PtxUnsupportedError("", f"unterminated statement {''.join(buf).strip()[:60]!r}", line)
    return stmts


def split_operands(s: str) -> list[str]:
    """Comma-separated operands at the top level (not inside [...] or {...})."""
    out, depth, cur = [], 0, []
    for c in s:
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


_GUARD = re.compile(r"^@(!?%?[\w$]+)\s+")


def parse_inst(st: Stmt) -> Inst:
    text = st.text
    guard = None
    m = _GUARD.match(text)
    if m:
        guard = m.group(1)
        text = text[m.end():]
    parts = text.split(None, 1)
    opcode = parts[0]
    ops = split_operands(parts[1]) if len(parts) > 1 else []
    return Inst(guard, opcode, opcode.split("."), ops, st.line, st.text, st.scope)


_ENTRY = re.compile(r"(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)\s*\(")
_FUNC = re.compile(r"(?:\.visible\s+|\.weak\s+|\.extern\s+)?\.func\b")
_VAR = re.compile(r"^(\.extern\s+|\.visible\s+|\.weak\s+)*\.(global|const|shared)\s+(.*)$", re.DOTALL)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _match_brace(text: str, i: int) -> int:
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise PtxUnsupportedError("", "unbalanced braces", _line_of(text, i))


def _parse_var(decl: str, line: int) -> GlobalVar:
    m = _VAR.match(decl.strip())
    assert m
    extern = "extern" in (m.group(1) or "") or decl.strip().startswith(".extern")
    space, rest = m.group(2), m.group(3)
    init: list[str] = []
    if "=" in rest:
        rest, val = rest.split("=", 1)
        val = val.strip()
        init = split_operands(val[1:-1]) if val.startswith("{") else [val]
    toks = rest.split()
    align = 1
    vtype = None
    name = None
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == ".align":
            align = int(toks[i + 1])
            i += 2
            continue
        if t.startswith(".") and t.lstrip(".") in _TYPE_SIZE:
            vtype = t
        elif not t.startswith("."):
            name = t
        i += 1
    if vtype is None or name is None:
        raise PtxUnsupportedError(".global", f"cannot parse the declaration {decl.strip()[:80]!r}", line)
    count: int | None = None
    am = re.match(r"([\w$]+)\[(\d*)\]$", name)
    if am:
        name = am.group(1)
        count = int(am.group(2)) if am.group(2) else 0
    return GlobalVar(space, name, vtype, align, count, init, extern, line)


def parse_params(text: str, line: int) -> list[Param]:
    params = []
    for p in split_operands(text):
        p = p.strip()
        if not p:
            continue
        toks = p.split()
        align, ptype, name = 0, None, None
        i = 0
        while i < len(toks):
            t = toks[i]
            if t == ".align":
                align = int(toks[i + 1])
                i += 2
                continue
            if t.startswith(".") and t.lstrip(".") in _TYPE_SIZE:
                ptype = t
            elif t in (".param", ".ptr", ".global", ".shared", ".const", ".local"):
                pass
            elif not t.startswith("."):
                name = t
            i += 1
        if ptype is None or name is None:
            raise PtxUnsupportedError(".param", f"cannot parse the parameter {p!r}", line)
        size = type_size(ptype)
        am = re.match(r"([\w$]+)\[(\d+)\]$", name)
        if am:
            name, size = am.group(1), size * int(am.group(2))
        params.append(Param(name, ptype, size, align or type_size(ptype)))
    return params


def parse_module(ptx: str) -> Module:
    text = strip_comments(ptx)
    version = target = ""
    address_size = 64
    globals_: list[GlobalVar] = []
    entries: list[Entry] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        m = _ENTRY.match(text, i)
        if m:
            name = m.group(1)
            close = text.index(")", m.end())
            params = parse_params(text[m.end():close], _line_of(text, i))
            ob = text.index("{", close)
            directives = text[close + 1:ob]
            maxntid = None
            dm = re.search(r"\.(?:maxntid|reqntid)\s+([\d,\s]+)", directives)
            if dm:
                maxntid = tuple(int(x) for x in dm.group(1).replace(" ", "").split(",") if x)
            cb = _match_brace(text, ob)
            body = split_body(text[ob + 1:cb], _line_of(text, ob + 1))
            # a function-scope static __shared__ variable (NVVM declares it in the body): a per-CTA
            # variable like a module-level one, laid out with them (names are function-mangled)
            for st in [st for st in body if st.kind == "decl" and re.match(r"\.shared\b", st.text)]:
                globals_.append(_parse_var(st.text, st.line))
                body.remove(st)
            entries.append(Entry(name, params, body, _line_of(text, i), maxntid))
            i = cb + 1
            continue
        if _FUNC.match(text, i):
            raise PtxUnsupportedError(".func", "device functions that are not inlined (.func / call) are not "
                                      "translated", _line_of(text, i))
        lm = re.match(r"\.(version|target|address_size)[ \t]+([^\n;]*)", text[i:])
        if lm:  # line-terminated directives (no semicolon)
            if lm.group(1) == "version":
                version = lm.group(2).strip()
            elif lm.group(1) == "target":
                target = lm.group(2).strip()
            else:
                address_size = int(lm.group(2).strip())
            i += lm.end()
            continue
        j = text.find(";", i)
        if j < 0:
            raise PtxUnsupportedError("", f"unterminated directive {text[i:i + 60]!r}", _line_of(text, i))
        decl = text[i:j].strip()
        line = _line_of(text, i)
        if _VAR.match(decl):
            globals_.append(_parse_var(decl, line))
        else:
            raise PtxUnsupportedError(decl.split()[0], f"unsupported module-level directive {decl[:80]!r}", line)
        i = j + 1
    return Module(version, target, address_size, globals_, entries, ptx)
