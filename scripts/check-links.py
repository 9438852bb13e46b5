#!/usr/bin/env python3
"""Checks the documentation's references: every relative link in README.md, docs/*.md and
bench/*.md resolves to a file of the repository (and a #fragment to a heading of it), and every
path they name (scripts/, bench/, tools/, tests/, docs/, fuzz/, src/, include/ ... ending in .sh, .py,
.md, or as source: .cpp, .h, .cu, .cuh, .c, .cmake, .txt) exists,
unless the paragraph names the commit it exists at ("at c9c9423"), which git is then asked about
(without a git history, a named commit is taken on trust).

    python3 scripts/check-links.py [ROOT]        exit 0 when every reference resolves, else 1
"""
import functools
import os
import re
import subprocess
import sys

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:scripts|bench|tools|tests|docs|fuzz|src|include)/[\w.+/-]*\w\.(?:sh|py|md|cpp|h|cu|cuh|c|cmake|txt))\b")
COMMIT = re.compile(r"\bat\s+([0-9a-f]{7,40})\b")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"`", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, seen = set(), {}
        fenced = False
        for line in open(path, encoding="utf-8"):
            if line.startswith("```"):
                fenced = not fenced
            m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                a = slug(m.group(1))
                n = seen.get(a, 0)
                seen[a] = n + 1
                found.add(a if n == 0 else f"{a}-{n}")
        cache[path] = found
    return cache[path]


@functools.lru_cache(maxsize=None)
def have_git(root):
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--git-dir"], capture_output=True).returncode == 0
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def exists_at(root, commit, path):
    """Whether PATH exists at COMMIT; without git history (a tarball) a named commit is taken on trust."""
    if not have_git(root):
        return True
    r = subprocess.run(["git", "-C", root, "cat-file", "-e", f"{commit}:{path}"], capture_output=True)
    return r.returncode == 0


def check_file(root, rel):
    problems = []
    text = open(os.path.join(root, rel), encoding="utf-8").read()
    # Paragraphs (blank-line separated) carry the "at COMMIT" that excuses a path gone since.
    for para in re.split(r"\n\s*\n", text):
        commits = COMMIT.findall(para)
        for target in LINK.findall(para):
            if re.match(r"[a-z]+:", target) or target.startswith("#") and not target[1:]:
                continue  # http:, mailto: ...
            file_part, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(rel), file_part)) if file_part else rel
            full = os.path.join(root, dest)
            if not os.path.exists(full):
                problems.append(f"{rel}: link to {target}: no file {dest}")
            elif frag and dest.endswith(".md") and frag not in anchors(full):
                problems.append(f"{rel}: link to {target}: no heading #{frag} in {dest}")
        for path in PATH.findall(para):
            if os.path.exists(os.path.join(root, path)):
                continue
            if any(exists_at(root, c, path) for c in commits):
                continue
            problems.append(f"{rel}: names {path}, which does not exist"
                            + (f" (nor at {', '.join(commits)})" if commits else " (and no commit is named beside it)"))
    return problems


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    files = ["README.md"]
    for d in ("docs", "bench"):
        files += sorted(os.path.join(d, f) for f in os.listdir(os.path.join(root, d)) if f.endswith(".md"))
    problems = [p for f in files if os.path.exists(os.path.join(root, f)) for p in check_file(root, f)]
    for p in problems:
        print(p)
    print(f"check-links: {len(files)} files, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
