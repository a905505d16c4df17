//! Vector clocks over lanes: streams, the host, the lanes of a capture and of each graph launch.

use std::collections::HashMap;

/// A sequence of operations that run in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Lane {
    /// A stream, by its id.
    Stream(u64),
    /// The host.
    Host,
    /// A stream's work inside a capture: (capture id, stream id).
    Capture(u64, u64),
    /// Lane `1` of the captured graph, in launch `0`.
    Launch(u64, u32),
}

/// How far each lane is known to have progressed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Clock(HashMap<Lane, u64>);

impl Clock {
    pub(crate) fn get(&self, lane: Lane) -> u64 {
        self.0.get(&lane).copied().unwrap_or(0)
    }

    /// Advances `lane` by one and returns its new position.
    pub(crate) fn tick(&mut self, lane: Lane) -> u64 {
        let p = self.0.entry(lane).or_insert(0);
        *p += 1;
        *p
    }

    pub(crate) fn raise(&mut self, lane: Lane, pos: u64) {
        let p = self.0.entry(lane).or_insert(0);
        *p = (*p).max(pos);
    }

    pub(crate) fn join(&mut self, other: &Clock) {
        for (lane, pos) in &other.0 {
            self.raise(*lane, *pos);
        }
    }

    /// Whether the operation at `pos` of `lane` happened before whatever this clock describes.
    pub(crate) fn covers(&self, lane: Lane, pos: u64) -> bool {
        self.get(lane) >= pos
    }

    /// Drops the lanes `gone` selects.
    pub(crate) fn forget(&mut self, gone: impl Fn(&Lane) -> bool) {
        self.0.retain(|lane, _| !gone(lane));
    }

    pub(crate) fn lanes(&self) -> impl Iterator<Item = (&Lane, &u64)> {
        self.0.iter()
    }
}
