//! Bad input: objects of another device, views out of bounds, mismatched lengths.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device};
use graphed::ops::elementwise;
use graphed::Error;

fn objects_of_another_device_are_refused(dev: &Device) -> anyhow::Result<()> {
    let other = Device::sim();
    let s = dev.stream()?;
    let foreign_stream = other.stream()?;
    let foreign_event = other.event()?;
    let foreign_buf = other.alloc::<f32>(4)?;
    let mine = dev.alloc::<f32>(4)?;
    let wrong = |r: graphed::Result<()>| matches!(r, Err(Error::WrongDevice { .. }));
    ensure!(wrong(s.record(&foreign_event)));
    ensure!(wrong(s.wait(&foreign_event)));
    ensure!(wrong(elementwise::fill(foreign_buf.view(), 1.0, &s)));
    ensure!(wrong(s.copy_d2d(&mine, &foreign_buf)));
    ensure!(wrong(mine.to_vec(&foreign_stream).map(|_| ())));
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(mine.view(), 1.0, &s)?;
    let exec = cap.finish()?.instantiate()?;
    ensure!(wrong(exec.launch(&foreign_stream)));
    ensure!(wrong(exec.upload(&foreign_stream)));
    let msg = exec.launch(&foreign_stream).unwrap_err().to_string();
    ensure!(msg.contains("create it from the same Device"), "the error says what to do: {msg}");
    Ok(())
}

fn views_outside_their_buffer_are_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(10)?;
    let y = dev.alloc::<f32>(10)?;
    ensure!(matches!(
        elementwise::fill(x.slice(5..12), 1.0, &s),
        Err(Error::OutOfBounds { start: 5, end: 12, len: 10, .. })
    ));
    let strided = x.strided(0, &[(4, 3), (2, 1)]).expect("two dims");
    ensure!(matches!(elementwise::fill(strided, 1.0, &s), Err(Error::OutOfBounds { end: 11, .. })));
    ensure!(matches!(s.copy_d2d(x.slice(..4), y.slice(..5)), Err(Error::LengthMismatch { src: 4, dst: 5, .. })));
    ensure!(matches!(
        s.memset(x.strided(0, &[(2, 4), (2, 1)]).expect("two dims"), 0),
        Err(Error::NotContiguous { .. })
    ));
    ensure!(matches!(x.write_from(&s, &[1.0; 3]), Err(Error::LengthMismatch { .. })));
    ensure!(x.to_vec(&s)? == vec![0.0; 10] || dev.kind() == graphed::device::DeviceKind::Cuda, "nothing was enqueued");
    Ok(())
}

crate::per_device!(objects_of_another_device_are_refused, views_outside_their_buffer_are_refused);
