"""The corpus: the King James Bible as Debian's bible-kjv prints it, split by chapter.

`bible -l0 gen1:1-rev22:21` (packages bible-kjv and bible-kjv-text) prints every
chapter as a heading line ("Genesis 1"), a blank line, and its verses, one a line,
each after its number. The text is public domain (the 1611 translation; Debian's
copyright file says so); the program's data file is free to copy ("Users may copy,
modify or distribute this file at will").

A chapter becomes its heading, a blank line and its verses without their numbers.
Every 20th chapter (index % 20 == 19, 59 of 1,189) is held out: it is never trained
on and is what `moegraph perplexity` scores.
"""
import re
import subprocess

HELD_OUT_EVERY = 20


def chapters(bible="bible"):
    """[(heading, [verse text, ...])] in canonical order."""
    text = subprocess.run([bible, "-l0", "gen1:1-rev22:21"], check=True, capture_output=True,
                          text=True).stdout
    result = []
    for line in text.splitlines():
        if not line.strip():
            continue
        verse = re.fullmatch(r"\s+\d+ (.*)", line)
        if verse:
            result[-1][1].append(verse.group(1).strip())
        else:
            result.append((line.strip(), []))
    return result


def chapter_text(heading, verses):
    return heading + "\n\n" + "\n".join(verses) + "\n\n"


def split(chapters_list):
    """(training text, held-out text): the chapters, every HELD_OUT_EVERY-th held out."""
    train, held_out = [], []
    for i, (heading, verses) in enumerate(chapters_list):
        (held_out if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(
            chapter_text(heading, verses))
    return "".join(train), "".join(held_out)
