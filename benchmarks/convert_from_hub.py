"""`nha-retrofit convert ID` for a model not yet downloaded: wall time and peak RSS of the download and conversion,
against converting the same checkpoint from a local folder.

The checkpoint has the tensor shapes of Meta-Llama-3-8B (random bf16, Hub-style shards and index; `--layers` keeps
the first N of its 32 layers to bound the disk used: three copies are written, the source, the Hugging Face cache
and the output). The local Hub of the tests (tests/support/hub_server.py) serves it from disk on 127.0.0.1; the
child runs the real CLI with HF_ENDPOINT and a fresh HF_HOME, so huggingface_hub downloads every file over plain
HTTP.
Usage: python benchmarks/convert_from_hub.py [--workdir /tmp/nha-hub-bench] [--layers 8] [--keep]
Writes benchmarks/results/convert_from_hub_llama3_8b_shapes.json.
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from convert_large import LLAMA3_8B, machine, run_cli, write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from hub_server import LocalHub, serve_tree  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/nha-hub-bench"))
    parser.add_argument("--layers", type=int, default=8, help="layers of the 32 kept (each adds 0.44 GB)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint for another run")
    args = parser.parse_args()
    config = {**LLAMA3_8B, "num_hidden_layers": args.layers}
    source = args.workdir / f"llama3-8b-shapes-{args.layers}-layers"
    if not source.exists():
        write_checkpoint(source, config)
    plan = ["--full-layers", str(min(4, args.layers))]
    results = {}
    with LocalHub() as hub:
        hub.add_repo("bench/llama3-8b-shapes", serve_tree(source, from_disk=True))
        for way, model, env in (
            ("local_folder", str(source), None),
            ("hub_download", "bench/llama3-8b-shapes", {
                **os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(args.workdir / "hf"),
                "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            }),
        ):
            output = args.workdir / f"out-{way}"
            shutil.rmtree(output, ignore_errors=True)
            shutil.rmtree(args.workdir / "hf", ignore_errors=True)
            wall, peak = run_cli(["convert", model, "-o", str(output), *plan], env=env)
            results[way] = {"wall_s": round(wall, 1), "peak_rss_gb": round(peak, 2)}
            shutil.rmtree(output, ignore_errors=True)
        downloaded = len(hub.file_requests("GET"))
    source_gb = sum(p.stat().st_size for p in source.iterdir()) / 1e9
    result = {
        "model": f"Meta-Llama-3-8B tensor shapes, first {args.layers} of 32 layers, random bf16, 4 Hub shards",
        "source_gb": round(source_gb, 2), "plan": f"{plan[1]} full layers, w=64, M=64", "files_downloaded": downloaded,
        **results, "transport": "local Hub on 127.0.0.1 (tests/support/hub_server.py), plain HTTP, huggingface_hub "
        "snapshot_download with 8 workers", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
        "load_average_1m": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=2))
    Path(__file__).parent.joinpath("results", "convert_from_hub_llama3_8b_shapes.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )
    shutil.rmtree(args.workdir / "hf", ignore_errors=True)
    if not args.keep:
        shutil.rmtree(source, ignore_errors=True)


if __name__ == "__main__":
    main()
