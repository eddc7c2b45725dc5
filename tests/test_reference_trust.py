"""DoReMi's reference checkpoint is untrusted until the user says otherwise (issue 29 item 2): real Composer,
Lightning and HF checkpoints load with weights_only=True; a pickle that runs code is refused in one line
naming reference_trusted, and its code does not run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from grape_stream.errors import ConfigError
from grape_stream.grape.reference_model import reference_state_dict
from grape_stream.grape.reweighting import build_reweighter


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 2))


def _want(prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in _net().state_dict().items()}


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_pickle_that_runs_code_is_refused_and_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    path = tmp_path / "evil.pt"
    torch.save({"model": _net().state_dict(), "payload": _RunsCode(str(marker))}, path)
    with pytest.raises(ConfigError) as info:
        reference_state_dict(str(path), _want())
    msg = str(info.value)
    assert "\n" not in msg and "reference_trusted" in msg and "exec" in msg, msg
    assert not marker.exists()
    # the user's explicit choice: full pickle (and the code runs, which is what "trusted" means)
    got = reference_state_dict(str(path), _want(), trusted=True)
    assert marker.read_text() == "ran"
    assert torch.equal(got["0.weight"], _net().state_dict()["0.weight"])


def test_reference_trusted_is_a_doremi_option_that_is_a_bool() -> None:
    assert build_reweighter("doremi", 2, 1, reference="r.pt").options["reference_trusted"] is False
    assert build_reweighter("doremi", 2, 1, reference="r.pt", reference_trusted=True).options["reference_trusted"]
    with pytest.raises(ConfigError, match="reference_trusted must be true or false"):
        build_reweighter("doremi", 2, 1, reference="r.pt", reference_trusted="yes")


def test_plain_and_hf_checkpoints_load_without_pickle_trust(tmp_path: Path) -> None:
    torch.save(_net().state_dict(), tmp_path / "plain.pt")
    assert torch.equal(reference_state_dict(str(tmp_path / "plain.pt"), _want())["0.bias"], _net()[0].bias)
    hf = tmp_path / "hf"
    hf.mkdir()
    torch.save(_want("model."), hf / "pytorch_model.bin")
    assert set(reference_state_dict(str(hf), _want())) == {"0.weight", "0.bias"}


@pytest.mark.integration
def test_a_real_composer_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    from composer import Trainer
    from composer.models import ComposerClassifier

    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    trainer = Trainer(model=ComposerClassifier(_net(), num_classes=2), train_dataloader=DataLoader(data, batch_size=4),
                      max_duration="2ba", save_folder=str(tmp_path / "ck"), save_interval="2ba", progress_bar=False,
                      log_to_console=False, device="cpu", seed=1)
    trainer.fit()
    trained = {k: v.clone() for k, v in trainer.state.model.module.state_dict().items()}
    trainer.close()
    path = next(str(p) for p in (tmp_path / "ck").iterdir() if p.suffix == ".pt")
    got = reference_state_dict(path, _want())  # state["model"] with its "module." prefix matched
    assert all(torch.equal(got[k], trained[k]) for k in trained)


@pytest.mark.integration
def test_a_real_lightning_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = _net()

        def training_step(self, batch, _):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    module = Module()
    L.Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu").fit(module, DataLoader(TensorDataset(torch.randn(8, 4)),
                                                                                   batch_size=4))
    path = next(os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".ckpt"))
    got = reference_state_dict(path, _want("net."))  # the LightningModule's own keys
    assert torch.equal(got["net.0.weight"], module.net[0].weight.detach())
