"""Recipes on omegaconf: ``${}`` interpolation, llm-foundry's key names (one alias table), dotlist overrides,
the ``callbacks:`` section, and one-line errors naming the key."""

from __future__ import annotations

import pytest
import torch

from grape_stream.errors import ConfigError, ConfigKeyError, ConfigTypeError
from grape_stream.integrations.composer.recipe_callbacks import build_callbacks
from grape_stream.integrations.composer.trainer import build, build_optimizer
from grape_stream.recipe import load_recipe

FOUNDRY_STYLE = """
variables:
  seq: 64
global_seed: 3
max_seq_len: ${variables.seq}
max_duration: 10ba
global_train_batch_size: 8
device_train_microbatch_size: 4
console_log_interval: 5ba
device_eval_batch_size: 4
model:
  n_layers: 3
  n_heads: 2
  d_model: 64
  d_ff: ${model.d_model}
  max_seq_len: ${variables.seq}
  vocab_size: 100
data:
  domains: [a, b]
  tasks: [t]
  local: /nowhere
optimizer: {name: decoupled_adamw, lr: 6e-4, betas: [0.9, 0.95], weight_decay: 0.0}
scheduler: {name: cosine_with_warmup, t_warmup: 2ba}
callbacks:
  lr_monitor: {}
"""


@pytest.fixture()
def foundry_yaml(tmp_path):
    path = tmp_path / "foundry-style.yaml"
    path.write_text(FOUNDRY_STYLE)
    return str(path)


def test_llm_foundry_key_names_and_interpolation(foundry_yaml, tmp_path):
    from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW

    from _grape_data import RULES, write_domain, write_task

    data = tmp_path / "data"  # the dry run checks that local data exists (its index files), opens nothing
    for k, name in enumerate(("a", "b")):
        write_domain(str(data), name, RULES[k], 8, seq_len=64)
    write_task(str(data / "tasks"), "t", RULES[0], 4, 4, seq_len=64)
    cfg = load_recipe(foundry_yaml, ["model.n_layers=4", "output_dir=/out/${run_name}", f"data.local={data}",
                                     f"data.task_local={data / 'tasks'}"])
    m, t = cfg["model"], cfg["trainer"]
    assert (m["n_layer"], m["n_head"], m["d_model"], m["d_ff"], m["seq_len"]) == (4, 2, 64, 64, 64)
    assert "n_layers" not in m and "max_seq_len" not in m and "max_duration" not in cfg
    assert (cfg["seed"], cfg["data"]["seq_len"], cfg["data"]["eval_batch_size"]) == (3, 64, 4)
    assert (t["max_duration"], t["global_train_batch_size"], t["device_train_microbatch_size"], t["log_interval"]) \
        == ("10ba", 8, 4, "5ba")
    assert cfg["optimizer"]["lr"] == 6e-4 and cfg["scheduler"]["name"] == "cosine"
    assert cfg["output_dir"] == "/out/foundry-style" and cfg["callbacks"] == {"lr_monitor": {}}
    built = build(cfg, dry_run=True)
    assert isinstance(built.optimizer, DecoupledAdamW) and built.optimizer.defaults["weight_decay"] == 0.0
    assert isinstance(built.scheduler, CosineAnnealingWithWarmupScheduler)
    gpt = built.model.model.config
    assert (gpt.n_layer, gpt.n_head, gpt.d_ff, gpt.seq_len, gpt.vocab_size) == (4, 2, 64, 64, 100)


def test_plain_adamw_is_torch_adamw():
    cfg = load_recipe("demo-cpu")
    opt = build_optimizer(cfg, torch.nn.Linear(2, 2))
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == cfg["optimizer"]["lr"] == 1e-3


def test_alias_and_our_key_together_is_one_error(foundry_yaml):
    with pytest.raises(ConfigError, match=r"'model\.n_layers' and 'model\.n_layer' .* same setting"):
        load_recipe({"model": {"n_layers": 2, "n_layer": 3}, "data": {"domains": ["a"]}})
    with pytest.raises(ConfigError, match=r"'max_duration' and 'trainer\.max_duration'"):
        load_recipe({"max_duration": "1ba", "trainer": {"max_duration": "2ba"}, "data": {"domains": ["a"]}})


def test_errors_are_one_line_naming_key_and_closest(foundry_yaml):
    with pytest.raises(ConfigKeyError, match=r"^unknown recipe key 'model\.n_layerz' \(command-line override\); "
                                             r"did you mean 'model\.n_layer'\?$"):
        load_recipe(foundry_yaml, ["model.n_layerz=2"])
    with pytest.raises(ConfigKeyError, match=r"^unknown recipe key 'model\.expansion_ratio'"):
        load_recipe({"model": {"expansion_ratio": 4}, "data": {"domains": ["a"]}})  # MPT's: not the same meaning
    with pytest.raises(ConfigKeyError, match=r"^unknown recipe key 'fsdp_config'; it is llm-foundry's: .*grape_mix"):
        load_recipe({"fsdp_config": {"sharding_strategy": "FULL_SHARD"}, "data": {"domains": ["a"]}})
    with pytest.raises(ConfigTypeError, match=r"^recipe key 'model\.n_layer' must be an int, got 'four'"):
        load_recipe(foundry_yaml, ["model.n_layers=four"])
    with pytest.raises(ConfigTypeError, match=r"^recipe key 'trainer' must be a mapping, got 'x'$"):
        load_recipe({"trainer": "x", "data": {"domains": ["a"]}})
    with pytest.raises(ConfigError, match=r"^recipe key 'trainer\.eval_interval'.*'nope' not found"):
        load_recipe(foundry_yaml, ["trainer.eval_interval=${nope}"])
    with pytest.raises(ConfigError) as info:  # the first failing override is the one reported, on one line
        load_recipe(foundry_yaml, ["x.y=1", "model.n_layers=four"])
    assert "\n" not in str(info.value) and "unknown recipe key 'x'" in str(info.value)


def test_callbacks_section_builds_composer_callbacks():
    from composer.callbacks import LRMonitor, SpeedMonitor

    got = build_callbacks({"lr_monitor": {}, "speed_monitor": {"window_size": 3},
                           "composer.callbacks:MemoryMonitor": None})
    assert [type(c).__name__ for c in got] == ["LRMonitor", "SpeedMonitor", "MemoryMonitor"]
    assert isinstance(got[0], LRMonitor) and isinstance(got[1], SpeedMonitor)
    with pytest.raises(ConfigError, match=r"unknown callback 'callbacks\.lr_monitr'; did you mean 'lr_monitor'"):
        build_callbacks({"lr_monitr": {}})
    with pytest.raises(ConfigError, match=r"^recipe key 'callbacks\.speed_monitor': .*'windw'"):
        build_callbacks({"speed_monitor": {"windw": 3}})


def test_a_callback_name_that_is_not_a_composer_callback_is_refused_before_it_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("os:system", "builtins:print", "collections:OrderedDict"):
        with pytest.raises(ConfigError, match=rf"^recipe key 'callbacks\.{name}': .*not a Composer Callback"):
            build_callbacks({name: {"command": "touch ran"}})
    assert not (tmp_path / "ran").exists()
