//! Layer 5, optimizers: objects that own their state on the device and update a model's
//! [`ParamStore`](crate::nn::ParamStore) in a fixed number of launches, capturable as one graph
//! (`graph::make_graphed_fn`).

mod adamw;

pub use crate::ops::adamw::{AdamWHyper, NonFinite};
pub use crate::ops::schedule::LrSchedule;
pub use adamw::AdamW;
