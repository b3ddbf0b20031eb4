//! Erasure through the records API: one record, or every record of a
//! tenant, page by page, with a count of what was erased and what was
//! kept because its attempt still runs.

use std::time::Duration;

use http::{Response, StatusCode};
use idem_core::{Erasure, RecordQuery, RecordsAdmin, ScopeHash};
use serde_json::json;

use super::{
    LIST_LIMIT, RecordsBody, RecordsService,
    json::{json_response, listing_busy, record_json},
};
use crate::{
    listing::Listing,
    problem::{ProblemCode, problem, unavailable_problem},
};

impl<S: RecordsAdmin> RecordsService<S> {
    /// Erases one record (not a processing one): counted and logged by
    /// its scope hash, never its key; this layer's replay cache forgets it.
    pub(super) async fn erase_one(&self, scope: &ScopeHash) -> Response<RecordsBody> {
        match self.rt.store.erase(scope).await {
            Ok(Erasure::Erased(record)) => {
                self.erased(&record);
                json_response(
                    StatusCode::OK,
                    &json!({ "result": "erased", "record": record_json(&record) }),
                )
            }
            Ok(Erasure::Processing(record)) => json_response(
                StatusCode::CONFLICT,
                &json!({ "result": "processing", "record": record_json(&record) }),
            ),
            Ok(Erasure::NotFound) => {
                problem(ProblemCode::RecordNotFound, "no record for this key", None)
            }
            Err(error) => unavailable_problem(&error),
        }
    }

    /// An erased record, counted and logged (its scope hash and tenant,
    /// never its key); the replay cache forgets it.
    fn erased(&self, record: &idem_core::Record) {
        metrics::counter!(crate::metrics::RECORDS_ERASED).increment(1);
        tracing::warn!(scope = %record.scope, tenant = &*record.tenant, "an operator erased a record");
        if let Some(cache) = self.rt.replays() {
            cache.forget(&record.scope);
        }
    }

    /// Erases every record of `tenant` that is not processing, a page of
    /// the listing at a time (listings are budgeted as the records API's
    /// are), each page after the last one's final record
    /// ([`RecordCursor`](idem_core::RecordCursor)), so the processing
    /// records it keeps never stop it early. The answer counts the records
    /// erased and those left processing, and says it finished; a store
    /// that fails part way is a `503` whose detail says how far it went.
    pub(super) async fn erase_tenant(&self, tenant: String) -> Response<RecordsBody> {
        let _listing = match Listing::begin(&self.rt.listings) {
            Ok(listing) => listing,
            Err(wait) => return listing_busy("erase", wait),
        };
        let (mut erased, mut processing) = (0usize, 0usize);
        let mut after = None;
        let stopped = |erased: usize, processing: usize, error: &idem_core::StoreError| {
            tracing::warn!(tenant, erased, processing, %error, "a tenant's erase stopped part way");
            let detail = format!(
                "the erase did not finish: {erased} records were erased and {processing} kept \
                 processing before the store failed ({error}); erase again"
            );
            problem(
                ProblemCode::StoreUnavailable,
                &detail,
                Some(Duration::from_secs(1)),
            )
        };
        loop {
            let query = RecordQuery {
                tenant: Some(tenant.clone()),
                limit: LIST_LIMIT,
                after: after.take(),
                ..RecordQuery::default()
            };
            let records = match self.rt.store.list(&query).await {
                Ok(records) => records,
                Err(error) => return stopped(erased, processing, &error),
            };
            let full_page = records.len() == LIST_LIMIT;
            after = records.last().map(idem_core::RecordCursor::after);
            for record in records {
                match self.rt.store.erase(&record.scope).await {
                    Ok(Erasure::Erased(record)) => {
                        self.erased(&record);
                        erased += 1;
                    }
                    Ok(Erasure::Processing(_)) => processing += 1,
                    Ok(Erasure::NotFound) => {}
                    Err(error) => return stopped(erased, processing, &error),
                }
            }
            if !full_page || after.is_none() {
                break;
            }
        }
        tracing::warn!(
            tenant,
            erased,
            processing,
            "an operator erased a tenant's records"
        );
        json_response(
            StatusCode::OK,
            &json!({
                "result": "erased",
                "finished": true,
                "erased": erased,
                "processing": processing,
            }),
        )
    }
}
