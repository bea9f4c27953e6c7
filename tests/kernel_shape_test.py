#!/usr/bin/env python3
"""The matvec kernels' code shape, proven without a GPU (issue 19).

Compiles kernels/matvec.cu to PTX for one architecture and checks every
grouped_matvec_kernel instance: it exists for each weight type the engine
serves; it makes at most one 8-bit global load (the rank's missed flag of an
expert pass; the weight stream is read in 16- and 32-bit words, mxfp4's
17-byte blocks in aligned words joined by funnel shifts); the quant
types use dp4a; and ptxas assembles it without register spills. qkv_kernel
(every type behind one switch) makes no 8-bit load, uses dp4a and does not
spill either. In kernels/dense.cu, the attention kernel of the f16 cache reads
its keys and values in 16-byte loads, and so does the prefill's: no 8- or
16-bit global load. In every
kernel of kernels/*.cu, griddepcontrol.wait (wait_for_prior_grids,
kernels/launch.cuh) comes before the first global (or generic) load, store or
atomic, and griddepcontrol.launch_dependents follows it: a kernel launched
programmatically may start before the one it follows has finished.

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


def main():
    nvcc, source_dir, arch = sys.argv[1:4]
    failures = []
    with tempfile.TemporaryDirectory() as work:
        ptx_path = os.path.join(work, "matvec.ptx")
        subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", f"-I{source_dir}", "-ptx",
                        os.path.join(source_dir, "kernels", "matvec.cu"), "-o", ptx_path],
                       check=True)
        ptx = open(ptx_path).read()
        ptxas = os.path.join(os.path.dirname(nvcc), "ptxas")
        assembled = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", ptx_path, "-o",
                                    os.path.join(work, "matvec.cubin")],
                                   check=True, capture_output=True, text=True).stderr

        dense_path = os.path.join(work, "dense.ptx")
        subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", f"-I{source_dir}", "-ptx",
                        os.path.join(source_dir, "kernels", "dense.cu"), "-o", dense_path],
                       check=True)
        dense_ptx = open(dense_path).read()
        other_ptx = []
        for source in ("moe.cu", "tokens.cu", "dequant.cu", "prefill.cu"):
            path = os.path.join(work, source + ".ptx")
            subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", f"-I{source_dir}",
                            "-ptx", os.path.join(source_dir, "kernels", source), "-o", path],
                           check=True)
            other_ptx.append(open(path).read())

    # The programmatic launch's order: the wait before any global access.
    memory_op = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red)\.(?!param|shared|local|const)",
                           re.M)
    entries = 0
    for text in [ptx, dense_ptx, *other_ptx]:
        for body in re.split(r"\.entry ", text)[1:]:
            name = body.split("(", 1)[0]
            code = body.split("\n}\n", 1)[0]
            entries += 1
            wait = code.find("griddepcontrol.wait;")
            trigger = code.find("griddepcontrol.launch_dependents;")
            first = memory_op.search(code)
            if wait < 0 or trigger < wait or (first is not None and first.start() < wait):
                failures.append(f"{name}: griddepcontrol.wait at {wait}, launch_dependents at "
                                f"{trigger}, first global access at "
                                f"{first.start() if first else None}")
    print(f"{entries} kernels wait for the prior grid before touching global memory")

    attention_seen = 0
    for body in re.split(r"\.entry ", dense_ptx)[1:]:
        name = body.split("(", 1)[0]
        # The uint16_t (f16) instances of the decode and the prefill attention.
        if "attention_split_kernelItE" not in name and "attention_prefill_kernelItE" not in name:
            continue
        attention_seen += 1
        code = body.split("\n}\n", 1)[0]
        vector = len(re.findall(r"\bld\.global(?:\.nc)?\.v4\.", code))
        narrow = len(re.findall(r"\bld\.global(?:\.nc|\.cg)?\.[usb](?:8|16)\b", code))
        print(f"{name}: {vector} 16-byte loads, {narrow} 8- or 16-bit loads")
        if vector < 2 or narrow > 0:
            failures.append(f"{name}: {vector} 16-byte loads, {narrow} 8- or 16-bit loads")
    if attention_seen != 2:
        failures.append(f"{attention_seen} f16 attention kernels, expected decode and prefill")

    seen = {}
    qkv_seen = False
    for body in re.split(r"\.entry ", ptx)[1:]:
        name = body.split("(", 1)[0]
        code = body.split("\n}\n", 1)[0]
        loads = collections.Counter(re.findall(r"\bld\.global(?:\.nc|\.cg)?(?:\.v\d)?\.(\w+)", code))
        byte_loads = loads["u8"] + loads["s8"]
        word_loads = loads["u16"] + loads["s16"] + loads["u32"] + loads["s32"] + loads["b32"]
        dp4a = len(re.findall(r"\bdp4a\.", code))
        if "qkv_kernel" in name:
            qkv_seen = True
            print(f"qkv: loads {dict(loads)}, dp4a {dp4a}")
            if byte_loads > 0 or dp4a == 0:
                failures.append(f"qkv_kernel: {byte_loads} 8-bit global loads, {dp4a} dp4a")
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
    for type_id, type_name in {**QUANT_TYPES, **ELEMENT_TYPES}.items():
        if type_id not in seen:
            failures.append(f"{type_name}: no grouped_matvec_kernel instance")
    # ptxas -v: "Compiling entry function 'NAME'" then "N bytes spill stores, M bytes spill loads".
    for name, stores, spill_loads in re.findall(
            r"entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads",
            assembled, re.S):
        if ("grouped_matvec_kernel" in name or "qkv_kernel" in name) and (
                stores != "0" or spill_loads != "0"):
            failures.append(f"{name}: {stores} bytes spill stores, {spill_loads} spill loads")

    for failure in failures:
        print(f"FAIL {failure}")
    if not failures:
        print(f"kernel_shape_test: {len(seen)} matvec kernels, no byte loads in the weight "
              f"stream, dp4a in every quant type, no spills")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
