"""Campaigns: many trials over node profiles, seeds and sync modes, from a plain config file.

A config is TOML or JSON, read into ``eval/config.py``'s ``Config``. Trials are
``profiles x seeds x modes`` (a profile may name its own ``modes``). Each finished trial is
appended to ``trials.jsonl`` in the run folder at once (``trials-pair{p}.jsonl`` when several
distributed pairs write), so an interrupted campaign loses nothing and ``resume`` skips the trials
already there. The resolved config is hashed into ``config.json`` and every record: a resume
with another config is refused, naming what differs. ``lock.json`` keeps a second writer out.
Pretraining runs once per campaign (``pretrain.bin``, raw tensors, checked by the SHA-256 in
``pretrain.json``). The run folder holds JSON, JSONL, TOML, Markdown, PNG and that raw file only:
nothing is unpickled.

Reproducible: each trial runs on ``threads`` torch threads (default 1) in-process and on every
rank alike, so in-process and distributed campaigns agree bit for bit; each profile draws its
faults from its own stream, derived from (campaign seed, profile, trial), while the training
data of trial k is the same for every profile.
"""
import contextlib
import glob
import hashlib
import json
import os
import sys
import time

from abft.eval.faults import whole
from abft.eval.replicas import pretrain, run_trial


def config_hash(cfg):
    """The resolved config's identity: 12 hex digits of its canonical JSON."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def fault_seed(seed, profile_name, k):
    """The fault stream of one profile's trial k: derived from all three, so profiles differ."""
    digest = hashlib.sha256(f"{seed}/{profile_name}/{k}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def trials(cfg):
    """Every trial of the campaign, in a fixed order, each with a stable id. ``seed`` is the data
    (the same batches for every profile's trial k), ``fault_seed`` the profile's fault stream
    (the same faults in every sync mode of one profile's trial k)."""
    out, h = [], config_hash(cfg)
    for node in cfg.profiles:
        name = node.profile.name
        for mode in cfg.modes if node.modes is None else node.modes:
            for k in range(cfg.seeds):
                seed = cfg.seed * 1000 + k
                out.append({"id": f"{name}/{mode}/{seed}", "profile": node.profile, "mode": mode,
                            "seed": seed, "fault_seed": fault_seed(cfg.seed, name, k),
                            "backend": cfg.backend, "threads": cfg.threads, "campaign": h})
    return out


def _records(out, warn=True):
    """(path, line number, record) of every whole record line in the run folder; a line that is
    not a record is reported on stderr, never silently dropped."""
    for path in sorted(glob.glob(os.path.join(out, "trials*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    rec["id"]
                except (ValueError, KeyError, TypeError):
                    if warn:
                        print(f"abft eval: {path}:{i}: not a trial record, skipped",
                              file=sys.stderr)
                    continue
                yield path, i, rec


def done_ids(out, warn=True):
    return {rec["id"] for _, _, rec in _records(out, warn)}


def read_trials(out):
    """The run folder's trial records (one per id). Records of another campaign (another config
    hash) are refused: a folder holds one campaign."""
    recs, hashes = {}, set()
    for path, _, rec in _records(out):
        recs[rec["id"]] = rec
        hashes.add(rec.get("campaign"))
    if len(hashes) > 1:
        raise ValueError(f"{out}: trials of {len(hashes)} different campaigns "
                         f"({', '.join(sorted(map(str, hashes)))}); a run folder holds one")
    return list(recs.values())


def repair(out):
    """Cut a torn last line (an interrupted write) back to the last whole line, with a warning,
    so a resume appends after a newline and loses nothing more."""
    for path in sorted(glob.glob(os.path.join(out, "trials*.jsonl"))):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                f.truncate(keep)
                print(f"abft eval: {path}: a torn last line ({len(data) - keep} bytes) removed; "
                      f"that trial runs again", file=sys.stderr)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(_flat(x, f"{key}[{i}]."))
            out[key + ".len"] = len(v)
        else:
            out[key] = v
    return out


def differences(old, new):
    """The dotted fields where two configs differ."""
    a, b = _flat(old), _flat(new)
    return sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))


class Busy(RuntimeError):
    """Another process holds the run folder."""


@contextlib.contextmanager
def locked(out):
    """Hold the run folder's ``lock.json`` (an exclusive lock) for the duration."""
    import fcntl
    import socket
    path = os.path.join(out, "lock.json")
    f = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise Busy(f"{out}: in use by {holder}; wait for it, or stop it first") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        f.flush()
        yield
    finally:
        f.close()            # closing releases the lock


def append(path, rec):
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Progress:
    """A one-line progress bar on stderr: done/total, elapsed and the estimate left."""

    def __init__(self, total, stream=sys.stderr):
        self.total, self.done, self.t0, self.stream = total, 0, time.perf_counter(), stream

    def tick(self, label=""):
        self.done += 1
        el = time.perf_counter() - self.t0
        left = el / self.done * (self.total - self.done)
        bar = "#" * int(20 * self.done / max(self.total, 1))
        self.stream.write(f"\r[{bar:<20}] {self.done}/{self.total} trials, {el:.0f}s, "
                          f"~{left:.0f}s left  {label[:40]:<40}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def write_config(cfg, out):
    """The campaign's config and its hash, as JSON, in the run folder."""
    path = os.path.join(out, "config.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"hash": config_hash(cfg), "config": cfg.to_dict()}, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def read_config(out):
    """(hash, config) of the run folder's campaign, or (None, None)."""
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            d = json.load(f)
        return d["hash"], d["config"]
    except FileNotFoundError:
        return None, None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{out}/config.json: not a campaign config written by abft eval") from None


def _folder(out):
    """Make the run folder (OSError, one line, where it cannot be one)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"--out {out}: a file, not a folder")
    os.makedirs(out, exist_ok=True)
    if not os.access(out, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out}: not writable")


def prepare(cfg, out, resume=False):
    """Check that the run folder can take this campaign; raises ValueError (another campaign's
    folder, naming what differs), FileExistsError (trials there, no resume) or OSError."""
    _folder(out)
    has_trials = bool(glob.glob(os.path.join(out, "trials*.jsonl")))
    if has_trials and not resume:
        raise FileExistsError(f"{out} holds trials already: pass --resume, or another --out")
    old_hash, old = read_config(out)
    if has_trials and old is None:
        raise ValueError(f"{out}: trials without config.json; not a folder abft eval can resume")
    if has_trials and old_hash != config_hash(cfg):
        diff = differences(old, cfg.to_dict())
        raise ValueError(f"{out}: --resume with another config (differs in: "
                         f"{', '.join(diff) or 'its hash'}); use another --out")


def run(cfg, out, resume=False, pairs=0, progress=True):
    """Run the campaign (a ``Config``) into the run folder ``out``; returns the trial records.

    ``pairs=0``: replica pairs in this process; ``pairs=N``: N distributed pairs (2N gloo ranks
    spawned on this machine, trials dealt round robin); under torchrun, the launched ranks.
    With ``train.tp`` > 1 each replica is a tensor-parallel group: 2 x tp ranks a pair, at least
    one pair.
    """
    if not whole(pairs) or pairs < 0:
        raise ValueError(f"--pairs: a whole number >= 0, got {pairs!r}")
    tp = cfg.train.tp
    if tp > 1:
        pairs = max(pairs, 1)
    if os.environ.get("WORLD_SIZE") and int(os.environ["WORLD_SIZE"]) > 1:
        world = int(os.environ["WORLD_SIZE"])
        if world % (2 * tp):
            raise ValueError(f"torchrun: {world} ranks; replica pairs with train.tp = {tp} need a "
                             f"multiple of {2 * tp}")
        _torchrun(cfg, out, resume)         # launched by torchrun: every rank runs this
        return read_trials(out)
    _folder(out)
    with locked(out):                 # checked under the lock: no second writer between
        prepare(cfg, out, resume)
        repair(out)
        write_config(cfg, out)
        done = done_ids(out)
        todo = [t for t in trials(cfg) if t["id"] not in done]
        base = pretrained(cfg.train, out, cfg.threads) if todo else None
        if todo and pairs:
            from abft.eval import replicas
            replicas.spawn_pairs(pairs, _DistRun(cfg.train, todo, out, cfg.threads),
                                 threads=cfg.threads, tp=tp)
        elif todo:
            with threads(cfg.threads):
                bar = Progress(len(todo)) if progress else None
                for t in todo:
                    append(os.path.join(out, "trials.jsonl"), run_trial(t, cfg.train, base))
                    if bar:
                        bar.tick(t["id"])
        return read_trials(out)


PRETRAIN_FIELDS = ("digits", "dim", "layers", "heads", "batch", "lr", "pretrain_steps", "seed")


def pretrained(train, out, nthreads):
    """The pretrained state, made once per campaign: ``pretrain.bin`` (raw tensors) and
    ``pretrain.json`` (their names, dtypes, shapes, the pretraining fields and a SHA-256 of the
    bytes). Reused by every trial, rank and resume when the fields and the hash agree; made again
    (and rewritten) otherwise. Nothing is unpickled."""
    import torch
    fields = {k: getattr(train, k) for k in PRETRAIN_FIELDS} | {"threads": nthreads,
                                                                "torch": torch.__version__}
    index_path, bin_path = os.path.join(out, "pretrain.json"), os.path.join(out, "pretrain.bin")
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        with open(bin_path, "rb") as f:
            data = f.read()
        if index["fields"] == fields and hashlib.sha256(data).hexdigest() == index["sha256"]:
            base = {}
            for t in index["tensors"]:
                raw = bytearray(data[t["offset"]:t["offset"] + t["nbytes"]])
                base[t["name"]] = torch.frombuffer(raw, dtype=getattr(torch, t["dtype"])) \
                    .reshape(t["shape"]).clone()
            return base
        print(f"abft eval: {index_path}: another pretraining or a changed file; pretraining again",
              file=sys.stderr)
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        print(f"abft eval: {index_path}: unreadable; pretraining again", file=sys.stderr)
    with threads(nthreads):
        base = pretrain(train)
    tensors, chunks, offset = [], [], 0
    for name, v in base.items():
        raw = v.contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b""
        tensors.append({"name": name, "dtype": str(v.dtype).replace("torch.", ""),
                        "shape": list(v.shape), "offset": offset, "nbytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    data = b"".join(chunks)
    with open(bin_path + ".tmp", "wb") as f:
        f.write(data)
    with open(index_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"fields": fields, "sha256": hashlib.sha256(data).hexdigest(),
                   "tensors": tensors}, f, indent=1)
    os.replace(bin_path + ".tmp", bin_path)
    os.replace(index_path + ".tmp", index_path)
    return base


@contextlib.contextmanager
def threads(n):
    """torch on ``n`` threads for the duration (results depend on the thread count)."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _DistRun:
    """What each spawned rank runs: its pair's share of the trials (picklable for spawn)."""

    def __init__(self, train, todo, out, nthreads=1):
        self.train, self.todo, self.out, self.threads = train, todo, out, nthreads

    def __call__(self, rank, link):
        import torch.distributed as dist
        from abft.eval.replicas import pair_of
        tp = self.train.tp
        pair, role, _ = pair_of(rank, tp)
        npairs = dist.get_world_size() // (2 * tp)
        if rank == 0:
            pretrained(self.train, self.out, self.threads)     # made once, here or before
        dist.barrier()
        base = pretrained(self.train, self.out, self.threads)
        # both ranks of a twin link start from H's pretrained state, bit for bit
        for v in base.values():
            if role == "H":
                link.send(v)
            else:
                v.copy_(link.recv(v))
        for t in self.todo[pair::npairs]:
            rec = run_trial(t, self.train, base, link=link, role=role)
            if rec is not None:
                append(os.path.join(self.out, f"trials-pair{pair}.jsonl"), rec)
        dist.barrier()          # every F rank has written before rank 0 reads the trials


def _torchrun(cfg, out, resume):
    """Under torchrun: rank 0 checks and prepares the folder (holding its lock), every rank
    learns the outcome, then each pair runs its share."""
    import torch
    import torch.distributed as dist

    from abft.eval.replicas import make_link
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        with contextlib.ExitStack() as stack:
            err, failure = [None], None
            if rank == 0:
                try:
                    _folder(out)
                    stack.enter_context(locked(out))
                    prepare(cfg, out, resume)
                    repair(out)
                    write_config(cfg, out)
                except (ValueError, OSError, Busy) as e:
                    err, failure = [str(e)], e
            dist.broadcast_object_list(err, src=0)
            if failure is not None:
                raise failure
            if err[0] is not None:
                raise ValueError(f"rank 0 refused the run folder: {err[0]}")
            done = done_ids(out, warn=rank == 0)
            todo = [t for t in trials(cfg) if t["id"] not in done]
            if todo:
                _DistRun(cfg.train, todo, out, cfg.threads)(
                    rank, make_link(rank, world, cfg.train.tp))
    finally:
        dist.destroy_process_group()
