//! Small copyable identities of device objects, used in errors, reports and graph introspection.

use std::fmt;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
        #[serde(transparent)]
        pub struct $name(pub(crate) u64);

        impl $name {
            /// The number behind the id (unique per process for its kind).
            pub fn raw(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_type!(
    /// Identity of a [`Device`](super::Device).
    DeviceId, "dev"
);
id_type!(
    /// Identity of a [`Stream`](super::Stream).
    StreamId, "s"
);
id_type!(
    /// Identity of an [`Event`](super::Event).
    EventId, "e"
);
id_type!(
    /// Identity of a device or pinned host allocation.
    BufferId, "b"
);
id_type!(
    /// Identity of a captured [`Graph`](super::Graph) (its executables share it).
    GraphId, "g"
);

/// Hands out process-unique ids, so objects of two devices never share one.
pub(crate) fn next_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
