"""Dynamo: the tracing context of a compile, its reset and compile callbacks, the graphs it hands a
backend, and the frames it converts (and those it gives up on, decided in memcompile/eager_frames.py)."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from typing import Any, Callable

import torch
import torch.fx as fx

from memcompile import eager_frames
from memcompile.eager_frames import EagerFrame

def current_tracing_context() -> Any:
    """Dynamo's tracing context of the graph being compiled (fake mode, shape env), or None."""
    return torch._guards.TracingContext.try_get()


@contextlib.contextmanager
def reentered_tracing_context(context: Any):
    """Compile again, after Dynamo returned, in the tracing context a graph was first compiled in:
    AOTAutograd then reuses its fake mode and symbolic sizes instead of specialising."""
    if context is None:
        yield
        return
    if getattr(context, "ddp_optimizer_ctx", None) is not None:
        # DDPOptimizer counts one forward compile per piece and pairs each lazily compiled
        # backward with the next piece's metadata; a re-plan is none of its pieces, so it gets a
        # copy without that count (its lazy backward then reads its own fw_metadata).
        context = copy.copy(context)
        context.ddp_optimizer_ctx = None
    with torch._guards.tracing(context):
        yield


def reset_dynamo() -> None:
    torch._dynamo.reset()


def watch_dynamo_compiles(started: Callable[[], None], ended: Callable[[], None]) -> Callable[[], None]:
    """Call `started` / `ended` around each Dynamo compile (of any frame) until the returned
    function is called, which removes them."""
    handler = torch._dynamo.callback_handler

    def on_start(_args):
        started()

    def on_end(_args):
        ended()

    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)

    def remove() -> None:
        # torch._dynamo.reset() may have cleared them already
        if on_start in handler.start_callbacks:
            handler.remove_start_callback(on_start)
        if on_end in handler.end_callbacks:
            handler.remove_end_callback(on_end)

    return remove


# The arguments of the frame Dynamo is converting (while its graphs are compiled), or None.
_FRAME_ARGUMENTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("memcompile_frame_arguments",
                                                                               default=None)


def compiling_frame_arguments() -> dict:
    """The local variables (arguments) of the frame whose graphs are being compiled: a backend
    called by Dynamo sees the module (`self`) and inputs the frame was called with. Empty
    outside a Dynamo compile watched by watch_eager_frames."""
    return _FRAME_ARGUMENTS.get() or {}


def graph_ends_at_graph_break(gm: fx.GraphModule) -> bool:
    """Dynamo compiled this graph at a graph break: the frame goes on after it (more graphs, or
    eager code) before it returns."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))


def module_stack(node: fx.Node) -> tuple[str, ...]:
    """The modules (and inlined functions) whose code made `node`, outermost first, as Dynamo
    spells their paths ("L['self'].layers.3", "L['self'].layers.3.mlp"); empty where Dynamo
    recorded none (backward nodes, decompositions added after the trace)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ()
    return tuple(entry[0] for entry in stack.values()
                 if isinstance(entry, tuple) and entry and isinstance(entry[0], str))


def autograd_sequence_number(node: fx.Node) -> int | None:
    """The autograd sequence number AOTAutograd recorded on a joint graph node: a backward node
    carries that of the forward op it differentiates."""
    seq = node.meta.get("seq_nr")
    return seq if isinstance(seq, int) else None


def graph_input_ids(gm: fx.GraphModule) -> frozenset[int]:
    """id() of the real tensors Dynamo lifted as this graph's inputs (parameters, buffers, the
    frame's tensors), as it recorded them at capture."""
    ids = set()
    for node in gm.graph.nodes:
        arg = node.meta.get("grapharg") if node.op == "placeholder" else None
        try:
            example = arg.example if arg is not None else None  # a weak reference Dynamo keeps
        except AssertionError:  # GraphArg.example: its weak reference expired (the tensor is gone)
            example = None
        if isinstance(example, torch.Tensor):
            ids.add(id(example))
    return frozenset(ids)


# watcher(backend, torch.compile options, frame, the frame's arguments) -> None, or raises
_EAGER_FRAME_WATCHERS: list[Callable[[Any, dict, EagerFrame, dict], None]] = []


def watch_eager_frames(watcher: Callable[[Any, dict, EagerFrame, dict], None]) -> None:
    """Call `watcher` for every frame Dynamo is about to run eagerly after failing to compile it
    (a graph break inside a loop skips the whole frame, unsupported code, the recompile limit),
    with the innermost backend the frame was compiled with and torch.compile's options for it.
    An exception the watcher raises reaches the caller of the compiled function unchanged
    instead. Where Dynamo raises anyway (fullgraph=True, error_on_graph_break) it is not called.

    The user's torch.compile runs outside any memcompile code and, for a skipped frame, never
    calls the backend, so this is the one place to notice: Dynamo's frame conversion is wrapped
    once per process, a pass-through for every frame that compiles and for every watcher that
    ignores other backends."""
    if watcher in _EAGER_FRAME_WATCHERS:
        return
    _EAGER_FRAME_WATCHERS.append(watcher)
    _watch_frame_conversions()


# hook() -> None, called before Dynamo converts any frame
_BEFORE_FRAME_CONVERSION: list[Callable[[], None]] = []


def before_each_frame_conversion(hook: Callable[[], None]) -> None:
    """Call `hook()` before Dynamo converts (traces, compiles) any frame in this process. Unlike
    Dynamo's compile callbacks, torch._dynamo.reset() does not remove it."""
    if hook not in _BEFORE_FRAME_CONVERSION:
        _BEFORE_FRAME_CONVERSION.append(hook)
    _watch_frame_conversions()


def _watch_frame_conversions() -> None:
    from torch._dynamo import convert_frame

    convert = convert_frame.ConvertFrameAssert
    if getattr(convert.__call__, "_memcompile_watched", False):
        return
    original = convert.__call__

    @functools.wraps(original)
    def watched(self, frame, *args, **kwargs):
        for hook in list(_BEFORE_FRAME_CONVERSION):
            hook()
        arguments = dict(frame.f_locals)
        token = _FRAME_ARGUMENTS.set(arguments)
        try:
            return original(self, frame, *args, **kwargs)
        except Exception as error:
            if eager_frames.runs_eagerly(_error_kind(error), _raises_on_graph_break(self), _suppress_errors()):
                backend, options = _innermost_backend(self._torchdynamo_orig_backend)
                code = frame.f_code
                record = eager_frames.eager_frame(code.co_name, f"{code.co_filename}:{code.co_firstlineno}",
                                                  _conversion_error(error))
                for each in list(_EAGER_FRAME_WATCHERS):
                    each(backend, options, record, arguments)
            raise
        finally:
            _FRAME_ARGUMENTS.reset(token)

    watched._memcompile_watched = True
    convert.__call__ = watched


def _innermost_backend(fn: Any) -> tuple[Any, dict]:
    """The user's backend under Dynamo's wrappers (its debug wrapper, DDPOptimizer, the
    torch.compile wrapper), and the options torch.compile passes it."""
    for _ in range(8):
        owner = getattr(fn, "__self__", None)
        if owner is not None and hasattr(owner, "backend_compile_fn"):  # DDPOptimizer.compile_fn
            fn = owner.backend_compile_fn
        elif hasattr(fn, "_torchdynamo_orig_backend"):  # WrapBackendDebug
            fn = fn._torchdynamo_orig_backend
        elif hasattr(fn, "compiler_fn") and isinstance(getattr(fn, "kwargs", None), dict):  # _TorchCompileWrapper
            return fn.compiler_fn, dict(fn.kwargs.get("options") or {})
        else:
            break
    return fn, {}


def _raises_on_graph_break(convert: Any) -> bool:
    """fullgraph=True, an export, or error_on_graph_break: Dynamo raises rather than run eagerly."""
    return bool(convert._one_graph or convert._export or convert._box.error_on_graph_break)


def _suppress_errors() -> bool:
    from torch._dynamo import config as dynamo_config

    return bool(dynamo_config.suppress_errors)


def _error_kind(error: Exception) -> str:
    """eager_frames.ERROR_* of a failed conversion's error, by Dynamo's exception types (the
    always-raised ones first: UncapturedHigherOrderOpError is an Unsupported too)."""
    from torch._dynamo import exc

    if isinstance(error, (exc.ResumePrologueTracingError, exc.UncapturedHigherOrderOpError)):
        return eager_frames.ERROR_ALWAYS_RAISED
    if isinstance(error, (exc.Unsupported, exc.UserError)):
        return eager_frames.ERROR_SOFT
    return eager_frames.ERROR_OTHER


def _conversion_error(error: Exception) -> eager_frames.ConversionError:
    """The facts memcompile names an eager frame by: Dynamo's graph-break type, the message, and
    the user's line of the innermost frame Dynamo was tracing (its real_stack)."""
    stack = getattr(error, "real_stack", None)
    user_line = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else None
    return eager_frames.ConversionError(_error_kind(error), type(error).__name__, str(getattr(error, "msg", error)),
                                        getattr(error, "gb_type", None), user_line)
