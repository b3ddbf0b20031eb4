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
    fmt::Write as _,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Redirect, Response},
    routing::{get, post},
};
use idem_core::{ForceRelease, Record, RecordQuery, RecordState, RecordsAdmin, ScopeHash};
use idem_layer::stores::LayerStore;
use rand::Rng;
use sha2::Digest;

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
use crate::owned::COOKIE;

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

/// A signed-in operator's session.
struct Session {
    /// The anti-forgery token its forms carry.
    csrf: String,
    until: Instant,
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

/// How many wrong sign-ins one source may make at once.
const SIGN_IN_BURST: f64 = 5.0;
/// How fast a source earns a sign-in back: one a second.
const SIGN_IN_REFILL_PER_SECOND: f64 = 1.0;
/// The most sources remembered; the one whose budget is fullest (the
/// least suspect) goes first.
const SIGN_IN_SOURCES: usize = 4096;

/// A source's sign-in budget: a token bucket that wrong tokens empty and
/// time refills. Per source, so a guesser elsewhere never locks the
/// operator out; a source whose budget is empty is answered `429` with
/// `Retry-After` before its token is even compared.
#[derive(Clone, Copy)]
struct SignInBudget {
    left: f64,
    at: Instant,
}

impl SignInBudget {
    fn full(now: Instant) -> Self {
        Self {
            left: SIGN_IN_BURST,
            at: now,
        }
    }

    /// The budget refilled up to `now`.
    fn refilled(self, now: Instant) -> Self {
        let earned = now.duration_since(self.at).as_secs_f64() * SIGN_IN_REFILL_PER_SECOND;
        Self {
            left: (self.left + earned).min(SIGN_IN_BURST),
            at: now,
        }
    }
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

/// Equal digests, compared whole.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// 32 random bytes in hex.
fn random_token() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    hex::encode(bytes)
}

/// The fields of a form body.
fn form(body: &[u8]) -> HashMap<String, String> {
    form_urlencoded::parse(body).into_owned().collect()
}

impl<S> Operator<S> {
    /// The session the request's cookie names, if it is live: its key and
    /// its anti-forgery token.
    fn session(&self, headers: &HeaderMap) -> Option<([u8; 32], String)> {
        let id = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(';'))
            .find_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))?;
        let key: [u8; 32] = sha2::Sha256::digest(id.as_bytes()).into();
        self.live_sessions()
            .get(&key)
            .map(|session| (key, session.csrf.clone()))
    }

    /// The sessions, those past their time removed.
    fn live_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Session>> {
        let mut sessions = self
            .sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        sessions.retain(|_, session| session.until > now);
        sessions
    }

    /// Opens a session: the cookie that names it.
    fn open(&self) -> String {
        let id = random_token();
        let key: [u8; 32] = sha2::Sha256::digest(id.as_bytes()).into();
        let mut sessions = self.live_sessions();
        let now = Instant::now();
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, session)| session.until)
                .map(|(key, _)| *key)
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            key,
            Session {
                csrf: random_token(),
                until: now + SESSION_FOR,
            },
        );
        self.cookie(&id, SESSION_FOR)
    }

    /// The session cookie naming `id`, for `lasting` (zero: removed).
    fn cookie(&self, id: &str, lasting: Duration) -> String {
        format!(
            "{COOKIE}={id}; Path={}; HttpOnly; SameSite=Strict; Max-Age={}{}",
            self.path,
            lasting.as_secs(),
            if self.secure { "; Secure" } else { "" }
        )
    }

    /// Whether `source` may try a sign-in now; else how long until it may.
    fn may_sign_in(&self, source: Option<std::net::IpAddr>) -> Result<(), Duration> {
        let Some(source) = source else { return Ok(()) };
        let attempts = self
            .attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(budget) = attempts.get(&source) else {
            return Ok(());
        };
        let budget = budget.refilled(Instant::now());
        if budget.left >= 1.0 {
            return Ok(());
        }
        let wait = (1.0 - budget.left) / SIGN_IN_REFILL_PER_SECOND;
        Err(Duration::from_secs_f64(wait.max(0.0)).max(Duration::from_secs(1)))
    }

    /// Takes one sign-in from `source`'s budget (a wrong token).
    fn spend_sign_in(&self, source: Option<std::net::IpAddr>) {
        let Some(source) = source else { return };
        let mut attempts = self
            .attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if attempts.len() >= SIGN_IN_SOURCES && !attempts.contains_key(&source) {
            let fullest = attempts
                .iter()
                .max_by(|a, b| {
                    let (a, b) = (a.1.refilled(now).left, b.1.refilled(now).left);
                    a.total_cmp(&b)
                })
                .map(|(ip, _)| *ip);
            if let Some(fullest) = fullest {
                attempts.remove(&fullest);
            }
        }
        let budget = attempts
            .get(&source)
            .map_or_else(|| SignInBudget::full(now), |budget| budget.refilled(now));
        attempts.insert(
            source,
            SignInBudget {
                left: budget.left - 1.0,
                at: now,
            },
        );
    }

    /// A redirect to the page that sets `cookie`.
    fn back_to_page(&self, cookie: &str) -> Response {
        let mut response = Redirect::to(&self.path).into_response();
        if let Ok(cookie) = HeaderValue::try_from(cookie) {
            response.headers_mut().insert(header::SET_COOKIE, cookie);
        }
        response
    }

    /// A form post that may act: a live session, and its anti-forgery
    /// token in the form.
    fn authorized(
        &self,
        headers: &HeaderMap,
        fields: &HashMap<String, String>,
    ) -> Option<[u8; 32]> {
        let (key, csrf) = self.session(headers)?;
        let given = fields.get("csrf")?;
        let (given, expected): ([u8; 32], [u8; 32]) = (
            sha2::Sha256::digest(given.as_bytes()).into(),
            sha2::Sha256::digest(csrf.as_bytes()).into(),
        );
        same(&given, &expected).then_some(key)
    }
}

/// A page's response: HTML, never cached, never framed.
fn html(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// Text made safe inside HTML (element content and quoted attributes).
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}\
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#f3f3f3}code{font-size:12px}.note{color:#555}\
.flash{background:#e8f5e9;border:1px solid #a5d6a7;padding:.5em 1em}\
.error{background:#ffebee;border:1px solid #ef9a9a;padding:.5em 1em}\
button{cursor:pointer}";

fn document(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{}</title><style>{STYLE}</style></head><body>{body}</body></html>",
        escape(title)
    )
}

fn sign_in_page(path: &str, error: Option<&str>) -> String {
    let error = error
        .map(|e| format!("<p class=\"error\">{}</p>", escape(e)))
        .unwrap_or_default();
    document(
        "idem operator: sign in",
        &format!(
            "<h1>idem operator</h1>{error}\
             <form method=\"post\" action=\"{path}/sign-in\">\
             <label>Records admin token <input type=\"password\" name=\"token\" \
             autocomplete=\"current-password\" required></label> \
             <button type=\"submit\">Sign in</button></form>\
             <p class=\"note\">The token is the gateway's --records-admin-token.</p>",
            path = escape(path)
        ),
    )
}

/// How long ago `then_ms` was, at `now_ms`, to the second.
fn ago(now_ms: u64, then_ms: u64) -> String {
    let seconds = now_ms.saturating_sub(then_ms) / 1000;
    humantime::format_duration(Duration::from_secs(seconds)).to_string()
}

/// A shortened tenant hash or scope, for reading.
fn short(text: &str) -> &str {
    text.get(..16).unwrap_or(text)
}

/// A table of records, each with a release button.
fn record_table(out: &mut String, records: &[&Record], now: u64, path: &str, csrf: &str) {
    if records.is_empty() {
        out.push_str("<p class=\"note\">None.</p>");
        return;
    }
    out.push_str(
        "<table><tr><th>operation</th><th>key</th><th>tenant</th><th>created</th>\
         <th>lease</th><th>attempt</th><th></th></tr>",
    );
    for record in records {
        let lease = if record.lease_expires_at_ms <= now {
            format!("lapsed {} ago", ago(now, record.lease_expires_at_ms))
        } else {
            format!("{} left", ago(record.lease_expires_at_ms, now))
        };
        let _ = write!(
            out,
            "<tr class=\"record\"><td>{}</td><td><code>{}</code></td><td><code>{}</code></td>\
             <td>{} ago</td><td>{}</td><td>{}</td><td>\
             <form class=\"release\" method=\"post\" action=\"{}/release\">\
             <input type=\"hidden\" name=\"scope\" value=\"{}\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <button type=\"submit\">Release</button></form></td></tr>",
            escape(&record.operation),
            escape(&record.key),
            escape(short(&record.tenant)),
            ago(now, record.created_at_ms),
            lease,
            record.generation,
            escape(path),
            record.scope.to_hex(),
            escape(csrf),
        );
    }
    out.push_str("</table>");
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

    fn render(&self, records: &[Record], csrf: &str, flash: Option<&str>) -> String {
        let now = idem_core::unix_ms();
        let path = &self.path;
        let mut out = String::new();
        let _ = write!(
            out,
            "<h1>idem operator</h1>\
             <form method=\"post\" action=\"{p}/sign-out\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{c}\">\
             <button type=\"submit\">Sign out</button></form>",
            p = escape(path),
            c = escape(csrf)
        );
        if let Some(flash) = flash {
            let _ = write!(out, "<p class=\"flash\" id=\"flash\">{}</p>", escape(flash));
        }
        // By state.
        let count = |state: RecordState| records.iter().filter(|r| r.state == state).count();
        out.push_str("<h2>Records by state</h2><table id=\"states\"><tr>");
        let states = [
            RecordState::Processing,
            RecordState::Completed,
            RecordState::Cancelled,
            RecordState::Released,
        ];
        for state in states {
            let _ = write!(out, "<th>{}</th>", state.as_str());
        }
        out.push_str("</tr><tr>");
        for state in states {
            let _ = write!(out, "<td>{}</td>", count(state));
        }
        out.push_str("</tr></table>");
        if records.len() == LISTED {
            let _ = write!(
                out,
                "<p class=\"note\">Counted over the oldest {LISTED} live records.</p>"
            );
        }
        // Lapsed and oldest processing.
        let processing: Vec<&Record> = records
            .iter()
            .filter(|r| r.state == RecordState::Processing)
            .collect();
        let (lapsed, running): (Vec<&Record>, Vec<&Record>) = processing
            .into_iter()
            .partition(|r| r.lease_expires_at_ms <= now);
        out.push_str(
            "<h2 id=\"lapsed\">Lapsed records</h2>\
             <p class=\"note\">Processing past their lease, and no retry took them over: \
             release those whose owner is known to be gone (the next request runs).</p>",
        );
        record_table(&mut out, &lapsed[..lapsed.len().min(50)], now, path, csrf);
        out.push_str("<h2 id=\"processing\">Oldest processing records</h2>");
        record_table(&mut out, &running[..running.len().min(20)], now, path, csrf);
        // Per tenant.
        let mut tenants: Vec<(&str, [usize; 4])> = Vec::new();
        for record in records {
            let at = match tenants.iter().position(|(t, _)| *t == &*record.tenant) {
                Some(at) => at,
                None => {
                    tenants.push((&record.tenant, [0; 4]));
                    tenants.len() - 1
                }
            };
            let column = states.iter().position(|s| *s == record.state).unwrap_or(0);
            tenants[at].1[column] += 1;
        }
        tenants.sort_by_key(|(tenant, counts)| {
            (std::cmp::Reverse(counts.iter().sum::<usize>()), *tenant)
        });
        out.push_str("<h2>Records per tenant</h2>");
        if tenants.is_empty() {
            out.push_str("<p class=\"note\">None.</p>");
        } else {
            out.push_str("<table id=\"tenants\"><tr><th>tenant</th>");
            for state in states {
                let _ = write!(out, "<th>{}</th>", state.as_str());
            }
            out.push_str("</tr>");
            for (tenant, counts) in tenants.iter().take(50) {
                let _ = write!(out, "<tr><td><code>{}</code></td>", escape(short(tenant)));
                for n in counts {
                    let _ = write!(out, "<td>{n}</td>");
                }
                out.push_str("</tr>");
            }
            out.push_str("</table>");
        }
        // Unknown outcomes.
        out.push_str(
            "<h2>Recent unknown outcomes</h2>\
             <p class=\"note\">The upstream did not answer in time, or its answer was lost: \
             the action may have run, so the key stays taken until a late answer is \
             recorded or its lease lapses.</p>",
        );
        let unknowns = self.unknowns.newest_first();
        if unknowns.is_empty() {
            out.push_str("<p class=\"note\">None since this gateway started.</p>");
        } else {
            out.push_str(
                "<table id=\"unknowns\"><tr><th>when</th><th>operation</th><th>scope</th>\
                 <th>attempt</th><th>why</th></tr>",
            );
            for unknown in unknowns {
                let at = unknown
                    .at
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                let _ = write!(
                    out,
                    "<tr><td>{} ago</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
                    ago(now, at),
                    escape(&unknown.operation),
                    short(&unknown.scope.to_hex()),
                    unknown.attempt,
                    unknown.code
                );
            }
            out.push_str("</table>");
        }
        document("idem operator", &out)
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
