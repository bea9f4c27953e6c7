"""The trained model as a GGUF v3 file llama.cpp loads as qwen3moe, and back.

write: keys and tensor names as llama.cpp's converter writes a Qwen3-MoE checkpoint
(convert_hf_to_gguf.py, Qwen3MoeModel; src/llama-arch.cpp's names), matrices f16
(ne0 the input dimension: a PyTorch weight [out, in] is ggml [in, out]), norms and
the router f32, the embedding tied (no output.weight), the vocabulary of bpe.py.
read: such a file's keys and its f32/f16 tensors, for lookahead.py.
"""
import struct

import numpy as np

U32, I32, F32_KIND, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
GGML_F32, GGML_F16 = 0, 1
ALIGNMENT = 32


def _string(s):
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def _value(kind, value):
    if kind == STRING:
        return _string(value)
    if kind == U32:
        return struct.pack("<I", value)
    if kind == I32:
        return struct.pack("<i", value)
    if kind == F32_KIND:
        return struct.pack("<f", value)
    if kind == BOOL:
        return struct.pack("<?", value)
    element, items = value
    body = b"".join(_value(element, v) for v in items)
    return struct.pack("<IQ", element, len(items)) + body


def tensors_of(model):
    """[(name, array)] in llama.cpp's order, arrays float32 in GGUF's layout."""
    def a(t):
        return t.detach().float().numpy()

    out = [("token_embd.weight", a(model.embed.weight)), ("output_norm.weight", a(model.norm.weight))]
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", a(b.attn_norm.weight)),
                (p + "attn_q.weight", a(b.attn.q.weight)),
                (p + "attn_k.weight", a(b.attn.k.weight)),
                (p + "attn_v.weight", a(b.attn.v.weight)),
                (p + "attn_output.weight", a(b.attn.o.weight)),
                (p + "attn_q_norm.weight", a(b.attn.q_norm.weight)),
                (p + "attn_k_norm.weight", a(b.attn.k_norm.weight)),
                (p + "ffn_norm.weight", a(b.ffn_norm.weight)),
                (p + "ffn_gate_inp.weight", a(b.moe.router.weight)),
                (p + "ffn_gate_exps.weight", a(b.moe.gate)),
                (p + "ffn_up_exps.weight", a(b.moe.up)),
                (p + "ffn_down_exps.weight", a(b.moe.down))]
    return out


def write(path, model, tokens, merges, name):
    c = model.c
    a = "qwen3moe."
    kvs = [("general.architecture", STRING, "qwen3moe"),
           ("general.name", STRING, name),
           ("general.file_type", U32, 1),  # LLAMA_FTYPE_MOSTLY_F16
           (a + "context_length", U32, c.ctx),
           (a + "embedding_length", U32, c.n_embd),
           (a + "block_count", U32, c.n_layer),
           (a + "feed_forward_length", U32, c.n_ff),
           (a + "attention.head_count", U32, c.n_head),
           (a + "attention.head_count_kv", U32, c.n_head_kv),
           (a + "attention.key_length", U32, c.head_dim),
           (a + "attention.value_length", U32, c.head_dim),
           (a + "rope.freq_base", F32_KIND, c.rope_base),
           (a + "attention.layer_norm_rms_epsilon", F32_KIND, c.eps),
           (a + "expert_count", U32, c.n_expert),
           (a + "expert_used_count", U32, c.top_k),
           (a + "expert_feed_forward_length", U32, c.n_ff),
           ("tokenizer.ggml.model", STRING, "gpt2"),
           ("tokenizer.ggml.pre", STRING, "qwen2"),
           ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
           ("tokenizer.ggml.token_type", ARRAY, (I32, [1] * (len(tokens) - 1) + [3])),
           ("tokenizer.ggml.merges", ARRAY, (STRING, merges)),
           ("tokenizer.ggml.eos_token_id", U32, len(tokens) - 1),
           ("tokenizer.ggml.bos_token_id", U32, len(tokens) - 1),
           ("tokenizer.ggml.add_bos_token", BOOL, False)]
    infos, blobs, offset = [], [], 0
    for name_, array in tensors_of(model):
        keep_f32 = array.ndim == 1 or name_.endswith("ffn_gate_inp.weight")
        data = array.astype(np.float32 if keep_f32 else np.float16).tobytes()
        ne = list(reversed(array.shape))
        infos.append(_string(name_) + struct.pack("<I", len(ne)) +
                     struct.pack(f"<{len(ne)}Q", *ne) +
                     struct.pack("<IQ", GGML_F32 if keep_f32 else GGML_F16, offset))
        pad = -len(data) % ALIGNMENT
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    head = [b"GGUF", struct.pack("<IQQ", 3, len(infos), len(kvs))]
    head += [_string(k) + struct.pack("<I", kind) + _value(kind, v) for k, kind, v in kvs]
    header = b"".join(head + infos)
    header += b"\0" * (-len(header) % ALIGNMENT)
    with open(path, "wb") as f:
        f.write(header)
        for blob in blobs:
            f.write(blob)


def _read_value(f, kind):
    if kind == STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode()
    if kind == ARRAY:
        element, n = struct.unpack("<IQ", f.read(12))
        return [_read_value(f, element) for _ in range(n)]
    fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", U32: "<I", I32: "<i", F32_KIND: "<f", BOOL: "<?",
           10: "<Q", 11: "<q", 12: "<d"}[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def read(path):
    """(keys {name: value}, tensors {name: float32 array in PyTorch's order}) of a file
    whose tensors are f32 or f16."""
    with open(path, "rb") as f:
        magic, _, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF", path
        keys = {}
        for _ in range(n_kv):
            name = _read_value(f, STRING)
            (kind,) = struct.unpack("<I", f.read(4))
            keys[name] = _read_value(f, kind)
        infos = []
        for _ in range(n_tensors):
            name = _read_value(f, STRING)
            (n_dims,) = struct.unpack("<I", f.read(4))
            ne = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            kind, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, ne, kind, offset))
        start = f.tell() + (-f.tell() % keys.get("general.alignment", ALIGNMENT))
        tensors = {}
        for name, ne, kind, offset in infos:
            assert kind in (GGML_F32, GGML_F16), f"{name}: type {kind}, not f32 or f16"
            dtype = np.float32 if kind == GGML_F32 else np.float16
            f.seek(start + offset)
            count = int(np.prod(ne))
            data = np.frombuffer(f.read(count * np.dtype(dtype).itemsize), dtype=dtype)
            tensors[name] = data.astype(np.float32).reshape(tuple(reversed(ne)))
    return keys, tensors
