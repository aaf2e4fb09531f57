"""Hugging Face Trainer with a tiny Llama (random weights from a config, nothing downloaded).

    python examples/hf_trainer.py [--codegen inductor|aot_eager] [--steps 3] [--by-name]

The model is compiled in place before it is handed to the Trainer (leave torch_compile off):

    callback = memcompile.hf.compile_for_trainer(model, budget="90%")
    Trainer(model=model, args=TrainingArguments(...), callbacks=[callback])

The callback adds the optimizer the Trainer creates to the reserve before the first step
compiles (AdamW: two moments per parameter). Or, by name, for a budget of the step alone:

    model.compile(backend="memcompile", options={"budget": "20GB"})

`TrainingArguments(torch_compile_backend="memcompile")` does not work with accelerate 1.x: the
Trainer builds accelerate's `TorchDynamoPlugin`, which accepts only the backend names of its
`DynamoBackend` enum and raises `ValueError: 'MEMCOMPILE' is not a valid DynamoBackend`.

The script trains an eager copy and a memcompile copy on the same batches, compares their
losses and first-step gradients, and measures every Trainer `training_step` (forward + loss +
backward): with the helper, plus AdamW's state, against the whole budget; by name, against the
budget of the step.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import memcompile
import memcompile.hf


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_dataset(n: int, seq: int, vocab: int = 128, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


class FirstGrads(TrainerCallback):
    """Copies the gradients of the first optimizer step."""

    def __init__(self) -> None:
        self.grads: tuple[torch.Tensor, ...] = ()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads = tuple(p.grad.detach().clone() for p in model.parameters())


class MeasuredTrainer(Trainer):
    """A Trainer whose every training_step (forward, loss, backward) is measured."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_peaks: list[int] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        live = [model] + [v for v in inputs.values() if isinstance(v, torch.Tensor)]
        model.zero_grad(set_to_none=True)  # frees made before a measurement are invisible to it
        m = memcompile.measure_peak(super().training_step, model, inputs, num_items_in_batch,
                                    live_at_start=live)
        self.step_peaks.append(m.peak_bytes)
        return m.result


@dataclass
class TrainerRun:
    losses: list[float]
    first_grads: tuple[torch.Tensor, ...]
    step_peaks: list[int]
    model: LlamaForCausalLM = field(repr=False)
    optimizer_state_bytes: int = 0  # what the Trainer's optimizer held at the end


def state_bytes(optimizer) -> int:
    return sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def train(model: LlamaForCausalLM, steps: int, batch: int, seq: int, callbacks: tuple = ()) -> TrainerRun:
    grads = FirstGrads()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, max_steps=steps, per_device_train_batch_size=batch,
                                 learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                 dataloader_num_workers=0, seed=0, disable_tqdm=True)
        trainer = MeasuredTrainer(model=model, args=args, train_dataset=token_dataset(steps * batch, seq),
                                  callbacks=[grads, *callbacks])
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return TrainerRun(losses, grads.grads, trainer.step_peaks, model, state_bytes(trainer.optimizer))


@dataclass(frozen=True)
class HFResult:
    budget_bytes: int
    eager: TrainerRun
    compiled: TrainerRun
    plans: tuple[memcompile.Plan, ...]


def run(steps: int = 3, batch: int = 4, seq: int = 64, budget_fraction: float = 0.8,
        codegen: str = "inductor", time_limit_s: float = 10.0) -> HFResult:
    """memcompile.hf.compile_for_trainer: the budget is the step's plus AdamW's state (the reserve)."""
    eager = train(tiny_llama(), steps, batch, seq)
    # A step budget below what the eager step needs, so memcompile has to recompute to fit,
    # plus what AdamW will hold (exp_avg, exp_avg_sq and a CPU step scalar per parameter).
    model = tiny_llama()
    adamw = sum(2 * p.nbytes + 4 for p in model.parameters())
    budget = math.floor(budget_fraction * max(eager.step_peaks)) + adamw
    callback = memcompile.hf.compile_for_trainer(model, budget=budget, codegen=codegen, time_limit_s=time_limit_s)
    compiled = train(model, steps, batch, seq, callbacks=(callback,))
    return HFResult(budget, eager, compiled, tuple(callback.backend.plans))


def run_by_name(steps: int = 3, batch: int = 4, seq: int = 64, budget_fraction: float = 0.8,
                codegen: str = "inductor", time_limit_s: float = 10.0) -> HFResult:
    """The backend by name: the budget is the step's alone."""
    eager = train(tiny_llama(), steps, batch, seq)
    budget = math.floor(budget_fraction * max(eager.step_peaks))
    options = {"budget": budget, "codegen": codegen, "time_limit_s": time_limit_s}
    model = tiny_llama()
    model.compile(backend="memcompile", options=options)
    compiled = train(model, steps, batch, seq)
    return HFResult(budget, eager, compiled, tuple(memcompile.named_backend(options).plans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--by-name", action="store_true", help='backend="memcompile" instead of compile_for_trainer')
    args = parser.parse_args()
    r = (run_by_name if args.by_name else run)(steps=args.steps, codegen=args.codegen)
    worst = max((a - b).abs().max().item() for a, b in zip(r.eager.first_grads, r.compiled.first_grads))
    print(f"budget {r.budget_bytes:,} B (AdamW state {r.compiled.optimizer_state_bytes:,} B); eager training_step "
          f"peaks {r.eager.step_peaks}; memcompile {r.compiled.step_peaks} (first one compiles)")
    print(f"losses eager {r.eager.losses}; memcompile {r.compiled.losses}; "
          f"largest |first-step grad difference| {worst:.2e}")
    print(memcompile.dump(list(r.plans)))


if __name__ == "__main__":
    main()
