"""Every private torch API memcompile touches, behind names of ours.

Tested against torch 2.13.0 only (pyproject pins <2.14). When torch moves one of these, this
package is the one place to change; tests/test_private_api_boundary.py fails if `torch._` is used
anywhere else in memcompile. One module per torch subsystem, each a thin layer of wrappers and
readers that turn torch's objects into plain facts; the decisions over those facts live in
memcompile/passes/ and plain modules. Callers import the package (`from memcompile import
_torch_private as tp`) and use the names below; a test that patches a name patches the module
whose code reads it (e.g. `inductor_hooks._planned_graph_now`).

  functorch        AOTAutograd, the joint graph and the stock partitioner
  tensors          fake and distributed tensors, ops as Dynamo records them
  inductor_hooks   memcompile's rules on Inductor's classes, scoped (inductor_rules)
  lowering         Inductor's compile and the lowering of a graph into its schedule
  scheduler_facts  Inductor's scheduler read into plain facts
  dynamo           tracing contexts, Dynamo's callbacks, the frames it converts
  profiler         allocator events and markers, the autograd engine's end of a backward
  cpu              this CPU's ISA, oneDNN, Inductor's configuration
"""

import torch

from memcompile._torch_private.cpu import (
    cpu_flash_attention_isa, inductor_config_text, inductor_lays_out_cpu_convolutions_channels_last,
    onednn_runs_cpu_matmuls_in)
from memcompile._torch_private.dynamo import (
    EagerFrame, before_each_frame_conversion, compiling_frame_arguments, current_tracing_context,
    autograd_sequence_number, graph_ends_at_graph_break, graph_input_ids, module_stack, reentered_tracing_context,
    reset_dynamo, watch_dynamo_compiles, watch_eager_frames)
from memcompile._torch_private.functorch import (
    PartitionerBase, aot_settings, classify_joint_nodes, compile_with_aot_eager, extract_forward_backward,
    inductor_decompositions, is_primal, is_sym_node, is_tangent, must_recompute_tag, node_nbytes,
    prepare_joint_graph, static_lifetime_nodes, stock_partition)
from memcompile._torch_private.inductor_hooks import (
    PLANNED_GRAPH, PLANNED_RULES, RECOMPUTED, InductorRules, inductor_rules, mark_planned, mark_recomputed)
from memcompile._torch_private.lowering import (
    CompiledSchedule, compile_with_inductor, inductor_lowering_facts, inductor_post_grad_copy, inductor_schedule)
from memcompile._torch_private.profiler import (
    after_backward_returns, call_when_backward_ends, profiler_allocation_deltas, profiler_mark, profiler_mark_times,
    profiler_running, release_profile, start_memory_profile, stop_memory_profile)
from memcompile._torch_private.tensors import (
    example_value_of, gelu_ops, is_distributed_tensor, is_fake_tensor, is_inductor_random_op, linear_ops,
    outside_tracing_modes, silu_ops)

TORCH_VERSION = torch.__version__

__all__ = [
    "TORCH_VERSION",
    # functorch
    "PartitionerBase", "aot_settings", "classify_joint_nodes", "compile_with_aot_eager", "extract_forward_backward",
    "inductor_decompositions", "is_primal", "is_sym_node", "is_tangent", "must_recompute_tag", "node_nbytes",
    "prepare_joint_graph", "static_lifetime_nodes", "stock_partition",
    # tensors
    "example_value_of", "gelu_ops", "is_distributed_tensor", "is_fake_tensor", "is_inductor_random_op", "linear_ops",
    "outside_tracing_modes", "silu_ops",
    # inductor_hooks
    "PLANNED_GRAPH", "PLANNED_RULES", "RECOMPUTED", "InductorRules", "inductor_rules", "mark_planned",
    "mark_recomputed",
    # lowering
    "CompiledSchedule", "compile_with_inductor", "inductor_lowering_facts", "inductor_post_grad_copy",
    "inductor_schedule",
    # dynamo
    "EagerFrame", "autograd_sequence_number", "before_each_frame_conversion", "compiling_frame_arguments",
    "current_tracing_context", "graph_ends_at_graph_break", "graph_input_ids", "module_stack",
    "reentered_tracing_context", "reset_dynamo",
    "watch_dynamo_compiles", "watch_eager_frames",
    # profiler
    "after_backward_returns", "call_when_backward_ends", "profiler_allocation_deltas", "profiler_mark",
    "profiler_mark_times", "profiler_running", "release_profile", "start_memory_profile", "stop_memory_profile",
    # cpu
    "cpu_flash_attention_isa", "inductor_config_text", "inductor_lays_out_cpu_convolutions_channels_last",
    "onednn_runs_cpu_matmuls_in",
]
