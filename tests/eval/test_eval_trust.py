"""The evaluation's own correctness: campaigns that cannot mix, faults that behave like the
defects they model, counts that mean what they say, and bad input refused in one line."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import abft
from abft.cli import main
from abft.eval import campaign, config, crosscheck, report
from abft.eval import faults as fm
from abft.eval.config import TrainConfig
from abft.eval.replicas import pretrain, run_trial

TINY = TrainConfig(dim=16, batch=8, micro_steps=2, pretrain_steps=10, steps=4)

TOML = """
seed = 0
[train]
dim = 16
batch = 8
pretrain_steps = 10
steps = 2
[[profiles]]
name = "alu"
rate = 1.0
sites = { gemm_accumulator = 1.0, weight_memory = 1.0, gemm_output = 1.0 }
kinds = { bitflip = 1.0, scale = 1.0 }
[[profiles]]
name = "alu-twin"
rate = 1.0
sites = { gemm_accumulator = 1.0, weight_memory = 1.0, gemm_output = 1.0 }
kinds = { bitflip = 1.0, scale = 1.0 }
"""


@pytest.fixture(scope="module")
def base():
    return pretrain(TINY)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust") / "run"
    cfg = config.loads(TOML)
    recs = campaign.run(cfg, str(out), progress=False)
    return out, cfg, {r["id"]: r for r in recs}


# ------------------------------------------------------------------ campaigns that cannot mix

def test_resume_with_another_config_is_refused_naming_what_differs(run_dir, capsys, tmp_path):
    out, cfg, _ = run_dir
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    before = (out / "config.json").read_text()
    assert main(["eval", str(path), "--out", str(out), "--resume", "--steps", "3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "train.steps" in err and len(err.strip().splitlines()) == 1
    path.write_text(TOML.replace('name = "alu-twin"', 'name = "alu-2"'))
    assert main(["eval", str(path), "--out", str(out), "--resume", "--quiet"]) == 2
    assert "profiles[1].name" in capsys.readouterr().err
    assert (out / "config.json").read_text() == before            # nothing overwritten
    assert json.loads(before)["hash"] == campaign.config_hash(cfg)


def test_every_record_names_its_campaign_and_environment(run_dir):
    _, cfg, recs = run_dir
    for r in recs.values():
        assert r["campaign"] == campaign.config_hash(cfg)
        assert r["env"]["threads"] == cfg.threads == 1
        assert r["env"]["torch"] == torch.__version__ and r["env"]["backend"] == "reference"
        assert r["env"]["host"]


def test_each_profile_draws_its_own_faults(run_dir):
    _, _, recs = run_dir
    a, b = recs["alu/computation/0"], recs["alu-twin/computation/0"]
    assert a["fault_seed"] != b["fault_seed"]
    where = [[(e["site"], e["module"], e["phase"], e["urow"]) for e in r["events"]] for r in (a, b)]
    assert where[0] != where[1]


def test_the_same_trial_draws_the_same_faults_in_every_mode():
    cfg = config.loads(TOML.replace(
        'kinds = { bitflip = 1.0, scale = 1.0 }\n[[', 'kinds = { bitflip = 1.0, scale = 1.0 }\n'
        'modes = ["computation", "parameter"]\n[[', 1))
    ts = {t["id"]: t for t in campaign.trials(cfg)}
    assert ts["alu/computation/0"]["fault_seed"] == ts["alu/parameter/0"]["fault_seed"]
    assert ts["alu/computation/0"]["seed"] == ts["alu-twin/computation/0"]["seed"]   # same data


def test_a_torn_last_line_is_cut_and_its_trial_runs_again(run_dir, tmp_path, capsys):
    out, cfg, recs = run_dir
    copy = tmp_path / "run"
    os.makedirs(copy)
    for f in ("config.json", "trials.jsonl"):
        (copy / f).write_bytes((out / f).read_bytes())
    lines = (copy / "trials.jsonl").read_text().splitlines()
    (copy / "trials.jsonl").write_text(lines[0] + "\n" + lines[1][:60])      # no newline
    campaign.run(cfg, str(copy), resume=True, progress=False)
    assert "torn last line" in capsys.readouterr().err
    got = [json.loads(x) for x in (copy / "trials.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in got) == sorted(recs)


def test_a_second_writer_is_kept_out(run_dir, tmp_path, capsys):
    out, cfg, _ = run_dir
    other = tmp_path / "busy"
    os.makedirs(other)
    with open(other / "lock.json", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write('{"pid": 4242}')
        f.flush()
        with pytest.raises(campaign.Busy, match="4242"):
            campaign.run(cfg, str(other), progress=False)
    assert not list(other.glob("trials*.jsonl"))


# launched as a script's background job or under nohup: SIGINT ignored, which the ranks
# inherit, so torch's own parent-death SIGINT does not stop them
_SLEEPER = """
import signal, sys, time
from abft.eval import replicas
signal.signal(signal.SIGINT, signal.SIG_IGN)

class Sleep:
    def __call__(self, rank, link):
        open(sys.argv[1] + f"/{rank}.pid", "w").write(str(__import__("os").getpid()))
        time.sleep(600)

if __name__ == "__main__":
    replicas.spawn_pairs(1, Sleep())
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_their_parent(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.time() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 2 and all(map(_alive, pids))
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 10
        while any(map(_alive, pids)) and time.time() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, "ranks outlived their parent"
    finally:
        parent.kill()


# ------------------------------------------------------------------ faults like real defects

def _event(**kw):
    tg = {"gemm": {"m": "linear"}, "nongemm": [], "weights": {"m.weight": "m"}}
    prof = fm.Profile("p", rate=1.0, timing="permanent", sites={"weight_memory": 1.0},
                     kinds={"bitflip": 1.0}, bits={"exponent_msb": 1.0}, multi_bit=0.0, **kw)
    return fm.schedule(prof, 4, 1, tg, 0)


def test_a_stuck_bit_stays_stuck():
    events = _event()
    assert len(events) == 4 and {e.fault for e in events} == {0}
    w = torch.full((4, 4), 0.5)
    flipped = None
    for ev in events:                      # the weight at rest, before each step
        fm.corrupt(ev, w)
        r, c = ev.applied[0]["row"], ev.applied[0]["col"]
        flipped = float(w[r, c]) if flipped is None else flipped
        assert float(w[r, c]) == flipped != 0.5          # set, never set back
    assert [e.applied[0]["changed"] for e in events] == [1, 0, 0, 0]
    w.fill_(0.5)                           # restored from the healthy replica: stuck again
    fm.corrupt(events[-1], w)
    assert float(w[r, c]) == flipped
    assert events[0].to_dict()["stuck"] is not None and "shared" not in events[0].to_dict()


def test_a_stuck_weight_bit_keeps_the_run_apart(base):
    prof = fm.Profile("p", rate=1.0, timing="permanent", onset=1, sites={"weight_memory": 1.0},
                     kinds={"bitflip": 1.0}, bits={"mantissa_high": 1.0}, multi_bit=0.0)
    rec = run_trial({"id": "t", "profile": prof, "mode": "none", "seed": 3}, TINY, base)
    div = rec["param_divergence"]
    assert div[0] == 0.0 and div[1] > 0
    assert all(d > 0.5 * div[1] for d in div[1:]), div      # a toggle would undo it every other step


def test_the_stuck_kind_forces_bits_in_a_checked_product():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    with abft.config(policy="record"):
        with abft.inject(row=3, col=4, kind="stuck", bit=30, value=None, times=None) as h:
            c1 = abft.matmul(a, b)
            c2 = abft.matmul(a, b)
        abft.flush()
    v = h.injection.value
    assert v is not None and [x.changed for x in h.hits] == [1, 1]
    bit = c1.view(torch.int32)[3, 4] & (1 << 30)
    assert int(bit) == (v & (1 << 30)) and torch.equal(c1, c2)


def test_an_accumulator_fault_that_changes_nothing_is_masked():
    a, b = torch.randn(16, 8), torch.randn(8, 16)
    a[5] = 0.0                             # row 5 of the product is exactly zero
    with abft.config(policy="record"):
        with abft.inject(row=5, col=2, kind="zero") as h:
            abft.matmul(a, b)
        abft.flush()
    assert h.hits[0].changed == 0
    ev = dict(id=0, step=0, fault=0, site="gemm_accumulator", module="m", phase="forward",
              kind="zero", pattern="element", bits=None, micro_step=0,
              applied=[{"shape": [16, 16], "row": 5, "col": 2, "changed": 0, "ratio": 0.0}])
    trial = {"events": [ev], "mismatches": [], "alarms": [], "micro_steps": 1}
    (c,) = crosscheck.cases(trial)
    assert c["changed"] is False and c["outcome"] == "masked"


def test_the_below_threshold_ratio_is_the_faults_tiles_not_the_products():
    a, b = torch.randn(256, 64), torch.randn(64, 256)
    ratios = lambda v: torch.maximum(v[..., 0], v[..., 3])      # noqa: E731
    with abft.config(policy="record", tiles=(32, 32)):
        with abft.inject(row=0, col=0, kind="add", value=0.0) as h:      # changes nothing
            abft.matmul(a, b)
        calm = ratios(h.hits[0].verdict)
        tr, tc = divmod(int(calm.argmin()), calm.shape[1])       # the calmest tile
        row, col = tr * 32 + 5, tc * 32 + 7
        with abft.inject(row=row, col=col, kind="bitflip", bit=0) as h:
            abft.matmul(a, b)
        abft.flush()
    ctx = h.hits[0]
    assert ctx.tiles == (32, 32)
    rec = {"shape": [256, 256], "row": row, "col": col, "pattern": "element"}
    mine = fm.fault_tiles(ctx.verdict, rec, ctx.tiles)
    assert tuple(mine.shape[:2]) == (1, 1)
    assert float(ratios(mine).max()) == float(ratios(ctx.verdict)[tr, tc])
    assert float(ratios(mine).max()) < float(ratios(ctx.verdict).max())   # not the product's
    row = {"shape": [256, 256], "row": 70, "col": 0, "pattern": "row"}
    assert tuple(fm.fault_tiles(ctx.verdict, row, ctx.tiles).shape[:2]) == (1, 8)


# ------------------------------------------------------------------ counts that mean what they say

def _case_trial(mode="computation", events=(), alarms=(), mismatches=(), **kw):
    t = {"id": f"p/{mode}/0", "profile": "p", "mode": mode, "seed": 0, "fault_seed": 7,
         "steps": 6, "micro_steps": 2, "events": list(events), "alarms": list(alarms),
         "alarms_healthy": [], "mismatches": list(mismatches), "grad_deviation": [],
         "param_divergence": [], "loss_healthy": [], "loss_faulty": [], "accuracy_healthy": 1.0,
         "accuracy_faulty": 1.0, "wall_s": 0.0}
    t.update(kw)
    return t


def _ev(i, step, fault=None, site="gemm_accumulator", micro=0, bits=(30,), changed=1):
    return dict(id=i, step=step, fault=i if fault is None else fault, site=site, module="m",
                phase="forward", kind="bitflip", pattern="element", bits=list(bits),
                micro_step=micro, applied=[{"shape": [8, 8], "row": 0, "col": 0,
                                            "changed": changed, "ratio": 5.0}])


def _mm(step):
    return dict(step=step, micro_step=0, point="forward", module="m", tensor="output", numel=64,
                mismatched=1, frequency=1 / 64, severity_max=1.0, severity_median=1.0, max_abs=1.0,
                nonfinite=0, row=0, col=0)


def _al(step, micro=0):
    return dict(step=step, micro_step=micro, kind="checksum", module="m", phase="forward",
                row=0, col=0, batch=None)


def test_detected_by_names_the_check_not_the_module():
    rest = dict(_al(1), kind="rest", module="m.weight", phase="param")
    cached = dict(_al(2), kind="checksum")
    recompute = dict(_al(3), kind="recompute")
    ts = [_case_trial(events=[_ev(0, 1, site="weight_memory"), _ev(1, 2, site="weight_memory"),
                              _ev(2, 3, site="nongemm_op")],
                      mismatches=[_mm(1), _mm(2), _mm(3)], alarms=[rest, cached, recompute])]
    assert report.summarize(ts)["detected_by"] == {
        "weight_memory/rest": 1, "weight_memory/cached weight checksums": 1,
        "nongemm_op/recompute": 1}


def test_an_alarm_on_a_harmless_fault_is_not_a_false_alarm():
    t = _case_trial(events=[_ev(0, 1)], alarms=[_al(1)])
    (c,) = crosscheck.cases(t)
    assert c["outcome"] == "alarm_no_mismatch"
    s = report.summarize([t])
    assert s["false_alarms"]["alarms"] == 0 and s["per_site"]["gemm_accumulator"]["alarm_no_mismatch"] == 1
    t2 = _case_trial(events=[], alarms=[_al(2)])
    assert report.summarize([t2])["false_alarms"]["alarms"] == 1


def test_distinct_faults_and_events_are_counted_apart():
    evs = [_ev(i, s, fault=0) for i, s in enumerate((1, 2, 3))]          # one stuck unit
    trials = [_case_trial(mode, events=evs, alarms=[_al(s) for s in (1, 2, 3)],
                          mismatches=[_mm(s) for s in (1, 2, 3)])
              for mode in ("computation", "parameter")]
    s = report.summarize(trials)
    assert s["per_pattern"]["gemm_accumulator/element"]["detected"] == 6
    site = s["per_site"]
    assert site["gemm_accumulator"]["faults"] == 1 and site["gemm_accumulator"]["events"] == 6
    assert site["gemm_accumulator"]["faults_detected"] == 1
    assert set(site) == set(fm.SITES) and site["nongemm_op"]["faults"] == 0  # undrawn sites stay


def test_latency_runs_from_the_fault_to_its_first_alarm():
    t = _case_trial(events=[_ev(0, 2, micro=1)], alarms=[_al(4, micro=0)],
                    mismatches=[_mm(2)])
    (c, _) = [x for x in crosscheck.cases(t)]
    assert c["outcome"] == "missed" and c["latency"] == {"steps": 2, "micro_steps": 3}
    lat = report.summarize([t])["latency"]
    assert (lat["steps_max"], lat["micro_steps_max"]) == (2, 3)


def test_a_multi_bit_flip_is_no_single_bits_figure():
    t = _case_trial(events=[_ev(0, 1, bits=(3, 30))], alarms=[_al(1)], mismatches=[_mm(1)])
    s = report.summarize([t])
    assert s["per_bit"] == {}
    assert s["per_bit_class"]["gemm_accumulator/exponent_msb"]["detected"] == 1
    assert s["per_bit_count"]["gemm_accumulator/2"]["detected"] == 1


def test_worst_gradient_deviation_is_under_parameter_sync_only():
    ts = [_case_trial("computation", grad_deviation=[5.0]),
          _case_trial("parameter", grad_deviation=[0.0, 0.1])]
    assert report.summarize(ts)["grad_deviation_max"] == 0.1


def test_plots_draw_zero_as_zero_and_mismatches_as_frequencies(tmp_path, monkeypatch):
    import matplotlib.axes
    seen = []
    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kw):
        seen.append((self, [list(a) for a in args]))      # titled after plotting
        return real(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    ts = [_case_trial("computation", events=[_ev(0, 1)], mismatches=[_mm(1)], alarms=[_al(1)]),
          _case_trial("parameter", grad_deviation=[0.0, 1e-3] + [0.0] * 4)]
    s = report.build(str(tmp_path), ts)
    ys = {ax.get_title(): args[-1] for ax, args in seen}
    grad = next(v for k, v in ys.items() if k.startswith("Gradient deviation"))
    assert grad[:2] == [0.0, 1e-3]
    freq = next(v for k, v in ys.items() if k.startswith("Mismatch frequency"))
    assert max(freq) == 1 / 64
    md = (tmp_path / "report.md").read_text()
    assert all(f"`{p}`" in md for p in s["plots"]) and len(s["plots"]) == 5


# ------------------------------------------------------------------ bad input, one line

BAD = [
    ('[[profiles]]\nrate = 0.5', "name"),
    ('[[profiles]]\nname = "a/b"', "name"),
    ('[[profiles]]\nname = "a"\nrate = true', "rate"),
    ('seeds = true\n[[profiles]]\nname = "a"', "seeds"),
    ('[[profiles]]\nname = "a"\nscale = 5', "scale"),
    ('[[profiles]]\nname = "a"\nscale = [1.0, inf]', "scale"),
    ('[[profiles]]\nname = "a"\nsites = { gemm_output = inf }', "gemm_output"),
    ('[[profiles]]\nname = "a"\nrate = "often"', "rate"),
    ('[[profiles]]\nname = "a"\nmulti_bit = "x"', "multi_bit"),
    ('threads = 0\n[[profiles]]\nname = "a"', "threads"),
    ('[train]\nsteps = 5\n[[profiles]]\nname = "a"\nonset = 5', "onset"),
    ('[train]\nrest = 1\n[[profiles]]\nname = "a"', "train.rest"),
    ('[train]\nrecompute = 2\n[[profiles]]\nname = "a"', "train.recompute"),
    ('[train]\ncomm = "yes"\n[[profiles]]\nname = "a"', "train.comm"),
    # the triton backend injects one element's bit flip or zero in the kernel, nothing else
    ('backend = "triton"\n[[profiles]]\nname = "a"', "kinds"),
    ('backend = "triton"\n[[profiles]]\nname = "a"\nkinds = { zero = 1 }\n'
     'patterns = { periodic = 1 }', "patterns"),
    ('backend = "triton"\n[[profiles]]\nname = "a"\nkinds = { bitflip = 1 }', "multi_bit"),
    ('backend = "triton"\n[[profiles]]\nname = "a"\nkinds = { signflip = 1 }\n'
     'timing = "permanent"', "timing"),
]


@pytest.mark.parametrize("text,field", BAD)
def test_bad_config_is_one_line_naming_the_field(tmp_path, capsys, text, field):
    p = tmp_path / "c.toml"
    p.write_text(text)
    out = tmp_path / "r"
    assert main(["eval", str(p), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
    assert not out.exists()                          # nothing half-written


def test_the_triton_backend_takes_what_its_kernel_injects():
    ok = ('backend = "triton"\n[[profiles]]\nname = "a"\nkinds = { bitflip = 1, zero = 1 }\n'
          'multi_bit = 0.0\ntiming = "intermittent"\n'
          '[[profiles]]\nname = "b"\nsites = { weight_memory = 1 }\ntiming = "permanent"')
    cfg = config.loads(ok)
    assert [n.profile.name for n in cfg.profiles] == ["a", "b"]


@pytest.mark.parametrize("args,field", [
    (["--steps", "0"], "--steps"), (["--pairs", "-1"], "--pairs"),
    (["--out", "{file}"], "--out"), (["--out", "{file}/sub"], "Not a directory"),
    (["--out", "/proc/abft-eval"], "/proc/abft-eval")])
def test_bad_arguments_are_one_line(tmp_path, capsys, args, field):
    f = tmp_path / "f"
    f.write_text("x")
    args = [a.replace("{file}", str(f)) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "r")]
    assert main(["eval", "--quiet"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
    assert f.read_text() == "x" and not (tmp_path / "r").exists()


# ------------------------------------------------------------------ the fault library

def test_the_periodic_pattern_repeats_runs_of_four():
    a, b = torch.randn(64, 32), torch.randn(32, 100)
    with abft.config(policy="record", tiles=(32, 32)):
        with abft.inject(pattern="periodic", row=2, col=1, size=(1, 4), stride=32, kind="value",
                         value=50.0) as h:
            c = abft.matmul(a, b)
        alarms = abft.flush()
    hit = sorted(set(range(1, 5)) | set(range(33, 37)) | set(range(65, 69)) | {97, 98, 99})
    assert (c[2] == 50.0).nonzero().flatten().tolist() == hit
    assert h.hits[0].changed == len(hit)
    assert alarms and {al.row for al in alarms} == {2}


@pytest.mark.parametrize("site", ["weight_memory", "optimizer_state"])
def test_the_state_at_rest_check_catches_and_locates_what_the_checksums_miss(base, site):
    import dataclasses
    prof = fm.Profile("p", rate=1.0, onset=1, sites={site: 1.0}, kinds={"bitflip": 1.0},
                     bits={"exponent": 1.0}, multi_bit=0.0).validate()
    trial = {"id": "t", "profile": prof, "mode": "computation", "seed": 2}
    on = crosscheck.cases(run_trial(trial, dataclasses.replace(TINY, rest=True), base))
    off = crosscheck.cases(run_trial(trial, TINY, base))
    hit = [c for c in on if c["changed"]]
    assert len(hit) == 3 and all(c["outcome"] in ("detected", "alarm_no_mismatch") for c in hit)
    assert all(c["by"].startswith("rest ") and c["located"] is True for c in hit), hit
    assert all(c["latency"]["steps"] == 0 for c in hit)
    assert not [c for c in on if c["outcome"] == "false_alarm"]
    if site == "optimizer_state":                       # no GEMM reads an Adam moment
        assert not any(c["alarms"] for c in off if c.get("changed"))


def test_the_recompute_check_catches_and_locates_a_corrupted_norm_or_activation(base):
    import dataclasses
    prof = fm.Profile("p", rate=1.0, onset=1, sites={"nongemm_op": 1.0}, kinds={"bitflip": 1.0},
                     bits={"exponent": 1.0}, multi_bit=0.0).validate()
    trial = {"id": "t", "profile": prof, "mode": "computation", "seed": 4}
    on = crosscheck.cases(run_trial(trial, dataclasses.replace(TINY, recompute=1.0), base))
    off = crosscheck.cases(run_trial(trial, TINY, base))
    hit = [c for c in on if c["changed"] and c["mismatches"]]
    assert hit and all(c["outcome"] == "detected" for c in hit)
    assert all(c["by"].startswith("recompute ") and c["located"] is True for c in hit), hit
    assert not [c for c in on if c["outcome"] == "false_alarm"]
    assert [c["outcome"] for c in off if c["changed"] and c["mismatches"]] == ["missed"] * len(hit)


def test_the_checksummed_all_reduce_catches_and_locates_corrupted_gradients(base):
    """gradient_comm: the corruption lands in the all-reduce's result, after the checksums were
    taken; without train.comm the gradient is corrupted where it lies and nothing sees it."""
    import dataclasses
    prof = fm.Profile("p", rate=1.0, onset=1, sites={"gradient_comm": 1.0}, kinds={"bitflip": 1.0},
                     bits={"exponent": 1.0}, multi_bit=0.0).validate()
    trial = {"id": "t", "profile": prof, "mode": "computation", "seed": 5}
    on = crosscheck.cases(run_trial(trial, dataclasses.replace(TINY, comm=True), base))
    off = crosscheck.cases(run_trial(trial, TINY, base))
    hit = [c for c in on if c["changed"] and c["mismatches"]]
    assert hit and all(c["outcome"] == "detected" for c in hit), on
    assert all(c["by"].startswith("comm ") and c["located"] is True for c in hit), hit
    assert all(c["latency"]["steps"] == 0 for c in hit)
    assert not [c for c in on if c["outcome"] == "false_alarm"]
    assert [c["outcome"] for c in off if c["changed"] and c["mismatches"]] == ["missed"] * len(hit)


def test_pins_fix_where_a_fault_lands():
    tg = fm.targets(TINY.model())
    pin = {"site": "gemm_accumulator", "module": "blocks.1.mlp.out", "phase": "grad_input",
           "micro_step": 1, "row": 3, "col": 5}
    prof = fm.Profile("p", rate=1.0, sites={"gemm_accumulator": 1.0, "nongemm_op": 1.0}, pin=pin)
    prof.validate().check_targets(tg, TINY.micro_steps)
    for e in fm.schedule(prof, 6, 2, tg, 11):
        assert (e.site, e.module, e.phase, e.micro_step, e.row, e.col) == tuple(pin.values())
        inj = fm.injection(e, (40, 16), torch.float32)
        assert (inj.row, inj.col) == (3, 5)


@pytest.mark.slow          # about 5 minutes: a training step under the Triton interpreter
def test_a_trial_on_the_triton_backend_flips_a_bit_in_the_kernel_and_alarms():
    cfg = TrainConfig(dim=16, batch=8, micro_steps=1, pretrain_steps=2, steps=1)
    prof = fm.Profile("p", rate=1.0, kinds={"bitflip": 1.0}, bits={"exponent_msb": 1.0},
                     multi_bit=0.0).validate()
    prof.check_backend("triton")
    rec = run_trial({"id": "t", "profile": prof, "mode": "computation", "seed": 0,
                     "backend": "triton"}, cfg, pretrain(cfg))
    assert rec["env"]["backend"] == "triton"
    applied = [a for e in rec["events"] for a in e["applied"]]
    assert len(applied) == 1, applied          # in the kernel: the bits it changed are not read back
    hit = applied[0]
    assert any((a["module"], a["phase"], a["row"], a["col"]) ==
               (hit["module"], hit["phase"], hit["row"], hit["col"]) for a in rec["alarms"]), \
        (hit, rec["alarms"])
    assert rec["mismatches"]


def test_a_pinned_adam_moment_is_the_one_corrupted():
    tg = fm.targets(TINY.model())
    for state in fm.STATES:
        prof = fm.Profile("p", rate=1.0, sites={"optimizer_state": 1.0}, pin={"state": state})
        events = fm.schedule(prof.validate(), 8, 2, tg, 3)
        assert events and {e.state for e in events} == {state}


@pytest.mark.parametrize("pin,field", [
    ('{ module = "blocks.9.mlp" }', "pin.module"), ('{ micro_step = 2 }', "pin.micro_step"),
    ('{ colour = 1 }', "pin"), ('{ phase = "sideways" }', "pin.phase"),
    ('{ phase = "grad_b" }\nsites = { gemm_output = 1.0 }', "pin.phase"),
    ('{ phase = "backward" }', "pin.phase"),
    ('{ module = "blocks.0.attn.scores" }\nsites = { gemm_accumulator = 1.0, weight_memory = 1.0 }',
     "pin.module"),
    ('{ site = "weight_memory" }\ntiming = "permanent"\nper_gemm = 0.5', "per_gemm"),
    ('{ state = "exp_avg" }', "pin.state"),
    ('{ site = "optimizer_state", state = "momentum" }', "pin.state")])
def test_a_bad_pin_is_one_line(tmp_path, capsys, pin, field):
    p = tmp_path / "c.toml"
    p.write_text(f'[[profiles]]\nname = "a"\npin = {pin}\n')
    assert main(["eval", str(p), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err


def test_a_defective_unit_fires_per_gemm_call_and_a_size_trigger_gates_it(base):
    prof = fm.Profile("p", rate=1.0, timing="permanent", onset=1, sites={"gemm_accumulator": 1.0},
                     kinds={"bitflip": 1.0}, bits={"exponent_msb": 1.0}, multi_bit=0.0,
                     per_gemm=0.2, trigger={"min_k": 64})
    trial = {"id": "t", "profile": prof, "mode": "computation", "seed": 0}
    rec = run_trial(trial, TINY, base)
    assert run_trial(trial, TINY, base)["events"] == rec["events"]      # seeded per call
    applied = [r for e in rec["events"] for r in e["applied"]]
    assert applied and all(r["k"] >= 64 for r in applied)
    # each call's verdict goes with its own record, in every micro-step the unit is armed
    assert {r["ratio_of"] for r in applied} == {"tiles"}
    assert {e["module"] for e in rec["events"]} == {"*"}
    assert len({(r["module"], r["phase"]) for r in applied}) > 1        # any GEMM, not one
    cs = [c for c in crosscheck.cases(rec) if c["outcome"] not in ("not_applied", "masked")]
    assert cs and all(c["outcome"] == "detected" and c["module_ok"] for c in cs)
    other = run_trial(dict(trial, fault_seed=12345), TINY, base)     # another trial's stream
    assert [(r["module"], r["phase"]) for e in other["events"] for r in e["applied"]] != \
        [(r["module"], r["phase"]) for r in applied]
    every = fm.Profile("q", rate=1.0, timing="permanent", sites={"gemm_accumulator": 1.0},
                      kinds={"bitflip": 1.0}, bits={"mantissa_low": 1.0}, multi_bit=0.0,
                      per_gemm=1.0)
    rec1 = run_trial({"id": "u", "profile": every, "mode": "computation", "seed": 0}, TINY, base)
    per_step = [len(e["applied"]) for e in rec1["events"]]
    assert len(set(per_step)) == 1 and per_step[0] > len(applied) / len(rec["events"])


def test_the_first_divergence_is_where_the_fault_began(base):
    prof = fm.Profile("p", rate=1.0, sites={"gemm_operand": 1.0}, kinds={"scale": 1.0},
                     scale=(10.0, 100.0), phases={"forward": 1.0})
    rec = run_trial({"id": "t", "profile": prof, "mode": "computation", "seed": 2}, TINY, base)
    d = crosscheck.first_divergence(rec)
    ev = rec["events"][0]
    assert (d["step"], d["point"], d["module"]) == (ev["step"], "forward", ev["module"])
    assert d["cause"].startswith("gemm_operand scale at " + ev["module"])
    s = report.summarize([rec])
    assert s["first_divergence"]["t"] == d and "first diverged" in report.markdown(s)


def test_pretraining_runs_once_per_campaign(run_dir, tmp_path, monkeypatch, capsys):
    out, cfg, recs = run_dir
    copy = tmp_path / "run"
    os.makedirs(copy)
    for f in ("config.json", "trials.jsonl", "pretrain.json", "pretrain.bin"):
        (copy / f).write_bytes((out / f).read_bytes())
    lines = (copy / "trials.jsonl").read_text().splitlines()
    (copy / "trials.jsonl").write_text(lines[0] + "\n")

    def no(*a, **k):
        raise AssertionError("pretrained again")
    monkeypatch.setattr(campaign, "pretrain", no)
    again = {r["id"]: r for r in campaign.run(cfg, str(copy), resume=True, progress=False)}
    assert {i: r["loss_faulty"] for i, r in again.items()} == \
        {i: r["loss_faulty"] for i, r in recs.items()}
    monkeypatch.undo()
    data = bytearray((copy / "pretrain.bin").read_bytes())
    data[0] ^= 1                                     # a changed checkpoint is not trusted
    (copy / "pretrain.bin").write_bytes(bytes(data))
    base = campaign.pretrained(cfg.train, str(copy), 1)
    assert "pretraining again" in capsys.readouterr().err
    with campaign.threads(1):
        fresh = pretrain(cfg.train)
    assert torch.equal(base["head.weight"], fresh["head.weight"])


def test_level_one_pools_layers_per_submodule_early_and_late():
    def mm(step, module, freq, sev):
        return dict(_mm(step), module=module, frequency=freq, severity_max=sev)
    t = _case_trial("computation", steps=4, mismatches=[
        mm(0, "blocks.0.attn.qkv", 0.1, 1.0), mm(1, "blocks.1.attn.qkv", 0.3, 3.0),
        mm(3, "blocks.0.attn.qkv", 0.5, 2.0), mm(3, "blocks.0.mlp.fc", 0.2, float("inf"))])
    rows = {r["submodule"]: r for r in report.submodule_table([t])}
    qkv = rows["attn.qkv"]
    assert qkv["mismatched_points"] == 3 and qkv["frequency_max"] == 0.5
    assert qkv["frequency_early_mean"] == pytest.approx(0.2) and qkv["frequency_late_mean"] == 0.5
    assert qkv["severity_median"] == 2.0 and rows["mlp.fc"]["severity_median"] is None


def test_level_two_is_the_gradient_deviation_trend_under_parameter_sync():
    ts = [_case_trial("parameter", grad_deviation=[0.01, 0.03, 0.2, float("nan")]),
          _case_trial("computation", grad_deviation=[9.0])]
    g = report.gradient_trend(ts)["p"]
    assert g["first_half"] == pytest.approx(0.02) and g["second_half"] == pytest.approx(0.2)
    assert g["max"] == 0.2 and g["nonfinite_steps"] == 1 and g["trials"] == 1


def test_the_terminal_report_keeps_the_metrics_and_names_what_it_leaves_out():
    ts = [_case_trial("computation", events=[_ev(0, 1)], mismatches=[_mm(1)], alarms=[_al(1)])]
    text = report.markdown(report.summarize(ts))
    short = report.terminal(text)
    assert "## What the faults did" in short and "## Coverage per site" in short
    assert "## Level 1" not in short and "Level 1" in short.splitlines()[-1]


def test_a_reseeded_healthy_pair_is_the_noise_floor_with_accuracy_over_training(base):
    cfg = TrainConfig(dim=16, batch=8, micro_steps=2, pretrain_steps=10, steps=4, eval_every=2)
    prof = fm.Profile("floor", rate=0.0, reseed=1)
    rec = run_trial({"id": "t", "profile": prof, "mode": "none", "seed": 0}, cfg, base)
    assert rec["events"] == [] and rec["reseeded"] and rec["alarms"] == []
    assert [s for s, _ in rec["accuracy_curve_faulty"]] == [2, 4]
    assert [s for s, _ in rec["accuracy_curve_healthy"]] == [2, 4]
    assert rec["param_divergence"][-1] > 0 and rec["loss_faulty"] != rec["loss_healthy"]
    s = report.summarize([rec])
    assert s["null"]["trials"] == 0 and s["free_running"][0]["reseeded"]


@pytest.mark.parametrize("extra,field", [('rate = 0.5\nreseed = 1', "reseed"),
                                         ('rate = 0.0\nreseed = 1', "reseed")])
def test_a_reseeded_profile_runs_free_without_faults(tmp_path, capsys, extra, field):
    p = tmp_path / "c.toml"
    modes = 'modes = ["none"]\n' if "0.5" in extra else ""
    p.write_text(f'[[profiles]]\nname = "a"\n{modes}{extra}\n')
    assert main(["eval", str(p), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err


def test_a_folder_mixing_two_campaigns_is_refused_by_the_report(tmp_path, capsys):
    recs = [dict(_case_trial(), id="a/computation/0", campaign="aaaa"),
            dict(_case_trial(), id="b/computation/0", campaign="bbbb")]
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 different campaigns" in err


@pytest.mark.parametrize("stuck_at,value,changes", [(1, 0.5, True), (1, 4.0, False),
                                                    (0, 4.0, True), (0, 0.5, False)])
def test_a_bit_stuck_at_a_chosen_value(stuck_at, value, changes):
    (ev, *_) = _event(stuck_at=stuck_at)
    w = torch.full((4, 4), value)
    fm.corrupt(ev, w)
    r, c = ev.applied[0]["row"], ev.applied[0]["col"]
    assert (float(w[r, c]) != value) == changes
    assert (int(w.view(torch.int32)[r, c]) >> 30) & 1 == stuck_at


def test_the_hash_is_of_the_resolved_config():
    bare = config.loads('[[profiles]]\nname = "a"')
    spelled = config.loads('[train]\nsteps = 30\n[[profiles]]\nname = "a"\n'
                           'rate = 0.2\ntiming = "transient"')
    assert campaign.config_hash(bare) == campaign.config_hash(spelled)
    assert config.Config.from_dict(json.loads(json.dumps(bare.to_dict()))) == bare  # idempotent


@pytest.mark.parametrize("kind", fm.KINDS)
def test_hook_kind_names_the_injection_the_builder_makes(kind):
    """HOOK_KIND (which campaign kinds the triton backend can inject) states what injection()
    builds for each kind of transient event: the two cannot drift apart."""
    ev = fm.FaultEvent(id=0, step=0, micro_step=0, site="gemm_accumulator", module="m",
                       phase="forward", kind=kind, pattern="element", bits=[3], factor=10.0)
    assert fm.injection(ev, (8, 8), torch.float32).kind == fm.HOOK_KIND[kind]
