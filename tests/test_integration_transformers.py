"""MemfitTrainer and MemoryCallback with the real transformers Trainer, on a simulated GPU.

A tiny GPT-2 (two layers, random init, no download) trains on an in-memory dataset whose
labels mask a different number of tokens per sample, so the token-count normalization
(``num_items_in_batch``) matters: a split that weighted micro-batches by samples would
give a different gradient.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import memfit

transformers = pytest.importorskip("transformers")

from memfit.integrations.transformers import MEMORY_METRICS, MemfitTrainer  # noqa: E402

#: a batch of 16 sequences runs out of memory in forward here; 8 fits
TIGHT = "sim:4MiB"
#: the same for the masked LM below
TIGHT_BERT = "sim:4MiB"


def dataset(samples: int = 32, length: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (samples, length), generator=generator)
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    labels[::3, 10:] = -100  # every third sample has fewer target tokens
    return [{"input_ids": i, "labels": target} for i, target in zip(ids, labels)]


def sgd_arguments(tmp: Path | str, **settings: Any) -> Any:
    """The Trainer's arguments of these tests: plain SGD at a constant rate on the CPU, quiet, nothing saved."""
    return transformers.TrainingArguments(
        output_dir=str(tmp),
        optim="sgd",
        lr_scheduler_type="constant",
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        **settings,
    )


def train(
    cls: type = transformers.Trainer, tmp: Path | None = None, *, accepts_loss_kwargs: bool = True, **options: Any
) -> tuple[Any, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    args = sgd_arguments(
        tmp or "unused", per_device_train_batch_size=16, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.1
    )
    trainer = cls(model=model, args=args, train_dataset=dataset(), **options)
    if not accepts_loss_kwargs:
        # The Trainer's other normalization: a mean over each batch, divided by the accumulation.
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    return trainer, model


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_oom_mid_training_is_recovered_with_the_unsplit_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference_trainer, reference = train(tmp=tmp_path)
    transformers.utils.logging.enable_propagation()  # its logger is its own; let caplog see it
    try:
        with caplog.at_level(logging.WARNING):
            trainer, model = train(MemfitTrainer, tmp_path, memfit_device=TIGHT)
    finally:
        transformers.utils.logging.disable_propagation()
    assert trainer.memfit_events, "the batch of 16 should have run out of memory"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit guard:")]
    assert said == [event.describe() for event in trainer.memfit_events]  # each recovery, one line
    assert trainer.memfit_events[0].micro_batch_before == 16
    assert trainer.memfit_micro_batch_size is not None and trainer.memfit_micro_batch_size < 16
    assert trainer.state.global_step == reference_trainer.state.global_step == 2
    assert_same_weights(model, reference)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    expected = [log["loss"] for log in reference_trainer.state.log_history if "loss" in log]
    assert losses == pytest.approx(expected, rel=1e-5)


def test_a_mean_loss_is_weighted_by_the_given_token_count(tmp_path: Path) -> None:
    _, reference = train(tmp=tmp_path, accepts_loss_kwargs=False)
    trainer, model = train(
        MemfitTrainer,
        tmp_path,
        accepts_loss_kwargs=False,
        memfit_device=TIGHT,
        memfit_weight=lambda batch: int((batch["labels"][:, 1:] != -100).sum()),
    )
    assert trainer.memfit_events
    assert_same_weights(model, reference)


def test_without_memfit_the_same_run_runs_out_of_memory(tmp_path: Path) -> None:
    with pytest.raises(torch.OutOfMemoryError), memfit.device(TIGHT):
        train(tmp=tmp_path)


def test_memory_is_recorded_per_step_and_reported_in_the_logs(tmp_path: Path) -> None:
    trainer, _ = train(MemfitTrainer, tmp_path, memfit_device="sim:64MiB")
    records = trainer.memory_callback.records
    assert [r["labels"]["global_step"] for r in records] == [1, 2]
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert [{name: log[name] for name in MEMORY_METRICS} for log in logged] == [
        {name: record[key] for name, key in MEMORY_METRICS.items()} for record in records
    ]
    assert all(r["peak_allocated"] > r["allocated"] > 0 for r in records)


# -- a masked LM whose forward takes **kwargs but whose loss ignores num_items_in_batch ----------


def masked_dataset(samples: int = 32, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """BERT-style masking: a different number of masked (target) positions per sample."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (samples, length), generator=generator)
    labels = torch.full_like(ids, -100)
    for i in range(samples):
        count = 1 + i % 6
        where = torch.randperm(length, generator=generator)[:count]
        labels[i, where] = ids[i, where]
        ids[i, where] = 4  # [MASK]
    return [{"input_ids": i, "labels": target} for i, target in zip(ids, labels)]


def train_masked_lm(cls: type, tmp: Path, **options: Any) -> tuple[Any, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(config)
    args = sgd_arguments(
        tmp,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=0.5,
        max_grad_norm=1.0,
    )
    trainer = cls(model=model, args=args, train_dataset=masked_dataset(), **options)
    trainer.train()
    return trainer, model


def test_a_masked_lm_ignoring_num_items_in_batch_trains_as_the_plain_trainer(tmp_path: Path) -> None:
    """The issue's case: ``model_accepts_loss_kwargs`` is true, the loss is a mean over masked tokens.

    Trusting the flag (weight 1 per micro-batch) multiplied loss and gradient by the number
    of micro-batches; the check weights each by its share of the masked tokens instead.
    """
    reference_trainer, reference = train_masked_lm(transformers.Trainer, tmp_path)
    assert reference_trainer.model_accepts_loss_kwargs  # the flag that misled before
    trainer, model = train_masked_lm(MemfitTrainer, tmp_path, memfit_device=TIGHT_BERT)
    assert trainer.memfit_events, "the batch of 16 should have run out of memory"
    assert trainer._memfit_splitter.weighting.name == "valid tokens of batch['labels']"
    assert_same_weights(model, reference)
    for key in ("loss", "grad_norm"):
        got = [log[key] for log in trainer.state.log_history if key in log]
        expected = [log[key] for log in reference_trainer.state.log_history if key in log]
        assert got == pytest.approx(expected, rel=1e-5), key


# -- checkpointing policies: the same weights as without, or refused before training ----------


def tiny_model(kind: str) -> torch.nn.Module:
    """A config-built model of three layers, with dropout where the architecture has it (the
    recompute must replay its random state)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            attention_dropout=0.1,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertForMaskedLM(config)


def train_policy(
    kind: str, tmp: Path, policy: str | None, *, freeze: str | None = None, **arguments: Any
) -> tuple[Any, torch.nn.Module, list[float]]:
    """Two optimizer steps of a tiny model under the plain Trainer (policy None) or MemfitTrainer."""
    model = tiny_model(kind)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(freeze is None or freeze not in name)
    args = sgd_arguments(tmp, per_device_train_batch_size=8, max_steps=2, learning_rate=0.05, seed=3, **arguments)
    data = masked_dataset() if kind == "bert" else dataset()
    if policy is None:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    else:
        trainer = MemfitTrainer(model=model, args=args, train_dataset=data, memfit_checkpointing=policy)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return trainer, model, losses


@pytest.mark.parametrize(
    ("kind", "policy", "recomputed"),
    [
        ("gpt2", "blocks", ["transformer.h.0", "transformer.h.1", "transformer.h.2"]),
        ("gpt2", "every:2", ["transformer.h.0", "transformer.h.2"]),
        ("gpt2", "first:1", ["transformer.h.0"]),
        ("gpt2", "modules:GPT2MLP", ["transformer.h.0.mlp", "transformer.h.1.mlp", "transformer.h.2.mlp"]),
        ("gpt2", "selective", ["transformer.h.0", "transformer.h.1", "transformer.h.2"]),
        ("llama", "every:2", ["model.layers.0", "model.layers.2"]),
        # the final RMSNorm is a block too: user code with parameters whose kind runs seven times
        ("llama", "selective", ["model.layers.0", "model.layers.1", "model.layers.2", "model.norm"]),
        ("bert", "first:2", ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
        ("bert", "modules:bert.encoder.layer.1", ["bert.encoder.layer.1"]),
    ],
)
def test_a_checkpointing_policy_trains_the_weights_of_the_run_without_it(
    tmp_path: Path, kind: str, policy: str, recomputed: list[str]
) -> None:
    _, reference, expected = train_policy(kind, tmp_path, None)
    trainer, model, losses = train_policy(kind, tmp_path, policy)
    assert [path for path, _ in trainer.memfit_checkpointed.modules] == recomputed
    assert losses == pytest.approx(expected, rel=1e-5)
    assert_same_weights(model, reference)
    # undone after train(): the model's own forwards, its key/value cache as the Trainer left it
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert model.config.use_cache == reference.config.use_cache


def test_the_key_value_cache_is_off_while_checkpointed_and_back_after(tmp_path: Path) -> None:
    """With use_cache on, a recompute would append to the cache forward filled (a wrong
    gradient, or a shape error): it is off for train() and back after it."""
    _, reference, expected = train_policy("llama", tmp_path, None, use_cache=True)
    trainer, model, losses = train_policy("llama", tmp_path, "every:2", use_cache=True)
    assert trainer.memfit_checkpointed.recomputing > 0
    assert losses == pytest.approx(expected, rel=1e-5)
    assert_same_weights(model, reference)
    assert model.config.use_cache is True


def test_the_dropout_the_policies_replay_changes_the_weights(tmp_path: Path) -> None:
    """The equality above is not the models' indifference to randomness: another seed trains others."""
    _, reference, _ = train_policy("gpt2", tmp_path, None)
    _, other, _ = train_policy("gpt2", tmp_path / "other", None, data_seed=4)
    changed = [k for k, v in other.state_dict().items() if not torch.equal(v, reference.state_dict()[k])]
    assert changed


@pytest.mark.parametrize(
    ("policy", "arguments", "said"),
    [
        ("modules:NoSuchBlock", {}, "has no module of class or path 'NoSuchBlock'"),
        ("every:2", {"gradient_checkpointing": True}, "would both checkpoint the same layers"),
        ("budget", {}, "checkpointing budget is a plan axis"),
        ("sometimes", {}, "unknown checkpointing 'sometimes'"),
    ],
)
def test_a_policy_the_model_cannot_take_is_refused_before_training(
    tmp_path: Path, policy: str, arguments: dict[str, Any], said: str
) -> None:
    model = tiny_model("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, save_strategy="no", **arguments
    )
    with pytest.raises(memfit.MemfitError, match=said) as refused:
        MemfitTrainer(model=model, args=args, train_dataset=dataset(), memfit_checkpointing=policy)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_model_already_checkpointed_by_transformers_is_refused(tmp_path: Path) -> None:
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    with pytest.raises(memfit.MemfitError, match="already uses transformers' gradient checkpointing"):
        MemfitTrainer(model=model, args=args, train_dataset=dataset(), memfit_checkpointing="first:1")


def test_a_policy_that_saves_nothing_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The position embedding frozen: its call keeps nothing for backward, so checkpointing it saves nothing."""
    transformers.utils.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            trainer, model, losses = train_policy("gpt2", tmp_path, "modules:transformer.wpe", freeze="wpe")
    finally:
        transformers.utils.logging.disable_propagation()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit: checkpointing")]
    assert said == [
        "memfit: checkpointing modules:transformer.wpe recomputes nothing: 1 x Embedding ran, but neither their "
        "inputs nor their parameters require gradients (a frozen part keeps nothing for backward), so it saves "
        "no memory"
    ]
    assert trainer.memfit_checkpointed.recomputing == 0
    _, reference, expected = train_policy("gpt2", tmp_path, None, freeze="wpe")
    assert losses == pytest.approx(expected, rel=1e-5)
    assert_same_weights(model, reference)


def test_a_policy_that_chooses_what_forward_does_not_run_is_refused_at_the_first_forward(tmp_path: Path) -> None:
    """The model itself is not one of its parts: refused before any gradient, the weights untouched."""
    model = tiny_model("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, save_strategy="no"
    )
    trainer = MemfitTrainer(
        model=model, args=args, train_dataset=dataset(), memfit_checkpointing="modules:GPT2LMHeadModel"
    )
    with pytest.raises(memfit.MemfitError, match="no module of that class or path runs in forward"):
        trainer.train()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ for m in model.modules())  # undone
