"""The ``abft`` command: ``abft --version``, ``abft demo``, ``abft bench``, ``abft eval``,
``abft report``, ``abft ledger``."""
import argparse
import sys

from abft._version import __version__


def _demo(args):
    if args.size < 1:
        print(f"abft demo: --size must be a whole number >= 1, got {args.size}", file=sys.stderr)
        return 2
    if not 0 <= args.bit < 32:
        print(f"abft demo: --bit must be a bit of a float32, 0..31, got {args.bit}", file=sys.stderr)
        return 2
    import torch
    import abft

    torch.manual_seed(args.seed)
    m = k = n = args.size
    a, b = torch.randn(m, k), torch.randn(k, n)
    g = torch.Generator().manual_seed(args.seed)
    row, col = (int(x) for x in torch.randint(0, m, (2,), generator=g))
    bit = args.bit
    print(f"abft {__version__}: a checked {m}x{k} @ {k}x{n} float32 product")
    clean = abft.matmul(a, b)
    print(f"  clean run: bit-identical to torch.matmul: {torch.equal(clean, a @ b)}; "
          f"alarms: {len(abft.flush())}")
    with abft.scope(step=0, module="demo"):
        with abft.inject(row=row, col=col, kind="bitflip", bit=bit) as fault:
            out = abft.matmul(a, b)
    err = (out - a @ b)[row, col].item()
    print(f"  injected: bit {bit} of C[{row}, {col}] flipped before the check (error {err:+.6g})")
    alarms = abft.flush()
    for al in alarms:
        print(f"  alarm: {al}")
    located = [al for al in alarms if (al.row, al.col) == (row, col)]
    print(f"  located at the injected element: {bool(located)}; "
          f"estimated error {located[0].residual:+.6g}" if located else "  NOT located")
    with abft.config(policy="correct"):
        with abft.inject(row=row, col=col, kind="bitflip", bit=bit):
            fixed = abft.matmul(a, b)
    print(f"  policy=correct: max |fixed - torch| = {(fixed - a @ b).abs().max().item():.3g}")
    del fault
    return 0 if located else 1


def _eval(args):
    import os
    from abft.eval import campaign, config, report
    try:
        cfg = config.load(args.config)
        if args.steps is not None:
            if args.steps < 1:
                raise ValueError(f"--steps: a whole number >= 1, got {args.steps}")
            cfg = cfg.with_train(steps=args.steps)
        if args.tp is not None:
            from abft.eval.tp import check
            check(cfg.train.heads, cfg.train.dim, args.tp, "--tp")
            cfg = cfg.with_train(tp=args.tp)
        if args.pairs < 0:
            raise ValueError(f"--pairs: a whole number >= 0, got {args.pairs}")
        campaign.run(cfg, args.out, resume=args.resume, pairs=args.pairs,
                     progress=not args.quiet)
    except (ValueError, OSError, campaign.Busy) as e:
        print(f"abft eval: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # finished trials are on disk; leave at once: tearing down a trial's autograd and gloo
        # threads from here can abort the interpreter (INTERNAL ASSERT ... THPVariable_clear)
        print(f"\nabft eval: interrupted; `abft eval --resume --out {args.out}` goes on from the "
              f"trials done", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    if os.environ.get("RANK", "0") != "0":
        return 0
    s = report.build(args.out)
    text = report.markdown(s)
    print(text if args.full else report.terminal(text))
    print(f"run folder: {args.out} (report.md, report.json, {len(s['plots'])} plots, trials.jsonl)")
    return 0


def _report(args):
    from abft.eval import report
    try:
        s = report.build(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"abft report: {e}", file=sys.stderr)
        return 2
    print(report.markdown(s))
    return 0


def _ledger(args):
    import json
    import os
    from abft.guard.ledger import Ledger, table
    try:
        if not os.path.isdir(args.job_dir):
            raise ValueError(f"job_dir: no such folder: {args.job_dir}")
        ledger = Ledger(args.job_dir, strikes=args.strikes, window_hours=args.window_hours)
        if args.release:
            host, sep, dev = args.release.partition(":")        # node1:cuda:0
            if (host, dev) not in ledger.devices() or not sep:
                raise ValueError(f"--release: HOST:DEVICE of a device on record "
                                 f"({', '.join(h + ':' + d for h, d in ledger.devices()) or 'none'}), "
                                 f"got {args.release!r}")
            ledger.release(host, dev, note=args.note or "")
        if args.json:
            print(json.dumps([ledger.state(h, d) for h, d in ledger.devices()], indent=1))
        else:
            table(ledger)
    except ValueError as e:
        print(f"abft ledger: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="abft", description="Checked GEMMs against silent data corruption")
    ap.add_argument("--version", action="version", version=f"abft {__version__}")
    sub = ap.add_subparsers(dest="cmd")
    d = sub.add_parser("demo", help="a checked product with one injected fault, located")
    d.add_argument("--size", type=int, default=1024)
    d.add_argument("--bit", type=int, default=22, help="bit of the float32 element to flip")
    d.add_argument("--seed", type=int, default=0)
    bn = sub.add_parser("bench", help="overhead of checked against plain products (interleaved)")
    from abft.bench import overhead
    overhead.add_arguments(bn)
    ev = sub.add_parser("eval", help="a detection-coverage campaign: paired replicas, faults, report")
    ev.add_argument("config", nargs="?", help="campaign config (TOML or JSON); default: embedded")
    ev.add_argument("--out", default="runs/eval", help="the run folder")
    ev.add_argument("--resume", action="store_true", help="skip the trials already in --out")
    ev.add_argument("--pairs", type=int, default=0,
                    help="N > 0: N distributed replica pairs (2N gloo ranks on this machine)")
    ev.add_argument("--steps", type=int, help="override train.steps")
    ev.add_argument("--tp", type=int, help="override train.tp: each replica a tensor-parallel "
                    "group of N ranks (2N gloo ranks a pair)")
    ev.add_argument("--full", action="store_true", help="print the whole report")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    rp = sub.add_parser("report", help="rebuild a run folder's report")
    rp.add_argument("run_dir")
    lg = sub.add_parser("ledger", help="the device ledger of a job folder: strikes, quarantines")
    lg.add_argument("job_dir", help="the folder given to StepGuard(ledger=...)")
    lg.add_argument("--strikes", type=int, default=3, help="the quarantine limit to judge by")
    lg.add_argument("--window-hours", type=float, default=24.0, help="how far back strikes count")
    lg.add_argument("--release", metavar="HOST:DEVICE",
                    help="end that device's quarantine (repaired or replaced): earlier strikes "
                         "stop counting")
    lg.add_argument("--note", help="with --release: why (kept in the ledger)")
    lg.add_argument("--json", action="store_true", help="the states as JSON")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)      # what a benchmark's file records
    if args.cmd == "eval":
        return _eval(args)
    if args.cmd == "report":
        return _report(args)
    if args.cmd == "ledger":
        return _ledger(args)
    if args.cmd == "demo":
        return _demo(args)
    if args.cmd == "bench" and args.validate:
        from abft.bench import validate
        return validate.main(args)
    if args.cmd == "bench":
        return overhead.main(args)
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
