"""Benchmark models nobody here wrote: Hugging Face GPT-2, Llama, BERT, ViT and ResNet (a CNN).

Built offline from configs with random weights (no download), dropout off (so gradients are
deterministic and comparable with eager PyTorch), fixed by a seed. Each model is wrapped so one
`forward(*inputs)` returns the scalar training loss: the compiled graph is the whole step.

    from hf_models import build
    bench = build("gpt2", "small")          # BenchModel(module, inputs, ...)
    bench.module(*bench.inputs).backward()

Single-graph fixes (Dynamo graph breaks otherwise, with torch 2.13 / transformers 5.x):
GPT-2 and Llama get `loss_type = "ForCausalLM"` set up front (the loss type is otherwise
looked up from the class name at call time); ViT / ResNet get `config.problem_type` set up front
(it is otherwise inferred from the labels' dtype inside forward and written to the config);
all get `use_cache=False` (with gradient checkpointing, a warning is logged inside forward otherwise).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

MODELS = ("gpt2", "llama", "bert", "vit", "resnet")
SIZES = ("tiny", "small", "medium", "real")

# Sizes for a 2-core CPU shared with other jobs (a pareto run compiles each model ~20 times).
# Vocabularies are cut (real GPT-2: 50257) so the logits do not dwarf the blocks; everything else
# keeps the real architecture.
CONFIGS: dict[str, dict[str, dict]] = {
    "gpt2": {
        "tiny": dict(layers=2, hidden=64, heads=4, vocab=512, batch=2, seq=32),
        "small": dict(layers=2, hidden=128, heads=4, vocab=2048, batch=4, seq=128),
        "medium": dict(layers=4, hidden=256, heads=4, vocab=8192, batch=4, seq=128),
        # The real GPT-2 small (124M parameters), at a batch and length where activations dominate
        # (benchmarks/gpu_check.py on a CUDA machine).
        "gpu": dict(layers=12, hidden=768, heads=12, vocab=50257, batch=8, seq=1024),
        # The real GPT-2 small again (124M: 1024 positions, the full vocabulary, tied embeddings) at a
        # batch and length a 2-core CPU steps in seconds while activations still outweigh parameters
        # and gradients together (benchmarks/pareto.py --size real).
        "real": dict(layers=12, hidden=768, heads=12, vocab=50257, batch=2, seq=512, positions=1024),
    },
    "llama": {
        "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=172, vocab=512, batch=2, seq=32),
        "small": dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=344, vocab=2048, batch=4, seq=128),
        "medium": dict(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=688, vocab=8192, batch=4, seq=128),
        # Llama-style, 333M parameters: 24 x 1024, grouped-query attention (16 query heads, 4 KV
        # heads), SwiGLU 2816, Llama 2's 32000-token vocabulary, untied head (benchmarks/gpu_check.py).
        "gpu": dict(layers=24, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32000, batch=8, seq=1024),
        # A deep Llama for the CPU (~100M parameters): 24 layers, GQA (8 query / 2 KV heads), SwiGLU,
        # RMSNorm, RoPE, Llama 2's 32000-token vocabulary; 512 wide so one compile takes minutes here.
        "real": dict(layers=24, hidden=512, heads=8, kv_heads=2, intermediate=1408, vocab=32000, batch=2, seq=512),
    },
    "bert": {
        "tiny": dict(layers=2, hidden=64, heads=4, intermediate=256, vocab=512, batch=2, seq=32),
        "small": dict(layers=2, hidden=128, heads=4, intermediate=512, vocab=2048, batch=4, seq=128),
        "medium": dict(layers=4, hidden=256, heads=4, intermediate=1024, vocab=8192, batch=4, seq=128),
    },
    "vit": {
        "tiny": dict(layers=2, hidden=64, heads=4, intermediate=256, image=32, patch=8, classes=10, batch=2),
        "small": dict(layers=2, hidden=128, heads=4, intermediate=512, image=64, patch=8, classes=10, batch=8),
        "medium": dict(layers=4, hidden=256, heads=4, intermediate=1024, image=128, patch=16, classes=100, batch=8),
    },
    "resnet": {
        "tiny": dict(widths=(8, 16), depths=(1, 1), image=32, classes=10, batch=2),
        "small": dict(widths=(16, 32, 64), depths=(1, 1, 1), image=64, classes=10, batch=8),
        "medium": dict(widths=(32, 64, 128), depths=(2, 2, 2), image=64, classes=100, batch=8),
    },
}


@dataclass
class BenchModel:
    name: str
    size: str
    module: nn.Module  # forward(*inputs) -> scalar loss
    inputs: tuple[torch.Tensor, ...]
    config: dict = field(default_factory=dict)
    enable_block_checkpointing: Callable[[], None] = lambda: None  # per-block torch.utils.checkpoint

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


class LossOf(nn.Module):
    """`model(**{name: input}).loss` as a module of positional inputs."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.input_names, inputs))).loss


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return make()
    finally:
        torch.random.set_rng_state(state)


def _tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf_checkpointing(model: nn.Module) -> Callable[[], None]:
    # Non-reentrant checkpoint: the variant Dynamo captures in one graph (tag_activation_checkpoint).
    def enable() -> None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers >= 5.25 routes attention through the `kernels` hub, whose forward sets and
        # resets a module global; Dynamo refuses such a side effect inside a checkpointed region
        # unless told it need not be replayed in the backward (it need not: it is set and reset).
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    return enable


def _gpt2(c: dict, seed: int) -> BenchModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=c["layers"], n_embd=c["hidden"], n_head=c["heads"], vocab_size=c["vocab"],
                     n_positions=c.get("positions", c["seq"]), bos_token_id=c["vocab"] - 1, eos_token_id=c["vocab"] - 1,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, attn_implementation="sdpa")
    model = _seeded(seed, lambda: GPT2LMHeadModel(cfg))
    model.loss_type = "ForCausalLM"
    ids = _tokens(c["batch"], c["seq"], c["vocab"], seed + 1)
    return BenchModel("gpt2", "", LossOf(model, ("input_ids", "labels")), (ids, ids.clone()), c,
                      _hf_checkpointing(model))


def _llama(c: dict, seed: int) -> BenchModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                      num_key_value_heads=c["kv_heads"], intermediate_size=c["intermediate"],
                      vocab_size=c["vocab"], max_position_embeddings=c["seq"], attention_dropout=0.0,
                      use_cache=False, attn_implementation="sdpa")
    model = _seeded(seed, lambda: LlamaForCausalLM(cfg))
    model.loss_type = "ForCausalLM"
    ids = _tokens(c["batch"], c["seq"], c["vocab"], seed + 1)
    return BenchModel("llama", "", LossOf(model, ("input_ids", "labels")), (ids, ids.clone()), c,
                      _hf_checkpointing(model))


def _bert(c: dict, seed: int) -> BenchModel:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                     intermediate_size=c["intermediate"], vocab_size=c["vocab"], max_position_embeddings=c["seq"],
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = _seeded(seed, lambda: BertForMaskedLM(cfg))
    ids = _tokens(c["batch"], c["seq"], c["vocab"], seed + 1)
    # Masked-LM labels: every 7th token is predicted, the rest ignored (-100), as in MLM training.
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    return BenchModel("bert", "", LossOf(model, ("input_ids", "labels")), (ids, labels), c,
                      _hf_checkpointing(model))


def _images(c: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(c["batch"], 3, c["image"], c["image"], generator=g)
    labels = torch.randint(0, c["classes"], (c["batch"],), generator=g)
    return pixels, labels


def _vit(c: dict, seed: int) -> BenchModel:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                    intermediate_size=c["intermediate"], image_size=c["image"], patch_size=c["patch"],
                    num_labels=c["classes"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    problem_type="single_label_classification", attn_implementation="sdpa")
    model = _seeded(seed, lambda: ViTForImageClassification(cfg))
    return BenchModel("vit", "", LossOf(model, ("pixel_values", "labels")), _images(c, seed + 1), c,
                      _hf_checkpointing(model))


def _resnet(c: dict, seed: int) -> BenchModel:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=c["widths"][0], hidden_sizes=list(c["widths"]), depths=list(c["depths"]),
                       layer_type="basic", num_labels=c["classes"], problem_type="single_label_classification")
    model = _seeded(seed, lambda: ResNetForImageClassification(cfg))
    # HF ResNet has no gradient-checkpointing support: checkpoint each stage's blocks by hand.
    return BenchModel("resnet", "", LossOf(model, ("pixel_values", "labels")), _images(c, seed + 1), c,
                      lambda: _checkpoint_children(model.resnet.encoder.stages))


def _checkpoint_children(stages: nn.ModuleList) -> None:
    from torch.utils.checkpoint import checkpoint

    # Replace each block's forward on the instance: parameter names stay as they are.
    for stage in stages:
        for layer in stage.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


_BUILDERS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit, "resnet": _resnet}


def build(name: str, size: str = "small", seed: int = 0, **overrides: int) -> BenchModel:
    """A model by name and size, weights fixed by `seed`; `overrides` replace config entries (e.g. batch=8)."""
    if name not in _BUILDERS:
        raise ValueError(f"model name={name!r}: expected one of {MODELS}")
    if size not in CONFIGS[name]:
        raise ValueError(f"size={size!r}: expected one of {tuple(CONFIGS[name])}")
    unknown = sorted(set(overrides) - set(CONFIGS[name][size]))
    if unknown:
        raise ValueError(f"overrides {unknown} are not config entries of {name}: {sorted(CONFIGS[name][size])}")
    c = {**CONFIGS[name][size], **overrides}
    bench = _BUILDERS[name](c, seed)
    bench.size = size
    bench.module.model.config.use_cache = False  # no KV cache in training (and no warning inside forward)
    bench.module.train()
    return bench
