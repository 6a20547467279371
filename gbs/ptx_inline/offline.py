"""Compile Numba CUDA kernels for a target GPU without having one, and read what came out.

The path is the one a launch takes: NVVM -> LTO-IR -> nvJitLink -> cubin. NVVM accepts any
inline-asm text; ptxas inside nvJitLink is where a bad PTX form is rejected, so a cubin from
``compile_cubin`` means the instructions really assemble for that target.

numba-cuda 0.30.4 asks the driver for the current device when it compiles a
``@cuda.jit(device=True)`` function; without a GPU that raises ``CudaSupportError``. While
compiling, ``compile_cubin`` swaps in a stub device whose compute capability is the target.
Compiled device-function overloads are cached per argument types, not per target, so a process
should compile one target per kernel object (tests build fresh kernels per target).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

SM90A = (9, 0, "a")
SM100A = (10, 0, "a")
TARGET_NAMES = {SM90A: "sm_90a", SM100A: "sm_100a"}


@functools.cache
def find_cuda_tool(name: str) -> str:
    """Path of ``ptxas`` / ``cuobjdump`` / ``nvdisasm``, preferring the pip toolkit wheel (a system
    ptxas 13.0 rejects the ``.version 9.5`` PTX that NVVM 13.5 emits)."""
    candidates = []
    try:
        import nvidia

        for root in nvidia.__path__:
            candidates += [os.path.join(root, sub, "bin", name) for sub in ("cu13", "cuda_nvcc", "cuda_cuobjdump")]
    except ImportError:
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "bin", name))
    if shutil.which(name):
        candidates.append(shutil.which(name))
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        f"{name} not found: install the toolkit wheel (pip install 'cuda-toolkit[nvcc,nvdisasm,cuobjdump]==13.*')")


class _StubDevice:
    def __init__(self, cc):
        self.compute_capability = cc[:2]
        self.id = 0
        self.name = b"offline-" + TARGET_NAMES.get(tuple(cc), "target").encode()


@contextlib.contextmanager
def _target_device(cc):
    """Make numba-cuda's device-function compiler see ``cc`` instead of asking the driver."""
    import numba.cuda.dispatcher as disp

    saved = disp.get_current_device
    disp.get_current_device = lambda: _StubDevice(cc)
    try:
        yield
    finally:
        disp.get_current_device = saved


def _check_cc(cc):
    cc = tuple(cc)
    if cc not in TARGET_NAMES:
        raise ValueError(f"offline target {cc} not supported; use one of {sorted(TARGET_NAMES.values())}")
    return cc


def compile_ptx(pyfunc, sig, cc) -> str:
    """PTX text of kernel ``pyfunc`` for ``cc`` (e.g. ``SM90A``)."""
    from numba import cuda

    cc = _check_cc(cc)
    with _target_device(cc):
        ptx, _ = cuda.compile(pyfunc, sig, device=False, abi="numba", cc=cc, output="ptx")
    return ptx


def compile_cubin(pyfunc, sig, cc, *, launch_bounds=None, max_registers=None) -> bytes:
    """cubin of kernel ``pyfunc`` for ``cc`` through NVVM LTO-IR and nvJitLink.

    ``launch_bounds`` = (max threads per block, min blocks per SM): the register cap that
    ``setmaxnreg`` needs to take effect. ``max_registers``: a per-thread cap given to the linker
    (``cuda.jit(max_registers=...)`` does the same at run time)."""
    from numba import cuda
    from numba.cuda.cudadrv import driver

    cc = _check_cc(cc)
    extra = {} if launch_bounds is None else {"launch_bounds": launch_bounds}
    with _target_device(cc):
        ltoir, _ = cuda.compile(pyfunc, sig, device=False, abi="numba", cc=cc, output="ltoir", **extra)
    linker = driver._Linker(cc=cc, lto=True, max_registers=max_registers)
    linker.add_ltoir(ltoir)
    return linker.complete().code


def _run_tool(tool, args, cubin):
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([find_cuda_tool(tool), *args, path], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed: {res.stderr.strip()[:500]}")
    return res.stdout


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin (``cuobjdump -sass``)."""
    return _run_tool("cuobjdump", ["-sass"], cubin)


_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(.*?)\s*;")


def sass_instructions(sass: str) -> list[str]:
    """Each instruction of a SASS listing, predicate guard removed (``'HGMMA.64x128x16.F32.BF16 ...'``)."""
    return [m.group(1) for m in map(_SASS_INSTR.search, sass.splitlines()) if m]


def sass_opcodes(sass: str) -> set[str]:
    """The set of full opcodes (``'UTMALDG.2D'``, ``'SYNCS.ARRIVE.TRANS64.A1T0'``...) in a listing."""
    return {ins.split()[0] for ins in sass_instructions(sass)}


def has_opcode(sass: str, prefix: str) -> bool:
    """Whether any opcode starts with ``prefix`` (``'HGMMA'``, ``'UTCQMMA'``)."""
    return any(op.startswith(prefix) for op in sass_opcodes(sass))


def uses_local_memory(sass: str) -> bool:
    """``LDL`` / ``STL`` present: an array or spill went to local memory."""
    return any(re.match(r"(LDL|STL)\b", ins) for ins in sass_instructions(sass))


WGMMA_OPCODES = ("HGMMA", "QGMMA")      # sm_90 warpgroup MMAs (bf16 / fp8 operands)
_WAIT_ALL_GROUPS = "WARPGROUP.DEPBAR.LE gsb0, 0x0"


def serialized_wgmma(instructions: list[str]) -> list[str]:
    """The warpgroup MMAs of a listing (``sass_instructions``) that wait for every earlier one: a wait for 0 groups
    right after an MMA, or between an MMA and the next one that accumulates onto it. ptxas serializes them so where
    it cannot prove the accumulators retired (warning C7514) or runs out of registers (C7512), and the tensor
    pipe then idles between them; an empty list: the MMAs are pipelined."""
    found, waited = [], False
    for i, ins in enumerate(instructions):
        if ins.startswith(_WAIT_ALL_GROUPS):
            waited = True
        elif ins.startswith(WGMMA_OPCODES):
            accumulates = ", RZ," not in ins
            waits_after = any(later.startswith(_WAIT_ALL_GROUPS) for later in instructions[i + 1:i + 3])
            if (waited and accumulates) or waits_after:
                found.append(f"{i}: {ins}")
            waited = False
    return found


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(.*?)\s*;")
_BACKWARD_BRANCH = re.compile(r"^BRA\b.*?(0x[0-9a-f]+)")


@dataclass(frozen=True)
class SassLoop:
    """One loop of a SASS listing: a branch back from ``end`` to ``start`` (byte addresses) and the
    opcodes between them, inner loops included (what one trip of the loop may execute)."""

    start: int
    end: int
    opcodes: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.opcodes)

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (``"HGMMA"``, ``"LDL"``, ``"LDS"``)."""
        return sum(op.startswith(prefix) for op in self.opcodes)


def sass_loops(sass: str) -> list[SassLoop]:
    """Every loop of a listing (``cuobjdump -sass``), innermost (smallest) first: the reading behind
    statements such as "the hot loop is 343 instructions" or "no local memory in the K loop"."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.search, sass.splitlines()) if m]
    loops = []
    for address, instruction in lines:
        branch = _BACKWARD_BRANCH.match(instruction)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            loops.append(SassLoop(start, address, tuple(ins.split()[0] for a, ins in lines if start <= a <= address)))
    return sorted(loops, key=lambda loop: loop.size)


@dataclass(frozen=True)
class Resources:
    registers: int
    shared_bytes: int
    local_bytes: int
    stack_bytes: int = 0


def resource_usage(cubin: bytes) -> Resources:
    """Registers per thread, static shared memory, local memory and the stack frame (where ptxas puts
    register spills: ``LOCAL`` stays 0 for them) of the (single) kernel."""
    text = _run_tool("cuobjdump", ["-res-usage"], cubin)
    fields = dict(re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", text))
    return Resources(int(fields.get("REG", 0)), int(fields.get("SHARED", 0)), int(fields.get("LOCAL", 0)),
                     int(fields.get("STACK", 0)))
