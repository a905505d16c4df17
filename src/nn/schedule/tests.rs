use super::*;
use crate::{Error, Result};

fn kind(r: Result<Schedule>) -> ScheduleErrorKind {
    match r {
        Err(Error::Schedule(k)) => k,
        other => panic!("expected a schedule error, got {other:?}"),
    }
}

#[test]
fn transformer_engine_orders_round_trip() {
    let order = [1.0, 2.0, 1.0, 2.0, -2.0, -1.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0];
    let s = Schedule::from_te_order(&order).unwrap();
    assert_eq!((s.chunks(), s.microbatches(), s.to_te_order()), (2, 3, order.to_vec()));
    let w = Schedule::from_te_order(&[1.0, -1.0, -1.5, 1.0, -1.0, -1.5]).unwrap();
    assert!(w.splits_weight_grads());
    assert_eq!(w.with_microbatches()[5], (Step::WeightGrad(0), 1));
}

#[test]
fn every_inconsistency_is_refused() {
    assert!(matches!(kind(Schedule::from_te_order(&[])), ScheduleErrorKind::Empty));
    assert!(matches!(kind(Schedule::from_te_order(&[1.0, -1.25])), ScheduleErrorKind::BadEntry { index: 1, .. }));
    assert!(matches!(kind(Schedule::from_te_order(&[0.0])), ScheduleErrorKind::BadEntry { .. }));
    assert!(matches!(kind(Schedule::from_te_order(&[1.5])), ScheduleErrorKind::BadEntry { .. }));
    // Chunk 2 has one microbatch, chunk 1 two: the counts do not divide.
    let r = Schedule::from_te_order(&[1.0, 2.0, 1.0, -2.0, -1.0, -1.0]);
    assert!(matches!(kind(r), ScheduleErrorKind::Counts { chunk: 1, .. }));
    // A backward before its forward.
    assert!(matches!(kind(Schedule::from_te_order(&[-1.0, 1.0])), ScheduleErrorKind::Dependency { index: 0, .. }));
    // Chunk 2's forward before chunk 1's, and chunk 1's backward before chunk 2's.
    let r = Schedule::from_te_order(&[2.0, 1.0, -2.0, -1.0]);
    assert!(matches!(kind(r), ScheduleErrorKind::Dependency { index: 0, .. }));
    let r = Schedule::from_te_order(&[1.0, 2.0, -1.0, -2.0]);
    assert!(matches!(kind(r), ScheduleErrorKind::Dependency { index: 2, .. }));
    // Weight gradients that do not match the backwards, or come before them.
    let r = Schedule::from_te_order(&[1.0, 1.0, -1.0, -1.5, -1.0]);
    assert!(matches!(kind(r), ScheduleErrorKind::WeightGrads { chunk: 0, wgrads: 1, backwards: 2 }));
    let r = Schedule::from_te_order(&[1.0, -1.5, -1.0]);
    assert!(matches!(kind(r), ScheduleErrorKind::WeightGrads { .. }));
    let r = Schedule::from_te_order(&[1.0, -1.0, -2.5]);
    assert!(matches!(kind(r), ScheduleErrorKind::WeightGrads { chunk: 1, .. }));
    assert!(matches!(
        kind(Schedule::interleaved_1f1b(2, 2, 1, 4)),
        ScheduleErrorKind::RankOutsideStages { rank: 2, stages: 2 }
    ));
    assert!(matches!(
        kind(Schedule::interleaved_1f1b(2, 0, 2, 3)),
        ScheduleErrorKind::NotMultipleOfStages { microbatches: 3, stages: 2 }
    ));
    assert!(matches!(kind(Schedule::all_forward_then_backward(0, 2)), ScheduleErrorKind::Zero { name: "chunks" }));
    let stage = Stage::new(2, 2).err();
    assert!(matches!(stage, Some(Error::Schedule(ScheduleErrorKind::NoSuchStage { index: 2, count: 2 }))));
}

#[test]
fn a_forward_runs_its_chunks_layers_in_order_and_the_other_passes_last_first() {
    let order = |step: Step| step.layer_order(3..6).collect::<Vec<_>>();
    assert_eq!(order(Step::Forward(1)), [3, 4, 5]);
    assert_eq!(order(Step::Backward(1)), [5, 4, 3]);
    assert_eq!(order(Step::WeightGrad(1)), [5, 4, 3]);
}

#[test]
fn a_stage_holds_every_stages_th_chunk_of_the_model() {
    let stage = Stage::new(1, 2).unwrap();
    assert_eq!((stage.prev(), stage.next(), stage.model_chunk(1)), (0, 0, 3));
    assert_eq!(stage.model_layers(2, 2), vec![2, 3, 6, 7]);
    assert!(Stage::new(2, 2).is_err());
}

#[test]
fn builders_make_valid_schedules_of_their_shape() {
    for (p, v, m) in [(1, 1, 3), (1, 2, 4), (2, 2, 4), (4, 2, 8), (4, 1, 8), (2, 3, 6)] {
        for rank in 0..p {
            let s = Schedule::interleaved_1f1b(p, rank, v, m).unwrap();
            assert_eq!((s.chunks(), s.microbatches(), s.steps().len()), (v, m, 2 * v * m), "{p} {rank} {v} {m}");
        }
    }
    // 1F1B on the last rank alternates from the start; on the first it warms up p - 1.
    let last = Schedule::interleaved_1f1b(4, 3, 1, 4).unwrap();
    assert_eq!(last.steps()[..2], [Step::Forward(0), Step::Backward(0)]);
    let first = Schedule::interleaved_1f1b(4, 0, 1, 4).unwrap();
    assert!(first.steps()[..4].iter().all(|s| *s == Step::Forward(0)));
    let zb = Schedule::zero_bubble(2, 0, 4).unwrap();
    assert_eq!(zb.steps().len(), 12);
    assert!(zb.splits_weight_grads());
    let all = Schedule::all_forward_then_backward(2, 2).unwrap();
    assert_eq!(all.to_te_order(), vec![1.0, 2.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0]);
}
