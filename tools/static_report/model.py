"""Predicted H100 times at the benchmark shapes, from the counts of kernels.py. Predictions, not measurements.

The model (stated in the report too):
- Memory: bytes / 3.0 TB/s, the copy rate measured on the lent H100 (read + write counted). Bytes: the floor (each
  input read once, each output written once, plus the fp32 state checkpoints the WKV7 forward writes and the
  backward reads, one per 16 tokens), plus twice any scratch the SASS stores beyond the outputs (written once, read
  back once; at these shapes it outgrows the 50 MB L2), unless the scratch that the resident blocks keep live fits
  the L2 (Workload.scratch_per_block: the WKV7 backwards' sub-chunk states). Loads that lanes repeat are
  assumed served by L1/L2.
- Issue: thread instructions / 32 lanes / (132 SMs x 4 schedulers x 1 warp-instruction per cycle x 1.755 GHz),
  i.e. every instruction costs one issue slot (no dual issue, no stalls beyond the rate).
- Per-thread instructions. Streaming kernels (RoPE, decode step): the kernel's work path (entry to exit, every
  loop body once, the branches that store the most and, among those, the fewest instructions: slow paths such as
  the sincos range reduction are not taken) plus as many more iterations of the hot loop as the thread's share of
  the output needs. Sequential kernels (WKV7 forward/backward): per token, one iteration of every token loop
  (the forward's token loop, the backward's recompute and adjoint loops; loops nested in them taken as many times
  as they run per token, Workload.inner_trips), on its lean path (the forward's every-16th-token checkpoint store
  left out; its bytes are in the floor); the once-per-chunk and once-per-sequence code is not counted. The
  backwards name their token loops' trips per token instead (Workload.cuda_token_loops, triton_token_loops): the
  recompute loop runs 1.5 times per token (2.5 at N = 128), storing a state on (k + 1) / k of them in CUDA; in
  Triton, which stops before each sub-chunk's last token, 1 / k fewer times, storing on (k - 1) / k of them
  (sub-chunks of k tokens; the state before that last token is stored once per sub-chunk, not counted); the
  adjoint loop once, in CUDA on its work path (lane 0's gradient stores:
  every warp issues them), with a loop nested in it (N = 128: the column sum) taken Workload.inner_trips times.
  (Triton predicates that state store, which no SASS path counts: its scratch is the workload's,
  Workload.triton_scratch, under the same L2 rule.) The CUDA sequential kernels' token loops also run a branch that
  no path takes (no global store): threads 0..N-1 stage each token's inputs in shared memory. Its instructions (the
  loop body's static count less the work path's) are added in the share of warps that issue it
  (Workload.cuda_staging_share: N / threads).
- Sequential kernels are a dependent chain per token: a block cannot start token t+1 before token t. Occupancy
  (registers, shared memory, threads, 32 blocks per SM) gives the blocks resident per SM, hence w warps per
  scheduler. Per token a scheduler issues the I instructions of each of its w warps: >= w * I cycles (ILP enough to
  fill the pipelines). If every instruction waits for the previous one (4-cycle FMA latency) and each token exposes
  one DRAM load latency (~600 cycles, no prefetch), it takes max(w, 4) * I + 600 cycles. Time: T x the cycles
  summed over the waves of the grid (a partial last wave has fewer warps per scheduler).
- Chunked kernels (the CUDA chunked WKV7 forward) are the same dependent chain per chunk of 16 tokens instead of
  per token: per chunk, one iteration of the chunk loop on its work path (the checkpoint stored: training saves one
  per chunk) with each loop nested in it taken as many times as it runs per chunk (Workload.inner_trips), its
  once-per-sequence code not counted; the chain bounds as above with I the instructions per chunk and one DRAM
  latency per chunk.
- The CUDA chunked backward runs two launches, each its own row: the state cotangent pass (a chunked kernel as the
  forward) and the gradients kernel, a block per chunk and head whose loops run different trip counts, named per loop
  (Workload.cuda_loop_trips: a loop's own body counted its trips times those of the loops around it). Its chain:
  per wave of blocks, the bounds above with I the block's whole program.
- The Triton chunked kernels run in several launches, each its own row (their times add): programs of one chunk
  each (the forward's and backward's prep, the backward's gradients) and passes over the chunks in order (the
  forward's state pass, the backward's state cotangent pass). A one-chunk program searches for its sequence (its
  first loop: log2 of the sequences times, Workload.search_trips), then runs its 16-column slice loops N / 16 times
  each (a loop nested in one N / 16 times per outer iteration: Workload.loop_trips), is independent of
  every other (its chain per wave of programs, as the gradients kernel's), and its bytes are named by the workload,
  the temporary buffers between the launches included (the prep, the backward's per-chunk state cotangents). The
  passes are chunked kernels as above.
- Predicted = max(memory, issue, chain at its lower bound); the chain's upper bound is printed beside it. The
  Triton backward that splits the state's rows over programs (N = 256) writes fp32 partial sums of five gradients,
  which a second, memory-bound kernel adds after the first: its bytes' time is added to the prediction (and to the
  memory column), the partials' writes count in the first kernel's bytes.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from .sass import Path

SMS = 132
SCHEDULERS = 4
CLOCK_HZ = 1.755e9
COPY_BYTES_PER_S = 3.0e12
REGISTERS_PER_SM = 65536
REGISTER_GRANULE = 256      # registers are allocated per warp in units of 256
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
SHARED_PER_SM = 228 * 1024
SHARED_PER_BLOCK_RESERVED = 1024
FMA_LATENCY = 4
DRAM_LATENCY = 600          # cycles
CHECKPOINT_EVERY = 16       # tokens between the WKV7 forward's fp32 state checkpoints (csrc/include/ropewkv/wkv7.h)
L2_BYTES = 50 * 2 ** 20


@dataclass(frozen=True)
class Workload:
    title: str
    unit: str               # what "per unit" counts: "element" or "token-head"
    units: int
    read: int               # floor bytes
    written: int
    blocks: int             # CUDA blocks = Triton programs (both twins use the same grid)
    cuda: tuple = ()        # readable names of the CUDA kernels predicted here
    cuda_threads: int = 0   # threads per CUDA block (the launcher's)
    cuda_dynamic_shared: int = 0
    triton: tuple = ()      # kernels.TRITON entries predicted here
    tokens: int = 0         # > 0: a sequential recurrence over this many tokens per block
    cuda_blocks: int = 0    # CUDA blocks where its grid differs from Triton's (0: blocks)
    chunk: int = 0          # > 0: the recurrence steps this many tokens per iteration of the kernel's outer loop
    inner_trips: int = 0    # iterations per chunk (chunked) or per token (sequential) of each loop nested in that loop
    cuda_token_loops: tuple = ()  # CUDA, sequential: per token loop (address order), (work, lean) trips per token
    triton_token_loops: tuple = ()  # the same for the Triton kernel
    scratch_per_block: int = 0  # scratch bytes a block keeps live (L2-resident if all resident blocks' fit)
    triton_blocks: int = 0  # Triton programs where its grid differs from CUDA's (0: blocks)
    triton_scratch_per_block: int = 0  # the same for the Triton kernel (0: scratch_per_block)
    triton_scratch: int = 0  # the bytes the Triton kernel stores to its scratch (its stores are predicated)
    # A Triton backward that splits the state's rows over programs: the fp32 partial sums of the key-indexed
    # gradients it writes, and the bytes its second kernel (which adds them) reads (the partials, w again) and writes
    # (five of the gradients: out of the first kernel's share of the floor, into its own).
    triton_partials: int = 0
    triton_combine_read: int = 0
    triton_combine_written: int = 0
    # CUDA, sequential: the share of a block's warps that also issue what its token loops' work path leaves out (the
    # branch of the threads that stage each token's inputs in shared memory: no global store, so no path takes it).
    cuda_staging_share: float = 0.0
    # > 0: a program's work is one chunk, every loop taken this many times per iteration of the code around it.
    loop_trips: int = 0
    # > 0: but its first loop (address order), the binary search for the program's sequence, this many times.
    search_trips: int = 0
    # CUDA, a program's work is one chunk: each loop's trips per iteration of the code around it, loops in address
    # order (where they differ; loop_trips where they do not).
    cuda_loop_trips: tuple = ()


def _rope() -> Workload:
    b, s, hq, hk, d = 8, 4096, 32, 8, 128
    elements = b * s * (hq + hk) * d
    # CUDA (NeoX; GPT-J has twice the units, each half the bytes): a thread per (token, unit) walking all 40 heads
    # (ropewkv/rope.h's thread map: 8 units of 2 x 8 dims at D 128 bf16; one head group at this many tokens).
    units = (d // 2) // 8
    return Workload(f"RoPE fwd B{b} S{s} Hq{hq} Hk{hk} D{d} bf16 (bwd: the same kernel, conjugate)", "element",
                    elements, 2 * elements, 2 * elements, b * s,
                    cuda=("rope_kernel<bf16_t, kFP32, true, false>",),
                    cuda_threads=128, cuda_blocks=b * s * units // 128, triton=("rope neox bf16", "rope gptj bf16"))


def _wkv7(backward: bool, heads: int, n: int, constants: dict, cuda: bool = True) -> Workload:
    """The sequential WKV7 kernels. The CUDA forward (csrc/wkv7/wkv7_kernels.cuh) runs ForwardLanes' threads per block;
    the backward BackwardLanes', and it recomputes each 16-token chunk in sub-chunks of k tokens
    (wkv7_backward_sub_chunk), keeping k + 1 states per block: constants.cu prints those (`constants`). The Triton
    kernels' rows per program, warps and sub-chunk are read from their module. cuda=False: Triton only (N = 256)."""
    from ropewkv.triton_kernels.rwkv7 import recurrent

    b, t = 8, 4096
    tensor = b * t * heads * n * 2  # one bf16 [B, T, H, N]
    checkpoints = t // CHECKPOINT_EVERY * b * heads * n * n * 4
    state = b * heads * n * n * 4
    if backward:  # r w k v a b dy and the checkpoints in; six gradients and the initial state's out
        read, written = 7 * tensor + checkpoints, 6 * tensor + state
    else:  # r w k v a b in; y, the checkpoints and the final state out
        read, written = 6 * tensor, tensor + checkpoints + state
    direction = "bwd" if backward else "fwd"

    def recompute(sub):  # iterations per token of a backward's recompute loop with sub-chunks of sub tokens
        return sum(range(sub, CHECKPOINT_EVERY + 1, sub)) / CHECKPOINT_EVERY

    cuda_fields = {}
    if cuda:
        sizes = constants["head_sizes"][str(n)]
        sub, threads = sizes["sub_chunk"], sizes["backward_threads" if backward else "forward_threads"]
        storing = (sub + 1) / sub
        # A column sum over more columns per thread than its unroll is a loop nested in the adjoint loop (N = 128).
        column_trips = sizes["backward_cols"] // constants["column_unroll"] if backward else 0
        cuda_fields = dict(cuda=(f"{'backward' if backward else 'forward'}_kernel<{n}, bf16_t, bf16_t, kFP32>",),
                           cuda_threads=threads, cuda_staging_share=n / threads,  # threads 0..n-1 stage
                           cuda_token_loops=((storing, recompute(sub) - storing), (1, 0)) if backward else (),
                           inner_trips=column_trips if column_trips > 1 else 0,
                           scratch_per_block=(sub + 1) * n * n * 4 if backward else 0)  # k + 1 states
    triton_sub = recurrent.sub_chunk(n)
    triton_stored = (triton_sub - 1) / triton_sub  # states the Triton recompute stores per token
    rows = (recurrent.BWD_ROWS_AND_WARPS if backward else recurrent.FWD_ROWS_AND_WARPS)[n][0]
    row_blocks = n // rows
    split = backward and row_blocks > 1
    partials = row_blocks * 5 * (tensor // 2) * 4 if split else 0
    return Workload(f"WKV7 {direction} B{b} T{t} H{heads} N{n} bf16", "token-head", b * t * heads, read, written,
                    b * heads, triton=(f"wkv7 {direction} N{n} bf16",), tokens=t,
                    # Triton's adjoint works from S_{t-1} alone (the state before the token) instead of keeping S_t,
                    # so its recompute stops before a sub-chunk's last token, storing the state before each of the
                    # others: k - 1 stores in recompute(k) - 1 / k steps per token.
                    triton_token_loops=((triton_stored, recompute(triton_sub) - 1), (0, 1)) if backward else (),
                    triton_blocks=b * heads * row_blocks,
                    triton_scratch_per_block=triton_sub * rows * n * 4 if backward else 0,  # k states' rows
                    triton_scratch=round(b * t * heads * n * n * 4 * triton_stored) if backward else 0,
                    triton_partials=partials, triton_combine_read=partials + tensor if split else 0,
                    triton_combine_written=5 * tensor if split else 0, **cuda_fields)


def _masked_trips(constants: dict, n: int, low_precision: bool) -> int:
    return constants["head_sizes"][str(n)]["chunked_masked_trips_bf16" if low_precision else "chunked_masked_trips"]


def _wkv7_chunked(heads: int, n: int, constants: dict, low_precision: bool = False) -> Workload:
    """The chunked CUDA forward (csrc/wkv7/wkv7_chunked_kernels.cuh): a block per (sequence, head, kValueSlice<N, P>
    value rows) of kThreads threads (constants.cu prints both); per chunk its masked-product loop runs 9 times (the
    16-lane groups' pairs of chunk rows within a half; the pairs across the halves apart, an mma in the bf16 mode), 17
    in the fp32 mode at N = 128 (the whole chunk): constants.cu's chunked_masked_trips per head size. Its floor is the
    sequential forward's (each slice's block reads the head's r, w, k, a, b again: from L2, as the model assumes of
    repeated loads). low_precision: precision="bf16", whose v-dependent products run on tensor cores (each HMMA
    counted as one issue slot)."""
    sequential = _wkv7(False, heads, n, constants)
    sizes = constants["head_sizes"][str(n)]
    b, t = 8, 4096
    slice_rows = sizes["chunked_value_slice_bf16" if low_precision else "chunked_value_slice"]
    mode = "kBF16" if low_precision else "kFP32"
    return Workload(f"WKV7 chunked fwd{' (bf16 mode)' if low_precision else ''} B{b} T{t} H{heads} N{n} bf16",
                    "token-head", sequential.units, sequential.read, sequential.written, b * heads * (n // slice_rows),
                    cuda=(f"chunked_forward_kernel<{n}, bf16_t, bf16_t, {mode}>",),
                    cuda_threads=constants["chunked_threads"], tokens=t, chunk=CHECKPOINT_EVERY,
                    inner_trips=_masked_trips(constants, n, low_precision))


def _wkv7_chunked_backward(heads: int, n: int, constants: dict, low_precision: bool = False) -> list:
    """The chunked CUDA backward (csrc/wkv7/wkv7_chunked_backward_kernels.cuh): the state cotangent pass (a chunked
    kernel as the forward, on its grid of kValueSlice<N, P> value rows, the masked-product loop 9 (17) times per chunk;
    r, w, k, a, b, dy in, the cotangent before each chunk out, shaped as the checkpoints) and the gradients kernel (a
    block per chunk and head; r..b, dy, the checkpoints and the cotangents in, six gradients out). The gradients
    kernel's loops, in address order: the search for the window's first sequence (no trips without cu_seqlens), the
    pieces of sequences in the window (1), the masked products (9, or 17), the passes over the value rows (N / rows),
    then each pass's three row products over k (fp32 mode, where not unrolled in full: constants.cu's
    chunked_row_product_trips) and contraction over the rows, or its row-product jobs and substitution jobs (bf16
    mode: 3 and 2 per 16 rows, the 4 warps taking them in turn: the mean per warp); the loads of S_0 and G rows are
    unrolled.
    low_precision: precision="bf16", whose state step, row products, substitutions and contractions run on tensor
    cores (each HMMA one issue slot)."""
    sequential = _wkv7(True, heads, n, constants)
    sizes = constants["head_sizes"][str(n)]
    b, t = 8, 4096
    tensor = b * t * heads * n * 2
    cotangents = t // CHECKPOINT_EVERY * b * heads * n * n * 4
    state = b * heads * n * n * 4
    slice_rows = sizes["chunked_value_slice_bf16" if low_precision else "chunked_value_slice"]
    rows = sizes["chunked_gradient_rows"]
    title = f"{' (bf16 mode)' if low_precision else ''} B{b} T{t} H{heads} N{n} bf16"
    units = dict(unit="token-head", units=sequential.units)
    threads = constants["chunked_threads"]
    row_products = (sizes["chunked_row_product_trips"],) * 3 if sizes["chunked_row_product_trips"] else ()
    jobs = (3 * (rows // 16) / (threads // 32), 2 * (rows // 16) / (threads // 32)) if low_precision else (
        *row_products, rows)
    mode = "kBF16" if low_precision else "kFP32"
    masked = _masked_trips(constants, n, low_precision)
    gradients = Workload(f"WKV7 chunked bwd gradients{title}",
                         read=7 * tensor + 2 * cotangents, written=6 * tensor, blocks=b * t // CHECKPOINT_EVERY * heads,
                         cuda=(f"chunked_gradients_kernel<{n}, bf16_t, bf16_t, {mode}>",), cuda_threads=threads,
                         cuda_dynamic_shared=sizes["chunked_gradient_shared"],
                         cuda_loop_trips=(0, 1, masked, n // rows, *jobs), **units)
    return [Workload(f"WKV7 chunked bwd state pass{title}", read=6 * tensor, written=cotangents + state,
                     blocks=b * heads * (n // slice_rows), cuda=(
                         f"chunked_state_cotangent_kernel<{n}, bf16_t, bf16_t, {mode}>",),
                     cuda_threads=threads, tokens=t, chunk=CHECKPOINT_EVERY, inner_trips=masked, **units),
            gradients]


def _wkv7_chunked_triton(heads: int, n: int) -> list:
    """The chunked Triton kernels (triton_kernels/rwkv7/chunked.py), one workload per launch: forward prep and state
    pass, the backward's state cotangent pass and gradients (its prep is the forward's, with four more L x L blocks
    stored). The bytes between launches are the module's own buffer sizes."""
    from ropewkv.triton_kernels.rwkv7 import chunked

    b, t, length = 8, 4096, chunked.CHUNK
    tensor = b * t * heads * n * 2
    slots = chunked.checkpoint_slots(b * t, b)
    chunk_heads = slots * heads
    prep, prep_bwd = (chunk_heads * chunked.prep_floats(n, backward) * 4 for backward in (False, True))
    checkpoints = chunk_heads * n * n * 4  # as the state cotangents the backward stores per chunk
    state = b * heads * n * n * 4
    pass_blocks = b * heads * (n // chunked.VALUE_BLOCK[n])
    title = f"B{b} T{t} H{heads} N{n} bf16"
    per_chunk = dict(unit="token-head", units=b * t * heads, loop_trips=n // 16, search_trips=(b - 1).bit_length(),
                     blocks=chunk_heads)
    in_order = dict(unit="token-head", units=b * t * heads, tokens=t, chunk=length, inner_trips=n // 16,
                    blocks=pass_blocks)
    found = [Workload(f"WKV7 chunked fwd prep {title}", read=5 * tensor, written=prep,
                      triton=(f"wkv7 chunked fwd prep N{n} bf16",), **per_chunk),
             Workload(f"WKV7 chunked fwd state pass {title}", read=prep + tensor, written=tensor + checkpoints + state,
                      triton=(f"wkv7 chunked fwd state N{n} bf16",), **in_order)]
    found += [Workload(f"WKV7 chunked bwd state pass {title}", read=prep_bwd + tensor, written=checkpoints + state,
                       triton=(f"wkv7 chunked bwd state N{n} bf16",), **in_order),
              # r w k v a b dy, the checkpoints, the state cotangents and the prep in; six gradients out.
              Workload(f"WKV7 chunked bwd gradients {title}", read=7 * tensor + 2 * checkpoints + prep_bwd,
                       written=6 * tensor, triton=(f"wkv7 chunked bwd N{n} bf16",), **per_chunk)]
    return found


def _decode() -> Workload:
    b, heads, n = 256, 64, 64
    state = b * heads * n * n * 4
    vectors = b * heads * n * 2
    return Workload(f"WKV7 decode step B{b} H{heads} N{n} bf16 (state fp32, in place)", "token-head", b * heads,
                    state + 6 * vectors, state + vectors, b * heads, cuda=("step_kernel<64, bf16_t, bf16_t, kFP32>",),
                    cuda_threads=n * n // 32, triton=("wkv7 decode N64 bf16",))


def _log_decay(backward: bool) -> Workload:
    """RWKV-7's raw decay over a [8, 4096, 4096] bf16 tensor: fp32 out (forward); fp32 gradient and bf16 x in, bf16
    gradient out (backward). CUDA: 256 threads, each one 16-byte vector of 8 elements; Triton: 1024 per program."""
    n = 8 * 4096 * 4096
    read, written = (6 * n, 2 * n) if backward else (2 * n, 4 * n)
    direction = "bwd" if backward else "fwd"
    return Workload(f"log_decay {direction} {n:,} elements bf16 (fp32 log decay)", "element", n, read, written,
                    n // 1024, cuda=(f"log_decay_{'backward' if backward else 'forward'}_kernel<bf16_t, true>",),
                    cuda_threads=256, cuda_blocks=n // 8 // 256, triton=(f"log_decay {direction} bf16",))


def workloads(constants: dict) -> list:
    """The benchmark shapes, given the WKV7 CUDA kernels' launch constants (cuda.wkv7_constants)."""
    return [_rope(), _wkv7(False, 64, 64, constants), _wkv7(True, 64, 64, constants), _wkv7(False, 32, 128, constants),
            _wkv7(True, 32, 128, constants),
            # N = 256 runs on Triton only (`auto` sends CUDA there).
            _wkv7(False, 16, 256, constants, cuda=False), _wkv7(True, 16, 256, constants, cuda=False),
            _wkv7_chunked(64, 64, constants), _wkv7_chunked(32, 128, constants),
            _wkv7_chunked(64, 64, constants, low_precision=True), _wkv7_chunked(32, 128, constants, low_precision=True),
            *_wkv7_chunked_backward(64, 64, constants), *_wkv7_chunked_backward(32, 128, constants),
            *_wkv7_chunked_backward(64, 64, constants, low_precision=True),
            *_wkv7_chunked_backward(32, 128, constants, low_precision=True),
            *_wkv7_chunked_triton(64, 64),
            *_wkv7_chunked_triton(32, 128), _decode(), _log_decay(False),
            _log_decay(True)]


@dataclass
class Prediction:
    workload: str
    kernel: str
    per_unit: float          # thread instructions per element or per token-head
    per_token: int | None    # sequential: instructions one thread executes per token (its critical path)
    bytes: int               # floor + scratch traffic
    scratch: int             # bytes stored beyond the outputs (written, then read back)
    floor_s: float           # the floor's bytes at the copy rate
    memory_s: float
    issue_s: float
    blocks_per_sm: int       # the occupancy limit
    waves: int
    warps_per_scheduler: int  # in the first wave
    chain_s: tuple | None    # sequential: (lower, upper) bound of the dependent chain
    predicted_s: float

    @property
    def copy_fraction(self) -> float:
        """The floor's time over the predicted time: the share of the copy rate the kernel's useful bytes reach."""
        return self.floor_s / self.predicted_s


def kernels_of(workload: Workload, kernels: list) -> list:
    """The kernels the workload names (CUDA by readable name, Triton by registry entry), in that order."""
    found = []
    for twin, names in (("cuda", workload.cuda), ("triton", workload.triton)):
        for name in names:
            match = [k for k in kernels if k.twin == twin and k.name == name]
            if len(match) != 1:
                raise LookupError(f"{workload.title}: {len(match)} {twin} kernels named {name!r}; update "
                                  "tools/static_report/model.py (or kernels.TRITON) to the kernels as they are now")
            found += match
    return found


def blocks_per_sm(registers: int, threads: int, shared: int) -> int:
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_PER_BLOCK_RESERVED)
    return max(0, min(BLOCKS_PER_SM, THREADS_PER_SM // (warps * 32), by_registers, by_shared))


def chunk_iteration(kernel, workload: Workload) -> Path:
    """One iteration of the kernel's chunk loop (its one outer loop) on its work path, with each loop nested in it
    taken workload.inner_trips times."""
    if len(kernel.outer_loops) != 1:
        raise LookupError(f"{kernel.key}: {len(kernel.outer_loops)} outer loops, the chunked model expects one (the "
                          "chunk loop); update tools/static_report/model.py to the kernel as it is now")
    outer = kernel.outer_loops[0]
    more = sum((inner.work for inner in outer.inner), start=Path())
    return outer.work + _times(more, workload.inner_trips - 1)


def program_with_loop_trips(kernel, trips: tuple | int, search_trips: int = 0) -> Path:
    """A program's work path with each loop (kernel.loops and kernel.outer_loops in address order) taken trips[i]
    times per iteration of the code around it (or every loop `trips` times, the first `search_trips` times if given):
    a loop's own body (without the loops nested in it) counted the product of its trips and those of every loop
    around it."""
    loops = sorted(kernel.loops + kernel.outer_loops, key=lambda loop: loop.address)
    if isinstance(trips, int):
        trips = (search_trips or trips, *(trips,) * (len(loops) - 1)) if loops else ()
    if len(loops) != len(trips):
        raise LookupError(f"{kernel.key}: {len(loops)} loops, the model names trips for {len(trips)}; update "
                          "tools/static_report/model.py to the kernel as it is now")

    def members(loop) -> set:  # the innermost loops in it (itself, if innermost)
        return {id(i) for i in loop.inner} or {id(loop)}

    def around(loop) -> list:  # the loops it is nested in
        return [other for other in kernel.outer_loops if other is not loop and members(loop) <= members(other)
                and other.instructions > loop.instructions]

    total = kernel.work
    for loop, trip in zip(loops, trips):
        # the loops directly in it: every loop around them is this one or around this one
        nested = [other for other in loops if other is not loop and loop in around(other)
                  and all(mid is loop or mid in around(loop) for mid in around(other))]
        body = sum((_times(inner.work, -1) for inner in nested), start=loop.work)
        times = trip * math.prod(trips[loops.index(outer)] for outer in around(loop))
        total = total + _times(body, times - 1)
    return total


def token_iteration(kernel, workload: Workload) -> Path:
    """One token of a sequential kernel on its lean path. The loops that run once per token are the innermost loops
    and the outer loops nested in another outer loop (a token loop around loops that run within each token), the
    latter with each loop nested in it taken workload.inner_trips times; the outermost loops step over chunks of
    tokens and are not counted. A kernel whose workload names its token loops' trips takes those instead."""
    outer = kernel.outer_loops
    nested = [loop for loop in outer
              if any({id(i) for i in loop.inner} < {id(i) for i in other.inner} for other in outer)]
    if nested and workload.inner_trips < 1:
        raise LookupError(f"{kernel.key}: loops nested in its token loop but no Workload.inner_trips; update "
                          "tools/static_report/model.py to the kernel as it is now")
    inside = {id(i) for loop in nested for i in loop.inner}
    token_loops = sorted(nested + [loop for loop in kernel.loops if id(loop) not in inside],
                         key=lambda loop: loop.address)

    def taken(loop, path: str) -> Path:  # one iteration ("work" or "lean"), each loop nested in it inner_trips times
        return getattr(loop, path) + _times(sum((getattr(i, path) for i in loop.inner), start=Path()),
                                            workload.inner_trips - 1)

    share = workload.cuda_staging_share if kernel.twin == "cuda" else 0.0

    def staging(loop, trips: float) -> Path:  # the branches the work path leaves out, in the staging warps
        return Path(instructions=(loop.instructions - loop.work.instructions) * share * trips)

    named = workload.cuda_token_loops if kernel.twin == "cuda" else workload.triton_token_loops
    if named:
        if len(token_loops) != len(named):
            raise LookupError(f"{kernel.key}: {len(token_loops)} token loops, the model names {len(named)}; update "
                              "tools/static_report/model.py")
        return sum((_times(taken(loop, "work"), work) + _times(taken(loop, "lean"), lean) + staging(loop, work + lean)
                    for loop, (work, lean) in zip(token_loops, named)), start=Path())
    return sum((taken(loop, "lean") + staging(loop, 1) for loop in token_loops), start=Path())


def _times(path: Path, count: float) -> Path:
    return Path(path.instructions * count, path.loaded * count, path.stored * count, path.stored_unmasked * count,
                Counter({access: n * count for access, n in path.accesses.items()}), path.barriers * count)


def predict(kernel, workload: Workload) -> Prediction:
    threads = kernel.threads or workload.cuda_threads
    triton = kernel.twin == "triton"
    if triton:
        blocks = workload.triton_blocks or workload.blocks
        scratch_per_block = workload.triton_scratch_per_block or workload.scratch_per_block
    else:
        blocks = workload.cuda_blocks or workload.blocks
        scratch_per_block = workload.scratch_per_block
    shared = kernel.shared + (workload.cuda_dynamic_shared if kernel.twin == "cuda" else 0)
    resident = blocks_per_sm(kernel.registers, threads, shared)
    if resident == 0:
        raise ValueError(f"{kernel.key}: a block of {threads} threads with {kernel.registers} registers and {shared} B "
                         "of shared memory does not fit an SM")
    # The warps per scheduler in each wave of the grid.
    waves = []
    for first in range(0, blocks, SMS * resident):
        in_flight = min(SMS * resident, blocks - first)
        waves.append(math.ceil(math.ceil(in_flight / SMS) * math.ceil(threads / 32) / SCHEDULERS))
    if workload.tokens:
        if workload.chunk:
            steps = math.ceil(workload.tokens / workload.chunk)
            per_step = chunk_iteration(kernel, workload)
        else:
            steps, per_step = workload.tokens, token_iteration(kernel, workload)
        thread_instructions = per_step.instructions * steps * blocks * threads
        stored = per_step.stored_unmasked * steps * blocks * threads
        scratch = workload.triton_scratch if triton else max(0, stored - workload.written)
        low = sum(max(w, 1) * per_step.instructions for w in waves)
        high = sum(max(w, FMA_LATENCY) * per_step.instructions + DRAM_LATENCY for w in waves)
        chain = (steps * low / CLOCK_HZ, steps * high / CLOCK_HZ)
        per_token = Path(instructions=round(per_step.instructions * steps / workload.tokens))
    elif loop_trips := (workload.cuda_loop_trips if not triton else ()) or workload.loop_trips:
        per_token, scratch = None, 0
        program = program_with_loop_trips(kernel, loop_trips, workload.search_trips).instructions
        thread_instructions = program * blocks * threads
        # Each wave's blocks run their whole program as one chain (I = the program's instructions, one exposed DRAM
        # latency): the bounds of the chunked kernels, per wave instead of per chunk.
        chain = (sum(max(w, 1) * program for w in waves) / CLOCK_HZ,
                 sum(max(w, FMA_LATENCY) * program + DRAM_LATENCY for w in waves) / CLOCK_HZ)
    else:
        per_token, chain, scratch = None, None, 0
        share = workload.written / (blocks * threads)  # output bytes one thread stores
        hot = kernel.hot_loop
        more = max(0.0, share - kernel.work.stored) / hot.work.stored if hot else 0.0
        thread_instructions = (kernel.work.instructions + more * (hot.work.instructions if hot else 0)) \
            * blocks * threads
    floor = workload.read + workload.written
    if 0 < SMS * resident * scratch_per_block <= L2_BYTES:
        scratch_traffic = 0  # the scratch stays in L2
    else:
        scratch_traffic = 2 * scratch
    # A second kernel that adds the first one's partial sums runs after it: its bytes' time adds to the first's.
    partials, combine = (workload.triton_partials - workload.triton_combine_written,
                         workload.triton_combine_read + workload.triton_combine_written) if triton else (0, 0)
    first_memory = (floor + scratch_traffic + partials) / COPY_BYTES_PER_S
    memory = first_memory + combine / COPY_BYTES_PER_S
    issue = thread_instructions / 32 / (SMS * SCHEDULERS * CLOCK_HZ)
    return Prediction(workload.title, kernel.key, thread_instructions / workload.units,
                      per_token.instructions if per_token else None, floor + scratch_traffic + partials + combine,
                      scratch, floor / COPY_BYTES_PER_S, memory, issue, resident, len(waves), waves[0], chain,
                      max(first_memory, issue, chain[0] if chain else 0.0) + combine / COPY_BYTES_PER_S)
