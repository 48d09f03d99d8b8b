"""What travels with a checkpoint besides its weights: the tokenizer and the chat template, kept
whole from the data a run trained on to the Hugging Face export.

Where they are found (`carried`), the first that has them:
- a run's checkpoint (RUN/checkpoints/<step>): the run's tokenizer (experiment.json's
  EvalConfig.tokenizer, when it is a file) with the tokenizer_config.json beside it, and the
  chat template its data was tokenized with (the prepared directory's manifest.json
  `chat.template`: name, sha256 and text, as `prepare --chat` writes it; or the template an
  open-instruct directory's saved tokenizer holds);
- a checkpoint olmo3 wrote outside a run (`import-hf`, `merge`): what its meta kept
  (`TOKENIZER_KEY`, `TEMPLATE_KEY`), so a later export writes them again.

An export writes tokenizer.json, tokenizer_config.json (EOS and PAD as the model's ids, the
other special tokens the source named, and the template as `chat_template`, which transformers
before 4.50 read) and chat_template.jinja (the same text: 4.5x and 5.x read it first, and
`save_pretrained` writes only it), so every version renders the template the data was made with.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from etils import epath
from tokenizers import Tokenizer

from olmo3.config import Experiment, ModelConfig
from olmo3.data import chat, label_masks, sources, tokenizer as tokenizer_lib
from olmo3.data.manifest import MANIFEST_FILE, SPLITS
from olmo3.data.tokens import DataError
from olmo3.io import pathnames, storage

TEMPLATE_KEY = "chat_template"  # in a checkpoint's meta: {name, sha256, text}
TOKENIZER_KEY = "tokenizer"  # in a checkpoint's meta: {TOKENIZER_JSON: text, "config": dict}
TOKENIZER_JSON = "tokenizer.json"
JINJA_FILE = "chat_template.jinja"  # what transformers >= 4.50 reads first, and writes


def template_entry(template: chat.ChatTemplate) -> dict[str, str]:
  """A template as a checkpoint's meta (and a chat directory's manifest) records it."""
  return {"name": template.name, "sha256": template.sha256, "text": template.text}


def template_of(entry: Any, where: str) -> chat.ChatTemplate | None:
  """The template a `template_entry` records (None for none), its text checked against its
  hash; DataError naming `where` otherwise."""
  if entry is None:
    return None
  if not (isinstance(entry, dict) and isinstance(entry.get("text"), str)
          and isinstance(entry.get("name"), str)):
    raise DataError(f"{where}: '{TEMPLATE_KEY}' is not an object with 'name' and 'text'")
  template = chat.ChatTemplate(entry["name"], entry["text"])
  if entry.get("sha256") not in (None, template.sha256):
    raise DataError(f"{where}: the chat template's text does not match its sha256 "
                    f"{entry['sha256']} (edited after it was written)")
  return template


def _data_directory(exp: Experiment) -> str | None:
  """The directory a run's data mix names (a built-in name's, DIR, or DIR for DIR/<split>), or
  None for data given as token files or a mix file's lines."""
  mix = exp.data.mix
  if mix is None:
    return None
  if mix in sources.EMBEDDED:
    return sources.prepared(mix).directory
  parent, name = pathnames.split(pathnames.normalized(mix))
  if name in SPLITS and storage.exists(pathnames.join(parent, MANIFEST_FILE)):
    return parent
  return pathnames.normalized(mix)


def _recorded(directory: str) -> chat.ChatTemplate | None:
  """The template a prepared chat directory's manifest records (`chat.template`: name, sha256,
  text, as `prepare --chat` writes it), else the one an open-instruct directory's saved
  tokenizer holds (olmo3.data.label_masks); None for neither."""
  path = pathnames.join(directory, MANIFEST_FILE)
  if storage.exists(path):
    try:
      entry = (json.loads(storage.read_text(path)).get("chat") or {}).get("template")
    except (ValueError, AttributeError):
      raise DataError(f"{path} is not a readable manifest") from None
    return template_of(entry, path)
  name, text = label_masks.open_instruct_template(directory)
  return None if text is None else chat.ChatTemplate(name or chat.TOKENIZERS_OWN, text)


def data_template(exp: Experiment) -> chat.ChatTemplate | None:
  """The chat template the run's data was tokenized with, whole: what its directory records,
  else the template DataConfig.chat_template names (a shipped name or a .jinja file; a bare
  SHA-256 has no text); None for data without one (pretraining text)."""
  directory = _data_directory(exp)
  recorded = None if directory is None else _recorded(directory)
  if recorded is not None:
    return recorded
  named = exp.data.chat_template
  if named is None or not (named in chat.shipped() or named.endswith(".jinja")):
    return None
  return chat.ChatTemplate.named(named, what="the run's DataConfig.chat_template")


def config_beside(tokenizer: str) -> dict[str, Any] | None:
  """The tokenizer_config.json beside a tokenizer.json file (a prepared chat directory's, an HF
  directory's), or None: its special tokens and chat template."""
  if not (pathnames.is_url(tokenizer) or os.path.isfile(tokenizer)):
    return None  # a hub name: no directory of ours
  path = pathnames.join(pathnames.split(tokenizer)[0], tokenizer_lib.CONFIG_FILE)
  if not storage.exists(path):
    return None
  try:
    config = json.loads(storage.read_text(path))
  except ValueError as e:
    raise DataError(f"{path}: not valid JSON ({e})") from None
  return config if isinstance(config, dict) else None


@dataclasses.dataclass(frozen=True)
class Carried:
  """A checkpoint's tokenizer (tokenizer.json's text, or None when it is not a file: a hub
  name), its tokenizer_config.json (special tokens) and chat template, and where they came
  from (for the messages)."""

  source: str
  tokenizer_json: str | None = None
  config: dict[str, Any] = dataclasses.field(default_factory=dict)
  template: chat.ChatTemplate | None = None

  def meta(self) -> dict[str, Any]:
    """What a checkpoint's meta keeps of it (olmo3.io.checkpoint.save_model's `meta`)."""
    out: dict[str, Any] = {}
    if self.tokenizer_json is not None:
      out[TOKENIZER_KEY] = {TOKENIZER_JSON: self.tokenizer_json, "config": self.config}
    if self.template is not None:
      out[TEMPLATE_KEY] = template_entry(self.template)
    return out

  def with_template(self, name: str | None) -> Carried:
    """This, with the template `name` (`--chat_template`: shipped, `tokenizer`, a .jinja
    file) in place of the one found."""
    if name is None:
      return self
    return dataclasses.replace(self, template=chat.ChatTemplate.named(name, self.config))


def of_meta(meta: dict[str, Any], source: str) -> Carried:
  """What a checkpoint olmo3 wrote outside a run kept in its meta."""
  kept = meta.get(TOKENIZER_KEY) or {}
  return Carried(source, kept.get(TOKENIZER_JSON), kept.get("config") or {},
                 template_of(meta.get(TEMPLATE_KEY), f"{source} (its meta)"))


def run_experiment(step_dir: epath.Path) -> Experiment | None:
  """The experiment of the run that wrote RUN/checkpoints/<step> (its experiment.json, as
  resolved when it trained), or None when the checkpoint is not a run's."""
  record = step_dir.parent.parent / "experiment.json"
  if step_dir.parent.name != "checkpoints" or not record.exists():
    return None
  return Experiment.from_dict(json.loads(record.read_text()))


def of_run(exp: Experiment, source: str) -> Carried:
  """A run's tokenizer (its file, when it is one) and its data's chat template."""
  name = exp.eval.tokenizer
  if name is None:
    return Carried(source, template=data_template(exp))
  file = sources.tokenizer_file(name)
  text = None
  if os.path.isfile(file):
    text = tokenizer_lib.load(file, what="the run's EvalConfig.tokenizer").to_str()
  return Carried(name, text, config_beside(name) or {}, data_template(exp))


def carried(step_dir: epath.Path, meta: dict[str, Any]) -> Carried:
  """What travels with the checkpoint at `step_dir` (whose meta is `meta`): the run's, or what
  its meta kept."""
  exp = run_experiment(step_dir)
  if exp is not None:
    return of_run(exp, os.fspath(step_dir))
  return of_meta(meta, os.fspath(step_dir))


def of_hf_dir(path: str | os.PathLike) -> Carried:
  """An HF directory's tokenizer.json, tokenizer_config.json and chat template (its
  chat_template.jinja first, as transformers reads it, else the config's `chat_template`)."""
  directory = epath.Path(path)
  tokenizer = directory / TOKENIZER_JSON
  if not tokenizer.exists():
    return Carried(os.fspath(path))
  config = config_beside(os.fspath(tokenizer)) or {}
  jinja = directory / JINJA_FILE
  if jinja.exists():
    template = chat.ChatTemplate(chat.TOKENIZERS_OWN, jinja.read_text())
  elif config.get("chat_template"):
    template = chat.ChatTemplate.named(chat.TOKENIZERS_OWN, config,
                                       what=f"{directory / tokenizer_lib.CONFIG_FILE}")
  else:
    template = None
  kept = {k: v for k, v in config.items() if k != "chat_template"}  # the template: once
  return Carried(os.fspath(path), tokenizer.read_text(), kept, template)


def hf_files(kept: Carried, cfg: ModelConfig) -> dict[str, str]:
  """tokenizer.json, the tokenizer_config.json with which transformers' AutoTokenizer loads it
  (PreTrainedTokenizerFast; EOS and PAD named as the model's ids, the source's other special
  tokens kept), and the chat template in both places transformers reads it from."""
  if kept.tokenizer_json is None:
    return {}
  tok = Tokenizer.from_str(kept.tokenizer_json)
  special = {k: v for k, v in kept.config.items()
             if k.endswith("_token") and k not in ("eos_token", "pad_token")
             and isinstance(v, (str, dict))}
  for key, token_id in (("eos_token", cfg.eos_token_id), ("pad_token", cfg.pad_token_id)):
    token = tok.id_to_token(token_id) if token_id is not None else None
    if token is None:
      raise DataError(f"{kept.source}: no token with the model's {key} id {token_id}")
    special[key] = token
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
            "add_bos_token": False, "add_eos_token": False, **special}
  files = {TOKENIZER_JSON: kept.tokenizer_json}
  if kept.template is not None:
    config["chat_template"] = kept.template.text
    files[JINJA_FILE] = kept.template.text
  files[tokenizer_lib.CONFIG_FILE] = json.dumps(config, indent=2, ensure_ascii=False)
  return files
