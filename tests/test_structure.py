"""The package's shape, as docs/design.md draws it: imports that only go down the layers
(lazy ones inside functions included), `launch` on the standard library alone, and `config` and the
`validate` / `init` path never importing JAX."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "jaxrl"
LAYERS = ("config", "parallel", "model", "kv", "inference", "envs", "rl", "compile", "run", "export", "evaluation",
          "cli")
"""The subpackages in data-flow order (docs/design.md): each may import those before it, never those after."""
MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, at any depth (lazy imports too); `from a import b`
    gives `a.b` as well as `a`, since b may be a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_imports_go_down_the_layers():
    upward = []
    for path in MODULES:
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2 or parts[0] not in LAYERS:
            continue
        layer = LAYERS.index(parts[0])
        for line, module in _imports(path):
            target = module.split(".")
            if target[0] == "jaxrl" and len(target) > 1 and target[1] in LAYERS and LAYERS.index(target[1]) > layer:
                upward.append(f"{_name(path)}:{line} imports {module}")
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(upward)


def test_launch_needs_only_the_standard_library():
    """`jaxrl.launch` runs on a machine before jaxrl's dependencies are installed (`docs/tpu.md`)."""
    foreign = [f"{_name(p)}:{line} imports {module}" for p in sorted((PACKAGE / "launch").rglob("*.py"))
               for line, module in _imports(p)
               if module.split(".")[0] not in sys.stdlib_module_names and not module.startswith("jaxrl.launch")
               and module != "__future__"]
    assert not foreign, "\n".join(foreign)


@pytest.mark.parametrize("code", [
    "import jaxrl.config.schema, jaxrl.config.env_file, jaxrl.config.starter",
    "from typer.testing import CliRunner; from jaxrl.cli.main import app; import sys;"
    "r = CliRunner().invoke(app, ['init', sys.argv[1] + '/rl.toml']); assert r.exit_code == 0, r.output;"
    "r = CliRunner().invoke(app, ['validate', sys.argv[1] + '/rl.toml']); assert r.exit_code in (0, 2), r.output",
])
def test_config_and_the_validate_init_path_import_no_jax(code, tmp_path):
    """`jaxrl validate` and `jaxrl init` answer at once: JAX takes seconds to import."""
    probe = code + "; import sys; assert 'jax' not in sys.modules, 'jax was imported'"
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]


HEAVY = {
    **dict.fromkeys(("jax", "flax", "optax", "orbax"),
                    "JAX takes seconds to import, and `jaxrl validate`, `init`, `--help` and the run management "
                    "commands import none (test_config_and_the_validate_init_path_import_no_jax)"),
    **dict.fromkeys(("verifiers", "renderers", "transformers", "torch"),
                    "the environments' stack (renderers and transformers' tokenizers: half a second and more), "
                    "which only commands that play an environment need"),
    "gepa": "GEPA's optimizer: only `jaxrl gepa` needs it",
    **dict.fromkeys(("starlette", "uvicorn"), "the HTTP server (with asyncio: about 0.3 s, as much as the rest of "
                                              "`jaxrl validate`'s imports): only commands that serve a model need it"),
    **dict.fromkeys(("jetstream", "grpc"), "the jaxrl[jetstream] extra (TensorFlow, about 5 s): only `jaxrl serve "
                                           "--jetstream` needs it, and it may not be installed"),
}
"""Libraries whose import cost (or absence) is the one documented reason for a function-level import of a
jaxrl module: by each, why."""


def _module_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, target, lazy) of every import in `path`: a jaxrl target as the module it names (`from a import
    b` gives `a.b` where b is a module, else `a`), any other as its top-level package; lazy: inside a
    function, so run when the function is called rather than when the module is imported."""
    names = {_name(p) for p in MODULES}
    out = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name if a.name.startswith("jaxrl") else a.name.split(".")[0], lazy)
                           for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if not child.module.startswith("jaxrl"):
                    out.append((child.lineno, child.module.split(".")[0], lazy))
                else:
                    out.extend((child.lineno, f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in names
                                else child.module, lazy) for a in child.names)
            visit(child, lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return out


@functools.cache
def _import_graph() -> dict[str, list[tuple[int, str, bool]]]:
    """Each jaxrl module's imports (`_module_imports`) by module name."""
    return {_name(p): sorted(set(_module_imports(p))) for p in MODULES}


@functools.cache
def _heavy_at_import(module: str) -> frozenset[str]:
    """The `HEAVY` libraries that importing `module` imports: its top-level imports' and, through them, those
    of every jaxrl module it imports at the top."""
    seen, todo, heavy = {module}, [module], set()
    while todo:
        for _, target, lazy in _import_graph().get(todo.pop(), ()):
            if lazy:
                continue
            if target.startswith("jaxrl"):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
            elif target in HEAVY:
                heavy.add(target)
    return frozenset(heavy)


def test_no_import_cycles():
    """No module imports, at the top or inside a function, a module that imports it back (directly or
    through others): a cycle hidden by a function-level import is a cycle all the same. The helpers two
    modules share go to a module both import."""
    graph = {m: sorted({(t, line) for line, t, _ in imports if t in _import_graph()})
             for m, imports in _import_graph().items()}
    cycles, done = [], set()

    def walk(module: str, stack: list[tuple[str, int]]) -> None:  # stack: (module, line importing the next)
        for target, line in graph[module]:
            frames = stack + [(module, line)]
            names = [m for m, _ in frames]
            if target in names:
                cycles.append(" -> ".join(f"{m}:{ln}" for m, ln in frames[names.index(target):]) + f" -> {target}")
            elif target not in done:
                walk(target, frames)
        done.add(module)

    for module in graph:
        if module not in done:
            walk(module, [])
    assert not cycles, "import cycles (module:line of the import):\n" + "\n".join(sorted(set(cycles)))


def test_function_level_imports_have_a_reason():
    """A jaxrl module imported inside a function rather than at the top must bring a `HEAVY` library the
    importer does not import already (JAX kept off the validate path, an optional extra): anything else
    could be imported at the top, where a reader sees it (and `test_no_import_cycles` sees any cycle)."""
    needless = [f"{module}:{line} imports {target} inside a function, though it brings no library of HEAVY "
                f"that {module} does not import already: import it at the top"
                for module, imports in _import_graph().items() for line, target, lazy in imports
                if lazy and target in _import_graph() and not _heavy_at_import(target) - _heavy_at_import(module)]
    assert not needless, "\n".join(needless)



PRIVATE_FOR_NOW: dict[str, str] = {}
"""Private names another module still uses, each with why it is left for now."""


def test_no_module_uses_another_modules_private_names():
    """A name with a leading underscore is its module's own: another module neither imports it (`from
    jaxrl.a import _b`) nor reads it off the module (`a._b`). What two modules share has a public name, in
    the module both import."""
    names = {_name(p) for p in MODULES}
    used = []
    for path in MODULES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = {}  # local name -> jaxrl module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("jaxrl"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in names:
                        modules[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        used.append(f"{_name(path)}:{node.lineno} imports {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names if a.asname and a.name in names})
        used += [f"{_name(path)}:{node.lineno} reads {modules[node.value.id]}.{node.attr}" for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                 and node.attr.startswith("_") and not node.attr.startswith("__")
                 and modules[node.value.id] != _name(path)]
    used = [u for u in used if not u.endswith(tuple(PRIVATE_FOR_NOW))]
    assert not used, "another module's private names:\n" + "\n".join(used)


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_module_or_function_too_long():
    """Small files with one concern each, and functions that fit on a screen (STYLE.md): a module over
    500 lines or a function / method over 80 lines (from its `def` to its last line, decorators left out,
    docstring counted) is named here."""
    long = []
    for path in MODULES:
        text = path.read_text(encoding="utf-8")
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            long.append(f"{_name(path)}: {lines} lines (module, over {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{_name(path)}:{node.lineno} {node.name}: {lines} lines (over {MAX_FUNCTION_LINES})")
    assert not long, "too long:\n" + "\n".join(long)


MAX_CLASS_ATTRIBUTES = 25


@functools.cache
def _classes(module: str) -> dict[str, tuple[ast.ClassDef, list[tuple[str, str]]]]:
    """Every class of `module` (a dotted name in the package) by name: its node and its bases inside the
    package, each as (module, name) through a class of the same module or a `from jaxrl... import Name`."""
    path = PACKAGE.parent.joinpath(*module.split("."))
    tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text("utf-8"))
    imported = {a.asname or a.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("jaxrl") for a in node.names}
    local = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    return {node.name: (node, [(module if b.id in local else imported[b.id], b.id) for b in node.bases
                               if isinstance(b, ast.Name) and (b.id in local or b.id in imported)])
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _own_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes `cls` declares: annotated names in its body (a dataclass's fields) and every `self.x`
    its methods assign (`=`, `+=`, annotated, tuple targets, `with ... as self.x`, `for self.x in`)."""
    names = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) or not method.args.args:
            continue
        me = method.args.args[0].arg
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor) else \
                [node.optional_vars] if isinstance(node, ast.withitem) and node.optional_vars else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                        names.add(t.attr)
    return names


def test_no_class_in_run_with_too_many_attributes():
    """A class a reader of `jaxrl/run` must hold in their head: at most 25 attributes, its bases' inside the
    package included (what `Run`'s reader sees is `Job`'s and its own); attributes that belong together
    are one small typed object (`RunEnvs`, `Progress`, `ModelFiles`). Over that, the class and its
    attributes are named here."""
    def attributes(module: str, name: str) -> set[str]:
        node, bases = _classes(module)[name]
        return _own_attributes(node).union(*(attributes(*b) for b in bases if b[1] in _classes(b[0])))

    big = [f"{_name(path)}.{name}: {len(attrs)} attributes (over {MAX_CLASS_ATTRIBUTES}): {', '.join(sorted(attrs))}"
           for path in sorted((PACKAGE / "run").glob("*.py")) for name in _classes(_name(path))
           if len(attrs := attributes(_name(path), name)) > MAX_CLASS_ATTRIBUTES]
    assert not big, "too many attributes:\n" + "\n".join(big)


PLATFORM_NAMES = re.compile(r"""["'](cpu|gpu|cuda|rocm|tpu)["']|default_backend|\.platform\b|mesh_platform""")
"""What deciding by platform looks like in code: a platform's name as a string, JAX's default backend, a
device's `.platform` or `jaxrl.parallel.sharding.mesh_platform`."""
DECIDES = PACKAGE / "model" / "kernels.py"
"""The one module that reads the platform for the model, the KV cache's picker and the sampler."""


def test_one_module_decides_the_kernels_by_platform():
    """Issue 40's done-when: the model, the engine and the sampler (jaxrl/model, jaxrl/inference) and the KV
    cache's picker (`jaxrl.kv.pick`) ask `jaxrl.model.kernels` which kernel and cache kind run where; a
    platform name appears in none of them but that module (the cache kinds of jaxrl/kv, each one kernel's
    code, may name the platform they run on). Docstrings count: an example that names a platform names the
    module that decides."""
    paths = [*sorted((PACKAGE / "model").rglob("*.py")), *sorted((PACKAGE / "inference").rglob("*.py")),
             PACKAGE / "kv" / "pick.py"]
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}" for path in paths if path != DECIDES
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if PLATFORM_NAMES.search(line)]
    assert not found, "decided by platform outside jaxrl/model/kernels.py:\n" + "\n".join(found)
    assert PLATFORM_NAMES.search(DECIDES.read_text(encoding="utf-8")), "the pattern finds nothing where it must"
