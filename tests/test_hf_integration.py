"""Hugging Face round trips and the Trainer callback, on models built from small configs."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fisherprune as fp  # noqa: E402
from fisherprune.integrations.hf import FisherPruningCallback  # noqa: E402

IDS = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))


def _models() -> dict:
    t = transformers
    small = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return {
        "bert": (
            lambda: t.BertForSequenceClassification(
                t.BertConfig(
                    vocab_size=100,
                    hidden_size=32,
                    max_position_embeddings=64,
                    num_labels=3,
                    **small,
                )
            ),
            {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)},
        ),
        "gpt2": (
            lambda: t.GPT2LMHeadModel(
                t.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)
            ),
            {"input_ids": IDS},
        ),
        "llama": (
            lambda: t.LlamaForCausalLM(
                t.LlamaConfig(
                    vocab_size=100,
                    hidden_size=32,
                    num_key_value_heads=2,
                    max_position_embeddings=64,
                    **small,
                )
            ),
            {"input_ids": IDS},
        ),
        "qwen2": (
            lambda: t.Qwen2ForCausalLM(
                t.Qwen2Config(
                    vocab_size=100,
                    hidden_size=32,
                    num_key_value_heads=2,
                    max_position_embeddings=64,
                    **small,
                )
            ),
            {"input_ids": IDS},
        ),
        "vit": (
            lambda: t.ViTForImageClassification(
                t.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_labels=3, **small)
            ),
            {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))},
        ),
        "gemma": (  # embeddings scaled by sqrt(hidden_size), derived from the config
            lambda: t.GemmaForCausalLM(
                t.GemmaConfig(
                    vocab_size=100,
                    hidden_size=32,
                    num_key_value_heads=2,
                    head_dim=8,
                    max_position_embeddings=64,
                    **small,
                )
            ),
            {"input_ids": IDS},
        ),
        "t5": (
            lambda: t.T5ForConditionalGeneration(
                t.T5Config(
                    vocab_size=100,
                    d_model=32,
                    d_kv=8,
                    d_ff=64,
                    num_layers=2,
                    num_decoder_layers=2,
                    num_heads=4,
                )
            ),
            {"input_ids": IDS, "decoder_input_ids": IDS},
        ),
    }


@functools.cache
def _uniform_pruned(name: str):
    """A model pruned with uniform=True by random scores (built once per module: the tests only
    read it; shrink works on a copy)."""
    build, x = _models()[name]
    torch.manual_seed(0)
    model = build().eval().double()
    fp.apply_masks(model, x)
    opt = fp.PruningOptimizer(
        model, x, uniform=True, criterion=fp.criteria.Random(seed=0), prune_every=1
    )
    for _ in range(6):
        opt.after_update()
    return model, x, opt


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "qwen2", "vit", "t5"])
def test_uniform_pruning_keeps_every_block_the_same_widths(name):
    _, _, opt = _uniform_pruned(name)
    assert opt.history, "nothing was pruned"
    for members in opt.uniform_classes:
        kept = {int(opt.masks[n].mask.sum()) for n in members}
        assert len(kept) == 1, (members, kept)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "qwen2", "gemma", "vit", "t5"])
def test_uniform_shrunk_model_round_trips_through_save_pretrained(name, tmp_path):
    model, x, _ = _uniform_pruned(name)
    small = fp.shrink(model, x)
    small.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path).eval().double()  # no fisherprune code
    with torch.no_grad():
        want, got = small(**x).logits, back(**x).logits
    # Gemma's embedding scale is a float32 buffer that from_pretrained recomputes in float64
    # after .double(): the dense model's own round trip differs by ~1e-7
    assert torch.allclose(got, want, rtol=0, atol=1e-6 if name == "gemma" else 1e-12)


def test_config_follows_the_shrunk_widths():
    model, x, _ = _uniform_pruned("llama")
    small = fp.shrink(model, x)
    layer = small.model.layers[0]
    assert small.config.intermediate_size == layer.mlp.up_proj.out_features
    assert small.config.hidden_size == small.model.embed_tokens.embedding_dim
    assert small.config.num_key_value_heads * 8 == layer.self_attn.k_proj.out_features
    assert small.config.num_attention_heads * 8 == layer.self_attn.q_proj.out_features
    assert small.config.hidden_size < 32 or small.config.intermediate_size < 64


def test_non_uniform_widths_leave_the_config_and_say_why():
    build, x = _models()["llama"]
    model = build().eval().double()
    masks = fp.apply_masks(model, x)
    mlp0 = next(n for n in masks if "layers_0_mlp" in n)
    with torch.no_grad():
        masks[mlp0].mask[:3] = 0.0
    with pytest.warns(UserWarning, match="different widths for intermediate_size"):
        small = fp.shrink(model, x)
    assert small.config.intermediate_size == 64  # still the dense model's


def test_gemma_hidden_width_is_left_whole_by_uniform_pruning():
    # Gemma scales its embeddings by sqrt(hidden_size), computed when the model is built: a
    # narrower hidden width would load with another scale, so uniform=True keeps it whole
    _, _, opt = _uniform_pruned("gemma")
    assert any("embed_tokens" in n for n in opt.kept_whole)
    assert all("mlp" not in n for n in opt.kept_whole)


def test_bert_hidden_width_is_left_whole_by_uniform_pruning():
    # BERT's head size is hidden_size / num_attention_heads: no config holds a narrower
    # hidden width with the same heads, so uniform=True must not prune it
    _, _, opt = _uniform_pruned("bert")
    assert any("word_embeddings" in n for n in opt.kept_whole)
    assert all("intermediate" not in n for n in opt.kept_whole)


def test_trainer_callback_prunes_to_the_target_inside_trainer_train(tmp_path):
    build, x = _models()["bert"]
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(2)
    data = [
        {"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": int(i % 3)}
        for i in range(64)
    ]
    callback = FisherPruningCallback(x, flops_target="97%", prune_every=1, burn_in=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=16,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    pruner = callback.pruner
    assert pruner.history and pruner.finished
    assert pruner.cost().total <= pruner.target
    model.eval()
    small = fp.shrink(model, x)  # checks shrunk == masked on x
    assert fp.computational_cost(small, x).total == pytest.approx(pruner.cost().total)


def test_trainer_callback_under_torch_compile_prunes_as_eager(tmp_path):
    """The Trainer's own ``torch_compile=True`` (``aot_eager``: traced, no kernels built)
    around a masked Hugging Face BERT: the callback prunes the channels, at the steps, that it
    prunes in eager (the masks' signal is gathered inside the compiled graph)."""
    runs = [
        _train_with_callback(tmp_path / "eager", False)[1],
        _train_with_callback(
            tmp_path / "compiled", False, torch_compile=True, torch_compile_backend="aot_eager"
        )[1],
    ]
    eager, compiled = ([(e.step, e.mask, e.channels) for e in p.history] for p in runs)
    assert eager and compiled == eager


def _train_with_callback(tmp_path, shrink_when_finished: bool, **more_args):
    """A tiny BERT classifier trained 24 Trainer steps with ``FisherPruningCallback``
    (``more_args``: more ``TrainingArguments``); the model, the pruner and the example."""
    t = transformers
    torch.manual_seed(0)
    model = t.BertForSequenceClassification(
        t.BertConfig(
            vocab_size=100, hidden_size=32, max_position_embeddings=64, num_labels=3,
            num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    data = [
        {"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": int(i % 3)}
        for i in range(64)
    ]
    x = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
    callback = FisherPruningCallback(
        x, flops_target="97%", prune_every=1, burn_in=2, shrink_when_finished=shrink_when_finished
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=24, per_device_train_batch_size=8,
        learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, **more_args,
    )  # fmt: skip
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    return model, callback.pruner, x


def test_callback_shrink_when_finished_fine_tunes_the_small_model_as_the_masked_one(tmp_path):
    """The steps after pruning train the shrunk model (its optimizer state carried over) and
    end with the weights the masked model reaches and is then shrunk to."""
    small, pruner, x = _train_with_callback(tmp_path / "a", shrink_when_finished=True)
    masked, reference, _ = _train_with_callback(tmp_path / "b", shrink_when_finished=False)
    assert pruner.shrunk and not fp.find_masks(small)
    assert [e.step for e in pruner.history] == [e.step for e in reference.history]
    assert pruner.history[-1].step < 24 - 4  # several steps trained the shrunk model
    late = fp.shrink(masked, x).state_dict()
    for k, v in small.state_dict().items():
        torch.testing.assert_close(v, late[k], rtol=1e-4, atol=1e-6, msg=k)


def test_prune_to_target_uniform_gives_a_model_from_pretrained_loads(tmp_path):
    """The post-training workflow with uniform=True on LLaMA (label-free, no labels): the
    shrunk model saves and loads back as a standard config with the same outputs."""
    build, x = _models()["llama"]
    torch.manual_seed(0)
    model = build().eval()
    g = torch.Generator().manual_seed(3)
    batches = [({"input_ids": torch.randint(0, 100, (4, 8), generator=g)}, None) for _ in range(3)]
    result = fp.prune_to_target(model, x, batches, "70%", uniform=True, reconstruct=False)
    assert result.cost_after <= result.target
    small = fp.shrink(model, x)
    small.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(**x).logits, small(**x).logits, rtol=1e-5, atol=1e-5)


def test_uniform_target_out_of_reach_is_refused_and_uniform_false_reaches_it():
    """On BERT, uniform=True can prune only the MLP (no config holds fewer heads or a narrower
    hidden width with BERT's head size), so 20% of the FLOPs is out of its reach: refused up
    front, naming a mask it keeps whole and the way out; uniform=False reaches the target."""
    build, x = _models()["bert"]
    g = torch.Generator().manual_seed(3)
    batches = [({"input_ids": torch.randint(0, 100, (4, 8), generator=g)}, None) for _ in range(2)]
    torch.manual_seed(0)
    model = build().eval()
    with pytest.raises(ValueError, match=r"keeps \d+ mask\(s\) whole, e\.g\. .*uniform"):
        fp.prune_to_target(model, x, batches, "20%", uniform=True, reconstruct=False)
    other = build().eval()
    free = fp.prune_to_target(other, x, batches, "20%", uniform=False, reconstruct=False)
    assert free.cost_after <= free.target


def test_t5_pruned_unevenly_shrinks_to_the_masked_outputs():
    """T5 builds its cross-attention bias as zeros with the first block's head count and reuses
    it in every block: the zeros follow that head width (graph.rules_buffers), so the
    cross-attention heads of every block are one group, pruned together; everything else prunes
    block by block (uniform=False) and the shrunk model gives the masked model's logits."""
    build, x = _models()["t5"]
    torch.manual_seed(0)
    model = build().eval()
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 100, (4, 8), generator=g) for _ in range(3)]
    batches = [({"input_ids": i, "decoder_input_ids": i}, None) for i in ids]
    result = fp.prune_to_target(model, x, batches, "50%", uniform=False, reconstruct=False)
    assert result.cost_after <= result.target
    assert len([n for n in fp.find_masks(model) if "EncDecAttention" in n]) == 1
    small = fp.shrink(model, x)
    with torch.no_grad():
        torch.testing.assert_close(small(**x).logits, model(**x).logits, rtol=1e-4, atol=1e-5)


def test_falcon_shrinks_though_its_head_dim_is_a_read_only_property():
    """FalconConfig derives head_dim (a property with no setter): shrink leaves it to follow
    the fields it derives from instead of failing to set it, and gives the masked logits."""
    cfg = transformers.FalconConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(cfg).eval()
    x = {"input_ids": IDS}
    g = torch.Generator().manual_seed(3)
    batches = [({"input_ids": torch.randint(0, 100, (4, 8), generator=g)}, None)] * 2
    fp.prune_to_target(model, x, batches, "50%", reconstruct=False)
    small = fp.shrink(model, x)
    assert small.config.head_dim == small.config.hidden_size // small.config.num_attention_heads
    with torch.no_grad():
        torch.testing.assert_close(small(**x).logits, model(**x).logits, rtol=1e-4, atol=1e-5)


def test_one_callback_refuses_the_model_of_a_second_trainer():
    """Issue 35, point 5: a callback already pruning one model, started by a second Trainer on
    another model, raises naming the fix (the second model got no masks, and the first lost
    channels on the second's steps); started again on its own model, it goes on."""
    x = torch.randn(4, 8)
    callback = FisherPruningCallback(x[:1], flops_target="50%", prune_every=1)
    first, second = (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 2)) for _ in range(2))  # fmt: skip
    for model in (first, first):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        callback.on_train_begin(None, None, None, model=model, optimizer=opt)
    opt = torch.optim.SGD(second.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="give each Trainer its own callback"):
        callback.on_train_begin(None, None, None, model=second, optimizer=opt)
    assert callback.pruner.model is first and not fp.find_masks(second)
