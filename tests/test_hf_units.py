"""Fast checks of the HF / Lightning integrations' framework-free parts and their construction-time errors.

The training runs (and the resumes) are in tests/test_hf_trainer.py and tests/test_lightning.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from _grape_data import SEQ, VOCAB, write_dataset
from grape_stream.errors import ConfigError, DataError
from grape_stream.integrations.common import IGNORE_INDEX, causal_lm_inputs, logits_per_sample_loss
from grape_stream.integrations.grape_loop import LOOP_STATE_FORMAT, GrapeLoop
from grape_stream.models import per_sample_lm_loss


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("hfu") / "data")
    write_dataset(root, domains=3, tasks=(0, 2), n_domain=32, n_val=16, n_test=8)
    return root


def _mixer(data: str, batch_size: int = 8, accumulate: int = 1):
    from grape_stream import DomainStream, WeightedStreamingMixer

    return WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in ("d0", "d1", "d2")],
                                  batch_size=batch_size, seed=0, global_batch_size=batch_size * accumulate)


def _tasks(data: str) -> list:
    from grape_stream import TaskStream

    return [TaskStream(t, local=f"{data}/tasks/{t}") for t in ("t0", "t1")]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ))


def test_causal_lm_inputs_masks_labels_and_drops_the_mixer_columns():
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.uint8)
    out = causal_lm_inputs({"tokens": tokens, "loss_mask": mask, "domain": torch.tensor([0, 1]),
                            "batch_index": torch.tensor([3, 3])})
    assert set(out) == {"input_ids", "labels"}
    assert torch.equal(out["input_ids"], tokens)
    assert out["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX], [9, 10, 11, 12]]
    assert torch.equal(causal_lm_inputs({"tokens": tokens})["labels"], tokens)  # no mask: every token counts


def test_the_probe_loss_of_an_hf_model_is_hf_s_own_loss_per_sample():
    """logits_per_sample_loss against the model's own shifted, -100-ignoring loss, one sample at a time."""
    model = _llama().eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (3, SEQ), generator=g)
    mask = (torch.rand(3, SEQ, generator=g) > 0.3).to(torch.uint8)
    mask[:, 1] = 1  # every sample counts at least one target
    batch = {"tokens": tokens, "loss_mask": mask}
    with torch.no_grad():
        ours = logits_per_sample_loss(model, batch)
        hf = torch.stack([model(**causal_lm_inputs({"tokens": tokens[i:i + 1], "loss_mask": mask[i:i + 1]})).loss
                          for i in range(3)])
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-6)

    class Plain(torch.nn.Module):  # a model returning logits directly, called as model(input_ids=...)
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids).logits

    with torch.no_grad():
        torch.testing.assert_close(logits_per_sample_loss(Plain(), batch), ours)
        torch.testing.assert_close(per_sample_lm_loss(lambda t: Plain()(t), batch), ours)


def test_importing_the_integration_packages_loads_no_trainer():
    code = ("import sys, grape_stream.integrations.hf, grape_stream.integrations.lightning\n"
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_grape_trainer_refuses_what_cannot_work(data, tmp_path):
    from transformers import TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer

    model, mixer = _llama(), _mixer(data)
    try:
        def args(**kw):
            base = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, report_to=[],
                        use_cpu=True)
            return TrainingArguments(**{**base, **kw})

        with pytest.raises(ConfigError, match="differs from the mixer's batch_size=8"):
            GrapeTrainer(model=model, args=args(per_device_train_batch_size=4), mixer=mixer)
        with pytest.raises(ConfigError, match="max_steps"):
            GrapeTrainer(model=model, args=args(max_steps=-1), mixer=mixer)
        # 2 micro-batches a step are 16 samples, the mixer's global batch is 8: its stream would not be the steps'
        with pytest.raises(ConfigError, match="= 16 samples a step, but the mixer's global_batch_size is 8") as err:
            GrapeTrainer(model=model, args=args(gradient_accumulation_steps=2), mixer=mixer)
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match="not both"):
            GrapeTrainer(model=model, args=args(), mixer=mixer, train_dataset=[1, 2])
        with pytest.raises(ConfigError, match="needs train_dataset= a grape_stream.WeightedStreamingMixer, got list"):
            GrapeTrainer(model=model, args=args(), train_dataset=[1, 2])
        trainer = GrapeTrainer(model=model, args=args(), mixer=mixer)
        assert trainer.args.ignore_data_skip  # the mixer restores its own position on resume
        batch = next(iter(trainer.get_train_dataloader()))
        assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (8, SEQ)
    finally:
        mixer.close()


@pytest.mark.parametrize("method", ["rnb", "odm"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["one-batch", "accumulate-2"])
def test_a_loss_built_from_each_sample_s_is_the_models_own_loss(data, tmp_path, accumulate, method):
    """On a step R&B (or alignments: steps) observes, and on every step of a loss-driven method, GrapeTrainer builds
    the loss from each sample's loss; it must be the number the model's own loss gives (padding masked out; with and
    without HF's num_items_in_batch), so the training objective does not change; a loss-driven method reads those
    per-sample losses, summed per domain."""
    from transformers import Trainer, TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback
    from grape_stream.integrations.hf.trainer import GRAPE_BATCH

    mixer = _mixer(data, batch_size=4, accumulate=accumulate)
    try:
        grape = GrapeTrainerCallback(method=method, alpha_every=2, trajectory=False, plots=False)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True,
                                 gradient_accumulation_steps=accumulate)
        model = _llama()
        trainer = GrapeTrainer(model=model, args=args, mixer=mixer, callbacks=[grape])
        ctl = grape.loop.attach(mixer)  # as at train begin
        batch = next(iter(trainer.get_train_dataloader()))
        gb = batch[GRAPE_BATCH]
        mask = torch.ones_like(gb["tokens"], dtype=torch.uint8)
        mask[0, 5:] = 0  # a padded sample, and a sample with few targets
        mask[2, :20] = 0
        gb["loss_mask"] = mask
        inputs = causal_lm_inputs(gb)
        for items in (None, torch.tensor(int(mask[:, 1:].sum()) * accumulate)):
            if method == "rnb":  # as GrapeTrainer.training_step sets it on an observed step
                trainer._observed_batch = gb
                own = trainer.compute_loss(model, dict(inputs), num_items_in_batch=items)
                trainer._observed_batch = None
            else:  # the loader's batch: the model's inputs and the mixer batch beside them
                # a batch_transform that masks other labels than loss_mask: the loss is still the model's own
                relabelled = {**inputs, "labels": inputs["labels"].clone()}
                relabelled["labels"][1, :9] = IGNORE_INDEX
                ctl.signal._step_sums = None
                mine = trainer.compute_loss(model, {**relabelled, GRAPE_BATCH: gb}, num_items_in_batch=items)
                assert mine.requires_grad
                theirs = Trainer.compute_loss(trainer, model, dict(relabelled), num_items_in_batch=items)
                torch.testing.assert_close(mine, theirs, rtol=2e-6, atol=0)
                ctl.signal._step_sums = None
                own = trainer.compute_loss(model, {**inputs, GRAPE_BATCH: gb}, num_items_in_batch=items)
                sums = ctl.signal._step_sums.clone()
                ctl.signal._step_sums = None
                with torch.no_grad():
                    each = logits_per_sample_loss(model, gb).double()
                want_sums = torch.zeros(3, dtype=torch.float64).index_add_(0, gb["domain"], each)
                torch.testing.assert_close(sums[0], want_sums, rtol=1e-5, atol=0)
                assert sums[1].tolist() == torch.bincount(gb["domain"], minlength=3).tolist()
            want = Trainer.compute_loss(trainer, model, dict(inputs), num_items_in_batch=items)
            assert own.requires_grad
            torch.testing.assert_close(own, want, rtol=2e-6, atol=0)  # float32: a wrong weighting is off by %
    finally:
        mixer.close()


def _float64_llama():
    """The tiny Llama in float64 throughout: HF's LlamaRMSNorm normalises in float32 whatever the model's dtype,
    which the engine's float64 form of the norm's weight gradient would differ from by ~1e-7; torch's RMSNorm
    (the same function) keeps float64."""
    model = _llama().double()
    for name, mod in list(model.named_modules()):
        if type(mod).__name__ == "LlamaRMSNorm":
            norm = torch.nn.RMSNorm(mod.weight.shape[0], eps=mod.variance_epsilon, dtype=torch.float64)
            norm.weight.data.copy_(mod.weight.data)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, norm)
    return model


def test_rnb_gram_in_the_hf_trainer_is_the_gram_of_explicit_per_domain_gradients(data, tmp_path):
    """R&B through GrapeTrainer (float64, 2 micro-batches a step, 2 rounds of 2 observed steps, lr 0 so every
    gradient is taken at the same parameters): each update's G is the Gram of the domains' mean gradients over
    the round's batches, computed here with one autograd call per domain."""
    import numpy as np
    from transformers import TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback

    mixer = _mixer(data, batch_size=4, accumulate=2)
    seen: list[dict] = []

    def recording(batch):
        seen.append({k: torch.as_tensor(batch[k]).clone() for k in ("tokens", "domain")})
        return causal_lm_inputs(batch)

    try:
        grape = GrapeTrainerCallback(method="rnb", alpha_every=2, alignment_steps=2, trajectory=False, plots=False)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, learning_rate=0.0, report_to=[], use_cpu=True,
                                 gradient_accumulation_steps=2, save_strategy="no", disable_tqdm=True)
        model = _float64_llama()
        GrapeTrainer(model=model, args=args, mixer=mixer, batch_transform=recording, callbacks=[grape]).train()
    finally:
        mixer.close()
    updates = [r for r in grape.controller.history if not r.get("initial")]
    assert [r["step"] for r in updates] == [2, 4] and len(seen) == 8
    params = [p for p in model.parameters() if p.requires_grad]
    for u, r in enumerate(updates):
        batches = seen[4 * u: 4 * u + 4]
        means = []
        for k in range(3):
            total, count = None, 0
            for b in batches:
                rows = b["domain"] == k
                if rows.any():
                    part = {"tokens": b["tokens"][rows]}
                    grads = torch.autograd.grad(logits_per_sample_loss(model, part).sum(), params)
                    flat = torch.cat([g.reshape(-1) for g in grads])
                    total, count = (flat if total is None else total + flat), count + int(rows.sum())
            means.append(None if total is None else total / count)
        want = np.array([[np.nan if a is None or b is None else float(a @ b) for b in means] for a in means])
        np.testing.assert_allclose(np.asarray(r["domain_gram"], dtype=np.float64), want, rtol=1e-9)


def test_grape_trainer_refuses_label_smoothing_with_in_step_alignments_in_one_line(data, tmp_path):
    """The observed steps' loss is built by GrapeTrainer (the plain token mean): a smoothed or custom loss would
    differ between observed and other steps, so it is refused before the first step."""
    from transformers import TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback

    mixer = _mixer(data)
    try:
        grape = GrapeTrainerCallback(method="rnb", alpha_every=2, trajectory=False, plots=False)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True,
                                 label_smoothing_factor=0.1)
        trainer = GrapeTrainer(model=_llama(), args=args, mixer=mixer, callbacks=[grape])
        with pytest.raises(ConfigError, match="cannot honour label_smoothing_factor") as err:
            trainer.train()
        assert "\n" not in str(err.value)
        assert mixer.state_dict()["batch"] == 0  # refused at train(): not one batch was drawn
    finally:
        mixer.close()


@pytest.mark.parametrize("method, options", [("grape", {"alignments": "steps"}), ("rnb", {})], ids=["steps", "rnb"])
def test_a_plain_trainer_refuses_in_step_alignments_in_one_line(data, tmp_path, method, options):
    """In-step alignments and R&B need each sample's loss in the step's graph, which only GrapeTrainer computes:
    the callback in a plain Trainer is refused at train()."""
    from transformers import Trainer, TrainingArguments

    from grape_stream.integrations.common import MixerTrainLoader
    from grape_stream.integrations.hf import GrapeTrainerCallback

    mixer = _mixer(data)
    try:
        grape = GrapeTrainerCallback(method=method, tasks=_tasks(data), alpha_every=2, z_every=2,
                                     alignment_steps=1, trajectory=False, **options)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, report_to=[],
                                 use_cpu=True)

        class PlainTrainer(Trainer):
            def get_train_dataloader(self):
                return MixerTrainLoader(mixer.dataloader())

        trainer = PlainTrainer(model=_llama(), args=args, train_dataset=mixer, callbacks=[grape])
        with pytest.raises(ConfigError, match="train with grape_stream.integrations.hf.GrapeTrainer") as err:
            trainer.train()
        assert "\n" not in str(err.value)
    finally:
        mixer.close()


def test_a_plain_trainer_batching_the_mixer_is_refused_in_one_line(data, tmp_path):
    """`Trainer(train_dataset=mixer, callbacks=[GrapeTrainerCallback(...)])`: the Trainer's own sampler and collator
    would batch the mixer's samples (accelerate failed with a 22-line traceback); refused at train(), one line."""
    from transformers import Trainer, TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainerCallback

    mixer = _mixer(data)
    try:
        grape = GrapeTrainerCallback(tasks=_tasks(data), alpha_every=2, z_every=2, trajectory=False)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, report_to=[],
                                 use_cpu=True)
        trainer = Trainer(model=_llama(), args=args, train_dataset=mixer, callbacks=[grape])
        with pytest.raises(ConfigError, match="in a plain transformers.Trainer.*GrapeTrainer") as err:
            trainer.train()
        assert "\n" not in str(err.value)
    finally:
        mixer.close()


def test_grape_trainer_takes_the_mixer_as_train_dataset_and_its_batch_size(data, tmp_path, caplog):
    """`GrapeTrainer(train_dataset=mixer)`, as any Trainer; the batch size is said once, by the mixer."""
    from transformers import TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer

    model, mixer = _llama(), _mixer(data, batch_size=4)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, report_to=[], use_cpu=True)
        with caplog.at_level("WARNING", logger="grape_stream"):
            trainer = GrapeTrainer(model=model, args=args, train_dataset=mixer)
        assert trainer.mixer is mixer and trainer.args.per_device_train_batch_size == 4
        # not silent: an 8 (the default, or the caller's) replaced by the mixer's 4 is one warning line
        assert [r.getMessage() for r in caplog.records if "per_device_train_batch_size=8" in r.getMessage()] == [
            "GrapeTrainer: per_device_train_batch_size=8 (TrainingArguments' default) set to the mixer's "
            "batch_size=4; pass per_device_train_batch_size=4 to say so"]
        assert trainer._train_batch_size == 4
        assert next(iter(trainer.get_train_dataloader()))["input_ids"].shape == (4, SEQ)
    finally:
        mixer.close()


def test_loop_state_round_trips_and_wrong_states_are_one_clear_error(data):
    from grape_stream.integrations.lightning import GrapeLightningCallback

    mixers = [_mixer(data), _mixer(data)]
    try:
        a = GrapeLightningCallback(mixers[0], tasks=_tasks(data), alpha_every=2, z_every=2)
        a.loop.start()
        mixers[0].set_weights([0.5, 0.25, 0.25])
        a._batches, a._step = 6, 3  # as after 6 batches, 3 optimizer steps (accumulating 2)
        state = a.state_dict()
        assert state["format"] == LOOP_STATE_FORMAT and state["step"] == 3 and state["batches"] == 6
        assert state["mixer"]["batch"] == 6
        b = GrapeLightningCallback(mixers[1], tasks=_tasks(data), alpha_every=2, z_every=2)
        b.load_state_dict(torch.load(_roundtrip(state), weights_only=True))
        assert b.controller.state_dict() == a.controller.state_dict()
        assert mixers[1].weight_history == mixers[0].weight_history and mixers[1].consumed_batches == 6
        with pytest.raises(DataError, match="no grape_stream loop state"):
            b.load_state_dict({"format": "something else"})
        loop = GrapeLoop(tasks=_tasks(data))
        loop.attach(mixers[1])
        with pytest.raises(DataError, match="of step 3 but the trainer resumes at step 4"):
            loop.load_state_dict(state, step=4)
        with pytest.raises(TypeError, match="WeightedStreamingMixer"):
            GrapeLightningCallback(object(), tasks=_tasks(data))  # type: ignore[arg-type]
    finally:
        for m in mixers:
            m.close()


def _roundtrip(state: dict):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf
