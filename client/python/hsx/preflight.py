"""The checks an online run makes before its first sample: the server answers,
accepts the token, and serves the model the trainer was configured for.

Each raises at once with a message naming the server and the field, instead of
the run waiting on retries (a wrong address) or training on states of another
model (a mismatch that would otherwise surface as a shape error deep in the
trainer, or not at all).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from .client import RETRYABLE, Client, ServerError
from .model_config import language_config

# The ModelInfo fields a trainer's configuration can pin, and the names
# transformers' config.json gives them.
CHECKED_FIELDS = ("hidden_size", "vocab_size", "num_layers")
CONFIG_NAMES = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_layers": "num_hidden_layers"}


class ServerUnreachable(ServerError):
    """No answer from the server within the connect timeout (a wrong address, or a
    server that is not up). A ServerError, not an OSError: loaders that retry
    transient I/O errors (ModelOpt's) must not retry it sample by sample. Constructible
    from the message alone, so that torch's DataLoader re-raises it from a worker as
    itself, not as a RuntimeError."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(code, message)


class ModelMismatch(ValueError):
    """The server serves a model other than the one the trainer is configured for."""


def server_model_info(target: str, token: str | None = None, tls: bool | dict[str, Any] | None = None,
                      connect_timeout: float = 20.0) -> dict[str, Any]:
    """The server's ModelInfo (as Client.model_info gives it), asked until connect_timeout
    seconds have passed while the server is unavailable; a refused token or any other
    status raises ServerError at once, no answer in time ServerUnreachable."""
    deadline = time.monotonic() + connect_timeout
    with Client(target, token=token, tls=tls, retries=0) as client:
        while True:
            try:
                return client.model_info()
            except ServerError as error:
                if error.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise ServerError(error.code, f"hsx-server {target} refused the token: {error.message}") from None
                if error.code not in RETRYABLE:
                    raise ServerError(error.code, f"hsx-server {target}: {error.message}") from None
                if time.monotonic() >= deadline:
                    raise ServerUnreachable(f"hsx-server {target} did not answer within {connect_timeout:g} s "
                                            f"({error.message})", error.code) from None
            time.sleep(0.2)


def check_model(info: Mapping[str, Any], expect: Mapping[str, int] | None = None,
                capture: Sequence[int] | None = None, source: str = "the trainer's configuration",
                target: str = "") -> None:
    """Raises ModelMismatch when a field of `expect` (hidden_size, vocab_size, num_layers)
    differs from the server's ModelInfo, or a capture id is not in 0..num_layers."""
    where = f"hsx-server {target}" if target else "hsx-server"
    for field, wanted in (expect or {}).items():
        if field not in CHECKED_FIELDS:
            raise ValueError(f"expect: unknown field {field!r}; expected some of {CHECKED_FIELDS}")
        have = int(info.get(field, 0))
        if wanted is not None and have != int(wanted):
            raise ModelMismatch(f"{where} serves {info.get('model_name', '?')!r} with {field} {have}, but "
                                f"{source} has {field} {int(wanted)}: a different model")
    layers = int(info.get("num_layers", 0))
    bad = [c for c in capture or [] if not 0 <= int(c) <= layers]
    if bad:
        raise ModelMismatch(f"{where}: capture ids {bad} are not layers of {info.get('model_name', '?')!r} "
                            f"(0..{layers}, {layers} = the last layer's output)")


def config_expectation(model_dir: str | os.PathLike) -> dict[str, int]:
    """hidden_size, vocab_size and num_layers from a transformers checkpoint's config.json
    (the verifier / target model a trainer is configured with)."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read the model's config ({error})") from None
    config = language_config(config)  # multimodal configs nest the language model's
    return {field: int(config[name]) for field, name in CONFIG_NAMES.items() if name in config}


def preflight(servers: Sequence[str], token: str | None = None, tls: bool | dict[str, Any] | None = None,
              connect_timeout: float = 20.0, expect: Mapping[str, int] | None = None,
              capture: Sequence[int] | None = None, source: str = "the trainer's configuration") -> list[dict]:
    """Every server's ModelInfo after server_model_info and check_model; the servers must
    also agree with each other (one model, one revision)."""
    infos = []
    for target in servers:
        info = server_model_info(target, token, tls, connect_timeout)
        check_model(info, expect, capture, source, target)
        infos.append(info)
    revisions = {(i.get("model_name"), i.get("model_revision")) for i in infos}
    if len(revisions) > 1:
        raise ModelMismatch(f"the servers serve different models: {sorted(revisions)}")
    return infos
