//! The workspace budget's decisions, from plain data: the plan's share of the budget beside
//! the cuBLAS workspace ([`plan_budget`]). `schedule.rs` takes the paths, `workspace.rs`
//! counts the bytes.

use super::*;

/// The bytes of a workspace budget of `budget` bytes that a plan may fill: the budget less the
/// cuBLAS workspace the engine holds ([`CUBLAS_WORKSPACE_BYTES`]), so that a call's workspace
/// with it stays within the budget. The backend plans with it (`cce_core::Plan::new` with
/// `workspace_budget_bytes` set to it); so does a caller of the engine that wants its plans.
pub fn plan_budget(budget: u64) -> u64 {
    budget.saturating_sub(CUBLAS_WORKSPACE_BYTES as u64)
}

/// A plan's `ResourceLimit` for the workspace (planned within [`plan_budget`]) as one against
/// the whole `budget`: the cuBLAS workspace added to what was asked. Other errors unchanged.
pub(crate) fn over_budget(e: CceError, budget: u64) -> CceError {
    match e {
        CceError::ResourceLimit {
            resource,
            requested,
            max,
        } if max == plan_budget(budget) && resource.starts_with("workspace bytes") => {
            CceError::ResourceLimit {
                resource: format!(
                    "{resource}, with the {CUBLAS_WORKSPACE_BYTES} B cuBLAS workspace beside it"
                ),
                requested: requested.saturating_add(CUBLAS_WORKSPACE_BYTES as u64),
                max: budget,
            }
        }
        other => other,
    }
}
