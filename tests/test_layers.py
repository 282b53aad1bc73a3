"""Imports run one way: every module of sana2/ imports only from its own layer or a lower one.

The layers, lowest first (a module in none of them fails the test, so a new package must be placed):
  leaves      the package root, log, seeding, staging, cli, models/config.py, data/buckets.py,
              data/frame_window.py: import no other layer
  core        config.py and models/: the typed config and the model, which knows nothing of parallelism
  distributed the device mesh (ParallelDims), parallelize, the sharded frozen encoder
  formats     checkpoint and model file formats
  encoders    the text encoder and the autoencoders
  data        datasets, loaders, data preparation's steps
  components  the trainer's parts: checkpointing, optimizer, EMA, metrics, validation, model transforms
  planning    the memory plan
  commands    train, sample, prepare, plan, launch, preflight and the conversion tools
Every import counts: the ones inside functions too (a lazy import is an import that runs later).
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sana2"

# "sana2" is the package root: every import of sana2 runs its (empty) __init__.py
LEAVES = {
    "sana2",
    "sana2.log",
    "sana2.seeding",
    "sana2.staging",
    "sana2.cli",
    "sana2.models.config",
    "sana2.data.buckets",
    "sana2.data.frame_window",
}
LAYERS = [
    ("leaves", lambda m: m in LEAVES),
    ("core", lambda m: m == "sana2.config" or _under(m, "sana2.models")),
    ("distributed", lambda m: _under(m, "sana2.distributed")),
    ("formats", lambda m: _under(m, "sana2.formats")),
    ("encoders", lambda m: _under(m, "sana2.encoders")),
    ("data", lambda m: _under(m, "sana2.data")),
    ("components", lambda m: _under(m, "sana2.components")),
    ("planning", lambda m: _under(m, "sana2.planning")),
    (
        "commands",
        lambda m: (
            m in {f"sana2.{c}" for c in ("train", "sample", "prepare", "plan", "launch", "preflight", "config_help")}
            or _under(m, "sana2.tools")
        ),
    ),
]
# config.py may import leaves only, even from its own layer: it is read by everything, torch-free commands too.
# It still checks the [model] section through sana2.models (the registry builds the typed model config of
# sana2/models/config.py); that import goes once the registry's lookup moves into the leaf.
CONFIG_MAY_ALSO_IMPORT = {"sana2.models"}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> int:
    for index, (_, belongs) in enumerate(LAYERS):
        if belongs(module):
            return index
    raise AssertionError(f"{module} is in no layer: place it in tests/test_layers.py's LAYERS")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every sana2 module `path` imports, at any depth of the file."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from sana2.x import y` imports sana2.x.y when y is a module, else a name of sana2.x
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if _is_module(candidate) else base))
    return sorted((line, name) for line, name in found if _under(name, "sana2"))


def _is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (PACKAGE.parent / relative).with_suffix(".py").is_file() or (PACKAGE.parent / relative).is_dir()


def every_module() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_import_runs_down_the_layers():
    upward = []
    for path in every_module():
        module = module_name(path)
        own = layer_of(module)
        for line, imported in imports_of(path):
            if layer_of(imported) > own:
                upward.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line}: {module} ({LAYERS[own][0]}) imports "
                    f"{imported} ({LAYERS[layer_of(imported)][0]})"
                )
    assert not upward, "imports up the layer order:\n" + "\n".join(upward)


def test_leaves_import_only_leaves_and_config_only_leaves():
    wrong = []
    for path in every_module():
        module = module_name(path)
        allowed = LEAVES | (CONFIG_MAY_ALSO_IMPORT if module == "sana2.config" else set())
        if module in LEAVES or module == "sana2.config":
            wrong += [
                f"{module}:{line} imports {name}"
                for line, name in imports_of(path)
                if name not in allowed and not any(_under(name, a) for a in CONFIG_MAY_ALSO_IMPORT & allowed)
            ]
    assert not wrong, "\n".join(wrong)


# sana2/models/__init__.py re-exports the models: sana2.models.config stays out of this check for as long as
# config.py imports sana2.models itself (CONFIG_MAY_ALSO_IMPORT)
@pytest.mark.parametrize(
    "leaf", sorted(m for m in LEAVES if _is_module(m) and not any(_under(m, a) for a in CONFIG_MAY_ALSO_IMPORT))
)
def test_importing_a_leaf_runs_no_package_init_above_the_leaves(leaf):
    """`import sana2.data.buckets` runs sana2/data/__init__.py first: it must not pull a higher layer in."""
    parts = leaf.split(".")
    for depth in range(1, len(parts)):
        init = PACKAGE.parent.joinpath(*parts[:depth], "__init__.py")
        if init.is_file():
            higher = [name for _, name in imports_of(init) if name not in LEAVES]
            assert not higher, f"{init.relative_to(PACKAGE.parent)} imports {higher}; importing {leaf} runs it"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The test would catch an upward import hidden in a function or written relatively."""
    fake = tmp_path / "sana2"
    (fake / "data").mkdir(parents=True)
    (fake / "components").mkdir()
    (fake / "data" / "__init__.py").write_text("")
    (fake / "components" / "__init__.py").write_text("")
    (fake / "components" / "checkpoint.py").write_text("")
    (fake / "data" / "loader.py").write_text(
        "def f():\n    from sana2.components import checkpoint\n\nfrom ..components.checkpoint import x\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = imports_of(fake / "data" / "loader.py")
    assert found == [(2, "sana2.components.checkpoint"), (4, "sana2.components.checkpoint")]
    assert all(layer_of(name) > layer_of("sana2.data.loader") for _, name in found)
