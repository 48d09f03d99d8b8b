"""RULER's synthetic long-context tasks, generated offline: the instances olmo3.eval.ruler
scores (docs/evaluation.md#ruler).

Each task is generated as lm-eval 0.4.13's `ruler` group generates it: the same templates,
the same word lists (wonderwords'), the same draws from the same random streams in the same
order, and the same search for the haystack size that fills the length, measured with the
same tokenizer. lm-eval draws from Python's and NumPy's global generators; here each (task,
length) draws from its own `random.Random(seed)` (and `numpy.random.RandomState(seed)`), so
that its instances do not depend on which other tasks or lengths were generated before it.
They equal lm-eval's for one length generated in a fresh process after `random.seed(seed)`
and `numpy.random.seed(seed)` (tests/test_ruler.py compares them), the first `samples` of
lm-eval's 500. Three differences, each where lm-eval cannot run offline or would not end:
- the essay haystacks (niah_single_2 and _3, niah_multikey_1, niah_multivalue,
  niah_multiquery): lm-eval downloads Paul Graham's essays and splits them into sentences with
  NLTK's punkt model (another download); here the haystack is the run's own held-out text (or
  the embedded corpus), split into sentences at '.', '!' or '?' followed by a space, and below
  4096 tokens sized in steps of 25 words, not 500 (which would leave one word);
- the QA tasks (SQuAD, HotpotQA) download their data sets: not generated here;
- where lm-eval's sample loop would shrink its haystack forever, or would ask for the common
  words of an empty list (a length too short to hold an instance), this raises RulerError
  naming the task and length.

`Instance.prompt` is what the model reads: the input, then the answer's prefix, joined as
lm-eval joins them (its target delimiter where neither side has a space at the seam).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import wonderwords

from olmo3.eval.tasks import TaskError

Count = Callable[[str], int]  # tokens of a text, as the tokenizer's __call__ counts them


class RulerError(TaskError):
  """A task that cannot be generated at a length (or is unknown): one line naming both; a run
  refuses to start with it, as with any task that cannot be prepared."""


NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again.")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
    "all the special magic {type_needle_v} for {query} mentioned in the provided text?")
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above.")
# (sic: "assgined" is RULER's spelling; the prompt must be the same text)
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
             "{num_v} variables are assgined the value {query}, they are: ")
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
    "common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any "
    "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
    "words in the above coded text?")
FWE_PREFIX = (" Answer: According to the coded text above, the three most frequently appeared "
              "words are:")


@dataclasses.dataclass(frozen=True)
class Instance:
  task: str
  length: int  # the RULER length it was generated for
  index: int
  input: str
  gen_prefix: str  # the answer's start, given to the model after the input
  outputs: tuple[str, ...]  # every one must appear in the answer
  delimiter: str  # between input and gen_prefix (lm-eval's target_delimiter)
  new_tokens: int  # the answer's budget (lm-eval's max_gen_toks)

  @property
  def prompt(self) -> str:
    seam = not (self.input[-1:].isspace() or self.gen_prefix[:1].isspace()) and self.input
    return self.input + (self.delimiter if seam else "") + self.gen_prefix


class Haystack(enum.Enum):
  """What a needle hides in (lm-eval's type_haystack names)."""

  NOISE = "repeat"  # the noise sentence, repeated
  NEEDLES = "needle"  # other needles, of other keys
  PROSE = "essay"  # sentences of text


@dataclasses.dataclass(frozen=True)
class Niah:
  """A needle-in-a-haystack task's settings (lm-eval's niah_utils)."""

  haystack: Haystack
  type_k: str = "words"
  type_v: str = "numbers"
  num_k: int = 1
  num_v: int = 1
  num_q: int = 1


NIAH = {
    "niah_single_1": Niah(Haystack.NOISE),
    "niah_single_2": Niah(Haystack.PROSE),
    "niah_single_3": Niah(Haystack.PROSE, type_v="uuids"),
    "niah_multikey_1": Niah(Haystack.PROSE, num_k=4),
    "niah_multikey_2": Niah(Haystack.NEEDLES),
    "niah_multikey_3": Niah(Haystack.NEEDLES, type_k="uuids", type_v="uuids"),
    "niah_multivalue": Niah(Haystack.PROSE, num_v=4),
    "niah_multiquery": Niah(Haystack.PROSE, num_q=4),
}
# ζ(2) = π²/6, lm-eval's normaliser of the frequent words' Zipf counts (scipy.special.zeta(2.0):
# the same float64).
ZETA_2 = math.pi ** 2 / 6
NEW_TOKENS = {**{name: 128 for name in NIAH}, "ruler_vt": 30, "ruler_cwe": 120, "ruler_fwe": 50}


def uses_text(task: str) -> bool:
  """Whether the task's haystack is prose (the run's held-out text)."""
  return task in NIAH and NIAH[task].haystack is Haystack.PROSE


def generate(task: str, length: int, samples: int, seed: int, count: Count,
             text_words: Sequence[str] = ()) -> list[Instance]:
  """The task's first `samples` instances at `length`. `count` measures texts in tokens;
  `text_words` is the essay haystack (prose split at spaces) for the tasks that read one."""
  if task in NIAH:
    return _niah(task, NIAH[task], length, samples, seed, count, text_words)
  makers = {"ruler_vt": _vt, "ruler_cwe": _cwe, "ruler_fwe": _fwe}
  if task not in makers:
    raise RulerError(f"RULER task {task!r} unknown: one of {sorted([*NIAH, *makers])}")
  return makers[task](task, length, samples, seed, count)


# --- needle in a haystack ------------------------------------------------------------------


class _AdjectiveNouns(Sequence[str]):
  """sorted({f"{adjective}-{noun}"}) over wonderwords' lists, lm-eval's needle keys, without
  writing out its 6.2 million strings (seconds and half a gigabyte): each adjective's strings
  form one sorted block, and blocks ordered by their first string follow one another, except
  where one adjective is another's start and a hyphen ('blue', 'blue-eyed'): those blocks
  interleave, so each such group is written out, sorted, on its own."""

  def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]):
    self.nouns = sorted(set(nouns))
    first, last = self.nouns[0], self.nouns[-1]
    groups: list[list[str]] = []  # adjectives whose blocks overlap, in order
    for adjective in sorted(set(adjectives), key=lambda a: f"{a}-{first}"):
      if groups and f"{adjective}-{first}" < max(f"{a}-{last}" for a in groups[-1]):
        groups[-1].append(adjective)
      else:
        groups.append([adjective])
    # Each part: an adjective (its block) or the written-out strings of an overlapping group.
    self.parts: list[str | list[str]] = [
        g[0] if len(g) == 1 else sorted({f"{a}-{n}" for a in g for n in self.nouns})
        for g in groups]
    self.ends = np.cumsum([len(self.nouns) if isinstance(p, str) else len(p)
                           for p in self.parts])

  def __len__(self) -> int:
    return int(self.ends[-1])

  def __getitem__(self, i):  # (random.choice indexes with an int in range)
    k = int(np.searchsorted(self.ends, i, side="right"))
    part, at = self.parts[k], i - (int(self.ends[k - 1]) if k else 0)
    return f"{part}-{self.nouns[at]}" if isinstance(part, str) else part[at]


@cache
def _categories() -> dict[str, list[str]]:
  """wonderwords' word lists. lm-eval reads them from `RandomWord()._categories` (a private
  attribute); so does this, the one place, since the instances must be drawn from the same
  lists in the same order."""
  return wonderwords.RandomWord()._categories  # pylint: disable=protected-access


@cache
def _needle_words() -> _AdjectiveNouns:
  c = _categories()
  return _AdjectiveNouns(c["adjectives"], c["nouns"])


def _draw(rng: random.Random, kind: str) -> str:
  if kind == "numbers":
    return str(rng.randint(10 ** 6, 10 ** 7 - 1))
  if kind == "words":
    return rng.choice(_needle_words())
  return str(uuid.UUID(int=rng.getrandbits(128), version=4))  # uuids


def _sentences(text: str) -> list[str]:
  return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def _niah_once(rng: random.Random, spec: Niah, num_haystack: int, text_words: Sequence[str]
               ) -> tuple[str, list[str], str]:
  keys, values, needles = [], [], []
  num_k = max(spec.num_k, spec.num_q)
  for _ in range(num_k):
    keys.append(_draw(rng, spec.type_k))
    values.append([])
    for _ in range(spec.num_v):
      values[-1].append(_draw(rng, spec.type_v))
      needles.append(NEEDLE.format(type_needle_v=spec.type_v, key=keys[-1], value=values[-1][-1]))
  random.Random(42).shuffle(needles)  # lm-eval's fixed needle order
  if spec.haystack is Haystack.PROSE:
    sentences = _sentences(" ".join(text_words[:num_haystack]).strip())
    cuts = [0] + sorted(int(len(sentences) * (d / 100)) for d in rng.sample(DEPTHS, len(needles)))
    cuts.append(len(sentences))
    pieces = []
    for i in range(1, len(cuts)):
      pieces.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
      if i - 1 < len(needles):
        pieces.append(needles[i - 1])
    context = " ".join(pieces)
  else:
    if spec.haystack is Haystack.NOISE:
      lines = [NOISE] * num_haystack
    else:
      lines = [NEEDLE.format(type_needle_v=spec.type_v, key=_draw(rng, spec.type_k),
                             value=_draw(rng, spec.type_v)) for _ in range(num_haystack)]
    for at, needle in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True),
                          needles):
      lines.insert(at, needle)
    context = "\n".join(lines)
  picked = rng.sample(range(num_k), spec.num_q)
  queries = [keys[i] for i in picked]
  answers = [v for i in picked for v in values[i]]
  query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
  template, type_v = NIAH_TEMPLATE, spec.type_v
  if spec.num_q * spec.num_v == 1:  # one answer: the template in the singular
    for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"),
                             ("answers", "answer")):
      template = template.replace(plural, singular)
    type_v = type_v[:-1]
  return template.format(type_needle_v=type_v, context=context, query=query), answers, query


def _niah(task: str, spec: Niah, length: int, samples: int, seed: int, count: Count,
          text_words: Sequence[str]) -> list[Instance]:
  rng, budget = random.Random(seed), NEW_TOKENS[task]
  needles = max(spec.num_k, spec.num_q) * spec.num_v
  if spec.haystack is Haystack.PROSE:
    if not text_words:
      raise RulerError(f"RULER task {task}: its haystack is prose, and no text was given")
    # lm-eval's step of 500 words at every length would leave a length under 4096 a haystack
    # of one word (500 words overrun its room); 25 below, as its own other haystacks do.
    step = 500 if length >= 4096 else 25
  else:
    step = 25 if length >= 4096 else 5
  size, total = max(step, needles), 0
  while total + budget < length:  # the largest haystack (in steps) that fits
    text, answers, _ = _niah_once(rng, spec, size, text_words)
    total = count(text + " ".join(answers))
    if total + budget > length:
      size -= step
      break
    if spec.haystack is Haystack.PROSE and size > len(text_words):
      size = len(text_words)
      break
    if size > length:
      raise RulerError(f"RULER task {task} at {length}: the haystack grew past {length} units "
                       f"without filling the length (the tokenizer counts {total} tokens)")
    size += step
  size = max(size, needles)
  out = []
  for index in range(samples):
    used = size
    while used > 0:  # shrunk until the instance fits (a needle's draws can lengthen it)
      text, answers, query = _niah_once(rng, spec, used, text_words)
      if count(text) + budget <= length:
        break
      used -= step
    else:
      raise RulerError(f"RULER task {task} at {length}: no haystack leaves room for the "
                       f"prompt, {needles} needle(s) and {budget} answer tokens")
    several = spec.num_q * spec.num_v > 1
    prefix = (f"The special magic {spec.type_v if several else spec.type_v[:-1]} for {query} "
              f"mentioned in the provided text {'are' if several else 'is'}")
    out.append(Instance(task, length, index, text, prefix, tuple(answers), " ", budget))
  return out


# --- variable tracking ---------------------------------------------------------------------


def _vt_once(rng: random.Random, np_rng: np.random.RandomState, noises: int, icl: bool
             ) -> tuple[str, list[str]]:
  hops, chains, k = 4, 1, 3 if icl else 5
  names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range((hops + 1) * chains)]
  while len(set(names)) < chains * (hops + 1):
    names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
  groups, lines_of = [], []
  for i in range(0, len(names), hops + 1):
    group = names[i:i + hops + 1]
    groups.append(group)
    lines_of.append([f"VAR {group[0]} = {np_rng.randint(10000, 99999)}"]
                    + [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(hops)])
  sentences = [NOISE + "\n"] * noises
  if len(sentences) <= len(lines_of[0]):
    sentences = [n + "." if n.strip() else n for s in sentences for n in s.split(".")]
    if len(sentences) <= len(lines_of[0]):
      lines_of = [chain[:len(sentences) - 1] for chain in lines_of]
  for chain in lines_of:
    for j, at in enumerate(sorted(rng.sample(range(len(sentences)), len(chain)))):
      sentences.insert(at + j, chain[j])
  context = " ".join(sentences).replace(". \n", ".\n")
  value = lines_of[0][0].split("=")[-1].strip()
  text = (VT_TEMPLATE + VT_PREFIX).format(context=context, query=value, num_v=hops + 1)
  return text, groups[0]


def _vt_fit(rng, np_rng, count: Count, length: int, step: int, budget: int, extra: int,
            icl: bool) -> int:
  noises, total = step, 0
  while total + budget + extra < length:
    text, answer = _vt_once(rng, np_rng, noises, icl)
    total = count(text + f" {answer}")  # (lm-eval measures the list's repr)
    if total + budget + extra > length:
      return noises - step
    noises += step
  return noises


def _vt_sample(rng, np_rng, count: Count, length: int, noises: int, step: int, budget: int,
               extra: int, icl: bool, what: str) -> tuple[str, list[str]]:
  while True:
    try:
      text, answer = _vt_once(rng, np_rng, noises, icl)
      if count(text) + budget + extra <= length:
        return text, answer
    except ValueError:  # too few noise sentences to hold the chain (lm-eval: tried again)
      pass
    if noises <= step:  # lm-eval would try this size forever
      raise RulerError(f"RULER task {what} at {length} tokens: no instance fits (its worked "
                       f"example takes {extra} tokens and its answer {budget}); give it a "
                       "longer length or leave it out of eval.ruler.tasks")
    noises -= step


def _vt(task: str, length: int, samples: int, seed: int, count: Count) -> list[Instance]:
  rng, np_rng, budget = random.Random(seed), np.random.RandomState(seed), NEW_TOKENS[task]
  # lm-eval's one worked example (at 500 tokens, 3-letter names), shown before each instance
  # with its names drawn anew.
  noises = _vt_fit(rng, np_rng, count, 500, 5, budget, 0, True)
  text, answer = _vt_sample(rng, np_rng, count, 500, noises, 5, budget, 0, True, task)
  example = text + " " + " ".join(answer) + "\n\n"
  extra = count(example)
  noises = _vt_fit(rng, np_rng, count, length, 10, budget, extra, False)
  out = []
  for index in range(samples):
    text, answer = _vt_sample(rng, np_rng, count, length, noises, 10, budget, extra, False, task)
    shown = example
    cut = example.index(VT_PREFIX[-10:])
    for name in example[cut + 10:].strip().split():
      shown = shown.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    at = text.index(VT_TEMPLATE[:20])
    text = text[:at] + shown + "\n\n" + text[at:]
    prefix_at = text.rfind(" Answer: According to the chain(s) of variable assignment")
    out.append(Instance(task, length, index, text[:prefix_at], text[prefix_at:].strip(),
                        tuple(answer), " ", budget))
  return out


# --- common words --------------------------------------------------------------------------


def _numbered(words: Sequence[str]) -> str:
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_once(rng, order_rng, words: list[str], num: int, length: int
              ) -> tuple[str, str, list[str]]:
  """(worked example, text, the 10 common words). lm-eval measures the example while it sizes
  the list, and does not show it."""
  def listing(num_words: int, common_repeats: int, uncommon_repeats: int) -> list[str]:
    chosen = rng.sample(words, num_words)
    common, uncommon = chosen[:10], chosen[10:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    order_rng.shuffle(listed)
    return (CWE_TEMPLATE + CWE_PREFIX).format(context=_numbered(listed)), common

  example, example_common = listing(20, 3, 1) if length < 4096 else listing(40, 10, 3)
  text, common = listing(num, 6, 1) if length < 4096 else listing(num, 30, 3)
  return example + _numbered(example_common), text, common


def _cwe(task: str, length: int, samples: int, seed: int, count: Count) -> list[Instance]:
  c = _categories()
  words = sorted({w for kind in ("noun", "adjective", "verb") for w in c[kind]})
  order_rng = random.Random(42)  # lm-eval's module-level generator, fresh at import
  order_rng.shuffle(words)
  rng, budget, step = random.Random(seed), NEW_TOKENS[task], 10
  num, total = step, 0
  while total + budget < length:
    example, text, common = _cwe_once(rng, order_rng, words, num, length)
    total = count(example + "\n" + text + " " + _numbered(common))
    if total + budget > length:
      num -= step
      break
    num += step
    if num > len(words):
      num = len(words)
      break
  if num < 10:  # lm-eval would ask for the 10 most common of fewer words (none at all)
    raise RulerError(f"RULER task {task} at {length} tokens: no room for a list of 10 common "
                     "words beside its worked example; give it a longer length or leave it out "
                     "of eval.ruler.tasks")
  out = []
  for index in range(samples):
    used = num
    while True:
      _, text, common = _cwe_once(rng, order_rng, words, used, length)
      if count(text) + budget <= length:
        break
      if used <= step:  # lm-eval would try this size forever
        raise RulerError(f"RULER task {task} at {length}: no instance fits the length")
      used -= step
    out.append(Instance(task, length, index, text[:text.rfind(CWE_PREFIX)].strip(),
                        CWE_PREFIX.strip(), tuple(common), "\n\n", budget))
  return out


# --- frequent words ------------------------------------------------------------------------


def _fwe_once(rng: random.Random, count: Count, max_len: int, num_words: int, vocab_size: int,
              step: int) -> tuple[str, list[str], int]:
  vocab = ["".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(vocab_size)]
  while len(set(vocab)) < vocab_size:
    vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
  vocab = sorted(set(vocab))
  random.Random(42).shuffle(vocab)
  vocab[0] = "..."  # the most frequent: noise

  def text_of(n: int) -> tuple[str, list[str]]:
    counts = (n * (np.arange(1, len(vocab) + 1) ** -2.0) / ZETA_2).astype(int)
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    random.Random(42).shuffle(words)
    return (FWE_TEMPLATE + FWE_PREFIX).format(context=" ".join(words)), vocab[1:4]

  if num_words > 0:
    text, answer = text_of(num_words)
    while count(text) > max_len:
      num_words -= step
      text, answer = text_of(num_words)
  else:
    num_words = max_len // 6
    text, answer = text_of(num_words)
    while count(text) < max_len:
      num_words += step
      text, answer = text_of(num_words)
    num_words -= step
  text, answer = text_of(num_words)
  return text, answer, num_words


def _fwe(task: str, length: int, samples: int, seed: int, count: Count) -> list[Instance]:
  rng, budget = random.Random(seed), NEW_TOKENS[task]
  vocab_size, step = length // 50, length // 32
  _, _, num_words = _fwe_once(rng, count, length, -1, vocab_size, step)
  out = []
  for index in range(samples):
    text, answer, _ = _fwe_once(rng, count, length, num_words, vocab_size, step)
    out.append(Instance(task, length, index, text[:text.rfind(FWE_PREFIX)].strip(),
                        FWE_PREFIX.strip(), tuple(answer), " ", budget))
  return out
