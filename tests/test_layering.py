"""Imports flow one way: interfaces <- core <- plugins / server. Core reaches plugins only by hooks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "tokenmill"
FORBIDDEN = {
    "interfaces": ("tokenmill.core", "tokenmill.plugins", "tokenmill.server", "tokenmill.testing", "tokenmill.cli"),
    "core": ("tokenmill.plugins", "tokenmill.server", "tokenmill.testing", "tokenmill.cli"),
    "plugins": ("tokenmill.server", "tokenmill.testing", "tokenmill.cli"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downwards(layer):
    """No module of a layer imports from a layer above it."""
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in (PACKAGE / layer).rglob("*.py")
        for module in imported_modules(path)
        if module.startswith(FORBIDDEN[layer])
    ]
    assert not offenders, offenders


def test_nothing_unpickles():
    """Weights load from safetensors only: no torch.load or pickle anywhere in the package."""
    for path in PACKAGE.rglob("*.py"):
        assert "torch.load(" not in path.read_text(), path
        assert not {"pickle", "dill", "cloudpickle"} & imported_modules(path), path


def test_only_platform_plugins_import_platform_modules():
    """The core asks its Platform; nothing outside plugins/platforms reaches a platform's code,
    but the cuda platform's CPU stand-in for the tests, which is that platform less its CUDA calls,
    and the ahead-of-time compile of every Triton kernel tokenmill ships (the cuda platform's too)."""
    platforms = PACKAGE / "plugins" / "platforms"
    allowed = {PACKAGE / "testing" / "fake_cuda_platform.py", PACKAGE / "testing" / "triton_aot.py"}
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in PACKAGE.rglob("*.py")
        if platforms not in path.parents and path not in allowed
        for module in imported_modules(path)
        if module.startswith("tokenmill.plugins.platforms")
    ]
    assert not offenders, offenders


#: imports that tie a module to one kind of device
DEVICE_IMPORTS = ("torch.utils.cpp_extension", "torch.cuda", "triton", "ctypes")
#: calls into one device's libraries
DEVICE_CALLS = ("torch.ops.mkldnn", "torch.cuda.", "torch.backends.mkldnn", "mallopt", '.to("cuda', "'cuda'")


def test_core_has_no_device_specific_code():
    """Core is device-agnostic: no C++ or other non-Python sources, no device libraries. What
    a device needs is its platform plugin's (plugins/platforms/<name>/)."""
    core = PACKAGE / "core"
    sources = [p.relative_to(PACKAGE) for p in core.rglob("*")
               if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
    assert not sources, sources
    offenders = [
        f"{path.relative_to(PACKAGE)}: {what}"
        for path in core.rglob("*.py")
        for what in [*(m for m in imported_modules(path) if m.startswith(DEVICE_IMPORTS)),
                     *(call for call in DEVICE_CALLS if call in path.read_text())]
    ]
    assert not offenders, offenders


def test_core_modules_import_each_other_without_cycles():
    """Every import in core is at module level and acyclic: a module can be read, and tested,
    from the bottom up (the builder imports the engine, never the other way round)."""
    core = PACKAGE / "core"
    names = {".".join(("tokenmill", *path.relative_to(PACKAGE).with_suffix("").parts)): path
             for path in core.rglob("*.py") if path.name != "__init__.py"}
    graph = {name: {m for m in imported_modules(path) if m in names and m != name} for name, path in names.items()}
    visiting, done = [], set()

    def visit(name: str) -> None:
        if name in done:
            return
        assert name not in visiting, "import cycle: " + " -> ".join(visiting[visiting.index(name):] + [name])
        visiting.append(name)
        for dependency in sorted(graph[name]):
            visit(dependency)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
