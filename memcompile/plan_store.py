"""Planning outcomes kept on disk: a second launch of the same script does not plan again.

A first call plans each joint graph with exact checks of candidate plans (each an Inductor
lowering and schedule of the whole graph: seconds per check at 12 layers). Its outcome depends
only on what the key below holds, so the next launch of the same script reads it back:

- key: the joint graph as data (every node's op, target, arguments, name, and its value's shape,
  stride, dtype and device; the checkpoint annotations), the planning options (the budget and
  the reserve included), the request's flags, and everything else the check reads: the torch
  version, memcompile's source, Inductor's configuration, the CPU's instruction set and thread
  count (library scratch depends on them), the accelerator's name, the experiment switches;
- value: the outcome: the chosen decisions and their Plan (its checked peak), or the
  InfeasibleBudgetError (with its floor) or NoSolverPlanFits that planning raised.

A hit re-makes the forward and backward graphs from the decisions and skips the search and the
checks: they would check exactly the graphs they checked before. A region's rewrite ladder is kept
the same way (keyed by its Dynamo graph): a later launch applies the rewrites it ended with at once
instead of planning the rungs before them again. Graphs with symbolic sizes are
not stored (their plans depend on the sizes seen so far). Unreadable or foreign files are misses;
writes are atomic (a temporary file renamed), so concurrent launches do not see half a record.

Records are pickles, and unpickling runs code: a record is read only from folders this user alone
can write (POSIX: each folder from the store's own, and for the default location its
`memcompile_<user>` parent, down to the file, owned by the user and writable by no one else,
where a symbolic link points). The folders are created 0700. Any other folder is a logged miss,
never written to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import pickle
import platform
import stat
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from memcompile.cost_models.cpu_workspace import onednn_max_cpu_isa_settings
from memcompile.plan import Plan, TextEnum

log = logging.getLogger("memcompile")

FORMAT = 1  # bump when StoredOutcome changes shape


class Outcome(TextEnum):
    """What one planning of a joint graph ended with (StoredOutcome.kind)."""

    PLAN = "plan"
    INFEASIBLE = "infeasible"  # InfeasibleBudgetError
    NO_FIT = "no_fit"  # NoSolverPlanFits
    COMPILED = "compiled"  # kept beside AOTAutograd's cache entry for the compiled graphs


@dataclass(frozen=True)
class StoredOutcome:
    """What one planning of a joint graph ended with."""

    kind: Outcome
    plan: Plan | None = None  # kind PLAN: the plan as first made
    solution: Any = None  # kind PLAN: ActivationSolution | StockSolution (decisions by candidate index)
    candidate_names: tuple[str, ...] = ()  # the problem's candidates the indices refer to (checked on a hit)
    error_message: str = ""  # kind INFEASIBLE
    min_feasible_bytes: int = 0  # INFEASIBLE: the floor named; NO_FIT: NoSolverPlanFits.floor_at_least
    contributors: tuple[tuple[str, int], ...] = ()
    whole_step: bool = True  # kind INFEASIBLE: InfeasibleBudgetError.whole_step
    inputs: Any = None  # kind COMPILED: the joint graph's InputBytes (memcompile/ledger.py)


def default_directory() -> str:
    """Where plans are kept unless the user says: beside Inductor's own default cache."""
    try:
        user = os.getlogin()
    except OSError:
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"memcompile_{user}", "plans")


def _value_text(value: object) -> str | None:
    """Shape, stride, dtype and device of a node's value; None where a size is symbolic."""
    if isinstance(value, torch.Tensor):
        sizes = tuple(value.shape) + tuple(value.stride()) + (value.storage_offset(),)
        if any(isinstance(s, torch.SymInt) for s in sizes):
            return None
        return f"T{tuple(value.shape)}{tuple(value.stride())}+{value.storage_offset()}{value.dtype}{value.device}"
    if isinstance(value, (list, tuple)):
        parts = [_value_text(v) for v in value]
        return None if any(p is None for p in parts) else "(" + ",".join(parts) + ")"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return None
    return type(value).__name__ if value is not None else "-"


def _argument_text(arg: object) -> str:
    if isinstance(arg, fx.Node):
        return "%" + arg.name
    if isinstance(arg, (list, tuple)):
        inner = ",".join(_argument_text(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, dict):
        return "{" + ",".join(f"{k}:{_argument_text(v)}" for k, v in arg.items()) + "}"
    return repr(arg)


def graph_text(gm: fx.GraphModule) -> str | None:
    """The graph as the planner reads it, as text; None if any size in it is symbolic."""
    lines = []
    for node in gm.graph.nodes:
        value = _value_text(node.meta.get("val", node.meta.get("example_value")))
        if value is None and node.op != "output":
            return None
        target = getattr(node.target, "__qualname__", None) or str(node.target)
        module = getattr(node.target, "__module__", "") if callable(node.target) else ""
        lines.append(f"{node.op} {node.name} {module}.{target} {_argument_text(node.args)} "
                     f"{_argument_text(node.kwargs)} {value} {node.meta.get('recompute')!r} "
                     f"{node.meta.get('ac_graph_id')!r}")
    return "\n".join(lines)


def outcome_key(joint: fx.GraphModule, *, num_fwd_outputs: int, static_lifetime_input_indices, options_text: str,
                request_text: str, environment_text: str) -> str | None:
    """The key of this planning; None where it must not be stored (symbolic sizes)."""
    text = graph_text(joint)
    if text is None:
        return None
    digest = hashlib.sha256()
    for part in (f"format {FORMAT}", text, f"outputs {num_fwd_outputs}", f"static {list(static_lifetime_input_indices or [])}",
                 options_text, request_text, environment_text):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def machine_text(device: str) -> str:
    """What of the machine the check reads: the CPU's ISA and threads, the accelerator."""
    parts = [platform.machine(), torch.backends.cpu.get_cpu_capability(), f"threads {torch.get_num_threads()}",
             "".join(onednn_max_cpu_isa_settings())]
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        parts += [torch.cuda.get_device_name(index), str(torch.cuda.get_device_capability(index)), str(torch.version.cuda)]
    return " ".join(parts)


def load(directory: str, key: str) -> StoredOutcome | None:
    stored = _load_any(directory, key)
    return stored if isinstance(stored, StoredOutcome) else None


# What unpickling a damaged, truncated or foreign record raises (a miss, never a failure).
_UNREADABLE = (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError, TypeError,
               ValueError, OSError)
_warned_folders: set[str] = set()


def _private(path: pathlib.Path) -> bool:
    """`path` (what a symbolic link points to) is this user's alone: owned by them, writable by no
    one else (always true where there are no POSIX owners)."""
    if not hasattr(os, "getuid"):
        return True
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _guarded_folders(directory: str, key: str) -> list[pathlib.Path]:
    """The folders a record's trust rests on, outermost first."""
    root = pathlib.Path(directory)
    folders = [root, root / key[:2]]
    if os.path.abspath(directory) == os.path.abspath(default_directory()):
        folders.insert(0, root.parent)  # memcompile_<user> in the shared temporary folder
    return folders


def _untrusted(folders: list[pathlib.Path]) -> pathlib.Path | None:
    """The first existing folder of `folders` another user could have written, if any."""
    for folder in folders:
        try:
            if not _private(folder):
                return folder
        except FileNotFoundError:
            return None
    return None


def _refuse(folder: pathlib.Path) -> None:
    if str(folder) not in _warned_folders:
        _warned_folders.add(str(folder))
        log.warning("memcompile: the plan store folder %s is not this user's alone (owner or permissions), so "
                    "plans are neither read from it nor written to it; remove it, or pass "
                    "memcompile.budget(..., plan_store=<a folder of your own>)", folder)


def _load_any(directory: str, key: str) -> object:
    folders = _guarded_folders(directory, key)
    path = folders[-1] / f"{key}.pkl"
    unsafe = _untrusted(folders + [path])
    if unsafe is not None:
        _refuse(unsafe)
        return None
    try:
        with path.open("rb") as f:
            stored = pickle.load(f)
    except FileNotFoundError:
        return None
    except _UNREADABLE as error:
        log.debug("memcompile: plan store entry %s unreadable (%s: %s)", path, type(error).__name__, error)
        return None
    return stored


def save(directory: str, key: str, outcome: "StoredOutcome | StoredLadder") -> None:
    folders = _guarded_folders(directory, key)
    folder = folders[-1]
    try:
        unsafe = _untrusted(folders)  # the existing ones, before anything is made in them
        if unsafe is None:
            for each in list(reversed(folders[0].parents)) + folders:
                if not each.exists():
                    each.mkdir(mode=0o700, exist_ok=True)
            unsafe = _untrusted(folders)  # one made by someone else in between
        if unsafe is not None:
            _refuse(unsafe)
            return
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(handle, "wb") as f:
            pickle.dump(outcome, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temporary, folder / f"{key}.pkl")
    except OSError as error:  # a read-only or full disk costs the next launch a plan, nothing else
        log.debug("memcompile: plan store not written (%s)", error)


@dataclass(frozen=True)
class StoredLadder:
    """Where a region's rewrite ladder ended: the rewrites applied, as (attribute, chunk limit,
    reason), and whether the compile that was kept searched its least peak."""

    moves: tuple[tuple[str, int | None, str], ...]
    searched_least_peak: bool


def save_ladder(directory: str, key: str, moves: tuple, searched_least_peak: bool) -> None:
    save(directory, key, StoredLadder(tuple(moves), searched_least_peak))


def load_ladder(directory: str, key: str) -> tuple[tuple, bool] | None:
    stored = _load_any(directory, key)
    return (stored.moves, stored.searched_least_peak) if isinstance(stored, StoredLadder) else None


def as_loaded(plan: Plan, graph_id: str) -> Plan:
    """The stored plan as this launch's: its graph's name here, no search or check time spent."""
    return dataclasses.replace(plan, graph_id=graph_id, solve_s=0.0, check_s=0.0, from_plan_store=True)
