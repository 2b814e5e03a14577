"""The backends: their names, the dtypes each computes, their default tiles, and which one a call
with given operands runs on. Every other module asks here."""
import torch

BACKENDS = ("reference", "triton", "auto")   # auto: triton on CUDA tensors, else reference

DTYPES = {"reference": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
          "triton": (torch.float32, torch.bfloat16, torch.float16)}   # (the tables' row order)

# the reference backend's (BM, BN); the fused kernel's depend on the shape (``configs.tile``)
REFERENCE_TILES = (256, 256)

# the types of plain tensors (not a subclass: DTensor, FakeTensor, a functorch wrapper, ...)
PLAIN = (torch.Tensor, torch.nn.Parameter)


def tf32_allowed(device):
    """Whether torch lets float32 GEMMs on ``device`` use tf32 (CUDA: ``allow_tf32``; CPU: a
    float32 matmul precision below "highest")."""
    if device.type == "cuda":
        return torch.backends.cuda.matmul.allow_tf32
    return torch.get_float32_matmul_precision() != "highest"


def resolve(backend, cuda):
    """The backend that runs: ``auto`` is triton on CUDA, reference elsewhere."""
    if backend == "auto":
        return "triton" if cuda else "reference"
    return backend


def runs_on_triton(backend, *ts):
    """Whether a product of these operands runs on the fused kernel under ``backend``: its
    dtypes, one dtype for all, and (auto) CUDA tensors."""
    if resolve(backend, all(t.is_cuda for t in ts)) != "triton":
        return False
    return all(t.dtype in DTYPES["triton"] and t.dtype == ts[0].dtype for t in ts)
