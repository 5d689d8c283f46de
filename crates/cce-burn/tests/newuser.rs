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

on_ndarray!(
    sliced_and_transposed_inputs,
    f16_inputs,
    bf16_inputs,
    f64_inputs,
    mixed_float_dtypes_are_a_typed_error,
    bias_of_another_dtype_is_a_typed_error,
    bias_of_wrong_length_is_a_typed_error,
    targets_of_other_int_dtypes,
    inputs_on_a_plain_device_beside_an_autodiff_one,
    targets_on_a_plain_device,
    two_uses_in_one_graph_accumulate,
    embedding_lm_with_bias_and_gradient_accumulation,
    frozen_head_with_trained_bias,
    nothing_requires_grad_on_an_autodiff_device,
    backward_twice_panics_like_burns_own_ops,
    deterministic_repeat,
    all_ignored_sum_and_none_have_zero_gradients,
    empty_batch_is_a_typed_error,
    bad_softcap_is_a_typed_error,
    negative_target_that_is_not_ignore_index,
    per_row_losses_under_burns_reductions,
    three_d_views_with_shift_and_per_row_losses,
    wide_i64_targets,
);
