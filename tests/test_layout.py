"""The code's shape, checked from its syntax trees (nothing is imported): short functions and
classes, no import cycle among the package's modules, no import from a floor above (the order of
docs/layout.md), no private name of ours used outside the module that defines it, the layout's
configuration fields read only by the config, the command line and the Layout; and the linter's
rules (ruff). Each check fails with the whole list of offenders."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fixres_dist"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_FILE_LINES = {"fixres_dist/training/trainer.py": 250,
                  # the memory estimate, split by concern (issue 42): one module each under the 300 lines
                  **{f"fixres_dist/training/{name}.py": 300 for name in ("memory_estimate", "tracked_memory",
                                                                          "split_memory", "memory_budget", "dry_run")}}
# Where private names of ours must not be reached into: the package, and the code that uses it.
USERS = ("tests", "benchmarks", "slurm")
SELF = ("self", "cls")
# Third-party private names the tests, benchmarks and slurm scripts cannot do without (`base._name`:
# the name, with the last part of its base or module where the name alone would be too broad).
THIRD_PARTY_PRIVATE = {
    "_actions",            # argparse: a parser's options (its only list of them)
    "os._exit",            # leave a forked process without running the parent's clean-up
    "torch._dynamo",       # torch.compile's backends and reset
    "_parameters", "_buffers", "_modules",  # torch.nn.Module's registries
    "batchnorm._BatchNorm",               # torch.nn.modules.batchnorm: every BatchNorm's base class
    "forkserver._forkserver",             # multiprocessing's forkserver (a test kills its server)
    "_fc", "_bn1",         # efficientnet_lite_pytorch's classifier and last norm (its own names)
}


def fail_with(offenders: list[str], what: str) -> None:
    if offenders:
        in_order = sorted(offenders, key=lambda line: re.sub(r"\d+", lambda number: number[0].zfill(9), line))
        pytest.fail(f"{what} ({len(offenders)}):\n" + "\n".join(in_order), pytrace=False)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def package_files() -> list[Path]:
    return sorted((ROOT / PACKAGE).rglob("*.py"))


def user_files() -> list[Path]:
    return sorted(p for folder in USERS for p in (ROOT / folder).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__``)."""
    return {module_name(path): path for path in package_files()}


def is_package(name: str) -> bool:
    return modules().get(name, Path()).name == "__init__.py"


def imported_from(node: ast.ImportFrom, importer: str) -> str:
    """The absolute module name of ``from X import ...`` in module ``importer``."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package(importer) else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(importer: str, module: ast.Module):
    """``(line, imported module, alias bound or None, imported name or None)`` for every import in
    ``module``, at module level or in a function; ``from package import submodule`` imports the
    submodule."""
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, alias.asname, None
        elif isinstance(node, ast.ImportFrom):
            source = imported_from(node, importer)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules():
                    yield node.lineno, submodule, alias.asname or alias.name, None
                else:
                    yield node.lineno, source, None, alias.name


def private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__") and name != "_"


def third_party(base: str, name: str) -> bool:
    """Whether ``base._name`` (``base``: a dotted name, or a module ``name`` is imported from) is allowed."""
    return name in THIRD_PARTY_PRIVATE or f"{base.rpartition('.')[2]}.{name}" in THIRD_PARTY_PRIVATE


def test_functions_and_classes_are_short():
    offenders = []
    for path in package_files():
        for node in ast.walk(tree(path)):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    offenders.append(f"{relative(path)}:{node.lineno} {node.name}: {lines} lines (at most {limit})")
    for name, limit in MAX_FILE_LINES.items():
        lines = len((ROOT / name).read_text().splitlines())
        if lines > limit:
            offenders.append(f"{name}: {lines} lines (at most {limit})")
    fail_with(offenders, "too long")


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module of the package it imports: line of the first such import}."""
    graph = {}
    for name, path in modules().items():
        edges = graph.setdefault(name, {})
        for line, imported, _, _ in imports(name, tree(path)):
            if imported in modules() and imported != name:
                edges.setdefault(imported, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for component in components:  # the shortest way back to its first module, breadth first
        start = min(component)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nexts = sorted(o for o in graph[path[-1]] if o in component)
            if start in nexts:
                found.append(path + [start])
                break
            for other in nexts:
                if other not in seen:
                    seen.add(other)
                    paths.append(path + [other])
    return found


def test_no_import_cycle():
    """Counting the imports inside functions too: a deferred import may avoid a cost (torch before
    ``--help``), never close a cycle."""
    graph = import_graph()
    offenders = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
                 for cycle in cycles(graph)]
    fail_with(offenders, "import cycles")


def test_the_graph_sees_deferred_and_submodule_imports():
    scripts = import_graph()["fixres_dist.entry.scripts"]
    assert "fixres_dist.entry.launch" in scripts  # inside run_script
    assert "fixres_dist.startup" in scripts and "fixres_dist" not in scripts  # from package import module
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c", "a"]]


# The one statement of the floors' order: a line of docs/layout.md that starts with this, then the
# subpackages' folders in backquotes, bottom first, above the package's top-level modules.
LAYOUT_PAGE = ROOT / "docs" / "layout.md"
FLOORS_LINE = "Floors, bottom first:"
GROUND = ""  # the floor of the top-level modules (config, errors, io, ...)


def floors(page: str) -> list[str]:
    """The floors ``page`` (docs/layout.md's text) states, bottom first: :data:`GROUND`, then the
    subpackages' names."""
    lines = [line for line in page.splitlines() if line.startswith(FLOORS_LINE)]
    assert len(lines) == 1, f"docs/layout.md must have one line that starts with {FLOORS_LINE!r}, not {len(lines)}"
    return [GROUND, *re.findall(r"`(\w+)/`", lines[0])]


def floor_of(name: str) -> str:
    """The floor of module ``name`` of the package: its subpackage, or :data:`GROUND`."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package(name)) else GROUND


def upward_imports(order: list[str]) -> list[str]:
    """``file:line -> module (floor -> floor)`` for every import of a module of the package from a
    floor above the importer's (in ``order``, bottom first), in functions too, and every import of the
    package's root. The root itself (``fixres_dist/__init__.py``) is exempt: its names, imported on
    first use, are the package's public face, above every floor."""
    found = []
    for importer, path in modules().items():
        if importer == PACKAGE:
            continue
        here = order.index(floor_of(importer))
        for line, imported, _, _ in imports(importer, tree(path)):
            where = f"{relative(path)}:{line} -> {imported}"
            if imported == PACKAGE:
                found.append(f"{where} (the package's root, above every floor)")
            elif imported in modules() and order.index(floor_of(imported)) > here:
                found.append(f"{where} ({floor_of(importer) or 'top level'} imports from "
                             f"{floor_of(imported)}/, a floor above)")
    return list(dict.fromkeys(found))  # ``from m import a, b``: one line


def test_the_floors_hold():
    """Every import goes down the floors docs/layout.md states, or stays on its own floor."""
    order = floors(LAYOUT_PAGE.read_text())
    subpackages = {floor_of(name) for name in modules() if name != PACKAGE} - {GROUND}
    unplaced = sorted(subpackages - set(order)) + sorted(set(order) - subpackages - {GROUND})
    assert not unplaced and len(order) == len(set(order)), \
        f"docs/layout.md's floors must name every subpackage once and nothing else: {unplaced or order}"
    fail_with(upward_imports(order), f"imports from a floor above (docs/layout.md: {' < '.join(order[1:])})")


def test_the_floors_are_read_from_the_page_and_see_every_import():
    assert floors("x\nFloors, bottom first: the top-level modules, `b/`, `a/`.\n") == [GROUND, "b", "a"]
    assert floor_of("fixres_dist.config") == GROUND and floor_of("fixres_dist.training") == "training"
    assert floor_of("fixres_dist.distributed.blocks") == "distributed"
    flipped = upward_imports([GROUND, *reversed(floors(LAYOUT_PAGE.read_text())[1:])])  # the package upside down
    assert not any(line.startswith("fixres_dist/entry/scripts.py:") and "-> fixres_dist.entry.launch " in line
                   for line in flipped)  # the same floor
    assert any(line.startswith("fixres_dist/training/tracked_memory.py:")
               and "-> fixres_dist.distributed.sharding " in line for line in flipped)  # inside a function



def test_the_tests_mirror_the_package():
    """Each folder of tests/ is named after a subpackage (its tests), or is ``jobs`` (the suites that start
    whole jobs); docs/testing.md's table says which covers what."""
    subpackages = {floor_of(name) for name in modules()} - {GROUND}
    folders = {path.name for path in (ROOT / "tests").iterdir() if path.is_dir() and path.name[0] not in "._"}
    assert folders <= subpackages | {"jobs"}, f"folders of tests/ named after no subpackage: {folders - subpackages}"
    table = (ROOT / "docs" / "testing.md").read_text()
    assert all(f"| `tests/{folder}/` |" in table for folder in folders), "docs/testing.md: a folder not in its table"


def dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def module_aliases(importer: str, module: ast.Module) -> dict[str, str]:
    """Names bound to modules of the package in ``module`` (``import fixres_dist.x as x``, ``from
    fixres_dist import x``; ``import fixres_dist.x`` binds ``fixres_dist``)."""
    bound = {}
    for _, imported, alias, name in imports(importer, module):
        if name is None and (imported == PACKAGE or imported.startswith(PACKAGE + ".")):
            bound[alias or imported.split(".")[0]] = imported if alias else imported.split(".")[0]
    return bound


def private_uses(path: Path, importer: str, ours_only: bool) -> list[str]:
    """Private names of another module that ``path`` uses: imported, or read as an attribute of a
    module of the package; with ``ours_only`` False (tests, benchmarks, slurm scripts), also any
    ``obj._name`` outside ``self``/``cls``, and any private name imported, but those of
    :data:`THIRD_PARTY_PRIVATE`."""
    module, where = tree(path), relative(path)
    found = []
    for line, imported, alias, name in imports(importer, module):
        ours = imported.startswith(PACKAGE)
        if private(name) and (ours or not (ours_only or third_party(imported, name))):
            found.append(f"{where}:{line} from {imported} import {name}")
        elif private(imported.rpartition(".")[2]) and imported.startswith(PACKAGE):
            found.append(f"{where}:{line} import {imported}")
    aliases = module_aliases(importer, module)
    for node in ast.walk(module):
        if not isinstance(node, ast.Attribute) or not private(node.attr):
            continue
        base = dotted(node.value)
        if base is not None and base.split(".")[0] in aliases:
            target = ".".join([aliases[base.split(".")[0]], *base.split(".")[1:]])
            if target in modules() or target == PACKAGE:
                found.append(f"{where}:{node.lineno} {base}.{node.attr}")
                continue
        if ours_only or base in SELF:
            continue
        if not third_party(base or "", node.attr):
            found.append(f"{where}:{node.lineno} {base or ast.unparse(node.value)}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    offenders = []
    for path in package_files():
        offenders += private_uses(path, module_name(path), ours_only=True)
    for path in user_files():
        offenders += private_uses(path, path.stem, ours_only=False)
    fail_with(offenders, "private names used outside the module that defines them")


def test_ruff_finds_nothing():
    """The linter's rules (ruff.toml: pycodestyle, pyflakes, import order, 120 columns) hold everywhere;
    ``scripts/setup.sh`` installs ruff into the environment that runs the tests."""
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.exists(), f"{ruff} is missing: run bash scripts/setup.sh (setup.py's test extra installs ruff)"
    found = subprocess.run([str(ruff), "check", "--output-format", "concise", str(ROOT)], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert found.returncode == 0, found.stdout[-4000:] + found.stderr[-2000:]


# The configuration's fields of the parallel layout: read only where they are defined, parsed from the
# command line and made a Layout; everything else asks the Layout (fixres_dist.distributed.layout) for
# its sizes (tensor, pipeline, shard, replicate, the *_enabled properties, describe()).
LAYOUT_FIELDS = ("tensor_parallel", "pipeline_stages")
LAYOUT_READERS = ("fixres_dist/config.py", "fixres_dist/entry/cli.py", "fixres_dist/distributed/layout.py")


def layout_field_reads(module: ast.Module, importer: str, where: str) -> list[str]:
    """``where:line what`` for every read of a layout field in ``module``: an attribute (``config.tensor_parallel``,
    not the module ``fixres_dist.distributed.tensor_parallel``), and the field's name as a value (a key read:
    ``fields["pipeline_stages"]``, ``.get("tensor_parallel")``, ``getattr(x, "tensor_parallel")``, ``in``; or a
    name kept to read by later). Writing a configuration is not a read: keyword arguments
    (``TrainerConfig(tensor_parallel=2)``, ``attrs.evolve(config, pipeline_stages=2)``), a dict display's keys,
    a subscript assigned to; nor a docstring's or a comment's words."""
    aliases = module_aliases(importer, module)
    parents = {id(child): node for node in ast.walk(module) for child in ast.iter_child_nodes(node)}
    augmented = {id(node.target) for node in ast.walk(module) if isinstance(node, ast.AugAssign)}
    found = []
    for node in ast.walk(module):
        if isinstance(node, ast.Attribute) and node.attr in LAYOUT_FIELDS:
            if not isinstance(node.ctx, ast.Load) and id(node) not in augmented:
                continue  # assigned to
            base = dotted(node.value)
            if base is not None and base.split(".")[0] in aliases:
                target = ".".join([aliases[base.split(".")[0]], *base.split(".")[1:]])
                if f"{target}.{node.attr}" in modules():
                    continue  # the module tensor_parallel, not the field
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and node.value in LAYOUT_FIELDS:
            parent = parents.get(id(node))
            if isinstance(parent, ast.Dict) and any(key is node for key in parent.keys):
                continue  # {"tensor_parallel": 2}: fields written
            if (isinstance(parent, ast.Subscript) and parent.slice is node and not isinstance(parent.ctx, ast.Load)
                    and id(parent) not in augmented):
                continue  # fields["tensor_parallel"] = 2
            read = parent if isinstance(parent, (ast.Subscript, ast.Call, ast.Compare, ast.Tuple)) else node
            found.append((node.lineno, ast.unparse(read)))
    return [f"{where}:{line} {what}" for line, what in sorted(found)]


def test_only_the_config_the_command_line_and_the_layout_read_the_layout_fields():
    """``tensor_parallel`` and ``pipeline_stages`` are read in :data:`LAYOUT_READERS` only: everything else
    asks ``layout.of(config)`` (a :class:`~fixres_dist.distributed.layout.Layout`) for the sizes."""
    offenders = []
    for path in package_files():
        if relative(path) not in LAYOUT_READERS:
            offenders += layout_field_reads(tree(path), module_name(path), relative(path))
    fail_with(offenders, f"{' and '.join(LAYOUT_FIELDS)} read outside {', '.join(LAYOUT_READERS)}: ask the Layout")


def test_the_layout_field_check_sees_reads_not_writes_nor_the_module():
    source = '''"""A docstring naming config.tensor_parallel and fields["pipeline_stages"]."""
import fixres_dist.distributed.tensor_parallel
from fixres_dist import distributed
from fixres_dist.distributed import tensor_parallel
from ..distributed import tensor_parallel as tp
tensor_parallel.parallelize(model, mesh)  # config.pipeline_stages, in a comment
fixres_dist.distributed.tensor_parallel.splittable(model, 2)
distributed.tensor_parallel.splittable(model, 2)
config = TrainerConfig(tensor_parallel=2, pipeline_stages=1)
config = attrs.evolve(config, pipeline_stages=2)
fields = {"tensor_parallel": 2, "pipeline_stages": 1}
fields["pipeline_stages"] = 4
config.tensor_parallel
args.pipeline_stages > 1
fields["tensor_parallel"]
saved.get("pipeline_stages", 1)
getattr(config, "tensor_parallel")
"pipeline_stages" in fields
for flag, field in (("--tensor-parallel", "tensor_parallel"),):
    pass
fields["tensor_parallel"] += 1
'''
    found = layout_field_reads(ast.parse(source), "fixres_dist.training.example", "example.py")
    assert found == ["example.py:13 config.tensor_parallel", "example.py:14 args.pipeline_stages",
                     "example.py:15 fields['tensor_parallel']", "example.py:16 saved.get('pipeline_stages', 1)",
                     "example.py:17 getattr(config, 'tensor_parallel')", "example.py:18 'pipeline_stages' in fields",
                     "example.py:19 ('--tensor-parallel', 'tensor_parallel')",
                     "example.py:21 fields['tensor_parallel']"]
