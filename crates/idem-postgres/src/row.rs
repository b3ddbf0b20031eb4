//! A record as a table row, and back.

use bytes::Bytes;
use idem_core::{
    Attempt, Fingerprint, Outcome, OwnerToken, Record, RecordState, ScopeHash, StoreError,
    StoredResponse,
};
use sqlx::{Row, postgres::PgRow};

/// The record's columns, in the order [`bind_record`] binds them.
pub(crate) const COLUMNS: &str = "scope, tenant, operation, key, fingerprint, state, generation, \
     owner, lease_ms, retention_ms, lease_expires_at_ms, created_at_ms, updated_at_ms, \
     completed_at_ms, expires_at_ms, status, stored, header_names, header_values, body, attempts";

/// The columns as read back (`attempts` as text).
pub(crate) const SELECTED: &str = "r.scope, r.tenant, r.operation, r.key, r.fingerprint, r.state, \
     r.generation, r.owner, r.lease_ms, r.retention_ms, r.lease_expires_at_ms, r.created_at_ms, \
     r.updated_at_ms, r.completed_at_ms, r.expires_at_ms, r.status, r.stored, r.header_names, \
     r.header_values, r.body, r.attempts::text AS attempts";

/// `$1 … $21` for the record's columns, `attempts` cast to `jsonb`.
pub(crate) fn placeholders() -> String {
    (1..=21)
        .map(|n| {
            if n == 21 {
                format!("${n}::jsonb")
            } else {
                format!("${n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A tenant as the `text` column holds it. PostgreSQL's `text` refuses
/// NUL, which a tenant may hold (the layer's anonymous tenant starts with
/// one, so that no header value can name it): `%` and NUL are written as
/// `%25` and `%00`, and every other tenant is stored as it is.
pub(crate) fn stored_tenant(tenant: &str) -> std::borrow::Cow<'_, str> {
    if !tenant.contains(['%', '\0']) {
        return std::borrow::Cow::Borrowed(tenant);
    }
    std::borrow::Cow::Owned(tenant.replace('%', "%25").replace('\0', "%00"))
}

/// The tenant a `text` column holds, as [`stored_tenant`] wrote it.
pub(crate) fn read_tenant(stored: &str) -> String {
    if !stored.contains('%') {
        return stored.to_owned();
    }
    stored.replace("%00", "\0").replace("%25", "%")
}

/// Milliseconds as stored (`bigint`), saturating.
pub(crate) fn ms(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn unms(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(column)
        .map_err(|error| corrupt(format!("column {column}: {error}")))
}

fn hash32(bytes: &[u8], what: &str) -> Result<[u8; 32], StoreError> {
    bytes
        .try_into()
        .map_err(|_| corrupt(format!("{what} is {} bytes, not 32", bytes.len())))
}

/// Reads a record from a row selected with [`SELECTED`].
pub(crate) fn decode(row: &PgRow) -> Result<Record, StoreError> {
    let scope: Vec<u8> = get(row, "scope")?;
    let fingerprint: Vec<u8> = get(row, "fingerprint")?;
    let state: String = get(row, "state")?;
    let state =
        RecordState::parse(&state).ok_or_else(|| corrupt(format!("unknown state {state:?}")))?;
    let owner: Option<uuid::Uuid> = get(row, "owner")?;
    let status: Option<i32> = get(row, "status")?;
    let stored: Option<bool> = get(row, "stored")?;
    let outcome = match (status, stored) {
        (None, _) => None,
        (Some(status), stored) => {
            let status = u16::try_from(status).map_err(|_| corrupt("status out of range"))?;
            if stored == Some(true) {
                let names: Vec<String> =
                    get::<Option<Vec<String>>>(row, "header_names")?.unwrap_or_default();
                let values: Vec<Vec<u8>> =
                    get::<Option<Vec<Vec<u8>>>>(row, "header_values")?.unwrap_or_default();
                if names.len() != values.len() {
                    return Err(corrupt("header names and values differ in number"));
                }
                let body: Vec<u8> = get::<Option<Vec<u8>>>(row, "body")?.unwrap_or_default();
                Some(Outcome::Stored(StoredResponse {
                    status,
                    // Only names a header map held are stored; one that does
                    // not parse is left out of the replay, as the layer
                    // always did.
                    headers: names
                        .into_iter()
                        .zip(values)
                        .filter_map(|(name, value)| {
                            let name = idem_core::HeaderName::from_bytes(name.as_bytes()).ok()?;
                            Some((name, Bytes::from(value)))
                        })
                        .collect(),
                    body: Bytes::from(body),
                }))
            } else {
                Some(Outcome::NotStored { status })
            }
        }
    };
    let attempts: String = get(row, "attempts")?;
    let attempts: Vec<Attempt> =
        serde_json::from_str(&attempts).map_err(|error| corrupt(format!("attempts: {error}")))?;
    let generation: i64 = get(row, "generation")?;
    Ok(Record {
        scope: ScopeHash::from_bytes(hash32(&scope, "scope")?),
        tenant: read_tenant(&get::<String>(row, "tenant")?).into(),
        operation: get::<String>(row, "operation")?.into(),
        key: get::<String>(row, "key")?.into(),
        fingerprint: Fingerprint::from_bytes(hash32(&fingerprint, "fingerprint")?),
        state,
        generation: unms(generation),
        owner: owner.map(OwnerToken),
        lease_expires_at_ms: unms(get(row, "lease_expires_at_ms")?),
        lease_ms: unms(get(row, "lease_ms")?),
        retention_ms: unms(get(row, "retention_ms")?),
        created_at_ms: unms(get(row, "created_at_ms")?),
        updated_at_ms: unms(get(row, "updated_at_ms")?),
        completed_at_ms: get::<Option<i64>>(row, "completed_at_ms")?.map(unms),
        expires_at_ms: unms(get(row, "expires_at_ms")?),
        outcome,
        attempts,
    })
}

/// The outcome's columns: status, stored, header names, header values,
/// body.
pub(crate) type OutcomeColumns = (
    i32,
    bool,
    Option<Vec<String>>,
    Option<Vec<Vec<u8>>>,
    Option<Vec<u8>>,
);

/// Splits an outcome into its columns.
pub(crate) fn outcome_columns(outcome: &Outcome) -> OutcomeColumns {
    match outcome {
        Outcome::NotStored { status } => (i32::from(*status), false, None, None, None),
        Outcome::Stored(response) => (
            i32::from(response.status),
            true,
            Some(
                response
                    .headers
                    .iter()
                    .map(|(n, _)| n.as_str().to_owned())
                    .collect(),
            ),
            Some(response.headers.iter().map(|(_, v)| v.to_vec()).collect()),
            Some(response.body.to_vec()),
        ),
    }
}

/// Binds every column of `record` in [`COLUMNS`] order.
pub(crate) fn bind_record<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    record: &Record,
) -> Result<sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>, StoreError> {
    let (status, stored, names, values, body) = match &record.outcome {
        Some(outcome) => {
            let (status, stored, names, values, body) = outcome_columns(outcome);
            (Some(status), Some(stored), names, values, body)
        }
        None => (None, None, None, None, None),
    };
    let attempts = serde_json::to_string(&record.attempts)
        .map_err(|error| corrupt(format!("attempts: {error}")))?;
    Ok(query
        .bind(record.scope.as_bytes().to_vec())
        .bind(stored_tenant(&record.tenant).into_owned())
        .bind(record.operation.to_string())
        .bind(record.key.to_string())
        .bind(record.fingerprint.as_bytes().to_vec())
        .bind(record.state.as_str())
        .bind(ms(record.generation))
        .bind(record.owner.map(|token| token.0))
        .bind(ms(record.lease_ms))
        .bind(ms(record.retention_ms))
        .bind(ms(record.lease_expires_at_ms))
        .bind(ms(record.created_at_ms))
        .bind(ms(record.updated_at_ms))
        .bind(record.completed_at_ms.map(ms))
        .bind(ms(record.expires_at_ms))
        .bind(status)
        .bind(stored)
        .bind(names)
        .bind(values)
        .bind(body)
        .bind(attempts))
}

#[cfg(test)]
mod tests {
    use super::{read_tenant, stored_tenant};

    #[test]
    fn tenants_with_nul_are_stored_without_it_and_read_back() {
        for tenant in [
            "alice",
            "\0anonymous",
            "%",
            "%00",
            "%25",
            "a%\0b\0%2500",
            "",
            "\0",
        ] {
            let stored = stored_tenant(tenant);
            assert!(!stored.contains('\0'), "{tenant:?} -> {stored:?}");
            assert_eq!(read_tenant(&stored), tenant);
        }
        assert!(matches!(
            stored_tenant("alice"),
            std::borrow::Cow::Borrowed("alice")
        ));
    }
}
