"""The README's examples run as written: each ```python block in order, then each detector's switch
from its table, in a fresh interpreter (the blocks set global configuration) given the names the
README leaves to the reader (operands, a model and its batch, an optimizer, a DDP model)."""
import os
import re
import subprocess
import sys
import textwrap

from paths import ROOT
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

SETUP = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
    import abft, abft.integrations.hf, abft.integrations.titan
    torch.manual_seed(0)
    a, b = torch.randn(64, 48), torch.randn(48, 40)
    x, w, bias = torch.randn(8, 48), torch.randn(40, 48), torch.randn(40)
    y = torch.randint(4, (8,))

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.norm = nn.Linear(48, 32), nn.Linear(32, 4), nn.LayerNorm(32)

        def forward(self, x, y):
            return F.cross_entropy(self.fc2(F.gelu(self.norm(self.fc1(x)))), y)

    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    batch = (x, y)

    def train_step(model, batch):
        loss = model(*batch)
        loss.backward()
        return loss
""")


def _blocks():
    return re.findall(r"```python\n(.*?)```", README, re.S)


def _switches():
    """{detector: its switch's code} from the README's table of detectors."""
    table = README[README.index("| detector | switch |"):]
    table = table[:table.index("\n\n")]
    out = {}
    for row in table.splitlines()[2:]:
        name, switch = [c.strip() for c in row.strip("|").split("|")[:2]]
        out[name.strip("`")] = "\n".join(re.findall(r"`([^`]+)`", switch))
    return out


def _run(code, tmp_path):
    r = subprocess.run([sys.executable, "-c", SETUP + code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_the_readme_code_blocks_run_as_written(tmp_path):
    blocks = _blocks()
    assert len(blocks) == 2 and "abft.matmul(a, b)" in blocks[0] and "abft.protect(model)" in blocks[1]
    _run(blocks[0] + textwrap.dedent("""
        assert len(new) == 1 and (new[0].row, new[0].col) == (3, 5), new     # the injected flip, located
        assert abft.settings.get().policy == "raise"
        x, y = batch                            # block 1 named a product y
        """) + blocks[1] + textwrap.dedent("""
        assert summary and not any(isinstance(m, abft.nn.Linear) for m in model.modules())
        print("ok")
        """), tmp_path)


def test_the_readme_detector_switches_run_as_written(tmp_path):
    sw = _switches()
    assert {"StepGuard", "RecomputeCheck", "CommCheck", "OutputCheck", "softmax invariants",
            "Hugging Face", "torchtitan"} <= set(sw)
    step = "model(x, y).backward()"
    code = "\n".join([
        sw["StepGuard"], "assert torch.isfinite(loss) and guard.step_index == 1, guard.step_index",
        sw["RecomputeCheck"], step,
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/pg', rank=0, world_size=1)",
        "ddp_model = torch.nn.parallel.DistributedDataParallel(model)",
        sw["CommCheck"], "ddp_model(x, y).backward()",
        sw["OutputCheck"].replace(": ...", ": " + step),
        sw["softmax invariants"].replace(": ...", ": " + step),
        "assert not abft.flush() and not len(abft.alarms()), list(abft.alarms())",
        # the Trainer and torchtitan lines need their trainers (tests/integrations/test_hf.py, tests/integrations/test_titan.py)
        "assert callable(abft.integrations.hf.GuardCallback) and callable(abft.integrations.titan.guard_trainer)",
        "dist.destroy_process_group()", "print('ok')"])
    _run(code, tmp_path)
