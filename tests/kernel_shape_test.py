#!/usr/bin/env python3
"""The matvec kernels' code shape, proven without a GPU (issue 19).

Compiles kernels/matvec.cu to PTX for one architecture and checks every
grouped_matvec_kernel instance: it exists for each weight type the engine
serves; it makes at most one 8-bit global load (the rank's missed flag of an
expert pass; the weight stream is read in 16- and 32-bit words, mxfp4's
17-byte blocks in aligned words joined by funnel shifts); the quant
types use dp4a; and ptxas assembles it without register spills. qkv_kernel
(every type behind one switch) makes no 8-bit load, uses dp4a and does not
spill either; nor do the two chained_matvec_kernel instances (two launches in
one: gate/up then down, attn_out then the router; each behind a switch), which
make at most the missed flag's 8-bit load in each of the two. In
kernels/dense.cu, the attention kernel of the f16 cache reads its keys and
values in 16-byte loads, and so does the prefill's: no 8- or 16-bit global
load. In every
kernel of kernels/*.cu, griddepcontrol.wait (wait_for_prior_grids,
kernels/launch.cuh) comes before the first global (or generic) load, store or
atomic, and griddepcontrol.launch_dependents follows it: a kernel launched
programmatically may start before the one it follows has finished.

Memory-level parallelism of the weight stream. A matvec at decode streams its
weights once; what bounds it is how many weight bytes each thread has in
flight before it must wait for one. For every weight-streaming kernel (each
grouped_matvec_kernel<T>, qkv_kernel and chained_matvec_kernel) the test measures,
from the PTX and ptxas -v:

  1. ptxas -v of the entry: a 0-byte stack frame and no spill stores or loads.
     "Used N registers" is recorded for the occupancy arithmetic.
  2. The weight loads in flight per thread before the first consumer. The
     first consumer is the body's first dp4a (quant types, qkv_kernel,
     chained_matvec_kernel) or first fma.rn.f32 (f32, f16, bf16). If a later branch jumps back to a label
     before it (it lies in a loop) the window starts at that loop head (the
     nearest such label: the innermost loop), else at the kernel's entry; it
     ends at the consumer. A global load (ld.global*, any cache qualifier and
     vector width) or a generic one (ld with no state space: a pointer read
     from a __grid_constant__ struct comes out so; the table counts them) in
     the window is a weight load when its address derives from the contents
     of the kernel's first parameter (<kernel>_param_0). The derivation is a
     data-flow taint over the PTX virtual registers, flow-insensitive (every
     definition of a register counts: loops reassign them), from each
     instruction's sources to its destinations. It has two kinds: the param
     symbol itself (mov, cvta.param: param 0's address) and what a load reads
     through it or through any value of param 0 (ld.param [param_0(+off)], a
     weight pointer, a loaded slot index multiplied into an address that adds
     a param-0 pointer: all values of param 0). A generic load of the struct
     itself is not a weight load; one through a value read from it is. Local
     and call-parameter memory count as one cell (what st.local or st.param
     writes, ld.local or ld.param of a call's symbol reads); shared and generic
     memory are followed only through addresses. Scoped `{ .reg ... }` names
     (inline asm) are renamed per scope. A weight load whose address derives
     (backward over every definition) from another weight load in the same
     window is dependent: it cannot be in flight with that one, so it does not
     count as independent. Widths are the whole instruction's (type bits x
     vector count); "narrow" means under 32 bits. The order is PTX's: ptxas
     may still hoist loads over consumers in SASS, so the count is the
     compiler's front end's promise, a lower bound.
     By convention param 0 of the matvec kernels holds only weight pointers
     (w[0], w[1], slots); activations, outputs and tables are in param 1.
  3. The control: llama.cpp's ggml mul_mat_vec_q (ncols_dst 1, no fusion,
     small_k and halve_iters off) for q8_0, q4_K and q6_K, from
     SOURCE_DIR/build-peer/llama.cpp (or a clone of the node-llama-cpp release
     bundle under tools/llama-crosscheck; skipped, with a line saying so, when
     neither is there), compiled with nvcc -ptx and cut down to the module's
     declarations, its .func's and those .entry bodies for ptxas -v. Its
     param 0 is vx, the weights.

  Shared criterion, ggml's and ours: >= 4 independent weight loads of >= 16
  bits before the first consumer, a 0-byte stack frame, no spills. If ggml
  misses it, the measurement is wrong and the test fails. Ours additionally:
  >= 4 independent weight loads of >= 32 bits and no weight load under 32 bits
  in the window. A markdown table of both is printed (with each kernel's
  registers). Before any of it, the parser runs on a small hand-written entry
  (scoped inline-asm names, predicates, vector operands, a slot-index chain, a
  table indexed by weights, generic loads, a call's parameters) and must find
  exactly its weight loads.

The Gated DeltaNet's state (kernels/delta_net.cu, param 0 of
delta_net_mix_kernel) is streamed at every token as a matvec's weights are,
but its loop is no dot product with one consumer: stream_runs counts, in
program order, the state loads issued before an instruction first reads one
of them. Every run must hold >= MIN_STATE_IN_FLIGHT (16: four rows of a
head_dim-128 state at a lane's 4 keys each). The kernel before it loaded a
row's keys one at a time, each used at once: runs of 1.

Usage: kernel_shape_test.py NVCC SOURCE_DIR ARCH   (exit 0: pass, 1: fail)
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

# GgmlType ids (loader/ggml_type.h) of the types the grouped matvec takes.
QUANT_TYPES = {8: "q8_0", 2: "q4_0", 12: "q4_K", 13: "q5_K", 14: "q6_K", 3: "q4_1", 6: "q5_0",
               7: "q5_1", 10: "q2_K", 11: "q3_K", 20: "iq4_nl", 23: "iq4_xs", 39: "mxfp4"}
ELEMENT_TYPES = {0: "f32", 1: "f16", 30: "bf16"}
# ggml's mul_mat_vec_q instances of the control (ggml_type ids are GgmlType's).
GGML_CONTROL_TYPES = (8, 12, 14)
GGML_BUNDLE = os.path.join("tools", "llama-crosscheck", "node_modules", "node-llama-cpp", "llama",
                           "gitRelease.bundle")
MIN_IN_FLIGHT = 4
MIN_STATE_IN_FLIGHT = 16

# --- PTX parsing -------------------------------------------------------------------------------

COMMENT = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/\*.*?\*/', re.S)
FUNCTION_HEAD = re.compile(r"^[ \t]*(?:\.(?:visible|weak|extern)[ \t]+)*\.(entry|func)\b", re.M)
PUNCTUATION = re.compile(r"[{}();]")
TOKEN = re.compile(r"(?<![\w$.%])%?[A-Za-z_$][\w$]*")
LABEL = re.compile(r"\s*([$\w]+):")
INSTRUCTION = re.compile(r"(?:@!?(%?[\w$]+)\s+)?([A-Za-z_][\w.:]*)\s*(.*)", re.S)
# Instructions whose first operand is not a destination register.
NO_DEST = {"bra", "brx", "call", "ret", "exit", "bar", "barrier", "membar", "fence",
           "griddepcontrol", "trap", "brkpt", "nanosleep", "pmevent", "stackrestore", "setmaxnreg"}
MEMORY = "@mem"  # local and call-parameter memory, one cell
CARRY = "@cc"
STATE_SPACES = {"global", "local", "shared", "param", "const", "tex"}
PARAM_ADDRESS, PARAM_VALUE = 1, 2  # taint kinds: param 0's address, a value read from it
WeightLoad = collections.namedtuple("WeightLoad", "text bits vector dependent generic")


def strip_comments(text):
    return COMMENT.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", text)


def module_functions(text):
    """(kind, name, start, end) of every .entry and .func of a comment-free PTX module."""
    functions = []
    pos = 0
    while True:
        head = FUNCTION_HEAD.search(text, pos)
        if head is None:
            return functions
        depth, end = 0, len(text)
        for mark in PUNCTUATION.finditer(text, head.end()):
            c = mark.group()
            if c in "({":
                depth += 1
            elif c in ")}":
                depth -= 1
                if depth == 0 and c == "}":
                    end = mark.end()
                    break
            elif depth == 0:  # ';': a declaration without a body
                end = mark.end()
                break
        rest = text[head.end():end].lstrip()
        if rest.startswith("("):  # a .func's return parameters
            rest = rest[rest.index(")") + 1:].lstrip()
        name = re.match(r"[\w$]*", rest).group()
        functions.append((head.group(1), name, head.start(), end))
        pos = end


def entries(text):
    """{name: body} of a comment-free PTX module's .entry definitions, body inside its braces."""
    bodies = {}
    for kind, name, start, end in module_functions(text):
        item = text[start:end]
        if kind != "entry" or not item.rstrip().endswith("}"):
            continue
        depth = 0
        for i, c in enumerate(item):  # the parameter list
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    break
        open_brace = item.index("{", i)
        bodies[name] = item[open_brace + 1:item.rindex("}")]
    return bodies


def split_operands(text):
    if not any(c in text for c in "[{("):
        return [part.strip() for part in text.split(",")] if text.strip() else []
    parts, depth, current = [], 0, []
    for c in text:
        if c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(c)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def load_bits(parts):
    """A load's width: (type bits, vector count) from its opcode's parts."""
    vector, bits = 1, 0
    for part in parts[1:]:
        m = re.fullmatch(r"v(\d+)|[bsuf](\d+)(?:x(\d+))?", part)
        if m and m.group(1):
            vector = int(m.group(1))
        elif m:
            bits = int(m.group(2)) * int(m.group(3) or 1)
    return bits, vector


class Instruction:
    __slots__ = ("op", "parts", "dests", "srcs", "addr", "root", "text", "target")

    def __init__(self, op, text):
        self.op, self.parts, self.text = op, op.split("."), text
        self.dests, self.srcs, self.addr, self.root, self.target = [], [], [], False, None

    def is_load(self):
        return self.parts[0] in ("ld", "ldu")

    def space(self):
        """The state space of a load or store, "" for a generic one."""
        return next((p.split("::")[0] for p in self.parts[1:]
                     if p.split("::")[0] in STATE_SPACES), "")

    def width(self):
        return load_bits(self.parts)


def parse_body(body, kernel):
    """The body's instructions (Instruction) and labels {label: index of the next instruction}."""
    param0 = kernel + "_param_0"
    own_param = re.compile(re.escape(kernel) + r"_param_\d+")
    instructions, labels = [], {}
    scopes = []  # (id, names, prefixes) of the open `{ }` blocks
    next_scope = [0]

    def local(token):
        for scope_id, names, prefixes in reversed(scopes):
            if token in names or any(re.fullmatch(re.escape(p) + r"\d+", token) for p in prefixes):
                return f"{token}@{scope_id}"
        return None

    def registers(operand, instruction):
        found = []
        for token in TOKEN.findall(operand):
            renamed = local(token) if scopes else None
            if renamed is not None:
                found.append(renamed)
            elif token.startswith("%"):
                found.append(token)
            elif token == param0:
                instruction.root = True
        return found

    for chunk in body.split(";"):
        text = chunk
        while True:
            text = text.lstrip()
            if text.startswith("{"):
                next_scope[0] += 1
                scopes.append((next_scope[0], set(), []))
                text = text[1:]
            elif text.startswith("}"):
                if scopes:
                    scopes.pop()
                text = text[1:]
            else:
                label = LABEL.match(text)
                if label is None:
                    break
                labels[label.group(1)] = len(instructions)
                text = text[label.end():]
        if not text:
            continue
        if text.startswith("."):
            if text.startswith(".reg") and scopes:
                names = re.sub(r"^\.reg(\s+\.\w+)+", "", text)
                for name in (n.strip() for n in names.split(",")):
                    prefix = re.fullmatch(r"(%?[\w$]+)<\d+>", name)
                    if prefix:
                        scopes[-1][2].append(prefix.group(1))
                    elif name:
                        scopes[-1][1].add(name)
            continue
        match = INSTRUCTION.match(text)
        if match is None:
            continue
        op = match.group(2)
        ins = Instruction(op, " ".join(text.split()))
        operands = split_operands(match.group(3))
        base = ins.parts[0]
        if base in ("ld", "ldu") and len(operands) >= 2:
            ins.dests = registers(operands[0], ins)
            ins.addr = registers(operands[1], ins)
            ins.srcs = list(ins.addr)
            # ld.local, or ld.param of a call's symbol (retval0): what st.local/st.param wrote.
            # Kernel parameters are read by their symbol or through a register holding one.
            symbols = [t for t in TOKEN.findall(operands[1])
                       if not t.startswith("%") and (not scopes or local(t) is None)]
            if "local" in ins.parts or ("param" in ins.parts and any(
                    not own_param.fullmatch(t) for t in symbols)):
                ins.srcs.append(MEMORY)
        elif base == "st" and ("local" in ins.parts or "param" in ins.parts):
            ins.dests = [MEMORY]
            ins.srcs = [r for operand in operands[1:] for r in registers(operand, ins)]
            registers(operands[0], ins)
        elif base in NO_DEST or not operands or operands[0].startswith("["):
            ins.srcs = [r for operand in operands for r in registers(operand, ins)]
            if base == "bra" and operands:
                ins.target = operands[-1].strip()
        else:
            ins.dests = registers(operands[0], ins)
            ins.srcs = [r for operand in operands[1:] for r in registers(operand, ins)]
        if "cc" in ins.parts:
            ins.dests.append(CARRY)
        if base in ("addc", "subc", "madc"):
            ins.srcs.append(CARRY)
        instructions.append(ins)
    return instructions, labels


def taint(instructions):
    """{register: PARAM_ADDRESS | PARAM_VALUE}: how each derives from param 0.

    A fixpoint over every definition. The param symbol itself (mov, cvta.param) is an
    address in the param space; what a load reads through it, or through any value of
    param 0, is a value (a weight pointer, a slot, a weight).
    """
    kinds = {}
    changed = True
    while changed:
        changed = False
        for ins in instructions:
            kind = 0
            if ins.is_load():
                if ins.root or any(kinds.get(r) for r in ins.addr):
                    kind = PARAM_VALUE
                if MEMORY in ins.srcs:
                    kind |= kinds.get(MEMORY, 0)
            else:
                for s in ins.srcs:
                    kind |= kinds.get(s, 0)
                if ins.root:
                    kind |= PARAM_ADDRESS
            if kind:
                for d in ins.dests:
                    if kinds.get(d, 0) | kind != kinds.get(d, 0):
                        kinds[d] = kinds.get(d, 0) | kind
                        changed = True
    return kinds


def weight_window(body, kernel, consumer):
    """The weight loads before a consumer (an opcode regex) of an entry's body, in
    its fewest-loaded K loop.

    Every loop (a branch back to a label) that holds a consumer and a weight load
    has a window: from its head to its first consumer. A consumer outside every loop (a peeled first
    trip) has the window from the entry. A kernel with several paths (a pair and a
    single matrix) has a loop each; the window with the fewest independent weight
    loads is the one returned. Returns a dict: consumer (index or None), start
    (label or "entry"), loads: the WeightLoads in program order.
    """
    instructions, labels = parse_body(body, kernel)
    consumers = [i for i, ins in enumerate(instructions) if consumer.match(ins.op)]
    result = {"consumer": None, "start": "entry", "loads": [], "size": len(instructions)}
    if not consumers:
        return result
    kinds = taint(instructions)
    is_weight = [ins.is_load() and ins.space() in ("global", "") and
                 any(kinds.get(r, 0) & PARAM_VALUE for r in ins.addr) for ins in instructions]
    windows = {}  # first consumer -> window start (label index, or 0 and "entry")
    for i, ins in enumerate(instructions):
        head = labels.get(ins.target)
        if head is None or head > i:
            continue
        # A K loop streams weights: an epilogue's loop of fmas (a combine, a norm) is not one.
        inside = [c for c in consumers if head <= c <= i]
        if inside and any(is_weight[head:i + 1]) and (
                inside[0] not in windows or windows[inside[0]][0] < head):
            windows[inside[0]] = (head, ins.target)
    if consumers[0] not in windows and not any(
            head <= consumers[0] <= c for c, (head, _) in windows.items()):
        windows[consumers[0]] = (0, "entry")
    defs = collections.defaultdict(list)
    for i, ins in enumerate(instructions):
        for d in ins.dests:
            defs[d].append(i)
    best = None
    for first, (lo, start) in sorted(windows.items()):
        window = [j for j in range(lo, first) if is_weight[j]]
        in_window = set(window)
        loads = []
        for j in window:
            seen_regs, seen_defs = set(instructions[j].addr), set()
            stack = list(seen_regs)
            dependent = False
            while stack and not dependent:
                for k in defs[stack.pop()]:
                    if k in seen_defs:
                        continue
                    seen_defs.add(k)
                    if k in in_window:
                        dependent = True
                        break
                    for s in instructions[k].srcs:
                        if s not in seen_regs:
                            seen_regs.add(s)
                            stack.append(s)
            loads.append(WeightLoad(instructions[j].text, *instructions[j].width(),
                                    dependent, instructions[j].space() == ""))
        independent = sum(1 for load in loads if not load.dependent)
        if best is None or independent < best[0]:
            best = (independent, first, start, loads)
    _, result["consumer"], result["start"], result["loads"] = best
    return result


def stream_runs(body, kernel, in_bytes=False):
    """Loads of the param-0 stream in flight at each first use of one (a kernel
    whose K loop is not a dot product's: delta_net_mix_kernel's state rows).

    In program order, a run collects the stream loads (as weight_window's: their
    address derives from param 0) until an instruction reads a register one of
    them wrote, or one's address does; that use ends the run. Returns the runs'
    load counts (their bytes with in_bytes), in order: their minimum is what the
    thread has in flight when it must first wait.
    """
    instructions, _ = parse_body(body, kernel)
    kinds = taint(instructions)
    runs, run, pending = [], 0, set()
    for ins in instructions:
        weight = ins.is_load() and ins.space() in ("global", "") and any(
            kinds.get(r, 0) & PARAM_VALUE for r in ins.addr)
        if pending and any(r in pending for r in ins.srcs):
            runs.append(run)
            run, pending = 0, set()
        if weight:
            bits, vector = ins.width()
            run += bits * vector // 8 if in_bytes else 1
            pending.update(ins.dests)
    if run:
        runs.append(run)
    return runs


def width_summary(loads):
    """'2×32b, 1×4x32b': how many loads of each width (type bits, times the vector count)."""
    counts = collections.Counter((load.bits * load.vector, load.vector) for load in loads)
    return ", ".join(f"{n}×{'' if vector == 1 else f'{vector}x'}{total // vector}b"
                     for (total, vector), n in sorted(counts.items(), reverse=True))


def parser_self_check():
    """The parser on a small hand-written entry: scopes, predicates, vectors, the slot chain."""
    ptx = strip_comments("""
.extern .func sink(.param .b64 sink_param_0);
.visible .entry k(
	.param .align 8 .b8 k_param_0[24],
	.param .align 8 .b8 k_param_1[16]
)
.maxntid 128, 1, 1
{
	.reg .pred %p<3>;
	.reg .b16 %rs<4>;
	.reg .b32 %r<40>;
	.reg .b64 %rd<30>;
	ld.param.u64 %rd2, [k_param_0+16];        // slots (weights)
	mov.b64 %rd20, k_param_1;
	ld.param.u64 %rd3, [%rd20];               // slot_of_rank
	ld.param.u64 %rd4, [%rd20+8];             // x
	cvta.to.global.u64 %rd5, %rd3;
	ld.global.nc.u32 %r1, [%rd5];              // the slot: not a weight load
	mul.wide.s32 %rd6, %r1, 4096;
	cvta.to.global.u64 %rd7, %rd2;
	add.s64 %rd8, %rd7, %rd6;
	cvta.to.global.u64 %rd12, %rd4;
	{ .param .b64 param0;
	st.param.b64 [param0+0], %rd8;            // a call's parameter: not the kernel's
	call.uni sink, (param0); }
	mov.u32 %r2, 0;
$L__BB0_0:
	ld.global.nc.u32 %r30, [%rd8+4];          // weight, before the inner loop's head
$L__BB0_1:
	mad.wide.s32 %rd9, %r2, 16, %rd8;
	ld.global.nc.L1::no_allocate.v4.u32 {%r3, %r4, %r5, %r6}, [%rd9];
	@%p1 ld.global.nc.u32 %r7, [%rd9+64];
	@!%p1 ld.global.nc.u16 %rs1, [%rd9+-80];
	cvt.u32.u16 %r8, %rs1;
	mul.wide.u32 %rd10, %r8, 4;
	add.s64 %rd11, %rd12, %rd10;
	ld.global.u32 %r9, [%rd11];                // a table indexed by weights: dependent
	{ .reg .b32 lo, hi;
	mov.b64 {lo, hi}, %rd9;
	prmt.b32 %r10, lo, hi, 0x5410; }
	{ .reg .b64 t;
	add.s64 t, %rd9, 96;
	mov.b64 %rd15, t; }
	ld.global.nc.u32 %r16, [%rd15];            // through an inline-asm name: a weight load
	mov.b64 %rd21, k_param_0;
	cvta.param.u64 %rd23, %rd21;
	ld.u64 %rd22, [%rd23+8];                  // w[1] read generically from param 0: no weight
	ld.v2.u32 {%r17, %r18}, [%rd22];          // a generic weight load
	ld.global.v2.u32 {%r11, %r12}, [%rd12+8];  // activations: not weights
	{
	.reg .b32 lo;
	mov.b32 lo, %r11;
	add.s32 %r14, lo, 1;
	}
	mul.wide.s32 %rd13, %r14, 4;
	add.s64 %rd14, %rd12, %rd13;
	ld.global.u32 %r15, [%rd14];               // indexed by activations: not weights
	add.s32 %r20, %r12, %r15;
	dp4a.s32.s32 %r20, %r3, %r11, %r20;
	add.s32 %r2, %r2, 1;
	setp.lt.s32 %p2, %r2, 8;
	@%p2 bra $L__BB0_1;
	@%p2 bra.uni $L__BB0_0;
	ret;
}
""")
    body = entries(ptx)["k"]
    window = weight_window(body, "k", re.compile(r"dp4a\."))
    got = [(load.bits, load.vector, load.dependent, load.generic) for load in window["loads"]]
    want = [(32, 4, False, False), (32, 1, False, False), (16, 1, False, False),
            (32, 1, True, False), (32, 1, False, False), (32, 2, False, True)]
    if window["start"] != "$L__BB0_1" or got != want:
        return [f"parser self-check: window from {window['start']}, loads {got}, expected "
                f"$L__BB0_1 and {want}"]
    return []


# --- ptxas -v ----------------------------------------------------------------------------------

def ptxas_properties(log):
    """{function: {stack, spill_stores, spill_loads, registers}} from ptxas -v's output."""
    props = collections.defaultdict(dict)
    current = entry = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([\w$]+)'", line)
        if m:
            entry = m.group(1)
        m = re.search(r"Function properties for ([\w$]+)", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and current:
            props[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m and entry:
            props[entry]["registers"] = int(m.group(1))
    return props


def cut_module(text, keep):
    """A comment-free PTX module with only the .entry bodies named in keep (and every .func)."""
    out, pos = [], 0
    for kind, name, start, end in module_functions(text):
        out.append(text[pos:start])
        if kind == "func" or name in keep:
            out.append(text[start:end])
        pos = end
    out.append(text[pos:])
    return "".join(out)


# --- the weight-stream check ------------------------------------------------------------------


def weight_row(label, window, props, ours):
    """A table row and its failures for one kernel instance."""
    loads = window["loads"]
    independent = [load.bits * load.vector for load in loads if not load.dependent]
    dependent = len(loads) - len(independent)
    wide16 = sum(1 for bits in independent if bits >= 16)
    wide32 = sum(1 for bits in independent if bits >= 32)
    narrow = sum(1 for load in loads if load.bits * load.vector < 32)
    generic = sum(1 for load in loads if load.generic)
    total_bytes = sum(load.bits * load.vector for load in loads) // 8
    problems = []
    if window["consumer"] is None:
        problems.append("no first consumer")
    if not props or "stack" not in props:
        problems.append("no ptxas properties")
        props = {}
    stack = props.get("stack")
    spills = (props.get("spill_stores"), props.get("spill_loads"))
    if stack:
        problems.append(f"{stack}-byte stack frame")
    if any(spills):
        problems.append(f"spills {spills[0]}/{spills[1]} bytes")
    if wide16 < MIN_IN_FLIGHT:
        problems.append(f"{wide16} independent weight loads of >= 16 bits (need {MIN_IN_FLIGHT})")
    if ours:
        if wide32 < MIN_IN_FLIGHT:
            problems.append(f"{wide32} independent weight loads of >= 32 bits "
                            f"(need {MIN_IN_FLIGHT})")
        if narrow:
            problems.append(f"{narrow} weight loads under 32 bits")
    count = f"{len(loads)}" + (f" ({width_summary(loads)})" if loads else "")
    if narrow:
        count += f", {narrow} under 32b"
    if generic:
        count += f", {generic} generic (not ld.global)"
    if dependent:
        count += f", {dependent} dependent"
    row = (f"| {label} | {count} | {total_bytes} | "
           f"{props.get('registers', '?')} | {stack if stack is not None else '?'} | "
           f"{spills[0] if spills[0] is not None else '?'}/"
           f"{spills[1] if spills[1] is not None else '?'} | "
           f"{'pass' if not problems else 'FAIL: ' + '; '.join(problems)} |")
    return row, [f"{label}: {p}" for p in problems]


def window_detail(label, window):
    consumer = "no consumer" if window["consumer"] is None else f"instruction {window['consumer']}"
    loads = "; ".join(("*" if dependent else "") + re.sub(r"_Z\w{40,}", "K", text)
                      for text, _, _, dependent, _ in window["loads"])
    return (f"{label}: window {window['start']} .. first consumer ({consumer}); weight loads "
            f"(* dependent): {loads or 'none'}")


def ggml_control(source_dir, nvcc, arch, work):
    """Starts the control's compile: (process, ptx path, llama.cpp dir), or None and why."""
    llama = os.path.join(source_dir, "build-peer", "llama.cpp")
    if not os.path.exists(os.path.join(llama, "ggml", "src", "ggml-cuda", "mmvq.cu")):
        bundle = os.path.join(source_dir, GGML_BUNDLE)
        if not os.path.exists(bundle):
            return None, (f"no {os.path.join('build-peer', 'llama.cpp')} and no {GGML_BUNDLE} "
                          f"under {source_dir}")
        llama = os.path.join(work, "llama.cpp")
        subprocess.run(["git", "-c", "advice.detachedHead=false", "clone", "-q", bundle, llama],
                       check=True)
    ptx_path = os.path.join(work, "mmvq.ptx")
    process = subprocess.Popen(
        [nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", "-Iggml/include", "-Iggml/src",
         "-Iggml/src/ggml-cuda", "-DNDEBUG", "-ptx", "ggml/src/ggml-cuda/mmvq.cu", "-o", ptx_path],
        cwd=llama, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return (process, ptx_path, llama), None


# chained_matvec_kernel's instances (kernels/matvec.cu's Chain), by enumerator.
CHAINS = {0: "expert_ffn", 1: "residual_router"}


def chain_label(name):
    """chained_matvec_kernel<expert_ffn> from the mangled name of an instance."""
    m = re.search(r"chained_matvec_kernelILNS\w*?ChainE(\d+)E", name)
    return f"chained_matvec_kernel<{CHAINS.get(int(m.group(1)), m.group(1)) if m else '?'}>"


def main():
    nvcc, source_dir, arch = sys.argv[1:4]
    failures = parser_self_check()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        # The control compiles (about half a minute) while ours do.
        try:
            control, skipped = ggml_control(source_dir, nvcc, arch, work)
        except (OSError, subprocess.CalledProcessError) as error:
            control, skipped = None, None
            failures.append(f"ggml control: {error}")
        try:
            ptx_path = os.path.join(work, "matvec.ptx")
            subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", f"-I{source_dir}",
                            "-ptx", os.path.join(source_dir, "kernels", "matvec.cu"), "-o",
                            ptx_path], check=True)
            ptx = open(ptx_path).read()
            ptxas = os.path.join(os.path.dirname(nvcc), "ptxas")
            assembled = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", ptx_path, "-o",
                                        os.path.join(work, "matvec.cubin")],
                                       check=True, capture_output=True, text=True).stderr

            dense_path = os.path.join(work, "dense.ptx")
            subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", f"-I{source_dir}",
                            "-ptx", os.path.join(source_dir, "kernels", "dense.cu"), "-o",
                            dense_path], check=True)
            dense_ptx = open(dense_path).read()
            other_ptx = []
            for source in ("moe.cu", "tokens.cu", "dequant.cu", "prefill.cu", "delta_net.cu"):
                path = os.path.join(work, source + ".ptx")
                subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", f"-I{source_dir}",
                                "-ptx", os.path.join(source_dir, "kernels", source), "-o", path],
                               check=True)
                other_ptx.append(open(path).read())
        except BaseException:
            if control is not None:
                control[0].kill()
                control[0].wait()
            raise

        # The control: ggml's mul_mat_vec_q, cut to the instances checked, through ptxas.
        ggml_rows, ggml_details = [], []
        if control is not None:
            process, mmvq_path, llama = control
            log = process.communicate()[0]
            if process.returncode != 0:
                failures.append(f"ggml control: nvcc failed in {llama}:\n{log[-2000:]}")
            else:
                ggml_text = strip_comments(open(mmvq_path).read())
                wanted = {}
                for kind, name, _, _ in module_functions(ggml_text):
                    m = re.match(r"_Z13mul_mat_vec_qIL9ggml_type(\d+)ELi1ELb0ELb0ELb0E", name)
                    if kind == "entry" and m and int(m.group(1)) in GGML_CONTROL_TYPES:
                        wanted[int(m.group(1))] = name
                cut_path = os.path.join(work, "mmvq_cut.ptx")
                with open(cut_path, "w") as f:
                    f.write(cut_module(ggml_text, set(wanted.values())))
                ggml_props = ptxas_properties(subprocess.run(
                    [ptxas, f"-arch=sm_{arch}", "-v", cut_path, "-o",
                     os.path.join(work, "mmvq.cubin")],
                    check=True, capture_output=True, text=True).stderr)
                bodies = entries(ggml_text)
                for type_id in GGML_CONTROL_TYPES:
                    label = f"ggml mul_mat_vec_q<{QUANT_TYPES[type_id]}>"
                    if type_id not in wanted:
                        failures.append(f"{label}: no instance in ggml's PTX")
                        continue
                    name = wanted[type_id]
                    window = weight_window(bodies[name], name, re.compile(r"dp4a\."))
                    ggml_details.append(window_detail(label, window))
                    row, problems = weight_row(label, window, ggml_props.get(name), ours=False)
                    ggml_rows.append(row)
                    failures.extend(f"control (the measurement is suspect) {p}" for p in problems)

    # The programmatic launch's order: the wait before any global access.
    memory_op = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red)\.(?!param|shared|local|const)",
                           re.M)
    entry_count = 0
    for text in [ptx, dense_ptx, *other_ptx]:
        for body in re.split(r"\.entry ", text)[1:]:
            name = body.split("(", 1)[0]
            code = body.split("\n}\n", 1)[0]
            entry_count += 1
            wait = code.find("griddepcontrol.wait;")
            trigger = code.find("griddepcontrol.launch_dependents;")
            first = memory_op.search(code)
            if wait < 0 or trigger < wait or (first is not None and first.start() < wait):
                failures.append(f"{name}: griddepcontrol.wait at {wait}, launch_dependents at "
                                f"{trigger}, first global access at "
                                f"{first.start() if first else None}")
    print(f"{entry_count} kernels wait for the prior grid before touching global memory")

    attention_seen = 0
    for body in re.split(r"\.entry ", dense_ptx)[1:]:
        name = body.split("(", 1)[0]
        # The uint16_t (f16) instances of the decode and the prefill attention.
        if "attention_split_kernelItE" not in name and "attention_prefill_kernelItE" not in name:
            continue
        attention_seen += 1
        code = body.split("\n}\n", 1)[0]
        ops = [op.split(".") for op in re.findall(r"\bld\.global[\w.:]*", code)]
        vector = sum(1 for parts in ops if "v4" in parts)
        narrow = sum(1 for parts in ops if load_bits(parts)[0] in (8, 16))
        print(f"{name}: {vector} 16-byte loads, {narrow} 8- or 16-bit loads")
        if vector < 2 or narrow > 0:
            failures.append(f"{name}: {vector} 16-byte loads, {narrow} 8- or 16-bit loads")
    if attention_seen != 2:
        failures.append(f"{attention_seen} f16 attention kernels, expected decode and prefill")

    seen = {}
    qkv_seen = False
    chains_seen = set()
    for body in re.split(r"\.entry ", ptx)[1:]:
        name = body.split("(", 1)[0]
        code = body.split("\n}\n", 1)[0]
        # Element types of the global loads, whatever their qualifiers (.nc, .L1::no_allocate).
        loads = collections.Counter(
            next((p for p in reversed(op.split(".")) if re.fullmatch(r"[bsuf]\d+", p)), "?")
            for op in re.findall(r"\bld\.global[\w.:]*", code))
        byte_loads = loads["u8"] + loads["s8"]
        word_loads = loads["u16"] + loads["s16"] + loads["u32"] + loads["s32"] + loads["b32"]
        dp4a = len(re.findall(r"\bdp4a\.", code))
        if "qkv_kernel" in name:
            qkv_seen = True
            print(f"qkv: loads {dict(loads)}, dp4a {dp4a}")
            if byte_loads > 0 or dp4a == 0:
                failures.append(f"qkv_kernel: {byte_loads} 8-bit global loads, {dp4a} dp4a")
            continue
        if "chained_matvec_kernel" in name:
            label = chain_label(name)
            chains_seen.add(label)
            print(f"{label}: loads {dict(loads)}, dp4a {dp4a}")
            if byte_loads > 2 or dp4a == 0:
                failures.append(f"{label}: {byte_loads} 8-bit global loads (at most the missed "
                                f"flag, once per launch of the two), {dp4a} dp4a")
            continue
        match = re.search(r"grouped_matvec_kernelILNS_8GgmlTypeE(\d+)E", name)
        if not match:
            continue
        type_id = int(match.group(1))
        type_name = QUANT_TYPES.get(type_id, ELEMENT_TYPES.get(type_id, f"type {type_id}"))
        seen[type_id] = name
        print(f"{type_name}: loads {dict(loads)}, dp4a {dp4a}")
        if byte_loads > 1:
            failures.append(f"{type_name}: {byte_loads} 8-bit global loads (at most the missed flag)")
        if type_id in QUANT_TYPES and (dp4a == 0 or word_loads == 0):
            failures.append(f"{type_name}: {dp4a} dp4a and {word_loads} 16/32-bit loads")

    if not qkv_seen:
        failures.append("no qkv_kernel")
    for chain in CHAINS.values():
        if f"chained_matvec_kernel<{chain}>" not in chains_seen:
            failures.append(f"no chained_matvec_kernel<{chain}>")
    for type_id, type_name in {**QUANT_TYPES, **ELEMENT_TYPES}.items():
        if type_id not in seen:
            failures.append(f"{type_name}: no grouped_matvec_kernel instance")
    # ptxas -v: "Compiling entry function 'NAME'" then "N bytes spill stores, M bytes spill loads".
    for name, stores, spill_loads in re.findall(
            r"entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads",
            assembled, re.S):
        if re.search(r"grouped_matvec_kernel|qkv_kernel|chained_matvec_kernel", name) and (
                stores != "0" or spill_loads != "0"):
            failures.append(f"{name}: {stores} bytes spill stores, {spill_loads} spill loads")

    # The weight stream's loads in flight, ours: every grouped_matvec_kernel, qkv_kernel and
    # chained_matvec_kernel.
    props = ptxas_properties(assembled)
    bodies = entries(strip_comments(ptx))
    order = list({**QUANT_TYPES, **ELEMENT_TYPES})
    ours = []
    for name in bodies:
        match = re.search(r"grouped_matvec_kernelILNS_8GgmlTypeE(\d+)E", name)
        if match:
            type_id = int(match.group(1))
            type_name = QUANT_TYPES.get(type_id, ELEMENT_TYPES.get(type_id, f"type {type_id}"))
            consumer = r"fma\.rn(\.ftz)?\.f32$" if type_id in ELEMENT_TYPES else r"dp4a\."
            rank = order.index(type_id) if type_id in order else len(order)
            ours.append((rank, f"grouped_matvec_kernel<{type_name}>", name, consumer))
        elif "qkv_kernel" in name:
            ours.append((len(order) + 1, "qkv_kernel", name, r"dp4a\."))
        elif "chained_matvec_kernel" in name:
            ours.append((len(order) + 2, chain_label(name), name, r"dp4a\."))
    for _, label, name, consumer in sorted(ours):
        window = weight_window(bodies[name], name, re.compile(consumer))
        print(window_detail(label, window))
        row, problems = weight_row(label, window, props.get(name), ours=True)
        rows.append(row)
        failures.extend(problems)

    # The Gated DeltaNet's state stream (delta_net_mix_kernel's param 0): a
    # lane's loads of its state rows in flight at their first use.
    delta_net_seen = False
    for text in other_ptx:
        for name, body in entries(strip_comments(text)).items():
            if "delta_net_mix_kernel" not in name:
                continue
            delta_net_seen = True
            runs = stream_runs(body, name)
            print(f"delta_net_mix_kernel: state loads in flight at each first use {runs}")
            if not runs or min(runs) < MIN_STATE_IN_FLIGHT:
                failures.append(f"delta_net_mix_kernel: state loads in flight {runs}, fewer than "
                                f"{MIN_STATE_IN_FLIGHT} at a first use")
    if not delta_net_seen:
        failures.append("no delta_net_mix_kernel")

    for detail in ggml_details:
        print(detail)
    print()
    print("| kernel | weight loads before first consumer (count, widths) | bytes | registers | "
          "stack | spills (st/ld) | verdict |")
    print("|---|---|---|---|---|---|---|")
    for row in rows + ggml_rows:
        print(row)
    if skipped:
        print(f"ggml control skipped: {skipped}")
    print()

    for failure in failures:
        print(f"FAIL {failure}")
    if not failures:
        print(f"kernel_shape_test: {len(seen)} matvec kernels, no byte loads in the weight "
              f"stream, dp4a in every quant type, no spills, no stack frame, "
              f">= {MIN_IN_FLIGHT} 32-bit weight loads in flight")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
