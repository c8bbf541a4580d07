"""hsx.prepare streams: its peak memory does not grow with the input. The same measurement as
bench/prepare_memory.py (ru_maxrss of the hsx.prepare process, measured from a small wrapper process), at a size CI can afford:
0.2 MB against 2 MB of conversations (the larger one's output holds about 1.6 million token ids,
hundreds of MiB if a run kept its samples as Python lists)."""

import sys
from pathlib import Path

from prepare_helpers import model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import prepare_memory  # noqa: E402  (bench/prepare_memory.py: the input generator)

GROWTH_LIMIT_MIB = 12  # measured: 3 MiB flat; 24 MiB when every sample's lists are kept


def _peak_rss_mib(model, source, out):
    cmd = [sys.executable, "-m", "hsx.prepare", "--model", str(model), "--input", str(source), "--output", str(out),
           "--no-progress"]
    code, stderr, peak = prepare_memory.run_measured(cmd)  # not forked from pytest: its RSS would count
    assert code == 0, stderr
    return peak


def test_peak_memory_is_flat_in_the_input_size(tmp_path):
    model = model_dir(tmp_path, "kimi-k2-instruct")
    peaks = {}
    for size in (200_000, 2_000_000):
        source = tmp_path / f"chats-{size}.jsonl"
        prepare_memory.generate(source, size)
        peaks[size] = _peak_rss_mib(model, source, tmp_path / f"out-{size}.jsonl")
    growth = peaks[2_000_000] - peaks[200_000]
    print(f"peak RSS (MiB): {peaks}")
    assert growth < GROWTH_LIMIT_MIB, f"peak RSS {peaks} MiB: grew by {growth:.1f} MiB for 10x the input"
