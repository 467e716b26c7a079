//! The payload messages, generated from `proto/cleave/v1/payload.proto` (a module file of its
//! own, so that the codec's modules depend on it and not on the crate root).

include!(concat!(env!("OUT_DIR"), "/cleave.v1.rs"));
