"""The import graph of olmo3/ runs one way: no cycles, no import of a higher layer, and no
Fiddle, absl flags, launch/ or experiments/ inside the library. Function-level imports count.
And the house's size ratchet over the product (olmo3/, launch/, experiments/): no module over 500
lines, no function over 80, and a ceiling on imports inside functions that only falls."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Lowest first. A module imports from its own entry or from lower layers; entries of one layer
# do not import each other.
LAYERS = (
    ("olmo3.platforms",),
    # a program's opening, error policy and settings (io reads through it); XLA:CPU's
    # workarounds (the loss, attention and model use them)
    ("olmo3.program", "olmo3.xla_cpu"),
    ("olmo3.io", "olmo3.compilation_cache"),
    ("olmo3.remat", "olmo3.loss", "olmo3.xla_flags", "olmo3.config_checks"),
    ("olmo3.config",),
    ("olmo3.sharding", "olmo3.flops"),
    ("olmo3.attention", "olmo3.halo"),
    ("olmo3.model", "olmo3.data"),
    ("olmo3.placement", "olmo3.convert", "olmo3.run"),
    ("olmo3.decode",),
    ("olmo3.eval",),
    ("olmo3.train", "olmo3.sample"),
    ("olmo3.inspect_step",),
)
FORBIDDEN = ("fiddle", "launch", "experiments", "absl.flags", "harness")
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
                               "olmo3.model (layer 7) imports olmo3.train.loop (layer 11)"]
  assert cycles(edges) == [["olmo3.data.a", "olmo3.data.b", "olmo3.data.a"],
                           ["olmo3.model", "olmo3.train.loop", "olmo3.model"]]


def test_tests_and_benchmarks_share_the_harness_one_way():
  """harness/ holds what tests/ and benchmarks/ both run: both import it, it imports neither,
  and neither imports the other."""
  banned = {"harness": ("tests", "benchmarks"), "benchmarks": ("tests",), "tests": ("benchmarks",)}
  found = [f"{path.relative_to(ROOT)} imports {name}"
           for folder, names in banned.items() for path in sorted((ROOT / folder).rglob("*.py"))
           for name in sorted(imports(path, set())) if name.split(".")[0] in names]
  assert found == []


def test_every_program_picks_the_platform_first():
  """Every command-line program (a module run as __main__) opens with olmo3.program's opening
  (`program.parser(...)`, or `program.begin()` for absl's; the launcher through logs.configure)
  in the function its __main__ block runs, before anything that touches JAX: on a machine
  without an accelerator none of them probes for a TPU. Benchmarks, scripts beside the
  library, call olmo3.platforms.choose() itself, or open with program.parser (which calls it). The launcher and `python -m olmo3.eval` are
  run that way in tests/test_launch_lifecycle.py."""
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
    for node in tree.body:  # a benchmark's main in harness/, beside the code tests run too
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness."):
        there = ast.parse((ROOT / f"{node.module.replace('.', '/')}.py").read_text()).body
        functions.update((n.name, n) for n in there if isinstance(n, ast.FunctionDef))
    # The last __main__ block runs the program (an earlier one may set the process up).
    named = {n.id for n in ast.walk(mains[-1]) if isinstance(n, ast.Name)}  # main, app.run(main)
    entry_points = [functions[name] for name in sorted(named) if name in functions]
    openings = (("platforms.choose()", "program.parser(") if path.parent.name == "benchmarks"
                else ("program.parser(", "program.begin()", "logs.configure("))
    if not any(_opens_first(f, openings, functions) for f in entry_points):
      missing.append(f"{path.relative_to(ROOT)}: {[f.name for f in entry_points]}")
  assert missing == []


def _opens_first(function: ast.FunctionDef, openings: tuple[str, ...],
                 functions: dict[str, ast.FunctionDef]) -> bool:
  """`function` calls one of `openings` in its body, itself or in the first lines of a function
  of its module it calls first (`args = parse(argv)`), before anything that names JAX
  (argument checks may come first)."""
  for statement in function.body:
    source = ast.unparse(statement)
    if any(opening in source for opening in openings):
      return True
    called = [functions[n.func.id] for n in ast.walk(statement) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id in functions]
    if any(f is not function and _opens_first(f, openings, {}) for f in called):
      return True
    if "jax" in source:
      return False
  return False


# The training path: what a launch, `sample`, `inspect_step` and `eval` import.
TRAINING_PATH = ("olmo3.train.loop", "olmo3.sample.__main__", "olmo3.inspect_step",
                 "olmo3.eval.__main__", "olmo3.run.plan", "olmo3.data.sources")
# The one way from it to the preparation tools: the built-in corpora are prepared on first use,
# once per machine (olmo3/data/embedded.py imports prepare and prepare_chat there, in the
# functions).
BUILDS_THE_CORPUS = {("olmo3.data.embedded", "olmo3.data.prepare"),
                     ("olmo3.data.embedded", "olmo3.data.prepare_chat")}


def test_the_training_path_never_loads_the_preparation_tool():
  """The data formats live apart from the command that writes them (olmo3.data.manifest,
  olmo3.data.tokenizer): nothing a run imports, at any depth and function-level imports
  included, reaches `prepare` or the overlap check it runs, but for building the built-in
  corpus. launch/main.py's own modules count from their olmo3 imports."""
  edges = graph()
  launch_modules = {"launch." + p.stem: p for p in (ROOT / "launch").glob("*.py")}
  starts, todo, seen = set(TRAINING_PATH), ["launch.main"], set()
  while todo:  # launch/main.py and the launch modules it imports, transitively
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for target in imports(launch_modules[name], set(edges) | set(launch_modules)):
      if target in launch_modules:
        todo.append(target)
      elif target.startswith("olmo3."):
        starts.add(target)
  reached, todo = set(), sorted(starts)
  while todo:
    module = todo.pop()
    if module in reached:
      continue
    reached.add(module)
    todo.extend(t for t in edges.get(module, ()) if (module, t) not in BUILDS_THE_CORPUS)
  assert "olmo3.data.sources" in reached and "olmo3.train.loop" in reached
  assert sorted(reached & {"olmo3.data.prepare", "olmo3.data.prepare_chat",
                           "olmo3.data.overlap"}) == []


# The size ratchet: the product stays readable as it grows. A module over MAX_MODULE_LINES or a
# function over MAX_FUNCTION_LINES is split where its jobs part; imports inside functions (lazy
# imports of heavy libraries, or of a higher layer's job) are counted, and the count may only
# fall: FUNCTION_LEVEL_IMPORTS is the count today, lowered whenever the code lowers it (the
# test fails both ways, so the number always states what is there).
PRODUCT = ("olmo3", "launch", "experiments")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
FUNCTION_LEVEL_IMPORTS = 111


def _product_files() -> list[pathlib.Path]:
  return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py"))


def _functions(tree: ast.AST):
  return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def function_level_imports(tree: ast.AST) -> int:
  """Import statements whose nearest enclosing scope is a function (each counted once)."""
  count = 0

  def visit(node: ast.AST, in_function: bool) -> None:
    nonlocal count
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
        count += 1
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                         ast.Lambda)))

  visit(tree, False)
  return count


def test_no_module_over_the_line_limit():
  long = {str(p.relative_to(ROOT)): n for p in _product_files()
          if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
  assert long == {}, f"split these modules where their jobs part (> {MAX_MODULE_LINES} lines)"


def test_no_function_over_the_line_limit():
  long = [f"{p.relative_to(ROOT)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
          for p in _product_files() for f in _functions(ast.parse(p.read_text()))
          if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
  assert long == [], f"split these functions (> {MAX_FUNCTION_LINES} lines)"


def test_function_level_imports_only_fall():
  count = sum(function_level_imports(ast.parse(p.read_text())) for p in _product_files())
  assert count <= FUNCTION_LEVEL_IMPORTS, (
      f"{count} imports inside functions, over the ceiling of {FUNCTION_LEVEL_IMPORTS}: import "
      "at the top of the module, unless the import is heavy or a layer's job (then say why)")
  assert count == FUNCTION_LEVEL_IMPORTS, (
      f"{count} imports inside functions, under the ceiling of {FUNCTION_LEVEL_IMPORTS}: lower "
      f"FUNCTION_LEVEL_IMPORTS to {count}, so that the ceiling only falls")


def test_the_ratchet_counts_what_it_names():
  tree = ast.parse("import os\n"
                   "def f():\n  import json\n  def g():\n    from a import b\n  return g\n"
                   "class C:\n  def m(self):\n    import re\n")
  assert function_level_imports(tree) == 3
  assert sorted(f.name for f in _functions(tree)) == ["f", "g", "m"]
