"""Conversations into training tokens as AI2 made OLMo 3's SFT data: a chat template renders
the messages, the tokenizer encodes the text, and only the assistant's turns are trained on.

- Templates (`ChatTemplate`): by name, AI2's shipped beside this module (`olmo3_think`: the
  template the 7B Think SFT data was tokenized with, open-instruct's `olmo_thinker_no_think_7b`,
  byte for byte), or `tokenizer` (the `chat_template` a tokenizer's tokenizer_config.json holds:
  how AI2 tokenized the Instruct SFT data, with `allenai/olmo-3-tokenizer-instruct-dev`), or a
  .jinja file. A template is data: its text and its SHA-256 travel with what it made.
- `render` renders as transformers' `apply_chat_template` does (a sandboxed Jinja environment
  that trims blocks, `loopcontrols`, its `tojson` and `raise_exception`; the tokenizer's special
  tokens as variables), and the text is encoded without adding special tokens, as transformers
  encodes it: `encode` gives the same ids as `apply_chat_template(messages, tokenize=True)`.
- `encode` also gives the trained-label mask exactly as open-instruct's
  `sft_tulu_tokenize_and_truncate_v1` made AI2's `labels_mask` files: the conversation is cut to
  `max_tokens`, and each non-assistant message's span, measured by rendering and encoding the
  conversation up to it (with the assistant header when an assistant message follows), is
  masked; everything else (assistant text, its end-of-turn, the final EOS) is trained. A
  conversation with nothing to train on is dropped, as open-instruct's filter drops it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer

from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.tokens import DataError

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
TOKENIZERS_OWN = "tokenizer"  # the template a tokenizer's tokenizer_config.json names
ROLES = ("system", "user", "assistant", "environment")


def shipped() -> tuple[str, ...]:
  """The named templates shipped with olmo3."""
  return tuple(sorted(n[:-len(".jinja")] for n in os.listdir(TEMPLATE_DIR)
                      if n.endswith(".jinja")))


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat template: where it came from (a shipped name, `tokenizer`, or a file) and its text."""

  name: str
  text: str

  @property
  def sha256(self) -> str:
    return hashlib.sha256(self.text.encode()).hexdigest()

  @classmethod
  def named(cls, name: str, tokenizer_config: dict[str, Any] | None = None,
            what: str = "--chat_template") -> ChatTemplate:
    """A shipped template, the tokenizer's own (`tokenizer`: from `tokenizer_config`), or a
    .jinja file; a DataError naming `what` otherwise."""
    if name in shipped():
      with open(os.path.join(TEMPLATE_DIR, f"{name}.jinja"), encoding="utf-8", newline="") as f:
        return cls(name, f.read())
    if name == TOKENIZERS_OWN:
      text = (tokenizer_config or {}).get("chat_template")
      if isinstance(text, list):  # a tokenizer with several templates names the default one
        text = next((t.get("template") for t in text if t.get("name") == "default"), None)
      if not isinstance(text, str) or not text:
        raise DataError(f"{what} {name!r}: the tokenizer has no chat_template in its "
                        f"{tokenizer_lib.CONFIG_FILE}; name a template ({', '.join(shipped())}) or a "
                        ".jinja file")
      return cls(name, text)
    if name.endswith(".jinja") and os.path.isfile(name):
      with open(name, encoding="utf-8", newline="") as f:
        return cls(os.path.abspath(name), f.read())
    raise DataError(f"{what} {name!r}: not a template olmo3 ships ({', '.join(shipped())}), "
                    f"{TOKENIZERS_OWN!r} (the tokenizer's own) or a .jinja file")


@functools.lru_cache(maxsize=8)
def _compiled(text: str) -> jinja2.Template:
  """The template compiled in the environment transformers renders chat templates in."""

  def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own filter: Jinja's escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  return env.from_string(text)


@dataclasses.dataclass(frozen=True)
class Chat:
  """A template with the tokenizer it renders for: `special` are the special tokens' texts the
  template may name (eos_token, bos_token, pad_token...), as transformers passes them."""

  template: ChatTemplate
  tokenizer: Tokenizer
  special: tuple[tuple[str, str], ...]

  def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
             ) -> str:
    try:
      return _compiled(self.template.text).render(
          messages=list(messages), tools=None, documents=None,
          add_generation_prompt=add_generation_prompt, **dict(self.special))
    except jinja2.exceptions.TemplateError as e:
      raise DataError(f"chat template {self.template.name}: {e}") from None

  def ids(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
          ) -> list[int]:
    """The token ids transformers' apply_chat_template gives (no special tokens added)."""
    return self.tokenizer.encode(self.render(messages, add_generation_prompt),
                                 add_special_tokens=False).ids

  def encode(self, messages: Sequence[dict[str, Any]], max_tokens: int
             ) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids, trained-label mask) of one conversation cut to `max_tokens`, as open-instruct
    made AI2's SFT data (the module's docstring); None when nothing in it is trained."""
    ids = self.ids(messages)[:max_tokens]
    trained = np.ones(len(ids), bool)
    for i, message in enumerate(messages):
      if message["role"] == "assistant":
        continue
      start = 0 if i == 0 else min(len(self.ids(messages[:i])), max_tokens)
      header = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
      end = min(len(self.ids(messages[:i + 1], add_generation_prompt=header)), max_tokens)
      trained[start:end] = False
      if end >= max_tokens:
        break
    if not trained.any():
      return None
    return np.asarray(ids, np.uint32), trained


def special_tokens(tokenizer: Tokenizer, eos_id: int,
                   tokenizer_config: dict[str, Any] | None = None) -> tuple[tuple[str, str], ...]:
  """The special tokens' texts a template is rendered with: the tokenizer_config.json's
  (`*_token` entries, a string or an added-token dict), the EOS at least (`eos_id`)."""
  out = {"eos_token": tokenizer.id_to_token(eos_id)}
  for key, value in (tokenizer_config or {}).items():
    if key.endswith("_token") and key != "eos_token":
      text = value.get("content") if isinstance(value, dict) else value
      if isinstance(text, str):
        out[key] = text
  return tuple(sorted(out.items()))


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
  """A conversation as open-instruct and the Hugging Face chat datasets write it: a non-empty
  list of {"role", "content"} objects with a known role; DataError naming `where`."""
  if not isinstance(messages, list) or not messages:
    raise DataError(f"{where}: 'messages' is not a non-empty list of messages")
  for j, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise DataError(f"{where}: message {j} has no role of {list(ROLES)} "
                      f"(got {m.get('role') if isinstance(m, dict) else type(m).__name__!r})")
    content = m.get("content")
    if not (isinstance(content, str)
            or (content is None and m["role"] == "assistant" and m.get("function_calls"))):
      raise DataError(f"{where}: message {j} ({m['role']}) has no text 'content'")
  return messages
