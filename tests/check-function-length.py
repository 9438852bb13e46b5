#!/usr/bin/env python3
"""The house rule that front doors stay thin: no function in the given folders is longer than --max
lines, from the line its signature starts on to its closing brace (C++, CUDA) or its last line
(Python, each def on its own, nested ones too) (docs/architecture.md). Prints each
one over, with file, line and length, and exits 1; --self-test checks that the check itself catches a
long function and passes a short one (a check that can fail)."""
import argparse
import ast
import os
import re
import sys
import tempfile

# A definition starts at column 0 (a free function) or 2 (a member in a class body) with a name and a
# '(' and no ';' on its first line; control statements, comments and type declarations are not.
SIGNATURE = re.compile(r"^ {0,2}[A-Za-z_~][\w:<>,\s\*&~\[\]]*\([^;]*$")
NOT_A_DEFINITION = ("if", "for", "while", "switch", "return", "//", "}", "namespace", "struct", "class", "enum", "#",
                    "case", "else", "do")
STRINGS_AND_COMMENTS = re.compile(r'"([^"\\]|\\.)*"|\'([^\'\\]|\\.)*\'|//.*')


def definitions(path):
    """(first line, length, signature) of each function defined in the file."""
    lines = open(path, encoding="utf-8", errors="replace").read().split("\n")
    found, i = [], 0
    while i < len(lines):
        line = lines[i]
        if SIGNATURE.match(line) and not line.strip().startswith(NOT_A_DEFINITION):
            j = i  # the line that opens the body
            while j < len(lines) and not lines[j].rstrip().endswith("{") and ";" not in lines[j]:
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{") and ";" not in lines[j]:
                depth = 0
                for k in range(j, len(lines)):
                    code = STRINGS_AND_COMMENTS.sub("", lines[k])
                    depth += code.count("{") - code.count("}")
                    if depth <= 0:
                        break
                found.append((i + 1, k - i + 1, line.strip()))
                i = k + 1
                continue
        i += 1
    return found


def python_definitions(path):
    """(first line, length, signature) of each def in a Python file, methods and nested ones included."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    return [(n.lineno, n.end_lineno - n.lineno + 1, f"def {n.name}(...)") for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def too_long(folders, limit):
    over = []
    for folder in folders:
        for root, _, files in os.walk(folder):
            for f in sorted(files):
                path = os.path.join(root, f)
                if f.endswith((".cpp", ".h", ".cu", ".cuh")):
                    over += [(path, line, n, sig) for line, n, sig in definitions(path) if n > limit]
                elif f.endswith(".py"):
                    over += [(path, line, n, sig) for line, n, sig in python_definitions(path) if n > limit]
    return over


def self_test():
    with tempfile.TemporaryDirectory() as d:
        body = "  x += 1;\n"
        with open(os.path.join(d, "a.cpp"), "w") as f:
            f.write("int short_one(int x) {\n" + body * 5 + "  return x;\n}\n")
            f.write("int long_one(int x,\n             int y) {\n" + body * 90 + "  return x;\n}\n")
            f.write("struct S {\n  void member() {\n" + body * 85 + "  }\n};\n")
        with open(os.path.join(d, "b.py"), "w") as f:
            f.write("def short_py(x):\n    return x\n\n\n")
            f.write("def register():\n    class Inner:\n        def method(self):\n" + "            x = 1\n" * 84 + "\n")
        got = sorted(sig.split("(")[0] for _, _, _, sig in too_long([d], 80))
    if got != ["def method", "def register", "int long_one", "void member"]:
        sys.exit(f"check-function-length self-test: found {got}, wanted long_one, member, register and method")
    print("check-function-length self-test: a 93-line function, an 87-line member, an 87-line Python def and the "
          "85-line method inside it are caught, short ones are not")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max", type=int, default=80)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("folders", nargs="*")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    over = too_long(a.folders, a.max)
    for path, line, n, sig in over:
        print(f"{path}:{line}: {n} lines, more than {a.max}: {sig}")
    if over:
        sys.exit(1)
    print(f"check-function-length: no function in {', '.join(a.folders)} is longer than {a.max} lines")


if __name__ == "__main__":
    main()
