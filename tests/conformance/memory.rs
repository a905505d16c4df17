//! Buffers, copies, memset and kernel launches on one stream.

use anyhow::ensure;
use graphed::device::Device;
use graphed::memory::CachingAllocator;
use graphed::ops::elementwise;
use graphed::Error;

fn blocking_roundtrip(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let x = dev.alloc_from(&s, &data)?;
    ensure!(x.to_vec(&s)? == data);
    let empty = dev.alloc_from::<f32>(&s, &[])?;
    ensure!(empty.to_vec(&s)?.is_empty());
    Ok(())
}

fn async_copies_through_pinned_memory(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let n = 4096;
    let host_in = dev.alloc_pinned::<f32>(n)?;
    let host_out = dev.alloc_pinned::<f32>(n)?;
    let data: Vec<f32> = (0..n).map(|i| (i % 97) as f32).collect();
    host_in.write(&data)?;
    let (a, b) = (dev.alloc::<f32>(n)?, dev.alloc::<f32>(n)?);
    s.copy_h2d(host_in.view(), &a)?;
    s.copy_d2d(&a, &b)?;
    s.memset(a.slice(..10), 0)?;
    s.copy_d2h(&b, host_out.view())?;
    s.synchronize()?;
    ensure!(host_out.read()? == data, "h2d -> d2d -> d2h roundtrip changed the data");
    let a_now = a.to_vec(&s)?;
    ensure!(a_now[..10].iter().all(|v| *v == 0.0) && a_now[10..] == data[10..], "memset touched the wrong range");
    Ok(())
}

fn partial_copies_respect_offsets(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
    let y = dev.alloc_from(&s, &[0.0f32; 6])?;
    s.copy_d2d(x.slice(1..3), y.slice(4..))?;
    ensure!(y.to_vec(&s)? == vec![0.0, 0.0, 0.0, 0.0, 2.0, 3.0]);
    Ok(())
}

fn kernels_in_stream_order(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let n = 1000;
    let x = dev.alloc::<f32>(n)?;
    let y = dev.alloc::<f32>(n)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    for _ in 0..20 {
        elementwise::axpy(y.view(), x.view(), 0.5, &s)?;
        elementwise::add_scalar(x.view(), 1.0, &s)?;
    }
    // y = 0.5 * (1 + 2 + ... + 20) = 105, for every element.
    ensure!(y.to_vec(&s)?.iter().all(|v| *v == 105.0));
    Ok(())
}

fn strided_views_touch_only_their_elements(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    // A (4 x 6) matrix seen as 2 heads of width 3; scale head 1 only.
    let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let x = dev.alloc_from(&s, &data)?;
    let y = dev.alloc_from(&s, &[-1.0f32; 24])?;
    let head = |buf| graphed::device::DeviceBuffer::strided(buf, 3, &[(4, 6), (3, 1)]).expect("two dims");
    elementwise::scale_rows(head(&y), head(&x), 2.0, &s)?;
    let got = y.to_vec(&s)?;
    for (i, v) in got.iter().enumerate() {
        let want = if i % 6 >= 3 { 2.0 * i as f32 } else { -1.0 };
        ensure!(*v == want, "element {i}: {v} != {want}");
    }
    Ok(())
}

fn blocking_writes_land_before_later_work(dev: &Device) -> anyhow::Result<()> {
    // A regression test: a synchronous cuMemcpyHtoD from pageable memory returns before its DMA
    // lands, so a kernel enqueued next on a non-blocking stream could read the old bytes.
    let s = dev.stream()?;
    let n = if dev.kind() == graphed::device::DeviceKind::Cuda { 16 << 20 } else { 1 << 10 };
    let y = dev.alloc::<f32>(n)?;
    for step in 1..=3 {
        let x = dev.alloc_from(&s, &vec![step as f32; n])?;
        elementwise::scale(y.view(), x.view(), 1.0, &s)?;
        let got = y.to_vec(&s)?;
        ensure!(
            got.iter().all(|v| *v == step as f32),
            "step {step}: the kernel read bytes the write had not landed yet"
        );
    }
    Ok(())
}

/// More memory than the device has is a typed error that says how much was asked and how much
/// is free, on both devices (never an abort); the caching allocator reports it for its segment,
/// and the device works on after it.
fn allocation_beyond_the_device_memory_is_a_typed_error(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let too_much = 1usize << 41; // 2 TiB: more than any H200 or simulated device has
    match dev.alloc::<u8>(too_much) {
        Err(Error::OutOfMemory { requested, free: Some(free), total: Some(total), .. }) => {
            ensure!(requested == too_much && free <= total && total < too_much, "{requested} {free} {total}");
        }
        other => anyhow::bail!("a 2 TiB allocation: {:?}", other.map(|_| ())),
    }
    let alloc = CachingAllocator::new(dev);
    match alloc.alloc::<f32>(&s, too_much / 4) {
        Err(Error::OutOfMemory { op: "CachingAllocator::alloc", requested, .. }) if requested >= too_much => {}
        other => anyhow::bail!("a 2 TiB tensor: {:?}", other.map(|_| ())),
    }
    let x = alloc.alloc::<f32>(&s, 16)?;
    elementwise::fill(x.view(), 3.0, &s)?;
    ensure!(x.to_vec(&s)? == vec![3.0; 16], "the device works after the refusal");
    Ok(())
}

/// `Device::memory_info` counts a plain allocation (on CUDA at least its bytes: the driver
/// rounds up) and gives it back when it is dropped; the total does not move.
fn memory_info_follows_allocations(dev: &Device) -> anyhow::Result<()> {
    let bytes = 64 << 20;
    let (free, total) = dev.memory_info()?;
    ensure!(free <= total && total > 0, "free {free} of {total}");
    let buf = dev.alloc::<u8>(bytes)?;
    let (during, total_during) = dev.memory_info()?;
    ensure!(during + bytes <= free && total_during == total, "{free} free before, {during} with {bytes} allocated");
    drop(buf);
    dev.synchronize()?;
    let (after, _) = dev.memory_info()?;
    ensure!(after >= during + bytes, "{after} free after the drop, {during} during");
    Ok(())
}

/// An alias of another element type over a buffer's start is the same memory under its own id:
/// a kernel's write through it is read through the buffer, and one longer than the buffer is
/// refused.
fn an_alias_is_the_same_memory_under_its_own_id(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[0.0f32; 64])?;
    let half = x.aliased_as::<f32>(32)?;
    ensure!(half.id() != x.id() && half.len() == 32);
    elementwise::fill(half.view(), 2.5, &s)?;
    let back = x.to_vec(&s)?;
    ensure!(back[..32].iter().all(|v| *v == 2.5) && back[32..].iter().all(|v| *v == 0.0), "{back:?}");
    match x.aliased_as::<f32>(65) {
        Err(Error::LengthMismatch { .. }) => Ok(()),
        other => anyhow::bail!("an alias past the buffer's end: {:?}", other.map(|b| b.len())),
    }
}

crate::per_device!(
    an_alias_is_the_same_memory_under_its_own_id,
    memory_info_follows_allocations,
    allocation_beyond_the_device_memory_is_a_typed_error,
    blocking_writes_land_before_later_work,
    blocking_roundtrip,
    async_copies_through_pinned_memory,
    partial_copies_respect_offsets,
    kernels_in_stream_order,
    strided_views_touch_only_their_elements,
);
