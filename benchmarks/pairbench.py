"""Cost of a paired, computation-synced step against one plain and one checked training step of
the same model (``python benchmarks/pairbench.py``): medians of interleaved rounds, one run."""
import statistics
import time

import torch

import abft
from abft.bench import results
from abft.eval.config import TrainConfig
from abft.eval.replicas import Replica, batches, pretrain
from abft.eval.sync import LocalLink, Sync


def _plain_step(model, opt, micro):
    opt.zero_grad(set_to_none=True)
    for x, y in micro:
        (model(x, y) / len(micro)).backward()
    opt.step()


def main(rounds=15):
    cfg = TrainConfig()
    base = pretrain(TrainConfig(pretrain_steps=0))
    plain = cfg.model()
    plain.load_state_dict(base)
    popt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr)
    link = LocalLink()
    solo = Replica("H", cfg, base, Sync("H", LocalLink(), "none"))
    h, f = (Replica(r, cfg, base, Sync(r, link, "computation")) for r in ("H", "F"))
    t = {"plain": [], "checked": [], "paired": []}
    with abft.config(policy="record"):
        for s in range(rounds):
            micro = batches(cfg, 0, s)
            t0 = time.perf_counter()
            _plain_step(plain, popt, micro)
            t1 = time.perf_counter()
            solo.step(s, micro)
            solo.sync.link.queue.clear()
            t2 = time.perf_counter()
            h.step(s, micro)
            f.step(s, micro)
            t3 = time.perf_counter()
            for k, v in zip(t, (t1 - t0, t2 - t1, t3 - t2)):
                t[k].append(v)
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    print(f"median of {rounds} interleaved rounds, TrainConfig() defaults, "
          f"{torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:8s} {v:8.1f} ms  {v / med['plain']:5.2f}x plain")
    print(f"  paired / (2 x checked) = {med['paired'] / (2 * med['checked']):.2f}")
    return dict(rounds=rounds, threads=torch.get_num_threads(), step_ms=med,
                over_plain={k: v / med["plain"] for k, v in med.items()},
                paired_over_two_checked=med["paired"] / (2 * med["checked"]))


def cli(argv=None):
    return results.run_rounds("pairbench", main, 15, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
