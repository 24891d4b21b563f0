"""What ``jax-residency generate`` and ``chat`` do: text from a model, printed as it is made.

MODEL is a store written by ``convert``, a Hugging Face checkpoint directory, or a
llama.cpp ``.gguf`` file; the last two are converted once (`models.as_store`: under the
library's cache directory, or ``--store DIR``) and the store is reused after that. The
model is placed from the store under ``--policy`` (the names ``run`` takes), or, without
one, under the placement the budgets admit first (`planner.default_placement`:
FullyResident where the device budget holds the model, else a dense stream keeping what
fits on the device and in host memory). Without ``--device-budget`` the device budget is
the device's memory where JAX reports it (GPU), else unbounded.

Tokens are printed as they are produced (`generate_llm`'s ``on_token``, through
`TextStream`), the text of a row ending at its first stop token (the model's EOS). The
last line on stderr gives the tokens per second, the bytes the placement read and moved,
and the placement.

``chat`` reads one user turn a line from stdin until its end or ``/exit``, keeps the
conversation, and renders it with the checkpoint's chat template
(`models.chat_template`) before each reply. The KV cache is kept between turns
(`models.llama_chat.Conversation`): each turn prefills only the tokens after the longest
prefix the rendered conversation shares with what the cache holds, so a reply is the one
a generation over the whole conversation gives, without its prefill of the turns before.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jax_residency._src.cli.commands import UNSET, policy_from_args
from jax_residency._src.cli.console import PROG, CommandError
from jax_residency._src.cli.stored_models import single_device_mesh
from jax_residency._src.cli.text_stream import TextStream

#: The ``--policy`` names: `run`'s, and ``dense`` for short.
GENERATE_POLICIES = ("fully_resident", "layerwise_host", "dense_disk_stream", "dense")
#: Tokens generated at most without ``-n`` (fewer where the model's context ends first).
DEFAULT_NEW_TOKENS = 64
#: What ends ``chat`` besides the end of its input.
EXIT = "/exit"
#: Flags that shape a named policy, refused without ``--policy``.
_POLICY_FLAGS = {
  "lookahead": "--lookahead",
  "queue": "--queue",
  "prefetch_depth": "--prefetch-depth",
  "device_resident_units": "--device-resident-units",
  "host_resident_units": "--host-resident-units",
}


@dataclasses.dataclass
class Model:
  """A model for generation (placed by `placing`), with what turns text into its tokens
  and back."""

  command: str
  store: str
  abstract: Any
  config: Any
  tokenizer: Any
  template: Any
  placed: Any = None
  placement: str = ""


@dataclasses.dataclass
class Totals:
  """Tokens generated and seconds spent generating them, over a run's generations; of
  those, the tokens after each generation's second and the seconds they took (the first
  waits for the prefill, the first two for compiling or loading the compiled programs)."""

  tokens: int = 0
  seconds: float = 0.0
  later_tokens: int = 0
  later_seconds: float = 0.0


def _say(command: str, message: str) -> None:
  """One line on stderr, naming the command."""
  print(f"{PROG} {command}: {message}", file=sys.stderr, flush=True)


# --- the model ---------------------------------------------------------------


def model_store(args: argparse.Namespace) -> str:
  """The store of ``args.model``, converted once where it is not one yet."""
  from jax_residency._src.models.model_source import as_store  # noqa: PLC0415

  path = args.model
  kinds = "a store written by `convert`, a Hugging Face checkpoint directory or a .gguf file"
  if "://" in path:
    raise CommandError(f"{path}: {args.command} takes a local path: {kinds}")
  if not os.path.exists(path):
    raise CommandError(f"{path}: no such file or directory; pass {kinds}")
  try:
    return as_store(path, store=args.store, progress=False if args.quiet else None)
  except FileNotFoundError as e:
    raise CommandError(f"{path} is not a model: {e}") from e


def _device_budget(args: argparse.Namespace) -> int | None:
  """``--device-budget``, else the device's memory where JAX reports it."""
  if args.device_budget is not UNSET:
    return args.device_budget
  import jax  # noqa: PLC0415

  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def choose_placement(args: argparse.Namespace, store: str) -> tuple[Any, str]:
  """The policy to place with, and how it was chosen, in words."""
  import jax  # noqa: PLC0415

  from jax_residency._src.policy.options import DenseDiskStreamLoadOptions  # noqa: PLC0415
  from jax_residency._src.policy.sizes import format_bytes  # noqa: PLC0415
  from jax_residency._src.run.planner import default_placement  # noqa: PLC0415

  if args.policy is not None:
    args.policy = "dense_disk_stream" if args.policy == "dense" else args.policy
    policy = policy_from_args(args)
    return policy, f"--policy {args.policy}"
  device = _device_budget(args)
  host = args.host_budget
  host = DenseDiskStreamLoadOptions().host_budget_bytes if host is UNSET else host
  policy = default_placement(
    store,
    device_budget_bytes=device,
    host_budget_bytes=host,
    device_is_host=jax.default_backend() == "cpu",
  )
  budgets = f"device budget {format_bytes(device)}, host budget {format_bytes(host)}"
  return policy, f"the first that fits the {budgets}; --policy to choose"


def _tokenizer(store: str) -> Any:
  path = os.path.join(store, "tokenizer.json")
  if not os.path.isfile(path):
    raise CommandError(
      f"{store} has no tokenizer.json, so text cannot be tokenized; convert a checkpoint "
      "that has one"
    )
  try:
    from tokenizers import Tokenizer  # noqa: PLC0415
  except ModuleNotFoundError as e:
    raise CommandError(
      "generating text needs the 'tokenizers' package: pip install 'jax-residency[models]'"
    ) from e
  return Tokenizer.from_file(path)


def _template(args: argparse.Namespace, store: str) -> Any:
  """The chat template: a checkpoint directory's own, else the store's (None: none)."""
  from jax_residency._src.models.chat_template import chat_template_of  # noqa: PLC0415
  from jax_residency._src.models.model_source import is_checkpoint_dir  # noqa: PLC0415

  if is_checkpoint_dir(args.model) and (found := chat_template_of(args.model)) is not None:
    return found
  return chat_template_of(store)


def loaded_model(args: argparse.Namespace, *, chat: bool) -> Model:
  """``args.model``'s store, model, tokenizer and chat template (for a ``chat``, refused
  without one unless ``--raw``), not placed yet."""
  from jax_residency._src.models.hf_convert import load  # noqa: PLC0415
  from jax_residency._src.models.llama import Llama  # noqa: PLC0415

  given = [flag for key, flag in _POLICY_FLAGS.items() if getattr(args, key) is not None]
  if given and args.policy is None:
    raise CommandError(f"{', '.join(given)} shapes a policy: name one with --policy")
  store = model_store(args)
  tokenizer, template = _tokenizer(store), _template(args, store)
  if template is None and chat and not args.raw:
    raise CommandError(
      f"{args.model} has no chat template (tokenizer_config.json's chat_template, or a "
      "GGUF file's tokenizer.chat_template): pass --raw to use the text as it is"
    )
  abstract = load(store)
  if not isinstance(abstract, Llama):
    raise CommandError(f"{args.model}: {args.command} runs Llama-family decoders only")
  return Model(args.command, store, abstract, abstract.config, tokenizer, template)


@contextlib.contextmanager
def placing(args: argparse.Namespace, model: Model) -> Iterator[Model]:
  """``model`` placed from its store, as ``--policy`` or the budgets say (on stderr)."""
  from jax_residency._src.run.place import place  # noqa: PLC0415
  from jax_residency._src.run.planner import describe  # noqa: PLC0415

  policy, why = choose_placement(args, model.store)
  model.placement = describe(policy)
  _say(args.command, f"placement {model.placement} ({why})")
  with place(model.abstract, policy, store=model.store, mesh=single_device_mesh()) as placed:
    model.placed = placed
    yield model


# --- generating --------------------------------------------------------------


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
  """``--temperature``, ``--top-k`` and ``--top-p`` as `generate_llm`'s keyword arguments
  (the seed is each caller's: a batch's is drawn from it)."""
  return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}


def _write(text: str) -> None:
  try:
    sys.stdout.write(text)
  except UnicodeEncodeError:
    enc = sys.stdout.encoding or "ascii"
    sys.stdout.write(text.encode(enc, "replace").decode(enc))
  sys.stdout.flush()


def fitted_tokens(model: Model, ids: Sequence[int], wanted: int | None, what: str) -> int:
  """How many tokens to generate after ``ids``: ``wanted`` (None: `DEFAULT_NEW_TOKENS`), or
  what the context has room for (said on stderr where ``-n`` was given).

  Raises:
    CommandError: the prompt alone fills the model's context.
  """
  context = int(model.config.max_position_embeddings)
  if len(ids) >= context:
    raise CommandError(
      f"{what} is {len(ids)} tokens, and the model's context is {context}: "
      + (
        f"shorten it to fewer than {context} tokens"
        if what.startswith("the prompt")
        else "start a new chat (each turn renders the whole conversation)"
      )
    )
  if wanted is None:
    return min(DEFAULT_NEW_TOKENS, context - len(ids))
  if len(ids) + wanted > context:
    wanted = context - len(ids)
    _say(
      model.command,
      f"-n lowered to {wanted}, what the context of {context} tokens leaves after {len(ids)}",
    )
  return wanted


def generate_text(
  model: Model,
  ids: Sequence[int],
  n: int,
  args: argparse.Namespace,
  totals: Totals,
  conversation: Any = None,
) -> str:
  """Generates up to ``n`` tokens after ``ids`` (a turn of ``conversation``, where given,
  its cache kept), writing the text to stdout as it comes; returns the text (up to the
  first stop token)."""
  from jax_residency._src.models.llama_generate import generate_llm  # noqa: PLC0415

  decode: Callable[[Sequence[int]], str] = lambda t: model.tokenizer.decode(  # noqa: E731
    list(t), skip_special_tokens=True
  )
  stream = TextStream(decode, _write)
  stops = set(model.config.eos_token_ids)
  produced = [0, False]  # tokens told, and whether a stop token came
  came: list[float] = []  # when the first two tokens came

  def on_token(tokens: Any) -> None:
    if produced[1]:
      return
    if len(came) < 2:
      came.append(time.perf_counter())
    produced[0] += 1
    token = int(tokens[0])
    if token in stops:
      produced[1] = True
    else:
      stream.push(token)

  sampling = _sampling(args) | {"seed": args.seed, "on_token": on_token}
  start = time.perf_counter()
  try:
    if conversation is None:
      generate_llm(model.placed, [list(ids)], n, config=model.config, **sampling)
    else:
      conversation.reply(ids, n, **sampling)
  except KeyboardInterrupt:  # Ctrl-C: end the line of text; `main` says it was interrupted
    _write("\n")
    raise
  end = time.perf_counter()
  totals.seconds += end - start
  totals.tokens += int(produced[0])
  if len(came) == 2:
    totals.later_tokens += int(produced[0]) - 2
    totals.later_seconds += end - came[1]
  return stream.finish()


def report_line(model: Model, totals: Totals) -> None:
  """The last line on stderr: tokens per second, bytes read and moved, the placement."""
  from jax_residency._src.policy.sizes import format_bytes  # noqa: PLC0415

  total = model.placed.report().total
  rate = totals.tokens / totals.seconds if totals.seconds else 0.0
  moved = format_bytes(total.host_to_device_bytes)
  after = ""
  if totals.later_tokens > 0 and totals.later_seconds > 0:
    # the first two wait for the prefill and for compiling (or loading) the programs
    later = totals.later_tokens / totals.later_seconds
    after = f", {later:.1f} from the third token on"
  _say(
    model.command,
    f"{totals.tokens} tokens in {totals.seconds:.2f} s ({rate:.1f} tokens/s{after}); read "
    f"{format_bytes(total.bytes_read)} from disk, moved {moved} host to device; placement "
    f"{model.placement}",
  )


def _prompt_ids(model: Model, args: argparse.Namespace, text: str) -> list[int]:
  """``text``'s token ids: as a user's turn rendered with the chat template with
  ``--chat``, else as it is with the tokenizer's special tokens."""
  special = True
  if args.chat and model.template is not None:
    text = model.template.render([{"role": "user", "content": text}])
    special = False  # the template writes the special tokens it wants
  return list(model.tokenizer.encode(text, add_special_tokens=special).ids)


def _draft_tokens(value: str) -> int | str:
  """``--draft-tokens``: a positive int, or ``auto``."""
  if value == "auto":
    return value
  try:
    k = int(value)
  except ValueError:
    k = 0
  if k < 1:
    raise CommandError(f"--draft-tokens {value}: pass a positive number of tokens, or auto")
  return k


def cmd_generate(args: argparse.Namespace) -> int:
  """Generates after ``--prompt`` (as a user's turn of a chat with ``--chat``), or after
  each line of ``--prompts``; with ``--draft``, speculatively."""
  if args.batch_size is not None and args.prompts is None:
    raise CommandError("--batch-size goes with --prompts FILE (many prompts, a batch at a time)")
  if args.draft is not None and args.prompts is not None:
    raise CommandError("--draft takes one --prompt: speculation and --prompts' batches are apart")
  k = _draft_tokens(args.draft_tokens)
  if args.draft is not None and not os.path.exists(args.draft):
    raise CommandError(
      f"--draft {args.draft}: no such file or directory; pass a store, a checkpoint "
      "directory or a .gguf file"
    )
  model = loaded_model(args, chat=args.chat)
  if args.prompts is not None:
    return _generate_many(model, args)
  ids = _prompt_ids(model, args, args.prompt)
  n = fitted_tokens(model, ids, args.max_new_tokens, "the prompt")
  with placing(args, model):
    totals = Totals()
    summary = None
    if args.draft is None:
      generate_text(model, ids, n, args, totals)
    else:
      summary = _generate_drafted(model, ids, n, args, k, totals)
    _write("\n")
    if summary is not None:
      _say(model.command, f"draft {args.draft}: {summary}")
    report_line(model, totals)
  return 0


def _generate_drafted(
  model: Model, ids: Sequence[int], n: int, args: argparse.Namespace, k: int | str, totals: Totals
) -> str:
  """``generate_llm`` with ``--draft`` placed FullyResident beside the model: writes the
  text once the generation ends; returns what speculation did, in words."""
  from jax_residency._src.models.llama_generate import speculate  # noqa: PLC0415
  from jax_residency._src.run.draft import draft_from  # noqa: PLC0415

  try:
    draft = draft_from(
      args.draft,
      target=model.placed,
      max_len=len(ids) + n + 64,
      progress=False if args.quiet else None,
    )
  except FileNotFoundError as e:
    raise CommandError(f"--draft {args.draft} is not a model: {e}") from e
  sampling = _sampling(args)
  with draft:
    start = time.perf_counter()
    tokens, report = speculate(
      model.placed,
      [list(ids)],
      n,
      draft=draft,
      config=model.config,
      draft_tokens=k,
      seed=args.seed,
      **sampling,
    )
    totals.seconds += time.perf_counter() - start
  out = _until_stop(model, [int(t) for t in tokens[0]])
  totals.tokens += len(out)
  _write(model.tokenizer.decode(out, skip_special_tokens=True))
  return report.summary()


def _until_stop(model: Model, tokens: list[int]) -> list[int]:
  """``tokens`` up to (not including) the first of the model's stop tokens."""
  stops = set(model.config.eos_token_ids)
  end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
  return tokens[:end]


def _read_prompts(path: str) -> list[str]:
  """``--prompts``' lines (``-``: stdin), blank ones left out."""
  try:
    if path == "-":
      text = sys.stdin.read()
    else:
      with open(path, encoding="utf-8") as f:
        text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise CommandError(f"--prompts {path}: cannot be read as UTF-8 text ({e})") from e
  prompts = [line for line in text.splitlines() if line.strip()]
  if not prompts:
    raise CommandError(f"--prompts {path} holds no prompt: write one prompt a line")
  return prompts


def _generate_many(model: Model, args: argparse.Namespace) -> int:
  """Each line of ``--prompts`` through `models.generate_batch`, ``--batch-size`` at a
  time; a JSON line a prompt on stdout once its batch ends."""
  import json  # noqa: PLC0415

  from jax_residency._src.models.llama_batch import batch_seed, generate_batch  # noqa: PLC0415

  prompts = _read_prompts(args.prompts)
  ids = [_prompt_ids(model, args, text) for text in prompts]
  longest = max(range(len(ids)), key=lambda i: len(ids[i]))
  what = f"the prompt at index {longest} of --prompts (the longest)"
  n = fitted_tokens(model, ids[longest], args.max_new_tokens, what)
  size = args.batch_size or len(ids)
  with placing(args, model):
    totals, start = Totals(), time.perf_counter()
    sampling = _sampling(args)
    for b, first in enumerate(range(0, len(ids), size)):
      # one batch a call, printed as it ends; seeds as one generate_batch call draws them
      seed = batch_seed(args.seed, b)
      out = generate_batch(
        model.placed, ids[first : first + size], n, config=model.config, seed=seed, **sampling
      )
      for i, tokens in enumerate(out, first):
        kept = _until_stop(model, tokens)
        totals.tokens += len(tokens)
        text = model.tokenizer.decode(kept, skip_special_tokens=True)
        record = {"index": i, "prompt": prompts[i], "text": text, "tokens": len(kept)}
        _write(json.dumps(record, ensure_ascii=False) + "\n")
    totals.seconds = time.perf_counter() - start
    report_line(model, totals)
  return 0


def _turns(stdin: Any) -> Iterator[str]:
  """The user's lines from ``stdin``, until its end or `EXIT`; a prompt on a terminal."""
  interactive = stdin.isatty()
  while True:
    if interactive:
      print("> ", end="", file=sys.stderr, flush=True)
    line = stdin.readline()
    if not line or line.strip() == EXIT:
      return
    if line.strip():
      yield line.rstrip("\n")


def cmd_chat(args: argparse.Namespace) -> int:
  """A conversation from stdin, a reply printed after each line."""
  from jax_residency._src.models.llama_chat import Conversation  # noqa: PLC0415

  with placing(args, loaded_model(args, chat=True)) as model:
    conversation = Conversation(model.placed, config=model.config)
    messages: list[dict[str, str]] = []
    transcript, totals = "", Totals()
    for line in _turns(sys.stdin):
      messages.append({"role": "user", "content": line})
      if model.template is not None:
        prompt = model.template.render(messages)
        ids = model.tokenizer.encode(prompt, add_special_tokens=False).ids
      else:  # --raw: the conversation's text, one turn a line
        transcript += line + "\n"
        ids = model.tokenizer.encode(transcript).ids
      n = fitted_tokens(model, ids, args.max_new_tokens, "the conversation")
      reply = generate_text(model, ids, n, args, totals, conversation)
      _write("\n")
      messages.append({"role": "assistant", "content": reply})
      transcript += reply + "\n"
    report_line(model, totals)
  return 0
