//! The simulator's scheduler: deferred work under each policy really exposes missing waits.

use graphed::device::{CaptureMode, Device, Policy, SimConfig};
use graphed::ops::elementwise;

/// A producer fills `x` on one stream and a consumer copies it on another. With `join` the
/// consumer waits on an event; without, it races. Returns what the consumer saw.
fn producer_consumer(dev: &Device, join: bool) -> graphed::Result<Vec<f32>> {
    let (producer, consumer) = (dev.stream()?, dev.stream()?);
    let (x, y) = (dev.alloc::<f32>(8)?, dev.alloc::<f32>(8)?);
    let ready = dev.event()?;
    elementwise::fill(x.view(), 1.0, &producer)?;
    producer.record(&ready)?;
    if join {
        consumer.wait(&ready)?;
    }
    elementwise::scale(y.view(), x.view(), 1.0, &consumer)?;
    dev.synchronize()?;
    y.to_vec(&consumer)
}

#[test]
fn missing_wait_corrupts_under_the_adversarial_policy() {
    let dev = Device::sim_with(SimConfig::with_policy(Policy::Adversarial));
    assert_eq!(producer_consumer(&dev, false).unwrap(), vec![0.0; 8], "the consumer ran before the producer");
    assert_eq!(producer_consumer(&dev, true).unwrap(), vec![1.0; 8]);
}

#[test]
fn issue_order_hides_the_race_and_random_seeds_find_it() {
    let in_order = Device::sim_with(SimConfig::with_policy(Policy::InOrder));
    assert_eq!(producer_consumer(&in_order, false).unwrap(), vec![1.0; 8]);
    let outcomes: Vec<Vec<f32>> = (0..32)
        .map(|seed| {
            producer_consumer(
                &Device::sim_with(SimConfig { policy: Policy::Random, seed, ..SimConfig::default() }),
                false,
            )
            .unwrap()
        })
        .collect();
    assert!(outcomes.contains(&vec![0.0; 8]) && outcomes.contains(&vec![1.0; 8]), "random seeds give both orders");
}

#[test]
fn a_seed_gives_one_schedule() {
    let run = |seed| {
        let dev = Device::sim_with(SimConfig { policy: Policy::Random, seed, ..SimConfig::default() });
        (0..16).map(|_| producer_consumer(&dev, false).unwrap()[0]).collect::<Vec<_>>()
    };
    assert_eq!(run(7), run(7));
}

#[test]
fn writer_without_wait_overwrites_before_an_earlier_reader() {
    // Write-after-read: the reader on `a` is enqueued first, the writer on `b` does not wait for
    // it. Adversarially the writer runs first and the reader sees the new value.
    let dev = Device::sim_with(SimConfig::with_policy(Policy::Adversarial));
    let (a, b) = (dev.stream().unwrap(), dev.stream().unwrap());
    let x = dev.alloc_from(&a, &[1.0f32; 4]).unwrap();
    let y = dev.alloc::<f32>(4).unwrap();
    elementwise::scale(y.view(), x.view(), 1.0, &a).unwrap();
    elementwise::fill(x.view(), 9.0, &b).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(y.to_vec(&a).unwrap(), vec![9.0; 4]);
}

#[test]
fn wait_issued_before_a_rerecord_keeps_the_old_record() {
    // The consumer's wait binds to the first record, so the producer's second fill is not among
    // what the consumer needs: synchronizing the consumer alone runs it without that fill.
    let dev = Device::sim_with(SimConfig::with_policy(Policy::Adversarial));
    let (producer, consumer) = (dev.stream().unwrap(), dev.stream().unwrap());
    let e = dev.event().unwrap();
    let (x, y) = (dev.alloc::<f32>(4).unwrap(), dev.alloc::<f32>(4).unwrap());
    elementwise::fill(x.view(), 1.0, &producer).unwrap();
    producer.record(&e).unwrap();
    consumer.wait(&e).unwrap();
    elementwise::fill(x.view(), 2.0, &producer).unwrap();
    producer.record(&e).unwrap();
    elementwise::scale(y.view(), x.view(), 1.0, &consumer).unwrap();
    assert_eq!(y.to_vec(&consumer).unwrap(), vec![1.0; 4]);
}

#[test]
fn caller_that_skips_the_graph_event_reads_stale_outputs() {
    // The upstream bug this project exists for: replay on a side stream and a caller that does
    // not wait on the in-graph event read outputs before the graph wrote them.
    let dev = Device::sim_with(SimConfig::with_policy(Policy::Adversarial));
    let (main, side) = (dev.stream().unwrap(), dev.stream().unwrap());
    let (x, y) = (dev.alloc_from(&main, &[3.0f32; 4]).unwrap(), dev.alloc::<f32>(4).unwrap());
    let done = dev.event().unwrap();
    let cap = side.capture(CaptureMode::ThreadLocal).unwrap();
    elementwise::scale(y.view(), x.view(), 2.0, &side).unwrap();
    side.record_external(&done).unwrap();
    let exec = cap.finish().unwrap().instantiate().unwrap();
    let never_recorded = dev.event().unwrap();
    exec.launch(&side).unwrap();
    main.wait(&never_recorded).unwrap();
    assert_eq!(y.to_vec(&main).unwrap(), vec![0.0; 4], "waiting on the wrong event is a no-op");
    main.wait(&done).unwrap();
    assert_eq!(y.to_vec(&main).unwrap(), vec![6.0; 4]);
}

#[test]
fn a_failing_kernel_is_reported_by_the_next_synchronize() {
    use graphed::device::{args, CpuArgs, In, Kernel, LaunchDims, Out};
    fn wrong_type(a: &CpuArgs) -> graphed::Result<()> {
        a.input::<u32>("x").map(|_| ())
    }
    static BAD: Kernel =
        Kernel { name: "reads_f32_as_u32", source: "", params: &["y", "x"], cpu: wrong_type, strided: false };
    let dev = Device::sim();
    let s = dev.stream().unwrap();
    let (x, y) = (dev.alloc::<f32>(2).unwrap(), dev.alloc::<f32>(2).unwrap());
    s.launch(&BAD, LaunchDims::for_elems(2), &args![Out(&y), In(&x)]).unwrap();
    let err = s.synchronize().unwrap_err();
    assert!(matches!(err, graphed::Error::KernelFailed { kernel: "reads_f32_as_u32", .. }), "{err}");
    assert!(err.to_string().contains("argument `x` is a Read f32 buffer"), "{err}");
    s.synchronize().unwrap();
}
