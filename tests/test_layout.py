"""The layout keeps its layers and its shape: no import cycles among our modules, no folder reaching
down the layers, no module over 400 lines nor function over 80 (as formatted at 120 columns), no
module taking another's private names or reaching into another module's private state, and the code
formatted and lint-free by the project's own ruff. Pure `ast` over the sources (and ruff): nothing is
imported (torch least of all), so it takes a moment."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "common",
    "shm",
    "text",
    "pulls",
    "models",
    "formats",
    "flash",
    "speculative",
    "actors",
    "scheduler",
    "engine",
    "cadence",
    "observe",
    "serve",
    "launch",
    "bench",
)
MAX_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package is its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """(module imported, names taken from it, line) for every import in the file, in functions too."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            yield base, [a.name for a in node.names], node.lineno


def _ours(mod: str) -> bool:
    return mod.split(".")[0] in PACKAGES


def _graph() -> dict[str, set[str]]:
    """Module -> our modules it imports; `from pkg import mod` is an edge to pkg.mod when that is a module."""
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for mod, names, _ in _imports(name, path):
            if not _ours(mod):
                continue
            subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES]
            edges.update(subs)
            if len(subs) < len(names) or not names:
                edges.add(mod)
        graph[name] = {e for e in edges if e in MODULES and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle a depth-first walk meets, as the path that closes it."""
    done, path, cycles = set(), [], []

    def visit(v: str) -> None:
        path.append(v)
        for w in sorted(graph[v]):
            if w in path:
                cycles.append(path[path.index(w) :] + [w])
            elif w not in done:
                visit(w)
        path.pop()
        done.add(v)

    for v in sorted(graph):
        if v not in done:
            visit(v)
    return cycles


def test_the_checks_see_what_they_check():
    graph = _graph()
    assert "launch.options" in graph["launch.cmd_run"]  # a module-level import
    assert "bench.in_cgroup" in graph["bench.cmd_bench"]  # one inside a function
    assert "bench.attention" in graph["bench.suites"]  # `from bench import attention as att`
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (imports inside functions count): " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_over_400_lines():
    over = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines, split them: " + ", ".join(
        f"{f} ({n})" for f, n in sorted(over.items())
    )


def test_no_function_over_80_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})"
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines, give them shape: " + "; ".join(long)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_names_imported_from_another_module():
    found = []
    for name, path in MODULES.items():
        for mod, names, line in _imports(name, path):
            if not _ours(mod) or mod == name:
                continue
            bad = [n for n in [*mod.split("."), *names] if _private(n)]
            if bad:
                found.append(f"{path.relative_to(ROOT)}:{line} takes {', '.join(bad)} from {mod}")
    assert not found, "private names imported from another module (make them public where they belong): " + "; ".join(
        found
    )


def _private_state(path: Path) -> list[str]:
    """`x._name` where x is not self or cls and `_name` is no private name of this module: another
    module's private state (a stdlib module's, `os._exit`, aside)."""
    tree = ast.parse(path.read_text())
    own = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
    }
    own |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    modules = {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if not _ours(a.name)
    }
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and _private(n.attr)) or n.attr in own:
            continue
        v = n.value
        if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in modules):
            continue
        out.append(f"{path.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    return out


def test_no_module_reaches_into_another_modules_private_state():
    found = [hit for path in MODULES.values() for hit in _private_state(path)]
    assert not found, "private attributes of another module's objects (give them a public way in): " + "; ".join(found)


# the README's layout table, top to bottom: a folder stands on those above it, never on those below
LAYERS = (
    "common",
    "shm",
    "text",
    "pulls",
    "models",
    "formats",
    "flash",
    "speculative",
    "actors",
    "scheduler",
    "scheduler.generation",
    "engine",
    "cadence",
    "observe",
    "serve",
    "launch",
    "bench",
)


def _layer(mod: str) -> int:
    return LAYERS.index("scheduler.generation" if mod.startswith("scheduler.generation") else mod.split(".")[0])


def test_each_folder_stands_only_on_the_folders_above_it():
    down = sorted(
        f"{name} -> {mod} (line {line})"
        for name, path in MODULES.items()
        for mod, _, line in _imports(name, path)
        if _ours(mod) and _layer(mod) > _layer(name)
    )
    assert not down, "imports that reach down the layers (README, Layout): " + "; ".join(down)


def test_the_product_never_imports_bench():
    """bench/ stands on the product and adds its commands to `launch` as plugins (pyproject.toml's entry points
    of `launch.commands`); no module of the product imports it, not even inside a function."""
    found = sorted(
        f"{name} -> {mod} (line {line})"
        for name, path in MODULES.items()
        if not name.startswith("bench")
        for mod, _, line in _imports(name, path)
        if mod == "bench" or mod.startswith("bench.")
    )
    assert not found, "the product imports bench/ (make it a plugin command): " + "; ".join(found)


def test_no_room_holds_over_a_quarter_of_the_code():
    """Rooms by responsibility (issue 55): no top-level folder over 25% of the lines of code, its C++ included."""
    lines = {pkg: 0 for pkg in PACKAGES}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*"):
            if path.suffix in (".py", ".cpp", ".hpp"):
                lines[pkg] += len(path.read_text().splitlines())
    total = sum(lines.values())
    over = {pkg: f"{n / total:.0%}" for pkg, n in lines.items() if n > total / 4}
    assert not over, f"rooms over a quarter of the {total} lines, split them by responsibility: {over}"


@pytest.mark.parametrize("check", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_finds_nothing_to_change(check):
    """ruff (pinned in the test dependencies), configured in pyproject.toml: format at 120 columns; lint for
    unused imports and variables and undefined names."""
    p = subprocess.run([sys.executable, "-m", "ruff", *check, "."], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]


# where a run's options (engine/config.py `RunConfig`) may be read: the front doors, and the engine up to `decide`
# (engine/decide.py), which makes every choice once; after it, everything reads the `RunPlan` (engine/plan.py)
READS_OPTIONS = (
    "engine.config",
    "engine.options",
    "engine.inputs",
    "engine.decide",
    "engine.budget_choice",
    "engine.memory",
)
READS_OPTIONS += ("engine.plan",)
READS_OPTIONS += ("engine.runner", "cadence", "bench", "launch")


def test_nothing_after_decide_takes_the_run_options():
    found = sorted(
        f"{path.relative_to(ROOT)}"
        for name, path in MODULES.items()
        if "RunConfig" in path.read_text() and not any(name == m or name.startswith(m + ".") for m in READS_OPTIONS)
    )
    assert not found, "modules past `decide` that take a RunConfig (give them the RunPlan): " + "; ".join(found)


def test_the_readme_follows_one_token_through_at_most_14_files_that_exist():
    """The README's path of one token from `launch run` to the screen: the files a reader must open, in order,
    at most 14 (issue 41: 23 before the plan, the session and the generic call), each one there."""
    import re

    part = (ROOT / "README.md").read_text().split("To follow one token from `launch run`")[1].split("In one process")[0]
    steps = re.findall(r"^\d+\. `([a-z_/]+\.py)`", part, re.M)
    named = set(re.findall(r"`?([a-z_]+/[a-z_/]+\.py)`?", part))
    assert 0 < len(steps) <= 14 and len(set(steps)) == len(steps), steps
    assert all((ROOT / f).is_file() for f in named), [f for f in named if not (ROOT / f).is_file()]
