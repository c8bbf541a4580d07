"""The language model's part of a transformers config.json, read as hsx-server reads it."""

from __future__ import annotations

from typing import Any


def language_config(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of the language model: `text_config` for a multimodal checkpoint that nests
    them (Kimi-K2.5), the config itself otherwise. The server (server/model/config.cc) reads
    the architecture from the same place, so a field found here is the one it serves."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config
