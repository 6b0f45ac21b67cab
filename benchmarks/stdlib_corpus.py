"""A corpus of every .py file of this Python's standard library, site-packages left out (about 30 MB of byte
tokens: 1790 files, 31.5 MB on Python 3.11), for data.source = "text".

The embedded corpus (the standard library's top-level files, 4.7 MB) is read about three times over by the 150M
fidelity runs (2 nodes x 800 steps x 16 x 512 tokens); this one well under once, as in pretraining, where a
run that memorizes faster does not score better for it.

    python3 benchmarks/stdlib_corpus.py DIR      # then --data.source text --data.path DIR
"""

import os
import shutil
import sys
import sysconfig

SKIP = ("site-packages", "dist-packages", "__pycache__")


def build(dst: str) -> tuple:
    """Copies the .py files under dst (their paths relative to the standard library's root); returns (files,
    bytes)."""
    root = sysconfig.get_paths()["stdlib"]
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            src = os.path.join(dirpath, name)
            out = os.path.join(dst, os.path.relpath(src, root))
            os.makedirs(os.path.dirname(out), exist_ok=True)
            shutil.copyfile(src, out)
            files, size = files + 1, size + os.path.getsize(src)
    return files, size


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    n, size = build(sys.argv[1])
    print(f"corpus: {n} .py files of {sysconfig.get_paths()['stdlib']}, {size / 1e6:.1f} MB, under {sys.argv[1]}")
