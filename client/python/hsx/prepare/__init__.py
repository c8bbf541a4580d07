"""python -m hsx.prepare: chat conversations -> hsx-dump's input (token ids and an assistant-only loss mask).

    python -m hsx.prepare --model MODEL_DIR --input CHATS.jsonl --output OUT.jsonl [--max-tokens N] ...

The package's parts:

  chats    the three input layouts (ShareGPT, OpenAI messages, prompt/response), sample ids and
           what counts as bad input
  masking  the model's tokenizer and chat template, and the mask rule (prefix rendering: the
           characters each assistant message adds are its span; a token overlapping a span is 1)
  fidelity what an assistant message holds, and whether a rendered turn still holds it
  turns    one assistant turn at its generation boundary: its prompt and its completion
  rows     the rows written for a conversation (--rows auto|packed|per-turn), each checked
  run      the streaming, resumable run: shards, --max-tokens, the report and frequency files
  cli      the command line

Regeneration (`python -m hsx.prepare requests|responses`: the target model answers each prompt):

  engines       vLLM's and SGLang's offline formats: the request lines written, the output lines read
  regenerate    conversations -> requests (one per turn), outputs -> rows of the engine's exact ids
  regen_cli     the two subcommands
  sglang_batch  a runner for SGLang's offline engine (run as a file where sglang is installed)

The user documentation is docs/prepare.md.
"""

from .chats import Conversation, InputError, canonical_id, parse_line
from .masking import Masker, NotPrefixStable, PrepareError, SampleError, TemplateRaised, load_tokenizer
from .rows import ROWS, Outcome, Row, RowMaker, Skip
from .run import Options, Run, Stats

__all__ = ["Conversation", "InputError", "Masker", "NotPrefixStable", "Options", "Outcome", "PrepareError", "ROWS",
           "Row", "RowMaker", "Run", "SampleError", "Skip", "Stats", "TemplateRaised", "canonical_id",
           "load_tokenizer", "parse_line"]
