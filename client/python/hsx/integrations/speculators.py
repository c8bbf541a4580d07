"""speculators 0.9.0 trains online from hsx-server: an "hsx" hidden-states backend in
its own plug-in registry (hs_connectors.HiddenStatesBackend), which its
`speculators train` selects with --hidden-states-backend hsx.

    python -m hsx.integrations.speculators --verifier-name-or-path MODEL --data-path DATA \
        --speculator-type eagle3 --hidden-states-backend hsx --hsx-server HOST:PORT [...]

runs speculators' own entry point (`speculators train`; under torchrun the same) after
registering the backend; the registry is read when speculators' config module is
imported, so the backend must be registered first (register() does, or importing
this module).

speculators' ArrowDataset asks the backend for hs_{i} by file index (get_cached); the
backend extracts row i of the prepared dataset (DATA, the output of `speculators
prepare-data`) from hsx-server and returns what hs_{i}.safetensors would hold:
hidden_states [T, L, H] (the target layers, then N: the verifier's last hidden state)
and token_ids [T]. Nothing is written to disk. speculators' own sampler shares the
indices out over ranks; its DataLoader workers (spawned) give the concurrency, one
extraction in flight per worker.

Flags (--hsx-*): --hsx-server (addresses, comma-separated: a worker spreads its
samples over them), --hsx-token-file, --hsx-connect-timeout (s), --hsx-retries. The
capture ids are speculators' target layer ids (--target-layer-ids, else EAGLE-3's
2, N/2, N-3) and N. Before training, from_train_args checks that every server
answers, accepts the token and serves a model with the verifier's hidden_size,
vocab_size and num_hidden_layers (hsx.preflight).
"""

from __future__ import annotations

import os
from typing import Any

from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from ..capture import parse_capture
from ..client import Client
from ..preflight import check_model, config_expectation, preflight

NAME = "hsx"


class HsxTransfer(HiddenStatesTransfer):
    """Serves speculators' get_cached(i) from hsx-server: row i of the prepared dataset,
    extracted and verified, as the dict hs_{i}.safetensors would hold. Picklable into
    spawned workers; each process opens its own connections on first use."""

    def __init__(self, data_path: str, servers: list[str], capture: list[int], token: str | None = None,
                 retries: int = 30) -> None:
        self.data_path = str(data_path)
        self.servers = list(servers)
        self.capture = list(capture)
        self.token = token
        self.retries = retries
        self._pid: int | None = None
        self._clients: list[Client] = []
        self._rows: Any = None
        self._next = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": None, "_clients": [], "_rows": None}

    def setup(self) -> None:
        if self._pid == os.getpid():
            return
        from datasets import load_from_disk

        self._rows = load_from_disk(self.data_path).with_format(None)
        self._clients = [Client(s, token=self.token, retries=self.retries) for s in self.servers]
        self._pid = os.getpid()

    def get_cached(self, file_idx: int) -> dict[str, Any]:
        import torch

        self.setup()
        if not 0 <= file_idx < len(self._rows):
            raise IndexError(f"hsx: file index {file_idx} is not a row of {self.data_path} ({len(self._rows)} rows)")
        client = self._clients[self._next % len(self._clients)]
        self._next += 1
        sample = client.extract(self._rows[file_idx]["input_ids"], capture=self.capture, torch=True,
                                sample_id=str(file_idx), index=file_idx)
        return {"hidden_states": sample["hidden_states"], "token_ids": sample["token_ids"].to(torch.long)}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> None:
        raise RuntimeError("hsx: samples are extracted by index (get_cached); there is no vLLM round trip to read")


class HsxBackend(HiddenStatesBackend):
    """The "hsx" backend: its train flags and the HsxTransfer they configure."""

    @staticmethod
    def add_train_args(parser: Any) -> None:
        parser.add_argument("--hsx-server", type=str, default=None,
                            help="hsx-server address(es), comma-separated (backend hsx).")
        parser.add_argument("--hsx-token-file", type=str, default=None,
                            help="File holding hsx-server's bearer token (backend hsx).")
        parser.add_argument("--hsx-connect-timeout", type=float, default=20.0,
                            help="Seconds to wait for hsx-server to answer at start (backend hsx).")
        parser.add_argument("--hsx-retries", type=int, default=30,
                            help="Retries of a sample whose stream broke (backend hsx).")

    @staticmethod
    def add_launch_args(parser: Any) -> None:
        """hsx-server is the producer; there is no vLLM to launch."""

    @staticmethod
    def from_train_args(args: Any, data_path: str) -> HsxTransfer:
        servers = [s.strip() for s in (args.hsx_server or "").split(",") if s.strip()]
        if not servers:
            raise ValueError("--hidden-states-backend hsx needs --hsx-server HOST:PORT[,HOST:PORT...]")
        token = None
        if args.hsx_token_file:
            with open(args.hsx_token_file) as f:
                token = f.read().strip()
        verifier = getattr(args, "verifier_name_or_path", None)
        expect = config_expectation(verifier) if verifier and os.path.isdir(verifier) else {}
        # A hub id has no local config.json to check: then N is the server's.
        infos = preflight(servers, token, None, args.hsx_connect_timeout, expect,
                          source=f"the verifier's config ({verifier})")
        layers = int(infos[0]["num_layers"])
        target = getattr(args, "target_layer_ids", None)
        capture = sorted(set(target)) + [layers] if target else list(parse_capture("speculators", layers)[0])
        check_model(infos[0], capture=capture, target=servers[0])
        return HsxTransfer(data_path, servers, capture, token, args.hsx_retries)

    @staticmethod
    def build_kv_transfer_config(args: Any) -> dict[str, Any]:
        raise RuntimeError("hsx: hsx-server extracts the hidden states; no vLLM kv_transfer_config applies")


def register() -> None:
    """Adds the "hsx" backend to speculators' registry (once). Call before speculators'
    config module (speculators.train.config) is imported: it reads the registry then."""
    if NAME not in HiddenStatesBackend.registry:
        HiddenStatesBackend.register(NAME)(HsxBackend)


register()


def main(argv: list[str] | None = None) -> None:
    """`speculators train` with the hsx backend registered (flags as `speculators train`)."""
    import sys

    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
