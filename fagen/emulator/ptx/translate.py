"""PTX -> C++ for the CPU emulator's PTX level.

Each ``.entry`` becomes one C++ function run by every fiber (CUDA thread) of the emulator's
runtime: every PTX register a local variable of its declared width, every label a C++ label,
every branch a ``goto``, every instruction one C++ statement -- plain C++ where C++ has the
PTX ISA's semantics (``add.f32`` = IEEE single addition, round to nearest even), a call into
``ptx_runtime.h`` where it does not (directed rounding, min/max NaN rules, shift clamping, cvt
rounding and saturation, bfe/bfi/prmt/lop3), and the runtime's warp / warpgroup collectives
(``runtime.h``, ``shim.h``, ``hopper.h``) for the collective instructions, with the PTX line as
the collective's call site. An instruction form not in :data:`FORMS` raises
:class:`PtxUnsupportedError` naming the opcode and the PTX line: nothing is skipped.

Address spaces: generic, global, local, const and param addresses are host pointers (the
emulator's global memory is the host's); a shared address is the byte offset into the block's
dynamic shared memory window (the convention of ``hopper.h``'s wgmma descriptors), and
``cvta.shared`` / ``cvta.to.shared`` convert between the two.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from . import counters as _counters
from .errors import PtxUnsupportedError
from .parser import Entry, Inst, Module, Stmt, parse_inst, parse_module, type_size

#: Bumped whenever the generated C++ for the same PTX changes (part of the build cache key).
TRANSLATOR_VERSION = "4"

# PTX register / instruction type -> C++ storage type of a register of that type.
_STORE = {"pred": "bool", "b8": "uint16_t", "u8": "uint16_t", "s8": "uint16_t",
          "b16": "uint16_t", "u16": "uint16_t", "s16": "uint16_t", "f16": "uint16_t", "bf16": "uint16_t",
          "b32": "uint32_t", "u32": "uint32_t", "s32": "uint32_t", "f32": "float", "f16x2": "uint32_t",
          "bf16x2": "uint32_t", "b64": "uint64_t", "u64": "uint64_t", "s64": "uint64_t", "f64": "double"}
# Instruction type -> C++ type the operation is computed in.
_CT = {"pred": "bool", "b8": "uint8_t", "u8": "uint8_t", "s8": "int8_t", "b16": "uint16_t", "u16": "uint16_t",
       "s16": "int16_t", "f16": "uint16_t", "bf16": "uint16_t", "b32": "uint32_t", "u32": "uint32_t",
       "s32": "int32_t", "f32": "float", "f16x2": "uint32_t", "bf16x2": "uint32_t", "b64": "uint64_t",
       "u64": "uint64_t", "s64": "int64_t", "f64": "double"}
_UNSIGNED = {"int8_t": "uint8_t", "int16_t": "uint16_t", "int32_t": "uint32_t", "int64_t": "uint64_t"}
_INT_TYPES = {"b16", "u16", "s16", "b32", "u32", "s32", "b64", "u64", "s64", "b8", "u8", "s8"}
_FLOAT_TYPES = {"f32", "f64"}
_ROUND = {"rn": "FE_TONEAREST", "rz": "FE_TOWARDZERO", "rm": "FE_DOWNWARD", "rp": "FE_UPWARD"}
_SPECIAL = {
    "%tid.x": "fagen_emu_state.cur->tid.x", "%tid.y": "fagen_emu_state.cur->tid.y",
    "%tid.z": "fagen_emu_state.cur->tid.z",
    "%ntid.x": "fagen_emu_state.block_dim.x", "%ntid.y": "fagen_emu_state.block_dim.y",
    "%ntid.z": "fagen_emu_state.block_dim.z",
    "%ctaid.x": "fagen_emu_state.block_idx.x", "%ctaid.y": "fagen_emu_state.block_idx.y",
    "%ctaid.z": "fagen_emu_state.block_idx.z",
    "%nctaid.x": "fagen_emu_state.grid_dim.x", "%nctaid.y": "fagen_emu_state.grid_dim.y",
    "%nctaid.z": "fagen_emu_state.grid_dim.z",
    "%laneid": "fagen_emu::px::laneid()", "%warpid": "fagen_emu::px::warpid()",
    "%nwarpid": "((fagen_emu_state.nthreads + 31u) / 32u)",
    "%warpsize": "32u", "WARP_SZ": "32u",
    "%lanemask_eq": "(1u << fagen_emu::px::laneid())",
    "%lanemask_lt": "((1u << fagen_emu::px::laneid()) - 1u)",
    "%lanemask_le": "((2u << fagen_emu::px::laneid()) - 1u)",
    "%lanemask_gt": "(~((2u << fagen_emu::px::laneid()) - 1u))",
    "%lanemask_ge": "(~((1u << fagen_emu::px::laneid()) - 1u))",
    "%smid": "0u", "%nsmid": "1u", "%clusterid.x": "0u", "%clusterid.y": "0u", "%clusterid.z": "0u",
    "%nclusterid.x": "1u", "%nclusterid.y": "1u", "%nclusterid.z": "1u",
    "%cluster_ctarank": "0u", "%cluster_nctarank": "1u",
    "%cluster_ctaid.x": "0u", "%cluster_ctaid.y": "0u", "%cluster_ctaid.z": "0u",
    "%cluster_nctaid.x": "1u", "%cluster_nctaid.y": "1u", "%cluster_nctaid.z": "1u",
    "%dynamic_smem_size": "uint32_t(fagen_emu_state.smem_bytes)",
}


# --------------------------------------------------------------------------- the forms table
@dataclass(frozen=True)
class Form:
    base: str          # base opcode ("add", "mma.sync", ...)
    modifiers: str     # the accepted modifiers and types, in the ISA's notation
    semantics: str     # how the emulator executes it


#: Every instruction form the translator accepts; docs/emulator.md's table is made from it
#: (:func:`forms_table`). A form outside it is a PtxUnsupportedError.
FORMS: list[Form] = []
_HANDLERS: dict[str, Callable[[_Fn, Inst], str]] = {}


def _handler(base: str, modifiers: str, semantics: str, *names: str):
    def deco(fn):
        FORMS.append(Form(base, modifiers, semantics))
        for n in names or (base,):
            _HANDLERS[n] = fn
        return fn
    return deco


def forms_table() -> str:
    """The supported-forms table of docs/emulator.md (markdown), generated from :data:`FORMS`."""
    lines = ["| opcode | accepted modifiers and types | emulation |", "|---|---|---|"]
    for f in FORMS:
        lines.append(f"| `{f.base}` | {f.modifiers} | {f.semantics} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- function state
@dataclass
class _Reg:
    cname: str
    ptype: str   # PTX type without the dot

    @property
    def ctype(self) -> str:
        return _STORE[self.ptype]


@dataclass
class _Tuple:
    tid: int
    regs: tuple[str, ...]   # C names
    kind: str               # "D" (accumulator) or "A" (A fragment)
    n: int = 0


class _Fn:
    """Translation state of one entry."""

    def __init__(self, mod: Module, entry: Entry, ptx_file: str, globals_: dict[str, str],
                 shared: dict[str, int]) -> None:
        self.mod, self.entry, self.ptx_file = mod, entry, ptx_file
        self.globals = globals_          # PTX name -> C++ expression of its address (uint64_t)
        self.shared = shared             # PTX name -> shared offset
        self.params = {p.name: i for i, p in enumerate(entry.params)}
        self.scope_parent: dict[int, int] = {0: -1}
        self.regs: dict[int, dict[str, _Reg]] = {}       # scope -> exact names
        self.ranges: dict[int, dict[str, tuple[int, str]]] = {}  # scope -> prefix -> (count, type)
        self.labels: dict[int, dict[str, str]] = {}
        self.decls: list[str] = []
        self.local_depot: list[str] = []
        self.tuples: dict[tuple[str, ...], _Tuple] = {}
        self.reg_tuples: dict[str, list[int]] = {}
        self.cur: Inst | None = None
        # the checks an entry needs (set by translate_entry from its instructions): cp.async
        # destinations (``cp``), generic-proxy writes read by the async proxy (``gw``), bulk stores
        # drained at exit (``bulk``); racecheck events of every memory instruction (``racecheck``)
        self.cp = self.gw = self.bulk = self.racecheck = False
        self.static_smem = 0  # static .shared bytes before the dynamic window

    # ---- errors
    def unsupported(self, reason: str, inst: Inst | None = None) -> PtxUnsupportedError:
        inst = inst or self.cur
        return PtxUnsupportedError(inst.opcode if inst else "", reason, inst.line if inst else 0,
                                   self.entry.name, inst.text if inst else "")

    # ---- names
    def _chain(self, scope: int):
        while scope != -1:
            yield scope
            scope = self.scope_parent.get(scope, -1)

    def reg(self, name: str, scope: int | None = None) -> _Reg | None:
        scope = self.cur.scope if scope is None else scope
        for s in self._chain(scope):
            r = self.regs.get(s, {}).get(name)
            if r is not None:
                return r
            m = re.match(r"^(.*?)(\d+)$", name)
            if m:
                rng = self.ranges.get(s, {}).get(m.group(1))
                if rng is not None and int(m.group(2)) < rng[0]:
                    return _Reg(_mangle(name, s), rng[1])
        return None

    def label(self, name: str) -> str:
        for s in self._chain(self.cur.scope):
            lab = self.labels.get(s, {}).get(name)
            if lab is not None:
                return lab
        raise self.unsupported(f"unknown label {name!r}")

    # ---- operands
    def src(self, op: str, t: str) -> str:
        """C++ expression of operand ``op`` read as PTX type ``t``."""
        ct = _CT[t]
        op = op.strip()
        neg = False
        if op.startswith("!"):
            neg, op = True, op[1:]
        r = self.reg(op)
        if r is not None:
            e = r.cname if r.ctype == ct else f"fagen_emu::px::bc<{ct}>({r.cname})"
            return f"(!{e})" if neg else e
        if neg:
            raise self.unsupported(f"negated operand {op!r} is not a predicate register")
        if op == "%dynamic_smem_size" and self.static_smem:
            return f"{ct}({_SPECIAL[op]} - {self.static_smem}u)"
        if op in _SPECIAL:
            return f"{ct}({_SPECIAL[op]})"
        m = re.fullmatch(r"0[fF]([0-9a-fA-F]{8})", op)
        if m:
            e = f"fagen_emu::px::f32(0x{m.group(1)}u)"
            return e if ct == "float" else f"fagen_emu::px::bc<{ct}>({e})"
        m = re.fullmatch(r"0[dD]([0-9a-fA-F]{16})", op)
        if m:
            e = f"fagen_emu::px::f64(0x{m.group(1)}ull)"
            return e if ct == "double" else f"fagen_emu::px::bc<{ct}>({e})"
        m = re.fullmatch(r"(-?)(0[xX][0-9a-fA-F]+|\d+)U?", op)
        if m:
            v = int(m.group(2), 0)
            if m.group(1):
                v = -v
            if ct in ("float", "double"):
                return f"{ct}({v})"
            if ct == "bool":
                return "true" if v else "false"
            return f"{ct}(0x{v & 0xffffffffffffffff:x}ull)"
        addr = self.symbol_address(op)
        if addr is not None:
            return f"{ct}({addr})"
        raise self.unsupported(f"operand {op!r} is not a register, immediate or known symbol")

    def symbol_address(self, name: str) -> str | None:
        if name in self.params:
            return f"uint64_t(reinterpret_cast<uintptr_t>(fagen_args[{self.params[name]}]))"
        if name in self.shared:
            return f"uint64_t({self.shared[name]}u)"
        if name in self.globals:
            return self.globals[name]
        if name in self.local_depot:
            return f"uint64_t(reinterpret_cast<uintptr_t>(ptx_local_{_ident(name)}))"
        return None

    def dst(self, op: str, t: str, expr: str) -> str:
        """Statement writing ``expr`` (of PTX type t's C++ type) into register ``op``."""
        op = op.strip()
        if op == "_":
            return f"(void)({expr});"
        r = self.reg(op)
        if r is None:
            raise self.unsupported(f"destination {op!r} is not a declared register")
        ct = _CT[t]
        if r.ctype == ct:
            return f"{r.cname} = {expr};"
        return f"{r.cname} = fagen_emu::px::bc<{r.ctype}>(static_cast<{ct}>({expr}));"

    def address(self, op: str) -> str:
        """uint64_t expression of an address operand ``[base+offset]``."""
        op = op.strip()
        if not (op.startswith("[") and op.endswith("]")):
            raise self.unsupported(f"expected an address operand, got {op!r}")
        inner = op[1:-1].strip()
        m = re.fullmatch(r"(.+?)\s*\+\s*(-?\s*(?:0[xX][0-9a-fA-F]+|\d+))", inner)
        base, off = (m.group(1).strip(), int(m.group(2).replace(" ", ""), 0)) if m else (inner, 0)
        r = self.reg(base)
        if r is not None:
            b = f"uint64_t({r.cname})"
        elif re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", base):
            b = f"uint64_t(0x{int(base, 0) & 0xffffffffffffffff:x}ull)"
        else:
            b = self.symbol_address(base)
            if b is None:
                raise self.unsupported(f"unknown address base {base!r}")
        return f"({b} + uint64_t({off}ll))" if off else b

    def host(self, op: str, space: str) -> str:
        a = self.address(op)
        if space == "shared":
            return f"fagen_emu::px::smem({a})"
        return f"fagen_emu::px::hp({a})"

    def vec(self, op: str) -> list[str]:
        op = op.strip()
        if not (op.startswith("{") and op.endswith("}")):
            raise self.unsupported(f"expected a vector operand {{...}}, got {op!r}")
        return [x.strip() for x in op[1:-1].split(",") if x.strip()]

    def site(self) -> str:
        return f"ptx_file, {self.cur.line}"


def _ident(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", lambda m: "_" if m.group(0) in "%." else f"_{ord(m.group(0)):x}_", name)


def _mangle(name: str, scope: int) -> str:
    return f"v{scope}_{_ident(name)}"


# --------------------------------------------------------------------------- helpers
def _check(fn: _Fn, inst: Inst, allowed: set[str], start: int = 1) -> list[str]:
    """The modifiers of ``inst`` after position ``start``; any outside ``allowed`` is unsupported."""
    mods = inst.parts[start:]
    for m in mods:
        if m not in allowed:
            raise fn.unsupported(f"modifier .{m} of {inst.parts[0]} is not supported")
    return mods


def _type_of(fn: _Fn, inst: Inst, mods: list[str]) -> str:
    types = [m for m in mods if m in _CT]
    if len(types) != 1:
        raise fn.unsupported("expected exactly one instruction type")
    return types[0]


def _nops(fn: _Fn, inst: Inst, n: int | tuple[int, ...]) -> None:
    ok = (n,) if isinstance(n, int) else n
    if len(inst.operands) not in ok:
        raise fn.unsupported(f"expected {' or '.join(map(str, ok))} operands, got {len(inst.operands)}")


def _u(ct: str) -> str:
    return _UNSIGNED.get(ct, ct)


_INT_ALL = {"s16", "u16", "s32", "u32", "s64", "u64"}
_FLT_MODS = {"rn", "rz", "rm", "rp", "ftz", "sat"}


def _float_expr(fn: _Fn, inst: Inst, mods: list[str], t: str, op: str, args: list[str]) -> str:
    """add/sub/mul/fma/div on f32 / f64 with rounding, .ftz and .sat."""
    ftz = "ftz" in mods and t == "f32"
    rnd = next((m for m in mods if m in _ROUND), "rn")
    a = [f"fagen_emu::px::ftz({x})" if ftz else x for x in args]
    if rnd == "rn":
        e = (f"fagen_emu::px::fma_rn({a[0]}, {a[1]}, {a[2]})" if op == "fma" else
             f"({a[0]} {dict(add='+', sub='-', mul='*', div='/')[op]} {a[1]})")
    else:
        c = a[2] if op == "fma" else f"{_CT[t]}(0)"
        e = f"fagen_emu::px::{op}_r<{_CT[t]}>({a[0]}, {a[1]}, {c}, {_ROUND[rnd]})"
    if ftz:
        e = f"fagen_emu::px::ftz({e})"
    if "sat" in mods:
        if t != "f32":
            raise fn.unsupported(".sat applies to .f32")
        e = f"fagen_emu::px::sat({e})"
    return e


# --------------------------------------------------------------------------- arithmetic
@_handler("add / sub", "`.s16 .u16 .s32 .u32 .s64 .u64`; `[.rn .rz .rm .rp][.ftz][.sat].f32`; `[.rn .rz .rm .rp].f64`",
          "integers wrap (two's complement); floats IEEE with the rounding mode asked (`.rn` is C++'s `+`, "
          "directed modes switch the host's rounding mode around the one operation), `.ftz` flushes "
          "subnormal inputs and result, `.sat` clamps to [0, 1] (NaN to 0)", "add", "sub")
def _add(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, _INT_ALL | _FLOAT_TYPES | _FLT_MODS)
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 3)
    d, a, b = inst.operands
    op = inst.parts[0]
    if t in _FLOAT_TYPES:
        return fn.dst(d, t, _float_expr(fn, inst, mods, t, op, [fn.src(a, t), fn.src(b, t)]))
    if len(mods) != 1:
        raise fn.unsupported("integer add/sub takes only a type")
    ut = _u(_CT[t])
    sym = "+" if op == "add" else "-"
    return fn.dst(d, t, f"{_CT[t]}({ut}({fn.src(a, t)}) {sym} {ut}({fn.src(b, t)}))")


@_handler("mul", "`.lo .hi .wide` `.s16 .u16 .s32 .u32 .s64 .u64`; `[.rn .rz .rm .rp][.ftz][.sat].f32`; `.f64`",
          "`.lo` wraps, `.hi` the upper half of the double-width product, `.wide` the double-width "
          "product; floats as `add`")
def _mul(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, _INT_ALL | _FLOAT_TYPES | _FLT_MODS | {"lo", "hi", "wide"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 3)
    d, a, b = inst.operands
    if t in _FLOAT_TYPES:
        return fn.dst(d, t, _float_expr(fn, inst, mods, t, "mul", [fn.src(a, t), fn.src(b, t)]))
    ct = _CT[t]
    if "wide" in mods:
        wt = {"s16": "s32", "u16": "u32", "s32": "s64", "u32": "u64"}.get(t)
        if wt is None:
            raise fn.unsupported("mul.wide takes a 16- or 32-bit type")
        return fn.dst(d, wt, f"{_CT[wt]}({_CT[wt]}({fn.src(a, t)}) * {_CT[wt]}({fn.src(b, t)}))")
    if "hi" in mods:
        if t in ("s16", "u16"):
            raise fn.unsupported("mul.hi on 16-bit types")
        return fn.dst(d, t, f"fagen_emu::px::mulhi<{ct}>({fn.src(a, t)}, {fn.src(b, t)})")
    ut = _u(ct)
    return fn.dst(d, t, f"{ct}({ut}({fn.src(a, t)}) * {ut}({fn.src(b, t)}))")


@_handler("mad", "`.lo .hi .wide` `.s32 .u32 .s64 .u64`; `.rn[.ftz][.sat].f32` (= fma)",
          "integers: the product (low half, high half or double width) plus c, wrapping; `mad.rn.f32` is fma")
def _mad(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, _INT_ALL | _FLOAT_TYPES | _FLT_MODS | {"lo", "hi", "wide"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 4)
    d, a, b, c = inst.operands
    if t in _FLOAT_TYPES:
        if not any(m in _ROUND for m in mods):
            raise fn.unsupported("mad.f32 without a rounding modifier (mad.f32 of sm_1x) is not supported")
        return fn.dst(d, t, _float_expr(fn, inst, mods, t, "fma", [fn.src(a, t), fn.src(b, t), fn.src(c, t)]))
    ct = _CT[t]
    if "wide" in mods:
        wt = {"s16": "s32", "u16": "u32", "s32": "s64", "u32": "u64"}[t]
        w = _u(_CT[wt])
        return fn.dst(d, wt, f"{_CT[wt]}({w}({_CT[wt]}({fn.src(a, t)}) * {_CT[wt]}({fn.src(b, t)})) + "
                             f"{w}({fn.src(c, wt)}))")
    ut = _u(ct)
    if "hi" in mods:
        return fn.dst(d, t, f"{ct}({ut}(fagen_emu::px::mulhi<{ct}>({fn.src(a, t)}, {fn.src(b, t)})) + "
                            f"{ut}({fn.src(c, t)}))")
    return fn.dst(d, t, f"{ct}({ut}({fn.src(a, t)}) * {ut}({fn.src(b, t)}) + {ut}({fn.src(c, t)}))")


@_handler("fma", "`.rn .rz .rm .rp` `[.ftz][.sat].f32`; `.f64`",
          "fused multiply-add rounded once (libm `fma` / `fmaf`, under the asked rounding mode)")
def _fma(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, _FLOAT_TYPES | _FLT_MODS)
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 4)
    if not any(m in _ROUND for m in mods):
        raise fn.unsupported("fma needs a rounding modifier")
    d, a, b, c = inst.operands
    return fn.dst(d, t, _float_expr(fn, inst, mods, t, "fma", [fn.src(a, t), fn.src(b, t), fn.src(c, t)]))


@_handler("div / rem", "`div`: `.s32 .u32 .s64 .u64`; `.rn[.ftz].f32`, `.full[.ftz].f32`, `.approx[.ftz].f32`, "
          "`.rn .rz .rm .rp .f64`; `rem`: integer types",
          "integer quotient truncated (x / 0: all ones; rem x % 0: x); `.rn` IEEE division; `.full` and "
          "`.approx` (about 2 ulp on the GPU) are the correctly rounded quotient here", "div", "rem")
def _div(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, _INT_ALL | _FLOAT_TYPES | _FLT_MODS | {"full", "approx"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 3)
    d, a, b = inst.operands
    if t in _FLOAT_TYPES:
        if inst.parts[0] == "rem":
            raise fn.unsupported("rem on floats")
        if not any(m in _ROUND or m in ("full", "approx") for m in mods):
            raise fn.unsupported("div.f32 needs .rn, .full or .approx")
        mm = [m for m in mods if m not in ("full", "approx")]
        return fn.dst(d, t, _float_expr(fn, inst, mm, t, "div", [fn.src(a, t), fn.src(b, t)]))
    if len(mods) != 1:
        raise fn.unsupported("integer div/rem takes only a type")
    f = "div_i" if inst.parts[0] == "div" else "rem_i"
    return fn.dst(d, t, f"fagen_emu::px::{f}<{_CT[t]}>({fn.src(a, t)}, {fn.src(b, t)})")


_UNARY_APPROX = {
    "ex2": "fagen_emu::px::ex2_approx", "lg2": "fagen_emu::px::lg2_approx", "sin": "sinf", "cos": "cosf",
    "tanh": "tanhf", "rsqrt": "1.0f / sqrtf",
}


@_handler("ex2 / lg2 / sin / cos / tanh / rsqrt", "`.approx[.ftz].f32`",
          "libm's `exp2f`, `log2f`, `sinf`, `cosf`, `tanhf`, `1 / sqrtf` (correctly rounded or nearly; "
          "the GPU's MUFU is within 2 ulp: `ex2.approx.ftz.f32` results differ from the GPU's in the "
          "last bits), `.ftz` flushing input and result", *_UNARY_APPROX)
def _approx(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"approx", "ftz", "f32"})
    if "approx" not in mods or "f32" not in mods:
        raise fn.unsupported("only the .approx .f32 form")
    _nops(fn, inst, 2)
    d, a = inst.operands
    x = fn.src(a, "f32")
    ftz = "ftz" in mods
    if ftz:
        x = f"fagen_emu::px::ftz({x})"
    f = _UNARY_APPROX[inst.parts[0]]
    e = f"({f}({x}))"
    if ftz:
        e = f"fagen_emu::px::ftz({e})"
    return fn.dst(d, "f32", e)


@_handler("rcp / sqrt", "`.rn[.ftz].f32`, `.approx[.ftz].f32`, `.rn .f64`",
          "`1 / x` and `sqrtf` (IEEE; the approximate forms are the correctly rounded value here)", "rcp", "sqrt")
def _rcp(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"rn", "approx", "ftz", "f32", "f64", "full"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 2)
    d, a = inst.operands
    x = fn.src(a, t)
    ftz = "ftz" in mods and t == "f32"
    if ftz:
        x = f"fagen_emu::px::ftz({x})"
    one = "1.0f" if t == "f32" else "1.0"
    e = f"({one} / {x})" if inst.parts[0] == "rcp" else f"std::sqrt({x})"
    if ftz:
        e = f"fagen_emu::px::ftz({e})"
    return fn.dst(d, t, e)


@_handler("min / max", "`[.ftz][.NaN].f32`, `.f64`, `.s16 .u16 .s32 .u32 .s64 .u64`",
          "floats: a NaN operand is ignored (the other returned), two NaNs (or any NaN with `.NaN`) give "
          "the canonical NaN 0x7fffffff, -0 < +0; integers by value", "min", "max")
def _minmax(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, _INT_ALL | _FLOAT_TYPES | {"ftz", "NaN"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 3)
    d, a, b = inst.operands
    x, y = fn.src(a, t), fn.src(b, t)
    if t in _FLOAT_TYPES:
        if "ftz" in mods:
            x, y = f"fagen_emu::px::ftz({x})", f"fagen_emu::px::ftz({y})"
        f = "fmax_ptx" if inst.parts[0] == "max" else "fmin_ptx"
        return fn.dst(d, t, f"fagen_emu::px::{f}<{_CT[t]}>({x}, {y}, {'true' if 'NaN' in mods else 'false'})")
    op = ">" if inst.parts[0] == "max" else "<"
    return fn.dst(d, t, f"([&] {{ const {_CT[t]} x_ = {x}, y_ = {y}; return x_ {op} y_ ? x_ : y_; }}())")


@_handler("abs / neg", "`[.ftz].f32`, `.f64`, `.s16 .s32 .s64`",
          "floats: the sign bit cleared / flipped (NaN payloads kept), `.ftz` flushing; integers wrap "
          "(abs(INT_MIN) = INT_MIN)", "abs", "neg")
def _absneg(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"s16", "s32", "s64", "f32", "f64", "ftz"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 2)
    d, a = inst.operands
    x = fn.src(a, t)
    if t == "f32":
        if "ftz" in mods:
            x = f"fagen_emu::px::ftz({x})"
        m = "0x7fffffffu" if inst.parts[0] == "abs" else "0x80000000u"
        op = "&" if inst.parts[0] == "abs" else "^"
        return fn.dst(d, t, f"fagen_emu::px::f32(fagen_emu::px::bits({x}) {op} {m})")
    if t == "f64":
        m = "0x7fffffffffffffffull" if inst.parts[0] == "abs" else "0x8000000000000000ull"
        op = "&" if inst.parts[0] == "abs" else "^"
        return fn.dst(d, t, f"fagen_emu::px::f64(fagen_emu::px::bits({x}) {op} {m})")
    ct, ut = _CT[t], _u(_CT[t])
    if inst.parts[0] == "neg":
        return fn.dst(d, t, f"{ct}({ut}(0) - {ut}({x}))")
    return fn.dst(d, t, f"([&] {{ const {ct} x_ = {x}; return x_ < 0 ? {ct}({ut}(0) - {ut}(x_)) : x_; }}())")


@_handler("copysign", "`.f32 .f64`", "`copysign d, a, b`: b with the sign bit of a (the ISA's operand order, the "
          "reverse of C's `copysign`); NaN payloads kept")
def _copysign(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"f32", "f64"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 3)
    d, a, b = inst.operands
    if t == "f32":
        return fn.dst(d, t, f"fagen_emu::px::f32((fagen_emu::px::bits({fn.src(b, t)}) & 0x7fffffffu) | "
                            f"(fagen_emu::px::bits({fn.src(a, t)}) & 0x80000000u))")
    return fn.dst(d, t, f"fagen_emu::px::f64((fagen_emu::px::bits({fn.src(b, t)}) & 0x7fffffffffffffffull) | "
                        f"(fagen_emu::px::bits({fn.src(a, t)}) & 0x8000000000000000ull))")


# --------------------------------------------------------------------------- logic and bits
@_handler("and / or / xor / not / cnot", "`.pred .b16 .b32 .b64`",
          "bitwise (predicates: logical)", "and", "or", "xor", "not", "cnot")
def _logic(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"pred", "b16", "b32", "b64"})
    t = _type_of(fn, inst, mods)
    op = inst.parts[0]
    if op in ("not", "cnot"):
        _nops(fn, inst, 2)
        d, a = inst.operands
        x = fn.src(a, t)
        if op == "cnot":
            return fn.dst(d, t, f"{_CT[t]}({x} == 0 ? 1 : 0)")
        return fn.dst(d, t, f"(!{x})" if t == "pred" else f"{_CT[t]}(~{x})")
    _nops(fn, inst, 3)
    d, a, b = inst.operands
    sym = {"and": "&", "or": "|", "xor": "^"}[op]
    if t == "pred":
        sym = {"and": "&&", "or": "||", "xor": "!="}[op]
        return fn.dst(d, t, f"({fn.src(a, t)} {sym} {fn.src(b, t)})")
    return fn.dst(d, t, f"{_CT[t]}({fn.src(a, t)} {sym} {fn.src(b, t)})")


@_handler("shl / shr", "`shl`: `.b16 .b32 .b64`; `shr`: `.b16 .b32 .b64 .u16 .u32 .u64 .s16 .s32 .s64`",
          "shift amounts (an unsigned 32-bit operand) beyond the width are clamped to it: `shl` gives 0, "
          "`shr.s` the sign fill, `shr.u` / `.b` 0", "shl", "shr")
def _shift(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"b16", "b32", "b64", "u16", "u32", "u64", "s16", "s32", "s64"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 3)
    d, a, b = inst.operands
    f = "shl" if inst.parts[0] == "shl" else "shr"
    return fn.dst(d, t, f"fagen_emu::px::{f}<{_CT[t]}>({fn.src(a, t)}, {fn.src(b, 'u32')})")


@_handler("shf", "`.l .r` `.wrap .clamp` `.b32`", "funnel shift of {b:a} (`.wrap`: amount mod 32, `.clamp`: at most 32)")
def _shf(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"l", "r", "wrap", "clamp", "b32"})
    _nops(fn, inst, 4)
    d, a, b, c = inst.operands
    return fn.dst(d, "b32", f"fagen_emu::px::shf({fn.src(a, 'b32')}, {fn.src(b, 'b32')}, {fn.src(c, 'u32')}, "
                            f"{'true' if 'l' in mods else 'false'}, {'true' if 'clamp' in mods else 'false'})")


@_handler("bfe / bfi", "`bfe`: `.u32 .s32 .u64 .s64`; `bfi`: `.b32 .b64`",
          "bit-field extract (sign-extended for signed types) / insert; position and length from their low "
          "8 bits, clamped as the ISA states", "bfe", "bfi")
def _bfe(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"u32", "s32", "u64", "s64", "b32", "b64"})
    t = _type_of(fn, inst, mods)
    if inst.parts[0] == "bfe":
        _nops(fn, inst, 4)
        d, a, b, c = inst.operands
        return fn.dst(d, t, f"fagen_emu::px::bfe<{_CT[t]}>({fn.src(a, t)}, {fn.src(b, 'u32')}, {fn.src(c, 'u32')})")
    _nops(fn, inst, 5)
    d, a, b, c, e = inst.operands
    return fn.dst(d, t, f"fagen_emu::px::bfi<{_CT[t]}>({fn.src(a, t)}, {fn.src(b, t)}, {fn.src(c, 'u32')}, "
                        f"{fn.src(e, 'u32')})")


@_handler("prmt", "`.b32` (default mode)", "byte permute of {b, a} by the selector's nibbles, bit 3 replicating the sign")
def _prmt(fn: _Fn, inst: Inst) -> str:
    _check(fn, inst, {"b32"})
    _nops(fn, inst, 4)
    d, a, b, c = inst.operands
    return fn.dst(d, "b32", f"fagen_emu::px::prmt({fn.src(a, 'b32')}, {fn.src(b, 'b32')}, {fn.src(c, 'b32')})")


@_handler("lop3", "`.b32`", "the 3-input function given by the 8-bit truth table immediate")
def _lop3(fn: _Fn, inst: Inst) -> str:
    _check(fn, inst, {"b32"})
    _nops(fn, inst, 5)
    d, a, b, c, lut = inst.operands
    return fn.dst(d, "b32", f"fagen_emu::px::lop3({fn.src(a, 'b32')}, {fn.src(b, 'b32')}, {fn.src(c, 'b32')}, "
                            f"{fn.src(lut, 'b32')})")


@_handler("popc / clz / brev", "`.b32 .b64`", "population count, leading zeros (32 / 64 for 0), bit reverse (.b32)",
          "popc", "clz", "brev")
def _bits(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"b32", "b64"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 2)
    d, a = inst.operands
    op = inst.parts[0]
    if op == "brev":
        if t != "b32":
            raise fn.unsupported("brev.b64")
        return fn.dst(d, "b32", f"fagen_emu::px::brev32({fn.src(a, t)})")
    return fn.dst(d, "u32", f"fagen_emu::px::{op}<{_CT[t]}>({fn.src(a, t)})")


# --------------------------------------------------------------------------- compare and select
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
        "lo": "<", "ls": "<=", "hi": ">", "hs": ">="}
_UCMP = {"equ": "==", "neu": "!=", "ltu": "<", "leu": "<=", "gtu": ">", "geu": ">="}


@_handler("setp", "`.eq .ne .lt .le .gt .ge .lo .ls .hi .hs` on integer types (`.b16 .b32 .b64 .u* .s*`); "
          "`.eq .ne .lt .le .gt .ge .equ .neu .ltu .leu .gtu .geu .num .nan` `[.ftz]` on `.f32 .f64`; "
          "`[.and .or .xor]` with a third predicate operand; `p|q` destinations",
          "ordered float comparisons (`.ne` included) are false when an operand is NaN, the `u` forms true; "
          "`q` = the negated comparison combined the same way")
def _setp(fn: _Fn, inst: Inst) -> str:
    mods = inst.parts[1:]
    if not mods or mods[0] not in {**_CMP, **_UCMP, "num": 0, "nan": 0}:
        raise fn.unsupported("unknown comparison")
    cmp = mods[0]
    rest = _check(fn, inst, set(_CT) | {"ftz", "and", "or", "xor"}, 2)
    t = _type_of(fn, inst, rest)
    boolop = next((m for m in rest if m in ("and", "or", "xor")), None)
    _nops(fn, inst, 4 if boolop else 3)
    dst, a, b = inst.operands[:3]
    x, y = fn.src(a, t), fn.src(b, t)
    if t in _FLOAT_TYPES and "ftz" in rest:
        x, y = f"fagen_emu::px::ftz({x})", f"fagen_emu::px::ftz({y})"
    if t in _FLOAT_TYPES:
        nan = "(fagen_emu::px::isnan_(x_) || fagen_emu::px::isnan_(y_))"
        if cmp in _CMP and cmp not in ("lo", "ls", "hi", "hs"):
            c = f"(!{nan} && (x_ {_CMP[cmp]} y_))"
        elif cmp in _UCMP:
            c = f"({nan} || (x_ {_UCMP[cmp]} y_))"
        elif cmp == "num":
            c = f"(!{nan})"
        elif cmp == "nan":
            c = nan
        else:
            raise fn.unsupported(f"comparison .{cmp} on floats")
    else:
        if cmp not in _CMP:
            raise fn.unsupported(f"comparison .{cmp} on integers")
        ct = _CT[t]
        if cmp in ("lo", "ls", "hi", "hs") or t.startswith("b"):
            ct = _u(ct)
        c = f"({ct}(x_) {_CMP[cmp]} {ct}(y_))"
    ct = _CT[t]
    pieces = dst.split("|")
    out = [f"{{ const {ct} x_ = {x}, y_ = {y}; const bool c_ = {c};"]
    if boolop:
        z = fn.src(inst.operands[3], "pred")
        comb = {"and": "&&", "or": "||", "xor": "!="}[boolop]
        out.append(f"const bool z_ = {z};")
        out.append(fn.dst(pieces[0], "pred", f"(c_ {comb} z_)"))
        if len(pieces) > 1:
            out.append(fn.dst(pieces[1], "pred", f"(!c_ {comb} z_)"))
    else:
        out.append(fn.dst(pieces[0], "pred", "c_"))
        if len(pieces) > 1:
            out.append(fn.dst(pieces[1], "pred", "!c_"))
    out.append("}")
    return " ".join(out)


@_handler("selp", "`.b16 .b32 .b64 .u16 .u32 .u64 .s16 .s32 .s64 .f32 .f64`", "`d = c ? a : b`")
def _selp(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, set(_CT) - {"pred"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 4)
    d, a, b, c = inst.operands
    return fn.dst(d, t, f"({fn.src(c, 'pred')} ? {fn.src(a, t)} : {fn.src(b, t)})")


# --------------------------------------------------------------------------- moves and conversions
@_handler("mov", "`.pred .b16 .b32 .b64 .u16 .u32 .u64 .s16 .s32 .s64 .f32 .f64`; vector pack / unpack "
          "`mov.b32 {a, b}` / `mov.b64 {a, b}`; symbol addresses; special registers",
          "a copy of the bits; a symbol's address (shared: its offset in the window; param: the host "
          "address of the argument; global: the host address)")
def _mov(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, set(_CT))
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 2)
    d, a = inst.operands
    size = type_size(t)
    if d.startswith("{"):  # unpack: low part first
        parts = fn.vec(d)
        k = size // len(parts)
        pt = {2: "b16", 4: "b32", 1: "b8"}[k]
        out = [f"{{ const {_CT[t]} v_ = {fn.src(a, t)};"]
        for i, p in enumerate(parts):
            if p == "_":
                continue
            out.append(fn.dst(p, pt, f"{_CT[pt]}(uint64_t(v_) >> {8 * k * i})"))
        out.append("}")
        return " ".join(out)
    if a.startswith("{"):  # pack
        parts = fn.vec(a)
        k = size // len(parts)
        pt = {2: "b16", 4: "b32"}[k]
        e = " | ".join(f"(uint64_t({fn.src(p, pt)}) << {8 * k * i})" for i, p in enumerate(parts))
        return fn.dst(d, t, f"{_CT[t]}({e})")
    return fn.dst(d, t, fn.src(a, t))


_CVT_RND = {"rn": 0, "rzi": 1, "rmi": 2, "rpi": 3, "rni": 0}


@_handler("cvt", "int <-> int (`.u8`-`.u64`, `.s8`-`.s64`, `[.sat]`); `.rn .rz .rm .rp` int -> `.f32 .f64`; "
          "`.rni .rzi .rmi .rpi[.ftz][.sat]` float -> int and float -> same float; `.rn[.relu][.satfinite]` "
          "`.f16 .bf16` <- `.f32`; `.f32` <- `.f16 .bf16` (exact); `.f32` <-> `.f64`; `[.ftz][.sat].f32.f32`",
          "integers truncated / sign- or zero-extended (`.sat`: clamped); float -> int rounded as asked, NaN -> 0, "
          "saturated to the range; f32 -> f16 / bf16 round to nearest even (NaN -> 0x7fff); `.sat` clamps to "
          "[0, 1] with NaN -> 0")
def _cvt(fn: _Fn, inst: Inst) -> str:
    mods = inst.parts[1:]
    types = [m for m in mods if m in _CT]
    flags = [m for m in mods if m not in _CT]
    for f in flags:
        if f not in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi", "ftz", "sat"):
            raise fn.unsupported(f"modifier .{f} of cvt is not supported")
    if len(types) != 2:
        raise fn.unsupported("cvt needs a destination and a source type")
    dt, st = types
    _nops(fn, inst, 2)
    d, a = inst.operands
    x = fn.src(a, st)
    sat, ftz = "sat" in flags, "ftz" in flags
    rnd = next((f for f in flags if f not in ("ftz", "sat")), None)
    dflt = dt in ("f32", "f64")
    sflt = st in ("f32", "f64")
    if dt in ("f16", "bf16"):
        if st != "f32" or rnd != "rn" or sat:
            raise fn.unsupported("only cvt.rn.f16.f32 / cvt.rn.bf16.f32 convert to 16-bit floats")
        f = "f32_to_f16_rn" if dt == "f16" else "f32_to_bf16_rn"
        return fn.dst(d, dt, f"fagen_emu::px::{f}({x})")
    if st in ("f16", "bf16"):
        if dt != "f32" or rnd is not None or sat:
            raise fn.unsupported("only cvt.f32.f16 / cvt.f32.bf16 convert from 16-bit floats")
        f = "f16_to_f32" if st == "f16" else "bf16_to_f32"
        e = f"fagen_emu::px::{f}({x})"
        return fn.dst(d, dt, f"fagen_emu::px::ftz({e})" if ftz else e)
    if dflt and sflt:
        if ftz and st == "f32":
            x = f"fagen_emu::px::ftz({x})"
        if dt == st:
            e = x
            if rnd in ("rni", "rzi", "rmi", "rpi"):
                e = f"fagen_emu::px::round_int<{_CT[dt]}>({x}, {_CVT_RND[rnd]})"
            elif rnd is not None:
                raise fn.unsupported("cvt between the same float type takes an integer rounding (.rni ...)")
        elif dt == "f64":
            e = f"double({x})"
        else:
            if rnd not in ("rn", None):
                raise fn.unsupported("cvt.f32.f64 with a directed rounding")
            e = f"float({x})"
        if sat:
            if dt != "f32":
                raise fn.unsupported("cvt.sat to .f64")
            e = f"fagen_emu::px::sat({e})"
        if ftz and dt == "f32":
            e = f"fagen_emu::px::ftz({e})"
        return fn.dst(d, dt, e)
    if sflt:  # float -> int
        if rnd not in ("rni", "rzi", "rmi", "rpi"):
            raise fn.unsupported("float -> int cvt needs .rni/.rzi/.rmi/.rpi")
        if ftz:
            x = f"fagen_emu::px::ftz({x})"
        return fn.dst(d, dt, f"fagen_emu::px::f2i<{_CT[dt]}>({x}, {_CVT_RND[rnd]})")
    if dflt:  # int -> float
        if rnd not in ("rn", None):
            raise fn.unsupported("int -> float cvt with a directed rounding")
        if sat:
            raise fn.unsupported("cvt.sat int -> float")
        return fn.dst(d, dt, f"{_CT[dt]}({x})")
    # int -> int
    if rnd is not None:
        raise fn.unsupported("int -> int cvt with a rounding modifier")
    if sat:
        return fn.dst(d, dt, f"fagen_emu::px::sat_int<{_CT[dt]}>({x})")
    return fn.dst(d, dt, f"{_CT[dt]}({x})")


@_handler("cvta", "`[.to].global .shared[::cta] .param .local .const` `.u32 .u64`",
          "global / param / local / const: identity (host addresses); shared: offset <-> host address of "
          "the window")
def _cvta(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"to", "global", "shared", "shared::cta", "param", "local", "const", "u32", "u64"})
    t = _type_of(fn, inst, mods)
    _nops(fn, inst, 2)
    d, a = inst.operands
    x = f"uint64_t({fn.src(a, t)})"
    if "shared" in mods or "shared::cta" in mods:
        e = f"fagen_emu::px::cvta_to_shared({x})" if "to" in mods else f"fagen_emu::px::cvta_shared({x})"
    else:
        e = x
    return fn.dst(d, t, f"{_CT[t]}({e})")


# --------------------------------------------------------------------------- memory
_CACHE = {"ca", "cg", "cs", "lu", "cv", "wb", "wt", "nc", "volatile", "weak", "relaxed", "acquire", "release",
          "gpu", "cta", "sys", "cluster", "L1::no_allocate", "L1::evict_last", "L1::evict_first",
          "L1::evict_normal", "L1::evict_unchanged", "L2::evict_last", "L2::evict_first", "L2::evict_normal",
          "L2::64B", "L2::128B", "L2::256B", "L2::cache_hint"}
_SPACES = {"global", "shared", "shared::cta", "param", "local", "const", "param::entry"}


def _space(mods: list[str]) -> str:
    for m in mods:
        if m in _SPACES:
            return "shared" if m.startswith("shared") else m.split("::")[0]
    return "generic"


@_handler("ld / st / ldu", "`[.weak .volatile .relaxed.scope .acquire.scope]` `[.global .shared[::cta] .param "
          ".local .const]` (or generic) `[cache / eviction hints]` `[.v2 .v4]` `.b8`-`.b64 .u8`-`.u64 "
          ".s8`-`.s64 .f32 .f64`",
          "a load / store of host memory (shared: the window at the offset); sub-register loads zero- or "
          "sign-extend by the type; memory is sequentially consistent (one fiber runs at a time), so "
          "ordering qualifiers need nothing", "ld", "st", "ldu")
def _ldst(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, _CACHE | _SPACES | set(_CT) | {"v2", "v4", "v8"})
    t = _type_of(fn, inst, mods)
    sp = _space(mods)
    vn = next((int(m[1:]) for m in mods if m in ("v2", "v4", "v8")), 1)
    size = type_size(t)
    ct = _CT[t]
    if t == "pred":
        raise fn.unsupported("ld/st of predicates")
    is_ld = inst.parts[0] in ("ld", "ldu")
    _nops(fn, inst, 2)
    if is_ld:
        d, a = inst.operands
        p = fn.host(a, sp)
        if vn == 1:
            return fn.dst(d, t, f"fagen_emu::px::ld<{ct}>({p})")
        regs = fn.vec(d)
        out = [f"{{ const unsigned char* p_ = static_cast<const unsigned char*>({p});"]
        for i, r in enumerate(regs):
            if r != "_":
                out.append(fn.dst(r, t, f"fagen_emu::px::ld<{ct}>(p_ + {i * size})"))
        out.append("}")
        return " ".join(out)
    a, v = inst.operands
    p = fn.host(a, sp)
    if vn == 1:
        return f"fagen_emu::px::st<{ct}>({p}, {ct}({fn.src(v, t)}));"
    regs = fn.vec(v)
    out = [f"{{ unsigned char* p_ = static_cast<unsigned char*>({p});"]
    for i, r in enumerate(regs):
        out.append(f"fagen_emu::px::st<{ct}>(p_ + {i * size}, {ct}({fn.src(r, t)}));")
    out.append("}")
    return " ".join(out)


_ATOM_OPS = {"add", "exch", "cas", "max", "min", "and", "or", "xor", "inc", "dec"}


def _rmw(op: str, ct: str, old: str, b: str, c: str | None) -> str:
    u = _u(ct)
    return {
        "add": f"{ct}({old} + {b})" if ct in ("float", "double") else f"{ct}({u}({old}) + {u}({b}))",
        "exch": b, "cas": f"({old} == {b} ? {c} : {old})",
        "max": f"({old} < {b} ? {b} : {old})", "min": f"({b} < {old} ? {b} : {old})",
        "and": f"{ct}({old} & {b})", "or": f"{ct}({old} | {b})", "xor": f"{ct}({old} ^ {b})",
        "inc": f"{ct}(({old} >= {b}) ? 0 : {old} + 1)", "dec": f"{ct}((({old} == 0) || ({old} > {b})) ? {b} : {old} - 1)",
    }[op]


@_handler("atom / red", "`[.relaxed .acquire .release .acq_rel]` `[.gpu .cta .sys]` `[.global .shared[::cta]]` "
          "`.add .exch .cas .max .min .and .or .xor .inc .dec` `[.v2 .v4 (red.add.f32)]` "
          "`.b32 .b64 .u32 .u64 .s32 .s64 .f32 .f64`",
          "a read-modify-write of host memory: fibers never switch inside one, so it is atomic; `atom` "
          "returns the old value; `red.global.add.v2.f32` needs an 8-byte aligned address (else a kernel "
          "error)", "atom", "red")
def _atom(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"relaxed", "acquire", "release", "acq_rel", "gpu", "cta", "sys", "global", "shared",
                             "shared::cta", "v2", "v4", "noftz"} | _ATOM_OPS | set(_CT))
    t = _type_of(fn, inst, mods)
    ops = [m for m in mods if m in _ATOM_OPS]
    if len(ops) != 1:
        raise fn.unsupported("atom/red needs one operation")
    op = ops[0]
    sp = _space(mods)
    ct = _CT[t]
    vn = next((int(m[1:]) for m in mods if m in ("v2", "v4")), 1)
    is_atom = inst.parts[0] == "atom"
    if vn > 1 and (is_atom or op != "add" or t != "f32"):
        raise fn.unsupported("vector atomics: only red.add.v2/.v4.f32")
    ops_ = inst.operands
    if is_atom:
        _nops(fn, inst, 4 if op == "cas" else 3)
        d, a, b = ops_[:3]
        c = fn.src(ops_[3], t) if op == "cas" else None
        p = fn.host(a, sp)
        return (f"{{ {ct}* p_ = static_cast<{ct}*>({p}); const {ct} old_ = fagen_emu::px::ld<{ct}>(p_); "
                f"fagen_emu::px::st<{ct}>(p_, {_rmw(op, ct, 'old_', fn.src(b, t), c)}); "
                f"{fn.dst(d, t, 'old_')} }}")
    _nops(fn, inst, 2)
    a, b = ops_
    p = fn.host(a, sp)
    if vn == 1:
        return (f"{{ {ct}* p_ = static_cast<{ct}*>({p}); const {ct} old_ = fagen_emu::px::ld<{ct}>(p_); "
                f"fagen_emu::px::st<{ct}>(p_, {_rmw(op, ct, 'old_', fn.src(b, t), None)}); }}")
    regs = fn.vec(b)
    out = [f"{{ float* p_ = static_cast<float*>({p});",
           f"if (reinterpret_cast<uintptr_t>(p_) % {4 * vn}u) fagen_emu::fail(\"red.add.v{vn}.f32 at %s:%d: "
           f"address %p is not {4 * vn}-byte aligned\", ptx_file, {inst.line}, static_cast<void*>(p_));"]
    for i, r in enumerate(regs):
        out.append(f"p_[{i}] = p_[{i}] + {fn.src(r, t)};")
    out.append("}")
    return " ".join(out)


# --------------------------------------------------------------------------- control flow
@_handler("bra / ret / exit / trap", "`bra[.uni] label`, `ret`, `exit`, `trap`",
          "`goto`; `ret` / `exit` end the thread; `trap` a kernel error", "bra", "ret", "exit", "trap")
def _bra(fn: _Fn, inst: Inst) -> str:
    op = inst.parts[0]
    if op == "bra":
        _check(fn, inst, {"uni"})
        _nops(fn, inst, 1)
        return f"goto {fn.label(inst.operands[0])};"
    _check(fn, inst, set())
    if op == "trap":
        return f"fagen_emu::fail(\"trap at %s:%d\", ptx_file, {inst.line});"
    if fn.bulk:  # bulk stores / reduces must be drained before the thread exits
        return f"fagen_emu::px::bulk_exit({fn.site()}); return;"
    return "return;"


@_handler("bar / barrier", "`bar.sync a[, b]`, `bar.arrive a, b`, `barrier.sync[.aligned] a[, b]`, "
          "`bar.warp.sync mask`, `bar.red.or.pred p, 0, q`",
          "barrier 0 without a count (or with the block's thread count): the runtime's `__syncthreads` "
          "with the PTX line as its call site (threads at different `bar.sync` lines: a divergence "
          "error); other ids: hopper.h's named barriers; `bar.warp.sync`: `__syncwarp(mask)`; `bar.red.or`: "
          "`__syncthreads_or`'s barrier (every thread gets the OR of the predicates)", "bar", "barrier")
def _bar(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"sync", "arrive", "aligned", "warp", "red", "or", "pred", "cta"})
    if "red" in mods:  # bar.red.or.pred p, 0, q (__syncthreads_or): block barrier 0 with the OR of q
        if "or" not in mods or "pred" not in mods:
            raise fn.unsupported("only bar.red.or.pred")
        _nops(fn, inst, 3)
        if inst.operands[1].strip() != "0":
            raise fn.unsupported("bar.red only on barrier 0 of the whole block")
        tail = " fagen_emu::px::cp_passed_block_barrier();" if fn.cp else ""
        red = f"fagen_emu::block_barrier_or({fn.src(inst.operands[2], 'pred')} ? 1 : 0, {fn.site()}) != 0"
        return f"{{ {fn.dst(inst.operands[0], 'pred', red)}{tail} }}"
    if mods and mods[0] == "warp":
        _nops(fn, inst, 1)
        tail = " fagen_emu::px::cp_passed_syncwarp();" if fn.cp else ""
        return f"__syncwarp({fn.src(inst.operands[0], 'b32')}, {fn.site()});{tail}"
    if not mods or mods[0] not in ("sync", "arrive"):
        raise fn.unsupported("only bar.sync / bar.arrive / bar.warp.sync")
    wait = mods[0] == "sync"
    _nops(fn, inst, (1, 2) if wait else 2)
    a = fn.src(inst.operands[0], "u32")
    # cp.async destinations: a block barrier publishes what the threads' waits landed before it
    block = f"{{ fagen_emu::block_barrier({fn.site()});{' fagen_emu::px::cp_passed_block_barrier();' if fn.cp else ''} }}"
    if len(inst.operands) == 1:
        return (f"{{ const uint32_t id_ = {a}; if (id_ == 0) {block} else "
                f"fagen_emu::hopper::named_barrier(id_, fagen_emu_state.nthreads, true, {fn.site()}); }}")
    b = fn.src(inst.operands[1], "u32")
    return (f"{{ const uint32_t id_ = {a}, n_ = {b}; if (id_ == 0 && n_ == fagen_emu_state.nthreads && "
            f"{'true' if wait else 'false'}) {block} else "
            f"fagen_emu::hopper::named_barrier(id_, n_, {'true' if wait else 'false'}, {fn.site()}); }}")


@_handler("membar / fence", "`membar.{cta,gl,sys}`, `fence.{sc,acq_rel}.{cta,gpu,sys,cluster}`, "
          "`fence.proxy.async[.shared::cta .global .shared::cluster]`, `fence.mbarrier_init.release.cluster`",
          "memory fences order nothing here (one fiber at a time); `fence.proxy.async` is hopper.h's "
          "(racecheck: the async proxy sees the thread's writes up to it), and in entries whose async proxy "
          "reads shared memory the generic-proxy writes (`st`, `atom`, `red`, `stmatrix`, landed cp.async) "
          "are tracked: one the async proxy reads (wgmma operand, bulk / TMA store or reduce source) before "
          "its writer's `fence.proxy.async` is a PtxHazardError", "membar", "fence")
def _fence(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"cta", "gl", "sys", "gpu", "cluster", "sc", "acq_rel", "proxy", "async",
                             "shared::cta", "shared::cluster", "global", "mbarrier_init", "release"})
    _nops(fn, inst, 0)
    if "proxy" in mods:
        if "async" not in mods:
            raise fn.unsupported("only fence.proxy.async")
        return f"fagen_emu::hopper::fence_proxy_async({fn.site()});{' fagen_emu::px::gw_fence();' if fn.gw else ''}"
    return ";"


@_handler("nanosleep / prefetch / pragma", "`nanosleep.u32`, `prefetch[.global .L1 .L2 .tensormap ...]`",
          "no effect", "nanosleep", "prefetch", "prefetchu")
def _noop(fn: _Fn, inst: Inst) -> str:
    return ";"


# --------------------------------------------------------------------------- warp collectives
_SHFL_MODE = {"up": 0, "down": 1, "bfly": 2, "idx": 3}


@_handler("shfl.sync", "`.up .down .bfly .idx` `.b32`, `d[|p]`",
          "a warp collective over the member mask (every lane in it must arrive at a `shfl.sync` of the same "
          "mode, else a divergence error naming the PTX line); source lane and `p` by the ISA's pseudo-code "
          "from b and c (segment mask c[12:8], clamp c[4:0]); a source lane outside the mask gives all-ones",
          "shfl")
def _shfl(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"sync", "up", "down", "bfly", "idx", "b32"})
    modes = [m for m in mods if m in _SHFL_MODE]
    if "sync" not in mods or len(modes) != 1:
        raise fn.unsupported("only shfl.sync.{up,down,bfly,idx}.b32")
    _nops(fn, inst, 5)
    d, a, b, c, m = inst.operands
    pieces = d.split("|")
    mode = modes[0]
    call = (f"fagen_emu::px::shfl<{_SHFL_MODE[mode]}>({fn.src(a, 'b32')}, {fn.src(b, 'b32')}, {fn.src(c, 'b32')}, "
            f"{fn.src(m, 'b32')}, &p_, \"shfl.sync.{mode}.b32\", {fn.site()})")
    out = [f"{{ bool p_ = false; const uint32_t d_ = {call};", fn.dst(pieces[0], "b32", "d_")]
    if len(pieces) > 1:
        out.append(fn.dst(pieces[1], "pred", "p_"))
    out.append("}")
    return " ".join(out)


@_handler("vote.sync", "`.ballot.b32`, `.any.pred`, `.all.pred`",
          "the runtime's `__ballot_sync` / `__any_sync` / `__all_sync` collectives at the PTX line", "vote")
def _vote(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"sync", "ballot", "any", "all", "b32", "pred"})
    _nops(fn, inst, 3)
    d, p, m = inst.operands
    pv, mv = fn.src(p, "pred"), fn.src(m, "b32")
    if "ballot" in mods:
        return fn.dst(d, "b32", f"uint32_t(__ballot_sync({mv}, {pv}, {fn.site()}))")
    f = "__any_sync" if "any" in mods else "__all_sync"
    return fn.dst(d, "pred", f"({f}({mv}, {pv}, {fn.site()}) != 0)")


@_handler("mma.sync", "`.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`",
          "shim.h's `mma_m16n8k16` warp collective (fragments of the ISA; each D element C plus 16 exact "
          "products summed in double, rounded once); `.aligned`: lanes at two different PTX lines are a "
          "divergence error naming both", "mma")
def _mma(fn: _Fn, inst: Inst) -> str:
    if inst.opcode not in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                           "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"):
        raise fn.unsupported("only mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32")
    _nops(fn, inst, 4)
    dv, av, bv, cv = (fn.vec(o) for o in inst.operands)
    if (len(dv), len(av), len(bv), len(cv)) != (4, 4, 2, 4):
        raise fn.unsupported("mma.m16n8k16 takes 4 D, 4 A, 2 B and 4 C registers")
    bf16 = "true" if ".bf16." in inst.opcode else "false"
    out = ["{ float d_[4]; const float c_[4] = {" + ", ".join(fn.src(r, "f32") for r in cv) + "};",
           "const uint32_t a_[4] = {" + ", ".join(fn.src(r, "b32") for r in av) + "};",
           "const uint32_t b_[2] = {" + ", ".join(fn.src(r, "b32") for r in bv) + "};",
           f"fagen_emu::px::mma<{bf16}>(d_, c_, a_, b_, {fn.site()});"]
    out += [fn.dst(r, "f32", f"d_[{i}]") for i, r in enumerate(dv)]
    out.append("}")
    return " ".join(out)


@_handler("ldmatrix / stmatrix", "`.sync.aligned.m8n8` `.x1 .x2 .x4` `[.trans]` `.shared[::cta].b16`",
          "shim.h's `ldmatrix` / hopper.h's `stmatrix` warp collectives (ISA fragment layout, 16-byte aligned "
          "rows); `.aligned`: lanes at two different PTX lines are a divergence error naming both",
          "ldmatrix", "stmatrix")
def _ldmatrix(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"sync", "aligned", "m8n8", "x1", "x2", "x4", "trans", "shared", "shared::cta", "b16"})
    num = next((int(m[1]) for m in mods if m in ("x1", "x2", "x4")), None)
    if num is None or "m8n8" not in mods or "b16" not in mods:
        raise fn.unsupported("ldmatrix/stmatrix need .m8n8, .x1/.x2/.x4 and .b16")
    trans = "true" if "trans" in mods else "false"
    _nops(fn, inst, 2)
    if inst.parts[0] == "ldmatrix":
        d, a = inst.operands
        regs = fn.vec(d)
        out = [f"{{ uint32_t r_[{num}]; fagen_emu::px::ldmatrix<{num}, {trans}>(r_, {fn.host(a, 'shared')}, {fn.site()});"]
        out += [fn.dst(r, "b32", f"r_[{i}]") for i, r in enumerate(regs)]
        out.append("}")
        return " ".join(out)
    a, s = inst.operands
    regs = fn.vec(s)
    name = f"stmatrix.x{num}{'.trans' if trans == 'true' else ''}"
    return (f"{{ const uint32_t r_[{num}] = {{{', '.join(fn.src(r, 'b32') for r in regs)}}}; "
            f"fagen_emu::px::stmatrix<{num}, {trans}>({fn.host(a, 'shared')}, r_, \"{name}\", {fn.site()}); }}")


@_handler("elect.sync", "`d|p, membermask` (`d` or `p` may be `_`)",
          "a ballot collective over the member mask at the PTX line (every lane in it must arrive); the "
          "highest lane of the mask is elected, as hopper.h's election: `d` = its lane id in every lane, `p` "
          "true in it alone", "elect")
def _elect(fn: _Fn, inst: Inst) -> str:
    _check(fn, inst, {"sync"})
    _nops(fn, inst, 2)
    d, m = inst.operands
    pieces = [x.strip() for x in d.split("|")]
    if len(pieces) != 2:
        raise fn.unsupported("elect.sync needs the destinations d|p (either may be `_`)")
    out = [f"{{ uint32_t l_ = 0; const bool e_ = fagen_emu::px::elect({fn.src(m, 'b32')}, &l_, {fn.site()});"]
    if pieces[0] != "_":
        out.append(fn.dst(pieces[0], "b32", "l_"))
    if pieces[1] != "_":
        out.append(fn.dst(pieces[1], "pred", "e_"))
    out.append("(void)e_; }")
    return " ".join(out)


@_handler("setmaxnreg", "`.inc .dec` `.sync.aligned.u32 N`",
          "hopper.h's warpgroup collective (N a multiple of 8 in [24, 256], the same in the warpgroup), after "
          "a warpgroup rendezvous keyed by the PTX line (`.aligned`); no other effect")
def _setmaxnreg(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"inc", "dec", "sync", "aligned", "u32"})
    _nops(fn, inst, 1)
    return (f"fagen_emu::px::wg_aligned(5, \"setmaxnreg.sync.aligned\", {fn.site()}); "
            f"fagen_emu::hopper::setmaxnreg(int({fn.src(inst.operands[0], 'u32')}), "
            f"{'true' if 'inc' in mods else 'false'}, {fn.site()});")


# --------------------------------------------------------------------------- cp.async
@_handler("cp.async", "`.ca .cg` `.shared[::cta].global [d], [s], 16[, src-size]`; `.commit_group`; "
          "`.wait_group N`; `.wait_all`",
          "shim.h's adversarial cp.async queue (destination poisoned until the issuing thread's wait); "
          "src-size 0 (zero fill) or 16; every shared-memory access of the entry is checked: a destination "
          "accessed before its thread's wait, or read by another thread before a `bar.sync` after that wait "
          "(its warp: `bar.warp.sync`), is a PtxHazardError naming both PTX lines", "cp")
def _cp(fn: _Fn, inst: Inst) -> str:
    p = inst.parts
    if p[:2] != ["cp", "async"] and p[:2] != ["cp", "reduce"]:
        raise fn.unsupported("unknown cp form")
    if p[:3] == ["cp", "async", "bulk"] or p[:2] == ["cp", "reduce"]:
        return _bulk(fn, inst)
    rest = p[2:]
    if rest == ["commit_group"]:
        return "fagen_emu::cp_async_commit();"
    gw = "true" if fn.gw else "false"
    if rest == ["wait_group"]:
        _nops(fn, inst, 1)
        return f"fagen_emu::px::cp_wait<{gw}>(unsigned({fn.src(inst.operands[0], 'u32')}), {fn.site()});"
    if rest == ["wait_all"]:
        return f"fagen_emu::px::cp_wait_all<{gw}>({fn.site()});"
    for m in rest:
        if m not in ("ca", "cg", "shared", "shared::cta", "global", "L2::128B", "L2::64B", "L2::256B"):
            raise fn.unsupported(f"modifier .{m} of cp.async")
    if len(inst.operands) not in (3, 4):
        raise fn.unsupported("cp.async [d], [s], size[, src-size]")
    d, s, size = inst.operands[:3]
    if size.strip() != "16":
        raise fn.unsupported("only 16-byte cp.async")
    valid = "true"
    if len(inst.operands) == 4:
        src_size = fn.src(inst.operands[3], "u32")
        valid = (f"([&] {{ const uint32_t n_ = {src_size}; if (n_ != 0u && n_ != 16u) fagen_emu::fail(\"cp.async at "
                 f"%s:%d: src-size %u (the emulator takes 0 or 16)\", ptx_file, {inst.line}, n_); return n_ != 0u; }}())")
    return (f"fagen_emu::px::cp_async({fn.host(d, 'shared')}, {fn.host(s, 'global')}, {valid}, {fn.site()});")


def _bulk(fn: _Fn, inst: Inst) -> str:
    """cp.async.bulk[.tensor] / cp.reduce.async.bulk[.tensor] / their groups."""
    p = inst.parts
    text = inst.opcode
    if text == "cp.async.bulk.commit_group":
        return "fagen_emu::hopper::bulk_commit();"
    if text in ("cp.async.bulk.wait_group", "cp.async.bulk.wait_group.read"):
        _nops(fn, inst, 1)
        return f"fagen_emu::hopper::bulk_wait(unsigned({fn.src(inst.operands[0], 'u32')}), {fn.site()});"
    reduce = p[1] == "reduce"
    tensor = "tensor" in p
    mods = set(p)
    if tensor:
        rank = next((int(m[0]) for m in p if re.fullmatch(r"[1-5]d", m)), None)
        if rank is None or rank < 2 or rank > 5:
            raise fn.unsupported("tensor copies of rank 2-5")
        if "shared::cluster" in mods and "global" in mods and p.index("shared::cluster") < p.index("global"):
            # load: [dst], [tmap, {c}], [mbar]
            if "mbarrier::complete_tx::bytes" not in mods or "tile" not in mods or reduce:
                raise fn.unsupported("tensor loads: .tile.mbarrier::complete_tx::bytes")
            extra = mods - {"cp", "async", "bulk", "tensor", f"{rank}d", "shared::cluster", "global", "tile",
                            "mbarrier::complete_tx::bytes"}
            if extra:
                raise fn.unsupported(f"modifiers {sorted(extra)}")
            _nops(fn, inst, 3)
            dst, tm, bar = inst.operands
            base, coords = _tmap_operand(fn, tm, rank)
            return (f"{{ const int c_[{rank}] = {{{coords}}}; fagen_emu::hopper::tma(fagen_emu::hopper::kTmaLoad, {rank}, "
                    f"{fn.host(dst, 'shared')}, reinterpret_cast<const FaTensorMap*>(fagen_emu::px::hp({base})), "
                    f"reinterpret_cast<unsigned long long*>({fn.host(bar, 'shared')}), c_, {fn.site()}); }}")
        # store / reduce: [tmap, {c}], [src]
        extra = mods - {"cp", "reduce", "async", "bulk", "tensor", f"{rank}d", "global", "shared::cta", "tile",
                        "bulk_group", "add"}
        if extra or "bulk_group" not in mods:
            raise fn.unsupported(f"tensor store / reduce modifiers {sorted(extra)}")
        if reduce and "add" not in mods:
            raise fn.unsupported("only the .add reduction")
        _nops(fn, inst, 2)
        tm, src = inst.operands
        base, coords = _tmap_operand(fn, tm, rank)
        kind = "kTmaReduceAdd" if reduce else "kTmaStore"
        tmap = f"reinterpret_cast<const FaTensorMap*>(fagen_emu::px::hp({base}))"
        check = (f"fagen_emu::px::gw_check_src({fn.host(src, 'shared')}, fagen_emu::px::tma_box_bytes({tmap}), "
                 f"\"{inst.opcode}\", {fn.site()}); " if fn.gw else "")
        return (f"{{ const int c_[{rank}] = {{{coords}}}; {check}fagen_emu::hopper::tma(fagen_emu::hopper::{kind}, "
                f"{rank}, {fn.host(src, 'shared')}, {tmap}, nullptr, c_, {fn.site()}); }}")
    # non-tensor bulk copies
    if "mbarrier::complete_tx::bytes" in mods:
        extra = mods - {"cp", "async", "bulk", "shared::cluster", "shared::cta", "global",
                        "mbarrier::complete_tx::bytes"}
        if extra or reduce:
            raise fn.unsupported(f"bulk load modifiers {sorted(extra)}")
        _nops(fn, inst, 4)
        dst, src, size, bar = inst.operands
        return (f"fagen_emu::hopper::bulk(fagen_emu::hopper::kTmaLoad, {fn.host(dst, 'shared')}, "
                f"{fn.host(src, 'global')}, unsigned({fn.src(size, 'u32')}), "
                f"reinterpret_cast<unsigned long long*>({fn.host(bar, 'shared')}), \"cp.async.bulk\", {fn.site()});")
    extra = mods - {"cp", "reduce", "async", "bulk", "global", "shared::cta", "bulk_group", "add", "f32"}
    if extra or "bulk_group" not in mods or (reduce and not {"add", "f32"} <= mods):
        raise fn.unsupported(f"bulk store / reduce modifiers {sorted(extra)}")
    _nops(fn, inst, 3)
    dst, src, size = inst.operands
    kind = "kTmaReduceAdd" if reduce else "kTmaStore"
    name = "cp.reduce.async.bulk.add.f32" if reduce else "cp.async.bulk"
    check = (f"fagen_emu::px::gw_check_src({fn.host(src, 'shared')}, {fn.src(size, 'u32')}, \"{inst.opcode}\", "
             f"{fn.site()}); " if fn.gw else "")
    return (f"{{ {check}fagen_emu::hopper::bulk(fagen_emu::hopper::{kind}, {fn.host(src, 'shared')}, "
            f"{fn.host(dst, 'global')}, unsigned({fn.src(size, 'u32')}), nullptr, \"{name}\", {fn.site()}); }}")


FORMS.append(Form("cp.async.bulk[.tensor] / cp.reduce.async.bulk[.tensor]",
                  "tensor `.2d .3d .4d .5d` (the ranks hopper.h emulates): `.shared::cluster.global.tile.mbarrier::complete_tx::bytes` (load), "
                  "`.global.shared::cta.tile.bulk_group` (store; reduce `.add`); non-tensor load "
                  "`.shared::cluster.global.mbarrier::complete_tx::bytes`, store `.global.shared::cta.bulk_group`, "
                  "reduce `.add.f32`; `.commit_group`, `.wait_group[.read] N`",
                  "hopper.h's TMA / bulk emulation (box read within the tensor, swizzled image, complete_tx on "
                  "the mbarrier, data poison until the phase completes; stores checked at the bulk wait); a "
                  "`ret` / `exit` with bulk stores or reduces not drained by `cp.async.bulk.wait_group` is a "
                  "PtxHazardError naming the copy's line"))


def _tmap_operand(fn: _Fn, op: str, rank: int) -> tuple[str, str]:
    op = op.strip()
    m = re.fullmatch(r"\[\s*([^,]+?)\s*,\s*(\{.*\})\s*\]", op)
    if not m:
        raise fn.unsupported(f"expected [tensor-map, {{coordinates}}], got {op!r}")
    coords = fn.vec(m.group(2))
    if len(coords) != rank:
        raise fn.unsupported(f"{len(coords)} coordinates for a rank-{rank} copy")
    base = fn.address(f"[{m.group(1)}]")
    return base, ", ".join(f"int({fn.src(c, 's32')})" for c in coords)


# --------------------------------------------------------------------------- mbarrier
@_handler("mbarrier", "`.init .arrive .arrive.expect_tx .expect_tx .try_wait.parity .test_wait.parity` "
          "`[.release .acquire .cta]` `.shared[::cta].b64`",
          "hopper.h's mbarrier (phase, pending count, tx-count; a wait that can never complete is a "
          "deadlock naming the barrier); `try_wait` blocks until the phase completes")
def _mbar(fn: _Fn, inst: Inst) -> str:
    mods = _check(fn, inst, {"init", "arrive", "expect_tx", "try_wait", "test_wait", "parity", "release",
                             "acquire", "cta", "shared", "shared::cta", "b64"})
    bar = lambda op: f"reinterpret_cast<unsigned long long*>({fn.host(op, 'shared')})"
    if "init" in mods:
        _nops(fn, inst, 2)
        return f"fagen_emu::hopper::mbar_init({bar(inst.operands[0])}, unsigned({fn.src(inst.operands[1], 'u32')}), {fn.site()});"
    if "try_wait" in mods or "test_wait" in mods:
        if "parity" not in mods:
            raise fn.unsupported("only the .parity waits")
        _nops(fn, inst, (3, 4))
        p, a, par = inst.operands[:3]
        return fn.dst(p, "pred", f"fagen_emu::hopper::mbar_wait({bar(a)}, unsigned({fn.src(par, 'u32')}) & 1u, {fn.site()})")
    if "arrive" in mods:
        tx = "expect_tx" in mods
        _nops(fn, inst, 3 if tx else (2, ))
        st, a = inst.operands[:2]
        n = f"unsigned({fn.src(inst.operands[2], 'u32')})" if tx else "0u"
        name = "mbarrier.arrive.expect_tx" if tx else "mbarrier.arrive"
        return fn.dst(st, "b64", f"uint64_t(fagen_emu::hopper::mbar_arrive({bar(a)}, {n}, true, \"{name}\", {fn.site()}))")
    if "expect_tx" in mods:
        _nops(fn, inst, 2)
        return (f"fagen_emu::hopper::mbar_arrive({bar(inst.operands[0])}, unsigned({fn.src(inst.operands[1], 'u32')}), "
                f"false, \"mbarrier.expect_tx\", {fn.site()});")
    raise fn.unsupported("unknown mbarrier operation")


# --------------------------------------------------------------------------- wgmma
@_handler("wgmma", "`.fence .commit_group .wait_group N` `.sync.aligned`; `.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}` "
          "(N a multiple of 8 up to 256) with descriptor or register A, scale-d predicate or immediate, "
          "imm-scale-a = imm-scale-b = 1, imm-trans-a / imm-trans-b 0 or 1",
          "hopper.h's warpgroup wgmma (operands through the descriptors, D at issue in double, rounded once), "
          "the accumulator staged per register tuple and copied into the registers at the `wait_group` that "
          "retires it; every access of an in-flight accumulator or A-fragment register is a PtxHazardError, "
          "and so is a wgmma issued after an access of its registers without `wgmma.fence`; each of the four "
          "instructions is a warpgroup rendezvous keyed by its PTX line (`.sync.aligned`)")
def _wgmma(fn: _Fn, inst: Inst) -> str:
    if inst.opcode == "wgmma.fence.sync.aligned":
        return f"fagen_emu::px::wg_aligned(1, \"wgmma.fence.sync.aligned\", {fn.site()}); fagen_emu::hopper::wgmma_fence({fn.site()}); for (int i_ = 0; i_ < {max(len(fn.tuples), 1)}; ++i_) wgt.touched_line[i_] = 0;"
    if inst.opcode == "wgmma.commit_group.sync.aligned":
        return (f"fagen_emu::px::wg_aligned(2, \"wgmma.commit_group.sync.aligned\", {fn.site()}); "
                f"fagen_emu::hopper::wgmma_commit({fn.site()}); ++wgt.commits;")
    if inst.opcode == "wgmma.wait_group.sync.aligned":
        _nops(fn, inst, 1)
        out = [f"{{ const int n_ = int({fn.src(inst.operands[0], 'u32')}); "
               f"fagen_emu::px::wg_aligned(3, \"wgmma.wait_group.sync.aligned\", {fn.site()}); "
               f"fagen_emu::hopper::wgmma_wait(unsigned(n_), {fn.site()});",
               "const int done_ = wgt.commits - n_;"]
        for tup in fn.tuples.values():
            body = [f"wgt.group[{tup.tid}] = -1; --wgt.inflight;"]
            if tup.kind == "D":
                body += [f"{r} = wgst_{tup.tid}[{i}];" for i, r in enumerate(tup.regs)]
            out.append(f"if (wgt.group[{tup.tid}] >= 0 && wgt.group[{tup.tid}] < done_) {{ {' '.join(body)} }}")
        out.append("}")
        return " ".join(out)
    m = re.fullmatch(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(f16|bf16)\.(f16|bf16)", inst.opcode)
    if not m or m.group(2) != m.group(3):
        raise fn.unsupported("only wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}")
    n = int(m.group(1))
    if n % 8 or not 8 <= n <= 256:
        raise fn.unsupported(f"N = {n}")
    ops = inst.operands
    dregs = fn.vec(ops[0])
    if len(dregs) != n // 2:
        raise fn.unsupported(f"{len(dregs)} accumulator registers for N = {n}")
    reg_a = ops[1].strip().startswith("{")
    # descriptor A: D, da, db, scale-d, sa, sb, ta, tb; register A: D, {a}, db, scale-d, sa, sb, tb
    if len(ops) != (7 if reg_a else 8):
        raise fn.unsupported("wgmma.mma_async operand count")
    for s in ops[4:6]:
        if s.strip() != "1":
            raise fn.unsupported(f"imm-scale {s.strip()} (only 1: the emulator does not negate operands)")
    tb = ops[-1].strip()
    ta = "0" if reg_a else ops[6].strip()
    if ta not in ("0", "1") or tb not in ("0", "1"):
        raise fn.unsupported("imm-trans must be 0 or 1")
    d_tuple = fn.tuples[tuple(fn.reg(r).cname for r in dregs)]
    scale = ops[3].strip()
    sd = fn.src(scale, "pred") if fn.reg(scale) is not None else ("true" if scale != "0" else "false")
    bf16 = "true" if m.group(2) == "bf16" else "false"
    out = ["{"]
    touched = [d_tuple]
    if reg_a:
        aregs = fn.vec(ops[1])
        a_tuple = fn.tuples[tuple(fn.reg(r).cname for r in aregs)]
        touched.append(a_tuple)
        # hopper.h poisons the A registers it is handed until the retiring wait: a per-tuple stage,
        # loaded unless another wgmma in flight holds it (it then reads the saved values).
        out.append(f"if (wgt.group[{a_tuple.tid}] < 0) {{ " + " ".join(
            f"wgsa_{a_tuple.tid}[{i}] = {fn.src(r, 'b32')};" for i, r in enumerate(aregs)) + " }")
        a_ptr, da = f"wgsa_{a_tuple.tid}", "0ull"
    else:
        a_ptr, da = "nullptr", fn.src(ops[1], "b64")
    for tup in touched:
        out.append(f"if (wgt.touched_line[{tup.tid}]) fagen_emu::px::hazard(ptx_file, {inst.line}, \"wgmma.mma_async "
                   f"issued without wgmma.fence after its {'accumulator' if tup.kind == 'D' else 'A fragment'} "
                   f"registers were accessed at PTX line %d\", wgt.touched_line[{tup.tid}]);")
    # C from the registers unless the tuple is in flight (then the pending result chains).
    out.append(f"if (wgt.group[{d_tuple.tid}] < 0) {{ " + " ".join(
        f"wgst_{d_tuple.tid}[{i}] = {fn.src(r, 'f32')};" for i, r in enumerate(dregs)) + " }")
    out.append(f"fagen_emu::px::wg_aligned(4, \"wgmma.mma_async.sync.aligned\", {fn.site()});")
    if fn.gw:  # the warpgroup has arrived: its shared operands must be visible to the async proxy
        out.append(f"if ((fagen_emu_state.cur->index & 127u) == 0u) fagen_emu::px::gw_check_wgmma("
                   f"{'false' if reg_a else 'true'}, {da if not reg_a else '0ull'}, {fn.src(ops[2], 'b64')}, {n}, "
                   f"{ta}, {tb}, {fn.site()});")
    out.append(f"fagen_emu::hopper::wgmma({bf16}, {n}, {ta}, {tb}, wgst_{d_tuple.tid}, {a_ptr}, {da}, "
               f"{fn.src(ops[2], 'b64')}, {sd} ? 1 : 0, {fn.site()});")
    for tup in touched:
        out.append(f"if (wgt.group[{tup.tid}] < 0) ++wgt.inflight; wgt.group[{tup.tid}] = wgt.commits; "
                   f"wgt.line[{tup.tid}] = {inst.line};")
    out.append("}")
    return " ".join(out)


# --------------------------------------------------------------------------- driver
def _collect_decls(fn: _Fn, stmts: list[Stmt]) -> None:
    """Scopes, registers and labels of the body (first pass)."""
    for st in stmts:
        if st.kind == "open":
            fn.scope_parent[int(st.text)] = st.scope
    for st in stmts:
        if st.kind == "label":
            fn.labels.setdefault(st.scope, {})[st.text] = f"L{st.scope}_{_ident(st.text)}"
        elif st.kind == "decl":
            toks = st.text.split()
            if toks[0] == ".reg":
                types = [t for t in toks[1:] if t.startswith(".") and t.lstrip(".") in _STORE]
                if len(types) != 1:
                    raise PtxUnsupportedError(".reg", "register declaration with an unknown type", st.line,
                                              fn.entry.name, st.text)
                ptype = types[0].lstrip(".")
                rest = st.text.split(types[0], 1)[1]
                for name in (x.strip() for x in rest.split(",")):
                    if not name:
                        continue
                    rm = re.fullmatch(r"(%?[\w$]+)<(\d+)>", name)
                    if rm:
                        fn.ranges.setdefault(st.scope, {})[rm.group(1)] = (int(rm.group(2)), ptype)
                        for i in range(int(rm.group(2))):
                            fn.decls.append(f"{_STORE[ptype]} {_mangle(rm.group(1) + str(i), st.scope)} = 0;")
                    else:
                        if "[" in name or "<" in name:
                            raise PtxUnsupportedError(".reg", "vector / array registers", st.line, fn.entry.name,
                                                      st.text)
                        fn.regs.setdefault(st.scope, {})[name] = _Reg(_mangle(name, st.scope), ptype)
                        fn.decls.append(f"{_STORE[ptype]} {_mangle(name, st.scope)} = 0;")
            elif toks[0] == ".local":
                lm = re.search(r"\.align\s+(\d+)\s+\.(\w+)\s+([\w$]+)\[(\d+)\]", st.text)
                if not lm:
                    raise PtxUnsupportedError(".local", "local declaration form", st.line, fn.entry.name, st.text)
                nbytes = type_size(lm.group(2)) * int(lm.group(4))
                fn.local_depot.append(lm.group(3))
                fn.decls.append(f"alignas({max(int(lm.group(1)), 16)}) unsigned char ptx_local_{_ident(lm.group(3))}"
                                f"[{nbytes}];")
            elif toks[0] in (".pragma", ".loc", ".file"):
                pass
            else:
                raise PtxUnsupportedError(toks[0], "directive inside a function body", st.line, fn.entry.name,
                                          st.text)


def _collect_tuples(fn: _Fn, insts: list[Inst]) -> None:
    for inst in insts:
        if not inst.opcode.startswith("wgmma.mma_async"):
            continue
        fn.cur = inst
        try:
            dregs = fn.vec(inst.operands[0])
        except (PtxUnsupportedError, IndexError):
            continue
        groups = [("D", dregs)]
        if len(inst.operands) > 1 and inst.operands[1].strip().startswith("{"):
            groups.append(("A", fn.vec(inst.operands[1])))
        for kind, regs in groups:
            rs = [fn.reg(r) for r in regs]
            if any(r is None for r in rs):
                raise fn.unsupported("wgmma operand is not a declared register")
            key = tuple(r.cname for r in rs)
            if key not in fn.tuples:
                if len(fn.tuples) >= 64:
                    raise fn.unsupported("more than 64 wgmma register tuples in one kernel")
                fn.tuples[key] = _Tuple(len(fn.tuples), key, kind, len(regs))
            elif fn.tuples[key].kind != kind:
                raise fn.unsupported("the same registers are a wgmma accumulator and an A fragment")
    for tup in fn.tuples.values():
        for r in tup.regs:
            fn.reg_tuples.setdefault(r, []).append(tup.tid)


_REG_TOKEN = re.compile(r"%?[A-Za-z_$][\w$]*")


def _hazard_checks(fn: _Fn, inst: Inst) -> str:
    """The in-flight check of every tracked register the instruction reads or writes."""
    if not fn.reg_tuples or inst.opcode.startswith("wgmma."):
        return ""
    tids: dict[int, str] = {}
    for tok in _REG_TOKEN.findall(" ".join(inst.operands) + (" " + inst.guard.lstrip("!") if inst.guard else "")):
        r = fn.reg(tok)
        if r is None:
            continue
        for tid in fn.reg_tuples.get(r.cname, ()):
            tids.setdefault(tid, tok)
    if not tids:
        return ""
    kinds = {t.tid: t.kind for t in fn.tuples.values()}
    checks = " ".join(
        f"if (wgt.group[{tid}] >= 0) fagen_emu::px::hazard(ptx_file, {inst.line}, \"register {tok} is "
        f"{'an accumulator' if kinds[tid] == 'D' else 'in the A fragment'} of the wgmma.mma_async at PTX line %d, "
        f"still in flight (commit group %d): {inst.opcode} accesses it before the wgmma.wait_group that "
        f"retires it\", wgt.line[{tid}], wgt.group[{tid}]);"
        for tid, tok in tids.items())
    marks = " ".join(f"wgt.touched_line[{tid}] = {inst.line};" for tid in tids)
    return f"if (wgt.inflight) {{ {checks} }} {marks} "


def _is_bulk_store(inst: Inst) -> bool:
    """cp.async.bulk[.tensor] stores and cp.reduce.async.bulk[.tensor]: the async proxy reads shared memory."""
    p = inst.parts
    return (p[:2] == ["cp", "reduce"] or p[:3] == ["cp", "async", "bulk"]) and "bulk_group" in p


def _entry_checks(fn: _Fn, insts: list[Inst], racecheck: bool) -> None:
    """Which of the PTX level's memory checks the entry needs (see _Fn)."""
    fn.cp = any(i.parts[:2] == ["cp", "async"] and "bulk" not in i.parts for i in insts)
    fn.bulk = any(_is_bulk_store(i) for i in insts)
    fn.gw = fn.bulk or any(i.opcode.startswith("wgmma.mma_async") for i in insts)
    fn.racecheck = racecheck


def _memory_hooks(fn: _Fn, inst: Inst) -> str:
    """Statements before a memory instruction: the cp.async destination check (entries with
    cp.async), the note of a generic-proxy write (entries whose async proxy reads shared memory),
    the racecheck event (racecheck translations)."""
    if not (fn.cp or fn.gw or fn.racecheck):
        return ""
    op, mods = inst.parts[0], inst.parts[1:]
    what = f'"{inst.opcode}"'
    out: list[str] = []
    if op in ("ld", "ldu", "st", "atom", "red"):
        sp = _space(mods)
        types = [m for m in mods if m in _CT]
        if sp not in ("shared", "generic", "global") or len(types) != 1 or types[0] == "pred":
            return ""
        vn = next((int(m[1:]) for m in mods if m in ("v2", "v4", "v8")), 1)
        size = type_size(types[0]) * vn
        addr_op = inst.operands[0] if op in ("st", "red") else inst.operands[1]
        ptr = fn.host(addr_op, sp)
        write = op == "st"
        if sp != "global":
            if fn.cp:
                out.append(f"fagen_emu::px::cp_check({ptr}, {size}, {1 if write else 0}, {what}, {fn.site()});")
            if fn.gw and op in ("st", "atom", "red"):
                out.append(f"fagen_emu::px::gw_note({ptr}, {size}, {inst.line});")
        if fn.racecheck and (sp != "global" or write):
            rop = "kWrite" if write else ("kRead" if op in ("ld", "ldu") else "kAtomic")
            out.append(f"{{ static uint32_t rw_; fagen_emu::px::rc_access({ptr}, {size}, fagen_emu::race::{rop}, rw_, "
                       f"{fn.site()}, {what}); }}")
    elif op in ("ldmatrix", "stmatrix") and (fn.cp or fn.gw):
        num = next((int(m[1]) for m in mods if m in ("x1", "x2", "x4")), 1)
        ptr = fn.host(inst.operands[1] if op == "ldmatrix" else inst.operands[0], "shared")
        # lanes 8i .. 8i + 7 give the 16-byte rows of matrix i
        row = []
        if fn.cp:
            row.append(f"fagen_emu::px::cp_check({ptr}, 16, {2 if op == 'ldmatrix' else 1}, {what}, {fn.site()});")
        if fn.gw and op == "stmatrix":
            row.append(f"fagen_emu::px::gw_note({ptr}, 16, {inst.line});")
        if row:
            out.append(f"if (fagen_emu::px::laneid() < {8 * num}u) {{ {' '.join(row)} }}")
    if not out:
        return ""
    return " ".join(out) + " "


def translate_entry(mod: Module, entry: Entry, ptx_file: str, globals_: dict[str, str],
                    shared: dict[str, int], sites: list | None = None, racecheck: bool = False,
                    static_smem: int = 0) -> str:
    """``sites``: with memory counters (counters.py), the module's site list, appended to.
    ``racecheck``: every load, store and atomic also reports to racecheck.h (a build with
    -DFAGEN_EMU_RACECHECK). ``static_smem``: the static shared bytes before the dynamic window."""
    fn = _Fn(mod, entry, ptx_file, globals_, shared)
    fn.static_smem = static_smem
    _collect_decls(fn, entry.body)
    insts: list[Inst] = []
    for st in entry.body:
        if st.kind == "inst":
            insts.append(parse_inst(st))
    _collect_tuples(fn, insts)
    _entry_checks(fn, insts, racecheck)
    loops = _counters.tile_loop_ranges(fn, insts) if sites is not None else []
    site0 = len(sites) if sites is not None else 0
    body: list[str] = []
    it = iter(insts)
    for st in entry.body:
        if st.kind == "label":
            body.append(f"{fn.labels[st.scope][st.text]}: ;")
            continue
        if st.kind != "inst":
            continue
        inst = next(it)
        fn.cur = inst
        handler = _HANDLERS.get(inst.parts[0])
        if inst.parts[0] in ("shfl", "vote", "elect", "mma", "ldmatrix", "stmatrix", "setmaxnreg") and \
                (len(inst.parts) < 2 or inst.parts[1] != "sync"):
            if inst.parts[0] != "setmaxnreg":
                raise fn.unsupported(f"{inst.parts[0]} without .sync")
        if handler is None:
            raise fn.unsupported("opcode not implemented by the translator")
        code = handler(fn, inst)
        code = _hazard_checks(fn, inst) + _memory_hooks(fn, inst) + code
        where = counter_site(fn, inst) if sites is not None else None
        if where is not None:  # memory counters: every lane notes its issue, active or predicated off
            kind, size, num, a0, a1 = where
            i = len(sites)
            sites.append(_counters.Site(i, entry.name, inst.line, inst.opcode, _counters.KIND_NAMES[kind], size,
                                        any(lo <= inst.line <= hi for lo, hi in loops)))
            pg = fn.src(inst.guard, "pred") if inst.guard else "true"
            code = (f"{{ const bool pg_ = {pg}; fagen_emu::pxc::note({i}u, {kind}, {size}, {num}, "
                    f"pxc_k[{i - site0}]++, pg_, {a0}, {a1}); if (pg_) {{ {code} }} }}")
        elif inst.guard:
            code = f"if ({fn.src(inst.guard, 'pred')}) {{ {code} }}"
        body.append(f"/* {inst.line} */ {code}")
    ntup = max(len(fn.tuples), 1)
    stage = [f"float wgst_{t.tid}[{t.n}];" if t.kind == "D" else f"uint32_t wgsa_{t.tid}[{t.n}];"
             for t in fn.tuples.values()]
    head = [f"// PTX entry {entry.name} (line {entry.line})",
            f"static void ptx_entry_{_ident(entry.name)}(void** fagen_args) {{",
            "    (void)fagen_args;",
            "    static const char* const ptx_file = fagen_ptx_file;",
            f"    struct {{ int group[{ntup}]; int line[{ntup}]; int touched_line[{ntup}]; int commits; int inflight; }} wgt;",
            f"    for (int i_ = 0; i_ < {ntup}; ++i_) wgt.group[i_] = -1, wgt.line[i_] = 0, wgt.touched_line[i_] = 0;",
            "    wgt.commits = 0; wgt.inflight = 0; (void)wgt;"]
    head += ["    " + d for d in fn.decls + stage]
    if sites is not None and len(sites) > site0:
        head.append(f"    uint32_t pxc_k[{len(sites) - site0}] = {{}};  // per-site execution counts (counters.h)")
    return "\n".join(head + ["    " + b for b in body] + ["}"])


@dataclass
class Translation:
    cpp: str
    entries: list[str]
    params: dict[str, int] = field(default_factory=dict)   # entry -> parameter count
    sites: list = field(default_factory=list)   # memory counters: the counters.Site of each memory instruction
    #: bytes of static ``.shared`` variables at the start of the window (the launch adds them to the
    #: dynamic shared memory; the dynamic window starts after them)
    static_smem: int = 0


def _static_shared(mod: Module) -> tuple[dict[str, int], int]:
    """Offsets of the module's shared variables in the block's window: the static ones first, in
    declaration order at their alignment, then the dynamic (``extern``) ones at the static bytes
    rounded up to 1024 (the window stays 1024-byte aligned for the swizzles); and that size."""
    shared: dict[str, int] = {}
    off = 0
    for gv in mod.globals:
        if gv.space != "shared" or gv.extern:
            continue
        if gv.count == 0:
            raise PtxUnsupportedError(".shared", "an unsized static shared array", gv.line, "", gv.name)
        if gv.init:
            raise PtxUnsupportedError(".shared", "an initialised shared variable", gv.line, "", gv.name)
        align = max(gv.align, 1)
        off = (off + align - 1) // align * align
        shared[gv.name] = off
        off += type_size(gv.vtype) * (gv.count or 1)
    static = (off + 1023) // 1024 * 1024
    for gv in mod.globals:
        if gv.space == "shared" and gv.extern:
            shared[gv.name] = static
    return shared, static


def _globals(mod: Module) -> tuple[list[str], dict[str, str], dict[str, int]]:
    decls: list[str] = []
    addrs: dict[str, str] = {}
    shared, _ = _static_shared(mod)
    for gv in mod.globals:
        if gv.space == "shared":
            continue
        size = type_size(gv.vtype)
        count = gv.count if gv.count else 1
        nbytes = size * count
        data = bytearray(nbytes)
        for i, v in enumerate(gv.init):
            v = v.strip()
            if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", v):
                b = int(v[2:], 16).to_bytes(4, "little")
            elif re.fullmatch(r"0[dD][0-9a-fA-F]{16}", v):
                b = int(v[2:], 16).to_bytes(8, "little")
            elif re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", v):
                b = (int(v, 0) & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
            else:
                raise PtxUnsupportedError(f".{gv.space}", f"initializer {v!r}", gv.line, "", gv.name)
            data[i * size:(i + 1) * size] = b
        cname = f"ptx_global_{_ident(gv.name)}"
        decls.append(f"alignas({max(gv.align, 16)}) static unsigned char {cname}[{max(nbytes, 1)}] = "
                     f"{{{', '.join(str(x) for x in data) or '0'}}};")
        addrs[gv.name] = f"uint64_t(reinterpret_cast<uintptr_t>({cname}))"
    return decls, addrs, shared


def translate(ptx: str, ptx_file: str = "kernel.ptx", counters: bool = False, racecheck: bool = False) -> Translation:
    """C++ for every ``.entry`` of ``ptx`` (functions ``ptx_entry_<name>(void** args)``); with
    ``counters``, every memory instruction also notes its access for counters.h (the
    translation's ``sites``); with ``racecheck``, every load, store and atomic reports to
    racecheck.h (compile with -DFAGEN_EMU_RACECHECK: :func:`fagen.emulator.ptx.build_ptx`'s
    ``racecheck=True``)."""
    mod = parse_module(ptx)
    if mod.address_size != 64:
        raise PtxUnsupportedError(".address_size", "only 64-bit addressing", 0)
    decls, addrs, shared = _globals(mod)
    _, static_smem = _static_shared(mod)
    out = [f"// translated from PTX by fagen.emulator.ptx (translator {TRANSLATOR_VERSION}; {mod.target})",
           f'static const char* const fagen_ptx_file = "{ptx_file}";',
           "[[maybe_unused]] static const int fagen_ptx_file_set = (fagen_emu::px::fagen_ptx_file_name = fagen_ptx_file, 0);",
           *decls]
    sites: list | None = [] if counters else None
    for e in mod.entries:
        out.append(translate_entry(mod, e, ptx_file, addrs, shared, sites, racecheck, static_smem))
    return Translation("\n".join(out) + "\n", [e.name for e in mod.entries],
                       {e.name: len(e.params) for e in mod.entries}, sites=sites or [], static_smem=static_smem)


def counter_site(fn: _Fn, inst: Inst) -> tuple[int, int, int, str, str] | None:
    """(kind, size, num, address expression, second address expression) of a memory instruction,
    None for any other (and for local / param / const accesses)."""
    op = inst.parts[0]
    mods = inst.parts[1:]
    if op in ("ld", "ldu", "st", "atom", "red"):
        sp = _space(mods)
        kind = {"shared": _counters.SHARED, "global": _counters.GLOBAL, "generic": _counters.GENERIC}.get(sp)
        if kind is None:
            return None
        types = [m for m in mods if m in _CT]
        if len(types) != 1 or types[0] == "pred":
            return None
        vn = next((int(m[1:]) for m in mods if m in ("v2", "v4", "v8")), 1)
        size = type_size(types[0]) * vn
        addr_op = inst.operands[0] if op in ("st", "red") else inst.operands[1]
        return kind, size, 1, fn.address(addr_op), "0"
    if op in ("ldmatrix", "stmatrix"):
        num = next((int(m[1]) for m in mods if m in ("x1", "x2", "x4")), 1)
        addr_op = inst.operands[1] if op == "ldmatrix" else inst.operands[0]
        return _counters.MATRIX, 16, num, fn.address(addr_op), "0"
    if op == "cp" and "bulk" in inst.parts and "commit_group" not in inst.parts and "wait_group" not in inst.parts:
        if "tensor" in inst.parts:
            rank = next((int(m[0]) for m in inst.parts if len(m) == 2 and m[1] == "d" and m[0].isdigit()), 0)
            loads = "shared::cluster" in inst.parts and inst.parts.index("shared::cluster") < inst.parts.index("global")
            base, _ = _tmap_operand(fn, inst.operands[1] if loads else inst.operands[0], rank)
            return _counters.BULK, 0, 0, f"fagen_emu::pxc::tma_bytes(fagen_emu::px::hp({base}))", "0"
        return _counters.BULK, 0, 0, f"uint64_t({fn.src(inst.operands[2], 'u32')})", "0"
    if op == "cp" and inst.parts[1:2] == ["async"] and len(inst.parts) > 2 and inst.parts[2] in (
            "ca", "cg", "shared", "shared::cta") and len(inst.operands) >= 3:
        try:
            size = int(inst.operands[2].strip(), 0)
        except ValueError:
            return None
        return _counters.CP_ASYNC, size, 1, fn.address(inst.operands[0]), fn.address(inst.operands[1])
    return None
