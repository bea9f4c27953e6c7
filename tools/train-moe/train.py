#!/usr/bin/python3
"""Trains moegraph's small MoE (a qwen3moe) on the King James Bible and writes it as GGUF.

Debian's python3-torch on the CPU (see README.md: with libopenblas0-pthread, or its
matrix products run on the reference BLAS at 5 GFLOPS). Reproducible from --seed at
a given --threads: the corpus and its split (corpus.py), the vocabulary (bpe.py), the
initialization, the batches and the learning rate (a function of the step) all
follow from them.

Every --eval-every steps it scores the held-out chapters (the mean next-token loss
over windows of --ctx tokens, each token predicted from the window before it) and
keeps the weights with the lowest; at the end it writes those as GGUF (gguf_io.py),
the loss curve as a PNG (plot.py) and the log as JSON.

Usage: train.py --out DIR [--steps N] [--seed S] [--threads T] [...]
"""
import argparse
import copy
import json
import math
import os
import sys
import time


def thread_count():
    """--threads, read before torch loads: OpenBLAS (Debian's libopenblas0-pthread)
    starts its own threads, as many as the CPUs, unless OPENBLAS_NUM_THREADS says."""
    for i, arg in enumerate(sys.argv):
        if arg == "--threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return "1"


os.environ["OPENBLAS_NUM_THREADS"] = thread_count()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe  # noqa: E402
import corpus  # noqa: E402
import gguf_io  # noqa: E402
import model as model_lib  # noqa: E402
import plot  # noqa: E402


def held_out_loss(net, ids, ctx, batch):
    """Mean next-token loss (nats) over the held-out ids in windows of ctx + 1."""
    windows = [ids[i:i + ctx + 1] for i in range(0, len(ids) - ctx - 1, ctx)]
    total, count = 0.0, 0
    net.eval()
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.tensor(windows[i:i + batch])
            logits, _ = net(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                   reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    net.train()
    return total / count


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-head-kv", type=int, default=2)
    p.add_argument("--n-expert", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--n-ff", type=int, default=32)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--balance", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--bible", default="bible")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    started = time.time()

    train_text, held_text = corpus.split(corpus.chapters(args.bible))
    tokens, merges = bpe.train(train_text, args.vocab)
    encoder = bpe.Encoder(tokens, merges)
    train_ids = torch.tensor(encoder.encode(train_text))
    held_ids = encoder.encode(held_text)
    with open(os.path.join(args.out, "held-out.txt"), "w") as f:
        f.write(held_text)
    print(f"corpus: {len(train_ids)} training tokens, {len(held_ids)} held out; vocabulary "
          f"{len(tokens)} ({time.time() - started:.0f} s)", flush=True)

    c = model_lib.Config(vocab=len(tokens), n_embd=args.n_embd, n_layer=args.n_layer,
                         n_head=args.n_head, n_head_kv=args.n_head_kv,
                         head_dim=args.n_embd // args.n_head, n_expert=args.n_expert,
                         top_k=args.top_k, n_ff=args.n_ff, ctx=args.ctx)
    net = model_lib.Qwen3Moe(c)
    n_params = sum(t.numel() for t in net.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    decay = [t for n, t in net.named_parameters() if t.dim() >= 2]
    rest = [t for n, t in net.named_parameters() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(args.seed)
    train_start = time.time()
    log = {"args": vars(args), "parameters": n_params, "train": [], "held_out": []}
    best, best_state, step = math.inf, None, 0
    warmup = 100
    while True:
        elapsed = time.time() - train_start
        done = step >= args.steps
        if step % args.eval_every == 0 or done:
            loss = held_out_loss(net, held_ids, args.ctx, args.batch)
            seen = step * args.batch * args.ctx
            log["held_out"].append((seen, loss))
            if loss < best:
                best, best_state = loss, copy.deepcopy(net.state_dict())
            print(f"step {step}: held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}), "
                  f"{seen} tokens seen, {elapsed / 60:.1f} min", flush=True)
        if done:
            break
        # The learning rate: linear warm-up, then a cosine to a tenth over the steps.
        progress = step / args.steps
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - args.ctx - 1, (args.batch,), generator=generator)
        x = torch.stack([train_ids[s:s + args.ctx + 1] for s in starts.tolist()])
        logits, balance = net(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + args.balance * balance).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            log["train"].append((step * args.batch * args.ctx, loss.item()))
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f} balance {balance.item():.3f} lr {lr:.2e}",
                  flush=True)

    net.load_state_dict(best_state)
    log["best_held_out"] = best
    log["steps"] = step
    log["minutes"] = (time.time() - started) / 60
    gguf_io.write(os.path.join(args.out, "kjv-moe-f16.gguf"), net, tokens, merges,
                   f"moegraph kjv-moe seed {args.seed}")
    plot.write(os.path.join(args.out, "loss.png"), log["train"], log["held_out"],
               y_max=math.ceil(max(l for _, l in log["train"][:1] + log["held_out"])))
    with open(os.path.join(args.out, "train-log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"best held-out loss {best:.4f} (perplexity {math.exp(best):.2f}); wrote "
          f"{args.out}/kjv-moe-f16.gguf", flush=True)


if __name__ == "__main__":
    main()
