"""A corpus of every .py file of this Python's standard library, site-packages left out (about 30 MB of byte
tokens: 1790 files, 31.5 MB on Python 3.11), for data.source = "text"; with --packages, also the .py files of
those installed packages (site-packages), for a corpus large enough to tokenize with a BPE and still read under
once.

The embedded corpus (the standard library's top-level files, 4.7 MB) is read about three times over by the 150M
fidelity runs (2 nodes x 800 steps x 16 x 512 tokens); this one well under once, as in pretraining, where a
run that memorizes faster does not score better for it.

    python3 benchmarks/stdlib_corpus.py DIR      # then --data.source text --data.path DIR
    python3 benchmarks/stdlib_corpus.py DIR --packages torch,numpy,scipy   # then prime-tokenize DIR --vocab-size N
"""

import argparse
import importlib.util
import os
import shutil
import sysconfig

SKIP = ("site-packages", "dist-packages", "__pycache__")


def copy_tree(root: str, dst: str) -> tuple:
    """Copies the .py files under root to dst, keeping their paths relative to root; returns (files, bytes)."""
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


def package_root(name: str) -> str:
    """The directory of an installed package; SystemExit naming it when it is not installed or is one module."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"stdlib_corpus: --packages: {name!r} is not an installed package")
    return list(spec.submodule_search_locations)[0]


def build(dst: str, packages: tuple = ()) -> tuple:
    """The standard library's .py files under dst, and each package's under dst/site-packages/NAME; returns
    (files, bytes)."""
    files, size = copy_tree(sysconfig.get_paths()["stdlib"], dst)
    for name in packages:
        n, b = copy_tree(package_root(name), os.path.join(dst, "site-packages", name))
        files, size = files + n, size + b
    return files, size


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--packages", default="", help="comma-separated installed packages to add (e.g. torch,numpy)")
    a = ap.parse_args()
    pkgs = tuple(p for p in a.packages.split(",") if p)
    n, size = build(a.dir, pkgs)
    what = " and of " + ", ".join(pkgs) if pkgs else ""
    print(f"corpus: {n} .py files of {sysconfig.get_paths()['stdlib']}{what}, {size / 1e6:.1f} MB, under {a.dir}")
