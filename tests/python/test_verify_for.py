"""hsx-verify --for speculators|specforge|modelopt: what each trainer assumes of a
dump (docs/trainers.md), each rule broken once."""

import json

import pytest

N = 8  # the tiny preset


def dump(run, tiny, tmp_path, name, *flags, rows=3, mask=True):
    lines = []
    for i in range(rows):
        row = {"input_ids": [(7 * i + j) % 2048 for j in range(4 + i)]}
        if mask:
            row["loss_mask"] = [j % 2 for j in range(4 + i)]
        lines.append(json.dumps(row) + "\n")
    (tmp_path / f"{name}.jsonl").write_text("".join(lines))
    run("hsx-dump", "--model", tiny, "--input", tmp_path / f"{name}.jsonl", "--out", tmp_path / name, *flags)
    return tmp_path / name


def verify(run, directory, trainer, ok):
    proc = run("hsx-verify", directory, "--for", trainer, expect_ok=ok)
    return proc.stdout


def test_eagle3_with_final_norm_passes_for_all(run, tiny, tmp_path):
    out = dump(run, tiny, tmp_path, "good", "--capture", "eagle3", "--final-norm")
    for trainer in ("speculators", "specforge", "modelopt"):
        text = verify(run, out, trainer, True)
        assert f"checked for {trainer}; 0 errors" in text
    assert "ModelOpt ignores loss_mask unless answer_only_loss" in verify(run, out, "modelopt", True)


def test_capture_ids_not_ending_in_n(run, tiny, tmp_path):
    out = dump(run, tiny, tmp_path, "no_n", "--capture", "1,2,3")
    text = verify(run, out, "speculators", False)
    assert f"capture ids [1,2,3] do not end in N = {N}" in text and "misread this dump silently" in text
    assert text.count("do not end in N") == 1  # reported once, not per sample
    assert "neither the final norm nor capture id N" in verify(run, out, "modelopt", False)


def test_specforge_needs_final_norm_and_three_aux_layers(run, tiny, tmp_path):
    out = dump(run, tiny, tmp_path, "eagle3", "--capture", "eagle3")
    assert "dump with --final-norm" in verify(run, out, "specforge", False)
    out = dump(run, tiny, tmp_path, "two_aux", "--capture", f"2,5,{N}", "--final-norm")
    assert "have 2 auxiliary layers below N = 8; SpecForge's EAGLE-3 draft reads exactly 3" in verify(
        run, out, "specforge", False)
    out = dump(run, tiny, tmp_path, "no_mask", "--capture", "eagle3", "--final-norm", mask=False)
    text = verify(run, out, "specforge", True)  # a warning only
    assert "no loss_mask" in text and "warning" in text


def test_speculators_needs_samples_without_gaps(run, tiny, tmp_path):
    out = dump(run, tiny, tmp_path, "gap", "--capture", "eagle3", rows=3)
    lines = (out / "manifest.jsonl").read_text().splitlines()
    (out / "manifest.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["index"] != 1))
    (out / "hs_1.safetensors").unlink()
    assert "samples 0..2 are not all journaled (2 of 3)" in verify(run, out, "speculators", False)


def test_unknown_trainer_is_an_error(run, tiny, tmp_path):
    out = dump(run, tiny, tmp_path, "any", "--capture", "eagle3")
    proc = run("hsx-verify", out, "--for", "eagle", expect_ok=False)
    assert "--for 'eagle': expected speculators, specforge or modelopt" in proc.stderr
