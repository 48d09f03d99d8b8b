"""How a file's name is spelt and taken apart, a local path or a URL alike (`gs://`, `s3://`,
`http(s)://`): its scheme, joins, the spelling runs record names in, parent and name, the
absolute form. Text only: nothing here touches a store. (Not `paths`: that is the name of many
callers' lists of them.)"""

from __future__ import annotations

import os
import pathlib

READ_WRITE_SCHEMES = ("gs", "s3")
READ_ONLY_SCHEMES = ("http", "https")


def scheme(path: str | os.PathLike) -> str:
  """'' for a local path, else the URL's scheme ('gs', 's3', 'http', 'https')."""
  text = os.fspath(path)
  head, sep, _ = text.partition("://")
  return head.lower() if sep and head.isalnum() else ""


def is_url(path: str | os.PathLike) -> bool:
  return bool(scheme(path))


def host(url: str) -> str:
  """A URL's host (or bucket)."""
  return url.partition("://")[2].partition("/")[0]


def absolute(path: str | os.PathLike):
  """`path` as an absolute etils.epath.Path: a URL as it is (epath's `absolute()` would make
  `gs://b/x` the local `$PWD/gs:/b/x`), a local path from the working directory."""
  from etils import epath  # pylint: disable=g-import-not-at-top

  text = os.fspath(path)
  return epath.Path(text if is_url(text) else os.path.abspath(text))


def join(base: str | os.PathLike, *parts: str) -> str:
  """`base/part/...` for a local path or a URL (URLs keep their `//` and use `/`)."""
  text = os.fspath(base)
  if not is_url(text):
    return os.path.join(text, *parts)
  for part in parts:
    text = text.rstrip("/") + "/" + part.lstrip("/")
  return text


def normalized(path: str | os.PathLike) -> str:
  """`path` spelt as etils.epath spells it (pathlib's rules for a local path: `./a/b/` is
  `a/b`; a URL's repeated and trailing slashes dropped), http(s):// URLs included, which etils
  cannot represent. Token-file paths built on it keep the spelling runs recorded them with."""
  text = os.fspath(path)
  if not is_url(text):
    return os.fspath(pathlib.PurePath(text))
  head, _, rest = text.partition("://")
  return f"{head}://" + "/".join(part for part in rest.split("/") if part)


def split(path: str | os.PathLike) -> tuple[str, str]:
  """(parent, name) of `normalized(path)`, as etils.epath's `parent` and `name`, URLs of every
  scheme alike: `http://host/a/b` is (`http://host/a`, `b`); a URL without a path (`http://host`,
  `gs://bucket`) is its own parent, named by its host or bucket."""
  text = normalized(path)
  if not is_url(text):
    pure = pathlib.PurePath(text)
    return os.fspath(pure.parent), pure.name
  head, _, rest = text.partition("://")
  parent, sep, name = rest.rpartition("/")
  return f"{head}://{parent if sep else rest}", name
