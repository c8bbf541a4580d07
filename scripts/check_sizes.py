#!/usr/bin/env python3
"""Checks the project's size limits on the code a reader has to hold in the head.

Under kernels/, format/, server/, client/ and tests/, no source or test file
(C++, CUDA and Python: .h .hh .hpp .c .cc .cpp .cxx .cu .cuh .py) may exceed
700 lines and no function in one may exceed 80 lines. A function's length is
lizard's `length`: the lines from its first to its last, comments and blank
lines included. Only files git tracks are checked; data files (.json, .jsonl,
...) and docs are not source.

    python scripts/check_sizes.py [--root DIR]

Prints one line per violation:

    path:line: function NAME is N lines (limit 80)
    path: N lines (limit 700)

and exits 1 if there is any; otherwise prints how many files it checked and
exits 0; exits 2 when it cannot run (lizard not
importable, DIR not a git checkout). Needs the PyPI package lizard.
"""

import argparse
import subprocess
import sys
from pathlib import Path

FOLDERS = ("kernels", "format", "server", "client", "tests")
SOURCE_SUFFIXES = (".h", ".hh", ".hpp", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".py")
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80


def tracked_sources(root: Path) -> list:
    """The tracked source files under FOLDERS, as paths relative to root."""
    listing = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--", *FOLDERS],
        capture_output=True, check=True,
    ).stdout.decode("utf-8", errors="surrogateescape")
    paths = [p for p in listing.split("\0") if p]
    return sorted(p for p in paths if p.endswith(SOURCE_SUFFIXES))


def file_violations(path: str, text: str) -> list:
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        return [f"{path}: {lines} lines (limit {MAX_FILE_LINES})"]
    return []


def function_violations(lizard, path: str, text: str) -> list:
    # lizard picks its reader by the name's suffix and reads unknown ones
    # (.cu, .cuh) as C/C++, which CUDA host and device code is.
    info = lizard.analyze_file.analyze_source_code(path, text)
    return [
        f"{path}:{f.start_line}: function {f.name} is {f.length} lines (limit {MAX_FUNCTION_LINES})"
        for f in info.function_list
        if f.length > MAX_FUNCTION_LINES
    ]


def check(root: Path, lizard) -> list:
    violations = []
    for path in tracked_sources(root):
        file = root / path
        if not file.is_file():  # deleted in the work tree, not yet in the index
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        violations += file_violations(path, text)
        violations += function_violations(lizard, path, text)
    return violations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout to check (default: this script's)")
    args = parser.parse_args()
    try:
        import lizard  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("check_sizes: the Python package lizard is not importable "
              "(pip install lizard, see tests/python/requirements.txt)", file=sys.stderr)
        return 2
    try:
        root = args.root.resolve()
        checked = len(tracked_sources(root))
        violations = check(root, lizard)
    except subprocess.CalledProcessError as e:
        print(f"check_sizes: git ls-files failed in {args.root}: {e.stderr.decode().strip()}",
              file=sys.stderr)
        return 2
    for line in violations:
        print(line)
    if violations:
        print(f"check_sizes: {len(violations)} violation(s) of the size limits "
              f"(files {MAX_FILE_LINES} lines, functions {MAX_FUNCTION_LINES})", file=sys.stderr)
        return 1
    print(f"check_sizes: {checked} files under {', '.join(FOLDERS)} within the limits "
          f"(files {MAX_FILE_LINES} lines, functions {MAX_FUNCTION_LINES})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
