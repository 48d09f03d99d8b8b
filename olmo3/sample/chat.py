"""`python -m olmo3.sample --chat`: a conversation with a run's checkpoint, in the chat template
its data was tokenized with (olmo3.data.chat; the run's data directory records it, or
--chat_template names one).

Each turn renders the whole conversation with the assistant's header added
(add_generation_prompt), as the template's own text tokenized (the ids `prepare --chat` would
write for it), generates until the template's end of turn, and appends the reply as an
assistant message, so the next turn sees it as the template renders a past turn. The end of a
turn: the EOS (the template ends the final assistant message with it), and `<|im_end|>` (how it
ends every earlier one) when the tokenizer holds it as one token; with a tokenizer that splits
`<|im_end|>` into several, the decoded text is watched for it instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer

from olmo3.data import chat
from olmo3.data.tokens import DataError

END_OF_TURN = "<|im_end|>"  # how the OLMo (ChatML-style) templates end a past turn
Generate = Callable[[list[int], Callable[[list[int]], bool]], list[int]]


class ChatError(ValueError):
  """A conversation that cannot go on (it outgrew the model's context). The message says why."""


def messages_given(text: str | None) -> list[dict[str, Any]]:
  """--messages: a JSON list of {"role", "content"} (the conversation so far); DataError naming
  the flag otherwise."""
  if text is None:
    return []
  try:
    messages = json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"--messages: not JSON ({e})") from None
  return chat.check_messages(messages, "--messages")


@dataclasses.dataclass(frozen=True)
class EndOfTurn:
  """Where the assistant's turn ends: these ids (EOS; `<|im_end|>` when one token), or `text`
  in the decoded reply (`<|im_end|>` when the tokenizer splits it)."""

  ids: frozenset[int]
  text: str | None

  @classmethod
  def of(cls, template: chat.ChatTemplate, tokenizer: Tokenizer, eos_id: int) -> EndOfTurn:
    if END_OF_TURN not in template.text:
      return cls(frozenset({eos_id}), None)
    ids = tokenizer.encode(END_OF_TURN, add_special_tokens=False).ids
    if len(ids) == 1:
      return cls(frozenset({eos_id, ids[0]}), None)
    return cls(frozenset({eos_id}), END_OF_TURN)

  def reached(self, tokenizer: Tokenizer, new: list[int]) -> bool:
    if new[-1] in self.ids:
      return True
    return self.text is not None and self.text in tokenizer.decode(new, skip_special_tokens=False)

  def reply(self, tokenizer: Tokenizer, new: list[int], eos_id: int) -> tuple[str, str]:
    """(the reply's text, the end of turn cut off, as it goes into the conversation; why it
    stopped: "eos", "end_of_turn" or "max_new_tokens")."""
    if new and new[-1] in self.ids:
      return (tokenizer.decode(new[:-1], skip_special_tokens=False),
              "eos" if new[-1] == eos_id else "end_of_turn")
    text = tokenizer.decode(new, skip_special_tokens=False)
    if self.text is not None and self.text in text:
      return text[:text.index(self.text)], "end_of_turn"
    return text, "max_new_tokens"


@dataclasses.dataclass(frozen=True)
class Turn:
  prompt_ids: list[int]
  ids: list[int]  # the new tokens, the end of turn included
  text: str  # the reply as appended to the conversation
  stop: str


def converse(renderer: chat.Chat, generate: Generate, end: EndOfTurn, eos_id: int,
             messages: list[dict[str, Any]], user_turns: Iterable[str], room: int,
             on_turn: Callable[[Turn], None]) -> list[dict[str, Any]]:
  """Answers the conversation `messages` if it awaits a reply (`awaits_reply`), then each
  of `user_turns` in order (each reply appended as an assistant message); `on_turn` sees each
  turn as it ends. `room`: the tokens a prompt may take (the model's context less
  max_new_tokens). Returns the whole conversation."""
  messages = list(messages)
  for text in _turns(awaits_reply(messages), user_turns):
    if text is not None:
      messages.append({"role": "user", "content": text})
    prompt_ids = renderer.ids(messages, add_generation_prompt=True)
    if len(prompt_ids) > room:
      raise ChatError(f"the conversation ({len(prompt_ids)} tokens) and --max_new_tokens reach "
                      "past the model's max_seq_len (the longest sequence it trained on): start "
                      "a new one, or lower --max_new_tokens")
    new = generate(prompt_ids, lambda ids: end.reached(renderer.tokenizer, ids))
    reply, stop = end.reply(renderer.tokenizer, new, eos_id)
    messages.append({"role": "assistant", "content": reply})
    on_turn(Turn(prompt_ids, new, reply, stop))
  return messages


def awaits_reply(messages: list[dict[str, Any]]) -> bool:
  """Whether a conversation ends with a turn the assistant answers: the user's or the
  environment's (a tool's output); a system message alone is a preamble."""
  return bool(messages) and messages[-1]["role"] in ("user", "environment")


def _turns(pending: bool, user_turns: Iterable[str]) -> Iterable[str | None]:
  """None (answer the conversation as given) when it awaits a reply, then the user's turns."""
  if pending:
    yield None
  yield from user_turns


def template_summary(template: chat.ChatTemplate) -> dict[str, str]:
  return {"name": template.name, "sha256": template.sha256}


def stdin_turns(lines: Iterable[str], ask: Callable[[], None]) -> Iterable[str]:
  """User turns typed one a line (blank lines skipped) until the input ends; `ask` prompts
  before each."""
  ask()
  for line in lines:
    if line.strip():
      yield line.rstrip("\n")
    ask()


def stop_words(turns: Sequence[Turn]) -> str:
  """How the turns ended, for the summary line."""
  names = {"eos": "EOS", "end_of_turn": END_OF_TURN, "max_new_tokens": "--max_new_tokens"}
  return ", ".join(names[t.stop] for t in turns) or "no turn"
