"""--capture speculators|specforge|modelopt: each trainer's exact capture set,
parsed once in C++ (CaptureSpec) and mirrored in Python (hsx.capture). Proves the
two agree (hsx-dump's files against parse_capture), that hsx-server's default and
a Client request by name give the same set, that hsx-verify --for accepts each
preset without warnings, and that unknown names are errors naming the presets."""

import json

import pytest

import hsx
from dump_helpers import write_jsonl
from hsx.capture import NAMES, parse_capture
from hsx_server import HsxServer

N = 8  # the tiny preset
ROWS = [{"input_ids": [5, 7, 11, 13], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [3, 1, 4], "loss_mask": [1, 1, 0]}]


def test_the_mirror_for_a_61_layer_model():
    assert parse_capture("eagle3", 61) == ((2, 30, 58, 61), False)
    assert parse_capture("speculators", 61) == ((2, 30, 58, 61), False)
    assert parse_capture("specforge", 61) == ((2, 30, 58), True)
    assert parse_capture("modelopt", 61, final_norm=True) == ((2, 30, 58), True)
    assert parse_capture("all", 2) == ((0, 1, 2), False)
    assert parse_capture(" 3, 1,3", 4) == ((1, 3), False)
    with pytest.raises(ValueError, match="capture id 9 is outside 0..4"):
        parse_capture("9", 4)
    with pytest.raises(ValueError, match="nothing to capture"):
        parse_capture("", 4)


@pytest.mark.parametrize("name", NAMES)
def test_hsx_dump_stores_what_the_mirror_says(run, tiny, tmp_path, name):
    write_jsonl(tmp_path / "in.jsonl", ROWS)
    run("hsx-dump", "--model", tiny, "--input", tmp_path / "in.jsonl", "--out", tmp_path / "out", "--capture", name)
    ids, final_norm = parse_capture(name, N)
    sample = hsx.read_sample(tmp_path / "out" / "hs_0.safetensors")
    assert tuple(sample.capture_ids) == ids
    assert sample["hidden_states"].shape[1] == len(ids)
    assert ("final_norm_hidden_states" in sample) == final_norm
    journal = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    assert tuple(journal["capture_ids"]) == ids and journal["final_norm"] == final_norm


@pytest.mark.parametrize("trainer", ["speculators", "specforge", "modelopt"])
def test_verify_for_accepts_its_preset_without_warnings(run, tiny, tmp_path, trainer):
    rows = ROWS if trainer != "modelopt" else [{"input_ids": r["input_ids"]} for r in ROWS]  # a mask: a warning
    write_jsonl(tmp_path / "in.jsonl", rows)
    run("hsx-dump", "--model", tiny, "--input", tmp_path / "in.jsonl", "--out", tmp_path / "out", "--capture", trainer)
    proc = run("hsx-verify", tmp_path / "out", "--input", tmp_path / "in.jsonl", "--for", trainer)
    assert f"checked for {trainer}; 0 errors, 0 warnings" in proc.stdout, proc.stdout


def test_verify_for_warns_about_what_the_trainer_does_not_read(run, tiny, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", ROWS)
    run("hsx-dump", "--model", tiny, "--input", tmp_path / "in.jsonl", "--out", tmp_path / "out", "--capture", "eagle3",
        "--final-norm")
    text = run("hsx-verify", tmp_path / "out", "--for", "specforge").stdout
    assert f"capture id N = {N} is stored but specforge does not read it (--capture specforge" in text
    text = run("hsx-verify", tmp_path / "out", "--for", "speculators").stdout
    assert "final_norm_hidden_states is stored but speculators does not read it" in text


@pytest.mark.parametrize("name", ["eagle4", "SpecForge", "speculators,", "modelopt 2"])
def test_unknown_names_are_errors_naming_the_presets(run, tiny, tmp_path, name):
    write_jsonl(tmp_path / "in.jsonl", ROWS)
    proc = run("hsx-dump", "--model", tiny, "--input", tmp_path / "in.jsonl", "--out", tmp_path / "out",
               "--capture", name, expect_ok=False)
    with pytest.raises(ValueError) as error:
        parse_capture(name, N)
    assert "one of eagle3, all, speculators, specforge, modelopt" in str(error.value)
    assert str(error.value) in proc.stderr  # the same message, word for word
    assert not (tmp_path / "out").exists()


def test_server_default_and_client_request_by_name(bin_dir, tiny):
    with HsxServer(bin_dir, tiny, "--capture", "specforge") as srv:
        client = hsx.Client(srv.address, native=False)
        default = client.extract([3, 1, 4, 1, 5])
        assert default.capture_ids == [2, 4, 5] and default["final_norm_hidden_states"].shape == (5, 128)
        by_name = client.extract([3, 1, 4], capture="speculators")
        assert by_name.capture_ids == [2, 4, 5, N] and "final_norm_hidden_states" not in by_name
        with pytest.raises(ValueError, match="one of eagle3"):
            client.extract([3, 1, 4], capture="eagle4")
