"""The Hugging Face Trainer under a memory budget: `compile_for_trainer`.

    from memcompile.hf import compile_for_trainer
    callback = compile_for_trainer(model, budget="90%")          # compiles `model` in place
    trainer = Trainer(model=model, args=TrainingArguments(...), callbacks=[callback])
    trainer.train()
    print(memcompile.dump(callback.backend))

`TrainingArguments(torch_compile_backend="memcompile")` cannot work with accelerate 1.x: the
Trainer builds accelerate's TorchDynamoPlugin, whose DynamoBackend enum accepts only its own
names (`ValueError: 'MEMCOMPILE' is not a valid DynamoBackend`). So the model is compiled before
it is handed over (leave `torch_compile` off), with a memcompile backend, and the returned
callback counts the optimizer's state in the reserve: the Trainer creates its optimizer inside
`train()`, after the model is compiled but before the first step compiles anything, and hands it
to callbacks at `on_train_begin`. Pass `count_optimizer=False` to leave it out (a budget for the
step alone). transformers is imported only here, when this module is.
"""

from __future__ import annotations

from typing import Any

import torch

from memcompile.backend import Backend
from memcompile.options import make_options, with_optimizer

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("memcompile.hf needs transformers (pip install transformers); memcompile itself does not"
                      ) from error


class MemcompileCallback(TrainerCallback):
    """Adds the Trainer's optimizer state to `backend`'s reserve before the first step compiles."""

    def __init__(self, backend: Backend, count_optimizer: bool = True) -> None:
        self.backend = backend
        self.count_optimizer = count_optimizer

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not self.count_optimizer or optimizer is None:
            return
        if self.backend.compiles or self.backend.plans:
            raise RuntimeError("memcompile: the model was compiled before train() began, so its plans do not count "
                               "the optimizer's state; call compile_for_trainer(..., count_optimizer=False) or "
                               "compile after creating the Trainer")
        self.backend.options = with_optimizer(self.backend.options, optimizer)


def compile_for_trainer(model: torch.nn.Module, budget: int | str, *, count_optimizer: bool = True,
                        **options: object) -> MemcompileCallback:
    """Compile `model` in place under `budget` (what memcompile.budget() takes, with its options)
    and return the callback to pass to `Trainer(callbacks=[...])`; its `.backend` holds the plans."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compile_for_trainer: model has type {type(model).__name__}: expected a torch.nn.Module")
    if "optimizer" in options:
        raise TypeError("compile_for_trainer: the Trainer makes the optimizer; its state is counted at "
                        "on_train_begin (count_optimizer=True), so optimizer= is not taken here")
    backend = Backend(make_options(budget, **options))
    model.compile(backend=backend)
    return MemcompileCallback(backend, count_optimizer)
