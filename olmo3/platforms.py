"""Which JAX platforms a program on this machine uses: every command-line program calls
`choose()` first, through `olmo3.program`'s opening (the launcher through
`olmo3.train.logs.configure`; benchmarks directly).

On a machine without a TPU or GPU, JAX is told to use the CPU (`JAX_PLATFORMS=cpu`, unless the
environment already says which platforms to use): otherwise JAX probes its plugins, and libtpu
(the `tpu` extra) then prints TPU runtime errors and waits for a metadata server that is not
there. Compiling for a TPU topology (`--compile_only=tpu7x:...`) loads libtpu directly and still
works; there libtpu is told it is one local worker (TPU_WORKER_HOSTNAMES, unless set), which it
otherwise asks the metadata server for, logging "unexpected worker hostname" when none answers.
On a machine with an accelerator nothing changes.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips attach through PCI with Google's vendor id (as JAX)
_GPU_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd")  # NVIDIA, AMD


def has_accelerator() -> bool:
  """A TPU chip on the PCI bus or a GPU device node: JAX may then probe its plugins."""
  if any(os.path.exists(d) for d in _GPU_DEVICES):
    return True
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    with contextlib.suppress(OSError), open(vendor) as f:
      if f.read().strip() == _GOOGLE_PCI_VENDOR:
        return True
  return False


def choose() -> None:
  """The CPU for JAX when this machine has no accelerator (see the module docstring). Works
  whether or not JAX was imported already, as long as no backend has started."""
  if has_accelerator():
    return
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  if "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: its config has read the environment
      sys.modules["jax"].config.update("jax_platforms", "cpu")


def compile_target() -> str:
  """The platform the program being traced is for ('cpu', 'tpu', 'gpu'): the abstract mesh's
  device when there is one (a TPU topology compiled from a CPU host is 'tpu'), else JAX's
  default backend. Kernels and layouts chosen per platform ask this."""
  import jax  # pylint: disable=import-outside-toplevel  # programs call `choose` before JAX

  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None) if not mesh.empty else None
  return device.platform if device is not None else jax.default_backend()
