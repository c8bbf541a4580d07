"""Capture sets by name, as hsx-server's and hsx-dump's --capture parse them
(format/capture_spec.cc, CaptureSpec::Parse; docs/trainers.md says what each
trainer reads). Capture id k is the residual stream entering decoder layer k;
id N (the model's layer count) is the last layer's output before the final norm.

  eagle3        {2, N/2, N-3, N}
  all           0..N
  speculators   {2, N/2, N-3, N}: its auxiliary layers and its last column N
  specforge     {2, N/2, N-3} and the post-final-norm state (not N)
  modelopt      {2, N/2, N-3} and the post-final-norm state (not N)
  "2,30,58,61"  a list of ids
"""

from __future__ import annotations

NAMES = ("eagle3", "all", "speculators", "specforge", "modelopt")


def eagle3_ids(num_layers: int) -> list[int]:
    """hsx-dump's --capture eagle3: 2, N/2, N-3 and N, in range, ascending, each once."""
    return sorted({i for i in (2, num_layers // 2, num_layers - 3, num_layers) if 0 <= i <= num_layers})


def parse_capture(text: str, num_layers: int, final_norm: bool = False) -> tuple[tuple[int, ...], bool]:
    """(capture ids ascending and unique, final norm wanted) for a --capture value.
    A trainer preset brings its own final norm; `final_norm` adds it elsewhere.
    Raises ValueError naming the offending part, as CaptureSpec::Parse does."""
    if text == "speculators" or text == "eagle3":
        ids = eagle3_ids(num_layers)
    elif text in ("specforge", "modelopt"):
        ids, final_norm = [i for i in eagle3_ids(num_layers) if i < num_layers], True
    elif text == "all":
        ids = list(range(num_layers + 1))
    else:
        ids = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            try:
                ids.append(int(part))
            except ValueError:
                raise ValueError(f"capture id {part!r} is not an integer (nor is {text!r} one of "
                                 f"{', '.join(NAMES)})") from None
        for i in ids:
            if not 0 <= i <= num_layers:
                raise ValueError(f"capture id {i} is outside 0..{num_layers} (the model has {num_layers} "
                                 "layers; id N is the last layer's output)")
        ids = sorted(set(ids))
    if not ids and not final_norm:
        raise ValueError("nothing to capture: give capture ids or the final norm")
    return tuple(ids), final_norm
