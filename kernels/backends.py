"""The backends, in one registry: each one's name, the dtypes it computes, whether it computes the
product itself or checks the product torch computed, what it needs installed, and where its entry
points are. Every other module asks here; a backend is one module with those entry points plus
one ``register`` call.

A checking backend's module (``computes=False``) has
    ``check_product(a, b, c, *, bm, bn, alpha, addend, beta, lam, b_stats) -> (verdict, detail,
    summary)``: the verdict tensor of ``c == alpha * a @ b + beta * addend`` in tiles of bm x bn
    (``layout``), the per-sum detail and ``layout.summary`` (or None); ``b_stats``: None or a
    function of bn giving b's kept statistics.
A computing backend's module (``computes=True``) has
    ``checked_product(a, b, *, addend, alpha, beta, tiles, inject, lam, b_stats) -> (c, verdict,
    detail, (bm, bn))``: the product and its verdict in tiles of bm x bn; ``tiles``: configured or
    None; ``inject``: an accumulator fault (``layout.INJECT_KINDS``) or None;
    ``unchecked_product(a, b, *, addend, alpha, beta) -> c``: its checks compiled out (a sampled-out
    call);
    ``tiles_error(bm, bn) -> str or None``: why configured tiles cannot run there.
"""
import importlib
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    name: str
    dtypes: tuple                  # what it computes (the tables' row order)
    module: str                    # its entry points (above), imported at first use
    computes: bool = False         # True: computes the product and checks it in one call
    requires: str = None           # a module that must import for it to run (its name)
    auto_on_cuda: bool = False     # what "auto" takes for CUDA tensors (else: the reference)
    tiles: tuple = None            # its default (BM, BN), where it has one shape for all products
    kernel_faults: bool = False    # injects accumulator faults inside its computation

    def entry(self):
        """Its module of entry points."""
        return sys.modules.get(self.module) or importlib.import_module(self.module)


_registry = {}
DTYPES = {}                        # name -> dtypes (every registered backend)
AUTO = "auto"                      # a computing backend's name on CUDA tensors, else the reference
REFERENCE = "reference"            # checks any product torch computed: the default and the oracle


def register(backend):
    """Add ``backend`` (a ``Backend``); its name must be new."""
    if backend.name in _registry or backend.name == AUTO:
        raise ValueError(f"backend {backend.name!r} is registered already")
    _registry[backend.name] = backend
    DTYPES[backend.name] = backend.dtypes


def get(name):
    return _registry[name]


def names():
    """Every name ``abft.config(backend=...)`` and a campaign take: the registered ones, then auto."""
    return tuple(_registry) + (AUTO,)


register(Backend(REFERENCE, (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                 "abft.kernels.reference", tiles=(256, 256)))
register(Backend("triton", (torch.float32, torch.bfloat16, torch.float16), "abft.kernels.triton_gemm",
                 computes=True, requires="triton", auto_on_cuda=True, kernel_faults=True))

# the types of plain tensors (not a subclass: DTensor, FakeTensor, a functorch wrapper, ...)
PLAIN = (torch.Tensor, torch.nn.Parameter)


def tf32_allowed(device):
    """Whether torch lets float32 GEMMs on ``device`` use tf32 (CUDA: ``allow_tf32``; CPU: a
    float32 matmul precision below "highest")."""
    if device.type == "cuda":
        return torch.backends.cuda.matmul.allow_tf32
    return torch.get_float32_matmul_precision() != "highest"


def resolve(backend, cuda):
    """The backend that runs: ``auto`` is the computing backend marked ``auto_on_cuda`` on CUDA,
    the reference elsewhere."""
    if backend == AUTO:
        if cuda:
            for b in _registry.values():
                if b.auto_on_cuda:
                    return b.name
        return REFERENCE
    return backend


def candidates(backend):
    """The registered backends ``backend`` may run on (auto: any it may pick)."""
    if backend == AUTO:
        return [b for b in _registry.values() if b.auto_on_cuda or b.name == REFERENCE]
    return [_registry[backend]]


def route(backend, *ts):
    """The backend a product of operands ``ts`` runs on under the configured ``backend``: a
    computing backend where it takes them (its dtypes, one dtype for all; auto: CUDA tensors),
    else the reference, which checks what torch computed."""
    if backend == REFERENCE:
        return REFERENCE
    name = resolve(backend, all(t.is_cuda for t in ts))
    b = _registry[name]
    if b.computes and not all(t.dtype in b.dtypes and t.dtype == ts[0].dtype for t in ts):
        return REFERENCE
    return name
