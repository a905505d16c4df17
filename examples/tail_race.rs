//! The checker's worked example (README): a caller resumes at the event a graph records, then
//! overwrites an input that the graph's tail still reads. Prints the report, then the fixed run.
//!
//! `cargo run --example tail_race`

use graphed::check::Checker;
use graphed::device::{CaptureMode, Device};
use graphed::ops::elementwise::{fill, scale};

fn main() -> graphed::Result<()> {
    let dev = Device::sim();
    let (main, g) = (dev.stream()?, dev.stream()?);
    let (x, y, t) = (dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?);
    let (done, entry, joined) = (dev.event()?, dev.event()?, dev.event()?);

    let cap = g.capture(CaptureMode::ThreadLocal)?;
    scale(y.view(), x.view(), 2.0, &g)?;
    g.record_external(&done)?;
    scale(t.view(), x.view(), 10.0, &g)?; // the tail: runs after `done`
    let graph = cap.finish()?.instantiate()?;

    main.record(&entry)?;
    g.wait(&entry)?;
    graph.launch(&g)?;
    main.wait(&done)?; // the caller resumes before the tail is done
    fill(x.view(), 1.0, &main)?; // and overwrites what the tail still reads
    let checker = Checker::of(&dev).expect("the simulator is always checked");
    for h in checker.take_hazards() {
        println!("{h}");
    }

    g.record(&joined)?; // the fix: join the tail (R4) before touching its inputs
    main.wait(&joined)?;
    fill(x.view(), 2.0, &main)?;
    println!("after joining the tail: {} reports", checker.take_hazards().len());
    dev.synchronize()
}
