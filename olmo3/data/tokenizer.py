"""The one tokenizer loader: `load(name, what)`, a tokenizer.json path or a Hugging Face hub name
(`allenai/dolma2-tokenizer`) -> a `tokenizers.Tokenizer`, or one DataError line that names the
caller's own flag or field (`what`: `--tokenizer`, the run's `EvalConfig.tokenizer`...). Run-level
names (`embedded`, a prepared directory's copy behind a URL) become files in
`olmo3.data.sources.tokenizer_file` first.

A hub name: the local path of its tokenizer.json, downloaded once into the Hugging Face cache,
or one DataError line within seconds when it cannot be had. Why not
`tokenizers.Tokenizer.from_pretrained`: it goes through huggingface_hub's download, which, when
the hub cannot be reached and the file is not cached, tries again with backoff
(1 + 2 + 4 + 8 + 8 s) and prints a warning each time before it gives up: 25 s of retries
before a machine without network says so. Here the hub is asked once (HF_HUB_ETAG_TIMEOUT
bounds the wait, as for huggingface_hub's own first request); unreachable, the cached copy is
used as huggingface_hub would, and without one the error says what to do.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer

from olmo3.data.tokens import DataError

HUB_FILE = "tokenizer.json"  # the file a hub repository holds its tokenizer in
CONFIG_FILE = "tokenizer_config.json"  # beside it: special tokens, the chat template


def load(name: str, what: str) -> Tokenizer:
  """The tokenizer of tokenizer.json file `name`, else of Hugging Face hub repository `name`.
  `what` is how the caller's user named it (a flag, a config field, a file): every error is
  one DataError line `{what} {name!r}: why`."""
  if os.path.exists(name):
    try:
      return Tokenizer.from_file(name)
    except Exception as e:  # pylint: disable=broad-except  # tokenizers raises its own types
      raise DataError(f"{what} {name!r}: not a readable tokenizer.json file "
                      f"({_reason(e)})") from None
  try:  # a hub name: fetched once, or one line within seconds (not from_pretrained)
    return Tokenizer.from_file(_hub_file(name))
  except DataError as e:
    raise DataError(f"{what} {name!r}: {e}") from None


def config(name: str, what: str) -> dict[str, Any] | None:
  """The tokenizer_config.json of tokenizer `name` (its special tokens, its chat template):
  beside a tokenizer.json file, or the hub repository's (fetched as `load` fetches its
  tokenizer.json); None when there is none."""
  if os.path.exists(name):
    path = os.path.join(os.path.dirname(os.path.abspath(name)), CONFIG_FILE)
    if not os.path.isfile(path):
      return None
  else:
    try:
      path = _hub_file(name, CONFIG_FILE)
    except DataError:
      return None
  try:
    with open(path, encoding="utf-8") as f:
      found = json.load(f)
  except ValueError as e:
    raise DataError(f"{what} {name!r}: {path} is not valid JSON ({e})") from None
  return found if isinstance(found, dict) else None


def _reason(e: BaseException) -> str:
  """An exception in a few words: huggingface_hub's messages run to several lines."""
  first = next((line for line in str(e).splitlines() if line.strip()), "")
  return f"{type(e).__name__}: {first.strip()}" if first else type(e).__name__


def _hub_file(name: str, file: str = HUB_FILE) -> str:
  """The local path of hub repository `name`'s tokenizer.json (or other `file`). DataError
  (the sentence's end: `load` puts the setting that named it first) when the name is no
  repository name, the hub says no, or the hub is out of reach (or HF_HUB_OFFLINE is set) and
  the file is not cached."""
  # Imported here: only a hub name needs it (0.3 s).
  import httpx  # pylint: disable=import-outside-toplevel
  from huggingface_hub import constants, errors, file_download  # pylint: disable=import-outside-toplevel
  from huggingface_hub.utils import validate_repo_id  # pylint: disable=import-outside-toplevel

  def cached() -> str | None:
    try:
      return file_download.hf_hub_download(name, file, local_files_only=True)
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
      return None

  try:
    validate_repo_id(name)
    if constants.HF_HUB_OFFLINE:
      found = cached()
      if found is None:
        raise DataError("not a tokenizer.json file, and not in the Hugging Face cache while "
                        "HF_HUB_OFFLINE is set: give a tokenizer.json path, or fetch it once "
                        "where the hub is reachable")
      return found
    try:  # one request, no retries (huggingface_hub retries only when told to)
      file_download.get_hf_file_metadata(file_download.hf_hub_url(name, file),
                                         timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (httpx.TransportError, OSError) as e:
      status = getattr(getattr(e, "response", None), "status_code", 500)
      if isinstance(e, errors.HfHubHTTPError) and status < 500 and status != 429:
        # The hub answered: no such repository or file, or not for this user.
        raise DataError(f"not a tokenizer.json file, nor a Hugging Face hub repository with "
                        f"one ({_reason(e)})") from None
      found = cached()  # out of reach: the cached copy, as huggingface_hub falls back to
      if found is None:
        raise DataError(f"not a tokenizer.json file, and the Hugging Face hub "
                        f"({constants.ENDPOINT}) cannot be reached to fetch it ({_reason(e)}) "
                        "nor is it cached: give a tokenizer.json path, or fetch it once where "
                        "the hub is reachable") from None
      return found
    try:
      return file_download.hf_hub_download(name, file)
    except (httpx.TransportError, OSError) as e:  # reached a moment ago: a download that failed
      raise DataError(f"not a tokenizer.json file, and its download from the Hugging Face "
                      f"hub failed ({_reason(e)})") from None
  except errors.HFValidationError:  # neither a file nor a repository name
    raise DataError("not a tokenizer.json file (no such file), nor a Hugging Face hub "
                    "repository name") from None
