"""NeoBERT's classification heads: the Auto classes load them from the official-layout fixture with a fresh head,
the pooling is the official one, every layout gives the same logits, the losses are transformers', and each head
trains, saves and reloads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

import neoembed  # noqa: F401  (registers the Auto classes)
from neoembed.modeling import (
    NeoBERTConfig,
    NeoBERTForSequenceClassification,
    NeoBERTForTokenClassification,
)

EQ = 1e-5


def tiny(**kw) -> NeoBERTConfig:
    base = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    return NeoBERTConfig(**{**base, **kw})


def batch(lengths, seed=0, left=False):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids, mask = torch.zeros(len(lengths), L, dtype=torch.long), torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        cols = slice(L - n, L) if left else slice(0, n)
        ids[i, cols] = torch.randint(1, 100, (n,), generator=g)
        mask[i, cols] = 1
    return ids, mask


@pytest.mark.parametrize(
    "auto, cls, fresh",
    [
        (AutoModelForSequenceClassification, NeoBERTForSequenceClassification, {"dense", "classifier"}),
        (AutoModelForTokenClassification, NeoBERTForTokenClassification, {"classifier"}),
    ],
)
def test_auto_class_loads_official_backbone_with_fresh_head(tiny_official, auto, cls, fresh):
    model, info = auto.from_pretrained(tiny_official, num_labels=3, output_loading_info=True)
    assert type(model) is cls and model.classifier.out_features == 3
    assert {k.split(".")[0] for k in info["missing_keys"]} == fresh
    backbone = AutoModel.from_pretrained(tiny_official)
    for (name, a), (_, b) in zip(
        model.model.state_dict().items(), backbone.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    # the head starts from the official rule: normal(0, classifier_init_range), zero bias
    assert model.classifier.bias.abs().max() == 0
    assert abs(model.classifier.weight.std().item() - 0.02) < 0.01
    # without output_loading_info, the plain call works too (the head may be missing; the encoder may not)
    assert type(auto.from_pretrained(tiny_official, num_labels=2)) is cls


def test_sequence_pooling_is_the_official_first_token_dense_tanh(tiny_official, tiny_expected):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_official, num_labels=4).eval()
    ids, mask = tiny_expected["input_ids"], tiny_expected["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        # official NeoBERTHFForSequenceClassification: h[:, 0] -> dense -> tanh -> classifier (dropout off)
        reference = model.classifier(torch.tanh(model.dense(tiny_expected["last_hidden_state"][:, 0])))
    assert (logits - reference).abs().max() <= 1e-4


@pytest.mark.parametrize("cls", [NeoBERTForSequenceClassification, NeoBERTForTokenClassification])
def test_layouts_agree(cls):
    torch.manual_seed(0)
    model = cls(tiny(num_labels=3, padding_free=False)).eval()
    ids, mask = batch([7, 3, 5])
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits
        model.config.padding_free = True
        free = model(input_ids=ids, attention_mask=mask).logits
        lengths = mask.sum(1)
        packed_ids = ids[mask.bool()][None]
        cu = torch.tensor([0, *lengths.cumsum(0).tolist()], dtype=torch.int32)
        packed = model(input_ids=packed_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits
        pos = torch.cat([torch.arange(int(n)) for n in lengths])[None]
        by_positions = model(input_ids=packed_ids, position_ids=pos).logits
    real = mask.bool()
    if cls is NeoBERTForTokenClassification:
        padded, free = padded[real], free[real]
        packed, by_positions = packed[0], by_positions[0]
    for other in (free, packed, by_positions):
        assert other.shape == padded.shape
        assert (other - padded).abs().max() <= EQ


def test_sequence_head_reads_the_first_real_token_under_left_padding():
    torch.manual_seed(0)
    model = NeoBERTForSequenceClassification(tiny(num_labels=2)).eval()
    right, left = batch([6, 2], seed=1), batch([6, 2], seed=1, left=True)
    with torch.no_grad():
        a = model(input_ids=right[0], attention_mask=right[1]).logits
        b = model(input_ids=left[0], attention_mask=left[1]).logits
    assert (a - b).abs().max() <= EQ


@pytest.mark.parametrize(
    "num_labels, problem_type, labels, reference",
    [
        (1, None, torch.tensor([0.5, 4.0, 2.5]), lambda z, y: F.mse_loss(z.view(-1), y)),
        (3, None, torch.tensor([0, 2, 1]), F.cross_entropy),
        (
            3,
            "multi_label_classification",
            torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]]),
            F.binary_cross_entropy_with_logits,
        ),
    ],
)
def test_sequence_losses_are_transformers_problem_types(num_labels, problem_type, labels, reference):
    torch.manual_seed(0)
    model = NeoBERTForSequenceClassification(tiny(num_labels=num_labels, problem_type=problem_type)).eval()
    ids, mask = batch([5, 4, 6])
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.allclose(out.loss, reference(out.logits, labels))
    assert model.config.problem_type == problem_type  # inferred per call, never written into the config


def test_unknown_problem_type_names_the_valid_ones():
    model = NeoBERTForSequenceClassification(tiny(num_labels=2))
    model.config.problem_type = "ranking"
    with pytest.raises(ValueError, match="single_label_classification"):
        model(input_ids=batch([3])[0], labels=torch.tensor([1]))


@pytest.mark.parametrize("cls", [NeoBERTForSequenceClassification, NeoBERTForTokenClassification])
def test_each_head_trains_saves_and_reloads(tiny_official, tmp_path, cls):
    """A few AdamW steps on the official fixture's backbone fit a tiny batch; the saved folder reloads exactly."""
    torch.manual_seed(0)
    model = cls.from_pretrained(tiny_official, num_labels=2, classifier_dropout=0.0)
    ids, mask = batch([9, 6, 8, 5], seed=2)
    ids = ids + 1000 * mask  # real word pieces of the fixture's vocabulary
    if cls is NeoBERTForSequenceClassification:
        labels = torch.tensor([0, 1, 1, 0])
    else:
        labels = torch.where(mask.bool(), ids % 2, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    model.save_pretrained(tmp_path)
    again = AutoModelForSequenceClassification if cls is NeoBERTForSequenceClassification else None
    again = (again or AutoModelForTokenClassification).from_pretrained(tmp_path).eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, mask).logits, again(ids, mask).logits)


def test_masked_lm_fine_tunes_through_transformers_trainer(tiny_official, tmp_path):
    """HF's Trainer passes ``num_items_in_batch`` to a forward that takes ``**kwargs``; NeoBERTForMaskedLM handed
    it on to the encoder, which refused it, so MLM fine-tuning through the Trainer raised. The loss with it is the
    sum over masked tokens divided by the count (gradient accumulation's normalisation)."""
    from datasets import Dataset
    from transformers import (
        AutoModelForMaskedLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_official)
    model = AutoModelForMaskedLM.from_pretrained(tiny_official)
    texts = [f"sentence number {i} about encoders and masked tokens" for i in range(16)]
    data = Dataset.from_dict(dict(tokenizer(texts, truncation=True, max_length=32)))
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=0)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
    )  # fmt: skip
    before = model.decoder.weight.detach().clone()
    Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()
    assert not torch.equal(before, model.decoder.weight)  # it trained
    torch.manual_seed(0)
    b = collator([data[i] for i in range(4)])
    masked = int((b["labels"] != -100).sum())
    model.eval()
    with torch.no_grad():
        mean = model(**b).loss
        summed = model(**b, num_items_in_batch=torch.tensor(2 * masked)).loss
    torch.testing.assert_close(summed, mean / 2)


def test_saved_classifier_loads_with_trust_remote_code_without_neoembed(
    tiny_official, tmp_path, block_neoembed
):
    """A classifier neoembed saves (what `neoembed glue` keeps in OUT/model) carries the two NeoBERT files and an
    auto_map to them: where neoembed is not installed, transformers' remote code gives the same logits."""
    import os
    import subprocess
    import sys
    import textwrap

    model = AutoModelForSequenceClassification.from_pretrained(tiny_official, num_labels=3).eval()
    model.save_pretrained(tmp_path / "clf")
    ids, mask = batch([5, 9, 3])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    torch.save({"ids": ids, "mask": mask}, tmp_path / "batch.pt")
    code = block_neoembed + textwrap.dedent(f"""
        import torch
        try:
            import neoembed
            raise SystemExit('neoembed should not be importable here')
        except ImportError:
            pass
        from transformers import AutoModelForSequenceClassification
        m = AutoModelForSequenceClassification.from_pretrained({str(tmp_path / "clf")!r}, trust_remote_code=True)
        assert type(m).__module__.startswith('transformers_modules'), type(m)
        b = torch.load({str(tmp_path / "batch.pt")!r})
        with torch.no_grad():
            torch.save(m.eval()(input_ids=b['ids'], attention_mask=b['mask']).logits, {str(tmp_path / "out.pt")!r})
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert torch.allclose(torch.load(tmp_path / "out.pt"), expected, atol=EQ)
