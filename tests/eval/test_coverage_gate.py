"""The coverage gate: with every detector on (checksums, state at rest, recompute, the checked
all-reduce, outputs and operands carried to their death), a campaign of the library's default
corruption mix at each of the seven sites must detect at least 90% of the faults that changed the
run, and never alarm without a fault."""
import pytest

from abft.eval import campaign, config, report

GATED = ("gemm_accumulator", "gemm_operand", "gemm_output", "weight_memory", "optimizer_state",
         "nongemm_op", "gradient_comm")

CONFIG = """
seed = 0
seeds = 2
modes = ["computation"]
[train]
dim = 16
batch = 8
pretrain_steps = 10
steps = 6
rest = true
recompute = 1.0
comm = true
carry = true
[[profiles]]
name = "healthy"
rate = 0.0
[[profiles]]
name = "alu"
rate = 1.0
sites = { gemm_accumulator = 1.0 }
[[profiles]]
name = "hbm"
rate = 1.0
sites = { weight_memory = 1.0, optimizer_state = 1.0 }
[[profiles]]
name = "link"
rate = 1.0
sites = { gradient_comm = 1.0 }
[[profiles]]
name = "datapath"
rate = 1.0
sites = { nongemm_op = 1.0, gemm_operand = 1.0 }
[[profiles]]
name = "after-check"
rate = 1.0
sites = { gemm_output = 1.0 }
"""


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate") / "run"
    campaign.run(config.loads(CONFIG), str(out), progress=False)
    return report.build(str(out))


def test_every_covered_site_detects_at_least_90_percent_of_what_changed_the_run(summary):
    sites = summary["per_site"]
    print({s: (d["detected"], d["missed"], d["rate"]) for s, d in sites.items()})
    for site in GATED:
        d = sites[site]
        assert d["detected"] + d["missed"] >= 4, (site, d)      # enough events to mean something
        assert d["detected"] >= 0.9 * (d["detected"] + d["missed"]), (site, d)


def test_no_alarm_without_a_fault(summary):
    assert summary["null"]["alarms"] == 0 and summary["null"]["mismatches"] == 0
    fa = summary["false_alarms"]
    assert fa["alarms"] == 0 and fa["healthy_replica"] == 0, fa
