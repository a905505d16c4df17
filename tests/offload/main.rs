//! Activation offloading: eager and graphed runs with and without it, bit for bit; the memory it
//! saves; the hazards of `notes/offload.md` §3.6 planted and caught; a stress test; and the
//! policy, on the simulator under all scheduler policies and on CUDA.

#[path = "../common/mod.rs"]
mod common;

mod equivalence;
mod fixtures;
mod hazards;
mod policy;
mod stress;
mod warmup;

pub use equivalence::*;
pub use hazards::*;
pub use stress::*;
pub use warmup::*;

per_device!(
    eager_offload_is_bitwise_eager,
    candidates_that_select_nothing_are_skipped,
    eager_offload_is_bitwise_eager_in_bf16,
    eager_offload_is_bitwise_eager_unfused,
    graphed_offload_on_caller_matches,
    graphed_offload_joined_matches,
    graphed_offload_side_stream_matches,
    graphed_offload_side_stream_matches_in_bf16,
    graphed_offload_with_lent_gradients_matches,
    whole_stack_graph_with_offload_matches,
    graphed_offload_switches_to_resident_and_back,
    switching_again_reuses_the_memory_given_back,
    switchable_capture_reserves_only_its_scratch,
    peak_memory_falls_by_the_offloaded_bytes,
    lent_peak_falls_by_the_expected_saving,
    h1_side_replay_without_sync_event_is_refused,
    h3_unjoined_copies_fail_the_capture,
    h4_wait_outside_capture_fails_the_capture,
    h5_copy_back_and_use_in_one_graph_are_joined,
    h6_graphs_of_one_pool_on_two_streams_are_refused,
    h7_release_before_copy_is_caught,
    h8_host_buffer_reused_before_copy_back_is_caught,
    h9_copy_back_before_copy_out_is_caught,
    h9_use_before_copy_back_is_caught,
    h11_delayed_copies_are_flushed_or_reported,
    h13_schedule_changes_are_refused,
    h14_graphs_outlive_their_manager,
    h17_failed_warmup_turns_offloading_back_on,
    random_delays_and_sizes_change_nothing,
    capture_peak_grows_by_less_than_each_layers_activations,
    auto_policy_windows_come_from_graph_replays,
    the_probe_of_a_lending_stack_borrows_the_gradients,
);
