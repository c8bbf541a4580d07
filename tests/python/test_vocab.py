"""python -m hsx.vocab: the draft vocabulary from token frequencies. Top-N selection
and its tie rule, the padding rule, each trainer's file layout (read back with
numpy/torch; the trainers' own loaders read them in tests/trainers/), shards summed,
every class of bad input refused with nothing written, and the command line."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hsx.vocab import FORMAT_TAG, VocabError, build, main, read_frequencies, select, sum_frequencies


def freq_file(path, counts, vocab_size=16, scope="assistant", samples=1, tokens=None, raw=None):
    """Writes a token-frequency file: counts is {token_id: count} (zero counts left out) or a list of
    pairs; raw replaces fields as they are, to write bad files."""
    if isinstance(counts, dict):
        counts = [[t, c] for t, c in sorted(counts.items()) if c]
    data = {"format": FORMAT_TAG, "vocab_size": vocab_size, "scope": scope, "samples": samples,
            "tokens": sum(c for _, c in counts) if tokens is None else tokens, "counts": counts}
    data.update(raw or {})
    path.write_text(json.dumps(data))
    return path


def chosen(tmp_path, counts, n, vocab_size=16):
    return select(read_frequencies(freq_file(tmp_path / "f.json", counts, vocab_size)), n).target_ids.tolist()


def test_top_n_by_count_in_ascending_id_order(tmp_path):
    counts = {1: 5, 3: 50, 7: 9, 9: 1, 12: 30, 15: 2}
    assert chosen(tmp_path, counts, 3) == [3, 7, 12]
    mapping = select(read_frequencies(tmp_path / "f.json"), 4)
    assert mapping.target_ids.tolist() == [1, 3, 7, 12]
    assert mapping.d2t.tolist() == [1, 2, 5, 9] and mapping.d2t.dtype == np.int64  # offsets: id - index
    assert mapping.t2d.dtype == np.bool_ and mapping.t2d.shape == (16,)
    assert np.flatnonzero(mapping.t2d).tolist() == [1, 3, 7, 12]
    assert (np.arange(4) + mapping.d2t).tolist() == [1, 3, 7, 12]
    assert mapping.padded == 0 and mapping.covered == 5 + 50 + 9 + 30


def test_ties_go_to_the_lower_token_id(tmp_path):
    assert chosen(tmp_path, {2: 4, 5: 4, 8: 4, 11: 4, 14: 9}, 3) == [2, 5, 14]
    assert chosen(tmp_path, {13: 1, 4: 1, 9: 1}, 2) == [4, 9]


def test_fewer_tokens_seen_than_n_pads_with_the_lowest_unseen_ids(tmp_path):
    mapping = select(read_frequencies(freq_file(tmp_path / "f.json", {0: 3, 2: 1, 9: 7})), 6)
    assert mapping.target_ids.tolist() == [0, 1, 2, 3, 4, 9] and mapping.padded == 3
    assert chosen(tmp_path, {}, 2) == [0, 1]  # nothing counted at all: ids 0..N-1


def test_n_equal_to_the_vocabulary_is_the_identity(tmp_path):
    mapping = select(read_frequencies(freq_file(tmp_path / "f.json", {3: 1}, vocab_size=5)), 5)
    assert mapping.target_ids.tolist() == [0, 1, 2, 3, 4] and mapping.d2t.tolist() == [0] * 5
    assert mapping.t2d.all()


def test_speculators_layout(tmp_path):
    f = freq_file(tmp_path / "f.json", {1: 5, 3: 50, 7: 9, 12: 30})
    _, _, files = build([f], 3, "speculators", tmp_path / "data")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["d2t-3.npy", "t2d-3.npy"]
    assert files == [tmp_path / "data" / "d2t-3.npy", tmp_path / "data" / "t2d-3.npy"]
    d2t, t2d = np.load(files[0]), np.load(files[1])
    assert d2t.dtype == np.int64 and d2t.tolist() == [3, 6, 10]
    assert t2d.dtype == np.bool_ and np.flatnonzero(t2d).tolist() == [3, 7, 12] and t2d.shape == (16,)


def test_specforge_layout(tmp_path):
    f = freq_file(tmp_path / "f.json", {1: 5, 3: 50, 7: 9, 12: 30})
    build([f], 3, "specforge", tmp_path / "vocab_mapping.pt")
    saved = torch.load(tmp_path / "vocab_mapping.pt", weights_only=True)
    assert sorted(saved) == ["d2t", "t2d"]
    assert saved["d2t"].dtype == torch.int64 and saved["d2t"].tolist() == [3, 6, 10]
    assert saved["t2d"].dtype == torch.bool and saved["t2d"].nonzero().flatten().tolist() == [3, 7, 12]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_modelopt_layout(tmp_path):
    f = freq_file(tmp_path / "f.json", {1: 5, 3: 50, 7: 9, 12: 30})
    build([f], 3, "modelopt", tmp_path / "d2t.pt")
    saved = torch.load(tmp_path / "d2t.pt", weights_only=True)
    assert isinstance(saved, torch.Tensor) and saved.dtype == torch.int64 and saved.tolist() == [3, 6, 10]


def test_an_existing_mapping_is_replaced(tmp_path):
    out = tmp_path / "d2t.pt"
    build([freq_file(tmp_path / "a.json", {4: 2})], 1, "modelopt", out)
    build([freq_file(tmp_path / "b.json", {9: 2})], 1, "modelopt", out)
    assert torch.load(out, weights_only=True).tolist() == [9]


def test_shards_are_summed(tmp_path):
    a = freq_file(tmp_path / "a.json", {1: 5, 2: 1, 6: 2}, samples=3)
    b = freq_file(tmp_path / "b.json", {2: 5, 6: 2, 9: 4}, samples=4)
    total = sum_frequencies([a, b])
    assert total.counts == {1: 5, 2: 6, 6: 4, 9: 4} and total.samples == 7 and total.tokens == 19
    # Neither shard alone ranks 2 first; the sum does.
    assert select(total, 2).target_ids.tolist() == [1, 2]
    assert select(read_frequencies(a), 1).target_ids.tolist() == [1]
    assert select(read_frequencies(b), 1).target_ids.tolist() == [2]


BAD = {
    "format tag": ({"format": "hsx-token-frequencies/2"}, "'format' is 'hsx-token-frequencies/2'"),
    "no format": ({"format": None}, "'format' is None"),
    "vocab_size": ({"vocab_size": 0}, "'vocab_size' must be an integer >= 1, not 0"),
    "vocab_size bool": ({"vocab_size": True}, "'vocab_size' must be an integer >= 1, not True"),
    "scope": ({"scope": "user"}, "'scope' is 'user', expected one of assistant, all"),
    "samples": ({"samples": -1}, "'samples' must be an integer >= 0"),
    "tokens sum": ({"tokens": 99}, "'tokens' is 99 but the counts sum to 8"),
    "counts type": ({"counts": {"1": 2}}, "'counts' must be a list of [token_id, count] pairs"),
    "pair": ({"counts": [[1, 2, 3]]}, "counts[0]: must be a pair of integers"),
    "float": ({"counts": [[1, 2.0]]}, "counts[0]: must be a pair of integers"),
    "id out of range": ({"counts": [[3, 2], [16, 6]]}, "counts[1]: token id 16 is out of range (vocab_size 16)"),
    "negative id": ({"counts": [[-1, 8]]}, "counts[0]: token id -1 is out of range"),
    "zero count": ({"counts": [[3, 8], [4, 0]]}, "counts[1]: count 0 for token 4"),
    "unsorted": ({"counts": [[5, 2], [3, 6]]}, "counts[1]: token id 3 after 5 (counts must be sorted by token id)"),
    "duplicate": ({"counts": [[5, 2], [5, 6]]}, "counts[1]: token id 5 listed twice"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_naming_the_file_and_entry(tmp_path, case):
    override, message = BAD[case]
    path = freq_file(tmp_path / "f.json", [[3, 2], [9, 6]], raw={"tokens": 8, **override})
    with pytest.raises(VocabError) as error:
        build([path], 2, "specforge", tmp_path / "out.pt")
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]  # nothing written


@pytest.mark.parametrize("text, message", [("{", "not valid JSON"), ("[1, 2]", "not a JSON object")])
def test_not_json_or_not_an_object(tmp_path, text, message):
    (tmp_path / "f.json").write_text(text)
    with pytest.raises(VocabError, match=message):
        read_frequencies(tmp_path / "f.json")


def test_missing_file(tmp_path):
    with pytest.raises(VocabError, match=r"missing\.json: cannot read \(No such file or directory\)"):
        read_frequencies(tmp_path / "missing.json")


def test_shards_that_disagree_are_refused(tmp_path):
    a = freq_file(tmp_path / "a.json", {1: 1})
    with pytest.raises(VocabError, match=r"b\.json: 'vocab_size' is 32, but .*a\.json has 16"):
        sum_frequencies([a, freq_file(tmp_path / "b.json", {1: 1}, vocab_size=32)])
    with pytest.raises(VocabError, match=r"c\.json: 'scope' is 'all', but .*a\.json has 'assistant'"):
        sum_frequencies([a, freq_file(tmp_path / "c.json", {1: 1}, scope="all")])


@pytest.mark.parametrize("n, message", [(17, "--draft-vocab-size 17 is larger than the target vocabulary (16 tokens)"),
                                        (0, "--draft-vocab-size must be at least 1, not 0")])
def test_impossible_draft_sizes(tmp_path, n, message):
    with pytest.raises(VocabError, match=message.replace("(", r"\(").replace(")", r"\)")):
        select(read_frequencies(freq_file(tmp_path / "f.json", {1: 1})), n)


def test_out_of_the_wrong_kind(tmp_path):
    f = freq_file(tmp_path / "f.json", {1: 1})
    with pytest.raises(VocabError, match="is a directory"):
        build([f], 1, "modelopt", tmp_path)
    with pytest.raises(VocabError, match="is not a directory"):
        build([f], 1, "speculators", f)
    with pytest.raises(VocabError, match="no such directory"):
        build([f], 1, "specforge", tmp_path / "absent" / "m.pt")


def test_command_line(tmp_path, capsys):
    a = freq_file(tmp_path / "a.json", {1: 5, 2: 1}, samples=2)
    b = freq_file(tmp_path / "b.json", {3: 4}, samples=1)
    assert main(["--frequencies", str(a), str(b), "--draft-vocab-size", "4", "--format", "modelopt",
                 "--out", str(tmp_path / "d2t.pt")]) == 0
    out, err = capsys.readouterr()
    assert "4 of 16 target tokens, covering 100.00% of 10 counted tokens (scope assistant, 3 samples)" in out
    assert "only 3 distinct tokens were seen; padded with the 1 lowest unseen token ids" in err
    assert torch.load(tmp_path / "d2t.pt", weights_only=True).tolist() == [0, 0, 0, 0]  # ids 0, 1, 2, 3
    assert main(["--frequencies", str(tmp_path / "nope.json"), "--draft-vocab-size", "1", "--format", "modelopt",
                 "--out", str(tmp_path / "x.pt")]) == 1
    assert capsys.readouterr().err.startswith(f"hsx.vocab: {tmp_path / 'nope.json'}: cannot read")


def test_module_entry_point_and_help():
    proc = subprocess.run([sys.executable, "-m", "hsx.vocab", "--help"], capture_output=True, text=True,
                          env={**os.environ})
    assert proc.returncode == 0
    for flag in ("--frequencies", "--draft-vocab-size", "--format", "--out", "speculators", "specforge",
                 "modelopt", "ties broken by the lower"):
        assert flag in proc.stdout.replace("\n", " ").replace("  ", " ")
