//! Named ranges of host time, so that a profiler's timeline reads like the model: NVTX push and
//! pop on a CUDA device (when `libnvToolsExt` can be loaded), and on both devices a log of the
//! ranges, kept only while [`Device::record_ranges`] is on.
//!
//! A range is a [`Range`] guard: it begins when [`Device::range`] returns it and ends when it is
//! dropped, on every path out of the scope (errors included), on the thread that opened it, as
//! NVTX's push/pop ranges must. With NVTX absent and recording off, opening one costs two loads.
//!
//! Recording is off by default: when on, each begin and end takes the log's lock and clones the
//! name (a reference count, no allocation: the callers that open ranges on every step make
//! their names once). The log holds at most [`RANGE_LOG_CAPACITY`] events; later ones are
//! counted in [`RangeLog::dropped`] and not kept.

use std::cell::Cell;
use std::ffi::{CStr, CString};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use super::{cuda, Device};

/// The most events a device's range log keeps between two [`Device::take_ranges`].
pub const RANGE_LOG_CAPACITY: usize = 1 << 16;

/// The log's first reservation: a few steps of a deep model, so that steps do not grow it.
const INITIAL_CAPACITY: usize = 1 << 10;

/// A range's name, made once and shared by every range that bears it. NVTX takes a
/// NUL-terminated string, so the name is kept in that form; a NUL inside it becomes a space.
///
/// ```
/// use graphed::device::RangeName;
/// assert_eq!(RangeName::new("replay h0.forward").as_str(), "replay h0.forward");
/// assert_eq!(RangeName::new("a\0b").as_str(), "a b");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RangeName(Arc<CStr>);

impl RangeName {
    /// The name `name`, a NUL inside it replaced by a space.
    pub fn new(name: &str) -> RangeName {
        let bytes: Vec<u8> = name.bytes().map(|b| if b == 0 { b' ' } else { b }).collect();
        // No NUL is left, so this cannot fail; the default (an empty name) keeps it panic-free.
        RangeName(CString::new(bytes).unwrap_or_default().into())
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        // Made from a `&str` with only NULs replaced: always UTF-8.
        self.0.to_str().unwrap_or_default()
    }

    /// The name as NVTX takes it.
    pub(crate) fn c_str(&self) -> &CStr {
        &self.0
    }
}

impl From<&str> for RangeName {
    fn from(name: &str) -> RangeName {
        RangeName::new(name)
    }
}

impl std::fmt::Display for RangeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for RangeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

/// Whether a [`RangeEvent`] begins or ends its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeEdge {
    /// The range began.
    Begin,
    /// The range ended.
    End,
}

/// One begin or end in a device's range log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeEvent {
    /// Begin or end.
    pub edge: RangeEdge,
    /// The range's name.
    pub name: RangeName,
    /// How many recorded ranges (of any device) were open on its thread when it began: 0 for
    /// an outermost range. An end carries its begin's depth.
    pub depth: usize,
    /// The thread that opened and closed it.
    pub thread: ThreadId,
}

/// A range of a [`RangeLog`], its begin paired with its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// The range's name.
    pub name: RangeName,
    /// Its nesting depth on its thread (0: outermost).
    pub depth: usize,
    /// Its thread.
    pub thread: ThreadId,
    /// The index of its begin in [`RangeLog::events`].
    pub begin: usize,
    /// The index of its end in [`RangeLog::events`].
    pub end: usize,
}

/// Why a [`RangeLog`] does not pair into properly nested spans.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeFault {
    /// Events were dropped at the log's capacity: the log is incomplete.
    #[error(
        "{dropped} range events were dropped at the log's capacity of {RANGE_LOG_CAPACITY}; take the log more often"
    )]
    Incomplete {
        /// How many.
        dropped: usize,
    },
    /// A range ended while another, opened after it on the same thread, was still open (guards
    /// dropped out of order).
    #[error("event {at}: `{name}` ends while `{open}` is the innermost open range of its thread; drop range guards in reverse order of opening")]
    Crossed {
        /// The end's index.
        at: usize,
        /// The range that ended.
        name: String,
        /// The innermost open range.
        open: String,
    },
    /// A range ended with no range open on its thread (it began before recording was on).
    #[error("event {at}: `{name}` ends but no recorded range is open on its thread")]
    NotOpen {
        /// The end's index.
        at: usize,
        /// The range that ended.
        name: String,
    },
    /// An event's depth is not the number of ranges open on its thread.
    #[error("event {at}: `{name}` has depth {found} but {expected} recorded ranges were open on its thread")]
    Depth {
        /// The event's index.
        at: usize,
        /// Its range.
        name: String,
        /// The depth it carries.
        found: usize,
        /// The open ranges counted from the log.
        expected: usize,
    },
    /// A range began and did not end (its guard is still alive, or was leaked).
    #[error("`{name}` begins at event {at} and never ends; take the log after its guard dropped")]
    Unclosed {
        /// The begin's index.
        at: usize,
        /// The range.
        name: String,
    },
}

/// What [`Device::take_ranges`] returns: the events recorded since the last take, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeLog {
    /// Begins and ends, in the order they happened (across threads, in the order they took the
    /// log's lock).
    pub events: Vec<RangeEvent>,
    /// Events not kept because the log was full.
    pub dropped: usize,
}

impl RangeLog {
    /// The ranges, each begin paired with its end, in order of their begins.
    ///
    /// # Errors
    /// A [`RangeFault`] when the log is incomplete or its ranges do not nest on some thread:
    /// every begin must have its end, on its thread, after every range opened inside it ended.
    pub fn spans(&self) -> Result<Vec<Span>, RangeFault> {
        if self.dropped > 0 {
            return Err(RangeFault::Incomplete { dropped: self.dropped });
        }
        let mut open: Vec<(ThreadId, Vec<usize>)> = Vec::new();
        let mut spans: Vec<Option<Span>> = vec![None; self.events.len()];
        for (at, e) in self.events.iter().enumerate() {
            let k = match open.iter().position(|(t, _)| *t == e.thread) {
                Some(k) => k,
                None => {
                    open.push((e.thread, Vec::new()));
                    open.len() - 1
                }
            };
            let stack = &mut open[k].1;
            let name = || e.name.as_str().to_string();
            match e.edge {
                RangeEdge::Begin => {
                    if e.depth != stack.len() {
                        return Err(RangeFault::Depth { at, name: name(), found: e.depth, expected: stack.len() });
                    }
                    stack.push(at);
                }
                RangeEdge::End => {
                    let Some(&begin) = stack.last() else { return Err(RangeFault::NotOpen { at, name: name() }) };
                    let b = &self.events[begin];
                    if b.name != e.name {
                        return Err(RangeFault::Crossed { at, name: name(), open: b.name.as_str().to_string() });
                    }
                    if e.depth != b.depth {
                        return Err(RangeFault::Depth { at, name: name(), found: e.depth, expected: b.depth });
                    }
                    stack.pop();
                    let span = Span { name: e.name.clone(), depth: e.depth, thread: e.thread, begin, end: at };
                    spans[begin] = Some(span);
                }
            }
        }
        if let Some(&at) = open.iter().flat_map(|(_, s)| s.first()).min() {
            return Err(RangeFault::Unclosed { at, name: self.events[at].name.as_str().to_string() });
        }
        Ok(spans.into_iter().flatten().collect())
    }
}

/// A device's range log and whether it records.
#[derive(Default)]
pub(crate) struct RangeRecorder {
    on: AtomicBool,
    log: Mutex<RangeLog>,
}

thread_local! {
    /// Recorded ranges open on this thread, of every device: the depth of the next one.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    /// This thread's id, kept: `thread::current()` costs a reference count per call.
    static THREAD: ThreadId = std::thread::current().id();
}

impl RangeRecorder {
    fn push(&self, edge: RangeEdge, name: &RangeName, depth: usize) {
        let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        if log.events.len() >= RANGE_LOG_CAPACITY {
            log.dropped += 1;
            return;
        }
        let thread = THREAD.with(|t| *t);
        log.events.push(RangeEvent { edge, name: name.clone(), depth, thread });
    }
}

/// An open range: it ends when dropped, on the thread that opened it (it cannot be sent to
/// another: NVTX's ranges are a per-thread stack). Made by [`Device::range`].
#[must_use = "a range ends when its guard drops: bind it (`let _range = ...`) for the scope it names"]
pub struct Range<'d> {
    device: &'d Device,
    /// Whether an NVTX range was pushed, to be popped.
    nvtx: bool,
    /// The name and depth recorded at its begin, for its end.
    recorded: Option<(RangeName, usize)>,
    /// Not `Send`: ends on its thread.
    _thread: PhantomData<*const ()>,
}

impl Drop for Range<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some((name, depth)) = self.recorded.take() {
            // One fewer open, as NVTX's pop counts, even for a guard dropped out of order.
            DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
            self.device.inner.ranges.push(RangeEdge::End, &name, depth);
        }
        if self.nvtx {
            cuda::nvtx::pop();
        }
    }
}

impl Device {
    /// Opens a range named `name` on this thread, until the guard drops: an NVTX range on a CUDA
    /// device with `libnvToolsExt` loaded (see [`Device::nvtx`]), and an entry in the range
    /// log while [`record_ranges`](Device::record_ranges) is on. Make the name once for ranges
    /// opened on every step.
    ///
    /// ```
    /// use graphed::device::{Device, RangeName};
    /// let dev = Device::sim();
    /// dev.record_ranges(true);
    /// let step = RangeName::new("step");
    /// {
    ///     let _step = dev.range(&step);
    ///     let _inner = dev.range_with(|| format!("microbatch {}", 0));
    /// }
    /// let spans = dev.take_ranges().spans()?;
    /// assert_eq!(spans.iter().map(|s| (s.name.as_str(), s.depth)).collect::<Vec<_>>(), [("step", 0), ("microbatch 0", 1)]);
    /// # Ok::<(), graphed::device::RangeFault>(())
    /// ```
    #[inline]
    pub fn range(&self, name: &RangeName) -> Range<'_> {
        self.open_range(|| name.clone())
    }

    /// [`range`](Device::range), its name made by `name` only when someone looks (NVTX loaded,
    /// or recording on): for ranges opened rarely (captures, eager offload copies), whose names
    /// are not worth keeping.
    pub fn range_with(&self, name: impl FnOnce() -> String) -> Range<'_> {
        self.open_range(|| RangeName::new(&name()))
    }

    #[inline]
    fn open_range(&self, name: impl FnOnce() -> RangeName) -> Range<'_> {
        let record = self.inner.ranges.on.load(Ordering::Relaxed);
        let mut range = Range { device: self, nvtx: false, recorded: None, _thread: PhantomData };
        if !record && !self.inner.nvtx {
            return range;
        }
        let name = name();
        if self.inner.nvtx {
            cuda::nvtx::push(name.c_str());
            range.nvtx = true;
        }
        if record {
            let depth = DEPTH.with(|d| d.replace(d.get() + 1));
            self.inner.ranges.push(RangeEdge::Begin, &name, depth);
            range.recorded = Some((name, depth));
        }
        range
    }

    /// Turns the range log on or off (off when the device is made). Ranges that began while it
    /// was on are logged when they end, even after it was turned off.
    pub fn record_ranges(&self, on: bool) {
        if on {
            let mut log = self.inner.ranges.log.lock().unwrap_or_else(PoisonError::into_inner);
            let want = INITIAL_CAPACITY.saturating_sub(log.events.len());
            log.events.reserve(want);
        }
        self.inner.ranges.on.store(on, Ordering::Relaxed);
    }

    /// The range events logged since the last take, emptying the log (which keeps recording if
    /// it was on).
    pub fn take_ranges(&self) -> RangeLog {
        let mut log = self.inner.ranges.log.lock().unwrap_or_else(PoisonError::into_inner);
        let capacity = if self.inner.ranges.on.load(Ordering::Relaxed) { INITIAL_CAPACITY } else { 0 };
        std::mem::replace(&mut *log, RangeLog { events: Vec::with_capacity(capacity), dropped: 0 })
    }

    /// Whether this device's ranges reach NVTX: a CUDA device in a process where
    /// `libnvToolsExt` (cudarc's name for NVTX's library) could be loaded. Nsight Systems shows
    /// them only then; see `docs/profiling.md`.
    pub fn nvtx(&self) -> bool {
        self.inner.nvtx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(log: &RangeLog) -> Vec<(RangeEdge, &str, usize)> {
        log.events.iter().map(|e| (e.edge, e.name.as_str(), e.depth)).collect()
    }

    #[test]
    fn nothing_is_logged_until_recording_is_on_and_after_it_is_off() {
        let dev = Device::sim();
        drop(dev.range(&"before".into()));
        dev.record_ranges(true);
        let outer = dev.range(&"outer".into());
        dev.record_ranges(false);
        drop(dev.range(&"after".into()));
        drop(outer);
        use RangeEdge::*;
        assert_eq!(names(&dev.take_ranges()), [(Begin, "outer", 0), (End, "outer", 0)]);
        assert!(!dev.nvtx(), "the simulator has no NVTX");
    }

    #[test]
    fn a_range_ends_on_every_path_out_of_its_scope() {
        fn fails(dev: &Device) -> Result<(), ()> {
            let _r = dev.range(&"fails".into());
            let _inner = dev.range_with(|| "inner".to_string());
            Err(())
        }
        let dev = Device::sim();
        dev.record_ranges(true);
        assert!(fails(&dev).is_err());
        let spans = dev.take_ranges().spans().expect("balanced");
        let got: Vec<_> = spans.iter().map(|s| (s.name.as_str(), s.depth, s.begin, s.end)).collect();
        assert_eq!(got, [("fails", 0, 0, 3), ("inner", 1, 1, 2)]);
    }

    #[test]
    fn guards_dropped_out_of_order_are_reported_as_crossed() {
        let dev = Device::sim();
        dev.record_ranges(true);
        let a = dev.range(&"a".into());
        let b = dev.range(&"b".into());
        drop(a);
        drop(b);
        let err = dev.take_ranges().spans().expect_err("a ends inside b");
        assert!(matches!(&err, RangeFault::Crossed { at: 2, name, open } if name == "a" && open == "b"), "{err}");
        // Both ended: the next range is outermost again.
        drop(dev.range(&"next".into()));
        assert_eq!(dev.take_ranges().events[0].depth, 0);
    }

    #[test]
    fn an_open_range_and_an_unmatched_end_are_faults() {
        let dev = Device::sim();
        dev.record_ranges(true);
        let open = dev.range(&"open".into());
        let log = dev.take_ranges();
        assert!(matches!(log.spans(), Err(RangeFault::Unclosed { at: 0, .. })));
        drop(open);
        assert!(matches!(dev.take_ranges().spans(), Err(RangeFault::NotOpen { at: 0, .. })));
    }

    #[test]
    fn a_full_log_counts_what_it_dropped_and_says_it_is_incomplete() {
        let dev = Device::sim();
        dev.record_ranges(true);
        let name = RangeName::new("r");
        for _ in 0..RANGE_LOG_CAPACITY / 2 + 1 {
            drop(dev.range(&name));
        }
        let log = dev.take_ranges();
        assert_eq!((log.events.len(), log.dropped), (RANGE_LOG_CAPACITY, 2));
        assert_eq!(log.spans(), Err(RangeFault::Incomplete { dropped: 2 }));
        assert_eq!(dev.take_ranges(), RangeLog::default());
    }

    #[test]
    fn ranges_of_two_threads_nest_each_on_its_own() {
        let dev = Device::sim();
        dev.record_ranges(true);
        let outer = dev.range(&"main".into());
        std::thread::scope(|s| {
            s.spawn(|| drop(dev.range(&"worker".into())));
        });
        drop(outer);
        let spans = dev.take_ranges().spans().expect("each thread nests");
        assert_eq!(spans.iter().map(|s| (s.name.as_str(), s.depth)).collect::<Vec<_>>(), [("main", 0), ("worker", 0)]);
    }
}
