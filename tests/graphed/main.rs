//! Graphed callables against eager execution, bitwise, and every refusal of the replay contract,
//! on the simulator under all scheduler policies and on CUDA.

#[path = "../common/mod.rs"]
mod common;

mod api;
mod contract;
mod edges;
mod equivalence;
mod fixtures;
mod grad_sync;
mod in_place;
mod lending;
mod misuse;
mod ranges;
mod release;
mod schedules;
mod sharing;

pub use api::*;
pub use contract::*;
pub use edges::*;
pub use equivalence::*;
pub use grad_sync::*;
pub use in_place::*;
pub use lending::*;
pub use misuse::*;
pub use ranges::*;
pub use release::*;
pub use schedules::*;
pub use sharing::*;

per_device!(
    stack_caller_matches_eager,
    stack_joined_matches_eager,
    stack_side_stream_matches_eager,
    stack_caller_matches_eager_in_bf16,
    stack_side_stream_matches_eager_in_bf16,
    stack_caller_matches_eager_in_fp8,
    stack_side_stream_matches_eager_in_fp8,
    stack_side_stream_matches_eager_in_fp8_e4m3_gradients,
    stack_side_stream_matches_eager_in_fp8_current,
    stack_side_stream_matches_eager_recomputing,
    stack_side_stream_matches_eager_recomputing_all,
    recomputing_lowers_the_pool_peak,
    lent_gradients_match_eager,
    lent_gradients_match_eager_on_a_side_stream_in_bf16,
    lent_gradients_lower_the_pool_peak,
    a_lent_output_refuses_reads_once_zeroed,
    lending_is_refused_where_it_cannot_work,
    pass_local_blocks_take_gradients_dead_for_their_pass,
    a_lending_stack_on_cudnn_matches_eager,
    a_lending_stack_warms_up_in_its_gradients,
    lent_gradients_refuse_a_step_out_of_order,
    a_pass_that_keeps_what_its_warmup_freed_is_refused,
    state_made_in_a_lending_warmup_is_refused,
    layers_unchained_match_eager,
    layers_read_in_place_match_eager,
    layers_read_in_place_match_eager_in_bf16,
    stack_read_in_place_matches_eager,
    gemm_operands_are_copied_in,
    a_copy_in_replay_after_an_in_place_one_reads_the_static_input,
    rebinding_happens_only_when_the_tensors_change,
    graphed_callables_draw_new_masks_every_microbatch,
    split_weight_gradient_matches_eager,
    stack_split_weight_gradient_matches_eager,
    training_and_inference_graphs_mix,
    hooks_run_in_order_outside_capture,
    post_warmup_runs_when_warmup_fails,
    warmup_gives_nonzero_gradients_back_bit_for_bit,
    the_warmups_backward_reads_its_forwards_output,
    failed_capture_changes_nothing,
    release_gives_the_pool_back,
    release_returns_fixed_and_expandable_segments,
    releasing_one_stack_leaves_another_working,
    static_tensors_held_across_release_keep_their_values,
    named_inputs_are_checked,
    unused_inputs_are_refused_unless_allowed,
    outputs_refuse_reads_after_overwrite,
    bad_arguments_are_refused,
    replay_choices_are_checked,
    tail_reading_static_input_is_refused,
    tail_writing_output_is_refused,
    event_recorded_twice_is_refused,
    external_wait_is_refused,
    an_edge_orders_a_consumer_on_another_stream,
    edges_order_callables_on_two_streams,
    without_the_edge_the_checker_sees_the_race,
    edge_misuse_is_refused,
    module_recording_the_sync_event_is_refused,
    side_stream_resumes_before_tail_ends,
    pool_order_is_enforced_across_calls,
    refused_replay_changes_nothing,
    refused_join_leaves_the_tails_pending,
    backward_dw_without_a_split_is_refused,
    misuse_refusals_change_nothing,
    all_forward_then_backward_matches_eager,
    interleaved_1f1b_matches_eager,
    one_f_one_b_matches_eager,
    transformer_engine_order_matches_eager,
    zero_bubble_with_split_weight_grads_matches_eager,
    split_weight_grads_without_their_steps_are_refused,
    grad_sync_is_told_each_callables_gradients_once_where_complete,
    out_of_schedule_replay_is_refused,
    schedule_outputs_refuse_stale_reads,
    schedule_shapes_are_checked,
    shared_outputs_lower_the_pool_peak_by_their_bytes,
    shared_outputs_change_no_result,
    stale_reads_of_shared_outputs_are_refused,
    later_captures_into_the_pool_count_as_writers_of_shared_outputs,
    chunk_handler_runs_once_per_chunk_in_schedule_order,
    ranges_name_every_pass_of_a_graphed_step,
    scheduled_replay_ranges_name_the_microbatch,
);
