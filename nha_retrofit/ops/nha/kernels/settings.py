"""Launch settings of the NHA kernels: block shapes, warps, pipelining stages and chunk sizes, frozen per kernel and
chosen by the device's compute capability (`settings_for`). Each has one line of reason here; the measurements
behind them are in docs/kernels.md. Plain Python data: nothing is compiled on import."""

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class ForwardSettings:
    """The fused forward (`chunk_fwd.py`) and the slot-state kernels before it (`chunk_states.py`)."""

    block_rows: int = 128  # rows (tokens x query heads of a kv head) per program: the chunk's states load less often
    warps: int = 8  # for blocks of 64 rows or more (fewer: 4); 4 spilled more at D = 128
    stages: int = 3  # 3 stages beat 2 at 32K; shared memory 48 -> 64 KB
    train_chunk: int = 32  # tokens per slot chunk when a backward follows: smaller [rows, chunk] tiles spill less there
    train_prefetch: int = 1  # L2 prefetches before the slot part in training: the window's keys and values
    inference_prefetch: int = 2  # without a backward, where states are segment-local: the chunk's states too
    update_elements: int = 8192  # state elements (slots x columns) per program of the chunk update
    segment_longest: int = 64  # chunks per segment of the state walks, at most (32 was slower at 32K and 64K)
    segment_shortest: int = 16  # ... at least: below, the states are scanned whole
    segments_least: int = 16  # segments a walk keeps, shortening them down to segment_shortest (fewer idle programs)
    scan_segment: int = 16  # chunks per segment of the chained scans over chunks
    scan_elements: int = 8192  # elements (chunks x columns x slots) per program of the chained scans, in registers


@dataclasses.dataclass(frozen=True)
class SlotBackwardSettings:
    """The slot half's backward (`chunk_bwd_slots.py`)."""

    block_tokens: int = 16  # tokens per row block of the key-side kernels: 8 and 32 were slower at 32K
    rows_block_tokens: int = 16  # tokens per block of the rows kernel, which loads the forward's logits
    warps: int = 4  # rows, state_grad and separate key kernels: 8 warps were slower despite fewer spills
    merged_keys_warps: int = 8  # the merged key kernel (dk, dv and the gates' terms in one program per chunk)
    stages: int = 2  # prefetch the next row block's tiles into shared memory
    stages_elements: int = 8192  # above this many row-block elements (rows x head dim) one stage: 2 overflow smem
    columns: int = 128  # state columns per program of state_grad and the key kernels: fewer recomputed weights
    keys_gate_slots: int = 64  # slots per program of the separate gate-gradient kernel (M = 128 faulted whole)


@dataclasses.dataclass(frozen=True)
class WindowBackwardSettings:
    """The window half's backward (`chunk_bwd_window.py`)."""

    block_tokens: int = 16  # query tokens per block of the dq kernel and of the dkv kernel's loop
    dq_keys_short: int = 16  # keys per tile of the dq loop up to a 64-token window (fewest keys computed)
    dq_keys_long: int = 32  # ... above it (16-key tiles were slower at w = 512)
    dkv_keys_short: int = 32  # keys per dkv program up to a 64-token window: fewest pairs without spills
    dkv_keys_long: int = 64  # ... above it: fewer query loads per key
    stages: int = 2
    overlap_tokens: int = 8192  # from this many tokens (batch x length) dkv runs on a second stream beside the slots


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """The one-token decode step (`fused_recurrent.py`)."""

    window_block: int = 64  # window entries per program: a long window is read by many programs, then merged
    warps: int = 8  # 4 warps spill the [M, D] slot tiles at D = 128


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    forward: ForwardSettings = ForwardSettings()
    slot_backward: SlotBackwardSettings = SlotBackwardSettings()
    window_backward: WindowBackwardSettings = WindowBackwardSettings()
    decode: DecodeSettings = DecodeSettings()


HOPPER = KernelSettings()  # measured on the H200 (sm_90)
# Untimed: one pipelining stage fewer in the forward for the smaller shared memory of earlier GPUs (a launch that
# still overflows it drops stages until it fits, `ops/utils/launch.py`).
EARLIER = dataclasses.replace(HOPPER, forward=dataclasses.replace(HOPPER.forward, stages=2))


@functools.lru_cache(maxsize=None)
def _for_capability(major: int) -> KernelSettings:
    return HOPPER if major >= 9 else EARLIER


def settings_for(device) -> KernelSettings:
    """The settings for tensors on `device` (HOPPER off CUDA: the CPU interpreter runs the shipped shapes)."""
    device = torch.device(device)
    if device.type != "cuda":
        return HOPPER
    return _for_capability(torch.cuda.get_device_capability(device)[0])


def forward_block(groups: int, chunk: int, settings: KernelSettings) -> int:
    """Query tokens per program of the fused forward: the largest power of two <= the chunk whose rows (tokens x
    `groups` query heads per kv head) fit `block_rows`."""
    tokens = chunk
    while tokens > 1 and tokens * groups > settings.forward.block_rows:
        tokens //= 2
    return tokens


def chunk_tokens(groups: int, training: bool, settings: KernelSettings) -> int:
    """Tokens per slot-state chunk: `train_chunk` when a backward follows; else 64 where one query block fills
    them, else 32 (a 64-token chunk's first 32-token block would be half causally masked)."""
    if training:
        return settings.forward.train_chunk
    return 64 if forward_block(groups, 64, settings) >= 64 else 32


def state_segment(chunks: int, settings: KernelSettings):
    """Chunks per segment of the segment walks over `chunks` chunks, or None to scan the states whole: the longest of
    at most `segment_longest` chunks that leaves `segments_least` segments, if not shorter than `segment_shortest`."""
    forward = settings.forward
    segment = forward.segment_longest
    while segment >= forward.segment_shortest and chunks < forward.segments_least * segment:
        segment //= 2
    return segment if segment >= forward.segment_shortest else None
