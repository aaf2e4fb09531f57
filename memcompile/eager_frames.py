"""Frames Dynamo gives up on: whether a failed frame conversion runs the frame eagerly, and how
memcompile names it, decided over plain facts the seam reads off Dynamo's error
(memcompile/_torch_private/dynamo.py watch_eager_frames)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EagerFrame:
    """A frame Dynamo failed to compile and is about to run eagerly, uncompiled."""

    name: str  # the function
    location: str  # file:first line
    reason: str  # Dynamo's one-line reason (its graph-break type, or the error's first line)


# Kinds of error a frame conversion raised, as the seam reads them off Dynamo's exception types.
ERROR_SOFT = "soft"  # unsupported code, a user error (exc.Unsupported, exc.UserError)
# Errors Dynamo raises even where it would run the frame eagerly otherwise (a resumed frame's
# prologue, a higher-order op it could not capture: exc.ResumePrologueTracingError,
# exc.UncapturedHigherOrderOpError, the latter an Unsupported too)
ERROR_ALWAYS_RAISED = "always_raised"
ERROR_OTHER = "other"  # anything else (Dynamo's own bugs, a backend's error)


@dataclass(frozen=True)
class ConversionError:
    """The error a frame conversion raised, as plain facts."""

    kind: str  # ERROR_*
    type_name: str  # its class's name
    message: str  # its message (Dynamo's `msg` where it has one)
    graph_break_type: str | None  # Dynamo's graph-break type (gb_type), where it records one
    # "file:line" of the user's code it happened at (the innermost frame of Dynamo's real_stack)
    user_line: str | None


def runs_eagerly(kind: str, raises_on_graph_break: bool, suppress_errors: bool) -> bool:
    """What torch/_dynamo/convert_frame.py ConvertFrame.__call__ does with a failed conversion
    that raised an error of `kind`: soft failures, or every error under Dynamo's
    `suppress_errors`, run the frame eagerly; fullgraph / export conversions and
    error_on_graph_break (`raises_on_graph_break`) raise."""
    if raises_on_graph_break or kind == ERROR_ALWAYS_RAISED:
        return False
    return kind == ERROR_SOFT or suppress_errors


def eager_frame(function: str, location: str, error: ConversionError) -> EagerFrame:
    """The frame, named by Dynamo's graph-break type; where one graph break led to another (a
    break inside a loop), the first one's too, and the user's line it happened at."""
    first_line = (error.message.strip().splitlines() or [error.type_name])[0]
    kind = error.graph_break_type or first_line
    reason = kind if first_line in (kind, "") else f"{kind}: {first_line}"
    if error.user_line:
        reason += f", at {error.user_line}"
    return EagerFrame(function, location, reason)
