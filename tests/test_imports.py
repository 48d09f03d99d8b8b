"""The import graph of olmo3/ runs one way: no cycles, no import of a higher layer, and no
Fiddle, absl flags, launch/ or experiments/ inside the library. Function-level imports count."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Lowest first. A module imports from its own entry or from lower layers; entries of one layer
# do not import each other.
LAYERS = (
    ("olmo3.io", "olmo3.platforms", "olmo3.compilation_cache"),
    ("olmo3.remat", "olmo3.loss", "olmo3.xla_flags", "olmo3.config_checks"),
    ("olmo3.config",),
    ("olmo3.sharding", "olmo3.flops"),
    ("olmo3.attention",),
    ("olmo3.model", "olmo3.data"),
    ("olmo3.placement", "olmo3.convert", "olmo3.run"),
    ("olmo3.eval",),
    ("olmo3.train", "olmo3.sample"),
    ("olmo3.inspect_step",),
)
FORBIDDEN = ("fiddle", "launch", "experiments", "absl.flags")
# The one exception: Grain's worker processes read absl flags, and programs whose main is not
# absl's must mark them parsed first (olmo3/data/grain_compat.py says why).
ALLOWED_EXCEPTIONS = {("olmo3.data.grain_compat", "absl.flags")}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
  """Every module `path` imports (at any depth of its code), olmo3 names resolved to modules."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        out.add(full if full in modules else node.module)
  return out


def graph() -> dict[str, set[str]]:
  paths = sorted((ROOT / "olmo3").rglob("*.py"))
  modules = {module_name(p) for p in paths}
  return {module_name(p): imports(p, modules) for p in paths}


def entry(module: str) -> tuple[int, str] | None:
  """(layer, entry) of an olmo3 module; None for the package itself."""
  for rank, layer in enumerate(LAYERS):
    for name in layer:
      if module == name or module.startswith(name + "."):
        return rank, name
  return None


def violations(edges: dict[str, set[str]]) -> list[str]:
  found = []
  for module, targets in sorted(edges.items()):
    here = entry(module)
    for target in sorted(targets):
      if any(target == f or target.startswith(f + ".") for f in FORBIDDEN) and (
          (module, target) not in ALLOWED_EXCEPTIONS):
        found.append(f"{module} imports {target}")
      there = entry(target) if target.startswith("olmo3.") else None
      if here is None or there is None:
        continue
      if there[0] > here[0] or (there[0] == here[0] and there[1] != here[1]):
        found.append(f"{module} (layer {here[0]}) imports {target} (layer {there[0]})")
  return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  found, state = [], {}

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(t for t in edges.get(node, ()) if t in edges):
      if state.get(nxt) == "open":
        found.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for node in sorted(edges):
    if node not in state:
      visit(node, [node])
  return found


def test_every_module_has_a_layer():
  assert [m for m in graph() if m != "olmo3" and entry(m) is None] == []


def test_imports_run_one_way():
  assert violations(graph()) == []


def test_no_import_cycles():
  assert cycles(graph()) == []


def test_the_checks_catch_what_they_name():
  """An upward import, a forbidden one and a cycle, in a made-up graph."""
  edges = {"olmo3.model": {"olmo3.train.loop", "fiddle"}, "olmo3.train.loop": {"olmo3.model"},
           "olmo3.data.a": {"olmo3.data.b"}, "olmo3.data.b": {"olmo3.data.a"},
           "olmo3.data.grain_compat": {"absl.flags"}}
  assert violations(edges) == ["olmo3.model imports fiddle",
                               "olmo3.model (layer 5) imports olmo3.train.loop (layer 8)"]
  assert cycles(edges) == [["olmo3.data.a", "olmo3.data.b", "olmo3.data.a"],
                           ["olmo3.model", "olmo3.train.loop", "olmo3.model"]]


def test_every_program_picks_the_platform_first():
  """Every command-line program (a module run as __main__) calls olmo3.platforms.choose() in
  the function its __main__ block runs, before anything that touches JAX (the launcher through
  logs.configure): on a machine without an accelerator none of them probes for a TPU. The
  launcher and `python -m olmo3.eval` are run that way in tests/test_launch_lifecycle.py."""
  missing = []
  for path in sorted([*(ROOT / "olmo3").rglob("*.py"), *(ROOT / "launch").glob("*.py"),
                      *(ROOT / "benchmarks").glob("*.py")]):
    tree = ast.parse(path.read_text())
    mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    if not mains:
      continue
    if path.name in ("mfu_gpu.py",  # needs the GPU, never the CPU choice
                     "train_parity_olmo_core.py"):  # always on the CPU: sets JAX_PLATFORMS
      continue
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    # The last __main__ block runs the program (an earlier one may set the process up).
    named = {n.id for n in ast.walk(mains[-1]) if isinstance(n, ast.Name)}  # main, app.run(main)
    entry_points = [functions[name] for name in sorted(named) if name in functions]
    if not any(_chooses_first(f) for f in entry_points):
      missing.append(f"{path.relative_to(ROOT)}: {[f.name for f in entry_points]}")
  assert missing == []


def _chooses_first(function: ast.FunctionDef) -> bool:
  """`function` calls platforms.choose() (or logs.configure) in its body before anything
  that names JAX (argument checks may come first)."""
  for statement in function.body:
    source = ast.unparse(statement)
    if source.startswith(("platforms.choose()", "logs.configure(")):
      return True
    if "jax" in source:
      return False
  return False
