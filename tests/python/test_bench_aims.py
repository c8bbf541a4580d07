"""bench/stream_cost.py's verdicts on the stream cost aims: a limit in ns/B scales with a socket pair
slower than when the aims were set, never below the plain aim, and a miss is a miss."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import stream_cost as sc  # noqa: E402


def runs_of(send, recv, streaming, discard, python=None, engine=0.3):
    """Three identical runs per side, as stream_cost records them: (server, client, engine, faults, faults)."""
    runs = {"socket": [(send, recv, 0.0, 0, 0)] * 3, "discard": [(streaming + engine, discard, engine, 0, 0)] * 3}
    if python is not None:
        runs["python"] = [(streaming + engine, python, engine, 0, 0)] * 3
    return runs


def by_name(verdicts):
    return {v.what.split(" <=")[0]: v for v in verdicts}


def test_limits_in_ns_per_byte_grow_with_a_slower_socket_pair():
    runs = runs_of(send=sc.REFERENCE_SEND * 2, recv=sc.REFERENCE_RECV * 1.5, streaming=0.6, discard=0.7, python=1.05)
    (send, recv), scales, verdicts = sc.aims(runs, ["socket", "discard", "python"])
    assert (send, recv) == (sc.REFERENCE_SEND * 2, sc.REFERENCE_RECV * 1.5)
    assert scales == (2.0, 1.5)
    v = by_name(verdicts)
    assert v["streaming"].limit == 1.0 and v["streaming"].plain == 0.5
    assert v["hsx-dump --discard"].limit == 0.75 and v["hsx-dump --discard"].value == 0.7
    assert v["streaming / socket sender"].limit == 3.0 and v["streaming / socket sender"].plain is None
    assert abs(v["streaming / socket sender"].value - 0.6 / (sc.REFERENCE_SEND * 2)) < 1e-12
    assert abs(v["python / hsx-dump --discard"].value - 1.5) < 1e-12
    assert "python-raw / hsx-dump --discard" not in v


def test_a_faster_socket_pair_keeps_the_plain_limits_and_a_miss_is_reported(capsys):
    runs = runs_of(send=sc.REFERENCE_SEND / 2, recv=sc.REFERENCE_RECV / 2, streaming=0.45, discard=0.55, python=0.8)
    _, scales, verdicts = sc.aims(runs, ["socket", "discard", "python"])
    assert scales == (1.0, 1.0)
    assert by_name(verdicts)["hsx-dump --discard"].limit == 0.5
    sc.report_aims(runs, ["socket", "discard", "python"])
    lines = {line.split("  ")[1].strip(): line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["hsx-dump --discard <= 0.5 ns/B"].rstrip().endswith("MISSED   (the plain 0.50: MISSED)")
    assert "holds   (the plain 0.50: holds)" in lines["streaming <= 0.5 ns/B"]
    assert "MISSED" not in lines["python / hsx-dump --discard <= 1.59"]
