#!/usr/bin/env python3
"""The decode step at Qwen3-30B-A3B's shape against the bandwidth it needs (issue 40).

No GPU: the launches come from `moegraph inspect --walk` (capture/walk_shape.h,
held to the engine's own launches by tests/walk_shape_test.cc) on a GGUF file of
the real model's header whose tensor data are holes (a sparse file: nothing is
quantized, nothing read); the code shape from nvcc's PTX and ptxas -v of
kernels/matvec.cu, measured as tests/kernel_shape_test.py measures it.

The file: 48 layers, 128 experts top-8, n_embd 2048, expert FFN 768, 32 query
and 4 KV heads of 128, vocabulary 151,936, typed as llama-quantize's Q4_K_M
makes a qwen3moe file (llama.cpp src/llama-quant.cpp, llama_tensor_get_type_impl;
not read from a published file): q4_K everywhere but attn_v and ffn_down_exps,
q6_K in the layers use_more_bits picks (i < 6, i >= 42, (i - 6) % 3 == 2: 24 of
48) and q4_K in the rest, output q6_K, token_embd q4_K, ffn_gate_inp (the
router) not quantized: f32 as the converter writes it.

Per weight-streaming launch (weight bytes > 0) of both arms:
  1. grid blocks >= 4 x 132 (an H100's SMs), except the launches of EXEMPT
     (each with its reason, and each at most EXEMPT_BYTES a token: an
     exemption cannot hide a launch that streams much);
  2. bytes in flight per SM >= 16 KiB, Little's law's share of one SM at
     3.35 TB/s and 600 ns: resident blocks per SM (sm_90: 65,536 registers
     allocated 256 a warp in groups of 4 warps, 228 KiB of shared memory with
     1 KiB reserved a block in 128-byte units, 32 blocks, 64 warps; ptxas's
     registers and shared memory), at most the grid's blocks / 132, times the
     block's threads, times the weight bytes a thread has in flight: its
     independent weight loads before the first dp4a/fma of its kernel's
     fewest-loaded K loop, times their width (kernel_shape_test.weight_window;
     a lower bound: a gate/up pair's loop holds both matrices' loads).
And per MoE layer: at most 7 kernel nodes on the resident arm, 9 on the graph arm.

Then a per-kernel table at that shape with a Little's-law time estimate on an
H100: achieved bandwidth = min(3.35e12, 132 x bytes in flight per SM / 600e-9),
time = weight bytes / bandwidth + a floor per kernel node (--floor-us, default
2: a dependent launch under PDL in a graph, the first DRAM round trip and the
tail, the last block's epilogue), summed per token into a predicted resident
tok/s. An estimate, not a measurement: ncu on a device confirms or refutes it.

Usage: walk_bandwidth_test.py NVCC SOURCE_DIR ARCH MOEGRAPH [--floor-us US]
                          [--extra-row 'LAYER|KERNEL|GRID|BLOCK|BYTES' ...]
--extra-row adds a resident-arm row to check (the failing demonstration).
Exit 0: pass, 1: fail.
"""
import argparse
import math
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_shape_test as ks  # noqa: E402

# --- the model -----------------------------------------------------------------------------------

N_LAYER, N_EXPERT, TOP_K = 48, 128, 8
N_EMBD, N_FF_EXP, N_HEAD, N_HEAD_KV, HEAD_DIM, N_VOCAB = 2048, 768, 32, 4, 128, 151936
# (ggml type id, elements per block, bytes per block)
F32, Q4_K, Q6_K = (0, 1, 4), (12, 256, 144), (14, 256, 210)


def use_more_bits(i, n):
    """llama-quantize's layers that get more bits (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def qwen3_tensors():
    """(name, [ne0, ne1, ...], type) of a Qwen3-30B-A3B Q4_K_M file, in its order."""
    tensors = [("token_embd.weight", [N_EMBD, N_VOCAB], Q4_K),
               ("output_norm.weight", [N_EMBD], F32),
               ("output.weight", [N_EMBD, N_VOCAB], Q6_K)]
    q = N_HEAD * HEAD_DIM
    kv = N_HEAD_KV * HEAD_DIM
    for i in range(N_LAYER):
        more = Q6_K if use_more_bits(i, N_LAYER) else Q4_K
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", [N_EMBD], F32),
                    (b + "attn_q.weight", [N_EMBD, q], Q4_K),
                    (b + "attn_k.weight", [N_EMBD, kv], Q4_K),
                    (b + "attn_v.weight", [N_EMBD, kv], more),
                    (b + "attn_output.weight", [q, N_EMBD], Q4_K),
                    (b + "attn_q_norm.weight", [HEAD_DIM], F32),
                    (b + "attn_k_norm.weight", [HEAD_DIM], F32),
                    (b + "ffn_norm.weight", [N_EMBD], F32),
                    (b + "ffn_gate_inp.weight", [N_EMBD, N_EXPERT], F32),
                    (b + "ffn_gate_exps.weight", [N_EMBD, N_FF_EXP, N_EXPERT], Q4_K),
                    (b + "ffn_up_exps.weight", [N_EMBD, N_FF_EXP, N_EXPERT], Q4_K),
                    (b + "ffn_down_exps.weight", [N_FF_EXP, N_EMBD, N_EXPERT], more)]
    return tensors


def gguf_string(s):
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def write_sparse_gguf(path):
    """A GGUF v3 file of the model's keys and tensor infos; its data section is a hole."""
    u32, f32, string = 4, 6, 8
    kvs = [("general.architecture", string, "qwen3moe"),
           ("qwen3moe.block_count", u32, N_LAYER),
           ("qwen3moe.context_length", u32, 40960),
           ("qwen3moe.embedding_length", u32, N_EMBD),
           ("qwen3moe.feed_forward_length", u32, 6144),
           ("qwen3moe.attention.head_count", u32, N_HEAD),
           ("qwen3moe.attention.head_count_kv", u32, N_HEAD_KV),
           ("qwen3moe.attention.key_length", u32, HEAD_DIM),
           ("qwen3moe.attention.value_length", u32, HEAD_DIM),
           ("qwen3moe.rope.freq_base", f32, 1e6),
           ("qwen3moe.attention.layer_norm_rms_epsilon", f32, 1e-6),
           ("qwen3moe.expert_count", u32, N_EXPERT),
           ("qwen3moe.expert_used_count", u32, TOP_K),
           ("qwen3moe.expert_feed_forward_length", u32, N_FF_EXP)]
    tensors = qwen3_tensors()
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kvs))]
    for key, kind, value in kvs:
        out.append(gguf_string(key) + struct.pack("<I", kind))
        out.append(gguf_string(value) if kind == string else
                   struct.pack("<I" if kind == u32 else "<f", value))
    offset = 0
    for name, ne, (type_id, block, block_bytes) in tensors:
        out.append(gguf_string(name) + struct.pack("<I", len(ne)) +
                   struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", type_id, offset))
        offset += math.prod(ne) // block * block_bytes
        offset = (offset + 31) // 32 * 32  # the default alignment
    header = b"".join(out)
    header += b"\0" * (-len(header) % 32)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + offset)


# --- the walk ------------------------------------------------------------------------------------

def parse_row(text):
    """(layer, kernel, (gx, gy, gz), (bx, by, bz), weight bytes) of a table row."""
    layer, kernel, grid, block, weight = (c.strip() for c in text.strip().strip("|").split("|"))

    def dims(cell):
        return tuple(int(v) for v in cell.split(","))

    return (layer, kernel, dims(grid), dims(block), int(weight))


def inspect_walk(moegraph, path, arm):
    """The rows and {layer: kernel nodes} `moegraph inspect --walk` prints."""
    out = subprocess.run([moegraph, "inspect", "--walk", "-m", path, "--arm", arm], check=True,
                         capture_output=True, text=True).stdout
    rows = [parse_row(line) for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| layer") and "---" not in line]
    nodes = {}
    for first, last, count in re.findall(r"^  layers? (\d+)(?:-(\d+))?: (\d+)$", out, re.M):
        for layer in range(int(first), int(last or first) + 1):
            nodes[layer] = int(count)
    return rows, nodes


# --- occupancy and bytes in flight ----------------------------------------------------------------

H100_SMS = 132
HBM_BYTES_PER_S = 3.35e12
DRAM_LATENCY_S = 600e-9
MIN_BLOCKS = 4 * H100_SMS
MIN_IN_FLIGHT_PER_SM = 16 * 1024
# Launches exempt from the grid and in-flight checks, by kernel label: why, and
# at most this many weight bytes a token each (at full bandwidth 0.3 us).
EXEMPT_BYTES = 1 << 20
EXEMPT = {
    "embed_kernel": "one row of the table a token, dequantized in one block",
    "grouped_matvec_kernel<f32>": "the router: 128 experts' f32 rows, one row a block",
}


def resident_blocks(registers, smem, threads):
    """Blocks of a kernel one sm_90 SM holds at once (the occupancy calculator's rule)."""
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = (65536 // regs_per_warp) // 4 * 4 // warps
    by_smem = (228 * 1024) // (-(-(smem + 1024) // 128) * 128)
    return min(by_regs, by_smem, 64 // warps, 32)


def ptxas_smem(log):
    """{entry: static shared memory bytes} from ptxas -v."""
    smem, entry = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([\w$]+)'", line)
        if m:
            entry = m.group(1)
        m = re.search(r"(\d+) bytes smem", line)
        if m and entry:
            smem[entry] = int(m.group(1))
    return smem


def kernel_code(nvcc, source_dir, arch, work):
    """{kernel label: (registers, smem, weight bytes in flight a thread)} of matvec.cu's
    weight-streaming kernels."""
    ptx_path = os.path.join(work, "matvec.ptx")
    subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17", f"-I{source_dir}", "-ptx",
                    os.path.join(source_dir, "kernels", "matvec.cu"), "-o", ptx_path], check=True)
    ptxas = os.path.join(os.path.dirname(nvcc), "ptxas")
    log = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", ptx_path, "-o",
                          os.path.join(work, "matvec.cubin")],
                         check=True, capture_output=True, text=True).stderr
    props, smem = ks.ptxas_properties(log), ptxas_smem(log)
    names = {**ks.QUANT_TYPES, **ks.ELEMENT_TYPES}
    code = {}
    for name, body in ks.entries(ks.strip_comments(open(ptx_path).read())).items():
        m = re.search(r"grouped_matvec_kernelILNS_8GgmlTypeE(\d+)E", name)
        if m:
            type_id = int(m.group(1))
            label = f"grouped_matvec_kernel<{names[type_id]}>"
            consumer = r"fma\.rn(\.ftz)?\.f32$" if type_id in ks.ELEMENT_TYPES else r"dp4a\."
        elif "qkv_kernel" in name:
            label, consumer = "qkv_kernel", r"dp4a\."
        else:
            continue
        window = ks.weight_window(body, name, re.compile(consumer))
        in_flight = sum(load.bits * load.vector for load in window["loads"]
                        if not load.dependent) // 8
        code[label] = (props[name]["registers"], smem.get(name, 0), in_flight)
    return code


def code_of(code, kernel):
    """The code entry of a row's kernel label ("qkv_kernel (q4_K, ...)" is qkv_kernel)."""
    return code.get(kernel.split(" (")[0])


# --- the checks and the estimate ------------------------------------------------------------------

def row_estimate(row, code, floor_s):
    """(blocks, bytes in flight per SM or None, seconds) of one row."""
    _, kernel, grid, block, weight = row
    blocks = grid[0] * grid[1] * grid[2]
    threads = block[0] * block[1] * block[2]
    entry = code_of(code, kernel)
    if weight == 0 or entry is None:
        return blocks, None, floor_s
    registers, smem, per_thread = entry
    per_sm = min(resident_blocks(registers, smem, threads), blocks / H100_SMS)
    in_flight = per_sm * threads * per_thread
    bandwidth = min(HBM_BYTES_PER_S, H100_SMS * in_flight / DRAM_LATENCY_S)
    return blocks, in_flight, weight / bandwidth + floor_s


def check_rows(rows, code):
    failures = []
    for row in rows:
        layer, kernel, grid, block, weight = row
        if weight == 0:
            continue
        where = f"layer {layer} {kernel} (grid {grid}, {weight} weight bytes)"
        if kernel in EXEMPT:
            if weight > EXEMPT_BYTES:
                failures.append(f"{where}: exempt ({EXEMPT[kernel]}) but over {EXEMPT_BYTES} bytes")
            continue
        if code_of(code, kernel) is None:
            failures.append(f"{where}: no weight-streaming kernel of that name in matvec.cu")
            continue
        blocks, in_flight, _ = row_estimate(row, code, 0)
        if blocks < MIN_BLOCKS:
            failures.append(f"{where}: {blocks} blocks, under 4 x {H100_SMS}")
        if in_flight < MIN_IN_FLIGHT_PER_SM:
            failures.append(f"{where}: {in_flight / 1024:.1f} KiB in flight per SM, under "
                            f"{MIN_IN_FLIGHT_PER_SM // 1024}")
    return failures


def check_nodes(nodes, arm, most):
    if len(nodes) != N_LAYER:
        return [f"{arm}: kernel nodes of {len(nodes)} layers printed, not {N_LAYER}"]
    return [f"{arm}: layer {layer} has {n} kernel nodes, over {most}"
            for layer, n in sorted(nodes.items()) if n > most]


def print_estimate(rows, code, floor_s):
    """The per-kernel table, a line per distinct launch with its count a token, and the
    predicted tok/s."""
    groups = {}
    for _, kernel, grid, block, weight in rows:
        key = (kernel, grid, block, weight)
        groups[key] = groups.get(key, 0) + 1
    total_s = total_bytes = 0
    shares = []
    print("| kernel | grid | launches per token | weight MiB per launch | KiB in flight per SM "
          "| us per launch | us per token |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (kernel, grid, block, weight), count in groups.items():
        _, in_flight, seconds = row_estimate((None, kernel, grid, block, weight), code, floor_s)
        total_s += count * seconds
        total_bytes += count * weight
        grid_text = ",".join(map(str, grid))
        shares.append((count * seconds, f"{kernel} {grid_text} x{count}"))
        print(f"| {kernel} | {grid_text} | {count} | {weight / 2**20:.2f} | "
              f"{'-' if in_flight is None else f'{in_flight / 1024:.1f}'} | "
              f"{seconds * 1e6:.2f} | {count * seconds * 1e6:.1f} |")
    floors = len(rows) * floor_s
    print(f"\nper token: {len(rows)} kernel nodes, {total_bytes / 2**30:.3f} GiB of weights, "
          f"{total_s * 1e6:.0f} us ({floors * 1e6:.0f} us of it the {floor_s * 1e6:.1f} us "
          f"floors); predicted resident {1 / total_s:.0f} tok/s "
          f"(the weights alone at {HBM_BYTES_PER_S / 1e12:.2f} TB/s: "
          f"{HBM_BYTES_PER_S / total_bytes:.0f} tok/s)")
    print("largest shares of the token's time: " +
          "; ".join(f"{name} {share * 1e6:.0f} us" for share, name in sorted(shares)[::-1][:4]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("nvcc")
    parser.add_argument("source_dir")
    parser.add_argument("arch")
    parser.add_argument("moegraph")
    parser.add_argument("--floor-us", type=float, default=2.0)
    parser.add_argument("--extra-row", action="append", default=[])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "qwen3-30b-a3b-q4_k_m-shape.gguf")
        write_sparse_gguf(path)
        resident, resident_nodes = inspect_walk(args.moegraph, path, "resident")
        graph, graph_nodes = inspect_walk(args.moegraph, path, "graph")
        code = kernel_code(args.nvcc, args.source_dir, args.arch, work)
    resident += [parse_row(text) for text in args.extra_row]

    print("weight-streaming kernels (ptxas, PTX weight loads before the first consumer):")
    for label, (registers, smem, per_thread) in sorted(code.items()):
        print(f"  {label}: {registers} registers, {smem} bytes smem, {per_thread} weight bytes "
              f"in flight a thread, {resident_blocks(registers, smem, 128)} blocks of 128 an SM")
    print(f"\nresident arm at Qwen3-30B-A3B Q4_K_M's shape, H100 ({H100_SMS} SMs, "
          f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s, {DRAM_LATENCY_S * 1e9:.0f} ns): an ESTIMATE\n")
    print_estimate(resident, code, args.floor_us * 1e-6)

    failures = check_rows(resident, code) + check_rows(graph, code)
    failures += check_nodes(resident_nodes, "resident", 7)
    failures += check_nodes(graph_nodes, "graph", 9)
    print()
    for failure in failures:
        print(f"FAIL {failure}")
    if not failures:
        print(f"walk_bandwidth_test: every weight-streaming launch of both arms has >= "
              f"{MIN_BLOCKS} blocks (or is exempt) and >= {MIN_IN_FLIGHT_PER_SM // 1024} KiB in "
              f"flight per SM; <= 7 kernel nodes a layer resident, <= 9 graph")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
