//! API calls every controller makes the same way: writes that must reach only the object
//! they were meant for, and the answers that mean "nothing left to do".

use std::fmt::Debug;

use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Whether an API error carries the HTTP status `code` (404, 409, 429…).
pub fn is_status(error: &kube::Error, code: u16) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == code)
}

/// Whether a write that carried the object's UID as a precondition found the name taken
/// by another object, or no object at all: the object it was meant for is gone, and the
/// watch brings whatever replaced it. The API server refuses a patch whose
/// `metadata.uid` differs as an invalid change of an immutable field (422); a 409 is what
/// other preconditions (and other API server versions) answer.
pub fn is_replaced(error: &kube::Error) -> bool {
    let uid_refused = matches!(error, kube::Error::Api(status)
        if status.code == 422
            && status
                .details
                .as_ref()
                .is_some_and(|d| d.causes.iter().any(|c| c.field == "metadata.uid")));
    uid_refused || is_status(error, 404) || is_status(error, 409)
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

/// What a [`replace_exact`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replaced {
    /// This call replaced the object.
    Now,
    /// The object changed since it was read (another resourceVersion), or the name now
    /// belongs to another object (another UID): read it again and decide anew.
    Conflict,
    /// The object is gone: its deletion wakes whoever made it.
    Gone,
}

/// Replaces `name` with `object`, which must carry the resourceVersion and UID of the
/// object it was made from (an optimistic, exact write: nothing changed or re-created
/// meanwhile is overwritten). A 409 is [`Replaced::Conflict`], a 404 [`Replaced::Gone`];
/// any other error (a 422 for a field that cannot change in place…) is returned.
pub async fn replace_exact<K>(api: &Api<K>, name: &str, object: &K) -> Result<Replaced, kube::Error>
where
    K: Clone + DeserializeOwned + Serialize + Debug,
{
    replaced(api.replace(name, &PostParams::default(), object).await)
}

/// The [`Replaced`] outcome of a replace call's result.
pub fn replaced<K>(result: Result<K, kube::Error>) -> Result<Replaced, kube::Error> {
    match result {
        Ok(_) => Ok(Replaced::Now),
        Err(e) if is_status(&e, 409) => Ok(Replaced::Conflict),
        Err(e) if is_status(&e, 404) => Ok(Replaced::Gone),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn status(code: u16) -> kube::Error {
        kube::Error::Api(
            Status::failure(&format!("status {code}"), "")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn replace_outcomes() {
        let cases: [(Result<(), kube::Error>, Option<Replaced>); 5] = [
            (Ok(()), Some(Replaced::Now)),
            (Err(status(409)), Some(Replaced::Conflict)),
            (Err(status(404)), Some(Replaced::Gone)),
            (Err(status(422)), None),
            (Err(status(500)), None),
        ];
        for (result, expected) in cases {
            let got = replaced(result);
            match expected {
                Some(outcome) => assert_eq!(got.ok(), Some(outcome)),
                None => assert!(got.is_err(), "an error the caller handles"),
            }
        }
    }
}
