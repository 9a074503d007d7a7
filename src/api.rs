//! API calls every controller makes the same way: writes that must reach only the object
//! they were meant for, and the answers that mean "nothing left to do".

use std::fmt::Debug;

use kube::api::{Api, DeleteParams, Preconditions};
use serde::de::DeserializeOwned;

/// Whether an API error carries the HTTP status `code` (404, 409, 429…).
pub fn is_status(error: &kube::Error, code: u16) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == code)
}

/// What a [`delete_exact`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deleted {
    /// This call deleted the object (or started its graceful deletion).
    Now,
    /// It was already gone, or the name now belongs to another object (another UID),
    /// which is left alone.
    AlreadyGone,
}

/// Deletes `name` only while it is still the object with `uid` (a precondition, so an
/// object re-created under the same name meanwhile is never deleted by mistake), with
/// `grace_seconds` if given. A 404 or a failed precondition (409) is [`Deleted::AlreadyGone`].
pub async fn delete_exact<K>(
    api: &Api<K>,
    name: &str,
    uid: Option<String>,
    grace_seconds: Option<u32>,
) -> Result<Deleted, kube::Error>
where
    K: Clone + DeserializeOwned + Debug,
{
    let params = DeleteParams {
        grace_period_seconds: grace_seconds,
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(Deleted::Now),
        Err(e) if is_status(&e, 404) || is_status(&e, 409) => Ok(Deleted::AlreadyGone),
        Err(e) => Err(e),
    }
}
