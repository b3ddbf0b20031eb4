//! The operator page: `{records prefix}/operator`, server-rendered HTML
//! for a person on call, behind the records admin token.
//!
//! A browser cannot send the admin token as a header from a plain form,
//! so the page signs in: the token, posted once, opens a session kept in
//! this gateway's memory (an `HttpOnly`, `SameSite=Strict` cookie scoped
//! to the page's path, eight hours). Every form that changes something
//! carries the session's own anti-forgery token as well, so a page of
//! another site can neither read the page nor post to it in the
//! operator's name.
//!
//! The page shows the records by state, the lapsed records (processing
//! past their lease: stuck) and the oldest processing ones, each with a
//! release button, the records per tenant, and the unknown outcomes this
//! gateway saw last. It reads the store through one listing of the oldest
//! [`LISTED`] live records, at most one every [`LISTING_EVERY`]: a page
//! reloaded in a loop costs the store no more than that.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Redirect, Response},
    routing::{get, post},
};
use idem_core::{ForceRelease, Record, RecordQuery, RecordsAdmin, ScopeHash};
use idem_layer::stores::LayerStore;
use sha2::Digest;

mod page;
mod session;

use page::{document, escape, html, short, sign_in_page};
use session::{Session, SignInBudget, form, same};

/// How many of the oldest live records the page reads.
pub(crate) const LISTED: usize = 1_000;
/// The page reads the store at most this often; in between it shows the
/// last listing (a release reads again, see [`LISTING_AFTER_ACTION`]).
pub(crate) const LISTING_EVERY: Duration = Duration::from_secs(5);
/// After a release the page reads again, but at most this often: a loop
/// of releases, or of reloads of the page an action leads to
/// (`?done=…`), costs the store no more listings than that.
pub(crate) const LISTING_AFTER_ACTION: Duration = Duration::from_secs(1);
/// How long a session lasts.
const SESSION_FOR: Duration = Duration::from_secs(8 * 3600);
/// The most sessions kept; the oldest goes first.
const MAX_SESSIONS: usize = 64;
/// How many unknown outcomes the page remembers.
const UNKNOWNS_KEPT: usize = 20;

/// An outcome the gateway could not know (the upstream did not answer in
/// time, or its answer was lost): the action may have run.
#[derive(Debug, Clone)]
pub(crate) struct Unknown {
    at: SystemTime,
    /// The gateway's problem code for it.
    code: &'static str,
    operation: String,
    scope: ScopeHash,
    attempt: u64,
}

/// The unknown outcomes this gateway saw last (the proxy notes them).
#[derive(Debug, Clone, Default)]
pub(crate) struct Unknowns(Arc<Mutex<VecDeque<Unknown>>>);

impl Unknowns {
    /// Notes an unknown outcome of the attempt `attempt` of `scope`.
    pub(crate) fn note(&self, code: &'static str, operation: &str, scope: ScopeHash, attempt: u64) {
        let mut kept = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if kept.len() == UNKNOWNS_KEPT {
            kept.pop_front();
        }
        kept.push_back(Unknown {
            at: SystemTime::now(),
            code,
            operation: operation.to_owned(),
            scope,
            attempt,
        });
    }

    fn newest_first(&self) -> Vec<Unknown> {
        let kept = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        kept.iter().rev().cloned().collect()
    }
}

/// The page's state.
pub(crate) struct Operator<S> {
    /// The layer's store: its calls bounded and timed like the layer's.
    store: Arc<LayerStore<S>>,
    /// SHA-256 of the admin token.
    token: [u8; 32],
    /// By SHA-256 of the session id (the id itself is only in the cookie).
    sessions: Mutex<HashMap<[u8; 32], Session>>,
    unknowns: Unknowns,
    /// The page's path.
    path: String,
    /// The last listing, when it was read, and whether a release made it
    /// stale since.
    listing: tokio::sync::Mutex<Option<Listing>>,
    /// Whether the session cookie is `Secure` (unless
    /// `--operator-plain-http`).
    secure: bool,
    /// Wrong sign-ins by source address (see [`SignInBudget`]).
    attempts: Mutex<HashMap<std::net::IpAddr, SignInBudget>>,
}

/// A listing the page keeps.
struct Listing {
    at: Instant,
    records: Arc<Vec<Record>>,
    /// A release changed the store since.
    stale: bool,
    /// When a release last had the store read again.
    after_action: Option<Instant>,
}

/// The page's routes under `path` (`{prefix}/operator`).
pub(crate) fn routes<S: RecordsAdmin>(
    store: Arc<LayerStore<S>>,
    token: &[u8],
    unknowns: Unknowns,
    path: &str,
    secure: bool,
) -> Router {
    let operator = Arc::new(Operator {
        store,
        token: sha2::Sha256::digest(token).into(),
        sessions: Mutex::new(HashMap::new()),
        unknowns,
        path: path.to_owned(),
        listing: tokio::sync::Mutex::new(None),
        secure,
        attempts: Mutex::new(HashMap::new()),
    });
    Router::new()
        .route(path, get(page::<S>))
        .route(&format!("{path}/sign-in"), post(sign_in::<S>))
        .route(&format!("{path}/sign-out"), post(sign_out::<S>))
        .route(&format!("{path}/release"), post(release::<S>))
        .with_state(operator)
}

impl<S: RecordsAdmin> Operator<S> {
    /// The oldest live records: the last listing if it is recent enough
    /// ([`LISTING_EVERY`], or [`LISTING_AFTER_ACTION`] once a release made
    /// it stale), else a new one. Whatever the page's address says.
    async fn records(&self) -> Result<Arc<Vec<Record>>, String> {
        let mut last = self.listing.lock().await;
        let mut after_action = None;
        if let Some(listing) = last.as_ref() {
            let reread = if listing.stale {
                // A release: read again at once, at most once a second.
                listing
                    .after_action
                    .is_none_or(|at| at.elapsed() >= LISTING_AFTER_ACTION)
            } else {
                listing.at.elapsed() >= LISTING_EVERY
            };
            if !reread {
                return Ok(Arc::clone(&listing.records));
            }
            after_action = if listing.stale {
                Some(Instant::now())
            } else {
                listing.after_action
            };
        }
        let query = RecordQuery {
            limit: LISTED,
            ..RecordQuery::default()
        };
        // The layer's store bounds the listing (30 s at least).
        let listed = self
            .store
            .list(&query)
            .await
            .map_err(|error| format!("the store could not list its records: {error}"))?;
        let listed = Arc::new(listed);
        *last = Some(Listing {
            at: Instant::now(),
            records: Arc::clone(&listed),
            stale: false,
            after_action,
        });
        Ok(listed)
    }
}

/// `GET`: the page for a signed-in operator, else the sign-in form.
async fn page<S: RecordsAdmin>(
    State(operator): State<Arc<Operator<S>>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    let Some((_, csrf)) = operator.session(&headers) else {
        return html(StatusCode::OK, sign_in_page(&operator.path, None));
    };
    let flash = uri.query().and_then(|query| {
        form_urlencoded::parse(query.as_bytes())
            .find(|(name, _)| name == "done")
            .map(|(_, value)| value.into_owned())
    });
    match operator.records().await {
        Ok(records) => html(
            StatusCode::OK,
            operator.render(&records, &csrf, flash.as_deref()),
        ),
        Err(error) => html(
            StatusCode::SERVICE_UNAVAILABLE,
            document(
                "idem operator",
                &format!(
                    "<h1>idem operator</h1><p class=\"error\">{}</p>",
                    escape(&error)
                ),
            ),
        ),
    }
}

/// `POST sign-in`: the admin token opens a session.
async fn sign_in<S: RecordsAdmin>(
    State(operator): State<Arc<Operator<S>>>,
    peer: Option<axum::Extension<crate::answer::PeerAddr>>,
    body: Bytes,
) -> Response {
    let source = peer.map(|axum::Extension(peer)| peer.0.ip());
    if let Err(wait) = operator.may_sign_in(source) {
        tracing::warn!(
            ?source,
            "operator page: sign-ins from this source are throttled"
        );
        let mut response = html(
            StatusCode::TOO_MANY_REQUESTS,
            sign_in_page(
                &operator.path,
                Some("Too many wrong tokens from this address; wait and try again."),
            ),
        );
        if let Ok(value) = HeaderValue::try_from(wait.as_secs().max(1).to_string()) {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        return response;
    }
    let fields = form(&body);
    let given: [u8; 32] = sha2::Sha256::digest(
        fields
            .get("token")
            .map(String::as_bytes)
            .unwrap_or_default(),
    )
    .into();
    if !same(&given, &operator.token) {
        operator.spend_sign_in(source);
        tracing::warn!("operator page: a sign-in with a wrong token");
        return html(
            StatusCode::FORBIDDEN,
            sign_in_page(&operator.path, Some("That is not the records admin token.")),
        );
    }
    tracing::info!("operator page: signed in");
    operator.back_to_page(&operator.open())
}

/// `POST sign-out`: ends the session.
async fn sign_out<S: RecordsAdmin>(
    State(operator): State<Arc<Operator<S>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(key) = operator.authorized(&headers, &form(&body)) {
        operator
            .sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&key);
    }
    operator.back_to_page(&operator.cookie("", Duration::ZERO))
}

/// `POST release`: releases one processing record, whatever its lease
/// (as the records API's `action=release`).
async fn release<S: RecordsAdmin>(
    State(operator): State<Arc<Operator<S>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let fields = form(&body);
    if operator.authorized(&headers, &fields).is_none() {
        return html(
            StatusCode::FORBIDDEN,
            sign_in_page(
                &operator.path,
                Some("Sign in again: the session ended, or the form did not come from this page."),
            ),
        );
    }
    let Some(scope) = fields.get("scope").and_then(|s| ScopeHash::from_hex(s)) else {
        return html(
            StatusCode::BAD_REQUEST,
            document("idem operator", "<p class=\"error\">No record named.</p>"),
        );
    };
    let done = match operator.store.force_release(&scope).await {
        Ok(ForceRelease::Released(record)) => {
            tracing::info!(scope = %scope, operation = &*record.operation, "operator page: released a record");
            format!(
                "Released {} (scope {}).",
                record.operation,
                short(&scope.to_hex())
            )
        }
        Ok(ForceRelease::NotProcessing(record)) => {
            format!("Not released: the record is {} now.", record.state.as_str())
        }
        Ok(ForceRelease::NotFound) => "Not released: the record is gone.".to_owned(),
        Err(error) => format!("Not released: the store failed ({error})."),
    };
    // The page shows the release once the listing may be read again.
    if let Some(listing) = operator.listing.lock().await.as_mut() {
        listing.stale = true;
    }
    let query: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("done", &done)
        .finish();
    Redirect::to(&format!("{}?{query}", operator.path)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_html() {
        assert_eq!(
            escape("<script>alert('x')</script> & \"y\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;y&quot;"
        );
    }

    #[test]
    fn a_session_is_found_by_its_cookie_only() {
        let layer = idem_layer::IdempotencyLayer::new(idem_memory::MemoryStore::new());
        let operator = Operator {
            store: Arc::clone(layer.store()),
            token: [0; 32],
            sessions: Mutex::new(HashMap::new()),
            unknowns: Unknowns::default(),
            path: "/_idempotency/operator".to_owned(),
            listing: tokio::sync::Mutex::new(None),
            secure: true,
            attempts: Mutex::new(HashMap::new()),
        };
        let cookie = operator.open();
        assert!(cookie.contains("HttpOnly; SameSite=Strict"), "{cookie}");
        assert!(cookie.contains("Path=/_idempotency/operator;"), "{cookie}");
        let id = cookie
            .strip_prefix("idem_operator=")
            .and_then(|rest| rest.split(';').next())
            .expect("an id");
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::try_from(format!("other=1; idem_operator={id}")).expect("cookie"),
        );
        let (_, csrf) = operator.session(&headers).expect("the session");
        let mut fields = HashMap::new();
        assert!(operator.authorized(&headers, &fields).is_none(), "no csrf");
        fields.insert("csrf".to_owned(), "0".repeat(64));
        assert!(
            operator.authorized(&headers, &fields).is_none(),
            "a wrong csrf"
        );
        fields.insert("csrf".to_owned(), csrf);
        assert!(operator.authorized(&headers, &fields).is_some());
        let mut forged = HeaderMap::new();
        forged.insert(
            header::COOKIE,
            HeaderValue::from_static("idem_operator=0000"),
        );
        assert!(operator.session(&forged).is_none());
    }
}
