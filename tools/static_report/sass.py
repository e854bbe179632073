"""What ptxas emitted: its resource report (-v) and the SASS as cuobjdump prints it, read into a control-flow graph
with natural loops and the paths through them.

Loops are found on the graph (dominators and back edges), not from address ranges, so out-of-line code that nvcc
places after a loop (slow paths, the int64 division routine reached by CALL) is never counted as the loop's.

A path (through one loop iteration, or through the kernel with every loop body taken at most once) is summarised by
the global bytes it stores per thread: `paths()` returns, for each reachable total, the path with the fewest
instructions. Branches that only add instructions (a sincos range-reduction slow path, a 64-bit division) are then
left out, and the caller picks which total it wants: the work path of a streaming kernel stores what its thread must
store; the lean path of a sequential token loop skips a periodic checkpoint store.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*(.*?)\s*;")
_ADDRESS = re.compile(r"0x([0-9a-f]+)\s*$")
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
_PTXAS_FIGURES = {
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "registers": re.compile(r"Used (\d+) registers"),
    "shared": re.compile(r"(\d+) bytes smem"),
}
# Bytes one lane moves, by width suffix; a memory instruction without one moves 4.
_WIDTHS = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
# Global memory: LD/ST are generic accesses (nvcc emits them when it cannot prove the space), LDGSTS the async
# global-to-shared copy, RED/ATOM global atomics. LDL/STL: local memory (the stack: spills and indexed arrays).
GLOBAL_LOADS = frozenset({"LDG", "LD", "LDGSTS"})
GLOBAL_STORES = frozenset({"STG", "ST", "RED", "REDG", "ATOM", "ATOMG"})
LOCAL = frozenset({"LDL", "STL"})
# Tensor-core instructions: warp-level mma (HMMA, IMMA, DMMA, BMMA) and Hopper's warpgroup mma (HGMMA and kin).
TENSOR_CORE = frozenset({"HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA"})
_BRANCHES = frozenset({"BRA", "JMP"})
_ENDS = frozenset({"BRA", "JMP", "BRX", "JMX", "EXIT", "RET", "KILL"})


def ptxas_resources(log: str) -> dict[str, dict[str, int]]:
    """ptxas -v's report -> {mangled entry name: registers, stack, spill_stores, spill_loads, shared (static)}."""
    resources: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if match := _PTXAS_ENTRY.search(line):
            current = resources.setdefault(match.group(1), dict.fromkeys(_PTXAS_FIGURES, 0))
        elif match := _PTXAS_FUNCTION.search(line):  # a device function called by the entry has its own figures
            current = resources.get(match.group(1))
        elif current is not None:
            for figure, pattern in _PTXAS_FIGURES.items():
                if match := pattern.search(line):
                    current[figure] = int(match.group(1))
    return resources


@dataclass
class Instruction:
    address: int
    predicate: str  # "" when unconditional
    opcode: str     # with its modifiers, e.g. LDG.E.128.CONSTANT
    operands: str

    @property
    def mnemonic(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def access_bytes(self) -> int:
        return next((_WIDTHS[m] for m in self.opcode.split(".")[1:] if m in _WIDTHS), 4)

    @property
    def access(self) -> str:
        """A memory instruction as the report names it: its mnemonic and width, e.g. LDG.U16, STG.128, LDL.32."""
        width = self.access_bytes
        return f"{self.mnemonic}.{ {1: 'U8', 2: 'U16'}.get(width, str(8 * width)) }"

    @property
    def conditional(self) -> bool:
        """Predicated (other than @PT), or a branch on a predicate operand (BRA !P2, 0x...)."""
        return (bool(self.predicate) and "PT" not in self.predicate) or "P" in self.operands.split("0x")[0]

    def target(self) -> int | None:
        match = _ADDRESS.search(self.operands)
        return int(match.group(1), 16) if match else None


def parse(text: str) -> dict[str, list[Instruction]]:
    """cuobjdump -sass output -> {mangled function name: its instructions in address order}."""
    functions: dict[str, list[Instruction]] = {}
    current = None
    for line in text.splitlines():
        if match := _FUNCTION.match(line):
            current = functions.setdefault(match.group(1), [])
        elif current is not None and (match := _INSTRUCTION.match(line)):
            address, predicate, opcode, operands = match.groups()
            current.append(Instruction(int(address, 16), (predicate or "").strip(), opcode, operands))
    return functions


@dataclass(frozen=True)
class Path:
    """Totals of one path, per thread: instructions issued (a CALL adds its callee's fewest), global bytes loaded and
    stored (`stored_unmasked`: by unpredicated stores, i.e. not a masked or deduplicated output), and the count of
    each global and local memory access (e.g. {"LDG.128": 4, "STG.128": 4}), and the block-wide barriers waited at
    (BAR.SYNC: a shared-memory round trip across warps, on the per-token chain of a sequential kernel)."""
    instructions: int = 0
    loaded: int = 0
    stored: int = 0
    stored_unmasked: int = 0
    accesses: Counter = field(default_factory=Counter)
    barriers: int = 0

    def __add__(self, other: Path) -> Path:
        return Path(self.instructions + other.instructions, self.loaded + other.loaded, self.stored + other.stored,
                    self.stored_unmasked + other.stored_unmasked, self.accesses + other.accesses,
                    self.barriers + other.barriers)


@dataclass
class Block:
    instructions: list[Instruction]
    successors: list[int] = field(default_factory=list)


@dataclass
class NaturalLoop:
    header: int
    blocks: set[int]
    innermost: bool = True
    address: int = 0  # of the header's first instruction


class ControlFlow:
    """Basic blocks of one function reachable from `entry` (an index into instructions), and its natural loops.

    A CALL falls through (its callee is separate code, costed by `paths`); EXIT and RET end a path; a predicated
    branch or EXIT also falls through.
    """

    def __init__(self, instructions: list[Instruction], entry: int = 0):
        self._all = instructions
        self._index = {ins.address: i for i, ins in enumerate(instructions)}
        leaders = {entry}
        for i, ins in enumerate(instructions):
            if ins.mnemonic in _ENDS:
                leaders.add(i + 1)
                if ins.mnemonic in _BRANCHES and ins.target() in self._index:
                    leaders.add(self._index[ins.target()])
        starts = sorted(i for i in leaders if entry <= i < len(instructions))
        block_at = {start: b for b, start in enumerate(starts)}
        self.blocks = [Block(instructions[start:end]) for start, end in zip(starts, starts[1:] + [len(instructions)])]
        for b, block in enumerate(self.blocks):
            last = block.instructions[-1]
            if last.mnemonic in _BRANCHES and last.target() in self._index:
                block.successors.append(block_at[self._index[last.target()]])
            if (last.conditional or last.mnemonic not in _ENDS) and b + 1 < len(self.blocks):
                block.successors.append(b + 1)
        self.reachable = self._reachable()
        self._predecessors = {b: [p for p in self.reachable if b in self.blocks[p].successors] for b in self.reachable}
        self.loops = self._natural_loops()
        self._callee_cost: dict[int, Path] = {}

    def _reachable(self) -> list[int]:
        seen, stack = {0}, [0]
        while stack:
            for s in self.blocks[stack.pop()].successors:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return sorted(seen)

    def _dominators(self) -> dict[int, set[int]]:
        dominators = {b: set(self.reachable) for b in self.reachable}
        dominators[0] = {0}
        changed = True
        while changed:
            changed = False
            for b in self.reachable[1:]:
                new = {b} | set.intersection(*(dominators[p] for p in self._predecessors[b]))
                if new != dominators[b]:
                    dominators[b], changed = new, True
        return dominators

    def _natural_loops(self) -> list[NaturalLoop]:
        dominators = self._dominators()
        loops: dict[int, NaturalLoop] = {}
        for tail in self.reachable:
            for header in self.blocks[tail].successors:
                if header in dominators[tail]:  # a back edge tail -> header: the body reaches tail avoiding header
                    body, stack = {header, tail}, [tail] if tail != header else []
                    while stack:
                        for p in self._predecessors[stack.pop()]:
                            if p not in body:
                                body.add(p)
                                stack.append(p)
                    address = self.blocks[header].instructions[0].address
                    loops.setdefault(header, NaturalLoop(header, set(), address=address)).blocks |= body
        for loop in loops.values():
            loop.innermost = not any(other.header in loop.blocks for other in loops.values() if other is not loop)
        return sorted(loops.values(), key=lambda loop: loop.header)

    def _block_path(self, b: int) -> Path:
        path = Path(instructions=len(self.blocks[b].instructions))
        for ins in self.blocks[b].instructions:
            if ins.mnemonic in GLOBAL_LOADS | GLOBAL_STORES | LOCAL:
                stored = ins.access_bytes if ins.mnemonic in GLOBAL_STORES else 0
                path += Path(loaded=ins.access_bytes if ins.mnemonic in GLOBAL_LOADS else 0, stored=stored,
                             stored_unmasked=0 if ins.predicate else stored, accesses=Counter({ins.access: 1}))
            elif ins.opcode.startswith("BAR.SYNC"):
                path += Path(barriers=1)
            elif ins.mnemonic == "CALL" and ins.target() in self._index:
                path += self._callee(ins.target())
        return path

    def _callee(self, address: int) -> Path:
        if address not in self._callee_cost:
            self._callee_cost[address] = Path()  # a recursive call costs nothing more
            callee = ControlFlow(self._all, self._index[address])
            self._callee_cost[address] = min(callee.paths().values(), key=lambda p: p.instructions)
        return self._callee_cost[address]

    def paths(self, loop: NaturalLoop | None = None) -> dict[int, Path]:
        """{global bytes stored per thread: the path with the fewest instructions storing them} over one iteration of
        `loop` (header to a block that branches back; the body of each loop nested in it taken at most once), or,
        without one, from the entry to an EXIT/RET with each loop body taken at most once."""
        if loop is not None:
            blocks, start = loop.blocks, loop.header
            nested = {lp.header: lp.blocks for lp in self.loops if lp is not loop and lp.header in blocks}
            edges = {b: [s for s in self.blocks[b].successors if s in blocks and s != start
                         and b not in nested.get(s, ())] for b in blocks}
            ends = {b for b in blocks if start in self.blocks[b].successors}
        else:
            blocks, start = set(self.reachable), 0
            headers = {lp.header: lp.blocks for lp in self.loops}
            edges = {b: [s for s in self.blocks[b].successors if b not in headers.get(s, ())] for b in blocks}
            ends = {b for b in blocks if self.blocks[b].instructions[-1].mnemonic in ("EXIT", "RET")}
        best: dict[int, dict[int, Path]] = {start: {}}
        first = self._block_path(start)
        best[start][first.stored] = first
        for b in _topological(start, edges):
            for s in edges[b]:
                step = self._block_path(s)
                for path in best.get(b, {}).values():
                    new = path + step
                    kept = best.setdefault(s, {}).get(new.stored)
                    if kept is None or new.instructions < kept.instructions:
                        best[s][new.stored] = new
        result: dict[int, Path] = {}
        for b in ends:
            for stored, path in best.get(b, {}).items():
                if stored not in result or path.instructions < result[stored].instructions:
                    result[stored] = path
        return result


def _topological(start: int, edges: dict[int, list[int]]) -> list[int]:
    order, seen, stack = [], {start}, [(start, iter(edges[start]))]
    while stack:
        node, successors = stack[-1]
        nxt = next((s for s in successors if s not in seen), None)
        if nxt is None:
            order.append(node)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(edges[nxt])))
    return order[::-1]
