"""The engine flags have one parser (server/runtime/engine_flags.h): hsx-server and hsx-dump
(with --model, and with --server before it connects) refuse a bad engine value with the same
message. tests/unit/engine_flags_test.cc checks the parser itself."""

import pytest

# (flags, the message both binaries give)
BAD_ENGINE_FLAGS = [
    (["--threads", "-1"], "--threads -1: expected 0 (all cores) to 1024"),
    (["--tp", "0"], "--tp must be at least 1"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens 0: expected 1 to 16777216 (the activations of a batch "
                                  "live at once)"),
    (["--precision", "fp16"], "--precision 'fp16': expected bf16 or fp32"),
    (["--attention", "flash"], "--attention 'flash': expected reference or cudnn"),
    (["--ranks-per-device", "2"], "--ranks-per-device 2: applies to --device cuda only (CPU ranks are threads)"),
    # Checked against the model's config.json, after the flags alone.
    (["--max-tokens-per-sample", "9000"], "--max-tokens-per-sample 9000 exceeds --max-batch-tokens 8192: a "
                                          "sample must fit in one batch"),
]


def error_message(proc, tool):
    """The message of `tool`'s one error line (base/cli.h: 'TOOL: error: MESSAGE')."""
    prefix = f"{tool}: error: "
    lines = [line[len(prefix):] for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture
def dump_args(tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"input_ids": [1, 2, 3]}\n')
    return ["--input", inputs, "--out", tmp_path / "out"]


@pytest.mark.parametrize("flags, message", BAD_ENGINE_FLAGS)
def test_server_and_in_process_dump_give_one_message(run, tiny, dump_args, flags, message):
    server = run("hsx-server", "--model", tiny, "--listen", "127.0.0.1:0", *flags, expect_ok=False, timeout=60)
    dump = run("hsx-dump", "--model", tiny, *dump_args, *flags, expect_ok=False, timeout=60)
    assert error_message(server, "hsx-server") == message
    assert error_message(dump, "hsx-dump") == message
    assert "listening on" not in server.stderr


@pytest.mark.parametrize("flags, message", BAD_ENGINE_FLAGS[:3])
def test_remote_dump_checks_the_engine_flags_before_it_connects(run, dump_args, flags, message):
    # Nothing listens on port 1: a dump that tried to connect would say so instead.
    dump = run("hsx-dump", "--server", "127.0.0.1:1", *dump_args, *flags, expect_ok=False, timeout=60)
    assert error_message(dump, "hsx-dump") == message


def test_remote_dump_refuses_engine_only_flags(run, dump_args):
    dump = run("hsx-dump", "--server", "127.0.0.1:1", *dump_args, "--threads", "2", expect_ok=False, timeout=60)
    assert error_message(dump, "hsx-dump") == "--threads applies to --model only"


@pytest.mark.parametrize("tool", ["hsx-server", "hsx-dump"])
def test_help_lists_the_engine_flags(run, tool):
    text = run(tool, "--help", expect_ok=None).stdout
    for flag in ("--device", "--tp", "--ranks_per_device", "--attention", "--precision", "--threads",
                 "--max_batch_tokens", "--max_tokens_per_sample", "--capture", "--final_norm"):
        assert flag in text, f"{tool} --help lacks {flag}:\n{text}"
