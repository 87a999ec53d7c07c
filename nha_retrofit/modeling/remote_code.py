"""The remote code of a converted checkpoint: the package's modeling files and the plain-PyTorch operator they call,
copied flat into the checkpoint folder, so it loads with `trust_remote_code=True` where only torch and transformers
are installed. The files are the package's own, byte for byte, except that imports of the operator folder
(`from ..ops.nha.chunk_torch import ...`) become imports of the sibling file (`from .chunk_torch import ...`)."""

import json
import re
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent
_MODELING, _OPERATOR = _PACKAGE / "modeling", _PACKAGE / "ops" / "nha"

# file name in the checkpoint -> the package file it is copied from
REMOTE_CODE_FILES = {
    "configuration_nha.py": _MODELING / "configuration_nha.py",
    "modeling_nha.py": _MODELING / "modeling_nha.py",
    "nha_cache.py": _MODELING / "nha_cache.py",
    "decode_graph.py": _MODELING / "decode_graph.py",
    "fused_step.py": _MODELING / "fused_step.py",
    "head_split.py": _MODELING / "head_split.py",
    "dispatch.py": _OPERATOR / "dispatch.py",
    "chunk_torch.py": _OPERATOR / "chunk_torch.py",
    "recurrent_torch.py": _OPERATOR / "recurrent_torch.py",
    "state.py": _OPERATOR / "state.py",
    "gates.py": _OPERATOR / "gates.py",
}
_OPERATOR_IMPORT = re.compile(r"^from \.\.ops\.nha\.(\w+) import", flags=re.MULTILINE)
_SIBLING_IMPORT = re.compile(r"^from \.(\w+) import", flags=re.MULTILINE)


def remote_code_source(name: str) -> str:
    """The text of the checkpoint's file `name`."""
    return _OPERATOR_IMPORT.sub(r"from .\1 import", REMOTE_CODE_FILES[name].read_text())


def write_remote_code(folder: Path, model_class) -> None:
    """Write the remote code files into `folder` and point its config's auto_map at them."""
    for name in REMOTE_CODE_FILES:
        (folder / name).write_text(remote_code_source(name))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {
        "AutoConfig": f"configuration_nha.{model_class.config_class.__name__}",
        "AutoModelForCausalLM": f"modeling_nha.{model_class.__name__}",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def checkpoint_remote_code(folder: Path) -> list[str]:
    """The remote code files a checkpoint folder ships: the two that auto_map names and every file they import,
    transitively (a checkpoint written by an earlier version of the package has other file names). Raises
    FileNotFoundError naming the first one missing."""
    folder, wanted, found = Path(folder), ["configuration_nha.py", "modeling_nha.py"], []
    while wanted:
        name = wanted.pop(0)
        if name in found:
            continue
        if not (folder / name).is_file():
            raise FileNotFoundError(name)
        found.append(name)
        wanted += [f"{module}.py" for module in _SIBLING_IMPORT.findall((folder / name).read_text())]
    return sorted(found)
