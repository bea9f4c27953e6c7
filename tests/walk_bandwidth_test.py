#!/usr/bin/env python3
"""The decode step at Qwen3-30B-A3B's and Qwen3.5-35B-A3B's shapes against the bandwidth
it needs (issues 40 and 41).

No GPU: the launches come from `moegraph inspect --walk` (capture/walk_shape.h,
held to the engine's own launches by tests/walk_shape_test.cc) on GGUF files of
the real models' headers whose tensor data are holes (sparse files: nothing is
quantized, nothing read); the code shape from nvcc's PTX and ptxas -v of
kernels/matvec.cu and kernels/delta_net.cu, measured as tests/kernel_shape_test.py
measures it.

Qwen3-30B-A3B: 48 layers, 128 experts top-8, n_embd 2048, expert FFN 768, 32
query and 4 KV heads of 128, vocabulary 151,936, typed as llama-quantize's Q4_K_M
makes a qwen3moe file (llama.cpp src/llama-quant.cpp, llama_tensor_get_type_impl;
not read from a published file): q4_K everywhere but attn_v and ffn_down_exps,
q6_K in the layers use_more_bits picks (i < 6, i >= 42, (i - 6) % 3 == 2: 24 of
48) and q4_K in the rest, output q6_K, token_embd q4_K, ffn_gate_inp (the
router) not quantized: f32 as the converter writes it. Qwen3.5-35B-A3B: see
qwen35_35b_a3b (30 Gated DeltaNet layers, whose mixer streams 4 MiB of f32
state a token, read and written, and 10 gated-attention layers).

Per streaming launch (weight bytes > 0, or the mixer's state) of both arms:
  1. grid blocks >= 4 x 132 (an H100's SMs), except the launches of EXEMPT
     (each with its reason, and each at most EXEMPT_BYTES a token: an
     exemption cannot hide a launch that streams much) and the DeltaNet
     mixer (a block per 32 state rows of a head, one block an SM);
  2. bytes in flight per SM >= Little's law's share of one SM at 3.35 TB/s
     and 600 ns (15,227 bytes): resident blocks per SM (sm_90: 65,536 registers
     allocated 256 a warp in groups of 4 warps, 228 KiB of shared memory with
     1 KiB reserved a block in 128-byte units, 32 blocks, 64 warps; ptxas's
     registers and shared memory), at most the grid's blocks / 132, times the
     block's threads, times the bytes a thread has in flight: its independent
     weight loads before the first dp4a/fma of its kernel's fewest-loaded K
     loop, times their width (kernel_shape_test.weight_window; a lower bound: a
     gate/up pair's loop holds both matrices' loads), or the mixer's state
     loads before their first use (kernel_shape_test.stream_runs, in bytes).
And per MoE layer: at most 7 kernel nodes on the resident arm, 9 on the graph arm.

Then a per-kernel table at each shape with a Little's-law time estimate on an
H100: achieved bandwidth = min(3.35e12, 132 x bytes in flight per SM / 600e-9),
time = streamed bytes / bandwidth + a floor per kernel node (--floor-us, default
2: a dependent launch under PDL in a graph, the first DRAM round trip and the
tail, the last block's epilogue), summed per token into a predicted resident
tok/s. A chained launch (chained_matvec_kernel: two matvecs, the second's blocks
waiting inside it for the first's rows they read; qkv_kernel: the matrix blocks
waiting for its first blocks' attn_norm) is one node and one floor; a line after
the table charges each one DRAM round trip more for that wait. An
estimate, not a measurement: ncu on a device confirms or refutes it.

Usage: walk_bandwidth_test.py NVCC SOURCE_DIR ARCH MOEGRAPH [--floor-us US]
                          [--extra-row 'LAYER|KERNEL|GRID|BLOCK|BYTES' ...]
--extra-row adds a resident-arm row to Qwen3-30B-A3B's to check (the failing
demonstration).
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

# --- the models ----------------------------------------------------------------------------------

# (ggml type id, elements per block, bytes per block)
F32, Q4_K, Q6_K = (0, 1, 4), (12, 256, 144), (14, 256, 210)
U32, I32, FLOAT32, STRING, ARRAY = 4, 5, 6, 8, 9  # GGUF value types


def use_more_bits(i, n):
    """llama-quantize's layers that get more bits (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class Model:
    """A model's GGUF header: its keys, its tensors (name, [ne0, ...], type) in file
    order, and the Gated DeltaNet state a recurrent layer's mixer reads and writes."""

    def __init__(self, name, arch, n_layer, kvs, tensors, state_bytes=0):
        self.name, self.arch, self.n_layer = name, arch, n_layer
        self.kvs, self.tensors, self.state_bytes = kvs, tensors, state_bytes


def qwen3_30b_a3b():
    """Qwen3-30B-A3B as llama-quantize's Q4_K_M writes it (see the module's docstring)."""
    n_layer, n_expert, top_k, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab = (
        48, 128, 8, 2048, 768, 32, 4, 128, 151936)
    q, kv = n_head * head_dim, n_head_kv * head_dim
    tensors = [("token_embd.weight", [n_embd, n_vocab], Q4_K),
               ("output_norm.weight", [n_embd], F32),
               ("output.weight", [n_embd, n_vocab], Q6_K)]
    for i in range(n_layer):
        more = Q6_K if use_more_bits(i, n_layer) else Q4_K
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", [n_embd], F32),
                    (b + "attn_q.weight", [n_embd, q], Q4_K),
                    (b + "attn_k.weight", [n_embd, kv], Q4_K),
                    (b + "attn_v.weight", [n_embd, kv], more),
                    (b + "attn_output.weight", [q, n_embd], Q4_K),
                    (b + "attn_q_norm.weight", [head_dim], F32),
                    (b + "attn_k_norm.weight", [head_dim], F32),
                    (b + "ffn_norm.weight", [n_embd], F32),
                    (b + "ffn_gate_inp.weight", [n_embd, n_expert], F32),
                    (b + "ffn_gate_exps.weight", [n_embd, n_ff, n_expert], Q4_K),
                    (b + "ffn_up_exps.weight", [n_embd, n_ff, n_expert], Q4_K),
                    (b + "ffn_down_exps.weight", [n_ff, n_embd, n_expert], more)]
    a = "qwen3moe."
    kvs = [("general.architecture", STRING, "qwen3moe"),
           (a + "block_count", U32, n_layer),
           (a + "context_length", U32, 40960),
           (a + "embedding_length", U32, n_embd),
           (a + "feed_forward_length", U32, 6144),
           (a + "attention.head_count", U32, n_head),
           (a + "attention.head_count_kv", U32, n_head_kv),
           (a + "attention.key_length", U32, head_dim),
           (a + "attention.value_length", U32, head_dim),
           (a + "rope.freq_base", FLOAT32, 1e6),
           (a + "attention.layer_norm_rms_epsilon", FLOAT32, 1e-6),
           (a + "expert_count", U32, n_expert),
           (a + "expert_used_count", U32, top_k),
           (a + "expert_feed_forward_length", U32, n_ff)]
    return Model("Qwen3-30B-A3B Q4_K_M", "qwen3moe", n_layer, kvs, tensors)


def qwen35_35b_a3b():
    """Qwen3.5-35B-A3B as llama-quantize's Q4_K_M writes it.

    The shape: its config.json as transformers' Qwen3_5MoeTextConfig reads it (the
    figures docs/QWEN35MOE.md cites): 40 layers, a full-attention layer every 4th (16
    query and 2 KV heads of 256, RoPE on 64 of each), the others Gated DeltaNets (16 key
    and 32 value heads of 128, a conv of 4), 256 experts top-8 of FFN 512 and a shared
    expert of 512, n_embd 2048, vocabulary 248,320; the MTP layer left out. The types:
    llama_tensor_get_type_impl for LLAMA_FTYPE_MOSTLY_Q4_K_M: attn_qkv counts with attn_v
    (category_is_attn_v), one of them a layer, so both are q6_K where use_more_bits(layer,
    40) and q4_K elsewhere, as ffn_down_exps and ffn_down_shexp (layer_info parses the
    layer from the name); ssm_alpha and ssm_beta (2-D, named .weight) q4_K like the other
    matrices; ffn_gate_inp (not quantized) and the 1-D tensors f32; output q6_K."""
    n_layer, n_expert, top_k, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab = (
        40, 256, 8, 2048, 512, 16, 2, 256, 248320)
    k_heads, v_heads, ssm_dim, d_conv = 16, 32, 128, 4
    key_dim, value_dim = k_heads * ssm_dim, v_heads * ssm_dim
    tensors = [("token_embd.weight", [n_embd, n_vocab], Q4_K),
               ("output_norm.weight", [n_embd], F32),
               ("output.weight", [n_embd, n_vocab], Q6_K)]
    for i in range(n_layer):
        more = Q6_K if use_more_bits(i, n_layer) else Q4_K
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", [n_embd], F32),
                    (b + "post_attention_norm.weight", [n_embd], F32)]
        if (i + 1) % 4:
            tensors += [(b + "attn_qkv.weight", [n_embd, 2 * key_dim + value_dim], more),
                        (b + "attn_gate.weight", [n_embd, value_dim], Q4_K),
                        (b + "ssm_conv1d.weight", [d_conv, 2 * key_dim + value_dim], F32),
                        (b + "ssm_dt.bias", [v_heads], F32),
                        (b + "ssm_a", [v_heads], F32),
                        (b + "ssm_beta.weight", [n_embd, v_heads], Q4_K),
                        (b + "ssm_alpha.weight", [n_embd, v_heads], Q4_K),
                        (b + "ssm_norm.weight", [ssm_dim], F32),
                        (b + "ssm_out.weight", [value_dim, n_embd], Q4_K)]
        else:
            tensors += [(b + "attn_q.weight", [n_embd, 2 * head_dim * n_head], Q4_K),
                        (b + "attn_k.weight", [n_embd, head_dim * n_head_kv], Q4_K),
                        (b + "attn_v.weight", [n_embd, head_dim * n_head_kv], more),
                        (b + "attn_output.weight", [head_dim * n_head, n_embd], Q4_K),
                        (b + "attn_q_norm.weight", [head_dim], F32),
                        (b + "attn_k_norm.weight", [head_dim], F32)]
        tensors += [(b + "ffn_gate_inp.weight", [n_embd, n_expert], F32),
                    (b + "ffn_gate_exps.weight", [n_embd, n_ff, n_expert], Q4_K),
                    (b + "ffn_up_exps.weight", [n_embd, n_ff, n_expert], Q4_K),
                    (b + "ffn_down_exps.weight", [n_ff, n_embd, n_expert], more),
                    (b + "ffn_gate_inp_shexp.weight", [n_embd], F32),
                    (b + "ffn_gate_shexp.weight", [n_embd, n_ff], Q4_K),
                    (b + "ffn_up_shexp.weight", [n_embd, n_ff], Q4_K),
                    (b + "ffn_down_shexp.weight", [n_ff, n_embd], more)]
    a = "qwen35moe."
    kvs = [("general.architecture", STRING, "qwen35moe"),
           (a + "block_count", U32, n_layer),
           (a + "context_length", U32, 262144),
           (a + "embedding_length", U32, n_embd),
           (a + "feed_forward_length", U32, n_ff),
           (a + "attention.head_count", U32, n_head),
           (a + "attention.head_count_kv", U32, n_head_kv),
           (a + "attention.key_length", U32, head_dim),
           (a + "attention.value_length", U32, head_dim),
           (a + "rope.freq_base", FLOAT32, 1e7),
           (a + "rope.dimension_count", U32, 64),
           (a + "rope.dimension_sections", ARRAY, [11, 11, 10, 0]),
           (a + "attention.layer_norm_rms_epsilon", FLOAT32, 1e-6),
           (a + "expert_count", U32, n_expert),
           (a + "expert_used_count", U32, top_k),
           (a + "expert_feed_forward_length", U32, n_ff),
           (a + "expert_shared_feed_forward_length", U32, n_ff),
           (a + "ssm.conv_kernel", U32, d_conv),
           (a + "ssm.inner_size", U32, value_dim),
           (a + "ssm.state_size", U32, ssm_dim),
           (a + "ssm.time_step_rank", U32, v_heads),
           (a + "ssm.group_count", U32, k_heads),
           (a + "full_attention_interval", U32, 4)]
    # The f32 delta state, read and written once a token: v_heads matrices of ssm_dim^2.
    state_bytes = 2 * v_heads * ssm_dim * ssm_dim * 4
    return Model("Qwen3.5-35B-A3B Q4_K_M", "qwen35moe", n_layer, kvs, tensors, state_bytes)


def gguf_string(s):
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_value(kind, value):
    if kind == STRING:
        return gguf_string(value)
    if kind == ARRAY:  # of i32
        return struct.pack("<IQ", I32, len(value)) + struct.pack(f"<{len(value)}i", *value)
    return struct.pack("<I" if kind == U32 else "<f", value)


def write_sparse_gguf(model, path):
    """A GGUF v3 file of the model's keys and tensor infos; its data section is a hole."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(model.tensors), len(model.kvs))]
    for key, kind, value in model.kvs:
        out.append(gguf_string(key) + struct.pack("<I", kind) + gguf_value(kind, value))
    offset = 0
    for name, ne, (type_id, block, block_bytes) in model.tensors:
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
# Little's law: the bytes one SM must keep in flight for its share of the bandwidth.
MIN_IN_FLIGHT_PER_SM = HBM_BYTES_PER_S * DRAM_LATENCY_S / H100_SMS
# Launches exempt from the grid and in-flight checks, by kernel label: why, and
# at most this many streamed bytes a launch (at full bandwidth 0.7 us).
EXEMPT_BYTES = 9 << 18
EXEMPT = {
    "embed_kernel": "one row of the table a token, dequantized in one block",
    "grouped_matvec_kernel<f32>": "the router: 128 or 256 experts' f32 rows (and the shared "
                                  "expert's gate row), one row a block",
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


def compile_kernels(nvcc, source, arch, work):
    """(PTX text, ptxas -v log) of one kernels/ source."""
    stem = os.path.splitext(os.path.basename(source))[0]
    ptx_path = os.path.join(work, stem + ".ptx")
    subprocess.run([nvcc, "-O3", f"-arch=sm_{arch}", "-std=c++17",
                    f"-I{os.path.dirname(os.path.dirname(source))}", "-ptx", source, "-o",
                    ptx_path], check=True)
    ptxas = os.path.join(os.path.dirname(nvcc), "ptxas")
    log = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", ptx_path, "-o",
                          os.path.join(work, stem + ".cubin")],
                         check=True, capture_output=True, text=True).stderr
    return ks.strip_comments(open(ptx_path).read()), log


def kernel_code(nvcc, source_dir, arch, work):
    """{kernel label: (registers, smem, streamed bytes in flight a thread)} of matvec.cu's
    weight-streaming kernels and delta_net.cu's mixer (its state: param 0's loads in flight
    at their first use, the fewest of its runs)."""
    ptx, log = compile_kernels(nvcc, os.path.join(source_dir, "kernels", "matvec.cu"), arch,
                               work)
    props, smem = ks.ptxas_properties(log), ptxas_smem(log)
    names = {**ks.QUANT_TYPES, **ks.ELEMENT_TYPES}
    code = {}
    for name, body in ks.entries(ptx).items():
        m = re.search(r"grouped_matvec_kernelILNS_8GgmlTypeE(\d+)E", name)
        if m:
            type_id = int(m.group(1))
            label = f"grouped_matvec_kernel<{names[type_id]}>"
            consumer = r"fma\.rn(\.ftz)?\.f32$" if type_id in ks.ELEMENT_TYPES else r"dp4a\."
        elif "qkv_kernel" in name:
            label, consumer = "qkv_kernel", r"dp4a\."
        elif "chained_matvec_kernel" in name:
            label, consumer = ks.chain_label(name), r"dp4a\."
        else:
            continue
        window = ks.weight_window(body, name, re.compile(consumer))
        in_flight = sum(load.bits * load.vector for load in window["loads"]
                        if not load.dependent) // 8
        code[label] = (props[name]["registers"], smem.get(name, 0), in_flight)
    ptx, log = compile_kernels(nvcc, os.path.join(source_dir, "kernels", "delta_net.cu"), arch,
                               work)
    props, smem = ks.ptxas_properties(log), ptxas_smem(log)
    for name, body in ks.entries(ptx).items():
        if "delta_net_mix_kernel" in name:
            runs = ks.stream_runs(body, name, in_bytes=True)
            code["delta_net_mix_kernel"] = (props[name]["registers"], smem.get(name, 0),
                                            min(runs) if runs else 0)
    return code


def code_of(code, kernel):
    """The code entry of a row's kernel label ("qkv_kernel (q4_K, ...)" is qkv_kernel;
    "chained_matvec_kernel (pair q4_K, q6_K)" the expert FFN's chain, without "pair" the
    residual's and router's)."""
    if kernel.startswith("chained_matvec_kernel ("):
        pair = kernel.startswith("chained_matvec_kernel (pair")
        return code.get(f"chained_matvec_kernel<{'expert_ffn' if pair else 'residual_router'}>")
    return code.get(kernel.split(" (")[0])


def streamed_rows(rows, model):
    """The rows with each mixer's delta state as its streamed bytes (inspect --walk prints
    weight bytes; the state is the mixer's stream)."""
    return [(layer, kernel, grid, block,
             model.state_bytes if kernel == "delta_net_mix_kernel" else weight)
            for layer, kernel, grid, block, weight in rows]


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
        where = f"layer {layer} {kernel} (grid {grid}, {weight} streamed bytes)"
        if kernel in EXEMPT:
            if weight > EXEMPT_BYTES:
                failures.append(f"{where}: exempt ({EXEMPT[kernel]}) but over {EXEMPT_BYTES} "
                                f"bytes")
            continue
        if code_of(code, kernel) is None:
            failures.append(f"{where}: no streaming kernel of that name in matvec.cu or "
                            f"delta_net.cu")
            continue
        blocks, in_flight, _ = row_estimate(row, code, 0)
        # The mixer's grid is its heads' rows at one block an SM (its registers): what
        # makes its speed is the state in flight, not a count of waves.
        if blocks < MIN_BLOCKS and kernel != "delta_net_mix_kernel":
            failures.append(f"{where}: {blocks} blocks, under 4 x {H100_SMS}")
        if in_flight < MIN_IN_FLIGHT_PER_SM:
            failures.append(f"{where}: {in_flight / 1024:.1f} KiB in flight per SM, under "
                            f"{MIN_IN_FLIGHT_PER_SM / 1024:.1f}")
    return failures


def check_nodes(nodes, model, arm, most):
    if len(nodes) != model.n_layer:
        return [f"{arm}: kernel nodes of {len(nodes)} layers printed, not {model.n_layer}"]
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
    print("| kernel | grid | launches per token | streamed MiB per launch | KiB in flight per SM "
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
    print(f"\nper token: {len(rows)} kernel nodes, {total_bytes / 2**30:.3f} GiB streamed, "
          f"{total_s * 1e6:.0f} us ({floors * 1e6:.0f} us of it the {floor_s * 1e6:.1f} us "
          f"floors); predicted resident {1 / total_s:.0f} tok/s "
          f"(the bytes alone at {HBM_BYTES_PER_S / 1e12:.2f} TB/s: "
          f"{HBM_BYTES_PER_S / total_bytes:.0f} tok/s)")
    # A chained launch's second matvec waits inside it for the first's rows it reads
    # (the router for all of attn_out's; a rank's down for its gate/up), and the
    # projections' matrix blocks for their launch's attn_norm blocks: one node, one
    # floor here; charged a DRAM round trip more each, the bound below.
    chained = sum(1 for row in rows
                  if row[1].startswith("chained_matvec_kernel") or row[1].startswith("qkv_kernel"))
    if chained:
        waits_s = total_s + chained * DRAM_LATENCY_S
        print(f"launches that wait inside (chains, the projections after their norm): "
              f"{chained} a token, each one floor; with a DRAM round trip more each for the "
              f"wait: {waits_s * 1e6:.0f} us, {1 / waits_s:.0f} tok/s")
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

    failures = []
    with tempfile.TemporaryDirectory() as work:
        code = kernel_code(args.nvcc, args.source_dir, args.arch, work)
        print("streaming kernels (ptxas; PTX weight loads before the first consumer, the "
              "mixer's state loads before their first use):")
        for label, (registers, smem, per_thread) in sorted(code.items()):
            threads = 256 if label == "delta_net_mix_kernel" else 128
            print(f"  {label}: {registers} registers, {smem} bytes smem, {per_thread} bytes "
                  f"in flight a thread, {resident_blocks(registers, smem, threads)} blocks of "
                  f"{threads} an SM")
        for model in (qwen3_30b_a3b(), qwen35_35b_a3b()):
            path = os.path.join(work, model.arch + "-shape.gguf")
            write_sparse_gguf(model, path)
            resident, resident_nodes = inspect_walk(args.moegraph, path, "resident")
            graph, graph_nodes = inspect_walk(args.moegraph, path, "graph")
            resident, graph = streamed_rows(resident, model), streamed_rows(graph, model)
            if model.arch == "qwen3moe":
                resident += [parse_row(text) for text in args.extra_row]
            print(f"\nresident arm at {model.name}'s shape, H100 ({H100_SMS} SMs, "
                  f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s, {DRAM_LATENCY_S * 1e9:.0f} ns): "
                  f"an ESTIMATE\n")
            print_estimate(resident, code, args.floor_us * 1e-6)
            failures += [f"{model.name}: {f}" for f in
                         check_rows(resident, code) + check_rows(graph, code) +
                         check_nodes(resident_nodes, model, "resident", 7) +
                         check_nodes(graph_nodes, model, "graph", 9)]
    print()
    for failure in failures:
        print(f"FAIL {failure}")
    if not failures:
        print(f"walk_bandwidth_test: at both models' shapes every streaming launch of both arms "
              f"has >= {MIN_BLOCKS} blocks (or is exempt, or is the mixer) and >= "
              f"{MIN_IN_FLIGHT_PER_SM / 1024:.1f} KiB in flight per SM; <= 7 kernel nodes a "
              f"layer resident, <= 9 graph")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
