"""The torch.compile backend: Dynamo graph -> AOTAutograd joint graph -> our partitioner -> codegen."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import pathlib
import threading
import weakref
from typing import Any, Callable, Sequence

import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.plan_dump import write_dump_dir
from memcompile.errors import InfeasibleBudgetError
from memcompile.options import Options
from memcompile.plan import Plan
from memcompile.planner import plan_joint_graph

log = logging.getLogger("memcompile")

# Partitioners must survive Inductor's deepcopy/pickle of its config, so they refer to their
# backend by id; plans are reported back through this registry.
_BACKENDS: "weakref.WeakValueDictionary[int, Backend]" = weakref.WeakValueDictionary()
_ids = itertools.count()
_lock = threading.Lock()


def _source_hash() -> str:
    """Changes whenever memcompile's code does: part of every cache key."""
    root = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    for sub in ("passes", "cost_models"):
        # installed layout: memcompile/passes; editable layout resolves to the repo's folders
        pkg = __import__(f"memcompile.{sub}", fromlist=["_"])
        for path in sorted(pathlib.Path(pkg.__file__).parent.glob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class Partitioner(tp.PartitionerBase):
    """Inductor's `custom_partitioner_fn`: plans the joint graph under the backend's budget."""

    def __init__(self, options: Options, backend_id: int) -> None:
        self.options = options
        self.backend_id = backend_id

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        backend = _BACKENDS.get(self.backend_id)
        graph_id = backend.next_graph_id() if backend is not None else "graph"
        fw, bw, plan = plan_joint_graph(
            gm,
            joint_inputs,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            options=self.options,
            graph_id=graph_id,
        )
        if backend is not None:
            backend.plans.append(plan)
            write_dump_dir(plan, os.environ.get("MEMCOMPILE_DUMP_DIR"))
        return fw, bw

    def uuid(self) -> str:
        # Budget, options, code and torch version: a cached graph is never reused under another plan.
        return f"memcompile-{_source_hash()}-{tp.TORCH_VERSION}-{self.options.describe()}"

    def __reduce__(self):
        return (Partitioner, (self.options, self.backend_id))

    def __deepcopy__(self, memo: dict) -> "Partitioner":
        return self


class Backend:
    """What `memcompile.budget(...)` returns: pass it as `torch.compile(..., backend=...)`.

    `plans` holds the plan of every graph compiled with it, in compile order.
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self.plans: list[Plan] = []
        self.errors: list[Exception] = []
        self._graph_count = itertools.count()
        with _lock:
            self.id = next(_ids)
            _BACKENDS[self.id] = self

    def next_graph_id(self) -> str:
        return f"graph_{next(self._graph_count)}"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        partitioner = Partitioner(self.options, self.id)
        try:
            if self.options.codegen == "inductor":
                return tp.compile_with_inductor(gm, example_inputs, partitioner)

            def partition_fn(joint, joint_inputs, **kwargs):
                return partitioner(joint, joint_inputs, **kwargs)

            return tp.compile_with_aot_eager(gm, example_inputs, partition_fn)
        except InfeasibleBudgetError as error:
            # Raised from the compiled callable so the user catches our type, not Dynamo's
            # wrapper; every call raises, so the step never runs over budget.
            self.errors.append(error)
            log.error("%s", error)
            saved_error = error  # `error` is unbound once the except block ends

            def over_budget(*_args: Any, **_kwargs: Any):
                raise saved_error

            return over_budget

    def __repr__(self) -> str:
        return f"memcompile.budget({self.options.describe()})"
