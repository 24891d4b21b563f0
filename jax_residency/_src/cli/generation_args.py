"""The parsers of ``jax-residency generate`` and ``chat`` (`generating.py` runs them)."""

from __future__ import annotations

import argparse

from jax_residency._src.cli.arguments import Subcommands, add_budgets, command, count
from jax_residency._src.cli.commands import UNSET
from jax_residency._src.cli.generating import (
  DEFAULT_NEW_TOKENS,
  GENERATE_POLICIES,
  cmd_chat,
  cmd_generate,
)

_MODEL_HELP = (
  "a store written by `convert`, a Hugging Face checkpoint directory, or a llama.cpp\n"
  ".gguf file (converted once into a store under the cache directory, or --store DIR)"
)
_PLACEMENT = (
  "Placement: --policy fully_resident, layerwise_host or dense_disk_stream (dense), shaped\n"
  "by the flags `run` takes; without --policy, FullyResident where the device budget\n"
  "holds the model, else a dense stream keeping on the device and in host memory the\n"
  "units that fit (the device budget defaults to the device's memory, where JAX reports\n"
  "it). The placement is printed on stderr, and at the end one line: tokens per second,\n"
  "bytes read and moved, the placement."
)


def _add_common(parser: argparse.ArgumentParser) -> None:
  """The model, where its store goes, sampling and placement: what both commands take."""
  parser.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
  parser.add_argument(
    "--store", metavar="DIR", help="convert MODEL into a store here (once; reused after)"
  )
  parser.add_argument(
    "-n",
    "--max-new-tokens",
    metavar="N",
    type=count(1),
    help=f"tokens to generate at most (default {DEFAULT_NEW_TOKENS}, fewer where the model's\n"
    "context ends first)",
  )
  parser.add_argument(
    "--temperature", type=float, default=0.0, help="0: greedy (default); else sampled"
  )
  parser.add_argument("--top-k", metavar="K", type=count(1), help="sampling: keep the K likeliest")
  parser.add_argument(
    "--top-p", metavar="P", type=float, help="sampling: keep the likeliest whose mass reaches P"
  )
  parser.add_argument("--seed", metavar="N", type=int, default=0, help="sampling seed (0)")
  parser.add_argument(
    "--raw",
    action="store_true",
    help="a model without a chat template: use the text as it is instead of refusing",
  )
  parser.add_argument("--quiet", action="store_true", help="no progress bars")
  _add_placement(parser)


def _add_placement(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
    "--policy", choices=GENERATE_POLICIES, help="default: chosen by the budgets (above)"
  )
  add_budgets(
    parser,
    default=UNSET,
    device_help="default: the device's memory where JAX reports it, else unbounded",
    host_help="default: the policy's (a dense stream's: 16 GiB); 0 = straight from disk",
  )
  for flag, text in (
    ("--lookahead", "dense host_lookahead (default 2)"),
    ("--queue", "dense background_queue_capacity (default 2)"),
    ("--device-resident-units", "layerwise and dense: the first N units stay on the device"),
    ("--host-resident-units", "dense with a host budget: the next N units stay in host memory"),
  ):
    parser.add_argument(flag, metavar="N", type=count(0), help=text)
  parser.add_argument(
    "--prefetch-depth", metavar="N", type=count(1), help="layerwise prefetch_depth (default 1)"
  )


def add_generate(sub: Subcommands) -> None:
  generate = command(
    sub,
    "generate",
    cmd_generate,
    summary="generate text after a prompt, printed as it is produced",
    description=(
      "Generates up to -n tokens after --prompt with a Llama-family model and prints them\n"
      "as they are produced, ending at the model's end-of-sequence token. With --chat the\n"
      "prompt is a user's turn, rendered with the checkpoint's chat template.\n\n" + _PLACEMENT
    ),
    epilog='Example: jax-residency generate ./model.gguf --prompt "The old cat" -n 32\n'
    "         jax-residency generate ./model.gguf --prompts prompts.txt --batch-size 32",
  )
  _add_common(generate)
  given = generate.add_mutually_exclusive_group(required=True)
  given.add_argument("--prompt", help="the prompt text")
  given.add_argument(
    "--prompts",
    metavar="FILE",
    help="many prompts, one a line (- for stdin), generated a batch at a time\n"
    "(models.generate_batch: each streamed pass serves the whole batch); each result is\n"
    'printed when its batch ends, as a JSON line {"index", "prompt", "text", "tokens"}',
  )
  generate.add_argument(
    "--batch-size",
    metavar="N",
    type=count(1),
    help="with --prompts: prompts a batch (default: all of them in one batch)",
  )
  generate.add_argument(
    "--chat", action="store_true", help="render the prompt as a user's turn (chat template)"
  )
  generate.add_argument(
    "--draft",
    metavar="MODEL",
    help="speculative decoding: a smaller model with the same vocabulary (a store,\n"
    "checkpoint directory or .gguf file) placed FullyResident proposes tokens that the\n"
    "model checks in one pass (docs/speculative.md); greedy tokens are the model's own.\n"
    "The text is printed when the generation ends",
  )
  generate.add_argument(
    "--draft-tokens",
    metavar="K",
    default="auto",
    help="with --draft: tokens proposed a round, or auto (default: chosen each round from\n"
    "measured times and hit rates)",
  )


def add_chat(sub: Subcommands) -> None:
  chat = command(
    sub,
    "chat",
    cmd_chat,
    summary="a conversation: one user turn a line of stdin, each reply printed as it comes",
    description=(
      "Reads one user turn a line from stdin (a terminal or a pipe) until its end or /exit,\n"
      "and prints the model's reply to each, rendering the whole conversation with the\n"
      "checkpoint's chat template (refused without one unless --raw). The KV cache is kept\n"
      "between turns: each prefills only what the conversation added.\n\n" + _PLACEMENT
    ),
    epilog="Example: printf 'Hi\\nWhat is 2+2?\\n' | jax-residency chat ./model.gguf -n 64",
  )
  _add_common(chat)
