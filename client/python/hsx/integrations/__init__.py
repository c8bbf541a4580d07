"""Online training from hsx-server inside each trainer's own training loop.

    hsx.integrations.speculators  a hidden-states backend for speculators 0.9.0
                                  (`--hidden-states-backend hsx`), registered in its
                                  hs_connectors registry; python -m hsx.integrations.speculators
                                  runs `speculators train` with it
    hsx.integrations.modelopt     a StreamingDataset for ModelOpt 0.47.0 (its online
                                  interface, plugins/hf_streaming_dataset.py) fetching from hsx
    hsx.integrations.specforge    a dataset yielding, per sample, exactly the dict
                                  SpecForge 0.2.0's offline loop reads (its normalizer
                                  applied), for its own collator and step

Each trainer is an optional dependency (pip install "hsx[speculators]" etc.), imported
only when its module is; the versions named are the ones tested (tests/trainers).
Each checks before the first sample that the server answers, accepts the token and
serves the model the trainer is configured with (hsx.preflight).
"""

from __future__ import annotations
