"""The reference check compiled (``csrc/reference.cpp``), built on first use and called through ctypes.

Why a plain shared library and not a torch extension (``torch.utils.cpp_extension``) or numba:
the check needs no torch API inside, only pointers and strides, so the source includes no torch
header and builds with the system's C++ compiler in about 8 s here (a torch extension compiles
torch's headers too; numba is one more large dependency, compiling each dtype's version at its
first call); it does not depend on torch's C++ ABI, so a torch upgrade does not break it. OpenMP threads: the library
links ``libgomp.so.1``, the runtime torch's CPU build loads itself, so both share one thread pool.

The library is compiled once per source, compiler flags and CPU (``-march=native``) into
``$ABFT_CACHE`` (default ``~/.cache/abft``), with one line on stderr while it builds. Where that
fails (no compiler), the torch check runs instead, with one warning that says so.
``ABFT_COMPILED=0`` turns the compiled check off (the torch check then runs everywhere).
"""
import array
import ctypes
import functools
import hashlib
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

import numpy
import torch

from abft.kernels import backends
from abft.kernels import threshold as T
from abft.kernels.stats import SAMPLES, OperandStats, _kept_places

SOURCE = pathlib.Path(__file__).parent / "csrc" / "reference.cpp"
# -fno-math-errno -fno-trapping-math: IEEE results unchanged (sqrt inline, no errno to set)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
         "-std=c++17"]
COEF_NAMES = ("lam,k,bs,p_s2,p_q,p_d2,c_p2,c_qs,c_s12,c_s2,c_q,bias,lowent,directed,directed_chk,"
              "eta_log2,eta_absolute,out,out_add,eta_acc,chk_parts,eta_out,ftz,w_t,w_sa,w_da,w_scale,cap,rep")

_lock = threading.Lock()
_lib = None
_tried = False


def enabled():
    return os.environ.get("ABFT_COMPILED", "1") != "0"


def _cpu_key():
    """What -march=native depends on: the machine and the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return platform.machine() + flags


def _cache_dir():
    root = os.environ.get("ABFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "abft")
    return pathlib.Path(root)


def _flags():
    """FLAGS, then ``$ABFT_CXXFLAGS`` (e.g. ``-DABFT_PROFILE``: per-stage times on stderr)."""
    return FLAGS + os.environ.get("ABFT_CXXFLAGS", "").split()


def _build():
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (c++, g++ or $CXX)")
    src = SOURCE.read_bytes()
    flags = _flags()
    key = hashlib.sha256(src + " ".join([cxx] + flags).encode() + _cpu_key().encode()).hexdigest()[:16]
    out = _cache_dir() / f"reference-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"abft: compiling the reference check (once; cached in {out.parent})", file=sys.stderr, flush=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cxx, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            os.replace(tmp, out)            # atomic: concurrent builders (ranks) each write their own
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    lib.abft_coef_names.restype = ctypes.c_char_p
    if lib.abft_coef_names().decode() != COEF_NAMES:
        raise RuntimeError("the compiled library's coefficient order differs from compiled.py's")
    P = ctypes.c_void_p
    lib.abft_stats.argtypes = [P, P]
    lib.abft_stats.restype = ctypes.c_int
    lib.abft_stats2.argtypes = [P, P, P, P]
    lib.abft_stats2.restype = ctypes.c_int
    lib.abft_check.argtypes = [P, P, P, P]
    lib.abft_check.restype = ctypes.c_int
    I = ctypes.c_int64
    lib.abft_fingerprint.argtypes = [P, I, I, I, P, I]
    lib.abft_fingerprint.restype = ctypes.c_int
    return lib


def library():
    """The loaded library, or None (turned off, or it could not be built: warned once)."""
    global _lib, _tried
    if _lib is not None or _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _build()
            except Exception as e:           # noqa: BLE001 (any failure: the torch check runs)
                warnings.warn(f"abft: the compiled reference check is unavailable ({e}); "
                              "the torch check runs instead (slower)", RuntimeWarning, stacklevel=3)
            _tried = True
    return _lib


F64 = torch.float64
DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_TINY = {torch.float16: torch.finfo(torch.float16).tiny, torch.bfloat16: torch.finfo(torch.bfloat16).tiny}
_MAX = {dt: torch.finfo(dt).max for dt in DTYPES}
_ZERO = torch.zeros(1, dtype=torch.int64)
_FOUR = (0.0, 0.0, 0.0, 0.0)
_FOUR_NULL = (0, 0, 0, 0)
_STRIDED = torch.strided
_PLAIN = backends.PLAIN


def usable(a, b, c, addend):
    """Whether the compiled check can take this product: plain strided CPU tensors of one
    supported dtype, nothing empty, outside torch.compile's tracing (asked first: dynamo cannot
    trace ``is_neg``)."""
    if torch.compiler.is_compiling():
        return False
    if not (a.dtype == b.dtype == c.dtype and c.dtype in DTYPES) or addend is not None and not addend.is_floating_point():
        return False
    for t in (a, b, c) if addend is None else (a, b, c, addend):
        if type(t) not in _PLAIN or not t.is_cpu or t.layout is not _STRIDED or t.is_neg():
            return False
    if c.numel() == 0 or a.shape[-1] == 0 or a.dim() < 2 or b.dim() < 2:
        return False
    return enabled() and library() is not None


def _offsets(x, batch):
    """Element offsets of the (…, R, K) matrices of ``x`` (expanded to ``batch``), int64."""
    if not batch:
        return _ZERO
    return _batch_offsets(tuple(batch), tuple(x.stride()[:len(batch)]))


@functools.lru_cache(maxsize=1024)
def _batch_offsets(batch, strides):
    """(kept: a training step repeats its shapes) offsets of every batch index, row-major."""
    with torch.inference_mode(False):      # made under inference_mode, it could not serve outside it
        idx = torch.arange(math.prod(batch))
        off = torch.zeros_like(idx)
        for size, stride in reversed(list(zip(batch, strides))):
            if stride and size > 1:
                off += (idx % size) * stride
            idx = idx // size
        return off


@functools.lru_cache(maxsize=1024)
def _batch_index(bbatch, batch):
    """For each batch index of C, the index of B's own batch (B broadcast along C's batch)."""
    with torch.inference_mode(False):
        if not bbatch:
            return torch.zeros(max(1, math.prod(batch)), dtype=torch.int64)
        ib = torch.arange(math.prod(bbatch)).view((1,) * (len(batch) - len(bbatch)) + bbatch)
        return ib.expand(batch).reshape(-1).contiguous()


def _addresses(ts):
    """The data pointers of ``ts``, 0 for None (the library's arrays of pointers)."""
    return [0 if t is None else t.data_ptr() for t in ts]


def _stats_call(x, bs, need_abs):
    """(dims, ptrs, the OperandStats the library fills) of ``stats``' arguments."""
    *batch, r, k = x.shape
    batch = tuple(batch)
    t = -(-r // bs)
    e, r1, rinf = torch.empty(3, *batch, r, dtype=F64).unbind(0)        # few allocations: each costs µs
    finite, low = torch.empty(2, *batch, r, dtype=torch.bool).unbind(0)
    E, x1, xinf, xs1, xsinf, nu = torch.empty(6, *batch, t, dtype=F64).unbind(0)
    s = torch.empty(*batch, t, k, dtype=F64)
    absum = torch.empty(*batch, t, k, dtype=F64) if need_abs else None
    n_places = min(k, SAMPLES)
    places = _kept_places(k, n_places, x.device)
    dims = array.array("q", (DTYPES[x.dtype], math.prod(batch), r, k, x.stride(-2), x.stride(-1), bs,
                             n_places, int(need_abs), torch.get_num_threads()))
    ptrs = array.array("Q", _addresses((x, _offsets(x, batch), places, e, r1, rinf, finite, low, E, x1,
                                        xinf, xs1, xsinf, nu, s, absum)))
    out = OperandStats(bs=bs, e=e, r1=r1, rinf=rinf, finite=finite, low=low, E=E, x1=x1, xinf=xinf,
                       xs1=xs1, xsinf=xsinf, nu=nu, s=s, absum=absum)
    return dims, ptrs, out


def stats(x, bs, *, need_abs):
    """``stats.operand_stats(x, bs, need_s=True, need_abs=need_abs)``, compiled: the statistics of
    a B kept between calls (``reference.weight_stats``); a check computes its own inside its call."""
    dims, ptrs, out = _stats_call(x, bs, need_abs)
    err = _lib.abft_stats(dims.buffer_info()[0], ptrs.buffer_info()[0])
    if err:
        raise RuntimeError(f"abft_stats failed ({err})")
    return out


def stats_pair(x, bs, need_abs, y, bs_y, need_abs_y):
    """``stats`` of ``x`` and of ``y`` (one dtype: a weight's two sides) in one call, the blocks
    of both spread over the threads together: each the same as ``stats`` gives."""
    (dx, px, ox), (dy, py, oy) = _stats_call(x, bs, need_abs), _stats_call(y, bs_y, need_abs_y)
    err = _lib.abft_stats2(dx.buffer_info()[0], px.buffer_info()[0], dy.buffer_info()[0], py.buffer_info()[0])
    if err:
        raise RuntimeError(f"abft_stats2 failed ({err})")
    return ox, oy


def _packed(units, k, bm, bn, acc, chk, lam, addend, alpha, beta):
    """The coefficients of the column sums' thresholds (blocks of ``bm`` rows) and of the row
    sums' (``bn`` columns), packed as rows of one float64 tensor (kept in the call's plan);
    ``acc`` None: ``threshold.recursive(k)``."""
    a = acc or T.recursive(k)
    cs = [T.coefficients(units, k=k, bs=bs, acc=a, chk=chk, lam=lam, addend=addend, alpha=alpha, beta=beta)
          for bs in (bm, bn)]
    return torch.tensor([[float(getattr(c, f)) for f in COEF_NAMES.split(",")] for c in cs], dtype=F64)


_NO_STATS = (None, (0,) * 13)


def _kept_pointers(s, cap):
    """(tensors to keep alive, their 13 pointers) of kept statistics ``s`` in the library's order
    (``absum`` only for a capped K). Read afresh each call (a cache of pointers on ``s`` would
    survive a copy of ``s`` and point at the original's memory)."""
    if s is None:
        return _NO_STATS
    if cap and s.absum is None:
        raise ValueError("b_stats lack the column sums of |B| that a product of K <= "
                         f"{T.SMALL_K} needs (made for another K)")
    kept = [None if z is None else z if z.is_contiguous() else z.contiguous()
            for z in (s.e, s.r1, s.rinf, s.E, s.x1, s.xinf, s.xs1, s.xsinf, s.nu, s.finite, s.low,
                      s.s, s.absum if cap else None)]
    return kept, _addresses(kept)


_plans = {}


def _addend64(addend, beta):
    """beta * addend in float64, as the library reads it (its strides follow the addend's)."""
    return addend.to(F64) if beta == 1 else addend.to(F64) * beta


def _plan(a, b, c, addend, bm, bn, units, acc, chk, alpha, beta, lam, b_stats):
    """What a check's call takes that depends only on its shapes, strides, dtype, tiles and
    coefficients, kept per those (a training step repeats its products): the dims, the pointers
    of the batch offsets, sampled places and coefficients (with the tensors they point into),
    the outputs' shapes. None of it depends on the operands' values or addresses."""
    m, n, k = c.shape[-2], c.shape[-1], a.shape[-1]
    batch = tuple(c.shape[:-2])
    nbc = math.prod(batch)
    bm, bn = max(1, min(bm, m)), max(1, min(bn, n))
    tm, tn = -(-m // bm), -(-n // bn)
    cap = k <= T.SMALL_K
    if b_stats is not None and b_stats.bs != bn:
        raise ValueError(f"b_stats were made for blocks of {b_stats.bs} columns, not {bn}")
    bbatch = tuple(b.shape[:-2]) if b_stats is None else tuple(b_stats.e.shape[:-1])
    if batch:
        a_e, b_e = a.expand(*batch, m, k), b.expand(*batch, k, n)
        offs = [_offsets(c, batch), _offsets(a_e, batch), _offsets(b_e, batch), _offsets(b, bbatch)]
        ib = _batch_index(bbatch, batch)
    else:
        offs, ib = [_ZERO] * 4, _ZERO
    d_strides = (0, 0)
    if addend is not None:
        d = _addend64(addend, beta).expand(*batch, m, n)     # (its strides: as each call's)
        offs.append(_offsets(d, batch) if batch else _ZERO)
        d_strides = (d.stride(-2), d.stride(-1))
    else:
        offs.append(None)
    coef = _packed(units, k, bm, bn, acc, chk, lam, addend is not None, alpha, beta)
    n_places = min(k, SAMPLES)
    places = _kept_places(k, n_places, c.device)
    keep = [*offs, ib, places, coef]
    prefix = _addresses(keep[:7])
    coef_ptrs = (coef.data_ptr(), coef.data_ptr() + coef.stride(0) * 8)     # then the row sums'
    dims = array.array("q", (nbc, max(1, math.prod(bbatch)), m, n, k, bm, bn, c.stride(-2), c.stride(-1),
                             a.stride(-2), a.stride(-1), b.stride(-2), b.stride(-1), *d_strides,
                             DTYPES[c.dtype], int(cap), torch.get_num_threads(), n_places))
    scal = array.array("d", (alpha, _TINY.get(c.dtype, 0.0), _MAX[c.dtype]))
    shapes = ((*batch, tm, tn, 9), (*batch, m, tn), (*batch, tm, n))
    return keep, prefix, coef_ptrs, dims, scal, shapes, cap


def check(a, b, c, *, bm, bn, units, acc, chk, alpha, addend, beta, lam, return_sums, b_stats,
          summary=False):
    """``reference.check`` compiled (its arguments and results; ``usable`` said yes). One call into
    the library: B's statistics (unless kept), A's with the row predictions, the column
    predictions, one pass over C, the thresholds and the tile records; with ``summary``, also
    ``layout.summary`` of the verdict, counted in the same call."""
    alpha, beta = float(alpha), float(beta)
    key = (a.shape, a.stride(), b.shape, b.stride(), c.shape, c.stride(), c.dtype, bm, bn, units, acc, chk,
           lam, alpha, beta, None if addend is None else (addend.shape, addend.stride(), addend.dtype),
           None if b_stats is None else (b_stats.bs, b_stats.e.shape), torch.get_num_threads())
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(a, b, c, addend, bm, bn, units, acc, chk, alpha, beta, lam, b_stats)
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = plan
    keep, prefix, coef_ptrs, dims, scal, (sv, sr, sc), cap = plan
    d = None if addend is None else _addend64(addend, beta)
    # (numpy allocates in a tenth of torch.empty's time; the tensors own the arrays)
    verdict = torch.from_numpy(numpy.empty(sv, numpy.float32))
    det_r = torch.from_numpy(numpy.empty(sr, numpy.float32))
    det_c = torch.from_numpy(numpy.empty(sc, numpy.float32))
    if return_sums:             # else the library keeps them in scratch memory
        res_c, thr_c = torch.empty(sc, dtype=F64), torch.empty(sc, dtype=F64)
        res_r, thr_r = torch.empty(sr, dtype=F64), torch.empty(sr, dtype=F64)
        sums = (res_c.data_ptr(), thr_c.data_ptr(), res_r.data_ptr(), thr_r.data_ptr())
    else:
        sums = _FOUR_NULL
    kept, kept_ptrs = _kept_pointers(b_stats, cap)
    # the arguments as flat arrays (array.array builds them several times faster than ctypes)
    ptrs = array.array("Q", (*prefix, a.data_ptr(), b.data_ptr(), c.data_ptr(), 0 if d is None else d.data_ptr(),
                             *kept_ptrs, *coef_ptrs))
    summ = array.array("d", _FOUR) if summary else None
    outs = array.array("Q", (verdict.data_ptr(), det_r.data_ptr(), det_c.data_ptr(), *sums,
                             0 if summ is None else summ.buffer_info()[0]))
    if _lib.abft_check(dims.buffer_info()[0], ptrs.buffer_info()[0], scal.buffer_info()[0],
                       outs.buffer_info()[0]):
        raise RuntimeError("abft_check failed")
    out = (verdict, (det_r, det_c))
    if return_sums:
        out += (dict(res_col=res_c, thr_col=thr_c, res_row=res_r, thr_row=thr_r),)
    if summary:
        out += (tuple(summ),)
    return out


def fingerprint(words, block):
    """``abft.detectors.rest.fingerprint``'s sums of ``words`` (flat contiguous int16 or int32 on the CPU),
    a (blocks, 3) int64 tensor; None where the library cannot take them (the torch version
    then runs)."""
    if torch.compiler.is_compiling() or not enabled() or not words.is_cpu or \
            words.dtype not in (torch.int16, torch.int32) or not words.is_contiguous() or \
            type(words) not in backends.PLAIN:
        return None
    lib = library()
    if lib is None:
        return None
    n = words.numel()
    out = torch.empty(-(-n // block), 3, dtype=torch.int64)
    if lib.abft_fingerprint(words.data_ptr(), words.element_size(), n, block, out.data_ptr(),
                            torch.get_num_threads()):
        return None
    return out
