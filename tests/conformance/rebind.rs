//! Patched replays: an executable rebound to other buffers reads them in place, bit for bit as a
//! replay that copies them in, and a rebind it cannot do is refused with nothing changed.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, Gemm, GraphExec, Rebind, RebindErrorKind, Stream};
use graphed::ops::elementwise;
use graphed::Error;

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| seed + (i as f32 * 0.37).sin()).collect()
}

fn refusal(e: Error) -> anyhow::Result<RebindErrorKind> {
    match e {
        Error::Rebind { kind, .. } => Ok(kind),
        other => anyhow::bail!("expected a rebind refusal, got {other}"),
    }
}

/// Two kernels and a copy read `x`: rebound, they read `other`, and the results equal those of
/// a second executable of the same graph into whose `x` the same values were copied.
fn rebound_reads_equal_a_copy_in_replay(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 1000;
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &values(N, 1.0))?;
    let (y, z) = (dev.alloc::<f32>(N)?, dev.alloc_from(&s, &vec![0.5f32; N])?);
    let host = dev.alloc_pinned::<f32>(N)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.view(), 3.0, &s)?;
    elementwise::axpy(z.view(), x.view(), -1.0, &s)?;
    s.copy_d2h(x.view(), host.view())?;
    let graph = cap.finish()?;
    let (patched, copied) = (graph.instantiate()?, graph.instantiate()?);

    let other = dev.alloc_from(&s, &values(N, -4.0))?;
    ensure!(patched.rebind(&[Rebind::new(x.view(), other.view())?])? == 3, "three nodes read x");
    ensure!(patched.rebind(&[Rebind::new(x.view(), other.view())?])? == 0, "already there: no driver call");
    let run = |exec: &GraphExec, s: &Stream| -> anyhow::Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        z.write_from(s, &[0.5f32; N])?;
        exec.launch(s)?;
        s.synchronize()?;
        Ok((y.to_vec(s)?, z.to_vec(s)?, host.read()?))
    };
    let in_place = run(&patched, &s)?;
    ensure!(x.to_vec(&s)? == values(N, 1.0), "the captured buffer is not read or written");
    s.copy_d2d(other.view(), x.view())?;
    let copied_in = run(&copied, &s)?;
    ensure!(in_place == copied_in, "a rebound replay equals a copy-in replay bit for bit");
    ensure!(in_place.0[7] == 3.0 * values(N, -4.0)[7]);

    // Back where it was captured.
    x.write_from(&s, &values(N, 2.0))?;
    ensure!(patched.rebind(&[Rebind::new(x.view(), x.view())?])? == 3);
    let back = run(&patched, &s)?;
    ensure!(back.0[7] == 3.0 * values(N, 2.0)[7], "rebound back, it reads x again");
    Ok(())
}

/// A view at an offset moves with its offset, and the executable keeps the buffer it reads after
/// the caller dropped its handle.
fn a_view_moves_with_its_offset_and_is_held(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &values(64, 0.0))?;
    let y = dev.alloc::<f32>(32)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.slice(16..48), 1.0, &s)?;
    let exec = cap.finish()?.instantiate()?;
    let big = dev.alloc_from(&s, &values(256, 10.0))?;
    exec.rebind(&[Rebind::new(x.view(), big.slice(100..164))?])?;
    drop(big);
    let _churn = dev.alloc_from(&s, &vec![-1.0f32; 256])?;
    exec.launch(&s)?;
    ensure!(y.to_vec(&s)? == values(256, 10.0)[116..148].to_vec(), "elements 16..48 of the rebound view");
    Ok(())
}

/// A launch already queued reads what it was launched with; the rebind changes later launches.
fn queued_launches_keep_their_buffers(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (a, b) = (dev.alloc_from(&s, &vec![1.0f32; 4096])?, dev.alloc_from(&s, &vec![100.0f32; 4096])?);
    let acc = dev.alloc_from(&s, &vec![0.0f32; 4096])?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::axpy(acc.view(), a.view(), 1.0, &s)?;
    let exec = cap.finish()?.instantiate()?;
    exec.launch(&s)?;
    exec.rebind(&[Rebind::new(a.view(), b.view())?])?;
    exec.launch(&s)?;
    ensure!(acc.to_vec(&s)?.iter().all(|v| *v == 101.0));
    Ok(())
}

/// What cannot move is refused, each with its reason, and the executable still replays as
/// captured: a write, a GEMM operand, a part of what a node reads, bytes no node reads.
fn refused_rebinds_change_nothing(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (x, w, a) =
        (dev.alloc_from(&s, &[1.0f32; 64])?, dev.alloc_from(&s, &[2.0f32; 64])?, dev.alloc_from(&s, &[1.0f32; 64])?);
    let (y, c) = (dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?);
    let unread = dev.alloc::<f32>(64)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.view(), 2.0, &s)?;
    elementwise::add_scalar(w.view(), 1.0, &s)?;
    s.gemm(Gemm::new(c.view(), a.view(), a.view(), (8, 8, 8)))?;
    let graph = cap.finish()?;
    let exec = graph.instantiate()?;
    let other = dev.alloc_from(&s, &[5.0f32; 64])?;
    let tries = [
        (Rebind::new(w.view(), other.view())?, "written"),
        (Rebind::new(a.view(), other.view())?, "opaque"),
        (Rebind::new(x.slice(0..32), other.slice(0..32))?, "partial"),
        (Rebind::new(unread.view(), other.view())?, "not read"),
    ];
    for (r, what) in &tries {
        let kind = refusal(exec.rebind(std::slice::from_ref(r)).unwrap_err())?;
        let ok = match *what {
            "written" => matches!(kind, RebindErrorKind::Written { .. }),
            "opaque" => matches!(kind, RebindErrorKind::Opaque { .. }),
            "partial" => matches!(kind, RebindErrorKind::Partial { .. }),
            _ => matches!(kind, RebindErrorKind::NotRead { .. }),
        };
        ensure!(ok, "{what}: {kind}");
        ensure!(graph.check_rebind(std::slice::from_ref(r)).is_err(), "{what}: the graph refuses it too");
    }
    // A refused list moves none of its rebinds, the acceptable one included.
    let mixed = [Rebind::new(x.view(), other.view())?, Rebind::new(w.view(), other.view())?];
    ensure!(exec.rebind(&mixed).is_err());
    exec.launch(&s)?;
    ensure!(y.to_vec(&s)?.iter().all(|v| *v == 2.0), "x is still read");
    Ok(())
}

/// With `moving_writes`, a kernel's output and a device copy's destination move too: the
/// launches write the new buffers and leave the captured ones alone. Without it they are refused
/// (`Written`), and a memset's destination is refused either way.
fn writes_move_when_asked(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 256;
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &values(N, 1.0))?;
    let (y, z, m) = (dev.alloc_from(&s, &[0.0f32; N])?, dev.alloc_from(&s, &[0.0f32; N])?, dev.alloc::<f32>(N)?);
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.view(), 2.0, &s)?;
    s.copy_d2d(x.view(), z.view())?;
    s.memset(m.view(), 0)?;
    let exec = cap.finish()?.instantiate()?;
    let (y2, z2, m2) = (dev.alloc_from(&s, &[-1.0f32; N])?, dev.alloc_from(&s, &[-1.0f32; N])?, dev.alloc::<f32>(N)?);
    let kind = refusal(exec.rebind(&[Rebind::new(y.view(), y2.view())?]).unwrap_err())?;
    ensure!(matches!(kind, RebindErrorKind::Written { .. }), "a write without moving_writes: {kind}");
    let kind = refusal(exec.rebind(&[Rebind::new(m.view(), m2.view())?.moving_writes()]).unwrap_err())?;
    ensure!(matches!(kind, RebindErrorKind::Written { .. }), "a memset's destination: {kind}");
    let moves = [Rebind::new(y.view(), y2.view())?.moving_writes(), Rebind::new(z.view(), z2.view())?.moving_writes()];
    ensure!(exec.rebind(&moves)? == 2, "the scale and the copy");
    exec.launch(&s)?;
    let expected: Vec<f32> = values(N, 1.0).iter().map(|v| 2.0 * v).collect();
    ensure!(y2.to_vec(&s)? == expected && z2.to_vec(&s)? == values(N, 1.0), "the new buffers are written");
    ensure!(y.to_vec(&s)? == vec![0.0; N] && z.to_vec(&s)? == vec![0.0; N], "the captured ones are not");
    Ok(())
}

/// The pattern a switch of offloading without a new capture uses: a forward graph copies `x` out
/// to pinned memory and, beside it, into a stand-in buffer; a backward graph copies back from
/// the host or from the stand-in into `r`, which it reads. The stand-in's copies start off. After
/// the forward, `x` is overwritten (its memory reused). Switched to a resident buffer (the
/// stand-in's copies rebound to it and turned on, the host's turned off) the backward reads the
/// same values without touching the host's memory; switched back, the host's again.
fn host_copies_switch_to_a_resident_buffer_and_back(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 4096;
    let (s, d2h, h2d) = (dev.stream()?, dev.stream()?, dev.stream()?);
    let x = dev.alloc_from(&s, &values(N, 3.0))?;
    let (stand_in, r, out) = (dev.alloc::<f32>(N)?, dev.alloc::<f32>(N)?, dev.alloc::<f32>(N)?);
    let host = dev.alloc_pinned::<f32>(N)?;
    // A graph whose copies run on `side`, forked from `s` and joined back before `then`.
    let forked = |side: &Stream, copies: &dyn Fn() -> graphed::Result<()>, then: &dyn Fn() -> graphed::Result<()>| {
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        side.wait_stream(&s)?;
        copies()?;
        s.wait_stream(side)?;
        then()?;
        cap.finish()?.instantiate()
    };
    let forward = forked(
        &d2h,
        &|| {
            d2h.copy_d2h(x.view(), host.view())?;
            d2h.copy_d2d(x.view(), stand_in.view())
        },
        &|| Ok(()),
    )?;
    let backward = forked(
        &h2d,
        &|| {
            h2d.copy_h2d(host.view(), r.view())?;
            h2d.copy_d2d(stand_in.view(), r.view())
        },
        &|| elementwise::scale(out.view(), r.view(), 2.0, &s),
    )?;
    for exec in [&forward, &backward] {
        ensure!(exec.set_enabled(&[stand_in.id()], false)? == 1, "one stand-in copy per graph");
    }
    let expected: Vec<f32> = values(N, 3.0).iter().map(|v| 2.0 * v).collect();
    let step = |x_now: f32| -> anyhow::Result<Vec<f32>> {
        x.write_from(&s, &values(N, x_now))?;
        forward.launch(&s)?;
        elementwise::fill(x.view(), -7.0, &s)?;
        backward.launch(&s)?;
        Ok(out.to_vec(&s)?)
    };
    ensure!(step(3.0)? == expected, "through the host");

    let resident = dev.alloc::<f32>(N)?;
    for exec in [&forward, &backward] {
        exec.rebind(&[Rebind::new(stand_in.view(), resident.view())?.moving_writes()])?;
        exec.set_enabled(&[stand_in.id()], true)?;
        exec.set_enabled(&[host.id()], false)?;
    }
    s.synchronize()?;
    host.write(&[11.0; N])?;
    ensure!(step(3.0)? == expected, "through the resident buffer");
    ensure!(host.read()? == vec![11.0; N], "the host's memory untouched");

    for exec in [&forward, &backward] {
        exec.set_enabled(&[host.id()], true)?;
        exec.set_enabled(&[stand_in.id()], false)?;
        exec.rebind(&[Rebind::new(stand_in.view(), stand_in.view())?.moving_writes()])?;
    }
    drop(resident);
    ensure!(step(3.0)? == expected, "through the host again");
    s.synchronize()?;
    ensure!(host.read()? == values(N, 3.0), "the host's memory holds x");
    Ok(())
}

/// A small random number generator for the cases below (the same cases on every device).
struct Draws(u64);

impl Draws {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

/// Random graphs of kernels and copies reading views of `x`, and random rebinds of a range of
/// `x` to a range of a larger buffer: a rebind is accepted exactly when every read that meets
/// the range lies inside it and one does, and an accepted one gives the bits of a replay into
/// whose `x` the same values were copied.
fn random_views_rebound_equal_copy_in(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 256;
    let s = dev.stream()?;
    let mut rng = Draws(7);
    for case in 0..32 {
        let x = dev.alloc_from(&s, &values(N, case as f32))?;
        let big = dev.alloc_from(&s, &values(4 * N, 100.0 + case as f32))?;
        let reads: Vec<(usize, usize)> = (0..1 + rng.below(4))
            .map(|_| {
                let a = rng.below(N - 1);
                (a, a + 1 + rng.below(N - a - 1))
            })
            .collect();
        let outs = reads.iter().map(|(a, b)| dev.alloc::<f32>(b - a)).collect::<graphed::Result<Vec<_>>>()?;
        let copied = dev.alloc::<f32>(N)?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        for (k, ((a, b), y)) in reads.iter().zip(&outs).enumerate() {
            if k % 2 == 0 {
                elementwise::scale(y.view(), x.slice(*a..*b), 1.0 + k as f32, &s)?;
            } else {
                s.copy_d2d(x.slice(*a..*b), copied.slice(*a..*b))?;
            }
        }
        let graph = cap.finish()?;
        let (patched, plain) = (graph.instantiate()?, graph.instantiate()?);
        // The hull of every read (accepted), of the first read (accepted unless another read
        // crosses its ends), or any range.
        let (r0, r1) = match rng.below(3) {
            0 => (reads.iter().map(|r| r.0).min().unwrap_or(0), reads.iter().map(|r| r.1).max().unwrap_or(N)),
            1 => reads[0],
            _ => {
                let r0 = rng.below(N - 1);
                (r0, r0 + 1 + rng.below(N - r0 - 1))
            }
        };
        let t0 = rng.below(3 * N);
        let rebind = Rebind::new(x.slice(r0..r1), big.slice(t0..t0 + (r1 - r0)))?;
        let meets: Vec<&(usize, usize)> = reads.iter().filter(|(a, b)| *a < r1 && r0 < *b).collect();
        let inside = meets.iter().all(|(a, b)| r0 <= *a && *b <= r1);
        match patched.rebind(std::slice::from_ref(&rebind)) {
            Ok(_) => ensure!(!meets.is_empty() && inside, "case {case}: accepted {r0}..{r1} over reads {reads:?}"),
            Err(e) => {
                let kind = refusal(e)?;
                let expected = match (meets.is_empty(), inside) {
                    (true, _) => matches!(kind, RebindErrorKind::NotRead { .. }),
                    (false, false) => matches!(kind, RebindErrorKind::Partial { .. }),
                    (false, true) => false,
                };
                ensure!(expected, "case {case}: {r0}..{r1} over reads {reads:?} refused: {kind}");
                continue;
            }
        }
        let run = |exec: &GraphExec| -> anyhow::Result<Vec<Vec<f32>>> {
            exec.launch(&s)?;
            let mut all = outs.iter().map(|y| y.to_vec(&s)).collect::<graphed::Result<Vec<_>>>()?;
            all.push(copied.to_vec(&s)?);
            Ok(all)
        };
        let in_place = run(&patched)?;
        s.copy_d2d(big.slice(t0..t0 + (r1 - r0)), x.slice(r0..r1))?;
        ensure!(in_place == run(&plain)?, "case {case}: {r0}..{r1} -> {t0} over reads {reads:?}");
    }
    Ok(())
}

crate::per_device!(
    random_views_rebound_equal_copy_in,
    rebound_reads_equal_a_copy_in_replay,
    a_view_moves_with_its_offset_and_is_held,
    queued_launches_keep_their_buffers,
    refused_rebinds_change_nothing,
    writes_move_when_asked,
    host_copies_switch_to_a_resident_buffer_and_back,
);
