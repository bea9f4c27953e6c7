#!/usr/bin/python3
"""The hidden-state lookahead on the trained model: how well layer l+1's router,
applied to layer l's output, predicts the experts layer l+1 will choose.

For each position of the held-out text (chunks of --ctx tokens from an empty
context) and each layer l+1 >= 1: the prediction is the top m of
softmax(router_{l+1}(ffn_norm_{l+1}(h_l))), h_l the residual stream leaving layer
l (before layer l+1's attention); the truth is layer l+1's own top k (its router
on its normed input after its attention). Recall at m = |prediction ∩ truth| / k,
averaged over positions, for m = k, 2k and 4k: the share of a layer's experts a
prefetch of m experts, issued one layer ahead, would have in time. The forward
is model.py's (llama.cpp's qwen3moe arithmetic) on the GGUF's weights.

Usage: lookahead.py MODEL.gguf TEXT [--ctx 512] [--chunks N] [--threads T]
Prints a markdown table, a row per predicted layer.
"""
import argparse
import math
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe  # noqa: E402
import gguf_io  # noqa: E402
import model as model_lib  # noqa: E402


def load(path):
    """(the model with the file's weights, its tokenizer)."""
    keys, t = gguf_io.read(path)
    a = "qwen3moe."
    n_embd, n_head = keys[a + "embedding_length"], keys[a + "attention.head_count"]
    c = model_lib.Config(vocab=len(keys["tokenizer.ggml.tokens"]), n_embd=n_embd,
                         n_layer=keys[a + "block_count"], n_head=n_head,
                         n_head_kv=keys[a + "attention.head_count_kv"],
                         head_dim=keys[a + "attention.key_length"],
                         n_expert=keys[a + "expert_count"], top_k=keys[a + "expert_used_count"],
                         n_ff=keys[a + "expert_feed_forward_length"], ctx=keys[a + "context_length"],
                         rope_base=keys[a + "rope.freq_base"])
    net = model_lib.Qwen3Moe(c)
    state = {"embed.weight": t["token_embd.weight"], "norm.weight": t["output_norm.weight"]}
    for i in range(c.n_layer):
        p, b = f"blk.{i}.", f"blocks.{i}."
        for ours, theirs in (("attn_norm.weight", "attn_norm.weight"), ("attn.q.weight", "attn_q.weight"),
                             ("attn.k.weight", "attn_k.weight"), ("attn.v.weight", "attn_v.weight"),
                             ("attn.o.weight", "attn_output.weight"),
                             ("attn.q_norm.weight", "attn_q_norm.weight"),
                             ("attn.k_norm.weight", "attn_k_norm.weight"),
                             ("ffn_norm.weight", "ffn_norm.weight"),
                             ("moe.router.weight", "ffn_gate_inp.weight"),
                             ("moe.gate", "ffn_gate_exps.weight"), ("moe.up", "ffn_up_exps.weight"),
                             ("moe.down", "ffn_down_exps.weight")):
            state[b + ours] = t[p + theirs]
    net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    merges = keys["tokenizer.ggml.merges"]
    return net.eval(), bpe.Encoder(keys["tokenizer.ggml.tokens"], merges)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=-1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    net, encoder = load(args.model)
    c = net.c
    with open(args.text) as f:
        ids = encoder.encode(f.read())
    n_chunk = len(ids) // args.ctx
    if args.chunks >= 0:
        n_chunk = min(n_chunk, args.chunks)
    widths = (c.top_k, 2 * c.top_k, 4 * c.top_k)
    hits = torch.zeros(c.n_layer, len(widths))
    positions = scored = 0
    nll = 0.0
    with torch.no_grad():
        for i in range(n_chunk):
            x = net.embed(torch.tensor([ids[i * args.ctx:(i + 1) * args.ctx]]))
            cos, sin = net.cos[:args.ctx], net.sin[:args.ctx]
            for layer, b in enumerate(net.blocks):
                leaving = x  # h_{layer-1}: what the layer before handed on
                x = x + b.attn(b.attn_norm(x), cos, sin)
                truth = b.moe.router(b.ffn_norm(x)).softmax(-1).topk(c.top_k, dim=-1).indices
                if layer > 0:
                    guess = b.moe.router(b.ffn_norm(leaving)).softmax(-1)
                    for w, m in enumerate(widths):
                        top = guess.topk(m, dim=-1).indices
                        hits[layer, w] += (top.unsqueeze(-1) == truth.unsqueeze(-2)).any(-2).sum()
                y, _ = b.moe(b.ffn_norm(x))
                x = x + y
            # The chunk's perplexity terms as llama-perplexity scores them: a check
            # that this forward is the engines' (compare `moegraph perplexity`).
            logits = net.norm(x) @ net.embed.weight.T
            first = args.ctx // 2
            chunk = torch.tensor(ids[i * args.ctx:(i + 1) * args.ctx])
            nll += torch.nn.functional.cross_entropy(
                logits[0, first:-1], chunk[first + 1:], reduction="sum").item()
            scored += args.ctx - 1 - first
            positions += args.ctx
    print(f"lookahead on {args.model}: {n_chunk} chunks of {args.ctx}, {positions} positions, "
          f"top-{c.top_k} of {c.n_expert}; perplexity {math.exp(nll / scored):.4f} over the "
          f"chunks' second halves")
    print()
    print("| layer | recall at " + " | recall at ".join(str(m) for m in widths) + " |")
    print("| ---: |" + " ---: |" * len(widths))
    for layer in range(1, c.n_layer):
        cells = " | ".join(f"{hits[layer, w] / (positions * c.top_k):.3f}" for w in range(len(widths)))
        print(f"| {layer} | {cells} |")
    mean = hits[1:].sum(0) / (positions * c.top_k * (c.n_layer - 1))
    print("| mean | " + " | ".join(f"{v:.3f}" for v in mean.tolist()) + " |")


if __name__ == "__main__":
    main()
