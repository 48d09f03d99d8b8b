"""The data package's one entrance: a mix name (or file list) -> labelled token files; a
tokenizer name -> the file or hub name it loads from; an Experiment -> the same Experiment with
its held-out sets and task tokenizer resolved (`resolve`).

A mix is one of: a directory written by `python -m olmo3.data.prepare` (its train split; as a
held-out set, its heldout split; `DIR/train` and `DIR/heldout` name a split explicitly), the
built-in corpus (`embedded`, `embedded-heldout`: such a directory, prepared here on first use,
so nothing below this module needs to know it exists; `embedded_chat`, `embedded_chat-heldout`:
the built-in chat corpus alike), a directory open-instruct's converter wrote for OLMo-core's
SFT (token_ids_part_*.npy and their label masks, no manifest: olmo3.data.label_masks), a mix
file (`label,path` lines), or the name of one of AI2's mixes (`olmo3.data.mixes`: those olmo3
ships, then ai2-olmo-core's where it is installed). Directories and mix files are local, gs://,
s3:// or http(s):// alike (olmo3.io.storage; over HTTP the server must answer Range requests).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import NamedTuple

from olmo3.io import clients, file_sizes, pathnames, storage
from olmo3.config import DataConfig, Experiment, ModelConfig
from olmo3.data import chat_data, embedded, label_masks, mixes, packing
from olmo3.data import tokenizer as tokenizer_lib
from olmo3.data.manifest import MANIFEST_FILE, SPLITS, TOKENIZER_FILE, Manifest
from olmo3.data.tokens import UNLABELLED, DataError, TokenFiles, token_counts

# The built-in corpora's mix names and their splits: the text corpus and the chat corpus
# (olmo3.data.embedded); each is one source, both its splits carrying its label.
EMBEDDED = {"embedded": "train", "embedded-heldout": "heldout",
            "embedded_chat": "train", "embedded_chat-heldout": "heldout"}
_BUILTIN_DIRS = {"embedded": embedded.corpus_dir, "embedded_chat": embedded.chat_dir}


class MixFile(NamedTuple):
  label: str  # the source it belongs to: a mix line's first column
  path: str  # a local path or a URL (olmo3.io.storage)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """One split of a prepared directory named as a mix."""

  directory: str  # pathnames.normalized: the spelling its token files' paths start with
  split: str
  label: str  # the source / held-out set name: the directory's name ("embedded" built in)
  manifest: Manifest
  builtin: bool  # the embedded corpus, named by its mix names

  @property
  def tokenizer(self) -> str:
    """What tasks load the tokenizer from: the copy `prepare` writes beside the tokens."""
    if self.builtin:
      return "embedded"
    return pathnames.join(self.directory, TOKENIZER_FILE)

  def mix(self, split: str) -> str:
    """The mix name of a split of this directory."""
    if self.builtin:
      return self.label if split == "train" else f"{self.label}-heldout"
    return pathnames.join(self.directory, split)


def prepared(mix: str, split: str = "train") -> Prepared | None:
  """The prepared directory (and split) `mix` names, or None when it names none. A bare
  directory means `split`; `DIR/<split>` names that split whatever `split` says."""
  builtin = mix in EMBEDDED
  if builtin:
    label = mix.removesuffix("-heldout")
    directory, split = pathnames.normalized(_BUILTIN_DIRS[label]()), EMBEDDED[mix]
  else:
    try:
      clients.check_supported(mix, what="mix")
    except ValueError as e:
      raise DataError(str(e)) from None
    directory = pathnames.normalized(mix)
    parent, name = pathnames.split(directory)
    has_manifest = storage.exists(pathnames.join(directory, MANIFEST_FILE))
    if (name in SPLITS and not has_manifest
        and storage.exists(pathnames.join(parent, MANIFEST_FILE))):
      directory, split = parent, name
    elif not has_manifest:
      return None
    label = pathnames.split(directory)[1]
  manifest = Manifest.load(directory)
  if split not in manifest.splits:
    raise DataError(f"{pathnames.join(directory, MANIFEST_FILE)} has no {split!r} split")
  return Prepared(directory, split, label, manifest, builtin)


def read_mix(mix: str, root: str = "", tokenizer_id: str = "", field: str = "DataConfig.mix"
             ) -> list[MixFile]:
  """The token files a mix lists (see the module docstring), in order, with their source
  labels. A mix file's paths are relative to `root` (a directory or URL) or, without one, to
  the mix file; `{TOKENIZER}` in them becomes `tokenizer_id`. `field` names the config field in
  errors."""
  return _listed(mix, prepared(mix), root, tokenizer_id, field)


def _listed(mix: str, split: Prepared | None, root: str, tokenizer_id: str, field: str
            ) -> list[MixFile]:
  """read_mix, given what `prepared(mix)` found (so a caller that needed it reads the
  manifest once)."""
  if split is not None:
    return [MixFile(split.label, p) for p in split.manifest.files(split.directory, split.split)]
  parts = label_masks.open_instruct_parts(mix)  # a directory open-instruct's converter wrote
  if parts is not None:
    return [MixFile(pathnames.split(pathnames.normalized(mix))[1], p) for p in parts]
  mix_path = mix
  if storage.is_dir(mix):
    raise DataError(f"{field}={mix!r} is a directory without {MANIFEST_FILE}: expected a directory "
                    "written by python -m olmo3.data.prepare (or a mix file)")
  if not storage.exists(mix):
    if pathnames.is_url(mix):
      raise DataError(f"{field}={mix!r}: no such mix file or prepared directory")
    packaged = mixes.find(mix)  # a user's file of that name came first
    if packaged is None:
      raise DataError(f"{field}={mix!r}: no such mix file or prepared directory, and no named "
                      f"mix of that name (olmo3 ships {', '.join(mixes.shipped())}; "
                      "python -m olmo3.data.mixes --list)")
    mix_path = packaged
  try:
    text = storage.read_bytes(mix_path).decode("utf-8")
  except UnicodeDecodeError:
    text = None
  if text is None or "\0" in text:
    raise DataError(f"{field}={mix!r} is a binary file (a token file?): expected a mix file of "
                    "'label,path' lines or a directory written by python -m olmo3.data.prepare")
  base = root if root else pathnames.split(mix_path)[0]  # a URL stays a URL (pathnames.join)
  paths = []
  for number, line in enumerate(text.splitlines(), start=1):
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    if line.count(",") != 1:
      raise DataError(f"{mix_path}:{number}: expected 'label,path', got {line!r}")
    label, rel = (part.strip() for part in line.split(","))
    if not label or not rel:
      raise DataError(f"{mix_path}:{number}: expected 'label,path', got {line!r}")
    paths.append(MixFile(label, pathnames.join(base, rel.replace("{TOKENIZER}", tokenizer_id))))
  if not paths:
    raise DataError(f"{mix_path}: the mix lists no token files")
  return paths


def training_files(cfg: DataConfig) -> list[MixFile]:
  """The configured training token files: a mix's, each labelled with its source, or `paths`
  (relative to `root` when given), which form one source (`tokens.UNLABELLED`)."""
  if cfg.mix:
    return read_mix(cfg.mix, cfg.root, cfg.tokenizer_id)
  return [MixFile(UNLABELLED, pathnames.join(cfg.root, p) if cfg.root else p) for p in cfg.paths]


def token_files(cfg: DataConfig, vocab_size: int | None,
                size_cache: file_sizes.SizeCache | None = None,
                files: list[MixFile] | None = None,
                model: ModelConfig | None = None) -> TokenFiles | packing.PackedInstances:
  """The training instances over the token files (`files`, as `training_files` lists them:
  listed here when not given), checked at startup: cut from the files, or, with `cfg.packing`,
  their documents packed (the `model`'s EOS ends a document, its pad token fills a bin; the
  index is built once per set of files and settings and kept in the cache). Remote files'
  sizes go through `size_cache` (a run keeps one in its workdir)."""
  files = training_files(cfg) if files is None else files
  labels = [f.label for f in files] if cfg.mix else None
  masks = chat_data.check_training(cfg, [f.path for f in files], size_cache)
  if cfg.packing is None:
    return TokenFiles([f.path for f in files], cfg.seq_len, vocab_size,
                      validate_tokens=cfg.validate_tokens, labels=labels, size_cache=size_cache,
                      chunk=cfg.chunk_instances)
  if model is None or model.eos_token_id is None or model.pad_token_id is None:
    raise DataError("DataConfig.packing needs the model's eos_token_id (documents end there) "
                    "and pad_token_id (bins are filled with it)")
  index = packing.cached_index(
      [f.path for f in files], embedded.cache_root() / "packing", seq_len=cfg.seq_len,
      eos_token_id=model.eos_token_id, source_group_size=cfg.packing.source_group_size,
      source_permutation_seed=cfg.packing.source_permutation_seed,
      long_doc_strategy=cfg.packing.long_documents.value, size_cache=size_cache,
      label_masks=masks)
  return packing.PackedInstances(index, pad_token_id=model.pad_token_id, vocab_size=vocab_size,
                                 labels=labels)


CHAT_PROMPT = "What does json.dumps do?"  # a first user turn for a model fine-tuned on chats


def sample_prompt(cfg: DataConfig) -> str:
  """A prompt to sample from a model trained on `cfg`'s data, in the kind of text it holds: the
  built-in corpus is Python's standard library (a prose opening only loops there)."""
  return "def main(" if cfg.mix in ("embedded", "embedded-heldout") else "The"


def tokenizer_file(name: str) -> str:
  """What a tokenizer name is loaded from: "embedded" is the built-in corpus's tokenizer.json;
  a URL (a prepared directory's copy in a bucket) a local copy of it in the cache; any other
  name (a tokenizer.json path or a Hugging Face hub name) is itself."""
  if name == "embedded":
    return os.fspath(embedded.corpus_dir() / TOKENIZER_FILE)
  if pathnames.is_url(name):  # tokenizers opens local files only: a copy in the cache
    return _remote_copy(name)
  return name


@functools.lru_cache(maxsize=16)
def _remote_copy(url: str) -> str:
  """A local copy of a remote tokenizer file, read once per process: the copy a directory
  re-prepared in its place (another tokenizer at the same URL) left in the cache is replaced,
  not compared or decoded with."""
  local = (embedded.cache_root() / "tokenizers" / hashlib.sha256(url.encode()).hexdigest()[:16]
           / os.path.basename(url))
  if not storage.exists(url):
    raise DataError(f"tokenizer file {url} does not exist")
  content = storage.read_bytes(url)
  if not local.exists() or local.read_bytes() != content:
    # Flushed: a cache, compared with the original at every first use in a process.
    storage.write_bytes_atomic(local, content, durability=storage.Durability.FLUSHED)
  return os.fspath(local)


def _file_digest(path: str) -> str:
  """The identity of a tokenizer file: the hash of its canonical serialisation (vocabulary,
  merges, normalizer, pre-tokenizer, special tokens...), so a pretty-printed copy of the same
  tokenizer matches and one that differs in any entry does not, whatever its size and ids."""
  stat = os.stat(path)
  return _digest(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _digest(path: str, mtime_ns: int, size: int) -> str:  # keyed by the file's state
  del mtime_ns, size
  return hashlib.sha256(tokenizer_lib.load(path, what="tokenizer file").to_str().encode()
                        ).hexdigest()


def _same_tokenizer(a: str, b: str) -> bool:
  """Whether two tokenizer names (files, "embedded" or hub names) are the same tokenizer:
  equal names, or local files with equal contents. A hub name is never downloaded to compare:
  it matches only itself."""
  if a == b:
    return True
  a, b = tokenizer_file(a), tokenizer_file(b)
  local = [os.path.isfile(n) for n in (a, b)]
  return all(local) and _file_digest(a) == _file_digest(b)


def check_init_tokenizer(exp: Experiment, theirs: str | None, source: str) -> None:
  """A resolved experiment that starts from `source` (checkpoint.init_from), whose run
  trained with the tokenizer `theirs` (its recorded eval.tokenizer, the data's where it was a
  prepared directory): DataError, one line naming both, when this run's data is a prepared
  directory tokenized with another tokenizer. The checkpoint's embeddings and head learned
  what its tokenizer's ids mean; the same ids from another vocabulary, even one of the same
  size and special ids, would train on as if they meant that. Where either side cannot be
  compared without a download (a hub name: see `_same_tokenizer`), nothing is refused."""
  ours = exp.eval.tokenizer
  train = prepared(exp.data.mix) if exp.data.mix else None
  if train is None or theirs is None or ours != train.tokenizer:
    return  # no data tokenizer on record here, or the task tokenizer set apart from the data
  try:
    files = [tokenizer_file(n) for n in (ours, theirs)]
  except DataError:  # that run's tokenizer file is gone: nothing to compare with
    return
  if not all(os.path.isfile(f) for f in files) or _same_tokenizer(ours, theirs):
    return
  raise DataError(f"DataConfig.mix={exp.data.mix!r} is tokenized with {ours}, but "
                  f"CheckpointConfig.init_from={source!r} was trained with another tokenizer "
                  f"({theirs}): its embeddings would read these ids as other tokens; prepare "
                  "the data with that run's tokenizer (python -m olmo3.data.prepare "
                  f"--tokenizer {tokenizer_file(theirs)})")


@dataclasses.dataclass(frozen=True)
class Resolved:
  """An experiment's data worked out once: the experiment a run executes and the files it
  reads, each mix and manifest read one time."""

  exp: Experiment  # held-out sets, their root and the task tokenizer filled in (`resolve`)
  train: tuple[MixFile, ...]  # the training token files, labelled with their sources
  heldout: tuple[tuple[str, tuple[MixFile, ...]], ...]  # (held-out mix, its files), in order
  train_files: TokenFiles | None = None  # `train` opened and sized (when resolve was asked to)
  # Why there is no held-out set, when there is none (a run's startup warning says it).
  no_heldout: str | None = None


def _heldout_mixes(exp: Experiment, train: Prepared | None
                   ) -> tuple[tuple[str, ...], list[Prepared | None], str | None]:
  """`resolve`'s held-out sets: (the mixes, each one's prepared split or None, why there is
  none when there is none). `eval.heldout=None` takes the training data's held-out split; a
  prepared directory named bare means its held-out split, spelled out."""
  data, ev = exp.data, exp.eval
  no_heldout = None
  if ev.heldout is None:
    has_docs = (train is not None
                and train.manifest.splits.get("heldout", {}).get("documents", 0) > 0)
    heldout = (train.mix("heldout"),) if has_docs else ()
    splits: list[Prepared | None] = [prepared(m, "heldout") for m in heldout]
    if train is not None and not has_docs:
      fraction = train.manifest.heldout_fraction
      no_heldout = (f"DataConfig.mix={data.mix!r} has no held-out split (" + (
          f"prepared with --heldout_fraction {fraction}: prepare it again without it"
          if not fraction else "too few documents to hold any out")
          + ", or name held-out sets in eval.heldout)")
    elif train is None:
      no_heldout = ("EvalConfig.heldout=None takes the held-out split of the training data's "
                    "prepared directory, and " + (f"DataConfig.mix={data.mix!r}" if data.mix
                                                  else "data.paths")
                    + " is none (name held-out sets in eval.heldout)")
  else:
    if not ev.heldout:
      no_heldout = "EvalConfig.heldout=() names none"
    # A directory named bare means its held-out split: spelled out, so that read_mix, which
    # reads a bare directory as training data, reads the right files.
    splits = [prepared(m, "heldout") for m in ev.heldout]
    heldout = tuple(p.mix("heldout") if p is not None and p.split == "heldout" else m
                    for p, m in zip(splits, ev.heldout))
  return heldout, splits, no_heldout


def resolve(exp: Experiment, sizes: file_sizes.SizeCache | None = None) -> Resolved:
  """The experiment a run executes and its files: `eval.heldout=None` becomes the held-out
  split of the training data (`data.mix` a prepared directory; `()` when it has none or the
  data is no prepared directory), a prepared directory named in `eval.heldout` becomes its
  heldout split, `eval.heldout_root=None` becomes `data.root` (the one place that default
  lives: `heldout_root`) and `eval.tokenizer=None` the training data's tokenizer. Explicit values are kept.
  Refuses (DataError, one line naming both) a data.root that does not exist or that nothing
  reads, a held-out set or task tokenizer whose tokenizer differs from the training data's, a
  held-out set that lists a training file, and a tokenizer whose EOS or vocabulary the model
  does not share. Idempotent: resolving the resolved experiment changes nothing.

  With `sizes` (a run's size cache), the training files are also opened and checked
  (`Resolved.train_files`) as soon as they are listed: a missing token file is the error a
  launch reports first, before what follows from the data's other settings."""
  data, ev, model = exp.data, exp.eval, exp.model
  train = prepared(data.mix) if data.mix else None
  heldout, splits, no_heldout = _heldout_mixes(exp, train)
  root = heldout_root(exp)
  follows = ev.heldout_root in (None, data.root)  # held-out mix files relative to data.root
  _check_root(exp, [train] * bool(data.mix) + splits * follows)
  if sizes is not None:  # a launch that reads them (a dry run lists the files it would read)
    for field, mix, mix_root in ([("DataConfig.mix", data.mix, data.root)] * bool(data.mix)
                                  + [("EvalConfig.heldout", m, root) for m in heldout]):
      _refuse_a_named_mix_without_root(field, mix, mix_root)
  training = (_listed(data.mix, train, data.root, data.tokenizer_id, "DataConfig.mix")
              if data.mix else training_files(data))
  opened = (token_files(data, model.vocab_size, sizes, files=training, model=model)
            if sizes is not None else None)
  tokenizer = ev.tokenizer
  if tokenizer is None and train is not None:
    tokenizer = train.tokenizer
  if tokenizer is None and ev.tasks:
    raise DataError(f"EvalConfig.tokenizer=None takes the tokenizer of the training data's "
                    f"prepared directory, but DataConfig.mix={data.mix!r} is none: set "
                    "eval.tokenizer for the tasks")
  if train is not None:
    _check_model(train, model)
    if ev.tokenizer is not None and ev.tasks and not _same_tokenizer(ev.tokenizer,
                                                                     train.tokenizer):
      raise DataError(f"EvalConfig.tokenizer={ev.tokenizer!r} is not the tokenizer of the "
                      f"training data ({train.tokenizer}, {train.directory}): drop the "
                      "override (None uses the data's) or prepare the data with it")
  chat_data.check_template(data, train, [f.path for f in training])
  trained_on = {f.path for f in training}
  per_mix = []
  for mix, split in zip(heldout, splits):
    files = _listed(mix, split, root, ev.heldout_tokenizer_id, "EvalConfig.heldout")
    overlap = [f.path for f in files if f.path in trained_on]
    if overlap:
      raise DataError(f"EvalConfig.heldout={mix!r} lists a training file ({overlap[0]}): "
                      "held-out documents must never be trained on")
    per_mix.append((mix, tuple(files)))
    if sizes is not None:  # chat data's held-out masks, checked as the training ones
      paths = [f.path for f in files]
      label_masks.check(paths, token_counts(paths, "held-out token file", sizes),
                        f"EvalConfig.heldout={mix!r}", sizes)
    if split is None:
      continue  # a mix file: its tokenizer is not recorded anywhere to compare
    if train is not None and not _same_tokenizer(split.tokenizer, train.tokenizer):
      raise DataError(f"EvalConfig.heldout={mix!r} was tokenized with {split.tokenizer}, the "
                      f"training data ({data.mix}) with {train.tokenizer}: a held-out loss "
                      "is only comparable on the training tokenizer")
    _check_model(split, model)
  resolved = dataclasses.replace(exp, eval=dataclasses.replace(
      ev, heldout=heldout, heldout_root=root, tokenizer=tokenizer))
  return Resolved(resolved, tuple(training), tuple(per_mix), opened, no_heldout)


def heldout_root(exp: Experiment) -> str | None:
  """What held-out mix files' paths are relative to: eval.heldout_root, else data.root (the
  one place that default lives; `resolve` writes it into the experiment a run executes)."""
  return exp.data.root if exp.eval.heldout_root is None else exp.eval.heldout_root


def heldout_sets(exp: Experiment) -> dict[str, tuple[str, ...]]:
  """{set: its token files} of a resolved experiment's held-out mixes, each mix read once:
  what `python -m olmo3.eval` evaluates from a run's experiment.json, whose training data need
  not be reachable."""
  ev = exp.eval
  root = heldout_root(exp)
  return by_set([f for mix in ev.heldout or ()
                 for f in read_mix(mix, root, ev.heldout_tokenizer_id, "EvalConfig.heldout")])


def by_set(files: list[MixFile]) -> dict[str, tuple[str, ...]]:
  """Held-out files grouped into sets: every label of every held-out mix is one set."""
  sets: dict[str, list[str]] = {}
  for f in files:
    sets.setdefault(f.label, []).append(f.path)
  return {k: tuple(v) for k, v in sets.items()}


def _refuse_a_named_mix_without_root(field: str, mix: str, root: str) -> None:
  """A named mix of AI2's (a list olmo3 ships) lists paths relative to AI2's token store: with
  no root to put them under, a launch named a file inside the installed package as missing."""
  # Cheap checks first: the package lookup rules out nearly every mix before the store is asked
  # (nothing before this asked it whether `mix` is a file; `prepared` looked for a manifest).
  if (not root and mix not in EMBEDDED and not pathnames.is_url(mix)
      and mixes.find(mix) is not None and not storage.exists(mix)):
    setting = "DataConfig.root" if field == "DataConfig.mix" else "eval.heldout_root (or data.root)"
    raise DataError(f"{field}={mix!r} is a named mix of AI2's token files, listed relative to "
                    f"where they are stored: set {setting} to that directory or URL "
                    "(--fdl_set=data.root='\"gs://bucket/olmo3-data\"')")


def _check_root(exp: Experiment, found: list[Prepared | None]) -> None:
  """DataConfig.root, if given, exists and is used: only token files given as `paths` and the
  files of a mix file are relative to it (also held-out mix files while eval.heldout_root is
  None); a prepared directory, the built-in corpus included, names its own files. `found` is
  what `prepared` found for each mix read relative to the root (None: a mix file)."""
  root = exp.data.root
  if not root:
    return
  # An HTTP root is a prefix, not a directory anything can check: its files are checked.
  if pathnames.scheme(root) not in pathnames.READ_ONLY_SCHEMES and not storage.exists(root):
    raise DataError(f"DataConfig.root={root!r} does not exist: give the directory (or URL) the "
                    "token files are under")
  if not exp.data.paths and all(p is not None for p in found):
    raise DataError(f"DataConfig.root={root!r} is not used: DataConfig.mix={exp.data.mix!r} is "
                    "a prepared directory (or the built-in corpus), which names its own files. "
                    "Drop data.root, or give data.paths or a mix file relative to it")


def _check_model(split: Prepared, model) -> None:
  """A prepared directory's tokens fit the model: its EOS ends the model's documents (held-out
  sets are cut at it) and its tokenizer's vocabulary is the model's."""
  m = split.manifest
  where = pathnames.join(split.directory, MANIFEST_FILE)
  if m.eos_id != model.eos_token_id:
    raise DataError(f"{where}: its documents end with EOS id {m.eos_id} ({split.tokenizer}), "
                    f"but ModelConfig.eos_token_id={model.eos_token_id}")
  if m.vocab_size != model.vocab_size:
    # More tokens than the model's vocabulary would index past its embedding; fewer leave the
    # model's extra rows untrained and its vocabulary not the tokenizer's (a 4,096-entry
    # tokenizer trained the tiny 8,192-entry model silently).
    raise DataError(f"{where}: its tokenizer has {m.vocab_size} tokens, "
                    f"{'more' if m.vocab_size > model.vocab_size else 'fewer'} than "
                    f"ModelConfig.vocab_size={model.vocab_size}: set model.vocab_size (and "
                    "model.padded_vocab_size, model.eos_token_id, model.pad_token_id) to "
                    "the tokenizer's")
