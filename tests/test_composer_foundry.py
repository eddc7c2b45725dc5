"""llm-foundry registration: the entry points resolve to our objects, and those objects build from the
mappings an llm-foundry YAML gives (llm-foundry itself pins torch 2.7.0 and streaming<0.13, so CI checks the
registration through importlib.metadata, the mechanism llm-foundry's catalogue registries read)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from _grape_data import SEQ, VOCAB, write_dataset


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("foundry_data"))
    write_dataset(root, domains=2, tasks=(1,), n_domain=64, n_val=16, n_test=8)
    return root


def _ep(group: str, name: str):
    eps = {e.name: e for e in entry_points(group=group)}
    assert name in eps, f"entry point {name!r} missing from group {group!r}: {sorted(eps)}"
    return eps[name].load()


def test_entry_points_resolve_to_the_adapters():
    from grape_stream.integrations.composer import (
        GrapeAlgorithm,
        GrapeTrajectoryCallback,
        TaskEvalSummary,
        build_grape_mixture_dataloader,
    )

    assert _ep("llmfoundry_algorithms", "grape") is GrapeAlgorithm
    assert _ep("llmfoundry_dataloaders", "grape_mixture") is build_grape_mixture_dataloader
    assert _ep("llmfoundry_callbacks", "grape_trajectory") is GrapeTrajectoryCallback
    assert _ep("llmfoundry_callbacks", "grape_eval_summary") is TaskEvalSummary


def test_objects_build_from_yaml_style_mappings(data_dir, tmp_path):
    import yaml

    from grape_stream.integrations.composer import find_mixer

    cfg = yaml.safe_load(f"""
train_loader:
  name: grape_mixture
  domains: [d0, d1]
  local: {data_dir}
  split: train
  seed: 3
algorithms:
  grape:
    method: grape
    alpha_every: 50
    probe_domain_batch: 4
    tasks:
      - {{name: t0, local: {data_dir}/tasks/t0}}
callbacks:
  grape_trajectory: {{folder: "{tmp_path}/{{run_name}}"}}
""")
    loader_cfg = dict(cfg["train_loader"])
    name = loader_cfg.pop("name")
    # llm-foundry calls the registered function with the loader config plus tokenizer and device_batch_size
    spec = _ep("llmfoundry_dataloaders", name)(tokenizer=None, device_batch_size=4, **loader_cfg)
    batch = spec.batch_transforms(next(iter(spec.dataloader)))  # what Composer applies to each batch
    assert batch["input_ids"].shape == (4, SEQ) and torch.equal(batch["labels"], batch["tokens"])
    assert spec.get_num_tokens_in_batch(batch) == 4 * SEQ
    mixer = find_mixer(spec.dataloader)
    assert mixer.domain_names == ["d0", "d1"] and mixer.seed == 3

    algo = _ep("llmfoundry_algorithms", "grape")(**cfg["algorithms"]["grape"])
    assert algo.config.alpha_every == 50 and [t.name for t in algo.tasks] == ["t0"]
    # no mu given: the library's default step (a KL trust region) needs none
    assert algo.reweighter_options == {}
    cb = _ep("llmfoundry_callbacks", "grape_trajectory")(**cfg["callbacks"]["grape_trajectory"])
    assert cb.folder.endswith("{run_name}")
    mixer.close()

    with pytest.raises(TypeError, match="mu_alfa"):
        _ep("llmfoundry_algorithms", "grape")(method="grape", mu_alfa=1.0)


def test_probe_loss_for_a_huggingface_style_composer_model():
    """llm-foundry's models take {"input_ids", ...} and return an output with .logits."""
    from composer.models import HuggingFaceModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from grape_stream.integrations.composer import composer_per_sample_loss

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
    hf = AutoModelForCausalLM.from_config(config)
    model = HuggingFaceModel(hf, tokenizer=None, use_logits=True)
    model.eval()  # GPT-2 configs default to dropout 0.1; the probe runs in eval mode too
    tokens = torch.randint(1, VOCAB, (3, SEQ))
    mask = torch.ones(3, SEQ, dtype=torch.uint8)
    mask[1, 10:] = 0
    got = composer_per_sample_loss(model, {"tokens": tokens, "loss_mask": mask})
    logits = hf(input_ids=tokens).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
    ce = ce.view(3, SEQ - 1)
    m = mask[:, 1:].float()
    assert torch.allclose(got, (ce * m).sum(1) / m.sum(1), atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# llm-foundry's loader shape: dataset: {...}, drop_last, num_workers; manifest vs tokenizer; loss_mask
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_data(tmp_path_factory) -> str:
    """A real conversion (byte tokenizer, one padded sample per record: every sample carries a loss_mask)."""
    import json

    from grape_stream.convert import convert

    root = tmp_path_factory.mktemp("foundry_bytes")
    src = root / "in"
    src.mkdir()
    with open(src / "docs.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            for lang in ("en", "fr"):
                f.write(json.dumps({"text": f"{lang} doc {i} " * (1 + i % 4), "lang": lang}) + "\n")
    out = str(root / "mds")
    convert("jsonl", [str(src)], out, tokenizer="bytes", seq_len=64, domain_field="lang", per_example=True,
            progress=False)
    return out


def _gpt2_hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from grape_stream.convert.tokenization import load_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=load_tokenizer("gpt2")._tok)


def _foundry_loader(byte_data: str, **dataset):
    import yaml

    cfg = yaml.safe_load(f"""
train_loader:
  name: grape_mixture
  dataset:
    local: {byte_data}
    split: null
    max_seq_len: 64
    shuffle: true
    shuffle_seed: 5
    eos_token_id: 256
    predownload: 8
  drop_last: true
  num_workers: 0
""")["train_loader"]
    cfg["dataset"].update(dataset)
    return cfg


def test_llm_foundry_dataset_block_and_loss_mask_labels(byte_data):
    from grape_stream.integrations.composer import find_mixer
    from grape_stream.integrations.composer.foundry_dataset import IGNORE_INDEX

    cfg = _foundry_loader(byte_data)
    spec = _ep("llmfoundry_dataloaders", cfg.pop("name"))(tokenizer=None, device_batch_size=4, **cfg)
    mixer = find_mixer(spec.dataloader)
    assert mixer.domain_names == ["en", "fr"] and mixer.seed == 5  # domains from the manifest, shuffle_seed
    masked = 0
    for _, raw in zip(range(10), spec.dataloader):
        batch = spec.batch_transforms(raw)
        tokens, mask, labels = batch["tokens"], batch["loss_mask"].bool(), batch["labels"]
        assert torch.equal(batch["input_ids"], tokens) and tokens.shape == (4, 64)
        assert torch.equal(labels[mask], tokens[mask]) and bool((labels[~mask] == IGNORE_INDEX).all())
        masked += int((~mask).sum())
    assert masked > 0  # the padded tail of every short record is ignored, not trained on as token 0
    mixer.close()
    # The loader keys reach mixer.dataloader: 2 workers, 3 batches a message (prefetch 1), lag (2 + 1) x 3 - 1.
    cfg = {**_foundry_loader(byte_data), "num_workers": 2, "batches_per_message": 3}
    spec = _ep("llmfoundry_dataloaders", cfg.pop("name"))(tokenizer=None, device_batch_size=4, **cfg)
    assert (spec.dataloader.batches_per_message, spec.dataloader.prefetch_depth) == (3, 8)
    find_mixer(spec.dataloader).close()


def test_llm_foundry_loader_checks_the_manifest_and_refuses_unknown_keys(byte_data):
    from grape_stream.errors import ConfigError

    build = _ep("llmfoundry_dataloaders", "grape_mixture")
    cfg = _foundry_loader(byte_data)
    cfg.pop("name")
    with pytest.raises(ConfigError, match=r"tokenized with 'bytes' \(vocab_size=257\) but the run's tokenizer .* "
                                          r"has 50257 tokens"):
        build(tokenizer=_gpt2_hf_tokenizer(), device_batch_size=4, **cfg)
    for bad, needle in (({"max_seq_len": 32}, r"seq_len=64 but dataset.max_seq_len is 32"),
                        ({"eos_token_id": 0}, r"eos_token_id is 0 but .* eos_id=256"),
                        ({"shuffle_algo": "py1e"}, r"dataset.shuffle_algo is not supported: the mixer shuffles"),
                        ({"hf_name": "x"}, r"dataset.hf_name is not supported")):
        cfg = _foundry_loader(byte_data, **bad)
        cfg.pop("name")
        with pytest.raises(ConfigError, match=needle) as info:
            build(tokenizer=None, device_batch_size=4, **cfg)
        assert "\n" not in str(info.value)


def test_task_eval_loader_for_llm_foundry_evaluators(data_dir):
    from grape_stream.integrations.composer import build_grape_task_eval_dataloader
    from grape_stream.integrations.composer.foundry_dataset import IGNORE_INDEX

    spec = build_grape_task_eval_dataloader(tokenizer=None, device_batch_size=3, task="t0",
                                            local=f"{data_dir}/tasks/t0", drop_last=False)
    batches = [spec.batch_transforms(b) for b in spec.dataloader]
    assert sum(b["tokens"].shape[0] for b in batches) == 8  # the whole test split, once (finite)
    for b in batches:
        mask = b["loss_mask"].bool()
        assert torch.equal(b["labels"][mask], b["tokens"][mask]) and bool((b["labels"][~mask] == IGNORE_INDEX).all())
    assert any(bool((~b["loss_mask"].bool()).any()) for b in batches)  # the padding is masked out
