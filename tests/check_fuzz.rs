//! Checker soundness by schedule fuzzing: a program whose results differ between schedules must have been reported.

use std::collections::HashMap;

use anyhow::Context;
use graphed::check::{Checker, Hazard, HazardKind};
use graphed::device::{Device, Policy, SimConfig};
use graphed::ops::elementwise;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

/// Elements per buffer.
const LEN: usize = 16;
/// Events a program may record and wait on.
const EVENTS: usize = 2;

/// One host call of a generated program; indices name the program's streams, buffers and events.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    /// `buf = value` on `stream`.
    Fill { stream: usize, buf: usize, value: f32 },
    /// `buf += c` on `stream`.
    AddScalar { stream: usize, buf: usize, c: f32 },
    /// `dst += a·src` on `stream`; `dst != src`.
    Axpy { stream: usize, dst: usize, src: usize, a: f32 },
    /// `stream.record(event)`.
    Record { stream: usize, event: usize },
    /// `stream.wait(event)` (possibly on a never-recorded event).
    Wait { stream: usize, event: usize },
}

/// A multi-stream program as plain data, so that it can be replayed on fresh devices.
#[derive(Debug, Clone, PartialEq)]
struct Program {
    streams: usize,
    buffers: usize,
    steps: Vec<Step>,
}

fn program_strategy() -> impl Strategy<Value = Program> {
    (2..=3usize, 2..=3usize).prop_flat_map(|(streams, buffers)| {
        let step = prop_oneof![
            3 => (0..streams, 0..buffers, 1..=9i32)
                .prop_map(|(stream, buf, v)| Step::Fill { stream, buf, value: v as f32 }),
            2 => (0..streams, 0..buffers, 1..=9i32)
                .prop_map(|(stream, buf, c)| Step::AddScalar { stream, buf, c: c as f32 }),
            3 => (0..streams, 0..buffers, 1..buffers, 1..=3i32).prop_map(move |(stream, dst, off, a)| Step::Axpy {
                stream,
                dst,
                src: (dst + off) % buffers,
                a: a as f32
            }),
            2 => (0..streams, 0..EVENTS).prop_map(|(stream, event)| Step::Record { stream, event }),
            2 => (0..streams, 0..EVENTS).prop_map(|(stream, event)| Step::Wait { stream, event }),
        ];
        prop::collection::vec(step, 4..=12).prop_map(move |steps| Program { streams, buffers, steps })
    })
}

/// What one run of a program gives: the buffers' final contents, and the checker's reports with
/// the run's ids replaced by the program's indices (so runs on different devices compare).
#[derive(Debug)]
struct Run {
    config: SimConfig,
    outputs: Vec<Vec<f32>>,
    hazards: Vec<(HazardKind, String)>,
}

impl Run {
    fn memory_hazards(&self) -> usize {
        self.hazards
            .iter()
            .filter(|(k, _)| {
                matches!(k, HazardKind::ReadAfterWrite | HazardKind::WriteAfterRead | HazardKind::WriteAfterWrite)
            })
            .count()
    }
}

/// `text` with every alphanumeric word found in `names` replaced by its name.
fn rename(text: &str, names: &HashMap<String, String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        out.push_str(names.get(word.as_str()).map_or(word.as_str(), String::as_str));
        word.clear();
    };
    for ch in text.chars() {
        if ch.is_ascii_alphanumeric() {
            word.push(ch);
        } else {
            flush(&mut word, &mut out);
            out.push(ch);
        }
    }
    flush(&mut word, &mut out);
    out
}

fn normalized(hazards: &[Hazard], names: &HashMap<String, String>) -> Vec<(HazardKind, String)> {
    hazards.iter().map(|h| (h.kind, rename(&h.to_string(), names))).collect()
}

/// Runs `program` on a fresh simulator under `config`, synchronizes and reads every buffer back.
fn run(program: &Program, config: SimConfig) -> anyhow::Result<Run> {
    let dev = Device::sim_with(config);
    let streams = (0..program.streams).map(|_| dev.stream()).collect::<graphed::Result<Vec<_>>>()?;
    let events = (0..EVENTS).map(|_| dev.event()).collect::<graphed::Result<Vec<_>>>()?;
    let buffers = (0..program.buffers)
        .map(|b| dev.alloc_from(&streams[0], &[b as f32 + 1.0; LEN]))
        .collect::<graphed::Result<Vec<_>>>()?;
    let mut names = HashMap::new();
    for (i, s) in streams.iter().enumerate() {
        names.insert(s.id().to_string(), format!("stream{i}"));
    }
    for (i, e) in events.iter().enumerate() {
        names.insert(e.id().to_string(), format!("event{i}"));
    }
    for (i, b) in buffers.iter().enumerate() {
        names.insert(b.id().to_string(), format!("buffer{i}"));
    }
    for step in &program.steps {
        match *step {
            Step::Fill { stream, buf, value } => elementwise::fill(buffers[buf].view(), value, &streams[stream])?,
            Step::AddScalar { stream, buf, c } => elementwise::add_scalar(buffers[buf].view(), c, &streams[stream])?,
            Step::Axpy { stream, dst, src, a } => {
                elementwise::axpy(buffers[dst].view(), buffers[src].view(), a, &streams[stream])?
            }
            Step::Record { stream, event } => streams[stream].record(&events[event])?,
            Step::Wait { stream, event } => streams[stream].wait(&events[event])?,
        }
    }
    dev.synchronize()?;
    let outputs = buffers.iter().map(|b| b.to_vec(&streams[0])).collect::<graphed::Result<Vec<_>>>()?;
    let hazards = Checker::of(&dev).context("the simulator is checked")?.hazards();
    Ok(Run { config, outputs, hazards: normalized(&hazards, &names) })
}

/// Every policy, and several seeds of the random one.
fn configs() -> Vec<SimConfig> {
    let mut configs = vec![SimConfig::with_policy(Policy::InOrder), SimConfig::with_policy(Policy::Adversarial)];
    configs.extend((0..6).map(|seed| SimConfig { policy: Policy::Random, seed, ..SimConfig::default() }));
    configs
}

fn runs(program: &Program) -> Vec<Run> {
    configs().into_iter().map(|c| run(program, c).unwrap_or_else(|e| panic!("{program:?} under {c:?}: {e}"))).collect()
}

fn outputs_differ(runs: &[Run]) -> bool {
    runs.iter().any(|r| r.outputs != runs[0].outputs)
}

/// The property: the checker's reports do not depend on the schedule, and a program whose results
/// do depend on it was reported to race in every run.
fn check_soundness(program: &Program) -> Result<(), TestCaseError> {
    let runs = runs(program);
    for r in &runs[1..] {
        prop_assert_eq!(
            &r.hazards,
            &runs[0].hazards,
            "the checker's reports depend on the schedule ({:?} vs {:?})",
            r.config,
            runs[0].config
        );
    }
    if outputs_differ(&runs) {
        for r in &runs {
            prop_assert!(
                r.memory_hazards() > 0,
                "results differ between schedules but {:?} reported no race:\n{:#?}\nhazards: {:#?}",
                r.config,
                runs.iter().map(|r| (r.config, &r.outputs)).collect::<Vec<_>>(),
                r.hazards
            );
        }
    }
    Ok(())
}

proptest! {
    // No regression files: this suite writes nothing into the source tree.
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::with_cases(64) })]

    #[test]
    fn schedule_dependent_results_are_reported(program in program_strategy()) {
        check_soundness(&program)?;
    }
}

/// The generator is not vacuous: among a fixed sample of programs, some really change results
/// between schedules (so the property above is exercised), and some are reported but happen to
/// give equal results.
#[test]
fn generated_programs_include_schedule_dependent_ones() {
    let mut runner = TestRunner::deterministic();
    let strategy = program_strategy();
    let (mut differing, mut reported) = (0, 0);
    for _ in 0..64 {
        let program = strategy.new_tree(&mut runner).expect("a program").current();
        let runs = runs(&program);
        differing += usize::from(outputs_differ(&runs));
        reported += usize::from(runs[0].memory_hazards() > 0);
    }
    assert!(differing > 0, "no sampled program exposed a race");
    assert!(reported >= differing, "{reported} reported, {differing} differing");
}

/// A producer on stream 0 fills buffer 0 and records event 0; a consumer on stream 1 reads it
/// into buffer 1, with or without waiting on the event.
fn producer_consumer(wait: bool) -> Program {
    let mut steps = vec![Step::Fill { stream: 0, buf: 0, value: 5.0 }, Step::Record { stream: 0, event: 0 }];
    if wait {
        steps.push(Step::Wait { stream: 1, event: 0 });
    }
    steps.push(Step::Axpy { stream: 1, dst: 1, src: 0, a: 2.0 });
    Program { streams: 2, buffers: 2, steps }
}

#[test]
fn known_race_differs_and_is_reported() {
    let racy = runs(&producer_consumer(false));
    assert!(outputs_differ(&racy), "the missing wait changes the consumer's result between schedules");
    let seen: Vec<f32> = racy.iter().map(|r| r.outputs[1][0]).collect();
    assert!(seen.contains(&12.0) && seen.contains(&4.0), "both orders occur: {seen:?}");
    for r in &racy {
        assert_eq!(r.memory_hazards(), 1, "{:?}: {:#?}", r.config, r.hazards);
        assert_eq!(r.hazards[0].0, HazardKind::ReadAfterWrite, "{:?}", r.hazards);
    }
    check_soundness(&producer_consumer(false)).unwrap();
}

#[test]
fn fixed_twin_is_equal_and_clean() {
    let fixed = runs(&producer_consumer(true));
    assert!(!outputs_differ(&fixed));
    assert_eq!(fixed[0].outputs[1], vec![12.0; LEN]);
    for r in &fixed {
        assert!(r.hazards.is_empty(), "{:?}: {:#?}", r.config, r.hazards);
    }
}
