"""A converted checkpoint loaded in a fresh Python process where `import nha_retrofit` fails: only torch,
transformers and the files shipped in the checkpoint (its remote code) are available."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch


def run_without_nha_retrofit(folder: Path, ids: torch.Tensor, logits: torch.Tensor, workdir: Path, *,
                             prompt_tokens: int, new_tokens: int, pad_token_id: int | None = None):
    """Load `folder` with trust_remote_code in a fresh process; return (class name, max |logits - expected| on
    `ids`, length of a greedy generation of `new_tokens` after the first `prompt_tokens` of `ids`)."""
    torch.save({"ids": ids, "logits": logits}, workdir / "expected.pt")
    pad = "" if pad_token_id is None else f", pad_token_id={pad_token_id}"
    script = textwrap.dedent(f"""
        import sys
        sys.modules["nha_retrofit"] = None  # any import of the package now fails
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        saved = torch.load({str(workdir / "expected.pt")!r})
        with torch.no_grad():
            diff = (model(saved["ids"]).logits - saved["logits"]).abs().max().item()
        generated = model.generate(saved["ids"][:, :{prompt_tokens}], max_new_tokens={new_tokens}, do_sample=False{pad})
        print(type(model).__name__, diff, generated.shape[1])
    """)
    result = run_script(script, workdir)
    assert "You are using a model of type" not in result.stderr, result.stderr[-2000:]
    name, diff, length = result.stdout.split()[-3:]
    return name, float(diff), int(length)


def tokenize_without_nha_retrofit(folder: Path, text: str, workdir: Path) -> tuple[list[int], str]:
    """`AutoTokenizer.from_pretrained(folder)(text)`, as a user without nha_retrofit types it (no arguments, stdin
    closed so that a prompt cannot wait): (the token ids, everything the process printed besides them)."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["nha_retrofit"] = None
        from transformers import AutoTokenizer
        print("ids:", AutoTokenizer.from_pretrained({str(folder)!r})({text!r}).input_ids)
    """)
    result = run_script(script, workdir)
    printed, _, ids = result.stdout.rpartition("ids: ")
    return ast.literal_eval(ids), printed + result.stderr


def run_script(script: str, workdir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_MODULES_CACHE": str(workdir / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    return result
