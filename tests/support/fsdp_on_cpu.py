"""`accelerate launch` entry point of the FSDP test on CPU processes: trains each recipe until a step, stops, then
resumes it to the end and exports, all through the CLI.

    accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes 2 fsdp_on_cpu.py STOP_STEP RECIPE...

accelerate 1.16 turns an FSDP config into plain DDP when its processes run on the CPU: AcceleratorState switches to
FSDP only for GPU-like devices (MULTI_GPU, MULTI_XPU, ...), never for MULTI_CPU, although FSDP2 (`fully_shard`)
itself shards over gloo on the CPU. So that the test runs the FSDP2 path that GPUs run (sharded parameters,
optimizer states and checkpoints, the teacher's in-place swap, the gathered export), this script makes accelerate's
state honour the FSDP config on the CPU; nothing else changes.
"""

import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType


def honour_fsdp_on_cpu():
    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.device.type == "cpu":
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


if __name__ == "__main__":
    honour_fsdp_on_cpu()
    from nha_retrofit.cli import app

    stop, recipes = sys.argv[1], sys.argv[2:]
    for recipe in recipes:
        app(["finetune", recipe, "--set", f"train.stop_after_steps={stop}"], standalone_mode=False)
        app(["finetune", recipe, "--resume"], standalone_mode=False)
