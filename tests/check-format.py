#!/usr/bin/env python3
"""The tree keeps its .clang-format: every C, C++ and CUDA file under src/, include/, tests/ and fuzz/
is as Debian's clang-format 14 writes it (scripts/setup.sh installs it). Prints each file that
differs, with the command that formats it, and exits 1; --self-test checks that a badly formatted
file is caught and a formatted one is not (a check that can fail)."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

FOLDERS = ("src", "include", "tests", "fuzz")
EXTENSIONS = (".c", ".cpp", ".h", ".cu", ".cuh")


def clang_format():
    for name in ("clang-format-14", "clang-format"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("check-format: no clang-format (Debian's clang-format 14: scripts/setup.sh installs it)")


def sources(root):
    for folder in FOLDERS:
        for base, dirs, files in os.walk(os.path.join(root, folder)):
            dirs[:] = sorted(d for d in dirs if d not in ("data", "tmp", "__pycache__"))
            for f in sorted(files):
                if f.endswith(EXTENSIONS):
                    yield os.path.join(base, f)


def unformatted(tool, files):
    """The files clang-format would change (it finds .clang-format above each file)."""
    bad = []
    for i in range(0, len(files), 64):
        chunk = files[i:i + 64]
        r = subprocess.run([tool, "--dry-run", "--Werror", "--style=file", *chunk], capture_output=True, text=True)
        if r.returncode != 0:
            bad += [f for f in chunk if f in r.stderr]
    return bad


def self_test(tool, root):
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(os.path.join(root, ".clang-format"), d)
        good, bad = os.path.join(d, "good.cpp"), os.path.join(d, "bad.cpp")
        with open(good, "w") as f:
            f.write("int f(int x) { return x + 1; }\n")
        with open(bad, "w") as f:
            f.write("int  f( int x ){return x+1 ;}\n")
        got = unformatted(tool, [good, bad])
    if got != [bad]:
        sys.exit(f"check-format self-test: flagged {got}, wanted only the badly formatted file")
    print("check-format self-test: a badly formatted file is caught, a formatted one is not")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    tool, root = clang_format(), os.path.abspath(a.root)
    if a.self_test:
        return self_test(tool, root)
    files = list(sources(root))
    bad = unformatted(tool, files)
    for f in bad:
        print(f"{os.path.relpath(f, root)}: not as .clang-format writes it (clang-format -i --style=file {os.path.relpath(f, root)})")
    if bad:
        sys.exit(1)
    print(f"check-format: {len(files)} files under {', '.join(FOLDERS)} as .clang-format writes them")


if __name__ == "__main__":
    main()
