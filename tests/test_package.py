"""The package's top level: `nha_retrofit.convert` is the conversion function, loaded on first use, and
`nha_retrofit.PlanSpec` the plan it takes; importing the package or asking the CLI for help loads neither torch nor
transformers; no module imports one that imports it back."""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import nha_retrofit

PACKAGE = Path(nha_retrofit.__file__).resolve().parent
HEAVY = ("torch", "transformers")


def test_convert_is_the_conversion_function(tiny_llama_folder, tmp_path):
    import nha_retrofit.conversion.shards as shards
    from nha_retrofit.conversion import convert, resolve_model
    from nha_retrofit.conversion.converter import convert as converter_convert

    assert inspect.isfunction(nha_retrofit.convert) and nha_retrofit.convert is convert is converter_convert
    assert inspect.isfunction(resolve_model) and inspect.isfunction(shards.find_checkpoint)
    assert "convert" in dir(nha_retrofit) and nha_retrofit.__all__ == ["PlanSpec", "convert"]
    nha_retrofit.convert(tiny_llama_folder, tmp_path / "a", nha_retrofit.PlanSpec(select="even", full_layers=1), log=lambda *_: None)
    assert (tmp_path / "a" / "config.json").is_file()


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        nha_retrofit.no_such_name  # noqa: B018


def loaded_after(code: str) -> list[str]:
    """Which of torch and transformers a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return eval(result.stdout.strip().splitlines()[-1])


def test_import_and_help_load_neither_torch_nor_transformers():
    assert loaded_after("import nha_retrofit") == []
    help_code = (
        "import contextlib, io, sys\nfrom nha_retrofit.cli import main\nsys.argv = ['nha-retrofit', '--help']\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n    main()\n"
        "assert 'convert' in out.getvalue()"
    )
    assert loaded_after(help_code) == []
    assert loaded_after("import nha_retrofit\nnha_retrofit.convert") == sorted(HEAVY)  # the probe does see them


def package_modules() -> dict[str, tuple[Path, bool]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def imported_modules(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (also inside functions), with the packages
    above them that the import system loads first (except `name`'s own, already loaded)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(base)
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    edges = set()
    for target in found:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix not in own and prefix != name:
                edges.add(prefix)
    return edges


def test_no_module_imports_one_that_imports_it_back():
    modules = package_modules()
    assert "nha_retrofit.conversion.converter" in modules and "nha_retrofit.convert" not in modules
    graph = {name: imported_modules(name, path, is_package, modules) for name, (path, is_package) in modules.items()}
    assert "nha_retrofit.plan" in graph["nha_retrofit.conversion.converter"]  # the scan sees imports
    cycles = []
    for start in sorted(graph):
        reached, frontier = set(), [start]
        while frontier:
            for target in graph[frontier.pop()]:
                if target not in reached:
                    reached.add(target)
                    frontier.append(target)
        if start in reached:
            cycles.append(start)
    assert cycles == [], f"modules on an import cycle: {cycles}"
