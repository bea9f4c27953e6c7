"""A byte-level BPE vocabulary trained on the corpus, in the form llama.cpp reads
(tokenizer.ggml.model "gpt2": byte-level tokens and a merge list) with Qwen2's
pre-tokenizer (tokenizer.ggml.pre "qwen2"), so llama.cpp and moegraph split text
as the training did.

The pre-tokenizer's expression is llama.cpp's for LLAMA_VOCAB_PRE_TYPE_QWEN2
(src/llama-vocab.cpp, llm_tokenizer_bpe), written here with ASCII classes
(\\p{L} as [A-Za-z], \\p{N} as [0-9]): exact on ASCII text, and the corpus is
ASCII (checked). Merges are chosen by count, ties by the pair's strings, so
the vocabulary is a function of the corpus alone.
"""
import collections
import re

PRE_TOKENIZER = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\nA-Za-z0-9]?[A-Za-z]+"
    r"|[0-9]"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+")
END_OF_TEXT = "<|endoftext|>"


def byte_symbols():
    """GPT-2's bytes_to_unicode: each byte as a printable character."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
                 list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _merge_order(item):
    """The next merge is the pair counted most; among equals, the one whose
    "a\0b" has the smallest code points (compared as negated tuples, so where
    one spelling is a prefix of the other the longer wins)."""
    (a, b), count = item
    return count, tuple(-ord(c) for c in a + "\0" + b)


def train(text, vocab_size):
    """(tokens, merges): the byte symbols, then one token a merge, then END_OF_TEXT."""
    assert text.isascii(), "the pre-tokenizer's classes are ASCII ones"
    symbol = byte_symbols()
    counts = collections.Counter(PRE_TOKENIZER.findall(text))
    words = [[symbol[b] for b in w.encode()] for w in counts]
    freq = list(counts.values())
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[a, b] += freq[i]
            where[a, b].add(i)
    tokens = [symbol[b] for b in range(256)]
    merges = []
    while len(tokens) < vocab_size - 1 and pairs:
        best = max(pairs.items(), key=_merge_order)[0]
        if pairs[best] < 2:
            break
        merged = best[0] + best[1]
        merges.append(best)
        tokens.append(merged)
        for i in list(where[best]):
            w = words[i]
            for a, b in zip(w, w[1:]):
                pairs[a, b] -= freq[i]
                if pairs[a, b] <= 0:
                    del pairs[a, b]
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(merged)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for a, b in zip(out, out[1:]):
                pairs[a, b] += freq[i]
                where[a, b].add(i)
        del where[best]
    tokens.append(END_OF_TEXT)
    return tokens, [f"{a} {b}" for a, b in merges]


class Encoder:
    """Text to ids with a trained vocabulary: pre-tokenize, then apply merges by rank."""

    def __init__(self, tokens, merges):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.symbol = byte_symbols()
        self.cache = {}

    def word(self, w):
        if w in self.cache:
            return self.cache[w]
        parts = [self.symbol[b] for b in w.encode()]
        while len(parts) > 1:
            ranked = [(self.rank.get((a, b), 1 << 30), j) for j, (a, b) in
                      enumerate(zip(parts, parts[1:]))]
            rank, j = min(ranked)
            if rank == 1 << 30:
                break
            parts[j:j + 2] = [parts[j] + parts[j + 1]]
        ids = [self.ids[p] for p in parts]
        self.cache[w] = ids
        return ids

    def encode(self, text):
        return [i for w in PRE_TOKENIZER.findall(text) for i in self.word(w)]
