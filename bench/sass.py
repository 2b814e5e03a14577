"""Reading compiled NVIDIA kernels without a GPU: the SASS of a cubin, its main loop, its registers.

``cuobjdump`` ships in the triton wheel (``triton/backends/nvidia/bin``). A kernel's main loop is
the backward branch whose body holds the most tensor-core instructions (HGMMA on Hopper, HMMA on
Ampere): the K loop of a GEMM. Local-memory instructions (LDL, STL) are register spills.
"""
import collections
import os
import re
import subprocess

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"0x([0-9a-f]+)")
TENSOR_CORE = ("HGMMA", "HMMA")
LOCAL = ("LDL", "STL")


def tool(name="cuobjdump"):
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} is not in this triton wheel ({path})")
    return path


def disassemble(cubin):
    """[(address, instruction text)] of a cubin file."""
    out = subprocess.run([tool(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.search, out.splitlines()) if m]


def opcode(text):
    """The opcode with its modifiers ('HGMMA.64x128x16.F32.BF16'), without a predicate."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def loops(ins):
    """(start, end) address of every backward branch."""
    out = []
    for addr, text in ins:
        if opcode(text).startswith("BRA"):
            m = _TARGET.search(text)
            if m and int(m.group(1), 16) <= addr:
                out.append((int(m.group(1), 16), addr))
    return out


def main_loop(ins):
    """The instructions of the loop with the most tensor-core instructions (the shortest such
    loop), or [] when no loop holds any."""
    best, key = [], (0, 0)
    for lo, hi in loops(ins):
        body = [t for a, t in ins if lo <= a <= hi]
        n_tc = sum(opcode(t).startswith(TENSOR_CORE) for t in body)
        if n_tc and (n_tc, -len(body)) > key:
            best, key = body, (n_tc, -len(body))
    return best


def resources(cubin):
    """{"regs", "stack"} of the cubin's (first) kernel, from ``cuobjdump -res-usage``."""
    out = subprocess.run([tool(), "-res-usage", cubin], capture_output=True, text=True,
                         check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return {"regs": int(regs.group(1)) if regs else 0, "stack": int(stack.group(1)) if stack else 0}


def summary(cubin):
    """What the static report says of one kernel: registers, stack bytes, local-memory
    instructions in the kernel ("spills"), and its main loop: instructions, tensor-core
    instructions, local-memory instructions, instructions by opcode (without modifiers)."""
    ins = disassemble(cubin)
    body = main_loop(ins)
    by_op = collections.Counter(opcode(t).split(".")[0] for t in body)
    res = resources(cubin)
    return dict(
        regs=res["regs"], stack=res["stack"],
        spills=sum(opcode(t).startswith(LOCAL) for _, t in ins),
        instructions=len(ins),
        loop_instructions=len(body),
        loop_tensor_core_instructions=sum(opcode(t).startswith(TENSOR_CORE) for t in body),
        loop_local=sum(by_op[op] for op in LOCAL),
        loop_by_opcode=dict(by_op.most_common()))


def tensor_loops(ins):
    """[(start, end, body)] of the innermost loops that hold tensor-core instructions, by address:
    a kernel's K loops. The retry of an mbarrier wait (TMA) branches back from past the kernel's
    EXIT into the loop: a "loop" holding an EXIT is not one."""
    found = []
    for lo, hi in loops(ins):
        body = [t for a, t in ins if lo <= a <= hi]
        if any(opcode(t) == "EXIT" for t in body):
            continue
        if any(opcode(t).startswith(TENSOR_CORE) for t in body):
            found.append((lo, hi, body))
    inner = [f for f in found if not any(g is not f and f[0] <= g[0] and g[1] <= f[1]
                                         for g in found)]
    return sorted(inner)


_SHAPE = re.compile(r"\.(\d+)x(\d+)x(\d+)\.")


def tensor_issue(text, operand_bytes=2):
    """(multiply-adds, shared-memory operand bytes) of one tensor-core instruction as issued:
    HGMMA.64xNxK is 64 N K multiply-adds for its warpgroup, reading B (and A, unless A is in
    registers) from shared memory; HMMA.16816 is 16 8 16 for its warp, from registers."""
    op = opcode(text)
    m = _SHAPE.search(op + ".")
    if op.startswith("HGMMA") and m:
        mm, nn, kk = (int(x) for x in m.groups())
        a_in_smem = text.split(",")[1].strip().startswith("gdesc")
        return mm * nn * kk, (mm * kk * a_in_smem + kk * nn) * operand_bytes
    if op.startswith("HMMA.16816"):
        return 16 * 8 * 16, 0
    return 0, 0


def smem_load_bytes(text):
    """Bytes a warp reads from shared memory into registers with one LDSM (ldmatrix: .x4 is
    four 8 x 8 matrices of 16-bit values)."""
    op = opcode(text)
    if not op.startswith("LDSM"):
        return 0
    mats = 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
    return mats * 8 * 8 * 2
