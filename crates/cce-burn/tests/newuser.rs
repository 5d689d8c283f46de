//! A new user's checks (`common/user.rs`) on NdArray with autodiff, and again with burn's
//! gradient checkpointing.
#![cfg(feature = "ndarray")]
// burn 0.22 deprecates NdArray (for Flex); it is the backend under test here.
#![allow(deprecated)]

mod common;

use burn::tensor::Device;
use common::user;

macro_rules! on_ndarray {
    ($($name:ident),* $(,)?) => {
        mod autodiff {
            use super::*;
            $(#[test] fn $name() { user::$name(&Device::ndarray().autodiff()); })*
        }
        mod checkpointing {
            use super::*;
            $(#[test] fn $name() { user::$name(&Device::ndarray().autodiff().gradient_checkpointing()); })*
        }
    };
}

common::user::with_user_checks!(on_ndarray);
