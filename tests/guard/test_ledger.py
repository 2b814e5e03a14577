"""The device ledger: strikes across steps and runs, strike-out quarantine, the guard's exit code
for schedulers, release, ``abft ledger``; two gloo ranks with a faulty device on one."""
import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

import abft
from abft import cli
from abft.guard.ledger import QUARANTINE_EXIT, Ledger, this_device
from abft.eval.replicas import free_port
from test_guard import _closure, _setup
from ranks import exit_clean


def test_strikes_are_weighted_windowed_and_judged(tmp_path):
    lg = Ledger(tmp_path, strikes=3, window_hours=1.0)
    assert lg.strike("h", "cuda:0", persistence="transient")["weight"] == 1
    st = lg.state("h", "cuda:0")
    # a clean rerun lowers suspicion, it does not clear it
    assert (st["suspicion"], st["strikes"], st["quarantined"]) == (1, 1, False)
    lg.strike("h", "cuda:0")                                   # unconfirmed: 2
    assert lg.judge("h", "cuda:0")["quarantined"]
    assert lg.state("h", "cuda:1")["suspicion"] == 0           # other devices untouched
    assert not lg.state("h", "cuda:0", now=time.time() + 7200)["suspicion"]   # out of the window
    assert lg.state("h", "cuda:0", now=time.time() + 7200)["quarantined"]     # until released
    lg.release("h", "cuda:0", note="replaced")
    st = lg.state("h", "cuda:0")
    assert not st["quarantined"] and st["suspicion"] == 0      # earlier strikes stop counting
    assert lg.strike("h", "cuda:0", persistence="persistent")["weight"] == 3
    assert lg.judge("h", "cuda:0")["quarantined"]              # one persistent fault is enough
    assert lg.devices() == [("h", "cuda:0")]


def test_a_torn_last_line_is_skipped(tmp_path):
    lg = Ledger(tmp_path)
    lg.strike("h", "cpu:0")
    with open(lg._file("h", "cpu:0"), "a") as f:
        f.write('{"time": 1, "event": "str')                  # a crash mid-write
    assert lg.state("h", "cpu:0")["strikes"] == 1


@pytest.mark.parametrize("line", ['{"time": 1, "event": "str\n', "garbage\n",
                                  '{"time": 1, "event": "strike", "host": "h"}\n',
                                  '{"time": "x", "event": "release", "host": "h", "device": "d"}\n'])
def test_a_damaged_ledger_is_refused_naming_the_file_and_line(tmp_path, capsys, line):
    lg = Ledger(tmp_path)
    lg.strike("h", "cpu:0")
    with open(lg._file("h", "cpu:0"), "a") as f:
        f.write(line)
    lg.strike("h", "cpu:0")                   # damage in the middle, not a torn end
    with pytest.raises(ValueError, match=r"h__cpu_0\.jsonl:2: not a ledger record"):
        lg.state("h", "cpu:0")
    assert cli.main(["ledger", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "jsonl:2" in err


def _append_many(path, n, tag):
    lg = Ledger(path)
    for i in range(n):
        lg.strike("h", "cpu:0", writer=tag, i=i)


def test_concurrent_writers_leave_every_record_whole(tmp_path):
    """Two processes on one device file (a restart racing a dying rank): appends stay whole."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), 200, t)) for t in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    recs = Ledger(tmp_path).records("h", "cpu:0")
    assert sorted((r["writer"], r["i"]) for r in recs) == \
        sorted((t, i) for t in ("a", "b") for i in range(200))


@pytest.mark.parametrize("kw, field", [(dict(strikes=0), "strikes"), (dict(strikes=True), "strikes"),
                                       (dict(window_hours=0), "window_hours"),
                                       (dict(window_hours="1"), "window_hours")])
def test_bad_ledger_settings_name_the_field(tmp_path, kw, field):
    with pytest.raises(ValueError, match=field):
        Ledger(tmp_path, **kw)


def _fault(times=1):
    return abft.inject(when=lambda c: c.module == "0" and c.phase == "forward", kind="add",
                       value=50.0, times=times)


def _run(tmp_path, steps, faults, times=1, **kw):
    """Guarded steps with a fault at the steps in ``faults``; returns (guard, exit code or None,
    the steps run)."""
    model, opt = _setup()
    guard, done = None, []
    try:
        guard = abft.StepGuard(opt, ledger=str(tmp_path), **kw)
        for s in range(steps):
            if s in faults:
                with _fault(times):
                    guard.step(_closure(model, s))
            else:
                guard.step(_closure(model, s))
            done.append(s)
    except abft.GuardHalt as e:
        return guard, e.code, done, e
    return guard, None, done, None


def test_transient_faults_strike_out_the_device_and_it_stays_out(tmp_path):
    guard, code, done, err = _run(tmp_path, 8, {1, 3, 5}, decision="rerun")
    # three transient faults, each rerun clean (weight 1): the third reaches the limit of 3
    assert code == QUARANTINE_EXIT and done == [0, 1, 2, 3, 4], (code, done)
    assert "quarantine at step 5" in str(err) and "do not requeue" in str(err)
    host, dev = this_device()
    st = Ledger(tmp_path).state(host, dev)
    assert st["quarantined"] and st["strikes"] == 3 and st["suspicion"] == 3
    # the next run on this device stops before its first step, with the same code
    _, code, done, err = _run(tmp_path, 2, set())
    assert code == QUARANTINE_EXIT and done == [] and "already quarantined" in str(err)
    Ledger(tmp_path).release(host, dev)
    assert _run(tmp_path, 2, set())[1] is None


def test_a_persistent_fault_quarantines_at_once_instead_of_the_plain_halt(tmp_path):
    guard, code, done, err = _run(tmp_path, 3, {1}, times=None, decision="rerun")
    assert code == QUARANTINE_EXIT and done == [0]
    rec = Ledger(tmp_path).records(*this_device())
    assert [r["event"] for r in rec] == ["strike", "quarantine"]
    assert rec[0]["persistence"] == "persistent" and rec[0]["weight"] == 3
    assert rec[0]["alarms"][0]["module"] == "0"


def test_without_a_ledger_nothing_is_written_and_halt_keeps_its_code(tmp_path):
    model, opt = _setup()
    guard = abft.StepGuard(opt, decision="halt")
    with _fault(), pytest.raises(abft.GuardHalt) as e:
        guard.step(_closure(model, 0))
    assert e.value.code == 43 and not os.listdir(tmp_path)


def test_cli_prints_releases_and_refuses_bad_input(tmp_path, capsys):
    _run(tmp_path, 3, {1}, times=None, decision="rerun")
    host, dev = this_device()
    assert cli.main(["ledger", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "QUARANTINED" in out and host in out and dev in out
    assert cli.main(["ledger", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["quarantined"] and rows[0]["suspicion"] == 3
    assert cli.main(["ledger", str(tmp_path / "nowhere")]) == 2
    assert "job_dir" in capsys.readouterr().err
    assert cli.main(["ledger", str(tmp_path), "--release", "otherhost:cuda:7"]) == 2
    assert "--release" in capsys.readouterr().err
    assert cli.main(["ledger", str(tmp_path), "--strikes", "0"]) == 2
    assert "strikes" in capsys.readouterr().err
    assert cli.main(["ledger", str(tmp_path), "--release", f"{host}:{dev}", "--note", "swapped"]) == 0
    assert "ok" in capsys.readouterr().out and not Ledger(tmp_path).state(host, dev)["quarantined"]


def _worker(rank, port, out):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, opt = _setup()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        guard = abft.StepGuard(opt, decision="rerun", ledger=out)
        code, done = None, []
        try:
            for s in range(6):
                g = torch.Generator().manual_seed(10 * s + rank)
                x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
                run = lambda: torch.nn.functional.mse_loss(ddp(x), y).backward()
                if rank == 1 and s in (1, 2, 3):          # rank 1's device fires now and then
                    with _fault():
                        guard.step(run)
                else:
                    guard.step(run)
                done.append(s)
        except abft.GuardHalt as e:
            code = e.code
        with open(os.path.join(out, f"r{rank}.json"), "w") as f:
            json.dump(dict(code=code, done=done, device=this_device()), f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    exit_clean()


def test_two_ranks_halt_together_and_only_the_faulty_device_is_struck(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    res = [json.load(open(tmp_path / f"r{r}.json")) for r in (0, 1)]
    assert [r["code"] for r in res] == [QUARANTINE_EXIT] * 2, res
    assert [r["done"] for r in res] == [[0, 1, 2]] * 2, res
    lg = Ledger(tmp_path)
    assert lg.state(*res[1]["device"])["quarantined"] and lg.state(*res[1]["device"])["strikes"] == 3
    assert lg.state(*res[0]["device"])["strikes"] == 0 and not lg.state(*res[0]["device"])["quarantined"]
