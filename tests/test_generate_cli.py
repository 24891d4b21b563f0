"""``jax-residency generate`` and ``chat`` (docs/cli.md#generate-and-chat), and what they
are built from: `generate_llm`'s ``on_token``, the chat template, the streamed text.

The commands run in a fresh process as a user's would (forked from the session's zygote,
`user_env.run_script`), on the tiny fixtures, one user's cache directory for the module,
so each checkpoint is converted once. What they print is compared with the text of
`generate_llm` called on the plain model (greedy): the same tokens. Bad input is checked
in-process: one line on stderr, exit 2, no traceback.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import gguf  # the test extras install it
import numpy as np
import pytest
from cli_call import call
from tokenizers import Tokenizer
from user_env import run_script, user_env

from jax_residency import models
from jax_residency._src.cli import text_stream
from jax_residency._src.models import llama_chat
from jax_residency._src.models.chat_template import ChatTemplate, chat_template_of
from jax_residency._src.models.gguf_reference import dequantized_model

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
GGUF = FIXTURES / "gguf_tiny_untied" / "model.gguf"
HF = FIXTURES / "llama_tiny_tied"  # the one checkpoint fixture with a tokenizer
NEW_TOKENS = 6

#: SmolLM2-Instruct's chat template, as its tokenizer_config.json holds it.
SMOLLM2_TEMPLATE = (
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
  "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
  "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
  "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: A template short enough for the fixture's context of 64 tokens (its words are in the
#: fixture's vocabulary or become <unk>).
SHORT_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
  "{% if add_generation_prompt %}assistant{% endif %}"
)


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict[str, str]:
  """One user's environment (cache directory) for the module's processes."""
  return user_env(tmp_path_factory.mktemp("generate-user"))


def jr_command(zygote, env, *argv: str, stdin: str | None = None):
  return run_script(
    [sys.executable, "-m", "jax_residency", *argv],
    zygote,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
    cwd=REPO,
    input=stdin,
  )


def greedy_text(model, tokenizer, ids, n, config=None) -> str:
  """What `generate_llm` gives the plain ``model`` after ``ids``, as text up to its EOS."""
  out = np.asarray(models.generate_llm(model, [ids], n))[0].tolist()
  eos = set(model.config.eos_token_ids)
  end = next((i for i, t in enumerate(out) if t in eos), len(out))
  return tokenizer.decode(out[:end], skip_special_tokens=True)


@pytest.fixture(scope="module")
def gguf_plain(tmp_path_factory):
  """The GGUF fixture's plain model (gguf-py's dequantized weights) and tokenizer."""
  store = tmp_path_factory.mktemp("gguf") / "store"
  models.convert_gguf(GGUF, store, progress=False)
  return dequantized_model(GGUF, store), Tokenizer.from_file(str(store / "tokenizer.json"))


# --- generate and chat, end to end --------------------------------------------


def test_generate_prints_the_greedy_text_of_the_plain_model_gguf(zygote, user, gguf_plain):
  """A .gguf file, converted once into the user's cache."""
  prompt = "The old cat sat by the river and"
  plain, tokenizer = gguf_plain
  want = greedy_text(plain, tokenizer, tokenizer.encode(prompt).ids, NEW_TOKENS)
  done = jr_command(
    zygote, user, "generate", str(GGUF), "--prompt", prompt, "-n", str(NEW_TOKENS), "--quiet"
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout == want + "\n"
  last = done.stderr.strip().splitlines()[-1]
  assert f"{NEW_TOKENS} tokens in" in last and "tokens/s" in last, last
  assert "from disk" in last and "placement FullyResident()" in last, last
  assert "Traceback" not in done.stderr


def test_generate_and_chat_on_a_checkpoint_directory(zygote, user, tmp_path):
  """A Hugging Face directory: ``generate`` prints the plain model's greedy text under the
  placement the budgets choose; ``chat`` answers two piped turns, each the plain model's
  greedy reply to the conversation rendered with the checkpoint's template."""
  src = tmp_path / "llama"
  shutil.copytree(HF, src)
  config = json.loads((src / "tokenizer_config.json").read_text())
  config["chat_template"] = SHORT_TEMPLATE
  (src / "tokenizer_config.json").write_text(json.dumps(config))
  plain, tokenizer = models.load_llama(HF), Tokenizer.from_file(str(HF / "tokenizer.json"))

  prompt = "the old cat"
  want = greedy_text(plain, tokenizer, tokenizer.encode(prompt).ids, NEW_TOKENS)
  done = jr_command(zygote, user, "generate", str(src), "--prompt", prompt, "-n", "6")
  assert done.returncode == 0, done.stderr
  assert done.stdout == want + "\n"
  assert "placement FullyResident() (the first that fits" in done.stderr

  template = chat_template_of(src)
  messages, replies = [], []
  for line in ("hello there", "star moon"):
    messages.append({"role": "user", "content": line})
    ids = tokenizer.encode(template.render(messages), add_special_tokens=False).ids
    replies.append(greedy_text(plain, tokenizer, ids, NEW_TOKENS))
    messages.append({"role": "assistant", "content": replies[-1]})
  done = jr_command(
    zygote, user, "chat", str(src), "-n", "6", stdin="hello there\n\nstar moon\n/exit\nnot read\n"
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout == "".join(r + "\n" for r in replies)
  assert f"{2 * NEW_TOKENS} tokens in" in done.stderr.strip().splitlines()[-1]


# --- the pieces ---------------------------------------------------------------


def test_the_chat_template_renders_as_transformers_does(tmp_path):
  """SmolLM2's template, found in a tokenizer_config.json, renders a two-turn conversation
  as transformers' apply_chat_template(..., add_generation_prompt=True, tokenize=False)
  does (written out by hand)."""
  (tmp_path / "tokenizer_config.json").write_text(
    json.dumps({"chat_template": SMOLLM2_TEMPLATE, "eos_token": "<|im_end|>"})
  )
  template = chat_template_of(tmp_path)
  messages = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
  ]
  assert template.render(messages) == (
    "<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello. How can I help?<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
  )
  # trim_blocks / lstrip_blocks, named templates, and raise_exception, as transformers has
  blocks = "  {% for m in messages %}\n{{ m['content'] }}|{% endfor %}"
  named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": blocks}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
  assert chat_template_of(tmp_path).render(messages[:2]) == "Hi!|Hello. How can I help?|"
  failing = ChatTemplate(source="{{ raise_exception('roles must alternate') }}", special_tokens={})
  with pytest.raises(ValueError, match="roles must alternate"):
    failing.render(messages)


def test_a_gguf_files_chat_template_comes_with_its_store(tmp_path):
  """``tokenizer.chat_template`` (added here with gguf-py's own metadata copier) is
  carried in the converted store's tokenizer_config.json, with the BOS and EOS tokens'
  text, and renders from there."""
  from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

  reader = gguf.GGUFReader(GGUF)
  writer = gguf.GGUFWriter(tmp_path / "chat.gguf", "llama", endianess=reader.endianess)
  template = MetadataDetails(gguf.GGUFValueType.STRING, SHORT_TEMPLATE)
  copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: template}, [])
  models.convert_gguf(tmp_path / "chat.gguf", tmp_path / "store", progress=False)
  found = chat_template_of(tmp_path / "store")
  assert found.source == SHORT_TEMPLATE
  assert dict(found.special_tokens) == {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
  }
  assert found.render([{"role": "user", "content": "hi"}]) == "<|begin_of_text|>user hi assistant"


def test_on_token_sees_every_token_as_made_and_changes_none():
  cfg = models.LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, eos_token_ids=(3,),
  )  # fmt: skip
  model = models.init_llama(cfg)  # greedy, two rows (sampled: the conversation's test)
  seen: list[np.ndarray] = []
  plain = np.asarray(models.generate_llm(model, [[5, 6, 7], [8, 9, 10]], 8))
  told = models.generate_llm(model, [[5, 6, 7], [8, 9, 10]], 8, on_token=seen.append)
  np.testing.assert_array_equal(np.asarray(told), plain)
  np.testing.assert_array_equal(np.stack(seen, axis=1), plain[:, : len(seen)])
  with pytest.raises(ValueError, match="on_token"):
    models.generate_llm(model, [5, 6], 2, draft=model, on_token=print)


def test_a_conversation_keeps_its_cache_and_replies_as_generate_llm(monkeypatch):
  """The second turn prefills only what follows the prefix its prompt shares with the
  cache (the first prompt and the reply tokens fed back, up to the reply's last token,
  which the next prompt writes otherwise), in a cache grown between the turns, and each
  turn replies what `generate_llm` gives for its whole prompt (sampled; the chat test
  above checks greedy replies)."""
  monkeypatch.setattr(llama_chat, "GROWTH", 8)
  cfg = models.LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, eos_token_ids=(3,),
  )  # fmt: skip
  model, sampling = models.init_llama(cfg), {"temperature": 0.9, "top_p": 0.9, "seed": 4}
  chat, prompt = llama_chat.Conversation(model), [1, 5, 6, 7]
  for turn in range(2):
    want = np.asarray(models.generate_llm(model, prompt, 5, **sampling))
    told: list[np.ndarray] = []
    got = np.asarray(chat.reply(prompt, 5, on_token=told.append, **sampling))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.stack(told, axis=1), want[:, : len(told)])
    reply = want[0].tolist()
    if turn == 0:
      assert chat.reused == 0 and chat.cached_tokens == 4 + len(told) - 1  # last pick unfed
      stop = reply.index(3) if 3 in reply else 5
      assert stop >= 2, reply  # (the seed gives a reply to rewrite)
      kept = 4 + stop - 1
      prompt = prompt + reply[: stop - 1] + [(reply[stop - 1] + 1) % 32, 2, 9, 10]
    else:
      assert chat.reused == kept
      assert chat.cached_tokens == len(prompt) + len(told) - 1


def test_streamed_text_is_the_final_decode(gguf_plain):
  """A byte-level vocabulary splits 'é' and '€' over tokens: the stream holds a piece
  until its character is whole, and what it wrote is the decode of all the tokens."""
  _, tokenizer = gguf_plain
  text = "The café costs 5€ — über naïve"
  ids = tokenizer.encode(text, add_special_tokens=False).ids
  pieces = [tokenizer.decode([i]) for i in ids]
  assert any("\ufffd" in p for p in pieces)  # the case this is about
  written: list[str] = []
  stream = text_stream.TextStream(lambda t: tokenizer.decode(list(t)), written.append)
  for i in ids:
    stream.push(i)
  final = stream.finish()
  assert "".join(written) == final == tokenizer.decode(ids) == text
  assert not any("\ufffd" in w for w in written)


# --- bad input ------------------------------------------------------------------


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
  assert code == 2 and "Traceback" not in err, err
  lines = err.strip("\n").splitlines()
  assert len(lines) == 1 and "error:" in lines[0], err
  for fragment in fragments:
    assert fragment in lines[0], (fragment, lines[0])


def test_prompts_file_and_draft_give_the_plain_models_greedy_text(
  tmp_path, monkeypatch, gguf_plain
):
  """``--prompts FILE``: a JSON line a prompt, in the file's order, each the greedy text
  the plain model gives that prompt alone (batches of 2 over 3 prompts of other lengths,
  a blank line left out). ``--draft`` (the model as its own draft, 3 tokens a round): the
  text without a draft, and what speculation did on stderr. In-process, placed
  FullyResident by the budgets."""
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))
  plain, tokenizer = gguf_plain
  prompts = ["The old cat", "A dog ran to the river", "Hello"]
  (tmp_path / "prompts.txt").write_text(prompts[0] + "\n\n" + "\n".join(prompts[1:]) + "\n")
  want = [greedy_text(plain, tokenizer, tokenizer.encode(p).ids, NEW_TOKENS) for p in prompts]
  n = str(NEW_TOKENS)
  argv = ("generate", str(GGUF), "--prompts", str(tmp_path / "prompts.txt"), "--batch-size", "2")
  code, out, err = call(*argv, "-n", n, "--quiet")
  assert code == 0, err
  records = [json.loads(line) for line in out.splitlines()]
  assert [r["index"] for r in records] == [0, 1, 2]
  assert [r["prompt"] for r in records] == prompts
  assert [r["text"] for r in records] == want
  assert f"{3 * NEW_TOKENS} tokens in" in err.strip().splitlines()[-1]

  code, out, err = call(
    "generate", str(GGUF), "--prompt", prompts[1], "-n", n, "--draft", str(GGUF),
    "--draft-tokens", "3", "--quiet",
  )  # fmt: skip
  assert code == 0, err
  assert out == want[1] + "\n"
  assert "speculation:" in err and "accepted" in err, err


def test_bad_input_is_one_line_naming_the_value_and_the_fix(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))
  code, _, err = call("generate", str(tmp_path / "absent"), "--prompt", "x")
  assert_one_line_error(code, err, "absent", "no such file", "Hugging Face checkpoint")
  (tmp_path / "empty").mkdir()
  code, _, err = call("chat", str(tmp_path / "empty"))
  assert_one_line_error(code, err, "empty", "is not a model", "config.json")

  writer = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen2")
  writer.add_uint32("qwen2.block_count", 1)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  code, _, err = call("generate", str(tmp_path / "qwen.gguf"), "--prompt", "x", "--quiet")
  assert_one_line_error(code, err, "general.architecture='qwen2'", "supported: 'llama'")

  code, _, err = call("chat", str(HF), "--quiet")
  assert_one_line_error(code, err, str(HF), "no chat template", "--raw")
  code, _, err = call("generate", str(HF), "--chat", "--prompt", "x", "--quiet")
  assert_one_line_error(code, err, "no chat template", "--raw")

  long = " ".join(["cat"] * 70)  # the fixture's context is 64 tokens
  code, _, err = call("generate", str(HF), "--prompt", long, "--quiet")
  assert_one_line_error(code, err, "the prompt is 7", "context is 64", "shorten it")
  code, _, err = call("generate", str(HF), "--prompt", "x", "--lookahead", "1")
  assert_one_line_error(code, err, "--lookahead", "--policy")
  code, _, err = call("generate", str(HF), "--prompt", "x", "--batch-size", "2")
  assert_one_line_error(code, err, "--batch-size", "--prompts FILE")
  code, _, err = call(
    "generate", str(HF), "--prompt", "x", "--draft", str(HF), "--draft-tokens", "0"
  )
  assert_one_line_error(code, err, "--draft-tokens 0", "positive", "auto")
  (tmp_path / "blank.txt").write_text("\n  \n")
  code, _, err = call("generate", str(HF), "--prompts", str(tmp_path / "blank.txt"), "--quiet")
  assert_one_line_error(code, err, "blank.txt", "holds no prompt", "one prompt a line")
  code, _, err = call("generate", str(HF), "--prompt", "x", "--draft", str(tmp_path / "nope"))
  assert_one_line_error(code, err, "--draft", "nope", "no such file")

  # a chat whose conversation outgrows the context: after the placement's line, one error
  monkeypatch.setattr(sys, "stdin", io.StringIO(long + "\n"))
  code, out, err = call("chat", str(HF), "--raw", "--quiet")
  assert code == 2 and out == "" and "Traceback" not in err
  assert (
    err.strip()
    .splitlines()[-1]
    .endswith("context is 64: start a new chat (each turn renders the whole conversation)")
  )


def test_ctrl_c_while_generating_is_one_line_and_exit_130(tmp_path, monkeypatch):
  """A real SIGINT, sent once the first token's text is out: the text's line is ended,
  and stderr's last line says the command was interrupted (exit 130, no traceback)."""
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))
  push = text_stream.TextStream.push

  def interrupting(self, token):
    push(self, token)
    os.kill(os.getpid(), signal.SIGINT)

  monkeypatch.setattr(text_stream.TextStream, "push", interrupting)
  code, out, err = call("generate", str(HF), "--prompt", "the old cat", "-n", "20")
  assert code == 130 and "Traceback" not in err
  assert out.endswith("\n") and len(out.split()) < 20
  assert err.strip().splitlines()[-1] == "jax-residency generate: interrupted"
