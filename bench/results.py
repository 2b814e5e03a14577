"""A benchmark's results as one JSON file: the figures with the machine, the date, the command
line and the load, so that a table or plot can be rebuilt from the file alone
(``benchmarks/plot.py``). Every script of benchmarks/ and ``abft bench`` take ``--json [FILE]``:
without FILE, ``benchmarks/data/NAME.json``."""
import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import sys
import time

DATA = pathlib.Path("benchmarks") / "data"     # from the repository's root, where the scripts run


def add_arguments(ap, name, more=""):
    """``--json [FILE]`` (FILE defaults to benchmarks/data/NAME.json) and ``--note TEXT``."""
    ap.add_argument("--json", nargs="?", const=str(DATA / f"{name}.json"), default=None,
                    metavar="FILE", help=f"write the results as JSON (default FILE: "
                                         f"{DATA / name}.json{more})")
    ap.add_argument("--note", default="", help="with --json: a remark kept in the file "
                                               "(the machine's load, say)")


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine():
    """CPU model, cores, threads torch uses, load average, Python, torch, triton, GPU."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return dict(cpu=_cpu_model(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                load_average=[round(x, 2) for x in os.getloadavg()],
                python=platform.python_version(), torch=torch.__version__, triton=triton_version,
                gpu=gpu, interpreter=os.environ.get("TRITON_INTERPRET", "") not in ("", "0"))


class Record:
    """Started when the run starts (its clock and load); ``write`` adds the figures."""

    def __init__(self, name, path, note="", argv=None):
        self.name, self.path, self.note = name, path, note
        argv = list(sys.argv if argv is None else argv)
        if argv[0].endswith(".py"):
            argv.insert(0, "python")
        else:
            argv[0] = os.path.basename(argv[0])
        self.command = shlex.join(argv)
        self.t0 = time.time()
        self.load_at_start = [round(x, 2) for x in os.getloadavg()]

    def write(self, figures):
        """Write the file (replaced whole); returns its path, or None without ``--json``."""
        if not self.path:
            return None
        doc = dict(name=self.name, command=self.command,
                   date=datetime.datetime.fromtimestamp(self.t0, datetime.timezone.utc)
                   .isoformat(timespec="seconds"),
                   seconds=round(time.time() - self.t0, 1), load_at_start=self.load_at_start,
                   machine=machine(), note=self.note, figures=figures)
        path = pathlib.Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_plain) + "\n")
        os.replace(tmp, path)
        print(f"results: {path}", file=sys.stderr)
        return path


def start(args, name, argv=None, prog=None):
    """A ``Record`` from parsed ``add_arguments`` options; ``argv`` the arguments given to
    ``prog``'s ``main`` (default benchmarks/NAME.py; None: the process's own command line)."""
    return Record(name, args.json, args.note,
                  None if argv is None else [prog or f"benchmarks/{name}.py", *argv])


def run_rounds(name, measure, rounds, argv=None):
    """``python benchmarks/NAME.py [--rounds N] [--json [FILE]]``: prints ``measure(rounds)``'s
    table and writes the figures it returns."""
    ap = argparse.ArgumentParser(prog=f"python benchmarks/{name}.py")
    ap.add_argument("--rounds", type=int, default=rounds)
    add_arguments(ap, name)
    args = ap.parse_args(argv)
    record = start(args, name, argv)
    record.write(measure(args.rounds))
    return 0


def _plain(x):
    """JSON for what ``json`` cannot write: tuples' and tensors' values, numbers of numpy/torch."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def load(path):
    with open(path) as f:
        return json.load(f)
