"""The multimodal guard (issue 44, item 4): a K2.5-style checkpoint names its media placeholder
token in config.json (media_placeholder_token_id); hsx runs the text model only, so hsx-server and
hsx-dump --model refuse a sample that holds it, naming the sample and the position, unless the
operator passes --allow-media-placeholder. tests/unit/media_placeholder_test.cc checks the pieces."""

import json
import shutil

import grpc
import pytest

from hsx_server import HsxServer
from server_helpers import VOCAB, error_of, read_stream

PLACEHOLDER = 1234  # within the tiny model's vocabulary (2048)
IDS = [5, 6, 7, 8, 9, PLACEHOLDER, 10, 11]  # the placeholder at position 5
EXPECTED = (f"sample_id 'mm-1': token_ids[5] = {PLACEHOLDER} is the model's media placeholder "
            "(media_placeholder_token_id); hsx extracts text only: ")


@pytest.fixture(scope="module")
def k25(make_model, tmp_path_factory):
    """The tiny model in K2.5's layout, with a top-level media_placeholder_token_id as K2.5 has."""
    model = tmp_path_factory.mktemp("k25-media") / "model"
    shutil.copytree(make_model("k2.5", seed=0), model)
    config = json.loads((model / "config.json").read_text())
    assert "text_config" in config
    config["media_placeholder_token_id"] = PLACEHOLDER
    (model / "config.json").write_text(json.dumps(config, indent=2))
    assert PLACEHOLDER < VOCAB
    return model


def extract(server, hsx_pb, ids, sample_id="mm-1"):
    pb, pb_grpc = hsx_pb
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.HiddenStatesStub(channel)
        return read_stream(stub.Extract(pb.ExtractRequest(sample_id=sample_id, token_ids=ids), timeout=60))


def test_server_refuses_a_sample_with_the_placeholder(bin_dir, k25, hsx_pb):
    with HsxServer(bin_dir, k25) as server:
        assert f"media placeholder {PLACEHOLDER} refused" in server.text()
        err = error_of(lambda: extract(server, hsx_pb, IDS))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith(EXPECTED), err.details()
        assert "--allow-media-placeholder" in err.details()
        # Text is served as before, by the same server.
        header, chunks, _, _ = extract(server, hsx_pb, [i for i in IDS if i != PLACEHOLDER], "text")
        assert header.num_tokens == len(IDS) - 1 and chunks


def test_server_extracts_it_when_the_operator_allows(bin_dir, k25, hsx_pb):
    with HsxServer(bin_dir, k25, "--allow-media-placeholder") as server:
        assert f"media placeholder {PLACEHOLDER} allowed (--allow-media-placeholder)" in server.text()
        header, chunks, _, trailer = extract(server, hsx_pb, IDS)
        assert header.sample_id == "mm-1" and header.num_tokens == len(IDS)
        assert chunks and trailer is not None


def test_in_process_dump_has_the_same_guard_and_flag(run, k25, tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": IDS}) + "\n")
    refused = run("hsx-dump", "--model", k25, "--input", inputs, "--out", tmp_path / "refused", expect_ok=False)
    assert (f"hsx-dump: error: {inputs}:2: input_ids[5] = {PLACEHOLDER} is the model's media placeholder "
            "(media_placeholder_token_id); hsx extracts text only: ") in refused.stderr
    assert not (tmp_path / "refused" / "hs_0.safetensors").exists()  # input is checked before any work

    # With --max-failures, the sample is quarantined with the same reason and the rest is extracted.
    run_dir = tmp_path / "quarantined"
    quarantined = run("hsx-dump", "--model", k25, "--input", inputs, "--out", run_dir, "--max-failures", "1",
                      expect_ok=None)
    assert quarantined.returncode == 3, quarantined.stderr
    reasons = (run_dir / "quarantine" / "shard-0-of-1.jsonl").read_text()
    assert f"input_ids[5] = {PLACEHOLDER} is the model's media placeholder" in reasons
    assert (run_dir / "hs_0.safetensors").exists() and not (run_dir / "hs_1.safetensors").exists()

    run("hsx-dump", "--model", k25, "--input", inputs, "--out", tmp_path / "allowed", "--allow-media-placeholder")
    assert (tmp_path / "allowed" / "hs_1.safetensors").exists()


def test_remote_dump_leaves_the_allowance_to_the_server(run, tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"input_ids": [1, 2]}\n')
    dump = run("hsx-dump", "--server", "127.0.0.1:1", "--input", inputs, "--out", tmp_path / "out",
               "--allow-media-placeholder", expect_ok=False, timeout=60)
    assert "hsx-dump: error: --allow_media_placeholder applies to --model only" in dump.stderr


@pytest.mark.parametrize("tool", ["hsx-server", "hsx-dump"])
def test_help_says_what_the_flag_does(run, tool):
    text = run(tool, "--help", expect_ok=None).stdout
    start = text.index("--allow_media_placeholder")
    help_text = " ".join(text[start:start + 1200].split())
    assert "media placeholder" in help_text and "Off by default" in help_text, help_text
