"""scripts/check_sizes.py: the file-size and function-size limits.

Runs the checker on small git trees made here: one with a function of 81
lines and a file of 701 lines (both must be named, exit 1), and one within the
limits (exit 0). Skips when lizard, which the checker needs, is not importable.
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lizard", reason="scripts/check_sizes.py needs the PyPI package lizard")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_sizes.py"


def cc_function(name: str, lines: int) -> str:
    """A C++ function of exactly `lines` lines, first to last."""
    body = [f"  total += {i};" for i in range(lines - 3)]
    return "\n".join([f"int {name}(int total) {{", *body, "  return total;", "}"]) + "\n"


def py_function(name: str, lines: int) -> str:
    """A Python function of exactly `lines` lines, first to last."""
    body = [f"    total += {i}" for i in range(lines - 2)]
    return "\n".join([f"def {name}(total):", *body, "    return total"]) + "\n"


def make_tree(root: Path, files: dict, untracked: dict = None) -> Path:
    """A git checkout at root holding `files` (tracked) and `untracked`."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    for path, text in {**files, **(untracked or {})}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    subprocess.run(["git", "-C", str(root), "add", "--", *files], check=True)
    return root


def run_checker(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_names_a_long_function_and_a_long_file(tmp_path):
    short = py_function("short", 3)
    root = make_tree(tmp_path / "tree", {
        "kernels/long_function.cc": cc_function("ok", 80) + cc_function("TooLong", 81),
        "tests/long_file.py": short * 234,  # 702 lines of 3-line functions
        "kernels/fine.cu": cc_function("Kernel", 80),
        "docs/notes.py": py_function("outside", 200),   # not a checked folder
        "tests/data/big.json": "[\n" + "1,\n" * 800 + "1]\n",  # data, not source
    }, untracked={"server/scratch.cc": cc_function("Untracked", 200)})
    proc = run_checker(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "kernels/long_function.cc:81: function TooLong is 81 lines (limit 80)" in lines
    assert "tests/long_file.py: 702 lines (limit 700)" in lines
    assert len(lines) == 2, proc.stdout  # nothing else: 80 lines, other folders, data, untracked


def test_a_long_cuda_kernel_is_named(tmp_path):
    root = make_tree(tmp_path / "tree", {"kernels/k.cu": "__global__ " + cc_function("Kernel", 90)})
    proc = run_checker(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "kernels/k.cu:1: function Kernel is 90 lines (limit 80)" in proc.stdout.splitlines()


def test_a_tree_within_the_limits_passes(tmp_path):
    root = make_tree(tmp_path / "tree", {
        "kernels/fine.cc": cc_function("Fine", 80),
        "client/fine.py": py_function("fine", 80) * 8,  # 640 lines
        "format/empty.h": "",
    })
    proc = run_checker(root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("check_sizes: 3 files under "), proc.stdout
    assert "within the limits" in proc.stdout
