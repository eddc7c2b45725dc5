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


def _mixer(data: str, batch_size: int = 8):
    from grape_stream import DomainStream, WeightedStreamingMixer

    return WeightedStreamingMixer([DomainStream(d, local=f"{data}/{d}", split="train") for d in ("d0", "d1", "d2")],
                                  batch_size=batch_size, seed=0)


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


@pytest.mark.parametrize("method, options", [("grape", {"alignments": "steps"}), ("rnb", {})], ids=["steps", "rnb"])
def test_grape_trainer_refuses_in_step_alignments_in_one_line(data, tmp_path, method, options):
    """The HF Trainer computes its loss inside the model (no watchable per-sample losses): in-step alignments and
    R&B (which reads the training steps' Gram) are refused at train()."""
    from transformers import TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer, GrapeTrainerCallback

    mixer = _mixer(data)
    try:
        grape = GrapeTrainerCallback(method=method, tasks=_tasks(data), alpha_every=2, z_every=2,
                                     alignment_steps=1, trajectory=False, **options)
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, report_to=[],
                                 use_cpu=True)
        trainer = GrapeTrainer(model=_llama(), args=args, mixer=mixer, callbacks=[grape])
        with pytest.raises(ConfigError, match="not available with the Hugging Face Trainer") as err:
            trainer.train()
        assert "\n" not in str(err.value)
    finally:
        mixer.close()


def test_grape_trainer_takes_the_mixer_as_train_dataset_and_its_batch_size(data, tmp_path):
    """`GrapeTrainer(train_dataset=mixer)`, as any Trainer; the batch size is said once, by the mixer."""
    from transformers import TrainingArguments

    from grape_stream.integrations.hf import GrapeTrainer

    model, mixer = _llama(), _mixer(data, batch_size=4)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, report_to=[], use_cpu=True)
        trainer = GrapeTrainer(model=model, args=args, train_dataset=mixer)
        assert trainer.mixer is mixer and trainer.args.per_device_train_batch_size == 4
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
