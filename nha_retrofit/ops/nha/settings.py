"""The kernels' tunable choices in one place: `CONFIG`, the settings every launch reads (block shapes, warps,
precisions, which kernels fuse or overlap), each with the measurement behind its default; `CONFIG_VARIANTS`,
named overrides that `benchmarks/ops.py --variants` times side by side and `tests/kernels` check against the
float64 reference; `FORWARD_KEYS`, the entries the forward reads; `state_segment`, the one setting that depends on
the sequence's length.

Change a setting for a whole run with `CONFIG.update(...)`, or by name with `variant_overrides` (the GPU tests and
`regreport.py` read NHA_KERNEL_VARIANT). Everything here is plain Python data: no kernel is compiled on import.
"""

CONFIG = {
    "num_warps_64": 8, "num_warps_128": 8, "num_stages": 3,  # launch settings of the fused kernel (3 stages
    # were 0.04 ms faster than 2 per 32K forward on the H200 in three calls, NOTES.md session 8; smem 48 -> 64 KB)
    "slot_precision": "bf16x3",  # its fp32 slot products (products.py: bf16x3, tf32x3, tf32; bf16x3 was 1.3 ms
    # faster than tf32x3 at 32K on the H200, NOTES.md session 5)
    "chunk": None,  # tokens per slot-state chunk (CS) of a forward without gradients (None: `inference_chunk`):
    # the intra-chunk products are [rows, CS] tiles, the states [T / CS + 1, M, D] per kv head; the slot backward's
    # and the fused forward's blocks must divide it
    "train_chunk": 32,  # ... of a forward whose backward will run (None: as without gradients): smaller [rows, CS]
    # tiles spill less in the slot backward, twice the chunks cost the state scans more (forward, reverse) and
    # double the kept states; at 32K on the H200 forward+backward 9.66-9.75 against 9.90-10.03 ms (NOTES.md
    # session 13)
    "fwd_block": None,  # query tokens per program of the fused kernel (a power of two <= CS; None: fwd_block(G))
    "fwd_rows": 128,  # rows (tokens x query heads per kv head) that fwd_block(G) aims at: at G = 4, 32-token
    # blocks (128 rows) made the forward 3.70 -> 2.34 ms at 32K on the H200 against 16-token blocks (64 rows)
    "fwd_slots_first": True,  # the fused kernel's slot part before its window part (fewer live tiles at once)
    "fwd_prefetch": 2,  # L2 prefetches the fused forward issues before its slot part (`_prefetch_l2`) in a forward
    # with segment-local states (`fwd_prefetch`): 1 the window's keys and values (read after the slot part), 2 also
    # the chunk's key and value states (0: none). On the H200, side by side, the 32K inference forward 1.678-1.686 ->
    # 1.626-1.634 ms at 2 (1.645-1.657 at 1, 1.719 with the states alone), 64K 3.32-3.34 -> 3.20-3.23; prefetching the
    # inputs of the program one wave later lost (1.93; NOTES.md session 28); 1.360-1.367 at 2 against 1.400-1.408 at 1
    # in session 39
    "train_fwd_prefetch": 1,  # ... in a training forward: at 2 the 32K step went 7.09-7.12 -> 7.05-7.09 ms in session
    # 28; since session 38's kernels 1 is ahead, with `window_dq_keys` and `keys_prefetch` below 6.058-6.073 ->
    # 6.009-6.013 ms (prefetch 1 alone -0.02; NOTES.md session 39)
    "value_precision": None,  # the slot part's P.V products (None: as slot_precision; "tf32" is enough for
    # o alone, but not for the backward's delta, so with it the delta pass runs instead of delta_from_output)
    "inference_value_precision": "bf16",  # ... of a forward without a backward, whose output alone reads them (None:
    # as value_precision): one MMA of the weights and the value state rounded to bf16, as flash attention's P . V.
    # On the H200 (side by side, NOTES.md session 28) 32K 1.626-1.632 -> 1.580 ms, 64K 3.20 -> 3.12, graph-replayed
    # 16K 0.835 -> 0.813, 4K 0.245 -> 0.236; TF32 1.66
    "inference_key_precision": "bf16",  # the slot logits' product with the key state before the chunk, q . Sk^T, in
    # a forward without a backward (None: as slot_precision): "bf16" rounds the state to bf16 for one MMA, as a bf16
    # model stores its keys (q is exact in bf16), and the chunk tokens' key weights in their product with the split
    # q . k. On the H200 side by side (NOTES.md session 30) 32K 1.572-1.581 -> 1.511-1.513 ms, 64K 3.11 -> 2.98; o's
    # error against float64 unchanged on the GPU (2.31-2.35e-3), +0-0.6% under the interpreter's GPU roundings
    "fwd_min_slot_tile": 64,  # the fused kernel's slot tiles are at least this wide (padding slots masked):
    # with 16 or 32 slots, D = 64 and 3-4 query heads per kv head, Triton 3.6 miscompiled it on the H200
    # (compute-sanitizer: an out-of-bounds shared-memory read in a slot product; wrong output or a fault;
    # NOTES.md session 5); 64-wide tiles never failed
    "block_factor_limit": 40.0,  # nats: a query block whose own tokens decay a slot by at most this takes them
    # in the factored matrix product; harder blocks walk them with direct weights (0: always direct)
    "slot_bwd_precision": "bf16x3",  # fp32 products of the slot backward (products.py; bf16x3 was 4.6 ms faster
    # than tf32x3 per 32K step on the H200)
    "slot_bwd_grad_precision": {"rows": "bf16", "keys": "bf16"},  # per slot-backward kernel ("rows": dq, "keys": dk
    # and dv), the precision of its products that form only those gradients (absent: as slot_bwd_precision): "bf16"
    # rounds their fp32 operands (the gradient weights dl and P, the states and the state gradients) to bf16 for one
    # MMA each, as flash attention's backward rounds dS and P; the logits, dP, E, UV and the state gradients keep
    # bf16x3 (the log_alpha and slot_bias gradients are cancellations). On the H200 side by side (NOTES.md session
    # 31) the 32K step 7.106-7.121 -> 6.835-6.879 ms (rows only 7.01, keys only 6.98-6.99)
    "slot_bwd_block": None,  # tokens per row block of the slot backward (None: slot_bwd.BQ = 16)
    "slot_bwd_warps": 4,  # warps of the slot backward kernels (4 was 4.0 ms faster than 8 at 32K on the H200,
    # despite more register spills)
    "slot_bwd_stages": 2,  # software-pipelining stages of its kernels (their loops over row blocks load Wk, Wv,
    # q and dO tiles per iteration; 2 prefetches the next block's into shared memory): 2 was 0.18-0.2 ms faster per
    # 32K step than 1 on the H200 once the kernels lost their mask loads (NOTES.md session 20)
    "slot_bwd_stages_block": 8192,  # ... for row blocks of at most this many rows x head-dim elements, 1 stage
    # above: at 128 rows x 128 (8 query heads per kv head) the merged key kernel needs 240 KB of shared memory with
    # 2 stages, more than the H200's 227 KB
    "slot_bwd_rows_block": 16,  # tokens per block of its rows kernel (None: slot_bwd_block; each program
    # loads the chunk's [M, D] states, as the forward's do): with the logits formed in the kernel 32 tokens with 8
    # warps were 0.2-0.3 ms faster per 32K step than 16 with 4 on the H200 (NOTES.md session 7); with the forward's
    # logits loaded (CONFIG["save_logits"]) 16 with 4 were 0.2 ms faster than 32 with 8 (session 17)
    "slot_bwd_rows_warps": 4,  # warps of its rows kernel (None: slot_bwd_warps)
    "slot_bwd_keys_warps": None,  # warps of its keys and keys_da kernels (None: slot_bwd_warps; with 8 and bf16x3
    # they spill 0 / 200 B instead of 384 / 1788 B in the register report; the rows kernel has its own setting)
    "slot_bwd_columns": (128, None),  # (columns, warps or None) per program of its state_grad and keys kernels
    # (at most D; None: (64, as the others)); each program recomputes its row blocks' [rows, CS] weights, so wider
    # is less of that: 128 columns were 1.2 ms faster than 64 per 32K step on the H200 (NOTES.md session 7)
    "slot_bwd_maxnreg": {},  # per slot-backward kernel ("rows", "state_grad", "keys"): a register cap per thread
    # (Triton's maxnreg), so more programs share a multiprocessor (each spills more; absent: uncapped). On the H200
    # at 32K state_grad capped at 168 (3 programs of 4 warps per multiprocessor instead of 2) was 8.71 against 8.78 ms
    # in session 17; since session 20's kernels uncapped is 0.07 ms faster per step (7.08 against 7.15, three
    # alternations; 8K 1.88 against 1.90; NOTES.md session 25); the rows kernel at 168 or 128 9.50, the merged key
    # kernel at 128 9.43 (session 17)
    "slot_bwd_merge_keys": True,  # dk and dv in one key kernel (False: one launch each, fewer registers)
    "slot_bwd_keys_merged_warps": 8,  # warps of `_keys_merged_kernel`, which does the keys and keys_da kernels'
    # work in one program per chunk (each row block's weights and rows loaded once for dk, dv and UV): 0.15 ms less
    # per 32K step than the two on the H200 (NOTES.md session 14); it needs D == DV, all D columns and all M slots in
    # one program, else (or with None) the two kernels run
    "keys_da_rows_block": False,  # True: a keys_da kernel (so not the merged one) takes the rows kernel's blocks and
    # warps (its UV and the rows kernel's E nearly cancel in the log_alpha gradient; the same blocks keep their
    # rounding alike: fp32 error 1.0e-5 -> 2.5e-6 under mixed decay in the interpreter; untimed)
    "keys_da_slots": 64,  # slots per program of the slot backward's keys_da kernel (None: all M in one program;
    # at M=128 that form hit an illegal memory access on the H200, NOTES.md)
    "window_bwd_block": 16,  # query tokens per block of the window backward's dq and delta kernels (None:
    # window_bwd.CQ = 16): 32 was ~0.1 ms faster per 32K step on the H200 with a delta pass; since the dq kernel
    # forms delta from the forward's output (delta_from_output) 16 is 0.08 ms faster (NOTES.md session 21)
    "window_dkv_block": 16,  # ... of its dkv kernel (None: window_bwd_block; at 32 its smem is 137 KB)
    "window_dq_keys": None,  # keys per tile of the window dq (and delta) kernel's loop (None: `window_bwd.dq_keys`,
    # 16 up to w = 64, else 32): a 16-token block's 79 keys at w = 64 in 3 tiles of 32 instead of 2 of 64 (session
    # 22), in 5 of 16 since session 39 (on the H200 the 32K step without keys_prefetch 6.042-6.046 -> 6.024-6.039 ms;
    # 32 at w = 512, where 16 made the step 9.08-9.09 -> 9.24-9.25 ms; NOTES.md session 39)
    "window_dkv_keys": None,  # keys per program of its dkv kernel (None: `window_bwd.dkv_keys`, 32 up to w = 64,
    # else 64). A program loads the (keys + w) / 16 query blocks its keys see: at w = 64, 6 blocks for 32 keys instead
    # of 8 for 64 (pairs computed 1.5x the window's, was 2x; spills 1808 -> 380 B), with window_dq_keys 32 the 32K
    # step on the H200 7.42-7.45 -> 7.25 ms (dq 0.58 -> 0.47, dkv 0.54 -> 0.48); at w = 512 32 keys load 17 query
    # blocks per key, 64 load 9: dkv 1.93 against 2.15 ms (NOTES.md session 22)
    "window_dkv_warps": None,  # warps of the window backward's key kernel (None: 4, or 8 for 128 rows; 8
    # spills less at D=128 in the register report)
    "scan_tile": None,  # (slots, columns) per program of the one-pass state scan and reverse scan (scan_segment
    # None; None: forward (16, 64), backward (M, 64): at M=64, D=128 only 8 / 2 programs per kv head)
    "update_block": 8192,  # state elements (slots x columns) per program of the chunk update: each program forms
    # its chunk's gate sums and weights again, so wider blocks do that less often; 128 columns at M=64 was 0.07 ms
    # faster per 32K forward than 64 on the H200 (NOTES.md session 20)
    "scan_segment": 16,  # chunks per segment of the chained state scan / reverse scan (chunk_scan.py; None:
    # one sequential pass over all chunks per tile; 16 was ~1.7 ms faster per 32K step on the H200)
    "state_segment": "auto",  # chunks per segment of the slot states of a forward that keeps none for a backward
    # (None: every state scanned, `slot_states`): one kernel walks each segment's chunks, stores the states local to
    # it and its end, a chained scan over the segments carries them, and the fused kernel adds the carry as it loads
    # a state (`local_slot_states`); the states cross DRAM once instead of three times. "auto": `state_segment`
    # below, the longest segment of at most state_segment_longest chunks that leaves 16 segments, scanned whole
    # below 16 chunks.
    # On the H200 (inference forward), side by side: 32K 1.80 -> 1.69 ms at 32 (16: 1.70, 8: 1.73, 4: 1.79), 64K
    # 3.56 -> 3.33, 8K 0.474 -> 0.449 at 16 (8: 0.458); from two tables (results/ops_h200.json at commits fe69b41 and
    # 9f65eb0, graph-replayed): 16K 0.92 -> 0.86, 8K 0.479 -> 0.482 and 4K 0.249 -> 0.292 at 32 (NOTES.md session 25)
    "walked_states": True,  # where `state_segment` gives a segment, the whole slot states (a training forward's,
    # kept for the backward) by two walks over segments (`chunk_fwd.walked_slot_states`: the first stores only each
    # segment's end, the second the states from the scanned ends) instead of the chunk update and the chained scan
    # over every chunk. On the H200, with segment_prefetch, side by side (three alternations): 32K step 5.998-6.019
    # -> 5.877-5.898 ms; the segment-local form in the training forward too (the fused kernel storing the whole
    # states it forms) 5.950-5.971, dropped (NOTES.md session 40)
    "segment_prefetch": True,  # the segment update walk loads each chunk's inputs one step ahead, so their latency
    # overlaps the chain of products (255 registers and 64 B spilled -> 251 and none in the register report). On the
    # H200 the 32K inference forward 1.41 -> 1.28 ms (its walk 0.31 -> 0.23; NOTES.md session 40)
    "state_segment_longest": 64,  # the longest segment "auto" takes: 64 from 1024 chunks on (32K tokens at 32-token
    # chunks). On the H200, side by side with 32: 32K forward 1.583-1.584 against 1.586-1.596 ms, 64K 3.116-3.128
    # against 3.129-3.147 (three alternations, NOTES.md session 29); sessions 26 and 29 (call 2) agree: 1.671-1.678
    # against 1.677-1.687, 1.572 against 1.585-1.587
    "segment_update_slots": None,  # slots per program of the segment-local states' update walk (None: all M): the
    # slots' updates are independent, so 32 halves each program's tiles (255 -> fewer registers) and doubles the
    # programs (untimed; 32-slot tiles are where Triton 3.6 miscompiled other kernels on the H200, NOTES.md session 25)
    "scan_block": 8192,  # elements (segment chunks x state columns x slots) per program of the chained scans,
    # held in registers, 64 per thread: 287 us per 32K training scan on the H200 against 335 with 8-chunk segments
    # of 4096 (NOTES.md session 19)
    "merge_kv_states": True,  # the key and the value states in one set of launches (when k and v share a layout):
    # 8 fewer launches per training step (host time at short T; ~0.05 ms per 32K step on the H200)
    "save_states": True,  # the backward reuses the forward's slot states instead of recomputing them: 0.53 ms
    # less per 32K step on the H200 (NOTES.md session 11) for 2 x [B, H, T/64 + 1, M, D] fp32 kept per layer, as
    # much memory as q (under gradient checkpointing only the layer being recomputed holds them); False recomputes
    "save_logits": True,  # with save_states, the training forward also keeps its scaled slot logits [B, T, HQ, M]
    # fp32 (G x CS / 2D of the states' memory at CS-token chunks: half at the Llama-3-8B shape, 256 MiB per layer
    # at 32K) and the rows kernel loads them instead of forming q against the states and the chunk's keys again;
    # False recomputes them
    "delta_from_output": True,  # a training forward keeps its output to fp32 accuracy (bf16/fp16: the window's
    # and the chunk tokens' weights split hi + lo in their products with v, and o's rounding residual stored), so
    # the window dq kernel forms delta = rowsum(dO * O) first (with a window; 0.19 ms less per 32K step on the
    # H200, NOTES.md session 21); False: a delta pass over the window forms the window share of sum P * dP and the
    # slot backward's rows kernel adds the slot share
    "overlap_window_dkv": 8192,  # from this many tokens (batch x length; None: never) the window backward's key
    # kernel runs on a second CUDA stream beside the slot backward (where delta is whole before either:
    # delta_from_output). On the H200 32K 7.22 -> 7.19 ms, 8K 1.928 -> 1.896, w = 512 32K 10.53 -> 10.42; at 4K,
    # host-bound, the fork and join cost more host time than they save (NOTES.md session 23)
    "keys_prefetch": False,  # the merged key kernel prefetches the rows it reads last (E, the window half's dv) into
    # L2 at its start (`slot_bwd.keys_prefetch`): 32K step 6.875-6.880 -> 6.843-6.851 ms on the H200; the same for
    # the rows kernel's keys and states lost 0.07 ms (NOTES.md, session 32). Since session 38's kernels it costs:
    # without it the step 6.058-6.073 -> 6.042-6.046 ms, the kernel 1.50 -> 1.475 (NOTES.md session 39)
    "fwd_whole_chunk_split": True,  # the fused forward's block split, where its query block is the whole chunk, from
    # the cumsum's last row (`chunk_fwd._fwd_kernel`): 32K inference forward 1.498-1.499 -> 1.384-1.387 ms on the H200
    # (NOTES.md, session 33)
    "keys_carry_split": True,  # the merged key kernel splits its row blocks from one cumsum row per block (the
    # block's end, carried as the next one's start) instead of two sums of the gates per block: 32K step 6.84 ->
    # 6.60-6.62 ms on the H200 (NOTES.md, sessions 32-33)
    "int8_residual": True,  # the training forward's rounding residual of o (delta_from_output) in int8, not o's
    # dtype: the difference of the fp32 output's and o's bit patterns, shifted (`chunk_fwd._residual_shift`; to 2^-15
    # of o in bf16, where a bf16 residual keeps ~2^-18): half its bytes, written by the forward and read by the window
    # dq kernel. On the H200 side by side the 32K step 6.18-6.21 -> 6.05-6.10 ms (training forward 1.333 -> 1.254,
    # window dq 0.467 -> 0.421; NOTES.md session 38)
    "rows_cumsum_split": True,  # the rows kernel's block split from two rows of the gates' cumsum, not two sums of
    # the gates (each a reduction across the warps over the chunk's tokens): 32K step 6.54-6.57 -> 6.45-6.46 ms on the
    # H200 (NOTES.md, session 33)
    "factored_carry_decay": True,  # the forward's and the rows kernel's decay of the chunk's carried state to each
    # row as exp(a_in) * exp(a_ref) (exp(a_in) is formed anyway), not exp(a_in + a_ref): rows kernel spills 252 ->
    # 128 B; 32K step 6.47-6.50 -> 6.36-6.37 ms, forward 1.38 -> 1.37 on the H200 (NOTES.md, sessions 33-34)
    "fwd_decays_late": True,  # the fused forward forms its slot products (q with the chunk's keys and the key state)
    # before the rows' decays and the chunk tokens' weights, which are then not live through them: training forward
    # spills 24 -> 8 B; on the H200 side by side the kernel 1.38 -> 1.33 ms, the 32K step 6.29-6.31 -> 6.22-6.28 ms,
    # the forward without a backward unchanged (NOTES.md, sessions 34-35)
    "keys_sides_apart": True,  # the merged key kernel loads and forms each row block's value-side weights after
    # its key side's products (fewer live tiles: spills 152 -> 32 B): the kernel 1.583 -> 1.547 ms at 32K on the
    # H200, the step 6.32 against 6.30-6.36 side by side (NOTES.md, session 34)
    "keys_rest_product": True,  # the merged key kernel forms a_end - a (the chunk's gates after each token) as one
    # product of its gates with a strictly upper 0/1 matrix, not their sum over the chunk's tokens (a reduction across
    # the warps) less a: 5152 -> 5080 instructions (spills 32 -> 48 B); on the H200 the 32K step 6.246-6.255 ->
    # 6.198-6.230 ms (four alternations, NOTES.md sessions 35-36)
    "shared_row_decays": False,  # a slot-backward kernel that forms each token's decay from its row block's start
    # stores them ([B, H, T, M] fp32), "rows" the rows kernel or "state_grad" the state_grad kernel (a second product
    # of the gates there), and the merged key kernel (with the same blocks) loads its rows' decays and its blocks'
    # ends from it instead of a scan over the rows and a row of the chunk's cumsum (reductions across the warps): on
    # the H200 at 32K with "rows" the merged key kernel 1.53 -> 1.47 ms, but the rows kernel 1.09 -> 1.13, the step
    # 6.23-6.26 against 6.23-6.25 (the chunk update as the store's producer instead: +0.044 ms there, the step the
    # same; NOTES.md session 36); with "state_grad" merged keys 1.48, state_grad 0.506 -> 0.536, the step
    # 6.24-6.26 against 6.25-6.26 (session 37)
    "state_grad_chunk_decay": True,  # the state_grad kernel forms each row's decay from the chunk's start in one
    # product of the chunk's gates (`_row_decay`; 64 slots or more), not from its block's start plus the gates before
    # the block (a reduction across the warps over the chunk's tokens per block): 2112 -> 1840 instructions, no
    # shuffles; on the H200 the kernel 0.513 -> 0.506 ms at 32K, the step 6.27-6.30 -> 6.26-6.27 (NOTES.md session 35;
    # its row weights loaded through `_load_rows` since, 1800 instructions, untimed)
    "fold_dv_sum": True,  # where the window dq kernel forms the whole delta (delta_from_output), the window's dv
    # is formed before the merged key kernel, which adds it to the slot half's and stores dv once in v's dtype (False:
    # the slot half's fp32 dv stored, then a PyTorch add of both)
    "maskless": True,  # without an attention mask the kernels get MASK = None, a specialization that loads no mask
    # (False: an all-ones mask, loaded as with padding)
    "fast_launch": True,  # launches through `fast_launch` (False: Triton's `kernel[grid](...)`, ~50 us more host
    # time per launch in Triton 3.6)
    "debug_sync": False,  # True (or NHA_KERNEL_SYNC=1): synchronize after every kernel launch and name the
    # kernel in a CUDA error (pins an asynchronous illegal memory access to its kernel; slow)
}

FORWARD_KEYS = {  # the CONFIG entries the forward reads (a variant of none of them changes only the backward)
    "chunk", "num_warps_64", "num_warps_128", "num_stages", "slot_precision", "fwd_block", "fwd_rows",
    "fwd_slots_first", "value_precision", "inference_value_precision", "inference_key_precision", "fwd_min_slot_tile",
    "block_factor_limit", "scan_tile", "scan_segment", "scan_block", "update_block", "merge_kv_states", "save_logits",
    "maskless", "delta_from_output", "state_segment", "segment_update_slots", "fwd_prefetch", "state_segment_longest",
    "segment_prefetch", "walked_states",
    "fwd_whole_chunk_split", "factored_carry_decay", "fwd_decays_late", "int8_residual",
    "train_fwd_prefetch",
}

CONFIG_VARIANTS = {  # named CONFIG overrides: timed side by side by benchmarks/ops.py, checked by tests/kernels
    "defaults": {},
    "values_tf32": dict(value_precision="tf32"),
    "inference_values_bf16x3": dict(inference_value_precision=None),  # the default before session 28
    "inference_keys_bf16x3": dict(inference_key_precision=None),  # the default before session 30
    "fwd_tf32": dict(slot_precision="tf32"),  # timing only: log_alpha 1.1e-2 at T=4097 (NOTES.md, session 19)
    "bwd_tf32": dict(slot_bwd_precision="tf32"),  # timing only: fails the log_alpha bound (NOTES.md, session 13)
    "tf32x3": dict(slot_precision="tf32x3", slot_bwd_precision="tf32x3"),
    "fwd_tf32x3": dict(slot_precision="tf32x3"),
    "bwd_tf32x3": dict(slot_bwd_precision="tf32x3"),
    "bwd_grads_bf16x3": dict(slot_bwd_grad_precision={}),  # the default before session 31
    "bwd_grads_bf16x3_rows": dict(slot_bwd_grad_precision={"keys": "bf16"}),  # only the rows kernel's in bf16x3
    "bwd_grads_bf16x3_keys": dict(slot_bwd_grad_precision={"rows": "bf16"}),  # only the key kernels' in bf16x3
    "tf32x3_window_first": dict(slot_precision="tf32x3", slot_bwd_precision="tf32x3", fwd_slots_first=False),
    "fwd_block8": dict(fwd_block=8),
    "fwd_block16": dict(fwd_block=16),
    "fwd_rows256": dict(fwd_rows=256),
    "fwd_warps4": dict(num_warps_64=4),
    "fwd_stages2": dict(num_stages=2),
    "fwd_window_first": dict(fwd_slots_first=False),
    "no_prefetch": dict(fwd_prefetch=0, train_fwd_prefetch=0),  # the default before session 28
    "prefetch_window": dict(fwd_prefetch=1),
    "train_prefetch_states": dict(train_fwd_prefetch=2),  # the default before session 39
    "direct_blocks": dict(block_factor_limit=0.0),
    "recompute_states": dict(save_states=False),
    "recompute_logits": dict(save_logits=False),
    "chunk32": dict(chunk=32),
    "chunk64": dict(chunk=64),  # the default before session 22
    "train_chunk64": dict(train_chunk=64),  # the training chunk before session 13
    "separate_kv_states": dict(merge_kv_states=False),
    "scan_one_pass": dict(scan_segment=None),
    "scan_one_pass_8x32": dict(scan_segment=None, scan_tile=(8, 32)),
    "scan_block_4096": dict(scan_block=4096),
    "update_block_4096": dict(update_block=4096),  # the default before session 20
    "ones_mask": dict(maskless=False),  # the default before session 20
    "delta_pass": dict(delta_from_output=False),  # the default before session 21
    "scan_segment_8": dict(scan_segment=8),
    "scanned_states": dict(state_segment=None),  # the default before session 25
    "state_segment4": dict(state_segment=4),
    "state_segment16": dict(state_segment=16),
    "state_segment32": dict(state_segment=32),
    "segment_update_slots32": dict(segment_update_slots=32),
    "no_segment_prefetch": dict(segment_prefetch=False),  # the default before session 40
    "scanned_train_states": dict(walked_states=False),  # the default before session 40
    "segment_longest32": dict(state_segment_longest=32),  # the default before session 29
    "scan_segment_32": dict(scan_segment=32),
    "window_dkv_8warps": dict(window_dkv_warps=8),
    "window_keys64": dict(window_dq_keys=64, window_dkv_keys=64),  # the default before session 22 (up to 64 rows)
    "window_dq_keys64": dict(window_dq_keys=64),
    "window_dkv_keys32": dict(window_dkv_keys=32),
    "window_dkv_keys64": dict(window_dkv_keys=64),
    "window_dq_keys16": dict(window_dq_keys=16),
    "window_dq_keys32": dict(window_dq_keys=32),  # the default before session 39 (at every window)
    "window_dkv_keys16": dict(window_dkv_keys=16),
    "window_bwd_block32": dict(window_bwd_block=32, window_dkv_block=32),
    "window_dq_block32": dict(window_bwd_block=32),  # the default before session 21
    "slot_bwd_8warps": dict(slot_bwd_warps=8),
    "slot_bwd_keys_8warps": dict(slot_bwd_keys_warps=8, slot_bwd_keys_merged_warps=None),
    "slot_bwd_block8": dict(slot_bwd_block=8),
    "slot_bwd_block32": dict(slot_bwd_block=32),
    "slot_bwd_rows32_4warps": dict(slot_bwd_rows_block=32, slot_bwd_rows_warps=4),
    "slot_bwd_rows32": dict(slot_bwd_rows_block=32, slot_bwd_rows_warps=8),  # sessions 7-16's rows kernel
    "slot_bwd_rows8": dict(slot_bwd_rows_block=8, slot_bwd_rows_warps=4),
    "slot_bwd_rows8_2warps": dict(slot_bwd_rows_block=8, slot_bwd_rows_warps=2),
    "slot_bwd_rows16_8warps": dict(slot_bwd_rows_block=16, slot_bwd_rows_warps=8),
    "slot_bwd_keys_block8": dict(slot_bwd_block=8, slot_bwd_rows_block=16),
    "slot_bwd_columns64": dict(slot_bwd_columns=None),
    "slot_bwd_columns128_8warps": dict(slot_bwd_columns=(128, 8)),
    "slot_bwd_stages1": dict(slot_bwd_stages=1),  # the default before session 20
    "slot_bwd_stages3": dict(slot_bwd_stages=3),  # 32K step 7.03 against 6.83 (NOTES.md session 31)
    "slot_bwd_split_keys": dict(slot_bwd_merge_keys=False),
    "keys_da_32slots": dict(keys_da_slots=32),
    "keys_da_8warps": dict(slot_bwd_keys_warps=8, slot_bwd_columns=(128, 4), slot_bwd_keys_merged_warps=None),
    "keys_da_rows_block": dict(keys_da_rows_block=True),
    "keys_separate": dict(slot_bwd_keys_merged_warps=None),  # the keys and keys_da kernels (before session 14)
    "keys_merged_4warps": dict(slot_bwd_keys_merged_warps=4),
    "state_grad_cap168": dict(slot_bwd_maxnreg={"state_grad": 168}),  # the default before session 25
    "rows_cap168": dict(slot_bwd_maxnreg={"rows": 168}),  # 32K step 7.37-7.40 against 6.84 (NOTES.md session 31)
    "keys_cap128": dict(slot_bwd_maxnreg={"keys": 128}),  # 7.97-8.00
    "keys_cap168_4warps": dict(slot_bwd_maxnreg={"keys": 168}, slot_bwd_keys_merged_warps=4),  # 9.09-9.13
    "overlap_dkv": dict(overlap_window_dkv=1),  # at every length (the tests' short sequences too)
    "serial_dkv": dict(overlap_window_dkv=None),  # the default before session 23
    "keys_prefetch": dict(keys_prefetch=True),  # the default in sessions 32-38
    "no_keys_carry_split": dict(keys_carry_split=False),  # the default before session 33
    "no_fwd_whole_chunk_split": dict(fwd_whole_chunk_split=False),  # the default before session 33
    "no_rows_cumsum_split": dict(rows_cumsum_split=False),  # the default before session 33
    "no_factored_carry_decay": dict(factored_carry_decay=False),  # the default before session 34
    "keys_sides_together": dict(keys_sides_apart=False),  # the default before session 34
    "fwd_decays_early": dict(fwd_decays_late=False),  # the default before session 35
    "state_grad_block_decay": dict(state_grad_chunk_decay=False),  # the default before session 35
    "keys_rest_sum": dict(keys_rest_product=False),  # the default before session 36
    "shared_row_decays": dict(shared_row_decays="rows"),
    "grad_row_decays": dict(shared_row_decays="state_grad"),
    "bf16_residual": dict(int8_residual=False),  # the default before session 38
    "dv_sum_apart": dict(fold_dv_sum=False),  # the default before session 23
    "triton_launch": dict(fast_launch=False),  # Triton's own launch path (host time only: the same kernels)
}


def state_segment(nch):
    """Chunks per segment of the segment-local slot states (`local_slot_states`) of a forward of nch chunks, or None
    to scan them whole: CONFIG["state_segment"], where "auto" takes the longest segment of at most
    CONFIG["state_segment_longest"] chunks that leaves 16 segments (fewer segments walk too few programs: at 4K
    tokens 32-chunk segments made the forward slower on the H200), scanned whole where that is under 16 chunks."""
    setting = CONFIG["state_segment"]
    if setting != "auto":
        return setting
    segment = CONFIG["state_segment_longest"]
    while segment >= 16 and nch < 16 * segment:
        segment //= 2
    return segment if segment >= 16 else None


def variant_overrides(name):
    """The CONFIG overrides of a CONFIG_VARIANTS name, or of several names joined by "+" (later ones win)."""
    overrides = {}
    for part in name.split("+"):
        if part not in CONFIG_VARIANTS:
            raise KeyError(f"unknown kernel variant {part!r}; known: {', '.join(CONFIG_VARIANTS)}")
        overrides.update(CONFIG_VARIANTS[part])
    return overrides
