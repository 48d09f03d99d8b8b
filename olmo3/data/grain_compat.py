"""Grain's multiprocess prefetch reads its own absl flags (--grain_*) when it starts workers, and
raises UnparsedFlagAccessError in any program whose main is not absl's (argparse CLIs, pytest,
notebooks). When nobody parsed absl flags, mark them parsed so Grain sees its defaults. An absl
main has parsed them already and is left alone."""

from absl import flags


def ensure_flags_parsed() -> None:
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
