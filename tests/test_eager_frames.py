"""What a failed frame conversion means (memcompile/eager_frames.py), over plain facts; and the
seam's reading of Dynamo's errors into them."""

from memcompile import eager_frames
from memcompile.eager_frames import ERROR_ALWAYS_RAISED, ERROR_OTHER, ERROR_SOFT, ConversionError


def test_soft_failures_run_eagerly_unless_dynamo_must_raise():
    assert eager_frames.runs_eagerly(ERROR_SOFT, raises_on_graph_break=False, suppress_errors=False)
    assert not eager_frames.runs_eagerly(ERROR_SOFT, raises_on_graph_break=True, suppress_errors=True)
    assert not eager_frames.runs_eagerly(ERROR_OTHER, raises_on_graph_break=False, suppress_errors=False)
    assert eager_frames.runs_eagerly(ERROR_OTHER, raises_on_graph_break=False, suppress_errors=True)
    assert not eager_frames.runs_eagerly(ERROR_ALWAYS_RAISED, raises_on_graph_break=False, suppress_errors=True)


def test_a_frame_is_named_by_its_graph_break_type_first_message_line_and_user_line():
    error = ConversionError(ERROR_SOFT, "Unsupported", "Data-dependent branching\n  details", "Graph break in loop",
                            "model.py:12")
    frame = eager_frames.eager_frame("forward", "model.py:3", error)
    assert frame == eager_frames.EagerFrame("forward", "model.py:3",
                                            "Graph break in loop: Data-dependent branching, at model.py:12")
    same = ConversionError(ERROR_SOFT, "Unsupported", "Graph break in loop", "Graph break in loop", None)
    assert eager_frames.eager_frame("f", "m.py:1", same).reason == "Graph break in loop"
    empty = ConversionError(ERROR_OTHER, "RuntimeError", "  ", None, None)
    assert eager_frames.eager_frame("f", "m.py:1", empty).reason == "RuntimeError"


def test_the_seam_reads_dynamos_error_types_into_kinds():
    from torch._dynamo import exc

    from memcompile._torch_private import dynamo

    assert dynamo._error_kind(exc.Unsupported("no")) == ERROR_SOFT
    assert dynamo._error_kind(exc.UserError(exc.UserErrorType.DYNAMIC_CONTROL_FLOW, "no")) == ERROR_SOFT
    assert dynamo._error_kind(exc.UncapturedHigherOrderOpError("no")) == ERROR_ALWAYS_RAISED
    assert dynamo._error_kind(RuntimeError("no")) == ERROR_OTHER
