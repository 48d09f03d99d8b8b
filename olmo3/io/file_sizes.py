"""The remote files' sizes and versions a run trained on (`SizeCache`, the workdir's
`file_sizes.json`), checked again at every launch. The run plan (olmo3.run.plan) makes one per
launch; it lives here, below the data code that is handed it (olmo3.data's token files, packed
documents and sources look their files up through it), which must not import olmo3.run."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from olmo3.io import errors, pathnames, storage


class SizeCache:
  """The remote files' sizes and versions a run trained on, kept in a JSON file (`path`, in
  the workdir) and checked again at every launch: each remote file is looked up once per
  launch (concurrently, with every other), and one whose size or version differs from the
  record is ChangedSince, naming the file and the record, unless `accept_changes`
  (data.allow_changed_data), when the new one is recorded. Without the check a file replaced
  under the same name would change the data a resumed run reads (shorter: reads past its end;
  other tokens: silently). Local files are never recorded: a stat costs nothing, and the
  loader checks their length before it maps them. `save` writes what was looked up (a
  launcher's checks look up without writing, before it has decided to write anything)."""

  def __init__(self, path: str | os.PathLike | None, *, accept_changes: bool = False):
    self.path = None if path is None else os.fspath(path)
    self.accept_changes = accept_changes
    self._recorded: dict[str, storage.Stat] = {}
    self._checked: dict[str, storage.Stat] = {}  # looked up by this launch
    if self.path is not None and storage.exists(self.path):
      try:
        recorded = json.loads(storage.read_text(self.path))
        self._recorded = {
            str(url): storage.Stat(int(size), None if version is None else str(version))
            for url, (size, version) in recorded.items()}
      except (ValueError, TypeError, AttributeError):  # unreadable: looked up and rewritten
        self._recorded = {}

  def sizes(self, paths: Sequence[str | os.PathLike]) -> list[int | None]:
    texts = [os.fspath(p) for p in paths]
    unchecked = sorted({t for t in texts if pathnames.is_url(t) and t not in self._checked})
    for url, found in zip(unchecked, storage.stats(unchecked)):
      if found is None:
        continue
      was = self._recorded.get(url)
      if was is not None and not self.accept_changes and (
          was.size != found.size or None not in (was.version, found.version)
          and was.version != found.version):
        raise errors.ChangedSince(
            f"{url} changed since this run recorded it in {self.path}: {was.describe()} then, "
            f"{found.describe()} now")
      self._checked[url] = found
    local = [t for t in texts if not pathnames.is_url(t)]
    found_local = dict(zip(local, storage.sizes(local)))
    return [self._checked[t].size if t in self._checked else found_local.get(t)
            for t in texts]

  def save(self) -> None:
    """Writes the record if this launch found a file it lacked or one changed (accepted)."""
    merged = {**self._recorded, **self._checked}
    if merged == self._recorded or self.path is None:
      return
    # Flushed: a cache of what the store says, re-checked at every launch.
    storage.write_bytes_atomic(self.path, json.dumps(
        {url: [stat.size, stat.version] for url, stat in merged.items()}, indent=0,
        sort_keys=True).encode(), durability=storage.Durability.FLUSHED)
    self._recorded = merged
