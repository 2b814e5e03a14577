"""The campaign config (eval/config.py): the dataclasses, their defaults, the messages, the
resolved form that config.json holds."""
import json
import tomllib
from dataclasses import fields

import pytest

from abft.eval import config
from abft.eval.config import Config, TrainConfig

A = '[[profiles]]\nname = "a"\n'


@pytest.mark.parametrize("text,message", [
    ('seeds = "2"\n' + A, "config.seeds: a whole number >= 1, got '2'"),
    ('seed = true\n' + A, "config.seed: a whole number >= 0, got True"),
    ('modes = "none"\n' + A,
     "config.modes: a list from ('computation', 'parameter', 'none'), got 'none'"),
    ('[train]\nrest = 1\n' + A, "config.train.rest: true or false, got 1"),
    ('[train]\ndim = "32"\n' + A, "config.train.dim: a whole number >= 1, got '32'"),
    ('[train]\nbatch = 9\n' + A, "config.train.batch: a multiple of micro_steps (2)"),
    ("[[profiles]]\nname = 3\n", "config.profiles[0].name: a non-empty string without '/', got 3"),
    (A + "scale = 3\n", "config.profiles[0] (a).scale: [low, high], got 3"),
    (A + "scale = [3, 1]\n",
     "config.profiles[0] (a).scale: [low, high], finite, 0 < low <= high, got (3, 1)"),
    (A + "reseed = 1\nrate = 0.0\n", 'config.profiles[0] (a).reseed: runs free only '
     '(modes = ["none"]): its replicas see different data'),
    (A + "onset = 40\n", "config.profiles[0] (a).onset: 40 is not before train.steps (30): "
     "the profile would never fire"),
    (A + A, "config.profiles[1].name: 'a' appears twice"),
    ("profiles = [1]\n", "config.profiles[0]: a table"),
    ("seed = 1\n", "config.profiles: a list of node profiles ([[profiles]] tables)"),
])
def test_a_bad_field_is_named_in_the_message(text, message):
    with pytest.raises(ValueError) as e:
        config.loads(text)
    assert str(e.value) == message


@pytest.mark.parametrize("text,where", [
    ("colour = 1\n" + A, "config: unknown field 'colour'; fields are ('seed', 'seeds', "
     "'threads', 'modes', 'backend', 'train', 'profiles')"),
    ("[train]\nwidth = 3\n" + A, "config.train: unknown field 'width'; fields are ('digits',"),
    (A + "colour = 2\n", "config.profiles[0]: unknown field 'colour'; fields are ['bits',"),
])
def test_an_unknown_field_is_refused_at_every_level(text, where):
    with pytest.raises(ValueError) as e:
        config.loads(text)
    assert str(e.value).startswith(where)


@pytest.mark.parametrize("text,message", [
    ("[]", "config: a table of fields ('seed', 'seeds', 'threads', 'modes', 'backend', 'train', "
     "'profiles'), got []"),
    ('{"train": 5, "profiles": [{"name": "a"}]}', "config.train: a table of fields ('digits',"),
])
def test_a_config_or_train_that_is_not_a_table_is_one_message(text, message):
    with pytest.raises(ValueError) as e:
        config.loads(text, "json")
    assert str(e.value).startswith(message)


def test_a_train_config_checks_itself():
    with pytest.raises(ValueError, match=r"^config\.train\.steps: a whole number >= 1, got 0$"):
        TrainConfig(steps=0)


def test_the_default_campaign_restates_the_field_defaults():
    """DEFAULT spells out the campaign's fields for the reader: each equals the dataclass
    default, except the detectors the default campaign turns on."""
    text = tomllib.loads(config.DEFAULT)
    top, default = {k: v for k, v in text.items() if k not in ("train", "profiles")}, Config()
    assert top == {f.name: getattr(default, f.name) for f in fields(Config)
                   if f.name not in ("train", "profiles")}
    differ = {k: v for k, v in text["train"].items() if getattr(TrainConfig(), k) != v}
    assert differ == {"rest": True, "recompute": 1.0, "comm": True, "carry": True}
    assert config.load() == config.loads(config.DEFAULT)


USER = """
seeds = 2
[train]
dim = 16
[[profiles]]
name = "w"
rate = 1
sites = { weight_memory = 1 }
scale = [1, 100]
modes = ["none"]
[[profiles]]
name = "b"
"""


def test_the_resolved_config_keeps_what_the_user_wrote_and_fills_the_rest():
    cfg = config.loads(USER)
    d = cfg.to_dict()
    assert d["seeds"] == 2 and d["seed"] == 0 and d["modes"] == ["computation"]
    assert d["train"] == {f.name: getattr(TrainConfig(dim=16), f.name) for f in fields(TrainConfig)}
    w, b = d["profiles"]
    assert w["rate"] == 1 and w["sites"] == {"weight_memory": 1} and w["scale"] == [1, 100]
    assert w["modes"] == ["none"] and "modes" not in b          # modes only where written
    assert b["kinds"] == cfg.profiles[1].profile.kinds and b["scale"] == [1e-3, 1e3]
    again = Config.from_dict(json.loads(json.dumps(d)))     # config.json read back
    assert again == cfg and again.to_dict() == d


def test_a_train_override_is_checked_with_the_whole_campaign():
    cfg = config.loads(A + "onset = 3\n")
    assert cfg.with_train(steps=4).train.steps == 4 and cfg.train.steps == 30
    with pytest.raises(ValueError, match=r"\(a\)\.onset: 3 is not before train\.steps \(3\)"):
        cfg.with_train(steps=3)


@pytest.mark.parametrize("kw, message", [
    (dict(seeds=0), "config.seeds: a whole number >= 1, got 0"),
    (dict(threads=1.5), "config.threads: a whole number >= 1, got 1.5"),
    (dict(modes=["sometimes"]), "config.modes: a list from"),
    (dict(backend="cuda"), "config.backend: reference | triton | auto"),
    (dict(train={"steps": 3}), "config.train: a TrainConfig, got {'steps': 3}")])
def test_a_config_built_in_code_checks_its_own_fields(kw, message):
    with pytest.raises(ValueError) as e:
        Config(**kw)
    assert str(e.value).startswith(message), str(e.value)
