"""olmo3.program: a program's settings name their variable, a setting's mistake is one line
whatever the program lists as its own errors, and every argparse program opens the same way."""

import logging as py_logging
import sys
import threading

import pytest

from olmo3 import program
from olmo3.io import errors, settings


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "nan"])
def test_a_setting_that_is_no_positive_number_is_a_value_error_naming_its_variable(
    monkeypatch, value):
  monkeypatch.setenv("OLMO3_SOME_TIMEOUT_S", value)
  with pytest.raises(program.SettingError) as raised:
    program.seconds_setting("OLMO3_SOME_TIMEOUT_S", 5.0)
  assert isinstance(raised.value, ValueError) and not isinstance(raised.value, OSError)
  assert str(raised.value) == (f"OLMO3_SOME_TIMEOUT_S={value!r}: expected a positive number "
                               "of seconds")
  monkeypatch.setenv("OLMO3_SOME_COUNT", value)
  with pytest.raises(program.SettingError, match=rf"^OLMO3_SOME_COUNT={value!r}: expected a "
                     "positive integer$"):
    program.count_setting("OLMO3_SOME_COUNT", 3)


def test_a_setting_unset_or_empty_is_its_default_and_a_good_one_is_read(monkeypatch):
  monkeypatch.delenv("OLMO3_SOME_TIMEOUT_S", raising=False)
  assert program.seconds_setting("OLMO3_SOME_TIMEOUT_S", 5.0) == 5.0
  monkeypatch.setenv("OLMO3_SOME_TIMEOUT_S", "")
  assert program.seconds_setting("OLMO3_SOME_TIMEOUT_S", 5.0) == 5.0
  monkeypatch.setenv("OLMO3_SOME_TIMEOUT_S", "2.5")
  assert program.seconds_setting("OLMO3_SOME_TIMEOUT_S", 5.0) == 2.5
  monkeypatch.setenv("OLMO3_SOME_COUNT", "12")
  assert program.count_setting("OLMO3_SOME_COUNT", 3) == 12


def test_the_storage_reads_its_durations_as_storage_errors(monkeypatch):
  """Read inside the storage's retries, whose callers handle a store's failures (OSError)."""
  monkeypatch.setenv(settings.RETRY_ENV, "soon")
  with pytest.raises(errors.StorageError, match=rf"^{settings.RETRY_ENV}='soon': expected"):
    settings.retry_budget_s()
  monkeypatch.setenv(settings.CONCURRENCY_ENV, "many")
  with pytest.raises(program.SettingError, match=rf"^{settings.CONCURRENCY_ENV}='many'"):
    settings.concurrency()


def test_a_setting_mistake_ends_any_program_in_one_line(monkeypatch, request):
  """`reported` ends a SettingError in one `error:` line though the program lists no error
  type of its own (the heartbeat's and the lease's settings reach the launcher's this way)."""
  # The wrapper ends a program: its failure quiets what the process's threads say afterwards
  # (program.quiet_leftovers). Called here in pytest's process, that is put back.
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(sys, "excepthook", sys.excepthook)
  request.addfinalizer(lambda: py_logging.disable(py_logging.NOTSET))
  monkeypatch.setenv("OLMO3_SOME_TIMEOUT_S", "soon")
  monkeypatch.delenv(program.TRACEBACK_ENV, raising=False)

  def main() -> int:
    program.seconds_setting("OLMO3_SOME_TIMEOUT_S", 5.0)
    return 0

  with pytest.raises(SystemExit) as exited:
    program.reported(main, lambda: ())()
  assert str(exited.value) == ("error: OLMO3_SOME_TIMEOUT_S='soon': expected a positive number "
                               "of seconds")


def test_ctrl_c_ends_any_program_in_one_line_with_its_status(monkeypatch, request, capsys):
  """Ctrl-C (KeyboardInterrupt) in a program's main: "interrupted (Ctrl-C)" and status 130, not
  a traceback (prepare's and sample's said KeyboardInterrupt with their stack)."""
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(sys, "excepthook", sys.excepthook)
  request.addfinalizer(lambda: py_logging.disable(py_logging.NOTSET))
  monkeypatch.delenv(program.TRACEBACK_ENV, raising=False)

  def main() -> int:
    raise KeyboardInterrupt

  with pytest.raises(SystemExit) as exited:
    program.reported(main, lambda: ())()
  assert exited.value.code == 130 and capsys.readouterr().err == "interrupted (Ctrl-C)\n"
  monkeypatch.setenv(program.TRACEBACK_ENV, "1")  # the traceback, when asked for
  with pytest.raises(KeyboardInterrupt):
    program.reported(main, lambda: ())()


def test_an_argparse_program_opens_with_the_platform_chosen_and_its_docstring_as_help(
    monkeypatch):
  chosen = []
  monkeypatch.setattr(program.platforms, "choose", lambda: chosen.append(True))
  parser = program.parser("python -m olmo3.something", "Does something.\n\n  laid out")
  assert chosen == [True]
  assert parser.prog == "python -m olmo3.something"
  assert "Does something.\n\n  laid out" in parser.format_help()
