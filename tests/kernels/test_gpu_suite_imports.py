"""The GPU kernel tests skip at module level on machines without CUDA, so an import that only fails there would
first show on the GPU machine. Here, on any machine: every module that those test files import at top level resolves
(helpers in tests/ through pytest's pythonpath, the package's modules as files), without importing Triton."""

import ast
import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
GPU_TEST_FILES = [HERE / "test_kernel_chunk.py", HERE / "test_fast_launch.py"]


def top_level_imports(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def resolves(module: str) -> bool:
    if module.split(".")[0] == "nha_retrofit":  # a file of the package (importing it may need Triton)
        path = ROOT / module.replace(".", "/")
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
    return importlib.util.find_spec(module.split(".")[0]) is not None or module.split(".")[0] == "triton"


@pytest.mark.parametrize("path", GPU_TEST_FILES, ids=lambda p: p.name)
def test_every_top_level_import_of_the_gpu_tests_resolves(path):
    missing = [name for name in top_level_imports(path) if not resolves(name)]
    assert not missing, f"{path.name} imports modules that do not resolve: {missing}"
