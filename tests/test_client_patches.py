"""olmo3.io.clients patches private attributes of gcsfs, s3fs and botocore so that every request
they send is retried within the retry budget. Each test here checks one of those attributes in
the installed library: still there, with the parameters the patch relies on. A library upgrade
that renames or reshapes one fails its test by name (and `configure_clients` raises
LibraryChanged naming the library's version) instead of the patch silently not applying.

The checks hold whether or not this process has patched already (other tests configure the
clients): a patched function keeps the library's own as its `__wrapped__`."""

import inspect
import types
from importlib import metadata

import pytest

from olmo3.io import clients, retry


def _parameters(function) -> list[str]:
  """`function`'s parameter names, `*args` as "*" and `**kwargs` as "**"."""
  marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
  return [marks.get(p.kind, p.name) for p in inspect.signature(function).parameters.values()]


def test_gcsfs_request_keeps_its_undecorated_coroutine_taking_method_path_and_args():
  """`_patch_gcsfs` budgets `GCSFileSystem._request.__wrapped__` (the request without gcsfs's
  retry decorator) and names each request from its method, path template and arguments
  (`_gcs_operation(fs, method, path, *args, **kwargs)`)."""
  import gcsfs

  # pylint: disable-next=protected-access
  inner = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", None)
  assert inner is not None, f"gcsfs {gcsfs.__version__}: GCSFileSystem._request lost __wrapped__"
  assert inspect.iscoroutinefunction(inner)
  parameters = _parameters(inner)
  assert parameters[:4] == ["self", "method", "path", "*"] and parameters[-1] == "**", parameters


def test_gcsfs_formats_a_request_path_from_its_template_and_arguments():
  """`_gcs_operation` names requests it does not recognise with `fs._format_path(path, args)`."""
  import gcsfs

  format_path = gcsfs.GCSFileSystem._format_path  # pylint: disable=protected-access
  assert _parameters(format_path) == ["self", "path", "args"]


def test_s3fs_call_s3_is_a_coroutine_taking_the_method_and_keywords():
  """`_patch_s3fs` budgets `S3FileSystem._call_s3` and names each call from its method (a name
  or a bound botocore method) and its Bucket / Key / Prefix keywords."""
  import s3fs

  call = inspect.unwrap(s3fs.S3FileSystem._call_s3)  # pylint: disable=protected-access
  assert inspect.iscoroutinefunction(call)
  parameters = _parameters(call)
  assert parameters[:2] == ["self", "method"] and parameters[-1] == "**", parameters


def test_s3fs_has_a_synchronous_call_s3_and_a_retry_count_to_replace():
  """`_patch_s3fs` remakes `call_s3` (s3fs's synchronous twin, which its files upload with)
  from the budgeted `_call_s3` with fsspec's `sync_wrapper`, and sets the class's own retry
  count, `retries`, to one attempt."""
  import s3fs
  from fsspec import asyn

  assert callable(s3fs.S3FileSystem.call_s3)
  assert _parameters(inspect.unwrap(s3fs.S3FileSystem.call_s3))[:2] == ["self", "method"]
  assert _parameters(asyn.sync_wrapper)[0] == "func"
  assert isinstance(s3fs.S3FileSystem.retries, int)


def test_botocore_adds_the_expect_header_by_a_builtin_handler():
  """`_patch_s3fs` drops `handlers.add_expect_header` from `handlers.BUILTIN_HANDLERS` (an
  (event, handler) list), which botocore registers on every session it makes."""
  from botocore import handlers

  assert _parameters(handlers.add_expect_header) == ["model", "params", "**"]
  assert all(isinstance(h, tuple) and callable(h[1]) for h in handlers.BUILTIN_HANDLERS)


def _olmo3s(function) -> bool:
  """Whether `function` is olmo3's budgeted retry loop (functools.wraps gave it the library
  function's names, not its code)."""
  return function.__code__.co_filename == inspect.getsourcefile(retry)


def test_the_patches_apply():
  """Configured, the clients' requests are budgeted: each patched attribute is olmo3's, around
  the library's own."""
  import gcsfs
  import s3fs
  from botocore import handlers

  clients.configure_clients()
  request = gcsfs.GCSFileSystem._request  # pylint: disable=protected-access
  assert _olmo3s(request) and request.__wrapped__.__module__ == "gcsfs.core"
  call = s3fs.S3FileSystem._call_s3  # pylint: disable=protected-access
  assert _olmo3s(call) and call.__wrapped__.__module__ == "s3fs.core"
  assert s3fs.S3FileSystem.retries == 1
  assert all(h[1] is not handlers.add_expect_header for h in handlers.BUILTIN_HANDLERS)


def _says(library: str, what: str) -> str:
  """How LibraryChanged's message starts for `library` lacking `what`."""
  return f"{library} {metadata.version(library)}: {what}"


class _S3FileSystem:
  """What `_patch_s3fs` reads of s3fs, for a botocore without the handler."""
  retries = 5

  async def _call_s3(self, method, *args, **kwargs):
    del self, method, args, kwargs

  call_s3 = _call_s3


def test_a_gcsfs_without_the_undecorated_request_fails_the_patch_naming_its_version():
  async def request(self, method, path, *args, **kwargs):
    del self, method, path, args, kwargs

  gcsfs = types.SimpleNamespace(GCSFileSystem=type("GCSFileSystem", (), {"_request": request}))
  with pytest.raises(clients.LibraryChanged) as raised:
    clients._patch_gcsfs(gcsfs)  # pylint: disable=protected-access
  assert str(raised.value).startswith(
      _says("gcsfs", "GCSFileSystem._request has no __wrapped__")), raised.value
  assert gcsfs.GCSFileSystem._request is request  # pylint: disable=protected-access


def test_an_s3fs_without_call_s3_fails_the_patch_naming_its_version():
  s3fs = types.SimpleNamespace(S3FileSystem=type("S3FileSystem", (), {"retries": 5}))
  with pytest.raises(clients.LibraryChanged) as raised:
    clients._patch_s3fs(s3fs, None, None)  # pylint: disable=protected-access
  assert str(raised.value).startswith(_says("s3fs", "S3FileSystem has no _call_s3")), raised.value
  assert s3fs.S3FileSystem.retries == 5


def test_a_botocore_without_the_expect_header_handler_fails_the_patch_naming_its_version():
  handlers = types.SimpleNamespace(BUILTIN_HANDLERS=[], add_expect_header=lambda **_: None)
  s3fs = types.SimpleNamespace(S3FileSystem=_S3FileSystem)
  with pytest.raises(clients.LibraryChanged) as raised:
    clients._patch_s3fs(s3fs, handlers, None)  # pylint: disable=protected-access
  says = _says("botocore", "handlers.add_expect_header is not among handlers.BUILTIN_HANDLERS")
  assert str(raised.value).startswith(says), raised.value
  assert _S3FileSystem.retries == 5  # nothing patched
